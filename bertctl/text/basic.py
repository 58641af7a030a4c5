"""BERT's basic tokenizer: text cleaning, CJK ideographs, accents, lower-casing and punctuation.

google-research/bert's ``BasicTokenizer`` as Hugging Face's fast ``BertTokenizerFast`` (the
``tokenizers`` library: its BertNormalizer and BertPreTokenizer) implements it, character for
character and with the same offsets:

1. text cleaning: NUL, U+FFFD and control, format and private-use characters are dropped, every
   other white space character becomes a word boundary;
2. CJK ideographs become single-character words;
3. accent stripping (NFD, then drop the non-spacing marks, category Mn) and lower-casing; accents are
   stripped when ``strip_accents`` is True, or when it is None and ``do_lower_case`` is True;
4. words are split at white space and around every punctuation character (ASCII 33-47, 58-64,
   91-96, 123-126 and Unicode P*), each punctuation character its own word.

Character classes, non-spacing marks and lower-case mappings come from tables generated from
``tokenizers`` itself (``char_tables.py``, by ``python -m bertctl.text.char_tables_gen``): its
Unicode data differ from Python's ``unicodedata`` (older categories, so e.g. characters assigned
since are kept as letters; newer case mappings), and only its own tables give identical results on
every code point. Offsets follow its alignment rules, including the re-ordering of combining marks
by NFD.

Printable ASCII, most of real text, needs none of this: ``ASCII_WORD`` splits it in one regex.
"""
from __future__ import annotations

import bisect
import re
import unicodedata

from bertctl.text import char_tables as _tables

# ASCII punctuation as BERT defines it (33-47, 58-64, 91-96, 123-126), as a regex class.
_ASCII_PUNCT = r"!-/:-@\[-`{-~"
# An ASCII chunk without control characters splits into words with one regex.
ASCII_WORD = re.compile(rf"[^{_ASCII_PUNCT}]+|[{_ASCII_PUNCT}]")
ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Chunks are cut at ASCII white space only: other white space (and characters Python treats as
# white space but BERT drops as control characters, e.g. U+0085) is handled inside a chunk.
CHUNK = re.compile(r"[^ \t\n\r]+")


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


class BasicTokenizer:
    """Cleaning, CJK splitting, accent stripping, lower-casing and punctuation splitting of text
    that holds no special tokens (``BertTokenizer`` keeps those whole before it calls this)."""

    def __init__(self, do_lower_case: bool = True, strip_accents: bool | None = None,
                 tokenize_chinese_chars: bool = True):
        self.do_lower_case = bool(do_lower_case)
        self.strip_accents = strip_accents
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        self.strip = self.do_lower_case if strip_accents is None else bool(strip_accents)
        self._char_cache: dict[str, tuple[str, str]] = {}

    def __getstate__(self) -> dict:
        # The cache is rebuilt on demand: a tokenizer sent to worker processes pickles small.
        state = dict(self.__dict__)
        state["_char_cache"] = {}
        return state

    def normalize_char(self, c: str) -> tuple[str, str]:
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
        if cls in ("w", "p", "c") and self.strip:
            form = _nfd(c)
        if cls == "w":
            # A few letters decompose into punctuation (U+2260 NOT EQUAL TO -> "=" + U+0338), which
            # tokenizers then splits off, since it splits after normalising: class "m" (mixed).
            final = "".join(_lower(d) for d in form) if self.do_lower_case else form
            if any(_char_class(d) != "w" for d in form + final):
                cls = "m"
        self._char_cache[c] = hit = (cls, form)
        return hit

    def words(self, seg: str) -> list[tuple[str, list[int]]]:
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
            cls, form = self.normalize_char(c)
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
        if self.strip:
            pairs = _canonical_order(pairs)
            pairs = [(c, i) for c, i in pairs if not _is_mark(c)]
        if self.do_lower_case:
            pairs = [(d, i) for c, i in pairs for d in _lower(c)]
        return "".join(c for c, _ in pairs), [i for _, i in pairs]


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
