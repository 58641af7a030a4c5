"""SQuAD v1.1 / v2.0 (paper §4.2, §4.3): reading, windowing, span decoding, fine-tuning, eval.

Windowing follows google-research/bert's ``run_squad.py``: the question (at most
``max_query_length`` = 64 word pieces) is followed by a window of the context, windows start every
``doc_stride`` = 128 context tokens and hold up to ``max_seq_length - len(question) - 3`` tokens
(``[CLS] Q [SEP] window [SEP]``, 384 in all). Answer character spans map to tokens through the
tokenizer's character offsets into the context; a window that does not hold the whole answer
is labelled with [CLS] (position 0), as is every unanswerable (v2.0) question.

Decoding: per window, the 20 best start and end logits over context tokens, spans with
end ≥ start, length ≤ ``max_answer_length`` = 30 and the start token in its "max context"
window; score S·T_i + E·T_j (= start_logit + end_logit); the text is the context slice between
the start token's first and the end token's last character. v2.0 (§4.3): the null score
s_null = S·C + E·C (the [CLS] logits, minimum over windows) against the best span; a question
is predicted unanswerable when s_null − s_best > τ, with τ chosen on the dev set to maximise F1.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from bertctl.errors import BertctlError
from bertctl.io import read_json_object, write_json
from bertctl.progress import stderr, track
from bertctl.tasks.base import Task
from bertctl.tasks.metrics import squad_v1_evaluate, squad_v2_evaluate
from bertctl.tasks.trainer import FinetuneConfig, predict, span_loss
from bertctl.workers import PARALLEL_CHARS, cpus_per_rank, map_in_order

NULL_THRESHOLD_KEY = "squad_null_score_diff_threshold"


@dataclass
class SquadConfig:
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    n_best_size: int = 20
    max_answer_length: int = 30
    version_2: bool = False


@dataclass
class SquadExample:
    qid: str
    title: str
    question: str
    context: str
    context_index: int  # paragraph number, to tokenize each context once
    answers: list[tuple[str, int]]  # (text, answer_start); all gold answers
    is_impossible: bool = False


@dataclass
class SquadData:
    path: str
    examples: list[SquadExample]
    dataset: list[dict]  # the (article-filtered) "data" list, for the official scorer
    contexts: list[str]
    skipped: list[str] = field(default_factory=list)
    realigned: int = 0
    realigned_examples: list[str] = field(default_factory=list)  # the first few, for the note on stderr


# ---------------------------------------------------------------------------------- reading


def parse_articles(spec: str | None) -> tuple[Path, str] | None:
    """``SPLIT.json:train`` -> (path, key)."""
    if spec is None:
        return None
    path, sep, key = spec.rpartition(":")
    if not sep or not path or not key:
        raise BertctlError(f"--articles {spec!r}: expected SPLIT.json:KEY (e.g. split.json:train)")
    return Path(path), key


def read_article_titles(spec: str) -> set[str]:
    path, key = parse_articles(spec)
    split = read_json_object(path, "split")
    if key not in split:
        keys = ", ".join(k for k, v in split.items() if isinstance(v, list))
        raise BertctlError(f"{path}: no list {key!r} in the split file (lists: {keys})")
    titles = split[key]
    if not isinstance(titles, list) or not all(isinstance(t, str) for t in titles):
        raise BertctlError(f"{path}: {key!r} must be a list of article titles")
    return set(titles)


def read_squad(path: str | Path, *, articles: str | None = None, version_2: bool = False,
               training: bool = False) -> SquadData:
    """Read a SQuAD JSON file, optionally restricted to the articles named in a split file.

    In training data each answerable question's first answer must sit at its ``answer_start``;
    one that does not is looked up elsewhere in the context (nearest occurrence: counted as
    realigned) or, if absent, the question is skipped and reported.
    """
    path = Path(path)
    raw = read_json_object(path, "SQuAD")
    if not isinstance(raw.get("data"), list):
        raise BertctlError(f"{path}: not a SQuAD file (expected an object with a 'data' list)")
    data = raw["data"]
    if articles is not None:
        titles = read_article_titles(articles)
        present = {a.get("title") for a in data}
        unknown = sorted(titles - present)
        if unknown:
            raise BertctlError(f"{articles}: {len(unknown)} article(s) not in {path}: {', '.join(unknown[:5])}")
        data = [a for a in data if a.get("title") in titles]
    out = SquadData(str(path), [], data, [])
    for ai, article in enumerate(data):
        title = article.get("title", f"article {ai}")
        for pi, para in enumerate(article.get("paragraphs", [])):
            where = f"{path}: {title!r} paragraph {pi}"
            if "context" not in para or "qas" not in para:
                raise BertctlError(f"{where}: missing 'context' or 'qas'")
            context = para["context"]
            out.contexts.append(context)
            for qa in para["qas"]:
                qid = qa.get("id")
                if qid is None or "question" not in qa:
                    raise BertctlError(f"{where}: a question without 'id' or 'question'")
                impossible = bool(qa.get("is_impossible", False))
                if impossible and not version_2:
                    raise BertctlError(f"{path}: question {qid} is unanswerable (is_impossible): SQuAD v2.0 data "
                                       "needs --version-2")
                answers = []
                for a in qa.get("answers", []):
                    if "text" not in a or "answer_start" not in a:
                        raise BertctlError(f"{path}: question {qid}: an answer without 'text' or 'answer_start'")
                    answers.append((a["text"], int(a["answer_start"])))
                if training and not impossible:
                    if not answers:
                        raise BertctlError(f"{path}: question {qid} has no answer (and is not marked is_impossible)")
                    text, start = answers[0]
                    if context[start : start + len(text)] != text:
                        hits = [i for i in _find_all(context, text)]
                        if not hits:
                            out.skipped.append(f"{path}: question {qid}: answer {text!r} not found at "
                                               f"answer_start {start} nor elsewhere in the context")
                            continue
                        moved = min(hits, key=lambda i: abs(i - start))
                        out.realigned += 1
                        if len(out.realigned_examples) < 3:
                            out.realigned_examples.append(f"{qid} ({text!r} at {moved}, not {start})")
                        start = moved
                        answers[0] = (text, start)
                out.examples.append(SquadExample(qid, title, qa["question"], context, len(out.contexts) - 1,
                                                 answers, impossible))
    if not out.examples:
        raise BertctlError(f"{path}: no questions" + (f" in the articles of {articles}" if articles else ""))
    return out


def _find_all(text: str, sub: str):
    i = text.find(sub)
    while i >= 0 and sub:
        yield i
        i = text.find(sub, i + 1)


# ---------------------------------------------------------------------------------- windows


def window_starts(n_tokens: int, max_tokens: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of each window over ``n_tokens`` context tokens (run_squad.py's loop)."""
    spans = []
    start = 0
    while True:
        length = min(n_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length >= n_tokens:
            break
        start += min(length, doc_stride)
    return spans


def max_context_mask(spans: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Per window, whether each of its tokens has its most context in this window: the score of a
    token in a window is min(left, right context) + 0.01·length (run_squad.py's rule; a tie goes to
    the first window)."""
    end = max(start + length for start, length in spans)
    pos = np.arange(end)
    score = np.full((len(spans), end), -np.inf)
    for w, (start, length) in enumerate(spans):
        p = pos[start : start + length]
        score[w, start : start + length] = np.minimum(p - start, start + length - 1 - p) + 0.01 * length
    owner = score.argmax(axis=0)  # the first of equal maxima
    return [owner[start : start + length] == w for w, (start, length) in enumerate(spans)]


@functools.lru_cache(maxsize=4096)
def _windows(n_tokens: int, max_tokens: int, doc_stride: int) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
    """``window_starts`` and their ``max_context_mask``, shared (read-only) by every question whose
    context and question lengths give the same windows."""
    spans = window_starts(n_tokens, max_tokens, doc_stride)
    masks = max_context_mask(spans)
    for m in masks:
        m.flags.writeable = False
    return spans, masks


def char_to_token_span(offsets: Sequence[tuple[int, int]] | np.ndarray, start_char: int,
                       end_char: int) -> tuple[int, int] | None:
    """First and last context token overlapping the characters [start_char, end_char)."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    hit = np.flatnonzero((offsets[:, 1] > start_char) & (offsets[:, 0] < end_char))
    return None if not len(hit) else (int(hit[0]), int(hit[-1]))


@dataclass
class ContextTokens:
    ids: np.ndarray  # (n,) int32
    offsets: np.ndarray  # (n, 2) character offsets into the context


def _context_tokens(tokenizer, context: str) -> ContextTokens:
    tokens, offsets = tokenizer.tokenize_with_offsets(context)
    return ContextTokens(np.asarray(tokenizer.convert_tokens_to_ids(tokens), dtype=np.int32),
                         np.asarray(offsets, dtype=np.int64).reshape(-1, 2))


def tokenize_contexts(contexts: Sequence[str], tokenizer, progress: bool = False,
                      workers: int | None = None) -> list[ContextTokens]:
    """Each context's token ids and character offsets, in ``workers`` processes (default: the usable
    CPUs, shared among the ranks on this host) once there is enough text to pay for starting them."""
    workers = cpus_per_rank() if workers is None else workers
    if sum(map(len, contexts)) < PARALLEL_CHARS:
        workers = 1
    return map_in_order(functools.partial(_context_tokens, tokenizer), contexts, workers=workers,
                        label="tokenize contexts", progress=progress)


def featurize(data: SquadData, tokenizer, cfg: SquadConfig, *, training: bool, progress: bool = False,
              contexts: list[ContextTokens] | None = None) -> list[dict]:
    """Windows of every example. Each feature holds model inputs, and for training the answer's
    token positions (0 = [CLS] when the window does not hold it); for evaluation the bookkeeping
    that maps logits back to the context (``_example``, ``_ctx_offset``, ``_span_start``,
    ``_max_context``)."""
    contexts = contexts if contexts is not None else tokenize_contexts(data.contexts, tokenizer, progress)
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    features: list[dict] = []
    with track("windows", len(data.examples), disable=not progress) as advance:
        for ei, ex in enumerate(data.examples):
            q_ids = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ex.question))[: cfg.max_query_length]
            ctx = contexts[ex.context_index]
            max_tokens = cfg.max_seq_length - len(q_ids) - 3
            if max_tokens <= 0:
                raise BertctlError(f"max_seq_length {cfg.max_seq_length} leaves no room for context after a "
                                   f"{len(q_ids)}-token question")
            spans, masks = _windows(len(ctx.ids), max_tokens, cfg.doc_stride)
            answer_tokens = None
            if training and not ex.is_impossible:
                text, start = ex.answers[0]
                answer_tokens = char_to_token_span(ctx.offsets, start, start + len(text))
            head = [cls_id, *q_ids, sep_id]
            ctx_offset = len(head)
            for (start, length), mask in zip(spans, masks):
                ids = np.asarray(head + ctx.ids[start : start + length].tolist() + [sep_id], dtype=np.int32)
                types = np.zeros(len(ids), dtype=np.int8)
                types[ctx_offset:] = 1
                f = {"input_ids": ids, "token_type_ids": types, "_example": ei, "_span_start": start}
                if training:
                    s = e = 0
                    if answer_tokens is not None:
                        a, b = answer_tokens
                        if a >= start and b < start + length:
                            s, e = a - start + ctx_offset, b - start + ctx_offset
                    f["start_positions"], f["end_positions"] = s, e
                else:
                    f.update(_ctx_offset=ctx_offset, _max_context=mask)
                features.append(f)
            advance(1)
    return features


# ---------------------------------------------------------------------------------- decoding


@dataclass
class Prediction:
    text: str
    null_odds: float  # s_null - s_best_span (v2.0); +inf when no span was valid
    nbest: list[dict]


def decode(data: SquadData, features: Sequence[dict], logits: Sequence[tuple[np.ndarray, np.ndarray]],
           contexts: Sequence[ContextTokens], cfg: SquadConfig) -> dict[str, Prediction]:
    """n-best span decoding over all windows of each question (see the module docstring)."""
    per_example: dict[int, list[int]] = {}
    for fi, f in enumerate(features):
        per_example.setdefault(f["_example"], []).append(fi)
    out: dict[str, Prediction] = {}
    k = cfg.n_best_size
    for ei, ex in enumerate(data.examples):
        ctx = contexts[ex.context_index]
        candidates: list[tuple[float, int, int]] = []  # (score, first char, last char)
        null = np.inf
        for fi in per_example.get(ei, []):
            f = features[fi]
            start_logits, end_logits = logits[fi]
            null = min(null, float(start_logits[0] + end_logits[0]))
            off = f["_ctx_offset"]
            n = len(f["_max_context"])
            s_ctx = start_logits[off : off + n]
            e_ctx = end_logits[off : off + n]
            top_s = np.argsort(-s_ctx, kind="stable")[:k]
            top_e = np.argsort(-e_ctx, kind="stable")[:k]
            top_s = top_s[f["_max_context"][top_s]]
            # (len(top_s), len(top_e)) grid of candidate spans; keep end >= start, length <= max.
            length = top_e[None, :] - top_s[:, None] + 1
            ok = (length >= 1) & (length <= cfg.max_answer_length)
            scores = s_ctx[top_s][:, None] + e_ctx[top_e][None, :]
            flat = np.flatnonzero(ok)
            flat = flat[np.argsort(-scores.ravel()[flat], kind="stable")[:k]]  # only k can reach the n-best
            i, j = np.unravel_index(flat, ok.shape)
            first = ctx.offsets[f["_span_start"] + top_s[i], 0]
            last = ctx.offsets[f["_span_start"] + top_e[j], 1]
            candidates += zip(scores[i, j].astype(np.float64).tolist(), first.tolist(), last.tolist())
        candidates.sort(key=lambda c: -c[0])
        nbest, seen = [], set()
        for score, a, b in candidates:
            text = ex.context[a:b]
            if text in seen:
                continue
            seen.add(text)
            nbest.append({"text": text, "score": score, "start": a})
            if len(nbest) >= k:
                break
        if nbest:
            scores = np.array([c["score"] for c in nbest])
            probs = np.exp(scores - scores.max())
            probs /= probs.sum()
            for c, p in zip(nbest, probs):
                c["probability"] = float(p)
            best_text, odds = nbest[0]["text"], null - nbest[0]["score"]
        else:
            best_text, odds = "", np.inf
        out[ex.qid] = Prediction(best_text, float(odds), nbest)
    return out


def final_answers(preds: dict[str, Prediction], version_2: bool, threshold: float = 0.0) -> dict[str, str]:
    """The official ``{id: answer}`` map: for v2.0 the empty answer where s_null − s_best > τ."""
    if not version_2:
        return {q: p.text for q, p in preds.items()}
    return {q: ("" if p.null_odds > threshold else p.text) for q, p in preds.items()}


def score_predictions(data: SquadData, preds: dict[str, Prediction], version_2: bool,
                      threshold: float | None = None) -> tuple[dict, float | None]:
    """Official metrics. For v2.0 with ``threshold=None`` τ is chosen on this data (best F1)."""
    if not version_2:
        return squad_v1_evaluate(data.dataset, final_answers(preds, False)), None
    odds = {q: p.null_odds for q, p in preds.items()}
    if threshold is None:
        raw = {q: p.text for q, p in preds.items()}
        search = squad_v2_evaluate(data.dataset, raw, na_probs=odds)
        threshold = float(search["best_f1_thresh"])
    metrics = squad_v2_evaluate(data.dataset, final_answers(preds, True, threshold), na_probs=None)
    metrics["null_score_diff_threshold"] = threshold
    return metrics, threshold


def write_predictions(output: Path, preds: dict[str, Prediction], version_2: bool, threshold: float,
                      nbest: bool = False) -> None:
    write_json(output / "predictions.json", final_answers(preds, version_2, threshold))
    if version_2:
        write_json(output / "null_odds.json", {q: p.null_odds if np.isfinite(p.null_odds) else 1e9
                                               for q, p in preds.items()})
    if nbest:
        write_json(output / "nbest_predictions.json", {q: p.nbest for q, p in preds.items()})


# ---------------------------------------------------------------------------------- runs


def _logits(model, features, tcfg: FinetuneConfig, progress: bool, shards=None):
    out = predict(model, features, outputs=("start_logits", "end_logits"), batch_size=tcfg.eval_batch_size,
                  batch_tokens=tcfg.eval_batch_tokens, precision=tcfg.train.precision, per_token=True,
                  progress=progress, description="predict", shards=shards)
    return [(o[0], o[1]) for o in out]


def _report(data: SquadData) -> dict:
    info = {}
    if data.skipped:
        for msg in data.skipped[:5]:
            stderr.print(f"skipped {msg}")
        info["skipped_questions"] = len(data.skipped)
    if len(data.skipped) > 5:
        stderr.print(f"... {len(data.skipped) - 5} more questions skipped in {data.path}")
    if data.realigned:
        info["realigned_answers"] = data.realigned
        stderr.print(f"{data.path}: {data.realigned} answers were not at their answer_start and were moved to the "
                     f"nearest place their text is (first: {', '.join(data.realigned_examples)})")
    return info


class Squad(Task):
    """SQuAD as a ``Task``: fine-tuning on ``train`` with ``dev`` scored, or (``train`` None) evaluating on
    ``dev``. v2.0's τ: ``threshold`` when given, else (evaluating) the model's saved one, else chosen on dev."""

    loss = staticmethod(span_loss)
    main_metric = "f1"

    def __init__(self, train: SquadData | None, dev: SquadData, cfg: SquadConfig, *, threshold: float | None = None,
                 write_nbest: bool = False):
        self.train, self.dev, self.cfg, self.write_nbest = train, dev, cfg, write_nbest
        self.name = "squad-v2.0" if cfg.version_2 else "squad-v1.1"
        self.threshold, self.source = threshold, None
        self.train_features: list[dict] = []

    @property
    def model_class(self):
        from bertctl.model import BertForQuestionAnswering

        return BertForQuestionAnswering

    def head_check(self) -> dict:
        return {"task": "squad"}

    def adopt(self, model, model_dir) -> None:
        if self.cfg.version_2:
            if self.threshold is None and NULL_THRESHOLD_KEY in model.config.extra:
                self.threshold, self.source = float(model.config.extra[NULL_THRESHOLD_KEY]), "model"
            elif self.threshold is not None:
                self.source = "given"
            else:
                self.source = "chosen on this data"

    def featurize(self, tokenizer, progress: bool) -> None:
        if self.train is not None:
            self.train_features = featurize(self.train, tokenizer, self.cfg, training=True, progress=progress)
        self.dev_contexts = tokenize_contexts(self.dev.contexts, tokenizer)
        self.dev_features = featurize(self.dev, tokenizer, self.cfg, training=False, contexts=self.dev_contexts)

    def predict(self, model, cfg: FinetuneConfig, *, progress=False, shards=None, final=False):
        return decode(self.dev, self.dev_features, _logits(model, self.dev_features, cfg, progress, shards),
                      self.dev_contexts, self.cfg)

    def score(self, preds, *, final=False) -> dict:
        if not final:  # an epoch end: the dev set's figures, τ chosen on it
            metrics, _ = score_predictions(self.dev, preds, self.cfg.version_2)
            return {k: float(v) for k, v in metrics.items() if k in ("exact_match", "f1", "best_f1")}
        metrics, self.threshold = score_predictions(self.dev, preds, self.cfg.version_2, self.threshold)
        return metrics

    def annotate(self, model) -> None:
        if self.cfg.version_2:
            model.config.extra[NULL_THRESHOLD_KEY] = self.threshold

    def write_predictions(self, output: Path, preds) -> None:
        write_predictions(output, preds, self.cfg.version_2, self.threshold or 0.0, self.write_nbest)

    def facts(self) -> dict:
        if self.train is None:
            return {"questions": len(self.dev.examples)}
        return {"train_questions": len(self.train.examples), "train_features": len(self.train_features),
                "dev_questions": len(self.dev.examples)}

    def notes(self) -> dict:
        if self.train is None:
            return {"null_score_diff_threshold_source": self.source} if self.source else {}
        return _report(self.train)


def score_files(data_path: str | Path, predictions_path: str | Path, *, version_2: bool = False,
                na_prob_path: str | Path | None = None, na_prob_thresh: float = 1.0,
                articles: str | None = None) -> dict:
    """Score an official-format predictions file against gold, as the official scripts do."""
    data = read_squad(data_path, articles=articles, version_2=True)
    preds = read_json_object(predictions_path, "predictions")
    bad = [q for q, v in preds.items() if not isinstance(v, str)]
    if bad:
        raise BertctlError(f"{predictions_path}: prediction for {bad[0]} is not a string")
    _say_unmatched(preds, data, predictions_path, data_path)
    if not version_2:
        if any(e.is_impossible for e in data.examples):
            raise BertctlError(f"{data_path}: has unanswerable questions: score it with --version-2")
        return squad_v1_evaluate(data.dataset, preds)
    na = None
    if na_prob_path is not None:
        na = {k: float(v) for k, v in read_json_object(na_prob_path, "no-answer probabilities").items()}
    return squad_v2_evaluate(data.dataset, preds, na_probs=na, na_prob_thresh=na_prob_thresh)


def _say_unmatched(preds: dict, data: SquadData, predictions_path, data_path) -> None:
    """Predictions whose id is no question of the data are not scored, and questions without a prediction score 0:
    say so on stderr, with counts and the first ids (scoring a file against the wrong split gives EM 0 otherwise)."""
    questions = {e.qid for e in data.examples}
    stray = [q for q in preds if q not in questions]
    missing = [q for q in questions if q not in preds]
    if stray:
        stderr.print(f"{predictions_path}: {len(stray)} of {len(preds)} predictions match no question of {data_path} "
                     f"and are not scored (first: {', '.join(stray[:3])})")
    if missing:
        stderr.print(f"{data_path}: {len(missing)} of {len(questions)} questions have no prediction in "
                     f"{predictions_path} and score 0 (first: {', '.join(sorted(missing)[:3])})")


def recover_answer(feature: dict, context: str, ctx: ContextTokens) -> str:
    """The context text a training window's answer positions point at (a check of the labels)."""
    off = int(np.flatnonzero(feature["token_type_ids"])[0])  # first context token: after [CLS] Q [SEP]
    a = feature["_span_start"] + feature["start_positions"] - off
    b = feature["_span_start"] + feature["end_positions"] - off
    return context[ctx.offsets[a][0] : ctx.offsets[b][1]]
