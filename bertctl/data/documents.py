"""Streaming document readers for the input formats, compressed input, and the encoding policy.

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
- ``wikiextractor``: WikiExtractor's output, ``<doc id=.. url=.. title=..>``
  ... ``</doc>`` blocks; each block is a document, each non-blank line in it a
  paragraph (WikiExtractor writes one paragraph per line), the title line that
  opens a block is dropped.
- ``parquet`` and ``arrow``: one document per row, its text in the string
  column ``text_field``, cut like ``jsonl``.  ``arrow`` reads Arrow IPC files in
  the stream format (what Hugging Face ``datasets`` keeps in its cache folder,
  ``*.arrow``) or the file format (Feather v2).  Both are read a record batch
  at a time.

Compression: a file (or stdin) that starts with the magic bytes of gzip, bzip2,
xz or zstd is decompressed while it is read, a block at a time; nothing is
decompressed to disk.  Concatenated streams (``cat a.gz b.gz``, pigz, pbzip2)
are read in turn; zero bytes after the last stream are ignored.  A file whose
name ends in ``.gz``, ``.bz2``, ``.xz`` or ``.zst`` must hold that format.  A
corrupt or truncated stream is a BertctlError naming the file and the byte
offset (in the compressed file) at which it was detected.  Parquet needs a
seekable file, so it is read from uncompressed files only.

``-`` as an input is stdin (any format but parquet, compressed or not).

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

import bz2
import contextlib
import fnmatch
import html
import io
import itertools
import json
import lzma
import os
import queue
import re
import sys
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from bertctl.errors import BertctlError, where

from .sentences import split_paragraphs

FORMATS = ("lines", "text", "jsonl", "wikiextractor", "parquet", "arrow")
FIRST_PLACES = 3  # places named in a note on skipped lines
STDIN = "-"
# A folder walked for these formats with the default pattern "*" yields only their files
# (a datasets cache folder also holds dataset_info.json, state.json and lock files).
FORMAT_PATTERNS = {"parquet": "*.parquet", "arrow": "*.arrow"}


@dataclass
class Document:
    """One document as read: its sentences (``lines``) or paragraphs (the other formats)."""

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
    lines_read: int = 0  # --format lines: non-blank lines, and those ending mid-sentence (prose wrapped across lines)
    lines_mid_sentence: int = 0
    # For the notes on stderr, not the summary (whose layout stays): the first few places of each skip,
    # the fields of the first JSON object that lacked the text field, and how the non-UTF-8 lines were decoded.
    skipped_at: dict = field(default_factory=dict)  # reason -> [location, ...] (at most FIRST_PLACES)
    fields_seen: list | None = None
    decoded: dict = field(default_factory=dict)  # "cp1252" / "latin-1" -> lines

    def skip_line(self, reason: str, location: str) -> None:
        entry = self.skipped_lines.setdefault(reason, {"count": 0, "first": location})
        entry["count"] += 1
        places = self.skipped_at.setdefault(reason, [])
        if len(places) < FIRST_PLACES:
            places.append(location)

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "bytes": self.bytes,
            "non_utf8_files": list(self.non_utf8_files),
            "skipped_inputs": list(self.skipped_inputs),
            "skipped_lines": dict(self.skipped_lines),
            "cut_documents": self.cut_documents,
        }

    def notes(self, fmt: str, most: int = 3) -> list[str]:
        """One line for each kind of input that was skipped or read otherwise than as given, for stderr."""
        out = []
        for reason, entry in self.skipped_lines.items():
            places = self.skipped_at.get(reason) or [entry["first"]]
            more = entry["count"] - len(places)
            where_ = (f"at {', '.join(places)}" if more <= 0 else f"the first at {', '.join(places)}")
            note = f"skipped {entry['count']:,} line(s): {reason} ({where_})"
            if reason.startswith("no string field") and self.fields_seen is not None:
                shown = ", ".join(repr(k) for k in self.fields_seen[:8]) or "none"
                note += f"; the first such object's fields: {shown} (choose the text's with --text-field)"
            out.append(note)
        if self.skipped_inputs:
            first = ", ".join(f"{s['path']} ({s['reason']})" for s in self.skipped_inputs[:most])
            more = f" and {len(self.skipped_inputs) - most} more" if len(self.skipped_inputs) > most else ""
            out.append(f"skipped {len(self.skipped_inputs)} input file(s): {first}{more}")
        if self.non_utf8_files:
            more = f" and {len(self.non_utf8_files) - most} more" if len(self.non_utf8_files) > most else ""
            how = f"{self.decoded.get('cp1252', 0):,} line(s) decoded as cp1252"
            if self.decoded.get("latin-1"):
                how += f" and {self.decoded['latin-1']:,} as latin-1 (bytes cp1252 leaves undefined)"
            out.append(f"read {len(self.non_utf8_files)} file(s) that are not all UTF-8: {how}, every other line as "
                       f"UTF-8, none skipped: {', '.join(self.non_utf8_files[:most])}{more}")
        if self.cut_documents:
            out.append(f"{self.cut_documents} document(s) cut where they outgrew the per-document memory bound")
        # Sentence-per-line text ends most lines with a sentence; wrapped prose ends most mid-sentence.
        if fmt == "lines" and self.lines_read >= 20 and self.lines_mid_sentence > 0.5 * self.lines_read:
            out.append(f"note: {self.lines_mid_sentence:,} of {self.lines_read:,} lines end mid-sentence, so this "
                       f"looks like prose wrapped across lines, read as one sentence a line and one document a "
                       f"paragraph; --format text joins wrapped lines and splits sentences")
        return out


# ----------------------------------------------------------------------------- input files


def _pattern_names(name: str) -> tuple[str, str]:
    """A file name, and the name without a compression suffix (``a.txt.gz`` matches ``*.txt`` too)."""
    stem, suffix = os.path.splitext(name)
    return name, stem if suffix in SUFFIXES else name


def list_inputs(inputs: list[str | os.PathLike], pattern: str = "*", fmt: str | None = None) -> list[Path]:
    """Input files in a fixed order: files as given (``-`` is stdin), folders walked recursively in
    sorted order (hidden entries skipped, names matching ``pattern`` with or without their
    compression suffix; ``*`` means ``*.parquet`` / ``*.arrow`` for those formats).  A missing
    path is an error."""
    if pattern == "*" and fmt in FORMAT_PATTERNS:
        pattern = FORMAT_PATTERNS[fmt]
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if str(item) == STDIN:
            if any(str(f) == STDIN for f in files):
                raise BertctlError("'-' (stdin) is given twice as an input")
            if fmt == "parquet":
                raise BertctlError("-: parquet cannot be read from stdin (it needs to seek); give the file")
            files.append(path)
        elif path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if not name.startswith(".") and any(fnmatch.fnmatch(n, pattern) for n in _pattern_names(name)):
                        files.append(Path(root) / name)
        elif path.is_file():
            files.append(path)
        else:
            raise BertctlError(f"{path}: no such input file or folder")
    if not files:
        raise BertctlError(f"no input files found in {', '.join(map(str, inputs))} (pattern {pattern!r})")
    return files


# ----------------------------------------------------------------------------- decompression

# Codec -> (file-name suffixes, magic bytes at the start of a stream).
CODECS = {
    "gzip": ((".gz",), (b"\x1f\x8b",)),
    "bzip2": ((".bz2",), tuple(b"BZh" + bytes([c]) for c in b"123456789")),
    "xz": ((".xz",), (b"\xfd7zXZ\x00",)),
    "zstd": ((".zst", ".zstd"), (b"\x28\xb5\x2f\xfd",)),
}
SUFFIXES = {s: codec for codec, (suffixes, _) in CODECS.items() for s in suffixes}
READ_BLOCK = 1 << 16  # compressed bytes fed to the decompressor at a time
OUT_BLOCK = 1 << 20  # decompressed bytes produced per call at most (bounds memory on extreme ratios)


def _sniff(magic: bytes) -> str | None:
    return next((codec for codec, (_, magics) in CODECS.items() if magic.startswith(magics)), None)


def _decompressor(codec: str):
    if codec == "gzip":
        return zlib.decompressobj(wbits=31)  # gzip header and trailer (CRC-32, length) checked
    if codec == "bzip2":
        return bz2.BZ2Decompressor()
    if codec == "xz":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


def _codec_errors(codec: str) -> tuple[type[Exception], ...]:
    """What the decompressors raise on bad data (bz2 raises OSError); zstandard only for zstd."""
    errors = (zlib.error, OSError, EOFError, lzma.LZMAError)
    if codec == "zstd":
        import zstandard

        errors += (zstandard.ZstdError,)
    return errors


def _decompress(source: BinaryIO, prefix: bytes, codec: str, name: str) -> Iterator[bytes]:
    """Decompressed blocks of the concatenated ``codec`` streams in ``source``.

    ``prefix``: bytes already read from ``source`` (the magic bytes).  Errors name
    the input and the compressed byte offset at which they were detected.
    """
    errors = _codec_errors(codec)
    consumed = len(prefix)  # compressed bytes read so far

    def read() -> bytes:
        nonlocal consumed
        block = source.read(READ_BLOCK)
        consumed += len(block)
        return block

    data = prefix
    while True:
        data = data.lstrip(b"\x00")  # between streams: zero padding is skipped
        if not data:
            data = read()
            if not data:
                return
            continue
        stream = _decompressor(codec)
        drain = False  # the last call hit OUT_BLOCK: take the rest before feeding more input
        while not stream.eof:
            if not data and not drain:
                data = read()
                if not data:
                    raise BertctlError(f"{name}: truncated {codec} file: it ends at byte offset {consumed} "
                                       "inside a compressed stream")
            try:
                out = stream.decompress(data) if codec == "zstd" else stream.decompress(data, OUT_BLOCK)
            except errors as e:
                raise BertctlError(f"{name}: corrupt {codec} data, detected at byte offset {consumed} "
                                   f"({' '.join(str(e).split()) or type(e).__name__})") from None
            data = stream.unconsumed_tail if codec == "gzip" else b""  # zlib hands back what it did not take
            drain = codec != "zstd" and len(out) >= OUT_BLOCK
            if out:
                yield out
        data = stream.unused_data + data  # the bytes after this stream: padding or the next stream


class _Prefetched(io.RawIOBase):
    """A raw stream over byte blocks that a thread produces ahead of the reader.

    The decompressors release the GIL, so decompression runs on another core while
    this process tokenizes.  At most ``depth`` blocks wait; an error in the thread is
    raised by the ``readinto`` that reaches it.  ``readinto`` fills the whole buffer
    unless the input ends, so a ``BufferedReader`` on top reads lines at C speed.
    """

    def __init__(self, blocks: Iterator[bytes], depth: int = 8):
        super().__init__()
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        self.block = memoryview(b"")
        self.finished = False
        self.thread = threading.Thread(target=self._produce, args=(blocks,), daemon=True)
        self.thread.start()

    def _produce(self, blocks: Iterator[bytes]) -> None:
        try:
            for block in blocks:
                if not self._put(block):
                    return
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread
            self._put(e)

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = 0
        while n < len(view) and not self.finished:
            if not self.block:
                item = self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item is None:
                    self.finished = True
                    break
                self.block = memoryview(item)
                continue
            k = min(len(self.block), len(view) - n)
            view[n : n + k] = self.block[:k]
            self.block = self.block[k:]
            n += k
        return n

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)  # it stops at its next block (a read from stdin may block longer)
        super().close()


@contextlib.contextmanager
def open_input(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A file (``-``: stdin) as a buffered binary stream, decompressed when it is gzip, bzip2, xz or zstd."""
    name = display_name(path)
    with contextlib.ExitStack() as stack:
        if str(path) == STDIN:
            source = sys.stdin.buffer
        else:
            source = stack.enter_context(open(path, "rb", buffering=1 << 20))
        magic = source.read(6)
        codec = _sniff(magic)
        suffix = os.path.splitext(name)[1]
        if SUFFIXES.get(suffix) not in (None, codec) and magic:
            raise BertctlError(f"{name}: byte offset 0: not {SUFFIXES[suffix]} data, although the name ends in "
                               f"{suffix}")
        if codec is not None:
            blocks = _decompress(source, magic, codec, name)
        elif source.seekable():
            source.seek(0)
            yield source
            return
        else:  # stdin, plain: the magic bytes, then the rest
            blocks = itertools.chain([magic], iter(lambda: source.read(READ_BLOCK), b""))
        yield stack.enter_context(io.BufferedReader(_Prefetched(blocks), buffer_size=1 << 20))


def is_compressed(path: str | os.PathLike) -> bool:
    """Whether a file starts with the magic bytes of a compression format bertctl reads."""
    with open(path, "rb") as f:
        return _sniff(f.read(6)) is not None


def known_text_bytes(files: list[Path], fmt: str) -> int | None:
    """The input bytes that reading ``files`` will count, when the file sizes say it without
    reading: uncompressed line-based files.  None otherwise (stdin, compressed, parquet, arrow)."""
    if fmt in ("parquet", "arrow"):
        return None
    total = 0
    for f in files:
        if str(f) == STDIN or is_compressed(f):
            return None
        total += f.stat().st_size
    return total


# ----------------------------------------------------------------------------- lines


def display_name(path: str | os.PathLike) -> str:
    """How an input is named in messages and the summary (stdin is ``<stdin>``)."""
    return "<stdin>" if str(path) == STDIN else str(path)


def _decode(raw: bytes) -> tuple[str, str]:
    """Decode one line by the policy above; returns (text, the encoding it was decoded as)."""
    try:
        return raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        try:
            return raw.decode("cp1252"), "cp1252"
        except UnicodeDecodeError:
            return raw.decode("latin-1"), "latin-1"


def _raw_lines(head: bytes, f: BinaryIO) -> Iterator[bytes]:
    """The lines of ``head`` followed by the rest of ``f`` (each with its ``\\n``)."""
    *lines, tail = head.split(b"\n")
    for line in lines:
        yield line + b"\n"
    first = tail + f.readline()
    if first:
        yield first
    yield from f


def _lines(path: Path, stats: ReadStats) -> Iterator[tuple[str, int]]:
    """(decoded line without its newline, raw byte count) for each line of a file."""
    name = display_name(path)
    with open_input(path) as f:
        head = f.read(8192)
        if not head.strip() and len(head) < 8192:
            stats.skipped_inputs.append({"path": name, "reason": "empty"})
            return
        if b"\x00" in head:
            stats.skipped_inputs.append({"path": name, "reason": "binary (NUL bytes)"})
            return
        stats.files += 1
        utf8 = True
        first = True
        for raw in _raw_lines(head, f):
            stats.bytes += len(raw)
            text, encoding = _decode(raw)
            if encoding != "utf-8":
                stats.decoded[encoding] = stats.decoded.get(encoding, 0) + 1
                if utf8:
                    utf8 = False
                    stats.non_utf8_files.append(name)
            if first:
                text = text.lstrip("\ufeff")
                first = False
            yield text.rstrip("\r\n"), len(raw)


# ----------------------------------------------------------------------------- documents


def read_documents(files: list[Path], fmt: str, stats: ReadStats, *, text_field: str = "text",
                   doc_separator: str | None = None, max_document_bytes: int = 16 << 20) -> Iterator[Document]:
    """Stream the documents of ``files`` in order; only one document is held at a time.

    A ``lines``, ``text`` or ``wikiextractor`` document that grows past
    ``max_document_bytes`` (a huge file with no document breaks) is cut at the
    next sentence or paragraph boundary, so memory stays bounded; cuts are
    counted in ``stats.cut_documents``.
    """
    if fmt not in FORMATS:
        raise BertctlError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    for path in files:
        if fmt == "lines":
            yield from _read_lines_format(path, stats, max_document_bytes)
        elif fmt == "text":
            yield from _read_text_format(path, stats, doc_separator, max_document_bytes)
        elif fmt == "wikiextractor":
            yield from _read_wikiextractor_format(path, stats, max_document_bytes)
        else:
            if fmt == "jsonl":
                texts = _jsonl_texts(path, stats, text_field)
            else:
                texts = _column_texts(path, fmt, stats, text_field)
            for text, nbytes in texts:
                paragraphs = split_paragraphs(text.split("\n"))
                if paragraphs:
                    yield Document(paragraphs, False, nbytes)


def read_lines(files: list[Path], fmt: str, stats: ReadStats, *, text_field: str = "text") -> Iterator[tuple[str, int]]:
    """(line of text, bytes) over the inputs, for counting words: every line of ``lines`` and
    ``text`` files; each paragraph of the documents of the other formats (bytes: its UTF-8 length + 1)."""
    if fmt in ("lines", "text"):
        for path in files:
            yield from _lines(path, stats)
        return
    for doc in read_documents(files, fmt, stats, text_field=text_field):
        for piece in doc.pieces:
            yield piece, len(piece.encode("utf-8", "surrogatepass")) + 1


SENTENCE_ENDS = tuple(".!?;:\"')]»”’…")


def _read_lines_format(path: Path, stats: ReadStats, max_bytes: int) -> Iterator[Document]:
    sentences, nbytes = [], 0
    for line, n in _lines(path, stats):
        nbytes += n
        line = line.strip()
        if line:
            sentences.append(line)
            stats.lines_read += 1
            stats.lines_mid_sentence += not line.endswith(SENTENCE_ENDS)
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


_DOC_OPEN = re.compile(r"<doc\b[^>]*>")
_DOC_TITLE = re.compile(r'\btitle="([^"]*)"')


def _read_wikiextractor_format(path: Path, stats: ReadStats, max_bytes: int) -> Iterator[Document]:
    """WikiExtractor blocks: ``<doc id=".." url=".." title="T">``, the title line ``T``, paragraphs, ``</doc>``."""
    paragraphs: list[str] | None = None  # None: outside a block
    title, nbytes = None, 0
    for lineno, (line, n) in enumerate(_lines(path, stats), 1):
        line = line.strip()
        if paragraphs is None:
            if _DOC_OPEN.fullmatch(line):
                match = _DOC_TITLE.search(line)
                paragraphs, nbytes = [], n
                title = html.unescape(match.group(1)) if match else None
            elif line:
                stats.skip_line("text outside <doc> ... </doc>", where(display_name(path), lineno))
            continue
        nbytes += n
        if line == "</doc>":
            if paragraphs:
                yield Document(paragraphs, False, nbytes)
            paragraphs = None
        elif line and title is not None and not paragraphs and line == title:
            title = None  # the title line that WikiExtractor writes first: a heading, not prose
        elif line:
            title = None
            paragraphs.append(line)
            if nbytes >= max_bytes:
                stats.cut_documents += 1
                yield Document(paragraphs, False, nbytes)
                paragraphs, nbytes = [], 0
    if paragraphs is not None:
        stats.skip_line("<doc> block without </doc> (kept)", where(display_name(path)))
        if paragraphs:
            yield Document(paragraphs, False, nbytes)


def _jsonl_texts(path: Path, stats: ReadStats, text_field: str) -> Iterator[tuple[str, int]]:
    for lineno, (line, n) in enumerate(_lines(path, stats), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            stats.skip_line("not valid JSON", where(display_name(path), lineno))
            continue
        text = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            if isinstance(obj, dict) and stats.fields_seen is None:
                stats.fields_seen = list(obj)
            reason = (f"no string field {text_field!r}" if isinstance(obj, dict) else
                      "not a JSON object")
            stats.skip_line(reason, where(display_name(path), lineno))
            continue
        yield text, n


def _column_texts(path: Path, fmt: str, stats: ReadStats, text_field: str) -> Iterator[tuple[str, int]]:
    """(text, UTF-8 bytes) of each row of a parquet or Arrow IPC file, a record batch at a time."""
    import pyarrow as pa

    name = display_name(path)
    try:
        with contextlib.ExitStack() as stack:
            batches = _record_batches(path, name, fmt, stack, text_field)
            stats.files += 1
            row = 0
            for batch in batches:
                column = batch.column(batch.schema.get_field_index(text_field))
                for text in column.to_pylist():
                    row += 1
                    if text is None:
                        stats.skip_line(f"null {text_field!r}", f"{name}:row {row}")
                        continue
                    n = len(text.encode("utf-8", "surrogatepass"))
                    stats.bytes += n
                    yield text, n
    except (pa.ArrowException, OSError) as e:  # a truncated IPC stream is an OSError
        raise BertctlError(f"{name}: not a readable {fmt} file ({' '.join(str(e).split())})") from None


def _record_batches(path: Path, name: str, fmt: str, stack: contextlib.ExitStack, text_field: str):
    """Record batches of ``text_field`` alone (parquet reads only that column)."""
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq

        if is_compressed(path):
            raise BertctlError(f"{name}: parquet is read from uncompressed files only (it needs to seek); "
                               "parquet compresses its columns itself")
        reader = pq.ParquetFile(path)
        _check_column(reader.schema_arrow, name, text_field)
        return reader.iter_batches(batch_size=1024, columns=[text_field])
    stream = None
    if name != "<stdin>" and not is_compressed(path):
        source = stack.enter_context(pa.memory_map(str(path)))
        if source.read(6) == b"ARROW1":  # the IPC file format (Feather v2); else the stream format
            source.seek(0)
            reader = pa.ipc.open_file(source)
            _check_column(reader.schema, name, text_field)
            return (reader.get_batch(k) for k in range(reader.num_record_batches))
        source.seek(0)
        stream = source
    if stream is None:
        stream = stack.enter_context(open_input(path))
    reader = pa.ipc.open_stream(stream)
    _check_column(reader.schema, name, text_field)
    return reader


def _check_column(schema, name: str, text_field: str) -> None:
    import pyarrow as pa

    if schema.get_field_index(text_field) < 0:
        raise BertctlError(f"{name}: no column {text_field!r} (--text-field); columns: {', '.join(schema.names)}")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise BertctlError(f"{name}: column {text_field!r} holds {kind}, not strings")
