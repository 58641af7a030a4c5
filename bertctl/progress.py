"""One progress helper for every long job, and a JSON-lines metrics log.

Progress bars go to stderr (stdout carries results); metrics go to a JSONL
file so nothing depends on a terminal, and to TensorBoard event files when the
``tensorboard`` package is installed.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import queue
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from bertctl.errors import BertctlError

stderr = Console(stderr=True)


def process_age() -> float | None:
    """Wall seconds since this process started, from the kernel's clock (Linux)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 2)


def progress(disable: bool = False) -> Progress:
    """A rich progress bar on stderr; ``task.fields['info']`` shows live metrics."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=stderr,
        disable=disable,
        transient=False,
    )


@contextmanager
def track(description: str, total: int | None, disable: bool = False) -> Iterator:
    """``with track("encode", n) as advance: advance(k, info="...")``."""
    with progress(disable) as bar:
        task = bar.add_task(description, total=total, info="")

        def advance(n: int = 1, info: str | None = None) -> None:
            if info is None:
                bar.advance(task, n)
            else:
                bar.update(task, advance=n, info=info)

        yield advance


class MetricsLog:
    """Append-only JSON-lines log: one object per event, with wall time; TensorBoard events beside it.

    With ``tensorboard`` on (``None``: on when the ``tensorboard`` package is importable) every
    numeric top-level field of a record is also a TensorBoard scalar ``<event>/<key>`` at the
    record's ``step`` (the last step seen when a record has none), in ``<log folder>/tensorboard/``.
    """

    def __init__(self, path: str | Path | None, tensorboard: bool | None = None):
        self.path = Path(path) if path else None
        self._f = None
        self._tb: _TensorBoardWriter | None = None
        self._step = 0
        self._lock = threading.Lock()
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")
            if tensorboard_wanted(tensorboard):
                self._tb = _TensorBoardWriter(self.path.parent / "tensorboard")

    @property
    def tensorboard_dir(self) -> Path | None:
        return self._tb.logdir if self._tb else None

    def log(self, **record) -> None:
        """Append one record (safe from several threads: a background checkpoint logs when it is done)."""
        with self._lock:
            if self._f is None:
                return
            record.setdefault("time", round(time.time(), 3))
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
            if self._tb is not None:
                step = record.get("step")
                if isinstance(step, int) and not isinstance(step, bool):
                    self._step = step
                self._tb.put(record, self._step)

    def close(self) -> None:
        with self._lock:
            if self._tb:
                self._tb.close()
                self._tb = None
            if self._f:
                self._f.close()
                self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tensorboard_wanted(switch: bool | None) -> bool:
    """``None``: on when ``tensorboard`` is importable; ``True`` without it is an error."""
    if switch is False:
        return False
    available = importlib.util.find_spec("tensorboard") is not None
    if switch and not available:
        raise BertctlError("TensorBoard logging needs the tensorboard package: pip install tensorboard "
                           "(or pass --no-tensorboard)")
    return available


class _TensorBoardWriter:
    """Scalars to a TensorBoard event file, off the caller's thread.

    ``put`` only queues the record (a few µs); a daemon thread turns each record into one
    ``Event`` holding all its scalars and hands it to tensorboard's ``EventFileWriter``, which
    appends and flushes (every ``flush_secs``) from its own thread.  torch's ``SummaryWriter``
    builds one event per scalar in the caller's thread, about 0.1 ms each.
    """

    def __init__(self, logdir: Path, flush_secs: float = 10.0):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = logdir
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir), flush_secs=flush_secs)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="bertctl-tensorboard", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a run that never closes its log still keeps what it queued

    def put(self, record: dict, step: int) -> None:
        if self._error is None:
            self._queue.put((record, step))

    def _run(self) -> None:
        Value = self._summary.Value
        while (item := self._queue.get()) is not None:
            record, step = item
            event = record.get("event") or "metrics"
            values = [Value(tag=f"{event}/{key}", simple_value=float(v)) for key, v in record.items()
                      if key not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)]
            if not values:
                continue
            try:
                self._writer.add_event(self._event(wall_time=record["time"], step=step,
                                                   summary=self._summary(value=values)))
            except Exception as e:  # a full disk must not stop training; metrics.jsonl still has it all
                self._error = e
                stderr.print(f"[yellow]TensorBoard logging stopped: {e}")
                return

    def close(self) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        atexit.unregister(self.close)
        try:
            self._writer.close()  # flushes
        except Exception:
            if self._error is None:
                raise
