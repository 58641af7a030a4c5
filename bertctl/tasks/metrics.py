"""Evaluation metrics, each re-implementing the rules of its official scorer.

- GLUE (Wang et al., 2018): accuracy, binary F1 of the positive class (MRPC, QQP),
  Matthews correlation (CoLA), Pearson and Spearman correlation (STS-B).
- SQuAD v1.1 and v2.0: the official ``evaluate-v1.1.py`` / ``evaluate-v2.0.py`` rules
  (answer normalisation, exact match, token F1, max over gold answers; for v2.0 the
  HasAns/NoAns breakdown and the best no-answer threshold search).
- NER: entity-level precision/recall/F1 with the chunk rules of ``conlleval``
  (CoNLL-2000/2003 shared tasks), which read IOB1, IOB2, IOE and IOBES alike.

Everything here is plain Python/numpy so it runs anywhere and can be checked by hand.
"""
from __future__ import annotations

import collections
import math
import re
import string
from typing import Iterable, Mapping, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------
# GLUE


def accuracy(preds: Sequence, labels: Sequence) -> float:
    preds, labels = np.asarray(preds), np.asarray(labels)
    return float((preds == labels).mean()) if len(labels) else 0.0


def binary_f1(preds: Sequence[int], labels: Sequence[int], positive: int = 1) -> float:
    """F1 of the positive class, as GLUE reports for MRPC and QQP (sklearn's ``f1_score``)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    tp = int(((preds == positive) & (labels == positive)).sum())
    fp = int(((preds == positive) & (labels != positive)).sum())
    fn = int(((preds != positive) & (labels == positive)).sum())
    if tp == 0:
        return 0.0
    return 2 * tp / (2 * tp + fp + fn)


def matthews_corrcoef(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation for binary labels (CoLA); 0 when a marginal is empty (as sklearn)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    tp = float(((preds == 1) & (labels == 1)).sum())
    tn = float(((preds == 0) & (labels == 0)).sum())
    fp = float(((preds == 1) & (labels == 0)).sum())
    fn = float(((preds == 0) & (labels == 1)).sum())
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else (tp * tn - fp * fn) / denom


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xm, ym = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xm * xm).sum()) * float((ym * ym).sum()))
    return 0.0 if denom == 0 else float((xm * ym).sum()) / denom


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their mean rank (scipy's ``rankdata(method='average')``)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: Pearson correlation of the tie-averaged ranks."""
    return pearson(_average_ranks(np.asarray(x, dtype=np.float64)), _average_ranks(np.asarray(y, dtype=np.float64)))


# Which metrics GLUE reports for each task; the first is the one used to pick a model / lr.
GLUE_METRICS: dict[str, tuple[str, ...]] = {
    "cola": ("matthews_corrcoef",),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "stsb": ("pearson", "spearmanr"),
    "qqp": ("accuracy", "f1"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}


def glue_metrics(task: str, preds: Sequence, labels: Sequence) -> dict[str, float]:
    """The metrics GLUE reports for ``task`` (fractions in [0, 1], correlations in [-1, 1])."""
    names = GLUE_METRICS.get(task, ("accuracy",))
    out: dict[str, float] = {}
    for name in names:
        if name == "accuracy":
            out[name] = accuracy(preds, labels)
        elif name == "f1":
            out[name] = binary_f1(preds, labels)
        elif name == "matthews_corrcoef":
            out[name] = matthews_corrcoef(preds, labels)
        elif name == "pearson":
            out[name] = pearson(preds, labels)
        elif name == "spearmanr":
            out[name] = spearman(preds, labels)
    return out


# ---------------------------------------------------------------------------------------------
# SQuAD (official evaluate-v1.1.py and evaluate-v2.0.py rules)

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_DROP_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (the official rule, in that order)."""
    s = s.lower()
    s = s.translate(_DROP_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def squad_exact(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_f1_v1(prediction: str, gold: str) -> float:
    """v1.1 token F1: bag-of-tokens overlap of the normalised strings; 0 when nothing is shared."""
    pred_toks = normalize_answer(prediction).split()
    gold_toks = normalize_answer(gold).split()
    common = collections.Counter(pred_toks) & collections.Counter(gold_toks)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def squad_f1_v2(prediction: str, gold: str) -> float:
    """v2.0 token F1: as v1.1, except that an empty answer scores 1 only against an empty one."""
    pred_toks = normalize_answer(prediction).split()
    gold_toks = normalize_answer(gold).split()
    if not pred_toks or not gold_toks:
        return float(pred_toks == gold_toks)
    return squad_f1_v1(prediction, gold)


def squad_questions(dataset: Sequence[Mapping]) -> Iterable[tuple[str, list[str]]]:
    """``(question id, gold answer texts)`` for every question of the SQuAD ``data`` list."""
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                yield qa["id"], [a["text"] for a in qa.get("answers", [])]


def squad_v1_evaluate(dataset: Sequence[Mapping], predictions: Mapping[str, str]) -> dict[str, float]:
    """The official v1.1 score: EM and F1 in percent, averaged over every question of ``dataset``.

    A question missing from ``predictions`` scores 0 (the official script says so and goes on).
    """
    total = em = f1 = 0.0
    missing = 0
    for qid, golds in squad_questions(dataset):
        total += 1
        if qid not in predictions:
            missing += 1
            continue
        pred = predictions[qid]
        em += max(squad_exact(pred, g) for g in golds)
        f1 += max(squad_f1_v1(pred, g) for g in golds)
    out = {"exact_match": 100.0 * em / total if total else 0.0, "f1": 100.0 * f1 / total if total else 0.0,
           "total": int(total)}
    if missing:
        out["unanswered"] = missing
    return out


def _v2_raw_scores(dataset, predictions):
    exact, f1, has_ans = {}, {}, {}
    for qid, golds in squad_questions(dataset):
        golds = [g for g in golds if normalize_answer(g)] or [""]
        has_ans[qid] = golds != [""]
        if qid not in predictions:
            continue
        pred = predictions[qid]
        exact[qid] = max(squad_exact(pred, g) for g in golds)
        f1[qid] = max(squad_f1_v2(pred, g) for g in golds)
    return exact, f1, has_ans


def _apply_threshold(scores, na_probs, has_ans, threshold):
    out = {}
    for qid, s in scores.items():
        out[qid] = float(not has_ans[qid]) if na_probs[qid] > threshold else s
    return out


def _best_threshold(preds, scores, na_probs, has_ans):
    """The official ``find_best_thresh``: sweep the no-answer odds in increasing order."""
    num_no_ans = sum(1 for k in has_ans if not has_ans[k])
    cur = best = float(num_no_ans)
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur += diff
        if cur > best:
            best, best_thresh = cur, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def squad_v2_evaluate(dataset: Sequence[Mapping], predictions: Mapping[str, str],
                      na_probs: Mapping[str, float] | None = None, na_prob_thresh: float = 1.0) -> dict[str, float]:
    """The official v2.0 score: exact/F1 overall and split into HasAns/NoAns, and, given no-answer
    odds, the best threshold on them (``best_exact_thresh``, ``best_f1_thresh``), all in percent.

    As in the official script, a question with ``na_probs[qid] > na_prob_thresh`` counts as
    answered with the empty string; without ``na_probs`` every odds is 0 (the prediction stands).
    """
    given_odds = na_probs is not None
    if na_probs is None:
        na_probs = {qid: 0.0 for qid in predictions}
    exact_raw, f1_raw, has_ans = _v2_raw_scores(dataset, predictions)
    missing = [qid for qid in has_ans if qid not in predictions]
    na = {qid: na_probs.get(qid, 0.0) for qid in has_ans}
    exact = _apply_threshold(exact_raw, na, has_ans, na_prob_thresh)
    f1 = _apply_threshold(f1_raw, na, has_ans, na_prob_thresh)
    # Missing predictions score 0 (the official script errors out; bertctl counts and reports them).
    for qid in missing:
        exact[qid] = f1[qid] = 0.0

    def block(qids):
        n = len(qids)
        return (100.0 * sum(exact[q] for q in qids) / n if n else 0.0,
                100.0 * sum(f1[q] for q in qids) / n if n else 0.0, n)

    all_q = list(has_ans)
    em, fm, n = block(all_q)
    out: dict[str, float] = {"exact_match": em, "exact": em, "f1": fm, "total": n}
    has = [q for q in all_q if has_ans[q]]
    no = [q for q in all_q if not has_ans[q]]
    if has:
        e, f, k = block(has)
        out.update(HasAns_exact=e, HasAns_f1=f, HasAns_total=k)
    if no:
        e, f, k = block(no)
        out.update(NoAns_exact=e, NoAns_f1=f, NoAns_total=k)
    if given_odds:
        # The official find_all_best_thresh, run only when no-answer odds are given.
        preds = {q: predictions.get(q, "") for q in all_q}
        full_exact = {q: exact_raw.get(q, 0.0) for q in all_q}
        full_f1 = {q: f1_raw.get(q, 0.0) for q in all_q}
        best_exact, best_exact_thresh = _best_threshold(preds, full_exact, na, has_ans)
        best_f1, best_f1_thresh = _best_threshold(preds, full_f1, na, has_ans)
        out.update(best_exact=best_exact, best_exact_thresh=best_exact_thresh,
                   best_f1=best_f1, best_f1_thresh=best_f1_thresh)
    if missing:
        out["unanswered"] = len(missing)
    return out


# ---------------------------------------------------------------------------------------------
# NER: conlleval chunk semantics


def _split_tag(tag: str) -> tuple[str, str]:
    """``B-PER`` -> (``B``, ``PER``); ``O`` -> (``O``, ``""``). conlleval splits at the first '-'."""
    if tag == "O" or tag == "":
        return "O", ""
    if "-" in tag:
        prefix, kind = tag.split("-", 1)
        return prefix, kind
    return tag, ""


def _end_of_chunk(prev_tag, tag, prev_type, type_) -> bool:
    # conlleval's endOfChunk, case by case.
    if prev_tag in ("E", "S"):
        return True
    if prev_tag == "B" and tag in ("B", "S", "O"):
        return True
    if prev_tag == "I" and tag in ("B", "S", "O"):
        return True
    if prev_tag not in ("O", ".") and prev_type != type_:
        return True
    return False


def _start_of_chunk(prev_tag, tag, prev_type, type_) -> bool:
    # conlleval's startOfChunk, case by case.
    if tag in ("B", "S"):
        return True
    if prev_tag in ("E", "S") and tag in ("E", "I"):
        return True
    if prev_tag == "O" and tag in ("E", "I"):
        return True
    if tag not in ("O", ".") and prev_type != type_:
        return True
    return False


def extract_chunks(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Entities ``(type, first, last)`` (inclusive token indexes) of one sentence, by conlleval's rules."""
    chunks = []
    prev_tag, prev_type = "O", ""
    start = None
    for i, t in enumerate(list(tags) + ["O"]):
        tag, type_ = _split_tag(t)
        if start is not None and _end_of_chunk(prev_tag, tag, prev_type, type_):
            chunks.append((prev_type, start, i - 1))
            start = None
        if _start_of_chunk(prev_tag, tag, prev_type, type_):
            start = i
        prev_tag, prev_type = tag, type_
    return chunks


def conlleval(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict:
    """Entity-level scores over sentences (lists of tags), as ``conlleval`` prints them.

    An entity counts as correct only if its type and both boundaries match. Returns fractions:
    ``precision``, ``recall``, ``f1``, token ``accuracy``, the counts, and ``per_type`` with the
    same for each entity type.
    """
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences but {len(pred)} predicted")
    n_gold = collections.Counter()
    n_pred = collections.Counter()
    n_correct = collections.Counter()
    tokens = correct_tokens = 0
    for g, p in zip(gold, pred):
        if len(g) != len(p):
            raise ValueError(f"sentence of {len(g)} gold tags but {len(p)} predicted")
        tokens += len(g)
        correct_tokens += sum(1 for a, b in zip(g, p) if a == b)
        gc, pc = set(extract_chunks(g)), set(extract_chunks(p))
        for c in gc:
            n_gold[c[0]] += 1
        for c in pc:
            n_pred[c[0]] += 1
        for c in gc & pc:
            n_correct[c[0]] += 1

    def prf(c, p, g):
        precision = c / p if p else 0.0
        recall = c / g if g else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return {"precision": precision, "recall": recall, "f1": f1, "correct": c, "predicted": p, "gold": g}

    out = prf(sum(n_correct.values()), sum(n_pred.values()), sum(n_gold.values()))
    out["accuracy"] = correct_tokens / tokens if tokens else 0.0
    out["per_type"] = {t: prf(n_correct[t], n_pred[t], n_gold[t]) for t in sorted(set(n_gold) | set(n_pred))}
    return out
