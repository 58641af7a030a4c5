"""The one training engine: pretraining and every fine-tuning task run through ``Engine.run``.

A job plugs in three things and the engine owns everything else:

- a model (any ``nn.Module``; the engine moves it to the device, wraps it in DDP under ``torchrun``
  and ``torch.compile``s it when asked);
- an ``Objective``: the summed losses of one micro-batch, keyed by the name of their normaliser
  (``{"mlm": Σ token CE, "nsp": Σ sequence CE}`` for pretraining, ``{"loss": Σ CE}`` for a task),
  plus counters for the log (correct predictions), and how a log window turns into a record;
- an iterator of ``StepBatch``es: one optimizer step's micro-batches for this rank, with this
  rank's count of each normaliser (masked tokens, sequences, labelled tokens).

What the engine does for every job, in one place:

- precision: bf16 autocast (GPU default), fp16 autocast with dynamic loss scaling, or fp32;
- CUDA graphs (``cuda_graphs``, not fp16): each step replays as one graph per batch shape
  (``bertctl.train.graphs``), the same maths and dropout masks as the eager step; under torchrun the
  graph holds the gradient all-reduce too (one flat gradient buffer instead of DDP's hooks);
- gradient accumulation: ``StepBatch.micro`` holds ``batch_size / (world_size · micro_batch_size)``
  micro-batches; each loss term is its sum divided by its count over the *global* batch (all ranks,
  all micro-batches), so N processes × k micro-batches compute exactly the one-process, one-batch
  loss and gradient (DDP averages gradients over ranks, hence the factor ``world_size``);
- AdamW or LAMB, warm-up then linear/cosine/constant decay, gradient clipping;
- exact resume: every step reseeds torch from (seed, step, rank), so the dropout masks after a
  resume are the ones the uninterrupted run drew; a checkpoint holds model, optimizer, scheduler,
  loss scaler, step, every rank's RNG states and whatever the job adds (data position, history);
- one checkpoint format (``bertctl.checkpoints.training``: ``OUT/checkpoints/step-N/``, written atomically);
- one metrics writer (``MetricsLog``, JSON lines) and one progress bar; no host sync per step
  (running sums stay on the device until a log line is due);
- SIGINT/SIGTERM (``StopSignal``): the first says at once what will happen and finishes the step, then
  the job checkpoints and exits cleanly; a second SIGINT aborts within a second (previous checkpoint
  intact), or once the checkpoint being written is complete, and says what is kept.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from bertctl import faults
from bertctl.checkpoints import training
from bertctl.data.batching import StepBatch
from bertctl.errors import BertctlError
from bertctl.progress import MetricsLog, progress
from bertctl.config import TrainConfig
from bertctl.runtime import Runtime, graphs_unsupported
from bertctl.train import distributed
from bertctl.train.graphs import StepGraphs
from bertctl.train.optim import build_optimizer, build_scheduler


class Objective(Protocol):
    loss_terms: tuple[str, ...]  # normaliser names; each is a key of ``sums`` and of StepBatch.counts
    stat_names: tuple[str, ...]  # extra counters summed over a log window (e.g. correct predictions)

    def sums(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward one micro-batch: {term: summed loss (fp32 scalar)} and {stat: count}."""

    def record(self, sums: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
        """A log record from a window's summed terms/stats and counts (ranks already summed)."""

    def info(self, rec: dict) -> str:
        """The progress line's text for a log record."""


def autocast(precision: str, device: torch.device, cache: bool = True):
    """The autocast context of a resolved precision (fp32: none); ``cache=False`` casts the weights at
    every use (under CUDA-graph capture, where the cast copies must not outlive the capture)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16,
                          cache_enabled=cache)


def step_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible torch seed for (run seed, optimizer step, rank)."""
    h = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def seed_step(seed: int, device: torch.device) -> None:
    """What ``torch.manual_seed(seed)`` does to the generators a training process draws from (the CPU's
    and, on a GPU, CUDA's), without its seeding of backends this process never uses, which formats the
    stack at every call: a cost of the order of a step replayed from a CUDA graph."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def to_device(micro: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in micro.items()}


# --------------------------------------------------------------------------- signals


class Interrupted(BaseException):
    """SIGINT/SIGTERM during a phase that stops at once (preparation, evaluation): raised in the main thread.

    A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` in the phase swallows it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal = signal_name


class StopSignal:
    """SIGINT/SIGTERM for a whole run: what a first signal does depends on the phase, a second SIGINT aborts.

    - a training step (the default phase): finish the step, then the job checkpoints and exits cleanly;
    - a phase entered with ``phase(..., at_once=True)`` (preparation, evaluation): ``Interrupted`` is raised in
      the main thread at once (the phase's work is abandoned; what was complete before it is kept);
    - a write (``writing()``: a checkpoint or the final model) is never cut by the first signal, and a second
      SIGINT during one aborts as soon as it is complete, so a second Ctrl-C never leaves a torn state.

    The handlers run in the main thread only between Python bytecodes, which on a CPU can be minutes into a
    step; so the C-level handler also writes to a wake-up socket that a watcher thread reads at once: it says
    what will happen and, on the second SIGINT, ends the process (exit 130) saying what is kept (``kept()``).
    """

    def __init__(self, what_next: Callable[[], str] | None = None, kept: Callable[[], str] | None = None):
        self.requested: str | None = None
        self._what_next = what_next or (lambda: "stopping")
        self.kept = kept or (lambda: "the last complete checkpoint is kept")
        self.at_once = False
        self._raised = False
        self._announced = False
        self._writing = 0
        self._abort_after_write = False
        self._lock = threading.Lock()
        self._old: dict = {}
        self._old_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None
        self._closed = False
        self._depth = 0

    def __enter__(self):
        self._depth += 1
        if self._depth > 1 or threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        read, write = socket.socketpair()
        read.setblocking(True)
        write.setblocking(False)
        self._sockets = (read, write)
        self._old_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        return self

    @contextlib.contextmanager
    def phase(self, what_next: Callable[[], str], at_once: bool = False):
        """Within the block a first signal is announced with ``what_next()``; with ``at_once`` it raises
        ``Interrupted`` (at once if one came before the block)."""
        saved = self._what_next, self.at_once
        self._what_next, self.at_once = what_next, at_once
        try:
            if at_once:
                self._raise_pending()
            yield self
        finally:
            self._what_next, self.at_once = saved

    @contextlib.contextmanager
    def writing(self):
        """A write that no signal cuts: a first one is acted on after it (``Interrupted`` in an at-once phase),
        and a second SIGINT aborts once it is complete. Safe to enter from the checkpoint writer's thread."""
        main = threading.current_thread() is threading.main_thread()
        saved = self.at_once
        with self._lock:
            self._writing += 1
            if main:
                self.at_once = False
        try:
            yield self
        finally:
            with self._lock:
                self._writing -= 1
                if main:
                    self.at_once = saved
                abort = self._abort_after_write and self._writing == 0
            if abort:
                sys.stderr.write(f"write complete: aborting now; {self.kept()}\n")
                sys.stderr.flush()
                os._exit(130)
            if main and saved:
                self._raise_pending()

    def _raise_pending(self) -> None:
        if self.requested is not None and not self._raised:
            self._raised = True
            raise Interrupted(self.requested)

    def what_next(self) -> str:
        return self._what_next()

    def _handle(self, signum, frame):  # main thread; the watcher has usually reacted already
        if self.requested is None:
            self.requested = signal.Signals(signum).name
        self._announce(signal.Signals(signum).name)
        if self.at_once and not self._writing:
            self._raise_pending()

    def _announce(self, name: str) -> None:
        """Say once, from whichever thread sees the first signal first, what it will do."""
        with self._lock:
            if self._announced:
                return
            self._announced = True
        again = "once the write in progress is complete" if self._writing else "at once"
        sys.stderr.write(f"\n{name}: {self._what_next()} (Ctrl-C again to abort {again})\n")
        sys.stderr.flush()

    def _watch(self) -> None:
        read = self._sockets[0]
        interrupts = 0
        while True:
            try:
                data = read.recv(64)
            except OSError:
                return
            if not data or self._closed:
                return
            for signum in data:
                if signum not in (signal.SIGINT, signal.SIGTERM):
                    continue
                name = signal.Signals(signum).name
                if self.requested is None:
                    self.requested = name
                interrupts += signum == signal.SIGINT
                if interrupts >= 2:
                    with self._lock:
                        if self._writing:
                            self._abort_after_write = True
                    if self._abort_after_write:
                        sys.stderr.write("\nsecond interrupt: aborting once the write in progress is complete\n")
                        sys.stderr.flush()
                        continue
                    sys.stderr.write(f"\nsecond interrupt: aborting now; {self.kept()}\n")
                    sys.stderr.flush()
                    os._exit(130)
                self._announce(name)

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth > 0 or self._sockets is None:
            return
        self._closed = True
        signal.set_wakeup_fd(self._old_fd)
        self._sockets[1].close()
        self._sockets[0].close()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._sockets = None


# --------------------------------------------------------------------------- the engine


@dataclass
class RunResult:
    steps: int
    start_step: int
    stopped: str | None            # None (finished), "time limit", or the signal's name
    train_seconds: float           # training steps only (evaluation and checkpoints excluded)
    sequences: int                 # sequences (examples) trained on, all ranks
    last_record: dict = field(default_factory=dict)


class Engine:
    """Build optimizer, scheduler, scaler and the DDP/compiled step model around ``model``."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, model: torch.nn.Module, objective: Objective, *,
                 dist: distributed.Dist, max_steps: int, run_dir: str | Path | None = None,
                 log: MetricsLog | None = None, flops: Callable[[dict], float] | None = None,
                 compile_dynamic: bool | None = None, description: str = "train"):
        """``cfg`` as the job gives it; ``max_steps``: the job's plan (its own count of an epoch, or
        ``cfg.max_steps``), which a time-boxed run re-plans; ``compile_dynamic``: ``torch.compile``'s
        ``dynamic`` (True for fine-tuning's varied shapes)."""
        self.cfg, self.runtime, self.objective, self.dist = cfg, runtime, objective, dist
        self.max_steps = max_steps
        self.description = description
        self.device = dist.device
        self.run_dir = Path(run_dir) if run_dir is not None else None  # where checkpoints go
        self.precision = runtime.precision
        self.reduce_dtype = distributed.REDUCE_DTYPES[distributed.ddp_options().get("reduce", "fp32")]
        self.log = log or MetricsLog(None)
        self.flops = flops  # counts -> training FLOPs of a step (for TFLOP/s and MFU), optional
        self.model = model.to(self.device)
        if runtime.cuda_graphs:  # the model's own attention, whatever built it, must fit the graphs too
            why = graphs_unsupported(device_type=self.device.type, precision=self.precision, optimizer=cfg.optimizer,
                                     compile=runtime.compile)
            if why:
                raise BertctlError(f"--cuda-graphs: {why}")
        self.optimizer = build_optimizer(self.model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         betas=tuple(cfg.betas), eps=cfg.adam_eps, capturable=runtime.cuda_graphs)
        self.warmup_steps = warmup_steps(max_steps, cfg.warmup_steps, cfg.warmup_fraction)
        self.scheduler = build_scheduler(self.optimizer, self.warmup_steps, max_steps, cfg.schedule)
        self.graphs = None
        self._flat_grad: torch.Tensor | None = None  # several processes under graphs: the all-reduced gradients
        if runtime.cuda_graphs:
            self._lr_to_tensors()
            self.graphs = StepGraphs(self._graph_body, self._graph_state, self.device)
            self._graph_stats: torch.Tensor | None = None
            self._graph_loss = torch.zeros((), device=self.device)
            self._graph_scales = torch.zeros(len(objective.loss_terms), device=self.device)
            self._host_scales = True  # the captured step reads its loss scales from _graph_scales
            if dist.enabled:
                self._graph_counts = torch.zeros(len(objective.loss_terms), device=self.device)
                self._flat_grad = distributed.flat_gradients(self.model)
                self._reducer = distributed.GradientReducer(
                    self.model, self._flat_grad, dist, bucket_mb=distributed.ddp_options().get("bucket_mb", 25.0),
                    reduce_dtype=self.reduce_dtype)
                distributed.broadcast_parameters(self.model, dist)  # what DDP does when it wraps
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.step = 0
        step_model = self.model
        self.ddp = None
        if dist.enabled and self._flat_grad is None:
            step_model = self.ddp = distributed.wrap_ddp(self.model, self.device, self.reduce_dtype)
        if runtime.compile:
            step_model = torch.compile(step_model, dynamic=compile_dynamic)
        self.step_model = step_model
        self._last_save = time.monotonic()
        self._writer = training.CheckpointWriter()  # mid-run checkpoints go to disk in the background
        self.stop: StopSignal | None = None  # the run's signal handling: writes are guarded by it

    def kept(self) -> str:
        """What the run folder holds now, for a message after an abort: its newest complete checkpoint."""
        last = training.latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        if last is None:
            return "no checkpoint was written yet, so nothing is kept (a rerun starts from the beginning)"
        return f"the checkpoint at step {last.step} ({last.path}) is kept: --resume continues from it"

    # ----------------------------------------------------------------- CUDA graphs

    def _lr_to_tensors(self) -> None:
        """The captured AdamW reads its lr from a device tensor that the scheduler fills in place."""
        for group in self.optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)

    def _graph_state(self) -> list[torch.Tensor]:
        """Every tensor a step mutates: parameters, gradients, optimizer state, running sums."""
        out = []
        for p in self.model.parameters():
            out.append(p.data)
            if p.grad is not None:
                out.append(p.grad)
        for st in self.optimizer.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        out += [self._graph_stats, self._graph_loss]
        return out

    def _graph_body(self, inputs: list[dict[str, torch.Tensor]]) -> None:
        """The step that the graphs capture: ``_step`` on static tensors, its results in tensors
        allocated outside the graph. ``inputs``: the micro-batches, then, where several processes know
        them, ``{"every_ids": ...}`` for the reducer. The loss scales come from the host
        (``_host_scales``: one process, or several that know the global counts); else each loss term's
        normaliser is summed over ranks here, as the eager step does (a copy: the input buffer must
        hold this rank's counts at every replay). The reducer sums gradients: the scales are
        1 / (global count), no world size."""
        self._graph_loss.zero_()
        every_ids = None
        if inputs and "every_ids" in inputs[-1]:
            every_ids, inputs = inputs[-1]["every_ids"], inputs[:-1]
        if self._host_scales:
            scales = self._graph_scales.unbind()
        else:
            counts = distributed.all_reduce_sum(self._graph_counts.clone(), self.dist)
            scales = (1.0 / counts.clamp(min=1.0)).unbind()
        self._step(inputs, scales, self._graph_stats, self._graph_loss, every_ids)

    # ----------------------------------------------------------------- one step

    def train_step(self, sb: StepBatch, stats: torch.Tensor) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the step's loss (device scalar).

        ``stats`` (device, fp32) accumulates the objective's loss terms then its stats, in order.
        Nothing here waits for the GPU: the normalisers are host numbers (one process) or an
        asynchronous all-reduce (several). With CUDA graphs the step replays from its graph.
        """
        terms = self.objective.loss_terms
        W = self.dist.world_size
        if self.graphs is not None:
            if stats is not self._graph_stats:  # a new run's running sums: graphs write to fixed tensors
                self.graphs.clear()
                self._graph_stats = stats
            if not isinstance(self.optimizer.param_groups[0]["lr"], torch.Tensor):
                # The param groups were replaced from outside (pretraining's --keep-optimizer sets a new
                # phase's lr): a float lr would be baked into the next capture, freezing the schedule.
                self._lr_to_tensors()
                self.graphs.clear()
            self._host_scales = self._flat_grad is None or sb.global_counts is not None
            if self._host_scales:
                counts = sb.counts if self._flat_grad is None else sb.global_counts
                scales = [1.0 / max(counts[t], 1.0) for t in terms]
                self._graph_scales.copy_(torch.tensor(scales, dtype=torch.float32, pin_memory=True), non_blocking=True)
            else:
                counts = [sb.counts[t] for t in terms]
                self._graph_counts.copy_(torch.tensor(counts, dtype=torch.float32, pin_memory=True), non_blocking=True)
            inputs = sb.micro
            if self._flat_grad is not None and sb.every_ids is not None:
                inputs = [*sb.micro, {"every_ids": sb.every_ids}]
            capture = sb.shape_steps is None or sb.shape_steps >= self.cfg.graph_min_steps
            if self.graphs.step(inputs, (sb.signature, self._host_scales), capture=capture):
                self.scheduler.step()
                return self._graph_loss
            # a shape too rare to be worth a capture, or past the graph budget: the same step, eagerly
            self._graph_body([to_device(m, self.device) for m in inputs])
            self.scheduler.step()
            return self._graph_loss
        micro = [to_device(m, self.device) for m in sb.micro]
        if self.dist.enabled and sb.global_counts is not None:
            scales = [W / max(sb.global_counts[t], 1.0) for t in terms]
        elif self.dist.enabled:
            # Pinned and non-blocking: a copy from pageable memory would make the host wait for the
            # GPU to finish the previous step, every step.
            counts = torch.tensor([sb.counts[t] for t in terms], dtype=torch.float32,
                                  pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
            distributed.all_reduce_sum(counts, self.dist)
            scales = [W / c for c in counts.clamp(min=1.0).unbind()]
        else:
            scales = [1.0 / max(sb.counts[t], 1.0) for t in terms]
        step_loss = torch.zeros((), device=self.device)
        self._step(micro, scales, stats, step_loss)
        self.scheduler.step()
        return step_loss

    def _step(self, micro: list[dict[str, torch.Tensor]], scales, stats: torch.Tensor,
              step_loss: torch.Tensor, every_ids: torch.Tensor | None = None) -> None:
        """Forward and backward over the micro-batches, clipping, the optimizer step, gradients zeroed.

        ``scales`` holds each loss term's world size / (its global count) where DDP averages the
        gradients over ranks, else 1 / (its global count) (floats, or device scalars under graphs);
        the step's loss is added to ``step_loss`` and the terms and stats to ``stats``. Under graphs
        nothing here may wait for the host: the scaler is off (no fp16) and DDP absent (several
        processes sum the flat gradient buffer through ``distributed.GradientReducer`` instead:
        buckets that backward starts, as DDP's; ``every_ids`` gives it the embedding rows).
        """
        terms = self.objective.loss_terms
        W = self.dist.world_size if self.ddp is not None else 1  # what the scales multiply the loss by
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            if last and self._flat_grad is not None:
                self._reducer.arm()  # the last backward starts the buckets' all-reduces
            sync = contextlib.nullcontext() if (last or self.ddp is None) else self.ddp.no_sync()
            with sync:
                # captured, autocast must not keep weight casts past the capture
                with autocast(self.precision, self.device, cache=self.graphs is None):
                    s = self.objective.sums(self.step_model, mb)
                loss = sum(s[t] * scale for t, scale in zip(terms, scales))
                self.scaler.scale(loss).backward()
            with torch.no_grad():
                step_loss += loss.detach() / W
                stats += torch.stack([s[k].detach().float() for k in (*terms, *self.objective.stat_names)])
        if self._flat_grad is not None:
            self._reducer.finish(every_ids)
        if self.cfg.max_grad_norm and self.cfg.optimizer != "lamb":  # LAMB normalises by the global norm itself
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # Gradients go at the end of every step, so the next backward writes them rather than adding to zeros
        # (under graphs, a whole pass over the weights less); several processes under graphs keep theirs in the
        # reducer's flat buffer, which must stay.
        self.optimizer.zero_grad(set_to_none=self._flat_grad is None)

    # ----------------------------------------------------------------- checkpoints

    def save(self, extra: dict, meta: dict | None = None, reason: str = "periodic", wait: bool = True) -> Path | None:
        """Checkpoint model, optimizer, scheduler, scaler, step, every rank's RNG and ``extra``.

        With ``wait`` False (mid-run checkpoints) the state is snapshot to host memory and written in
        the background while training goes on (``training.CheckpointWriter``); ``wait_for_checkpoints``,
        the next save and the end of ``run`` wait for it. The ``checkpoint`` event is logged once the
        checkpoint is complete."""
        rngs = distributed.gather_to_main(training.capture_rng(), self.dist)
        path = None
        if self.dist.is_main:
            blob = {"model": self.model.state_dict(), "optimizer": _plain_lr(self.optimizer.state_dict()),
                    "scheduler": _plain_last_lr(self.scheduler.state_dict()), "scaler": self.scaler.state_dict(),
                    "step": self.step, "rng": rngs, **extra}
            info = {"step": self.step, "reason": reason, "world_size": self.dist.world_size, **(meta or {})}
            step = self.step
            path = self._writer.submit(self.run_dir, step, blob, info, keep=self.cfg.keep, done=lambda p: self.log.log(
                event="checkpoint", step=step, path=str(p), reason=reason),
                guard=self.stop.writing if self.stop is not None else None)
            if wait:
                self._writer.wait()
        distributed.barrier(self.dist)
        self._last_save = time.monotonic()
        return path

    def wait_for_checkpoints(self) -> None:
        """Return once a checkpoint being written in the background is complete (raising its error)."""
        self._writer.wait()

    def restore(self, blob: dict) -> None:
        """Continue from a checkpoint blob (``training.load_checkpoint``)."""
        self.model.load_state_dict(blob["model"])
        load_optimizer_state(self.optimizer, blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        if self.graphs is not None:  # new optimizer state tensors: capture again
            self._lr_to_tensors()
            self.graphs.clear()
        if blob.get("scaler"):
            self.scaler.load_state_dict(blob["scaler"])
        self.step = int(blob["step"])
        if self.cfg.fit_to_minutes:  # a re-planned run continues with its plan
            self.max_steps = self.scheduler.lr_lambdas[0].total
        rngs = blob.get("rng") or []
        if self.dist.rank < len(rngs):
            training.restore_rng(rngs[self.dist.rank])

    # ----------------------------------------------------------------- the loop

    def run(self, batches: Iterator[StepBatch], *, after_step: Callable[[int], None] | None = None,
            checkpoint: Callable[[str], Any] | None = None, on_interrupt: str = "then saving",
            stop: StopSignal | None = None) -> RunResult:
        """Train from ``self.step`` to ``self.max_steps`` (or a stop request / the time box).

        ``after_step(step)`` runs after every step (evaluation when due; its time is not training
        time); ``checkpoint(reason)`` saves (periodic saves and on a stop request). Returns how the
        run ended, with any checkpoint written in the background complete; the caller does the final
        save, evaluation and export. ``stop``: the job's signal handling when it spans more than the
        steps (a request made before the first step stops the run there); else the run's own.
        """
        try:
            result = self._run(batches, after_step, checkpoint, on_interrupt, stop)
        except KeyboardInterrupt:  # a second Ctrl-C: out at once (a half-written checkpoint stays a .tmp folder)
            raise
        except BaseException:
            with contextlib.suppress(Exception):  # the checkpoint being written completes: resume starts there
                self._writer.wait()
            raise
        self._writer.wait()
        return result

    def _run(self, batches: Iterator[StepBatch], after_step: Callable[[int], None] | None,
             checkpoint: Callable[[str], Any] | None, on_interrupt: str, stop: StopSignal | None) -> RunResult:
        cfg = self.cfg
        n_stats = len(self.objective.loss_terms) + len(self.objective.stat_names)
        stats = torch.zeros(n_stats, device=self.device)
        bad = torch.zeros((), dtype=torch.int32, device=self.device)
        window = _Window()
        t_start = time.monotonic()
        start_step = self.step
        train_seconds = 0.0
        sequences = 0
        record: dict = {}
        stop_reason = None
        pace_from = None  # (step, time) from which the time-boxed plan measures the pace
        log_every = max(1, cfg.log_every)
        sync_every = log_every if self.dist.enabled else 1
        bar = progress(disable=not (self.dist.is_main and cfg.show_progress))
        in_step = False

        def what_next() -> str:  # true at the moment the signal comes: inside a step, or between two
            return (f"finishing step {self.step + 1}, {on_interrupt}" if in_step else
                    f"stopping at step {self.step}, {on_interrupt}")

        stop = stop if stop is not None else StopSignal(kept=self.kept)
        self.stop = stop
        with stop, stop.phase(what_next), bar:
            task = bar.add_task(self.description, total=self.max_steps, completed=self.step, info="")
            t_window = time.perf_counter()
            while self.step < self.max_steps:
                if stop.requested is not None:  # asked between steps (before the first, or during an evaluation)
                    stop_reason = stop.requested
                    break
                try:
                    sb = next(batches)
                except StopIteration:
                    break
                seed_step(step_seed(cfg.seed, self.step, self.dist.rank), self.device)
                in_step = True
                faults.point("step")
                try:
                    loss = self.train_step(sb, stats)
                except torch.OutOfMemoryError:
                    raise BertctlError(self._out_of_memory(sb)) from None
                bad += (~torch.isfinite(loss)).int()
                self.step += 1
                in_step = False
                sequences += sb.sequences
                window.add(sb.counts, self.flops(sb.counts) if self.flops else 0.0)
                bar.update(task, completed=self.step)
                want_stop = stop.requested is not None or (
                    cfg.minutes is not None and time.monotonic() - t_start >= cfg.minutes * 60)
                want_save = cfg.save_minutes is not None and time.monotonic() - self._last_save >= cfg.save_minutes * 60
                if not self.dist.enabled:
                    pass  # one process decides alone: no collective, no host sync
                elif self.step % sync_every == 0 or self.step == self.max_steps:
                    flags = torch.tensor([float(want_stop), float(want_save)], device=self.device)
                    distributed.all_reduce_sum(flags, self.dist)
                    want_stop, want_save = bool(flags[0] > 0), bool(flags[1] > 0)
                else:
                    want_stop = want_save = False
                if self.step % log_every == 0 or self.step == self.max_steps or want_stop:
                    now = time.perf_counter()
                    train_seconds += now - t_window
                    rec = self._log_window(stats, window, now - t_window)
                    t_window = now
                    if rec:
                        record = rec
                        if cfg.fit_to_minutes and cfg.minutes is not None:
                            if pace_from is None:  # the first window holds compilation and warm-up: not the pace
                                pace_from = (self.step, time.monotonic())
                            else:
                                self._replan(self.step - pace_from[0], time.monotonic() - pace_from[1],
                                             time.monotonic() - t_start, task, bar)
                        bar.update(task, info=self.objective.info(rec))
                paused = time.perf_counter()
                if after_step is not None:
                    after_step(self.step)
                if want_stop:
                    stop_reason = stop.requested or "time limit"
                    break
                if checkpoint is not None and ((cfg.save_every and self.step % cfg.save_every == 0) or want_save) \
                        and self.step < self.max_steps:
                    self.check_finite(bad)
                    checkpoint("periodic")
                t_window += time.perf_counter() - paused  # evaluation and checkpoints are not training time
        if window.steps:
            now = time.perf_counter()
            train_seconds += now - t_window
            record = self._log_window(stats, window, now - t_window) or record
        self.bad = bad
        if self.graphs is not None:
            self.log.log(event="cuda_graphs", step=self.step, **self.graphs.summary())
        self.check_finite()
        total = torch.tensor([float(sequences)], dtype=torch.float64, device=self.device)
        distributed.all_reduce_sum(total, self.dist)
        return RunResult(self.step, start_step, stop_reason, train_seconds, int(total.item()), record)

    def _out_of_memory(self, sb: StepBatch) -> str:
        """The one line for a training step that ran out of device memory: the micro-batch that did not
        fit and the flag that makes it smaller (accumulation keeps the optimizer step the same)."""
        ids = sb.micro[0].get("input_ids") if sb.micro else None
        rows = int(ids.shape[0]) if ids is not None else 0
        shape = f"{rows} rows of {ids.shape[-1]} tokens" if ids is not None else "one micro-batch"
        total = ""
        if self.device.type == "cuda":
            total = f" ({torch.cuda.get_device_properties(self.device).total_memory / 2**30:.0f} GiB)"
        fix = (f"pass --micro-batch-size {max(1, rows // 2)}: gradients accumulate to the same --batch-size "
               f"{self.cfg.batch_size}, the same optimizer step" if rows > 1 else
               "a smaller model, --max-seq-length or --precision bf16 may fit")
        with contextlib.suppress(Exception):  # a checkpoint being written: complete it, and name it
            self._writer.wait()
        last = training.latest_checkpoint(self.run_dir) if self.run_dir else None
        resume = f"; --resume continues from {last.path}" if last else ""
        return (f"out of {self.device.type.upper()} memory at step {self.step + 1}: {shape} per forward did not fit "
                f"on {self.device}{total} beside the model and its optimizer; {fix}{resume}")

    def _replan(self, steps_done: int, seconds: float, elapsed: float, task, bar) -> None:
        """Fit the remaining steps to the time left at the run's own pace (``steps_done`` in
        ``seconds`` since the first log line, evaluations and checkpoints included), aiming at 85% of
        the time left: re-planned at every log line, the run ends a little early rather than cut off
        when the pace drops.

        The lr keeps its current value and decays linearly to 0 at the new last step, so a run whose
        steps got slower (a busy machine) still completes its schedule instead of stopping mid-decay.
        """
        if self.step >= self.max_steps:  # the schedule is complete: nothing to stretch
            return
        rate = steps_done / max(seconds, 1e-9)  # steps per second, everything included
        left = self.cfg.minutes * 60 - elapsed
        total = self.step + max(1, int(0.85 * left * rate))
        if abs(total - self.max_steps) < max(2.0, 0.1 * (self.max_steps - self.step)):
            return
        self.scheduler.lr_lambdas[0].replan(self.step, total)
        self.log.log(event="replan", step=self.step, max_steps=total, previous=self.max_steps,
                     steps_per_s=rate)
        self.max_steps = total
        bar.update(task, total=total)

    def check_finite(self, bad: torch.Tensor | None = None) -> None:
        """Stop with a clear message if any step's loss was not finite (fp16: the scaler skips those)."""
        if self.precision == "fp16":
            return
        n_bad = torch.zeros(1, device=self.device) + (self.bad if bad is None else bad)
        distributed.all_reduce_sum(n_bad, self.dist)
        if n_bad.item() > 0:
            last = training.latest_checkpoint(self.run_dir) if self.run_dir else None
            where = f"; the last good checkpoint is {last.path}" if last else ""
            raise BertctlError(f"non-finite loss by step {self.step}: stopped without saving{where} "
                               f"(lower --lr, or use --precision fp16 with loss scaling)")

    def _log_window(self, stats: torch.Tensor, window: "_Window", seconds: float) -> dict:
        keys = list(window.counts)
        host = torch.tensor([window.counts[k] for k in keys] + [window.flops], dtype=torch.float64)
        if self.dist.enabled:  # ranks hold different counts
            s = torch.cat([stats.double(), host.to(self.device)])
            distributed.all_reduce_sum(s, self.dist)
        else:
            s = torch.cat([stats.double().cpu(), host])
        values = s.tolist()  # the one host sync per log window
        stats.zero_()
        names = (*self.objective.loss_terms, *self.objective.stat_names)
        sums = dict(zip(names, values[: len(names)]))
        counts = dict(zip(keys, values[len(names):len(names) + len(keys)]))
        flops = values[-1]
        window.reset()
        if not counts.get("sequences"):
            return {}
        dt = max(seconds, 1e-9)
        rec = {"step": self.step, **self.objective.record(sums, counts), "lr": float(self.scheduler.get_last_lr()[0]),
               "seq_per_s": counts["sequences"] / dt, "tokens_per_s": counts.get("tokens", 0.0) / dt}
        if self.flops:
            from bertctl.train.metrics import peak_flops

            rec["tflops"] = flops / dt / 1e12
            peak = peak_flops(self.device)
            if peak:
                rec["mfu"] = flops / dt / peak / self.dist.world_size
        if self.scaler.is_enabled():
            rec["loss_scale"] = self.scaler.get_scale()
        self.log.log(event="train", **rec)
        return rec


#: How an optimizer runs, not what it learnt: a load keeps the live optimizer's.
_IMPLEMENTATION_KEYS = ("capturable", "fused", "foreach")


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Optimizer state saved in any step mode or on any device: each group keeps the live optimizer's
    ``capturable``, ``fused`` and ``foreach`` (``load_state_dict`` would take the saved ones, and they
    decide where AdamW's step counts go: on the device for CUDA graphs and the fused step)."""
    groups = [{**g, **{k: live[k] for k in _IMPLEMENTATION_KEYS if k in live}}
              for g, live in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})


def _plain_lr(opt_state: dict) -> dict:
    """An optimizer state dict with float learning rates (the CUDA-graph step keeps them as device
    tensors): one checkpoint format, whichever way the step ran."""
    for group in opt_state["param_groups"]:
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), torch.Tensor):
                group[key] = float(group[key])
    return opt_state


def _plain_last_lr(sched_state: dict) -> dict:
    sched_state["_last_lr"] = [float(v) for v in sched_state.get("_last_lr", [])]
    return sched_state


class _Window:
    """Host-side counts of the steps since the last log line (this rank's)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts: dict[str, float] = {}
        self.flops = 0.0
        self.steps = 0

    def add(self, counts: dict[str, float], flops: float) -> None:
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + float(v)
        self.flops += flops
        self.steps += 1


def warmup_steps(max_steps: int, warmup_steps: int | None, warmup_fraction: float) -> int:
    """Explicit warm-up steps, else the fraction of the run (rounded up, as Hugging Face does)."""
    if warmup_steps is not None:
        return warmup_steps
    return math.ceil(warmup_fraction * max_steps)
