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
