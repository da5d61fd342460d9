"""Stages run inside a time budget that nothing can overrun or lose (the
machinery of bench/first_gpu_run.py, which a rare GPU window runs once).

- Time is shared in stage order: a stage may take up to its ``max_s``, as
  long as every later stage keeps its ``min_s``; when the budget is short,
  the time left is split in proportion to the ``min_s`` of the stages still
  to run. What a stage leaves unused goes to the later ones.
- A stage's deadline is an alarm (SIGALRM, ``setitimer``) that raises
  ``Capped`` in the main thread wherever it is: a BaseException, so an
  ``except Exception`` in the work (a case that records failures) cannot
  swallow it. Writes of the record defer it (``Alarm.quiet``) so no line is
  torn.
- Every case is a line of ``cases.jsonl``, flushed and synced as it ends;
  ``summary.json`` (and ``summary.txt``) is rewritten after every stage, at
  the end, and on SIGTERM or SIGINT (``Interrupted``), so a run killed at
  any point still says what it proved.
- A watchdog thread covers a main thread stuck in a C call (a hung driver
  call holds no Python frame where an alarm could land): it learns of a
  signal through ``signal.set_wakeup_fd`` at once, and at ``budget_s +
  HANG_S`` or ``SIGNAL_GRACE_S`` after a signal it writes the summary itself,
  dumps every thread's stack to stderr and exits the process.
  ``faulthandler.dump_traceback_later`` exits a few seconds later still,
  from a C thread, should even the watchdog not get the interpreter.
So a run ends within ``budget_s + FINAL_S`` seconds whatever happens.
"""
from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HANG_S = 18.0            # past the budget: the watchdog ends a run whose main thread is stuck
SIGNAL_GRACE_S = 8.0     # after SIGTERM/SIGINT: how long the main thread has to write and exit
FINAL_S = 26.0           # past the budget: faulthandler's exit, the last resort
EXIT_HUNG = 124          # as timeout(1) exits: the run did not end in time by itself


class Capped(BaseException):
    """The stage's share of the budget is spent (raised by the alarm, anywhere in the main thread)."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived: the run stops, writing what it has."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class StageSpec:
    """A stage: its body (called with its Stage; may return a dict for the summary) and its time."""

    name: str
    body: Callable
    min_s: float
    max_s: float


def stage_cap(specs: list[StageSpec], i: int, left: float) -> float:
    """Seconds stage ``i`` may take of the ``left`` the run still has (module doc)."""
    rest = sum(s.min_s for s in specs[i + 1:])
    share = left * specs[i].min_s / (specs[i].min_s + rest) if specs[i].min_s + rest > 0 else left
    return max(0.0, min(specs[i].max_s, max(share, left - rest), left))


class Alarm:
    """SIGALRM at a deadline raises Capped in the main thread, except inside ``quiet()``, where it
    (and an interrupt) waits for the end of the block."""

    def __init__(self, install: bool = True):
        self.what, self.depth, self.pending = "", 0, None
        if install:                       # a test's stage needs no handlers
            signal.signal(signal.SIGALRM, self._fire)
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._interrupt)

    def arm(self, seconds: float, what: str) -> None:
        self.what = what
        if isinstance(self.pending, Interrupted):      # still to be delivered: at once
            seconds = 0.0
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))

    def disarm(self) -> None:
        """No alarm, and no cap left pending (an interrupt stays: the next arm delivers it)."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        if not isinstance(self.pending, Interrupted):
            self.pending = None

    def _fire(self, signum, frame):
        self._deliver(self.pending or Capped(self.what), frame)

    def _interrupt(self, signum, frame):
        self._deliver(Interrupted(signum), frame)

    def _deliver(self, exc: BaseException, frame):
        """Raise ``exc`` here, unless inside ``quiet()`` (then at its end) or inside an import: a module
        cut off halfway stays broken for the rest of the run (torch does), so the alarm tries again
        50 ms later, until the import is done."""
        if not isinstance(self.pending, Interrupted):            # an interrupt outranks a cap
            self.pending = exc
        if self.depth:
            return
        if _importing(frame):
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        exc, self.pending = self.pending, None
        raise exc

    @contextmanager
    def quiet(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                exc, self.pending = self.pending, None
                raise exc


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


class Record:
    """What a run has established, on disk as it goes: ``cases.jsonl`` (a line per case, synced) and
    ``summary.json``/``summary.txt`` (rewritten whole, atomically). ``text(summary) -> str`` renders
    the summary for people."""

    def __init__(self, out: Path, meta: dict, text: Callable[[dict], str]):
        self.out, self.meta, self.text = out, dict(meta), text
        self.lock = threading.RLock()
        self.stages: dict[str, dict] = {}
        self.extra: dict = {}
        self.current: tuple[str, str] | None = None       # (stage, case) running now, for a hang report
        self.start = time.time()
        self._cases = open(out / "cases.jsonl", "a", buffering=1, encoding="utf-8")

    def case(self, stage: str, rec: dict) -> None:
        with self.lock:
            self._cases.write(json.dumps({"stage": stage, **rec}, default=str) + "\n")
            self._cases.flush()
            os.fsync(self._cases.fileno())

    def summary(self, ended: str, passed: bool | None = None) -> dict:
        with self.lock:
            stages = {name: dict(st) for name, st in self.stages.items()}
            if passed is None:
                passed = bool(stages) and all(st["status"] in ("pass", "skipped") for st in stages.values())
            data = {**self.meta, "ended": ended, "complete": ended == "finished", "passed": passed,
                    "seconds": round(time.time() - self.start, 1), "running": self.current,
                    "stages": stages, **self.extra}
            _write_atomic(self.out / "summary.json", json.dumps(data, indent=1, default=str))
            _write_atomic(self.out / "summary.txt", self.text(data))
            return data

    def close(self) -> None:
        self._cases.close()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Stage:
    """One stage under way: its cases (name, ok, seconds, detail), each recorded as it ends."""

    def __init__(self, record: Record, alarm: Alarm, name: str, cap_s: float):
        self.record, self.alarm, self.name, self.cap = record, alarm, name, cap_s
        self.t0, self.started = time.monotonic(), time.time()
        self.cases: list[dict] = []
        self.status, self.error = "pass", None

    def left(self) -> float:
        return self.cap - (time.monotonic() - self.t0)

    def case(self, name: str, fn, *args, **kw) -> bool:
        """Run one case; a failure is recorded (and the stage fails), not raised; Capped and
        Interrupted are recorded as the case cut off, then raised on."""
        if self.left() <= 0:
            raise Capped(f"{self.name}: its {self.cap:.0f} s were spent before {name}")
        t0 = time.monotonic()
        self.record.current = (self.name, name)
        try:
            detail, ok = fn(*args, **kw), True
        except (Capped, Interrupted) as exc:
            self._cut(name, exc, t0)
            raise
        except Exception as exc:        # a wrong result, a device error: the record says which
            cut = _cause(exc, (Capped, Interrupted))
            if cut is not None:         # wrapped on the way (msc's tracer makes user code's errors its own)
                self._cut(name, cut, t0)
                raise cut from None
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            self.record.current = None
        self._add({"case": name, "ok": ok, "seconds": _since(t0), "detail": detail})
        if not ok:
            self.status = "fail"
        return ok

    def _cut(self, name: str, exc: BaseException, t0: float) -> None:
        self._add({"case": name, "ok": None, "cut": type(exc).__name__, "seconds": _since(t0),
                   "detail": f"cut off: {exc}"})

    def skip(self, name: str, why: str) -> None:
        self._add({"case": name, "ok": None, "seconds": 0.0, "detail": f"skipped: {why}"})

    def log(self, line: str) -> None:
        self._add({"case": "log", "ok": None, "detail": line})

    def _add(self, rec: dict) -> None:
        with self.alarm.quiet():
            self.cases.append(rec)
            self.record.case(self.name, rec)

    def summary(self) -> dict:
        counted = [c for c in self.cases if c["case"] != "log"]
        return {"status": self.status, "started": round(self.started, 3),
                "seconds": round(time.monotonic() - self.t0, 1), "cap_s": round(self.cap, 1),
                "error": self.error, "passed": sum(1 for c in counted if c["ok"]),
                "failed": sum(1 for c in counted if c["ok"] is False),
                "skipped": sum(1 for c in counted if c["ok"] is None and "cut" not in c),
                "cut": sum(1 for c in counted if "cut" in c),
                "failures": [f"{c['case']}: {c['detail']}" for c in counted if c["ok"] is False][:10]}


def _cause(exc: BaseException, kinds: tuple) -> BaseException | None:
    """The first of ``kinds`` in ``exc``'s chain of causes and contexts, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kinds):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 3)


class Runner:
    """Runs StageSpecs inside ``budget_s`` (module doc), writing ``record`` as it goes."""

    def __init__(self, record: Record, budget_s: float, log=print, hang_s: float = HANG_S):
        self.record, self.budget_s, self.log, self.hang_s = record, float(budget_s), log, hang_s
        self.start = time.monotonic()
        self.deadline = self.start + self.budget_s
        self.alarm = Alarm()
        self.done = threading.Event()
        self._watchdog()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, specs: list[StageSpec]) -> str:
        """Every stage in turn; how the run ended: "finished", "budget" (stages left unrun) or the
        interrupting signal's name (Interrupted is caught here, after the summary is written)."""
        ended = "finished"
        try:
            for i, spec in enumerate(specs):
                left = self.left()
                if left < 0.1:
                    for later in specs[i:]:
                        self.record.stages[later.name] = {"status": "not run", "error": "the budget was spent",
                                                          "seconds": 0.0, "cap_s": 0.0}
                    ended = "budget"
                    break
                self._stage(spec, stage_cap(specs, i, left))
        except Interrupted as exc:
            ended = exc.args[0]
            for later in specs:
                self.record.stages.setdefault(later.name, {"status": "not run", "error": f"{ended} arrived first",
                                                           "seconds": 0.0, "cap_s": 0.0})
        return ended

    def _stage(self, spec: StageSpec, cap: float) -> None:
        stage = Stage(self.record, self.alarm, spec.name, cap)
        self.log(f"== {spec.name} (cap {cap:.0f} s; {time.monotonic() - self.start:.0f} s of {self.budget_s:.0f} "
                 f"so far)")
        try:
            self.alarm.arm(cap, f"{spec.name}: its {cap:.0f} s are spent")
            got = spec.body(stage)
            if isinstance(got, dict):
                self.record.extra[spec.name] = got
        except Capped as exc:
            stage.status, stage.error = "capped", str(exc)
        except Interrupted as exc:
            stage.status, stage.error = "interrupted", f"{exc.args[0]} arrived"
            raise
        except Exception as exc:                   # a stage that breaks is recorded; the next still runs
            stage.status, stage.error = "fail", traceback.format_exc()[-3000:]
            self.log(f"   {spec.name}: {type(exc).__name__}: {exc}")
        finally:
            self.alarm.disarm()
            with self.alarm.quiet():
                self.record.stages[spec.name] = stage.summary()
                self.record.summary("running")
            self.log(f"   {spec.name}: {stage.status} in {self.record.stages[spec.name]['seconds']} s")

    def finish(self, ended: str) -> dict:
        """The final summary; the watchdog stands down. Signals from here on are held for good: the
        process ends right after (a SIGTERM now only waits for the summary's few milliseconds)."""
        self.alarm.depth += 1
        try:
            return self.record.summary(ended)
        finally:
            self.done.set()
            faulthandler.cancel_dump_traceback_later()
            self.record.close()

    # -- the watchdog -------------------------------------------------------------------------------
    def _watchdog(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        faulthandler.dump_traceback_later(self.budget_s + max(FINAL_S, self.hang_s + FINAL_S - HANG_S), exit=True)
        threading.Thread(target=self._watch, args=(read,), name="budget-watchdog", daemon=True).start()

    def _watch(self, read: int) -> None:
        hard = self.deadline + self.hang_s
        while not self.done.is_set():
            wait = hard - time.monotonic()
            if wait <= 0:
                return self._give_up(f"hung: still running {self.record.current} {self.hang_s:.0f} s past the "
                                     f"budget", EXIT_HUNG)
            ready, _, _ = select.select([read], [], [], min(wait, 1.0))
            if not ready:
                continue
            for byte in os.read(read, 64):
                if byte in (signal.SIGTERM, signal.SIGINT) and not self.done.wait(SIGNAL_GRACE_S):
                    return self._give_up(f"{signal.Signals(byte).name}: the main thread did not stop within "
                                         f"{SIGNAL_GRACE_S:.0f} s (in {self.record.current})", 128 + byte)

    def _give_up(self, ended: str, code: int) -> None:
        if self.done.is_set():
            return
        print(f"budgeted: {ended}; stacks follow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        try:
            if self.record.lock.acquire(timeout=2.0):
                self.record.summary(ended, passed=False)
        finally:
            os._exit(code)
