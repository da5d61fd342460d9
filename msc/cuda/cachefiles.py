"""Files of msc's kernel caches (NVRTC cubins, rendered sources, emulated
device libraries): written whole or not at all, and trusted only if whole.

Each cached file has a sidecar ``NAME.sha256`` holding the SHA-256 of its
bytes, written after it. A reader gets the bytes only when both exist and
agree; an empty, truncated, altered or half-written entry is a miss (and the
caller rebuilds it). Writes go through a temporary file and a rename, so a
concurrent reader never sees part of a file.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def write_checked(path: Path, data: bytes) -> None:
    """``path`` and its digest (the digest last: a reader never trusts a file before its digest exists)."""
    write_atomic(path, data)
    write_atomic(_sidecar(path), hashlib.sha256(data).hexdigest().encode())


def read_checked(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is non-empty and matches its digest, else None."""
    try:
        data, want = path.read_bytes(), _sidecar(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return data if data and hashlib.sha256(data).hexdigest() == want else None
