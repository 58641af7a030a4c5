"""The encoder's matmuls as their own autograd nodes: where autograd's default graph does extra memory
passes (a separate add of a residual's two gradients, a 16-bit weight gradient widened by a cast, a
slice of vocabulary-padded logits), these do the same maths in fewer.

Each wrapper (``input_projection``, ``linear``, ``vocab_projection``) falls back to plain ``F.linear``
where no backward will run. Shapes: N rows (B * S, or T packed tokens), H hidden, V vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bertctl import ops


class InputProjection(torch.autograd.Function):
    """A sub-layer's input projection x W^T + b, cut into column blocks of ``widths`` (Q, K and V, or
    the FFN's one), and x itself, handed on as the sub-layer's residual.

    A post-LN layer reads x twice: in this matmul and in the residual add before the sub-layer's
    LayerNorm. Left to autograd, the two gradients of x meet in a separate add, which reads two
    activation-sized tensors and writes one. Here one node owns both reads of x, and its backward
    accumulates the matmul's input gradient into the residual's as the GEMM's C operand (``addmm_``,
    beta 1). The blocks' gradients are joined into one (N, sum of widths) gradient first (Q, K and V's
    arrive from the attention kernels in (B, S, nh, hs) memory: one vectorised concatenation), so each
    product is one wide GEMM: three narrow accumulating ones cost more GEMM time than the add saved
    (``benchmarks/results/model-inputprojection-ab-d2af69e.json``). The bias's gradient, the joined
    gradient's column sums, is taken in the same pass (``ops.concat_column_sums``) rather than by
    reading it again.

    ``into_residual_grad``: the residual feeds only a LayerNorm, whose backward writes its gradient
    as a new tensor, downstream of every use of the projection: when this backward runs that
    gradient has no other reader left, so it is accumulated into in place (when it is a plain
    contiguous tensor of the GEMM's dtype and no graph is being built over the backward). Otherwise,
    as for a gradient a caller passes in, the sum is a new tensor.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, widths, into_residual_grad, dtype):
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        if dtype is not None:  # under autocast: the parameters cast here, their gradients returned as they are
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        xc = x.to(weight.dtype)
        ctx.save_for_backward(xc, weight)
        ctx.widths, ctx.has_bias, ctx.x_dtype = widths, bias is not None, x.dtype
        ctx.into_residual_grad = into_residual_grad
        y = F.linear(xc, weight, bias)  # (..., sum of widths)
        return (*(y.split(widths, dim=-1) if len(widths) > 1 else (y,)), x.view_as(x))

    @staticmethod
    def backward(ctx, *grads):
        xc, weight = ctx.saved_tensors
        *blocks, grad_r = grads
        H = xc.shape[-1]
        rows = [xc.new_zeros(xc.numel() // H, w) if g is None else g.reshape(-1, w)
                for g, w in zip(blocks, ctx.widths)]  # (N, w) each
        dx = dw = db = None
        if len(rows) == 1:
            g = rows[0]
        elif ctx.has_bias and ctx.needs_input_grad[2]:
            g, db = ops.concat_column_sums(rows)  # (N, sum of widths) and its column sums, one pass
        else:
            g = torch.cat(rows, dim=-1)
        if ctx.needs_input_grad[0]:
            if (ctx.into_residual_grad and grad_r is not None and grad_r.dtype == weight.dtype
                    and grad_r.is_contiguous() and not grad_r._is_view() and not torch.is_grad_enabled()):
                dx = grad_r.view(-1, H).addmm_(g, weight).view(xc.shape)
            else:
                dx = (g @ weight).view(xc.shape)
                if grad_r is not None:
                    dx = grad_r + dx
            dx = dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(g, xc, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = (g.sum(0) if db is None else db).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def weight_grad(g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """g^T x over all leading dims, (out, in), in ``dtype``: a linear layer's weight gradient. For an
    fp32 weight under autocast the GEMM writes fp32 itself (on CUDA, from its fp32 accumulator)
    instead of a 16-bit product that a cast then widens: that cast, autograd's for autocast's 16-bit
    copy of the weight, ran as unvectorised copies
    (``benchmarks/results/model-step-changes-ab-h200-b401318.json``)."""
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    if dtype == g.dtype:
        return g2.t() @ x2
    if g.is_cuda and dtype == torch.float32:
        return torch.mm(g2.t(), x2, out_dtype=dtype)
    return (g2.t() @ x2).to(dtype)


class CastLinear(torch.autograd.Function):
    """x W^T (no bias) in the autocast dtype for a weight of another dtype: autocast's cast of the
    weight and the matmul in one node, whose backward returns the weight's gradient in the weight's
    dtype (``weight_grad``) rather than a 16-bit one for autograd to widen."""

    @staticmethod
    def forward(ctx, x, weight, dtype):
        xc, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(xc, w)
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        return F.linear(xc, w)

    @staticmethod
    def backward(ctx, g):
        xc, w = ctx.saved_tensors
        dx = (g @ w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = weight_grad(g, xc, ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T without a bias: ``CastLinear`` under autocast where a backward will run, ``F.linear`` otherwise."""
    device = x.device.type
    if (torch.is_grad_enabled() and weight.requires_grad and torch.is_autocast_enabled(device)
            and weight.dtype != torch.get_autocast_dtype(device)):
        return CastLinear.apply(x, weight, torch.get_autocast_dtype(device))
    return F.linear(x, weight)


def input_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     widths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """(x W^T + b cut into column blocks of ``widths``, ..., x): ``InputProjection`` where a backward
    will run, plain ``F.linear`` otherwise. The caller feeds the residual x only to its sub-layer's
    LayerNorm (``into_residual_grad``). Under autocast the weight and bias are cast to the autocast
    dtype inside the node, whose backward returns their gradients in their own dtype (``weight_grad``);
    the residual keeps x's dtype."""
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        y = F.linear(x, weight, bias)
        return (*(y.split(widths, dim=-1) if len(widths) > 1 else (y,)), x)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    # Under torch.compile the backward's in-place accumulation is left to the compiler (dynamo cannot
    # trace the aliasing check that guards it, and broke the graph at every layer).
    return InputProjection.apply(x, weight, bias, tuple(widths), not torch.compiler.is_compiling(), dtype)


#: On CUDA the V-way projection computes V rounded up to this many logits: its output rows then start on
#: 16-byte boundaries, which cuBLAS needs for its Hopper kernels (BERT's 30,522 is 2 past a multiple of 8).
VOCAB_ALIGN = 8


def vocab_projection(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pad_to: int = 1) -> torch.Tensor:
    """h W^T + b over V rounded up to a multiple of ``pad_to``, (..., V'): the matmul runs on W padded
    with zero rows and b padded with -inf, so each extra column is -inf. A softmax over the padded row
    then gives the V real columns the same probabilities (exp(-inf) = 0), the same loss and argmax, and
    the extra columns a gradient of exactly 0; the loss's gradient is the padded matrix's, with no
    zero-filled copy made by slicing back. Unaligned, cuBLAS ran V = 30,522 on slower kernels for
    16-bit inputs misaligned to 4 bytes (``benchmarks/results/model-vocab-padding-ab-h200-f29cc4e.json``)."""
    pad = -weight.shape[0] % pad_to
    if not pad:
        return F.linear(h, weight, bias)
    return F.linear(h, F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad), value=float("-inf")))
