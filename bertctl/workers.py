"""The worker processes of the parallel stages (vocabulary counting, data building, tokenising for
``embed`` and SQuAD's contexts): one way to start them, and how many the process may use."""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import multiprocessing.reduction
import os
import signal
import threading
from typing import Callable, Iterator, Sequence

from bertctl.errors import WorkerDied

#: Seconds between checks that every worker lives, while a result is waited for.
POLL = 0.5

#: Characters of text below which tokenising stays in this process (starting workers costs more than it
#: saves): the SQuAD v1.1 train set is about 14 M, the shared split's halves 0.7 M each, SST-2's train set 3.6 M.
PARALLEL_CHARS = 2_000_000


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, which containers narrow), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpus_per_rank() -> int:
    """The usable CPUs shared among the processes torchrun started on this host (``LOCAL_WORLD_SIZE``): each
    rank of a fine-tuning run tokenises its sets itself, and 8 ranks each starting a worker a CPU would start
    8 a CPU."""
    return max(1, usable_cpus() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class WorkerPool(multiprocessing.pool.Pool):
    """multiprocessing's Pool, whose results are waited for through ``wait`` and ``imap_in_order``: they raise
    ``WorkerDied`` once a worker has ended, where the Pool would replace the worker and wait forever for the
    task it took with it (or, for a worker whose start fails, start new ones forever)."""

    def __init__(self, workers: int, initializer: Callable, initargs: tuple, context):
        super().__init__(workers, initializer, initargs, context=context)
        self._first = list(self._pool)  # no worker ends before terminate(): there is no maxtasksperchild

    def _check(self) -> None:
        for worker in self._first:
            code = worker.exitcode  # the pool's own thread reaps it, through this same Process
            if code is None:
                continue
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
                how = f"was killed by {name}" + (" (as the out-of-memory killer does)" if -code == signal.SIGKILL else "")
            else:
                how = f"exited with status {code}"
            raise WorkerDied(f"worker process {worker.pid} {how}, and its task with it; fewer worker processes "
                             "(--workers, where the command has it) need less memory")

    def wait(self, pending: multiprocessing.pool.AsyncResult):
        """``pending.get()``, or ``WorkerDied`` once a worker has ended."""
        while True:
            try:
                return pending.get(timeout=POLL)
            except multiprocessing.TimeoutError:
                self._check()

    def terminate(self) -> None:
        """Stop the workers and the pool's threads. CPython's ``terminate`` reads the task queue only while it
        finds something there, so a task handler that was still pickling a task when the pool stopped writes it
        afterwards and, with a task larger than the pipe holds and no worker left to read it, blocks forever
        (and ``terminate`` with it, joining that thread). Here the handler's last write is read off first."""
        handler = self._task_handler
        stolen = 0  # the handler's end-of-work sentinels read here, which idle workers wait for
        if handler.is_alive():
            # No new workers for those that read the handler's sentinels and end, then no new task for the pipe.
            self._worker_handler._state = multiprocessing.pool.TERMINATE
            handler._state = multiprocessing.pool.TERMINATE
            passed = threading.Event()
            self._taskqueue.put((_set_when_read(passed), None))  # the handler reads this once its write is done
            while handler.is_alive() and not passed.wait(0.05):
                # An idle worker holds the queue's read lock while it waits for a task; a busy one does not.
                if self._inqueue._rlock.acquire(timeout=0.05):
                    try:
                        if self._inqueue._reader.poll(0):
                            stolen += self._inqueue._reader.recv_bytes() == _SENTINEL  # else a task no one runs now
                    finally:
                        self._inqueue._rlock.release()
        for _ in range(stolen):
            # An idle worker holds the read lock until it reads one, and CPython's terminate waits for that lock.
            self._inqueue.put(None)
        super().terminate()

    def imap_in_order(self, fn: Callable, items: Sequence) -> Iterator:
        """``imap(fn, items)``, or ``WorkerDied`` once a worker has ended."""
        results = self.imap(fn, items)
        while True:
            try:
                yield results.next(timeout=POLL)
            except StopIteration:
                return
            except multiprocessing.TimeoutError:
                self._check()


#: The pickled None that tells a worker there is no more work.
_SENTINEL = bytes(multiprocessing.reduction.ForkingPickler.dumps(None))


def _set_when_read(event: threading.Event) -> Iterator:
    """An empty task list that sets ``event`` when the pool's task handler reads it."""
    event.set()
    yield from ()


def _start_worker(initializer: Callable, initargs: tuple) -> None:
    """A worker's signals, then ``initializer(*initargs)``. The main process answers a Ctrl-C (which the
    terminal sends to every worker too) and stops the pool; a worker keeps the default TERM, which is how the
    pool stops it. A fork copies the parent's handlers: under a command's stop guard a worker would note a
    TERM and wait on its queue, and the pool's join would never return."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)  # the guard's wake-up socket belongs to the parent
    initializer(*initargs)


def worker_pool(workers: int, initializer: Callable, initargs: tuple) -> WorkerPool:
    """A pool of ``workers`` processes, each set up by ``initializer(*initargs)``: forked where the
    platform can (the workers inherit the tokenizer and tables without pickling them), else spawned.
    Start it before any progress bar, whose thread a fork would not carry."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    return WorkerPool(workers, _start_worker, (initializer, initargs), ctx)


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
            for part in pool.imap_in_order(_apply_to_chunk, [items[i:i + size] for i in range(0, len(items), size)]):
                out += part
                advance(len(part))
        return out
    finally:
        pool.terminate()
        pool.join()
