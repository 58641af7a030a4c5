"""A padded batch's real tokens packed into one (T, H) tensor, for the ``unpadded`` attention: the
embeddings, projections, FFN, LayerNorm, GELU and dropout then do no work for padding.

The layout comes from the loader (``layout``, on the host, as the batch is made) so that the step has no
host sync and its shapes repeat: T is rounded up to one of a few bucket sizes (``bucket``), the extra
rows forming one more sequence of dummy tokens whose results are dropped, so CUDA graphs capture each
bucket once. A model called without a layout packs the batch itself from its mask on the device
(``Packed.from_mask``), which waits for the GPU once (``nonzero``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The real share of the positions under which packing pays: in a nearly full batch the gathers cost
# more than the padding's work they save.
PACK_BELOW = 0.9
# Buckets per doubling of the token count: padding T up to its bucket wastes at most 1/16 of the work.
BUCKETS_PER_OCTAVE = 16


def granule(tokens: int) -> int:
    """The spacing of the buckets around ``tokens``: a sixteenth of the power of two below it, at least 8."""
    return max(8, (1 << (max(tokens, 1).bit_length() - 1)) // BUCKETS_PER_OCTAVE)


def bucket(real_tokens: int) -> int:
    """The packed row count for ``real_tokens``: above it (the dummy sequence is never empty), rounded up
    to a multiple of ``granule``; so a run's steps share a few sizes."""
    g = granule(real_tokens + 1)
    return -(-(real_tokens + 1) // g) * g


def packed_rows(real_tokens: int, positions: int) -> int:
    """The rows ``layout`` packs a batch of ``positions`` padded positions into: 0 (not packed) when
    packing would not pay, else ``bucket(real_tokens)``. The loader plans CUDA graphs by it."""
    return 0 if real_tokens >= PACK_BELOW * positions else bucket(real_tokens)


def layout(attention_mask: torch.Tensor) -> torch.Tensor:
    """The loader's packed layout of a CPU mask (..., S) (1 = token), as one int64 tensor that travels as
    the batch's ``packing`` entry: ``[cu_seqlens (R + 2) | pack_index (T) | unpack_index (T)]`` over the
    R = mask.numel() // S rows, T = ``bucket`` of the real tokens. Rows T_real.. are the dummy sequence:
    they gather token 0 and scatter to a discarded row. An empty tensor when packing would not pay
    (``PACK_BELOW``): the model then runs the batch padded."""
    S = attention_mask.shape[-1]
    mask = attention_mask.reshape(-1, S).bool()
    real = int(mask.sum())
    T = packed_rows(real, mask.numel())
    if not T:
        return torch.empty(0, dtype=torch.int64)
    rows = mask.shape[0]
    flat = mask.flatten().nonzero().squeeze(1)
    cu = F.pad(mask.sum(1).cumsum(0), (1, 0))
    cu = torch.cat([cu, torch.tensor([T])])
    pack_index = torch.zeros(T, dtype=torch.int64)
    pack_index[:real] = flat
    unpack_index = torch.full((T,), rows * S, dtype=torch.int64)
    unpack_index[:real] = flat
    return torch.cat([cu, pack_index, unpack_index])


class Packed:
    """A batch's packed layout: ``pack_index`` (T,) into the flattened (R * S) positions, ``unpack_index``
    (T,) back to them (a discarded row R * S for the dummy tokens), ``cu_seqlens`` (int32) the offsets of
    each sequence's rows (FlashAttention's varlen layout) and ``max_seqlen`` a bound on their lengths.

    Attention runs FlashAttention's variable-length kernel on the packed rows where it can
    (``bertctl.nn.attention.varlen_ok``: a GPU, fp16/bf16); elsewhere it scatters Q, K and V back to
    (R, nh, S, hs) and runs SDPA with the key mask (the real positions' results equal the padded
    model's), its padded work the one part left.
    """

    def __init__(self, key_mask: torch.Tensor, pack_index: torch.Tensor, unpack_index: torch.Tensor,
                 cu_seqlens: torch.Tensor, max_seqlen: int):
        self.shape = tuple(key_mask.shape)  # (R, S)
        self.key_mask = key_mask
        self.pack_index = pack_index
        self.unpack_index = unpack_index
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.max_seqlen = max_seqlen

    @classmethod
    def from_layout(cls, packing: torch.Tensor, key_mask: torch.Tensor) -> "Packed":
        """Decode ``layout``'s tensor (on the model's device) for the (R, S) bool ``key_mask``; only
        shapes are read, so this neither waits for the GPU nor breaks a CUDA graph's capture."""
        R, S = key_mask.shape
        T = (packing.shape[0] - R - 2) // 2
        cu, pack_index, unpack_index = packing.split([R + 2, T, T])
        # The dummy sequence's length is below the bucket spacing at T; real ones are at most S.
        return cls(key_mask, pack_index, unpack_index, cu, max(S, granule(T)))

    @classmethod
    def from_mask(cls, key_mask: torch.Tensor) -> "Packed":
        """The layout of a (R, S) bool mask, made on its device: no dummy rows, one wait for the GPU."""
        R, S = key_mask.shape
        index = key_mask.flatten().nonzero().squeeze(1)
        cu = F.pad(key_mask.sum(1).cumsum(0), (1, 0))
        return cls(key_mask, index, index, cu, S)

    @property
    def positions(self) -> torch.Tensor:
        """(T,) each packed row's position in its sequence (0 for the dummy rows)."""
        return self.pack_index % self.shape[1]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(R, S, ...) -> (T, ...)"""
        return x.flatten(0, 1).index_select(0, self.pack_index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (R, S, ...), zeros at the padding."""
        R, S = self.shape
        out = x.new_zeros((R * S + 1, *x.shape[1:]))
        return out.index_copy(0, self.unpack_index, x)[:R * S].view(R, S, *x.shape[1:])


def worth_packing(key_mask: torch.Tensor) -> bool:
    """Whether a batch has enough padding for ``Packed`` to pay for its gathers (one host sync; packing
    from the mask needs one anyway for its data-dependent size)."""
    return int(key_mask.sum()) < PACK_BELOW * key_mask.numel()
