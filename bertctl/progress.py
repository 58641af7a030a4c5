"""One progress helper for every long job, and a JSON-lines metrics log.

Progress bars go to stderr (stdout carries results); metrics go to a JSONL
file so nothing depends on a terminal.
"""
from __future__ import annotations

import json
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

stderr = Console(stderr=True)


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
    """Append-only JSON-lines log: one object per event, with wall time."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._f = None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")

    def log(self, **record) -> None:
        if self._f is None:
            return
        record.setdefault("time", round(time.time(), 3))
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
