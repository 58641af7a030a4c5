"""Whole-step CUDA graphs: one optimizer step (forward, backward, clipping, AdamW, zeroing) replayed
as a single graph launch.

Why: a fine-tuning step at batch 32 is bound by the host issuing its ~1,000 kernels; replayed from a
graph, the host issues one launch (``benchmarks/results/finetune-step-cudagraphs-h100.json``). So is
pretraining wherever a step's GPU work is short (``pretrain-step-modes-h100-*.json``).

How, and what stays exact:

- One graph per batch *shape* (every micro-batch's tensor shapes): fine-tuning batches are padded to
  their own longest row, so a task has a few dozen shapes. Each replay computes what the eager step
  computes on the same tensors, with the same dropout masks. A run that meets more than
  ``max_graphs`` shapes runs the rest eagerly, and so does a shape too rare to repay its capture:
  fine-tuning knows its whole run's batches in advance, so each step comes with the number of steps
  that share its shapes, and a shape with fewer than ``graph_min_steps`` runs eagerly
  (``finetune-graph-min-steps-h200-*.json``). Before that, the loader pads a batch whose length is
  that rare up to the next common length (``batching.common_lengths``), which attention and the
  losses mask: eager steps are bound by the host, and do not get faster with more GPUs.
- Inputs are copied into static buffers; the learning rate is a device tensor the scheduler fills
  in place; AdamW's moments and step counts live at fixed addresses, allocated before the first
  capture; everything the graph allocates comes from one shared memory pool and is dead when a
  replay ends (the graph writes its results into tensors allocated outside it), so any graph may
  replay after any other. The gradients are among those: the step drops them at its end, so each
  backward writes them afresh instead of adding to zeros.
- Dropout: each replay reads the CUDA generator's seed and offset at launch, so the engine's
  per-step reseeding (seed, step, rank) gives the masks of the eager step: resume stays exact.
- Capture needs the kernels' lazy set-up (cuBLAS workspaces, cuDNN attention plans) done first, so a
  new shape first runs one eager step on the capture stream; parameters, optimizer state, gradients,
  the running sums and the RNG are snapshotted before it and restored after, so that warm-up leaves
  no trace.

Several processes (torchrun): the graph holds the all-reduces too (NCCL collectives can be
captured), so DDP's hooks are not used: gradients live in one flat buffer that
``distributed.GradientReducer`` sums over ranks in buckets (the loss scales are 1 / the global count,
so a sum is the one-process gradient), and the loss normalisers are summed over ranks inside the
graph. NCCL requires that every rank captures, and replays, the same collectives at the same steps,
so the graph key is the *global* step's signature (every rank's shapes, known to every rank from the
global batch), not this rank's shapes alone: all ranks then hit, capture or fall back to eager at
the same steps.

What cannot be captured runs eagerly, and ``bertctl.runtime.graphs_unsupported`` says why: fp16 (its
loss scaler decides on the host whether to skip a step), LAMB (host-side step count),
``torch.compile`` (its own graphs) and the unpadded attention (data-dependent sizes).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from bertctl.errors import BertctlError

class StepGraphs:
    """Captures and replays ``body(static_micro)``, one graph per micro-batch shape signature.

    ``body`` runs one whole optimizer step on device tensors and writes its results into tensors
    allocated outside the graph (the engine's running sums); ``state_tensors()`` lists every tensor
    the step mutates (parameters, gradients, optimizer state, running sums), which the warm-up
    snapshot restores.
    """

    def __init__(self, body: Callable[[list[dict[str, torch.Tensor]]], None],
                 state_tensors: Callable[[], list[torch.Tensor]], device: torch.device, max_graphs: int = 128):
        self.body = body
        self.state_tensors = state_tensors
        self.device = device
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[dict[str, torch.Tensor]]]] = {}
        self.eager_shapes = 0  # steps run eagerly because max_graphs was reached
        self.rare_steps = 0  # steps run eagerly because their shape was too rare to capture
        self.capture_seconds = 0.0  # host time spent warming up and capturing (the price of each new shape)
        # capture_seconds' parts: the eager warm-up (the first one also sets up the process's kernels and
        # libraries), the recording, the instantiation
        self.phase_seconds = {"warmup": 0.0, "record": 0.0, "instantiate": 0.0}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def key(micro: list[dict[str, torch.Tensor]]) -> tuple:
        return tuple(tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(m.items())) for m in micro)

    def clear(self) -> None:
        """Forget every graph (after the step's tensors were replaced, e.g. an optimizer state load)."""
        self.graphs.clear()

    def step(self, micro: list[dict[str, torch.Tensor]], signature: tuple = (), capture: bool = True) -> bool:
        """Run one step from ``micro`` (host or device tensors) through its graph; False when the
        caller must run the step eagerly: a new shape with ``capture`` False (rare), or the graph
        budget spent. ``signature`` tells the global step apart where several processes must capture
        and replay together (``capture`` must then be the same on every rank)."""
        key = (self.key(micro), signature)
        entry = self.graphs.get(key)
        if entry is None:
            if not capture:
                self.rare_steps += 1
                return False
            if len(self.graphs) >= self.max_graphs:
                self.eager_shapes += 1
                return False
            try:
                entry = self._capture(micro)
            except torch.OutOfMemoryError:
                raise BertctlError(
                    "no GPU memory left to capture the training step as a CUDA graph (a capture briefly holds "
                    "a copy of the weights, gradients and optimizer state, about 4x the weights): rerun with "
                    "--no-cuda-graphs or a smaller --micro-batch-size; --resume continues from the last "
                    "checkpoint") from None
            self.graphs[key] = entry
        graph, static = entry
        for dst, src in zip(static, micro):
            for k, v in src.items():
                dst[k].copy_(v, non_blocking=True)
        graph.replay()
        return True

    def _capture(self, micro: list[dict[str, torch.Tensor]]):
        t0 = time.perf_counter()
        static = [{k: torch.empty(v.shape, dtype=v.dtype, device=self.device) for k, v in m.items()}
                  for m in micro]
        for dst, src in zip(static, micro):
            for k, v in src.items():
                dst[k].copy_(v, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        rng = torch.cuda.get_rng_state(self.device)
        cpu_rng = torch.get_rng_state()
        snapshot = [(t, t.clone()) for t in self.state_tensors()]
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.body(static)  # warm-up: lazy allocations and plans happen outside the capture
            # the warm-up may have created state (AdamW's moments on the first step): fresh is zero
            known = {t.data_ptr() for t, _ in snapshot}  # by storage: ``p.data`` is a new object per call
            for t in self.state_tensors():
                if t.data_ptr() not in known:
                    t.zero_()
            for t, saved in snapshot:
                t.copy_(saved)
            t1 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self.body(static)
                t2 = time.perf_counter()
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        del snapshot  # after the wait: the restoring copies on the capture stream read it
        t3 = time.perf_counter()
        self.phase_seconds["warmup"] += t1 - t0
        self.phase_seconds["record"] += t2 - t1
        self.phase_seconds["instantiate"] += t3 - t2
        torch.cuda.set_rng_state(rng, self.device)
        torch.set_rng_state(cpu_rng)
        self.capture_seconds += time.perf_counter() - t0
        return graph, static

    def summary(self) -> dict:
        return {"graphs": len(self.graphs), "capture_seconds": round(self.capture_seconds, 3),
                **{f"{k}_seconds": round(v, 3) for k, v in self.phase_seconds.items()},
                "eager_steps": self.eager_shapes, "rare_shape_steps": self.rare_steps}
