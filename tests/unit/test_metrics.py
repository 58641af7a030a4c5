"""Metrics against hand-computed cases, numpy references and the official SQuAD golden score."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bertctl.tasks import metrics as M
from test_finetune_support import data_path

# ----------------------------------------------------------------------------------- GLUE


def test_accuracy_and_f1_hand_computed():
    preds = [1, 1, 0, 0, 1, 0]
    gold = [1, 0, 0, 1, 1, 0]
    assert M.accuracy(preds, gold) == pytest.approx(4 / 6)
    # tp=2 (0, 4), fp=1 (1), fn=1 (3): F1 = 2*2 / (2*2 + 1 + 1)
    assert M.binary_f1(preds, gold) == pytest.approx(4 / 6)
    assert M.binary_f1([0, 0], [1, 1]) == 0.0


def test_matthews_hand_computed():
    # tp=3, tn=2, fp=1, fn=2
    preds = [1, 1, 1, 1, 0, 0, 0, 0]
    gold = [1, 1, 1, 0, 1, 1, 0, 0]
    tp, tn, fp, fn = 3, 2, 1, 2
    want = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert M.matthews_corrcoef(preds, gold) == pytest.approx(want)
    assert M.matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0  # an empty marginal: 0, as sklearn


def test_pearson_spearman_against_references():
    rng = np.random.default_rng(0)
    x = rng.normal(size=50)
    y = 0.5 * x + rng.normal(size=50)
    assert M.pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)
    # Spearman with ties: ranks by hand. x = [1, 2, 2, 3] -> [1, 2.5, 2.5, 4]; y = [1, 3, 2, 4] -> itself.
    rx, ry = np.array([1, 2.5, 2.5, 4]), np.array([1, 3, 2, 4.0])
    assert M.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert M.spearman([3, 1, 2], [30, 10, 20]) == pytest.approx(1.0)


def test_glue_metric_sets():
    assert set(M.glue_metrics("mrpc", [1, 0], [1, 1])) == {"f1", "accuracy"}
    assert set(M.glue_metrics("cola", [1, 0], [1, 1])) == {"matthews_corrcoef"}
    assert set(M.glue_metrics("stsb", [1.0, 2.0, 3.0], [1.0, 2.5, 2.0])) == {"pearson", "spearmanr"}


# ----------------------------------------------------------------------------------- SQuAD


def test_normalize_answer_official_rules():
    assert M.normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert M.normalize_answer("an apple, a pear") == "apple pear"
    assert M.normalize_answer("theory") == "theory"  # articles only as whole words
    assert M.normalize_answer("A.B.C") == "abc"


def test_normalize_answer_as_the_official_script_on_every_answer(shared_data):
    """The official evaluate-v1.1.py normaliser, character by character, on every gold answer and
    context of the dev set and on non-ASCII punctuation (which it keeps)."""
    import json
    import re
    import string

    def official(s):
        s = s.lower()
        s = "".join(ch for ch in s if ch not in set(string.punctuation))
        s = re.sub(r"\b(a|an|the)\b", " ", s)
        return " ".join(s.split())

    data = json.loads((shared_data / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    texts = ["“Quoted” — dash… ¿qué? l'été, «a» the_the A-an"]
    for article in data:
        for paragraph in article["paragraphs"]:
            texts.append(paragraph["context"])
            texts += [a["text"] for qa in paragraph["qas"] for a in qa["answers"]]
    assert len(texts) > 35000
    assert [M.normalize_answer(t) for t in texts] == [official(t) for t in texts]


def test_em_f1_hand_computed():
    assert M.squad_exact("the Broncos", "Broncos.") == 1.0
    # pred tokens [denver, broncos, team], gold [broncos]: p=1/3, r=1, F1 = 0.5
    assert M.squad_f1_v1("Denver Broncos team", "Broncos") == pytest.approx(0.5)
    assert M.squad_f1_v1("", "Broncos") == 0.0
    assert M.squad_f1_v2("", "") == 1.0 and M.squad_f1_v2("x", "") == 0.0


def _dataset(qas):
    return [{"title": "t", "paragraphs": [{"context": "c", "qas": [
        {"id": qid, "question": "?", "answers": [{"text": a, "answer_start": 0} for a in answers]}
        for qid, answers in qas]}]}]


def test_v1_max_over_gold_and_missing():
    data = _dataset([("a", ["Denver Broncos", "Broncos"]), ("b", ["Carolina"])])
    out = M.squad_v1_evaluate(data, {"a": "the Broncos"})
    # a: EM 1 (matches "Broncos"), F1 1; b: missing, 0.
    assert out["exact_match"] == pytest.approx(50.0) and out["f1"] == pytest.approx(50.0)
    assert out["unanswered"] == 1


def test_v2_has_no_ans_and_best_threshold():
    data = _dataset([("h1", ["Denver"]), ("h2", ["Carolina Panthers"]), ("n1", []), ("n2", [])])
    preds = {"h1": "Denver", "h2": "Panthers", "n1": "foo", "n2": ""}
    out = M.squad_v2_evaluate(data, preds)
    # h1 EM1 F1 1; h2 EM0 F1 2/3; n1 0; n2 1 (empty against empty)
    assert out["exact"] == pytest.approx(50.0)
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0 + 1) / 4)
    assert out["HasAns_total"] == 2 and out["NoAns_total"] == 2
    assert out["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert out["NoAns_exact"] == pytest.approx(50.0)
    assert "best_f1" not in out  # only with no-answer odds, as the official script
    # With odds: answering nothing above 0.5 turns n1 right (0 -> 1) and leaves h1/h2 answered.
    odds = {"h1": 0.1, "h2": 0.2, "n1": 0.9, "n2": 0.8}
    out = M.squad_v2_evaluate(data, preds, na_probs=odds, na_prob_thresh=0.5)
    assert out["exact"] == pytest.approx(75.0)
    # Official sweep: start at #NoAns = 2 (all blank), then by odds h1 +1, h2 +2/3 (F1), n2 0, n1 -1.
    # F1 running: 2, 3, 3.667, 3.667, 2.667 -> best 3.667 at odds 0.2.
    assert out["best_f1"] == pytest.approx(100 * (2 + 1 + 2 / 3) / 4)
    assert out["best_f1_thresh"] == pytest.approx(0.2)
    assert out["best_exact"] == pytest.approx(75.0) and out["best_exact_thresh"] == pytest.approx(0.1)


def test_squad_golden_bert_ensemble():
    """The BERT-Large ensemble's official predictions score EM 86.21 / F1 92.20 (paper Table 2)."""
    data = json.loads(data_path("squad", "dev-v1.1.json").read_text())["data"]
    preds = json.loads(data_path("squad", "predictions-v1.1-bert-ensemble.json").read_text())
    out = M.squad_v1_evaluate(data, preds)
    assert round(out["exact_match"], 2) == 86.21
    assert round(out["f1"], 2) == 92.20
    assert out["total"] == 10570


# ----------------------------------------------------------------------------------- conlleval


def test_chunks_iob2_and_iob1():
    assert M.extract_chunks(["B-PER", "I-PER", "O", "B-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3)]
    # IOB1: an I- after O starts a chunk; B- only splits two same-type chunks.
    assert M.extract_chunks(["I-PER", "I-PER", "B-PER", "O", "I-LOC"]) == [("PER", 0, 1), ("PER", 2, 2), ("LOC", 4, 4)]
    # A type change inside I- tags ends one chunk and starts another (conlleval).
    assert M.extract_chunks(["B-PER", "I-LOC"]) == [("PER", 0, 0), ("LOC", 1, 1)]
    # IOBES.
    assert M.extract_chunks(["S-ORG", "B-PER", "E-PER"]) == [("ORG", 0, 0), ("PER", 1, 2)]


def test_conlleval_hand_computed():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "O", "O", "B-LOC"], ["B-ORG", "B-MISC"]]
    out = M.conlleval(gold, pred)
    # gold chunks: PER(0,1) LOC(3) ORG(0) = 3; predicted: PER(0,0) LOC ORG MISC = 4; correct LOC, ORG = 2
    assert out["precision"] == pytest.approx(2 / 4)
    assert out["recall"] == pytest.approx(2 / 3)
    assert out["f1"] == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert out["accuracy"] == pytest.approx(4 / 6)
    assert out["per_type"]["PER"]["f1"] == 0.0
    assert out["per_type"]["LOC"]["f1"] == 1.0
    assert out["per_type"]["MISC"]["precision"] == 0.0 and out["per_type"]["MISC"]["gold"] == 0


def test_conlleval_sentence_boundaries_split_chunks():
    # The same tags across a sentence break are two entities, not one.
    out = M.conlleval([["B-PER"], ["I-PER"]], [["B-PER"], ["I-PER"]])
    assert out["gold"] == 2 and out["correct"] == 2
