"""The performance trajectory: its reference (the newest run of the GPU kind that may serve as one, by its recorded
date where there is no git history; a run marked "reference": false is never the reference), and the probe of
its host's own speed."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TRAJECTORY = Path(__file__).resolve().parents[2] / "benchmarks" / "trajectory.py"


def load(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("trajectory_under_test", TRAJECTORY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    monkeypatch.setattr(module, "ROOT", tmp_path)  # no git repository here: files by their dates
    monkeypatch.setattr(module, "RESULTS", results)
    return module, results


def test_the_newest_run_that_may_serve_is_the_reference(tmp_path, monkeypatch):
    t, results = load(tmp_path, monkeypatch)
    runs = {"trajectory-h200-aaa.json": {"date": "2026-11-01"},
            "trajectory-h200-bbb.json": {"date": "2026-11-20"},
            "trajectory-h200-ccc.json": {"date": "2026-12-01", "reference": False},
            "trajectory-h100-ddd.json": {"date": "2026-12-02"}}
    for name, d in runs.items():
        (results / name).write_text(json.dumps({**d, "figures": {}}))
    assert t.reference("h200", "auto").name == "trajectory-h200-bbb.json"
    assert t.reference("h100", "auto").name == "trajectory-h100-ddd.json"
    assert t.reference("a100", "auto") is None
    assert t.reference("h200", "none") is None
    assert t.reference("h200", str(results / "trajectory-h200-ccc.json")).name == "trajectory-h200-ccc.json"
    # This run's own file, newest of all once written, is never its reference (it would compare the run with itself).
    own = results / "trajectory-h200-eee.json"
    own.write_text(json.dumps({"date": "2026-12-04", "figures": {}}))
    assert t.reference("h200", "auto", own).name == "trajectory-h200-bbb.json"
    assert t.reference("h200", "auto").name == "trajectory-h200-eee.json"


def test_the_host_probe_measures_and_compares(tmp_path, monkeypatch):
    """A run records how fast its host imports torch and runs Python, and the comparison says how the two hosts
    differ, or that the reference has no probe."""
    t, _ = load(tmp_path, monkeypatch)
    probe = t.host_probe(repeats=1)
    assert probe["torch_import_seconds"] > 0.05 and probe["python_loop_seconds"] > 0.01 and probe["cpus"] >= 1
    slower = {**probe, "torch_import_seconds": 2 * probe["torch_import_seconds"]}
    line = t.host_line(slower, probe)
    assert "import torch" in line and "+100%" in line and "Python loop" in line and "+0%" in line
    assert t.host_line(probe, None) == "host: no probe in the reference run"
