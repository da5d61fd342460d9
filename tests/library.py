"""The algorithm library as the tests see it: every algorithm, keyed
"collective/file:name" (e.g. "allreduce/ring:ring"), loaded once."""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

import msc

LIBRARY = Path(__file__).resolve().parent.parent / "algorithms"


# The NCCL-grade baselines (*/nccl_*.py) run 8 rings or 8 tree channel pairs by default: 8 to 16
# times the chunks of the other algorithms, and as much of the default suite's time. Library-wide
# tests take them with 2 (the same code, the same rank orders); tests/test_library.py's slow sweep
# and tests/test_baselines.py take their defaults.
LIGHT = {"rings": 2, "channels": 2, "chunks": 1}


@lru_cache(maxsize=4)
def algorithms(light: bool = True, switch: bool = True) -> dict[str, msc.Algorithm]:
    """The library; ``switch=False`` leaves out the algorithms with switch
    ops (NVLS), for the backends and formats that have none (yet): the
    CUDA runtime and its emulated device, the torch executor, MSCCL XML."""
    if not switch:
        return {key: alg for key, alg in algorithms(light).items() if not uses_switch(alg)}
    found = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        for alg in msc.load_algorithms(path):
            key = f"{path.relative_to(LIBRARY).with_suffix('').as_posix()}:{alg.name}"
            if light and "/nccl_" in key:
                alg = dataclasses.replace(alg, params={**alg.params, **{k: v for k, v in LIGHT.items()
                                                                         if k in alg.params}})
            found[key] = alg
    return found


def rank_counts(alg: msc.Algorithm, preferred=(2, 3, 4, 5, 8)) -> list[int]:
    """The ``preferred`` rank counts ``alg`` supports, or, where it supports
    none of them (a 3x3 torus at least), the smallest count it supports."""
    found = [n for n in preferred if alg.supports(n)]
    return found or [next(n for n in range(1, 65) if alg.supports(n))]


def uses_switch(alg: msc.Algorithm) -> bool:
    """Whether ``alg``'s program has switch ops (at its smallest preferred rank count)."""
    return msc.trace(alg, rank_counts(alg)[0]).has_switch


def rotated(cases, ids, every: int = 3):
    """pytest params of ``cases`` (tuples starting with the algorithm's key):
    each algorithm's first case and every ``every``-th after it in the default
    run, the rest marked slow; ``ids`` names a case. Library-wide sweeps use
    it where another default test already checks every library plan (the plan
    verifier's results, tests/test_lowering.py), so the default run keeps every
    algorithm and, across them, every form, and -m slow the whole product."""
    import pytest

    seen: dict[str, int] = {}
    for case in cases:
        i = seen[case[0]] = seen.get(case[0], -1) + 1
        yield pytest.param(*case, marks=() if i % every == 0 else pytest.mark.slow, id=ids(case))


# A custom collective the tests share (its contract travels with plans, exports and files): rank r's
# output holds its own input plus its next neighbour's.
PAIR_SUM = msc.CustomCollective("pair_sum", input_chunks=1, output_chunks=1,
                                postcondition=lambda r, i, n, k: [(r, 0), ((r + 1) % n, 0)])


@msc.algorithm(PAIR_SUM, inplace=False)
def neighbours(p):
    n = p.num_ranks
    for r in range(n):
        p.chunk(r, "input", 0).copy(r, "output", 0)
    for r in range(n):
        p.chunk(r, "output", 0).reduce(p.chunk((r + 1) % n, "input", 0))
