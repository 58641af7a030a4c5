"""Streaming document readers for the three input formats, and the encoding policy.

Formats (``DataConfig.format``):

- ``lines``: the BERT format of create_pretraining_data.py: one sentence per
  line, a blank line between documents.  Lines are taken as sentences as is.
- ``text``: raw prose.  Wrapped lines are joined into paragraphs (a blank line
  ends a paragraph) and paragraphs are split into sentences by
  :mod:`bertctl.data.sentences`.  One document per file, unless
  ``doc_separator`` is set: then a line equal to it (after stripping) ends a
  document.
- ``jsonl``: one JSON object per line, the document text under ``text_field``;
  its text is cut into paragraphs and sentences like ``text``.

Encoding policy: every line is decoded as UTF-8 (a leading BOM is dropped);
a line that is not valid UTF-8 is decoded as cp1252 (Windows Western, a
superset of the printable ISO-8859-1), and as latin-1 if it holds one of the
five bytes cp1252 leaves undefined.  Deciding per line, not per file, keeps
reading a stream (no whole-file sniffing) and keeps the UTF-8 lines of a
mixed file intact.  A file with any such line is listed in the summary's
``non_utf8_files``.  Files holding NUL bytes (binary) and empty files are skipped
and counted, never a crash.
"""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from bertctl.errors import BertctlError, where

from .sentences import split_paragraphs

FORMATS = ("lines", "text", "jsonl")


@dataclass
class Document:
    """One document as read: its sentences (``lines``) or paragraphs (``text``/``jsonl``)."""

    pieces: list[str]
    presplit: bool  # True: pieces are sentences already; False: paragraphs to split
    nbytes: int  # raw bytes of input this document came from (progress, chunking)


@dataclass
class ReadStats:
    """What the readers saw: counted, never fatal."""

    files: int = 0
    bytes: int = 0
    non_utf8_files: list[str] = field(default_factory=list)
    skipped_inputs: list[dict] = field(default_factory=list)  # {"path", "reason"}
    skipped_lines: dict = field(default_factory=dict)  # reason -> {"count", "first"}
    cut_documents: int = 0  # documents cut at max_document_bytes (memory bound)

    def skip_line(self, reason: str, location: str) -> None:
        entry = self.skipped_lines.setdefault(reason, {"count": 0, "first": location})
        entry["count"] += 1

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "bytes": self.bytes,
            "non_utf8_files": list(self.non_utf8_files),
            "skipped_inputs": list(self.skipped_inputs),
            "skipped_lines": dict(self.skipped_lines),
            "cut_documents": self.cut_documents,
        }


def list_inputs(inputs: list[str | os.PathLike], pattern: str = "*") -> list[Path]:
    """Input files in a fixed order: files as given, folders walked recursively in sorted
    order (hidden entries skipped, names matching ``pattern``).  A missing path is an error."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if not name.startswith(".") and fnmatch.fnmatch(name, pattern):
                        files.append(Path(root) / name)
        elif path.is_file():
            files.append(path)
        else:
            raise BertctlError(f"{path}: no such input file or folder")
    if not files:
        raise BertctlError(f"no input files found in {', '.join(map(str, inputs))} (pattern {pattern!r})")
    return files


def _decode(raw: bytes) -> tuple[str, bool]:
    """Decode one line by the policy above; returns (text, was_utf8)."""
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        try:
            return raw.decode("cp1252"), False
        except UnicodeDecodeError:
            return raw.decode("latin-1"), False


def _lines(path: Path, stats: ReadStats) -> Iterator[tuple[str, int]]:
    """(decoded line without its newline, raw byte count) for each line of a file."""
    with open(path, "rb") as f:
        head = f.read(8192)
        if not head.strip() and len(head) < 8192:
            stats.skipped_inputs.append({"path": str(path), "reason": "empty"})
            return
        if b"\x00" in head:
            stats.skipped_inputs.append({"path": str(path), "reason": "binary (NUL bytes)"})
            return
        f.seek(0)
        stats.files += 1
        utf8 = True
        first = True
        for raw in f:
            stats.bytes += len(raw)
            text, ok = _decode(raw)
            if not ok and utf8:
                utf8 = False
                stats.non_utf8_files.append(str(path))
            if first:
                text = text.lstrip("\ufeff")
                first = False
            yield text.rstrip("\r\n"), len(raw)


def read_documents(files: list[Path], fmt: str, stats: ReadStats, *, text_field: str = "text",
                   doc_separator: str | None = None, max_document_bytes: int = 16 << 20) -> Iterator[Document]:
    """Stream the documents of ``files`` in order; only one document is held at a time.

    A ``lines`` or ``text`` document that grows past ``max_document_bytes`` (a huge
    file with no document breaks) is cut at the next sentence or paragraph
    boundary, so memory stays bounded; cuts are counted in ``stats.cut_documents``.
    """
    if fmt not in FORMATS:
        raise BertctlError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    for path in files:
        if fmt == "lines":
            yield from _read_lines_format(path, stats, max_document_bytes)
        elif fmt == "text":
            yield from _read_text_format(path, stats, doc_separator, max_document_bytes)
        else:
            yield from _read_jsonl_format(path, stats, text_field)


def _read_lines_format(path: Path, stats: ReadStats, max_bytes: int) -> Iterator[Document]:
    sentences, nbytes = [], 0
    for line, n in _lines(path, stats):
        nbytes += n
        line = line.strip()
        if line:
            sentences.append(line)
            if nbytes >= max_bytes:
                stats.cut_documents += 1
                yield Document(sentences, True, nbytes)
                sentences, nbytes = [], 0
        elif sentences:
            yield Document(sentences, True, nbytes)
            sentences, nbytes = [], 0
    if sentences:
        yield Document(sentences, True, nbytes)


def _read_text_format(path: Path, stats: ReadStats, doc_separator: str | None, max_bytes: int) -> Iterator[Document]:
    lines, nbytes = [], 0
    for line, n in _lines(path, stats):
        nbytes += n
        separator = doc_separator is not None and line.strip() == doc_separator
        if not separator:
            lines.append(line)
        cut = not separator and nbytes >= max_bytes and not line.strip()  # at a paragraph break
        if separator or cut:
            paragraphs = split_paragraphs(lines)
            if paragraphs:
                stats.cut_documents += cut
                yield Document(paragraphs, False, nbytes)
            lines, nbytes = [], 0
    paragraphs = split_paragraphs(lines)
    if paragraphs:
        yield Document(paragraphs, False, nbytes)


def _read_jsonl_format(path: Path, stats: ReadStats, text_field: str) -> Iterator[Document]:
    for lineno, (line, n) in enumerate(_lines(path, stats), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            stats.skip_line("not valid JSON", where(path, lineno))
            continue
        text = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            stats.skip_line(f"no string field {text_field!r}", where(path, lineno))
            continue
        paragraphs = split_paragraphs(text.split("\n"))
        if paragraphs:
            yield Document(paragraphs, False, n)
