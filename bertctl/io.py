"""Atomic file output: write to a temporary name beside the target, then rename.

A reader never sees a half-written file under its final name, and an
interrupted writer leaves only ``*.tmp`` debris, named with its host and
process id: the next write of the same target on that host removes the debris
of writers that no longer run (a KILLed run's half-written embeddings can be
gigabytes), and leaves a live writer's, or another host's, alone.
What a failed write leaves is removed: the temporary file or folder, and the
parent folders it created.  Published files and folders get the permissions a
plain ``open``/``mkdir`` would give under the caller's umask (``mkstemp`` and
``mkdtemp`` create them 0600/0700).  An ``OSError`` without a file name (a full
disk during a write) is re-raised naming the target, so the CLI can say which
output failed.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
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


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="ascii") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: set and restore (briefly racy with other threads)
    os.umask(mask)
    return mask


def make_parents(folder: Path) -> list[Path]:
    """``mkdir -p folder``; returns the folders it created, innermost first (for clean-up)."""
    created = []
    for p in [folder, *folder.parents]:
        if p.exists():
            if not p.is_dir():  # mkdir would say "File exists", naming the file
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
            break
        created.append(p)
    folder.mkdir(parents=True, exist_ok=True)
    return created


def remove_empty(folders: list[Path]) -> None:
    for p in folders:
        with contextlib.suppress(OSError):
            p.rmdir()


def _naming(e: OSError, target: Path) -> OSError:
    """``e`` if it names one file, else the same error naming ``target`` (not a temporary name)."""
    if (e.filename is not None and e.filename2 is None) or e.errno is None:
        return e
    return type(e)(e.errno, e.strerror, str(target))


def _as_if_made_under_umask(tree: Path) -> None:
    """Give a finished temporary folder, and everything in it, the modes plain ``mkdir``/``open`` would
    under the current umask: ``mkdtemp`` makes 0700, and writers like safetensors' ``save_file`` 0600."""
    mask = current_umask()
    os.chmod(tree, 0o777 & ~mask)
    for folder, dirs, files in os.walk(tree):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            executable = os.stat(path).st_mode & 0o111
            os.chmod(path, (0o777 if executable else 0o666) & ~mask)


# What to do about the operating-system errors a user can fix, by errno.
OS_ERROR_FIXES = {
    errno.EROFS: "read-only file system; write somewhere else",
    errno.EACCES: "permission denied; choose a location you may write to, or fix its permissions",
    errno.EPERM: "operation not permitted; choose a location you may write to, or fix its permissions",
    errno.ENOSPC: "no space left on the device; free some space or write somewhere else",
    errno.EDQUOT: "disk quota exceeded; free some space or write somewhere else",
    errno.ENOTDIR: "a part of this path is a file, not a folder",
    errno.EISDIR: "is a folder, expected a file",
    errno.ENOENT: "no such file or folder",
    errno.EEXIST: "already exists",
}


def describe_os_error(e: OSError) -> str:
    """One line for an ``OSError``: the path it names, what happened and, where there is one, the fix."""
    what = OS_ERROR_FIXES.get(e.errno) or (e.strerror or str(e)).lower()
    path = e.filename2 if e.filename2 is not None else e.filename
    return f"{path}: {what}" if path is not None else what


def check_writable(target: str | os.PathLike, *, folder: bool = False, what: str = "--output") -> None:
    """Fail at once, before any expensive work, if ``target`` (a file, or with ``folder`` a folder) cannot be
    created: a BertctlError naming it and the reason.  The probe is a real file created and removed in the
    nearest existing folder, so read-only mounts, permissions and quotas all count (also for root)."""
    from bertctl.errors import BertctlError

    target = Path(target)
    if folder and target.exists() and not target.is_dir():
        raise BertctlError(f"{target}: {what} exists and is not a folder")
    if not folder and target.is_dir():
        raise BertctlError(f"{target}: {what} is a folder; give a file name")
    base = target if folder else target.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise BertctlError(f"{target}: cannot write {what}: {base} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".bertctl-probe.", suffix=".tmp", dir=base)
    except OSError as e:
        raise BertctlError(f"{target}: cannot write {what}: {describe_os_error(OSError(e.errno, e.strerror, str(base)))}") from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it onto ``target`` on success."""
    target = Path(target)
    created = make_parents(target.parent)
    published = False
    try:
        remove_debris(target)
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(target), suffix=".tmp", dir=target.parent)
        os.close(fd)
        tmp = Path(tmp)
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fchmod(f.fileno(), 0o666 & ~current_umask())
                os.fsync(f.fileno())
            os.replace(tmp, target)
            published = True
            _fsync_dir(target.parent)
        except OSError as e:
            named = _naming(e, target)
            if named is e:
                raise
            raise named from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    finally:
        if not published:
            remove_empty(created)


@contextlib.contextmanager
def atomic_open(target: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """``open`` for writing that only publishes the file when the block completes."""
    with atomic_path(target) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def write_json(target: str | os.PathLike, obj, indent: int = 2) -> None:
    with atomic_open(target, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, sort_keys=False)
        f.write("\n")


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "host"


def _temporary_prefix(target: Path) -> str:
    """The start of ``target``'s temporary names for this process: ``.<name>.<host>-<pid>.`` (then mkstemp's
    random part and ``.tmp``)."""
    return f".{target.name}.{_host()}-{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_debris(target: Path) -> None:
    """Remove the temporary files and folders that writers of ``target`` on this host left when they were
    killed (their process is gone); a running writer's, another host's and unparsable names stay."""
    head, host = f".{target.name}.", _host()
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not (name.startswith(head) and name.endswith(".tmp")):
            continue
        owner = name[len(head):-len(".tmp")].rpartition(".")[0]  # <host>-<pid>, before mkstemp's part
        their_host, _, pid = owner.rpartition("-")
        if their_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``target`` (an old one is removed).

    The swap is two renames (old aside, new in), so a crash leaves either the
    old directory, the new one, or the old one under ``.<name>.old``; never a mix.
    """
    target = Path(target)
    created = make_parents(target.parent)
    published = False
    try:
        remove_debris(target)
        tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(target), suffix=".tmp", dir=target.parent))
        try:
            yield tmp
            _as_if_made_under_umask(tmp)
            old = target.parent / f".{target.name}.old"
            if old.exists():
                shutil.rmtree(old)
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
            published = True
            _fsync_dir(target.parent)
            if old.exists():
                shutil.rmtree(old)
        except OSError as e:
            named = _naming(e, target)
            if named is e:
                raise
            raise named from e
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if not published:
            remove_empty(created)


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
