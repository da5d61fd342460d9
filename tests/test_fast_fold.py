"""The fast engine on a folded plan (msc.sim.fast_fold) against the full
plan: the same results (times, contention flags, iterations) float for
float on library and NCCL plans across nodes, a partition shared by a
plan's protocols, and the refusals of partitions that do not fold."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import msc
from msc.lower.pipeline import LowerOptions, lower
from msc.sim import fast_fold
from msc.sim.presets import get_topology
from msc.sim.simulate import Simulator
from msc.units import sizes

from test_symmetry import CASES, _nccl_simulator

SIZES = sizes(1024, 256 * 1024 ** 2, 4)


def _plan(name, n, instances=1, **params):
    [alg] = msc.load_algorithms(name)
    prog = msc.trace(alg, n, **params)
    msc.verify(prog)
    return lower(prog, LowerOptions(instances=instances))


def _same(full: Simulator, folded: Simulator, requested) -> None:
    a = full.run(requested, engine="fast")
    b = folded.run(requested, engine="fast")
    assert [(r.seconds, r.contended, r.iterations, r.size) for r in a] == \
        [(r.seconds, r.contended, r.iterations, r.size) for r in b]


@pytest.mark.parametrize("name,n,topo,instances,params", [
    ("allreduce/ring", 16, "dgx-h100:2", 1, {}), ("allreduce/ring", 32, "dgx-h100:4", 4, {}),
    ("allreduce/ring", 24, "dgx-a100:3", 2, {}), ("allreduce/halving_doubling", 32, "dgx-h100:4", 1, {}),
    ("allreduce/halving_doubling", 16, "dgx-h100:2", 2, {}), ("allreduce/hierarchical", 32, "dgx-h100:4", 2, {}),
    ("allreduce/hierarchical", 32, "dgx-h100:4", 1, {"gpus_per_node": 8}), ("allgather/ring", 16, "dgx-h100:2", 2, {}),
    ("allgather/recursive_doubling", 16, "dgx-h100:2", 1, {}), ("allreduce/nvls", 8, "dgx-h100", 1, {}),
    ("reducescatter/ring", 32, "dgx-h100:4", 2, {}),
])
def test_folded_fast_engine_equals_the_full_one(name, n, topo, instances, params):
    plan = _plan(name, n, instances, **params)
    topology = get_topology(topo, n)
    protocols = ("Simple",) if plan.first_switch_step() is not None else ("Simple", "LL", "LL128")
    sims = [Simulator(replace(plan, protocol=p), topology) for p in protocols]
    cls = fast_fold.partition(sims[0])              # one partition for the plan's protocols, as msc tune shares it
    if cls is None:
        pytest.skip(f"{name}: too little symmetry to fold at {n} ranks")
    for sim in sims:
        q = fast_fold.quotient(sim, cls)
        assert q is not None and q.sp.num_steps < sim.sp.num_steps
        _same(sim, q, SIZES)


def test_rings_fold_by_node_and_instance():
    sim = Simulator(_plan("allreduce/ring", 64, 4), get_topology("dgx-h100:8", 64))
    q = fast_fold.quotient(sim, fast_fold.partition(sim))
    assert q.sp.num_tbs * 8 * 4 == sim.sp.num_tbs         # 8 nodes and 4 instances alike: one of each class
    res = sim.run(SIZES, engine="fast")
    assert all(r.contended for r in res)          # the instances share each NIC: the check must see all 4
    _same(sim, q, SIZES)


@pytest.mark.parametrize("topo,size", CASES[:6])
def test_nccl_plans_fold_exactly(topo, size):
    """NCCL's plans as simulate --nccl builds them (tree shares, network steps, tiles, slots, NVLS)."""
    _, sim = _nccl_simulator(get_topology(topo, None), size)
    cls = fast_fold.partition(sim)
    q = fast_fold.quotient(sim, cls) if cls is not None else None
    if q is None:
        pytest.skip("not folded")
    _same(sim, q, [size // 4, size, 4 * size])


def test_a_partition_that_does_not_fold_is_refused():
    sim = Simulator(_plan("allreduce/ring", 16, 2), get_topology("dgx-h100:2", 16))
    cls = fast_fold.partition(sim)
    T = sim.sp.num_tbs
    bad = cls.copy()
    bad[:T] = cls[0]                      # every threadblock in one class: the NIC's are not like the others
    assert fast_fold.quotient(sim, bad) is None
    assert fast_fold.quotient(sim, cls[:-1]) is None          # not a partition of this sim's nodes


def test_random_coarsenings_fold_exactly_or_are_refused():
    """Merging classes at random: whatever quotient accepts gives the full results."""
    rng = np.random.default_rng(38)
    sim = Simulator(replace(_plan("allreduce/hierarchical", 32, 2), protocol="LL"), get_topology("dgx-h100:4", 32))
    cls = fast_fold.partition(sim)
    accepted = 0
    for _ in range(40):
        ids = np.unique(cls)
        a, b = rng.choice(ids, 2, replace=False)
        merged = np.where(cls == a, b, cls)
        q = fast_fold.quotient(sim, merged)
        if q is not None:
            accepted += 1
            _same(sim, q, SIZES[::3])
    assert accepted < 40                  # most merges join unlike nodes and are refused


def test_a_folded_simulator_has_no_event_engine():
    sim = Simulator(_plan("allreduce/ring", 16, 2), get_topology("dgx-h100:2", 16))
    q = fast_fold.quotient(sim, fast_fold.partition(sim))
    with pytest.raises(TypeError, match="fast engine only"):
        q.event_sim()
