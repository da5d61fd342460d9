"""Files msc writes, whole or not at all, and files it reads, bounded.

``write_atomic`` writes a temporary file in the same folder and renames it
over the target, so a concurrent reader sees the old file or the new one,
never part of one, and a failed write leaves the old file as it was. Every
file msc writes for its user (plans, MSCCL XML, plans.json) goes through
``write_output``; the caches use ``write_atomic`` (the kernel caches sign
their entries: msc.cuda.kcache).

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
from contextlib import contextmanager, suppress
from pathlib import Path

from msc.errors import MscError, UsageError

# O_NONBLOCK: opening a FIFO with no writer returns at once (and is then refused) instead of waiting
_OPEN = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def write_atomic(path: str | Path, data, *, mode: int | None = None, dir_fd: int | None = None) -> None:
    """``data`` (bytes, or an iterable of bytes: a writer that streams) into
    ``path`` through a temporary file beside it and a rename.
    ``mode``: the new file's permission bits (default: 0o666 less the umask).
    ``dir_fd``: ``path`` is a name in that open folder (msc.verification.cache's cache
    reaches its files without following links)."""
    head, base = os.path.split(os.fspath(path))
    tmp = os.path.join(head, f".{base[:120]}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, _CREATE, 0o600 if mode is not None else 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as out:
            if mode is not None and hasattr(os, "fchmod"):
                os.fchmod(out.fileno(), mode)
            _write_all(out, data)
        os.replace(tmp, os.fspath(path), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _write_all(out, data) -> None:
    if isinstance(data, (bytes, bytearray, memoryview)):
        out.write(data)
    else:
        for piece in data:
            out.write(piece)


def write_output(path: str | Path, data) -> Path:
    """A file the user named (``-o``), written atomically: ``data`` is text,
    bytes or an iterable of bytes (written piece by piece). A symbolic link is
    written through (its target is replaced, the link stays); a file that
    exists keeps its permission bits; a target that is not a regular file
    (``/dev/stdout``, a pipe) is written in place, as it cannot be renamed over."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    try:
        if st is not None and not stat.S_ISREG(st.st_mode):
            with open(target, "wb") as out:      # a full device fails on close: no file name then
                _write_all(out, data)
        else:
            write_atomic(target, data, mode=None if st is None else stat.S_IMODE(st.st_mode))
    except OSError as exc:       # name the file asked for, not the temporary beside it
        if exc.errno is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None
    return path


@contextmanager
def folder_lock(folder: str | Path):
    """An exclusive lock on ``folder`` for a read-merge-write of files in it
    (plans.json: two writers would each keep only what they read), held until
    the block ends or the process dies: fcntl.flock on the folder itself, so
    nothing is left in it; on a file system that does not lock folders, on a
    ``.msc.lock`` file in it. None without fcntl (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            fd = os.open(os.path.join(folder, ".msc.lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                   # releases the lock


def others_can_change(path: str | Path) -> str | None:
    """Why a user other than this one (or root) can change the file or
    folder ``path`` names, links followed, or None: it is writable by its
    group or by others, or another user owns it (the kernel cache's rule
    for its own folders, msc.cuda.hostbuild._private). None where the
    platform has no users (no os.getuid) or it cannot be read."""
    if not hasattr(os, "getuid"):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_mode & 0o022:
        return f"writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_uid not in (os.getuid(), 0):
        return f"owned by user {st.st_uid}"
    return None


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``b`` names the file ``a`` (the same path, or a symbolic or
    hard link to it): writing ``b`` would overwrite ``a``."""
    try:
        return os.path.samefile(a, b)
    except OSError:              # one of them does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


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
