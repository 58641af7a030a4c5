"""BERT pretraining: masked LM + next-sentence prediction (paper §3.1, §A.2), one CPU to many GPUs.

The objective comes from the data: ``build-data --objective mlm-nsp`` (the default) trains
``BertForPreTraining`` on both tasks; ``--objective mlm`` data (the paper's "No NSP" ablation,
§5.1) trains ``BertForMaskedLM``, masked LM alone, with no pooler or NSP head to train, and the
exported model is a ``BertForMaskedLM`` that ``transformers`` loads as such.

``pretrain(PretrainConfig(...))`` is the whole job: build or load the model, resume from the
run's newest checkpoint if asked, train on the one engine (``bertctl.train.engine``: DDP under
``torchrun``, accumulation to the global batch, precision, checkpoints, logging), evaluate on
held-out data (and say so when the run has collapsed), and export a Hugging Face directory.

Exactness (the "never lose work" contract): the engine reseeds torch every step from
(seed, step, rank) and saves every rank's RNG states; the data loader seeks to (epoch, step)
and never replays a batch. On CPU a killed and resumed run ends bit-identical to an
uninterrupted one.

Loss normalisation: the MLM loss is Σ token cross-entropy / (masked tokens in the *global*
batch, all ranks and micro-batches), NSP Σ / (global batch size), so N processes × k
micro-batches give one process's loss and gradient on the same global batch.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bertctl import faults, rundir
from bertctl.checkpoints import training
from bertctl.config import IGNORE_INDEX, PretrainConfig
from bertctl.data.batching import Prefetcher, bucketed_batches, pretraining_batches, pretraining_step, trim
from bertctl.errors import BertctlError, Stopped
from bertctl.model import masked_lm_cross_entropy
from bertctl.progress import MetricsLog, stderr
from bertctl.runtime import Runtime, resolve
from bertctl.train import distributed
from bertctl.train.engine import Engine, Interrupted, StopSignal, autocast, load_optimizer_state, to_device
from bertctl.train.metrics import plot_curves, train_flops_6nt
from bertctl.train.optim import build_scheduler


# --------------------------------------------------------------------------- helpers


#: Default peak learning rate of each ``--model-size`` preset (AdamW, post-LN BERT, warm-up 6% of the
#: run), the same at every batch size: a post-LN BERT collapses (MLM accuracy pinned at the majority
#: token, NSP at the class prior) when the lr is too high for its warm-up, and scaling the lr up with
#: the batch did so at batch 2048 (``benchmarks/results/convergence-preset-large-2048-*.json``).
PRESET_LR = {"tiny": 1e-3, "mini": 1e-3, "small": 5e-4, "medium": 3e-4, "base": 1e-4, "large": 5e-5}


def _manifest_id(manifest: dict) -> str:
    if "id" in manifest:
        return str(manifest["id"])
    blob = json.dumps(manifest, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _is_run_dir(path: Path) -> bool:
    return (path / training.CHECKPOINT_DIR).is_dir() or (path / "model" / "config.json").is_file()


def _runtime(model: torch.nn.Module):
    """The Runtime of a model, also inside DistributedDataParallel (``.module``)."""
    while not hasattr(model, "runtime") and hasattr(model, "module"):
        model = model.module
    return model.runtime


def pretraining_sums(model, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward one micro-batch; return summed losses and correct counts (fp32 scalars).

    The MLM head runs at masked_positions only (the model gathers (B, P, H) before
    the V-way projection).  Cross-entropy is in fp32 over the (B·P, V) logits, read in
    their own dtype by the fused op (``masked_lm_cross_entropy``), from the vocabulary-padded
    matrix (its extra columns -inf change neither loss nor argmax).  A model without an
    NSP head (``BertForMaskedLM``) gives no ``nsp_*`` entries.
    """
    out = model(mb["input_ids"], mb["token_type_ids"], mb["attention_mask"],
                masked_positions=mb["masked_positions"], packing=mb.get("packing"))
    logits = out.padded_prediction_logits.flatten(0, 1)              # (B·P, V' >= V), extra columns -inf
    labels = mb["masked_lm_labels"].flatten()                        # (B·P,)
    loss, predicted = masked_lm_cross_entropy(_runtime(model).fused, logits, labels)
    mlm_sum = loss.sum()
    mlm_correct = ((predicted == labels) & (labels != IGNORE_INDEX)).sum()
    sums = {"mlm_sum": mlm_sum, "mlm_correct": mlm_correct}
    if out.seq_relationship_logits is not None:
        nsp_logits = out.seq_relationship_logits.float()                # (B, 2)
        nsp_labels = mb["next_sentence_label"]
        sums["nsp_sum"] = F.cross_entropy(nsp_logits, nsp_labels, reduction="sum")
        sums["nsp_correct"] = (nsp_logits.argmax(-1) == nsp_labels).sum()
    return sums


class PretrainingObjective:
    """Masked LM + next-sentence prediction (§3.1): two loss terms, normalised by masked tokens and
    sequences; with ``nsp=False`` masked LM alone (the "No NSP" ablation, §5.1)."""

    def __init__(self, nsp: bool = True):
        self.nsp = nsp
        self.loss_terms = ("mlm", "nsp") if nsp else ("mlm",)
        self.stat_names = ("mlm_correct", "nsp_correct") if nsp else ("mlm_correct",)

    def sums(self, model, mb):
        s = pretraining_sums(model, mb)
        out = {"mlm": s["mlm_sum"], "mlm_correct": s["mlm_correct"]}
        if self.nsp:
            out.update(nsp=s["nsp_sum"], nsp_correct=s["nsp_correct"])
        return out

    def record(self, sums, counts):
        masked = max(counts["mlm"], 1.0)
        mlm_loss, mlm_acc = sums["mlm"] / masked, sums["mlm_correct"] / masked
        if not self.nsp:
            return {"loss": mlm_loss, "mlm_loss": mlm_loss, "mlm_acc": mlm_acc}
        seqs = max(counts["nsp"], 1.0)
        nsp_loss = sums["nsp"] / seqs
        return {"loss": mlm_loss + nsp_loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
                "mlm_acc": mlm_acc, "nsp_acc": sums["nsp_correct"] / seqs}

    def info(self, rec):
        return _info(rec)


def is_stuck(ev: dict) -> bool:
    """A held-out evaluation at the unigram stage: MLM accuracy no better than always guessing the most
    frequent masked token, and the MLM loss not below the masked tokens' unigram entropy."""
    return (ev["mlm_acc"] <= ev["mlm_majority_baseline"] + 0.005
            and ev["mlm_loss"] >= ev["mlm_unigram_entropy"] - 0.05)


#: Steps (or sequences, whichever comes first: a batch-2048 run takes 125 steps to see what a
#: batch-256 run sees in 1000) before which no run is called collapsed: a short run (the built-in job
#: on a busy CPU) may still be at the unigram stage without anything being wrong.
COLLAPSE_MIN_STEPS = 1000
COLLAPSE_MIN_SEQUENCES = 256_000


MEMORISING_GAP = 0.1  # training minus held-out accuracy (MLM or NSP)


def memorising_note(train: dict | None, held_out: dict | None, passes: float) -> str | None:
    """A note when the model has started to memorise its data, after several passes over the text:
    training accuracy well above the held-out one. MLM: more (different) text then helps more than
    more steps. NSP: the model knows its training text, so a "next" segment cut from it is easy to
    tell and one from an unseen document is not (training NSP accuracy near 1, held-out far below).
    It is the text, not the pairs, that it learns: data built with each pair seen about once gave the
    same gap."""
    if not train or not held_out or passes < 2:
        return None
    notes = []
    if "mlm_acc" in train and "mlm_acc" in held_out:
        gap = train["mlm_acc"] - held_out["mlm_acc"]
        if gap >= MEMORISING_GAP:
            notes.append(f"training MLM accuracy {train['mlm_acc']:.3f} is {gap:.3f} above held-out "
                         f"{held_out['mlm_acc']:.3f} after {passes:g} passes over the text: the model is memorising "
                         f"it; more text will help more than more steps")
    if train.get("nsp_acc") is not None and held_out.get("nsp_acc") is not None:
        gap = train["nsp_acc"] - held_out["nsp_acc"]
        if gap >= MEMORISING_GAP:
            notes.append(f"training NSP accuracy {train['nsp_acc']:.3f} is {gap:.3f} above held-out "
                         f"{held_out['nsp_acc']:.3f} after {passes:g} passes over the text: the model knows its "
                         f"training text, so its own next segments are easy to tell and those of unseen documents "
                         f"are not; more documents will help (a higher build-data --dupe-factor does not: it "
                         f"repeats the same text)")
    return "; ".join(notes) or None


def collapse_warning(previous: dict | None, ev: dict, step: int, warmup: int, max_steps: int, lr: float,
                     batch_size: int = 256) -> str | None:
    """One sentence with the fix when a run has collapsed, else None.

    Every run starts at the unigram stage (predicting token frequencies); a healthy one leaves it
    soon after warm-up. Collapse: two evaluations in a row still there, the later one past twice the
    warm-up, 30% of the run and ``COLLAPSE_MIN_STEPS`` steps or ``COLLAPSE_MIN_SEQUENCES`` sequences, which
    is what a post-LN BERT does when the lr is too high for its warm-up.
    """
    floor = min(COLLAPSE_MIN_STEPS, math.ceil(COLLAPSE_MIN_SEQUENCES / max(batch_size, 1)))
    late = step >= max(2 * warmup, 0.3 * max_steps, floor)
    if previous is None or not late or not (is_stuck(previous) and is_stuck(ev)):
        return None
    return (f"collapse: at step {step}, well after warm-up, held-out MLM accuracy is {ev['mlm_acc']:.3f} against the "
            f"majority-token baseline {ev['mlm_majority_baseline']:.3f} and the loss {ev['mlm_loss']:.2f} is not below "
            f"the unigram entropy {ev['mlm_unigram_entropy']:.2f}: the model predicts token frequencies only. Likely "
            f"cause: --lr {lr:g} too high for its warm-up ({warmup} steps) in a post-LN BERT; restart with a lower "
            f"--lr (e.g. {lr / 4:g}) or a longer --warmup-fraction. (A run far too short to leave this stage looks "
            f"the same: then give it more steps.)")


# --------------------------------------------------------------------------- the run


class Trainer:
    """A pretraining run: data, model and evaluation around the one training engine."""

    def __init__(self, cfg: PretrainConfig, dist: distributed.Dist, runtime: Runtime, tokenizer=None,
                 stop: StopSignal | None = None, extend_schedule: bool = False):
        self.cfg, self.dist, self.runtime = cfg, dist, runtime
        self.stop = stop if stop is not None else StopSignal(kept=lambda: kept_state(Path(cfg.output)))
        self.extend_schedule = extend_schedule
        self.device = dist.device
        self.out = Path(cfg.output)
        self.precision = runtime.precision
        self.use_graphs = runtime.cuda_graphs
        self.tokenizer = tokenizer
        self.log = MetricsLog(None)  # opened in run(), once data and model are known to be good
        self.collapsed = False
        self.last_eval: dict | None = None

    # ----------------------------------------------------------------- setup

    def _say(self, msg: str) -> None:
        if self.dist.is_main:
            stderr.print(msg)

    def _load_data(self):
        from bertctl.data import PretrainingData

        if not self.cfg.data:
            raise BertctlError("no --data directory given (build one with `bertctl build-data`)")
        self.data = PretrainingData(self.cfg.data)
        if self.cfg.eval_data:
            ev = PretrainingData(self.cfg.eval_data)
            # A folder built with a held-out split: evaluate on its "eval" part.
            self.eval_data = PretrainingData(self.cfg.eval_data, split="eval") if "eval" in ev.manifest["splits"] else ev
        elif "eval" in self.data.manifest.get("splits", {}):
            self.eval_data = PretrainingData(self.cfg.data, split="eval")
        else:
            self.eval_data = None
        # The objective is the data's (build-data --objective): NSP pairs or masked-LM-only instances.
        self.objective = self.data.objective
        if self.eval_data is not None:
            self._check_eval_vocabulary()
        if self.eval_data is not None and self.eval_data.objective != self.objective:
            raise BertctlError(f"--eval-data {self.cfg.eval_data}: built with --objective {self.eval_data.objective}, "
                               f"but --data {self.cfg.data} with --objective {self.objective}: evaluate on data "
                               f"built with the same --objective")
        G, W = self.cfg.train.batch_size, self.dist.world_size
        if G < 1:
            raise BertctlError(f"--batch-size must be at least 1, not {G}")
        if G % W:
            raise BertctlError(f"--batch-size {G} is not divisible by the {W} processes")
        per_rank = G // W
        self.micro = self.cfg.train.micro_batch_size or per_rank
        if self.micro < 1 or per_rank % self.micro:
            raise BertctlError(f"per-process batch {per_rank} (= --batch-size {G} / {W} processes) is not a multiple "
                               f"of --micro-batch-size {self.micro}")
        self.steps_per_epoch = self.data.steps_per_epoch(G)
        if self.steps_per_epoch < 1:
            raise BertctlError(f"{self.cfg.data}: its {self.data.num_instances} instances are fewer than one "
                               f"--batch-size of {G}: lower --batch-size or build more data")
        self.max_steps = self.cfg.train.max_steps or self.steps_per_epoch
        if self.tokenizer is None:
            self.tokenizer = _data_tokenizer(Path(self.cfg.data), self.data.manifest)

    def _check_eval_vocabulary(self) -> None:
        """Held-out data's token ids must mean the data's tokens (another vocabulary gives nonsense figures, or
        ids past the embedding table)."""
        def vocab(d):
            return d.manifest.get("tokenizer", {}).get("vocab_sha256"), d.vocab_size

        (want, n_data), (have, n_eval) = vocab(self.data), vocab(self.eval_data)
        if (want and have and want != have) or n_data != n_eval:
            raise BertctlError(f"--eval-data {self.cfg.eval_data}: built with another vocabulary ({n_eval:,} tokens) "
                               f"than --data {self.cfg.data} ({n_data:,} tokens), so its token ids mean other tokens; "
                               f"build it with --vocab {Path(self.cfg.data) / 'vocab.txt'}")

    def _model_config(self, ckpt_state: dict | None):
        from bertctl.checkpoints.hf import load_config
        from bertctl.config import BertConfig

        over = self.cfg.model_overrides
        if ckpt_state is not None:  # resume, or init from a previous run's checkpoint
            return BertConfig.from_dict(ckpt_state["configs"]["model"], **over), None
        if self.cfg.init_from:
            src = Path(self.cfg.init_from)
            if _is_run_dir(src):
                src = src / "model"
            return load_config(src, **over), src
        if self.cfg.model_config:
            return BertConfig.from_json_file(self.cfg.model_config, **over), None
        return BertConfig.preset(self.cfg.model_size, vocab_size=self.data.vocab_size, **over), None

    def _check_vocabulary(self, mconf, hf_dir: Path | None) -> None:
        """The data's token ids must mean the same tokens to the model.

        A pretrained model's vocab.txt must be the data's vocabulary; any model needs at least the
        data's vocabulary size (a larger embedding, e.g. padded to a multiple of 64, is fine).
        """
        build = f"rebuild the data with the model's vocabulary (bertctl build-data --vocab {hf_dir or 'MODEL'}/vocab.txt)"
        what = self.cfg.init_from or self.cfg.model_config or "the checkpoint"
        if hf_dir is not None and (hf_dir / "vocab.txt").is_file():
            from bertctl.data.shards import vocab_sha256

            with open(hf_dir / "vocab.txt", encoding="utf-8") as f:
                tokens = [line.rstrip("\r\n") for line in f]
            want = self.data.manifest.get("tokenizer", {}).get("vocab_sha256")
            if want and vocab_sha256(tokens) != want:
                raise BertctlError(f"{self.cfg.data}: data built with a {self.data.vocab_size}-token vocabulary, "
                                   f"not the {len(tokens)}-token {hf_dir / 'vocab.txt'} of --init-from (model "
                                   f"vocab_size {mconf.vocab_size}): {build}")
        if mconf.vocab_size < self.data.vocab_size:
            raise BertctlError(f"{self.cfg.data}: data built with a {self.data.vocab_size}-token vocabulary, but "
                               f"{what} has vocab_size {mconf.vocab_size}: {build}")

    def _build(self) -> None:
        from bertctl.checkpoints.hf import load_pretrained, load_state
        from bertctl.model import BertForMaskedLM, BertForPreTraining

        cfg = self.cfg
        model_cls = BertForPreTraining if self.data.nsp else BertForMaskedLM
        # The output folder rule (claim_output) has already refused checkpoints without --resume.
        resume_from = training.latest_checkpoint(self.out) if cfg.resume else None
        if cfg.resume and resume_from is None:
            self._say(f"[yellow]no checkpoint in {self.out}: starting a new run")
        init_state = None
        if resume_from is not None:
            init_state = training.load_checkpoint(resume_from.path)
        elif cfg.init_from and (Path(cfg.init_from) / training.CHECKPOINT_DIR).is_dir():
            prev = training.latest_checkpoint(cfg.init_from)
            if prev is not None:
                init_state = training.load_checkpoint(prev.path)
        mconf, hf_dir = self._model_config(init_state)
        self._check_vocabulary(mconf, hf_dir)
        if self.data.max_seq_length > mconf.max_position_embeddings:
            raise BertctlError(f"data max_seq_length {self.data.max_seq_length} exceeds the model's "
                               f"max_position_embeddings {mconf.max_position_embeddings}")
        # Same initial weights on every rank: seed before construction.
        torch.manual_seed(cfg.train.seed)
        if hf_dir is not None and init_state is None:
            model = load_pretrained(model_cls, hf_dir, fresh_heads=True, runtime=self.runtime, **cfg.model_overrides)
        else:
            model = model_cls(mconf, self.runtime)
        if init_state is not None and resume_from is None:
            # A previous run's weights: with another objective, the heads this one lacks are dropped
            # and the ones it adds (NSP head, pooler) start fresh.
            before = init_state["configs"].get("objective", "mlm-nsp")
            if before != self.objective and cfg.keep_optimizer:
                raise BertctlError(f"--keep-optimizer: {cfg.init_from} was trained with --objective {before}, this "
                                   f"data with {self.objective}: the optimizer state does not fit the model; drop "
                                   f"--keep-optimizer")
            load_state(model, init_state["model"], fresh_heads=True, source=str(cfg.init_from))
        self.model_config = model.config
        n_params = sum(p.numel() for p in model.parameters())
        self.n_params = n_params
        self.engine = Engine(cfg.train, self.runtime, model, PretrainingObjective(nsp=self.data.nsp), dist=self.dist,
                             max_steps=self.max_steps, run_dir=self.out, log=self.log, description="pretrain",
                             flops=lambda c: train_flops_6nt(self.model_config, n_params, c["tokens"], c["attn_pairs"]))
        self.warmup = self.engine.warmup_steps
        self.model = self.engine.model
        if resume_from is None and init_state is not None and cfg.keep_optimizer:
            load_optimizer_state(self.engine.optimizer, init_state["optimizer"])
            for g in self.engine.optimizer.param_groups:  # the new phase's hyper-parameters, the old moments
                g["lr"] = g["initial_lr"] = cfg.train.lr
                g["weight_decay"] = cfg.train.weight_decay if g["weight_decay"] else 0.0
            self.engine.scheduler = build_scheduler(self.engine.optimizer, self.warmup, self.max_steps,
                                                    cfg.train.schedule)
        if resume_from is not None:
            saved = init_state["configs"]
            if saved.get("data_manifest_id") != _manifest_id(self.data.manifest):
                raise BertctlError(f"{resume_from.path}: checkpoint was trained on other data "
                                   f"(manifest {saved.get('data_manifest_id')}); cannot resume on {cfg.data}")
            saved_batch = PretrainConfig.from_dict(saved["training"]).train.batch_size
            if saved_batch != cfg.train.batch_size:
                raise BertctlError(f"{resume_from.path}: checkpoint used --batch-size {saved_batch}, "
                                   f"not {cfg.train.batch_size}")
            wanted = self.engine.max_steps
            self.engine.restore(init_state)
            planned = self.engine.scheduler.lr_lambdas[0].total  # the saved plan: where its lr reaches 0
            if not cfg.train.fit_to_minutes and planned != wanted:
                self._extend(planned, wanted)
            self.max_steps = self.engine.max_steps
            self._say(f"resumed from {resume_from.path} at step {self.engine.step}")
        self.resumed_from = str(resume_from.path) if resume_from else None

    def _extend(self, planned: int, wanted: int) -> None:
        """A resumed run asked for another length than its schedule's: refused (its lr would sit at 0, or stop
        mid-decay) unless ``extend_schedule``, which re-plans the decay to end at the new last step."""
        step = self.engine.step
        if not self.extend_schedule:
            raise BertctlError(f"--max-steps {wanted}: the run in {self.out} was planned for {planned} steps (its lr "
                               f"decays to 0 there); add --extend-schedule to re-plan the decay from step {step} to "
                               f"end at step {wanted}, or resume with --max-steps {planned}")
        if wanted <= step:
            raise BertctlError(f"--max-steps {wanted}: the run in {self.out} is at step {step} already; give more")
        # The lr keeps its value at this step and decays linearly to 0 at the new last step.
        self.engine.scheduler.lr_lambdas[0].replan(step, wanted)
        self.engine.max_steps = wanted
        self._say(f"extending the schedule from {planned} to {wanted} steps: the lr decays from its value at step "
                  f"{step} to 0 at step {wanted}")

    @property
    def step(self) -> int:
        return self.engine.step

    # ----------------------------------------------------------------- data

    def _batches(self, start_step: int):
        """Global step ``start_step`` onwards, epoch after epoch (seeking, never replaying)."""
        epoch, k = divmod(start_step, self.steps_per_epoch)
        while True:
            kw = dict(seed=self.cfg.train.seed, epoch=epoch, start_step=k, rank=self.dist.rank,
                      world_size=self.dist.world_size)
            if self.cfg.bucket_lengths:
                yield from bucketed_batches(self.data, self.cfg.train.batch_size, **kw)
            else:
                yield from pretraining_batches(self.data, self.cfg.train.batch_size, **kw)
            epoch, k = epoch + 1, 0

    # ----------------------------------------------------------------- eval

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """MLM accuracy and perplexity (and NSP accuracy, with NSP) on the first ``eval_batches`` held-out
        batches (fixed masks)."""
        if self.eval_data is None:
            return None
        W = self.dist.world_size
        G = self.cfg.eval_batch_size or min(self.cfg.train.batch_size, 256)
        G = min(G, self.eval_data.num_instances)  # a held-out split smaller than a batch is one batch
        G = (G // W) * W
        if G < 1:  # fewer held-out instances than processes: nothing to evaluate
            return None
        n = max(1, min(self.cfg.eval_batches, self.eval_data.steps_per_epoch(G)))
        self.model.eval()
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)
        label_hist = None
        it = pretraining_batches(self.eval_data, G, seed=self.cfg.train.seed, epoch=0, start_step=0,
                                 rank=self.dist.rank, world_size=W)
        for _, batch in zip(range(n), it):
            faults.point("eval")
            mb = to_device(trim(batch), self.device)
            with autocast(self.precision, self.device):
                s = pretraining_sums(self.model, mb)
            labels = mb["masked_lm_labels"]
            valid = labels[labels != IGNORE_INDEX]
            h = torch.bincount(valid, minlength=self.model_config.vocab_size).double()
            label_hist = h if label_hist is None else label_hist + h
            zero = torch.zeros((), device=self.device)
            sums += torch.stack([s["mlm_sum"].double(), s.get("nsp_sum", zero).double(), s["mlm_correct"].double(),
                                 s.get("nsp_correct", zero).double(),
                                 valid.numel() * torch.ones((), dtype=torch.float64, device=self.device),
                                 torch.tensor(float(labels.shape[0]), dtype=torch.float64, device=self.device)])
        self.model.train()
        distributed.all_reduce_sum(sums, self.dist)
        if label_hist is not None:
            distributed.all_reduce_sum(label_hist, self.dist)
        mlm_sum, nsp_sum, mlm_ok, nsp_ok, n_masked, n_seq = sums.tolist()
        mlm_loss = mlm_sum / max(n_masked, 1)
        p = label_hist / label_hist.sum().clamp(min=1)
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
        nsp = {"nsp_loss": nsp_sum / max(n_seq, 1), "nsp_acc": nsp_ok / max(n_seq, 1)} if self.data.nsp else {}
        return {
            "mlm_loss": mlm_loss, "mlm_acc": mlm_ok / max(n_masked, 1), **nsp,
            "perplexity": math.exp(min(mlm_loss, 80.0)),
            # Always guessing the most frequent masked token: the floor MLM accuracy must clear;
            # the masked tokens' unigram entropy: the loss of predicting token frequencies only.
            "mlm_majority_baseline": float(label_hist.max() / max(n_masked, 1)),
            "mlm_unigram_entropy": entropy,
            "masked_tokens": int(n_masked), "sequences": int(n_seq),
        }

    def _evaluate_and_log(self, step: int) -> dict | None:
        ev = self.evaluate()
        if ev is None:
            return None
        warning = collapse_warning(self.last_eval, ev, step, self.warmup, self.engine.max_steps, self.cfg.train.lr,
                                   self.cfg.train.batch_size)
        self.last_eval = ev
        if warning:
            ev["collapsed"] = True
            if not self.collapsed:
                self._say(f"[bold red]{warning}")
                self.log.log(event="warning", step=step, kind="collapse", message=warning)
            self.collapsed = True
        self.log.log(event="eval", step=step, **ev)
        return ev

    # ----------------------------------------------------------------- checkpoint / export

    def save(self, reason: str) -> Path | None:
        epoch, k = divmod(self.step, self.steps_per_epoch)
        extra = {"data": {"epoch": epoch, "step_in_epoch": k, "global_step": self.step,
                          "sequences_seen": self.step * self.cfg.train.batch_size},
                 "configs": self._configs()}
        if reason == "periodic":  # written while training goes on (guarded in the writer's thread)
            return self.engine.save(extra, {"data": extra["data"], "configs": extra["configs"]}, reason, wait=False)
        with self.stop.writing():
            return self.engine.save(extra, {"data": extra["data"], "configs": extra["configs"], "reason": reason},
                                    reason, wait=True)

    def _configs(self) -> dict:
        return {"model": self.model_config.to_dict(), "objective": self.objective,
                "data_manifest_id": _manifest_id(self.data.manifest),
                "data": str(self.cfg.data), "training": self.cfg.to_dict()}

    def export(self) -> Path | None:
        if not self.dist.is_main:
            return None
        from bertctl.checkpoints.hf import save_pretrained

        target = self.out / "model"
        save_pretrained(self.model, target, tokenizer=self.tokenizer)
        return target

    # ----------------------------------------------------------------- loop

    def run(self) -> dict[str, Any]:
        with self.stop:
            try:
                return self._run()
            except OSError as e:  # a full disk or a file-size limit while writing: one line, and what is kept
                from bertctl.io import describe_os_error

                raise BertctlError(f"{describe_os_error(e)}; {kept_state(self.out)}") from None

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        stop = self.stop
        try:
            with stop.phase(lambda: "stopping now: training has not started", at_once=True):
                faults.point("start")
                self._load_data()
                self._build()
        except Interrupted as e:
            self._say(f"stopped ({e.signal}) before training started: {kept_state(self.out)}")
            raise Stopped() from None
        self.engine.stop = stop
        self._say(f"objective {self.objective} (from the data's manifest): "
                  + ("masked LM + next-sentence prediction, BertForPreTraining" if self.data.nsp else
                     "masked LM only, no NSP (the paper's section 5.1 ablation), BertForMaskedLM"))
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.log = self.engine.log = MetricsLog(self.out / "metrics.jsonl", tensorboard=self.cfg.train.tensorboard)
            self.log.log(event="config", step=self.step, configs=self._configs(), world_size=self.dist.world_size,
                         precision=self.precision, parameters=self.n_params, device=str(self.device))
        eval_start = None
        if cfg.eval_at_start and self.step == 0:
            try:
                with stop.phase(lambda: "stopping the evaluation at step 0 now, then saving", at_once=True):
                    eval_start = self._evaluate_and_log(0)
            except Interrupted:
                pass  # the run stops before its first step, and checkpoints it
        # Fewer distinct shapes to compile or capture. With graphs under torchrun every rank must capture
        # and replay the same graphs at the same steps: no trimming (packed sequences are nearly full).
        multiple = 64 if cfg.train.compile or self.use_graphs else 8
        if self.use_graphs and self.dist.world_size > 1:
            multiple = self.data.max_seq_length
        pack = self.runtime.attn == "unpadded" and self.dist.world_size == 1  # the loader packs: no host sync
        loader = Prefetcher(self._batches(self.step), lambda b: pretraining_step(b, self.micro, multiple, pack),
                            pin=self.device.type == "cuda")
        t_start = time.monotonic()
        start_step = self.step

        def after_step(step: int) -> None:
            if cfg.eval_every and step % cfg.eval_every == 0 and step < self.engine.max_steps:
                try:
                    with stop.phase(lambda: f"stopping the evaluation at step {step} now, then saving", at_once=True):
                        self._evaluate_and_log(step)
                except Interrupted:
                    pass  # the run stops before its next step, and checkpoints this one

        def checkpoint(reason: str) -> None:
            self.save(reason)
            self._curves()

        try:
            result = self.engine.run(loader, after_step=after_step, checkpoint=checkpoint, stop=stop)
        finally:
            loader.close()
        self.max_steps = self.engine.max_steps
        stop_reason = result.stopped
        complete = stop_reason is None or stop_reason == "time limit"
        with stop.phase(lambda: f"finishing the checkpoint at step {self.step}, then stopping"):
            ckpt = self.save("final" if complete else "interrupted")
        eval_end = model_dir = None
        if complete and stop.requested is not None:  # asked while the final checkpoint was written
            stop_reason = stop.requested
        elif complete:
            try:
                with stop.phase(lambda: "stopping the final evaluation now", at_once=True):
                    eval_end = self._evaluate_and_log(self.step)
            except Interrupted as e:
                stop_reason = e.signal
            else:  # the last phase: a signal now lets the model's write finish, and the run is then complete
                with stop.phase(lambda: f"finishing writing the model to {self.out / 'model'}: the run is then "
                                        f"complete"), stop.writing():
                    model_dir = self.export()
                if stop.requested is not None:
                    self._say(f"{stop.requested} came as the model was written: the run is complete ({model_dir})")
        if stop_reason not in (None, "time limit"):
            self._say(f"stopped ({stop_reason}) at step {self.step}/{self.max_steps}: {kept_state(self.out)}")
        png = self._curves()
        elapsed = time.monotonic() - t_start
        passes = self.text_passes()
        memorising = memorising_note(result.last_record, eval_end, passes)
        if memorising:
            self._say(f"[yellow]{memorising}")
            self.log.log(event="note", step=self.step, message=memorising)
        summary = {
            "output": str(self.out), "objective": self.objective, "steps": self.step, "start_step": start_step, "max_steps": self.max_steps,
            "stopped": stop_reason, "resumed_from": self.resumed_from,
            "checkpoint": str(ckpt) if ckpt else None, "model": str(model_dir) if model_dir else None,
            "curves": str(png) if png else None, "metrics": str(self.out / "metrics.jsonl"),
            "seconds": round(elapsed, 2), "world_size": self.dist.world_size, "precision": self.precision,
            "parameters": self.n_params, "train": result.last_record, "eval_start": eval_start, "eval_end": eval_end,
            "final_lr": float(self.engine.scheduler.get_last_lr()[0]), "collapsed": self.collapsed,
            "epochs": round(self.step / self.steps_per_epoch, 3), "passes_over_text": passes, "note": memorising,
        }
        self.log.log(event="end", **{k: v for k, v in summary.items() if k not in ("train",)})
        self.log.close()
        return summary

    def text_passes(self) -> float:
        """How often the run has seen each sentence of the raw text: epochs over the built data times the
        build's ``--dupe-factor`` (each copy holds every sentence once)."""
        dupe = (self.data.manifest.get("data_config") or {}).get("dupe_factor") or 1
        return round(self.step / self.steps_per_epoch * dupe, 2)

    def _curves(self) -> Path | None:
        if not self.dist.is_main or not (self.out / "metrics.jsonl").is_file():
            return None
        try:
            return plot_curves(self.out / "metrics.jsonl", self.out / "curves.png")
        except Exception as e:  # a picture must never cost a run
            stderr.print(f"[yellow]could not draw curves: {e}")
            return None


def _info(rec: dict) -> str:
    if not rec:
        return ""
    nsp = f"nsp_acc {rec['nsp_acc']:.3f} " if "nsp_acc" in rec else ""
    s = (f"loss {rec['loss']:.3f} mlm_acc {rec['mlm_acc']:.3f} {nsp}"
         f"lr {rec['lr']:.2e} {rec['seq_per_s']:.0f} seq/s {rec['tokens_per_s'] / 1e3:.1f}k tok/s")
    if "mfu" in rec:
        s += f" {rec['tflops']:.0f} TFLOP/s MFU {100 * rec['mfu']:.1f}%"
    return s


def _data_tokenizer(data_dir: Path, manifest: dict):
    """The tokenizer the data was built with: its SentencePiece model, or vocab.txt with the manifest's settings."""
    if not (data_dir / "vocab.txt").is_file():
        return None
    from bertctl.text import load_tokenizer

    return load_tokenizer(data_dir)  # a build-data folder is a tokenizer directory


RUN_OUTPUTS = ("checkpoints", "model", "metrics.jsonl", "curves.png", "tensorboard")


def kept_state(folder: Path) -> str:
    """What a pretraining folder holds now, for a message after a stop or an abort."""
    last = training.latest_checkpoint(folder)
    if last is None:
        return "no checkpoint was written yet, so nothing is kept (a rerun starts from the beginning)"
    try:
        final = json.loads((last.path / "meta.json").read_text()).get("reason") == "final"
    except (OSError, ValueError):
        final = False
    if final and not (folder / "model" / "config.json").is_file():
        return f"the final checkpoint (step {last.step}) is kept: --resume evaluates it and exports the model"
    return f"the checkpoint at step {last.step} is kept: --resume continues from it"


def unfinished_work(folder: Path) -> str | None:
    """What an unfinished pretraining run left in ``folder`` (its newest checkpoint), or None."""
    last = training.latest_checkpoint(folder)
    return f"a checkpoint at step {last.step}" if last is not None else None


def finished_before_marker(folder: Path) -> bool:
    """A run finished before output folders had their marker: its model exported after a final checkpoint."""
    last = training.latest_checkpoint(folder)
    if last is None or not (folder / "model" / "config.json").is_file():
        return False
    try:
        return json.loads((last.path / "meta.json").read_text()).get("reason") == "final"
    except (OSError, ValueError):
        return False


def claim_output(cfg: PretrainConfig, main: bool = True) -> rundir.Claim:
    """The output folder rule (bertctl.rundir) for a pretraining run."""
    return rundir.claim(cfg.output, command="pretrain", resume=cfg.resume, overwrite=cfg.overwrite,
                        started=unfinished_work, finished_before=finished_before_marker, outputs=RUN_OUTPUTS,
                        main=main, marks=True)


#: What a resumed run may give other values than it was made with: how it is shown, logged, checkpointed and
#: evaluated, where and how its steps run (the same maths), and its time box. ``--max-steps`` may change with
#: ``extend_schedule`` (``Trainer._extend``); every other option changes the run.
MAY_CHANGE = ("show_progress", "log_every", "tensorboard", "save_every", "save_minutes", "keep", "device",
              "micro_batch_size", "compile", "cuda_graphs", "eval_every", "eval_batches", "eval_batch_size", "minutes",
              "graph_min_steps")
#: Options that say how to run the command, not what the run is; ``max_steps`` has its own rule.
NOT_THE_RUN = ("output", "resume", "overwrite", "fit_to_minutes", "max_steps")
#: The flags of the options whose flag is not their name.
FLAGS = {"model_overrides": "--dropout", "show_progress": "--no-progress", "model_config": "--config"}


def saved_config(folder: Path) -> dict | None:
    """The options the run in ``folder`` was made with (its newest checkpoint's), or None."""
    last = training.latest_checkpoint(folder)
    if last is None:
        return None
    try:
        return json.loads((last.path / "meta.json").read_text())["configs"]["training"]
    except (OSError, ValueError, KeyError):
        return None


def check_resume(cfg: PretrainConfig, saved: dict | None) -> None:
    """A resumed run continues the run it was made as: each option that changes the run must be the saved one
    (refused by flag, with both values); the ones that may change are said (``rundir.check_resume``)."""
    if saved is None:
        return
    saved = PretrainConfig.from_dict(saved).to_dict()  # a checkpoint of an older version: its defaults filled in
    given = {k: v for k, v in cfg.to_dict().items() if k not in NOT_THE_RUN}
    for key in ("data", "eval_data", "init_from", "model_config"):  # the same files from any folder
        for d in (given, saved):
            if d.get(key):
                d[key] = str(Path(d[key]).resolve())
    renamed = {FLAGS.get(k, k): v for k, v in given.items()}
    rundir.check_resume({FLAGS.get(k, k): v for k, v in saved.items()}, renamed,
                        [FLAGS.get(k, k) for k in MAY_CHANGE], folder=Path(cfg.output), command="pretrain")


def pretrain(cfg: PretrainConfig, tokenizer=None, *, extend_schedule: bool = False) -> dict[str, Any]:
    """Run (or continue) a pretraining job; returns a JSON-able summary.  See ``PretrainConfig``.
    ``extend_schedule``: a resumed run given a larger ``max_steps`` re-plans its lr decay to end there."""
    t = cfg.train
    runtime = resolve(t.device, t.precision, attn=t.attn, kernels=t.kernels, compile=t.compile,
                      cuda_graphs=t.cuda_graphs, optimizer=t.optimizer, packed_data=True)
    dist = distributed.setup(runtime.device_type)
    finished = False
    trainer = None
    claim = None
    try:
        if cfg.resume and rundir.is_finished(Path(cfg.output), finished_before_marker) and t.max_steps:
            saved = (saved_config(Path(cfg.output)) or {}).get("max_steps")
            if saved and t.max_steps != saved:
                raise BertctlError(f"--max-steps {t.max_steps}: the run in {cfg.output} finished its {saved}-step "
                                   f"schedule (its lr decayed to 0), so there is nothing to extend; train on from it as "
                                   f"a new phase: --init-from {cfg.output} --keep-optimizer --output NEW")
        claim = claim_output(cfg, main=dist.is_main)
        if claim.state == "resume":
            check_resume(cfg, saved_config(Path(cfg.output)))
        trainer = Trainer(cfg, dist, runtime, tokenizer=tokenizer, extend_schedule=extend_schedule)
        summary = trainer.run()
        if summary["model"] is not None and dist.is_main:
            claim.finish(steps=summary["steps"])
        finished = True
        return summary
    finally:
        if claim is not None:
            claim.release()
        # The trainer (its DistributedDataParallel reducer holds the process group and gloo's
        # pending work) sits in reference cycles: it must be gone before the group is, not
        # freed at interpreter exit, where gloo's threads abort the process ("terminate called
        # without an active exception").  No barrier after a failure: the other ranks may never
        # reach it.
        trainer = None
        distributed.teardown(dist, synchronize=finished)
