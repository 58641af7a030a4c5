"""What every bertctl tokenizer offers: the ``Tokenizer`` interface, BERT's input layout and truncation.

Each tokenizer kind (``wordpiece.BertTokenizer``, ``sentencepiece.SentencePieceTokenizer``) implements
``_encode_text`` (the ids and offsets of one text); this class lays them out as BERT's inputs
(``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]``), truncates and pads them as Hugging Face does.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from bertctl.errors import BertctlError

TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second")


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
    with segment ids 0 and 1 (section 3). ``bertctl.text.load_tokenizer`` picks the class from what a
    path holds.
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


def read_json(path: Path) -> dict:
    """A tokenizer file's JSON object (``tokenizer_config.json``, ``tokenizer.json``, a data manifest)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BertctlError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BertctlError(f"{path}: expected a JSON object")
    return data
