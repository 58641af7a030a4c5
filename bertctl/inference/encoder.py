"""The interface every embedding backend implements (``Encoder``), and the tokenised texts it takes.

A backend runs a whole job, not one batch: ``features`` receives every batch at once, so that each
backend keeps its own rhythm of host waits. The PyTorch backend leaves its pooled rows on the device
and copies many batches back at once; the native encoder queues its batches on the GPU and waits once
per chunk. A per-batch call returning host arrays would wait for the device at every batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from bertctl.inference.pooling import PoolingSpec

if TYPE_CHECKING:
    from bertctl.config import BertConfig


@dataclass(frozen=True)
class Tokens:
    """Texts tokenised: every id, text after text (``ids``, int64), and each text's length."""

    ids: np.ndarray  # (total,)
    lengths: np.ndarray  # (N,)

    @cached_property
    def starts(self) -> np.ndarray:
        """Where each text begins in ``ids``."""
        return np.cumsum(self.lengths) - self.lengths

    def packed(self, index: np.ndarray) -> np.ndarray:
        """The ids of texts ``index``, text after text: gathered at once, not sliced a text at a time."""
        counts = self.lengths[index]
        return self.ids[np.repeat(self.starts[index] - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())]

    def padded(self, index: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Texts ``index`` as one batch: (B, S) int64 ids, padded on the right with ``pad_id``, and the
        (B, S) int64 mask, 1 = real token; S is the longest of them."""
        lengths = self.lengths[index]
        mask = np.arange(int(lengths.max()))[None, :] < lengths[:, None]
        ids = np.full(mask.shape, pad_id, dtype=np.int64)
        ids[mask] = self.packed(index)
        return ids, mask.astype(np.int64)


class Encoder(Protocol):
    """A checkpoint's encoder under one backend: tokenised texts in, pooled float32 features out."""

    name: str  # the backend: "torch", "onnxruntime" or "native"
    config: BertConfig  # the checkpoint's
    device: str  # where it runs: "cpu", "cuda", "cuda:1"
    precision: str  # fp32, bf16 or fp16, as it computes

    def features(self, tokens: Tokens, batches: list[np.ndarray], spec: PoolingSpec, pad_id: int,
                 normalize: bool = False, advance: Callable[[int], None] | None = None) -> np.ndarray:
        """(N, ``spec.width``) float32, row i for text i, L2-normalised with ``normalize``: the texts run
        in ``batches`` (arrays of text indices, one forward pass each), ``advance(texts)`` called as
        they finish."""
        ...


def run_padded(tokens: Tokens, batches: list[np.ndarray], pad_id: int, forward, advance=None,
               copy_every: int = 32, copy_rows: int = 65536) -> np.ndarray:
    """The batches as padded (B, S) arrays through ``forward(ids, mask)``, which returns (B, D) features,
    on the host (numpy) or on a device (torch): those are copied to the host ``copy_every`` batches or
    ``copy_rows`` rows at a time (one wait for many batches; it bounds the device memory they hold).
    Returns (N, D) float32 in text order."""
    out: np.ndarray | None = None
    pending: list = []  # (indices, features) not yet in out
    held = 0

    def flush() -> None:
        nonlocal held
        for idx, feats in pending:
            out[idx] = feats if isinstance(feats, np.ndarray) else feats.cpu().numpy()
        pending.clear()
        held = 0

    for index in batches:
        feats = forward(*tokens.padded(index, pad_id))
        if out is None:
            out = np.empty((len(tokens.lengths), feats.shape[-1]), dtype=np.float32)
        pending.append((index, feats))
        held += len(index)
        if len(pending) >= copy_every or held >= copy_rows:
            flush()
        if advance is not None:
            advance(len(index))
    flush()
    assert out is not None, "no batches"
    return out
