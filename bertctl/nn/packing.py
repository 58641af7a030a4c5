"""A padded batch's real tokens packed into one (T, H) tensor, T the sum of the lengths, for
the ``unpadded`` attention: the projections, the FFN, LayerNorm, GELU and dropout then do no
work for padding (``benchmarks/results/unpadded-cpu-2threads-8a2216f.json``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Packed:
    """A padded batch's real tokens, packed: ``index`` (T,) into the flattened (B * S) positions,
    ``cu_seqlens`` (B + 1,) the offsets of each sequence's tokens (FlashAttention's varlen layout).

    Attention runs FlashAttention's variable-length kernel on the packed tokens where it can
    (``bertctl.nn.attention.varlen_ok``: a GPU, fp16/bf16); elsewhere it scatters Q, K and V back to
    (B, nh, S, hs) and runs SDPA with the key mask (the real positions' results equal the padded
    model's), its padded work the one part left.
    """

    def __init__(self, attention_mask: torch.Tensor):
        self.shape = tuple(attention_mask.shape)  # (B, S)
        mask = attention_mask.bool()
        self.key_mask = mask
        self.index = mask.flatten().nonzero().squeeze(1)  # (T,)
        lengths = mask.sum(1)  # (B,)
        self.cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # (B + 1,)
        self.max_seqlen = int(lengths.max()) if mask.is_cuda else 0  # FlashAttention's varlen kernel needs it

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (T, ...)"""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (B, S, ...), zeros at the padding."""
        B, S = self.shape
        out = x.new_zeros((B * S, *x.shape[1:]))
        return out.index_copy(0, self.index, x).view(B, S, *x.shape[1:])


# The real share of the positions under which packing pays: in a nearly full batch the gathers cost
# more than the padding's work they save.
PACK_BELOW = 0.9


def worth_packing(key_mask: torch.Tensor) -> bool:
    """Whether a batch has enough padding for ``Packed`` to pay for its gathers (one host sync; packing
    needs one anyway for its data-dependent size)."""
    return int(key_mask.sum()) < PACK_BELOW * key_mask.numel()
