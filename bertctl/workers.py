"""The worker processes of the parallel stages (vocabulary counting, data building, tokenising for
``embed`` and SQuAD's contexts): one way to start them, and how many the process may use."""
from __future__ import annotations

import multiprocessing
import os
from typing import Callable


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, which containers narrow), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_pool(workers: int, initializer: Callable, initargs: tuple):
    """A pool of ``workers`` processes, each set up by ``initializer(*initargs)``: forked where the
    platform can (the workers inherit the tokenizer and tables without pickling them), else spawned.
    Start it before any progress bar, whose thread a fork would not carry."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    return ctx.Pool(workers, initializer=initializer, initargs=initargs)
