"""Training checkpoints: everything needed to continue a run exactly.

Layout under the run directory::

    checkpoints/step-00000100/state.pt   model, optimizer, scheduler, loss scaler, step,
                                         every rank's RNG states, data position, configs
    checkpoints/step-00000100/meta.json  the same minus tensors, for people and scripts

Each checkpoint directory is written with ``bertctl.io.atomic_dir``: it appears
under its final name only when complete, so a kill mid-write leaves the previous
checkpoints untouched and at most a ``.step-*.tmp`` folder that is ignored here.
"""
from __future__ import annotations

import contextlib
import random
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bertctl import faults
from bertctl.checkpoints.writes import write_errors
from bertctl.errors import BertctlError
from bertctl.io import atomic_dir, write_json

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d{8,})$")


# --------------------------------------------------------------------------- RNG states


def capture_rng() -> dict:
    """This process's RNG states (torch CPU, CUDA, numpy, python) as tensors and plain tuples."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    """Put back the RNG states ``capture_rng`` took."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------- save / find / load


@dataclass
class Checkpoint:
    path: Path
    step: int


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def list_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Complete checkpoints of a run, oldest first (half-written ``.tmp`` folders are skipped)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / "state.pt").is_file():
            found.append(Checkpoint(p, int(m.group(1))))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: str | Path, step: int, state: dict, meta: dict, keep: int | None = None) -> Path:
    """Write ``state`` (torch objects) and ``meta`` (JSON) atomically as ``step-NNNNNNNN``; keep the last ``keep``."""
    target = checkpoint_dir(run_dir) / f"step-{step:08d}"
    with atomic_dir(target) as tmp:
        with write_errors(target):
            torch.save(state, tmp / "state.pt")
        write_json(tmp / "meta.json", meta)
        faults.point("checkpoint")
    if keep is not None and keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
    return target


def host_copy(obj):
    """``obj`` with every tensor copied to host memory and every dict, list and tuple rebuilt: a
    snapshot that training can go on changing the live tensors and containers beside."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple takes its fields as arguments
        return type(obj)(*(host_copy(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class CheckpointWriter:
    """Writes checkpoints in a background thread, so that training goes on while one goes to disk
    (``benchmarks/results/checkpoint-stall-cpu-b02f7fc.json``).

    ``submit`` snapshots the state to host memory (``host_copy``: a BERT-Large with AdamW is 4 GB,
    copied in a fraction of the seconds its write takes) and returns; at most one write is in flight,
    so a submit first waits for the previous one. ``wait`` returns once the last write is complete
    and raises its error, if it had one. A process killed mid-write leaves the previous checkpoint
    (``save_checkpoint`` publishes a folder only when complete)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, run_dir: str | Path, step: int, state: dict, meta: dict, keep: int | None = None,
               done=None, guard=None) -> Path:
        """Start writing ``state`` as checkpoint ``step``; ``done(path)`` runs in the writer once it is complete;
        ``guard()``: a context the write runs in (the run's ``StopSignal.writing``: no signal cuts it)."""
        self.wait()
        snapshot, meta = host_copy(state), host_copy(meta)

        def write():
            try:
                with guard() if guard is not None else contextlib.nullcontext():
                    path = save_checkpoint(run_dir, step, snapshot, meta, keep)
                if done is not None:
                    done(path)
            except BaseException as e:  # handed to the next wait()
                self._error = e

        self._thread = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        return checkpoint_dir(run_dir) / f"step-{step:08d}"

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint folder's ``state.pt`` onto the CPU (tensors and plain types only)."""
    f = Path(path) / "state.pt"
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise BertctlError(f"{f}: checkpoint not found") from None
    except Exception as e:  # a truncated or foreign file
        raise BertctlError(f"{f}: unreadable checkpoint ({type(e).__name__}: {e})") from None
