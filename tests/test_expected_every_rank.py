"""Expected.of_every_rank (a reduction's output: label (r, i) of every rank
once, its counts made only when asked for) against Expected built from the
labels, and the verifiers' fast paths reading it (multisets.Leaves.expected)
against the same objects read label by label."""
from __future__ import annotations

import random

import numpy as np
import pytest

import msc
from msc.dsl.collectives import BUILTIN, Expected
from msc.verification.multisets import Leaves
from msc.verification.program_verifier import _run
from msc.verification.program_verifier_fast import checked_outputs


def _plain(e: Expected) -> Expected:
    """The same expectation built from its labels (the general form)."""
    n, index = e.every_rank
    return Expected((r, index) for r in range(n))


@pytest.mark.parametrize("seed", range(20))
def test_same_counts_single_and_text(seed):
    rng = random.Random(seed)
    n, index = rng.randint(1, 70), rng.randint(0, 300)
    compact, plain = Expected.of_every_rank(n, index), _plain(Expected.of_every_rank(n, index))
    assert compact.single == plain.single
    assert repr(compact) == repr(plain)
    assert list(compact.counts.items()) == list(plain.counts.items())      # the same order too
    assert compact.counts is compact.counts                                 # made once


def _leaves(n: int, k: int) -> Leaves:
    layout = BUILTIN["allreduce"]().layout(n, k, False)
    return Leaves(layout, k, lambda rank, buf, off, width, index: rank * 10_000 + index)


@pytest.mark.parametrize("seed", range(30))
def test_leaves_read_it_as_the_labels(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 24), rng.randint(1, 6)
    leaves = _leaves(n, k)
    # indices in and out of the input's range (out of range: no input starts as the label)
    exps = [Expected.of_every_rank(n, rng.randint(0, k + 2)) for _ in range(rng.randint(1, 12))]
    fast = leaves.expected(exps)
    slow = leaves.expected([_plain(e) for e in exps])
    for a, b in zip(fast, slow):
        assert np.array_equal(a, b)
    mixed = [e if rng.random() < 0.5 else _plain(e) for e in exps]      # some in the general form: read as labels
    for a, b in zip(leaves.expected(mixed), slow):
        assert np.array_equal(a, b)
    other = [Expected.of_every_rank(n + 1, 0)]                           # other rank counts: the general reading
    got = leaves.expected(other)
    assert np.array_equal(got[1], leaves.expected([_plain(other[0])])[1])


@pytest.mark.parametrize("name", ["allreduce", "reducescatter", "reduce"])
def test_library_reductions_fast_path_agrees_with_the_python_run(name):
    """The library's reductions at random rank counts, in and out of place:
    the fast path checks as many outputs as the Python run, and the plan
    verifier's fast path accepts their plans (it reads the expectations the same way)."""
    from library import algorithms
    from msc.lower import lower
    from msc.verification.plan_fast import accepts

    rng = random.Random(name)
    algs = [alg for key, alg in algorithms(switch=False).items() if alg.collective.name == name]
    assert algs
    for alg in algs:
        for n in rng.sample(range(2, 17), 3):
            for inplace in (True, False):
                try:
                    program = msc.trace(alg, n, inplace=inplace)
                except msc.MscError:
                    continue
                assert checked_outputs(program) == _run(program)
                plan = lower(program)          # ends with the plan verifier against the collective
                assert accepts(plan, program.layout, plan.slots), (alg.name, n, inplace)
