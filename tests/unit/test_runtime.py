"""The one runtime decision (``bertctl.runtime.resolve``): device, precision, graphs, attention, kernels."""
from __future__ import annotations

import pytest

from bertctl import runtime as R
from bertctl.errors import BertctlError


def test_the_cpu_resolves_without_torch_and_auto_precision_is_fp32_there():
    rt = R.resolve("cpu")
    assert (rt.device, rt.device_type, rt.precision, rt.cuda_graphs, rt.device_index) == ("cpu", "cpu", "fp32", False,
                                                                                          None)
    assert rt.graphs_unsupported == "they need a CUDA device"
    assert str(rt.torch_device) == "cpu"


def test_precision_choices_and_their_errors():
    assert R.resolve_precision("auto", "cuda") == "bf16"
    assert R.resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(BertctlError, match=r"--precision fp16 needs a GPU \(use fp32 or bf16 on the CPU\)"):
        R.resolve("cpu", "fp16")
    with pytest.raises(BertctlError, match="--precision must be auto, bf16, fp16 or fp32, not 'fp8'"):
        R.resolve_precision("fp8", "cuda")


def test_device_names_and_indices():
    assert [R.device_index(n) for n in ("auto", "cuda", "cuda:3", "cpu", "mps")] == [0, 0, 3, None, None]
    with pytest.raises(BertctlError, match="--device: unknown device 'nonsense'"):
        R.resolve_device("nonsense")


def test_cuda_graphs_asked_for_on_the_cpu_is_one_clear_error():
    assert R.resolve("cpu", cuda_graphs=None).cuda_graphs is False
    with pytest.raises(BertctlError, match="--cuda-graphs: they need a CUDA device"):
        R.resolve("cpu", cuda_graphs=True)


def test_attention_and_kernels_follow_the_request():
    assert R.resolve("cpu").attn == "unpadded"
    assert R.resolve("cpu", compile=True).attn == "sdpa"
    assert R.resolve("cpu", attn="explicit").attn == "explicit"
    torch_ops = R.resolve("cpu", kernels="torch", packed_data=True)
    assert (torch_ops.fused, torch_ops.own_masks, torch_ops.attn) == (False, False, "unpadded")
    fused = R.resolve("cpu", kernels="fused", dropout_masks="torch")
    assert (fused.fused, fused.own_masks) == (True, False)
    assert R.resolve("cpu", kernels="fused").own_masks
    assert R.resolve("cpu", kernels="auto").fused == R.kernels_built()
    with pytest.raises(BertctlError, match="attention backend must be one of"):
        R.resolve("cpu", attn="flash")
    with pytest.raises(BertctlError, match="kernels must be one of"):
        R.resolve("cpu", kernels="cuda")
    default = R.default()  # a model built without a runtime
    assert (default.device, default.attn, default.fused, default.own_masks) == ("cpu", "sdpa", R.kernels_built(),
                                                                               R.kernels_built())
