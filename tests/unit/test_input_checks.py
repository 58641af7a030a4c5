"""Inputs a run could not finish with are refused with one line before any training: empty dev sets, a
--max-seq-length past the model's positions, NER rows of another column count and tags only the dev file has,
held-out shards of another vocabulary, an unwritable output; long lists of tensor names are summarised."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bertctl.checkpoints.hf import summary
from bertctl.cli.app import app
from test_finetune_support import data_path, head_lines, make_tiny_model_dir

runner = CliRunner()


def one_line(r) -> str:
    return " ".join(r.output.split())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def sst2(tmp_path):
    head_lines(data_path("glue", "SST-2", "train.tsv"), tmp_path / "train.tsv", 17)
    head_lines(data_path("glue", "SST-2", "dev.tsv"), tmp_path / "dev.tsv", 9)
    return tmp_path


def glue(sst2, tiny, out, *extra):
    return runner.invoke(app, ["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny),
                               "-o", str(out), "--no-progress", "--no-tensorboard", *extra])


def test_a_header_only_dev_set_is_refused_before_training(sst2, tiny, tmp_path):
    (sst2 / "dev.tsv").write_text("sentence\tlabel\n")
    r = glue(sst2, tiny, tmp_path / "out")
    assert r.exit_code == 2 and f"{sst2 / 'dev.tsv'}: no examples" in one_line(r), r.output
    assert not (tmp_path / "out").exists()


def test_a_max_seq_length_past_the_models_positions_is_refused(sst2, tiny, tmp_path):
    r = glue(sst2, tiny, tmp_path / "out", "--max-seq-length", "100000")
    assert r.exit_code == 2 and "--max-seq-length 100000 is longer than the model's 512 positions" in one_line(r)
    assert not (tmp_path / "out").exists()


def test_ner_rows_keep_their_files_column_count_and_dev_tags_must_be_trained(tiny, tmp_path):
    rows = ["EU NNP B-NP B-ORG", "rejects VBZ B-VP O", "German JJ B-NP B-MISC", ". . O O", ""]
    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.txt").write_text("\n".join(rows * 4) + "\n")
    out = tmp_path / "out"
    args = ["finetune", "ner", "--data-dir", str(tmp_path), "--model", str(tiny), "-o", str(out), "--no-progress"]
    (tmp_path / "valid.txt").write_text("\n".join(rows[:1] + ["calls VBZ B-VP"] + rows[2:]) + "\n")
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and f"{tmp_path / 'valid.txt'}:2: 3 columns, but the file's rows have 4" in one_line(r)
    (tmp_path / "valid.txt").write_text("\n".join(["Bonn NNP B-NP B-LOC"] + rows[1:]) + "\n")
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "tag 'B-LOC' is not among" in one_line(r) and "no step would train it" in one_line(r)
    assert not out.exists()


def test_held_out_shards_of_another_vocabulary_are_refused(data_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for f in data_dir.iterdir():
        (other / f.name).symlink_to(f)
    (other / "manifest.json").unlink()
    manifest = json.loads((data_dir / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    r = runner.invoke(app, ["pretrain", "--data", str(data_dir), "--eval-data", str(other), "-o", str(tmp_path / "run"),
                            "--model-size", "tiny", "--batch-size", "8", "--max-steps", "2", "--no-progress"])
    assert r.exit_code == 2 and f"--eval-data {other}: built with another vocabulary" in one_line(r), r.output


def test_long_lists_of_names_are_summarised():
    names = [f"encoder.layer.{i}.weight" for i in range(96)]
    assert summary(names) == ("96 tensors (encoder.layer.0.weight, encoder.layer.1.weight, encoder.layer.2.weight, "
                              "encoder.layer.3.weight, and 92 more)")
    assert summary(names[:3]) == ", ".join(names[:3])
