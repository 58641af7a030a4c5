"""Load the compiled extension ``bertctl._C`` once; fall back to plain PyTorch without it."""
from __future__ import annotations

import functools
import os
import warnings

from bertctl.errors import BertctlError

# The ops of csrc/bertctl.cpp: each forward, its backward, LayerNorm's forward without statistics, and the
# backward passes' concatenation with column sums.
OP_NAMES = ("softmax", "softmax_backward", "layer_norm", "layer_norm_backward", "layer_norm_inference", "bias_gelu", "bias_gelu_backward", "dropout", "bias_dropout_add_layer_norm",
            "bias_dropout_add_layer_norm_backward", "bias_dropout_add_layer_norm_backward_from_output",
            "cross_entropy", "cross_entropy_backward", "concat_column_sums")


@functools.lru_cache(maxsize=1)
def compiled():
    """The ``bertctl._C`` module, or None (said once) when it is missing or disabled.

    ``BERTCTL_NO_EXT=1`` disables it on purpose (used by tests of the fallback).
    ``BERTCTL_REQUIRE_EXT=1`` makes a module that fails to import an error instead of a warning
    (CI and the test suite set it).
    """
    if os.environ.get("BERTCTL_NO_EXT") == "1":
        return None
    try:
        from bertctl import _C  # noqa: F401  (importing registers the torch.ops.bertctl ops)
    except ImportError as e:
        if os.environ.get("BERTCTL_REQUIRE_EXT") == "1":
            raise BertctlError(
                f"BERTCTL_REQUIRE_EXT=1 but the compiled kernels bertctl._C did not load ({e}); "
                "build them with `pip install --no-build-isolation -e .`") from e
        warnings.warn(
            f"bertctl: compiled kernels unavailable ({e}); using plain PyTorch ops",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return _C


def kernels_loaded() -> dict[str, list[str]]:
    """Which compiled ops are registered, and for which dispatch keys (devices)."""
    import torch

    if compiled() is None:
        return {}
    out: dict[str, list[str]] = {}
    for name in OP_NAMES:
        if not hasattr(torch.ops.bertctl, name):
            continue
        packet = getattr(torch.ops.bertctl, name)
        op = packet.default
        keys = [k for k in ("CPU", "CUDA") if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k)]
        out[name] = keys
    return out
