"""SQuAD windowing, answer mapping and span decoding (v1.1 and the v2.0 null decision)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bertctl.errors import BertctlError
from bertctl.tasks import squad
from bertctl.tasks.metrics import normalize_answer
from test_finetune_support import data_path, minilm_dir


@pytest.fixture(scope="module")
def tokenizer():
    from bertctl.text.wordpiece import BertTokenizer

    return BertTokenizer.from_pretrained(minilm_dir())


def test_window_starts_follow_run_squad():
    # 700 tokens, windows of 317, stride 128: starts 0, 128, 256, 384 (384 + 316 = 700 ends it).
    assert squad.window_starts(700, 317, 128) == [(0, 317), (128, 317), (256, 317), (384, 316)]
    assert squad.window_starts(100, 317, 128) == [(0, 100)]
    # Every token is in some window.
    spans = squad.window_starts(1000, 50, 20)
    covered = set()
    for s, n in spans:
        covered.update(range(s, s + n))
    assert covered == set(range(1000))


def test_max_context_picks_the_most_centred_window():
    spans = [(0, 10), (5, 10)]
    masks = squad.max_context_mask(spans)
    # Token 7: window 0 has min(7, 2) = 2 context, window 1 min(2, 7) = 2; tie -> first window.
    # Token 8: window 0 min(8, 1) = 1, window 1 min(3, 6) = 3 -> window 1.
    assert masks[0][7] and not masks[1][7 - 5]
    assert not masks[0][8] and masks[1][8 - 5]
    # Each token has exactly one max-context window.
    owners = {}
    for w, ((s, n), m) in enumerate(zip(spans, masks)):
        for i in np.flatnonzero(m):
            assert s + i not in owners
            owners[s + i] = w
    assert set(owners) == set(range(15))


def _max_context_loop(spans):
    """run_squad.py's _check_is_max_context, token by token: the reference for the vectorised mask. Its answer
    for a token depends on the token's position alone (it scans every window), so each position is scanned once
    and every window holding it reads that answer."""
    best_window = {}

    def check_is_max_context(pos):
        if pos not in best_window:
            best_score, best_w = None, None
            for v, (s, n) in enumerate(spans):
                if s <= pos < s + n:
                    score = min(pos - s, s + n - 1 - pos) + 0.01 * n
                    if best_score is None or score > best_score:
                        best_score, best_w = score, v
            best_window[pos] = best_w
        return best_window[pos]

    return [[check_is_max_context(pos) == w for pos in range(start, start + length)]
            for w, (start, length) in enumerate(spans)]


def test_max_context_mask_matches_the_token_by_token_rule():
    rng = np.random.default_rng(0)
    cases = [squad.window_starts(int(n), int(m), int(st)) for n, m, st in
             zip(rng.integers(1, 900, 300), rng.integers(8, 400, 300), rng.integers(1, 200, 300))]
    cases += [[(0, 10), (5, 10)], [(0, 7), (3, 4), (3, 9)], [(0, 0)]]
    for spans in cases:
        got = squad.max_context_mask(spans)
        assert [m.tolist() for m in got] == _max_context_loop(spans), spans


def test_char_to_token_span_matches_a_scan_of_the_offsets():
    rng = np.random.default_rng(1)
    for _ in range(300):
        lengths = rng.integers(1, 8, int(rng.integers(1, 60)))
        gaps = rng.integers(0, 3, len(lengths))
        ends = np.cumsum(lengths + gaps)
        offsets = [(int(e - n), int(e)) for e, n in zip(ends, lengths)]
        a = int(rng.integers(0, ends[-1] + 2))
        b = a + int(rng.integers(0, 12))
        hits = [i for i, (s, e) in enumerate(offsets) if e > a and s < b]
        want = (hits[0], hits[-1]) if hits else None
        assert squad.char_to_token_span(offsets, a, b) == want
        assert squad.char_to_token_span(np.asarray(offsets), a, b) == want


def test_contexts_tokenised_in_workers_as_in_one_process(tokenizer, monkeypatch):
    data = squad.read_squad(data_path("squad", "dev-v1.1.json"))
    contexts = data.contexts[:300]
    one = squad.tokenize_contexts(contexts, tokenizer, workers=1)
    monkeypatch.setattr(squad, "PARALLEL_CHARS", 0)
    two = squad.tokenize_contexts(contexts, tokenizer, workers=2)
    assert len(two) == len(one) == 300
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.offsets, b.offsets)
    first = one[0]
    assert tokenizer.convert_ids_to_tokens(first.ids[:3].tolist()) == tokenizer.tokenize(contexts[0])[:3]


def test_split_file_structure_and_article_filter():
    split = data_path("squad", "split.json")
    titles = squad.read_article_titles(f"{split}:train")
    assert len(titles) == 24 and "Super_Bowl_50" in titles
    raw = json.loads(split.read_text())
    data = squad.read_squad(data_path("squad", "dev-v1.1.json"), articles=f"{split}:eval")
    assert len(data.examples) == raw["questions"]["eval"] == 5609
    assert {e.title for e in data.examples} == set(raw["eval"])
    with pytest.raises(BertctlError, match="no list 'nope'"):
        squad.read_article_titles(f"{split}:nope")


def test_every_train_answer_is_recoverable_from_its_windows(tokenizer):
    """For each question of the split's train articles, the windows that hold the answer point
    at it: exactly (after normalisation) when its ends fall on token boundaries (checked from
    the offsets), else at the smallest token-aligned span around it."""
    split = data_path("squad", "split.json")
    data = squad.read_squad(data_path("squad", "dev-v1.1.json"), articles=f"{split}:train", training=True)
    assert len(data.examples) == 4961 and not data.skipped
    cfg = squad.SquadConfig()
    contexts = squad.tokenize_contexts(data.contexts, tokenizer)
    features = squad.featurize(data, tokenizer, cfg, training=True, contexts=contexts)
    by_example: dict[int, list[dict]] = {}
    for f in features:
        by_example.setdefault(f["_example"], []).append(f)
        assert len(f["input_ids"]) <= cfg.max_seq_length
    inexact = 0
    for ei, ex in enumerate(data.examples):
        text, start = ex.answers[0]
        end = start + len(text)
        ctx = contexts[ex.context_index]
        aligned = start in set(ctx.offsets[:, 0]) and end in set(ctx.offsets[:, 1])
        holding = [f for f in by_example[ei] if f["start_positions"] > 0]
        assert holding, f"{ex.qid}: no window holds the answer"
        for f in holding:
            assert f["start_positions"] <= f["end_positions"]
            got = squad.recover_answer(f, ex.context, ctx)
            if aligned:
                assert normalize_answer(got) == normalize_answer(text), ex.qid
            else:
                assert text in got, ex.qid
        inexact += not aligned
    # Answers that cut a word piece (e.g. "10." of "2010.") are rare.
    assert inexact < 0.01 * len(data.examples)


def test_offsets_agree_with_hf_fast_tokenizer(tokenizer):
    import transformers
    hf = transformers.BertTokenizerFast.from_pretrained(minilm_dir())
    data = squad.read_squad(data_path("squad", "dev-v1.1.json"))
    for context in data.contexts[:40]:
        tokens, offsets = tokenizer.tokenize_with_offsets(context)
        enc = hf(context, add_special_tokens=False, return_offsets_mapping=True)
        assert tokens == hf.convert_ids_to_tokens(enc["input_ids"])
        assert [tuple(o) for o in offsets] == [tuple(o) for o in enc["offset_mapping"]]


def _one_example(version_2=False):
    context = "Denver Broncos beat the Carolina Panthers in Santa Clara."
    raw = {"version": "2.0", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": "q", "question": "Who won?", "answers": [{"text": "Denver Broncos", "answer_start": 0}],
         "is_impossible": False}]}]}]}
    return raw


def _decode_crafted(tmp_path, tokenizer, start_pos, end_pos, null_boost=0.0, version_2=False):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(_one_example()))
    data = squad.read_squad(path, version_2=version_2)
    cfg = squad.SquadConfig(version_2=version_2)
    contexts = squad.tokenize_contexts(data.contexts, tokenizer)
    feats = squad.featurize(data, tokenizer, cfg, training=False, contexts=contexts)
    (f,) = feats
    n = len(f["input_ids"])
    s = np.full(n, -5.0, dtype=np.float32)
    e = np.full(n, -5.0, dtype=np.float32)
    off = f["_ctx_offset"]
    s[off + start_pos] = 5.0
    e[off + end_pos] = 4.0
    s[0] = e[0] = null_boost  # [CLS]
    return squad.decode(data, feats, [(s, e)], contexts, cfg)["q"], contexts[0]


def test_decode_crafted_logits(tmp_path, tokenizer):
    tokens, _ = tokenizer.tokenize_with_offsets(_one_example()["data"][0]["paragraphs"][0]["context"])
    i = tokens.index("carolina")
    pred, _ = _decode_crafted(tmp_path, tokenizer, i, i + 1)
    assert pred.text == "Carolina Panthers"
    assert pred.nbest[0]["score"] == pytest.approx(9.0)
    # end before start is never a span: the best valid one is chosen instead.
    pred, _ = _decode_crafted(tmp_path, tokenizer, i + 1, i)
    assert pred.text != "" and pred.nbest[0]["score"] < 9.0


def test_v2_null_decision(tmp_path, tokenizer):
    tokens, _ = tokenizer.tokenize_with_offsets(_one_example()["data"][0]["paragraphs"][0]["context"])
    i = tokens.index("denver")
    # s_null = 2 * 6 = 12 > best span 5 + 4 = 9: null odds +3.
    pred, _ = _decode_crafted(tmp_path, tokenizer, i, i + 1, null_boost=6.0, version_2=True)
    assert pred.text == "Denver Broncos"
    assert pred.null_odds == pytest.approx(3.0)
    preds = {"q": pred}
    assert squad.final_answers(preds, True, threshold=0.0) == {"q": ""}  # 3 > 0: no answer
    assert squad.final_answers(preds, True, threshold=3.5) == {"q": "Denver Broncos"}
    assert squad.final_answers(preds, False) == {"q": "Denver Broncos"}
    # s_null = 2 < 9: answered at τ = 0.
    pred, _ = _decode_crafted(tmp_path, tokenizer, i, i + 1, null_boost=1.0, version_2=True)
    assert pred.null_odds == pytest.approx(-7.0)
    assert squad.final_answers({"q": pred}, True, 0.0) == {"q": "Denver Broncos"}


def test_threshold_chosen_on_dev_maximises_f1(tmp_path):
    raw = {"data": [{"title": "t", "paragraphs": [{"context": "a b c", "qas": [
        {"id": "h", "question": "?", "answers": [{"text": "b", "answer_start": 2}], "is_impossible": False},
        {"id": "n", "question": "?", "answers": [], "is_impossible": True}]}]}]}
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(raw))
    data = squad.read_squad(path, version_2=True)
    preds = {"h": squad.Prediction("b", -1.0, []), "n": squad.Prediction("c", 2.0, [])}
    metrics, tau = squad.score_predictions(data, preds, version_2=True)
    # Any τ in [-1, 2) answers h and blanks n: both right; the official search returns -1.
    assert tau == pytest.approx(-1.0)
    assert metrics["f1"] == pytest.approx(100.0) and metrics["HasAns_f1"] == 100.0 and metrics["NoAns_f1"] == 100.0


def test_answer_not_at_start_is_realigned_or_skipped(tmp_path):
    raw = {"data": [{"title": "t", "paragraphs": [{"context": "red green blue", "qas": [
        {"id": "a", "question": "?", "answers": [{"text": "green", "answer_start": 0}]},
        {"id": "b", "question": "?", "answers": [{"text": "purple", "answer_start": 0}]}]}]}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    data = squad.read_squad(path, training=True)
    assert [e.qid for e in data.examples] == ["a"] and data.examples[0].answers[0] == ("green", 4)
    assert data.realigned == 1 and len(data.skipped) == 1 and "purple" in data.skipped[0]


def test_v2_data_needs_flag(tmp_path):
    raw = {"data": [{"title": "t", "paragraphs": [{"context": "x", "qas": [
        {"id": "n", "question": "?", "answers": [], "is_impossible": True}]}]}]}
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(BertctlError, match="--version-2"):
        squad.read_squad(path)
