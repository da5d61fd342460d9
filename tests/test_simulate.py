"""The simulator against the textbook alpha-beta costs (exact, in the limit
where the model is the classic one: uniform links, no contention), the two
engines against each other, contention and max-min sharing, and the
``msc simulate`` command."""
from __future__ import annotations

import argparse
import json
import math
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import msc
from msc.errors import DeadlockError, UsageError
from msc.lower.pipeline import LowerOptions, lower
from msc.sim.events import _Flow, maxmin
from msc.sim.simulate import Simulator
from msc.sim.presets import nvswitch
from msc.sim.topology import Nodes, Uniform

REPO = Path(__file__).resolve().parent.parent
A_US, B_GBPS = 2.0, 100.0
A, B = A_US * 1e-6, B_GBPS * 1e9


@lru_cache(maxsize=None)
def plan_of(name: str, n: int, alg: str | None = None, inplace: bool = False, **params):
    algs = msc.load_algorithms(name)
    algorithm = next(a for a in algs if alg is None or a.name == alg)
    prog = msc.trace(algorithm, n, inplace=inplace, **params)
    msc.verify(prog)
    return lower(prog, LowerOptions())


def times(plan, topology=None, sizes=(8192, 65536, 1 << 20), engine="auto", **kw):
    sim = Simulator(plan, topology or Uniform(plan.num_ranks, A_US, B_GBPS), **kw)
    return sim.run(list(sizes), engine=engine)


def assert_formula(plan, formula, topology=None, sizes=(8192, 65536, 1 << 20), **kw):
    for engine in ("fast", "events"):
        for r in times(plan, topology, sizes, engine=engine, **kw):
            expected = formula(plan.num_ranks, r.size, r.iterations)
            assert r.seconds == pytest.approx(expected, rel=1e-12, abs=0), (engine, r)


# -- textbook costs ------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_ring_allreduce_is_textbook(n):
    # 2(N-1) messages of S/N, one after the other: 2(N-1)(alpha + S/(N B)) (peers.md)
    assert_formula(plan_of("allreduce/ring", n), lambda N, S, I: 2 * (N - 1) * (A + S / (N * B)),
                   sizes=(n * 4096, n * 65536))


def test_ring_allreduce_with_gamma_adds_the_reductions():
    # N-1 of the hops reduce S/N bytes each: + (N-1)/N S gamma
    n = 8
    topo = Uniform(n, A_US, B_GBPS, reduce_gbps=50.0)
    assert_formula(plan_of("allreduce/ring", n),
                   lambda N, S, I: 2 * (N - 1) * (A + S / (N * B)) + (N - 1) / N * S / 50e9, topo)


def test_ring_allreduce_tiles_pay_latency_per_iteration():
    # the runtime loops over tiles, each iteration a whole ring: 2(N-1)(I alpha + S/(N B))
    n = 8
    plan = plan_of("allreduce/ring", n)
    sizes = (n * (512 << 10) * 3, n * (512 << 10) * 8 + 8 * 1024)
    assert_formula(plan, lambda N, S, I: 2 * (N - 1) * (I * A + S / (N * B)), sizes=sizes)
    assert [r.iterations for r in times(plan, sizes=sizes)] == [3, 9]


@pytest.mark.parametrize("n", [2, 4, 8, 32])
def test_halving_doubling_is_textbook(n):
    # 2 log2(N) alpha + 2 (N-1)/N S/B (Rabenseifner; gamma = 0)
    assert_formula(plan_of("allreduce/halving_doubling", n),
                   lambda N, S, I: 2 * math.log2(N) * A + 2 * (N - 1) / N * S / B)


@pytest.mark.parametrize("n", [6, 12])
def test_halving_doubling_with_extra_ranks(n):
    # the library folds the n - m extra ranks into the core first and unfolds them last:
    # one more whole-buffer message each way: 2 (log2 m + 1) alpha + (2 + 2 (m-1)/m) S/B
    m = 1 << (n.bit_length() - 1)
    assert_formula(plan_of("allreduce/halving_doubling", n),
                   lambda N, S, I: 2 * (math.log2(m) + 1) * A + (2 + 2 * (m - 1) / m) * S / B)


def test_ring_allgather_and_reducescatter():
    # S is nccl-tests' size, the whole gathered array: (N-1)(alpha + S/(N B))
    for name in ("allgather/ring", "reducescatter/ring"):
        assert_formula(plan_of(name, 8), lambda N, S, I: (N - 1) * (A + S / (N * B)))


def test_recursive_doubling_allgather():
    assert_formula(plan_of("allgather/recursive_doubling", 8), lambda N, S, I: 3 * A + (N - 1) / N * S / B)


def test_trees_without_pipelining():
    # one chunk: a binomial tree's depth ceil(log2 N) rounds of a whole buffer each way
    # (the uniform model lets a rank send to its children at once, as the textbook bound assumes)
    depth = lambda N: math.ceil(math.log2(N))  # noqa: E731
    assert_formula(plan_of("allreduce/tree", 8, "binomial", chunks=1), lambda N, S, I: 2 * depth(N) * (A + S / B),
                   sizes=(8192, 65536))
    assert_formula(plan_of("broadcast/binomial_tree", 8, chunks=1), lambda N, S, I: depth(N) * (A + S / B),
                   sizes=(8192, 65536))
    assert_formula(plan_of("reduce/tree", 8, chunks=1), lambda N, S, I: depth(N) * (A + S / B), sizes=(8192, 65536))


@pytest.mark.parametrize("chunks", [1, 4])
def test_pipelined_chain_broadcast_approaches_bandwidth(chunks):
    # P = chunks x iterations pieces of p = S/P bytes: (K-1) alpha + (K-2+P) p/B, the course's
    # (K-2+S) N/(S B) plus latency; needs enough slots to keep the chain busy (see docs/performance.md)
    plan = plan_of("broadcast/chain", 8, chunks=chunks)
    sizes = (1 << 22, 1 << 26)
    assert_formula(plan, lambda N, S, I: (N - 1) * A + (N - 2 + chunks * I) * S / (chunks * I) / B, sizes=sizes,
                   slots=8)
    big = times(plan, sizes=(1 << 28,), slots=8)[0]
    assert big.size / big.seconds > 0.97 * B        # the bandwidth bound


def test_few_slots_throttle_a_pipeline():
    plan = plan_of("broadcast/chain", 8, chunks=4)
    [one] = times(plan, sizes=(1 << 26,), slots=1)
    [eight] = times(plan, sizes=(1 << 26,), slots=8)
    assert one.seconds > 1.5 * eight.seconds


# -- contention and the engines -------------------------------------------------
def test_maxmin_water_filling():
    # link 0 (10) carries a, b, c; link 1 (4) carries c and d: c and d get 2, a and b share the rest (4 each)
    caps = [10.0, 4.0]
    a, b = _Flow(0, 1.0, (0,), math.inf, 0.0), _Flow(1, 1.0, (0,), math.inf, 0.0)
    c, d = _Flow(2, 1.0, (0, 1), math.inf, 0.0), _Flow(3, 1.0, (1,), math.inf, 0.0)
    members = {0: {a, b, c}, 1: {c, d}}
    rates = maxmin([a, b, c, d], caps, members)
    assert rates[c] == pytest.approx(2) and rates[d] == pytest.approx(2)
    assert rates[a] == pytest.approx(4) and rates[b] == pytest.approx(4)
    a.cap = 1.0                                      # a private cap frees link 0 for b
    rates = maxmin([a, b, c, d], caps, members)
    assert rates[a] == pytest.approx(1) and rates[b] == pytest.approx(7)


@pytest.mark.parametrize("n", [4, 8])
def test_shared_ports_are_shared_fairly(n):
    # all-pairs allgather on a switch: N-1 flows leave each port at once, alpha + (N-1) S/(N B)
    topo = Nodes("switch", 1, n, port_gbps=B_GBPS, port_alpha_us=A_US)
    plan = plan_of("allgather/allpairs", n)
    for r in times(plan, topo):
        assert r.engine == "events" and r.contended
        assert r.seconds == pytest.approx(A + (n - 1) * r.size / (n * B), rel=1e-12)
    # without the ports (uniform: a link per pair) the same plan is alpha + S/(N B), no contention
    for r in times(plan):
        assert r.engine == "fast" and not r.contended
        assert r.seconds == pytest.approx(A + r.size / (n * B), rel=1e-12)


def test_overlap_below_capacity_is_not_contention():
    # ring x4 on NVSwitch: 4 threadblocks share a port but 4 x 40 GB/s < 450 GB/s: the fast engine is exact
    plan = lower(msc.trace(msc.load_algorithms("allreduce/ring")[0], 8), LowerOptions(instances=4))
    fast = times(plan, nvswitch(), sizes=(1 << 20, 1 << 26))
    events = times(plan, nvswitch(), sizes=(1 << 20, 1 << 26), engine="events")
    for f, e in zip(fast, events):
        assert f.engine == "fast" and f.seconds == pytest.approx(e.seconds, rel=1e-9)


LIBRARY = [("allreduce/ring", None, {}), ("allreduce/halving_doubling", None, {}), ("allreduce/tree", "binomial", {}),
           ("allreduce/tree", "double_binary", {}), ("allreduce/torus2d", None, {}), ("allreduce/allpairs", None, {}),
           ("allreduce/hierarchical", None, {}), ("allgather/ring", None, {}), ("broadcast/chain", None, {}),
           ("alltoall/allpairs", None, {}), ("reduce/tree", None, {}), ("reducescatter/ring", None, {})]


@pytest.mark.parametrize("name,alg,params", LIBRARY)
def test_engines_agree(name, alg, params):
    """Fast (max-plus) and event engines, on a topology with contention:
    the same time wherever the fast engine claims no contention."""
    plan = plan_of(name, 8, alg, **params)
    topo = Nodes("switch", 1, 8, port_gbps=100.0, port_alpha_us=1.0, threadblock_gbps=30.0, reduce_gbps=500.0)
    sizes = (4096, 1 << 20, 40 << 20)
    for f, e in zip(times(plan, topo, sizes), times(plan, topo, sizes, engine="events")):
        assert f.seconds == pytest.approx(e.seconds, rel=1e-9), (f, e)


def test_periodic_jumps_are_exact():
    from msc.sim import fast as sim_fast

    plan = lower(msc.trace(msc.load_algorithms("allreduce/tree")[0], 8), LowerOptions(protocol="LL"))
    sizes = (1 << 24, 5 << 22)
    jumped = times(plan, nvswitch(), sizes)
    assert max(r.iterations for r in jumped) > 100
    old = sim_fast.JUMP_MIN
    sim_fast.JUMP_MIN = 10 ** 9
    try:
        full = times(plan, nvswitch(), sizes)
    finally:
        sim_fast.JUMP_MIN = old
    for a, b in zip(jumped, full):
        assert a.seconds == pytest.approx(b.seconds, rel=1e-10)


def test_deadlock_with_too_few_slots():
    plan = plan_of("allreduce/ring", 4)
    assert plan.slots == 2
    for engine in ("fast", "events"):
        with pytest.raises(DeadlockError):
            times(plan, sizes=(4096,), engine=engine, slots=1)


def test_protocols_and_sizes():
    ll = lower(msc.trace(msc.load_algorithms("allreduce/ring")[0], 8), LowerOptions(protocol="LL"))
    simple = plan_of("allreduce/ring", 8, inplace=True)
    topo = nvswitch()
    [ll_small, ll_big] = times(ll, topo, sizes=(1024, 1 << 28))
    [s_small, s_big] = times(simple, topo, sizes=(1024, 1 << 28))
    assert ll_small.seconds < s_small.seconds / 2      # LL: a quarter of the latency
    assert ll_big.seconds > 1.5 * s_big.seconds        # and half the bandwidth
    zero, odd = times(simple, topo, sizes=(0, 1001))
    assert zero.seconds == 0 and zero.iterations == 0
    assert odd.size == 1000 and odd.count == 250         # whole elements per unit, as msc run rounds


def test_ring_plan_builder_matches_lowering():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from simulate_speed import ring_plan
    finally:
        sys.path.pop(0)
    assert ring_plan(6) == plan_of("allreduce/ring", 6)


def test_topology_must_match_the_plan():
    with pytest.raises(UsageError, match="ranks"):
        Simulator(plan_of("allreduce/ring", 4), nvswitch())


# -- the command ------------------------------------------------------------
def run_cli(argv, capsys):
    """msc.cli.main.main with the simulator's commands registered."""
    from msc.cli import main as cli
    from msc.cli.sim import add_commands

    orig = cli.build_parser

    def build():
        parser = orig()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "simulate" not in sub.choices:
            add_commands(sub, cli.load_plan_arg)
        return parser

    cli.build_parser = build
    try:
        rc = cli.main([str(a) for a in argv])
    finally:
        cli.build_parser = orig
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_simulate_command(tmp_path, capsys):
    from msc.formats.plan_text import save_plan

    path = save_plan(plan_of("allreduce/ring", 8), tmp_path / "ring.plan")
    rc, out, err = run_cli(["simulate", path, "--alpha-us", A_US, "--bandwidth-gbps", B_GBPS, "-b", "8K", "-e", "32K",
                            "-f", "2"], capsys)
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [8192, 16384, 32768]
    t = 2 * 7 * (A + 8192 / (8 * B)) * 1e6
    assert float(rows[0][5]) == pytest.approx(t, abs=0.01)
    # predicted: nothing is checked, so no #wrong column and no "Out of bounds" verdict; msc bound's %bound last
    assert all(len(r) == 9 for r in rows) and "#wrong" not in out and "Out of bounds" not in out and "%bound" in out
    rc, out, err = run_cli(["simulate", path, "-t", "nvswitch", "-b", "1M", "-e", "1M", "--json"], capsys)
    assert rc == 0
    [record] = json.loads(out)
    assert record["size"] == 1 << 20 and record["busbw"] == pytest.approx(record["algbw"] * 14 / 8)
    rc, out, err = run_cli(["simulate", path, "-t", "ring:4"], capsys)
    assert rc == 2 and "4 ranks" in err
    rc, out, err = run_cli(["simulate", path], capsys)
    assert rc == 2 and "--topology" in err


def test_simulate_prices_uneven_alltoall_as_padded_units(tmp_path, capsys):
    """--splits: the plan's time at the padded size (msc.torch's way), beside
    the even call's; skewed routing pads by about n times the hot rank's
    share, uniform by its sampling noise; on textbook links a large call's
    time grows by the padding."""
    from msc.formats.plan_text import save_plan
    from msc.sim.uneven import SplitStats, token_matrix, uneven_records

    plan = plan_of("alltoall/allpairs", 8)
    sim = Simulator(plan, Uniform(8, A_US, B_GBPS))
    for text, lo, hi in (("uniform", 1.0, 1.2), ("skewed", 2.5, 3.5), ("skewed:0.5", 1.5, 2.3)):
        stats = SplitStats.parse(text)
        m = token_matrix(stats, 8, 4096)
        assert (m.sum(axis=1) == 4096).all()
        [rec] = uneven_records(sim, [64 << 20], stats)
        assert rec["pad"] == m.max() * 8 / 4096 and lo < rec["pad"] < hi, (text, rec["pad"])
        assert rec["time"] == sim.records([round((64 << 20) * rec["pad"])])[0]["time"]
        assert rec["even_time"] == sim.records([64 << 20])[0]["time"]
        assert rec["vs_even"] == pytest.approx(rec["pad"], rel=0.03)           # bandwidth-bound: the padding
        assert 1 <= rec["busiest"] <= rec["pad"]
    path = save_plan(plan, tmp_path / "a2a.plan")
    rc, out, err = run_cli(["simulate", path, "-t", "nvswitch", "-b", "1M", "-e", "1M", "--splits", "skewed:1.5",
                            "--tokens", "512", "--json"], capsys)
    assert rc == 0, err
    [rec] = json.loads(out)
    assert (rec["splits"], rec["tokens"], rec["size"]) == ("skewed:1.5", 512, 1 << 20)
    rc, out, err = run_cli(["simulate", path, "-t", "nvswitch", "-b", "1M", "-e", "1M", "--splits", "skewed"], capsys)
    assert rc == 0 and "alltoall with uneven splits, 8 ranks, 4096 tokens per rank" in out and "vs even" in out, out
    ring = save_plan(plan_of("allreduce/ring", 8), tmp_path / "ring.plan")
    for plan_file, args, says in ((ring, ["--splits", "skewed"], "'ring' is a plan of allreduce"),
                                  (path, ["--tokens", "5"], "--tokens goes with --splits"),
                                  (path, ["--splits", "zipf"], "expected uniform, skewed or skewed:Z")):
        rc, out, err = run_cli(["simulate", plan_file, "-t", "nvswitch", *args], capsys)
        assert rc == 2 and says in err, err


def test_custom_collective(tmp_path):
    # a pipeline hand-off (not an nccl-tests collective): busbw = algbw, one hop of S per stage
    path = tmp_path / "pipe.py"
    path.write_text(
        "import msc\n"
        "send_next = msc.CustomCollective('send_next', input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,\n"
        "                                 postcondition=lambda r, i, n, k: None if r == 0 else [(r - 1, i)])\n"
        "@msc.algorithm(send_next, chunk_factor=1)\n"
        "def backward(p):\n"
        "    for r in reversed(range(p.num_ranks - 1)):\n"
        "        p.chunk(r, 'input', 0).copy(r + 1, 'output', 0)\n")
    [alg] = msc.load_algorithms(path)
    plan = lower(msc.trace(alg, 4, inplace=False), LowerOptions(), collective=alg.collective)
    assert plan.slots == 1
    sim = Simulator(plan, Uniform(4, A_US, B_GBPS), slots=1)
    [rec] = sim.records([256 << 10])
    assert rec["busbw"] == rec["algbw"] and rec["time"] == pytest.approx((A + (256 << 10) / B) * 1e6)
    # two tiles through one slot: the second waits for the first's release (a latency each way)
    [rec] = sim.records([1 << 20])
    assert rec["iterations"] == 2 and rec["time"] == pytest.approx((3 * A + (1 << 20) / B) * 1e6)
    # msc's runtime gives the connection 8 slots (the default): the second tile follows the first
    [rec] = Simulator(plan, Uniform(4, A_US, B_GBPS)).records([1 << 20])
    assert rec["iterations"] == 2 and rec["time"] == pytest.approx((A + (1 << 20) / B) * 1e6)


def test_simulate_gives_a_plan_the_slots_its_runtime_gives(tmp_path, capsys):
    """A plan file runs on msc's runtime (max(plan.slots, 8) slots per
    connection), MSCCL XML on an MSCCL runtime (Simple: 2); --slots and
    --runtime say otherwise."""
    from msc.formats.plan_text import save_plan
    from msc.formats.xml_export import plan_to_xml

    plan = plan_of("allreduce/tree", 4)
    assert plan.slots == 1
    path = save_plan(plan, tmp_path / "tree.plan")
    xml = tmp_path / "tree.xml"
    xml.write_text(plan_to_xml(plan, runtime="msccl"))

    def simulated(*argv):
        rc, out, err = run_cli(["simulate", *argv, "--alpha-us", A_US, "--bandwidth-gbps", B_GBPS,
                                "-b", "64M", "-e", "64M", "--json"], capsys)
        assert rc == 0, err
        return json.loads(out)[0]["time"]

    def expected(slots):
        return Simulator(plan, Uniform(4, A_US, B_GBPS), slots=slots).records([64 << 20])[0]["time"]

    assert expected(1) > expected(2) > expected(8)         # the slots matter for this plan at this size
    assert simulated(path) == pytest.approx(expected(8))
    assert Simulator(plan, Uniform(4, A_US, B_GBPS)).slots == 8
    assert simulated(path, "--slots", 1) == pytest.approx(expected(1))
    assert simulated(xml) == pytest.approx(expected(2)) == simulated(path, "--runtime", "msccl")
