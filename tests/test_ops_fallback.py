"""Without the compiled module (BERTCTL_NO_EXT=1) the ops run their plain-PyTorch versions."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import torch, torch.nn.functional as F
from bertctl import ops
from bertctl._ext import kernels_loaded
assert not ops.fused_available() and kernels_loaded() == {}
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 3, 4, 9, generator=g, dtype=torch.float64, requires_grad=True)
mask = torch.rand(2, 9, generator=g) > 0.3
mask[1] = False
y = ops.softmax(x, mask, 0.5)
assert torch.equal(y[1], torch.zeros_like(y[1]))
torch.testing.assert_close(y[0], torch.softmax(0.5 * x[0].masked_fill(~mask[0, None, None], float("-inf")), -1))
assert torch.autograd.gradcheck(lambda t: ops.softmax(t, mask, 0.5), (x,))
h = torch.randn(5, 12, generator=g, dtype=torch.float64, requires_grad=True)
r = torch.randn(5, 12, generator=g, dtype=torch.float64, requires_grad=True)
w = torch.randn(12, generator=g, dtype=torch.float64, requires_grad=True)
b = torch.randn(12, generator=g, dtype=torch.float64, requires_grad=True)
torch.testing.assert_close(ops.layer_norm(h, w, b, 1e-12, residual=r), F.layer_norm(h + r, (12,), w, b, 1e-12))
assert torch.autograd.gradcheck(lambda *t: ops.layer_norm(t[0], t[2], t[3], 1e-12, residual=t[1]), (h, r, w, b))
torch.testing.assert_close(ops.bias_gelu(h, b), F.gelu(h + b))
assert torch.autograd.gradcheck(lambda t, u: ops.bias_gelu(t, u, "tanh"), (h, b))
print("ok")
"""


def test_ops_without_compiled_module():
    env = {**os.environ, "BERTCTL_NO_EXT": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
