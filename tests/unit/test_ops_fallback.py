"""Without the compiled module (BERTCTL_NO_EXT=1) the ops run their plain-PyTorch versions; a module
that fails to load is a warning, or with BERTCTL_REQUIRE_EXT=1 an error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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
c = torch.randn(12, generator=g, dtype=torch.float64, requires_grad=True)
torch.testing.assert_close(ops.bias_dropout_add_layer_norm(h, c, r, w, b, 1e-12, 0.1, training=False),
                           F.layer_norm(h + c + r, (12,), w, b, 1e-12))
assert torch.autograd.gradcheck(lambda *t: ops.bias_dropout_add_layer_norm(*t, 1e-12, 0.0), (h, c, r, w, b))
y = ops.bias_dropout_add_layer_norm(h, c, r, w, b, 1e-12, 0.5)  # torch's dropout inside
assert y.shape == h.shape and torch.isfinite(y).all()
print("ok")
"""


def test_ops_without_compiled_module():
    env = {**os.environ, "BERTCTL_NO_EXT": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


# `bertctl env --json` in a process where importing bertctl._C (and the native encoder) fails, as after a failed
# or stale build.
HIDDEN = r"""
import sys
class Hide:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in ("bertctl._C", "bertctl._encoder"):
            raise ImportError(f"{name} hidden by the test")
sys.meta_path.insert(0, Hide)
from bertctl.cli.app import main
main(["env", "--json"])
"""


def test_missing_module_is_an_error_under_require_ext():
    """Under BERTCTL_REQUIRE_EXT=1 a module that does not load is one error line and exit code 2;
    without it, a warning and the plain-PyTorch ops."""
    env = {k: v for k, v in os.environ.items() if k not in ("BERTCTL_NO_EXT", "BERTCTL_REQUIRE_EXT")}

    def run(require: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", HIDDEN], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**env, "OMP_NUM_THREADS": "1", "BERTCTL_REQUIRE_EXT": require})

    out = run("0")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["compiled_module"] is None and info["kernels"] == {}
    assert info["native_encoder"].startswith("unavailable: bertctl._encoder did not load (bertctl._encoder hidden by")
    assert "compiled kernels unavailable (bertctl._C hidden by the test)" in out.stderr
    out = run("1")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr == ("bertctl: error: BERTCTL_REQUIRE_EXT=1 but the compiled kernels bertctl._C did not load "
                          "(bertctl._C hidden by the test); build them with `pip install --no-build-isolation -e .`\n")
