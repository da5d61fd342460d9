"""The kernel caches' entries: rendered sources, cubins, tables, emulated
device libraries and precompiled headers, under ``$MSC_CACHE_DIR``.

An entry is a file and a sidecar ``NAME.mac`` holding an HMAC-SHA256, under
the user's cache key (the verified-plan cache's ``verified/key``:
msc.verification.cache.user_key), of the entry's path inside the cache and
its bytes. So a hit is a file this user's msc wrote at that very place: an
empty, torn or altered file, one copied from another entry, or one that
someone who can write to the cache folder but cannot read the key planted
(with any digest they can compute) is a miss, and the caller builds the
entry again. A reader gets the bytes it checked, and uses only those: a
library is loaded from a private copy (msc.cuda.emu), a source is compiled
from memory, so nothing swapped in after the check is ever run.

Files are opened without following a link and only if they are regular
(a FIFO or a device planted as an entry is a miss, not a hang). Without a
key (a cache whose key others can read, a link for the cache root, a
platform that cannot refuse links) nothing is read or written: kernels are
built every time (a warning says why, once). A cache that cannot be written
(full, read-only) only costs the next build: ``write`` warns once, naming
the folder, and the caller goes on with the bytes it has.
"""
from __future__ import annotations

import errno
import hmac
import os
import stat
import warnings
from pathlib import Path

from msc.files import write_atomic

SIDECAR = ".mac"
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_MAC_HEX = 64
_warned: set[str] = set()


class KernelCacheWarning(UserWarning):
    """The kernel cache is not used, or not written, and why."""


def _warn_once(reason: str, message: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(message, KernelCacheWarning, stacklevel=3)


def _key() -> bytes | None:
    from msc.verification.cache import user_key

    key = user_key()
    if key is None:
        from msc.resources import cache_dir

        _warn_once("no key", f"msc: the kernel cache in {cache_dir()} is not used: it holds no key that only this "
                             f"user can read (verified/key), and none could be made there: kernels are built in a "
                             f"temporary folder every time")
    return key


def _mac(key: bytes, name: str, data: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + data, "sha256").hexdigest().encode()


def _read_regular(path: Path, limit: int = -1) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (a link is not followed), else None."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit)


def read(root: Path, name: str) -> bytes | None:
    """The bytes of entry ``name`` (a path inside the cache ``root``) if this
    user's msc wrote them there, else None (a miss)."""
    key = _key()
    if key is None:
        return None
    path = root / name
    mac = _read_regular(path.with_name(path.name + SIDECAR), _MAC_HEX + 1)
    if mac is None or len(mac) != _MAC_HEX:
        return None
    data = _read_regular(path)
    if not data or not hmac.compare_digest(mac, _mac(key, name, data)):
        return None
    return data


def write(root: Path, name: str, data: bytes) -> bool:
    """Store ``data`` as entry ``name`` (the file, then its sidecar: a reader
    never trusts a file before its sidecar exists). False when the cache
    cannot hold it (no key, full, read-only: warned once, naming the folder)."""
    key = _key()
    if key is None:
        return False
    path = root / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
        write_atomic(path.with_name(path.name + SIDECAR), _mac(key, name, data))
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        what = "is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "cannot be written"
        _warn_once(f"write {root}", f"msc: the kernel cache {root} {what} ({why}, at {path.parent}): kernels are "
                                    f"built in a temporary folder and used without being cached")
        return False
    return True
