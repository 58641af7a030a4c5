"""The build of bertctl._C (setup.py): a progress line per compiled file, an incremental build in a
kept directory, and a module in the source tree left alone when unchanged.

Each build runs setuptools' PEP 517 editable hook as pip does, in a child process; its stderr is
what ``pip install -v`` shows.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from bertctl._ext import OP_NAMES, compiled, kernels_loaded

ROOT = Path(__file__).resolve().parents[2]

HOOK = "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"


def build(wheels: Path) -> str:
    """Build as pip does (same BERTCTL_* switches as the module under test); the build's stderr."""
    wheels.mkdir()
    r = subprocess.run([sys.executable, "-c", HOOK, str(wheels)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"build failed:\n{r.stdout}\n{r.stderr}"
    return r.stderr


def test_module_loads_with_its_ops_and_build_info():
    module = compiled()
    assert module is not None and Path(module.__file__).parent == ROOT / "bertctl"
    assert set(kernels_loaded()) == set(OP_NAMES)
    info = module.build_info()
    assert set(info) == {"cuda"} and isinstance(info["cuda"], bool)
    if torch.version.cuda is None:
        assert info["cuda"] is False


def test_edit_recompiles_one_file_with_progress_and_no_change_compiles_nothing(tmp_path):
    module = Path(compiled().__file__)
    source = ROOT / "csrc" / "bertctl.cpp"  # the quickest file to compile
    os.utime(source)  # as an edit would

    seen = build(tmp_path / "edited")
    # Normally one file of several; all of them where build/ holds no build of these switches yet.
    assert re.search(r"^bertctl: compiling bertctl\._C, \d+ of \d+ files: .*csrc/bertctl\.cpp", seen, re.M), seen
    assert re.search(r"^bertctl: \[\d+/\d+\] csrc/bertctl\.cpp compiled \(\d+ s\)$", seen, re.M), seen
    assert re.search(r"^bertctl: built build/ext-\S+ in \d+ s$", seen, re.M), seen

    before = module.stat()
    seen = build(tmp_path / "unchanged")
    assert "bertctl: bertctl._C is up to date (build/ext-" in seen and "nothing to compile" in seen, seen
    assert "compiling" not in seen, seen
    after = module.stat()
    # Unchanged, the module in the source tree is not rewritten (a process that loaded it keeps it).
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
