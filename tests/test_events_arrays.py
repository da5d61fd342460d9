"""The event engine's array form (flows per threadblock, max-min by numpy)
against the per-flow one it replaced: maxmin_arrays gives maxmin's floats,
and simulate --nccl's contended sizes keep the times the per-flow engine
gave (main 4a0ecbb, repr of each float)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from msc.sim import events
from msc.sim.events import _Flow, link_columns, maxmin, maxmin_arrays, maxmin_classes
from msc.sim.nccl_sim import simulate_nccl
from msc.sim.presets import get_topology


def _random_case(rng: random.Random, weighted: bool):
    """Flows over a few shared links, some with private caps, some tied (equal caps and links)."""
    nlinks = rng.randint(1, 8)
    capacity = [rng.choice([10.0, 25.0, 50.0, 3.0 + rng.random()]) for _ in range(nlinks)]
    res, wts, caps = [], [], []
    for _ in range(rng.randint(1, 40)):
        links = tuple(rng.sample(range(nlinks), rng.randint(1, min(3, nlinks))))
        res.append(links)
        wts.append(tuple(float(rng.choice([1, 2, 3])) for _ in links) if weighted else None)
        caps.append(rng.choice([math.inf, 7.0, 12.5, 1.0 + rng.random() * 20]))
    return capacity, res, wts, caps


def _arrays(res, wts):
    ptr = np.concatenate([[0], np.cumsum([len(r) for r in res])]).astype(np.int64)
    link = np.array([x for r in res for x in r], dtype=np.int64)
    wt = np.array([x for r, w in zip(res, wts) for x in (w if w is not None else [1.0] * len(r))])
    return ptr, link, wt


@pytest.mark.parametrize("weighted", [False, True])
def test_maxmin_arrays_gives_maxmins_rates(weighted):
    rng = random.Random(38)
    rounds = 0
    for _ in range(300):
        capacity, res, wts, caps = _random_case(rng, weighted)
        flows = [_Flow(i, 1.0, r, c, 0.0, i, w) for i, (r, w, c) in enumerate(zip(res, wts, caps))]
        members: dict = {}
        for f in flows:
            for r in f.res:
                members.setdefault(r, set()).add(f)
        want = maxmin(flows, capacity, members)
        ptr, link, wt = _arrays(res, wts)
        got = maxmin_arrays(np.arange(len(flows)), np.array(caps), ptr, link, wt, np.array(capacity))
        rounds += len(set(want.values())) > 2
        for f in flows:
            if weighted:        # a link's frozen flows are subtracted in another order: rounding only
                assert got[f.t] == pytest.approx(want[f], rel=1e-12)
            else:
                assert got[f.t] == want[f]
    assert rounds > 50                     # many cases need several rounds of water filling


def test_maxmin_arrays_takes_a_subset_in_any_order():
    # flows 2 and 0 of three: link 0 (9) shared by both, flow 2 also capped at 2
    ptr, link, wt = _arrays([(0,), (1,), (0, 1)], [None] * 3)
    rates = maxmin_arrays(np.array([2, 0]), np.array([math.inf, math.inf, 2.0]), ptr, link, wt, np.array([9.0, 5.0]))
    assert rates.tolist() == [2.0, 7.0]


def test_maxmin_classes_gives_maxmin_arrays_rates():
    # unit weights, flows repeated (several threadblocks' flows of one cap and links) and links shared
    rng = random.Random(39)
    rounds = 0
    for _ in range(300):
        capacity, res, _, caps = _random_case(rng, False)
        kinds = list(zip(res, caps))
        flows = [rng.randrange(len(kinds)) for _ in range(rng.randint(1, 60))]
        res, caps = [kinds[k][0] for k in flows], [kinds[k][1] for k in flows]
        ptr, link, wt = _arrays(res, [None] * len(res))
        want = maxmin_arrays(np.arange(len(flows)), np.array(caps), ptr, link, wt, np.array(capacity))
        # the same flows as classes: one per kind, with its count
        kind_ptr, kind_link, _ = _arrays([r for r, _ in kinds], [None] * len(kinds))
        cols = link_columns(kind_ptr, kind_link, len(capacity))
        used = sorted(set(flows))
        mult = np.array([flows.count(k) for k in used], dtype=np.float64)
        got = maxmin_classes(np.array(used), mult, np.array([c for _, c in kinds]), cols, np.array(capacity))
        by_kind = dict(zip(used, got.tolist()))
        assert [by_kind[k] for k in flows] == want.tolist()
        rounds += len(set(want.tolist())) > 2
    assert rounds > 50


# (topology, size) -> NCCL's choice and the per-flow engine's time (us) at main 4a0ecbb
PER_FLOW = {
    ("dgx-h100:2", 1 << 22): ("nvlstree", "Simple", 104.66552935064938),
    ("dgx-h100:2", 1 << 25): ("nvlstree", "Simple", 235.77389658469212),
    ("dgx-h100:4", 1 << 14): ("tree", "LL", 36.50974402852051),
    ("dgx-h100:4", 1 << 22): ("tree", "LL128", 92.10576723226576),
    ("dgx-a100:4", 1 << 12): ("tree", "LL", 39.51161121495329),
    ("dgx-a100:4", 1 << 20): ("tree", "LL128", 86.81205794392525),
}


@pytest.mark.parametrize("few", [None, 0, 1 << 30])
@pytest.mark.parametrize("topology", sorted({t for t, _ in PER_FLOW}))
def test_contended_nccl_sizes_keep_the_per_flow_engines_times(topology, few, monkeypatch):
    # few: rebalance in numpy for every set of linked flows (0), in Python floats for every one (1 << 30)
    if few is not None:
        monkeypatch.setattr(events, "SMALL", few)
    sizes = sorted(s for t, s in PER_FLOW if t == topology)
    for r in simulate_nccl("allreduce", get_topology(topology, None), sizes):
        algorithm, protocol, us = PER_FLOW[topology, r["size"]]
        assert (r["algorithm"], r["protocol"], r["engine"], r["contended"]) == (algorithm, protocol, "events", True)
        assert r["time"] == us
