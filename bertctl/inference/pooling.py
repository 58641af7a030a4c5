"""Which hidden states make a text's features, and how its tokens are pooled: one ``PoolingSpec``
that every backend reads, and the pooling arithmetic on numpy arrays or torch tensors.

The layer choices are the paper's feature-based ones (§5.3, Table 7); the pooling modes are
sentence-transformers' ``Pooling``'s, so that its checkpoints give its vectors.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bertctl.errors import BertctlError

LAYER_CHOICES = ("last", "second-to-last", "sum-last-4", "concat-last-4", "embeddings")
POOLING_CHOICES = ("cls", "mean", "max", "mean-sqrt-len", "weighted-mean", "last")


@dataclass(frozen=True)
class PoolingSpec:
    """``layers``: one of LAYER_CHOICES; ``pooling``: one of POOLING_CHOICES, or several joined by ","
    (their vectors side by side, in that order)."""

    layers: str = "last"
    pooling: str = "mean"

    def __post_init__(self) -> None:
        if self.layers not in LAYER_CHOICES:
            raise BertctlError(f"--layers must be one of {', '.join(LAYER_CHOICES)}, not {self.layers!r}")
        if not all(mode in POOLING_CHOICES for mode in self.modes):
            raise BertctlError(f"--pooling must be one of {', '.join(POOLING_CHOICES)} (or several joined by ','), "
                               f"not {self.pooling!r}")

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.pooling.split(","))

    @property
    def all_layers(self) -> bool:
        """Whether hidden states other than the last one are needed."""
        return self.layers != "last"

    def hidden_states(self, num_layers: int) -> tuple[list[int], bool]:
        """(indices of the hidden states combined, 0 the embeddings' output and ``num_layers`` the last;
        whether they are summed rather than concatenated)."""
        if self.layers == "last":
            return [num_layers], False
        if self.layers == "second-to-last":
            return [num_layers - 1], False
        if self.layers == "embeddings":
            return [0], False
        if num_layers < 4:
            raise BertctlError(f"--layers {self.layers} needs at least 4 layers; the model has {num_layers}")
        return list(range(num_layers - 3, num_layers + 1)), self.layers == "sum-last-4"

    def width(self, hidden_size: int, num_layers: int) -> int:
        """Features a text: each mode's pooled vector of the hidden states used (or of their sum)."""
        keep, summed = self.hidden_states(num_layers)
        return len(self.modes) * (1 if summed else len(keep)) * hidden_size


def features(hidden_states, mask, spec: PoolingSpec):
    """``hidden_states``: the L+1 (B, S, H) arrays, embeddings first, or only the last one when
    ``spec.all_layers`` is False; mask (B, S), 1 = real token.  Returns (B, ``spec.width``), pooled in
    float32 whatever precision the model computes in."""
    x = combine_layers(hidden_states, spec)
    return pool(x if isinstance(x, np.ndarray) else x.float(), mask, spec.pooling)


def combine_layers(hidden_states, spec: PoolingSpec):
    """The hidden states ``spec.layers`` names (numpy or torch), summed or side by side: (B, S, H) or
    (B, S, 4H).  ``hidden_states``: L+1, embeddings first, or for ``last`` the last one alone."""
    keep, summed = spec.hidden_states(len(hidden_states) - 1)
    parts = [hidden_states[i] for i in keep]
    if len(parts) == 1:
        return parts[0]
    if summed:
        total = parts[0]
        for part in parts[1:]:  # in layer order, as the native encoder sums
            total = total + part
        return total
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=-1)
    import torch

    return torch.cat(parts, dim=-1)


def pool(x, mask, pooling: str):
    """x (B, S, D) float, mask (B, S) 1 = real token (padding on the right) -> (B, D), or (B, k*D) for
    k modes joined by ","; padding never contributes.  numpy arrays or torch tensors (both of one kind).
    The modes are sentence-transformers' ``Pooling``'s: cls, mean, max, mean-sqrt-len (the sum over the
    square root of the length), weighted-mean (token i weighs i, from 1), last (the last real token)."""
    numpy = isinstance(x, np.ndarray)
    if not numpy:
        import torch
    if "," in pooling:
        parts = [pool(x, mask, mode) for mode in pooling.split(",")]
        return np.concatenate(parts, axis=-1) if numpy else torch.cat(parts, dim=-1)
    if pooling == "cls":
        return x[:, 0]
    if pooling == "last":
        rows = np.arange(x.shape[0]) if numpy else torch.arange(x.shape[0], device=x.device)
        return x[rows, mask.sum(1) - 1]
    m = mask[:, :, None].astype(x.dtype) if numpy else mask.unsqueeze(-1).to(x.dtype)  # (B, S, 1)
    if pooling == "max":
        return np.where(m > 0, x, -np.inf).max(1) if numpy else x.masked_fill(m == 0, float("-inf")).amax(1)
    if pooling == "weighted-mean":
        positions = np.arange(1, x.shape[1] + 1, dtype=x.dtype) if numpy else \
            torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        m = m * positions[None, :, None]
    total, count = (x * m).sum(1), m.sum(1)  # (B, D), (B, 1)
    count = np.maximum(count, 1e-9) if numpy else count.clamp(min=1e-9)
    return total / (count ** 0.5 if pooling == "mean-sqrt-len" else count)


def normalize_rows(out: np.ndarray, rows: int = 65536) -> np.ndarray:
    """L2-normalises the (N, D) float32 ``out`` in place, ``rows`` at a time (the temporaries stay small
    beside a large output), as ``torch.nn.functional.normalize``: norms below 1e-12 count as 1e-12."""
    for i in range(0, len(out), rows):
        block = out[i:i + rows]
        norms = np.sqrt(np.einsum("ij,ij->i", block, block))  # einsum: no (rows, D) temporary
        block /= np.maximum(norms, 1e-12)[:, None]
    return out
