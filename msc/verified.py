"""Plan texts this msc has verified before, so that loading one again skips
the plan verifier (about 30 s for a 1024-rank ring, paid by every process
that loads it).

An entry is an empty file under ``cache_dir()/verified`` named by the
SHA-256 of: a digest of msc's own source files (parser, verifier and all),
the reader (plan text or MSCCL XML), the collective the plan was verified
against, and the text. So a hit means: this exact text, read the same way
by this exact msc, verified against this collective. Editing one byte of the plan, or changing msc, misses. Only
built-in collectives named by the plan are remembered (a custom collective
is a Python object with no stable name). ``MSC_VERIFY_CACHE=0`` turns the
cache off; an unwritable cache directory only costs the second verification.
"""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

from msc.resources import cache_dir, data_dir

_PACKAGE = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def msc_digest() -> str:
    """SHA-256 over msc's Python modules and the plan grammar (names and
    bytes). The algorithm library is left out: a wheel puts it inside the
    package, a checkout beside it, and it does not read or verify plans."""
    h = hashlib.sha256()
    modules = sorted(p for p in _PACKAGE.rglob("*.py") if p.relative_to(_PACKAGE).parts[0] != "algorithms")
    for name, path in [(p.relative_to(_PACKAGE).as_posix(), p) for p in modules] + [
            ("grammars/plan.lark", data_dir("grammars") / "plan.lark")]:
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _enabled(collective) -> bool:
    return os.environ.get("MSC_VERIFY_CACHE", "1") != "0" and (collective is None or isinstance(collective, str))


def _entry(text: str, reader: str, plan_collective: str, collective) -> Path:
    h = hashlib.sha256()
    for part in (msc_digest(), reader, str(collective or plan_collective)):
        h.update(part.encode())
        h.update(b"\0")
    h.update(text.encode())
    return cache_dir() / "verified" / h.hexdigest()


def known(text: str, reader: str, plan_collective: str, collective=None) -> bool:
    """Whether this text, read by ``reader`` ("plan" or "xml"), was verified
    before against ``collective`` (or the collective the plan names) by this msc."""
    return _enabled(collective) and _entry(text, reader, plan_collective, collective).is_file()


def remember(text: str, reader: str, plan_collective: str, collective=None) -> None:
    """Record that this text verified (call only after it did)."""
    if not _enabled(collective):
        return
    entry = _entry(text, reader, plan_collective, collective)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.touch()
    except OSError:
        pass              # a read-only cache: the next load verifies again, nothing is lost
