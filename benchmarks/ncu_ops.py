"""One call of each fused bf16 kernel at BERT-Base shapes, for Nsight Compute:
    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        -k regex:'softmax|ln_|bias_gelu|bdaln|column_sum' python3 benchmarks/ncu_ops.py
"""
import torch

from bertctl import ops

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
s128 = torch.randn(256, 12, 128, 128, device=dev, dtype=dt)
s512 = torch.randn(64, 12, 512, 512, device=dev, dtype=dt)
m128 = torch.rand(256, 128, device=dev) > 0.2
m512 = torch.rand(64, 512, device=dev) > 0.2
x = torch.randn(32768, 768, device=dev, dtype=dt)
r = torch.randn_like(x)
w, b = torch.randn(768, device=dev, dtype=dt), torch.randn(768, device=dev, dtype=dt)
h = torch.randn(32768, 3072, device=dev, dtype=dt)
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
torch.cuda.synchronize()
