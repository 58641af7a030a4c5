"""The suite's own rules (tests/conftest.py), run on a scratch suite with the same conftest: a skip
fails unless it is a CUDA test without a GPU (or a two-GPU test with fewer), a missing shared data set fails, and the
exhaustive sweeps run only when -m names them or the command line names their folder."""
from __future__ import annotations

import os
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
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def pytest_(*args: str, path: str = "tests") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args, path],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)

    out = pytest_("-m", "not cuda")
    assert out.returncode == 1, out.stdout
    assert "skipped (Skipped: a reason); only CUDA tests may skip, on a machine without a GPU" in out.stdout
    assert "Failed: real data sets not found at" in out.stdout
    assert "FAILED tests/test_scratch.py::test_skips" in out.stdout
    assert "ERROR tests/test_scratch.py::test_needs_data" in out.stdout
    assert "1 failed, 4 deselected" in out.stdout and "1 error in" in out.stdout
    out = pytest_("-m", "exhaustive and not cuda")
    assert out.returncode == 0 and "2 passed, 4 deselected" in out.stdout, out.stdout
    out = pytest_(path="tests/exhaustive")
    assert out.returncode == 0 and "1 passed" in out.stdout and "deselected" not in out.stdout, out.stdout
    out = pytest_("-k", "test_gpu")
    assert out.returncode == 0, out.stdout
    assert ("1 passed" if torch.cuda.is_available() else "1 skipped") in out.stdout
    out = pytest_("-k", "test_two_gpus")
    assert out.returncode == 0, out.stdout
    assert ("1 passed" if torch.cuda.device_count() >= 2 else "1 skipped") in out.stdout
    out = pytest_("-m", "exhaustive and cuda")
    assert out.returncode == 5, out.stdout  # what .ci/run treats as a failure
