"""Progress bars for long work (tune, synthesize, simulate, run and bench
sweeps), on stderr, only where a person watches: stderr is a terminal and
the command's output is not JSON (``quiet``). tqdm draws them: a small,
well-kept library with no dependencies of its own, so msc keeps no
terminal-drawing code; on a non-terminal nothing is written, so logs, pipes
and tests see the output they saw before. tqdm is imported only to draw a
bar: without it, a line says what is being done, and the work runs as it
would on a non-terminal."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar

_quiet: ContextVar[bool] = ContextVar("msc_progress_quiet", default=False)


@contextmanager
def quiet(on: bool = True):
    """No progress inside (e.g. under --json, whose reader wants only JSON)."""
    token = _quiet.set(bool(on) or _quiet.get())
    try:
        yield
    finally:
        _quiet.reset(token)


def shown() -> bool:
    """Whether progress is drawn: stderr is a terminal and nothing asked for quiet."""
    if _quiet.get():
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def steps(iterable, what: str, *, total: int | None = None, unit: str = "it", label=None):
    """``iterable``, drawing a bar named ``what`` (what is being done) on a
    terminal; the bar is removed when the work ends. ``label(item)``: what
    the item about to be worked on is, shown beside the bar."""
    if not shown():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:          # a bare machine (the GPU scripts of bench/ run without it): say what, no bar
        print(f"msc: {what} (no progress bar: tqdm is not installed)", file=sys.stderr, flush=True)
        return iterable

    bar = tqdm(iterable, desc=f"msc: {what}", total=total, unit=unit, file=sys.stderr, leave=False,
               dynamic_ncols=True)
    return bar if label is None else _labelled(bar, label)


def _labelled(bar, label):
    with bar:
        for item in bar:
            bar.set_postfix_str(str(label(item)), refresh=True)
            yield item
