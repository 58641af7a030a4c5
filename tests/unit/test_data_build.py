"""build_data on real text: statistics, layout, determinism, resume, bad input, CLI.

Independent references: the documents are re-read and re-tokenized here with the
plain tokenizer (no word cache), every instance's segments are looked up in
them, and rates are checked against the paper's numbers within binomial
tolerances (4 standard deviations).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.data.build import WordCache, build_data
from bertctl.data.config import DataConfig, default_max_predictions
from bertctl.data.documents import ReadStats, list_inputs, read_documents
from bertctl.data.dataset import PretrainingData
from bertctl.data.sentences import split_sentences
from bertctl.errors import BertctlError
from bertctl.text.wordpiece import BertTokenizer
from helpers import whole_word_masks

NON_UTF8 = ["1970-Nixon.txt", "1971-Nixon.txt", "1972-Nixon.txt", "1973-Nixon.txt", "1974-Nixon.txt"]


@pytest.fixture(scope="module")
def tokenizer(minilm_vocab):
    return BertTokenizer.from_vocab_file(minilm_vocab)


@pytest.fixture(scope="module")
def corpus(shared_data) -> list[Path]:
    """Inaugural addresses (0.9 MB) and five ISO-8859-1 State of the Union files."""
    return [shared_data / "corpus" / "inaugural"] + [shared_data / "corpus" / "state_union" / n for n in NON_UTF8]


def load_shards(out: Path, split: str = "train") -> np.ndarray:
    manifest = json.loads((out / "manifest.json").read_text())
    return np.concatenate([np.load(out / s["file"]) for s in manifest["splits"][split]["shards"]])


def dir_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def static_build(tmp_path_factory, corpus, tokenizer):
    out = tmp_path_factory.mktemp("static") / "data"
    cfg = DataConfig(format="text", pattern="*.txt", dupe_factor=2, seed=7, chunk_bytes=300_000)
    summary = build_data(corpus, out, tokenizer, cfg, workers=1, progress=False)
    return out, summary, load_shards(out)


def test_summary_counts_inputs(static_build, corpus):
    out, summary, rec = static_build
    assert summary["files"] == len(list((corpus[0]).glob("*.txt"))) + len(NON_UTF8)
    assert sorted(Path(p).name for p in summary["non_utf8_files"]) == sorted(NON_UTF8 + ["2005-Bush.txt"])
    assert summary["instances"] == len(rec) == summary["instances_per_split"]["train"]
    assert summary["documents"] == summary["files"]  # one document per file in text format
    assert summary["tokens"] == int(rec["length"].sum())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["do_lower_case"] is True
    assert manifest["tokenizer"]["vocab_sha256"] == "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
    assert rec.dtype["input_ids"].base == np.dtype("<u2")


def test_layout_invariants(static_build, tokenizer):
    _, _, rec = static_build
    S = 128
    cls, sep, mask = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id
    for r in rec:
        n = int(r["length"])
        ids, tt = r["input_ids"], r["token_type_ids"]
        assert 5 <= n <= S
        assert ids[0] == cls and ids[n - 1] == sep and not ids[n:].any()
        n_a = int(np.argmax(tt[:n])) - 2  # first type-1 position = len(A) + 2
        assert n_a >= 1 and ids[n_a + 1] == sep
        assert (tt[: n_a + 2] == 0).all() and (tt[n_a + 2 : n] == 1).all() and not tt[n:].any()
        assert n - n_a - 3 >= 1  # B is never empty
        pos = r["masked_positions"][r["masked_positions"] > 0]
        assert (np.diff(pos) > 0).all()
        assert set(pos.tolist()).isdisjoint({0, n_a + 1, n - 1}), "a special token was masked"
        assert (pos < n).all()
        assert not r["masked_lm_labels"][len(pos) :].any()
        labels = r["masked_lm_labels"][: len(pos)]
        assert not np.isin(labels, [cls, sep, mask, 0]).any()


def _doc_streams(corpus, tokenizer) -> list[bytes]:
    """Each document's token ids as big-endian uint32 bytes, tokenized here without the word cache."""
    stats = ReadStats()
    streams = []
    for doc in read_documents(list_inputs(corpus, "*.txt"), "text", stats):
        ids = [i for p in doc.pieces for s in split_sentences(p) for i in tokenizer.convert_tokens_to_ids(tokenizer.tokenize(s))]
        streams.append(np.asarray(ids, dtype=">u4").tobytes())
    return streams


def _find(streams: list[bytes], seg: np.ndarray) -> set[int]:
    needle = seg.astype(">u4").tobytes()
    found = set()
    for d, s in enumerate(streams):
        i = s.find(needle)
        while i >= 0:
            if i % 4 == 0:
                found.add(d)
                break
            i = s.find(needle, i + 1)
    return found


def test_segments_are_real_text_and_labels_are_original_tokens(static_build, corpus, tokenizer):
    """Put the masked labels back: segment A and B must then be contiguous runs of one
    document's tokens, and for NSP label 0 both from the same document."""
    _, _, rec = static_build
    streams = _doc_streams(corpus, tokenizer)
    rng = np.random.default_rng(0)
    same_doc_random = 0
    sample = rng.choice(len(rec), 150, replace=False)
    for r in rec[sample]:
        n = int(r["length"])
        ids = r["input_ids"][:n].astype(np.int64)
        pos = r["masked_positions"][r["masked_positions"] > 0]
        ids[pos] = r["masked_lm_labels"][: len(pos)]
        n_a = int(np.argmax(r["token_type_ids"][:n])) - 2
        docs_a, docs_b = _find(streams, ids[1 : n_a + 1]), _find(streams, ids[n_a + 2 : n - 1])
        assert docs_a and docs_b, "a segment is not contiguous corpus text"
        if r["next_sentence_label"] == 0:
            assert docs_a & docs_b
        else:
            same_doc_random += bool(docs_a & docs_b)
    assert same_doc_random < 20  # random B comes from another document (short texts may repeat)


def test_masking_statistics(static_build, tokenizer):
    """Budget rule of create_pretraining_data, 15% of tokens, 80/10/10 within 4 sigma."""
    _, summary, rec = static_build
    P = default_max_predictions(128)
    lengths = rec["length"].astype(np.int64)
    expected = np.minimum(P, np.maximum(1, np.round(lengths * 0.15))).sum()  # round half even, as Python's round
    n_masked = int((rec["masked_positions"] > 0).sum())
    assert n_masked == expected == summary["masked"]
    rate = n_masked / (lengths - 3).sum()
    assert 0.14 < rate < 0.16 and abs(rate - summary["mask_rate"]) < 1e-3

    rows, cols = np.nonzero(rec["masked_positions"] > 0)
    inputs = rec["input_ids"][rows, rec["masked_positions"][rows, cols]].astype(np.int64)
    labels = rec["masked_lm_labels"][rows, cols].astype(np.int64)
    is_mask = inputs == tokenizer.mask_token_id
    is_same = inputs == labels
    is_random = ~is_mask & ~is_same
    V = tokenizer.vocab_size
    for observed, p in [(is_mask.mean(), 0.8), (is_same.mean(), 0.1 + 0.1 / V), (is_random.mean(), 0.1 * (1 - 1 / V))]:
        sigma = math.sqrt(p * (1 - p) / n_masked)
        assert abs(observed - p) < 4 * sigma, (observed, p)


def test_nsp_and_short_sequence_rates(static_build):
    _, summary, rec = static_build
    c = summary["counters"]
    n = len(rec)
    assert (rec["next_sentence_label"] == 1).sum() == c["random_next"]
    # Random B segments come from other documents through the excerpt pool (issue: never A's own).
    assert summary["nsp_random_next_same_document"] == 0 and summary["nsp_random_next_from_unit"] == 0
    free = n - c["forced_random_next"]  # one-sentence chunks are random by construction (the reference)
    assert c["forced_random_next"] < 0.1 * n  # long 18th-century sentences fill a target alone
    p_hat = (c["random_next"] - c["forced_random_next"]) / free
    assert abs(p_hat - 0.5) < 4 * math.sqrt(0.25 / free)
    short = c["short_target"] / n
    assert abs(short - 0.1) < 4 * math.sqrt(0.09 / n)
    # Short targets show in the lengths: a full target almost always fills >= 100 tokens.
    assert (rec["length"] < 100).mean() > 0.03


def test_word_cache_matches_tokenizer(corpus, minilm_vocab):
    """Every distinct word of the test corpus, and tricky strings, give the tokenizer's ids."""
    words = sorted({w for doc in read_documents(list_inputs(corpus, "*.txt"), "text", ReadStats())
                    for p in doc.pieces for w in p.split()})
    assert len(words) > 15000
    texts = [" ".join(words[i : i + 40]) for i in range(0, len(words), 40)]  # fresh words: cache misses
    texts += ["Hello, World!!", "x" * 101, "y" * 100, "unaffable UNAFFABLE Unaffable", "3.14159 1,000,000"]
    texts += ["Hello, World!!", "\"Quoted\" (bracketed) [x]... ok?", "Caf\u00e9 na\u00efve \u00c9T\u00c9", "a\x1cb c\x0bd",
              "\u4e2d\u6587 mixed\u4e2dtext", "__init__ don't re-use 3.14 $5", "\u00bfQu\u00e9? \u2014dash\u2014", "",
              "a [MASK] b x[CLS]y [SEP]. [mask] [UNK]!", "caf\u00e9[SEP]na\u00efve", "tab\there\xa0nbsp\u3000ideographic"]
    # Every character str.split() cuts at, between two words: the word split must agree with BERT's
    # (or the text must take the tokenizer's own path), in either casing.
    texts += [f"a{c}b x{c}{c}y" for c in map(chr, range(0x110000)) if c.isspace()]
    for lower in (True, False):
        tok = BertTokenizer.from_vocab_file(minilm_vocab, do_lower_case=lower)
        cache = WordCache(tok)
        for text in texts + texts:  # second pass: from the cache
            assert cache.encode(text) == tok.convert_tokens_to_ids(tok.tokenize(text)), ascii(text)


def test_same_output_for_1_and_2_workers(tmp_path, shared_data, tokenizer):
    inputs = [shared_data / "corpus" / "inaugural"]
    cfg = DataConfig(format="text", dupe_factor=1, seed=3, chunk_bytes=120_000, shard_size=500)
    s1 = build_data(inputs, tmp_path / "w1", tokenizer, cfg, workers=1, progress=False)
    s2 = build_data(inputs, tmp_path / "w2", tokenizer, cfg, workers=2, progress=False)
    assert s1["shards"] > 4 and s2["shards"] == s1["shards"]
    a, b = dir_bytes(tmp_path / "w1"), dir_bytes(tmp_path / "w2")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    s3 = build_data(inputs, tmp_path / "w3", tokenizer, DataConfig(**{**cfg.to_dict(), "seed": 4}), progress=False)
    assert dir_bytes(tmp_path / "w3")["train-00000-000.npy"] != a["train-00000-000.npy"]
    assert s3["instances"] > 0


# ----------------------------------------------------------------------------- random next segments


def _books(tmp_path: Path, tokenizer, n_docs: int = 8, words_per_doc: int = 8000) -> tuple[Path, dict[int, int]]:
    """A corpus of book-like documents, one file each, every document written in its own words
    (disjoint sets of whole-word vocabulary tokens), so a token names the document it came from.
    Document 5 is one long paragraph (no blank lines): excerpts of it are windows of a paragraph.
    Returns the folder and {token id: document}."""
    import random

    words = [t for t in tokenizer.ids_to_tokens[2000:] if t.isalpha() and t.isascii() and 4 <= len(t) <= 8
             and tokenizer.ids(t) == [tokenizer.vocab[t]]]
    rng = random.Random(0)
    rng.shuffle(words)
    per_doc = len(words) // n_docs
    owner = {}
    folder = tmp_path / "books"
    folder.mkdir()
    for d in range(n_docs):
        own = words[d * per_doc : (d + 1) * per_doc]
        owner.update((tokenizer.vocab[w], d) for w in own)
        paragraphs, n = [], 0
        while n < words_per_doc:
            sentences = []
            for _ in range(rng.randint(3, 7)):
                k = rng.randint(5, 16)
                sentences.append(" ".join(rng.choice(own) for _ in range(k)).capitalize() + ".")
                n += k
            paragraphs.append(" ".join(sentences))
        (folder / f"book{d}.txt").write_text((" " if d == 5 else "\n\n").join(paragraphs) + "\n", encoding="utf-8")
    return folder, owner


BOOKS_CFG = dict(format="text", max_seq_length=64, dupe_factor=2, dynamic_masking=True, seed=11, chunk_bytes=70_000,
                 shard_size=400)


def test_random_next_comes_from_other_documents(tmp_path, tokenizer):
    """Book-length documents, two per work unit: every random B comes from another document, from
    across the corpus (not the unit's other book), uniformly, as contiguous text of that document."""
    folder, owner = _books(tmp_path, tokenizer)
    out = tmp_path / "out"
    summary = build_data([folder], out, tokenizer, DataConfig(**BOOKS_CFG), progress=False)
    assert summary["documents"] == 8
    assert summary["nsp_random_next_same_document"] == 0 and summary["nsp_random_next_from_unit"] == 0
    streams = {}
    for f in sorted(folder.iterdir()):
        ids = tokenizer.ids(f.read_text(encoding="utf-8"))
        streams[owner[ids[0]]] = np.asarray(ids, dtype=">u4").tobytes()
    manifest = json.loads((out / "manifest.json").read_text())
    unit_docs: dict[int, set] = {}
    pairs = []  # (unit, document of A, document of B, label)
    for shard in manifest["splits"]["train"]["shards"]:
        unit = int(shard["file"].split("-")[1])
        for r in np.load(out / shard["file"]):
            n = int(r["length"])
            ids = r["input_ids"][:n].astype(np.int64)
            n_a = int(np.argmax(r["token_type_ids"][:n])) - 2
            seg_a, seg_b = ids[1 : n_a + 1], ids[n_a + 2 : n - 1]
            docs_a, docs_b = {owner.get(int(t)) for t in seg_a} - {None}, {owner.get(int(t)) for t in seg_b} - {None}
            assert len(docs_a) == 1 and len(docs_b) == 1, "a segment mixes documents"
            (a,), (b,) = docs_a, docs_b
            assert streams[b].find(seg_b.astype(">u4").tobytes()) % 4 == 0, "B is not contiguous text of its document"
            unit_docs.setdefault(unit, set()).add(a)
            pairs.append((unit, a, b, int(r["next_sentence_label"])))
    assert len(unit_docs) == 4 and all(len(d) == 2 for d in unit_docs.values())  # two books per unit
    assert all(a == b for _, a, b, label in pairs if label == 0)
    negatives = [(u, a, b) for u, a, b, label in pairs if label == 1]
    assert len(negatives) > 300
    assert all(a != b for _, a, b in negatives)
    # From the unit's other book only about 1/3, 1/5, 1/7, 1/7 of the time (units 0..3 see 4, 6, 8, 8
    # documents); drawing within the unit gave 100%.
    same_unit = np.mean([b in unit_docs[u] for u, a, b in negatives])
    assert same_unit < 0.35, same_unit
    # The last two units see all 8 documents: B's document is uniform over the 7 others (chi-square,
    # 7 degrees of freedom, p = 0.001 at 24.3).
    late = [(a, b) for u, a, b in negatives if u >= 2]
    observed = np.bincount([b for _, b in late], minlength=8)
    from_a = np.bincount([a for a, _ in late], minlength=8)
    expected = np.array([sum(from_a[a] for a in range(8) if a != b) / 7 for b in range(8)])
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < 24.3, (observed, expected)

    # random_next_per_unit=0: the unit's own documents, the earlier behaviour, counted as such.
    s0 = build_data([folder], tmp_path / "unit", tokenizer, DataConfig(**BOOKS_CFG, random_next_per_unit=0),
                    progress=False)
    assert s0["nsp_random_next_from_unit"] + s0["nsp_random_next_same_document"] == s0["counters"]["random_next"]


def test_random_next_pool_same_bytes_for_workers_and_resume(tmp_path, tokenizer):
    folder, _ = _books(tmp_path, tokenizer, n_docs=6, words_per_doc=6000)
    cfg = DataConfig(**{**BOOKS_CFG, "dynamic_masking": False, "random_next_pool": 3, "random_next_per_unit": 2})
    build_data([folder], tmp_path / "w1", tokenizer, cfg, workers=1, progress=False)
    build_data([folder], tmp_path / "w2", tokenizer, cfg, workers=2, progress=False)
    a, b = dir_bytes(tmp_path / "w1"), dir_bytes(tmp_path / "w2")
    assert len(a) > 4 and a.keys() == b.keys() and all(a[k] == b[k] for k in a)

    def stop_after_one(record):
        raise Stop

    with pytest.raises(Stop):
        build_data([folder], tmp_path / "cut", tokenizer, cfg, workers=2, progress=False, on_unit_done=stop_after_one)
    summary = build_data([folder], tmp_path / "cut", tokenizer, cfg, workers=1, resume=True, progress=False)
    assert summary["resumed_units"] >= 1
    c = dir_bytes(tmp_path / "cut")
    assert a.keys() == c.keys() and all(a[k] == c[k] for k in a)
    assert summary["nsp_random_next_same_document"] == 0


def test_excerpt_reservoir_is_uniform_and_bounded():
    """Algorithm R: after 200 documents each is in a 20-slot sample with probability 1/10
    (chi-square over 2000 seeds); excerpts stay under three times their size."""
    import random

    from bertctl.data.build import ExcerptReservoir

    n_docs, capacity, chars = 200, 20, 50
    docs = [[f"Doc {d} paragraph {p}. " * (1 + (d + p) % 9) for p in range(1 + d % 7)] for d in range(n_docs)]
    hits = np.zeros(n_docs)
    for seed in range(2000):
        reservoir = ExcerptReservoir(capacity, chars, random.Random(seed))
        for pieces in docs:
            reservoir.offer(pieces, False)
        assert len(reservoir.items) == capacity and reservoir.seen == n_docs
        for e in reservoir.items:
            hits[e.document] += 1
            assert all(any(p in q for q in docs[e.document]) for p in e.pieces) and sum(map(len, e.pieces)) < 3 * chars
    expected = 2000 * capacity / n_docs
    chi2 = ((hits - expected) ** 2 / expected).sum()
    # 199 degrees of freedom (mean 199, sd 20); 20-of-200 sampling makes it a little tighter
    assert chi2 < 199 + 5 * 20, chi2


def test_excerpt_of_a_long_paragraph_keeps_whole_sentences(tokenizer):
    """A window cut from a long paragraph drops its partial first and last sentences."""
    import random

    from bertctl.data.build import ChunkWorker, make_excerpt

    sentences = [f"Sentence number {k} says {k * 7} things." for k in range(400)]
    paragraph = " ".join(sentences)
    worker = ChunkWorker(tokenizer, DataConfig().resolved(), Path("unused"))
    whole = {tuple(tokenizer.ids(s)) for s in sentences}
    cut = 0
    for seed in range(40):
        e = make_excerpt(seed, [paragraph], False, 300, random.Random(seed))
        assert len(e.pieces) == 1 and len(e.pieces[0]) <= 300 and e.pieces[0] in paragraph
        cut += e.cut_head
        run = worker._excerpt("train", e)
        assert run and all(tuple(ids) in whole for ids in run)
    assert cut > 30
    short = make_excerpt(0, ["One. Two.", "Three. Four."], False, 300, random.Random(1))
    assert not short.cut_head and not short.cut_tail and short.pieces[-1] == "Three. Four."


class Stop(Exception):
    pass


def test_interrupted_build_resumes_byte_identical(tmp_path, shared_data, tokenizer):
    inputs = [shared_data / "corpus" / "inaugural"]
    cfg = DataConfig(format="text", dupe_factor=1, seed=5, chunk_bytes=120_000, dynamic_masking=True)
    build_data(inputs, tmp_path / "full", tokenizer, cfg, workers=1, progress=False)

    done = []

    def stop_after_three(record):
        done.append(record["unit"])
        if len(done) == 3:
            raise Stop

    with pytest.raises(Stop):
        build_data(inputs, tmp_path / "cut", tokenizer, cfg, workers=2, progress=False, on_unit_done=stop_after_three)
    assert not (tmp_path / "cut" / "manifest.json").exists()
    (tmp_path / "cut" / ".train-00009-000.npy.x.tmp").write_bytes(b"half a shard")  # debris of a killed write
    # Two workers: units in flight when the stop came may finish too, so 3 or more are kept.
    with pytest.raises(BertctlError, match=r"unfinished build-data run \(an interrupted build with [3-9] finished "
                                           r"work units\); pass --resume"):
        build_data(inputs, tmp_path / "cut", tokenizer, cfg, progress=False)
    with pytest.raises(BertctlError, match="different data_config"):
        build_data(inputs, tmp_path / "cut", tokenizer, DataConfig(**{**cfg.to_dict(), "seed": 6}), resume=True,
                   progress=False)
    summary = build_data(inputs, tmp_path / "cut", tokenizer, cfg, workers=1, resume=True, progress=False)
    assert summary["resumed_units"] >= 3
    a, b = dir_bytes(tmp_path / "full"), dir_bytes(tmp_path / "cut")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "cut").iterdir())
    with pytest.raises(BertctlError, match="finished build-data run, so there is nothing to resume"):
        build_data(inputs, tmp_path / "cut", tokenizer, cfg, resume=True, progress=False)
    assert dir_bytes(tmp_path / "cut") == a  # the refusal touched nothing


def test_whole_word_masking_masks_whole_words(tmp_path, shared_data, tokenizer):
    inputs = [shared_data / "corpus" / "state_union" / n for n in NON_UTF8]
    cfg = DataConfig(format="text", dupe_factor=2, whole_word_mask=True, seed=1)
    build_data(inputs, tmp_path / "wwm", tokenizer, cfg, progress=False)
    rec = load_shards(tmp_path / "wwm")
    cont = np.array([t.startswith("##") for t in tokenizer.ids_to_tokens])
    multi_piece = 0
    for r in rec:
        n = int(r["length"])
        ids = r["input_ids"][:n].astype(np.int64)
        pos = r["masked_positions"][r["masked_positions"] > 0]
        ids[pos] = r["masked_lm_labels"][: len(pos)]
        masked = np.zeros(n, bool)
        masked[pos] = True
        multi_piece += whole_word_masks(ids, masked, cont, tokenizer)
    assert multi_piece > 20


def test_holdout_split(tmp_path, shared_data, tokenizer):
    inputs = [shared_data / "corpus" / "inaugural"]
    cfg = DataConfig(format="text", dupe_factor=1, holdout_fraction=0.2, seed=2)
    summary = build_data(inputs, tmp_path / "h", tokenizer, cfg, progress=False)
    split = summary["instances_per_split"]
    assert split["eval"] > 0 and split["train"] > 3 * split["eval"]
    assert PretrainingData(tmp_path / "h", split="eval").num_instances == split["eval"]


def test_formats_lines_and_jsonl(tmp_path, tokenizer, minilm_vocab):
    lines = tmp_path / "a.txt"
    lines.write_text("The first sentence here.\nThe second one follows.\nA third.\n\n"
                     "Another document starts.\nIt ends here.\n\nOnly one sentence.\n\n", encoding="utf-8")
    cfg = DataConfig(format="lines", dupe_factor=3, max_seq_length=16)
    s = build_data([lines], tmp_path / "lines", tokenizer, cfg, progress=False)
    assert s["documents_read"] == 3 and s["documents"] == 2 and s["sentences"] == 5
    assert s["skipped"]["documents_with_fewer_than_2_sentences"] == 1

    text = tmp_path / "t.txt"
    text.write_text("First doc, first line\nwrapped here. Second sentence.\n\nNew paragraph.\n---\n"
                    "Second doc. It has two.\n  ---  \nThird doc. Also two.\n", encoding="utf-8")
    s = build_data([text], tmp_path / "text", tokenizer, DataConfig(format="text", doc_separator="---"),
                   progress=False)
    assert s["documents"] == 3 and s["sentences"] == 7
    # a document past max_document_bytes is cut at the next paragraph break (memory bound)
    s = build_data([text], tmp_path / "text-cut", tokenizer, DataConfig(format="text", max_document_bytes=30),
                   progress=False)
    assert s["documents_cut_at_max_bytes"] == 1 and s["documents_read"] == 2

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"body": "One sentence. Two sentences here."}\nnot json\n{"other": 1}\n'
                     '{"body": "Para one.\\n\\nPara two. And more."}\n', encoding="utf-8")
    s = build_data([jsonl], tmp_path / "jsonl", vocab=minilm_vocab, config=DataConfig(format="jsonl", text_field="body"),
                   progress=False)  # a vocab.txt path instead of a tokenizer object
    assert s["documents"] == 2 and s["sentences"] == 5
    assert s["skipped"]["lines"]["not valid JSON"] == {"count": 1, "first": f"{jsonl}:2"}
    assert s["skipped"]["lines"]["no string field 'body'"]["count"] == 1


def test_bad_inputs(tmp_path, tokenizer, minilm_vocab):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x00\x01\x02abc")
    one = tmp_path / "one.txt"
    one.write_text("Just one sentence here.\n", encoding="utf-8")
    with pytest.raises(BertctlError, match="no instances"):
        build_data([empty, binary, one], tmp_path / "o1", tokenizer, DataConfig(format="text"), progress=False)
    with pytest.raises(BertctlError, match="no such input"):
        build_data([tmp_path / "missing.txt"], tmp_path / "o2", tokenizer, DataConfig(), progress=False)
    with pytest.raises(BertctlError, match=r"\[CLS\]"):  # the tokenizer or build_data refuses it
        build_data([one], tmp_path / "o3", BertTokenizer(["[PAD]", "[UNK]", "a", "b"]), DataConfig(format="text"),
                   progress=False)
    with pytest.raises(BertctlError, match="max-seq-length"):
        build_data([one], tmp_path / "o4", tokenizer, DataConfig(max_seq_length=4), progress=False)
    two = tmp_path / "two.txt"
    two.write_text("One sentence here. Another sentence there.", encoding="utf-8")
    s = build_data([empty, binary, two], tmp_path / "o5", tokenizer, DataConfig(format="text"), progress=False)
    assert {d["reason"] for d in s["skipped"]["inputs"]} == {"empty", "binary (NUL bytes)"}


def test_cli_build_data(tmp_path, minilm_vocab, shared_data):
    runner = CliRunner()
    inputs = [str(shared_data / "corpus" / "state_union" / n) for n in NON_UTF8[:2]]
    out = tmp_path / "cli"
    args = ["build-data", "--vocab", str(minilm_vocab), "--format", "text", "--dupe-factor", "1",
            "--max-seq-length", "64", "--no-progress", "-o", str(out), *inputs]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["instances"] > 0 and len(summary["non_utf8_files"]) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data_config"]["max_predictions_per_seq"] == default_max_predictions(64) == 12
    assert manifest["data_config"]["random_next_pool"] == 4096 and manifest["data_config"]["random_next_per_unit"] == 32
    assert manifest["summary"]["nsp_random_next_same_document"] == 0
    bad = runner.invoke(app, [*args[:-4], "--random-next-pool", "8", "--random-next-per-unit", "9", "-o",
                              str(tmp_path / "bad"), *inputs])
    assert bad.exit_code == 2 and "--random-next-per-unit: must be in [0, 8]" in bad.stderr
    no_vocab = runner.invoke(app, ["build-data", "-o", str(tmp_path / "none"), *inputs])
    assert no_vocab.exit_code == 2 and "bertctl tokenize train" in no_vocab.stderr
    assert not (tmp_path / "none").exists()
    built = dir_bytes(out)
    result = runner.invoke(app, args)  # a finished build, without --overwrite
    assert result.exit_code == 2 and "holds a finished build-data run; pass --overwrite" in result.stderr
    result = runner.invoke(app, args + ["--resume"])
    assert result.exit_code == 2 and "nothing to resume" in result.stderr
    assert dir_bytes(out) == built
    result = runner.invoke(app, args + ["--overwrite"])
    assert result.exit_code == 0, result.output
    assert dir_bytes(out) == built and not (out / ".replaced").exists()
    # the installed entry point: one line on stderr, exit code 2
    bad_vocab = tmp_path / "vocab.txt"
    bad_vocab.write_text("a\nb\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "bertctl", "build-data", "--vocab", str(bad_vocab), "-o",
                           str(tmp_path / "x"), *inputs], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("bertctl: error:") and proc.stderr.count("\n") == 1


def test_mask_batch_is_uniform_over_candidates(tokenizer):
    """Every non-special position is chosen with probability budget / candidates (chi-square over positions)."""
    from bertctl.data.build import special_ids
    from bertctl.data.instances import mask_batch

    B, S, n_a = 20000, 128, 50
    ids = np.full((B, S), 2000, dtype=np.int64)
    ids[:, 0], ids[:, n_a + 1], ids[:, S - 1] = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.sep_token_id
    seeds = np.arange(B, dtype=np.uint64) * np.uint64(7919)
    _, pos, labels = mask_batch(ids, np.full(B, S), seeds, special_ids(tokenizer), masked_lm_prob=0.15,
                                max_predictions=20)
    budget = round(S * 0.15)  # 19
    assert ((pos > 0).sum(1) == budget).all() and (labels[pos > 0] == 2000).all()
    counts = np.bincount(pos[pos > 0], minlength=S)
    assert counts[0] == counts[n_a + 1] == counts[S - 1] == 0
    observed = np.delete(counts, [0, n_a + 1, S - 1])
    expected = B * budget / len(observed)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    # 124 degrees of freedom (sampling without replacement makes it a little tighter): mean 124, sd ~15.7
    assert chi2 < 124 + 5 * 15.7, chi2


def test_truncate_seq_pair_matches_the_reference_rule():
    """Lengths as google-research's loop leaves them; the ends trimmed follow Binomial(k, 1/2)."""
    import random

    from bertctl.data.instances import truncate_seq_pair

    def reference(a, b, max_num_tokens, rng):
        while len(a) + len(b) > max_num_tokens:
            trunc = a if len(a) > len(b) else b
            if rng.random() < 0.5:
                del trunc[0]
            else:
                trunc.pop()

    rng = random.Random(0)
    for _ in range(300):
        la, lb, m = rng.randint(1, 200), rng.randint(1, 200), rng.randint(2, 125)
        a, b = list(range(la)), list(range(1000, 1000 + lb))
        ra, rb = list(a), list(b)
        reference(ra, rb, m, rng)
        assert truncate_seq_pair(a, b, m, rng) == (la + lb > m)
        assert (len(a), len(b)) == (len(ra), len(rb))
        assert a == list(range(a[0], a[0] + len(a))) and b == list(range(b[0], b[0] + len(b)))  # contiguous
    fronts = []
    for _ in range(4000):
        a = list(range(20))
        truncate_seq_pair(a, [0], 13, rng)  # 8 cuts from A
        fronts.append(a[0])
    assert abs(np.mean(fronts) - 4) < 4 * math.sqrt(2 / 4000) and abs(np.var(fronts) - 2) < 0.25


def test_cli_workers_default_to_the_usable_cpus(tmp_path, minilm_vocab, monkeypatch):
    """build-data's --workers means what it means in tokenize train: worker processes, by default the CPUs
    this process may use (shown in --help); the bytes written do not depend on it."""
    import os

    import bertctl.data.build

    seen = []
    original = bertctl.data.build.build_data

    def spy(*args, **kwargs):
        seen.append(kwargs["workers"])
        return original(*args, **kwargs)

    monkeypatch.setattr(bertctl.data.build, "build_data", spy)
    corpus = tmp_path / "a.txt"
    corpus.write_text("".join(f"Sentence {i} of document {i // 7}. It has a second part here.\n" +
                              ("\n" if i % 7 == 6 else "") for i in range(70)), encoding="utf-8")
    outs = []
    for k, flag in enumerate(([], ["--workers", "1"])):
        out = tmp_path / f"data{k}"
        r = CliRunner().invoke(app, ["build-data", str(corpus), "--vocab", str(minilm_vocab), "-o", str(out),
                                     "--max-seq-length", "32", "--no-progress", *flag])
        assert r.exit_code == 0, r.output
        outs.append(dir_bytes(out))
    usable = len(os.sched_getaffinity(0))
    assert seen == [usable, 1]
    assert outs[0] == outs[1]
    help_text = " ".join(CliRunner().invoke(app, ["build-data", "--help"]).output.replace("│", " ").split())
    assert f"[default: (the usable CPUs, {usable} here)]" in help_text
