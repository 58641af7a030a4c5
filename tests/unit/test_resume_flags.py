"""A resumed run continues the run it was made as: a flag that changes the run is refused by name with both
values, one that may change is said, and pretraining's schedule is extended only when asked."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from bertctl import faults, rundir
from bertctl.cli.app import app
from test_finetune_support import data_path, head_lines, make_tiny_model_dir

runner = CliRunner()


def one_line(r) -> str:
    return " ".join(r.output.replace("│", " ").split())  # help tables and wrapped lines read as one line


@pytest.fixture
def fault(monkeypatch):
    def set_fault(spec: str) -> None:
        monkeypatch.setenv(faults.ENV, spec)
        monkeypatch.setattr(faults, "_hits", {})
    yield set_fault


def sst2_run(tmp_path):
    """A tiny model and 32 SST-2 rows (4 steps an epoch at batch 8): the output folder and the run's flags."""
    tiny = make_tiny_model_dir(tmp_path / "tiny")
    sst2 = tmp_path / "sst2"
    sst2.mkdir()
    head_lines(data_path("glue", "SST-2", "train.tsv"), sst2 / "train.tsv", 33)
    head_lines(data_path("glue", "SST-2", "dev.tsv"), sst2 / "dev.tsv", 9)
    out = tmp_path / "out"
    return out, ["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "-o", str(out),
                 "--batch-size", "8", "--no-progress", "--no-tensorboard"]


def test_finetune_resume_refuses_another_lr_and_says_a_changed_log_cadence(tmp_path, fault, monkeypatch):
    out, args = sst2_run(tmp_path)
    args += ["--lr", "5e-5"]
    fault("step@3:SIGINT")
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "stopped (SIGINT) at step 3/12" in one_line(r), r.output
    monkeypatch.delenv(faults.ENV)
    r = runner.invoke(app, [*args[:-1], "1e-4", "--resume"])
    assert r.exit_code == 2
    assert f"--lr 0.0001: the finetune run in {out} was made with --lr 5e-05" in one_line(r), r.output
    r = runner.invoke(app, [*args, "--resume", "--log-every", "7"])
    assert r.exit_code == 0, r.output
    assert "resuming with --log-every 7 (the run had 50)" in one_line(r)
    assert rundir.is_finished(out)


def test_finetune_help_lists_what_a_resume_may_change():
    r = runner.invoke(app, ["finetune", "ner", "--help"])
    assert "except --no-progress, --log-every" in one_line(r)


def test_pretrain_resume_refuses_another_model_size_and_extends_only_when_asked(tmp_path, data_dir):
    out = tmp_path / "run"
    args = ["pretrain", "--data", str(data_dir), "-o", str(out), "--model-size", "tiny", "--batch-size", "8",
            "--max-steps", "6", "--no-progress", "--no-tensorboard", "--device", "cpu", "--eval-batches", "1"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*args, "--resume", "--max-steps", "10"])
    assert r.exit_code == 2 and "finished its 6-step schedule" in one_line(r) and "--init-from" in one_line(r)
    (out / rundir.MARKER).unlink()  # as if the run had stopped after its last checkpoint, before its export
    shutil.rmtree(out / "model")
    r = runner.invoke(app, [*args, "--resume", "--model-size", "mini"])
    assert r.exit_code == 2 and "--model-size mini: the pretrain run" in one_line(r)
    assert "made with --model-size tiny" in one_line(r)
    r = runner.invoke(app, [*args[:-4], "--resume", "--max-steps", "10"])
    assert r.exit_code == 2 and "planned for 6 steps" in one_line(r) and "--extend-schedule" in one_line(r)
    r = runner.invoke(app, [a for a in args if a not in ("--model-size", "tiny")] + ["--resume", "--max-steps", "10",
                                                                                     "--extend-schedule"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["steps"] == 10 and summary["final_lr"] == 0.0
    lrs = [json.loads(l)["lr"] for l in (out / "metrics.jsonl").read_text().splitlines()
           if json.loads(l).get("event") == "train" and json.loads(l)["step"] > 6]
    assert lrs and all(lr > 0 for lr in lrs[:-1])  # the extra steps train: no step at lr 0 before the last


def test_finetune_resume_extends_its_schedule_only_when_asked(tmp_path, fault, monkeypatch):
    out, args = sst2_run(tmp_path)
    args += ["--log-every", "1"]
    r = runner.invoke(app, [*args, "--extend-schedule"])
    assert r.exit_code == 2 and "--extend-schedule continues a run: give it with --resume" in one_line(r)
    fault("step@3:SIGINT")
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "stopped (SIGINT) at step 3/12" in one_line(r), r.output
    monkeypatch.delenv(faults.ENV)
    r = runner.invoke(app, [*args, "--resume", "--epochs", "4"])
    assert r.exit_code == 2 and "--epochs 4.0: the finetune run" in one_line(r), r.output
    assert "planned with --epochs 3.0" in one_line(r) and "--extend-schedule" in one_line(r)
    r = runner.invoke(app, [*args, "--resume", "--epochs", "4", "--extend-schedule"])
    assert r.exit_code == 0, r.output
    assert "extending the schedule from 12 to 16 steps" in one_line(r)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epochs"] == 4.0
    train = {json.loads(l)["step"]: json.loads(l)["lr"] for l in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(l).get("event") == "train"}
    assert max(train) == 16
    later = [train[s] for s in sorted(train) if s > 3]
    # From step 3 the lr decays linearly to 0 at step 16: equal decrements, none at 0 before the end.
    steps = [s for s in sorted(train) if s > 3]
    assert all(lr > 0 for lr in later[:-1])
    per_step = [(a - b) / (t - s) for (s, a), (t, b) in zip(zip(steps, later), zip(steps[1:], later[1:]))]
    assert max(per_step) == pytest.approx(min(per_step), rel=1e-6)
