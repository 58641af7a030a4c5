"""MetricsLog: the JSONL log and the TensorBoard events beside it, read back with tensorboard's own reader."""
from __future__ import annotations

import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bertctl.errors import BertctlError
from bertctl.progress import MetricsLog, tensorboard_wanted


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_every_numeric_field_is_a_scalar_at_the_record_step(tmp_path):
    records = [dict(event="train", step=s, loss=1.0 / s, lr=1e-4 * s, seq_per_s=100 + s, epoch=1) for s in range(1, 301)]
    records += [
        dict(event="eval", step=150, mlm_acc=0.25, perplexity=123.5, split="dev", flag=True, nested={"a": 1.0}),
        dict(event="checkpoint", step=300, path="x/ckpt"),  # no numeric field: no event
        dict(event="final", accuracy=0.875, train_examples=1000),  # no step: at the last step seen (300)
        dict(loss=float("nan"), step=301),  # no event name: "metrics"
    ]
    with MetricsLog(tmp_path / "metrics.jsonl", tensorboard=True) as log:
        assert log.tensorboard_dir == tmp_path / "tensorboard"
        for r in records:
            log.log(**r)
    got = read_scalars(tmp_path / "tensorboard")
    assert sorted(got) == sorted(["train/loss", "train/lr", "train/seq_per_s", "train/epoch", "eval/mlm_acc",
                                  "eval/perplexity", "final/accuracy", "final/train_examples", "metrics/loss"])
    for key in ("loss", "lr", "seq_per_s", "epoch"):
        want = [(r["step"], r[key]) for r in records[:300]]
        assert [s for s, _ in got[f"train/{key}"]] == [s for s, _ in want]
        # simple_value is a float32 in the event proto
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([v for _, v in want], rel=1e-6)
    assert got["eval/mlm_acc"] == [(150, 0.25)] and got["eval/perplexity"] == [(150, 123.5)]
    assert got["final/accuracy"] == [(300, 0.875)] and got["final/train_examples"] == [(300, 1000.0)]
    assert got["metrics/loss"][0][0] == 301 and math.isnan(got["metrics/loss"][0][1])
    # The JSONL log is unchanged by it: every record, in order, with wall time.
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == len(records) and all("time" in line for line in lines)
    assert lines[0]["loss"] == 1.0 and lines[-2] == {**records[-2], "time": lines[-2]["time"]}


def test_wall_time_is_the_record_time(tmp_path):
    with MetricsLog(tmp_path / "m.jsonl") as log:
        log.log(event="train", step=1, loss=2.0, time=1234.5)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.wall_time for e in acc.Scalars("train/loss")] == [1234.5]


def test_off_writes_no_events(tmp_path):
    with MetricsLog(tmp_path / "metrics.jsonl", tensorboard=False) as log:
        assert log.tensorboard_dir is None
        log.log(event="train", step=1, loss=1.0)
    assert not (tmp_path / "tensorboard").exists()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_default_is_on_when_tensorboard_is_importable(tmp_path, monkeypatch):
    with MetricsLog(tmp_path / "a" / "metrics.jsonl") as log:
        assert log.tensorboard_dir == tmp_path / "a" / "tensorboard"
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert tensorboard_wanted(None) is False
    with MetricsLog(tmp_path / "b" / "metrics.jsonl") as log:
        assert log.tensorboard_dir is None
    with pytest.raises(BertctlError, match="pip install tensorboard"):
        tensorboard_wanted(True)


def test_no_path_logs_nothing(tmp_path):
    log = MetricsLog(None, tensorboard=True)
    log.log(event="train", step=1, loss=1.0)
    log.close()
    assert log.tensorboard_dir is None
