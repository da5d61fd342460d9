"""msc.verification.multisets.jump (both verifiers' alias resolution): every
entry goes to the end of its chain, as following the pointers one at a time does."""
from __future__ import annotations

import numpy as np
import pytest

from msc.verification.multisets import jump


def _followed(ptr: np.ndarray) -> list[int]:
    ends = []
    for i in range(len(ptr)):
        while ptr[i] != i:
            i = int(ptr[i])
        ends.append(i)
    return ends


@pytest.mark.parametrize("seed", range(20))
def test_jump_ends_every_chain_where_following_it_does(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    i = np.arange(n, dtype=np.int64)
    # a forest with pointers to earlier entries (SSA aliases) or, in a shuffled labelling, anywhere
    ptr = np.where(rng.random(n) < rng.random(), i, (rng.random(n) * (i + 1)).astype(np.int64))
    if seed % 2:
        perm = rng.permutation(n)
        ptr = perm[ptr][np.argsort(perm)]          # the same forest, its entries relabelled
    before = ptr.copy()
    assert jump(ptr).tolist() == _followed(ptr)
    assert (ptr == before).all()                    # the input is left as it was


@pytest.mark.parametrize("seed", range(10))
def test_pointers_jumped_in_place_equal_the_copying_jump(seed):
    from msc.verification.multisets import pointers

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    to = (rng.random(n) * (np.arange(n) + 1)).astype(np.int64)
    select = rng.random(n) < 0.7
    ptr = pointers(select, to)
    assert ptr.tolist() == np.where(select, to, np.arange(n)).tolist()
    expected = _followed(ptr)
    assert jump(ptr, own=True).tolist() == expected and ptr.tolist() == expected    # worked on in place


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("wide", [False, True])
def test_contributions_count_every_leaf_as_a_walk_does(seed, wide, monkeypatch):
    """multisets.contributions (int32 pointers where the values fit; ``wide``: int64 throughout, as past
    msc.ir.accesses.NARROW_BELOW) against counting each root's leaves by recursion, on random sum DAGs."""
    from collections import Counter

    import msc.ir.accesses as accesses
    from msc.verification.multisets import contributions

    if wide:
        monkeypatch.setattr(accesses, "NARROW_BELOW", 0)
    rng = np.random.default_rng(seed)
    leaves, sums = int(rng.integers(1, 12)), int(rng.integers(1, 60))
    T = leaves + sums
    kind = np.array([0] * leaves + [2] * sums, dtype=np.int8)
    ca, cb = np.full(T, -1, dtype=np.int64), np.full(T, -1, dtype=np.int64)
    for v in range(leaves, T):                        # operands: earlier values, often the one just before
        ca[v] = v - 1 if rng.random() < 0.5 else int(rng.integers(0, v))
        cb[v] = int(rng.integers(0, v))
    roots = np.unique(rng.integers(leaves, T, size=int(rng.integers(1, 6))))

    def count(v):
        return Counter({v: 1}) if kind[v] == 0 else count(int(ca[v])) + count(int(cb[v]))

    expected = [(p, leaf, m) for p, r in enumerate(roots.tolist()) for leaf, m in sorted(count(r).items())]
    got = contributions(roots, kind, ca, cb)
    assert list(zip(*(x.tolist() for x in got))) == expected
