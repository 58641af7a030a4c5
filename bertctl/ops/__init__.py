"""Fused ops used by the model: softmax (attention), LayerNorm(+residual), bias+GELU.

Public entry points (stable; the model calls only these):

- ``softmax(scores, mask=None, scale=1.0)``: softmax(scale * scores + mask) over the
  last dim.  ``scores`` (B, heads, Sq, Sk).  ``mask`` is a key-padding mask of shape
  (B, Sk): bool (True = attend) or additive float (0 / -inf or a large negative).
  Fully masked rows give exact zeros.
- ``layer_norm(x, weight, bias, eps, residual=None)``: LayerNorm(x + residual).
- ``bias_gelu(x, bias, approximate="none")``: GELU(x + bias), "none" = exact erf, "tanh".

This file currently holds the plain-PyTorch versions; the compiled kernels replace
them where available.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def softmax(scores: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    x = scores.float() * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            x = x.masked_fill(~mask[:, None, None, :], float("-inf"))
        else:
            x = x + mask[:, None, None, :].float()
    y = torch.softmax(x, dim=-1)
    # A fully masked row is all -inf: softmax gives NaN there; define it as zeros.
    y = torch.nan_to_num(y, nan=0.0)
    return y.to(scores.dtype)


def layer_norm(x, weight, bias, eps: float, residual=None):
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def bias_gelu(x, bias, approximate: str = "none"):
    return F.gelu(x + bias, approximate=approximate)
