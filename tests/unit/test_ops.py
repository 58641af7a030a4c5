"""The fused ops (bertctl.ops) against a float64 reference, on CPU and (marked cuda) on a GPU.

The reference is ``bertctl.ops.reference`` evaluated in float64 on the same (rounded)
inputs; its hand-derived backward is itself checked against torch autograd here.
"""
from __future__ import annotations

import math
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bertctl import ops
from bertctl._ext import kernels_loaded
from bertctl.ops import reference

OP_NAMES = ("softmax", "softmax_backward", "layer_norm", "layer_norm_backward", "layer_norm_inference", "bias_gelu",
            "bias_gelu_backward", "dropout", "bias_dropout_add_layer_norm", "bias_dropout_add_layer_norm_backward",
            "bias_dropout_add_layer_norm_backward_from_output", "cross_entropy", "cross_entropy_backward",
            "concat_column_sums")
SIZES = (1, 7, 13, 127, 768, 1000, 1024, 4096)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One rounding of an O(1) result: fp32 math inside; fp16 has 11 significant bits, bf16 8.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

pytestmark = pytest.mark.usefixtures("fused_kernels")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1.0) -> None:
    """assert_close against a float64 reference, tolerances of `dtype` (atol times `scale` for large sums)."""
    tol = dict(TOL[dtype])
    tol["atol"] *= scale
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), **tol, equal_nan=False,
                               msg=lambda m: f"{what} ({dtype}):\n{m}")


def rand(*shape, dtype, device, std=1.0, gen=None):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(device=device, dtype=dtype)


# --- softmax ------------------------------------------------------------------------------

def make_mask(kind: str, B: int, Sk: int, device, gen) -> torch.Tensor | None:
    if kind == "none":
        return None
    keep = torch.rand(B, Sk, generator=gen) < 0.7
    keep[:, 0] = True
    keep[-1] = False  # the last batch element is fully masked
    if kind == "bool":
        return keep.to(device)
    if kind == "additive_inf":
        return torch.zeros(B, Sk).masked_fill(~keep, float("-inf")).to(device)
    if kind == "additive_4d":  # the (B, 1, 1, Sk) layout, large finite negative, bf16
        return torch.zeros(B, Sk).masked_fill(~keep, -10000.0)[:, None, None, :].to(device, torch.bfloat16)
    raise AssertionError(kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sk", SIZES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive_inf", "additive_4d"])
def test_softmax_matches_float64(device, dtype, Sk, mask_kind):
    gen = torch.Generator().manual_seed(Sk)
    B, H, Sq, scale = 3, 2, 5, 0.125
    x = rand(B, H, Sq, Sk, dtype=dtype, device=device, std=8.0, gen=gen).requires_grad_()
    mask = make_mask(mask_kind, B, Sk, device, gen)
    assert ops.softmax_kernel_ok(x, mask)
    y = ops.softmax(x, mask, scale)
    ref_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    y_ref = reference.softmax_forward(x.detach().double(), ref_mask, scale)
    assert y.dtype == dtype and y.shape == x.shape
    if mask_kind == "additive_4d":
        # A row masked with a finite -1e4 everywhere is softmax of (-1e4 + small): fp32 keeps only ~3 digits
        # of the small part, so that row is compared for being a distribution; the others exactly.
        torch.testing.assert_close(y[-1].double().sum(-1).cpu(), torch.ones(H, Sq, dtype=torch.float64),
                                   **TOL[dtype])
        y, y_ref = y[:-1], y_ref[:-1]
    close(y, y_ref, dtype, "softmax forward")
    if mask_kind in ("bool", "additive_inf"):  # fully masked rows: exact zeros, and zero gradient
        assert torch.equal(y[-1].detach().cpu(), torch.zeros_like(y[-1].cpu()))
    dy = rand(*y.shape, dtype=dtype, device=device, gen=gen)
    (dx,) = torch.autograd.grad(y, x, dy)
    dx = dx[: y.shape[0]]
    dx_ref = reference.softmax_backward(dy.double(), y_ref, scale)
    close(dx, dx_ref, dtype, "softmax backward")
    if mask_kind in ("bool", "additive_inf"):
        assert torch.equal(dx[-1].cpu(), torch.zeros_like(dx[-1].cpu()))


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_noncontiguous_and_3d(device):
    gen = torch.Generator().manual_seed(1)
    base = rand(2, 64, 3, 48, dtype=torch.float32, device=device, gen=gen)
    x = base.transpose(1, 2)  # (2, 3, 64, 48), not contiguous
    assert not x.is_contiguous()
    mask = torch.rand(2, 48, generator=gen).to(device) > 0.3
    close(ops.softmax(x, mask, 0.5), reference.softmax_forward(x.double(), mask, 0.5), torch.float32, "non-contiguous")
    z = rand(4, 9, 33, dtype=torch.float32, device=device, gen=gen)  # any rank without a mask
    close(ops.softmax(z, None, 2.0), torch.softmax(2.0 * z.double(), -1), torch.float32, "3-d")


def test_softmax_other_mask_shapes_fall_back():
    x = torch.randn(2, 3, 4, 5)
    full = torch.randn(2, 1, 4, 5)  # a (B, 1, Sq, Sk) mask is not a key-padding mask: plain PyTorch path
    assert not ops.softmax_kernel_ok(x, full)
    close(ops.softmax(x, full, 1.0), torch.softmax(x.double() + full.double(), -1), torch.float32, "fallback")


# --- LayerNorm ----------------------------------------------------------------------------

def check_layer_norm(x, res, w, b, eps, gen, tol_dtype):
    """ops.layer_norm and its gradients (x, weight, bias, residual) against the float64 reference on
    the same rounded inputs, at the tolerances of ``tol_dtype``; dweight/dbias are sums over the
    rows, so their atol grows with sqrt(rows)."""
    rows = x.numel() // x.shape[-1]
    y = ops.layer_norm(x, w, b, eps, residual=res)
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    y_ref, mean, rstd = reference.layer_norm_forward(d(x), d(res), d(w), d(b), eps)
    assert y.dtype == x.dtype
    close(y, y_ref, tol_dtype, "layer_norm forward")
    dy = rand(*x.shape, dtype=x.dtype, device=x.device, gen=gen)
    inputs = (x, w, b) + ((res,) if res is not None else ())
    grads = torch.autograd.grad(y, inputs, dy)
    dx_ref, dw_ref, db_ref = reference.layer_norm_backward(dy.double(), d(x), d(res), d(w), mean, rstd)
    close(grads[0], dx_ref, tol_dtype, "layer_norm dx")
    close(grads[1], dw_ref, tol_dtype, "layer_norm dweight", scale=rows**0.5)
    close(grads[2], db_ref, tol_dtype, "layer_norm dbias", scale=rows**0.5)
    if res is not None:
        close(grads[3], dx_ref, tol_dtype, "layer_norm dresidual")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", SIZES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_matches_float64(device, dtype, H, with_residual):
    gen = torch.Generator().manual_seed(H)
    N, eps = 37, 1e-12
    x = rand(N, H, dtype=dtype, device=device, std=3.0, gen=gen).add_(1.5).requires_grad_()
    res = rand(N, H, dtype=dtype, device=device, gen=gen).requires_grad_() if with_residual else None
    # bf16/fp16 activations keep fp32 parameters (mixed precision); fp32 has fp32 ones.
    w = rand(H, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    b = rand(H, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    assert ops.layer_norm_kernel_ok(x, w, b, res)
    check_layer_norm(x, res, w, b, eps, gen, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_16bit_params_and_mixed_residual(device, dtype):
    gen = torch.Generator().manual_seed(3)
    x = rand(8, 4, 96, dtype=dtype, device=device, gen=gen)
    w, b = rand(96, dtype=dtype, device=device, gen=gen), rand(96, dtype=dtype, device=device, gen=gen)
    close(ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x.double(), (96,), w.double(), b.double(), 1e-5), dtype, "16-bit")
    res32 = rand(8, 4, 96, dtype=torch.float32, device=device, gen=gen)  # bf16 sublayer + fp32 residual stream
    y = ops.layer_norm(x, w, b, 1e-5, residual=res32)
    assert y.dtype == torch.float32
    close(y, F.layer_norm(x.double() + res32.double(), (96,), w.double(), b.double(), 1e-5), torch.float32, "mixed")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H", [264, 1000, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_16bit_params_vector_rows(device, dtype, H, with_residual):
    """16-bit activations with 16-bit weight/bias on the 16-byte vector path, where the CUDA
    forward loads weight and bias with the row (H = 1000 leaves the last vectors of a lane empty)."""
    gen = torch.Generator().manual_seed(H + with_residual)
    N = 67
    x = rand(N, H, dtype=dtype, device=device, std=2.0, gen=gen).add_(-0.7)
    res = rand(N, H, dtype=dtype, device=device, gen=gen) if with_residual else None
    w = rand(H, dtype=dtype, device=device, gen=gen)
    b = rand(H, dtype=dtype, device=device, gen=gen)
    assert ops.layer_norm_kernel_ok(x, w, b, res)
    y, mean, rstd = torch.ops.bertctl.layer_norm(x, res, w, b, 1e-12)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    y_ref, mean_ref, rstd_ref = reference.layer_norm_forward(d(x), d(res), d(w), d(b), 1e-12)
    close(y, y_ref, dtype, "layer_norm forward")
    close(mean.reshape(-1), mean_ref.reshape(-1), torch.float32, "layer_norm mean")
    close(rstd.reshape(-1), rstd_ref.reshape(-1), torch.float32, "layer_norm rstd")


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_noncontiguous(device):
    gen = torch.Generator().manual_seed(4)
    x = rand(64, 10, dtype=torch.float32, device=device, gen=gen).t()  # (10, 64) view
    res = rand(10, 128, dtype=torch.float32, device=device, gen=gen)[:, ::2]
    w = rand(128, dtype=torch.float32, device=device, gen=gen)[::2]
    b = rand(64, dtype=torch.float32, device=device, gen=gen)
    assert not (x.is_contiguous() or res.is_contiguous() or w.is_contiguous())
    expected = F.layer_norm(x.double() + res.double(), (64,), w.double(), b.double(), 1e-12)
    close(ops.layer_norm(x, w, b, 1e-12, residual=res), expected, torch.float32, "non-contiguous")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,H,param_dtype", [(torch.bfloat16, 768, torch.bfloat16),
                                                 (torch.float16, 1024, torch.float32),
                                                 (torch.float32, 768, torch.float32)])
def test_layer_norm_many_rows(device, dtype, H, param_dtype):
    """Enough rows that every block of the backward walks several of them and the column
    sums of dweight/dbias add many partials (the BERT shapes take these code paths)."""
    gen = torch.Generator().manual_seed(H + 1)
    N = 3001
    x = rand(N, H, dtype=dtype, device=device, std=2.0, gen=gen).add_(0.5).requires_grad_()
    res = rand(N, H, dtype=dtype, device=device, gen=gen).requires_grad_()
    w = rand(H, dtype=param_dtype, device=device, gen=gen).requires_grad_()
    b = rand(H, dtype=param_dtype, device=device, gen=gen).requires_grad_()
    y = ops.layer_norm(x, w, b, 1e-12, residual=res)
    d = lambda t: t.detach().double()  # noqa: E731
    y_ref, mean, rstd = reference.layer_norm_forward(d(x), d(res), d(w), d(b), 1e-12)
    close(y, y_ref, dtype, "layer_norm forward")
    dy = rand(N, H, dtype=dtype, device=device, gen=gen)
    dx, dres, dw, db = torch.autograd.grad(y, (x, res, w, b), dy)
    dx_ref, dw_ref, db_ref = reference.layer_norm_backward(dy.double(), d(x), d(res), d(w), mean, rstd)
    close(dx, dx_ref, dtype, "layer_norm dx")
    close(dres, dx_ref, dtype, "layer_norm dresidual")
    pt = param_dtype if param_dtype != torch.float32 else dtype
    close(dw, dw_ref, pt, "layer_norm dweight", scale=N**0.5)
    close(db, db_ref, pt, "layer_norm dbias", scale=N**0.5)


# The CPU kernels write y and dx with streaming stores (and LayerNorm prefetches the backward's rows
# into L2) once the bytes an op moves reach these sizes (kStreamTraffic* in csrc/cpu/layer_norm.cpp
# and csrc/cpu/bias_gelu.cpp).
CPU_STREAM_TRAFFIC_FWD, CPU_STREAM_TRAFFIC_BWD = 32 * 2**20, 16 * 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("H", [768, 1000])  # 1000: rows start off the vector boundaries
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_cpu_streamed_outputs(dtype, H, with_residual):
    """Tensors large enough for the CPU kernel's streaming-store path, forward and backward."""
    gen = torch.Generator().manual_seed(H + with_residual)
    itemsize = torch.empty((), dtype=dtype).element_size()
    N = -(-CPU_STREAM_TRAFFIC_FWD // (H * itemsize * (3 if with_residual else 2))) + 5
    assert N * H * itemsize * (4 if with_residual else 3) >= CPU_STREAM_TRAFFIC_BWD
    x = rand(N, H, dtype=dtype, device="cpu", std=2.0, gen=gen).add_(0.5).requires_grad_()
    res = rand(N, H, dtype=dtype, device="cpu", gen=gen).requires_grad_() if with_residual else None
    w = rand(H, dtype=dtype, device="cpu", gen=gen).requires_grad_()
    b = rand(H, dtype=dtype, device="cpu", gen=gen).requires_grad_()
    # fp64 has no entry in TOL: it is compared at fp32 tolerance, far looser than it needs.
    check_layer_norm(x, res, w, b, 1e-12, gen, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [8, 4096])  # 4096 x 768 and x 1000 fp32 take the CPU streaming path
@pytest.mark.parametrize("H", [768, 1000])
def test_layer_norm_constant_rows_cancel_exactly(device, N, H):
    """A constant row has variance 0, so with eps = 1e-12 rstd = 1e6 and dx = 1e6 (g*w - mean(g*w)).
    With g*w constant along the row that is exactly 0, provided the kernel rounds g*w the same way in
    the row sum and in dx: g = fp32(1/3) and w = 3 give g*w = 1 + 3e-8 before rounding and 1 after, so
    an unrounded product in either place leaves 1e6 * 3e-8 = 0.03 instead of 0."""
    gen = torch.Generator().manual_seed(N + H)
    level = torch.randn(N, 1, generator=gen)
    x = level.expand(N, H).contiguous().to(device).requires_grad_()
    res = torch.full((N, H), 0.25, device=device).requires_grad_()
    w = torch.full((H,), 3.0, device=device).requires_grad_()
    b = rand(H, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    y = ops.layer_norm(x, w, b, 1e-12, residual=res)
    assert torch.equal(y, b.detach().expand(N, H))  # (h - mean) is exactly 0
    dy = torch.full((N, H), 1 / 3, device=device)
    dx, dres, dw, db = torch.autograd.grad(y, (x, res, w, b), dy)
    assert torch.count_nonzero(dx) == 0 and torch.count_nonzero(dres) == 0, dx.abs().max()
    assert torch.count_nonzero(dw) == 0
    close(db, torch.full((H,), N * dy[0, 0].double().item(), dtype=torch.float64), torch.float32, "dbias")


class OpsRun(TorchDispatchMode):
    """Records the name of every op that reaches the kernels (below autograd)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", (7, 768, 1000, 1024, 4096))
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_without_gradients_stores_no_statistics(device, dtype, H, with_residual):
    """Where no gradient is recorded, ops.layer_norm runs layer_norm_inference (no mean/rstd written):
    the same y as the training op, bit for bit, and within the dtype's tolerance of float64.  With an
    input that requires grad it runs the training op."""
    gen = torch.Generator().manual_seed(H + 1)
    x = rand(37, H, dtype=dtype, device=device, std=3.0, gen=gen).add_(1.5)
    res = rand(37, H, dtype=dtype, device=device, gen=gen) if with_residual else None
    # parameters of the activation dtype: the 16-bit vector kernel on CUDA for H <= 1024
    w, b = (rand(H, dtype=dtype, device=device, gen=gen) for _ in range(2))
    d = lambda t: None if t is None else t.double()  # noqa: E731
    y_ref = reference.layer_norm_forward(d(x), d(res), d(w), d(b), 1e-12)[0]
    y_train = torch.ops.bertctl.layer_norm(x, res, w, b, 1e-12)[0]
    for grad_mode in (False, True):  # grad mode on, but nothing requires grad: still nothing to record
        with torch.set_grad_enabled(grad_mode), OpsRun() as run:
            y = ops.layer_norm(x, w, b, 1e-12, residual=res)
        assert run.names == ["bertctl::layer_norm_inference"]
        assert torch.equal(y, y_train)
        close(y, y_ref, dtype, "layer_norm_inference")
    w.requires_grad_()
    with OpsRun() as run:
        y = ops.layer_norm(x, w, b, 1e-12, residual=res)
    assert run.names == ["bertctl::layer_norm"] and y.requires_grad


def test_layer_norm_inference_refuses_to_record_a_gradient():
    x = torch.randn(4, 8, requires_grad=True)
    w, b = torch.ones(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match="layer_norm_inference has no backward"):
        torch.ops.bertctl.layer_norm_inference(x, None, w, b, 1e-5)
    with torch.no_grad():
        y = torch.ops.bertctl.layer_norm_inference(x, None, w, b, 1e-5)
    close(y, F.layer_norm(x.detach().double(), (8,), eps=1e-5), torch.float32, "no grad")


# --- bias + GELU --------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", SIZES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_matches_float64(device, dtype, H, approximate):
    gen = torch.Generator().manual_seed(H)
    N = 19
    x = rand(N, H, dtype=dtype, device=device, std=2.0, gen=gen).requires_grad_()
    b = rand(H, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    assert ops.bias_gelu_kernel_ok(x, b, approximate)
    y = ops.bias_gelu(x, b, approximate)
    # torch's own GELU in float64 is the independent reference here.
    y_ref = F.gelu(x.detach().double() + b.detach().double(), approximate=approximate)
    assert y.dtype == dtype
    close(y, y_ref, dtype, "bias_gelu forward")
    dy = rand(N, H, dtype=dtype, device=device, gen=gen)
    dx, db = torch.autograd.grad(y, (x, b), dy)
    xd, bd = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    dx_ref, db_ref = torch.autograd.grad(F.gelu(xd + bd, approximate=approximate), (xd, bd), dy.double())
    close(dx, dx_ref, dtype, "bias_gelu dx")
    close(db, db_ref, dtype, "bias_gelu dbias", scale=N**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("H", [3072, 1037])  # 1037: rows start off the vector boundaries
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_cpu_streamed_outputs(dtype, H, approximate):
    """Tensors large enough for the CPU kernel's streaming-store path (forward reads x, writes y;
    backward reads dy, x, writes dx), against torch's GELU in float64."""
    gen = torch.Generator().manual_seed(H)
    itemsize = torch.empty((), dtype=dtype).element_size()
    N = -(-CPU_STREAM_TRAFFIC_FWD // (2 * H * itemsize)) + 3
    x = rand(N, H, dtype=dtype, device="cpu", std=2.0, gen=gen).requires_grad_()
    b = rand(H, dtype=dtype, device="cpu", gen=gen).requires_grad_()
    y = ops.bias_gelu(x, b, approximate)
    xd, bd = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    y_ref = F.gelu(xd + bd, approximate=approximate)
    # fp64 has no entry in TOL: it is compared at fp32 tolerance, far looser than it needs.
    close(y, y_ref.detach(), torch.float32, "bias_gelu forward, streamed")
    dy = rand(N, H, dtype=dtype, device="cpu", gen=gen)
    dx, db = torch.autograd.grad(y, (x, b), dy)
    dx_ref, db_ref = torch.autograd.grad(y_ref, (xd, bd), dy.double())
    close(dx, dx_ref, torch.float32, "bias_gelu dx, streamed")
    close(db, db_ref, torch.float32, "bias_gelu dbias, streamed", scale=N**0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gelu_noncontiguous_and_16bit_bias(device):
    gen = torch.Generator().manual_seed(5)
    x = rand(3, 40, 24, dtype=torch.bfloat16, device=device, gen=gen).transpose(0, 1)  # (40, 3, 24) view
    b = rand(24, dtype=torch.bfloat16, device=device, gen=gen)
    close(ops.bias_gelu(x, b), F.gelu(x.double() + b.double()), torch.bfloat16, "non-contiguous")


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gelu_more_row_chunks_than_one_grid_dimension(device):
    """140,000 rows of two-row chunks: more than a CUDA grid's 65,535 in y, so the forward's
    chunks spill into the grid's z dimension; every row must still be computed once."""
    gen = torch.Generator().manual_seed(11)
    x = rand(140_000, 8, dtype=torch.bfloat16, device=device, std=2.0, gen=gen)
    b = rand(8, dtype=torch.bfloat16, device=device, gen=gen)
    close(ops.bias_gelu(x, b), F.gelu(x.double() + b.double()), torch.bfloat16, "bias_gelu 140k rows")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 5e-5), (torch.bfloat16, 8e-3)])
def test_bias_gelu_negative_tail_relative_accuracy(device, dtype, rtol):
    """GELU(v) = v Phi(v) is tiny for v << 0 (-6e-9 at v = -6): the kernels must keep its
    relative accuracy there, not only an absolute one (float64 reference, no atol)."""
    v = torch.linspace(-10.0, -1.0, 4096, dtype=torch.float64)
    x = v.reshape(8, 512).to(device=device, dtype=dtype)
    b = torch.zeros(512, dtype=torch.float32, device=device)
    y = ops.bias_gelu(x, b).double().cpu()
    xd = x.double().cpu()
    y_ref = xd * 0.5 * torch.special.erfc(-xd / 2**0.5)  # erfc: no 1 + erf(-large) cancellation
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=0.0)


def test_bias_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        ops.bias_gelu(torch.randn(2, 3), torch.randn(3), approximate="sigmoid")


# --- softmax cross-entropy ------------------------------------------------------------------

def ce_inputs(N, V, dtype, device, gen, pad=0):
    """Logits (N, V) (a view of rows V + pad wide when pad > 0, as the vocabulary projection gives them),
    std 3, one row shifted by +1000 and one by -1000 (the max must be taken out before exp); labels with
    every third row ignored."""
    wide = torch.randn(N, V + pad, generator=gen, dtype=torch.float64) * 3
    wide[0] += 1000.0
    wide[-1] -= 1000.0
    x = wide.to(device=device, dtype=dtype)[:, :V].requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[1::3] = -100
    return x, labels.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,pad", [(1, 0), (7, 0), (1000, 0), (1003, 0), (30522, 6), (30522, 0), (4096, 8)])
def test_cross_entropy_matches_float64(device, dtype, V, pad):
    """Per-row loss, argmax and the logits' gradient against F.cross_entropy in float64 on the same rounded
    logits (rows of the 30,522-word vocabulary, contiguous and as a view of 30,528-wide rows)."""
    gen = torch.Generator().manual_seed(V + pad)
    x, labels = ce_inputs(37, V, dtype, device, gen, pad)
    assert ops.cross_entropy_kernel_ok(x, labels)
    loss, argmax = ops.cross_entropy(x, labels)
    assert loss.dtype == torch.float32 and argmax.dtype == torch.int64
    x64 = x.detach().double().cpu().requires_grad_()
    ref = F.cross_entropy(x64, labels.cpu(), ignore_index=-100, reduction="none")
    close(loss, ref, torch.float32, "loss", scale=50)  # |loss| up to ~40: a few fp32 ulps of the log-sum-exp
    assert torch.equal(argmax.cpu(), x64.detach().argmax(-1))
    g = torch.randn(37, generator=gen, dtype=torch.float64)
    dx, = torch.autograd.grad(loss, x, g.to(device, torch.float32))
    assert dx.dtype == dtype and dx.shape == x.shape
    dref, = torch.autograd.grad(ref, x64, g)
    close(dx, dref, dtype, "dlogits")
    assert torch.equal(dx[1::3].cpu(), torch.zeros_like(dx[1::3]).cpu())  # ignored rows: exact zeros


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_reference_and_reduction(device):
    """The compiled op and the plain-PyTorch fallback agree; summed over rows it is F.cross_entropy's sum."""
    gen = torch.Generator().manual_seed(3)
    x, labels = ce_inputs(64, 513, torch.float32, device, gen)
    loss, argmax = ops.cross_entropy(x, labels)
    ref_loss, ref_argmax = reference.cross_entropy(x, labels)
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-5)
    assert torch.equal(argmax, ref_argmax)
    total = F.cross_entropy(x.double(), labels, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss.sum().double(), total, atol=1e-3, rtol=1e-6)
    op_loss, lse, op_argmax = torch.ops.bertctl.cross_entropy(x.detach(), labels, -100)
    ref_rows = reference.cross_entropy_forward(x.detach().double(), labels, -100)
    for a, e in zip((op_loss, lse), ref_rows[:2]):
        torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-5)
    assert torch.equal(op_argmax, ref_rows[2])
    g = torch.randn(64, generator=gen, dtype=torch.float32).to(device)
    torch.testing.assert_close(torch.ops.bertctl.cross_entropy_backward(g, x.detach(), labels, lse, -100),
                               reference.cross_entropy_backward(g, x.detach(), labels, lse, -100), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_argmax_is_the_first_maximum(device):
    """Ties go to the first maximal index (torch.argmax's rule), wherever they fall in the row's vectors."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 100, generator=gen)
    for row, cols in enumerate(([3, 4], [17, 40], [0, 99], [63, 64], [98, 99], [5])):
        x[row, cols] = 10.0
    loss, argmax = ops.cross_entropy(x.to(device), torch.zeros(6, dtype=torch.int64, device=device))
    assert argmax.tolist() == [3, 17, 0, 63, 98, 5] == x.argmax(-1).tolist()


def test_cross_entropy_bad_label_is_an_error_on_cpu():
    x = torch.randn(3, 5)
    with pytest.raises(RuntimeError, match="label 5 of row 1 is outside"):
        ops.cross_entropy(x, torch.tensor([0, 5, -100]))


@pytest.mark.cuda
def test_cross_entropy_bad_label_gives_nan_on_cuda():
    x = torch.randn(3, 5, device="cuda")
    loss, _ = ops.cross_entropy(x, torch.tensor([0, 5, -100], device="cuda"))
    assert torch.isnan(loss[1]) and torch.isfinite(loss[0]) and loss[2] == 0


# --- concatenation with column sums ---------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,widths,strided", [
    (4096, (768, 768, 768), False),   # BERT-Base's QKV gradient: whole 16-byte vectors
    (1000, (64, 64, 64), True),       # rows of wider buffers (a view), a row count off the unroll
    (7, (13, 16, 5), False),          # widths that are no whole vectors: the element path
    (1, (8,), False),
    (0, (8, 8), False),
])
def test_concat_column_sums_matches_cat_and_float64_sums(device, dtype, rows, widths, strided):
    """The joined matrix is torch.cat's exactly; the column sums match float64 sums of the same values
    within one rounding of the sum (the inputs' magnitudes summed over up to 4096 rows)."""
    gen = torch.Generator().manual_seed(rows + sum(widths))
    blocks = []
    for w in widths:
        wide = rand(rows, w + (8 if strided else 0), dtype=dtype, device=device, gen=gen)
        blocks.append(wide[:, :w])
    assert all(b.is_contiguous() != strided or rows <= 1 for b in blocks)
    with torch.no_grad():
        out, sums = ops.concat_column_sums(blocks)
    assert out.dtype == dtype and sums.dtype == dtype and out.shape == (rows, sum(widths))
    assert torch.equal(out.cpu(), torch.cat(blocks, 1).cpu())
    ref = torch.cat(blocks, 1).double().sum(0).cpu()
    scale = max(1.0, rows ** 0.5)  # the sum of n unit normals has size sqrt(n): its rounding grows with it
    close(sums, ref, dtype, "column sums", scale=scale)


def test_concat_column_sums_refuses_mismatched_blocks():
    with pytest.raises(RuntimeError, match="block 1 has 3 rows, block 0 has 4"):
        torch.ops.bertctl.concat_column_sums([torch.zeros(4, 2), torch.zeros(3, 2)])
    with pytest.raises(RuntimeError, match="block 1 must be 2-D"):
        torch.ops.bertctl.concat_column_sums([torch.zeros(4, 2), torch.zeros(4)])


# --- the reference's hand-derived backward against autograd; gradcheck; opcheck ----------

def test_reference_backward_matches_autograd():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 4, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 9, generator=gen) > 0.3
    dy = torch.randn(2, 3, 4, 9, generator=gen, dtype=torch.float64)
    auto = torch.softmax((0.3 * x).masked_fill(~mask[:, None, None, :], float("-inf")), -1)
    torch.testing.assert_close(torch.autograd.grad(reference.softmax(x, mask, 0.3), x, dy),
                               torch.autograd.grad(auto, x, dy))
    h = torch.randn(5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.randn(5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(reference.layer_norm(h, w, b, 1e-5, r), (h, r, w, b), g),
                               torch.autograd.grad(F.layer_norm(h + r, (11,), w, b, 1e-5), (h, r, w, b), g))
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(torch.autograd.grad(reference.bias_gelu(h, b, approximate), (h, b), g),
                                   torch.autograd.grad(F.gelu(h + b, approximate=approximate), (h, b), g))
    c = torch.randn(11, generator=gen, dtype=torch.float64, requires_grad=True)
    for p, seed in ((0.25, torch.tensor(5)), (0.0, None)):
        dropped = reference.dropout_forward(h + c, p, seed) if p > 0 else h + c  # differentiable: a torch.where
        torch.testing.assert_close(
            torch.autograd.grad(reference.bias_dropout_add_layer_norm(h, c, r, w, b, 1e-5, p, seed), (h, c, r, w, b), g),
            torch.autograd.grad(F.layer_norm(dropped + r, (11,), w, b, 1e-5), (h, c, r, w, b), g))


def test_gradcheck_float64_cpu():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 7, generator=gen) > 0.3
    mask[:, 0] = True
    assert torch.autograd.gradcheck(lambda t: ops.softmax(t, mask, 0.7), (x,))
    h = torch.randn(4, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: ops.layer_norm(t[0], t[2], t[3], 1e-12, residual=t[1]), (h, r, w, b))
    for approximate in ("none", "tanh"):
        assert torch.autograd.gradcheck(lambda t, u: ops.bias_gelu(t, u, approximate), (h, b))
    labels = torch.tensor([3, -100, 0, 12])
    assert torch.autograd.gradcheck(lambda t: ops.cross_entropy(t, labels)[0], (h,))
    wide = torch.randn(4, 16, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: ops.cross_entropy(t[:, :13], labels)[0], (wide.requires_grad_(),))


def test_create_graph_first_order_right_second_order_refused():
    """Under create_graph=True the first-order gradients equal the float64 reference's; trying to
    differentiate them again raises a clear error (the backward ops have no derivative), where an op
    without an autograd kernel would silently drop the second-order terms."""
    gen = torch.Generator().manual_seed(11)
    h = torch.randn(4, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    s = torch.randn(2, 2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    w_dead = w.detach().clone()
    w_dead[3] = 0.0  # no xhat from y: the backward from the input
    w_dead.requires_grad_()
    cases = [
        ("layer_norm_backward", ops.layer_norm(h, w, b, 1e-12, residual=r),
         F.layer_norm(h + r, (13,), w, b, 1e-12), (h, r, w, b)),
        ("bias_gelu_backward", ops.bias_gelu(h, b, "none"), F.gelu(h + b), (h, b)),
        ("softmax_backward", ops.softmax(s, None, 0.7), torch.softmax(0.7 * s, -1), (s,)),
        ("bias_dropout_add_layer_norm_backward",
         ops.bias_dropout_add_layer_norm(h, c, r, w_dead, b, 1e-12, 0.1, False),
         F.layer_norm(h + c + r, (13,), w_dead, b, 1e-12), (h, c, r, w_dead, b)),
        ("bias_dropout_add_layer_norm_backward_from_output",
         ops.bias_dropout_add_layer_norm(h, c, r, w.abs() + 0.5, b.clamp(-1, 1), 1e-12, 0.1, False),
         F.layer_norm(h + c + r, (13,), w.abs() + 0.5, b.clamp(-1, 1), 1e-12), (h, c, r, w, b)),
        ("cross_entropy_backward", ops.cross_entropy(h, torch.tensor([3, -100, 0, 12]))[0],
         F.cross_entropy(h, torch.tensor([3, -100, 0, 12]), reduction="none"), (h,)),
    ]
    for name, y, y_torch, wrt in cases:
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad((y * dy).sum(), wrt, create_graph=True)
        torch.testing.assert_close(grads, torch.autograd.grad((y_torch * dy).sum(), wrt))
        with pytest.raises(RuntimeError, match=f"bertctl::{name} has no derivative"):
            torch.autograd.grad(sum(g.square().sum() for g in grads), wrt)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(8)
    x = rand(2, 3, 4, 16, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    mask = (torch.rand(2, 16, generator=gen) > 0.3).to(device)
    h = rand(6, 32, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    r = rand(6, 32, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    w = rand(32, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    b = rand(32, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    y = rand(2, 3, 4, 16, dtype=torch.float32, device=device, gen=gen).softmax(-1)
    _, mean, rstd = torch.ops.bertctl.layer_norm(h, r, w, b, 1e-5)
    bl = torch.ops.bertctl
    cases = [
        (bl.softmax.default, (x, mask, 0.5)),
        (bl.softmax.default, (x, None, 1.0)),
        (bl.softmax_backward.default, (torch.randn_like(y), y, 0.5)),
        (bl.layer_norm.default, (h, r, w, b, 1e-12)),
        (bl.layer_norm.default, (h, None, w, b, 1e-5)),
        (bl.layer_norm_backward.default, (torch.randn_like(h), h.detach(), r.detach(), w.detach(), mean, rstd)),
        (bl.layer_norm_inference.default, (h.detach(), r.detach(), w.detach(), b.detach(), 1e-12)),
        (bl.layer_norm_inference.default, (h.detach(), None, w.detach(), b.detach(), 1e-5)),
        (bl.bias_gelu.default, (h, b, "none")),
        (bl.bias_gelu.default, (h, b, "tanh")),
        (bl.bias_gelu_backward.default, (torch.randn_like(h), h.detach(), b.detach(), "none")),
    ]
    # bias_dropout_add_layer_norm's seed lives on its input's device; dropout has a CPU kernel only
    seed, c = torch.tensor(7, device=device), rand(32, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    if device == "cpu":  # dropout and the backward from the output: CPU kernels only
        cases.append((bl.dropout.default, (h, 0.1, seed)))
        for p, s in ((0.1, seed), (0.0, None)):
            cases.append((bl.bias_dropout_add_layer_norm_backward_from_output.default,
                          (torch.randn_like(h), h.detach(), c.detach(), w.detach().abs() + 0.5, b.detach(), rstd, p,
                           s)))
    dh = torch.randn_like(h)
    for p, s in ((0.1, seed), (0.0, None)):
        _, m, sd = bl.bias_dropout_add_layer_norm(h, c, r, w, b, 1e-12, p, s)
        cases.append((bl.bias_dropout_add_layer_norm.default, (h, c, r, w, b, 1e-12, p, s)))
        cases.append((bl.bias_dropout_add_layer_norm_backward.default,
                      (dh, h.detach(), c.detach(), r.detach(), w.detach(), m, sd, p, s)))
    logits = rand(9, 40, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    labels = torch.tensor([0, 39, -100, 5, 7, -100, 1, 2, 3], device=device)
    _, lse, _ = bl.cross_entropy(logits, labels, -100)
    cases.append((bl.cross_entropy.default, (logits, labels, -100)))
    cases.append((bl.cross_entropy.default, (logits[:, :37], labels.clamp(max=36), -100)))
    cases.append((bl.cross_entropy_backward.default, (torch.randn(9, device=device), logits.detach(), labels, lse, -100)))
    blocks = [rand(6, w, dtype=torch.float32, device=device, gen=gen) for w in (8, 16, 5)]
    cases.append((bl.concat_column_sums.default, (blocks,)))
    for op, args in cases:
        # The backward ops' and layer_norm_inference's inputs do not require grad: they have no
        # derivative of their own (test_create_graph_first_order_right_second_order_refused,
        # test_layer_norm_inference_refuses_to_record_a_gradient).
        torch.library.opcheck(op, args)


# --- dropout (CPU) ------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_the_share_and_scales_exactly(p):
    """Over a million elements the dropped share is p within 5 standard errors, in every 64k block too
    (no drift along the index), and each kept element is x / (1 - p) in float32."""
    x = torch.rand(1 << 20) + 0.5
    torch.manual_seed(0)
    y = ops.dropout(x, p, True)
    dropped = (y == 0).double()
    se = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(dropped.mean().item() - p) < 5 * se
    blocks = dropped.view(16, -1)
    assert (blocks.mean(1) - p).abs().max().item() < 5 * (p * (1 - p) / blocks.shape[1]) ** 0.5
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] * torch.tensor(1 / (1 - p), dtype=torch.float32), rtol=0, atol=0)
    # Neighbours are dropped independently: P(both) = p^2.
    both = (dropped[1:] * dropped[:-1]).mean().item()
    assert abs(both - p * p) < 5 * (p * p * (1 - p * p) / x.numel()) ** 0.5


def test_dropout_repeats_with_the_seed_and_not_without():
    """The mask comes from torch's CPU generator: manual_seed repeats it, the next call differs; the
    thread count and the dtype do not change it."""
    x = torch.ones(50_000)
    torch.manual_seed(3)
    a, b = ops.dropout(x, 0.3, True), ops.dropout(x, 0.3, True)
    torch.manual_seed(3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a1 = ops.dropout(x, 0.3, True)
    finally:
        torch.set_num_threads(threads)
    torch.manual_seed(3)
    a16 = ops.dropout(x.to(torch.bfloat16), 0.3, True)
    assert torch.equal(a, a1) and not torch.equal(a, b)
    assert torch.equal(a == 0, a16 == 0)
    assert ops.dropout(x, 0.3, False) is x and ops.dropout(x, 0.0, True) is x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dropout_backward_is_the_same_mask(dtype):
    """dx = dy * mask / (1 - p) with the forward's mask, recomputed (nothing stored); the op is linear,
    so a second derivative goes through it too (float64 gradcheck and gradgradcheck)."""
    gen = torch.Generator().manual_seed(4)
    x = rand(3, 1000, dtype=dtype, device="cpu", gen=gen).requires_grad_()
    dy = rand(3, 1000, dtype=dtype, device="cpu", gen=gen)
    y = ops.dropout(x, 0.25, True)
    (dx,) = torch.autograd.grad(y, x, dy)
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # the kernel's arithmetic
    expected = torch.where(y != 0, dy.to(acc) * torch.tensor(1 / 0.75, dtype=acc), 0).to(dtype)
    torch.testing.assert_close(dx, expected, rtol=0, atol=0)
    x64 = rand(4, 33, dtype=torch.float64, device="cpu", gen=gen).requires_grad_()
    seed = torch.tensor(11)
    f = lambda t: torch.ops.bertctl.dropout(t, 0.4, seed)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x64,)) and torch.autograd.gradgradcheck(f, (x64,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 5, 1027)])
def test_dropout_matches_the_reference_hash(dtype, shape):
    """The kernel's output equals the plain-PyTorch reference (the same hash in int64 arithmetic)
    bit for bit, for odd shapes, every dtype, seeds with high bits set, and a non-contiguous input."""
    gen = torch.Generator().manual_seed(5)
    for seed, p in ((0, 0.1), (2 ** 61 + 12345, 0.5), (987654321, 0.9)):
        x = rand(*shape, dtype=dtype, device="cpu", gen=gen)
        s = torch.tensor(seed)
        torch.testing.assert_close(torch.ops.bertctl.dropout(x, p, s), reference.dropout_forward(x, p, s),
                                   rtol=0, atol=0)
    xt = rand(shape[-1], 6, dtype=dtype, device="cpu", gen=gen).t()  # non-contiguous: row-major order of x
    torch.testing.assert_close(torch.ops.bertctl.dropout(xt, 0.3, s), reference.dropout_forward(xt, 0.3, s),
                               rtol=0, atol=0)


def _lowbias32(x: int) -> int:
    """lowbias32 in Python integers (independent of the kernel's and the reference's arithmetic)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_dropout_calls_do_not_share_one_mask_sequence():
    """Two seeds whose first key words differ by one row's worth of Weyl steps: with a alone,
    lowbias32(i * 0x9E3779B9 + a), the second call's mask would be the first's moved up one row (every call a
    window of one sequence of period 2^32). The kernel XORs b in before the hash, which makes them unrelated: rows
    agree as often as independent masks do (0.9^2 + 0.1^2 of elements at p = 0.1)."""
    rows, width, golden = 64, 768, 0x9E3779B9
    s1 = 0x1234_5678_9ABC_DEF0
    a1 = _lowbias32(s1 & 0xFFFFFFFF) ^ (s1 >> 32)
    lo2 = 4242
    hi2 = _lowbias32(lo2) ^ ((a1 + width * golden) & 0xFFFFFFFF)  # a2 = a1 + width * golden
    s2 = (hi2 << 32) | lo2
    assert reference.dropout_key(s2)[0] == (a1 + width * golden) & 0xFFFFFFFF
    one_round = lambda a, i: _lowbias32((i * golden + a) & 0xFFFFFFFF) >= int(0.1 * 2 ** 32)  # noqa: E731
    a2 = reference.dropout_key(s2)[0]
    assert all(one_round(a2, i) == one_round(a1, i + width) for i in range(0, rows * width, 97))  # the setup
    x = torch.ones(rows, width)
    signed = lambda s: torch.tensor(s - 2 ** 64 if s >= 2 ** 63 else s)  # noqa: E731
    kept1 = torch.ops.bertctl.dropout(x, 0.1, signed(s1)) != 0
    kept2 = torch.ops.bertctl.dropout(x, 0.1, signed(s2)) != 0
    b1 = _lowbias32((s1 >> 32) ^ a1)
    flat = kept1.flatten()
    assert all(bool(flat[i]) == (_lowbias32(((i * golden + a1) & 0xFFFFFFFF) ^ b1) >= int(0.1 * 2 ** 32))
               for i in range(0, rows * width, 89))  # the kernel's mask is the header's hash
    agree = (kept2[:-1] == kept1[1:]).double().mean().item()
    n = (rows - 1) * width
    expected = 0.9 ** 2 + 0.1 ** 2
    assert abs(agree - expected) < 5 * (expected * (1 - expected) / n) ** 0.5, agree
    assert abs(kept1.double().mean().item() - 0.9) < 5 * (0.09 / x.numel()) ** 0.5

def _lag_correlations(kept: torch.Tensor, lags: int) -> torch.Tensor:
    """The autocorrelation of a 0/1 sequence at lags 1..lags, in float64 (by FFT)."""
    m = kept.double() - kept.double().mean()
    n = m.numel()
    f = torch.fft.rfft(m, 2 * n)
    auto = torch.fft.irfft(f * f.conj(), 2 * n)[1:lags + 1]
    return auto / (n - torch.arange(1, lags + 1, dtype=torch.float64)) / m.var()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_statistics(p):
    """One call's mask over 2^21 elements (2,048 rows of 1,024): the kept share is 1 - p, every autocorrelation at
    lags 1..4,096 (rows, columns of a row apart, the Weyl step's near-returns at Fibonacci lags) is within 5.5
    standard errors of 0, and the columns' kept counts over the rows are binomial (their variance within 25% of
    n p (1 - p)). The Weyl sequence alone, kept where i * 0x9E3779B9 mod 2^32 >= p * 2^32, fails the lags."""
    rows, width, lags = 2048, 1024, 4096
    kept = torch.ops.bertctl.dropout(torch.ones(rows, width), p, torch.tensor(20261128)) != 0
    n = kept.numel()
    q = 1 - p
    assert abs(kept.double().mean().item() - q) < 5 * (p * q / n) ** 0.5
    z = _lag_correlations(kept.flatten(), lags) * n ** 0.5
    assert z.abs().max().item() < 5.5, (z.abs().argmax().item() + 1, z.abs().max().item())
    cols = kept.double().sum(dim=0)
    assert abs(cols.var().item() / (rows * p * q) - 1) < 0.25
    weyl = (torch.arange(n, dtype=torch.int64) * 0x9E3779B9) % 2 ** 32 >= int(p * 2 ** 32)
    assert (_lag_correlations(weyl, lags) * n ** 0.5).abs().max().item() > 100


def test_dropout_under_torch_compile():
    """ops.dropout traces into one graph (its seed drawn in the graph, the fake kernel, the C++ autograd):
    the share dropped is p, and the gradient is the output's mask times 1 / (1 - p)."""
    torch._dynamo.reset()
    x = (torch.rand(200_000) + 0.5).requires_grad_()
    y = torch.compile(lambda t: ops.dropout(t, 0.2, True), fullgraph=True)(x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert abs((y == 0).double().mean().item() - 0.2) < 5 * (0.2 * 0.8 / x.numel()) ** 0.5
    torch.testing.assert_close(dx, (y != 0).float() * torch.tensor(1 / 0.8), rtol=0, atol=0)


def test_dropout_elsewhere_is_torchs():
    """No kernel for the device or p outside (0, 1): torch's dropout (p = 1 drops everything)."""
    x = torch.ones(100)
    assert not ops.dropout_kernel_ok(x, 1.0) and torch.equal(ops.dropout(x, 1.0, True), torch.zeros(100))
    assert not ops.dropout_kernel_ok(torch.ones(0), 0.1)
    assert ops.dropout_kernel_ok(x, 0.1) and not ops.dropout_kernel_ok(torch.ones(4, dtype=torch.int64), 0.1)


# --- bias + dropout + residual + LayerNorm -------------------------------------------------

BDALN_GRADS = ("dx", "dbias", "dresidual", "dweight", "dln_bias")


def seed_after(rng_seed: int, device: str = "cpu") -> torch.Tensor:
    """The seed that ops.dropout (and ops.bias_dropout_add_layer_norm) draws first after torch.manual_seed(rng_seed):
    from the CPU generator on the CPU, on the device from its generator elsewhere."""
    torch.manual_seed(rng_seed)
    if device == "cpu":
        return torch.randint(0, 2 ** 62, (), dtype=torch.int64)
    return torch.randint(0, 2 ** 62, (), dtype=torch.int64, device=device)


def bdaln_inputs(N: int, H: int, dtype: torch.dtype, gen: torch.Generator, param_dtype=torch.float32, device="cpu"):
    """(x, bias, residual, weight, ln_bias), all requiring grad: x a matmul's output, parameters BERT-like."""
    x = rand(N, H, dtype=dtype, device=device, std=2.0, gen=gen)
    bias = rand(H, dtype=param_dtype, device=device, std=0.5, gen=gen)
    res = rand(N, H, dtype=dtype, device=device, gen=gen)
    w = (1 + rand(H, dtype=torch.float64, device=device, std=0.2, gen=gen)).to(param_dtype)
    lb = rand(H, dtype=param_dtype, device=device, std=0.5, gen=gen)
    return tuple(t.requires_grad_() for t in (x, bias, res, w, lb))


def check_bdaln(x, bias, res, w, lb, eps, p, tol_dtype, training=True, rng_seed=0):
    """ops.bias_dropout_add_layer_norm and its five gradients against the float64 reference on the same rounded
    inputs, with the mask of the seed the op draws after torch.manual_seed(rng_seed); column sums (dbias,
    dweight, dln_bias) at atol times sqrt(rows).  Returns (y, grads)."""
    rows = x.numel() // x.shape[-1]
    p_run = p if training else 0.0
    seed = seed_after(rng_seed, x.device.type) if p_run > 0 else None
    torch.manual_seed(rng_seed)
    y = ops.bias_dropout_add_layer_norm(x, bias, res, w, lb, eps, p, training)
    d = lambda t: t.detach().double()  # noqa: E731
    y_ref, mean, rstd = reference.bias_dropout_add_layer_norm_forward(d(x), d(bias), d(res), d(w), d(lb), eps, p_run,
                                                                      seed)
    assert y.dtype == x.dtype
    close(y, y_ref, tol_dtype, f"bias_dropout_add_layer_norm forward (p={p_run})")
    dy = rand(*x.shape, dtype=x.dtype, device=x.device, gen=torch.Generator().manual_seed(rng_seed + 1))
    grads = torch.autograd.grad(y, (x, bias, res, w, lb), dy)
    refs = reference.bias_dropout_add_layer_norm_backward(dy.double(), d(x), d(bias), d(res), d(w), mean, rstd, p_run,
                                                          seed)
    for g, ref, what in zip(grads, refs, BDALN_GRADS):
        assert g.dtype == {"dx": x, "dresidual": res, "dbias": bias, "dweight": w, "dln_bias": lb}[what].dtype
        close(g, ref, tol_dtype, f"bias_dropout_add_layer_norm {what} (p={p_run})",
              scale=1.0 if what in ("dx", "dresidual") else rows**0.5)
    return y, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", SIZES)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_bias_dropout_add_layer_norm_matches_float64(device, dtype, H, p):
    """Forward and every gradient against the float64 reference (dropout_forward's hashed mask for the drawn seed),
    every H of SIZES: 1 and 7 are shorter than a vector, 13, 127 and 1000 end in a partial one; on CUDA 768 and
    1024 take the 16-byte vectors, 13 and 127 single elements, 4096 (16-bit) a block per row."""
    gen = torch.Generator().manual_seed(H)
    args = bdaln_inputs(37, H, dtype, gen, device=device)
    assert ops.bias_dropout_add_layer_norm_kernel_ok(*args, p)
    check_bdaln(*args, 1e-12, p, dtype, rng_seed=H)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H", [384, 768])
def test_bias_dropout_add_layer_norm_at_fine_tunings_shapes(device, H):
    """MiniLM's rows (384 wide: on CUDA the backward's 64-thread groups have 16 idle threads) and BERT-Base's, bf16,
    dropout 0.1, 5,000 rows (several rows to each group of the CUDA backward's grid), against float64."""
    args = bdaln_inputs(5000, H, torch.bfloat16, torch.Generator().manual_seed(H), device=device)
    check_bdaln(*args, 1e-12, 0.1, torch.bfloat16, rng_seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_dropout_add_layer_norm_one_and_two_threads(dtype):
    """1 and 2 threads (301 rows of 768: the forward's rows and the backward's chunks split over both at 2): each
    matches the reference, and y, dx and dresidual are the same bits (a row is one thread's work, the mask a
    function of the element's index)."""
    args = bdaln_inputs(301, 768, dtype, torch.Generator().manual_seed(31))
    threads = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = check_bdaln(*args, 1e-12, 0.1, dtype, rng_seed=5)
    finally:
        torch.set_num_threads(threads)
    (y1, g1), (y2, g2) = out[1], out[2]
    assert torch.equal(y1, y2) and torch.equal(g1[0], g2[0]) and torch.equal(g1[2], g2[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_bias_dropout_add_layer_norm_masks_like_the_ops_apart(dtype, p):
    """After one torch.manual_seed the fused op drops exactly the elements that ops.dropout drops of x + bias (the
    ops apart, as the model ran them), takes one draw from the generator as ops.dropout does, and agrees in
    value with ops.layer_norm(ops.dropout(x + bias), residual)."""
    gen = torch.Generator().manual_seed(17)
    x, bias, res, w, lb = bdaln_inputs(64, 1000, dtype, gen)
    dy = rand(64, 1000, dtype=dtype, device="cpu", gen=gen)
    torch.manual_seed(3)
    y = ops.bias_dropout_add_layer_norm(x, bias, res, w, lb, 1e-12, p)
    after_fused = torch.rand(4)
    torch.manual_seed(3)
    dropped = ops.dropout(x + bias, p, True)
    y_apart = ops.layer_norm(dropped, w, lb, 1e-12, residual=res)
    after_apart = torch.rand(4)
    assert torch.equal(after_fused, after_apart)
    dx, dres = torch.autograd.grad(y, (x, res), dy)
    kept = dx != 0  # dx = dresidual * mask / (1 - p), and dresidual has no zeros here
    assert torch.count_nonzero(dres) == dres.numel()
    assert torch.equal(kept, dropped != 0)
    assert abs(1 - kept.double().mean().item() - p) < 5 * (p * (1 - p) / kept.numel()) ** 0.5
    close(y, y_apart.detach().double(), dtype, "fused against the ops apart")
    dx_apart, dres_apart = torch.autograd.grad(y_apart, (x, res), dy)
    close(dx, dx_apart.double(), dtype, "dx against the ops apart")
    close(dres, dres_apart.double(), dtype, "dresidual against the ops apart")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_dropout_add_layer_norm_eval_and_p0(device, dtype):
    """In eval (training=False) and with p = 0 the op is LayerNorm(x + bias + residual): it draws no seed (the
    generator is untouched, no randint runs), and x's gradient is the residual's."""
    gen = torch.Generator().manual_seed(19)
    args = bdaln_inputs(45, 1000, dtype, gen, device=device)
    for p, training in ((0.1, False), (0.0, True)):
        torch.manual_seed(0)
        with OpsRun() as run:
            y = ops.bias_dropout_add_layer_norm(*args, 1e-12, p, training)
        assert run.names == ["bertctl::bias_dropout_add_layer_norm"]
        after = torch.rand(4, device=device)
        torch.manual_seed(0)
        assert torch.equal(after, torch.rand(4, device=device))  # nothing drawn
        y2, grads = check_bdaln(*args, 1e-12, p, dtype, training=training)
        assert torch.equal(y, y2) and torch.equal(grads[0], grads[2])


@pytest.mark.parametrize("device", DEVICES)
def test_bias_dropout_add_layer_norm_noncontiguous_and_16bit_params(device):
    """Views that are not contiguous (the mask follows x's row-major order, as dropout's does), and bf16
    parameters beside bf16 activations."""
    gen = torch.Generator().manual_seed(21)
    x = rand(64, 10, dtype=torch.float32, device=device, gen=gen).t().requires_grad_()  # (10, 64) view
    res = rand(10, 128, dtype=torch.float32, device=device, gen=gen)[:, ::2].requires_grad_()
    bias = rand(128, dtype=torch.float32, device=device, gen=gen)[::2].requires_grad_()
    w = rand(64, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    lb = rand(64, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    assert not (x.is_contiguous() or res.is_contiguous() or bias.is_contiguous())
    check_bdaln(x, bias, res, w, lb, 1e-12, 0.3, torch.float32, rng_seed=2)
    args = bdaln_inputs(33, 264, torch.bfloat16, gen, param_dtype=torch.bfloat16, device=device)
    assert ops.bias_dropout_add_layer_norm_kernel_ok(*args, 0.1)
    check_bdaln(*args, 1e-12, 0.1, torch.bfloat16, rng_seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("H", [768, 1000])  # 1000: rows start off the vector boundaries
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("from_output", [False, True])
def test_bias_dropout_add_layer_norm_cpu_streamed_outputs(dtype, H, p, from_output):
    """Tensors large enough for the streaming-store path of the forward (x, residual -> y) and of the backward
    (dy and x, residual or y -> dresidual and dx, both streamed), the backward from the input (one LayerNorm
    weight near 0) and from the output."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    N = -(-CPU_STREAM_TRAFFIC_FWD // (3 * H * itemsize)) + 5
    args = bdaln_inputs(N, H, dtype, torch.Generator().manual_seed(H), param_dtype=dtype)
    if not from_output:
        args = ill_conditioned(args)
    assert bdaln_backward_op(*args, p) == BDALN_BACKWARD_FROM[from_output]
    # fp64 has no entry in TOL: it is compared at fp32 tolerance, far looser than it needs.
    check_bdaln(*args, 1e-12, p, torch.float32, rng_seed=H)


BDALN_BACKWARD_FROM = {False: "bertctl::bias_dropout_add_layer_norm_backward",
                       True: "bertctl::bias_dropout_add_layer_norm_backward_from_output"}


def saved_storages(fn):
    """fn()'s result and the storages (data pointers) of the tensors autograd saved for its backward."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, set(saved)


def ill_conditioned(args):
    """bdaln_inputs with one LayerNorm weight of 1e-3 beside a bias of 1: the backward cannot work from y."""
    x, bias, res, w, lb = (t.detach().clone() for t in args)
    w[w.numel() // 2], lb[w.numel() // 2] = 1e-3, 1.0
    return tuple(t.requires_grad_() for t in (x, bias, res, w, lb))


def bdaln_backward_op(x, bias, res, w, lb, p):
    """The bertctl op that ops.bias_dropout_add_layer_norm's backward runs (recorded in the backward only)."""
    y = ops.bias_dropout_add_layer_norm(x, bias, res, w, lb, 1e-12, p)
    with OpsRun() as run:
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    return next(n for n in run.names if n.startswith("bertctl::"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_bias_dropout_add_layer_norm_backward_from_the_output_on_the_cpu(dtype, p):
    """On the CPU in fp32/fp64 with LayerNorm weights away from 0, the backward works from the output y and
    keeps neither the matmul's output x nor the residual (only y, which the next layer keeps anyway); with a
    weight near 0, or bf16 activations, it keeps x and the residual. Either way it matches the float64
    reference, and the two paths agree to a few ulps."""
    gen = torch.Generator().manual_seed(47)
    args = bdaln_inputs(53, 264, dtype, gen, param_dtype=dtype)
    assert bdaln_backward_op(*args, p) == BDALN_BACKWARD_FROM[True]
    x, bias, res, w, lb = args
    y, kept = saved_storages(lambda: ops.bias_dropout_add_layer_norm(*args, 1e-12, p))
    assert y.untyped_storage().data_ptr() in kept
    assert not {x.untyped_storage().data_ptr(), res.untyped_storage().data_ptr()} & kept
    _, from_output = check_bdaln(*args, 1e-12, p, torch.float32, rng_seed=3)
    # the backward from the input on the same arguments
    seed = seed_after(3) if p > 0 else None
    _, mean, rstd = torch.ops.bertctl.bias_dropout_add_layer_norm(*(t.detach() for t in args), 1e-12, p, seed)
    dy = rand(*x.shape, dtype=x.dtype, device="cpu", gen=torch.Generator().manual_seed(4))
    from_input = torch.ops.bertctl.bias_dropout_add_layer_norm_backward(
        dy, x.detach(), bias.detach(), res.detach(), w.detach(), mean, rstd, p, seed)
    if p == 0:
        from_input = (from_input[2],) + from_input[1:]
    for a, e, what in zip(from_output, from_input, BDALN_GRADS):
        torch.testing.assert_close(a, e, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                                   atol=2e-4 if dtype == torch.float32 else 1e-12, msg=what)
    assert bdaln_backward_op(*ill_conditioned(args), p) == BDALN_BACKWARD_FROM[False]
    check_bdaln(*ill_conditioned(args), 1e-12, p, torch.float32, rng_seed=3)
    assert bdaln_backward_op(*bdaln_inputs(53, 264, torch.bfloat16, gen), p) == BDALN_BACKWARD_FROM[False]


def test_bias_dropout_add_layer_norm_backward_from_the_input_where_the_output_cannot_give_it():
    """x and the residual are kept, and the backward works from them, where xhat cannot come back from y
    accurately: a LayerNorm weight of 0 or infinite, a bias over 64 times its weight, a forward under a dispatch
    mode (torch.compile's tracer is one: the weights' values are not looked at); a dead unit as in
    all-MiniLM-L6-v2's last LayerNorm (weight 5e-33, bias 58 times it) still takes the output path. Every case
    matches the float64 reference."""
    gen = torch.Generator().manual_seed(41)
    x, bias, res, w0, lb0 = bdaln_inputs(19, 96, torch.float32, gen)
    for (wj, bj), from_output in (((0.0, 0.0), False), ((1e-3, 0.065), False), ((1e-3, 0.064), True),
                                  ((-2.0, 128.0), True), ((5e-33, 2.9e-31), True), ((float("inf"), 0.0), False)):
        w, lb = w0.detach().clone(), lb0.detach().clone()
        w[7], lb[7] = wj, bj
        args = (x, bias, res, w.requires_grad_(), lb.requires_grad_())
        assert bdaln_backward_op(*args, 0.1) == BDALN_BACKWARD_FROM[from_output], (wj, bj)
        if math.isfinite(wj):
            check_bdaln(*args, 1e-12, 0.1, torch.float32, rng_seed=7)
    with OpsRun():  # a dispatch mode in the forward
        y = ops.bias_dropout_add_layer_norm(x, bias, res, w0, lb0, 1e-12, 0.1)
    with OpsRun() as run:
        torch.autograd.grad(y.sum(), x)
    assert run.names.count(BDALN_BACKWARD_FROM[False]) == 1


def test_bias_dropout_add_layer_norm_output_changed_in_place_is_an_error():
    """With the output saved, changing it in place before the backward is refused by autograd (as for
    torch.tanh's output), never a wrong gradient."""
    args = bdaln_inputs(5, 32, torch.float32, torch.Generator().manual_seed(43))
    y = ops.bias_dropout_add_layer_norm(*args, 1e-12, 0.1)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.cuda
def test_bias_dropout_add_layer_norm_backward_from_the_input_on_cuda():
    """On CUDA the node keeps x and the residual in every dtype (checking the weights would cost a device
    sync)."""
    gen = torch.Generator().manual_seed(45)
    for dtype in (torch.float32, torch.bfloat16):
        args = bdaln_inputs(19, 768, dtype, gen, device="cuda")
        assert bdaln_backward_op(*args, 0.1) == BDALN_BACKWARD_FROM[False]
        check_bdaln(*args, 1e-12, 0.1, dtype, rng_seed=5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_dropout_add_layer_norm_same_seed_same_mask_on_cpu_and_cuda(dtype):
    """One seed value drops the same elements on the CPU and the GPU (the hash of dropout_hash.h on both), and the
    two devices' outputs and gradients agree; BERT-Base's rows, 1000 rows."""
    gen = torch.Generator().manual_seed(23)
    cpu = bdaln_inputs(1000, 768, dtype, gen)
    gpu = tuple(t.detach().cuda().requires_grad_() for t in cpu)
    dy = rand(1000, 768, dtype=dtype, device="cpu", gen=gen)
    out = {}
    for name, args, seed in (("cpu", cpu, torch.tensor(123456789012345)),
                             ("cuda", gpu, torch.tensor(123456789012345, device="cuda"))):
        y = torch.ops.bertctl.bias_dropout_add_layer_norm(*args, 1e-12, 0.1, seed)[0]
        out[name] = (y, *torch.autograd.grad(y, args, dy.to(y.device)))
    kept_cpu, kept_gpu = out["cpu"][1] != 0, out["cuda"][1].cpu() != 0
    assert torch.equal(kept_cpu, kept_gpu)
    assert abs(1 - kept_cpu.double().mean().item() - 0.1) < 0.005
    for what, a, b in zip(("y", *BDALN_GRADS), out["cpu"], out["cuda"]):
        close(b.cpu(), a.detach().double(), dtype, f"{what}: CUDA against the CPU",
              scale=1.0 if what in ("y", "dx", "dresidual") else 1000 ** 0.5)


@pytest.mark.cuda
def test_bias_dropout_add_layer_norm_cuda_graph_replays_draw_new_seeds():
    """Captured in a CUDA graph with the seed drawn inside it (as ops.bias_dropout_add_layer_norm draws it), each
    replay draws a new seed, and the kernel, which reads the seed when it runs, drops that seed's elements: every
    replay matches the float64 reference for the seed it drew."""
    gen = torch.Generator().manual_seed(29)
    x, bias, res, w, lb = (t.detach() for t in bdaln_inputs(512, 768, torch.bfloat16, gen, device="cuda"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.bertctl.bias_dropout_add_layer_norm(x, bias, res, w, lb, 1e-12, 0.1, ops._seed(x))  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            seed = ops._seed(x)
            y = torch.ops.bertctl.bias_dropout_add_layer_norm(x, bias, res, w, lb, 1e-12, 0.1, seed)[0]
    torch.cuda.current_stream().wait_stream(stream)
    d = lambda t: t.double()  # noqa: E731
    seeds = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        seeds.append(int(seed))
        ref = reference.bias_dropout_add_layer_norm_forward(d(x), d(bias), d(res), d(w), d(lb), 1e-12, 0.1,
                                                            torch.tensor(seeds[-1]))[0]
        close(y, ref, torch.bfloat16, f"replay {len(seeds)}")
    assert len(set(seeds)) == 3


def test_bias_dropout_add_layer_norm_gradcheck_float64():
    gen = torch.Generator().manual_seed(12)
    args = tuple(t.detach().double().requires_grad_() for t in bdaln_inputs(4, 13, torch.float64, gen))
    for p, seed in ((0.3, torch.tensor(99)), (0.0, None)):
        f = lambda *t: torch.ops.bertctl.bias_dropout_add_layer_norm(*t, 1e-12, p, seed)[0]  # noqa: E731
        assert torch.autograd.gradcheck(f, args)
        g = lambda *t: reference.bias_dropout_add_layer_norm(*t, 1e-12, p, seed)  # noqa: E731
        assert torch.autograd.gradcheck(g, args)


def test_bias_dropout_add_layer_norm_under_torch_compile():
    """ops.bias_dropout_add_layer_norm traces into one graph (the seed drawn in it, the fake kernels, the C++
    autograd): with p = 0 the values and gradients of eager mode, with and without grad; with dropout the share
    dropped is p, and dx is dresidual / (1 - p) where kept and 0 elsewhere (one mask forward and backward)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(13)
    args = bdaln_inputs(64, 96, torch.float32, gen)
    dy = rand(64, 96, dtype=torch.float32, device="cpu", gen=gen)
    f = lambda *a: ops.bias_dropout_add_layer_norm(*a, 1e-12, 0.0)  # noqa: E731
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True)(*args)
    for a, e in zip((compiled, *torch.autograd.grad(compiled, args, dy)), (eager, *torch.autograd.grad(eager, args, dy))):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(*args), eager, atol=1e-5, rtol=1e-5)
    y = torch.compile(lambda *a: ops.bias_dropout_add_layer_norm(*a, 1e-12, 0.2), fullgraph=True)(*args)
    dx, dres = torch.autograd.grad(y, (args[0], args[2]), dy)
    kept = dx != 0
    assert abs(1 - kept.double().mean().item() - 0.2) < 5 * (0.2 * 0.8 / kept.numel()) ** 0.5
    torch.testing.assert_close(dx, torch.where(kept, dres * torch.tensor(1 / 0.8), 0), rtol=0, atol=0)


def test_bias_dropout_add_layer_norm_elsewhere_is_the_ops_apart():
    """Outside the kernel's preconditions the ops apart run (bias add, dropout, layer_norm): p = 1 drops
    everything (LayerNorm of the residual alone); a float16 bias beside bfloat16 x gives the reference's values
    (the same hashed mask, through ops.dropout)."""
    gen = torch.Generator().manual_seed(23)
    x, bias, res, w, lb = bdaln_inputs(9, 40, torch.float32, gen)
    assert not ops.bias_dropout_add_layer_norm_kernel_ok(x, bias, res, w, lb, 1.0)
    y = ops.bias_dropout_add_layer_norm(x, bias, res, w, lb, 1e-12, 1.0)
    d = lambda t: t.detach().double()  # noqa: E731
    close(y, reference.layer_norm_forward(d(res), None, d(w), d(lb), 1e-12)[0], torch.float32, "p = 1")
    x, bias, res, w, lb = bdaln_inputs(9, 40, torch.bfloat16, gen)
    bias = bias.detach().half()
    assert not ops.bias_dropout_add_layer_norm_kernel_ok(x, bias, res, w, lb, 0.2)
    seed = seed_after(4)
    torch.manual_seed(4)
    y = ops.bias_dropout_add_layer_norm(x, bias, res, w, lb, 1e-12, 0.2)
    y_ref = reference.bias_dropout_add_layer_norm_forward(d(x), d(bias), d(res), d(w), d(lb), 1e-12, 0.2, seed)[0]
    close(y, y_ref, torch.bfloat16, "float16 bias")


def test_kernels_loaded_lists_every_op_for_cpu():
    loaded = kernels_loaded()
    assert set(loaded) == set(OP_NAMES)
    assert all("CPU" in keys for keys in loaded.values())


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_parity(device):
    """The ops trace into one graph (fake kernels + registered autograd) and compute the same values and grads."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(9)

    def f(scores, mask, h, res, w, b, bias):
        p = ops.softmax(scores, mask, 0.125)
        y = ops.layer_norm(ops.bias_gelu(h, bias), w, b, 1e-12, residual=res)
        ce = ops.cross_entropy(y[:, :14], torch.tensor([1, -100, 13, 0, 2, 5], device=y.device))[0]
        return p, y + ce[:, None]

    scores = rand(2, 2, 4, 8, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    mask = (torch.rand(2, 8, generator=gen) > 0.3).to(device)
    h, res = (rand(6, 16, dtype=torch.float32, device=device, gen=gen).requires_grad_() for _ in range(2))
    w, b, bias = (rand(16, dtype=torch.float32, device=device, gen=gen).requires_grad_() for _ in range(3))
    args = (scores, mask, h, res, w, b, bias)
    grads_in = [a for a in args if a.requires_grad]
    dp, dy = torch.randn(2, 2, 4, 8, generator=gen).to(device), torch.randn(6, 16, generator=gen).to(device)

    eager = f(*args)
    eager_grads = torch.autograd.grad(eager, grads_in, (dp, dy))
    compiled = torch.compile(f, fullgraph=True)(*args)
    compiled_grads = torch.autograd.grad(compiled, grads_in, (dp, dy))
    for a, e in zip(compiled + compiled_grads, eager + eager_grads):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the inference graph: layer_norm_inference's fake and kernel
        for a, e in zip(torch.compile(f, fullgraph=True)(*args), eager):
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_bias_gelu_cpu_large_inputs_and_nan():
    """The CPU kernel clamps |v| at 20 inside its erfc/exp (beyond, every term is 0 in fp32):
    large finite inputs must still give GELU(v) = v (v > 0) or 0 (v < 0), slope 1 or 0, and
    NaN must propagate (float64 erfc reference)."""
    v = torch.tensor([-3e38, -1e4, -30.0, -20.5, -19.5, 19.5, 20.5, 30.0, 1e4, 3e38], dtype=torch.float64)
    x = v.float()[None, :].requires_grad_()
    b = torch.zeros(v.numel())
    y = ops.bias_gelu(x, b)
    y_ref = v * 0.5 * torch.special.erfc(-v / 2**0.5)
    torch.testing.assert_close(y[0].double(), y_ref, rtol=2e-5, atol=1e-30)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(dx[0].double(), (v > 0).double(), rtol=0, atol=1e-30)
    nan = ops.bias_gelu(torch.tensor([[float("nan"), 1.0]]), torch.zeros(2))
    assert torch.isnan(nan[0, 0]) and not torch.isnan(nan[0, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_chain_of_kernels_each_reading_the_last_ones_output(device):
    """Forward and backward through 6 bias+GELU -> LayerNorm(+residual) -> softmax blocks:
    every kernel reads what the kernel just before it wrote (on CUDA they are launched with
    programmatic dependent launch, so a kernel that touched memory before its predecessor
    finished would read stale values here).  float64 plain-PyTorch chain as the reference."""
    gen = torch.Generator().manual_seed(23)
    N, H, steps = 2048, 768, 6
    x = rand(N, H, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    params = [(rand(H, dtype=torch.float32, device=device, gen=gen, std=0.1).requires_grad_(),
               (1 + rand(H, dtype=torch.float32, device=device, gen=gen, std=0.1)).requires_grad_(),
               rand(H, dtype=torch.float32, device=device, gen=gen, std=0.1).requires_grad_()) for _ in range(steps)]

    def chain(impl, inp, ps):
        h = inp
        for b, w, beta in ps:
            h = impl.layer_norm(impl.bias_gelu(h, b), w, beta, 1e-12, residual=h)
            h = impl.softmax(h, None, 4.0) * H
        return h

    b, w, beta = params[0]
    assert ops.bias_gelu_kernel_ok(x, b) and ops.layer_norm_kernel_ok(x, w, beta, x) and ops.softmax_kernel_ok(x)
    y = chain(ops, x, params)
    xd = x.detach().double().requires_grad_()
    pd = [tuple(p.detach().double().requires_grad_() for p in ps) for ps in params]
    y_ref = chain(reference, xd, pd)
    close(y, y_ref, torch.float32, "chain forward", scale=10)
    dy = rand(N, H, dtype=torch.float32, device=device, gen=gen)
    grads = torch.autograd.grad(y, [x, *params[0]], dy)
    grads_ref = torch.autograd.grad(y_ref, [xd, *pd[0]], dy.double())
    for g, g_ref, what in zip(grads, grads_ref, ["dx", "dbias (GELU)", "dweight", "dbias (LayerNorm)"]):
        close(g, g_ref, torch.float32, f"chain {what}", scale=10 * N**0.5)
