"""The worker processes of the parallel stages (vocabulary counting, data building, tokenising for
``embed`` and SQuAD's contexts): one way to start them, and how many the process may use."""
from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Sequence


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, which containers narrow), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_pool(workers: int, initializer: Callable, initargs: tuple):
    """A pool of ``workers`` processes, each set up by ``initializer(*initargs)``: forked where the
    platform can (the workers inherit the tokenizer and tables without pickling them), else spawned.
    Start it before any progress bar, whose thread a fork would not carry."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    return ctx.Pool(workers, initializer=initializer, initargs=initargs)


_worker_fn: Callable | None = None


def _set_worker_fn(fn: Callable) -> None:
    global _worker_fn
    _worker_fn = fn


def _apply_to_chunk(chunk: list) -> list:
    return [_worker_fn(x) for x in chunk]


def map_in_order(fn: Callable, items: Sequence, *, workers: int, label: str, progress: bool = False) -> list:
    """``[fn(x) for x in items]`` in ``workers`` processes, 8 chunks a worker, the results in input order
    (so they do not depend on the number of workers); here when ``workers`` <= 1. A forked worker gets
    ``fn`` (a tokenizer and all) at its start, unpickled; the items and results travel pickled."""
    from bertctl.progress import track

    items = list(items)
    if workers <= 1 or len(items) < 2:
        out = []
        with track(label, len(items), disable=not progress) as advance:
            for x in items:
                out.append(fn(x))
                advance(1)
        return out
    size = -(-len(items) // (8 * workers))
    pool = worker_pool(workers, _set_worker_fn, (fn,))  # before the progress bar's thread
    try:
        out = []
        with track(label, len(items), disable=not progress) as advance:
            for part in pool.imap(_apply_to_chunk, [items[i:i + size] for i in range(0, len(items), size)]):
                out += part
                advance(len(part))
        return out
    finally:
        pool.terminate()
        pool.join()
