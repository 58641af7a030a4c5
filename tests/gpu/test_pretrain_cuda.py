"""Pretraining on a GPU (marked cuda): a run killed and resumed continues its loss curve within
the run-to-run noise of bf16 GPU training, and fp16 with loss scaling trains.

Same shards as tests/parity/test_pretrain.py (conftest's data_dir: a few inaugural addresses, a small
WordPiece vocabulary); a mini BERT (4 layers, hidden 256), so each run takes seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertctl.checkpoints import training
from helpers import kill_at_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.cuda

STEPS = 120


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bertctl", "pretrain", "--data", str(data), "--output", str(out),
            "--model-size", "mini", "--batch-size", "32", "--lr", "1e-3", "--device", "cuda", "--no-progress",
            "--log-every", "4", "--eval-batches", "4", "--max-steps", str(STEPS), "--save-every", "10",
            "--save-minutes", "1000", "--keep", "3", "--seed", "7", *extra]


def _run(*args: str) -> dict:
    done = subprocess.run(list(args), env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _train_losses(run: Path) -> dict[int, float]:
    """step -> mean training loss of the log window ending there (the last record per step wins:
    a resumed run logs the steps after its checkpoint again)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def test_killed_and_resumed_run_continues_the_loss_curve(data_dir, tmp_path):
    a, c, b = tmp_path / "a", tmp_path / "c", tmp_path / "b"
    _run(*_args(data_dir, a, "--precision", "bf16"))
    _run(*_args(data_dir, c, "--precision", "bf16"))  # the same run again: GPU run-to-run noise
    killed_at = kill_at_checkpoint(_args(data_dir, b, "--precision", "bf16"), b, STEPS // 3, ENV)
    assert killed_at < STEPS
    summary = _run(*_args(data_dir, b, "--precision", "bf16", "--resume"))
    assert summary["start_step"] == killed_at and summary["steps"] == STEPS

    la, lb, lc = _train_losses(a), _train_losses(b), _train_losses(c)
    after = [s for s in sorted(la) if s > killed_at + 4]
    assert after and all(s in lb and s in lc for s in after)
    # The curve continues: right after the resume the loss is where the uninterrupted run's is,
    # far below where training started.
    first = after[0]
    assert lb[first] < la[min(la)] - 0.5, (lb[first], la[min(la)])
    # Within noise: the resumed run differs from the uninterrupted one no more than a repeat of the
    # uninterrupted run does (the max over the steps after the kill, with a floor for lucky repeats).
    noise = max(abs(la[s] - lc[s]) for s in after)
    gap = max(abs(la[s] - lb[s]) for s in after)
    assert gap <= max(3 * noise, 0.05), (gap, noise)
    # The held-out MLM loss at the end, likewise.
    ea, eb, ec = (json.loads((r / "metrics.jsonl").read_text().splitlines()[-1]) for r in (a, b, c))
    assert ea["event"] == eb["event"] == ec["event"] == "end"
    mlm_a, mlm_b, mlm_c = (e["eval_end"]["mlm_loss"] for e in (ea, eb, ec))
    assert abs(mlm_a - mlm_b) <= max(3 * abs(mlm_a - mlm_c), 0.05), (mlm_a, mlm_b, mlm_c)


def test_fp16_with_loss_scaling_trains_and_checkpoints_its_scaler(data_dir, tmp_path):
    out = tmp_path / "fp16"
    summary = _run(*_args(data_dir, out, "--precision", "fp16"))
    assert summary["precision"] == "fp16" and summary["stopped"] is None
    losses = _train_losses(out)
    steps = sorted(losses)
    assert losses[steps[-1]] < losses[steps[0]] - 0.5, losses
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in recs if r.get("event") == "train"]
    assert scales and all(s > 0 and s == s for s in scales)
    ckpt = torch.load(training.latest_checkpoint(out).path / "state.pt", weights_only=True)
    assert ckpt["scaler"]["scale"] == scales[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_steps_pretrain_as_the_eager_steps(data_dir, tmp_path, precision):
    """CUDA graphs (the default on a GPU) replay the eager step (the same maths, data, masks and
    dropout): the same loss curve and the same weights at the end, one graph per padded length."""
    eager, graphed = tmp_path / "eager", tmp_path / "graphed"
    _run(*_args(data_dir, eager, "--precision", precision, "--max-steps", "40", "--no-cuda-graphs"))
    _run(*_args(data_dir, graphed, "--precision", precision, "--max-steps", "40"))  # on by default
    le, lg = _train_losses(eager), _train_losses(graphed)
    assert sorted(le) == sorted(lg) and len(le) == 10
    torch.testing.assert_close(torch.tensor([lg[s] for s in sorted(lg)]), torch.tensor([le[s] for s in sorted(le)]),
                               rtol=1e-4, atol=1e-5)
    recs = [json.loads(x) for x in (graphed / "metrics.jsonl").read_text().splitlines()]
    graphs = [r for r in recs if r.get("event") == "cuda_graphs"]
    assert graphs and 1 <= graphs[-1]["graphs"] <= 4 and graphs[-1]["eager_steps"] == 0
    we = torch.load(training.latest_checkpoint(eager).path / "state.pt", weights_only=True)["model"]
    wg = torch.load(training.latest_checkpoint(graphed).path / "state.pt", weights_only=True)["model"]
    for k, v in we.items():
        torch.testing.assert_close(wg[k], v, rtol=1e-3, atol=1e-4, msg=k)


def test_a_second_phase_keeping_the_optimizer_follows_its_schedule_under_graphs(data_dir, tmp_path):
    """--init-from a run --keep-optimizer sets the new phase's lr on the loaded param groups: under
    graphs the captured AdamW must still read the scheduled lr each step (not the value at capture),
    so the phase trains as the eager phase does."""
    phase1 = tmp_path / "phase1"
    _run(*_args(data_dir, phase1, "--precision", "fp32", "--max-steps", "20", "--no-cuda-graphs"))
    runs = {}
    for mode in ("--no-cuda-graphs", "--cuda-graphs"):
        out = tmp_path / mode.strip("-")
        _run(*_args(data_dir, out, "--precision", "fp32", "--max-steps", "40", "--init-from", str(phase1),
                    "--keep-optimizer", "--lr", "3e-3", "--warmup-steps", "8", mode))
        runs[mode] = _train_losses(out)
    eager, graphed = runs["--no-cuda-graphs"], runs["--cuda-graphs"]
    assert sorted(eager) == sorted(graphed) and len(eager) == 10
    torch.testing.assert_close(torch.tensor([graphed[s] for s in sorted(graphed)]),
                               torch.tensor([eager[s] for s in sorted(eager)]), rtol=1e-4, atol=1e-5)


@pytest.mark.two_gpus
def test_two_gpus_with_cuda_graphs_pretrain_as_eager_ddp(data_dir, tmp_path):
    """torchrun on 2 GPUs: the captured step (untrimmed batches, so both ranks replay the same graphs;
    the normalisers and the gradient averaging inside the graph) trains as DDP's eager step, with
    accumulation (micro-batches of 8 of each rank's 16) and dropout on: same losses and weights."""
    from test_finetune_glue import torchrun

    runs = {}
    for name, flag in (("eager", "--no-cuda-graphs"), ("graphs", "--cuda-graphs")):
        out = tmp_path / name
        args = _args(data_dir, out, "--precision", "fp32", "--max-steps", "24", "--micro-batch-size", "8", flag)
        r = torchrun(args[args.index("pretrain"):], dict(ENV))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    captured = [r for r in runs["graphs"] if r.get("event") == "cuda_graphs"]
    assert captured and captured[-1]["eager_steps"] == 0
    assert not [r for r in runs["eager"] if r.get("event") == "cuda_graphs"]
    train = {k: [r["loss"] for r in v if r.get("event") == "train"] for k, v in runs.items()}
    assert len(train["graphs"]) == len(train["eager"]) == 6
    torch.testing.assert_close(torch.tensor(train["graphs"]), torch.tensor(train["eager"]), rtol=1e-4, atol=1e-5)
    we = torch.load(training.latest_checkpoint(tmp_path / "eager").path / "state.pt", weights_only=True)["model"]
    wg = torch.load(training.latest_checkpoint(tmp_path / "graphs").path / "state.pt", weights_only=True)["model"]
    for k, v in we.items():
        torch.testing.assert_close(wg[k], v, rtol=1e-3, atol=1e-4, msg=k)
