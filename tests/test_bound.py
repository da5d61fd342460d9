"""msc.sim.cut_bound (``msc bound``): the formulas on cases worked by hand, the
built-in topologies' cuts against every cut, the bound against the
simulator (never above a simulated time: the library on the built-in
topologies and on random TOML graphs; ``-m slow`` sweeps all of it), its
tightness, and the command."""
from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest

import msc
from msc.sim.cut_bound import (ALL_CUTS, COLLECTIVES, _route_cut, _routes_model, cut_model, demand, lower_bound,
                       nccl_size)
from msc.cli.bound import COLLECTIVE_NAMES
from msc.dsl.collectives import ROOTED
from msc.errors import MscError, UsageError
from msc.lower.pipeline import LowerOptions, lower
from msc.sim.simulate import Simulator
from msc.sim.machines import A100, H100
from msc.sim.presets import dgx, infiniband, nvswitch, pcie, ring, torus
from msc.sim.topology import GB, US, Nodes, Uniform, topology_from_dict

from library import algorithms, uses_switch

MB64 = 64 << 20


def big(collective, topo, size=MB64, **kw):
    return lower_bound(collective, topo, [size], **kw)[0]


SIMPLE = H100.protocols["Simple"]
NVLINK = 450 * GB * SIMPLE.link("nvlink").bandwidth_factor        # what Simple carries of an H100's NVLink
NIC = 50 * GB * SIMPLE.link("net").bandwidth_factor                # and of a 400 Gb/s NIC
LAUNCH = SIMPLE.launch_us * US


def switch(n, gbps=100.0, alpha_us=2.0):
    """The classic one-port machine: n ranks on a switch, no threadblock limit."""
    return Nodes("switch", 1, n, port_gbps=gbps, port_alpha_us=alpha_us)


# -- formulas by hand --------------------------------------------------------------
def test_allgather_on_nvswitch_is_one_ports_share():
    # a rank lacks 7 of 8 shards and has one port in (what Simple carries of 450 GB/s); then one
    # 3.4 us hop, and the launch
    b = big("allgather", nvswitch())
    assert b.seconds == pytest.approx(7 / 8 * MB64 / NVLINK + 3.4 * US + LAUNCH, rel=1e-12)
    assert (b.term, b.protocol, b.limit) == ("bandwidth", "Simple", f"1 rank in (1 port: {NVLINK / GB:g} GB/s)")
    assert b.launch == LAUNCH
    assert big("reducescatter", nvswitch()).seconds == pytest.approx(b.seconds, rel=1e-12)   # one rank out


def test_allreduce_on_one_port_is_the_classic_bound():
    # 2(n-1)/n S/B: every element's sum is a one-way gossip among n ranks, 2(n-1) messages
    for n in (2, 3, 8):
        b = big("allreduce", switch(n))
        assert b.seconds == pytest.approx(2 * (n - 1) / n * MB64 / (100 * GB) + 2 * US, rel=1e-12), n
    assert big("allreduce", switch(8)).limit == "every rank out (8 ports: 800 GB/s)"


def test_uniform_links_add_up():
    # a link per pair: a rank takes n-1 links in, and all n(n-1) links carry an allreduce
    n, t = 8, Uniform(8, 2.0, 100.0)
    assert big("allgather", t).seconds == pytest.approx(7 / 8 * MB64 / (700 * GB) + 2 * US, rel=1e-12)
    assert big("allreduce", t).seconds == pytest.approx(2 * (n - 1) * MB64 / (56 * 100 * GB) + 2 * US, rel=1e-12)
    # any k ranks: k(n-k) pairs' shares over k(n-k) links
    assert big("alltoall", t).seconds == pytest.approx(MB64 / n / (100 * GB) + 2 * US, rel=1e-12)


def test_ring_alltoall_is_the_bisection():
    # halves of 4: 16 pairs x S/8 each must cross two 50 GB/s NVLink links
    b = big("alltoall", ring(8))
    link = 50 * GB * SIMPLE.link("nvlink").bandwidth_factor
    assert b.seconds == pytest.approx(16 * MB64 / 8 / (2 * link) + 3.4 * US + LAUNCH, rel=1e-12)
    assert b.limit == f"4 ranks | 4 (2 links: {2 * link / GB:g} GB/s)"
    assert big("alltoall", torus(4, 4)).limit == f"2 rows | 2 (8 links: {8 * link / GB:g} GB/s)"


def test_multi_node_cuts():
    t = infiniband(2)
    b = big("broadcast", t)                  # the other node's 8 NICs carry everything
    assert b.seconds == pytest.approx(MB64 / (8 * NIC) + 14 * US + LAUNCH, rel=1e-12)
    assert b.limit == f"1 node | 1 (8 NICs: {8 * NIC / GB:g} GB/s)"
    b = big("allgather", t)                  # a rank: its NVLink port and its NIC
    assert b.seconds == pytest.approx(15 / 16 * MB64 / (NVLINK + NIC) + 3.4 * US + LAUNCH, rel=1e-12)
    port = 25 * A100.protocols["Simple"].link("pcie").bandwidth_factor          # the pcie preset's GPUs
    assert big("allgather", pcie()).limit == f"1 rank in (1 port: {port:g} GB/s)"
    assert big("broadcast", pcie()).limit == f"4 ranks | 4 (1 uplink: {port:g} GB/s)"


def test_latency_is_the_farthest_pair_at_the_best_protocol():
    b = lower_bound("allgather", ring(8), [1])[0]
    assert (b.term, b.protocol) == ("latency", "LL")
    assert b.seconds == pytest.approx(4 * 0.6 * US + 6.6 * US)         # 4 hops of LL's 0.6 us, LL's launch
    assert lower_bound("allgather", ring(8), [1], protocols=("Simple",))[0].seconds == \
        pytest.approx(4 * 3.4 * US + LAUNCH)
    assert lower_bound("allgather", torus(4, 4), [1])[0].limit == "farthest ranks: 4 hops, 2.4 us"
    b = lower_bound("allgather", Uniform(8, 2.0, 100.0), [1])[0]       # the textbook: no launch, LL's quarter
    assert b.seconds == pytest.approx(0.5 * US, rel=1e-4) and b.launch == 0.0
    assert lower_bound("allreduce", nvswitch(), [0])[0].seconds == 0.0   # nothing to move
    assert lower_bound("allreduce", switch(1), [MB64])[0].seconds == 0.0  # one rank


def test_demands():
    n = 8
    assert [demand("allgather", n, k, False) for k in (1, 7)] == [7 / 8, 1 / 8]
    assert [demand("reducescatter", n, k, False) for k in (1, 7)] == [1 / 8, 7 / 8]
    assert demand("alltoall", n, 4, False) == 2.0
    assert (demand("broadcast", n, 3, True), demand("broadcast", n, 3, False)) == (0.0, 1.0)
    assert (demand("reduce", n, 3, True), demand("reduce", n, 3, False)) == (1.0, 0.0)
    assert nccl_size("allgather", 8, 100, 4) == (96, 3) and nccl_size("allreduce", 8, 10, 4) == (8, 2)


def test_the_root_matters_on_an_asymmetric_graph():
    # 0 -> 1 at 100 GB/s but 1 -> 0 at 10: a broadcast from 1 must squeeze into rank 0
    t = topology_from_dict({"ranks": 3, "link": [
        {"from": 0, "to": 1, "alpha_us": 1, "bandwidth_gbps": 100, "duplex": False},
        {"from": 1, "to": 0, "alpha_us": 1, "bandwidth_gbps": 10, "duplex": False},
        {"from": 1, "to": 2, "alpha_us": 1, "bandwidth_gbps": 100}]})
    assert big("broadcast", t, root=0).seconds == pytest.approx(MB64 / (100 * GB) + US, rel=1e-12)
    b = big("broadcast", t, root=1)
    assert b.seconds == pytest.approx(MB64 / (10 * GB) + US, rel=1e-12) and b.limit.startswith("rank 0 in")


def test_allreduce_between_nodes_of_a_graph():
    # 3 nodes of 2 ranks behind switches joined by 20 GB/s links to a core: every element's sum is a
    # gossip among the 3 nodes, 4 crossings through 3 links into them (each node's min cut in)
    t = topology_from_dict({"ranks": 6, "gpus_per_node": 2, "link": [
        {"from": list(range(6)), "to": ["a", "a", "b", "b", "c", "c"], "alpha_us": 1, "bandwidth_gbps": 100},
        {"from": ["a", "b", "c"], "to": ["core"] * 3, "alpha_us": 2, "bandwidth_gbps": 20}]})
    b = big("allreduce", t)
    assert b.seconds == pytest.approx(4 * MB64 / (60 * GB) + 6 * US, rel=1e-12)
    assert b.limit == "every node out (3 links: 60 GB/s)"


def test_unshared_links_carry_any_sum():
    t = topology_from_dict({"ranks": 2, "link": [{"from": 0, "to": 1, "alpha_us": 1, "bandwidth_gbps": 10,
                                                  "shared": False}]})
    b = big("allgather", t)
    assert b.seconds == pytest.approx(0.25 * US) and (b.term, b.protocol) == ("latency", "LL")


def test_bad_input():
    with pytest.raises(UsageError, match="no bound for collective 'allscatter'.*allgather"):
        lower_bound("allscatter", nvswitch(), [8])
    with pytest.raises(UsageError, match="root 8 is not a rank"):
        lower_bound("broadcast", nvswitch(), [8], root=8)
    with pytest.raises(UsageError, match="sizes must be ints >= 0"):
        lower_bound("allreduce", nvswitch(), [-1])
    with pytest.raises(UsageError, match="no path from rank 1 to rank 0|no route into"):
        lower_bound("allgather", topology_from_dict({"ranks": 2, "link": [
            {"from": 0, "to": 1, "alpha_us": 1, "bandwidth_gbps": 10, "duplex": False}]}), [64])
    assert lower_bound("reduce-scatter", nvswitch(), [64])[0].seconds > 0
    assert COLLECTIVE_NAMES == COLLECTIVES


# -- the built-in topologies' cuts are the best of all cuts ----------------------
SMALL = [nvswitch(), pcie(), Uniform(5, 1.0, 10.0), ring(2), ring(5), torus(2, 3), torus(3, 3), torus(2, 4),
         switch(6)]


@pytest.mark.parametrize("topo", SMALL, ids=lambda t: t.name)
def test_builtin_cuts_match_every_cut(topo):
    """The analytic cuts give the bound the min-cut over all 2^n - 2 cuts
    gives (at 64 MB: the data part; a smaller size may find a cut with a
    longer hop into it, so there the analytic bound may only be lower)."""
    assert _routes_model(topo, 0).exact and topo.num_ranks <= ALL_CUTS
    for c in COLLECTIVES:
        sizes = [1, 4096, MB64]
        mine, best = lower_bound(c, topo, sizes), lower_bound(c, topo, sizes, cuts=_routes_model)
        assert mine[-1].seconds == pytest.approx(best[-1].seconds, rel=1e-12), c
        for a, b in zip(mine, best):
            assert a.seconds <= b.seconds * (1 + 1e-12), (c, a, b)


@pytest.mark.parametrize("topo", [nvswitch(), pcie(), infiniband(2), Uniform(6, 1.0, 10.0), ring(7), torus(3, 4)],
                         ids=lambda t: t.name)
def test_builtin_cut_capacities_are_min_cuts_of_the_routes(topo):
    """Each analytic cut's capacity is that of a set of links every route
    into its side crosses: the routes' own min cut (first k ranks; a torus
    also lists them by columns)."""
    n = topo.num_ranks
    routes = {(s, d): topo.route(s, d) for s in range(n) for d in range(n) if s != d}
    model = cut_model(topo)
    for cut in model.cuts[:n - 1]:
        side = frozenset(range(cut.k))
        assert cut.capacity == pytest.approx(_route_cut(topo, routes, side, 0).capacity, rel=1e-12), cut


@pytest.mark.parametrize("rows, cols", [(1, 12), (1, 16), (3, 4), (4, 4), (2, 8), (3, 5)])
def test_torus_bands_are_the_sparsest_cuts(rows, cols):
    """Every cut of a torus up to 16 ranks (numpy over all subsets): no cut
    asks more of its links than the analytic ones, for every collective."""
    topo = torus(rows, cols)
    n = topo.num_ranks
    links = sorted({(s, d) for s in range(n) for d in range(n) if s != d and topo.route(s, d).alpha == topo.alpha})
    masks = np.arange(1, (1 << n) - 1, dtype=np.int64)
    inside = (masks[:, None] >> np.arange(n)) & 1 == 1
    U, V = np.array(links).T
    cap = (~inside[:, U] & inside[:, V]).sum(axis=1) * topo.bandwidth
    k = inside.sum(axis=1)
    model = cut_model(topo)
    for c in COLLECTIVES:
        if c in ROOTED:                            # any rank may be the root: take the worse side
            d = np.ones(len(k))
        else:
            d = np.array([demand(c, n, int(x), False) for x in range(n + 1)])[k]
        every = float((d / cap).max())
        mine = max(max(demand(c, n, cut.k, r) for r in cut.root_in) / cut.capacity for cut in model.cuts)
        assert mine == pytest.approx(every, rel=1e-12), c


# -- never above a simulated time ---------------------------------------------------
def plans(n: int, protocols=("Simple", "LL"), instances=(1,), switch=False):
    """Library plans at ``n`` ranks; ``switch``: only those with switch ops
    (NVLS: the Simple protocol, topologies with NVLS), else none of them."""
    out = []
    for key, alg in algorithms().items():
        if alg.collective.name not in COLLECTIVES or not alg.supports(n) or uses_switch(alg) != switch:
            continue
        try:
            prog = msc.trace(alg, n)
            msc.verify(prog)
        except MscError:
            continue
        out += [(key, lower(prog, LowerOptions(protocol=p, instances=i))) for p in protocols for i in instances]
    return out


def assert_below(topo, plan, key, sizes=(8, 65536, MB64)):
    """The bound at each simulated size is at most the simulated time."""
    results = Simulator(plan, topo).run(list(sizes))
    bounds = lower_bound(plan.collective, topo, [r.size for r in results], root=plan.root)
    worst = math.inf
    for r, b in zip(results, bounds):
        assert b.seconds <= r.seconds * (1 + 1e-9), (topo.name, key, plan.protocol, plan.instances, r, b)
        if b.seconds > 0:
            worst = min(worst, r.seconds / b.seconds)
    return worst


def builtins(n: int):
    out = [ring(n), Uniform(n, 1.5, 80.0)] + [torus(r, n // r) for r in range(2, n) if n % r == 0 and r * r <= n]
    return out + ([nvswitch(), pcie(), infiniband(1)] if n == 8 else [])


def random_topology(seed: int, max_ranks: int = 8):
    """A seeded TOML graph: switches, direct links of unequal bandwidth and
    latency (some one-way, some unshared), a slow ring so every rank is
    reached, sometimes forwarding ranks, a threadblock limit, nodes."""
    rng = random.Random(seed)
    n = rng.randint(2, max_ranks)
    switches = [f"s{i}" for i in range(rng.randint(0, 3))]
    links = [{"from": r, "to": rng.choice(switches), "alpha_us": rng.choice([0.0, 0.5, 1, 3]),
              "bandwidth_gbps": rng.choice([5, 20, 50, 200]), "shared": rng.random() < 0.9}
             for r in range(n) if switches]
    links += [{"from": a, "to": b, "alpha_us": rng.choice([0.5, 2]), "bandwidth_gbps": rng.choice([10, 100])}
              for a, b in zip(switches, switches[1:])]
    for _ in range(rng.randint(0 if switches else n, 2 * n)):
        a, b = rng.sample(range(n), 2)
        links.append({"from": a, "to": b, "alpha_us": rng.choice([0.2, 1, 4]),
                      "bandwidth_gbps": rng.choice([3, 25, 100]), "duplex": rng.random() < 0.8,
                      "shared": rng.random() < 0.9})
    links += [{"from": r, "to": (r + 1) % n, "alpha_us": rng.choice([1, 5]), "bandwidth_gbps": rng.choice([2, 10])}
              for r in range(n)]
    data = {"name": f"random{seed}", "ranks": n, "link": links, "forward": rng.random() < 0.3}
    if rng.random() < 0.3:
        data["threadblock_gbps"] = rng.choice([10, 40])
    if n % 2 == 0 and rng.random() < 0.5:
        data["gpus_per_node"] = 2                  # its parts are one more allreduce partition
    return topology_from_dict(data)


def connected(topo) -> bool:
    n = topo.num_ranks
    try:
        [topo.route(s, d) for s in range(n) for d in range(n) if s != d]
    except UsageError:
        return False
    return True


@pytest.mark.slow          # 7-14 s: CI's slow run; the default run stays short
def test_never_above_the_simulator_on_the_builtin_topologies():
    for key, plan in plans(8, protocols=("Simple",)):
        for topo in builtins(8):
            assert_below(topo, plan, key)
    for key, plan in plans(8, protocols=("LL",)):
        assert_below(nvswitch(), plan, key)
    for key, plan in plans(4, protocols=("LL128",), instances=(2,)):
        assert_below(ring(4), plan, key)
    for key, plan in plans(8, protocols=("Simple",), instances=(1, 16), switch=True):
        assert_below(nvswitch(), plan, key)


def test_never_above_the_simulator_on_random_graphs():
    found = 0
    for seed in range(40):
        topo = random_topology(seed, max_ranks=4)
        if not connected(topo):
            continue
        for key, plan in plans(topo.num_ranks, protocols=("Simple",)):
            assert_below(topo, plan, key)
        found += 1
        if found == 4:
            break
    assert found == 4


@pytest.mark.slow
def test_never_above_the_simulator_anywhere():
    """Every library algorithm at 2..8 ranks, Simple/LL/LL128 x 1/2
    instances, on every built-in topology and 20 random graphs; the switch
    ones (Simple) on a node of as many H100 with NVLS."""
    worst = math.inf
    for n in range(2, 9):
        cands = plans(n, protocols=("Simple", "LL", "LL128"), instances=(1, 2))
        for topo in builtins(n):
            for key, plan in cands:
                worst = min(worst, assert_below(topo, plan, key))
    for n in range(2, 9):                          # switch plans on a node of n H100 with NVLS
        node = dgx(H100, 1, 50.0, f"h100x{n}", gpus_per_node=n)
        for key, plan in plans(n, protocols=("Simple",), instances=(1, 2), switch=True):
            worst = min(worst, assert_below(node, plan, key))
    graphs = [t for t in (random_topology(s) for s in range(60)) if connected(t)][:20]
    assert len(graphs) == 20
    for topo in graphs:
        for key, plan in plans(topo.num_ranks, protocols=("Simple", "LL", "LL128"), instances=(1, 2)):
            worst = min(worst, assert_below(topo, plan, key))
    assert worst >= 1 - 1e-9


# -- with the switch (NVLS) ----------------------------------------------------------
def nvls_plan(n: int, instances: int, name="allreduce/nvls"):
    [(_, plan)] = [(k, p) for k, p in plans(n, protocols=("Simple",), instances=(instances,), switch=True)
                   if k.startswith(name + ":")]
    return plan


@pytest.mark.parametrize("instances", [1, 16])
def test_the_nvls_plan_is_never_faster_than_the_bound_and_meets_it(instances):
    """On dgx-h100 (nvswitch) at 1K-4G: the switch's "every rank out"
    term is what NVLS allreduce moves, so the plan nears it at large sizes."""
    sizes = [1 << k for k in range(10, 33, 2)]
    assert_below(nvswitch(), nvls_plan(8, instances), "allreduce/nvls", sizes)
    [r] = Simulator(nvls_plan(8, 16), nvswitch()).run([4 << 30])
    b = big("allreduce", nvswitch(), r.size)
    assert 0.99 < b.seconds / r.seconds <= 1.0 and "the switch reducing" in b.limit
    # its busbw: 2(n-1)/(n+1) of the switch's port rate, the launch aside
    port_s = (b.seconds - b.launch) / r.size
    assert 2 * 7 / 9 * H100.nvls_gbps * GB == pytest.approx(2 * 7 / 8 / port_s, rel=1e-3)


def test_the_bound_with_nvls_is_below_every_library_allreduce():
    for key, plan in plans(8, protocols=("Simple",)) + plans(8, protocols=("Simple",), switch=True):
        if plan.collective == "allreduce":
            assert_below(nvswitch(), plan, key, sizes=(4096, 1 << 20, MB64))
    assert_below(infiniband(2), nvls_plan(16, 1, "allreduce/nvls_tree"), "allreduce/nvls_tree",
                 sizes=(4096, 1 << 20, MB64))


def test_the_switch_terms_only_where_the_switch_reduces():
    """Without NVLS (or with a protocol switch ops do not run with) the
    bound is the link-only one; with it, only the every-rank partition's
    bytes shrink (to (n + 1) P / (2 (n - 1) R)) and the terms' latencies
    are capped at the two barriers."""
    plain, nvls = Nodes("sw", 1, 8, port_gbps=450.0, port_alpha_us=3.0), \
        Nodes("sw", 1, 8, port_gbps=450.0, port_alpha_us=3.0, nvls_gbps=300.0, nvls_barrier_us=1.0)
    for c in COLLECTIVES:
        a, b = big(c, plain, protocols=("Simple",)), big(c, nvls, protocols=("LL",))
        assert b.seconds == big(c, plain, protocols=("LL",)).seconds, c
        if c != "allreduce":
            # one port's share, at most the barriers' 2 us of latency instead of the hop's 3
            assert big(c, nvls, protocols=("Simple",)).seconds == pytest.approx(a.seconds - 1e-6, rel=1e-12), c
    ar = big("allreduce", nvls, protocols=("Simple",))
    assert ar.seconds == pytest.approx(MB64 * 7 / 8 * 9 / 7 / (300 * GB) + 2e-6, rel=1e-12)
    assert big("allreduce", plain, protocols=("Simple",)).seconds == pytest.approx(
        MB64 * 2 * 7 / 8 / (450 * GB) + 3e-6, rel=1e-12)


# -- tight where it should be ------------------------------------------------------
def test_ring_allgather_on_one_port_is_within_a_few_percent():
    """Large sizes on a one-port switch: the ring moves exactly what a rank
    must receive, and pays a latency per hop and tile to the bound's one
    (16 MiB tiles: 2 of them per hop; at the default 512 KiB, 72%)."""
    for key, plan in plans(8, protocols=("Simple",)):
        if key.startswith("allgather/ring"):
            [r] = Simulator(plan, switch(8), tile=16 << 20).run([256 << 20])
            b = big("allgather", switch(8), r.size)
            assert 0.98 < b.seconds / r.seconds <= 1.0


def test_allpairs_reaches_the_bound_on_nvswitch():
    """Exactly, where messages cost nothing but their latency and bytes; within the per-message cost
    (Simple's step_us, which the bound leaves out) on the calibrated machine."""
    [plan] = [p for k, p in plans(8, protocols=("Simple",), instances=(16,)) if k.startswith("allgather/allpairs")]
    free = nvswitch()
    free.protocols["Simple"] = dataclasses.replace(free.protocols["Simple"], step_us=0.0)
    [r] = Simulator(plan, free).run([MB64])
    assert big("allgather", free).seconds / r.seconds == pytest.approx(1.0, rel=1e-9)
    [r] = Simulator(plan, nvswitch()).run([MB64])
    assert 0.95 < big("allgather", nvswitch()).seconds / r.seconds < 1.0


# -- the command -------------------------------------------------------------------
def cli(argv, capsys):
    from msc.cli.main import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_table_and_json(capsys):
    code, out, _ = cli(["bound", "allgather", "--topology", "nvswitch", "-b", "4", "-e", "64M", "-f", "4"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "# msc bound allgather: 8 ranks on " + nvswitch().summary()
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert rows[0][:2] == ["0", "0"] and rows[0][7] == "none"                       # 4 B: no whole float per rank
    last = rows[-1]
    assert last[0] == str(MB64)
    assert float(last[4]) == pytest.approx(big("allgather", nvswitch()).seconds * 1e6, abs=0.01)
    assert last[7:9] == ["bandwidth", "Simple"] and " ".join(last[9:]) == f"1 rank in (1 port: {NVLINK / GB:g} GB/s)"
    assert "# cuts: every cut that matters (exact)" in lines and "4 -> 0" in lines[-1]
    code, out, _ = cli(["bound", "broadcast", "-t", "ring", "-n", "6", "--root", "2", "-b", "1M", "-e", "1M", "--json",
                        "--protocol", "LL"], capsys)
    [rec] = json.loads(out)
    b = big("broadcast", ring(6), 1 << 20, root=2, protocols=("LL",))
    assert rec["time"] == pytest.approx(b.seconds * 1e6) and rec["protocol"] == "LL" and rec["root"] == 2
    assert rec["busbw"] == pytest.approx(rec["algbw"]) and rec["exact"] is True
    assert set(rec) >= {"size", "count", "type", "time", "algbw", "busbw", "term", "limit", "requested_size"}


@pytest.mark.parametrize("argv, message", [
    (["bound", "allscatter", "-t", "nvswitch"], "no bound for collective 'allscatter'"),
    (["bound", "allreduce", "-t", "nvswitch", "--ranks", "4"], "--ranks 4 does not match topology 'nvswitch'"),
    (["bound", "allreduce", "-t", "ring"], "takes its size from the rank count: give --ranks N"),
    (["bound", "allreduce", "--alpha-us", "1", "--bandwidth-gbps", "10"], "needs a rank count"),
    (["bound", "reduce", "-t", "pcie", "--root", "8"], "root 8 is not a rank"),
    (["bound", "allreduce", "-t", "nvlink"], "unknown topology 'nvlink'"),
])
def test_cli_errors(argv, message, capsys):
    code, _, err = cli(argv, capsys)
    assert code == 2 and message in err, err


def test_simulate_and_tune_show_the_percent_of_bound(tmp_path, capsys):
    plan = tmp_path / "ag.plan"
    assert cli(["compile", "allgather/allpairs", "--ranks", "8", "--instances", "16", "-o", str(plan)], capsys)[0] == 0
    code, out, _ = cli(["simulate", str(plan), "-t", "nvswitch", "-b", "64M", "-e", "64M"], capsys)
    assert code == 0
    header = next(line for line in out.splitlines() if "count" in line)
    [row] = [line for line in out.splitlines() if not line.startswith("#")]
    assert header.split()[-1] == "%bound" and 95.0 < float(row.split()[-1]) < 100.0   # within the message costs
    code, out, _ = cli(["simulate", str(plan), "-t", "nvswitch", "-b", "1K", "-e", "64M", "-f", "64", "--json"], capsys)
    recs = json.loads(out)
    assert all(0 < r["bound_pct"] <= 100 + 1e-9 and r["bound_time"] > 0 for r in recs)
    code, out, _ = cli(["tune", "allgather/ring", "allgather/allpairs", "-n", "8", "-t", "nvswitch", "-b", "1K",
                        "-e", "64M", "-f", "64", "--json"], capsys)
    rows = json.loads(out)["per_size"]
    assert all(0 < r["bound_pct"] <= 100 + 1e-9 for r in rows)
    code, out, _ = cli(["tune", "allgather/ring", "-n", "8", "-t", "nvswitch", "-b", "1K", "-e", "1K"], capsys)
    assert "%bound" in out.splitlines()[1]


def test_simulate_and_tune_show_the_percent_of_bound_for_switch_plans(tmp_path, capsys):
    plan = tmp_path / "nvls.plan"
    assert cli(["compile", "allreduce/nvls", "--ranks", "8", "--instances", "16", "-o", str(plan)], capsys)[0] == 0
    code, out, _ = cli(["simulate", str(plan), "-t", "dgx-h100", "-b", "1K", "-e", "4G", "-f", "64", "--json"], capsys)
    recs = json.loads(out)
    assert code == 0 and all(0 < r["bound_pct"] <= 100 + 1e-9 for r in recs)
    assert recs[-1]["size"] == 256 << 20 and recs[-1]["bound_pct"] > 98.0   # NVLS moves what the switch term says
    code, out, _ = cli(["tune", "allreduce/ring", "allreduce/nvls", "-n", "8", "-t", "dgx-h100", "-b", "64M",
                        "-e", "1G", "-f", "16", "--instances", "16", "--json"], capsys)
    rows = json.loads(out)["per_size"]
    assert code == 0 and all(0 < r["bound_pct"] <= 100 + 1e-9 for r in rows)
    assert all("nvls" in r["winner"] for r in rows), rows
