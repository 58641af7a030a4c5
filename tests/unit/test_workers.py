"""The worker pool of the parallel stages: a worker that dies (the out-of-memory killer's KILL) or cannot start
is an error, not a wait forever for the task it took with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bertctl.errors import WorkerDied
from bertctl.workers import map_in_order, worker_pool


def _nothing() -> None:
    pass


def _square_or_die(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x * x


def _fail_to_start() -> None:
    raise SystemExit(3)


def test_results_come_back_in_order_while_every_worker_lives():
    pool = worker_pool(2, _nothing, ())
    try:
        assert [pool.wait(pool.apply_async(_square_or_die, (x,))) for x in (1, 2)] == [1, 4]
        assert list(pool.imap_in_order(_square_or_die, [5, 6, 7])) == [25, 36, 49]
    finally:
        pool.terminate()
        pool.join()


@pytest.mark.parametrize("how", ["wait", "imap"])
def test_a_killed_worker_is_an_error_naming_it(how):
    pool = worker_pool(2, _nothing, ())
    start = time.monotonic()
    try:
        with pytest.raises(WorkerDied, match=r"worker process \d+ was killed by SIGKILL \(as the out-of-memory "
                                             r"killer does\), and its task with it"):
            if how == "wait":
                pool.wait(pool.apply_async(_square_or_die, (3,)))
            else:
                list(pool.imap_in_order(_square_or_die, [1, 2, 3, 4]))
    finally:
        pool.terminate()
        pool.join()
    assert time.monotonic() - start < 30


def test_a_worker_that_cannot_start_is_an_error():
    pool = worker_pool(2, _fail_to_start, ())
    try:
        with pytest.raises(WorkerDied, match="exited with status 3"):
            pool.wait(pool.apply_async(_square_or_die, (1,)))
    finally:
        pool.terminate()
        pool.join()


def test_map_in_order_raises_for_a_killed_worker():
    with pytest.raises(WorkerDied):
        map_in_order(_square_or_die, list(range(8)), workers=2, label="squares")
    assert map_in_order(_square_or_die, [1, 2, 4], workers=2, label="squares") == [1, 4, 16]


def test_workers_under_a_runs_stop_guard_neither_hang_nor_signal_the_run():
    """A run's stop guard notes a TERM and goes on, and wakes its watcher through a socket. Forked workers must
    inherit neither: a pool stopped before its workers take their end-of-work marks (here they are still
    starting) stops them with TERM, which would leave them waiting on their queue, the pool's join never
    returning, and would reach the run's watcher as a TERM sent to the run."""
    code = ("import time\n"
            "from bertctl.train.engine import StopSignal\n"
            "from bertctl.workers import worker_pool\n"
            "with StopSignal() as stop:\n"
            "    pool = worker_pool(2, time.sleep, (2.0,))\n"
            "    time.sleep(0.5)\n"
            "    pool.terminate()\n"
            "    pool.join()\n"
            "    time.sleep(0.5)  # the watcher thread's time to read what the workers' handlers wrote\n"
            "    print(stop.requested)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None"], r.stdout + r.stderr


def test_ranks_on_one_host_share_its_cpus(monkeypatch):
    """Each of torchrun's ranks tokenises its own sets: together they start a worker a usable CPU, not one each."""
    from bertctl import workers

    monkeypatch.setattr(workers, "usable_cpus", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert workers.cpus_per_rank() == 16
    for ranks, each in (("1", 16), ("2", 8), ("3", 5), ("32", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert workers.cpus_per_rank() == each


class SlowToPickle:
    """A task argument whose pickling takes a while and whose pickle is more than a pipe holds: the pool's task
    handler is then still pickling it when the pool stops, and writes it afterwards."""

    def __reduce__(self):
        time.sleep(1)
        return bytes, (b"x" * (1 << 20),)


def _len(data: bytes) -> int:
    return len(data)


def test_a_pool_stopped_while_a_large_task_is_on_its_way_stops():
    pool = worker_pool(1, _nothing, ())
    pool.apply_async(time.sleep, (60,))  # the one worker is busy, so no worker reads the next task
    pool.apply_async(_len, (SlowToPickle(),))
    stopper = threading.Thread(target=lambda: (pool.terminate(), pool.join()), daemon=True)
    stopper.start()
    stopper.join(timeout=60)
    assert not stopper.is_alive(), "terminate() blocked on the task handler's write"


@pytest.mark.parametrize("attempt", range(3))
def test_a_pool_stopped_with_tasks_not_yet_handed_out_stops(attempt):
    """The task handler stops at the next task and sends each worker its end-of-work mark; the workers that
    read them end, and must not be replaced by new ones that would wait for a task with the queue's lock
    held (CPython's terminate waits for that lock)."""
    pool = worker_pool(2, _nothing, ())
    assert pool.wait(pool.apply_async(_len, (b"ab",))) == 2  # the workers are up, idle, one holding the lock
    for _ in range(4):
        pool.apply_async(_len, (b"abc",))  # queued, and stopped before the handler hands them all out
    stopper = threading.Thread(target=lambda: (pool.terminate(), pool.join()), daemon=True)
    stopper.start()
    stopper.join(timeout=30)
    assert not stopper.is_alive(), "terminate() waited for a worker started after the pool stopped"
