"""Files written before the reorganisation still load, and give the same numbers.

``tests/data/legacy-d8b6c0f/`` was written by bertctl at d8b6c0f on the CPU, one thread: a WordPiece vocabulary,
``build-data`` shards, a pretraining run stopped after its step-2 checkpoint (a micro BERT, ``config.json``), and a
fine-tuned SST-2 model with its metrics and predictions. Today's code resumes that run to the losses the
uninterrupted run logged then, and scores the fine-tuned model as it was scored then.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LEGACY = Path(__file__).resolve().parents[1] / "data" / "legacy-d8b6c0f"
EXPECTED = json.loads((LEGACY / "expected.json").read_text())


def bertctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "bertctl", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_interrupted_pretraining_run_resumes_to_the_old_losses(tmp_path):
    for name in ("data", "run-interrupted", "config.json"):
        src = LEGACY / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    bertctl("pretrain", "--data", "data", "--config", "config.json", "--batch-size", "8", "--max-steps", "4",
            "--save-every", "2", "--keep", "3", "--seed", "0", "--log-every", "1", "--no-progress",
            "--no-tensorboard", "--device", "cpu", "--output", "run-interrupted", "--resume", cwd=tmp_path)
    records = [json.loads(line) for line in (tmp_path / "run-interrupted" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "train"}
    want = {int(k): v for k, v in EXPECTED["pretrain_losses"].items()}
    assert sorted(losses) == sorted(want)
    for step, loss in want.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), step
    assert (tmp_path / "run-interrupted" / "model" / "model.safetensors").is_file()


def test_fine_tuned_model_scores_as_it_did(tmp_path, shared_data):
    dev = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text().splitlines(keepends=True)
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "dev.tsv").write_text("".join(dev[:1 + EXPECTED["finetune_dev_rows"]]))
    p = bertctl("eval", "glue", "--task", "sst2", "--data-dir", "sst2", "--model", str(LEGACY / "finetuned" / "model"),
                "--max-seq-length", "64", "--device", "cpu", "--no-progress", "-o", "out", cwd=tmp_path)
    metrics = json.loads(p.stdout[p.stdout.index("{"):])
    assert metrics["accuracy"] == EXPECTED["finetune_accuracy"]
    old = list(csv.reader(open(LEGACY / "finetuned" / "predictions_sst2.tsv"), delimiter="\t"))
    new_files = sorted((tmp_path / "out").glob("predictions*"))
    assert new_files, sorted(p.name for p in (tmp_path / "out").iterdir())
    new = list(csv.reader(open(new_files[0]), delimiter="\t"))
    # The last column names the source file and line, which moved with the data.
    assert [row[:-1] for row in new] == [row[:-1] for row in old]
    assert [row[-1].rsplit(":", 1)[1] for row in new[1:]] == [row[-1].rsplit(":", 1)[1] for row in old[1:]]


def test_old_shards_load_and_hold_what_their_manifest_says():
    from bertctl.data.dataset import PretrainingData

    manifest = json.loads((LEGACY / "data" / "manifest.json").read_text())
    data = PretrainingData(LEGACY / "data", verify="eager")
    counts = sum(s["num_instances"] for s in manifest["splits"]["train"]["shards"])
    assert data.num_instances == counts > 0
    assert (data.max_seq_length, data.vocab_size, data.objective) == (64, 500, "mlm-nsp")
