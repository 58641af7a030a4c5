"""Fine-tuning on the one training engine (paper §4, Appendix A.3).

Recipe: AdamW (no decay on biases and LayerNorm, ``bertctl.train.optim``), linear warm-up over
the first 10% of steps then linear decay to 0, batch 32, 3 epochs, lr 5e-5, dropout 0.1; the
paper's lr choice over {5e-5, 4e-5, 3e-5, 2e-5} on dev is the GLUE suite's (``--lr 5e-5,4e-5,...``).

``fine_tune`` takes a model with a fresh head, featurised examples (dicts of numpy arrays, see
``bertctl.data.batching.collate``), the task's loss on the head's logits (``label_loss``, ``span_loss``) and an
``evaluate(model, shards)`` callback (``bertctl.tasks.base.finetune`` makes them from a ``Task``), and runs them on
``bertctl.train.engine.Engine``, which brings DDP under ``torchrun``, accumulation from
``micro_batch_size``, bf16/fp16/fp32, compile, exact resume and the metrics log. Batches are
random (Hugging Face Trainer's order) and padded to their own longest row; ``group_by_length``
(Hugging Face's ``LengthGroupedSampler`` scheme) trades a little randomness for less padding.
Evaluation runs at every epoch end, under torchrun shared by the processes (each predicts a share of
the batches, all score the whole); a checkpoint is written there too
(``OUT/checkpoints/step-N``), so ``resume=True`` continues exactly: batch order is a pure
function of (seed, epoch), dropout of (seed, step, rank). The trained model is written before the
last evaluation, so a signal there loses nothing (``fine_tune``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from bertctl import faults
from bertctl.checkpoints import training
from bertctl.checkpoints.hf import MODEL_SUBDIR
from bertctl.config import IGNORE_INDEX, FinetuneConfig
from bertctl.data.batching import (BATCH_TOKENS, Prefetcher, collate, feature_length, length_batches,
                                   median_step_length, steps_per_epoch, task_batches)
from bertctl.errors import BertctlError, Stopped
from bertctl.nn.attention import cudnn_training_attention, varied_shapes
from bertctl.progress import MetricsLog, stderr, track
from bertctl.runtime import Runtime, resolve, resolve_precision
from bertctl.train import distributed
from bertctl.train.engine import Engine, Interrupted, StopSignal, autocast, to_device


@dataclass
class TrainResult:
    model: torch.nn.Module
    history: list[dict] = field(default_factory=list)  # one record per evaluation
    best: dict | None = None  # the evaluation record of the returned weights
    train_examples: int = 0
    train_seconds: float = 0.0  # training steps only (no evaluation, no featurisation)
    steps: int = 0
    epochs: float = 0.0  # epochs actually trained (a --max-steps run stops early)
    eval_seconds: float = 0.0  # the epoch-end evaluations
    reloaded: bool = False  # select_best took an earlier epoch's weights than the last step's
    outcome: Any = None  # what the driver's ``finish`` returned

    @property
    def examples_per_second(self) -> float:
        return self.train_examples / self.train_seconds if self.train_seconds > 0 else 0.0


def runtime_of(cfg: FinetuneConfig) -> Runtime:
    """Where and how fine-tuning runs: the runtime ``cfg`` asks for. Decided before the model is built,
    since with CUDA graphs ``--attn auto`` picks the padded attention; graphs asked for where they cannot
    run are one clear error."""
    t = cfg.train
    return resolve(t.device, t.precision, attn=t.attn, kernels=t.kernels, dropout_masks=t.dropout_masks,
                   compile=t.compile, cuda_graphs=t.cuda_graphs, optimizer=t.optimizer)


def eager_ddp_note(runtime: Runtime, world_size: int, graphs_on: bool) -> str | None:
    """A note for several GPUs stepping eagerly: at fine-tuning's batches each step waits on the host
    issuing its kernels, which DDP adds to, so more GPUs can be slower than one
    (``benchmarks/results/finetune-ddp-squad-large-eager-*.json``; the note gives its figure)."""
    if world_size < 2 or runtime.device_type != "cuda" or graphs_on:
        return None
    why = runtime.graphs_unsupported or "--no-cuda-graphs"
    return (f"note: {world_size} processes without CUDA graphs ({why}): each step waits on the host issuing its "
            f"kernels, and at a few dozen rows a GPU more GPUs can be slower than one (BERT-Large on SQuAD, 16 rows a "
            f"GPU: 2 GPUs ran 0.74x one); CUDA graphs, the default, need bf16 or fp32, AdamW and no "
            f"--compile")


def _dist(runtime: Runtime) -> distributed.Dist:
    """This process's place: under torchrun one rank per GPU; otherwise the configured device."""
    device = runtime.torch_device
    dist = distributed.setup(device.type)
    if not dist.enabled and device.type == "cuda" and device.index is not None:
        dist.device = device
        torch.cuda.set_device(device)
    return dist


def _unpadded(model: torch.nn.Module) -> bool:
    """Whether the model runs the ``unpadded`` attention: its batches then come packed by the loader."""
    return getattr(getattr(model, "runtime", None), "attn", None) == "unpadded"


#: The batch fields a task's loss reads; the model's forward gets the rest, and returns logits only.
LABEL_KEYS = ("labels", "start_positions", "end_positions")


# ------------------------------------------------------------------------------------ prediction

@torch.no_grad()
def predict(model: torch.nn.Module, features: Sequence[dict], *, outputs: Sequence[str] = ("logits",),
            batch_size: int = 128, batch_tokens: int | None = None, device: torch.device | None = None,
            precision: str = "auto", per_token: bool = False, progress: bool = False,
            description: str = "predict", shards: distributed.Dist | None = None) -> list[list[np.ndarray]]:
    """Run ``model`` over ``features`` and return, per feature, the float32 numpy arrays of the named
    output fields; with ``per_token`` the arrays are cut back to the feature's own length (token
    classification, QA logits). Features go longest first, in batches of at most ``batch_size`` and
    ``batch_tokens`` padded tokens (``embed``'s budget: by default 1024 on the CPU, where long batches
    run slower, 65536 on a GPU); a multiple-choice feature counts its choices' tokens. With
    ``shards`` (several processes evaluating the same features, as fine-tuning's epoch ends under
    torchrun) each process runs every ``world_size``-th batch (longest first, so the shares are even)
    and all of them receive every result: every process must then make the same ``predict`` calls."""
    device = device or next(model.parameters()).device
    precision = resolve_precision(precision, device.type)
    was_training = model.training
    model.eval()
    cost = np.array([f["input_ids"].size for f in features], dtype=np.int64)  # (S,) or (C, S)
    budget = batch_tokens or BATCH_TOKENS.get(device.type, BATCH_TOKENS["cuda"])
    results: list[list[np.ndarray] | None] = [None] * len(features)
    pending = []  # device tensors kept until the end: one host sync, not one per batch

    def flush():
        for idx, tensors in pending:
            arrays = [t.float().cpu().numpy() for t in tensors]
            for j, i in enumerate(idx):
                row = [a[j] for a in arrays]
                if per_token:
                    n = feature_length(features[i])
                    row = [r[:n] for r in row]
                results[i] = row
        pending.clear()

    shards = shards if shards is not None and shards.enabled else None
    batches = length_batches(cost, batch_size, budget)
    if shards is not None:
        batches = batches[shards.rank::shards.world_size]
    with track(description, len(features), disable=not progress) as advance, varied_shapes():
        for idx in batches:
            batch = collate([features[i] for i in idx], pack=_unpadded(model))
            if device.type == "cuda":  # pinned: the copy queues behind the GPU's work instead of waiting for it
                batch = {k: v.pin_memory() for k, v in batch.items()}
            batch = to_device(batch, device)
            for key in LABEL_KEYS:
                batch.pop(key, None)
            with autocast(precision, device):
                try:
                    out = model(**batch)
                except torch.OutOfMemoryError:
                    rows, width = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
                    raise BertctlError(
                        f"out of {device.type.upper()} memory evaluating {rows} examples of {width} tokens in one "
                        f"forward pass: pass a smaller --batch-tokens (bertctl eval) or --eval-batch-tokens (bertctl "
                        f"finetune)") from None
            pending.append((idx, [getattr(out, name) for name in outputs]))
            if len(pending) >= 32:
                flush()
            advance(len(idx))
            faults.point("eval")
        flush()
    if shards is not None:
        mine = [(int(i), results[i]) for idx in batches for i in idx]
        for part in distributed.all_gather_objects(mine, shards):
            for i, row in part:
                results[i] = row
    model.train(was_training)
    return results  # type: ignore[return-value]


# ------------------------------------------------------------------------------------ training


def label_loss(out, batch) -> torch.Tensor:
    """Cross-entropy of the head's logits against ``labels`` (one per example, per token with -100 where none,
    or one per choice set), or for float labels the squared error of a regression's one output; summed."""
    logits, labels = out.logits.float(), batch["labels"]
    if labels.dtype.is_floating_point:  # regression
        return F.mse_loss(logits.squeeze(-1), labels.float(), reduction="sum")
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def span_loss(out, batch) -> torch.Tensor:
    """Span QA: the mean of the start and end cross-entropies, summed over the examples; a position past the
    window is ignored, as in Hugging Face's head."""
    S = out.start_logits.shape[1]
    start = F.cross_entropy(out.start_logits.float(), batch["start_positions"].clamp(0, S), ignore_index=S,
                            reduction="sum")
    end = F.cross_entropy(out.end_logits.float(), batch["end_positions"].clamp(0, S), ignore_index=S,
                          reduction="sum")
    return (start + end) / 2


class TaskObjective:
    """A task's one loss, on the head's logits, as the engine's objective: a sum over the micro-batch,
    normalised by the global batch's examples (labelled tokens for per-token labels), so accumulation and N
    processes give the one-batch loss. The labels stay out of the forward, so the head computes no second
    loss."""

    loss_terms = ("loss",)
    stat_names = ()

    def __init__(self, loss: Callable = label_loss):
        self.loss = loss

    def sums(self, model, mb):
        out = model(**{k: v for k, v in mb.items() if k not in LABEL_KEYS})
        return {"loss": self.loss(out, mb)}

    def record(self, sums, counts):
        return {"loss": sums["loss"] / max(counts["loss"], 1.0)}

    def info(self, rec):
        return f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} {rec['seq_per_s']:.0f} ex/s"


def total_steps(num_features: int, cfg: FinetuneConfig, world_size: int = 1) -> int:
    per_epoch = steps_per_epoch(num_features, cfg.train.batch_size, world_size)
    steps = math.ceil(per_epoch * cfg.epochs)
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


def kept_state(run_dir: Path | None) -> str:
    """What a fine-tuning folder holds now, for the message after an abort: the trained model with its
    evaluation still to run, a checkpoint, or nothing."""
    last = training.latest_checkpoint(run_dir) if run_dir is not None else None
    if last is None:
        return "no checkpoint was written yet, so nothing is kept (a rerun starts from the beginning)"
    if is_final(last):
        return (f"the trained model in {run_dir / MODEL_SUBDIR} is kept, its evaluation not done: --resume "
                f"evaluates it")
    return f"the checkpoint at step {last.step} is kept: --resume continues from it"


def is_final(checkpoint: training.Checkpoint) -> bool:
    """Whether a checkpoint is a complete training's (the trained model written, its evaluation to run)."""
    try:
        return json.loads((checkpoint.path / "meta.json").read_text()).get("reason") == "final"
    except (OSError, ValueError):
        return False


def fine_tune(model: torch.nn.Module, train_features: Sequence[dict], cfg: FinetuneConfig, *,
              evaluate: Callable[[torch.nn.Module, distributed.Dist], dict] | None = None,
              main_metric: str | None = None, output_dir: str | Path | None = None, resume: bool = False,
              log: MetricsLog | None = None, runtime: Runtime | None = None, loss: Callable = label_loss,
              save_model: Callable[[torch.nn.Module], None] | None = None,
              finish: Callable[["TrainResult"], Any] | None = None, stop: StopSignal | None = None,
              meta: dict | None = None, extend_schedule: bool = False) -> TrainResult:
    """Fine-tune ``model`` on ``train_features`` with the task's ``loss`` (``label_loss``, ``span_loss``);
    evaluate after every epoch (shared by the processes).

    ``evaluate(model, shards)`` returns a metrics dict, predicting with ``predict(..., shards=shards)``;
    ``main_metric`` names the key that picks the best epoch when ``cfg.select_best``; ``runtime``: the
    command's (default: ``cfg``'s). Checkpoints go to ``output_dir/checkpoints/`` (epoch ends, every
    ``save_every`` steps, and on SIGINT/SIGTERM, after which ``Stopped`` ends the process with exit 0), with
    ``meta`` in their ``meta.json``.

    The end, in this order, so that no signal loses the trained model: ``save_model(model)`` writes the
    trained model (the last step's weights) and a final checkpoint records the run's evaluations (no optimizer:
    nothing trains again); then the last evaluation, and ``finish(result)`` (the driver's final predictions,
    scores and outputs; its value becomes ``result.outcome``). A signal during those stops them at once, and
    ``resume`` on a final checkpoint just evaluates. Without ``save_model`` (a library call) the checkpoints are
    removed once training completes. Returns the model (best epoch's weights when ``select_best``, else the
    last), the evaluation history and the throughput.
    """
    if not train_features:
        raise BertctlError("no training examples")
    runtime = runtime if runtime is not None else runtime_of(cfg)
    dist = _dist(runtime)
    W = dist.world_size
    if cfg.train.batch_size < W:
        raise BertctlError(f"--batch-size {cfg.train.batch_size} is smaller than the {W} processes")
    per_epoch = steps_per_epoch(len(train_features), cfg.train.batch_size, W)
    steps = total_steps(len(train_features), cfg, W)
    run_dir = Path(output_dir) if output_dir is not None else None
    log = log if (log is not None and dist.is_main) else MetricsLog(None)
    engine = Engine(cfg.train, runtime, model, TaskObjective(loss), dist=dist, max_steps=steps, run_dir=run_dir,
                    log=log, compile_dynamic=True, description="finetune")
    model = engine.model
    note = eager_ddp_note(runtime, W, runtime.cuda_graphs)
    if note and dist.is_main:
        stderr.print(note)
    with (stop if stop is not None else StopSignal(kept=lambda: kept_state(run_dir))) as stop:
        engine.stop = stop
        return _fine_tune(engine, model, train_features, cfg, evaluate=evaluate, main_metric=main_metric,
                          run_dir=run_dir, resume=resume, log=log, runtime=runtime, save_model=save_model,
                          finish=finish, stop=stop, meta=meta or {}, per_epoch=per_epoch, steps=steps,
                          extend_schedule=extend_schedule)


def _replan(engine: Engine, steps: int, extend_schedule: bool, run_dir, say) -> None:
    """A resumed run of another length than its schedule's: its lr decay re-planned from the step reached to
    end at ``steps`` (``extend_schedule``), else refused (the lr would stop mid-decay, or sit at 0)."""
    schedule = engine.scheduler.lr_lambdas[0]
    planned, step = schedule.total, engine.step
    if planned == steps:
        return
    if not extend_schedule:
        raise BertctlError(f"the run in {run_dir} was planned for {planned} steps (its lr decays to 0 there), not "
                           f"{steps}; add --extend-schedule to re-plan the decay, or resume with its --max-steps "
                           f"and --epochs")
    if steps <= step:
        raise BertctlError(f"the run in {run_dir} is at step {step} already, and these flags end it at step {steps}; "
                           f"give more steps or epochs")
    schedule.replan(step, steps)
    engine.max_steps = steps
    say(f"extending the schedule from {planned} to {steps} steps: the lr decays from its value at step {step} to "
        f"0 at step {steps}")


def _fine_tune(engine: Engine, model, train_features, cfg: FinetuneConfig, *, evaluate, main_metric, run_dir, resume,
               log, runtime, save_model, finish, stop: StopSignal, meta: dict, per_epoch: int,
               steps: int, extend_schedule: bool = False) -> TrainResult:
    dist, W = engine.dist, engine.dist.world_size
    say = stderr.print if dist.is_main else (lambda *a, **k: None)
    history: list[dict] = []
    best: dict | None = None
    best_state: dict | None = None
    eval_seconds = 0.0
    trained = False  # the run's training is complete and its model written: only the evaluation is left
    pending_eval = False
    if resume:
        latest = training.latest_checkpoint(run_dir) if run_dir else None
        if latest is None:
            raise BertctlError(f"--resume: no checkpoint in {run_dir}/{training.CHECKPOINT_DIR}")
        blob = training.load_checkpoint(latest.path)
        history, best, best_state = blob["history"], blob["best"], blob.get("best_model")
        if blob.get("final"):
            from bertctl.checkpoints.hf import load_state, read_state_dict

            load_state(model, read_state_dict(run_dir / MODEL_SUBDIR), source=str(run_dir / MODEL_SUBDIR))
            engine.step = int(blob["step"])
            trained = True
            say(f"resuming: training is complete (step {engine.step}/{steps}); evaluating the trained model in "
                f"{run_dir / MODEL_SUBDIR}")
        else:
            engine.restore(blob)
            _replan(engine, steps, extend_schedule, run_dir, say)
            pending_eval = bool(blob.get("pending_eval"))
            say(f"resuming at step {engine.step}/{steps} (epoch {engine.step // per_epoch + 1})"
                + (", its evaluation first" if pending_eval else ""))

    def checkpoint(reason: str, pending: bool = False) -> None:
        if run_dir is None:
            return
        extra = {"history": history, "best": best, "configs": {"training": cfg.to_dict()}, "pending_eval": pending}
        if cfg.select_best and best_state is not None:
            extra["best_model"] = best_state
        engine.save(extra, {"epoch": engine.step / per_epoch, **meta}, reason, wait=reason == "interrupted")

    def evaluation(step: int) -> None:
        """The dev evaluation at ``step`` (an epoch end, or the end of training), recorded in the history."""
        nonlocal best, best_state, eval_seconds
        t0 = time.perf_counter()
        metrics = evaluate(model, dist)  # every process predicts a share and scores the whole
        eval_seconds += time.perf_counter() - t0
        record = {"epoch": round(step / per_epoch, 4), "step": step, **metrics}
        history.append(record)
        log.log(event="eval", **record)
        say(f"epoch {record['epoch']:g}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                        if isinstance(v, float)))
        if main_metric is not None and (best is None or metrics[main_metric] > best[main_metric]):
            best = record
            if cfg.select_best:
                best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def epoch_end(step: int) -> None:
        """An epoch end before the last step: its evaluation (stopped at once by a signal, the checkpoint at this
        step then written with the evaluation still to run), then its checkpoint."""
        if evaluate is not None and cfg.epoch_evals:
            try:
                with stop.phase(lambda: f"stopping the evaluation at step {step} now, then saving", at_once=True):
                    evaluation(step)
            except Interrupted as e:
                checkpoint("interrupted", pending=True)
                say(f"stopped ({e.signal}) during the evaluation at step {step}/{steps}: checkpoint in "
                    f"{run_dir}/{training.CHECKPOINT_DIR}; continue with --resume (it evaluates first)")
                raise Stopped() from None
        checkpoint("epoch")

    def after_step(step: int) -> None:
        if step % per_epoch == 0 and step < steps:
            epoch_end(step)

    result = None
    if not trained:
        if pending_eval:
            epoch_end(engine.step)
        pin = engine.device.type == "cuda"
        batches = Prefetcher(task_batches(train_features, cfg.train.batch_size, seed=cfg.train.seed,
                                          start_step=engine.step, steps_per_epoch=per_epoch, group_by_length=cfg.group_by_length,
                                          rank=dist.rank, world_size=W, micro_batch_size=cfg.train.micro_batch_size,
                                          max_steps=steps,
                                          min_shape_steps=cfg.train.graph_min_steps if runtime.cuda_graphs else None,
                                          pack=_unpadded(model), fixed_length=runtime.cuda_graphs),
                             lambda sb: sb, pin=pin)
        config = getattr(model, "config", None)
        long_steps = config is not None and cudnn_training_attention(
            config.hidden_size // config.num_attention_heads,
            median_step_length(train_features, cfg.train.batch_size, seed=cfg.train.seed,
                               group_by_length=cfg.group_by_length, world_size=W), steps)
        try:
            with contextlib.nullcontext() if long_steps else varied_shapes():
                result = engine.run(batches, after_step=after_step, checkpoint=checkpoint, on_interrupt="then saving",
                                    stop=stop)
        finally:
            batches.close()
            engine.graphs = None  # the graphs' memory goes now, not at the next garbage collection
        if result.stopped is not None and engine.step < steps:
            checkpoint("interrupted")
            say(f"stopped ({result.stopped}) at step {engine.step}/{steps}: checkpoint in "
                f"{run_dir}/{training.CHECKPOINT_DIR}; continue with --resume")
            raise Stopped()
        if save_model is None:  # a library call: complete, nothing left to resume
            if run_dir is not None and dist.is_main:
                shutil.rmtree(run_dir / training.CHECKPOINT_DIR, ignore_errors=True)
        else:
            model_dir = run_dir / MODEL_SUBDIR
            with stop.phase(lambda: f"finishing writing the trained model to {model_dir}, then stopping before "
                                    f"its evaluation"):
                with stop.writing():
                    if dist.is_main:
                        save_model(model)
                        final = {"final": True, "step": engine.step, "history": history, "best": best,
                                 "configs": {"training": cfg.to_dict()}}
                        if cfg.select_best and best_state is not None:
                            final["best_model"] = best_state
                        training.save_checkpoint(run_dir, engine.step, final,
                                                 {"step": engine.step, "reason": "final", **meta}, keep=1)
                    distributed.barrier(dist)
            if stop.requested is not None:
                say(f"stopped ({stop.requested}) once training was complete: the trained model is in {model_dir}; "
                    f"run again with --resume to evaluate it")
                raise Stopped()
    train_sequences = result.sequences if result else 0
    train_seconds = result.train_seconds if result else 0.0
    try:
        with stop.phase(lambda: "stopping the final evaluation now", at_once=True):
            if evaluate is not None:
                evaluation(engine.step)
            reloaded = False
            if cfg.select_best and best_state is not None:
                reloaded = bool(history) and best is not history[-1]
                model.load_state_dict(best_state)
            elif history:
                best = history[-1]
            out = TrainResult(model, history, best, train_sequences, train_seconds, engine.step,
                              round(engine.step / per_epoch, 4), eval_seconds, reloaded=reloaded)
            if finish is not None:
                out.outcome = finish(out)
            return out
    except Interrupted as e:
        where = (f"the trained model is in {run_dir / MODEL_SUBDIR}, written before it: run again with --resume to "
                 f"evaluate it" if save_model is not None else "nothing was written")
        say(f"stopped ({e.signal}) during the final evaluation: {where}")
        raise Stopped() from None


def device_info() -> dict:
    """A description of where this ran, for metrics files and benchmark results."""
    info = {"torch": torch.__version__, "device": "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    info["host_cpus"] = os.cpu_count()
    info["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    return info
