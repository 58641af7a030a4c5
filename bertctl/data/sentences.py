"""A rule-based English sentence splitter for raw prose.

BERT's pretraining input is a list of documents, each a list of sentences
(create_pretraining_data.py reads "one sentence per line").  Raw text has to be
split first; this splitter is a small, fast, deterministic set of rules, not a
trained model.  It works on one paragraph at a time (a paragraph break is
always a sentence break) and prefers to *under*-split: a missed boundary only
makes one "sentence" longer, which instance creation handles anyway, while a
false split cuts a segment in the middle.

Rules, applied at every run of terminal punctuation (``.``, ``!``, ``?``, ``…``)
that is followed by white space:

1. Closing quotes and brackets right after the punctuation stay with the
   sentence they close: ``He said "Stop." Then...`` splits after the quote,
   ``(See above.) Next`` after the bracket.
2. No split when the next word starts with a lower-case letter
   (``He paused... then went on``, ``e.g. apples``, ``Mr. smith``) or with
   other punctuation that continues the sentence (``,;:``).
3. No split after a title or a "never final" abbreviation:
   ``Mr. Mrs. Ms. Dr. Prof. St. Sr. Jr. Rev. Hon. Gen. Col. Lt. Sgt. Capt.
   Gov. Sen. Rep. Messrs. Mt. Ft. e.g. i.e. cf. vs. viz. al. approx.``
4. No split after ``No. Nos. Vol. Fig. pp. p. Art. Sec. Ch.`` when a digit follows
   (``No. 5``), while ``... said no. Then`` splits.
5. No split after a single letter (initials: ``Harry S. Truman``, ``J. R. R.
   Tolkien``) nor after an upper-case dotted initialism (``U.S. Congress``,
   ``U.N. Charter``, ``D.C.``), which is far more often inside a sentence than at
   its end.  Lower-case initialisms (``a.m.``, ``p.m.``) do split before an
   upper-case word.
6. Decimals (``3.14``), dotted numbers and URLs never match because the ``.``
   is not followed by white space.
7. Ellipses (``...`` or ``…``), ``?!`` and friends split like a full stop:
   only before a word that does not start in lower case.

Known limits: an abbreviation that really does end a sentence before a
capitalised word (``... in the U.S. The next ...``) stays one sentence; a
sentence that starts in lower case is glued to the one before it.
"""
from __future__ import annotations

import re

__all__ = ["split_sentences", "split_paragraphs"]

# Terminal punctuation, then closing quotes/brackets, then the white space
# that separates it from the next sentence (which must begin with a non-space).
_BOUNDARY = re.compile(r"([.!?\u2026]+)([\"'\u201d\u2019)\]}\u00bb]*)\s+(?=\S)")
# Opening quotes/brackets that may precede the next sentence's first word.
_OPENERS = "\"'\u201c\u2018([{\u00ab"
# Leading characters to strip from the word before the punctuation.
_WORD_LEAD = "\"'\u201c\u2018([{\u00ab"

_NEVER_FINAL = frozenset(
    """mr mrs ms dr prof st sr jr rev hon gen col lt sgt capt cmdr adm maj gov sen rep
    messrs mme mlle mt ft e.g i.e cf vs viz al approx esp""".split()
)
_BEFORE_DIGIT = frozenset("no nos vol vols fig figs pp p art sec ch".split())
_INITIALISM = re.compile(r"^(?:[A-Za-z]\.)+[A-Za-z]$")
_LOOK_BACK = 32  # characters searched for the word before a full stop


def _is_boundary(text: str, punct_start: int, punct: str, next_start: int) -> bool:
    nxt = text[next_start]
    j = next_start
    while nxt in _OPENERS and j + 1 < len(text):  # look past an opening quote or bracket
        j += 1
        nxt = text[j]
    if nxt.islower() or nxt in ",;:":
        return False
    if punct != ".":
        return True
    # The word right before the full stop, e.g. "Mr", "U.S", "(e.g"; the rules below only concern
    # short words, so a bounded look-back suffices (no rescan of a long paragraph per full stop).
    before = text[max(0, punct_start - _LOOK_BACK) : punct_start].rsplit(None, 1)
    word = before[-1].lstrip(_WORD_LEAD) if before else ""
    if not word:
        return True
    lower = word.lower()
    if lower in _NEVER_FINAL:
        return False
    if lower in _BEFORE_DIGIT and nxt.isdigit():
        return False
    if len(word) == 1 and word.isalpha():
        return False
    if _INITIALISM.match(word) and word.isupper():
        return False
    return True


def split_sentences(paragraph: str) -> list[str]:
    """Split one paragraph of prose into sentences (see the module docstring for the rules).

    White space inside the paragraph is kept as is; each sentence is stripped.
    Returns ``[]`` for a blank paragraph.
    """
    sentences = []
    start = 0
    for m in _BOUNDARY.finditer(paragraph):
        if _is_boundary(paragraph, m.start(1), m.group(1), m.end()):
            sentence = paragraph[start : m.end(2)].strip()
            if sentence:
                sentences.append(sentence)
            start = m.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def split_paragraphs(lines: list[str]) -> list[str]:
    """Join wrapped lines into paragraphs: a blank line ends a paragraph.

    ``lines`` are text lines without their newline; lines of one paragraph are
    joined with one space (prose wrapped at 70 columns reads as one paragraph).
    """
    paragraphs, current = [], []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs
