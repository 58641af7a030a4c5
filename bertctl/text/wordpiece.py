"""BERT's WordPiece tokenizer: the basic tokenizer, then greedy longest-match-first WordPiece.

Devlin et al., 2018, section 3 and appendix A.2, as Hugging Face's fast ``BertTokenizerFast`` (the
``tokenizers`` library) implements google-research/bert's ``FullTokenizer``; ids *and* character
offsets equal that implementation's:

1. special tokens (``[CLS] [SEP] [PAD] [MASK] [UNK]``) written in the raw text stay whole;
2. the basic tokenizer (``basic.py``) cleans the text, splits off CJK ideographs, strips accents,
   lower-cases and splits words at white space and punctuation;
3. each word becomes the longest vocabulary prefix, then ``##``-continuations, greedily; a word that
   cannot be covered, or is longer than 100 characters, becomes one ``[UNK]``
   (``unaffable -> un ##aff ##able``).

Text is cut at ASCII white space into chunks, and each distinct chunk's (ids, offsets) is computed
once and cached: natural text repeats chunks such as ``the`` or ``said,`` heavily, so the full
Unicode pipeline runs only on a chunk's first occurrence.

A tokenizer directory is Hugging Face's: ``vocab.txt``, ``tokenizer.json`` and ``tokenizer_config.json``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

from bertctl.errors import BertctlError
from bertctl.text.base import Tokenizer, read_json
from bertctl.text.basic import ASCII_CONTROL, ASCII_WORD, CHUNK, BasicTokenizer

SPECIAL_TOKENS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
MAX_INPUT_CHARS_PER_WORD = 100  # longer words become [UNK] (google-research/bert, WordpieceTokenizer)
_CACHE_LIMIT = 1 << 18  # entries per cache; a full cache is cleared, so memory stays bounded on any corpus


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
        self.basic = BasicTokenizer(do_lower_case, strip_accents, tokenize_chinese_chars)
        # Its settings, as tokenizer_config.json names them; plain attributes, read on every uncached chunk.
        self.do_lower_case = self.basic.do_lower_case
        self.strip_accents = self.basic.strip_accents
        self.tokenize_chinese_chars = self.basic.tokenize_chinese_chars
        self.model_max_length = int(model_max_length)
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
        self._basic_cache: dict[str, tuple[str, ...]] = {}
        self._special_words = frozenset(SPECIAL_TOKENS.values())
        self._continues: tuple[bool, ...] | None = None

    def __getstate__(self) -> dict:
        # Caches are rebuilt on demand: a tokenizer sent to worker processes pickles small.
        state = dict(self.__dict__)
        for key in ("_chunk_cache", "_word_cache", "_basic_cache"):
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
        return cls(read_vocab(path), do_lower_case=do_lower_case, **checked_settings(path, kw))

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
            config = read_json(config_path)
            for key in ("do_lower_case", "strip_accents", "tokenize_chinese_chars"):
                if key in config:
                    kw[key] = config[key]
            max_len = config.get("model_max_length")
            # Hugging Face writes a huge sentinel (int(1e30)) for "no limit": keep BERT's 512 then.
            if isinstance(max_len, int) and 0 < max_len < 1_000_000:
                kw["model_max_length"] = max_len
        kw = checked_settings(config_path, kw)
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
        if seg.isascii() and not ASCII_CONTROL.search(seg):  # the basic tokenizer's work is one regex here
            if self.do_lower_case:
                seg = seg.lower()
            for m in ASCII_WORD.finditer(seg):
                wids, bounds = self._wordpiece(m.group())
                s = start + m.start()
                ids.extend(wids)
                offsets.extend((s + bounds[k], s + bounds[k + 1]) for k in range(len(wids)))
            return
        for word, index in self.basic.words(seg):
            wids, bounds = self._wordpiece(word)
            ids.extend(wids)
            # A piece covers normalised characters [a, b): its offsets run from the original
            # character of its first to that of its last one.
            offsets.extend(
                (start + index[bounds[k]], start + index[bounds[k + 1] - 1] + 1) for k in range(len(wids))
            )

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
            for chunk in CHUNK.findall(text):
                hit = cache.get(chunk)
                if hit is None:
                    hit = self._cache_chunk(chunk)
                ids.extend(hit[0])
            return ids, None
        offsets: list[tuple[int, int]] = []
        append = offsets.append
        for m in CHUNK.finditer(text):
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
        for chunk in CHUNK.findall(text):
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
            return tuple(ASCII_WORD.findall(chunk.lower() if self.do_lower_case else chunk))
        words: list[str] = []
        pos = 0
        matches = list(self._special_re.finditer(chunk)) if "[" in chunk else []
        for m in [*matches, None]:
            seg = chunk[pos : m.start() if m else len(chunk)]
            if seg.isascii() and not ASCII_CONTROL.search(seg):
                words.extend(ASCII_WORD.findall(seg.lower() if self.do_lower_case else seg))
            elif seg:
                words.extend(w for w, _ in self.basic.words(seg))
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


def checked_settings(where_, kw: dict) -> dict:
    """``kw`` when its basic-tokenizer settings have the types tokenizer_config.json allows; else an error naming ``where_``."""
    for key in ("do_lower_case", "tokenize_chinese_chars"):
        if key in kw and not isinstance(kw[key], bool):
            raise BertctlError(f"{where_}: {key} must be true or false, got {kw[key]!r}")
    if "strip_accents" in kw and kw["strip_accents"] is not None and not isinstance(kw["strip_accents"], bool):
        raise BertctlError(f"{where_}: strip_accents must be true, false or null, got {kw['strip_accents']!r}")
    return kw


def _read_tokenizer_json(path: Path) -> tuple[list[str], dict]:
    """Vocabulary and BertNormalizer settings of a ``tokenizers`` file; BertctlError unless BERT WordPiece."""
    data = read_json(path)
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
    return tokens, checked_settings(path, settings)


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

