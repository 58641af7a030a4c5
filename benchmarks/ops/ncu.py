"""One call of each fused kernel at BERT-Base shapes, for Nsight Compute (timings come from
``bertctl bench ops``; this is for the profiler's view of each kernel):

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        -k regex:'softmax|ln_|bias_gelu|bdaln|column_sum' python3 benchmarks/ops/ncu.py

``--device cpu --dtype float32`` runs the same calls on the CPU kernels (a check that the calls match
the ops' schemas).
"""
import argparse

import torch

from bertctl import ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tokens", type=int, default=32768, help="rows of the LayerNorm and GELU inputs (BERT-Base 256x128)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dt, n = a.device, getattr(torch, a.dtype), a.tokens
    s128 = torch.randn(n // 128, 12, 128, 128, device=dev, dtype=dt)
    s512 = torch.randn(n // 512, 12, 512, 512, device=dev, dtype=dt)
    m128 = torch.rand(n // 128, 128, device=dev) > 0.2
    m512 = torch.rand(n // 512, 512, device=dev) > 0.2
    x = torch.randn(n, 768, device=dev, dtype=dt)
    r = torch.randn_like(x)
    w, b = torch.randn(768, device=dev, dtype=dt), torch.randn(768, device=dev, dtype=dt)
    h = torch.randn(n, 3072, device=dev, dtype=dt)
    hb = torch.randn(3072, device=dev, dtype=dt)
    y = ops.softmax(s128, m128, 0.125)
    ops.softmax(s512, m512, 0.125)
    torch.ops.bertctl.softmax_backward(s128, y, 0.125)
    out, mean, rstd = torch.ops.bertctl.layer_norm(x, r, w, b, 1e-12)
    torch.ops.bertctl.layer_norm_backward(x, x, r, w, mean, rstd)
    ops.bias_gelu(h, hb)
    torch.ops.bertctl.bias_gelu_backward(h, h, hb, "none")
    # the sub-layer output's LayerNorm(dropout(x + bias) + residual) at BERT's hidden dropout, as training runs it
    seed = torch.tensor([1234], device=dev, dtype=torch.int64)
    yb, mb, rb = torch.ops.bertctl.bias_dropout_add_layer_norm(x, b, r, w, b, 1e-12, 0.1, seed)
    torch.ops.bertctl.bias_dropout_add_layer_norm_backward(x, x, b, r, w, mb, rb, 0.1, seed)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
