"""Atomic file output: write to a temporary name beside the target, then rename.

A reader never sees a half-written file under its final name, and an
interrupted writer leaves only ``*.tmp*`` debris that later runs ignore.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Iterator


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it onto ``target`` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_open(target: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """``open`` for writing that only publishes the file when the block completes."""
    with atomic_path(target) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def write_json(target: str | os.PathLike, obj, indent: int = 2) -> None:
    with atomic_open(target, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, sort_keys=False)
        f.write("\n")


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``target`` (an old one is removed).

    The swap is two renames (old aside, new in), so a crash leaves either the
    old directory, the new one, or the old one under ``.<name>.old``; never a mix.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        old = target.parent / f".{target.name}.old"
        if old.exists():
            shutil.rmtree(old)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_json_object(path: str | os.PathLike, what: str = "JSON") -> dict:
    """A JSON file holding one object; a missing file or bad JSON is a one-line error naming it."""
    from bertctl.errors import BertctlError

    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BertctlError(f"{path}: {what} file not found") from None
    except json.JSONDecodeError as e:
        raise BertctlError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise BertctlError(f"{path}: expected a JSON object")
    return obj


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSON-lines file; bad lines are errors naming file:line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, parse_json_line(line, path, lineno)


def parse_json_line(line: str, path: str | os.PathLike, lineno: int) -> dict:
    """One line of a JSON-lines file as a dict; anything else is an error naming file:line."""
    from bertctl.errors import BertctlError

    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise BertctlError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise BertctlError(f"{path}:{lineno}: expected a JSON object per line")
    return row
