"""The simulator's switch ports (NVLS): a switch op is a flow over its
group's NVLink ports, a reduce-load loading every member's port out and
the reader's in, a store the writer's out and every member's in, so that
reduce-loads and stores of different chunks share each port's two
directions as the fused op does; the ports are the links NVLink transfers
cross too; both engines agree."""
from __future__ import annotations

import pytest

from msc.formats.plan_text import parse_plan
from msc.sim.events import _Flow, maxmin
from msc.sim.simulate import Simulator
from msc.sim.topology import Nodes

N = 4
PORT_GBPS, SWITCH_GBPS, SWITCH_US, BARRIER_US = 200.0, 100.0, 0.5, 3.0
GROUP = ",".join(map(str, range(N)))


def _topology(**kw) -> Nodes:
    kw.setdefault("threadblock_gbps", 1000.0)
    return Nodes("switch", 1, N, port_gbps=PORT_GBPS, port_alpha_us=1.0, nvls_gbps=SWITCH_GBPS,
                 nvls_alpha_us=SWITCH_US, nvls_barrier_us=BARRIER_US, **kw)


def _plan(threadblocks):
    """An N-rank plan whose rank r runs ``threadblocks(r)``: (header, steps) each."""
    lines = [f'msc-plan 1\nname "t" collective allreduce ranks {N} chunk_factor {N}',
             f"input_chunks {N} output_chunks {N} inplace false root 0",
             "protocol Simple instances 1 slots 1 tile 0", ""]
    for r in range(N):
        lines.append(f"rank {r} scratch 0")
        for t, (header, steps) in enumerate(threadblocks(r)):
            lines.append(f"  tb {t} {header}")
            lines += [f"    {i}: {s}" for i, s in enumerate(steps)]
        lines.append("")
    return parse_plan("\n".join(lines))


def _switch_tb(channel: int, op: str | None) -> tuple:
    """A threadblock of the group: ``op`` between two barriers (None: the barriers only)."""
    return f"send - recv - channel {channel} group {GROUP}", ["barrier"] + ([op] if op else []) + ["barrier"]


def _reduce_loads_beside_stores(r):
    """Rank r reduce-loads chunk r and, on another threadblock, stores chunk r + 1."""
    return [_switch_tb(0, f"swred input[{r}] -> output[{r}]"),
            _switch_tb(1, f"swst output[{(r + 1) % N}] -> output[{(r + 1) % N}]")]


def _expected(sim, size: int, per_byte: float) -> float:
    """The launch, both end barriers, per tile the switch latency, and the
    chunk's bytes at ``per_byte`` seconds each."""
    _, _, q = sim.chunk_geometry(size)
    tiles = -(-int(q) // sim.tile)
    return sim.view.launch + 2 * BARRIER_US * 1e-6 + tiles * SWITCH_US * 1e-6 + q * per_byte


SIZES = [1 << 12, 1 << 20, 1 << 26]


@pytest.mark.parametrize("name,threadblocks,port_bytes", [
    ("fused", lambda r: [_switch_tb(0, f"swrs input[{r}] -> output[{r}]")], N + 1),
    ("reduce-loads", lambda r: [_switch_tb(0, f"swred input[{r}] -> output[{r}]")], N),
    ("stores", lambda r: [_switch_tb(0, f"swst input[{r}] -> output[{r}]")], N),
    # the pipelined NVLS schedule: reduce-loads (N out of each port, 1 in) beside stores (1 out, N in)
    ("reduce-loads beside stores", _reduce_loads_beside_stores, N + 1),
])
def test_every_member_at_once_loads_each_port_direction(name, threadblocks, port_bytes):
    sim = Simulator(_plan(threadblocks), _topology())
    for engine in ("auto", "events"):
        for r in sim.run(SIZES, engine=engine):
            assert r.engine == "events" and r.contended == (engine == "auto"), (name, r)
            assert r.seconds == pytest.approx(_expected(sim, r.size, port_bytes / (SWITCH_GBPS * 1e9)), rel=1e-12)


def test_a_lone_switch_op_runs_at_its_ports_rate_on_both_engines():
    # only rank 0 issues a fused op: its own port carries it twice each way, the others once
    def lone(r):
        return [_switch_tb(0, "swrs input[0] -> output[0]" if r == 0 else None)]
    sim = Simulator(_plan(lone), _topology())
    fast, events = sim.run(SIZES, engine="auto"), sim.run(SIZES, engine="events")
    for f, e in zip(fast, events):
        assert f.engine == "fast" and not f.contended
        assert f.seconds == pytest.approx(e.seconds, rel=1e-12)
        assert f.seconds == pytest.approx(_expected(sim, f.size, 2 / (SWITCH_GBPS * 1e9)), rel=1e-12)
    # the threadblock's own rate caps a switch op as it caps a transfer
    slow = Simulator(_plan(lone), _topology(threadblock_gbps=20.0))
    for r in slow.run(SIZES):
        assert r.seconds == pytest.approx(_expected(slow, r.size, 1 / 20e9), rel=1e-12)


def test_switch_ops_share_the_nvlink_ports_with_transfers():
    # beside the fused ops, every rank sends its whole input to the next rank: the same port out
    def with_ring(r):
        return [_switch_tb(0, f"swrs input[{r}] -> output[{r}]"),
                (f"send {(r + 1) % N} recv {(r - 1) % N} channel 1", ["send input[0:4]", "recv -> output[0:4]"])]
    alone = Simulator(_plan(lambda r: [_switch_tb(0, f"swrs input[{r}] -> output[{r}]")]), _topology())
    shared = Simulator(_plan(with_ring), _topology())
    port = shared.view.switch_ports(0)
    assert port[0] in shared.view.route(0, 1).resources and port[1] in shared.view.route(1, 0).resources
    ring_alone = Simulator(_plan(lambda r: [(f"send {(r + 1) % N} recv {(r - 1) % N} channel 1",
                                             ["send input[0:4]", "recv -> output[0:4]"])]), _topology())
    for a, s, ring in zip(alone.run(SIZES), shared.run(SIZES), ring_alone.run(SIZES)):
        assert s.contended and s.seconds > max(a.seconds, ring.seconds) * 1.05


def test_maxmin_weighs_each_flows_bytes_on_a_link():
    # link 0 (12): a puts 2 bytes on it per byte, b 1: both rise to 4; b alone on link 1 would allow 10
    a = _Flow(0, 1.0, (0,), float("inf"), 0.0, 0, (2.0,))
    b = _Flow(1, 1.0, (0, 1), float("inf"), 0.0, 1, (1.0, 1.0))
    rates = maxmin([a, b], [12.0, 10.0], {0: {a, b}, 1: {b}})
    assert rates[a] == pytest.approx(4) and rates[b] == pytest.approx(4)
    a.cap = 1.0                                     # a capped at 1 leaves link 0 10 for b, link 1 caps b at 10
    rates = maxmin([a, b], [12.0, 10.0], {0: {a, b}, 1: {b}})
    assert rates[a] == pytest.approx(1) and rates[b] == pytest.approx(10)
