"""Skip mark for tests that need the emulated device's host C++ compiler."""
from __future__ import annotations

import functools

import pytest


@functools.cache
def host_compiler_missing() -> str | None:
    """None when msc's emulated device finds a C++20 compiler; else why not."""
    from msc.cuda.hostbuild import find_compiler
    from msc.errors import UsageError

    try:
        find_compiler()
    except UsageError as exc:
        return str(exc)
    return None


needs_emu = pytest.mark.skipif(host_compiler_missing() is not None,
                               reason=f"the emulated device needs a C++20 compiler: {host_compiler_missing()}")
