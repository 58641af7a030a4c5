"""Each sub-layer step of the encoder through bertctl's fused ops (``bertctl.ops``) or plain PyTorch.

The model's runtime decides which (``Runtime.fused``), and whose dropout masks training draws
(``Runtime.own_masks``). Each helper here is one step of the post-LN layer: LN(x + residual),
dropout, act(x W^T + b), LN(Dropout(h W^T + b) + residual); the fused path gives the same maths
(tests/unit/test_fused_model.py holds it to the plain one).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bertctl import ops
from bertctl.config import GELU_APPROXIMATION
from bertctl.nn.projections import linear


def activation(name: str):
    """The function for a config's ``hidden_act``."""
    if name in GELU_APPROXIMATION:
        return lambda x: F.gelu(x, approximate=GELU_APPROXIMATION[name])
    if name == "relu":
        return F.relu
    if name == "tanh":
        return torch.tanh
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported hidden_act {name!r}")


def layer_norm(ln: nn.LayerNorm, x: torch.Tensor, residual: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """LN(x + residual): one fused op, or the add then torch's LayerNorm.

    Under autocast the fused path keeps the residual stream in the autocast dtype (bf16/fp16 in
    and out, fp32 statistics and parameters, as apex's mixed LayerNorm): half the bytes of the
    fp32 stream that torch's autocast LayerNorm produces, and no casts before the next matmul.
    """
    if fused:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x = x.to(dtype)
            residual = None if residual is None else residual.to(dtype)
        return ops.layer_norm(x, ln.weight, ln.bias, ln.eps, residual=residual)
    return ln(x if residual is None else x + residual)


def dropout(module: nn.Dropout, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """The module's dropout: with fused kernels bertctl's (on the CPU a hashed mask, recomputed in
    the backward, where torch draws each element from a Mersenne Twister), else torch's."""
    return ops.dropout(x, module.p, module.training) if fused else module(x)


def dense_dropout_add_norm(dense: nn.Linear, drop: nn.Dropout, ln: nn.LayerNorm, h: torch.Tensor,
                           residual: torch.Tensor, fused: bool, own: bool = True) -> torch.Tensor:
    """LN(Dropout(h W^T + b) + residual).

    With fused kernels (CPU and CUDA): the matmul without its bias, then one op for the bias, dropout,
    residual add and LayerNorm (its mask a hash of a seed and the element's index; on the CPU the mask
    that ``dropout`` would draw, so the same seed trains the same), which never writes the dropped-out
    sum or a mask to memory.  Otherwise the Linear, the dropout, then LN(x + residual): so too in training
    without ``own`` masks (``Runtime.own_masks``), with torch's dropout.
    """
    device = h.device.type
    dropping = drop.training and drop.p > 0
    if fused and (own or not dropping) and ops.bias_dropout_add_layer_norm_available(device):
        y = linear(h, dense.weight)  # (..., H), the bias added by the fused op
        if torch.is_autocast_enabled(device):  # as layer_norm: the residual stream in the autocast dtype
            dtype = torch.get_autocast_dtype(device)
            y, residual = y.to(dtype), residual.to(dtype)
        return ops.bias_dropout_add_layer_norm(y, dense.bias, residual, ln.weight, ln.bias, ln.eps, drop.p,
                                               drop.training)
    return layer_norm(ln, dropout(drop, dense(h), fused and own), residual, fused)


def dense_act(dense: nn.Linear, act_name: str, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """act(x W^T + b): with fused kernels the bias add and GELU are one op after the matmul."""
    return bias_act(dense, act_name, linear(x, dense.weight) if fuses_bias(act_name, fused) else dense(x), fused)


def fuses_bias(act_name: str, fused: bool) -> bool:
    """Whether ``bias_act`` adds the bias itself (the fused bias + GELU op), so the matmul goes without it."""
    return fused and act_name in GELU_APPROXIMATION


def bias_act(dense: nn.Linear, act_name: str, h: torch.Tensor, fused: bool) -> torch.Tensor:
    """act(h + b) for the matmul output h, which already holds the bias unless ``fuses_bias``."""
    if fuses_bias(act_name, fused):
        return ops.bias_gelu(h, dense.bias, approximate=GELU_APPROXIMATION[act_name])
    return activation(act_name)(h)
