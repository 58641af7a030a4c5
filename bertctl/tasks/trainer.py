"""The fine-tuning loop shared by every task (paper §4, Appendix A.3).

Recipe: AdamW (no decay on biases and LayerNorm, ``bertctl.train.optim``), linear warm-up over
the first 10% of steps then linear decay to 0, batch 32, 3 epochs, lr 5e-5, dropout 0.1; the
paper's lr sweep over {5e-5, 4e-5, 3e-5, 2e-5} picks the best on dev.

Speed, without changing the maths:
- dynamic padding: each batch is padded to its own longest row (rounded up to 8), not to
  max_seq_length, and ``group_by_length`` draws batches of similar length (random mega-batches
  of 50 batches sorted by length, Hugging Face's ``LengthGroupedSampler`` scheme);
- bf16 autocast on GPU, fused AdamW, SDPA attention, pinned host memory and async copies;
- no host sync per step: the running loss stays on the device until a log line is due.

Features are dicts of numpy arrays / ints (see ``collate``); the task modules build them.
Checkpoints (``OUT/checkpoint/last.pt``) hold model, optimizer, scheduler, RNG states and the
position (epoch, step), so ``resume=True`` continues exactly where the last save stopped:
batch order in an epoch is a pure function of (seed, epoch).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from bertctl.errors import BertctlError
from bertctl.io import atomic_path
from bertctl.progress import MetricsLog, stderr, track

IGNORE_INDEX = -100
PAD_MULTIPLE = 8  # pad lengths to a multiple of 8: tensor-core friendly, few distinct shapes


@dataclass
class TrainConfig:
    """Fine-tuning hyper-parameters; the defaults are the paper's (Appendix A.3)."""

    epochs: float = 3.0
    lr: float = 5e-5
    batch_size: int = 32
    eval_batch_size: int = 128
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    adam_eps: float = 1e-6
    max_grad_norm: float = 1.0
    seed: int = 42
    device: str = "auto"  # "auto" = cuda if available
    bf16: bool = True  # autocast to bfloat16 on GPU (ignored on CPU)
    group_by_length: bool = True
    compile: bool = False
    kernels: str = "auto"  # model ops: "auto" (compiled kernels where built), "fused" or "torch"
    attention: str = "sdpa"  # attention backend: "sdpa" or "explicit"
    max_steps: int | None = None  # stop early (tests, smoke runs)
    save_steps: int = 0  # also checkpoint every N optimizer steps (0 = only at epoch ends)
    log_steps: int = 50
    select_best: bool = False  # keep the epoch with the best dev score (NER: chosen on valid)
    progress: bool = True


@dataclass
class TrainResult:
    model: torch.nn.Module
    history: list[dict] = field(default_factory=list)  # one record per evaluation
    best: dict | None = None  # the evaluation record of the returned weights
    train_examples: int = 0
    train_seconds: float = 0.0  # training steps only (no evaluation, no featurisation)

    @property
    def examples_per_second(self) -> float:
        return self.train_examples / self.train_seconds if self.train_seconds > 0 else 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BertctlError(f"--device {name}: no CUDA device is available")
    return torch.device(name)


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on GPU; a no-op context elsewhere (CPU bf16 is slower than fp32 there)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16 and device.type == "cuda")


# ------------------------------------------------------------------------------------ batching


def feature_length(feature: dict) -> int:
    ids = feature["input_ids"]
    return int(ids.shape[-1])


def _round_up(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def collate(features: Sequence[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Stack features into padded int64 tensors (pinned when CUDA is present).

    ``input_ids`` / ``token_type_ids`` are (S,) or (C, S) arrays (C choices); ``attention_mask``
    is derived from their lengths. ``labels`` may be a scalar (class / float score) or an (S,)
    array (token labels, padded with -100); ``start_positions`` / ``end_positions`` are ints.
    Keys starting with ``_`` are bookkeeping and stay out of the batch.
    """
    first = features[0]
    length = _round_up(max(feature_length(f) for f in features))
    lead = first["input_ids"].shape[:-1]  # () or (C,)
    B = len(features)
    ids = np.full((B, *lead, length), pad_id, dtype=np.int64)
    types = np.zeros((B, *lead, length), dtype=np.int64)
    mask = np.zeros((B, *lead, length), dtype=np.int64)
    for i, f in enumerate(features):
        n = f["input_ids"].shape[-1]
        ids[i, ..., :n] = f["input_ids"]
        types[i, ..., :n] = f["token_type_ids"]
        if "lengths" in f:  # multiple choice: each choice has its own length
            for c, m in enumerate(f["lengths"]):
                mask[i, c, :m] = 1
        else:
            mask[i, :n] = 1
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    for key in ("labels", "start_positions", "end_positions"):
        if key not in first:
            continue
        value = first[key]
        if isinstance(value, np.ndarray) and value.ndim == 1:
            arr = np.full((B, length), IGNORE_INDEX, dtype=np.int64)
            for i, f in enumerate(features):
                arr[i, : len(f[key])] = f[key]
            batch[key] = arr
        else:
            dtype = np.float32 if isinstance(value, (float, np.floating)) else np.int64
            batch[key] = np.asarray([f[key] for f in features], dtype=dtype)
    out = {k: torch.from_numpy(v) for k, v in batch.items()}
    if torch.cuda.is_available():
        out = {k: v.pin_memory() for k, v in out.items()}
    return out


def epoch_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int, group_by_length: bool) -> list[np.ndarray]:
    """The batches (index arrays) of one epoch: a pure function of (seed, epoch), so resume can seek.

    With ``group_by_length``, a random permutation is cut into mega-batches of 50 batches, each
    sorted by length (longest first) and cut into batches, and the batch order is shuffled again,
    so padding is small while every epoch still sees a fresh random order.
    """
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))
    if group_by_length:
        mega = batch_size * 50
        chunks = [perm[i : i + mega] for i in range(0, len(perm), mega)]
        perm = np.concatenate([c[np.argsort(-lengths[c], kind="stable")] for c in chunks])
    batches = [perm[i : i + batch_size] for i in range(0, len(perm), batch_size)]
    if group_by_length:
        order = rng.permutation(len(batches))
        batches = [batches[i] for i in order]
    return batches


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ------------------------------------------------------------------------------------ prediction


@torch.no_grad()
def predict(model: torch.nn.Module, features: Sequence[dict], *, outputs: Sequence[str] = ("logits",),
            batch_size: int = 128, device: torch.device | None = None, bf16: bool = True,
            per_token: bool = False, progress: bool = False, description: str = "predict") -> list[list[np.ndarray]]:
    """Run ``model`` over ``features`` (sorted by length for little padding) and return, per
    feature, the float32 numpy arrays of the named output fields; with ``per_token`` the arrays
    are cut back to the feature's own length (token classification, QA logits)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    order = np.argsort([-feature_length(f) for f in features], kind="stable")
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

    with track(description, len(features), disable=not progress) as advance:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = to_device(collate([features[i] for i in idx]), device)
            for key in ("labels", "start_positions", "end_positions"):
                batch.pop(key, None)
            with autocast(device, bf16):
                out = model(**batch)
            pending.append((idx, [getattr(out, name) for name in outputs]))
            if len(pending) >= 32:
                flush()
            advance(len(idx))
        flush()
    model.train(was_training)
    return results  # type: ignore[return-value]


# ------------------------------------------------------------------------------------ training


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(path: Path, model, optimizer, scheduler, position: dict, history: list, best) -> None:
    state = {
        "model": {k: v.detach().cpu() for k, v in _unwrap(model).state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "position": position,
        "history": history,
        "best": best,
        "rng": _rng_state(),
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def _unwrap(model):
    return getattr(model, "_orig_mod", model)


def total_steps(num_features: int, cfg: TrainConfig) -> int:
    per_epoch = math.ceil(num_features / cfg.batch_size)
    steps = math.ceil(per_epoch * cfg.epochs)
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def fine_tune(model: torch.nn.Module, train_features: Sequence[dict], cfg: TrainConfig, *,
              evaluate: Callable[[torch.nn.Module], dict] | None = None, main_metric: str | None = None,
              output_dir: str | Path | None = None, resume: bool = False,
              log: MetricsLog | None = None) -> TrainResult:
    """Fine-tune ``model`` on ``train_features``; evaluate after every epoch.

    ``evaluate(model)`` returns a metrics dict; ``main_metric`` names the key that picks the best
    epoch when ``cfg.select_best``. Checkpoints go to ``output_dir/checkpoint/last.pt``.
    Returns the model (best epoch's weights when ``select_best``, else the last), the history
    of evaluations and the training throughput.
    """
    if not train_features:
        raise BertctlError("no training examples")
    from bertctl.train.optim import build_optimizer, build_scheduler

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model.to(device)
    optimizer = build_optimizer(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    steps = total_steps(len(train_features), cfg)
    warmup = int(cfg.warmup_ratio * steps)
    scheduler = build_scheduler(optimizer, warmup, steps, "linear")
    lengths = np.asarray([feature_length(f) for f in train_features])
    per_epoch = math.ceil(len(train_features) / cfg.batch_size)
    n_epochs = math.ceil(steps / per_epoch)
    log = log or MetricsLog(None)

    ckpt = Path(output_dir) / "checkpoint" / "last.pt" if output_dir else None
    history: list[dict] = []
    best: dict | None = None
    best_state = None
    epoch, start_step, global_step = 0, 0, 0
    if resume:
        if ckpt is None or not ckpt.exists():
            raise BertctlError(f"--resume: no checkpoint at {ckpt}")
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        _unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        epoch, start_step, global_step = (state["position"][k] for k in ("epoch", "step", "global_step"))
        history, best = state["history"], state["best"]
        if cfg.select_best and best is not None and (Path(output_dir) / "checkpoint" / "best.pt").exists():
            best_state = torch.load(Path(output_dir) / "checkpoint" / "best.pt", map_location="cpu")
        stderr.print(f"resuming at epoch {epoch + 1}, step {global_step}/{steps}")

    run_model = torch.compile(model, dynamic=True) if cfg.compile else model
    model.train()
    train_seconds = 0.0
    examples = 0

    def save(position):
        if ckpt is not None:
            _save_checkpoint(ckpt, model, optimizer, scheduler, position, history, best)

    while epoch < n_epochs and global_step < steps:
        batches = epoch_batches(lengths, cfg.batch_size, cfg.seed, epoch, cfg.group_by_length)
        running = torch.zeros((), device=device)
        running_n = 0
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with track(f"epoch {epoch + 1}/{n_epochs}", len(batches), disable=not cfg.progress) as advance:
            advance(start_step)
            for step in range(start_step, len(batches)):
                if global_step >= steps:
                    break
                idx = batches[step]
                batch = to_device(collate([train_features[i] for i in idx]), device)
                with autocast(device, cfg.bf16):
                    out = run_model(**batch)
                loss = out.loss
                loss.backward()
                if cfg.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                running += loss.detach()
                running_n += 1
                global_step += 1
                examples += len(idx)
                if global_step % cfg.log_steps == 0 or step == len(batches) - 1:
                    mean_loss = (running / running_n).item()  # the one host sync, every log_steps
                    running.zero_()
                    running_n = 0
                    lr = scheduler.get_last_lr()[0]
                    log.log(event="train", epoch=epoch + 1, step=global_step, loss=mean_loss, lr=lr)
                    advance(1, info=f"loss {mean_loss:.4f} lr {lr:.2e}")
                else:
                    advance(1)
                if cfg.save_steps and global_step % cfg.save_steps == 0 and step + 1 < len(batches):
                    save({"epoch": epoch, "step": step + 1, "global_step": global_step})
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_seconds += time.perf_counter() - t0
        start_step = 0
        epoch += 1
        if evaluate is not None:
            metrics = evaluate(model)
            record = {"epoch": epoch, "step": global_step, **metrics}
            history.append(record)
            log.log(event="eval", **record)
            stderr.print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                         if isinstance(v, float)))
            if main_metric is not None and (best is None or metrics[main_metric] > best[main_metric]):
                best = record
                if cfg.select_best:
                    best_state = {k: v.detach().cpu().clone() for k, v in _unwrap(model).state_dict().items()}
                    if ckpt is not None:
                        with atomic_path(ckpt.parent / "best.pt") as tmp:
                            torch.save(best_state, tmp)
        save({"epoch": epoch, "step": 0, "global_step": global_step})

    if cfg.select_best and best_state is not None:
        _unwrap(model).load_state_dict(best_state)
    elif history:
        best = history[-1]
    return TrainResult(_unwrap(model), history, best, examples, train_seconds)


def lr_sweep_values(lr_sweep: bool, lr: float) -> list[float]:
    """The paper's grid (§4.1: {5e-5, 4e-5, 3e-5, 2e-5}) or the one given lr."""
    return [5e-5, 4e-5, 3e-5, 2e-5] if lr_sweep else [lr]


def with_lr(cfg: TrainConfig, lr: float) -> TrainConfig:
    return dataclasses.replace(cfg, lr=lr)


def device_info() -> dict:
    """A description of where this ran, for metrics files and benchmark results."""
    info = {"torch": torch.__version__, "device": "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    info["host_cpus"] = os.cpu_count()
    return info


def clone_state(model: torch.nn.Module) -> dict:
    return copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()})
