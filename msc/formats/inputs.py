"""Files msc reads for its user: whole, regular and of bounded size.

Every reader of a user's file (plans and MSCCL XML, TOML topologies and
calibrations, plans.json, algorithm sources) takes its bytes from
``read_input``, which refuses, before reading, what is not a regular file
(``/dev/zero``, a FIFO, a folder, a link to one of them) and a file over its
kind's size (msc.ir.limits: MAX_PLAN_FILE_BYTES, MAX_TEXT_FILE_BYTES), so a
wrong path is an exit-2 error naming the file, never a hang, the OOM killer
or a MemoryError.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from msc.errors import MscError, UsageError

# O_NONBLOCK: opening a FIFO with no writer returns at once (and is then refused) instead of waiting
_OPEN = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def read_input(path: str | Path, limit: int, *, what: str = "file", error: type[MscError] = UsageError,
               head: int | None = None) -> bytes:
    """The bytes of ``path`` (its first ``head`` bytes, if given), a regular
    file of at most ``limit`` bytes; else ``error`` naming the file (``what``
    says what it was to be: "plan", "topology")."""
    path = Path(path)
    try:
        fd = os.open(path, _OPEN)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise error(f"cannot read {what} {path}: it is {kind}, not a regular file")
        if head is None and st.st_size > limit:
            raise error(f"cannot read {what} {path}: it has {st.st_size} bytes, over msc's limit of {limit}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1 if head is None else head)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:                 # it grew after fstat
        raise error(f"cannot read {what} {path}: it has over {limit} bytes, msc's limit")
    return data
