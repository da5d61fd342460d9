"""Limits that a loaded machine cannot trip (issue 40, item 2).

A test that waits for something (a process, a thread, a pool's answer) gives
up after a number of seconds only to turn a hang into a failure; a test that
checks that work is fast bounds its cost. Neither may fail because other
work shares the cores:

- ``cpu_seconds()`` is this process's CPU time (user + system, its waited-for
  children included): work measured with it costs the same on a loaded machine.
  ``cpu_budget(s)`` raises ``OverBudget`` in code that burns ``s`` CPU-seconds
  (a hang that spins: a parser or verifier in a loop).
- ``patience(s)`` is ``s`` seconds of a quiet machine as wall seconds now: ``s``
  times the load per core (the 1-minute load average over the cores this
  process may use), at least ``s``. ``Waiter(s)`` keeps that account over a
  wait, re-reading the load as it goes.
"""
from __future__ import annotations

import os
import resource
import signal
import time
from contextlib import contextmanager


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_factor() -> float:
    """How many times slower than on a quiet machine wall time passes for a process now (>= 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        return max(1.0, os.getloadavg()[0] / max(1, cores))
    except OSError:
        return 1.0


def patience(seconds: float) -> float:
    """``seconds`` of a quiet machine, in wall seconds at the present load."""
    return seconds * load_factor()


class Waiter:
    """An account of quiet-machine seconds spent waiting: each slice of wall time counts
    divided by the load factor of its moment; ``expired`` once ``seconds`` are spent."""

    def __init__(self, seconds: float):
        self.seconds, self.spent, self._last = seconds, 0.0, time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        self.spent += (now - self._last) / load_factor()
        self._last = now

    @property
    def expired(self) -> bool:
        self.tick()
        return self.spent >= self.seconds

    def slice(self, step: float = 1.0) -> float:
        """The next wall-clock wait: ``step``, or what is left if less."""
        self.tick()
        return max(0.01, min(step, (self.seconds - self.spent) * load_factor()))


def join(thread_or_process, seconds: float, step: float = 1.0) -> bool:
    """``join`` a thread or multiprocessing.Process for ``seconds`` of quiet-machine time;
    whether it ended."""
    waiter = Waiter(seconds)
    while not waiter.expired:
        thread_or_process.join(waiter.slice(step))
        if not thread_or_process.is_alive():
            return True
    return not thread_or_process.is_alive()


class OverBudget(Exception):
    pass


@contextmanager
def cpu_budget(seconds: float):
    """Raise OverBudget in this (main) thread once the process has used ``seconds`` more CPU
    time (ITIMER_PROF: user + system, every thread); a block waiting on nothing does not count."""
    def expired(signum, frame):
        raise OverBudget(f"over {seconds} CPU-seconds")
    old = signal.signal(signal.SIGPROF, expired)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)
