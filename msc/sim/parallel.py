"""Simulations of many candidates on the machine's cores, with results that
do not depend on how many there are (msc tune).

A ``Pool`` holds a list of items (msc tune's candidates) and runs
``fn(items[k], *args)`` for a job: in worker processes forked once with the
items (nothing is pickled but the job's index and arguments, and its
result), or in this process where there is one core, no ``fork`` (only
Linux is assumed to fork safely) or too little work to pay for the workers.
Every job is a pure function of its item and arguments (a simulation), so
where it runs changes nothing; the choices that use the results (``drive``)
stay sequential per walk, so a tune's results are the same with any number
of workers (tests/test_tune.py checks it).
"""
from __future__ import annotations

import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, Future, wait

_items: list = []                 # a worker's items (set by _start, inherited through fork)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _start(items: list) -> None:
    """A worker's initializer: keep the items; leave Ctrl-C to the parent,
    which stops the pool (the worker's job ends; no traceback per worker)."""
    global _items
    _items = items
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Failed:
    """A job raised in a worker: the parent runs it again to raise the error
    itself (msc's errors carry context that need not survive pickling)."""


def _call(fn, k: int, args: tuple):
    try:
        return fn(_items[k], *args)
    except Exception:
        return _Failed()


class Pool:
    """Jobs on ``items`` in ``workers`` processes (1: in this process)."""

    def __init__(self, items: list, workers: int):
        self.items = items
        self.index = {id(x): k for k, x in enumerate(items)}
        self.workers = workers if workers > 1 and sys.platform.startswith("linux") else 1
        self._executor = None
        if self.workers > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor     # imports multiprocessing: only when used

            self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                                 initializer=_start, initargs=(items,))

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (jobs not started are dropped) and wait for them."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def submit(self, fn, item, *args) -> Future:
        """``fn(item, *args)`` (``item`` one of the pool's items), as a future;
        in this process it has run when submit returns."""
        if self._executor is not None:
            future = self._executor.submit(_call, fn, self.index[id(item)], args)
            future.job = (fn, item, args)
            return future
        done: Future = Future()
        try:
            done.set_result(fn(item, *args))
        except BaseException as exc:          # raised where the result is read, as from a worker
            done.set_exception(exc)
        return done

    @staticmethod
    def result(future: Future):
        """A submitted job's result; a job that failed in a worker runs again
        here, so its own exception is raised."""
        value = future.result()
        if isinstance(value, _Failed):
            fn, item, args = future.job
            return fn(item, *args)
        return value

    def map(self, fn, items: list, *args):
        """``fn(item, *args)`` per item, the results in order (at most
        2 x workers jobs queued ahead, so a stop cancels little)."""
        queue: list[Future] = []
        ahead = 2 * self.workers
        for k, item in enumerate(items):
            queue.append(self.submit(fn, item, *args))
            if len(queue) > ahead:
                yield self.result(queue.pop(0))
        for f in queue:
            yield self.result(f)


def drive(pool: Pool, walks: list):
    """Run ``walks``, generators that yield a list of jobs ``(fn, item,
    *args)``, receive the list of their results, and return a value, side
    by side: the jobs of every walk run at once on the pool's workers, and
    each walk goes on when its own jobs are done. Yields (walk index,
    value) as walks end, in the order they end; a walk's decisions depend on
    its own results only, so its value does not depend on that order."""
    pending: dict[int, list[Future]] = {}

    def advance(k: int, results):
        try:
            jobs = walks[k].send(results)
        except StopIteration as stop:
            return stop.value, True
        pending[k] = [pool.submit(*job) for job in jobs]
        return None, False

    finished = []
    for k in range(len(walks)):
        value, ended = advance(k, None)
        if ended:
            finished.append((k, value))
    yield from finished
    while pending:
        ready = [k for k, fs in pending.items() if all(f.done() for f in fs)]
        if not ready:
            # wait on the jobs still running only: a walk with some of its jobs done would
            # otherwise return at once, again and again (a busy loop on a core the workers need)
            wait([f for fs in pending.values() for f in fs if not f.done()], return_when=FIRST_COMPLETED)
            continue
        for k in ready:
            results = [pool.result(f) for f in pending.pop(k)]
            value, ended = advance(k, results)
            if ended:
                yield k, value
