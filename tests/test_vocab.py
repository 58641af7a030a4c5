"""WordPiece vocabulary training: layout, size, determinism, min-frequency, and held-out quality.

Independent references: Hugging Face's BertTokenizerFast encodes with the learnt vocabulary exactly
as bertctl does, word counts are recounted here with plain string operations, and the held-out
[UNK] rate is measured on corpus files that training never saw.
"""
from __future__ import annotations

import re
from collections import Counter

import pytest

from bertctl.errors import BertctlError
from bertctl.tokenizer import BertTokenizer
from bertctl.vocab import VocabConfig, iter_text_lines, train_from_counts, train_vocab, vocab_stats

from tokenizer_data import DATA

CORPUS = DATA / "corpus"
needs_data = pytest.mark.usefixtures("shared_data")  # fails where ../shared/data is missing
HELD_OUT = ("austen-persuasion.txt", "2005-Bush.txt", "1961-Kennedy.txt")


def corpus_split():
    files = sorted(p for p in CORPUS.rglob("*.txt"))
    held = [p for p in files if p.name in HELD_OUT]
    return [p for p in files if p not in held], held


@pytest.fixture(scope="module")
def inaugural_vocab():
    """A 2,000-token vocabulary from the inaugural addresses (all but two held out)."""
    files = sorted((CORPUS / "inaugural").glob("*.txt"))
    train = [p for p in files if p.name not in HELD_OUT]
    config = VocabConfig(vocab_size=2000, min_frequency=3, reserved_unused=3)
    return train_vocab(train, config), config, train


@needs_data
def test_layout_size_and_pieces(inaugural_vocab):
    tokens, config, _ = inaugural_vocab
    assert tokens[:8] == ["[PAD]", "[unused0]", "[unused1]", "[unused2]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(tokens) == 2000  # enough pairs occur 3 times to fill it
    assert len(set(tokens)) == len(tokens)
    assert any(t.startswith("##") and len(t) > 3 for t in tokens)
    assert all(t == t.lower() for t in tokens[8:])  # uncased
    assert all(c in tokens and "##" + c in tokens for c in "abcdefghijklmnopqrstuvwxyz")


@needs_data
def test_deterministic(inaugural_vocab):
    tokens, config, train = inaugural_vocab
    # Same inputs, same vocabulary; the order of the files does not matter either.
    assert train_vocab(train, config) == tokens
    assert train_vocab(list(reversed(train)), config) == tokens


@needs_data
def test_min_frequency_respected(inaugural_vocab):
    tokens, config, train = inaugural_vocab
    # Recount words with plain string operations (the inaugural files are ASCII-only apart from
    # a few quotes): every learnt piece of 2+ characters must occur >= min_frequency times in the
    # position it stands for (word start, or inside a word for ## pieces).
    counts: Counter = Counter()
    for path in train:
        for line, _ in iter_text_lines(path):
            counts.update(re.findall(r"[a-z0-9]+|[^\sa-z0-9]", line.lower()))
    learnt = [t for t in tokens[8:] if len(t.removeprefix("##")) > 1 and t.removeprefix("##").isascii()
              and t.removeprefix("##").isalnum()]
    assert len(learnt) > 1000
    occurrences: Counter = Counter()  # (starts the word?, substring) -> weighted count
    for w, c in counts.items():
        for k in range(len(w)):
            for e in range(k + 2, len(w) + 1):
                occurrences[k == 0, w[k:e]] += c
    for piece in learnt:
        n = occurrences[not piece.startswith("##"), piece.removeprefix("##")]
        assert n >= config.min_frequency, (piece, n)
    # A high threshold stops merging early. By hand: a ##a ##a ##b (x5), a ##a ##b (x1): pairs
    # (a ##a)=6, (##a ##b)=6, (##a ##a)=5; the tie goes to the smaller string "##ab"; after it
    # every pair occurs at most 5 < 6 times.
    few = train_from_counts({"aaab": 5, "aab": 1}, VocabConfig(vocab_size=100, min_frequency=6))
    assert few == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "##a", "##b", "##ab"]


def test_small_merge_sequence_by_hand():
    # Words: "hug" x10, "hugs" x5, "pug" x5. Pairs: (##u,##g)=20, (h,##u)=15, (##g,##s)=5, (p,##u)=5.
    tokens = train_from_counts({"hug": 10, "hugs": 5, "pug": 5}, VocabConfig(vocab_size=100, min_frequency=1))
    specials, rest = tokens[:5], tokens[5:]
    assert specials == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    # Alphabet by frequency: g=20, u=20, h=15, p=5, s=5 (ties by code point), then the ## forms.
    assert rest[:10] == ["g", "u", "h", "p", "s", "##g", "##u", "##h", "##p", "##s"]
    # Merges: ##ug (20); then h ##ug = hug (15); then ##s joins hug (hug ##s = hugs, 5) and
    # p ##ug = pug (5): a tie broken by the merged string ("hugs" < "pug").
    assert rest[10:] == ["##ug", "hug", "hugs", "pug"]


@needs_data
def test_hf_encodes_learnt_vocab_identically(inaugural_vocab, tmp_path):
    import transformers
    tokens, config, _ = inaugural_vocab
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    ours = BertTokenizer.from_vocab_file(path)
    ref = transformers.BertTokenizerFast(vocab=str(path), do_lower_case=True)
    _, held = corpus_split()
    lines = [line for p in held for line, _ in iter_text_lines(p)][:3000]
    assert [ours.encode(t).input_ids for t in lines] == ref(lines)["input_ids"]


@needs_data
def test_held_out_unk_rate_and_pieces(inaugural_vocab):
    tokens, _, _ = inaugural_vocab
    tok = BertTokenizer(tokens)
    lines = [line for name in ("2005-Bush.txt", "1961-Kennedy.txt")
             for line, _ in iter_text_lines(CORPUS / "inaugural" / name)]
    stats = vocab_stats(tok, lines)
    assert stats["words"] > 3000
    assert stats["unk_rate"] < 0.02
    assert 1.0 < stats["pieces_per_word"] < 1.6
    # Only words with a character that training never saw become [UNK] (these files hold some
    # mis-encoded characters such as "\xa1").
    unk_words = {w for line in lines for w in tok.basic_tokenize(line) if tok.unk_token_id in tok._wordpiece(w)[0]}
    assert all(any(c not in tok.vocab for c in w) for w in unk_words), unk_words


def test_cased_and_accents(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("Café Café Résumé résumé NAÏVE naïve\n" * 5, encoding="utf-8")
    cased = train_vocab([text], VocabConfig(vocab_size=60, do_lower_case=False, min_frequency=1))
    assert "C" in cased and "##é" in cased
    keep = train_vocab([text], VocabConfig(vocab_size=60, strip_accents=False, min_frequency=1))
    assert "##é" in keep and "C" not in keep
    plain = train_vocab([text], VocabConfig(vocab_size=60, min_frequency=1))
    assert "##é" not in plain and "cafe" in plain


def test_latin1_files_are_counted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "latin.txt").write_bytes(b"caf\xe9 caf\xe9 caf\xe9\n")
    (tmp_path / "utf8.txt").write_text("café\n", encoding="utf-8")
    tokens = train_vocab([tmp_path], VocabConfig(vocab_size=40, min_frequency=1))
    assert "cafe" in tokens  # four occurrences, both encodings


def test_sampling_bounds_what_is_read(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("".join(f"word{k % 50} common\n" for k in range(2000)), encoding="utf-8")
    from bertctl.vocab import _pretokenizer, count_words

    config = VocabConfig(sample_bytes=2000, seed=1)
    counts = count_words([path], config, _pretokenizer(config))
    assert 100 < counts["common"] < 250  # about 2000 / 19 bytes per line ~ 105 lines of 2000, sampled
    config = VocabConfig(max_sentences=10)
    assert count_words([path], config, _pretokenizer(config))["common"] == 10
    config = VocabConfig(max_word_types=20)
    counts = count_words([path], config, _pretokenizer(config))
    assert len(counts) <= 21 and counts["common"] == 2000


def test_errors(tmp_path):
    with pytest.raises(BertctlError, match="nope: no such input file or folder"):
        train_vocab([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(BertctlError, match=r"no input files found in .*empty \(pattern '\*\.txt'\)"):
        train_vocab([tmp_path / "empty"])
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n")
    with pytest.raises(BertctlError, match="no words found"):
        train_vocab([blank])
    with pytest.raises(BertctlError, match="leaves no room"):
        train_from_counts({"a": 1}, VocabConfig(vocab_size=5))
