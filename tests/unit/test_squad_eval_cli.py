"""`bertctl eval squad --predictions`: the official scores from the command line."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from bertctl.cli.app import app
from test_finetune_support import data_path

runner = CliRunner()


def test_golden_bert_ensemble_scores():
    """EM 86.21 / F1 92.20: the BERT-Large ensemble's leaderboard entry (paper Table 2)."""
    r = runner.invoke(app, ["eval", "squad", "--data", str(data_path("squad", "dev-v1.1.json")),
                            "--predictions", str(data_path("squad", "predictions-v1.1-bert-ensemble.json"))])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert round(out["exact_match"], 2) == 86.21 and round(out["f1"], 2) == 92.20


def test_v2_rules_on_v1_data_with_odds(tmp_path):
    preds = json.loads(data_path("squad", "predictions-v1.1-bert-ensemble.json").read_text())
    odds = {q: 0.0 for q in preds}
    (tmp_path / "odds.json").write_text(json.dumps(odds))
    r = runner.invoke(app, ["eval", "squad", "--version-2", "--data", str(data_path("squad", "dev-v1.1.json")),
                            "--predictions", str(data_path("squad", "predictions-v1.1-bert-ensemble.json")),
                            "--na-prob", str(tmp_path / "odds.json")])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    # Every v1.1 question has an answer, so v2.0 rules give the same scores, all under HasAns.
    assert round(out["exact"], 2) == 86.21 and round(out["HasAns_f1"], 2) == 92.20
    assert out["HasAns_total"] == 10570 and "NoAns_total" not in out


def test_restricted_to_split_articles():
    split = data_path("squad", "split.json")
    r = runner.invoke(app, ["eval", "squad", "--data", str(data_path("squad", "dev-v1.1.json")),
                            "--predictions", str(data_path("squad", "predictions-v1.1-bert-ensemble.json")),
                            "--articles", f"{split}:eval"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["total"] == 5609


def test_bad_predictions_file(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text('{"a": 1}')
    r = runner.invoke(app, ["eval", "squad", "--data", str(data_path("squad", "dev-v1.1.json")),
                            "--predictions", str(bad)])
    assert r.exit_code == 2 and "p.json: prediction for a is not a string" in r.output
