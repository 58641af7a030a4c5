"""The fault-injection suite's helper: run a bertctl command with a fault (``BERTCTL_FAULT``, see
``bertctl.faults``), and compare two output folders' final results.

Runs go through a fork server: one Python process per test worker that has imported torch and bertctl
once and forks a child for each command, so that the hundred runs of the matrix cost their work, not a
4-second start-up each. A child is the command as ``python -m bertctl`` would run it: its own process,
its own signal handlers, its faults delivered to itself, its exit code (or the signal that killed it).
``run(..., real=True)`` starts a real interpreter instead (for limits set before exec, ``preexec_fn``).

    from harness import run, final_results
    r = run(["finetune", "glue", ...], fault="eval@2:SIGINT")
    assert r.rc == 0 and "stopped (SIGINT)" in r.stderr
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[2]

# The server: import once, then fork one child per request (a JSON line on stdin; the exit status on stdout).
SERVER = r'''
import atexit, json, os, resource, sys, time, traceback
import torch
torch.set_num_threads(1)
import bertctl.cli.app, bertctl.cli.finetune, bertctl.cli.pretrain, bertctl.faults
import bertctl.tasks.base, bertctl.tasks.glue, bertctl.tasks.squad, bertctl.tasks.ner, bertctl.tasks.swag
import bertctl.train.pretrain, bertctl.checkpoints.hf, bertctl.train.metrics
# What a run would import on its way (the optimizer's first use loads torch._dynamo; curves load matplotlib).
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot, safetensors.torch, torch._dynamo
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                f = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            if req.get("fsize"):
                resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
            if req.get("count"):  # how often each fault point is reached, for choosing the N of a fault
                hits = {}
                real = bertctl.faults.point
                def point(name, real=real):
                    hits[name] = hits.get(name, 0) + 1
                    real(name)
                bertctl.faults.point = point
                atexit.register(lambda: open(req["count"], "w").write(json.dumps(hits)))
            try:
                bertctl.cli.app.main(req["argv"])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.01)
    rc = None if status is None else (os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status))
    print(json.dumps({"rc": rc}), flush=True)
'''


@dataclass
class Result:
    rc: int | None  # the exit code, or minus the signal that ended the process; None: it ran past its timeout
    stdout: str
    stderr: str

    @property
    def text(self) -> str:
        """stderr with the terminal's line wrapping undone, for matching messages."""
        return " ".join(self.stderr.split())


class ForkServer:
    def __init__(self):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        ready = self.proc.stdout.readline()
        assert ready and json.loads(ready)["ready"], "the fork server did not start"

    def run(self, req: dict) -> int | None:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["rc"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


_server: ForkServer | None = None


def server() -> ForkServer:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = ForkServer()
    return _server


def run(argv: Sequence[str], *, fault: str | None = None, cwd: str | Path | None = None, env: dict | None = None,
        timeout: float = 180, real: bool = False, fsize: int | None = None,
        count: str | Path | None = None) -> Result:
    """``bertctl ARGV`` with ``BERTCTL_FAULT=fault`` (None: no fault): its exit code, stdout and stderr.

    ``fsize``: a real file-size limit (RLIMIT_FSIZE, bytes) in the child, so writes past it fail as on a full
    disk; ``real``: a fresh interpreter (``python -m bertctl``, the limit set in ``preexec_fn``) rather than a
    fork; ``count``: a file that receives how often each fault point was reached."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("BERTCTL_FAULT", None)
    if fault:
        env["BERTCTL_FAULT"] = fault
    cwd = str(cwd or ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        if real:
            def limit():
                if fsize:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

            try:
                p = subprocess.run([sys.executable, "-m", "bertctl", *argv], env=env, cwd=cwd, timeout=timeout,
                                   preexec_fn=limit, stdout=open(out, "w"), stderr=open(err, "w"))
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = None
        else:
            rc = server().run({"argv": list(argv), "env": env, "cwd": cwd, "stdout": str(out), "stderr": str(err),
                               "timeout": timeout, "fsize": fsize, "count": str(count) if count else None})
        return Result(rc, out.read_text(errors="replace"), err.read_text(errors="replace"))


def point_counts(argv: Sequence[str], **kw) -> tuple[Result, dict[str, int]]:
    """Run ``argv`` without a fault and count how often it reaches each fault point."""
    with tempfile.TemporaryDirectory() as tmp:
        count = Path(tmp) / "count.json"
        r = run(argv, count=count, **kw)
        return r, json.loads(count.read_text()) if count.exists() else {}


# ------------------------------------------------------------------------------------ results

#: metrics.json fields that are about the machine and the clock, not the run's result.
VOLATILE = {"seconds", "device", "train_examples_per_second"}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weights(model_dir: Path) -> dict[str, str]:
    """Each tensor of a model directory's model.safetensors, by name: a digest of its bytes (bit-exact)."""
    from safetensors.numpy import load_file

    return {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in load_file(model_dir / "model.safetensors").items()}


def final_results(folder: Path) -> dict:
    """What a finished run leaves for its user: the model's weights and config, metrics.json without the clock's
    fields, every predictions file, and (pretraining) the last held-out evaluation and the step reached."""
    folder = Path(folder)
    config = json.loads((folder / "model" / "config.json").read_text())
    out = {"weights": weights(folder / "model"), "config": {k: v for k, v in config.items() if k != "transformers_version"}}
    if (folder / "metrics.json").is_file():
        out["metrics"] = {k: v for k, v in json.loads((folder / "metrics.json").read_text()).items()
                          if k not in VOLATILE}
    for p in sorted(folder.glob("predictions*")) + sorted(folder.glob("null_odds.json")):
        out[p.name] = _digest(p)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ends = [r for r in records if r.get("event") == "end"]
    if ends:  # pretraining: its summary's final evaluation and length
        end = ends[-1]
        out["pretrain"] = {"steps": end["steps"], "eval_end": end.get("eval_end")}
    return out


def assert_same(folder: Path, reference: dict) -> None:
    """A run's final results equal the uninterrupted run's, exactly (resume is exact on the CPU)."""
    got = final_results(folder)
    for key in sorted(set(got) | set(reference)):
        assert got.get(key) == reference.get(key), f"{folder}: {key} differs from the uninterrupted run's"


# ------------------------------------------------------------------------------------ shared set-up

@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``root/name``, built once by ``build(path)`` for every test worker (the others wait for it)."""
    target = root / name
    with _locked(root / f".{name}.lock"):
        if not (root / f".{name}.done").exists():
            build(target)
            (root / f".{name}.done").write_text(str(time.time()))
    return target
