"""Fault injection for the fault-injection tests: named points in every command's work where a test may
deliver a signal or a full disk, so that each phase's recovery is tested, not assumed.

A run reads ``BERTCTL_FAULT`` once, as ``POINT[@N]:KIND``: at the N-th time (default the first) the code
reaches ``point(POINT)``, the process gets ``KIND``:

- ``SIGINT``, ``SIGTERM``, ``SIGKILL``: that signal, sent to the process itself (its handlers then run as
  they would for a user's Ctrl-C, a scheduler's TERM or an OOM killer's KILL);
- ``SIGINT2``: two SIGINTs, the second once the first's handler has run (a user pressing Ctrl-C twice);
- ``ENOSPC``: ``point`` raises the OSError a full disk gives, as the write at that point would.

Points (each command reaches those of its phases):

===================  ==============================================================
``start``            the command has checked its inputs and claimed its folder; no work done
``step``             inside a training step (the step's work is issued, not finished)
``checkpoint``       a checkpoint's files are written under their temporary name, not yet renamed
``eval``             between two batches of an evaluation
``final-save``       the final model's files are written under their temporary name, not yet renamed
``shard``            ``build-data``: between two shards
``write``            ``build-data`` / ``embed``: an output file written, not yet renamed
``batch``            ``embed``: between two batches
===================  ==============================================================

Unset (every real run), ``point`` costs one dictionary lookup.
"""
from __future__ import annotations

import errno
import os
import signal
import time

ENV = "BERTCTL_FAULT"
KINDS = ("SIGINT", "SIGTERM", "SIGKILL", "SIGINT2", "ENOSPC")
POINTS = ("start", "step", "checkpoint", "eval", "final-save", "shard", "write", "batch")

_hits: dict[str, int] = {}


def _parse(spec: str) -> tuple[str, int, str]:
    where, _, kind = spec.partition(":")
    name, _, nth = where.partition("@")
    if name not in POINTS or kind not in KINDS or (nth and not nth.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected POINT[@N]:KIND, POINT one of {', '.join(POINTS)}, "
                         f"KIND one of {', '.join(KINDS)}")
    return name, int(nth or 1), kind


def point(name: str) -> None:
    """Deliver the configured fault if this is its point and its N-th arrival; otherwise nothing."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, nth, kind = _parse(spec)
    if name != target:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != nth:
        return
    if kind == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if kind == "SIGINT2":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the first signal's handler runs in the main thread meanwhile
        os.kill(os.getpid(), signal.SIGINT)
        return
    os.kill(os.getpid(), getattr(signal, kind))
