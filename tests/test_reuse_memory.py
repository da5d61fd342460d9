"""msc.perf.reuse_freed_memory: the command line's malloc keeps freed
memory, so a large array freed and allocated again costs no new page
faults (each a page the kernel zeroes: a third of the CPU time of the
largest compiles). Run in a child process: it changes the process's malloc."""
from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = r"""
import resource, sys
import numpy as np
from msc.perf import reuse_freed_memory

if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(int(sys.argv[2]), dtype=np.int8)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del a
print(faults[0], min(faults[1:]))
"""


def _faults(mode: str, size: int = 32 << 20) -> tuple[int, int]:
    """(page faults of the first allocation of ``size`` bytes, the fewest of the next three)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(size)], capture_output=True, text=True,
                         check=True)
    first, again = map(int, out.stdout.split())
    return first, again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_array_is_reused_without_new_page_faults():
    # 32 MiB: past glibc's largest default mmap threshold
    (_, default), (_, reused) = _faults("default"), _faults("reuse")
    assert default >= 16                         # a fresh mapping each time: 16 huge pages of 2 MiB at the fewest
    assert reused <= default // 8, (default, reused)       # the freed heap memory taken again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_an_array_past_2_gib_is_reused_too():
    """mallopt's thresholds are ints: an array past 2 GiB would be mapped
    afresh each time but for M_MMAP_MAX 0 (the 4096-rank verifiers' largest)."""
    first, again = _faults("reuse", (2 << 30) + (64 << 20))
    assert first >= 1000 and again <= first // 8, (first, again)


def test_only_the_command_line_process_changes_its_malloc(monkeypatch):
    from msc.cli import main as cli

    calls = []
    monkeypatch.setattr(cli, "reuse_freed_memory", lambda: calls.append(1))
    assert cli.main(["list"]) == 0               # main([...]) inside another program: left as it is
    assert calls == []


_HUGE_CHILD = r"""
import os, sys
from msc.perf import no_huge_pages

if sys.argv[1] == "after":
    import numpy
no_huge_pages()
import numpy
try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:
    from numpy.core.multiarray import _set_madvise_hugepage
print(int(_set_madvise_hugepage(False)), os.environ.get("NUMPY_MADVISE_HUGEPAGE"))   # (the advice it had)
"""


def _advice(when: str, env: dict) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", _HUGE_CHILD, when], capture_output=True, text=True, check=True,
                         env=env)
    return tuple(out.stdout.split())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="numpy advises huge pages on Linux only")
@pytest.mark.parametrize("when", ["before", "after"])      # numpy imported before no_huge_pages() or after
def test_numpy_advises_no_huge_pages_unless_the_environment_says(when):
    import os

    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    assert _advice(when, env) == ("0", "0" if when == "before" else "None")
    assert _advice(when, {**env, "NUMPY_MADVISE_HUGEPAGE": "1"}) == ("1", "1")     # the user's choice stays
