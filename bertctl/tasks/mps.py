"""CUDA MPS for the suite's runs side by side on a GPU.

Without MPS a GPU time-slices between processes: only one process's kernels run at a time, so five small
fine-tuning runs on one GPU take about as long as five runs in turn. Under an MPS server their kernels run
together (``benchmarks/results/restarts-sst2-minilm-mps-h200-*.json``). ``sharing`` starts a private MPS
control daemon for the suite's lifetime (its pipe and log folders in a temporary folder, so it touches no
other user's MPS), checks that a CUDA context can be made through it, and stops it at the end. Where MPS
is already running, or cannot start, the runs go as they would without it, and the suite says which.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

CONTROL = "nvidia-cuda-mps-control"
# The folder an MPS daemon started without CUDA_MPS_PIPE_DIRECTORY listens in.
DEFAULT_PIPE_DIRECTORY = Path("/tmp/nvidia-mps")
# One CUDA context made through the driver API, without importing torch (which takes seconds): the check
# that clients can reach the server before any run depends on it.
PROBE = [sys.executable, "-c",
         "import ctypes, sys\n"
         "cuda = ctypes.CDLL('libcuda.so.1')\n"
         "dev, ctx = ctypes.c_int(), ctypes.c_void_p()\n"
         "rc = cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0) or "
         "cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)\n"
         "sys.exit(rc)\n"]
TIMEOUT = 60


def _say(message: str) -> None:
    from bertctl.progress import stderr

    stderr.print(message)


def running_already() -> bool:
    """Whether this process's CUDA clients already go through an MPS server: the user's own daemon."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    return bool(pipe) or (DEFAULT_PIPE_DIRECTORY / "control").exists()


@contextlib.contextmanager
def sharing(gpus_shared: Sequence[str], say=_say) -> Iterator[dict[str, str]]:
    """Within the block, runs side by side on the GPUs ``gpus_shared`` (CUDA device ids, empty: no GPU holds
    more than one run) share them through MPS. Yields the environment the runs need: the private daemon's
    folders, or nothing where no daemon of ours is needed or can start."""
    if not gpus_shared or running_already():
        yield {}
        return
    control = shutil.which(CONTROL)
    if control is None:
        say(f"suite: {CONTROL} is not on PATH, so runs sharing a GPU take turns on it (CUDA MPS runs them together)")
        yield {}
        return
    root = Path(tempfile.mkdtemp(prefix="bertctl-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    for folder in env.values():
        Path(folder).mkdir()
    full = {**os.environ, **env}
    started = False
    try:
        started = _call([control, "-d"], full) == 0
        if started and _call(PROBE, full) == 0:
            say(f"suite: runs sharing GPU {', '.join(gpus_shared)} go through CUDA MPS (a daemon of this suite's, "
                f"stopped at its end)")
            yield env
            return
        why = "its daemon did not start" if not started else "no CUDA context could be made through it"
        say(f"suite: CUDA MPS is unavailable here ({why}), so runs sharing a GPU take turns on it")
        started = started and _call([control], full, "quit\n") != 0  # stopped now: nothing left to stop
        yield {}
    finally:
        if started:
            _call([control], full, "quit\n")
        shutil.rmtree(root, ignore_errors=True)


def _call(argv: list[str], env: dict[str, str], stdin: str | None = None) -> int:
    try:
        return subprocess.run(argv, env=env, input=stdin, text=True, capture_output=True, timeout=TIMEOUT).returncode
    except (OSError, subprocess.SubprocessError):
        return -1
