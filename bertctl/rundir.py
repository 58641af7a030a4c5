"""One rule for every command's output folder, so that no run's work is lost by a rerun, a resume or a
second run into the same folder.

- A new or empty folder (or one holding none of bertctl's files) starts a run.
- A folder holding an unfinished run needs ``--resume``; without it the command refuses, saying what is there.
- A finished run is refused unless ``--overwrite`` is given; ``--resume`` on it says it is finished.
  ``--overwrite`` moves the old run's files aside into ``.replaced/`` and deletes them only once the new run
  has finished, so a new run that fails leaves the old one recoverable.
- A lock file (``.bertctl.lock``: the holder's process id, host and start time) refuses a second run while
  the first is alive. It is freed when the run ends, and taken over only when its process is gone.

A run is finished when the command has written its results and called ``Claim.finish``, which marks
``.bertctl-run.json`` finished. The claim of a command that calls ``finish`` writes that marker unfinished first, so a run stopped between its last
write and ``finish`` (a second Ctrl-C as the model is written) resumes to its end; folders written before the
marker existed are recognised by each command's own files (``finished_before``).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from bertctl.errors import BertctlError
from bertctl.io import check_writable, make_parents, remove_empty

LOCK = ".bertctl.lock"
MARKER = ".bertctl-run.json"
REPLACED = ".replaced"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a live holder from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_time(pid)
    return started is None or now is None or now == started


@dataclass
class Claim:
    """A command's hold on its output folder: ``state`` is ``new``, ``resume`` or ``overwrite``."""

    folder: Path
    command: str
    state: str
    lock: Path | None = None
    replaced: Path | None = None
    created: list[Path] = field(default_factory=list)  # folders the claim made: removed again if left empty
    _released: bool = field(default=False, repr=False)

    def finish(self, **summary) -> None:
        """Mark the run finished (after its results are written) and delete what ``--overwrite`` moved aside."""
        from bertctl.io import write_json

        write_json(self.folder / MARKER, {"command": self.command, "finished": True,
                                          "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **summary})
        shutil.rmtree(self.folder / REPLACED, ignore_errors=True)  # a finished run supersedes a replaced one
        self.replaced = None

    def begin(self) -> None:
        """Mark the folder as holding a run of this version in progress: never taken for a finished old one."""
        from bertctl.io import write_json

        write_json(self.folder / MARKER, {"command": self.command, "finished": False,
                                          "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

    def release(self) -> None:
        """Free the lock (if this process still holds it); a run that wrote nothing leaves no marker."""
        if self._released or self.lock is None:
            return
        self._released = True
        _drop_bare_marker(self.folder)
        key = self.lock.resolve()
        if _held.get(key, 0) > 1:
            _held[key] -= 1
            return
        _held.pop(key, None)
        try:
            held = json.loads(self.lock.read_text())
            if held.get("pid") == os.getpid():
                self.lock.unlink()
        except (OSError, ValueError):
            pass
        remove_empty(self.created)  # a run refused before its first write leaves no folder behind

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _drop_bare_marker(folder: Path) -> None:
    """An unfinished marker beside nothing but the lock: the run wrote no work, so the folder holds none."""
    marker = folder / MARKER
    try:
        if json.loads(marker.read_text()).get("finished") is False and \
                {p.name for p in folder.iterdir()} <= {MARKER, LOCK}:
            marker.unlink()
    except (OSError, ValueError):
        pass


def is_finished(folder: Path, finished_before: Callable[[Path], bool] | None = None) -> bool:
    marker = folder / MARKER
    if marker.is_file():
        try:
            return bool(json.loads(marker.read_text()).get("finished"))
        except (OSError, ValueError):
            return False
    return bool(finished_before and finished_before(folder))


_held: dict[Path, int] = {}  # locks this process holds, and how many claims hold each


def _take_lock(folder: Path, command: str) -> Path:
    path = folder / LOCK
    if path.resolve() in _held:  # a command that claims before its library call claims again
        _held[path.resolve()] += 1
        return path
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
          "command": command, "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(path.read_text())
            except (OSError, ValueError):
                held = {}  # a lock being written this instant, or a torn one: look once more
                time.sleep(0.2)
                try:
                    held = json.loads(path.read_text())
                except (OSError, ValueError):
                    pass
            pid = held.get("pid")
            if isinstance(pid, int) and held.get("host") not in (None, me["host"]):
                raise BertctlError(f"{folder}: another bertctl {held.get('command', 'run')} (pid {pid} on host "
                                   f"{held['host']}, since {held.get('since')}) holds this folder; if that run is "
                                   f"gone, delete {path}")
            if isinstance(pid, int) and _alive(pid, held.get("started")):
                raise BertctlError(f"{folder}: another bertctl {held.get('command', 'run')} (pid {pid}, since "
                                   f"{held.get('since')}) is writing this folder; wait for it to end, or choose "
                                   f"another --output")
            path.unlink(missing_ok=True)  # its process is gone: a stale lock
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        _held[path.resolve()] = 1
        return path
    raise BertctlError(f"{folder}: could not take the lock {path} (another run keeps taking it)")


def claim(folder: str | os.PathLike, *, command: str, resume: bool = False, overwrite: bool = False,
          started: Callable[[Path], str | None], finished_before: Callable[[Path], bool] | None = None,
          outputs: Iterable[str] = (), main: bool = True, marks: bool = False) -> Claim:
    """Apply the rule to ``folder`` for ``command`` and lock it; the caller calls ``finish`` and ``release``.

    ``started(folder)`` says what unfinished work the folder holds (e.g. "a checkpoint at step 400"), or None;
    ``finished_before`` recognises a finished run written before the marker; ``outputs`` are the names
    (globs) that ``--overwrite`` moves aside; ``marks``: the command calls ``finish`` when done, so its run is
    marked unfinished now (``Claim.begin``). Only the ``main`` process of a distributed run claims."""
    folder = Path(folder)
    if not main:
        return Claim(folder, command, "resume" if resume else "new")
    if resume and overwrite:
        raise BertctlError("--resume and --overwrite: choose one")
    if folder.exists() and not folder.is_dir():
        raise BertctlError(f"{folder}: exists and is not a folder")
    created = make_parents(folder)
    try:
        check_writable(folder, folder=True)  # a read-only, unwritable or full folder: refused before any work
    except BaseException:
        remove_empty(created)
        raise
    try:
        lock = _take_lock(folder, command)
    except BaseException:
        remove_empty(created)
        raise
    try:
        state = _decide(folder, command, resume, overwrite, started, finished_before)
        replaced = _move_aside(folder, outputs) if state == "overwrite" else None
    except BaseException:
        Claim(folder, command, "refused", lock, created=created).release()
        raise
    c = Claim(folder, command, state, lock, replaced, created)
    atexit.register(c.release)
    if marks and not (folder / MARKER).is_file():  # (a resumed run keeps the marker it has)
        c.begin()
    return c


def _decide(folder: Path, command: str, resume: bool, overwrite: bool, started, finished_before) -> str:
    if is_finished(folder, finished_before):
        if overwrite:
            return "overwrite"
        if resume:
            raise BertctlError(f"{folder}: holds a finished {command} run, so there is nothing to resume; pass "
                               f"--overwrite to run again there, or choose another --output")
        raise BertctlError(f"{folder}: holds a finished {command} run; pass --overwrite to replace it, or choose "
                           f"another --output")
    work = started(folder)
    if work:
        if resume:
            return "resume"
        if overwrite:
            return "overwrite"
        raise BertctlError(f"{folder}: holds an unfinished {command} run ({work}); pass --resume to continue it, "
                           f"--overwrite to start again, or choose another --output")
    return "new"


def _move_aside(folder: Path, outputs: Iterable[str]) -> Path | None:
    """Move the old run's files into ``.replaced/`` (emptied first: an earlier replaced run is already superseded)."""
    names = sorted({p for pattern in (*outputs, MARKER) for p in folder.glob(pattern)
                    if p.name not in (LOCK, REPLACED)})
    if not names:
        return None
    aside = folder / REPLACED
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    for p in names:
        p.rename(aside / p.name)
    return aside


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "none"
    return str(value)


def flag_name(name: str) -> str:
    """A parameter's flag, as the user types it (``compile_`` is ``--compile``)."""
    return name if name.startswith("--") else "--" + name.rstrip("_").replace("_", "-")


def check_resume(saved: dict | None, given: dict, may_change: Iterable[str], *, folder: Path, command: str,
                 say: Callable[[str], None] | None = None) -> None:
    """A resumed run continues the run as it was made: a flag whose value differs from the saved one is refused
    (one line naming it, with both values), unless ``may_change`` names it, when the run says it differs.
    ``saved`` None: the checkpoint predates recorded flags, so there is nothing to check against."""
    if saved is None:
        return
    if say is None:
        from bertctl.progress import stderr

        say = stderr.print
    may_change = set(may_change)
    for name, value in given.items():
        if name not in saved or saved[name] == value:
            continue
        flag = flag_name(name)
        if name in may_change:
            say(f"resuming with {flag} {_shown(value)} (the run had {_shown(saved[name])})")
            continue
        if _moved(saved[name], value):
            say(f"resuming with {flag} {_shown(value)}: the run's {_shown(saved[name])} is gone or holds the same")
            continue
        raise BertctlError(f"{flag} {_shown(value)}: the {command} run in {folder} was made with {flag} "
                           f"{_shown(saved[name])}, and a resumed run cannot change it; resume with {flag} "
                           f"{_shown(saved[name])}, or start again with --overwrite")


def _fingerprint(path: Path) -> tuple:
    """What a file or folder holds, cheaply: a folder's manifest.json where it has one, else its files' names and
    sizes; a file's size and first and last MiB."""
    if path.is_dir():
        manifest = path / "manifest.json"
        if manifest.is_file():
            return ("manifest", manifest.read_bytes())
        return ("files", tuple(sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())))
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    return ("file", size, head, tail)


def _moved(saved, given) -> bool:
    """Whether a path flag names the run's input moved or copied elsewhere: the saved path is gone and the given
    one exists, or both hold the same (``_fingerprint``); a moved data folder is not another run's data."""
    if not (isinstance(saved, str) and isinstance(given, str) and os.path.isabs(saved) and os.path.isabs(given)):
        return False
    a, b = Path(saved), Path(given)
    if not b.exists():
        return False
    if not a.exists():
        return True
    try:
        return _fingerprint(a) == _fingerprint(b)
    except OSError:
        return False


def flag_values(params: dict) -> dict:
    """A command's parameters as JSON values for ``check_resume``: paths made absolute (a resume from another
    folder names the same files)."""
    out = {}
    for name, value in params.items():
        if isinstance(value, os.PathLike):
            value = str(Path(value).resolve())
        elif isinstance(value, (list, tuple)):
            value = [str(Path(v).resolve()) if isinstance(v, os.PathLike) else v for v in value]
        elif not isinstance(value, (str, int, float, bool, type(None))):
            value = str(value)
        out[name] = value
    return out
