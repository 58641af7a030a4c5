"""Learn a BERT WordPiece vocabulary, or a SentencePiece model, from raw text.

Pre-tokenisation is bertctl's BERT basic tokenizer (``basic.py``: cleaning, lower-casing and accent
stripping, CJK and punctuation splitting), so training sees exactly the words that encoding will see. The
pieces are learnt as Hugging Face's ``WordPieceTrainer`` learns them (BPE over word counts with
``##`` continuation symbols; Sennrich et al., 2016): each word starts as ``c1 ##c2 ##c3 ...`` and
the most frequent adjacent pair is merged until the vocabulary is full or no pair occurs
``min_frequency`` times. Greedy longest-match WordPiece (Devlin et al., 2018, section 3) then
encodes with it.

Vocabulary layout (the bert-base layout): ``[PAD]``, ``[unused0]`` .. ``[unused{K-1}]``, ``[UNK]``,
``[CLS]``, ``[SEP]``, ``[MASK]``, then the alphabet (word-initial characters, then ``##``
characters), then the merged pieces in the order they were learnt. With K = 0 the five special
tokens are ids 0-4.

Inputs are read as ``build-data`` reads them (:mod:`bertctl.data.documents`): text files (``*.txt``
in folders), compressed or not (gzip, bzip2, xz, zstd), or stdin (``-``); ``format`` also takes the
documents of ``jsonl``, ``wikiextractor``, ``parquet`` and ``arrow`` inputs, paragraph by paragraph.

Memory stays bounded: files are streamed line by line; ``sample_bytes`` keeps a seeded random
sample of lines (each line with probability ``sample_bytes / total input bytes``; inputs whose size
the file system does not tell, compressed or columnar ones, are measured by one reading pass first),
``max_sentences`` stops after that many lines, and the word counter is pruned of its rarest words
whenever it holds more than ``max_word_types`` distinct words.

Speed: words are counted by ``workers`` processes, in batches of lines added up in input order (the
counts, so the vocabulary, do not depend on ``workers``); merging updates only the pairs beside each
merged pair, not every pair of the words it touches.
"""
from __future__ import annotations

import heapq
import os
import random
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from bertctl.errors import BertctlError
from bertctl.text.wordpiece import SPECIAL_TOKENS, BertTokenizer
from bertctl.workers import worker_pool

SPECIALS_AFTER_UNUSED = ("[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass
class VocabConfig:
    vocab_size: int = 30522  # tokens in the file, specials and [unusedN] included
    do_lower_case: bool = True
    strip_accents: bool | None = None  # None: follow do_lower_case, as BERT does
    tokenize_chinese_chars: bool = True
    min_frequency: int = 2  # a merge needs its pair to occur this often (weighted by word counts)
    limit_alphabet: int = 1000  # keep the most frequent characters; others become [UNK] at encode time
    reserved_unused: int = 0  # [unused0..K-1] slots after [PAD], for later task tokens
    sample_bytes: int | None = None  # read about this many bytes, a uniform random sample of lines
    max_sentences: int | None = None  # stop after this many lines (after sampling)
    max_word_types: int = 2_000_000  # distinct words held in memory before the rarest are pruned
    seed: int = 0  # seed of the line sampling
    format: str = "text"  # input format (bertctl.data.documents.FORMATS); text: every line of the files
    text_field: str = "text"  # jsonl, parquet, arrow: the field holding the text
    pattern: str | None = None  # in input folders (compressed names match too); None: the format's default
    character_coverage: float = 0.9995  # SentencePiece: share of characters kept; rarer ones are <unk>

    def to_dict(self) -> dict:
        return asdict(self)


def collect_files(inputs: Iterable[str | os.PathLike], config: VocabConfig | None = None) -> list[Path]:
    """Files named directly (``-``: stdin), plus the files under folders that match ``config.pattern``
    (default ``*.txt`` for text, the format's files otherwise; sorted, so runs are reproducible)."""
    from bertctl.data.documents import list_inputs

    config = config or VocabConfig()
    pattern = config.pattern or ("*.txt" if config.format in ("text", "lines") else "*")  # "*": *.parquet, *.arrow
    return list_inputs(list(inputs), pattern, config.format)


def iter_text_lines(path: str | os.PathLike) -> Iterator[tuple[str, int]]:
    """(line, bytes) of a text file, compressed or not, decoded as build-data decodes it (UTF-8, else
    cp1252, else ISO-8859-1; never skipped)."""
    from bertctl.data.documents import ReadStats, read_lines

    return read_lines([Path(path)], "text", ReadStats())


def sample_lines(files: Sequence[Path], config: VocabConfig, *, progress: bool = False,
                 description: str = "read lines", stats=None) -> Iterator[str]:
    """The non-blank lines of text of ``files`` in ``config.format``, streamed, sampled at
    ``config.sample_bytes`` and stopped at ``config.max_sentences`` (both with ``config.seed``). ``stats``
    (a ``bertctl.data.documents.ReadStats``) counts what was skipped or decoded otherwise, as build-data's."""
    from bertctl.data.documents import STDIN, ReadStats, known_text_bytes, read_lines
    from bertctl.progress import track

    stats = stats if stats is not None else ReadStats()

    def lines(into=stats) -> Iterator[tuple[str, int]]:
        return read_lines(files, config.format, into, text_field=config.text_field)

    total = known_text_bytes(files, config.format)
    if config.sample_bytes and total is None:  # compressed or columnar: one pass to size the input
        if any(str(f) == STDIN for f in files):
            raise BertctlError("--sample-bytes: stdin ('-') cannot be sized before it is read; "
                               "use --max-sentences instead")
        total = sum(size for _, size in lines(ReadStats()))  # a sizing pass: its skips are counted below
    rate = 1.0 if not config.sample_bytes or config.sample_bytes >= total else config.sample_bytes / total
    rng = random.Random(config.seed)
    taken = 0
    with track(description, total, disable=not progress) as advance:
        unshown = 0  # bytes read since the bar last moved (it moves every MiB: a call per line costs)
        for line, size in lines():
            unshown += size
            if unshown >= 1 << 20:
                advance(unshown)
                unshown = 0
            if rate < 1.0 and rng.random() >= rate or not line.strip():
                continue
            yield line
            taken += 1
            if config.max_sentences is not None and taken >= config.max_sentences:
                break
        advance(unshown)


def count_words(files: Sequence[Path], config: VocabConfig, tokenizer: BertTokenizer, progress: bool = False,
                *, workers: int = 1, stats=None) -> Counter:
    """Word counts after BERT basic tokenisation, streamed and (optionally) sampled.

    Lines are counted in batches (``BATCH_CHARS``), by ``workers`` processes when there are more than
    one, and the batches' counts are added in input order. A batch that would take the counter past
    ``max_word_types`` distinct words is added again line by line, pruning where counting one line
    at a time prunes: the counts do not depend on ``workers``.
    """
    if workers < 1:
        raise BertctlError(f"--workers: must be >= 1, got {workers}")
    counts: Counter = Counter()

    def add(lines: list[str], batch: Counter) -> None:
        if (len(counts) + len(batch) <= config.max_word_types
                or len(counts) + len(batch.keys() - counts.keys()) <= config.max_word_types):
            counts.update(batch)  # no line of the batch fills the counter: nothing is pruned
            return
        for line in lines:
            counts.update(tokenizer.basic_tokenize(line, keep_special_tokens=False))
            if len(counts) > config.max_word_types:
                _prune(counts, config.max_word_types // 2)

    pool = None
    if workers > 1:  # fork before the progress bar starts its thread
        pool = worker_pool(workers, _init_counter, (tokenizer,))
    try:
        in_flight: deque = deque()  # (lines, their pending counts), oldest first
        for lines in _batches(sample_lines(files, config, progress=progress, description="count words", stats=stats)):
            if pool is None:
                add(lines, _count_lines(tokenizer, lines))
                continue
            in_flight.append((lines, pool.apply_async(_count_in_worker, (lines,))))
            while len(in_flight) >= 2 * workers:
                lines, pending = in_flight.popleft()
                add(lines, pool.wait(pending))
        while in_flight:
            lines, pending = in_flight.popleft()
            add(lines, pool.wait(pending))
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return counts


BATCH_CHARS = 1 << 20  # characters of text counted at once (in one worker process)


def _batches(lines: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for line in lines:
        batch.append(line)
        size += len(line)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _count_lines(tokenizer: BertTokenizer, lines: list[str]) -> Counter:
    return Counter(chain.from_iterable(tokenizer.basic_tokenize(line, keep_special_tokens=False) for line in lines))


_counter_tokenizer: BertTokenizer | None = None  # a worker process's pre-tokenizer


def _init_counter(tokenizer: BertTokenizer) -> None:
    global _counter_tokenizer
    _counter_tokenizer = tokenizer


def _count_in_worker(lines: list[str]) -> Counter:
    return _count_lines(_counter_tokenizer, lines)


def _prune(counts: Counter, keep: int) -> None:
    """Drop the rarest words so that at most ``keep`` remain (ties dropped together)."""
    threshold = sorted(counts.values(), reverse=True)[keep]
    for word in [w for w, c in counts.items() if c <= threshold]:
        del counts[word]


def train_vocab(
    files: Iterable[str | os.PathLike],
    config: VocabConfig | None = None,
    *,
    progress: bool = False,
    workers: int = 1,
    stats=None,
) -> list[str]:
    """Learn a WordPiece vocabulary from text files or folders; returns the tokens in id order.

    ``workers``: processes counting words (the vocabulary does not depend on it); ``stats``: see ``sample_lines``.
    """
    config = config or VocabConfig()
    paths = collect_files(files, config)
    tokenizer = _pretokenizer(config)
    counts = count_words(paths, config, tokenizer, progress=progress, workers=workers, stats=stats)
    if not counts:
        raise BertctlError(f"no words found in {len(paths)} input file(s) ({paths[0]}{', ...' if len(paths) > 1 else ''})")
    return train_from_counts(counts, config, progress=progress)


def _pretokenizer(config: VocabConfig) -> BertTokenizer:
    """A tokenizer whose basic (pre-)tokenisation follows the config; its vocabulary is irrelevant."""
    return BertTokenizer(list(SPECIAL_TOKENS.values()), do_lower_case=config.do_lower_case,
                         strip_accents=config.strip_accents, tokenize_chinese_chars=config.tokenize_chinese_chars)


def special_tokens(reserved_unused: int) -> list[str]:
    return ["[PAD]", *(f"[unused{k}]" for k in range(reserved_unused)), *SPECIALS_AFTER_UNUSED]


def train_from_counts(counts: dict[str, int], config: VocabConfig, *, progress: bool = False) -> list[str]:
    """BPE merges with ``##`` continuations over word counts (the WordPieceTrainer algorithm)."""
    from bertctl.progress import track

    head = special_tokens(config.reserved_unused)
    if config.vocab_size < len(head) + 1:
        raise BertctlError(f"--vocab-size {config.vocab_size} leaves no room after {len(head)} special tokens")
    pretok = _pretokenizer(config)

    # Alphabet: the most frequent characters (ties by code point, for determinism). The words of
    # one count are counted as one string, so Python loops over counts, not over characters.
    by_count: dict[int, list[str]] = {}
    for word, n in counts.items():
        by_count.setdefault(n, []).append(word)
    char_counts: Counter = Counter()
    for n, group in by_count.items():
        for c, k in Counter("".join(group)).items():
            char_counts[c] += k * n
    alphabet = sorted(char_counts, key=lambda c: (-char_counts[c], c))[: config.limit_alphabet]
    # Punctuation and CJK ideographs are always one-character words, so they never need "##".
    lone = {c for c in alphabet if pretok.basic.normalize_char(c)[0] in ("p", "c")}
    initial = [c for c in alphabet]
    continuing = ["##" + c for c in alphabet if c not in lone]
    room = config.vocab_size - len(head)
    if len(initial) + len(continuing) > room:
        # A small vocabulary keeps the most frequent characters (both forms) that fit.
        keep = sorted(alphabet[:room], key=lambda c: (-char_counts[c], c))
        while len(keep) + sum(c not in lone for c in keep) > room:
            keep.pop()
        initial = keep
        continuing = ["##" + c for c in keep if c not in lone]
    symbols: list[str] = initial + continuing
    ids = {s: k for k, s in enumerate(symbols)}

    # Words as symbol-id lists (a character starts a word, ##character continues one); characters
    # outside the alphabet split a word (their pieces would straddle an [UNK] at encode time anyway).
    # Word order does not matter: every choice below depends on counts and strings only.
    inside = {s[2:]: k for s, k in ids.items() if s.startswith("##")}
    words: list[list[int]] = []
    freqs: list[int] = []
    for word, n in counts.items():
        if len(word) < 2:
            continue
        syms = [ids.get(word[0]), *map(inside.get, word[1:])]
        for part in _split_at_none(syms) if None in syms else (syms,):
            if len(part) > 1:
                words.append(part)
                freqs.append(n)

    # Pair statistics: count (weighted) and the words where each pair occurs. ``where`` may list a
    # word that no longer holds the pair (a merge does not look for other copies before unlisting
    # it); merging checks each word, so only ``pair_count`` has to be exact.
    pair_count: dict[tuple[int, int], int] = {}
    where: defaultdict[tuple[int, int], list[int]] = defaultdict(list)
    for w, (syms, n) in enumerate(zip(words, freqs)):
        for pair in zip(syms, syms[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + n
            where[pair].append(w)
    # Max-heap with lazy invalidation: an entry is live when its count equals the current one, and
    # every pair has a live entry. Ties break on the merged string, so the result does not depend
    # on dict order.
    heap = [(-c, symbols[a] + symbols[b][2:], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    target = room - len(symbols)
    merges = 0
    with track("learn pieces", target, disable=not progress) as advance:
        while merges < target and heap:
            neg, merged, a, b = heapq.heappop(heap)
            if pair_count.get((a, b), 0) != -neg:
                continue
            if -neg < config.min_frequency:
                break
            new = ids.get(merged)  # two pairs can spell the same piece: ##ab ##c, ##a ##bc
            if new is None:
                new = len(symbols)
                symbols.append(merged)
                ids[merged] = new
                merges += 1
                advance(1)
            # Replace each a b, left to right, by the new symbol; only the pairs beside it change:
            # x a b y loses (x, a) and (b, y) and gains (x, new) and (new, y), each by the word's count.
            before: defaultdict[int, int] = defaultdict(int)  # x -> weighted count of x a b
            after: defaultdict[int, int] = defaultdict(int)  # y -> weighted count of a b y
            before_in: defaultdict[int, list[int]] = defaultdict(list)  # x -> words with x a b
            after_in: defaultdict[int, list[int]] = defaultdict(list)
            for w in where.pop((a, b)):
                syms, n = words[w], freqs[w]
                left = syms.count(a)  # copies of a still to look at (no exceptions from index)
                k = -1
                while left:
                    k = syms.index(a, k + 1)
                    left -= 1
                    if k + 1 == len(syms) or syms[k + 1] != b:
                        continue
                    left -= a == b  # the b merged is one of them
                    if k:
                        x = syms[k - 1]
                        before[x] += n
                        before_in[x].append(w)
                    if k + 2 < len(syms):
                        y = syms[k + 2]
                        after[y] += n
                        after_in[y].append(w)
                    syms[k : k + 2] = (new,)
            del pair_count[a, b]  # every a b is merged (with a == b, a neighbour (a, a) went too)
            delta: defaultdict[tuple[int, int], int] = defaultdict(int)
            for x, c in before.items():
                delta[x, a] -= c
                delta[x, new] += c
                where[x, new] += before_in[x]
            for y, c in after.items():
                delta[b, y] -= c
                delta[new, y] += c
                where[new, y] += after_in[y]
            delta.pop((a, b), None)
            for pair, d in delta.items():
                if not d:
                    continue
                c = pair_count.get(pair, 0) + d
                if c > 0:
                    pair_count[pair] = c
                    heapq.heappush(heap, (-c, symbols[pair[0]] + symbols[pair[1]][2:], pair[0], pair[1]))
                else:
                    del pair_count[pair]
                    where.pop(pair, None)
    return head + symbols


def _split_at_none(syms: list[int | None]) -> Iterator[list[int]]:
    """The runs of ids between the Nones (empty runs included)."""
    part: list[int] = []
    for s in syms:
        if s is None:
            yield part
            part = []
        else:
            part.append(s)
    yield part


# ---------------------------------------------------------------------- SentencePiece models
ALGORITHMS = ("wordpiece", "unigram", "bpe")
# BERT's specials inside a trained SentencePiece model, in ALBERT's spiece.model layout: <pad> 0,
# <unk> 1, then control symbols (never produced from text, like BERT's specials) [CLS] 2, [SEP] 3,
# [MASK] 4, and [unused0..K-1]; no <s> or </s>. bertctl's SentencePieceTokenizer finds them by name.
SPM_CONTROL_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")
SPM_MAX_LINE_BYTES = 1 << 16  # the trainer skips longer lines (its default, 4,192 bytes, drops paragraphs)


def train_sentencepiece(
    files: Iterable[str | os.PathLike],
    config: VocabConfig | None = None,
    algorithm: str = "unigram",
    *,
    progress: bool = False,
    stats=None,
) -> bytes:
    """Train a SentencePiece model with sentencepiece's own trainer; returns the ``.model`` file's bytes.

    ``algorithm``: "unigram" (Kudo, 2018; ALBERT's) or "bpe" (Sennrich et al., 2016). Lines are read
    and sampled as for WordPiece (``sample_lines``). ``do_lower_case`` selects the ``nmt_nfkc_cf``
    normalisation (NFKC and case folding) inside the model, otherwise ``nmt_nfkc``: the model file
    then carries its casing, and encoding needs no setting. ``vocab_size`` counts every piece,
    specials included. Options that shape WordPiece only (strip_accents, tokenize_chinese_chars,
    min_frequency, limit_alphabet) do not apply.
    """
    import io

    from bertctl.text.sentencepiece import sentencepiece_module

    config = config or VocabConfig()
    if algorithm not in ("unigram", "bpe"):
        raise BertctlError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    paths = collect_files(files, config)
    lines = 0

    def sentences() -> Iterator[str]:
        nonlocal lines
        for line in sample_lines(paths, config, progress=progress, stats=stats):
            line = line.strip()
            if line:
                lines += 1
                yield line

    control = [*SPM_CONTROL_SYMBOLS, *(f"[unused{k}]" for k in range(config.reserved_unused))]
    model = io.BytesIO()
    try:
        sentencepiece_module().SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=model, model_type=algorithm, vocab_size=config.vocab_size,
            pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, control_symbols=control,
            normalization_rule_name="nmt_nfkc_cf" if config.do_lower_case else "nmt_nfkc",
            character_coverage=config.character_coverage,
            max_sentence_length=SPM_MAX_LINE_BYTES, num_threads=max(1, min(16, os.cpu_count() or 1)),
            minloglevel=2)
    except RuntimeError as e:  # e.g. "Vocabulary size is too high (30522). Please set it to a value <= 8103."
        message = str(e).strip().splitlines()[-1].split("] ", 1)[-1] if str(e).strip() else "failed"
        raise BertctlError(f"sentencepiece trainer ({algorithm}, --vocab-size {config.vocab_size}, {lines} lines): "
                           f"{message}") from None
    if not lines:
        raise BertctlError(f"no text found in {len(paths)} input file(s) ({paths[0]}{', ...' if len(paths) > 1 else ''})")
    return model.getvalue()


def write_vocab(tokens: Sequence[str], path: str | os.PathLike) -> None:
    """Write a ``vocab.txt`` atomically (one token per line, UTF-8, ``\\n`` line ends)."""
    from bertctl.io import atomic_open

    with atomic_open(path, "w", encoding="utf-8", newline="\n") as f:
        for tok in tokens:
            f.write(tok + "\n")


def vocab_stats(tokenizer: BertTokenizer, lines: Iterable[str]) -> dict:
    """[UNK] rate (per token and per word) and mean pieces per word on some text."""
    words = pieces = unk = unk_words = 0
    for line in lines:
        for word in tokenizer.basic_tokenize(line, keep_special_tokens=False):
            ids = tokenizer._wordpiece(word)[0]
            words += 1
            pieces += len(ids)
            if tokenizer.unk_token_id in ids:
                unk += ids.count(tokenizer.unk_token_id)
                unk_words += 1
    return {
        "words": words,
        "pieces": pieces,
        "pieces_per_word": pieces / max(words, 1),
        "unk_rate": unk / max(pieces, 1),
        "unk_word_rate": unk_words / max(words, 1),
    }
