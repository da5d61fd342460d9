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


# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead
    of handing it back to the kernel. At scale the numpy passes allocate and
    free arrays of hundreds of MB one after another; by default each is a
    fresh mmap whose pages the kernel zeroes on first touch, and that system
    time was a third of ``msc compile allreduce/hierarchical -n 2048`` (25.8
    of 80 CPU s). Every array now comes from the heap (none is mapped on its
    own), and the heap is never trimmed. For the command line (one command per process); False where
    the C library is not glibc.

    numpy's advice that its arrays of 4 MB and more be backed by huge pages
    is turned off too (unless NUMPY_MADVISE_HUGEPAGE says otherwise): in a
    heap that is reused, with the kernel's THP defrag at "madvise" (Debian's
    default), faults in advised ranges compact memory first, and that was
    4.7 of 6.4 system CPU-s of the 2048-rank hierarchical compile (no_huge_pages)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        most = (1 << 31) - 1                  # mallopt takes an int
        # no mmap at all (M_MMAP_MAX 0: arrays past the threshold too), never trimmed (-1): at 4096 ranks
        # arrays of over 2 GiB, mapped afresh each time, were 6.2 million page faults, 30 of 37 system CPU-s
        kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, most) and libc.mallopt(_M_MMAP_MAX, 0)
                    and libc.mallopt(_M_TRIM_THRESHOLD, -1) and libc.mallopt(_M_TOP_PAD, 64 << 20))
    except (OSError, AttributeError):
        return False
    if kept:
        no_huge_pages()
    return kept


_HUGEPAGE_VARIABLE = "NUMPY_MADVISE_HUGEPAGE"     # numpy reads it when it is imported


def no_huge_pages() -> None:
    """numpy no longer advises huge pages for its arrays (see
    reuse_freed_memory), unless the environment names a choice. Before numpy
    is imported this sets the variable numpy reads (so processes this one
    starts inherit it); after, numpy is told directly."""
    import os
    import sys

    if os.environ.get(_HUGEPAGE_VARIABLE) is not None:
        return
    if "numpy" not in sys.modules:
        os.environ[_HUGEPAGE_VARIABLE] = "0"
        return
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:                   # numpy 1.x
        from numpy.core.multiarray import _set_madvise_hugepage
    _set_madvise_hugepage(False)
