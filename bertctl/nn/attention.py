"""Multi-head attention, softmax(q k^T / sqrt(hs)) v, by the runtime's ``attn``.

The implementations (``ATTENTION``) work on a padded batch's heads, (B, nh, S, hs), over the same
weights: ``sdpa`` (torch's scaled_dot_product_attention) and ``explicit`` (the scores materialised,
the path bertctl's fused softmax serves). ``unpadded`` packs the batch (``bertctl.nn.packing``):
attention then runs FlashAttention's variable-length kernel on the packed tokens (``VarlenAttention``)
where it can (``varlen_ok``), else SDPA on the tokens scattered back to (B, S).

``cudnn_training_attention`` and ``varied_shapes`` decide where SDPA may use its cuDNN backend.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bertctl import ops
from bertctl.nn.packing import Packed
from bertctl.runtime import Runtime


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                   dropout_p: float, scale: float, runtime: Runtime) -> torch.Tensor:
    """torch's fused attention (FlashAttention, memory-efficient or cuDNN kernels): (B, nh, S, hs)."""
    mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S): over heads and queries
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                       dropout_p: float, scale: float, runtime: Runtime) -> torch.Tensor:
    """The scores materialised, then the softmax (bertctl's fused masked one with fused kernels),
    dropout on the probabilities and their product with v: (B, nh, S, hs)."""
    scores = q @ k.transpose(-1, -2)  # (B, nh, S, S), unscaled: the softmax applies the scale
    if runtime.fused:
        probs = ops.softmax(scores, key_mask, scale)
    else:
        scores = scores * scale
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
    training = dropout_p > 0  # the caller passes 0 outside training
    probs = ops.dropout(probs, dropout_p, training) if runtime.own_masks else F.dropout(probs, dropout_p, training)
    return probs @ v


#: Runtime.attn -> attention over a padded batch's heads. ``unpadded`` uses SDPA where a batch
#: was not packed, or where its packed tokens cannot take the varlen kernel.
ATTENTION = {"sdpa": sdpa_attention, "explicit": explicit_attention, "unpadded": sdpa_attention}


def attention(runtime: Runtime, nh: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_mask: torch.Tensor | Packed | None, dropout_p: float) -> torch.Tensor:
    """Multi-head attention over the projections q, k, v: (B, S, H) each with ``key_mask`` (B, S) bool
    (True = a real token that may be attended to) or None; or (T, H) each with the batch's ``Packed``
    layout. Returns the heads' outputs joined, (B, S, H) or (T, H). ``dropout_p`` is 0 outside training."""
    H = q.shape[-1]
    hs = H // nh
    scale = 1.0 / math.sqrt(hs)
    packed = key_mask if isinstance(key_mask, Packed) else None
    if packed is not None and varlen_ok(q, hs):  # (T, H) each: attention without padding
        q, k, v = (t.view(-1, nh, hs).contiguous() for t in (q, k, v))  # (T, nh, hs)
        return VarlenAttention.apply(q, k, v, packed.cu_seqlens, packed.max_seqlen, dropout_p, scale).reshape(-1, H)
    if packed is not None:
        q, k, v, key_mask = packed.unpack(q), packed.unpack(k), packed.unpack(v), packed.key_mask
    B, S = q.shape[0], q.shape[1]
    # (B, nh, S, hs) views; the attention kernels return their gradients in (B, S, nh, hs) memory,
    # which InputProjection's backward reads as (B * S, H) rows without a copy.
    q, k, v = (t.view(B, S, nh, hs).transpose(1, 2) for t in (q, k, v))
    ctx = ATTENTION[runtime.attn](q, k, v, key_mask, dropout_p, scale, runtime)  # (B, nh, S, hs)
    ctx = ctx.transpose(1, 2).reshape(B, S, H)
    return ctx if packed is None else packed.pack(ctx)


def varlen_ok(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether FlashAttention's variable-length kernel takes these packed projections: an Ampere or
    newer GPU, fp16 or bf16, a head size it supports; otherwise attention scatters back to (B, S) and
    runs SDPA."""
    return (qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(qkv.device) >= (8, 0))


class VarlenAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v over each sequence of a packed batch, with dropout on the
    probabilities: ``aten._flash_attention_forward``/``_backward`` on (T, heads, head_dim) with
    ``cu_seqlens`` (PyTorch's public ``varlen_attn`` has no dropout, which BERT trains with). The
    backward replays the forward's dropout from the philox state the forward returns."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, dropout_p: float, scale: float):
        out, lse, rng, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, offset)
        ctx.meta = (max_seqlen, dropout_p, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_seqlens, rng, offset = ctx.saved_tensors
        max_seqlen, dropout_p, scale = ctx.meta
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
            False, rng, offset, scale=scale)
        return dq, dk, dv, None, None, None, None


# Fine-tuning trains with cuDNN's attention where its steps are long and many: heads at least this wide,
# the run's median step padded to at least this many tokens, and at least this many steps (see
# cudnn_training_attention).
CUDNN_TRAINING_MIN_HEAD_DIM = 64
CUDNN_TRAINING_MIN_LENGTH = 256
CUDNN_TRAINING_MIN_STEPS = 1000


def cudnn_training_attention(head_dim: int, median_step_length: int, steps: int) -> bool:
    """Whether fine-tuning's training steps keep SDPA's cuDNN backend (else ``varied_shapes``).

    With padding masks and dropout, SDPA without cuDNN runs the memory-efficient kernel, built for
    Ampere; cuDNN's is faster on Hopper for 64-wide heads at 256 tokens and more, and slower for
    shorter steps or narrower heads. It costs seconds at the process's first call and a plan for every
    new shape, so a run needs enough steps to win that back
    (``benchmarks/results/finetune-cudnn-attention-2xh200-6995104.json``).
    """
    return (head_dim >= CUDNN_TRAINING_MIN_HEAD_DIM and median_step_length >= CUDNN_TRAINING_MIN_LENGTH
            and steps >= CUDNN_TRAINING_MIN_STEPS)


@contextlib.contextmanager
def varied_shapes():
    """SDPA without its cuDNN backend while batches come in many shapes (evaluation, embedding, and
    fine-tuning's short steps: ``cudnn_training_attention``).

    cuDNN's attention builds an execution plan for every new shape, which on a run of many shapes
    costs more than the steps themselves; PyTorch's other fused kernels (FlashAttention,
    memory-efficient) need no plan.
    """
    if not torch.cuda.is_available():
        yield
        return
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
