"""The algorithm library as the tests see it: every algorithm, keyed
"collective/file:name" (e.g. "allreduce/ring:ring"), loaded once."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import msc

LIBRARY = Path(__file__).resolve().parent.parent / "algorithms"


@lru_cache(maxsize=1)
def algorithms() -> dict[str, msc.Algorithm]:
    found = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        for alg in msc.load_algorithms(path):
            found[f"{path.relative_to(LIBRARY).with_suffix('').as_posix()}:{alg.name}"] = alg
    return found


def rank_counts(alg: msc.Algorithm, preferred=(2, 3, 4, 5, 8)) -> list[int]:
    """The ``preferred`` rank counts ``alg`` supports, or, where it supports
    none of them (a 3x3 torus at least), the smallest count it supports."""
    found = [n for n in preferred if alg.supports(n)]
    return found or [next(n for n in range(1, 65) if alg.supports(n))]
