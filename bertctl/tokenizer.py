"""BERT's tokenizer: basic tokenizer + greedy WordPiece (Devlin et al., 2018, section 3 and appendix A.2).

The pipeline is the one of google-research/bert's ``FullTokenizer`` as Hugging Face's fast
``BertTokenizerFast`` (the ``tokenizers`` library) implements it, and ids *and* character offsets
equal that implementation's:

1. special tokens (``[CLS] [SEP] [PAD] [MASK] [UNK]``) written in the raw text stay whole;
2. text cleaning: NUL, U+FFFD and control, format and private-use characters are dropped, every
   other white space character becomes a word boundary;
3. CJK ideographs become single-character words;
4. accent stripping (NFD, then drop the non-spacing marks, category Mn) and lower-casing; accents are
   stripped when ``strip_accents`` is True, or when it is None and ``do_lower_case`` is True;
5. words are split at white space and around every punctuation character (ASCII 33-47, 58-64,
   91-96, 123-126 and Unicode P*), each punctuation character its own word;
6. each word becomes the longest vocabulary prefix, then ``##``-continuations, greedily; a word that
   cannot be covered, or is longer than 100 characters, becomes one ``[UNK]``.

Speed: text is cut at ASCII white space into chunks, and each distinct chunk's (ids, offsets) is
computed once and cached (natural text repeats chunks such as ``the`` or ``said,`` heavily), so the
per-chunk cost of the full Unicode pipeline is paid only on the first occurrence.

Character classes, non-spacing marks and lower-case mappings come from tables generated from
``tokenizers`` itself (``bertctl/_wordpiece_tables.py``, by ``python -m bertctl._wordpiece_gen``):
its Unicode data differ from Python's ``unicodedata`` (older categories, so e.g. characters
assigned since are kept as letters; newer case mappings), and only its own tables give identical
results on every code point. Offsets follow its alignment rules, including the re-ordering of
combining marks by NFD.

``SentencePieceTokenizer`` puts a SentencePiece model (ALBERT's ``spiece.model``, or one trained by
``bertctl tokenize train --algorithm unigram|bpe``) behind the same interface (``Tokenizer``);
``load_tokenizer`` picks the class from what a file or directory holds.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from bertctl import _wordpiece_tables as _tables
from bertctl.errors import BertctlError

SPECIAL_TOKENS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
MAX_INPUT_CHARS_PER_WORD = 100  # longer words become [UNK] (google-research/bert, WordpieceTokenizer)
TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second")

# ASCII punctuation as BERT defines it (33-47, 58-64, 91-96, 123-126), as a regex class.
_ASCII_PUNCT = r"!-/:-@\[-`{-~"
# An ASCII chunk without control characters splits into words with one regex.
_ASCII_WORD = re.compile(rf"[^{_ASCII_PUNCT}]+|[{_ASCII_PUNCT}]")
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Chunks are cut at ASCII white space only: other white space (and characters Python treats as
# white space but BERT drops as control characters, e.g. U+0085) is handled inside a chunk.
_CHUNK = re.compile(r"[^ \t\n\r]+")
_CACHE_LIMIT = 1 << 18  # entries per cache (~50-100 MB at most); a full cache is cleared


def _table_lookup(starts: list[int], runs: list[tuple], cp: int):
    k = bisect.bisect_right(starts, cp) - 1
    if k >= 0 and runs[k][0] <= cp <= runs[k][1]:
        return runs[k]
    return None


_CLASS_STARTS = [r[0] for r in _tables.CLASS_RUNS]
_MARK_STARTS = [r[0] for r in _tables.MARK_RUNS]


def _char_class(c: str) -> str:
    """'x' dropped by cleaning, ' ' white space, 'p' punctuation, 'c' CJK ideograph, 'w' other."""
    run = _table_lookup(_CLASS_STARTS, _tables.CLASS_RUNS, ord(c))
    return run[2] if run else "w"


def _is_mark(c: str) -> bool:
    """Non-spacing mark (Mn) as ``tokenizers`` sees it: removed by accent stripping."""
    return _table_lookup(_MARK_STARTS, _tables.MARK_RUNS, ord(c)) is not None


def _nfd(c: str) -> str:
    """Canonical decomposition; only Hangul syllables (algorithmic, stable) come from unicodedata."""
    cp = ord(c)
    if 0xAC00 <= cp <= 0xD7A3:
        return unicodedata.normalize("NFD", c)
    return _tables.NFD.get(cp, c)


def _combining(c: str) -> int:
    return _tables.CCC.get(ord(c), 0)


def _lower(c: str) -> str:
    return _tables.LOWER.get(ord(c), c)


@dataclass
class Encoding:
    """One encoded text or pair: lists of equal length (the padded length when padded)."""

    input_ids: list[int]
    token_type_ids: list[int]
    attention_mask: list[int]
    offsets: list[tuple[int, int]] | None = None  # (start, end) chars into the original text; (0, 0) for specials/padding
    sequence_ids: list[int | None] = field(default_factory=list)  # None for specials/padding, 0 text, 1 pair

    def __len__(self) -> int:
        return len(self.input_ids)


class Tokenizer:
    """What every bertctl tokenizer offers; the rest of bertctl uses only this interface.

    A tokenizer has ``ids_to_tokens`` (tokens in id order), ``vocab`` (token -> id), the special ids
    ``cls_token_id``, ``sep_token_id``, ``pad_token_id``, ``mask_token_id``, ``unk_token_id`` and
    ``all_special_ids``, ``model_max_length`` and ``continues_word``; it implements
    ``_encode_text`` (ids and offsets of one text), ``decode``, ``config`` and ``save_pretrained``.
    Inputs are laid out as BERT's for every tokenizer: ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]``
    with segment ids 0 and 1 (section 3). ``load_tokenizer`` picks the class from what a path holds.
    """

    kind = ""  # "wordpiece" | "sentencepiece": stored in data manifests and tokenizer configs

    def _encode_text(self, text: str, with_offsets: bool) -> tuple[list[int], list[tuple[int, int]] | None]:
        """ids (and character offsets into ``text``) of one text, without special tokens."""
        raise NotImplementedError

    @property
    def continues_word(self) -> tuple[bool, ...]:
        """Per id: True when the token continues the word of the token before it (whole-word masking)."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        return len(self.ids_to_tokens)

    def __len__(self) -> int:
        return self.vocab_size


    # ------------------------------------------------------------------ public token API
    def tokenize(self, text: str) -> list[str]:
        """Tokens of ``text`` (no [CLS]/[SEP])."""
        ids, _ = self._encode_text(text, False)
        return self.convert_ids_to_tokens(ids)

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` (no [CLS]/[SEP])."""
        return self._encode_text(text, False)[0]

    def tokenize_with_offsets(self, text: str) -> tuple[list[str], list[tuple[int, int]]]:
        """Tokens and their (start, end) character offsets into ``text``."""
        ids, offsets = self._encode_text(text, True)
        return self.convert_ids_to_tokens(ids), offsets

    def tokenize_words(self, words: Sequence[str]) -> tuple[list[str], list[int]]:
        """Tokens of pre-split words (e.g. CoNLL columns) and the word index of each token.

        Each word is tokenised on its own, as Hugging Face does with ``is_split_into_words=True``:
        WordPiece still runs the basic tokenizer on it (``U.S.`` gives four tokens), SentencePiece
        gives each word its own ``▁`` start.
        """
        tokens: list[str] = []
        word_index: list[int] = []
        for k, word in enumerate(words):
            ids, _ = self._encode_text(word, False)
            tokens.extend(self.convert_ids_to_tokens(ids))
            word_index.extend([k] * len(ids))
        return tokens, word_index

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]):
        if isinstance(tokens, str):
            return self.vocab.get(tokens, self.unk_token_id)
        return [self.vocab.get(t, self.unk_token_id) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]):
        table = self.ids_to_tokens
        if isinstance(ids, int):
            ids = [ids]
            single = True
        else:
            ids = list(ids)
            single = False
        if ids and (min(ids) < 0 or max(ids) >= len(table)):
            bad = next(i for i in ids if not 0 <= i < len(table))
            raise BertctlError(f"token id {bad} is outside the vocabulary (size {len(table)})")
        tokens = [table[i] for i in ids]
        return tokens[0] if single else tokens

    # ------------------------------------------------------------------ encode / decode
    def encode(
        self,
        text: str,
        pair: str | None = None,
        *,
        max_length: int | None = None,
        truncation: str | bool | None = "longest_first",
        padding: bool | str = False,
        return_offsets: bool = False,
    ) -> Encoding:
        """``[CLS] text [SEP]`` or ``[CLS] text [SEP] pair [SEP]`` with segment ids (BERT section 3).

        ``max_length`` (tokens, specials included) applies only when given: ``truncation`` is
        "longest_first" (drop from the longer sequence, as Hugging Face does), "only_first",
        "only_second", or False/None (no truncation). ``padding``: False, True / "longest" (no-op for
        one text, as in Hugging Face), "max_length" (pad to ``max_length``).
        """
        a, a_off = self._encode_text(text, return_offsets)
        b, b_off = (None, None) if pair is None else self._encode_text(pair, return_offsets)
        return self._build(a, a_off, b, b_off, max_length, truncation, padding, return_offsets)

    def _build(self, a, a_off, b, b_off, max_length, truncation, padding, return_offsets) -> Encoding:
        if max_length is not None and truncation not in (False, None, "do_not_truncate"):
            if truncation is True:
                truncation = "longest_first"
            n_a, n_b = truncated_lengths(len(a), None if b is None else len(b), max_length, truncation)
            a = a[:n_a]
            a_off = a_off[:n_a] if a_off is not None else None
            if b is not None:
                b = b[:n_b]
                b_off = b_off[:n_b] if b_off is not None else None
        cls, sep = self.cls_token_id, self.sep_token_id
        ids = [cls, *a, sep]
        types = [0] * (len(a) + 2)
        seq: list[int | None] = [None, *([0] * len(a)), None]
        if b is not None:
            ids += [*b, sep]
            types += [1] * (len(b) + 1)
            seq += [*([1] * len(b)), None]
        offsets = None
        if return_offsets:
            offsets = [(0, 0), *a_off, (0, 0)]
            if b is not None:
                offsets += [*b_off, (0, 0)]
        mask = [1] * len(ids)
        if padding == "max_length" and max_length is not None and len(ids) < max_length:
            n = max_length - len(ids)
            ids += [self.pad_token_id] * n
            types += [0] * n
            mask += [0] * n
            seq += [None] * n
            if offsets is not None:
                offsets += [(0, 0)] * n
        return Encoding(ids, types, mask, offsets, seq)

    def encode_batch(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        *,
        max_length: int | None = None,
        truncation: str | bool | None = "longest_first",
        padding: bool | str = "longest",
    ) -> dict:
        """Encode many texts (and pairs) into right-padded ``(B, S)`` int64 tensors.

        Returns ``input_ids``, ``token_type_ids``, ``attention_mask``. ``padding="longest"`` pads
        to the longest row, ``"max_length"`` to ``max_length``.
        """
        import numpy as np
        import torch

        if pairs is not None and len(pairs) != len(texts):
            raise BertctlError(f"{len(texts)} texts but {len(pairs)} pairs")
        encs = [
            self._build(
                self._encode_text(t, False)[0], None,
                None if pairs is None else self._encode_text(pairs[k], False)[0], None,
                max_length, truncation, False, False,
            )
            for k, t in enumerate(texts)
        ]
        width = max((len(e) for e in encs), default=0)
        if padding == "max_length" and max_length is not None:
            width = max(width, max_length)
        # Scatter the concatenated rows into (B, S) arrays through the attention mask: one numpy
        # operation per field instead of a tensor construction per row.
        lengths = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
        mask = np.arange(width)[None, :] < lengths[:, None]  # (B, S) bool
        ids = np.full((len(encs), width), self.pad_token_id, dtype=np.int64)
        ids[mask] = np.fromiter(itertools.chain.from_iterable(e.input_ids for e in encs), dtype=np.int64)
        types = np.zeros((len(encs), width), dtype=np.int64)
        types[mask] = np.fromiter(itertools.chain.from_iterable(e.token_type_ids for e in encs), dtype=np.int64)
        ids, types, mask = (torch.from_numpy(x) for x in (ids, types, mask.astype(np.int64)))
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


class BertTokenizer(Tokenizer):
    """BERT WordPiece tokenizer; ids and offsets equal Hugging Face's ``BertTokenizerFast``.

    ``vocab`` is the token list in id order (a ``vocab.txt``); it must contain the five special
    tokens. ``strip_accents=None`` follows ``do_lower_case``, as in BERT and Hugging Face.
    """

    kind = "wordpiece"

    def __init__(
        self,
        vocab: list[str],
        do_lower_case: bool = True,
        strip_accents: bool | None = None,
        tokenize_chinese_chars: bool = True,
        model_max_length: int = 512,
    ):
        if not vocab:
            raise BertctlError("vocabulary is empty")
        self.ids_to_tokens: list[str] = list(vocab)
        # A token listed twice maps to its last line, as Hugging Face's vocab loader does.
        self.vocab: dict[str, int] = {tok: i for i, tok in enumerate(self.ids_to_tokens)}
        missing = [t for t in SPECIAL_TOKENS.values() if t not in self.vocab]
        if missing:
            raise BertctlError(f"vocabulary lacks the special token(s) {' '.join(missing)}")
        self.do_lower_case = bool(do_lower_case)
        self.strip_accents = strip_accents
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        self.model_max_length = int(model_max_length)
        self._strip = self.do_lower_case if strip_accents is None else bool(strip_accents)
        self.pad_token_id = self.vocab["[PAD]"]
        self.unk_token_id = self.vocab["[UNK]"]
        self.cls_token_id = self.vocab["[CLS]"]
        self.sep_token_id = self.vocab["[SEP]"]
        self.mask_token_id = self.vocab["[MASK]"]
        self.all_special_ids = frozenset(self.vocab[t] for t in SPECIAL_TOKENS.values())
        # Special tokens in raw text are matched before any normalisation, longest first.
        specials = sorted(SPECIAL_TOKENS.values(), key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in specials))
        self._chunk_cache: dict[str, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
        self._word_cache: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._char_cache: dict[str, tuple[str, str]] = {}
        self._basic_cache: dict[str, tuple[str, ...]] = {}
        self._special_words = frozenset(SPECIAL_TOKENS.values())
        self._continues: tuple[bool, ...] | None = None

    def __getstate__(self) -> dict:
        # Caches are rebuilt on demand: a tokenizer sent to worker processes pickles small.
        state = dict(self.__dict__)
        for key in ("_chunk_cache", "_word_cache", "_char_cache", "_basic_cache"):
            state[key] = {}
        return state

    # ------------------------------------------------------------------ construction / files
    @property
    def continues_word(self) -> tuple[bool, ...]:
        """``##`` pieces continue a word."""
        if self._continues is None:
            self._continues = tuple(t.startswith("##") for t in self.ids_to_tokens)
        return self._continues

    @classmethod
    def from_vocab_file(cls, path: str | os.PathLike, do_lower_case: bool = True, **kw) -> "BertTokenizer":
        """Load a ``vocab.txt`` (one token per line, id = line number - 1)."""
        return cls(read_vocab(path), do_lower_case=do_lower_case, **_checked_kwargs(path, kw))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "BertTokenizer":
        """Load a tokenizer directory as ``transformers`` does.

        ``tokenizer.json`` (what ``transformers`` 5 writes) wins when present: vocabulary and
        normaliser settings come from it. Otherwise ``vocab.txt`` with the settings of
        ``tokenizer_config.json`` (do_lower_case, strip_accents, tokenize_chinese_chars; defaults
        as BERT: lower-cased). ``model_max_length`` comes from ``tokenizer_config.json``.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise BertctlError(f"{directory}: no such model directory")
        config_path = directory / "tokenizer_config.json"
        kw: dict = {}
        if config_path.is_file():
            config = _read_json(config_path)
            for key in ("do_lower_case", "strip_accents", "tokenize_chinese_chars"):
                if key in config:
                    kw[key] = config[key]
            max_len = config.get("model_max_length")
            # Hugging Face writes a huge sentinel (int(1e30)) for "no limit": keep BERT's 512 then.
            if isinstance(max_len, int) and 0 < max_len < 1_000_000:
                kw["model_max_length"] = max_len
        kw = _checked_kwargs(config_path, kw)
        json_path = directory / "tokenizer.json"
        if json_path.is_file():
            vocab, settings = _read_tokenizer_json(json_path)
            kw.update(settings)
            return cls(vocab, **kw)
        vocab_path = directory / "vocab.txt"
        if not vocab_path.is_file():
            raise BertctlError(f"{vocab_path}: missing (a tokenizer directory needs vocab.txt or tokenizer.json)")
        return cls(read_vocab(vocab_path), **kw)

    def save_pretrained(self, directory: str | os.PathLike) -> list[str]:
        """Write ``vocab.txt``, ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

        The directory loads in ``transformers`` (``AutoTokenizer`` / ``BertTokenizerFast``) and in
        ``tokenizers`` with the same ids. Files are written atomically; other files are kept.
        Returns the names of the files written.
        """
        from bertctl.io import atomic_open, write_json

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_open(directory / "vocab.txt", "w", encoding="utf-8", newline="\n") as f:
            for tok in self.ids_to_tokens:
                f.write(tok + "\n")
        with atomic_open(directory / "tokenizer.json", "w", encoding="utf-8") as f:
            json.dump(self.tokenizer_json(), f, ensure_ascii=False, indent=2)
            f.write("\n")
        write_json(directory / "tokenizer_config.json", self.config())
        write_json(directory / "special_tokens_map.json", dict(SPECIAL_TOKENS))
        return ["vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]

    def tokenizer_json(self) -> dict:
        """The ``tokenizers`` serialisation of this tokenizer (BertNormalizer, BertPreTokenizer, WordPiece)."""
        def special(tok: str) -> dict:
            return {"id": self.vocab[tok], "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                    "normalized": False, "special": True}

        cls_, sep = {"id": "[CLS]", "type_id": 0}, {"id": "[SEP]", "type_id": 0}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": sorted((special(t) for t in SPECIAL_TOKENS.values()), key=lambda d: d["id"]),
            "normalizer": {"type": "BertNormalizer", "clean_text": True,
                           "handle_chinese_chars": self.tokenize_chinese_chars,
                           "strip_accents": self.strip_accents, "lowercase": self.do_lower_case},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": cls_}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": sep}],
                "pair": [{"SpecialToken": cls_}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": sep},
                         {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
                "special_tokens": {t: {"id": t, "ids": [self.vocab[t]], "tokens": [t]} for t in ("[CLS]", "[SEP]")},
            },
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "max_input_chars_per_word": MAX_INPUT_CHARS_PER_WORD, "vocab": dict(self.vocab)},
        }

    def config(self) -> dict:
        """The Hugging Face ``tokenizer_config.json`` content (also stored in data manifests)."""
        return {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": self.do_lower_case,
            "strip_accents": self.strip_accents,
            "tokenize_chinese_chars": self.tokenize_chinese_chars,
            "model_max_length": self.model_max_length,
            "clean_up_tokenization_spaces": True,
            **SPECIAL_TOKENS,
        }

    # ------------------------------------------------------------------ tokenisation core
    def _chunk(self, chunk: str) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """ids and (start, end) offsets relative to the chunk, for one white-space-free chunk."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pos = 0
        if "[" in chunk:
            for m in self._special_re.finditer(chunk):
                self._segment(chunk, pos, m.start(), ids, offsets)
                ids.append(self.vocab[m.group()])
                offsets.append((m.start(), m.end()))
                pos = m.end()
        self._segment(chunk, pos, len(chunk), ids, offsets)
        return tuple(ids), tuple(offsets)

    def _segment(self, chunk: str, start: int, end: int, ids: list, offsets: list) -> None:
        """Tokenise ``chunk[start:end]`` (no special tokens in it), appending ids and offsets."""
        if start >= end:
            return
        seg = chunk[start:end]
        if seg.isascii() and not _ASCII_CONTROL.search(seg):
            if self.do_lower_case:
                seg = seg.lower()
            for m in _ASCII_WORD.finditer(seg):
                wids, bounds = self._wordpiece(m.group())
                s = start + m.start()
                ids.extend(wids)
                offsets.extend((s + bounds[k], s + bounds[k + 1]) for k in range(len(wids)))
            return
        for word, index in self._normalized_words(seg):
            wids, bounds = self._wordpiece(word)
            ids.extend(wids)
            # A piece covers normalised characters [a, b): its offsets run from the original
            # character of its first to that of its last one.
            offsets.extend(
                (start + index[bounds[k]], start + index[bounds[k + 1] - 1] + 1) for k in range(len(wids))
            )

    def _normalize_char(self, c: str) -> tuple[str, str]:
        """(class, normalised form) of one character; NFD ordering is fixed up per word.

        Classes: see ``_char_class``, plus "m" for a letter whose normal form holds punctuation.
        """
        hit = self._char_cache.get(c)
        if hit is not None:
            return hit
        cls = _char_class(c)
        if cls == "c" and not self.tokenize_chinese_chars:
            cls = "w"
        form = c
        if cls in ("w", "p", "c") and self._strip:
            form = _nfd(c)
        if cls == "w":
            # A few letters decompose into punctuation (U+2260 NOT EQUAL TO -> "=" + U+0338), which
            # tokenizers then splits off, since it splits after normalising: class "m" (mixed).
            final = "".join(_lower(d) for d in form) if self.do_lower_case else form
            if any(_char_class(d) != "w" for d in form + final):
                cls = "m"
        self._char_cache[c] = hit = (cls, form)
        return hit

    def _normalized_words(self, seg: str) -> list[tuple[str, list[int]]]:
        """Words of a segment after cleaning, CJK splitting, accent stripping and lower-casing.

        Each word comes with the original index (into ``seg``) of every normalised character.
        """
        words: list[tuple[str, list[int]]] = []
        chars: list[str] = []
        index: list[int] = []

        def flush() -> None:
            if chars:
                words.append(self._finish_word(chars, index))
                chars.clear()
                index.clear()

        for i, c in enumerate(seg):
            cls, form = self._normalize_char(c)
            if cls == "x":
                continue
            if cls == " ":
                flush()
            elif cls == "w":
                for d in form:
                    chars.append(d)
                    index.append(i)
            elif cls == "m":
                for d in form:
                    kind = _char_class(d)
                    if kind == "p":
                        flush()
                        chars.append(d)
                        index.append(i)
                        flush()
                    elif kind == " ":
                        flush()
                    else:
                        chars.append(d)
                        index.append(i)
            else:  # punctuation and CJK ideographs are words of their own
                flush()
                for d in form:
                    chars.append(d)
                    index.append(i)
                flush()
        flush()
        return [w for w in words if w[0]]

    def _finish_word(self, chars: list[str], index: list[int]) -> tuple[str, list[int]]:
        """Canonical reordering (NFD), dropping of Mn marks, lower-casing, for one word."""
        pairs = list(zip(chars, index))
        if self._strip:
            pairs = _canonical_order(pairs)
            pairs = [(c, i) for c, i in pairs if not _is_mark(c)]
        if self.do_lower_case:
            pairs = [(d, i) for c, i in pairs for d in _lower(c)]
        return "".join(c for c, _ in pairs), [i for _, i in pairs]

    def _wordpiece(self, word: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Greedy longest-match-first WordPiece: ids and the piece boundaries (len(ids) + 1 of them)."""
        hit = self._word_cache.get(word)
        if hit is not None:
            return hit
        n = len(word)
        vocab = self.vocab
        result: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        whole = vocab.get(word) if n <= MAX_INPUT_CHARS_PER_WORD else None
        if whole is not None:  # the word is one piece (the loop's first try, without its lists)
            result = ((whole,), (0, n))
        elif n <= MAX_INPUT_CHARS_PER_WORD:
            ids: list[int] = []
            bounds = [0]
            start = 0
            while start < n:
                end = n
                found = None
                while start < end:
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    found = vocab.get(piece)
                    if found is not None:
                        break
                    end -= 1
                if found is None:
                    break
                ids.append(found)
                bounds.append(end)
                start = end
            else:
                result = (tuple(ids), tuple(bounds))
        if result is None:
            result = ((self.unk_token_id,), (0, n))
        if len(self._word_cache) >= _CACHE_LIMIT:
            self._word_cache.clear()
        self._word_cache[word] = result
        return result

    def word_ids(self, word: str) -> list[int]:
        """ids of one word without white space: its basic-tokenized pieces through WordPiece, with no
        chunk cache (for callers that cache per word themselves, as build-data does)."""
        cache = self._word_cache
        ids: list[int] = []
        for piece in self._basic_chunk(word):
            hit = cache.get(piece)
            ids += (hit if hit is not None else self._wordpiece(piece))[0]
        return ids

    def _encode_text(self, text: str, with_offsets: bool) -> tuple[list[int], list[tuple[int, int]] | None]:
        """ids (and offsets into ``text``) of a text, without special tokens."""
        if not isinstance(text, str):
            raise BertctlError(f"expected text (str), got {type(text).__name__}")
        cache = self._chunk_cache
        ids: list[int] = []
        if not with_offsets:
            for chunk in _CHUNK.findall(text):
                hit = cache.get(chunk)
                if hit is None:
                    hit = self._cache_chunk(chunk)
                ids.extend(hit[0])
            return ids, None
        offsets: list[tuple[int, int]] = []
        append = offsets.append
        for m in _CHUNK.finditer(text):
            chunk = m.group()
            hit = cache.get(chunk)
            if hit is None:
                hit = self._cache_chunk(chunk)
            chunk_ids, chunk_offsets = hit
            ids.extend(chunk_ids)
            s = m.start()
            if len(chunk_offsets) == 1:  # most chunks are one token
                a, b = chunk_offsets[0]
                append((s + a, s + b))
            else:
                offsets.extend([(s + a, s + b) for a, b in chunk_offsets])
        return ids, offsets

    def _cache_chunk(self, chunk: str):
        hit = self._chunk(chunk)
        if len(self._chunk_cache) >= _CACHE_LIMIT:
            self._chunk_cache.clear()
        self._chunk_cache[chunk] = hit
        return hit

    def basic_tokenize(self, text: str, keep_special_tokens: bool = True) -> list[str]:
        """Words after the basic tokenizer (cleaned, lower-cased, split at white space, punctuation
        and CJK ideographs), before WordPiece; special tokens in the text are words of their own
        (or dropped with ``keep_special_tokens=False``)."""
        cache = self._basic_cache
        words: list[str] = []
        for chunk in _CHUNK.findall(text):
            hit = cache.get(chunk)
            if hit is None:
                hit = self._basic_chunk(chunk)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[chunk] = hit
            words.extend(hit)
        if not keep_special_tokens and any(w in self._special_words for w in words):
            words = [w for w in words if w not in self._special_words]
        return words

    def _basic_chunk(self, chunk: str) -> tuple[str, ...]:
        # The common case; a chunk holds no white space, so printable ASCII means no control characters.
        if "[" not in chunk and chunk.isascii() and chunk.isprintable():
            return tuple(_ASCII_WORD.findall(chunk.lower() if self.do_lower_case else chunk))
        words: list[str] = []
        pos = 0
        matches = list(self._special_re.finditer(chunk)) if "[" in chunk else []
        for m in [*matches, None]:
            seg = chunk[pos : m.start() if m else len(chunk)]
            if seg.isascii() and not _ASCII_CONTROL.search(seg):
                words.extend(_ASCII_WORD.findall(seg.lower() if self.do_lower_case else seg))
            elif seg:
                words.extend(w for w, _ in self._normalized_words(seg))
            if m:
                words.append(m.group())
                pos = m.end()
        return tuple(words)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ids as Hugging Face decodes it: ``##`` pieces joined to the previous token,
        others preceded by a space, and the WordPiece decoder's clean-up applied to each token
        (no space before ``. ? ! ,`` and before ``n't 'm 's 've 're``)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        out = []
        for k, tok in enumerate(self.convert_ids_to_tokens(ids)):
            if k:
                tok = tok[2:] if tok.startswith("##") else " " + tok
            out.append(_cleanup(tok))
        return "".join(out)


def _cleanup(s: str) -> str:
    """The clean-up of ``tokenizers``' WordPiece decoder, applied per token (as it does)."""
    return (
        s.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
        .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
        .replace(" 've", "'ve").replace(" 're", "'re")
    )


def _canonical_order(pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Unicode canonical ordering: stable-sort each run of combining marks by combining class.

    Original indices are re-assigned the way ``tokenizers``' NFD aligns: the first character of
    each original character's decomposition consumes the next original index (in text order),
    and the other characters of a decomposition take the index consumed last.
    """
    ccc = [_combining(c) for c, _ in pairs]
    if sum(1 for x in ccc if x) < 2:
        return pairs
    first = [k == 0 or pairs[k][1] != pairs[k - 1][1] for k in range(len(pairs))]
    order: list[int] = []  # positions of pairs in canonical order
    k = 0
    while k < len(pairs):
        if ccc[k] == 0:
            order.append(k)
            k += 1
            continue
        j = k
        while j < len(pairs) and ccc[j]:
            j += 1
        order.extend(sorted(range(k, j), key=lambda m: ccc[m]))
        k = j
    consumed = iter([i for (_, i), f in zip(pairs, first) if f])
    last = pairs[0][1]
    out: list[tuple[str, int]] = []
    for m in order:
        if first[m]:
            last = next(consumed)
        out.append((pairs[m][0], last))
    return out


def truncated_lengths(n_a: int, n_b: int | None, max_length: int, strategy: str) -> tuple[int, int | None]:
    """Lengths (without specials) that fit ``max_length`` tokens with the specials, as Hugging Face cuts."""
    if strategy not in TRUNCATION_STRATEGIES:
        raise BertctlError(f"truncation must be one of {', '.join(TRUNCATION_STRATEGIES)}, got {strategy!r}")
    specials = 2 if n_b is None else 3
    budget = max_length - specials
    if budget < 0:
        raise BertctlError(f"max_length {max_length} leaves no room for the {specials} special tokens")
    if budget == 0:  # tokenizers empties both texts whatever the strategy
        return 0, None if n_b is None else 0
    if n_b is None:
        if strategy == "only_second":
            if n_a > budget:
                raise BertctlError("truncation only_second needs a pair of texts")
            return n_a, None
        return min(n_a, budget), None
    excess = n_a + n_b - budget
    if excess <= 0:
        return n_a, n_b
    if strategy == "only_first":
        if n_a <= excess:
            raise BertctlError(f"cannot truncate the first text ({n_a} tokens) to fit max_length {max_length}")
        return n_a - excess, n_b
    if strategy == "only_second":
        if n_b <= excess:
            raise BertctlError(f"cannot truncate the second text ({n_b} tokens) to fit max_length {max_length}")
        return n_a, n_b - excess
    # longest_first, as tokenizers computes it: with s the shorter and l the longer length, the
    # longer keeps budget - s tokens when s <= budget // 2; otherwise the shorter keeps budget // 2
    # and the longer the rest (the longer one, or the second on a tie, gets the odd token).
    swap = n_a > n_b
    short, long_ = (n_b, n_a) if swap else (n_a, n_b)
    if short > budget // 2:
        short, long_ = budget // 2, budget - budget // 2
    else:
        long_ = budget - short
    return (long_, short) if swap else (short, long_)


def _checked_kwargs(where_, kw: dict) -> dict:
    for key in ("do_lower_case", "tokenize_chinese_chars"):
        if key in kw and not isinstance(kw[key], bool):
            raise BertctlError(f"{where_}: {key} must be true or false, got {kw[key]!r}")
    if "strip_accents" in kw and kw["strip_accents"] is not None and not isinstance(kw["strip_accents"], bool):
        raise BertctlError(f"{where_}: strip_accents must be true, false or null, got {kw['strip_accents']!r}")
    return kw


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BertctlError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BertctlError(f"{path}: expected a JSON object")
    return data


def _read_tokenizer_json(path: Path) -> tuple[list[str], dict]:
    """Vocabulary and BertNormalizer settings of a ``tokenizers`` file; BertctlError unless BERT WordPiece."""
    data = _read_json(path)
    model, norm = data.get("model") or {}, data.get("normalizer") or {}
    pre = data.get("pre_tokenizer") or {}
    if model.get("type") != "WordPiece" or norm.get("type") != "BertNormalizer" or pre.get("type") != "BertPreTokenizer":
        raise BertctlError(
            f"{path}: not a BERT WordPiece tokenizer (model {model.get('type')}, normalizer {norm.get('type')}, "
            f"pre-tokenizer {pre.get('type')})")
    if model.get("continuing_subword_prefix", "##") != "##" or model.get("max_input_chars_per_word", 100) != 100:
        raise BertctlError(f"{path}: WordPiece options other than prefix '##' and 100 characters are not supported")
    if not norm.get("clean_text", True):
        raise BertctlError(f"{path}: BertNormalizer without clean_text is not supported")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise BertctlError(f"{path}: model.vocab is missing or empty")
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise BertctlError(f"{path}: vocabulary ids are not 0..{len(ids) - 1}")
    tokens = sorted(vocab, key=vocab.get)
    missing = [t for t in SPECIAL_TOKENS.values() if t not in vocab]
    if missing:
        raise BertctlError(f"{path}: vocabulary lacks the special token(s) {' '.join(missing)}")
    settings = {"do_lower_case": bool(norm.get("lowercase", True)), "strip_accents": norm.get("strip_accents"),
                "tokenize_chinese_chars": bool(norm.get("handle_chinese_chars", True))}
    return tokens, _checked_kwargs(path, settings)


def read_vocab(path: str | os.PathLike) -> list[str]:
    """Tokens of a ``vocab.txt``, one per line, as Hugging Face reads it (only the newline stripped)."""
    path = Path(path)
    if not path.exists():
        raise BertctlError(f"{path}: vocabulary file not found")
    if path.is_dir():
        raise BertctlError(f"{path}: is a directory, expected a vocab.txt file")
    try:
        with open(path, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f]
    except UnicodeDecodeError as e:
        with open(path, "rb") as f:
            line = f.read()[: e.start].count(b"\n") + 1
        raise BertctlError(f"{path}:{line}: vocabulary is not valid UTF-8") from None
    if not tokens:
        raise BertctlError(f"{path}: vocabulary file is empty")
    missing = [t for t in SPECIAL_TOKENS.values() if t not in set(tokens)]
    if missing:
        raise BertctlError(f"{path}: vocabulary lacks the special token(s) {' '.join(missing)}")
    return tokens


# ---------------------------------------------------------------------- SentencePiece
SPM_MODEL_FILES = ("spiece.model", "sentencepiece.bpe.model")  # ALBERT/T5's name, XLM-R/CamemBERT's name
SPM_WORD_START = "\u2581"  # "▁": SentencePiece's mark of a word start (the space before it)
# Where each BERT special comes from in a SentencePiece vocabulary, first match wins, after a name
# that tokenizer_config.json gives (ALBERT's layout is <pad> <unk> [CLS] [SEP] [MASK] = ids 0-4, which
# is also what ``bertctl tokenize train --algorithm unigram|bpe`` writes). "pad"/"unk"/"bos"/"eos" stand
# for the model's own pad, unknown, begin- and end-of-sentence pieces.
SPM_SPECIAL_CANDIDATES = {
    "cls_token": ("[CLS]", "<cls>", "bos"),
    "sep_token": ("[SEP]", "<sep>", "eos"),
    "pad_token": ("pad", "<pad>", "[PAD]"),
    "mask_token": ("[MASK]", "<mask>"),
    "unk_token": ("unk",),
}


def _sentencepiece():
    try:
        import sentencepiece
    except ImportError:  # a declared dependency; only a broken install lacks it
        raise BertctlError("the sentencepiece package is not installed (pip install sentencepiece)") from None
    return sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (unigram or BPE) as a BERT tokenizer; ids equal ``sp.encode(text)``.

    The model file's own normaliser (e.g. NFKC, case folding) is the whole normalisation: no text
    processing happens before or after SentencePiece, so ids are exactly SentencePiece's. Ids are the
    model's own (no fairseq offset). The five BERT specials are pieces of the model, found by
    ``SPM_SPECIAL_CANDIDATES`` (or the names in tokenizer_config.json); a model lacking one is an
    error. Character offsets come from SentencePiece's alignment to the original text, with the
    white space a piece's ``▁`` stands for left out (as ``transformers``' trimmed offsets), so
    ``text[start:end]`` is the text the piece came from. A piece without a leading ``▁`` continues
    the word before it (whole-word masking).
    """

    kind = "sentencepiece"

    def __init__(self, model: bytes | str | os.PathLike, *, special_tokens: dict[str, str] | None = None,
                 model_max_length: int = 512, filename: str | None = None):
        if isinstance(model, (bytes, bytearray)):
            source, proto = filename or "SentencePiece model", bytes(model)
        else:
            path = Path(model)
            if not path.is_file():
                raise BertctlError(f"{path}: SentencePiece model not found" if not path.exists()
                                   else f"{path}: not a file (expected a SentencePiece .model)")
            source, proto = str(path), path.read_bytes()
            filename = filename or path.name
        # Saved under its own name when it is one of the two conventional ones (transformers looks for those).
        self.model_filename = filename if filename in SPM_MODEL_FILES else SPM_MODEL_FILES[0]
        self.model_proto = proto
        self.model_sha256 = hashlib.sha256(proto).hexdigest()
        self._source = source
        self._sp = self._load(proto, source)
        sp = self._sp
        self.ids_to_tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        self.vocab = {tok: i for i, tok in enumerate(self.ids_to_tokens)}
        self.model_max_length = int(model_max_length)
        self.special_tokens = self._special_tokens(special_tokens or {})
        self.pad_token_id = self.vocab[self.special_tokens["pad_token"]]
        self.unk_token_id = self.vocab[self.special_tokens["unk_token"]]
        self.cls_token_id = self.vocab[self.special_tokens["cls_token"]]
        self.sep_token_id = self.vocab[self.special_tokens["sep_token"]]
        self.mask_token_id = self.vocab[self.special_tokens["mask_token"]]
        self.all_special_ids = frozenset(self.vocab[t] for t in self.special_tokens.values())
        self._spaces: dict[str, bool] = {}
        self._starts_word = tuple(tok.startswith(SPM_WORD_START) for tok in self.ids_to_tokens)
        self._continues = tuple(
            not tok.startswith(SPM_WORD_START) and not sp.is_control(i) for i, tok in enumerate(self.ids_to_tokens))

    @staticmethod
    def _load(proto: bytes, source: str):
        sp = _sentencepiece().SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError) as e:
            raise BertctlError(f"{source}: not a SentencePiece model ({str(e).strip() or 'unreadable'})") from None
        return sp

    def __getstate__(self) -> dict:
        # The processor is rebuilt from the model bytes (worker processes get a copy).
        state = dict(self.__dict__)
        state["_sp"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._sp = self._load(self.model_proto, self._source)

    def _special_tokens(self, named: dict[str, str]) -> dict[str, str]:
        sp = self._sp
        own = {"pad": sp.pad_id(), "unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
        found: dict[str, str] = {}
        for role, candidates in SPM_SPECIAL_CANDIDATES.items():
            name = named.get(role)
            if name is not None:
                if name not in self.vocab:
                    raise BertctlError(f"{self._source}: {role} {name!r} (from tokenizer_config.json) is not a piece "
                                       "of the SentencePiece model")
                found[role] = name
                continue
            for c in candidates:
                if c in own:
                    if own[c] >= 0:
                        found[role] = self.ids_to_tokens[own[c]]
                        break
                elif c in self.vocab:
                    found[role] = c
                    break
            else:
                looked = ", ".join(f"the model's {c} piece" if c in own else c for c in candidates)
                raise BertctlError(
                    f"{self._source}: the SentencePiece model has no {role.removesuffix('_token')} piece (looked for "
                    f"{looked}); bertctl needs [CLS], [SEP], pad, [MASK] and unknown pieces inside the model "
                    "(as ALBERT's spiece.model, or one from bertctl tokenize train --algorithm unigram)")
        return found

    @property
    def continues_word(self) -> tuple[bool, ...]:
        """Pieces without a leading ``▁`` (and not control symbols such as [CLS]) continue a word."""
        return self._continues

    @property
    def model_type(self) -> str | None:
        """"unigram", "bpe", "word" or "char" from the model's trainer spec; None without protobuf."""
        try:
            from sentencepiece import sentencepiece_model_pb2
        except ImportError:
            return None
        m = sentencepiece_model_pb2.ModelProto()
        m.ParseFromString(self.model_proto)
        return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(m.trainer_spec.model_type).lower()

    # ------------------------------------------------------------------ files
    @classmethod
    def from_model_file(cls, path: str | os.PathLike, **kw) -> "SentencePieceTokenizer":
        return cls(path, **kw)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "SentencePieceTokenizer":
        """A directory holding ``spiece.model`` or ``sentencepiece.bpe.model`` (the first found), with the
        special-token names and ``model_max_length`` of its ``tokenizer_config.json`` when present."""
        directory = Path(directory)
        model = find_spm_model(directory)
        if model is None:
            raise BertctlError(f"{directory}: no {' or '.join(SPM_MODEL_FILES)} in this directory")
        kw: dict = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = _read_json(config_path)
            names = {}
            for role in SPM_SPECIAL_CANDIDATES:
                value = config.get(role)
                if isinstance(value, dict):  # transformers' AddedToken form
                    value = value.get("content")
                if isinstance(value, str):
                    names[role] = value
            kw["special_tokens"] = names
            max_len = config.get("model_max_length")
            if isinstance(max_len, int) and 0 < max_len < 1_000_000:  # see BertTokenizer.from_pretrained
                kw["model_max_length"] = max_len
        return cls(model, **kw)

    def save_pretrained(self, directory: str | os.PathLike) -> list[str]:
        """Copy the model file and write ``tokenizer_config.json`` and ``special_tokens_map.json``.

        The config names the model file and says ``"tokenizer_type": "sentencepiece"``. For a unigram
        model it also names ``AlbertTokenizer``, which ``transformers`` loads with the same ids except
        that it rewrites ``````/``''`` to ``"`` (ALBERT's preprocessing); ``transformers`` has no class
        for a BPE model without fairseq's id offset, so none is named then. Returns the file names.
        """
        from bertctl.io import atomic_open, write_json

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_open(directory / self.model_filename, "wb") as f:
            f.write(self.model_proto)
        write_json(directory / "tokenizer_config.json", self.config())
        write_json(directory / "special_tokens_map.json", dict(self.special_tokens))
        return [self.model_filename, "tokenizer_config.json", "special_tokens_map.json"]

    def config(self) -> dict:
        """The ``tokenizer_config.json`` content (also what data manifests store)."""
        config: dict = {"tokenizer_type": self.kind, "sentencepiece_model": self.model_filename,
                        "sentencepiece_sha256": self.model_sha256, "model_max_length": self.model_max_length}
        if self.model_type == "unigram":
            # transformers' AlbertTokenizer is a unigram model; no lower-casing or accent stripping there:
            # SentencePiece's own normaliser is the whole normalisation, as in bertctl.
            config.update(tokenizer_class="AlbertTokenizer", do_lower_case=False, keep_accents=True,
                          bos_token=self.special_tokens["cls_token"], eos_token=self.special_tokens["sep_token"])
        config.update(self.special_tokens)
        return config

    # ------------------------------------------------------------------ tokenisation
    def _encode_text(self, text: str, with_offsets: bool) -> tuple[list[int], list[tuple[int, int]] | None]:
        if not isinstance(text, str):
            raise BertctlError(f"expected text (str), got {type(text).__name__}")
        if not with_offsets:
            return self._sp.encode(text), None
        pieces = [(p.id, p.begin, p.end) for p in _spm_proto(self._sp, text).pieces]
        ids = [i for i, _, _ in pieces]
        if not text.isascii():  # SentencePiece aligns in UTF-8 bytes: byte offset -> characters before it
            ends = list(itertools.accumulate(len(c.encode("utf-8", "surrogatepass")) for c in text))
            pieces = [(i, bisect.bisect_right(ends, a), bisect.bisect_right(ends, b)) for i, a, b in pieces]
        offsets = []
        starts_word = self._starts_word
        for i, a, b in pieces:
            if starts_word[i]:  # the white space "▁" stands for is not the piece's text
                while a < b and (text[a] == " " or self._is_space(text[a])):
                    a += 1
            offsets.append((a, b))
        return ids, offsets

    def _is_space(self, c: str) -> bool:
        """Whether the model's normaliser turns ``c`` into a word boundary (cached per character)."""
        hit = self._spaces.get(c)
        if hit is None:
            hit = self._spaces[c] = c.isspace() and self._sp.encode("a" + c + "a") == self._sp.encode("a a")
        return hit

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """SentencePiece's decode (``▁`` becomes a space); kept specials appear as their pieces, space-separated."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        self.convert_ids_to_tokens(ids)  # range check
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if i not in self.all_special_ids])
        parts: list[str] = []
        run: list[int] = []
        for i in [*ids, None]:
            if i is None or i in self.all_special_ids:
                if run:
                    parts.append(self._sp.decode(run))
                    run = []
                if i is not None:
                    parts.append(self.ids_to_tokens[i])
            else:
                run.append(i)
        return " ".join(parts)


def _spm_proto(sp, text: str):
    """SentencePiece's encoding with alignment (pieces with id, begin and end bytes)."""
    try:
        return sp.encode(text, out_type="proto")
    except ValueError:  # sentencepiece 0.2.0 calls it immutable_proto
        return sp.encode(text, out_type="immutable_proto")


def find_spm_model(directory: str | os.PathLike) -> Path | None:
    """The SentencePiece model file of a directory (``spiece.model``, then ``sentencepiece.bpe.model``)."""
    for name in SPM_MODEL_FILES:
        path = Path(directory) / name
        if path.is_file():
            return path
    return None


def load_tokenizer(path: str | os.PathLike, *, do_lower_case: bool = True) -> Tokenizer:
    """The tokenizer a path holds; every command loads tokenizers through this.

    - a ``.model`` file: a SentencePiece model;
    - another file: a WordPiece ``vocab.txt`` (``do_lower_case`` says its casing);
    - a directory with ``spiece.model`` or ``sentencepiece.bpe.model``: SentencePiece (the model file
      wins over any ``vocab.txt`` or ``tokenizer.json`` beside it);
    - a ``bertctl build-data`` folder without one (``manifest.json`` and ``vocab.txt``, no
      ``tokenizer_config.json``): WordPiece with the casing the manifest stores;
    - any other directory: WordPiece from ``tokenizer.json`` or ``vocab.txt`` (``BertTokenizer.from_pretrained``).
    """
    path = Path(path)
    if path.is_file():
        if path.suffix == ".model":
            return SentencePieceTokenizer.from_model_file(path)
        return BertTokenizer.from_vocab_file(path, do_lower_case=do_lower_case)
    if not path.is_dir():
        raise BertctlError(f"{path}: no such file or directory")
    if find_spm_model(path) is not None:
        return SentencePieceTokenizer.from_pretrained(path)
    manifest = path / "manifest.json"
    if manifest.is_file() and (path / "vocab.txt").is_file() and not (path / "tokenizer_config.json").is_file():
        info = _read_json(manifest).get("tokenizer") or {}
        kw = {k: info[k] for k in ("strip_accents", "tokenize_chinese_chars") if k in info}
        return BertTokenizer.from_vocab_file(path / "vocab.txt", do_lower_case=info.get("do_lower_case", True),
                                             **_checked_kwargs(manifest, kw))
    return BertTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------- files (the CLI's library side)
def parse_separator(sep: str | None) -> str | None:
    """``TAB`` or a literal backslash-t mean a tab; anything else is taken as written."""
    if sep is None:
        return None
    if sep in ("TAB", "tab", "\\t", "\t"):
        return "\t"
    if not sep:
        raise BertctlError("--pair-separator must not be empty")
    return sep


def iter_lines(path: str | os.PathLike):
    """(line number, text) of a UTF-8 file, without line endings; BertctlError naming a bad line."""
    path = Path(path)
    if not path.is_file():
        raise BertctlError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BertctlError(
                    f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "convert the file, e.g. iconv -f latin1 -t utf-8"
                ) from None
            yield number, line.rstrip("\n").removesuffix("\r"), len(raw)


def read_lines(path: str | os.PathLike) -> list[str]:
    """All lines of a UTF-8 file as ``iter_lines`` gives them, decoded at once (67,349 SST-2 sentences:
    a few hundredths of a second against a tenth line by line); a bad byte is named as there."""
    path = Path(path)
    if not path.is_file():
        return [line for _, line, _ in iter_lines(path)]  # its error
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return [line for _, line, _ in iter_lines(path)]  # its error, with the line's number
    lines = text.split("\n")
    if lines[-1] == "":  # the final newline ends the last line; it starts none
        lines.pop()
    return [line.removesuffix("\r") for line in lines] if "\r" in text else lines


def encode_file(
    tokenizer: Tokenizer,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    pair_separator: str | None = None,
    max_length: int | None = None,
    truncation: str = "longest_first",
    offsets: bool = False,
    progress: bool = False,
) -> dict:
    """Encode every line of a UTF-8 text file into ``.jsonl`` or ``.npy`` (see ``bertctl tokenize encode``).

    Returns a summary: lines, tokens (specials included), truncated lines, output path(s).
    """
    import numpy as np

    from bertctl.io import atomic_open, atomic_path
    from bertctl.progress import track

    input_path, output_path = Path(input_path), Path(output_path)
    suffix = output_path.suffix.lower()
    if suffix not in (".jsonl", ".npy"):
        raise BertctlError(f"{output_path}: output must end in .jsonl or .npy")
    sep = parse_separator(pair_separator)
    if not input_path.is_file():
        raise BertctlError(f"{input_path}: no such file")
    total = input_path.stat().st_size
    if total == 0:
        raise BertctlError(f"{input_path}: empty file, nothing to encode")
    n_lines = n_tokens = n_truncated = 0
    rows: list[list[int]] = []
    types: list[list[int]] = []

    def encode_line(number: int, line: str) -> tuple[Encoding, bool]:
        text, pair = line, None
        if sep is not None:
            if sep not in line:
                raise BertctlError(f"{input_path}:{number}: no pair separator {pair_separator!r} in this line")
            text, pair = line.split(sep, 1)
        a, a_off = tokenizer._encode_text(text, offsets)
        b, b_off = (None, None) if pair is None else tokenizer._encode_text(pair, offsets)
        full = len(a) + 2 + (0 if b is None else len(b) + 1)
        try:
            enc = tokenizer._build(a, a_off, b, b_off, max_length, truncation, False, offsets)
        except BertctlError as e:
            raise BertctlError(f"{input_path}:{number}: {e}") from None
        return enc, full > len(enc)

    with track(f"encode {input_path.name}", total, disable=not progress) as advance:
        if suffix == ".jsonl":
            with atomic_open(output_path, "w", encoding="utf-8") as out:
                for number, line, size in iter_lines(input_path):
                    enc, cut = encode_line(number, line)
                    record = {"input_ids": enc.input_ids, "token_type_ids": enc.token_type_ids,
                              "attention_mask": enc.attention_mask}
                    if offsets:
                        record["offsets"] = enc.offsets
                    out.write(json.dumps(record, separators=(",", ":")) + "\n")
                    n_lines, n_tokens, n_truncated = n_lines + 1, n_tokens + len(enc), n_truncated + cut
                    advance(size)
            outputs = [str(output_path)]
        else:
            for number, line, size in iter_lines(input_path):
                enc, cut = encode_line(number, line)
                rows.append(enc.input_ids)
                types.append(enc.token_type_ids)
                n_lines, n_tokens, n_truncated = n_lines + 1, n_tokens + len(enc), n_truncated + cut
                advance(size)
            width = max((len(r) for r in rows), default=0)
            ids = np.full((len(rows), width), tokenizer.pad_token_id, dtype=np.int32)
            segs = np.zeros((len(rows), width), dtype=np.int32)
            for k, (r, t) in enumerate(zip(rows, types)):
                ids[k, : len(r)] = r
                segs[k, : len(t)] = t
            with atomic_path(output_path) as tmp:
                with open(tmp, "wb") as f:
                    np.save(f, ids)
            outputs = [str(output_path)]
            if sep is not None:
                seg_path = output_path.with_suffix(".token_type_ids.npy")
                with atomic_path(seg_path) as tmp:
                    with open(tmp, "wb") as f:
                        np.save(f, segs)
                outputs.append(str(seg_path))
    return {"lines": n_lines, "tokens": n_tokens, "truncated_lines": n_truncated, "outputs": outputs}


def decode_file(tokenizer: Tokenizer, path: str | os.PathLike, *, skip_special_tokens: bool = True) -> list[str]:
    """Texts of the id rows of a ``.jsonl`` (``input_ids`` objects or plain id lists) or ``.npy`` file."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise BertctlError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise BertctlError(f"{path}: empty file, nothing to decode")
    if path.suffix.lower() == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise BertctlError(f"{path}: not a readable .npy array ({e})") from None
        if array.ndim != 2 or array.dtype.kind not in "iu":
            raise BertctlError(f"{path}: expected a 2-D integer array, got {array.ndim}-D {array.dtype}")
        return [_decode_row(tokenizer, row.tolist(), skip_special_tokens, path, k + 1) for k, row in enumerate(array)]
    texts = []
    for number, line, _ in iter_lines(path):
        if not line.strip():
            raise BertctlError(f"{path}:{number}: empty line (expected a JSON object with input_ids)")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BertctlError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        ids = record.get("input_ids") if isinstance(record, dict) else record
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BertctlError(f"{path}:{number}: expected input_ids as a list of integers")
        texts.append(_decode_row(tokenizer, ids, skip_special_tokens, path, number))
    return texts


def _decode_row(tokenizer: Tokenizer, ids: list[int], skip: bool, path, number: int) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=skip)
    except BertctlError as e:
        raise BertctlError(f"{path}:{number}: {e}") from None
