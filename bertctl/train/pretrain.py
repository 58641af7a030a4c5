"""BERT pretraining: masked LM + next-sentence prediction (paper §3.1, §A.2), one CPU to many GPUs.

``pretrain(TrainConfig(...))`` is the whole job: build or load the model, resume
from the run's newest checkpoint if asked, train with gradient accumulation to the
global batch size, checkpoint atomically, evaluate on held-out data, and export a
Hugging Face directory.  Under ``torchrun`` it runs DistributedDataParallel, one
process per GPU (NCCL) or CPU process (gloo).

Exactness (the "never lose work" contract):
- every step reseeds torch from (seed, step, rank), so dropout after a resume is
  the dropout the uninterrupted run drew;
- the data loader seeks to (epoch, step) and never replays a batch;
- model, optimizer, scheduler, loss scaler and every rank's RNG states are saved.
On CPU a killed and resumed run therefore ends bit-identical to an uninterrupted one.

Loss normalisation: the MLM loss is Σ token cross-entropy / (masked tokens in the
*global* batch, all ranks and micro-batches), NSP Σ / (global batch size).  Each
micro-batch contributes its sums scaled by world_size / count (DDP averages
gradients over ranks), so N processes × k micro-batches give one process's
loss and gradient on the same global batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bertctl.errors import BertctlError
from bertctl.progress import MetricsLog, progress, stderr
from bertctl.train import distributed, state
from bertctl.train.loader import Prefetcher, StepBatch, bucketed_batches, to_device
from bertctl.train.metrics import peak_flops, plot_curves, train_flops, train_flops_6nt
from bertctl.train.optim import build_optimizer, build_scheduler

IGNORE_INDEX = -100


@dataclass
class TrainConfig:
    """Everything that defines a pretraining run (saved in every checkpoint)."""

    output: str
    data: str | None = None
    eval_data: str | None = None          # held-out shards; default: the data's held-out part if it has one
    # Model: a preset, a config.json, or initialised from a HF directory / previous run.
    model_size: str = "base"
    model_config: str | None = None
    init_from: str | None = None
    keep_optimizer: bool = False          # with init_from = a previous run: keep its optimizer moments
    model_overrides: dict = field(default_factory=dict)  # e.g. {"hidden_dropout_prob": 0.0}
    # Schedule.
    max_steps: int | None = None          # None: one epoch of the data
    minutes: float | None = None          # time box: stop (checkpoint + export) after this long
    batch_size: int = 256                 # global, sequences per optimizer step
    micro_batch_size: int | None = None   # per process per forward; None = batch_size // world_size
    optimizer: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    schedule: str = "linear"
    warmup_steps: int | None = None
    warmup_fraction: float = 0.01         # paper: 10,000 of 1,000,000 steps
    max_grad_norm: float = 1.0
    seed: int = 0
    # Speed.
    precision: str = "auto"               # auto = bf16 on GPU, fp32 on CPU; fp16 uses loss scaling
    kernels: str = "auto"
    attn: str = "sdpa"
    compile: bool = False
    bucket_lengths: bool = False          # length-bucketed batch order (less padding for varied lengths)
    device: str | None = None             # cpu | cuda | None (cuda when available)
    # Never lose work.
    resume: bool = False
    save_every: int | None = None         # steps
    save_minutes: float | None = 30.0
    keep: int = 3
    # Observability.
    log_every: int = 10
    eval_every: int | None = None
    eval_batches: int = 20
    eval_batch_size: int | None = None
    eval_at_start: bool = True
    show_progress: bool = True

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


# --------------------------------------------------------------------------- helpers


def _precision(cfg: TrainConfig, device: torch.device) -> str:
    p = cfg.precision
    if p == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if p not in ("bf16", "fp16", "fp32"):
        raise BertctlError(f"--precision must be bf16, fp16 or fp32, not {p!r}")
    if p == "fp16" and device.type != "cuda":
        raise BertctlError("--precision fp16 needs a GPU (use fp32 or bf16 on CPU)")
    return p


def _manifest_id(manifest: dict) -> str:
    if "id" in manifest:
        return str(manifest["id"])
    blob = json.dumps(manifest, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _step_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible torch seed for (run seed, optimizer step, rank)."""
    h = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _is_run_dir(path: Path) -> bool:
    return (path / state.CHECKPOINT_DIR).is_dir() or (path / "model" / "config.json").is_file()


def pretraining_sums(model, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward one micro-batch; return summed losses and correct counts (fp32 scalars).

    The MLM head runs at masked_positions only (the model gathers (B, P, H) before
    the V-way projection).  Cross-entropy is in fp32 on the (B·P, V) logits.
    """
    out = model(mb["input_ids"], mb["token_type_ids"], mb["attention_mask"],
                masked_positions=mb["masked_positions"])
    logits = out.prediction_logits.flatten(0, 1).float()            # (B·P, V)
    labels = mb["masked_lm_labels"].flatten()                        # (B·P,)
    mlm_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    nsp_logits = out.seq_relationship_logits.float()                # (B, 2)
    nsp_labels = mb["next_sentence_label"]
    nsp_sum = F.cross_entropy(nsp_logits, nsp_labels, reduction="sum")
    valid = labels != IGNORE_INDEX
    mlm_correct = ((logits.argmax(-1) == labels) & valid).sum()
    nsp_correct = (nsp_logits.argmax(-1) == nsp_labels).sum()
    return {"mlm_sum": mlm_sum, "nsp_sum": nsp_sum, "mlm_correct": mlm_correct, "nsp_correct": nsp_correct}


# --------------------------------------------------------------------------- the run


class _Stop:
    """SIGINT/SIGTERM: finish the step, checkpoint, exit cleanly (a second SIGINT aborts)."""

    def __init__(self):
        self.requested: str | None = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Trainer:
    def __init__(self, cfg: TrainConfig, dist: distributed.Dist, tokenizer=None):
        self.cfg, self.dist = cfg, dist
        self.device = dist.device
        self.out = Path(cfg.output)
        self.precision = _precision(cfg, self.device)
        self.tokenizer = tokenizer
        self.log = MetricsLog(self.out / "metrics.jsonl" if dist.is_main else None)
        self._last_save_time = time.monotonic()

    # ----------------------------------------------------------------- setup

    def _say(self, msg: str) -> None:
        if self.dist.is_main:
            stderr.print(msg)

    def _load_data(self):
        from bertctl.data.loader import PretrainingData

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
        G, W = self.cfg.batch_size, self.dist.world_size
        if G % W:
            raise BertctlError(f"--batch-size {G} is not divisible by the {W} processes")
        per_rank = G // W
        self.micro = self.cfg.micro_batch_size or per_rank
        if per_rank % self.micro:
            raise BertctlError(f"per-process batch {per_rank} (= {G} / {W}) is not a multiple of "
                               f"--micro-batch-size {self.micro}")
        self.steps_per_epoch = self.data.steps_per_epoch(G)
        if self.steps_per_epoch < 1:
            raise BertctlError(f"{self.cfg.data}: {self.data.num_instances} instances are fewer than one "
                               f"global batch of {G}")
        self.max_steps = self.cfg.max_steps or self.steps_per_epoch
        if self.tokenizer is None:
            self.tokenizer = _data_tokenizer(Path(self.cfg.data), self.data.manifest)

    def _model_config(self, ckpt_state: dict | None):
        from bertctl import checkpoint
        from bertctl.config import BertConfig

        runtime = dict(attn_implementation=self.cfg.attn, kernels=self.cfg.kernels)
        over = {**self.cfg.model_overrides, **runtime}
        if ckpt_state is not None:  # resume, or init from a previous run's checkpoint
            return BertConfig.from_dict(ckpt_state["configs"]["model"], **over), None
        if self.cfg.init_from:
            src = Path(self.cfg.init_from)
            if _is_run_dir(src):
                src = src / "model"
            return checkpoint.load_config(src, **over), src
        if self.cfg.model_config:
            return BertConfig.from_json_file(self.cfg.model_config, **over), None
        return BertConfig.preset(self.cfg.model_size, vocab_size=self.data.vocab_size, **over), None

    def _build(self) -> None:
        from bertctl import checkpoint
        from bertctl.model import BertForPreTraining

        cfg = self.cfg
        resume_from = state.latest_checkpoint(self.out) if cfg.resume else None
        if not cfg.resume and state.latest_checkpoint(self.out) is not None:
            raise BertctlError(f"{self.out} already holds checkpoints: pass --resume to continue that run, "
                               f"or choose another --output")
        if cfg.resume and resume_from is None:
            self._say(f"[yellow]no checkpoint in {self.out}: starting a new run")
        init_state = None
        if resume_from is not None:
            init_state = state.load_checkpoint(resume_from.path)
        elif cfg.init_from and (Path(cfg.init_from) / state.CHECKPOINT_DIR).is_dir():
            prev = state.latest_checkpoint(cfg.init_from)
            if prev is not None:
                init_state = state.load_checkpoint(prev.path)
        mconf, hf_dir = self._model_config(init_state)
        if mconf.vocab_size < self.data.vocab_size:
            raise BertctlError(f"model vocab_size {mconf.vocab_size} is smaller than the data's vocabulary "
                               f"({self.data.vocab_size})")
        if self.data.max_seq_length > mconf.max_position_embeddings:
            raise BertctlError(f"data max_seq_length {self.data.max_seq_length} exceeds the model's "
                               f"max_position_embeddings {mconf.max_position_embeddings}")
        # Same initial weights on every rank: seed before construction.
        torch.manual_seed(cfg.seed)
        if hf_dir is not None and init_state is None:
            model = checkpoint.load_pretrained(BertForPreTraining, hf_dir, fresh_heads=True,
                                               attn_implementation=cfg.attn, kernels=cfg.kernels,
                                               **cfg.model_overrides)
        else:
            model = BertForPreTraining(mconf)
        if init_state is not None:
            model.load_state_dict(init_state["model"])
        self.model = model.to(self.device)
        self.model_config = model.config
        self.optimizer = build_optimizer(self.model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         betas=tuple(cfg.betas), eps=cfg.eps,
                                         fused=True if self.device.type == "cuda" else None)
        self.step = 0
        if resume_from is None and init_state is not None and cfg.keep_optimizer:
            self.optimizer.load_state_dict(init_state["optimizer"])
            for g in self.optimizer.param_groups:  # the new phase's hyper-parameters, the old moments
                g["lr"] = g["initial_lr"] = cfg.lr
                g["weight_decay"] = cfg.weight_decay if g["weight_decay"] else 0.0
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_fraction * self.max_steps)
        self.warmup = warmup
        self.scheduler = build_scheduler(self.optimizer, warmup, self.max_steps, cfg.schedule)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        if resume_from is not None:
            # Optimizer after the scheduler's construction (which rewrites the groups' lr), then its state.
            self.optimizer.load_state_dict(init_state["optimizer"])
            self.scheduler.load_state_dict(init_state["scheduler"])
            self.step = int(init_state["step"])
            if init_state.get("scaler"):
                self.scaler.load_state_dict(init_state["scaler"])
            saved = init_state["configs"]
            if saved.get("data_manifest_id") != _manifest_id(self.data.manifest):
                raise BertctlError(f"{resume_from.path}: checkpoint was trained on other data "
                                   f"(manifest {saved.get('data_manifest_id')}); cannot resume on {cfg.data}")
            if saved["training"]["batch_size"] != cfg.batch_size:
                raise BertctlError(f"{resume_from.path}: checkpoint used --batch-size "
                                   f"{saved['training']['batch_size']}, not {cfg.batch_size}")
            rngs = init_state.get("rng") or []
            if self.dist.rank < len(rngs):
                state.restore_rng(rngs[self.dist.rank])
            self._say(f"resumed from {resume_from.path} at step {self.step}")
        self.resumed_from = str(resume_from.path) if resume_from else None

        step_model = self.model
        if self.dist.enabled:
            step_model = distributed.wrap_ddp(self.model, self.device)
        self.ddp = step_model if self.dist.enabled else None
        if cfg.compile:
            step_model = torch.compile(step_model)
        self.step_model = step_model
        self.n_params = sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------- data

    def _batches(self, start_step: int):
        """Global step ``start_step`` onwards, epoch after epoch (seeking, never replaying)."""
        epoch, k = divmod(start_step, self.steps_per_epoch)
        while True:
            kw = dict(seed=self.cfg.seed, epoch=epoch, start_step=k, rank=self.dist.rank,
                      world_size=self.dist.world_size)
            if self.cfg.bucket_lengths:
                yield from bucketed_batches(self.data, self.cfg.batch_size, **kw)
            else:
                yield from self.data.batches(self.cfg.batch_size, trim=True, **kw)
            epoch, k = epoch + 1, 0

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    # ----------------------------------------------------------------- one step

    def _train_step(self, sb: StepBatch, stats: torch.Tensor) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the step's loss (device scalar).

        ``stats`` (device, fp32): running mlm_sum, nsp_sum, mlm_correct, nsp_correct of the log window.
        Nothing here waits for the GPU: the normalisers are host numbers (one process) or an
        asynchronous all-reduce (several).
        """
        W = self.dist.world_size
        micro = [to_device(m, self.device) for m in sb.micro]
        if self.dist.enabled:
            # Global normalisers: masked tokens and sequences over all ranks and micro-batches.
            counts = torch.tensor([sb.masked, float(sb.sequences)], dtype=torch.float32).to(self.device)
            distributed.all_reduce_sum(counts, self.dist)
            mlm_scale = W / counts[0].clamp(min=1.0)
            nsp_scale = W / counts[1].clamp(min=1.0)
        else:
            mlm_scale, nsp_scale = 1.0 / max(sb.masked, 1.0), 1.0 / max(sb.sequences, 1)
        step_loss = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if (last or self.ddp is None) else self.ddp.no_sync()
            with sync:
                with self._autocast():
                    s = pretraining_sums(self.step_model, mb)
                loss = s["mlm_sum"] * mlm_scale + s["nsp_sum"] * nsp_scale
                self.scaler.scale(loss).backward()
            with torch.no_grad():
                step_loss += loss.detach() / W
                stats += torch.stack([s["mlm_sum"].detach(), s["nsp_sum"].detach(), s["mlm_correct"].float(),
                                      s["nsp_correct"].float()])
        if self.cfg.max_grad_norm and self.cfg.optimizer != "lamb":  # LAMB normalises by the global norm itself
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_loss

    # ----------------------------------------------------------------- eval

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """MLM / NSP accuracy and perplexity on the first ``eval_batches`` held-out batches (fixed masks)."""
        if self.eval_data is None:
            return None
        W = self.dist.world_size
        G = self.cfg.eval_batch_size or min(self.cfg.batch_size, 256)
        G = max(W, (G // W) * W)
        n = max(1, min(self.cfg.eval_batches, self.eval_data.steps_per_epoch(G)))
        if self.eval_data.steps_per_epoch(G) < 1:
            return None
        self.model.eval()
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)
        label_hist = None
        it = self.eval_data.batches(G, seed=self.cfg.seed, epoch=0, start_step=0, rank=self.dist.rank,
                                    world_size=W, trim=True)
        for _, batch in zip(range(n), it):
            mb = to_device(batch, self.device)
            with self._autocast():
                s = pretraining_sums(self.model, mb)
            labels = mb["masked_lm_labels"]
            valid = labels[labels != IGNORE_INDEX]
            h = torch.bincount(valid, minlength=self.model_config.vocab_size).double()
            label_hist = h if label_hist is None else label_hist + h
            sums += torch.stack([s["mlm_sum"].double(), s["nsp_sum"].double(), s["mlm_correct"].double(),
                                 s["nsp_correct"].double(), valid.numel() * torch.ones((), dtype=torch.float64,
                                                                                       device=self.device),
                                 torch.tensor(float(labels.shape[0]), dtype=torch.float64, device=self.device)])
        self.model.train()
        distributed.all_reduce_sum(sums, self.dist)
        if label_hist is not None:
            distributed.all_reduce_sum(label_hist, self.dist)
        mlm_sum, nsp_sum, mlm_ok, nsp_ok, n_masked, n_seq = sums.tolist()
        mlm_loss = mlm_sum / max(n_masked, 1)
        return {
            "mlm_loss": mlm_loss, "nsp_loss": nsp_sum / max(n_seq, 1),
            "mlm_acc": mlm_ok / max(n_masked, 1), "nsp_acc": nsp_ok / max(n_seq, 1),
            "perplexity": math.exp(min(mlm_loss, 80.0)),
            # Always guessing the most frequent masked token: the floor MLM accuracy must clear.
            "mlm_majority_baseline": float(label_hist.max() / max(n_masked, 1)) if label_hist is not None else 0.0,
            "masked_tokens": int(n_masked), "sequences": int(n_seq),
        }

    # ----------------------------------------------------------------- checkpoint / export

    def save(self, reason: str) -> Path | None:
        rngs = distributed.gather_to_main(state.capture_rng(), self.dist)
        path = None
        if self.dist.is_main:
            epoch, k = divmod(self.step, self.steps_per_epoch)
            blob = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": self.step,
                "rng": rngs,
                "data": {"epoch": epoch, "step_in_epoch": k, "global_step": self.step,
                         "sequences_seen": self.step * self.cfg.batch_size},
                "configs": self._configs(),
            }
            meta = {k: v for k, v in blob.items() if k in ("step", "data", "configs")}
            meta["reason"] = reason
            meta["world_size"] = self.dist.world_size
            path = state.save_checkpoint(self.out, self.step, blob, meta, keep=self.cfg.keep)
            self.log.log(event="checkpoint", step=self.step, path=str(path), reason=reason)
        distributed.barrier(self.dist)
        self._last_save_time = time.monotonic()
        return path

    def _configs(self) -> dict:
        return {"model": self.model_config.to_dict(), "data_manifest_id": _manifest_id(self.data.manifest),
                "data": str(self.cfg.data), "training": self.cfg.to_dict()}

    def export(self) -> Path | None:
        if not self.dist.is_main:
            return None
        from bertctl import checkpoint

        target = self.out / "model"
        checkpoint.save_pretrained(self.model, target, tokenizer=self.tokenizer)
        return target

    # ----------------------------------------------------------------- loop

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self._load_data()
        self._build()
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.log.log(event="config", step=self.step, configs=self._configs(), world_size=self.dist.world_size,
                         precision=self.precision, parameters=self.n_params, device=str(self.device))
        peak = peak_flops(self.device)
        eval_start = None
        if cfg.eval_at_start and self.step == 0:
            eval_start = self.evaluate()
            if eval_start is not None:
                self.log.log(event="eval", step=0, **eval_start)
        multiple = 64 if cfg.compile else 8  # fewer distinct shapes when compiling
        loader = Prefetcher(self._batches(self.step), self.micro, multiple=multiple,
                            pin=self.device.type == "cuda")
        stats = torch.zeros(4, device=self.device)      # mlm_sum, nsp_sum, mlm_ok, nsp_ok (this window)
        bad = torch.zeros((), dtype=torch.int32, device=self.device)
        window = {"t": time.perf_counter(), "seq": 0, "tok": 0.0, "flops": 0.0, "useful": 0.0, "steps": 0,
                  "masked": 0.0}
        t_start = time.monotonic()
        last_train: dict = {}
        stop_reason = None
        start_step = self.step
        sync_every = 1 if not self.dist.enabled else max(1, cfg.log_every)
        bar = progress(disable=not (self.dist.is_main and cfg.show_progress))
        try:
            with _Stop() as stop, bar:
                task = bar.add_task("pretrain", total=self.max_steps, completed=self.step, info="")
                while self.step < self.max_steps:
                    sb = next(loader)
                    torch.manual_seed(_step_seed(cfg.seed, self.step, self.dist.rank))
                    loss = self._train_step(sb, stats)
                    bad += (~torch.isfinite(loss)).int()
                    self.step += 1
                    window["steps"] += 1
                    # This rank's work (host numbers); summed over ranks when the window is logged.
                    window["masked"] += sb.masked
                    window["seq"] += sb.sequences
                    window["tok"] += sb.tokens
                    window["flops"] += train_flops_6nt(self.model_config, self.n_params, sb.tokens, sb.attn_pairs)
                    window["useful"] += train_flops(self.model_config, sb.tokens, sb.attn_pairs, sb.masked,
                                                    sb.sequences)
                    bar.update(task, completed=self.step)
                    # Decisions every rank must agree on (stop, save) are taken at sync points.
                    want_stop = stop.requested is not None or (
                        cfg.minutes is not None and time.monotonic() - t_start >= cfg.minutes * 60)
                    want_save = cfg.save_minutes is not None and (
                        time.monotonic() - self._last_save_time >= cfg.save_minutes * 60)
                    log_now = self.step % cfg.log_every == 0 or self.step == self.max_steps
                    if not self.dist.enabled:
                        pass  # one process decides alone, no collective and no host sync
                    elif self.step % sync_every == 0 or self.step == self.max_steps:
                        flags = torch.tensor([float(want_stop), float(want_save)], device=self.device)
                        distributed.all_reduce_sum(flags, self.dist)
                        want_stop, want_save = bool(flags[0] > 0), bool(flags[1] > 0)
                    else:
                        want_stop = want_save = False
                    if log_now or want_stop:
                        last_train = self._log_window(stats, bad, window, peak)
                        bar.update(task, info=_info(last_train))
                    paused = time.perf_counter()  # evaluation and checkpoints do not count as training time
                    if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.max_steps:
                        ev = self.evaluate()
                        if ev is not None:
                            self.log.log(event="eval", step=self.step, **ev)
                    if want_stop:
                        stop_reason = stop.requested or "time limit"
                        break
                    if (cfg.save_every and self.step % cfg.save_every == 0) or want_save:
                        self._check_finite(bad)
                        self.save("periodic")
                        self._curves()
                    window["t"] += time.perf_counter() - paused
        finally:
            loader.close()
        self._check_finite(bad)
        if window["steps"] > 0 or not last_train:
            last_train = self._log_window(stats, bad, window, peak) or last_train
        ckpt = self.save("interrupted" if stop_reason and stop_reason != "time limit" else "final")
        eval_end = None
        if stop_reason is None or stop_reason == "time limit":
            eval_end = self.evaluate()
            if eval_end is not None:
                self.log.log(event="eval", step=self.step, **eval_end)
        model_dir = self.export() if stop_reason is None or stop_reason == "time limit" else None
        png = self._curves()
        elapsed = time.monotonic() - t_start
        summary = {
            "output": str(self.out), "steps": self.step, "start_step": start_step, "max_steps": self.max_steps,
            "stopped": stop_reason, "resumed_from": self.resumed_from,
            "checkpoint": str(ckpt) if ckpt else None, "model": str(model_dir) if model_dir else None,
            "curves": str(png) if png else None, "metrics": str(self.out / "metrics.jsonl"),
            "seconds": round(elapsed, 2), "world_size": self.dist.world_size, "precision": self.precision,
            "parameters": self.n_params, "train": last_train, "eval_start": eval_start, "eval_end": eval_end,
        }
        self.log.log(event="end", **{k: v for k, v in summary.items() if k not in ("train",)})
        self.log.close()
        return summary

    def _check_finite(self, bad: torch.Tensor) -> None:
        if self.precision == "fp16":
            return  # GradScaler skips non-finite steps and lowers the scale
        n_bad = torch.zeros(1, device=self.device) + bad
        distributed.all_reduce_sum(n_bad, self.dist)
        if n_bad.item() > 0:
            last = state.latest_checkpoint(self.out)
            where = f"; the last good checkpoint is {last.path}" if last else ""
            raise BertctlError(f"non-finite loss by step {self.step}: stopped without saving{where} "
                               f"(lower --lr, or use --precision fp16 with loss scaling)")

    def _log_window(self, stats: torch.Tensor, bad: torch.Tensor, window: dict, peak: float | None) -> dict:
        host = torch.tensor([window["masked"], window["seq"], window["tok"], window["flops"], window["useful"]],
                            dtype=torch.float64)
        if self.dist.enabled:  # ranks hold different numbers of masked tokens and real tokens
            s = torch.cat([stats.double(), host.to(self.device)])
            distributed.all_reduce_sum(s, self.dist)
        else:
            s = torch.cat([stats.double().cpu(), host])
        # The one host sync per log window.
        mlm_sum, nsp_sum, mlm_ok, nsp_ok, n_masked, n_seq, n_tok, flops, useful = s.tolist()
        stats.zero_()
        if n_seq == 0:
            return {}
        now = time.perf_counter()
        dt = max(now - window["t"], 1e-9)
        mlm_loss, nsp_loss = mlm_sum / max(n_masked, 1), nsp_sum / n_seq
        rec = {
            "step": self.step, "loss": mlm_loss + nsp_loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
            "mlm_acc": mlm_ok / max(n_masked, 1), "nsp_acc": nsp_ok / n_seq,
            "lr": self.scheduler.get_last_lr()[0],
            "seq_per_s": n_seq / dt, "tokens_per_s": n_tok / dt,
            "tflops": flops / dt / 1e12,
        }
        if peak:  # 6·N·T convention; useful = MLM projection at masked positions only
            rec["mfu"] = flops / dt / peak / self.dist.world_size
            rec["mfu_useful"] = useful / dt / peak / self.dist.world_size
        if self.scaler.is_enabled():
            rec["loss_scale"] = self.scaler.get_scale()
        window.update(t=now, seq=0, tok=0.0, flops=0.0, useful=0.0, steps=0, masked=0.0)
        self.log.log(event="train", **rec)
        return rec

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
    s = (f"loss {rec['loss']:.3f} mlm_acc {rec['mlm_acc']:.3f} nsp_acc {rec['nsp_acc']:.3f} "
         f"lr {rec['lr']:.2e} {rec['seq_per_s']:.0f} seq/s {rec['tokens_per_s'] / 1e3:.1f}k tok/s")
    if "mfu" in rec:
        s += f" {rec['tflops']:.0f} TFLOP/s MFU {100 * rec['mfu']:.1f}%"
    return s


def _data_tokenizer(data_dir: Path, manifest: dict):
    """The tokenizer the data was built with: its SentencePiece model, or vocab.txt with the manifest's settings."""
    if not (data_dir / "vocab.txt").is_file():
        return None
    from bertctl.tokenizer import load_tokenizer

    return load_tokenizer(data_dir)  # a build-data folder is a tokenizer directory


def pretrain(cfg: TrainConfig, tokenizer=None) -> dict[str, Any]:
    """Run (or continue) a pretraining job; returns a JSON-able summary.  See ``TrainConfig``."""
    dist = distributed.setup(cfg.device)
    finished = False
    trainer = None
    try:
        trainer = Trainer(cfg, dist, tokenizer=tokenizer)
        summary = trainer.run()
        finished = True
        return summary
    finally:
        # The trainer (its DistributedDataParallel reducer holds the process group and gloo's
        # pending work) sits in reference cycles: it must be gone before the group is, not
        # freed at interpreter exit, where gloo's threads abort the process ("terminate called
        # without an active exception").  No barrier after a failure: the other ranks may never
        # reach it.
        trainer = None
        distributed.teardown(dist, synchronize=finished)
