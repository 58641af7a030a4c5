"""A prefetching loader: a background thread cuts, trims and pins batches ahead of the GPU.

The thread runs the data set's deterministic iterator (so the batches and their
order do not depend on timing), splits each rank batch into micro-batches for
gradient accumulation, trims each micro-batch to its longest sequence, counts
the work in it (tokens, masked predictions, for throughput and FLOPs), and pins
it.  The training thread then copies with ``non_blocking=True``, which overlaps
the host-to-device copy with the previous step's kernels.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from bertctl.train.metrics import batch_counts

KEYS = ("input_ids", "token_type_ids", "attention_mask", "masked_positions", "masked_lm_labels", "next_sentence_label")


@dataclass
class StepBatch:
    """One optimizer step's data for this rank: micro-batches plus counts (host numbers)."""

    micro: list[dict[str, torch.Tensor]]
    tokens: float          # real tokens
    attn_pairs: float      # Σ length²
    masked: float          # masked predictions with a label
    sequences: int
    padded_tokens: float   # B·S actually computed (with the padding left after trimming)


def trim(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Cut the sequence dim to the longest sequence, rounded up to ``multiple`` (tensor-core shapes)."""
    s = batch["input_ids"].shape[1]
    longest = int(batch["attention_mask"].sum(dim=1).max())
    keep = min(s, max(multiple, -(-longest // multiple) * multiple))
    if keep == s:
        return batch
    out = dict(batch)
    for k in ("input_ids", "token_type_ids", "attention_mask"):
        out[k] = batch[k][:, :keep].contiguous()
    return out


def split(batch: dict[str, torch.Tensor], micro_batch_size: int, multiple: int) -> StepBatch:
    b = batch["input_ids"].shape[0]
    micro = []
    for start in range(0, b, micro_batch_size):
        mb = {k: batch[k][start:start + micro_batch_size] for k in KEYS}
        micro.append(trim(mb, multiple) if multiple else mb)
    tokens, pairs, masked, seqs = batch_counts(batch)
    padded = float(sum(m["input_ids"].numel() for m in micro))
    return StepBatch(micro, tokens, pairs, masked, int(seqs), padded)


class Prefetcher:
    """Iterate ``StepBatch``es produced ``depth`` steps ahead by a daemon thread."""

    def __init__(self, batches: Iterable[dict], micro_batch_size: int, *, multiple: int = 8,
                 pin: bool = False, depth: int = 4):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(iter(batches), micro_batch_size, multiple, pin), daemon=True)
        self._thread.start()

    def _work(self, it: Iterator[dict], micro: int, multiple: int, pin: bool) -> None:
        try:
            for batch in it:
                if self._stop.is_set():
                    return
                sb = split(batch, micro, multiple)
                if pin:
                    sb.micro = [{k: v.pin_memory() for k, v in m.items()} for m in sb.micro]
                while not self._stop.is_set():
                    try:
                        self._q.put(sb, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            self._q.put(None)
        except BaseException as e:  # hand the error to the consumer
            self._q.put(e)

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        item = self._q.get()
        if item is None:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=5)


def bucketed_batches(data, global_batch_size: int, *, seed: int, epoch: int = 0, start_step: int = 0,
                     rank: int = 0, world_size: int = 1, window: int = 64) -> Iterator[dict[str, torch.Tensor]]:
    """One epoch in length-bucketed order: less padding when lengths vary.

    The epoch's permutation (the loader's, from (seed, epoch)) is cut into windows of
    ``window`` global batches; inside a window the instances are sorted by length and cut
    into global batches, whose order is then shuffled from (seed, epoch, window start).
    Every instance is still seen once an epoch; rank r takes the r-th slice of each global
    batch, and ``start_step`` seeks exactly (a window is recomputed, never replayed).
    """
    perm = data.permutation(seed, epoch)
    steps = data.steps_per_epoch(global_batch_size)
    b = global_batch_size // world_size
    for w0 in range(start_step - start_step % window, steps, window):
        w1 = min(steps, w0 + window)
        idx = perm[w0 * global_batch_size:w1 * global_batch_size]
        lengths = np.asarray(data.records(idx)["length"])
        ordered = idx[np.argsort(lengths, kind="stable")].reshape(w1 - w0, global_batch_size)
        ordered = ordered[np.random.default_rng([seed, epoch, w0, 7]).permutation(w1 - w0)]
        for k in range(max(w0, start_step), w1):
            yield data.collate(ordered[k - w0][rank * b:(rank + 1) * b], seed=seed, epoch=epoch, trim=True)


def to_device(micro: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in micro.items()}
