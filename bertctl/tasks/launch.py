"""How the suite starts its runs: forked from a process that has imported torch already, where it safely can.

Every fine-tuning run of a suite is its own ``bertctl`` process (``bertctl.tasks.suite``), and each fresh
process spends seconds importing torch, ``torch._dynamo`` (the optimizer's first parameter group imports it)
and sympy (through ``torch.fx.experimental.symbolic_shapes``, which loading a model imports) before it does
any work. Five runs side by side on one GPU import them five times at once, after the suite has planned.
``Launcher`` imports them once, in a thread while the suite plans, and then forks each ``bertctl`` run from
the suite's process: the child starts with those modules loaded and runs the command as ``python -m
bertctl`` would, with its own environment, log and signals, and with bertctl's own modules imported
afresh (so none of the suite's state, its folder's lock included, carries over).

A fork is safe only from a process that runs no other Python thread (the child would inherit the locks it
held) and has not started CUDA (the CUDA driver cannot be used in the child of a process that initialised
it). Where either is not so, for a command that is not ``bertctl``, and for runs on the CPU (``refuse``),
the run starts as a new process, as before. The one native thread these imports leave, numpy's OpenBLAS
thread server, idles on a condition variable, and OpenBLAS shuts it down around a fork itself (so Python
3.12's warning about forking a process with threads does not apply to it).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import IO, Mapping, Sequence

# The modules every run imports that cost most to import; third-party only, since each child imports bertctl
# afresh (a module of bertctl's imported here would carry the suite's state, or register its operators twice).
PRELOAD = ("torch", "numpy", "safetensors.torch", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")
OPTIONAL = ("tensorboard.summary.writer.event_file_writer",)  # the metrics log's TensorBoard writer, if installed


def die_with_parent() -> None:
    """A run must not outlive its suite (a killed suite would leave it writing a folder the rerun resumes)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU's device node: what ``--device auto`` may use, known without
    starting CUDA or nvidia-smi."""
    return any(name[len("nvidia"):].isdigit() for name in os.listdir("/dev") if name.startswith("nvidia"))


def cuda_started() -> bool:
    """Whether this process has opened the NVIDIA driver (CUDA's initialisation does): a forked child then
    could not use CUDA."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return True  # cannot tell: do not fork
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


class Forked:
    """A forked run, answering as ``subprocess.Popen`` does for what the suite asks of a process."""

    def __init__(self, pid: int, argv: Sequence[str]):
        self.pid, self.args, self.returncode = pid, list(argv), None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost, so count it failed
                pid, status = self.pid, 1 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (a reaped pid may belong to another process by now)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """Starts the suite's processes; ``preload`` imports ``PRELOAD`` in the background from now on."""

    def __init__(self, preload: bool = True):
        self._thread = None
        self.why_not: str | None = None  # why runs start as new processes, once known
        self.first_start: float | None = None  # time.monotonic() when the first process started
        self.imports: dict[str, float] = {}  # seconds each preloaded module took, in import order
        self.preloaded_at: float | None = None  # time.monotonic() when the imports ended
        if not sys.platform.startswith("linux"):
            self.why_not = "forking is only done on Linux"
        elif preload:
            self._thread = threading.Thread(target=self._preload, name="bertctl-preload", daemon=True)
            self._thread.start()
        else:
            self.why_not = "preloading is off"

    def _preload(self) -> None:
        _preload(self.imports)
        self.preloaded_at = time.monotonic()

    def refuse(self, why: str) -> None:
        """Start every later run as a new process, for the reason ``why`` (the imports, if begun, go on)."""
        self.why_not = why

    def forkable(self) -> bool:
        """Whether the next bertctl run can be forked from here (waits for the imports)."""
        if self.why_not is not None:
            return False
        if self._thread is not None:
            self._thread.join()
        if self.why_not is None:
            if cuda_started():
                self.why_not = "this process has started CUDA"
            elif threading.active_count() > 1:
                self.why_not = "this process runs other threads"
        return self.why_not is None

    def start(self, argv: Sequence[str], *, env: Mapping[str, str], log: IO[bytes]):
        """Start ``argv`` with ``log`` as its stdout and stderr; returns a ``Popen`` or a ``Forked``."""
        argv = list(argv)
        fork = argv[:3] == [sys.executable, "-m", "bertctl"] and self.forkable()
        self.first_start = self.first_start or time.monotonic()
        if not fork:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                                    preexec_fn=die_with_parent)
        for stream in (sys.stdout, sys.stderr, log):  # or the child would write their buffers again
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _run_in_child(argv[3:], dict(env), log.fileno(), parent)  # does not return
        return Forked(pid, argv)


def for_runs_on(device: str) -> Launcher:
    """The suite's launcher for runs on ``device`` (its --device): it preloads only where they may go to a GPU,
    since runs on the CPU are not forked (``refuse``)."""
    return Launcher(preload=device != "cpu" and (device != "auto" or gpu_present()))


preloaded = False  # whether this process imported PRELOAD for its runs (so its own exit may skip their teardown)


def _preload(seconds: dict[str, float]) -> None:
    """Import ``PRELOAD`` and what of ``OPTIONAL`` is installed, noting each one's seconds in ``seconds``."""
    import importlib
    import importlib.util

    global preloaded
    preloaded = True

    for name in PRELOAD + OPTIONAL:
        t0 = time.monotonic()
        try:
            if name in PRELOAD or importlib.util.find_spec(name.split(".")[0]) is not None:
                importlib.import_module(name)
        except Exception:  # an optional writer that does not import is the run's to report, not the suite's
            if name in PRELOAD:
                raise
        seconds[name] = round(time.monotonic() - t0, 3)


def _run_in_child(args: list[str], env: dict[str, str], log_fd: int, parent: int) -> None:
    """In the forked child: become ``python -m bertctl ARGS`` and exit with its status, never returning (the
    suite's frames below this one, its ``finally`` blocks included, are the suite's, not this run's)."""
    code = 1
    try:
        die_with_parent()
        if os.getppid() != parent:  # the suite died before the line above
            os._exit(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        # Fresh standard streams on the log, as a new process has (the suite's may be a test runner's).
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        # The suite's exit handlers (the release of its folder's lock) and finalisers are not this run's.
        atexit._clear()
        weakref.finalize._registry.clear()
        atexit.register(weakref.finalize._exitfunc)
        for name in [m for m in sys.modules if m == "bertctl" or m.startswith("bertctl.")]:
            del sys.modules[name]
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # read when torch loaded, in the suite: set it again
            import torch

            torch.set_num_threads(int(threads))
        import runpy

        main = str(Path(__file__).resolve().parent.parent / "__main__.py")
        sys.argv = [main, *args]
        try:
            runpy.run_module("bertctl", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        # What an interpreter does at its end: wait for the run's own threads, run its exit handlers.
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)
