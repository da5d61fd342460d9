"""The event engine folded by its symmetry (msc.sim.symmetry) against the
full run: the same makespan, float for float, on NCCL's plans (tree, ring,
NVLSTree; LL, LL128, Simple) across nodes, and the refusals that send the
simulator back to the full run."""
from __future__ import annotations

import math

import numpy as np
import pytest

from msc.sim import nccl, nccl_sim, symmetry
from msc.sim.events import EventSim
from msc.sim.nccl_sim import simulate_nccl
from msc.sim.presets import get_topology
from msc.sim.simulate import Simulator


def _nccl_simulator(topo, size):
    """The Simulator simulate_nccl runs ``size`` with (its choice, slots, tile, shares)."""
    s = nccl.system(topo)
    choice = nccl.choose(s, "allreduce", size)
    plan = nccl_sim.plan_for(topo, "allreduce", choice)
    shares = nccl_sim.tree_shares(plan, topo, choice) if choice.algorithm == "tree" else None
    sim = Simulator(plan, topo, slots=nccl.SLOTS[choice.protocol], shares=shares)
    how = nccl.pipeline(s, "allreduce", choice, sim.chunk_geometry(size)[2], size, sim.view.step_overhead * 1e6)
    sim = Simulator(sim.sp, topo, tile=how.tile, slots=how.slots, step_us=how.step_us, shares=shares,
                    network_step=how.network_step)
    return choice, sim.retiled(how.tile)


def _tiles(sim, size):
    q = sim.chunk_geometry(size)[2]
    return [sim._tlen(q, it) for it in range(math.ceil(q / sim.tile))]


# (topology, size): NCCL's tree (LL, LL128), ring (LL128, Simple) and NVLSTree in the event engine
CASES = [("dgx-h100:2", 2097152), ("dgx-h100:2", 33554432),
         ("dgx-h100:4", 65536), ("dgx-h100:4", 8388608), ("dgx-h100:4", 134217728),
         ("dgx-h100:8", 131072), ("dgx-h100:8", 8388608), ("dgx-h100:8", 67108864),
         ("dgx-a100:2", 8388608), ("dgx-a100:2", 33554432), ("dgx-a100:2", 134217728)]


@pytest.mark.parametrize("spec,size", CASES)
def test_folded_run_gives_the_full_runs_makespan(spec, size):
    choice, sim = _nccl_simulator(get_topology(spec, None), size)
    folding = sim.folding
    assert folding.sim is not None, folding.reason
    assert folding.classes * 4 <= folding.threadblocks       # at least the 8 rails fold, less a margin
    assert len(folding.sim.steps) == folding.classes
    tlen = _tiles(sim, size)
    full = sim.event_sim().run(tlen)
    assert folding.sim.run(tlen) == full                      # the same float, not close to it
    [record] = sim.records([size])
    assert record["engine"] == "events" and record["time"] == pytest.approx((full + sim.launch) * 1e6, rel=1e-15)


@pytest.mark.parametrize("spec", ["dgx-h100:2", "dgx-a100:2"])
def test_simulate_nccl_records_unchanged_by_folding(spec, monkeypatch):
    """simulate --nccl's records over its sizes, folded and with folding refused, are equal."""
    sizes = [1 << k for k in range(10, 28, 3)]
    topo = get_topology(spec, None)
    folded = simulate_nccl("allreduce", topo, sizes)
    monkeypatch.setattr(symmetry, "MIN_FOLD", 0.0)           # every folding refused: the full run
    full = simulate_nccl("allreduce", get_topology(spec, None), sizes)
    assert any(r["engine"] == "events" for r in full)
    assert folded == full


def test_no_symmetry_is_refused_and_runs_in_full(monkeypatch):
    """NCCL's one-channel tree on four nodes: no two threadblocks alike, so nothing folds; the plan's
    other simulators are refused without another look."""
    _, sim = _nccl_simulator(get_topology("dgx-h100:4", None), 4096)
    folding = sim.folding
    assert folding.sim is None and folding.classes == folding.threadblocks
    assert "too little symmetry" in folding.reason
    [record] = sim.records([4096])
    tlen = _tiles(sim, 4096)
    assert record["time"] == pytest.approx((sim.event_sim().run(tlen) + sim.launch) * 1e6, rel=1e-15)
    monkeypatch.setattr(symmetry, "RefinementGraph", lambda es: pytest.fail("looked again"))
    other = Simulator(sim.sp, sim.topology, tile=sim.tile, slots=sim.slots + 1)
    assert other.folding is folding


def _perturbed(es: EventSim, link: int, factor: float) -> EventSim:
    capacity = list(es.capacity)
    capacity[link] *= factor
    return EventSim(es.steps, es.per_iter, es.alpha, es.cap, es.res, capacity, es.slots, es.names, es.wts, es.floors)


def test_a_slower_link_breaks_part_of_the_symmetry_and_stays_exact():
    """One NIC at half its rate: the threadblocks whose times it reaches split off their classes,
    the rest still fold, and the folded run still gives the full run's makespan."""
    size = 4194304
    _, sim = _nccl_simulator(get_topology("dgx-h100:2", None), size)
    es = sim.event_sim()
    used = sorted({x for r in es.res for x in r})
    slow = _perturbed(es, used[len(used) // 2], 0.5)
    before, after = symmetry.fold(es), symmetry.fold(slow)
    assert after.sim is not None and after.classes > before.classes
    tlen = _tiles(sim, size)
    full = slow.run(tlen)
    assert full != es.run(tlen)                 # the slow link matters
    assert after.sim.run(tlen) == full


def test_a_partition_that_is_not_equitable_is_refused(monkeypatch):
    """Where refinement's hashes would merge unlike nodes, the exact check refuses the folding."""
    _, sim = _nccl_simulator(get_topology("dgx-h100:2", None), 4194304)
    es = sim.event_sim()
    monkeypatch.setattr(symmetry.RefinementGraph, "refine", lambda g: g.init.copy())    # attributes only: too coarse
    folding = symmetry.fold(es)
    assert folding.sim is None and "not equitable" in folding.reason


def test_refinement_is_a_partition_of_like_nodes():
    """Every class of the refined partition holds nodes of one kind and one attribute set."""
    _, sim = _nccl_simulator(get_topology("dgx-h100:2", None), 33554432)
    g = symmetry.RefinementGraph(sim.event_sim())
    cls = g.refine()
    kind = np.repeat(np.arange(4), [g.T, g.C, g.F, g.X])
    for c in np.unique(cls):
        members = cls == c
        assert len(np.unique(kind[members])) == 1 and len(np.unique(g.init[members])) == 1


def test_a_plans_partition_is_reused_by_its_other_simulators(monkeypatch):
    """simulate --nccl's sims of one plan with other step times and slots take the partition found for
    the first (checked equitable for theirs), with no refinement, and stay exact."""
    size = 8388608
    _, sim = _nccl_simulator(get_topology("dgx-h100:4", None), size)
    assert sim.folding.sim is not None
    refined = []
    monkeypatch.setattr(symmetry.RefinementGraph, "refine", lambda g: refined.append(g) or pytest.fail("refined again"))
    other = Simulator(sim.sp, sim.topology, tile=sim.tile, slots=sim.slots + 2, step_us=0.5, shares=None)
    folding = other.folding
    assert folding.sim is not None and not refined
    tlen = _tiles(other, size)
    assert folding.sim.run(tlen) == other.event_sim().run(tlen)


def test_step_columns_and_rows_round_trip():
    """An EventSim's rows made from Simulator's columns, read back as columns, give the same rows."""
    from msc.sim.events import StepColumns

    _, sim = _nccl_simulator(get_topology("dgx-h100:2", None), 33554432)
    rows = sim.event_sim().steps
    assert any(deps for tb in rows for *_, deps, _fixed, _fc in tb)          # dependencies included
    assert StepColumns.of(rows).rows() == rows
    assert StepColumns.of(rows).rows([3, 1]) == [rows[3], rows[1]]
