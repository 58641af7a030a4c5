"""Plain-PyTorch forward and hand-derived backward of every fused op.

These are the test oracle and the fallback the public ops in ``bertctl.ops`` use
when the compiled module is absent or the inputs fall outside a kernel's
preconditions.  They compute in float32 (float64 for float64 inputs) and return
the input dtype, exactly like the kernels; their signatures mirror the
``torch.ops.bertctl`` schemas.
"""
from __future__ import annotations

import math

import torch

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_C = 0.044715


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _mask_4d(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A (B, Sk) key-padding mask broadcasts over heads and queries; other ranks
    # must already broadcast against x (B, heads, Sq, Sk).
    return mask[:, None, None, :] if mask.dim() == 2 and x.dim() == 4 else mask


# --- softmax ------------------------------------------------------------------------------

def softmax_forward(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale * x + mask) over the last dim; a fully masked row gives zeros."""
    v = x.to(acc_dtype(x)) * scale
    if mask is not None:
        m = _mask_4d(mask, x)
        v = v.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else v + m.to(v.dtype)
    mx = v.amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)  # all -inf: exp gives 0, not NaN
    e = torch.exp(v - mx)
    s = e.sum(dim=-1, keepdim=True)
    y = torch.where(s > 0, e / s, torch.zeros_like(e))
    return y.to(x.dtype)


def softmax_backward(grad_y: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) over the last dim."""
    g, p = grad_y.to(acc_dtype(y)), y.to(acc_dtype(y))
    dot = (g * p).sum(dim=-1, keepdim=True)
    return (scale * p * (g - dot)).to(y.dtype)


# --- LayerNorm ----------------------------------------------------------------------------

def layer_norm_forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) of LayerNorm(x + residual); mean/rstd in the accumulation dtype, shape x.shape[:-1]."""
    acc = acc_dtype(x)
    h = x.to(acc) if residual is None else x.to(acc) + residual.to(acc)
    mean = h.mean(dim=-1)
    var = (h - mean[..., None]).pow(2).mean(dim=-1)  # biased variance, as in the paper / torch
    rstd = torch.rsqrt(var + eps)
    y = (h - mean[..., None]) * rstd[..., None] * weight.to(acc) + bias.to(acc)
    return y.to(x.dtype), mean, rstd


def layer_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); dx is also the residual's gradient.

    With xhat = (h - mean) * rstd and g = dy * w, per row of H features:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dweight = sum_rows dy * xhat; dbias = sum_rows dy.
    """
    acc = acc_dtype(x)
    h = x.to(acc) if residual is None else x.to(acc) + residual.to(acc)
    rs = rstd.to(acc)[..., None]
    xhat = (h - mean.to(acc)[..., None]) * rs
    dy = grad_y.to(acc)
    g = dy * weight.to(acc)
    dx = rs * (g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    rows = tuple(range(x.dim() - 1))
    dweight = (dy * xhat).sum(dim=rows) if rows else dy * xhat
    dbias = dy.sum(dim=rows) if rows else dy
    return dx.to(x.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype)


# --- bias + GELU --------------------------------------------------------------------------

_U32 = 0xFFFFFFFF


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The CPU dropout kernel's 32-bit hash, in int64 arithmetic kept to 32 bits (x: int64 < 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def dropout_key(seed: int) -> tuple[int, int]:
    """The two 32-bit key words (a, b) of a dropout call's int64 seed, as csrc/dropout_hash.h derives them:
    a = lowbias32(low 32 bits) ^ high 32 bits, b = lowbias32(high 32 bits ^ a)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    lo, hi = s & _U32, s >> 32
    a = int(_lowbias32(torch.tensor(lo))) ^ hi
    return a, int(_lowbias32(torch.tensor(hi ^ a)))


def dropout_forward(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """``torch.ops.bertctl.dropout``: element i (of x in row-major order) is kept when
    lowbias32((i * 0x9E3779B9 + a) ^ b) >= p * 2^32, (a, b) = ``dropout_key(seed)``; kept elements
    are x / (1 - p) (times the rounded scale, in the accumulation dtype)."""
    a, b = dropout_key(int(seed))
    i = torch.arange(x.numel(), dtype=torch.int64)
    keep = (_lowbias32(((i * 0x9E3779B9 + a) & _U32) ^ b) >= int(p * 4294967296.0)).view(x.shape)
    acc = acc_dtype(x)
    return torch.where(keep.to(x.device), x.to(acc) * torch.tensor(1.0 / (1.0 - p), dtype=acc), 0).to(x.dtype)


# --- bias + dropout + residual + LayerNorm ---------------------------------------------------

def _dropped(x: torch.Tensor, bias: torch.Tensor, p: float, seed: torch.Tensor | None) -> torch.Tensor:
    """dropout(x + bias) in the accumulation dtype (not rounded to x's), the mask dropout_forward's."""
    v = x.to(acc_dtype(x)) + bias.to(acc_dtype(x))
    return dropout_forward(v, p, seed) if p > 0 else v


def bias_dropout_add_layer_norm_forward(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                        weight: torch.Tensor, ln_bias: torch.Tensor, eps: float, p: float,
                                        seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) of LayerNorm(dropout(x + bias) + residual); the mask is ``dropout_forward``'s for
    (p, seed), none with p = 0."""
    h = _dropped(x, bias, p, seed)
    y, mean, rstd = layer_norm_forward(h, residual.to(h.dtype), weight, ln_bias, eps)
    return y.to(x.dtype), mean, rstd


def bias_dropout_add_layer_norm_backward(
        grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dbias, dresidual, dweight, dln_bias): dresidual is LayerNorm's dx (``layer_norm_backward``), dx the
    same mask on it (dropout is linear), dbias the column sums of dx.  (The kernel returns dx empty when p = 0,
    where it equals dresidual.)"""
    h = _dropped(x, bias, p, seed)
    dh, dweight, dln_bias = layer_norm_backward(grad_y, h, residual.to(h.dtype), weight, mean, rstd)
    dx = dropout_forward(dh, p, seed) if p > 0 else dh
    dbias = dx.reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dbias.to(bias.dtype), dh.to(x.dtype), dweight, dln_bias


def _check_approximate(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise ValueError(f'bias_gelu: approximate must be "none" or "tanh", got {approximate!r}')


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU(x + bias): 0.5 v (1 + erf(v / sqrt 2)), or the tanh form (Hendrycks & Gimpel, 2016)."""
    _check_approximate(approximate)
    v = x.to(acc_dtype(x)) + bias.to(acc_dtype(x))
    if approximate == "tanh":
        y = 0.5 * v * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (v + _TANH_C * v**3)))
    else:
        y = 0.5 * v * (1.0 + torch.erf(v * _SQRT1_2))
    return y.to(x.dtype)


def bias_gelu_backward(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                       approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) with dx = dy * GELU'(x + bias) and dbias = sum over rows of dx."""
    _check_approximate(approximate)
    acc = acc_dtype(x)
    v = x.to(acc) + bias.to(acc)
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (v + _TANH_C * v**3))
        d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_C * v * v)
    else:
        d = 0.5 * (1.0 + torch.erf(v * _SQRT1_2)) + v * _INV_SQRT_2PI * torch.exp(-0.5 * v * v)
    dx = grad_y.to(acc) * d
    dbias = dx.reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dbias.to(bias.dtype)


# --- softmax cross-entropy ------------------------------------------------------------------

def cross_entropy_forward(logits: torch.Tensor, labels: torch.Tensor,
                          ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, argmax) per row of logits (N, V): lse the log-sum-exp, loss = lse - logits[label]
    (0 where the label is ignore_index), argmax the first maximal index; loss and lse in float32
    (float64 for float64 logits)."""
    x = logits.to(acc_dtype(logits))
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != ignore_index
    picked = x.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    return torch.where(valid, lse - picked, 0.0), lse, x.argmax(dim=-1)


def cross_entropy_backward(grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                           ignore_index: int) -> torch.Tensor:
    """dlogits = grad_loss * (softmax(logits) - onehot(label)), zero on ignored rows, in logits' dtype."""
    x = logits.to(acc_dtype(logits))
    valid = labels != ignore_index
    g = torch.where(valid, grad_loss.to(x.dtype), 0.0)[:, None]
    d = g * torch.exp(x - lse.to(x.dtype)[:, None])
    d.scatter_add_(1, torch.where(valid, labels, 0)[:, None], -g)
    return d.to(logits.dtype)


# --- differentiable fallbacks -------------------------------------------------------------

class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale):
        y = softmax_forward(x, mask, scale)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (y,) = ctx.saved_tensors
        return softmax_backward(grad_y, y, ctx.scale), None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        y, mean, rstd = layer_norm_forward(x, residual, weight, bias, eps)
        ctx.save_for_backward(x, residual, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, residual, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = layer_norm_backward(grad_y, x, residual, weight, mean, rstd)
        return dx, (dx if residual is not None else None), dweight, dbias.to(ctx.bias_dtype), None


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx, grad_y):
        x, bias = ctx.saved_tensors
        dx, dbias = bias_gelu_backward(grad_y, x, bias, ctx.approximate)
        return dx, dbias, None


class _BiasDropoutAddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, weight, ln_bias, eps, p, seed):
        y, mean, rstd = bias_dropout_add_layer_norm_forward(x, bias, residual, weight, ln_bias, eps, p, seed)
        ctx.save_for_backward(x, bias, residual, weight, mean, rstd, seed)
        ctx.p, ctx.ln_bias_dtype = p, ln_bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, bias, residual, weight, mean, rstd, seed = ctx.saved_tensors
        dx, dbias, dres, dweight, dln_bias = bias_dropout_add_layer_norm_backward(
            grad_y, x, bias, residual, weight, mean, rstd, ctx.p, seed)
        return dx, dbias, dres, dweight, dln_bias.to(ctx.ln_bias_dtype), None, None, None


def softmax(scores: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """Differentiable plain-PyTorch softmax(scale * scores + mask)."""
    return _Softmax.apply(scores, mask, float(scale))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable plain-PyTorch LayerNorm(x + residual)."""
    return _LayerNorm.apply(x, residual, weight, bias, float(eps))


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Differentiable plain-PyTorch GELU(x + bias)."""
    _check_approximate(approximate)
    return _BiasGelu.apply(x, bias, approximate)


def bias_dropout_add_layer_norm(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                ln_bias: torch.Tensor, eps: float, p: float,
                                seed: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable plain-PyTorch LayerNorm(dropout(x + bias) + residual), the hashed mask of (p, seed)."""
    return _BiasDropoutAddLayerNorm.apply(x, bias, residual, weight, ln_bias, float(eps), float(p), seed)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                  ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch per-row softmax cross-entropy (float32, float64 for float64 logits; 0 on ignored
    rows) and each row's argmax; differentiable in the logits (autograd through log_softmax)."""
    loss = torch.nn.functional.cross_entropy(logits.to(acc_dtype(logits)), labels, ignore_index=ignore_index,
                                             reduction="none")
    return loss, logits.argmax(dim=-1)
