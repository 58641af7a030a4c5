"""Fused ops used by the model: softmax (attention), LayerNorm(+residual), bias+GELU, dropout and
bias+dropout+residual+LayerNorm.

Public entry points (stable; the model calls only these):

- ``softmax(scores, mask=None, scale=1.0)``: softmax(scale * scores + mask) over the
  last dim.  ``scores`` (B, heads, Sq, Sk).  ``mask`` is a key-padding mask of shape
  (B, Sk) or (B, 1, 1, Sk): bool (True = attend) or additive float (0 / -inf or a large
  negative).  Fully masked rows give exact zeros.
- ``layer_norm(x, weight, bias, eps, residual=None)``: LayerNorm(x + residual) over the
  last dim; mean and rstd are kept in float32 for the backward.  Where no gradient is
  recorded (grad mode off, or no input requiring grad) it runs ``layer_norm_inference``,
  which stores no statistics.
- ``bias_gelu(x, bias, approximate="none")``: GELU(x + bias), "none" = exact erf (BERT's),
  "tanh" = the tanh approximation.
- ``dropout(x, p, training)``: x * mask / (1 - p) in training, x otherwise. On the CPU the
  compiled kernel draws the mask from a hash of (seed, element index), the seed from torch's
  CPU generator (so ``torch.manual_seed`` and a restored RNG state repeat it), and its backward
  recomputes the mask instead of storing it; elsewhere ``torch.nn.functional.dropout``.
- ``bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, eps, p, training)``:
  LayerNorm(dropout(x + bias) + residual), BERT's sub-layer output after a matmul without its
  bias, one compiled op on the CPU and on CUDA: the mask is a hash of (seed, element index),
  ``dropout``'s on the CPU for the same seed, recomputed in the backward (nothing of it stored), and
  dropout(x + bias) + residual is never stored; mean and rstd are kept in float32.  On the CPU in
  fp32/fp64, with LayerNorm weights away from 0 (every |ln_bias| <= 64 |weight|), the backward works
  from the output y, (y - ln_bias) / weight giving the normalised input back, and keeps y (which the
  next layer keeps anyway) instead of x and residual (``backward_from_output`` in csrc/autograd.cpp).  The seed comes
  from the input's device generator: on the CPU as ``dropout`` draws it (so the ops apart give the
  same mask), on CUDA as a one-element device tensor the kernel reads at run time (so a CUDA graph
  replays with a new seed each time, and ``torch.manual_seed`` repeats it).  One seed value drops
  the same elements on either device.  Elsewhere the ops apart: the bias add, ``dropout``,
  ``layer_norm``.
- ``cross_entropy(logits, labels, ignore_index=-100)``: (loss, argmax) per row of logits (N, V):
  the softmax cross-entropy against labels (N,) int64 in float32 (float64 for float64 logits; 0 on
  rows labelled ignore_index) and the row's first maximal index.  The compiled op reads the logits
  in their own dtype (no fp32 copy), rows may be strided (a view of wider aligned rows), and its
  backward writes the gradient in one pass from the logits and each row's log-sum-exp.  A label
  outside [0, V) is an error on the CPU and gives a NaN loss on CUDA.
- ``concat_column_sums(blocks)``: (``torch.cat(blocks, dim=1)``, its column sums) of 2-D blocks, for
  backward passes (the QKV projection's gradient and its bias's): on CUDA one pass, no autograd.

Each op runs the compiled ``torch.ops.bertctl`` kernel (C++ on CPU, CUDA on NVIDIA GPUs)
when the extension loaded and the inputs meet the kernel's preconditions (one gate
function per op: ``softmax_kernel_ok``, ``layer_norm_kernel_ok``, ``bias_gelu_kernel_ok``, ...);
otherwise the plain-PyTorch version in ``bertctl.ops.reference`` (same maths, hand-derived
backward).  Forward and backward are separate ops with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` keeps them in the graph; the forwards' autograd nodes are C++
(``csrc/autograd.cpp``) and call the backward ops.  Outputs have the input dtype.
"""
from __future__ import annotations

import torch

from bertctl._ext import OP_NAMES, compiled, kernels_loaded
from bertctl.ops import reference

__all__ = ["softmax", "layer_norm", "bias_gelu", "dropout", "bias_dropout_add_layer_norm", "cross_entropy",
           "concat_column_sums",
           "fused_available", "softmax_kernel_ok", "layer_norm_kernel_ok", "bias_gelu_kernel_ok", "dropout_kernel_ok",
           "bias_dropout_add_layer_norm_kernel_ok", "bias_dropout_add_layer_norm_available", "cross_entropy_kernel_ok",
           "reference"]

# Which compiled ops are registered for which dispatch keys, read once at import
# (a constant for torch.compile's tracer).
_KERNELS: dict[str, tuple[str, ...]] = {name: tuple(keys) for name, keys in kernels_loaded().items()}
_DTYPES = {
    "cpu": (torch.float64, torch.float32, torch.float16, torch.bfloat16),
    "cuda": (torch.float32, torch.float16, torch.bfloat16),
}
_KEY = {"cpu": "CPU", "cuda": "CUDA"}


def fused_available() -> bool:
    """True when the compiled module loaded with all its ops (what ``kernels="auto"`` resolves to)."""
    return all(_KERNELS.get(name) for name in OP_NAMES)


def _has_kernel(op: str, x: torch.Tensor, *extra: str) -> bool:
    key = _KEY.get(x.device.type)
    return (key is not None and all(key in _KERNELS.get(name, ()) for name in (op, op + "_backward") + extra)
            and x.dtype in _DTYPES[x.device.type])


def _param_ok(x: torch.Tensor, p: torch.Tensor) -> bool:
    # Per-feature parameters: 1-D of size H, the input's dtype or float32 (mixed precision).
    return (p.dim() == 1 and p.shape[0] == x.shape[-1] and p.device == x.device
            and p.dtype in (x.dtype, torch.float32))


# --- softmax ------------------------------------------------------------------------------

def _mask_2d(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """A key-padding mask as the kernel takes it, (B, Sk) bool or float32; None if it is not one."""
    if mask is None or scores.dim() != 4:
        return None
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        mask = mask[:, 0, 0, :]
    if mask.dim() != 2 or tuple(mask.shape) != (scores.shape[0], scores.shape[3]):
        return None
    if mask.dtype != torch.bool:
        if not mask.dtype.is_floating_point:
            return None
        mask = mask.float()  # (B, Sk): small next to the scores
    return mask


def softmax_kernel_ok(scores: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """The compiled softmax takes: scores of a supported dtype on a device with a kernel (CPU: fp64/fp32/fp16/bf16,
    CUDA: fp32/fp16/bf16), at least 1-D and non-empty; a mask only with 4-D scores (B, heads, Sq, Sk), of shape (B, Sk)
    or (B, 1, 1, Sk), bool or floating, on the same device."""
    if not (_has_kernel("softmax", scores) and scores.dim() >= 1 and scores.numel() > 0):
        return False
    if mask is None:
        return True
    m = _mask_2d(scores, mask)
    return m is not None and m.device == scores.device


def softmax(scores: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """softmax(scale * scores + mask) over the last dim; see the module docstring."""
    if softmax_kernel_ok(scores, mask):
        return torch.ops.bertctl.softmax(scores, _mask_2d(scores, mask), float(scale))
    return reference.softmax(scores, mask, scale)


# --- LayerNorm ----------------------------------------------------------------------------

def layer_norm_kernel_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         residual: torch.Tensor | None = None) -> bool:
    """The compiled LayerNorm takes: x of a supported dtype on a device with a kernel, at least 1-D and non-empty;
    weight and bias 1-D of size H = x.shape[-1], one dtype, x's or float32; a residual of x's shape, dtype, device."""
    if not (_has_kernel("layer_norm", x, "layer_norm_inference") and x.dim() >= 1 and x.numel() > 0):
        return False
    if not (_param_ok(x, weight) and _param_ok(x, bias) and weight.dtype == bias.dtype):
        return False
    return residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                and residual.device == x.device)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(x + residual) over the last dim (Ba et al., 2016), output in x's dtype (promoted with residual's)."""
    if residual is not None and residual.dtype != x.dtype:
        # Mixed precision: a bf16 sublayer output added to an fp32 residual stream.
        common = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(common), residual.to(common)
    if layer_norm_kernel_ok(x, weight, bias, residual):
        inputs = (x, weight, bias) if residual is None else (x, weight, bias, residual)
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return torch.ops.bertctl.layer_norm(x, residual, weight, bias, float(eps))[0]
        return torch.ops.bertctl.layer_norm_inference(x, residual, weight, bias, float(eps))
    return reference.layer_norm(x, weight, bias, eps, residual)


# --- bias + GELU --------------------------------------------------------------------------

def bias_gelu_kernel_ok(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> bool:
    """The compiled bias+GELU takes: x of a supported dtype on a device with a kernel, at least 1-D and non-empty;
    bias 1-D of size H = x.shape[-1], x's dtype or float32; approximate "none" or "tanh"."""
    return (_has_kernel("bias_gelu", x) and x.dim() >= 1 and x.numel() > 0 and _param_ok(x, bias)
            and approximate in ("none", "tanh"))


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU(x + bias); ``approximate`` "none" is the exact erf form (BERT), "tanh" the approximation."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f'bias_gelu: approximate must be "none" or "tanh", got {approximate!r}')
    if bias_gelu_kernel_ok(x, bias, approximate):
        return torch.ops.bertctl.bias_gelu(x, bias, approximate)
    return reference.bias_gelu(x, bias, approximate)


# --- dropout ------------------------------------------------------------------------------

def dropout_kernel_ok(x: torch.Tensor, p: float) -> bool:
    """The compiled dropout takes: x of a supported dtype on the CPU (the only device it has a kernel for),
    non-empty, fewer than 2^32 elements; 0 < p < 1."""
    key = _KEY.get(x.device.type)
    return (key is not None and key in _KERNELS.get("dropout", ()) and x.dtype in _DTYPES[x.device.type]
            and 0 < x.numel() < 2 ** 32 and 0 < p < 1)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """x * mask / (1 - p), each element kept with probability 1 - p, in training; x otherwise."""
    if not training or p == 0:
        return x
    if dropout_kernel_ok(x, p):
        seed = torch.randint(0, 2 ** 62, (), dtype=torch.int64)  # torch's CPU generator
        return torch.ops.bertctl.dropout(x, float(p), seed)
    return torch.nn.functional.dropout(x, p, True)


# --- bias + dropout + residual + LayerNorm --------------------------------------------------

def bias_dropout_add_layer_norm_available(device: str) -> bool:
    """Whether the compiled bias+dropout+residual+LayerNorm (and its backward) has a kernel for ``device``
    ("cpu", "cuda"): the model then runs its sub-layer outputs' matmuls without their bias."""
    key = _KEY.get(device)
    return key is not None and all(key in _KERNELS.get(name, ()) for name in
                                   ("bias_dropout_add_layer_norm", "bias_dropout_add_layer_norm_backward"))


def _seed(x: torch.Tensor) -> torch.Tensor:
    """A dropout seed from x's device generator: on the CPU as ``dropout`` draws it (the same stream
    either way); on CUDA on the device, read by the kernel when it runs (a CUDA graph's replay draws
    its own)."""
    if x.device.type == "cpu":
        return torch.randint(0, 2 ** 62, (), dtype=torch.int64)
    return torch.randint(0, 2 ** 62, (), dtype=torch.int64, device=x.device)


def bias_dropout_add_layer_norm_kernel_ok(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                          weight: torch.Tensor, ln_bias: torch.Tensor, p: float) -> bool:
    """The compiled bias+dropout+residual+LayerNorm takes: x of a supported dtype on a device with a kernel (CPU:
    fp64/fp32/fp16/bf16, CUDA: fp32/fp16/bf16), at least 1-D, non-empty, fewer than 2^32 elements; bias, weight and ln_bias 1-D of size
    H = x.shape[-1], x's dtype or float32, weight and ln_bias one dtype; a residual of x's shape, dtype, device;
    0 <= p < 1."""
    if not (_has_kernel("bias_dropout_add_layer_norm", x) and x.dim() >= 1 and 0 < x.numel() < 2 ** 32
            and 0 <= p < 1):
        return False
    if not (_param_ok(x, bias) and _param_ok(x, weight) and _param_ok(x, ln_bias) and weight.dtype == ln_bias.dtype):
        return False
    return residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device


def bias_dropout_add_layer_norm(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                ln_bias: torch.Tensor, eps: float, p: float, training: bool = True) -> torch.Tensor:
    """LayerNorm(dropout(x + bias) + residual) over the last dim, dropout p in training only; output in x's dtype
    (promoted with residual's)."""
    if residual.dtype != x.dtype:  # mixed precision, as in layer_norm
        common = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(common), residual.to(common)
    p = float(p) if training else 0.0
    if bias_dropout_add_layer_norm_kernel_ok(x, bias, residual, weight, ln_bias, p):
        seed = _seed(x) if p > 0 else None
        return torch.ops.bertctl.bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, float(eps), p,
                                                             seed)[0]
    return layer_norm(dropout(x + bias, p, training), weight, ln_bias, eps, residual=residual)


# --- softmax cross-entropy -------------------------------------------------------------------

def cross_entropy_kernel_ok(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """The compiled cross-entropy takes: logits (N, V) of a supported dtype on a device with a kernel, N > 0,
    0 < V < 2^31; labels (N,) int64 on the same device."""
    return (_has_kernel("cross_entropy", logits) and logits.dim() == 2 and logits.shape[0] > 0
            and 0 < logits.shape[1] < 2 ** 31 and labels.dtype == torch.int64
            and tuple(labels.shape) == (logits.shape[0],) and labels.device == logits.device)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                  ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, argmax) per row of logits (N, V); see the module docstring."""
    if cross_entropy_kernel_ok(logits, labels):
        loss, _, argmax = torch.ops.bertctl.cross_entropy(logits, labels, int(ignore_index))
        return loss, argmax
    return reference.cross_entropy(logits, labels, ignore_index)


# --- concatenation with column sums --------------------------------------------------------

def concat_column_sums(blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``torch.cat(blocks, dim=1)``, its column sums in the blocks' dtype) for 2-D blocks with the same
    rows: the compiled op where it has a kernel for them (on CUDA one pass, the sums taken from the
    values on their way to the output), else the two ATen ops. For backward passes: no autograd, so
    the op runs only with grad mode off."""
    x = blocks[0]
    key = _KEY.get(x.device.type)
    if (key in _KERNELS.get("concat_column_sums", ()) and x.dtype in _DTYPES[x.device.type]
            and not torch.is_grad_enabled() and len(blocks) <= 4
            and all(b.dim() == 2 and b.shape[0] == x.shape[0] and b.dtype == x.dtype and b.device == x.device
                    for b in blocks)):
        out, sums = torch.ops.bertctl.concat_column_sums(list(blocks))
        return out, sums
    out = torch.cat(blocks, dim=1)
    return out, out.sum(0)


# --- registration: fake (meta) kernels for torch.compile ------------------------------------
# (autograd is in C++, csrc/autograd.cpp, on the Autograd dispatch key)

def _register() -> None:
    lib = "bertctl::"

    @torch.library.register_fake(lib + "softmax")
    def _softmax_fake(x, mask, scale):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "softmax_backward")
    def _softmax_backward_fake(grad_y, y, scale):
        return y.new_empty(y.shape)

    def _stats_dtype(x):
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    @torch.library.register_fake(lib + "layer_norm")
    def _layer_norm_fake(x, residual, weight, bias, eps):
        stats = x.new_empty(x.shape[:-1], dtype=_stats_dtype(x))
        return x.new_empty(x.shape), stats, stats.new_empty(stats.shape)

    @torch.library.register_fake(lib + "layer_norm_inference")
    def _layer_norm_inference_fake(x, residual, weight, bias, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "layer_norm_backward")
    def _layer_norm_backward_fake(grad_y, x, residual, weight, mean, rstd):
        return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)

    @torch.library.register_fake(lib + "bias_gelu")
    def _bias_gelu_fake(x, bias, approximate):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "dropout")
    def _dropout_fake(x, p, seed):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "bias_gelu_backward")
    def _bias_gelu_backward_fake(grad_y, x, bias, approximate):
        return x.new_empty(x.shape), bias.new_empty(bias.shape)

    @torch.library.register_fake(lib + "bias_dropout_add_layer_norm")
    def _bias_dropout_add_layer_norm_fake(x, bias, residual, weight, ln_bias, eps, p, seed):
        stats = x.new_empty(x.shape[:-1], dtype=_stats_dtype(x))
        return x.new_empty(x.shape), stats, stats.new_empty(stats.shape)

    @torch.library.register_fake(lib + "bias_dropout_add_layer_norm_backward")
    def _bias_dropout_add_layer_norm_backward_fake(grad_y, x, bias, residual, weight, mean, rstd, p, seed):
        dx = x.new_empty(x.shape if p > 0 else (0,))  # p = 0: dx is dresidual, returned empty
        return (dx, bias.new_empty(bias.shape), x.new_empty(x.shape), weight.new_empty(weight.shape),
                weight.new_empty(weight.shape))

    @torch.library.register_fake(lib + "bias_dropout_add_layer_norm_backward_from_output")
    def _bias_dropout_add_layer_norm_backward_from_output_fake(grad_y, y, bias, weight, ln_bias, rstd, p, seed):
        dx = y.new_empty(y.shape if p > 0 else (0,))  # p = 0: dx is dresidual, returned empty
        return (dx, bias.new_empty(bias.shape), y.new_empty(y.shape), weight.new_empty(weight.shape),
                weight.new_empty(weight.shape))

    @torch.library.register_fake(lib + "concat_column_sums")
    def _concat_column_sums_fake(blocks):
        width = sum(b.shape[1] for b in blocks)
        return blocks[0].new_empty((blocks[0].shape[0], width)), blocks[0].new_empty((width,))

    @torch.library.register_fake(lib + "cross_entropy")
    def _cross_entropy_fake(logits, labels, ignore_index):
        n = logits.shape[0]
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return logits.new_empty((n,), dtype=acc), logits.new_empty((n,), dtype=acc), \
            logits.new_empty((n,), dtype=torch.int64)

    @torch.library.register_fake(lib + "cross_entropy_backward")
    def _cross_entropy_backward_fake(grad_loss, logits, labels, lse, ignore_index):
        n, v = logits.shape
        if logits.device.type != "cuda":
            return logits.new_empty((n, v))
        per16 = 16 // logits.element_size()  # CUDA: rows on 16-byte boundaries, a view of the first V columns
        return logits.new_empty_strided((n, v), (-(-v // per16) * per16, 1))


if compiled() is not None and _KERNELS:
    _register()
