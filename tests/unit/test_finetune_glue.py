"""GLUE and own-data classification: readers, errors, fine-tuning end to end on a tiny model, eval."""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.errors import BertctlError
from bertctl.tasks import glue
from test_finetune_support import data_path, head_lines, make_tiny_model_dir

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    d = tmp_path_factory.mktemp("sst2")
    head_lines(data_path("glue", "SST-2", "train.tsv"), d / "train.tsv", 97)  # header + 96 rows
    head_lines(data_path("glue", "SST-2", "dev.tsv"), d / "dev.tsv", 41)
    return d


def invoke(args):
    result = runner.invoke(app, args)
    return result


def losses(out):
    return [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(l)["event"] == "train"]


def test_sst2_end_to_end_and_eval(tiny, sst2, tmp_path):
    out = tmp_path / "out"
    r = invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--output",
                str(out), "--epochs", "6", "--lr", "2e-3", "--batch-size", "16", "--log-every", "3", "--no-progress",
                "--seed", "1"])
    assert r.exit_code == 0, r.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["train_examples"] == 96
    ls = losses(out)
    assert np.mean(ls[-3:]) < ls[0] - 0.05, ls  # the training loss falls (96 rows, 36 steps)
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "0", "1": "1"} and config["architectures"] == ["BertForSequenceClassification"]
    rows = (out / "predictions_sst2.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:3] == ["index", "prediction", "label"] and len(rows) == 41
    preds = [r.split("\t")[1] for r in rows[1:]]
    assert set(preds) <= {"0", "1"}
    # Accuracy recomputed here from the written predictions and the gold file.
    gold = [l.split("\t")[1].strip() for l in (sst2 / "dev.tsv").read_text().splitlines()[1:]]
    assert metrics["accuracy"] == pytest.approx(np.mean([p == g for p, g in zip(preds, gold)]))
    # bertctl eval on the fine-tuned directory gives the same score.
    r = invoke(["eval", "glue", "--task", "sst2", "--data", str(sst2 / "dev.tsv"), "--model", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout[r.stdout.index("{"):])["accuracy"] == pytest.approx(metrics["accuracy"])
    # A task folder holding only its dev file evaluates (no train.tsv needed), here in the canonical SST-2/.
    dev_only = tmp_path / "glue" / "SST-2"
    dev_only.mkdir(parents=True)
    (dev_only / "dev.tsv").write_bytes((sst2 / "dev.tsv").read_bytes())
    r = invoke(["eval", "glue", "--task", "sst2", "--data-dir", str(dev_only.parent), "--model", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout[r.stdout.index("{"):])["accuracy"] == pytest.approx(metrics["accuracy"])
    r = invoke(["eval", "glue", "--task", "sst2", "--data-dir", str(tmp_path / "glue" / "nothing"), "--model", str(out)])
    assert r.exit_code == 2 and "no dev.tsv here or in" in r.output, r.output


def test_saved_model_loads_in_transformers(tiny, sst2, tmp_path):
    import transformers
    import torch

    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.model import BertForSequenceClassification

    out = tmp_path / "out"
    r = invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--output",
                str(out), "--max-steps", "2", "--no-progress"])
    assert r.exit_code == 0, r.output
    ours = load_pretrained(BertForSequenceClassification, out / "model").eval()
    hf = transformers.BertForSequenceClassification.from_pretrained(out / "model").eval()
    ids = torch.tensor([[101, 2023, 2003, 2204, 102]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-5)
    assert hf.config.id2label == {0: "0", 1: "1"}


def test_head_mismatch_is_a_clear_error(tiny, sst2, tmp_path):
    out = tmp_path / "out"
    assert invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--output",
                   str(out), "--max-steps", "1", "--no-progress"]).exit_code == 0
    mnli = tmp_path / "dev_matched.tsv"
    mnli.write_text("index\tsentence1\tsentence2\tgold_label\n0\ta\tb\tneutral\n")
    r = invoke(["eval", "glue", "--task", "mnli", "--data", str(mnli), "--model", str(out)])
    assert r.exit_code == 2
    assert "2 labels" in r.output and "mnli has 3" in r.output


def test_canonical_layouts(tmp_path):
    cola = tmp_path / "CoLA"
    cola.mkdir()
    (cola / "train.tsv").write_text("gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n")
    (cola / "dev.tsv").write_text("gj04\t1\t\tGood one.\n")
    data = glue.load_data(task="cola", data_dir=tmp_path)
    assert [(e.text_a, e.label) for e in data.train] == [("Our friends won't buy this analysis.", "1"),
                                                         ("They drank the pub.", "0")]
    mnli = tmp_path / "MNLI"
    mnli.mkdir()
    header = "index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tgold_label\n"
    (mnli / "train.tsv").write_text(header + "0\t1\t1\tg\tx\tx\tx\tx\tA man.\tA person.\tentailment\tentailment\n")
    dev_header = header.replace("label1\t", "label1\tlabel2\tlabel3\tlabel4\tlabel5\t")
    for name in ("dev_matched.tsv", "dev_mismatched.tsv"):
        (mnli / name).write_text(dev_header + "0\t1\t1\tg\tx\tx\tx\tx\tA.\tB.\tneutral\tn\tn\tn\tn\tneutral\n")
    data = glue.load_data(task="mnli", data_dir=tmp_path)
    assert [n for n, _, _ in data.devs] == ["mnli_m", "mnli_mm"]
    assert data.train[0].text_b == "A person." and data.devs[1][2][0].label == "neutral"
    assert glue.main_metric_name(data) == "mnli_m_accuracy"
    stsb = tmp_path / "STS-B"
    stsb.mkdir()
    h = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    (stsb / "train.tsv").write_text(h + "0\tg\tf\t2012\t1\tn\tn\tA plane.\tAn airplane.\t5.000\n")
    (stsb / "dev.tsv").write_text(h + "0\tg\tf\t2012\t1\tn\tn\tA.\tB.\t1.5\n")
    data = glue.load_data(task="stsb", data_dir=tmp_path)
    assert data.task.labels is None and data.train[0].label == 5.0


def test_bad_rows_name_file_and_line(tmp_path):
    d = tmp_path / "SST-2"
    d.mkdir()
    (d / "train.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t7\ntoo\tmany\tcolumns\n")
    (d / "dev.tsv").write_text("sentence\tlabel\nok\t0\n")
    with pytest.raises(BertctlError, match=r"train.tsv:3: unknown label '7'"):
        glue.load_data(task="sst2", data_dir=d)
    data = glue.load_data(task="sst2", data_dir=d, skip_bad_rows=True)
    assert len(data.train) == 1 and len(data.reports[0].skipped) == 2
    assert "train.tsv:4: 3 columns, expected 2" in data.reports[0].skipped[1]


def test_own_data_csv_and_jsonl(tiny, tmp_path):
    train = tmp_path / "train.csv"
    rows = ["text,other,label"] + [f'"item {i}, with comma",x{i},{"pos" if i % 2 else "neg"}' for i in range(20)]
    train.write_text("\n".join(rows) + "\n")
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"text": f"item {i}", "other": "y", "label": "pos" if i % 2 else "neg"}) + "\n"
                           for i in range(6)))
    out = tmp_path / "out"
    r = invoke(["finetune", "glue", "--train", str(train), "--dev", str(dev), "--text-column", "text",
                "--text-pair-column", "other", "--label-column", "label", "--model", str(tiny), "--output", str(out),
                "--epochs", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "model" / "config.json").read_text())["id2label"] == {"0": "neg", "1": "pos"}
    r = invoke(["eval", "glue", "--data", str(dev), "--text-column", "text", "--text-pair-column", "other",
                "--label-column", "label", "--model", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a", "label": "pos"}\n{"text": "b"}\n')
    r = invoke(["finetune", "glue", "--train", str(bad), "--dev", str(dev), "--text-column", "text",
                "--label-column", "label", "--model", str(tiny), "--output", str(out)])
    assert r.exit_code == 2 and "bad.jsonl:2: missing column(s) label" in r.output


def test_regression_head(tiny, tmp_path):
    d = tmp_path / "STS-B"
    d.mkdir()
    h = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    rows = "".join(f"{i}\tg\tf\t2012\t1\tn\tn\tA cat {i}.\tA dog {i}.\t{i % 5}.0\n" for i in range(12))
    (d / "train.tsv").write_text(h + rows)
    (d / "dev.tsv").write_text(h + rows)
    out = tmp_path / "out"
    r = invoke(["finetune", "glue", "--task", "stsb", "--data-dir", str(d), "--model", str(tiny), "--output",
                str(out), "--epochs", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"pearson", "spearmanr"}
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["num_labels"] == 1 and config["problem_type"] == "regression"


def test_labels_are_scores_as_a_float_column_reads():
    def ex(*labels):
        return [glue.Example(f"r{i}", "a", None, label) for i, label in enumerate(labels)]
    assert glue.labels_are_scores(ex("3.4", "0", "5"))
    assert glue.labels_are_scores(ex("1.0", "0.0"))  # floats, though whole: a float column
    assert glue.labels_are_scores(ex(2.5, 1))  # JSON numbers
    assert glue.labels_are_scores(ex("2e-1", "1"))
    assert not glue.labels_are_scores(ex("1", "0", "2"))
    assert not glue.labels_are_scores(ex("pos", "3.5"))
    assert not glue.labels_are_scores(ex("nan", "1.5"))
    assert not glue.labels_are_scores(ex(True, False))


def test_own_scores_train_a_regression_without_the_flag(tiny, tmp_path):
    """Own data whose labels are decimal numbers train a regression as run_glue does (float column), say so,
    and eval scores it from the head alone; --no-regression keeps them classes."""
    train, dev = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    train.write_text("a\tb\tscore\n" + "".join(f"A cat {i}.\tA dog {i}.\t{i % 5}.{i % 3}\n" for i in range(16)))
    dev.write_text("a\tb\tscore\n" + "".join(f"A cat {i}.\tA cow {i}.\t{(i * 7) % 5}.5\n" for i in range(8)))
    cols = ["--text-column", "a", "--text-pair-column", "b", "--label-column", "score"]
    out = tmp_path / "out"
    r = invoke(["finetune", "glue", "--train", str(train), "--dev", str(dev), *cols, "--model", str(tiny), "--output",
                str(out), "--epochs", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "regression" in r.output and "--no-regression" in r.output
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["num_labels"] == 1 and config["problem_type"] == "regression"
    r = invoke(["eval", "glue", "--data", str(dev), *cols, "--model", str(out), "--output", str(tmp_path / "ev"),
                "--no-progress"])
    assert r.exit_code == 0, r.output
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    rows = [line.split("\t") for line in (tmp_path / "ev" / "predictions_dev.tsv").read_text().splitlines()[1:]]
    pred, gold = np.array([float(r[1]) for r in rows]), np.array([float(r[2]) for r in rows])
    # the file's 6 decimals against the tiny model's outputs, which spread over about 1e-4: rounding each
    # prediction by at most 5e-7 moves Pearson's r by at most about 5e-7 / std(predictions)
    assert metrics["pearson"] == pytest.approx(np.corrcoef(pred, gold)[0, 1], abs=2 * 5e-7 / pred.std())
    assert sorted(gold) == sorted((i * 7) % 5 + 0.5 for i in range(8))
    classes = tmp_path / "classes"
    r = invoke(["finetune", "glue", "--train", str(train), "--dev", str(train), *cols, "--no-regression", "--model",
                str(tiny), "--output", str(classes), "--epochs", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    config = json.loads((classes / "model" / "config.json").read_text())
    assert config["num_labels"] == len({f"{i % 5}.{i % 3}" for i in range(16)})


def test_unlabelled_test_file_gets_predictions(tiny, sst2, tmp_path):
    out = tmp_path / "out"
    assert invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--output",
                   str(out), "--max-steps", "1", "--no-progress"]).exit_code == 0
    test = tmp_path / "test.tsv"
    test.write_text("index\tsentence\n0\ta fine film .\n1\tdreadful .\n")
    r = invoke(["eval", "glue", "--task", "sst2", "--data", str(test), "--model", str(out), "--output",
                str(tmp_path / "pred"), "--no-progress"])
    assert r.exit_code == 0, r.output
    rows = (tmp_path / "pred" / "predictions_sst2.tsv").read_text().splitlines()
    assert len(rows) == 3 and all(r.split("\t")[1] in ("0", "1") for r in rows[1:])


def test_eval_of_a_transformers_fine_tuned_model_matches_transformers(tiny, sst2, tmp_path):
    """A classifier saved by transformers (labels LABEL_0/LABEL_1) is scored like transformers scores it."""
    import transformers
    import shutil

    import torch

    torch.manual_seed(3)
    config = transformers.BertConfig.from_pretrained(tiny, num_labels=2)
    hf = transformers.BertForSequenceClassification(config).eval()
    d = tmp_path / "hf"
    hf.save_pretrained(d)
    shutil.copy(tiny / "vocab.txt", d / "vocab.txt")
    tok = transformers.BertTokenizerFast(vocab_file=str(d / "vocab.txt"))
    rows = [l.split("\t") for l in (sst2 / "dev.tsv").read_text().splitlines()[1:]]
    enc = tok([r[0] for r in rows], padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        want = (hf(**enc).logits.argmax(-1).numpy() == np.array([int(r[1]) for r in rows])).mean()
    r = invoke(["eval", "glue", "--task", "sst2", "--data", str(sst2 / "dev.tsv"), "--model", str(d), "--no-progress",
                "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout[r.stdout.index("{"):])["accuracy"] == pytest.approx(want)


def test_tensorboard_events_follow_the_flag(tiny, sst2, tmp_path):
    """On by default (tensorboard is a test dependency): the train loss reaches an event file; off with the flag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--max-steps", "3",
            "--log-every", "1", "--no-progress", "--output"]
    assert invoke(args + [str(tmp_path / "on")]).exit_code == 0
    logged = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logged if r["event"] == "train"]
    acc = EventAccumulator(str(tmp_path / "on" / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    assert invoke(args + [str(tmp_path / "off"), "--no-tensorboard"]).exit_code == 0
    assert not (tmp_path / "off" / "tensorboard").exists()


def torchrun(args: list[str], env: dict, nproc: int = 2):
    """``python -m bertctl ARGS`` under torchrun on a free local port."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "bertctl", *args],
                          env=env, capture_output=True, text=True, timeout=600)


def test_two_gloo_processes_fine_tune_like_one(tiny, sst2, tmp_path):
    """torchrun with 2 CPU processes (gloo) = 1 process on the same global batches: same weights, and
    rank 0 alone writes the outputs. Batch 10 over 2 ranks with micro-batches of 2 (accumulation and
    DDP's no_sync path) against one process with micro-batches of 5; dropout off."""
    import os
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    common = ["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--max-steps", "4",
              "--batch-size", "10", "--dropout", "0", "--device", "cpu", "--no-progress", "--no-tensorboard",
              "--eval-batch-tokens", "128", "--output"]  # the 40 dev rows in several batches, which the ranks share
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    one = subprocess.run([sys.executable, "-m", "bertctl", *common, str(tmp_path / "one"), "--micro-batch-size", "5"],
                         env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    assert one.returncode == 0, one.stderr
    two = torchrun([*common, str(tmp_path / "two"), "--micro-batch-size", "2"], env)
    assert two.returncode == 0, two.stderr
    m1, m2 = json.loads(one.stdout), json.loads(two.stdout)  # rank 0 prints once
    # The run's own account of its wall time, against this process's clock around it.
    seconds = m1["seconds"]
    assert 0 < seconds["training_steps"] and 0 < seconds["evaluations"]
    assert seconds["training_steps"] + seconds["evaluations"] < seconds["since_process_start"] <= wall + 0.05
    assert json.loads((tmp_path / "one" / "metrics.json").read_text())["seconds"] == seconds
    assert m2["device"]["world_size"] == 2 and m2["accuracy"] == m1["accuracy"]
    w1, w2 = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("one", "two"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)
    evals = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["event"] == "final" for r in evals) == 1  # one writer
    # The epoch-end evaluation, shared by the two processes, scores as one process's.
    one_evals = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accuracy"] for r in evals if r["event"] == "eval"] == [
        r["accuracy"] for r in one_evals if r["event"] == "eval"] != []
    preds = [(tmp_path / d / "predictions_sst2.tsv").read_text() for d in ("one", "two")]
    assert preds[0] == preds[1]


@pytest.mark.cuda
@pytest.mark.two_gpus
def test_two_gpus_with_cuda_graphs_train_as_eager_ddp(tiny, sst2, tmp_path):
    """torchrun on 2 GPUs: the captured step (the normalisers and one flat gradient all-reduce inside
    the graph) trains as DDP's eager step, over batches of every length, with accumulation (micro-batches
    of 3 and 2 rows: the global batch 10 splits 5 + 5) and dropout on: same losses and weights."""
    import os

    import torch
    from safetensors.torch import load_file

    common = ["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--max-steps", "12",
              "--batch-size", "10", "--micro-batch-size", "3", "--attn", "sdpa", "--device", "cuda", "--log-every", "1",
              "--no-progress", "--no-tensorboard"]
    runs = {}
    for name, flags in (("eager", ["--no-cuda-graphs"]), ("graphs", ["--cuda-graphs", "--graph-min-steps", "1"])):
        r = torchrun([*common, *flags, "--output", str(tmp_path / name)], {**os.environ})
        assert r.returncode == 0, r.stderr
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    captured = [r for r in runs["graphs"] if r["event"] == "cuda_graphs"]
    assert captured and captured[0]["graphs"] > 1 and not [r for r in runs["eager"] if r["event"] == "cuda_graphs"]
    train = {k: [r["loss"] for r in v if r["event"] == "train"] for k, v in runs.items()}
    assert len(train["graphs"]) == len(train["eager"]) == 12
    torch.testing.assert_close(torch.tensor(train["graphs"]), torch.tensor(train["eager"]), rtol=1e-5, atol=1e-6)
    w1, w2 = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("eager", "graphs"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_short_run_reports_the_epochs_it_trained_and_a_failed_one_leaves_nothing(tiny, sst2, tmp_path):
    out = tmp_path / "short"
    r = invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--output",
                str(out), "--max-steps", "2", "--batch-size", "16", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "metrics.json").read_text())["epochs"] == pytest.approx(2 / 6, abs=1e-4)  # 96 rows / 16 = 6 steps
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    failed = tmp_path / "failed"
    r = invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(bad), "--output",
                str(failed), "--max-steps", "1", "--no-progress"])
    assert r.exit_code == 2 and not failed.exists()


def test_from_scratch_keeps_the_architecture_and_draws_every_weight_afresh(tiny, sst2, tmp_path):
    """--from-scratch: config from --model, weights from the seeded initialiser (no pretrained tensor kept)."""
    import torch

    from bertctl.checkpoints.hf import read_state_dict
    from bertctl.model import BertForSequenceClassification
    from bertctl.tasks.common import load_for_finetuning
    from bertctl.config import FinetuneConfig

    pretrained = read_state_dict(tiny)
    torch.manual_seed(3)
    scratch = load_for_finetuning(BertForSequenceClassification, tiny, cfg=FinetuneConfig.of(from_scratch=True), num_labels=2)
    loaded = load_for_finetuning(BertForSequenceClassification, tiny, cfg=FinetuneConfig.of(), num_labels=2)
    name, saved = "bert.embeddings.word_embeddings.weight", pretrained["embeddings.word_embeddings.weight"].float()
    assert torch.equal(loaded.state_dict()[name], saved)
    fresh = scratch.state_dict()[name]
    assert fresh.shape == saved.shape and not torch.allclose(fresh, saved)
    # The initialiser's distribution, N(0, initializer_range), not the checkpoint's.
    assert fresh.std().item() == pytest.approx(scratch.config.initializer_range, rel=0.05)
    torch.manual_seed(3)
    again = load_for_finetuning(BertForSequenceClassification, tiny, cfg=FinetuneConfig.of(from_scratch=True), num_labels=2)
    assert all(torch.equal(a, b) for a, b in zip(scratch.state_dict().values(), again.state_dict().values()))
    out = tmp_path / "out"
    r = invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--output",
                str(out), "--epochs", "1", "--batch-size", "16", "--no-progress", "--from-scratch"])
    assert r.exit_code == 0, r.output
    assert 0.0 <= json.loads((out / "metrics.json").read_text())["accuracy"] <= 1.0


def test_the_multi_process_benchmark_runs_and_summarises(tiny, sst2, tmp_path, monkeypatch):
    """benchmarks/finetune/ddp.py end to end on the CPU (one process, then torchrun with 2 gloo processes):
    every run succeeds, and the summary holds each configuration's metric and its examples/s ratio."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "finetune"))
    import ddp as finetune_ddp

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "ddp.json"
    rc = finetune_ddp.main(["--data", str(sst2), "--model", str(tiny), "--configs", "1x8,2x8", "--seeds", "42",
                            "--epochs", "1", "--work", str(tmp_path / "work"), "--out", str(out), "--",
                            "--device", "cpu", "--max-steps", "3", "--log-every", "1"])
    result = json.loads(out.read_text())
    assert rc == 0 and [r["rc"] for r in result["runs"]] == [0, 0]
    assert [r["world_size"] for r in result["runs"]] == [1, 2]
    one, two = result["summary"]
    assert one["examples_per_second_vs_first"] == 1.0 and two["runs"] == 1
    assert two["examples_per_second_vs_first"] == pytest.approx(  # rounded to 3 places
        two["train_examples_per_second"]["mean"] / one["train_examples_per_second"]["mean"], abs=5e-4)
    assert 0.0 <= two["accuracy"]["mean"] <= 1.0
    for run in result["runs"]:  # windows of one step: the first apart, the median of steps 2 and 3
        events = [json.loads(line) for line in (tmp_path / "work" / f"g{run['world_size']}-b8-s42" / "metrics.jsonl")
                  .read_text().splitlines()]
        windows = [e["seq_per_s"] for e in events if e.get("event") == "train"]
        assert len(windows) == 3 and run["first_window_seq_per_s"] == pytest.approx(windows[0], abs=0.05)
        assert run["later_windows_median_seq_per_s"] == pytest.approx((windows[1] + windows[2]) / 2, abs=0.05)
    assert two["later_windows_vs_first"] == pytest.approx(
        two["later_windows_median_seq_per_s"]["mean"] / one["later_windows_median_seq_per_s"]["mean"], abs=5e-4)
    # --rescore re-reads the run folders (as brought back from a GPU machine) and rebuilds the same summary
    assert finetune_ddp.main(["--rescore", "--data", str(sst2), "--model", str(tiny), "--work", str(tmp_path / "work"),
                              "--out", str(out)]) == 0
    assert json.loads(out.read_text())["summary"] == result["summary"]
    with pytest.raises(SystemExit, match="not GPUSxBATCH"):
        finetune_ddp.parse_configs("2x1")


def test_the_startup_timeline_marks_a_whole_run_in_order(tiny, sst2, tmp_path):
    """benchmarks/finetune/startup_timeline.py runs the command as the user starts it and marks each stage once, in the
    order the run goes through them, on one clock since process start that the run's own account agrees with."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out, timeline = tmp_path / "out", tmp_path / "timeline.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "finetune" / "startup_timeline.py"), "--json", str(timeline),
                           "finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny),
                           "--output", str(out), "--epochs", "1", "--max-steps", "2", "--device", "cpu",
                           "--no-progress", "--no-tensorboard"], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = json.loads(timeline.read_text())["events"]
    times, names = [t for t, _ in events], [n for _, n in events]
    assert times == sorted(times) and 0.0 <= times[0] < 5.0
    order = ["interpreter up", "torch imported", "bertctl imported", "> common.load_tokenizer", "> glue.featurize",
             "> common.load_for_finetuning", "> Engine.__init__", "> engine.build_optimizer", "> Engine.run",
             "< Engine.run", "> hf.save_pretrained", "> glue.evaluate_devs", "end"]  # the model saved, then evaluated
    assert [n for n in names if n in order] == [n for n in order for _ in range(names.count(n))]
    assert names.count("> Engine.run") == 1 and names.count("> glue.featurize") == 2  # train, then dev
    seconds = json.loads((out / "metrics.json").read_text())["seconds"]
    # metrics.json is written between the save and the end: its clock (since process start) lies between them
    save_end = times[names.index("< hf.save_pretrained")]
    assert save_end - 0.5 <= seconds["since_process_start"] <= times[-1] + 0.5


def test_the_multi_process_benchmark_runs_the_squad_split(tmp_path):
    """``--task squad``: ``finetune squad`` on the article split (train articles, scored on the eval ones),
    through torchrun for several GPUs, and F1 as the metric."""
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "finetune"))
    import ddp as finetune_ddp

    a = SimpleNamespace(task="squad", data=tmp_path, model=tmp_path / "m", epochs=1.0, extra=["--no-cuda-graphs"])
    cmd = finetune_ddp.command(2, 32, 42, tmp_path / "out", a)
    i = cmd.index("bertctl")
    assert cmd[i - 1] == "-m" and "--nproc-per-node" in cmd[:i]
    squad, split = str(tmp_path / "dev-v1.1.json"), str(tmp_path / "split.json")
    assert cmd[i + 1:i + 11] == ["finetune", "squad", "--train", squad, "--dev", squad, "--train-articles",
                                 f"{split}:train", "--dev-articles", f"{split}:eval"]
    assert cmd[-1] == "--no-cuda-graphs" and cmd[cmd.index("--batch-size") + 1] == "32"


def test_full_batch_steps_equal_the_transformers_trainers(tiny, sst2, tmp_path):
    """The fine-tuning recipe is the transformers Trainer's, step for step: with the whole training set in each batch
    (so the data order cannot matter) and no dropout, both start from one checkpoint, task head included, and take 12
    AdamW steps with the same flags (lr 1e-3, 10% warm-up then linear decay, weight decay 0.5 (large, so that
    decaying the wrong parameters shows), clipping at 1,
    eps 1e-6); the losses of every step and the final weights agree up to fp32 rounding."""
    import inspect
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import (BertForSequenceClassification, BertTokenizerFast, DataCollatorWithPadding, Trainer,
                              TrainingArguments)

    start = tmp_path / "start"
    torch.manual_seed(3)
    BertForSequenceClassification.from_pretrained(tiny, num_labels=2, hidden_dropout_prob=0.0,
                                                  attention_probs_dropout_prob=0.0).save_pretrained(start)
    for f in tiny.iterdir():
        if "token" in f.name or f.name == "vocab.txt":
            shutil.copy(f, start / f.name)
    steps, rows = 12, 96
    out = tmp_path / "out"
    r = invoke(["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(start), "--output", str(out),
                "--batch-size", str(rows), "--epochs", str(steps), "--lr", "1e-3", "--warmup-fraction", "0.1",
                "--weight-decay", "0.5", "--max-grad-norm", "1", "--dropout", "0", "--device", "cpu", "--log-every", "1",
                "--no-progress", "--seed", "5"])
    assert r.exit_code == 0, r.output
    ours = losses(out)

    tok = BertTokenizerFast.from_pretrained(start)
    lines = [l.split("\t") for l in (sst2 / "train.tsv").read_text().splitlines()[1:]]
    train = [dict(tok(text, truncation=True, max_length=128), labels=int(label)) for text, label in lines]
    assert len(train) == rows
    hf = BertForSequenceClassification.from_pretrained(start)
    warmup = "warmup_ratio" if "warmup_ratio" in inspect.signature(TrainingArguments).parameters else "warmup_steps"
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=rows, learning_rate=1e-3,
                             num_train_epochs=steps, **{warmup: 0.1}, weight_decay=0.5, max_grad_norm=1.0,
                             adam_epsilon=1e-6, lr_scheduler_type="linear", seed=5, logging_steps=1, report_to="none",
                             save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=hf, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tok))
    trainer.train()
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(ours) == len(theirs) == steps
    assert ours[-1] < ours[0] - 0.01  # it learns: the steps are not all the same
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    final = load_file(out / "model" / "model.safetensors")
    for name, p in hf.state_dict().items():
        if name in final:
            torch.testing.assert_close(final[name], p, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert set(hf.state_dict()) - set(final) <= {"bert.embeddings.position_ids"}, set(hf.state_dict()) - set(final)


def test_the_output_folder_rule_keeps_every_run(tiny, sst2, tmp_path):
    """A rerun, a resume of a finished run, a rerun over an interrupted one and a second run at once each keep
    the work that is there (bertctl.rundir)."""
    from bertctl import rundir

    out = tmp_path / "out"
    args = ["finetune", "glue", "--task", "sst2", "--data-dir", str(sst2), "--model", str(tiny), "--output", str(out),
            "--max-steps", "2", "--save-every", "1", "--no-progress", "--no-tensorboard"]
    assert runner.invoke(app, args).exit_code == 0
    finished = (out / "metrics.json").read_bytes()
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "finished finetune sst2 run; pass --overwrite" in " ".join(r.output.split())
    r = runner.invoke(app, args + ["--resume"])
    assert r.exit_code == 2 and "nothing to resume" in r.output
    assert (out / "metrics.json").read_bytes() == finished
    (out / rundir.LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                               "started": rundir._start_time(os.getppid()), "command": "finetune"}))
    r = runner.invoke(app, args + ["--overwrite"])  # another live process holds the folder
    assert r.exit_code == 2 and f"pid {os.getppid()}" in r.output and "is writing this folder" in r.output
    (out / rundir.LOCK).unlink()
    r = runner.invoke(app, args + ["--overwrite"])
    assert r.exit_code == 0, r.output
    assert not (out / rundir.REPLACED).exists() and rundir.is_finished(out)
    # An interrupted run (killed after a checkpoint): a plain rerun is refused, and the checkpoint stays.
    from helpers import kill_at_checkpoint

    cut = tmp_path / "cut"
    long = [a if a != str(out) else str(cut) for a in args]
    long[long.index("--max-steps") + 1] = "200"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    step = kill_at_checkpoint([sys.executable, "-m", "bertctl", *long], cut, 1, env)
    r = runner.invoke(app, long)
    assert r.exit_code == 2 and f"unfinished finetune sst2 run (a checkpoint at step {step})" in " ".join(r.output.split())
    from bertctl.checkpoints import training

    assert training.latest_checkpoint(cut).step == step


@pytest.mark.parametrize("workers", [1, 2])
def test_features_equal_transformers_tokenizer_in_and_out_of_workers(minilm_dir, shared_data, monkeypatch, workers):
    """Each example's ids and segment ids are BertTokenizerFast's for the pair, truncated longest-first, in this
    process or in worker processes (whose features travel back packed a chunk at a time)."""
    import transformers

    monkeypatch.setattr(glue, "PARALLEL_CHARS", 0)  # workers even for these few texts
    rows = [l.split("\t") for l in (shared_data / "glue" / "SST-2" / "dev.tsv").read_text().splitlines()[1:301]]
    examples = [glue.Example(guid=f"dev-{i}", text_a=a[0], text_b=b[0] if i % 3 else None, label=a[1])
                for i, (a, b) in enumerate(zip(rows, rows[1:] + rows[:1]))]
    tokenizer = glue.common.load_tokenizer(minilm_dir)
    features = glue.featurize(examples, tokenizer, glue.task_spec("sst2"), max_seq_length=24, workers=workers)
    reference = transformers.BertTokenizerFast.from_pretrained(minilm_dir)
    for e, f in zip(examples, features, strict=True):
        want = reference(e.text_a, e.text_b, truncation="longest_first", max_length=24)
        assert f["input_ids"].tolist() == want["input_ids"]
        assert f["token_type_ids"].tolist() == want["token_type_ids"]
        assert f["labels"] == int(e.label)
