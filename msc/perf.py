"""The garbage-collector pause for the allocation-heavy stages (trace, verify, lower)."""
from __future__ import annotations

import functools
import gc


def pause_gc(fn):
    """Run ``fn`` with the cyclic garbage collector paused.

    These stages allocate millions of small objects that live until the
    stage ends; CPython's collector, triggered by allocation counts, would
    rescan them again and again (it doubled lowering time at 256 ranks).
    Nothing they build forms a reference cycle, so reference counting frees
    it all; the collector is restored on the way out.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper
