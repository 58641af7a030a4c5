"""The suite's launcher: a bertctl run forked from the suite's process runs with its own environment, log,
threads and exit handlers (the suite's folder lock survives it), a run that cannot be forked starts as a new
process, and a forked run answers poll, wait and terminate as a new process does."""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bertctl import rundir
from bertctl.tasks import launch

BERTCTL = [sys.executable, "-m", "bertctl"]


def env_of_child(launcher, tmp_path, **extra):
    log_path = tmp_path / f"env{len(list(tmp_path.glob('env*.log')))}.log"
    env = dict(os.environ, BERTCTL_NO_EXT="1", OMP_NUM_THREADS="1", **extra)
    with open(log_path, "ab") as log:
        p = launcher.start(BERTCTL + ["env", "--json"], env=env, log=log)
    assert p.wait(timeout=120) == 0, log_path.read_text()
    return p, json.loads(log_path.read_text())


def in_a_fresh_process(body: str, tmp_path) -> None:
    """Run ``body`` (with this module's helpers) as a script of its own: a test process may hold other tests'
    threads, from which nothing is forked."""
    script = tmp_path / "script.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      f"from test_launch import *\ntmp_path = Path({str(tmp_path)!r})\n{textwrap.dedent(body)}")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_bertctl_run_is_forked_with_its_own_environment_threads_and_log(tmp_path):
    in_a_fresh_process("""
        launcher = launch.Launcher()
        assert "BERTCTL_NO_EXT" not in os.environ and launcher.forkable(), launcher.why_not
        p, report = env_of_child(launcher, tmp_path)
        assert isinstance(p, launch.Forked) and p.args == BERTCTL + ["env", "--json"]
        # The child read its own environment: without the extension (BERTCTL_NO_EXT=1), on one thread.
        assert report["compiled_module"] is None and report["cpu_threads"] == 1
        assert report["native_encoder"] == "unavailable: BERTCTL_NO_EXT=1"
        assert "torch" in sys.modules  # preloaded here, so the child had it
        """, tmp_path)


def test_the_suites_exit_handlers_and_folder_lock_are_not_the_childs(tmp_path):
    """A child that ran the suite's exit handlers would release the suite's folder while the suite runs on."""
    in_a_fresh_process("""
        launcher = launch.Launcher()
        marker = tmp_path / "handler-ran"
        atexit.register(lambda: marker.write_text("ran"))
        claim = rundir.claim(tmp_path / "suite-out", command="test suite", started=lambda f: None)
        lock = tmp_path / "suite-out" / rundir.LOCK
        before = lock.read_text()
        p, _ = env_of_child(launcher, tmp_path)
        assert isinstance(p, launch.Forked)
        assert not marker.exists()
        assert lock.read_text() == before and json.loads(before)["pid"] == os.getpid()
        claim.release()
        """, tmp_path)


@pytest.fixture
def preloading(monkeypatch):
    """A launcher made in this test process imports in a thread and marks the process preloaded: the imports end
    within the test (a thread importing torch's modules beside later tests could deadlock with them), and the
    mark is taken off again."""
    monkeypatch.setattr(launch, "preloaded", False)
    yield
    for thread in threading.enumerate():
        if thread.name == "bertctl-preload":
            thread.join()


def test_runs_that_cannot_be_forked_start_as_new_processes(tmp_path, preloading):
    launcher = launch.Launcher()
    with open(tmp_path / "x.log", "ab") as log:  # not a bertctl command: always a new process
        p = launcher.start([sys.executable, "-c", "print('hi')"], env=os.environ, log=log)
    assert isinstance(p, subprocess.Popen) and p.wait(timeout=60) == 0
    assert (tmp_path / "x.log").read_text() == "hi\n"
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:  # a second thread: a fork could copy a lock it holds, so a new process
        p, report = env_of_child(launch.Launcher(), tmp_path)
        assert isinstance(p, subprocess.Popen) and report["cpu_threads"] == 1
    finally:
        stop.set()
        other.join()
    off = launch.Launcher(preload=False)
    p, _ = env_of_child(off, tmp_path)
    assert isinstance(p, subprocess.Popen) and off.why_not == "preloading is off"
    refused = launch.Launcher()
    refused.refuse("runs on the CPU")  # the suite's choice for CPU runs: no fork, whatever else holds
    p, _ = env_of_child(refused, tmp_path)
    assert isinstance(p, subprocess.Popen) and not refused.forkable() and refused.why_not == "runs on the CPU"


def test_the_suite_preloads_only_where_its_runs_may_go_to_a_gpu(monkeypatch, preloading):
    """Runs on the CPU start as new processes, so importing torch for them would only take the CPU from the first."""
    monkeypatch.setattr(os, "listdir", lambda path: ["nvidiactl", "nvidia-uvm", "null"])
    assert not launch.gpu_present()
    assert launch.for_runs_on("auto")._thread is None and launch.for_runs_on("cpu")._thread is None
    monkeypatch.setattr(os, "listdir", lambda path: ["nvidiactl", "nvidia0", "null"])
    assert launch.gpu_present()
    assert launch.for_runs_on("cpu")._thread is None
    for device in ("auto", "cuda", "cuda:1"):
        launcher = launch.for_runs_on(device)
        assert launcher._thread is not None
        launcher._thread.join()
        # What the suite's summary reports of them: each import's seconds, and when they ended.
        assert set(launch.PRELOAD) <= set(launcher.imports) and all(s >= 0 for s in launcher.imports.values())
        assert launcher.preloaded_at is not None and launcher.preloaded_at <= time.monotonic()


def spawned(code: str) -> int:
    """The pid of a new Python child running ``code``, which only ``os.waitpid`` reaps (a fork of a test runner
    would carry the runner's state, and a child that ran any of its code would talk on the runner's pipes)."""
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ)


def test_a_forked_process_answers_as_popen_does():
    pid = spawned("import time; time.sleep(60)")
    p = launch.Forked(pid, ["sleeper"])
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.1)
    p.terminate()
    assert p.wait(timeout=10) == -signal.SIGTERM and p.poll() == -signal.SIGTERM
    p.kill()  # ended and reaped: nothing is signalled
    assert launch.Forked(spawned("raise SystemExit(3)"), ["exits"]).wait(timeout=30) == 3


def test_a_command_called_in_process_returns_in_a_preloaded_process(preloading, capsys):
    """``main`` ends a preloaded process's own successful command at once; called with arguments, it returns."""
    from bertctl.cli import app

    launch.preloaded = True
    with pytest.raises(SystemExit) as done:
        app.main(["env", "--json"])
    assert done.value.code in (0, None) and json.loads(capsys.readouterr().out)["bertctl"]


@pytest.mark.cuda
def test_planning_on_a_gpu_starts_no_cuda_so_runs_fork(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 384, "num_hidden_layers": 6,
                                                      "intermediate_size": 1536, "num_attention_heads": 12,
                                                      "vocab_size": 30522, "max_position_embeddings": 512}))
    in_a_fresh_process("""
        from bertctl.tasks import suite
        launcher = launch.Launcher()
        slots = suite.plan_slots("auto", None, None, tmp_path, 32, 128, runs=5)
        assert slots[0].device == "0" and slots[0].capacity > 1, slots
        assert launcher.forkable(), launcher.why_not
        """, tmp_path)
