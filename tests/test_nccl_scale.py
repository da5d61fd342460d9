"""The shortcuts simulate --nccl takes at cluster scale against the full
paths: NCCL's plans lowered unverified (past nccl_sim.VERIFIED_RANKS ranks)
are the verified plans, and the contention probe over a prefix of a size's
tile iterations sends a size to the event engine exactly when the full fast
evaluation does."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from msc.sim import nccl, nccl_sim
from msc.sim.fast import evaluate
from msc.sim.presets import get_topology
from test_symmetry import _nccl_simulator


def _choices(spec):
    """NCCL's distinct (algorithm, protocol, channels) for allreduce over simulate --nccl's sizes."""
    s = nccl.system(get_topology(spec, None))
    found = {}
    for size in (8 * 2 ** i for i in range(25)):
        c = nccl.choose(s, "allreduce", size)
        found.setdefault((c.algorithm, c.protocol, c.channels), c)
    return list(found.values())


@pytest.mark.parametrize("spec", ["dgx-h100:2", "dgx-h100:4", "dgx-h100:8", "dgx-a100:2"])
def test_unverified_nccl_plans_are_the_verified_ones(spec):
    """Every plan simulate --nccl lowers (tree on 1-16 channels, LL and LL128, NVLSTree, ring): the
    first order lowering takes unverified is the order the verifier accepts, step for step."""
    topo = get_topology(spec, None)
    for choice in _choices(spec):
        verified = nccl_sim._lower(topo, "allreduce", choice, verify=True)
        unverified = nccl_sim._lower(topo, "allreduce", choice, verify=False)
        assert unverified.slots == 1
        assert dataclasses.replace(unverified, slots=verified.slots) == verified, choice


def test_plans_past_the_verified_ranks_are_lowered_unverified(monkeypatch):
    seen = []
    real = nccl_sim._lower

    def spy(topology, collective, choice, verify=None):
        plan = real(topology, collective, choice, verify)
        seen.append(plan.slots)
        return plan
    monkeypatch.setattr(nccl_sim, "_lower", spy)
    monkeypatch.setattr(nccl_sim, "VERIFIED_RANKS", 8)
    nccl_sim.simulate_nccl("allreduce", get_topology("dgx-h100:2", None), [1 << 20])
    assert seen == [1]


def test_unverified_plans_of_one_program_are_lowered_once(monkeypatch):
    """Past the verified ranks, tree LL and LL128 on as many channels share a lowering: the plan
    of the second protocol is the one its own lowering gives."""
    topo = get_topology("dgx-h100:2", None)
    monkeypatch.setattr(nccl_sim, "VERIFIED_RANKS", 8)
    lowered = []
    real = nccl_sim._lower
    monkeypatch.setattr(nccl_sim, "_lower", lambda *a, **k: lowered.append(a[2]) or real(*a, **k))
    tree = [c for c in _choices("dgx-h100:2") if c.algorithm == "tree" and c.channels == 16]
    assert sorted(c.protocol for c in tree) == ["LL", "LL128"]
    plans = [nccl_sim.plan_for(topo, "allreduce", c) for c in tree]
    assert lowered == tree[:1]
    assert plans[1] == real(topo, "allreduce", tree[1], verify=False)
    assert plans[1].protocol == tree[1].protocol and plans[0].protocol == tree[0].protocol


# sizes of many tile iterations (NCCL's tree, LL128): contended, some within the probe's prefixes, some not
PROBED = [("dgx-h100:4", 4 << 20), ("dgx-h100:4", 8 << 20), ("dgx-h100:8", 4 << 20), ("dgx-h100:8", 8 << 20),
          ("dgx-a100:2", 4 << 20), ("dgx-a100:2", 8 << 20), ("dgx-a100:4", 16 << 20)]


@pytest.mark.parametrize("spec,size", PROBED)
def test_the_contention_probe_agrees_with_the_full_evaluation(spec, size):
    """_clashes_early says contended only where the full evaluation of every iteration does, and a prefix's
    times are the full schedule's first iterations (to the float, without jumps)."""
    _, sim = _nccl_simulator(get_topology(spec, None), size)
    [r] = sim.run([size], engine="fast")          # the full evaluation: its verdict in ``contended``
    q = sim.chunk_geometry(size)[2]
    n = math.ceil(q / sim.tile)
    assert n > 16
    early = sim._clashes_early(q, n)
    assert not early or r.contended
    [auto] = sim.run([size])
    assert auto.engine == ("events" if r.contended else "fast")
    tlen = np.array([[sim._tlen(q, it)] for it in range(n)])
    whole = evaluate(sim._layers, sim._levels, tlen, jump=False, record=True)
    part = evaluate(sim._layers, sim._levels, tlen[:n // 2], jump=False, record=True)
    assert (part.timeline == whole.timeline[:, :n // 2]).all()


@pytest.mark.parametrize("spec", ["dgx-h100:4", "dgx-a100:2"])
def test_a_kept_probe_verdict_is_a_fresh_one(spec):
    """The verdicts of prefixes of full tiles are kept for the simulator's later sizes: each later
    size's verdict is what a fresh simulator finds (prefixes with a short last tile are not kept)."""
    topo = get_topology(spec, None)
    _, sim = _nccl_simulator(topo, 4 << 20)
    for size in (4 << 20, 8 << 20, 6 << 20):
        q = sim.chunk_geometry(size)[2]
        n = math.ceil(q / sim.tile)
        _, fresh = _nccl_simulator(topo, 4 << 20)
        fresh.run([8], engine="fast")                     # (builds its layers)
        sim.run([8], engine="fast")
        assert sim._clashes_early(q, n) == fresh._clashes_early(q, n)
    kept = sim._engines["probes"]
    assert kept and all(p * tile <= sim.chunk_geometry(4 << 20)[2] or p * tile <= sim.chunk_geometry(8 << 20)[2]
                        for tile, p in kept)
