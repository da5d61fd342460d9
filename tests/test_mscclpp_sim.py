"""``msc simulate`` of MSCCL++ plans in the one-sided cost model
(msc.sim.onesided): its arithmetic on the textbook model, the library's
exports against msc's own simulation of the plans they came from, plans in
shapes lift cannot read (gets, several puts before one signal, threadblocks
chained by semaphores) with times that move as the model says, switch
channels against msc's simulator of the NVLS plans they were exported from,
port channels through their proxies, every operation name priced or refused,
and the command line."""
from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
from pathlib import Path

import pytest

import clirun
import msc
from msc.errors import PlanError, UsageError
from msc.formats.mscclpp.export import plan_to_mscclpp_json
from msc.formats.mscclpp.check import verify_mscclpp
from msc.formats.mscclpp.lift import lift_plan
from msc.formats.mscclpp.reader import parse_mscclpp
from msc.lower.pipeline import LowerOptions, lower
from msc.ir.onesided import KNOWN_OPS, Operation
from msc.sim.onesided import PRICING, PROXY_US, OneSidedSimulator, switch_port_load
from msc.sim.presets import get_topology
from msc.sim.simulate import Simulator
from msc.sim.topology import Uniform
from library import algorithms, rank_counts
from test_mscclpp_channels import nvls_allgather_packets, nvls_allreduce      # switch plans in the executor's format

ALGORITHMS = algorithms(switch=False)
CASES = [(key, n) for key in ALGORITHMS for n in rank_counts(ALGORITHMS[key], (4, 8))]
MB = 1024 ** 2


# -- hand-written plans (the format as src/core/executor/execution_plan.cc reads it) -------------
def _peers(r: int, n: int) -> list[int]:
    return [p for p in range(n) if p != r]


def _gpu(r: int, n: int, threadblocks: list[list[dict]], semaphores=(), inputs: int = 1, outputs: int = 0) -> dict:
    """Rank ``r`` with a memory channel and a remote output buffer per peer (channel and buffer_id j: the
    j-th peer), every threadblock declaring them all."""
    peers = _peers(r, n)
    tb = lambda ops: {"id": 0, "ops": ops,
                      "channels": [{"channel_type": "memory", "channel_ids": list(range(len(peers)))}],
                      "remote_buffer_refs": [{"access_channel_type": "memory",
                                              "remote_buffer_ids": list(range(len(peers)))}]}
    tbs = [dict(tb(ops), id=t) for t, ops in enumerate(threadblocks)]
    return {"id": r, "input_chunks": inputs, "output_chunks": outputs or n, "scratch_chunks": 0,
            "channels": [{"channel_type": "memory", "connected_to": peers}],
            "remote_buffers": [{"rank": p, "type": "o", "access_channel_types": ["memory"]} for p in peers],
            "semaphores": [{"init_value": v} for v in semaphores], "threadblocks": tbs}


def _plan(name: str, gpus: list[dict], collective: str = "allgather") -> dict:
    return {"name": name, "collective": collective, "protocol": "Simple", "inplace": False, "gpus": gpus}


def _sync(n: int) -> list[dict]:
    """Publish what came before to every peer, then wait for every peer to do the same."""
    every = list(range(n - 1))
    return [{"name": "nop"}, {"name": "signal", "channel_ids": every, "channel_type": "memory"},
            {"name": "wait", "channel_ids": every, "channel_type": "memory"}, {"name": "nop"}]


def _own_copy(r: int) -> dict:
    return {"name": "copy", "src_buff": [{"type": "i", "index": 0, "size": 1}],
            "dst_buff": [{"type": "o", "index": r, "size": 1}]}


def _put(r: int, j: int, source: int = 0) -> dict:
    return {"name": "put", "src_buff": [{"type": "i", "index": source, "size": 1}],
            "dst_buff": [{"buffer_id": j, "index": r, "size": 1}], "channel_ids": [j], "channel_type": "memory"}


def get_allgather(n: int) -> dict:
    """Each rank copies its input into its output, tells its peers, gets each peer's chunk from the peer's
    output, and tells them it has read (a get-based allgather: lift reads no gets)."""
    def ops(r):
        gets = [{"name": "get", "src_buff": [{"buffer_id": j, "index": p, "size": 1}],
                 "dst_buff": [{"type": "o", "index": p, "size": 1}], "channel_ids": [j], "channel_type": "memory"}
                for j, p in enumerate(_peers(r, n))]
        return [_own_copy(r)] + _sync(n) + gets + _sync(n)
    return _plan("get_allgather", [_gpu(r, n, [ops(r)]) for r in range(n)])


def put_allgather(n: int) -> dict:
    """Each rank puts its input straight into every peer's output, several puts before one signal (lift
    reads one put a signal, into a scratch slot); the k-th puts of all ranks go to distinct peers."""
    ops = lambda r: [_own_copy(r)] + [_put(r, _peers(r, n).index((r + 1 + k) % n)) for k in range(n - 1)] + _sync(n)
    return _plan("put_allgather", [_gpu(r, n, [ops(r)]) for r in range(n)])


def spread_allgather(n: int, chained: bool) -> dict:
    """put_allgather with each put on a threadblock of its own (parallel), or the same threadblocks each
    waiting for the previous one's put through a device semaphore (a serial chain)."""
    def tbs(r):
        out = []
        for step in range(n - 1):                  # the k-th puts of all ranks go to distinct peers
            j = _peers(r, n).index((r + 1 + step) % n)
            acquire = [{"name": "sem_acquire", "semaphore_ids": [step - 1]}] if chained and step else []
            release = [{"name": "sem_release", "semaphore_ids": [step]}] if chained and step < n - 2 else []
            out.append(acquire + [_put(r, j), {"name": "nop"},
                                  {"name": "signal", "channel_ids": [j], "channel_type": "memory"}] + release
                       + [{"name": "wait", "channel_ids": [j], "channel_type": "memory"}])
        out[0] = [_own_copy(r)] + out[0]
        return out
    sems = [0] * (n - 2) if chained else []
    return _plan("chained" if chained else "parallel", [_gpu(r, n, tbs(r), sems) for r in range(n)])


def read(doc: dict):
    plan = parse_mscclpp(json.dumps(doc))
    verify_mscclpp(plan)                  # what msc verify takes: the model times only such plans
    return plan


# -- the model's arithmetic on the textbook alpha-beta model -----------------------------------
def test_a_put_then_wait_costs_its_bytes_over_the_rate_plus_one_latency():
    topo = Uniform(2, alpha_us=1.0, bandwidth_gbps=10.0)          # textbook: no launch, overheads or copy costs
    sim = OneSidedSimulator(read(put_allgather(2)), topo)
    size = 2 * MB
    [r] = sim.run([size])
    assert r.chunk == MB and r.seconds == pytest.approx(MB / 10e9 + 1e-6, rel=1e-12)


def test_two_threadblocks_putting_over_one_link_share_it():
    topo = Uniform(2, alpha_us=1.0, bandwidth_gbps=10.0)
    # rank r's two threadblocks put its two input chunks into the peer's output chunks 0 and 1 at once
    tbs = [[_put(c, 0, source=c), {"name": "nop"}, {"name": "signal", "channel_ids": [0], "channel_type": "memory"},
            {"name": "wait", "channel_ids": [0], "channel_type": "memory"}] for c in (0, 1)]
    plan = read(_plan("two_flows", [_gpu(r, 2, tbs, inputs=2, outputs=2) for r in range(2)], collective="pairs"))
    [r] = OneSidedSimulator(plan, topo).run([2 * MB])
    # both 1 MB flows cross the link r->peer together at half its rate each, and end together
    assert r.chunk == MB and r.seconds == pytest.approx(2 * MB / 10e9 + 1e-6, rel=1e-12)


# -- shapes lift cannot read, timed ---------------------------------------------------------------
FOREIGN = {"get_allgather": get_allgather, "put_allgather": put_allgather}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_a_foreign_shape_simulates_and_doubles_its_time_with_its_size(name):
    plan = read(FOREIGN[name](8))
    with pytest.raises(PlanError, match="not in the shape msc's MSCCL\\+\\+ export writes"):
        lift_plan(plan)
    sim = OneSidedSimulator(plan, get_topology("dgx-h100", 8))
    small, large, double = sim.run([8 * 1024, 256 * MB, 512 * MB])
    assert 0 < small.seconds < large.seconds
    # at large sizes bytes over rates dominate: twice the bytes, about twice the time (less the fixed latencies)
    assert 1.95 < double.seconds / large.seconds <= 2.0


def test_a_serial_chain_of_threadblocks_is_slower_than_its_parallel_twin():
    topo = get_topology("dgx-h100", 8)
    parallel, chained = (OneSidedSimulator(read(spread_allgather(8, c)), topo) for c in (False, True))
    [p], [c] = parallel.run([256 * MB]), chained.run([256 * MB])
    view = topo.view("Simple")
    port = view.capacity[view.route(0, 1).resources[0]]          # rank 0's NVLink port out (Simple's share)
    assert 7 * view.threadblock_bandwidth > port
    # side by side, the 7 puts share the rank's port fairly; chained, one at a time at a threadblock's rate
    fixed = view.launch + view.step_overhead + view.route(0, 1).alpha      # a launch, a signal, a wait
    assert p.chunk / (port / 7) < p.seconds < p.chunk / (port / 7) + p.chunk * topo.delta + fixed
    assert c.seconds == pytest.approx(7 * c.chunk / view.threadblock_bandwidth, rel=0.02)
    assert c.seconds > 5 * p.seconds


def test_a_put_per_peer_on_one_threadblock_is_as_slow_as_the_chain():
    topo = get_topology("dgx-h100", 8)
    one, chained = (OneSidedSimulator(read(doc), topo) for doc in (put_allgather(8), spread_allgather(8, True)))
    [a], [b] = one.run([256 * MB]), chained.run([256 * MB])
    assert a.seconds == pytest.approx(b.seconds, rel=0.01)      # one threadblock's puts go one after another


# -- the consistency yardstick: the library's exports against msc's own simulation ---------------
@functools.lru_cache(maxsize=None)
def library_pair(key: str, n: int, protocol: str):
    plan = lower(msc.trace(ALGORITHMS[key], n, inplace=False), LowerOptions(protocol=protocol))
    return plan, parse_mscclpp(plan_to_mscclpp_json(plan))


def reference_simulator(plan, topo) -> Simulator:
    """msc's simulator run as the export runs: a chunk in one piece (the executor moves whole chunks; msc's
    runtime tiles them), the connection's slots (Simple: the plan's; LL: one per message)."""
    if plan.protocol == "LL":
        slots = max(sum(1 for s in tb.steps if s.op.sends) for rp in plan.ranks for tb in rp.threadblocks)
    else:
        slots = plan.slots
    return Simulator(plan, topo, tile=1 << 40, slots=max(slots, 1))


SIZES = [1024, 1 * MB, 64 * MB]


@pytest.mark.parametrize("protocol", ["Simple", "LL"])
def test_every_library_export_agrees_with_msc_simulation_of_its_plan(protocol):
    for key, n in CASES:
        plan, osp = library_pair(key, n, protocol)
        topo = get_topology("dgx-h100" if n % 8 == 0 else f"ring:{n}", n)
        one = OneSidedSimulator(osp, topo).run(SIZES)
        ref = reference_simulator(plan, topo).run([a.size for a in one])     # whole 16-byte units a chunk
        view = topo.view(protocol)
        drain = view.step_overhead + max(view.route(0, p).alpha for p in range(1, n))
        for a, b in zip(one, ref):
            assert a.size == b.size, (key, n)
            ratio = a.seconds / b.seconds
            if protocol == "LL":                 # no extra copies, and the credits pass at once: the same schedule
                assert abs(ratio - 1) < 0.02, (key, n, a.size, ratio)
            else:                                # what the export adds costs time, never saves any
                assert 0.999 < ratio < (1.35 if a.size < 64 * MB else 1.06), (key, n, a.size, ratio)
        # at the smallest size the difference is the senders' wait for their last credits (a credit signal's
        # overhead and latency at most): the export's drain, which msc's runtime does not do
        assert -1e-9 < one[0].seconds - ref[0].seconds <= drain + 1e-9, (key, n)


# -- the command line ----------------------------------------------------------------------------
# in this process (tests/clirun.py); tests/test_cli_processes.py runs each command as a process
def cli(*args, cwd) -> subprocess.CompletedProcess:
    return clirun.msc(*args, cwd=cwd)


def test_simulate_says_which_model_ran(tmp_path):
    (tmp_path / "gets.json").write_text(json.dumps(get_allgather(8)))
    plan, _ = library_pair("allgather/ring:ring", 8, "Simple")
    (tmp_path / "ring.json").write_text(plan_to_mscclpp_json(plan))
    runs = {}
    for name, extra in (("gets", ()), ("ring", ()), ("ring", ("--model", "onesided"))):
        out = cli("simulate", f"{name}.json", "-t", "dgx-h100", "-b", "1M", "-e", "4M", "--json", *extra,
                  cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        runs[(name, extra)] = json.loads(out.stdout)
    assert {r["model"] for r in runs[("gets", ())]} == {"onesided"}
    assert {r["model"] for r in runs[("ring", ())]} == {"lifted"}
    assert {r["model"] for r in runs[("ring", ("--model", "onesided"))]} == {"onesided"}
    assert [r["size"] for r in runs[("gets", ())]] == [MB, 2 * MB, 4 * MB]
    assert all(r["busbw"] == pytest.approx(r["algbw"] * 7 / 8) for r in runs[("gets", ())])
    text = cli("simulate", "gets.json", "-t", "dgx-h100", "-b", "1M", "-e", "1M", cwd=tmp_path)
    assert "MSCCL++ plan in the one-sided model (msc.sim.onesided)" in text.stdout
    refused = cli("simulate", "gets.json", "-t", "dgx-h100", "--tile", "4096", cwd=tmp_path)
    assert refused.returncode == 2 and "--tile describes an msc plan's run" in refused.stderr
    foreign = json.loads(plan_to_mscclpp_json(plan))
    del foreign["msc_slots"]                        # msc's shape, but not msc's export: its slots unknown
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    out = cli("simulate", "foreign.json", "-t", "dgx-h100", "-b", "1M", "-e", "1M", "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)[0]["model"] == "onesided", out.stderr
    lifted = cli("simulate", "gets.json", "-t", "dgx-h100", "--model", "lifted", cwd=tmp_path)
    assert lifted.returncode != 0 and "operation 5 (get): not in the shape" in lifted.stderr


def test_simulate_refuses_a_plan_msc_verify_refuses(tmp_path):
    doc = get_allgather(4)
    for g in doc["gpus"]:
        g["threadblocks"][0]["ops"] = g["threadblocks"][0]["ops"][:-4]     # no wait for the peers' reads
    (tmp_path / "early.json").write_text(json.dumps(doc))
    out = cli("simulate", "early.json", "-t", "ring:4", cwd=tmp_path)
    assert out.returncode != 0 and "nothing on rank" in out.stderr


def test_the_flags_of_other_plans_are_refused(tmp_path):
    assert cli("compile", "allgather/ring", "--ranks", "4", "-o", "ag.plan", cwd=tmp_path).returncode == 0
    out = cli("simulate", "ag.plan", "-t", "ring:4", "--model", "onesided", cwd=tmp_path)
    assert out.returncode == 2 and "--model onesided chooses how an MSCCL++ plan (.json) is simulated" in out.stderr
    out = cli("simulate", "--nccl", "allreduce", "-t", "dgx-h100", "--model", "lifted", cwd=tmp_path)
    assert out.returncode == 2 and "--model" in out.stderr
    with pytest.raises(UsageError, match="topology 'ring:4' has 4 ranks, plan 'get_allgather' 8"):
        OneSidedSimulator(read(get_allgather(8)), get_topology("ring", 4))


def _put_pair(shape: str) -> dict:
    """A 2-rank allgather whose put is plain, split over a threadblock group of 2, or a pipeline of 4 slices."""
    signal_wait = [{"name": "nop"}, {"name": "signal", "channel_ids": [0], "channel_type": "memory"},
                   {"name": "wait", "channel_ids": [0], "channel_type": "memory"}]
    def tbs(r):
        if shape == "group":
            return [([_own_copy(r)] if i == 0 else []) + [dict(_put(r, 0), tbg_info={"tb_id": i, "tbg_size": 2})]
                    + signal_wait for i in range(2)]
        put = _put(r, 0)
        if shape == "pipeline":
            put = {"name": "pipeline", "iter_context": {"unit_size": 256 * 1024, "num_chunks": 1}, "ops": [put]}
        return [[_own_copy(r), put] + signal_wait]
    return _plan(shape, [_gpu(r, 2, tbs(r)) for r in range(2)])


def test_a_pipeline_runs_its_slices_in_turn_and_a_group_splits_the_bytes():
    topo = Uniform(2, alpha_us=1.0, bandwidth_gbps=100.0, threadblock_gbps=10.0)   # the threadblock limits
    times = {shape: OneSidedSimulator(read(_put_pair(shape)), topo).run([2 * MB])[0].seconds
             for shape in ("plain", "pipeline", "group")}
    assert times["plain"] == pytest.approx(MB / 10e9 + 1e-6, rel=1e-12)
    assert times["pipeline"] == pytest.approx(times["plain"], rel=1e-12)        # 4 slices of 256 KiB, one by one
    assert times["group"] == pytest.approx(MB / 2 / 10e9 + 1e-6, rel=1e-12)     # two threadblocks, half each


# -- switch channels (NVLS): priced as msc's simulator prices switch steps --------------------------
def _nvls_pair(instances: int):
    """msc's NVLS allreduce at 8 ranks exported, read back, and the msc plan lift gives (what --model lifted runs)."""
    alg = algorithms()["allreduce/nvls:nvls"]
    osp = parse_mscclpp(plan_to_mscclpp_json(lower(msc.trace(alg, 8, inplace=True), LowerOptions(instances=instances))))
    verify_mscclpp(osp)
    return osp, lift_plan(osp)


@pytest.mark.parametrize("instances", [1, 16])
def test_an_nvls_export_agrees_with_msc_simulation_of_its_lifted_plan(instances):
    topo = get_topology("dgx-h100", 8)
    view = topo.view("Simple")
    osp, lifted = _nvls_pair(instances)
    sizes = [MB, 64 * MB, 1024 * MB]
    one = OneSidedSimulator(osp, topo).run(sizes)
    ref = Simulator(lifted, topo, slots=lifted.slots).run(sizes)      # as msc simulate --model lifted runs it
    # the export's group barrier (a signal to every member and a wait on each) costs a signal's overhead and a
    # route's latency where msc's simulator charges its barrier latency; msc tiles a chunk and pays the switch
    # latency per tile, the executor moves the chunk in one multimem op: what the two differ by, and nothing else
    barriers = 2 * (view.nvls_barrier - view.step_overhead - view.route(0, 1).alpha)
    for a, b in zip(one, ref):
        assert a.size == b.size
        expected = barriers + (b.iterations - 1) * view.nvls_alpha
        assert b.seconds - a.seconds == pytest.approx(expected, abs=1e-9), (instances, a.size)
        assert 0.95 < a.seconds / b.seconds <= 1.0, (instances, a.size)
        # not free: each rank's glres of its 1/8 puts 8 + 1 bytes per byte on its port at the switch's rate
        assert a.seconds > a.chunk * 9 / view.nvls_bandwidth


def test_switch_port_load_is_msc_simulators_rule():
    assert switch_port_load("glres", 8, 1) == 9 and switch_port_load("gstore", 8, 1) == 8
    assert switch_port_load("glres", 8, 16) == 9 * 16          # the rank's 16 threadblocks share its port
    assert switch_port_load("gstorepkt", 4, 1) == 8            # packets: twice the bytes


def test_switch_plans_are_refused_where_msc_simulator_refuses_them():
    osp, _ = _nvls_pair(1)
    with pytest.raises(UsageError, match="topology 'ring:8' has no switch that does"):
        OneSidedSimulator(osp, get_topology("ring", 8))
    doc = nvls_allreduce(16)                       # one group over the 16 GPUs of 2 nodes
    with pytest.raises(UsageError, match="rank 0 threadblock 0 operation 5 \\(glres\\)'s switch group 0,1,.*,15 "
                                         "spans more than one NVSwitch domain of 'dgx-h100:2'"):
        OneSidedSimulator(parse_mscclpp(json.dumps(doc)), get_topology("dgx-h100:2", 16))


def test_packets_through_the_switch_are_read_once_the_gstorepkt_is_done():
    topo = get_topology("dgx-h100", 8)
    plan = read(nvls_allgather_packets(8))
    small, large, double = OneSidedSimulator(plan, topo).run([8 * 1024, 128 * MB, 256 * MB])
    view = topo.view("LL")
    # each rank's gstorepkt writes 8 members' packets (16 bytes a 8-byte word) through its port; the peers'
    # unpacks wait for it
    assert large.seconds > large.chunk * switch_port_load("gstorepkt", 8, 1) / view.nvls_bandwidth
    assert 0 < small.seconds < large.seconds and 1.95 < double.seconds / large.seconds <= 2.0


# -- port channels (through the host proxy) ---------------------------------------------------------------
def port_allgather(n: int, one_flush: bool = True) -> dict:
    """Each rank copies its input into its output, signals every peer it is ready and waits for theirs, puts
    its input into every peer's output with a signal (pws, one port channel a peer), flushes them all and waits
    for the peers' data."""
    def gpu(r):
        peers = _peers(r, n)
        every = list(range(n - 1))
        port = lambda name, ids, **more: {"name": name, "channel_ids": ids, "channel_type": "port", **more}
        puts = [port("pws", [j], src_buff=[{"type": "i", "index": 0, "size": 1}],
                     dst_buff=[{"buffer_id": j, "index": r, "size": 1}]) for j in range(n - 1)]
        flush = port("flush", every, dst_buff=[{"buffer_id": j, "index": r, "size": 1} for j in every])
        ops = [_own_copy(r), {"name": "nop"}, port("signal", every), port("wait", every), {"name": "nop"},
               *puts, flush, port("wait", every), {"name": "nop"}]
        return {"id": r, "input_chunks": 1, "output_chunks": n, "scratch_chunks": 0,
                "channels": [{"channel_type": "port", "connected_to": peers}],
                "remote_buffers": [{"rank": p, "type": "o", "access_channel_types": ["port"]} for p in peers],
                "semaphores": [], "threadblocks": [{"id": 0, "ops": ops,
                                                    "channels": [{"channel_type": "port", "channel_ids": every}],
                                                    "remote_buffer_refs": [{"access_channel_type": "port",
                                                                            "remote_buffer_ids": every}]}]}
    return _plan("port_allgather", [gpu(r) for r in range(n)])


def test_a_port_channel_allgather_moves_its_bytes_through_the_proxies():
    topo = get_topology("dgx-h100", 8)
    plan = read(port_allgather(8))
    sim = OneSidedSimulator(plan, topo)
    small, large, double = sim.run([8 * 1024, 256 * MB, 512 * MB])
    assert 0 < small.seconds < large.seconds < double.seconds
    view = topo.view("Simple")
    port = view.capacity[view.route(0, 1).resources[0]]          # rank 0's NVLink port out
    # the 7 proxies' copies run at once (no threadblock's rate caps a copy engine), sharing the rank's port:
    # more bytes cost exactly their time at the port's rate and the own chunk's copy at the copy rate; the rest
    # (launch, triggers, proxy and route latencies: the small size's time) stays
    per_byte = 7 / port + topo.delta
    assert double.seconds - large.seconds == pytest.approx((double.chunk - large.chunk) * per_byte, rel=1e-6)
    assert large.seconds == pytest.approx(large.chunk * per_byte + small.seconds, rel=1e-3)
    [threadblock] = OneSidedSimulator(read(put_allgather(8)), topo).run([256 * MB])
    assert threadblock.seconds > 3 * large.seconds               # memory channels: one put after another
    # the proxy's latency is paid twice on the way: the ready signal, then the pws
    slow = OneSidedSimulator(plan, topo, proxy_us=PROXY_US + 3.0)
    assert slow.run([8 * 1024])[0].seconds - small.seconds == pytest.approx(6e-6, rel=1e-6)


def test_a_port_put_signals_after_its_transfer_and_a_flush_waits_for_it():
    topo = Uniform(2, alpha_us=1.0, bandwidth_gbps=10.0)           # textbook: no overheads
    plan = read(port_allgather(2))
    [r] = OneSidedSimulator(plan, topo, proxy_us=0.5).run([2 * MB])
    # ready: signal (proxy 0.5) + latency 1; then the put (proxy 0.5 + 1 MB at 10 GB/s), its signal, latency 1
    assert r.seconds == pytest.approx(0.5e-6 + 1e-6 + 0.5e-6 + MB / 10e9 + 1e-6, rel=1e-12)


def port_packets() -> dict:
    """2-rank LL allgather whose packets the proxy copies raw, scratch to the peer's scratch (port ppkt)."""
    gpus = []
    for r in (0, 1):
        p = 1 - r
        scratch = lambda index: [{"type": "s", "index": index, "size": 1}]
        ops = [_own_copy(r),
               {"name": "cpkt", "src_buff": [{"type": "i", "index": 0, "size": 1}], "dst_buff": scratch(r)},
               {"name": "ppkt", "channel_ids": [0], "channel_type": "port", "src_buff": scratch(r),
                "dst_buff": [{"buffer_id": 0, "index": r, "size": 1}]},
               {"name": "upkt", "src_buff": scratch(p), "dst_buff": [{"type": "o", "index": p, "size": 1}]}]
        gpus.append({"id": r, "input_chunks": 1, "output_chunks": 2, "scratch_chunks": 2,
                     "channels": [{"channel_type": "port", "connected_to": [p]}],
                     "remote_buffers": [{"rank": p, "type": "s", "access_channel_types": ["port"]}], "semaphores": [],
                     "threadblocks": [{"id": 0, "ops": ops, "channels": [{"channel_type": "port", "channel_ids": [0]}],
                                       "remote_buffer_refs": [{"access_channel_type": "port",
                                                               "remote_buffer_ids": [0]}]}]})
    return {"name": "port_pkt", "collective": "allgather", "protocol": "LL", "inplace": False,
            "use_double_scratch_buffer": True, "gpus": gpus}


def test_packets_a_proxy_copies_are_read_once_its_transfer_is_done():
    topo = Uniform(2, alpha_us=1.0, bandwidth_gbps=10.0)           # textbook: no overheads
    view = topo.view("LL")
    rate, latency = view.capacity[view.route(0, 1).resources[0]], view.route(0, 1).alpha
    plan = read(port_packets())
    for proxy_us in (0.0, 2.0):
        [r] = OneSidedSimulator(plan, topo, proxy_us=proxy_us).run([2 * MB])
        # the proxy's latency, the 1 MB chunk at LL's rate, then the packets' route latency before the unpack
        assert r.seconds == pytest.approx(proxy_us * 1e-6 + MB / rate + latency, rel=1e-12)


# -- every operation the reader knows is priced or refused by name --------------------------------------
def test_every_operation_name_the_reader_knows_has_a_price():
    assert set(KNOWN_OPS) == set(PRICING)


def test_an_operation_without_a_price_is_refused_naming_where():
    plan = read(put_allgather(4))
    def with_op(op):
        gpus = list(plan.gpus)
        tbs = list(gpus[2].threadblocks)
        tbs[0] = tbs[0][:3] + (op,) + tbs[0][4:]
        gpus[2] = dataclasses.replace(gpus[2], threadblocks=tuple(tbs))
        return dataclasses.replace(plan, gpus=tuple(gpus))
    topo = get_topology("ring", 4)
    with pytest.raises(PlanError, match="rank 2, threadblock 0: operation 3: the one-sided cost model refuses "
                                        "'glre', an operation it has no price for"):
        OneSidedSimulator(with_op(Operation("glre")), topo)
    with pytest.raises(PlanError, match="rank 2, threadblock 0: operation 3: the one-sided cost model refuses copy on "
                                        "a port channel"):
        OneSidedSimulator(with_op(Operation("copy", channels=(0,), channel_type="port")), topo)


def test_simulate_gives_no_bound_for_switch_plans(tmp_path):
    osp_doc = plan_to_mscclpp_json(lower(msc.trace(algorithms()["allreduce/nvls:nvls"], 8, inplace=True)))
    (tmp_path / "nvls.json").write_text(osp_doc)
    (tmp_path / "gets.json").write_text(json.dumps(get_allgather(8)))
    runs = {}
    for name in ("nvls", "gets"):
        out = cli("simulate", f"{name}.json", "-t", "dgx-h100", "-b", "1M", "-e", "1M", "--model", "onesided",
                  "--json", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        runs[name] = json.loads(out.stdout)[0]
    assert "bound_pct" not in runs["nvls"] and runs["nvls"]["model"] == "onesided" and runs["nvls"]["time"] > 0
    assert runs["gets"]["bound_pct"] > 0                    # memory-channel plans keep their bound
    text = cli("simulate", "nvls.json", "-t", "dgx-h100", "-b", "1M", "-e", "1M", "--model", "onesided", cwd=tmp_path)
    assert "%bound" not in text.stdout
