"""NER, SQuAD and SWAG end to end on a tiny random model; label alignment; readers' errors."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl import rundir
from bertctl.errors import BertctlError
from bertctl.tasks import ner, swag
from bertctl.tasks.metrics import conlleval
from test_finetune_support import conll_slice, data_path, make_tiny_model_dir, minilm_dir, squad_slice

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer():
    from bertctl.text.wordpiece import BertTokenizer

    return BertTokenizer.from_pretrained(minilm_dir())


def train_losses(out):
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["event"] == "train"]


# ------------------------------------------------------------------------------------ NER


def test_conll_reader_and_alignment_round_trip(tokenizer):
    data = ner.read_conll(data_path("conll2003", "valid.txt"))
    assert len(data.sentences) == 3250
    labels = ner.label_list(data)
    assert labels[0] == "O" and set(labels) == {"O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG",
                                                "B-PER", "I-PER"}
    part = ner.NerData(data.path, data.sentences[:300])
    l2i = {l: i for i, l in enumerate(labels)}
    feats = ner.featurize(part, tokenizer, l2i, max_seq_length=128)
    assert feats.truncated_words == 0
    for f, s in zip(feats.features, part.sentences):
        # Exactly one labelled piece per word, at the word's first piece, carrying its tag.
        labelled = np.flatnonzero(f["labels"] != -100)
        assert list(labelled) == [p for p in f["_first"] if p >= 0]
        pieces, word_index = tokenizer.tokenize_words(s.words)
        for w, p in enumerate(f["_first"]):
            assert p == 1 + word_index.index(w)
            assert labels[f["labels"][p]] == s.tags[w]
    # Round trip: logits that are one-hot on the labels decode to the original tags.
    logits = [np.eye(len(labels))[np.where(f["labels"] >= 0, f["labels"], 0)] for f in feats.features]
    decoded = ner.decode(feats.features, logits, labels)
    assert decoded == [s.tags for s in part.sentences]
    assert conlleval([s.tags for s in part.sentences], decoded)["f1"] == 1.0


def test_truncated_words_are_counted_and_tagged_o(tokenizer):
    data = ner.NerData("x", [ner.Sentence(["Paris"] * 20, ["B-LOC"] * 20, 1)])
    feats = ner.featurize(data, tokenizer, {"O": 0, "B-LOC": 1}, max_seq_length=10)
    assert feats.truncated_words == 12  # 8 pieces fit between [CLS] and [SEP]
    logits = [np.tile([0.0, 1.0], (10, 1))]
    assert ner.decode(feats.features, logits, ["O", "B-LOC"])[0] == ["B-LOC"] * 8 + ["O"] * 12


def test_conll_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects\n")
    with pytest.raises(BertctlError, match=r"bad.txt:4: expected 'token \.\.\. tag'"):
        ner.read_conll(bad)
    bad.write_text("EU NNP B-NP ORG-B\n")
    with pytest.raises(BertctlError, match=r"bad.txt:1: tag 'ORG-B'"):
        ner.read_conll(bad)


def test_ner_end_to_end_iob1(tiny, tmp_path):
    """Train on an IOB1 conversion of a CoNLL slice: tags are learned as written, scored by conlleval."""
    d = tmp_path / "conll"
    d.mkdir()
    for name, n in (("train", 48), ("valid", 16), ("test", 16)):
        src = ner.read_conll(conll_slice(data_path("conll2003", f"{name}.txt"), tmp_path / f"{name}.src", n))
        with open(d / f"{name}.txt", "w") as f:
            for s in src.sentences:
                prev = "O"
                for w, t in zip(s.words, s.tags):
                    # IOB2 -> IOB1: B- only when the previous tag is the same type.
                    if t.startswith("B-") and not (prev != "O" and prev[2:] == t[2:]):
                        t = "I-" + t[2:]
                    f.write(f"{w} NNP O {t}\n")
                    prev = t
                f.write("\n")
    out = tmp_path / "out"
    r = runner.invoke(app, ["finetune", "ner", "--data-dir", str(d), "--model", str(tiny), "--output", str(out),
                            "--epochs", "5", "--lr", "3e-3", "--batch-size", "8", "--log-every", "2", "--no-progress"])
    assert r.exit_code == 0, r.output
    metrics = json.loads((out / "metrics.json").read_text())
    ls = train_losses(out)
    assert np.mean(ls[-3:]) < ls[0], ls
    assert metrics["best_epoch"] in range(1, 6)
    # The valid F1 of the chosen epoch is the best one in the log (model chosen on valid).
    evals = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    best = max(e["valid_f1"] for e in evals if e["event"] == "eval")
    assert metrics["valid_f1"] == pytest.approx(best)
    # Predictions: "token gold pred" columns; rescoring them gives the reported test F1.
    sents, cur = [], []
    for line in (out / "predictions_test.txt").read_text().splitlines():
        if not line:
            sents.append(cur)
            cur = []
        else:
            cur.append(line.split(" "))
    assert all(len(c) == 3 for s in sents for c in s)
    rescored = conlleval([[c[1] for c in s] for s in sents], [[c[2] for c in s] for s in sents])
    assert rescored["f1"] == pytest.approx(metrics["test_f1"])
    r = runner.invoke(app, ["eval", "ner", "--data", str(d / "test.txt"), "--model", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout[r.stdout.index("{"):])["f1"] == pytest.approx(metrics["test_f1"])


# ------------------------------------------------------------------------------------ SQuAD


def test_squad_end_to_end(tiny, tmp_path):
    path = squad_slice(data_path("squad", "dev-v1.1.json"), tmp_path / "slice.json", articles=1, paragraphs=3)
    out = tmp_path / "out"
    r = runner.invoke(app, ["finetune", "squad", "--train", str(path), "--dev", str(path), "--model", str(tiny),
                            "--output", str(out), "--epochs", "8", "--lr", "2e-3", "--batch-size", "16",
                            "--log-every", "2", "--max-seq-length", "128", "--doc-stride", "64", "--no-progress"])
    assert r.exit_code == 0, r.output
    ls = train_losses(out)
    assert np.mean(ls[-2:]) < ls[0] - 0.5, ls
    metrics = json.loads((out / "metrics.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    data = json.loads(path.read_text())["data"]
    qids = {qa["id"] for a in data for p in a["paragraphs"] for qa in p["qas"]}
    assert set(preds) == qids and all(isinstance(v, str) for v in preds.values())
    # Scoring the written predictions with the official rules gives the reported numbers.
    r = runner.invoke(app, ["eval", "squad", "--data", str(path), "--predictions", str(out / "predictions.json")])
    scored = json.loads(r.stdout)
    assert scored["f1"] == pytest.approx(metrics["f1"]) and scored["exact_match"] == pytest.approx(metrics["exact_match"])
    r = runner.invoke(app, ["eval", "squad", "--data", str(path), "--model", str(out), "--max-seq-length", "128",
                            "--doc-stride", "64", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout[r.stdout.index("{"):])["f1"] == pytest.approx(metrics["f1"])


def test_squad_scores_its_dev_set_once_by_default_and_training_does_not_depend_on_it(tiny, tmp_path):
    """SQuAD scores the dev set once, after training (``--no-epoch-evals``, its default, as the paper's and Hugging
    Face's scripts do); ``--epoch-evals`` adds one evaluation an epoch, whose last equals the default run's, and the
    training is the same step for step: the same losses, the same final metrics and weights."""
    from safetensors.torch import load_file

    path = squad_slice(data_path("squad", "dev-v1.1.json"), tmp_path / "slice.json", articles=1, paragraphs=2)
    runs = {}
    for flag in ("", "--epoch-evals"):
        out = tmp_path / (flag.strip("-") or "default")
        r = runner.invoke(app, ["finetune", "squad", "--train", str(path), "--dev", str(path), "--model", str(tiny),
                                "--output", str(out), "--epochs", "3", "--batch-size", "16", "--log-every", "1",
                                "--max-seq-length", "128", "--doc-stride", "64", "--no-progress", "--device", "cpu"]
                               + ([flag] if flag else []))
        assert r.exit_code == 0, r.output
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[flag] = out, [e for e in events if e["event"] == "eval"], train_losses(out)
    (once, evals_once, losses_once), (each, evals_each, losses_each) = runs[""], runs["--epoch-evals"]
    assert [e["epoch"] for e in evals_once] == [3.0] and [e["epoch"] for e in evals_each] == [1.0, 2.0, 3.0]
    assert evals_each[-1]["f1"] == evals_once[0]["f1"] and losses_each == losses_once and len(losses_once) > 3
    m_once, m_each = (json.loads((o / "metrics.json").read_text()) for o in (once, each))
    assert (m_once["f1"], m_once["exact_match"]) == (m_each["f1"], m_each["exact_match"])
    w_once, w_each = (load_file(str(o / "model" / "model.safetensors")) for o in (once, each))
    assert all(torch.equal(w_once[k], w_each[k]) for k in w_once) and w_once.keys() == w_each.keys()


def test_ner_refuses_no_epoch_evals(tiny, tmp_path):
    """NER keeps the epoch with the best validation F1, so it needs an evaluation every epoch: one line, exit 2."""
    d = tmp_path / "conll"
    d.mkdir()
    for name in ("train", "valid", "test"):  # every set from train's sentences: no tag is unseen in training
        conll_slice(data_path("conll2003", "train.txt"), d / f"{name}.txt", 8)
    r = runner.invoke(app, ["finetune", "ner", "--data-dir", str(d), "--model", str(tiny), "--output",
                            str(tmp_path / "out"), "--no-epoch-evals", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 2 and "--no-epoch-evals" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_squad_v2_end_to_end(tiny, tmp_path):
    src = json.loads(squad_slice(data_path("squad", "dev-v1.1.json"), tmp_path / "s.json", 1, 2).read_text())
    # Make every third question unanswerable (v2.0 layout: no answers, is_impossible).
    k = 0
    for a in src["data"]:
        for p in a["paragraphs"]:
            for qa in p["qas"]:
                qa["is_impossible"] = k % 3 == 0
                if qa["is_impossible"]:
                    qa["answers"] = []
                k += 1
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(src))
    out = tmp_path / "out"
    r = runner.invoke(app, ["finetune", "squad", "--version-2", "--train", str(path), "--dev", str(path), "--model",
                            str(tiny), "--output", str(out), "--epochs", "2", "--max-seq-length", "128", "--no-progress"])
    assert r.exit_code == 0, r.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"HasAns_f1", "NoAns_f1", "null_score_diff_threshold"} <= set(metrics)
    odds = json.loads((out / "null_odds.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    tau = metrics["null_score_diff_threshold"]
    for q in preds:  # the empty answer exactly where s_null - s_best > τ
        assert (preds[q] == "") == (odds[q] > tau), (q, preds[q], odds[q], tau)
    # The reported F1 is the best over thresholds on this dev set (τ chosen on dev).
    r = runner.invoke(app, ["eval", "squad", "--version-2", "--data", str(path), "--predictions",
                            str(out / "predictions.json")])
    assert json.loads(r.stdout)["f1"] == pytest.approx(metrics["f1"])
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["squad_null_score_diff_threshold"] == pytest.approx(tau)


def test_squad_cli_errors(tiny, tmp_path):
    path = squad_slice(data_path("squad", "dev-v1.1.json"), tmp_path / "s.json", 1, 1)
    r = runner.invoke(app, ["finetune", "squad", "--train", str(path), "--train-articles", "nosuch.json:train",
                            "--dev", str(path), "--model", str(tiny), "--output", str(tmp_path / "o")])
    assert r.exit_code == 2 and "nosuch.json: split file not found" in r.output
    r = runner.invoke(app, ["eval", "squad", "--data", str(path), "--predictions", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "none.json: predictions file not found" in r.output


# ------------------------------------------------------------------------------------ SWAG


def test_swag_end_to_end_jsonl_and_csv(tiny, tmp_path):
    sample = data_path("swag", "sample.jsonl")
    examples = swag.read_swag(sample)
    assert len(examples) == 10 and examples[1].label == 3
    csv_path = tmp_path / "val.csv"
    import csv

    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1",
                    "ending2", "ending3", "label"])
        for i, e in enumerate(examples):
            w.writerow([i, "v", i, e.context + " " + e.start, e.context, e.start, "gold", *e.endings, e.label])
    assert [e.endings for e in swag.read_swag(csv_path)] == [e.endings for e in examples]
    out = tmp_path / "out"
    r = runner.invoke(app, ["finetune", "swag", "--train", str(sample), "--dev", str(csv_path), "--model", str(tiny),
                            "--output", str(out), "--epochs", "12", "--lr", "2e-3", "--batch-size", "4",
                            "--log-every", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    ls = train_losses(out)
    # 36 steps over the 10 examples: from chance (ln 4) to well below it (0.22-0.41 over seeds 1-5; at 6 epochs
    # the loss had barely left ln 4, and whether it ended below the first step's was the masks' luck)
    assert np.mean(ls[-3:]) < 0.75 * ls[0], ls
    rows = (out / "predictions_dev.tsv").read_text().splitlines()[1:]
    probs = np.array([[float(x) for x in r.split("\t")[3:7]] for r in rows])
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=2e-4)  # softmax across the four choices
    acc = np.mean([int(r.split("\t")[1]) == e.label for r, e in zip(rows, examples)])
    assert json.loads((out / "metrics.json").read_text())["accuracy"] == pytest.approx(acc)
    r = runner.invoke(app, ["eval", "swag", "--data", str(sample), "--model", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output


def test_swag_bad_label(tmp_path):
    bad = tmp_path / "bad.jsonl"
    row = {"sent1": "a", "sent2": "b", "ending0": "c", "ending1": "d", "ending2": "e", "ending3": "f", "label": 4}
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(BertctlError, match=r"bad.jsonl:1: label 4 is not in 0-3"):
        swag.read_swag(bad)


def test_kernels_and_attention_choices_reach_the_model(tiny, tmp_path):
    from bertctl.model import BertForMultipleChoice
    from bertctl.tasks import common
    from bertctl.config import FinetuneConfig

    model = common.load_for_finetuning(BertForMultipleChoice, tiny, cfg=FinetuneConfig.of(kernels="torch",
                                                                                    attn="explicit"))
    assert model.runtime.kernels == "torch" and model.runtime.attn == "explicit"
    auto = common.load_for_finetuning(BertForMultipleChoice, tiny, cfg=FinetuneConfig.of(device="cpu"))
    assert auto.runtime.attn == "unpadded"  # auto on a CPU
    assert auto.runtime.dropout_masks == "torch"
    own = common.load_for_finetuning(BertForMultipleChoice, tiny, cfg=FinetuneConfig.of(device="cpu", dropout_masks="fused"))
    assert own.runtime.dropout_masks == "fused"
    r = runner.invoke(app, ["finetune", "swag", "--train", str(data_path("swag", "sample.jsonl")), "--dev",
                            str(data_path("swag", "sample.jsonl")), "--model", str(tiny), "--output",
                            str(tmp_path / "m"), "--max-steps", "1", "--dropout-masks", "philox", "--no-progress"])
    assert r.exit_code == 2 and "--dropout-masks must be one of fused, torch, not 'philox'" in r.output
    r = runner.invoke(app, ["finetune", "swag", "--train", str(data_path("swag", "sample.jsonl")), "--dev",
                            str(data_path("swag", "sample.jsonl")), "--model", str(tiny), "--output",
                            str(tmp_path / "o"), "--max-steps", "1", "--attn", "bogus", "--no-progress"])
    assert r.exit_code == 2 and "--attn must be one of auto, sdpa, explicit, unpadded, not 'bogus'" in r.output


def test_each_task_loss_on_logits_is_its_heads_loss():
    """A task's one loss (``Task.loss``, summed over the batch) over the examples, or over the labelled tokens for
    NER, is the loss the Hugging Face-style head computes from the labels itself: cross-entropy for GLUE
    classes, NER tags and SWAG choices, squared error for a GLUE regression, the mean of the start and end
    cross-entropies for SQuAD (no dropout)."""
    from bertctl.config import BertConfig
    from bertctl.data.batching import collate
    from bertctl.model import (BertForMultipleChoice, BertForQuestionAnswering, BertForSequenceClassification,
                               BertForTokenClassification)
    from bertctl.tasks import glue, squad

    rng = np.random.default_rng(3)
    conf = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    lens = [5, 11, 3, 17]

    def seq(n):
        return {"input_ids": rng.integers(1, 50, n), "token_type_ids": (np.arange(n) > n // 2).astype(np.int8)}

    tags = [np.where(rng.random(n) < 0.3, -100, rng.integers(0, 4, n)) for n in lens]
    cases = [
        (glue.Glue, BertForSequenceClassification, dict(num_labels=3),
         [{**seq(n), "labels": i % 3} for i, n in enumerate(lens)], len(lens)),
        (glue.Glue, BertForSequenceClassification, dict(num_labels=1, problem_type="regression"),
         [{**seq(n), "labels": float(rng.uniform(0, 5))} for n in lens], len(lens)),
        (ner.Ner, BertForTokenClassification, dict(num_labels=4), [{**seq(n), "labels": t} for n, t in zip(lens, tags)],
         sum(int((t != -100).sum()) for t in tags)),
        (squad.Squad, BertForQuestionAnswering, {},
         [{**seq(n), "start_positions": n // 3, "end_positions": n // 2} for n in lens], len(lens)),
        (swag.Swag, BertForMultipleChoice, {},
         [{"input_ids": np.stack([rng.integers(1, 50, 24)] * 4), "token_type_ids": np.zeros((4, 24), dtype=np.int8),
           "lengths": [n, n + 2, n + 1, n], "labels": i % 4} for i, n in enumerate(lens)], len(lens)),
    ]
    label_keys = ("labels", "start_positions", "end_positions")
    for task, cls, kw, features, count in cases:
        torch.manual_seed(0)
        model = cls(BertConfig(**conf, **kw)).double().eval()
        batch = collate(features)
        head_loss = model(**batch).loss
        out = model(**{k: v for k, v in batch.items() if k not in label_keys})
        assert getattr(out, "loss", None) is None  # no labels in the forward: the head computes no second loss
        # float32's tolerance: the task's loss reads the logits in float32, as it does under bf16 training
        torch.testing.assert_close(task.loss(out, batch).double() / count, head_loss.double(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=f"{task.__name__} {kw}": f"{name}: {m}")
