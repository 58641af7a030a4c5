"""WordPiece vocabulary training: layout, size, determinism, min-frequency, and held-out quality.

Independent references: Hugging Face's BertTokenizerFast encodes with the learnt vocabulary exactly
as bertctl does, word counts are recounted here with plain string operations, and the held-out
[UNK] rate is measured on corpus files that training never saw.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pytest

from bertctl.errors import BertctlError
from bertctl.text.vocab_training import VocabConfig, iter_text_lines, train_from_counts, train_vocab, vocab_stats
from bertctl.text.wordpiece import BertTokenizer

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


RECORDED = Path(__file__).resolve().parents[1] / "data" / "vocab-corpus-3000.txt"


@needs_data
def test_vocabulary_equals_the_recorded_one():
    # Recorded with the code of e62ef29 (one process, every pair of a merged word recounted) from
    # all 132 corpus files; limit_alphabet=45 leaves out digits and letters found inside words
    # (4, 6, 7, 8, æ), so some words are split where they stand.
    config = VocabConfig(vocab_size=3000, reserved_unused=2, limit_alphabet=45)
    expected = RECORDED.read_text(encoding="utf-8").splitlines()
    tokens = train_vocab([CORPUS], config, workers=2)
    assert len(tokens) == len(expected) == 3000
    first = next((k for k, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    assert first is None, f"token {first}: {tokens[first]!r}, recorded {expected[first]!r}"


@needs_data
def test_word_counts_do_not_depend_on_workers_or_batches(monkeypatch):
    """Counting in batches, in 1 to 3 processes, gives the counts of counting one line at a time,
    pruning included (max_word_types is small, so the counter is pruned inside batches)."""
    from bertctl.text import vocab_training as vocab

    files = sorted((CORPUS / "inaugural").glob("*.txt"))
    config = VocabConfig(max_word_types=3000)
    tok = vocab._pretokenizer(config)
    reference: Counter = Counter()
    prunes = 0
    for path in files:
        for line, _ in iter_text_lines(path):
            if not line.strip():
                continue
            reference.update(tok.basic_tokenize(line, keep_special_tokens=False))
            if len(reference) > config.max_word_types:  # keep the 1,500 most frequent (ties dropped together)
                threshold = sorted(reference.values(), reverse=True)[config.max_word_types // 2]
                reference = Counter({w: c for w, c in reference.items() if c > threshold})
                prunes += 1
    assert prunes >= 5
    monkeypatch.setattr(vocab, "BATCH_CHARS", 5000)  # about 170 batches
    for workers in (1, 2, 3):
        counts = vocab.count_words(files, config, tok, workers=workers)
        assert counts == reference, workers


def _recount_reference(counts: dict[str, int], vocab_size: int, min_frequency: int) -> list[str]:
    """WordPiece training as its definition reads, recounting every pair at every step: the most
    frequent pair (ties: the smaller merged string, then the smaller symbol ids) is merged left to
    right in every word. Words of letters only (no character stands alone; the alphabet fits)."""
    chars: Counter = Counter()
    for word, n in counts.items():
        for c in word:
            chars[c] += n
    alphabet = sorted(chars, key=lambda c: (-chars[c], c))
    symbols = alphabet + ["##" + c for c in alphabet]
    words = {word: [word[0]] + ["##" + c for c in word[1:]] for word in counts}
    while len(symbols) < vocab_size - 5:
        pairs: Counter = Counter()
        for word, syms in words.items():
            for pair in zip(syms, syms[1:]):
                pairs[pair] += counts[word]
        if not pairs:
            break
        (x, y), n = min(pairs.items(), key=lambda p: (-p[1], p[0][0] + p[0][1][2:], symbols.index(p[0][0]),
                                                       symbols.index(p[0][1])))
        if n < min_frequency:
            break
        merged = x + y[2:]
        if merged not in symbols:  # ##ab ##c and ##a ##bc spell the same piece
            symbols.append(merged)
        for word, syms in words.items():
            out, k = [], 0
            while k < len(syms):
                if syms[k : k + 2] == [x, y]:
                    out.append(merged)
                    k += 2
                else:
                    out.append(syms[k])
                    k += 1
            words[word] = out
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *symbols]


def test_merges_equal_a_recount_at_every_step():
    # Words over two or three letters repeat pairs inside a word (a ##a ##a), tie often, and spell
    # one piece from different pairs: the cases where updating only the pairs beside a merge could
    # go wrong.
    rng = random.Random(0)
    for case in range(300):
        letters = "ab" if case % 2 else "abc"
        counts = {"".join(rng.choices(letters, k=rng.randint(1, 8))): rng.randint(1, 6) for _ in range(rng.randint(1, 12))}
        vocab_size, min_frequency = rng.randint(12, 60), rng.randint(1, 3)
        config = VocabConfig(vocab_size=vocab_size, min_frequency=min_frequency)
        assert train_from_counts(counts, config) == _recount_reference(counts, vocab_size, min_frequency), counts


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
    from bertctl.text.vocab_training import _pretokenizer, count_words

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
