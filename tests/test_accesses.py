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


@pytest.mark.parametrize("seed", range(20))
def test_pieces_cover_the_accesses_and_never_split_a_key(seed):
    from msc.ir.accesses import pieces

    rng = random.Random(seed)
    per_key = rng.choice((1, 3, 10))
    codes = np.sort(np.array([rng.randrange(per_key * rng.choice((1, 5, 50))) for _ in range(rng.randint(0, 200))],
                             dtype=np.int64))
    size = rng.choice((1, 2, 7, 50, 1000))
    got = pieces(codes, per_key, size)
    assert got[0][0] == 0 and got[-1][1] == codes.size
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(got, got[1:]))
    keys = codes // per_key
    assert all(start == 0 or keys[start] != keys[start - 1] for start, _ in got)
    assert len(got) >= min(codes.size // max(size, int(np.bincount(keys).max(initial=1))), 1)


@pytest.mark.parametrize("seed", range(6))
def test_writes_around_int64_past_the_narrow_range_equals_int32(seed, monkeypatch):
    import msc.ir.accesses as accesses

    rng = np.random.default_rng(seed)
    keys = np.sort(rng.integers(0, 30, size=200))
    write = rng.random(200) < 0.4
    narrow = writes_around(keys, write)
    monkeypatch.setattr(accesses, "NARROW_BELOW", 0)
    wide = writes_around(keys, write)
    assert narrow[0].dtype == np.int32 and wide[0].dtype == wide[1].dtype == np.int64
    assert all(np.array_equal(a, b) for a, b in zip(narrow, wide))
