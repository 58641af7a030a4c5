"""The suite's own rules (tests/conftest.py), run on a scratch suite with the same conftest: a skip
fails unless it is a CUDA test without a GPU (or a two-GPU test with fewer), a missing shared data set fails, and the
exhaustive sweeps run only when -m names them or the command line names their folder, and a folder named on the
command line none of whose tests ran fails the run."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]  # tests/, where the conftest under test lives

SCRATCH = '''
import pytest

def test_skips():
    pytest.skip("a reason")

def test_needs_data(shared_data):
    pass

@pytest.mark.cuda
def test_gpu():
    pass

@pytest.mark.cuda
@pytest.mark.two_gpus
def test_two_gpus():
    pass

@pytest.mark.exhaustive
def test_sweep():
    pass
'''
SWEEPS = '''
import pytest

pytestmark = pytest.mark.exhaustive

def test_every_case():
    pass
'''


def test_skips_fail_and_exhaustive_runs_only_when_named(tmp_path):
    # The copied conftest looks for tmp_path/../shared/data, which is not there.
    (tmp_path / "tests").mkdir()
    shutil.copy(HERE / "conftest.py", tmp_path / "tests" / "conftest.py")
    shutil.copy(HERE / "helpers.py", tmp_path / "tests" / "helpers.py")  # what the conftest imports
    (tmp_path / "tests" / "test_scratch.py").write_text(SCRATCH)
    (tmp_path / "tests" / "exhaustive").mkdir()
    (tmp_path / "tests" / "exhaustive" / "test_sweeps.py").write_text(SWEEPS)
    # No plugins but pytest's own: the rules are the conftest's, and loading the installed ones (hypothesis,
    # xdist, ...) cost each run a third of its time.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

    def pytest_(*args: str, path: str = "tests") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args, path],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)

    # Every test but the sweeps: the skip and the missing data fail, the CUDA tests skip (and only they may)
    # without a GPU, the two-GPU test with fewer than two.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    passed, skipped = (gpus >= 1) + (gpus >= 2), (gpus < 1) + (gpus < 2)
    out = pytest_()
    assert out.returncode == 1, out.stdout
    assert "skipped (Skipped: a reason); only CUDA tests may skip, on a machine without a GPU" in out.stdout
    assert "Failed: real data sets not found at" in out.stdout
    assert "FAILED tests/test_scratch.py::test_skips" in out.stdout
    assert "ERROR tests/test_scratch.py::test_needs_data" in out.stdout
    summary = out.stdout.splitlines()
    assert [line.split(" - ")[0] for line in summary if line.startswith(("FAILED ", "ERROR "))] == [
        "ERROR tests/test_scratch.py::test_needs_data", "FAILED tests/test_scratch.py::test_skips"], out.stdout
    counts = ["1 failed"] + [f"{passed} passed"] * bool(passed) + [f"{skipped} skipped"] * bool(skipped)
    assert re.search(", ".join(counts + ["2 deselected", r"(\d+ warnings, )?1 error in"]), out.stdout), out.stdout
    if not gpus:
        assert "needs a CUDA GPU" in out.stdout
    elif gpus < 2:
        assert "needs two GPUs" in out.stdout
    out = pytest_("-m", "exhaustive and not cuda")
    assert out.returncode == 0 and "2 passed, 4 deselected" in out.stdout, out.stdout
    out = pytest_(path="tests/exhaustive")
    assert out.returncode == 0 and "1 passed" in out.stdout and "deselected" not in out.stdout, out.stdout
    out = pytest_("-m", "exhaustive and cuda")
    assert out.returncode == 5, out.stdout  # what .ci/run treats as a failure
    # CI names its tiers in one command: one whose tests are gone fails it, though the others pass.
    (tmp_path / "tests" / "emptied").mkdir()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/exhaustive",
                          "tests/emptied"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "1 passed" in out.stdout, out.stdout
    assert "tests/emptied: no test of this folder ran" in out.stdout + out.stderr
