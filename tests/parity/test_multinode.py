"""Several nodes under torchrun, on the CPU: two "nodes" of two gloo processes each on localhost, joined by
torchrun's c10d rendezvous as separate machines would be, sharing the run folder as a shared filesystem.

The result must equal one process at the same global batch, and a job killed with its nodes after a checkpoint
resumes, started again on both, to the uninterrupted run's weights.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
COMMON = ("--model-size", "tiny", "--batch-size", "16", "--lr", "2e-3", "--device", "cpu", "--no-progress",
          "--log-every", "1", "--eval-batches", "2", "--save-minutes", "1000", "--dropout", "0", "--seed", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(port: int, run_id: str, args: list[str], *, host: bool) -> subprocess.Popen:
    """One node's torchrun agent: 2 processes, c10d rendezvous at 127.0.0.1:port, whose store the ``host`` node
    serves (as the first machine would)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--rdzv-conf", f"is_host={int(host)}", "-m", "bertctl", *args]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if host:  # the others connect once its store listens
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and p.poll() is None, "the rendezvous store did not start"
                time.sleep(0.1)
    return p


def kill_node(p: subprocess.Popen) -> None:
    """SIGKILL a node: its agent and every process below it (torchrun starts each worker in a session of its own,
    so the agent's process group does not hold them)."""
    tree, frontier = [p.pid], [p.pid]
    while frontier:
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", ",".join(map(str, frontier))],
                                  capture_output=True, text=True).stdout.split()
        frontier = [int(c) for c in children]
        tree += frontier
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.communicate()


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_node(p)
        out, err = p.stdout.read() if p.stdout and not p.stdout.closed else "", ""
        pytest.fail(f"a node did not finish in {timeout} s:\n{err[-3000:]}")
    return p.returncode, out, err


def weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "model" / "model.safetensors")


def one_process(data_dir: Path, out: Path, *extra: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "bertctl", "pretrain", "--data", str(data_dir), "--output", str(out),
                        *COMMON, *extra], env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.long
def test_two_nodes_of_two_processes_equal_one_process(data_dir, tmp_path):
    """Global batch 16: one process in 2 micro-batches of 8; 4 ranks on 2 nodes with 4 rows each."""
    ref = one_process(data_dir, tmp_path / "one", "--max-steps", "3", "--micro-batch-size", "8")
    port, args = free_port(), ["pretrain", "--data", str(data_dir), "--output", str(tmp_path / "two"), *COMMON,
                               "--max-steps", "3"]
    nodes = [node(port, "same", args, host=True), node(port, "same", args, host=False)]
    results = [finish(p) for p in nodes]
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    summary = json.loads(next(out for _, out, _ in results if out.strip()))
    assert summary["world_size"] == 4
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc"):
        assert summary["train"][key] == pytest.approx(ref["train"][key], rel=1e-5, abs=1e-6), key
    w1, w4 = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in w1:
        torch.testing.assert_close(w4[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.long
def test_a_job_killed_with_its_nodes_resumes_to_the_same_weights(data_dir, tmp_path):
    """A node dies after the step-2 checkpoint and the job goes down with it (both nodes killed, as a scheduler
    tears a multi-node job down); started again on both nodes, it resumes and ends as the uninterrupted run."""
    from bertctl.checkpoints import training

    one_process(data_dir, tmp_path / "one", "--max-steps", "20", "--micro-batch-size", "8")
    out = tmp_path / "run"
    # Every node runs the same command; --resume starts a new run in an empty folder and resumes otherwise.
    args = ["pretrain", "--data", str(data_dir), "--output", str(out), *COMMON, "--max-steps", "20",
            "--save-every", "2", "--resume"]
    port = free_port()
    first, second = node(port, "before", args, host=True), node(port, "before", args, host=False)
    deadline = time.time() + 240
    while (training.latest_checkpoint(out) is None or training.latest_checkpoint(out).step < 2):
        assert time.time() < deadline and first.poll() is None and second.poll() is None, first.stderr.read()[-3000:]
        time.sleep(0.05)
    for p in (second, first):
        kill_node(p)
    killed_at = training.latest_checkpoint(out).step
    assert killed_at < 20, "the run ended before it was killed"
    port = free_port()
    first, second = node(port, "after", args, host=True), node(port, "after", args, host=False)
    results = [finish(first), finish(second)]
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    summary = json.loads(next(o for _, o, _ in results if o.strip()))
    assert summary["world_size"] == 4 and summary["start_step"] == killed_at and summary["steps"] == 20
    w1, w4 = weights(tmp_path / "one"), weights(out)
    for k in w1:
        torch.testing.assert_close(w4[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)
