"""NER's final report takes valid's tags from the last evaluation when the reported model is the one it
evaluated: valid is predicted once, and the outputs are those of predicting it again."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.tasks import base, ner
from test_finetune_support import conll_slice, data_path, make_tiny_model_dir

runner = CliRunner()
TIMINGS = ("seconds", "train_examples_per_second", "device", "time", "seq_per_s", "tokens_per_s")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def conll_dir(tmp_path):
    d = tmp_path / "conll"
    d.mkdir()
    for name, n in (("train", 48), ("valid", 16), ("test", 12)):  # valid and test from train: no unseen tag
        conll_slice(data_path("conll2003", "train.txt"), d / f"{name}.txt", n)
    return d


def run(tiny, data, out, monkeypatch, *, predict_valid_again: bool) -> dict[str, int]:
    """Fine-tune 3 steps (one evaluation, so its model is the one reported); returns the sets predicted, by file."""
    calls: dict[str, int] = {}
    predict_tags = ner._predict_tags

    def counted(model, data, *a, **k):
        name = data.path.rsplit("/", 1)[-1]
        calls[name] = calls.get(name, 0) + 1
        return predict_tags(model, data, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(ner, "_predict_tags", counted)
        if predict_valid_again:  # the final report as it was: no evaluation's outputs to take
            m.setattr(base.LastEvaluation, "reuse", lambda self, r: None)
        r = runner.invoke(app, ["finetune", "ner", "--data-dir", str(data), "--model", str(tiny), "--output", str(out),
                                "--max-steps", "3", "--batch-size", "8", "--seed", "3", "--no-progress",
                                "--device", "cpu"])
    assert r.exit_code == 0, r.output
    return calls


def outputs(out):
    metrics = {k: v for k, v in json.loads((out / "metrics.json").read_text()).items() if k not in TIMINGS}
    log = [{k: v for k, v in json.loads(l).items() if k not in TIMINGS}
           for l in (out / "metrics.jsonl").read_text().splitlines()]
    files = {p.name: p.read_text() for p in sorted(out.glob("predictions_*"))}
    return metrics, log, files


def test_conll_final_report_predicts_valid_once(tiny, tmp_path, monkeypatch):
    data = conll_dir(tmp_path)
    once = run(tiny, data, tmp_path / "once", monkeypatch, predict_valid_again=False)
    again = run(tiny, data, tmp_path / "again", monkeypatch, predict_valid_again=True)
    assert once == {"valid.txt": 1, "test.txt": 1}
    assert again == {"valid.txt": 2, "test.txt": 1}
    metrics, log, files = outputs(tmp_path / "once")
    assert (metrics, log, files) == outputs(tmp_path / "again")
    assert set(files) == {"predictions_valid.txt", "predictions_test.txt"} and "valid_f1" in metrics
