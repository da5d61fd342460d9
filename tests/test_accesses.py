"""msc.ir.accesses against a plain Python walk over random sorted accesses."""
import random

import numpy as np
import pytest

from msc.ir.accesses import last_of_each, writes_around


@pytest.mark.parametrize("seed", range(40))
def test_writes_around_match_a_walk(seed):
    rng = random.Random(seed)
    keys = sorted(rng.randrange(rng.choice((1, 8, 40))) for _ in range(rng.randint(0, 60 if seed < 20 else 300)))
    write = [rng.random() < 0.4 for _ in keys]
    before, after = writes_around(np.array(keys, dtype=np.int64), np.array(write, dtype=bool))
    for p, k in enumerate(keys):
        same = [q for q, kq in enumerate(keys) if kq == k and write[q]]
        assert before[p] == max((q for q in same if q < p), default=-1)
        assert after[p] == min((q for q in same if q > p), default=len(keys))
    assert writes_around(np.array(keys, dtype=np.int64), np.array(write, dtype=bool), following=False)[1] is None
    assert last_of_each(np.array(keys, dtype=np.int64)).tolist() == [
        p for p, k in enumerate(keys) if p + 1 == len(keys) or keys[p + 1] != k]
