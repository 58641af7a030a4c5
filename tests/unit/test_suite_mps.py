"""The suite's private CUDA MPS daemon (bertctl.tasks.mps), with a stand-in nvidia-cuda-mps-control on PATH
that records how it was called: started with private folders, given to the runs, stopped at the end; and the
fallbacks when it cannot start or the user runs MPS already."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bertctl.tasks import mps

FAKE = """#!/bin/sh
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$(cat)" >> "{log}"
exit {rc}
"""


def fake_control(tmp_path: Path, monkeypatch, rc: int = 0) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    script = bin_dir / mps.CONTROL
    script.write_text(FAKE.format(log=log, rc=rc))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIRECTORY", tmp_path / "no-default-daemon")
    return log


def test_private_daemon_started_given_to_runs_and_stopped(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    monkeypatch.setattr(mps, "PROBE", [sys.executable, "-c", "import os, sys; sys.exit(0 if os.environ['CUDA_MPS_PIPE_DIRECTORY'] else 1)"])
    said = []
    with mps.sharing(["0"], say=said.append) as env:
        pipe, logs = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
        assert pipe.is_dir() and logs.is_dir() and pipe.parent == logs.parent
        calls = log.read_text().splitlines()
        assert calls == [f"-d pipe={pipe} log={logs} stdin="]
    calls = log.read_text().splitlines()
    assert calls[1] == f" pipe={pipe} log={logs} stdin=quit"  # the daemon of ours is stopped
    assert not pipe.parent.exists()  # and its folders removed
    assert len(said) == 1 and "go through CUDA MPS" in said[0]


def test_probe_failure_stops_the_daemon_and_runs_take_turns(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    monkeypatch.setattr(mps, "PROBE", [sys.executable, "-c", "raise SystemExit(1)"])
    said = []
    with mps.sharing(["0", "1"], say=said.append) as env:
        assert env == {}
        calls = log.read_text().splitlines()
        assert len(calls) == 2 and calls[0].startswith("-d ") and calls[1].endswith("stdin=quit")  # stopped at once
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and calls[1].endswith("stdin=quit")  # stopped once, not twice
    assert "no CUDA context could be made" in said[0] and "take turns" in said[0]


def test_daemon_that_does_not_start(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch, rc=1)
    said = []
    with mps.sharing(["0"], say=said.append) as env:
        assert env == {}
    assert len(log.read_text().splitlines()) == 1  # tried to start; nothing to stop
    assert "its daemon did not start" in said[0]


@pytest.mark.parametrize("users_own", ["env", "default"])
def test_users_own_mps_is_left_alone(tmp_path, monkeypatch, users_own):
    log = fake_control(tmp_path, monkeypatch)
    if users_own == "env":
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "theirs"))
    else:
        (tmp_path / "no-default-daemon").mkdir()
        (tmp_path / "no-default-daemon" / "control").touch()
    with mps.sharing(["0"], say=pytest.fail) as env:
        assert env == {}
    assert not log.exists()


def test_nothing_shared_or_no_control_program(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch)
    with mps.sharing([], say=pytest.fail) as env:
        assert env == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    said = []
    with mps.sharing(["0"], say=said.append) as env:
        assert env == {}
    assert "not on PATH" in said[0]


def test_run_jobs_gives_gpu_runs_the_environment(tmp_path, monkeypatch):
    from bertctl.tasks.suite import Job, Slot, run_jobs

    out = tmp_path / "env.txt"
    job = Job("x", [sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(os.environ.get('CUDA_MPS_PIPE_DIRECTORY', '-'))"],
              tmp_path / "x.log")
    run_jobs([job], [Slot("0", 2)], gpu_env={"CUDA_MPS_PIPE_DIRECTORY": "/p"}, poll=0.01)
    assert job.returncode == 0 and out.read_text() == "/p"
    cpu_job = Job("y", job.argv, tmp_path / "y.log")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    run_jobs([cpu_job], [Slot("cpu", 1)], gpu_env={"CUDA_MPS_PIPE_DIRECTORY": "/p"}, poll=0.01)
    assert out.read_text() == "-"  # CPU runs need no MPS
