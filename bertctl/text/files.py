"""Text files in and out: UTF-8 line readers, and ``bertctl tokenize encode`` / ``decode`` on whole files."""
from __future__ import annotations

import json
import os
from pathlib import Path

from bertctl.errors import BertctlError
from bertctl.text.base import Encoding, Tokenizer


def iter_lines(path: str | os.PathLike):
    """(line number, text without its line ending, bytes read) of each line of a UTF-8 file;
    BertctlError naming a bad line."""
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
    """All lines of a UTF-8 file as ``iter_lines`` gives them, decoded at once (faster than line by
    line); a bad byte is named as there."""
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


def parse_separator(sep: str | None) -> str | None:
    """``TAB`` or a literal backslash-t mean a tab; anything else is taken as written."""
    if sep is None:
        return None
    if sep in ("TAB", "tab", "\\t", "\t"):
        return "\t"
    if not sep:
        raise BertctlError("--pair-separator must not be empty")
    return sep


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
