"""The runtimes' limits (msc.lower.runtimes): foreign MSCCL XML is verified with
the capacity its protocol has on the runtimes, --slots and --runtime set it
at load, export names the limit a plan exceeds, and lowering for a runtime
gives a plan that fits it or names the limit. The XML here is our own,
written as MSCCLang writes it (no msc_* attributes)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import msc
from msc.cli.main import main
from msc.errors import DeadlockError, RuntimeLimitError, UsageError
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.lower.pipeline import LowerOptions, lower
from msc.formats.load import load_plan
from msc.verification.plan import verify_plan
from msc.lower.runtimes import RUNTIMES, CapacityWarning, xml_capacity
from msc.formats.xml_export import plan_to_xml
from msc.formats.xml_import import xml_to_plan
from library import algorithms

ALGORITHMS = algorithms(switch=False)


# -- MSCCL-IR as MSCCLang writes it -------------------------------------------------------
def _step(s, kind, src=("i", -1), dst=("o", -1), dep=(-1, -1), hasdep=0) -> str:
    return (f'      <step s="{s}" type="{kind}" srcbuf="{src[0]}" srcoff="{src[1]}" dstbuf="{dst[0]}" '
            f'dstoff="{dst[1]}" cnt="1" depid="{dep[0]}" deps="{dep[1]}" hasdep="{hasdep}"/>')


def _algo(name, coll, n, nchunks, gpus, proto="Simple", inplace=1) -> str:
    return (f'<algo name="{name}" proto="{proto}" nchannels="1" nchunksperloop="{nchunks}" ngpus="{n}" '
            f'coll="{coll}" inplace="{inplace}">\n' + "\n".join(gpus) + "\n</algo>\n")


def ring_allreduce_xml(n: int, proto: str = "Simple") -> str:
    """In-place ring allreduce, one threadblock per rank, chunk c summed
    from rank c around the ring: s, rrs..., rrcs, rcs..., r (as MSCCLang fuses it)."""
    gpus = []
    for r in range(n):
        steps = [("s", r)] + [("rrs", (r - t) % n) for t in range(1, n - 1)] + [("rrcs", (r + 1) % n)]
        steps += [("rcs", (r - u + 1) % n) for u in range(1, n - 1)] + [("r", (r + 2) % n)]
        body = []
        for s, (kind, c) in enumerate(steps):
            src = ("i", c) if kind in ("s", "rrs", "rrcs") else ("i", -1)
            dst = ("i", c) if kind in ("rrcs", "rcs", "r") else ("o", -1)
            body.append(_step(s, kind, src, dst))
        gpus.append(f'  <gpu id="{r}" i_chunks="{n}" o_chunks="0" s_chunks="0">\n'
                    f'    <tb id="0" send="{(r + 1) % n}" recv="{(r - 1) % n}" chan="0">\n' + "\n".join(body) +
                    "\n    </tb>\n  </gpu>")
    return _algo("allreduce_ring", "allreduce", n, n, gpus, proto)


def ring_allgather_xml(n: int) -> str:
    """In-place ring allgather (the output buffer only): send own, rcs, r."""
    gpus = []
    for r in range(n):
        steps = [("s", r)] + [("rcs", (r - u) % n) for u in range(1, n - 1)] + [("r", (r + 1) % n)]
        body = [_step(s, kind, ("o", c) if kind == "s" else ("o", -1), ("o", c) if kind != "s" else ("o", -1))
                for s, (kind, c) in enumerate(steps)]
        gpus.append(f'  <gpu id="{r}" i_chunks="0" o_chunks="{n}" s_chunks="0">\n'
                    f'    <tb id="0" send="{(r + 1) % n}" recv="{(r - 1) % n}" chan="0">\n' + "\n".join(body) +
                    "\n    </tb>\n  </gpu>")
    return _algo("allgather_ring", "allgather", n, n, gpus)


@pytest.fixture(scope="module")
def ring_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("xml")
    files = {"allreduce": folder / "ar8.xml", "allgather": folder / "ag8.xml", "ll": folder / "ar8ll.xml"}
    files["allreduce"].write_text(ring_allreduce_xml(8))
    files["allgather"].write_text(ring_allgather_xml(8))
    files["ll"].write_text(ring_allreduce_xml(8, "LL"))
    return files


# -- the table ------------------------------------------------------------------------
def test_the_table_holds_the_runtimes_constants():
    msccl, azure = RUNTIMES["msccl"], RUNTIMES["azure"]
    assert (msccl.max_steps, azure.max_steps) == (256, 64)                    # MSCCL_MAX_NUM_STEPS
    assert (msccl.max_threadblocks, azure.max_threadblocks) == (216, 1024)
    assert msccl.max_nodes == azure.max_nodes == 4095                         # MAX_NODES 4096, one less read
    for rt in (msccl, azure):
        assert [rt.connection_slots(p) for p in ("Simple", "LL", "LL128")] == [2, 8, 8]
        assert (rt.max_tb_per_channel, rt.max_channels, rt.max_count, rt.max_offset, rt.max_dep_tb) == \
               (32, 32, 71, 32767, 127)
    assert RUNTIMES["msc"].connection_slots("Simple") is None


def test_the_capacity_where_the_runtimes_differ(monkeypatch):
    assert (xml_capacity("Simple").slots, xml_capacity("Simple").assumed) == (2, None)
    monkeypatch.setitem(RUNTIMES, "azure", dataclasses.replace(RUNTIMES["azure"], slots=(4, 8, 8)))
    cap = xml_capacity("Simple")
    assert (cap.slots, cap.runtimes) == (2, ("msccl",)) and "--runtime" in cap.assumed and "azure 4" in cap.assumed
    assert xml_capacity("Simple", "azure").slots == 4 and xml_capacity("LL").assumed is None
    with pytest.warns(CapacityWarning, match="assumed the msccl runtime's 2"):
        assert xml_to_plan(ring_allreduce_xml(4)).slots == 2
    assert xml_to_plan(ring_allreduce_xml(4), runtime="azure").slots == 4


# -- reading foreign XML ------------------------------------------------------------------
def test_foreign_rings_verify_with_the_runtimes_capacity(ring_files):
    for key, slots in (("allreduce", 2), ("allgather", 2), ("ll", 8)):
        plan = xml_to_plan(ring_files[key].read_bytes())
        assert plan.slots == slots
        verify_plan(plan)
    with pytest.raises(DeadlockError):          # the ring deadlocks with one slot: the old reading
        verify_plan(dataclasses.replace(xml_to_plan(ring_files["allreduce"].read_bytes()), slots=1))


def test_foreign_ring_runs(ring_files, capsys):
    assert main(["run", str(ring_files["allreduce"]), "--backend", "sim", "-b", "1K", "-e", "1K"]) == 0
    assert main(["verify", str(ring_files["allgather"])]) == 0
    assert "2 slot(s)" in capsys.readouterr().out


def test_slots_apply_at_load_before_verifying(ring_files, tmp_path, capsys):
    path = str(ring_files["allreduce"])
    with pytest.raises(DeadlockError, match="runs with 2") as info:
        load_plan(path, slots=1)
    assert "a Simple connection holds 2 messages on the msccl and azure runtimes" in str(info.value)
    assert load_plan(path, slots=4).slots == 4 and load_plan(path, runtime="azure").slots == 2
    assert main(["verify", path, "--slots", "1"]) == 1
    assert main(["verify", path, "--slots", "4"]) == 0 and "4 slot(s)" in capsys.readouterr().out
    assert main(["import", path, "-o", str(tmp_path / "r.plan"), "--slots", "4"]) == 0
    assert "slots 4 " in (tmp_path / "r.plan").read_text()
    assert main(["simulate", path, "-t", "nvswitch", "-b", "1K", "-e", "1K", "--slots", "1"]) == 1
    capsys.readouterr()
    for bad in (["verify", path, "--slots", "0"], ["verify", path, "--slots", "2", "--runtime", "azure"],
                ["verify", "allreduce/ring", "--ranks", "4", "--slots", "2"]):
        assert main(bad) == 2
    with pytest.raises(UsageError):
        load_plan(path, runtime="msc")


def test_a_plan_that_needs_more_than_the_runtime_gives_says_so(tmp_path):
    """A 4-slot plan (msc's runtime gives it that), read as MSCCL runs it."""
    plan = lower(msc.trace(burst_ring, 4, inplace=False), LowerOptions(threadblocks="manual"))
    assert plan.slots == 8
    path = tmp_path / "burst.plan"
    from msc.formats.plan_text import save_plan

    save_plan(plan, path)
    with pytest.raises(DeadlockError, match="needs 8 slots per connection.*it can hang there"):
        load_plan(path, runtime="msccl")


# -- writing: the limits, named -----------------------------------------------------------
def _copies(count: int) -> tuple:
    return tuple(Step(StepOp.COPY, (Slice("input", 0, 1),), Slice("output", 0, 1), 1) for _ in range(count))


def test_the_ring_of_64_ranks_exceeds_azures_steps():
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 64))
    with pytest.raises(RuntimeLimitError, match="MSCCL_MAX_NUM_STEPS = 64") as info:
        plan_to_xml(plan, runtime="azure")
    assert (info.value.limit, info.value.value, info.value.maximum, info.value.runtime) == \
           ("MSCCL_MAX_NUM_STEPS", 127, 64, "azure")
    assert "Azure/msccl-executor-nccl" in str(info.value)
    assert plan_to_xml(plan, runtime="msccl").startswith("<algo")


def test_xml_nodes_per_rank():
    """algo + gpus + own threadblocks + own steps: 4095 read, the 4096th refused by both."""
    def plan(last: int) -> Plan:       # 63 threadblocks of 63 steps, one of ``last``
        tbs = [Threadblock(t, None, None, 0, _copies(63)) for t in range(63)]
        tbs.append(Threadblock(63, None, None, 0, _copies(last)))
        return Plan("nodes", "allreduce", 1, 1, False, 1, 1, (RankPlan(0, 0, tuple(tbs)),))

    fits, over = plan(60), plan(61)        # 1 + 1 + 64 + 63 * 63 + 60 = 4095
    for runtime in ("msccl", "azure"):
        plan_to_xml(fits, runtime=runtime)
        with pytest.raises(RuntimeLimitError, match=r"MAX_NODES .* = 4096, at most 4095") as info:
            plan_to_xml(over, runtime=runtime)
        assert (info.value.value, info.value.maximum) == (4096, 4095)


# -- lowering for a runtime ---------------------------------------------------------------
@msc.algorithm("allgather", chunk_factor=4, inplace=False)
def burst_ring(p: msc.Program):
    """Ring allgather that forwards a rank's 4 chunks in a burst, one threadblock per rank."""
    n, k = p.num_ranks, 4
    for r in range(n):
        for i in range(k):
            p.chunk(r, "input", i).copy(r, "output", r * k + i)
    for hop in range(1, n):
        for r in range(n):
            src = (r - hop + 1) % n
            for i in range(k):
                p.chunk(r, "output", src * k + i).copy((r + 1) % n, "output", src * k + i, sendtb=0, recvtb=0)


@msc.algorithm("allreduce", chunk_factor=lambda n: n, ranks=lambda n, g: n % g == 0, g=4)
def two_level_rings(p: msc.Program, g=4):
    """Blue Connect's allreduce as MSCCLang's hierarchical example schedules it
    automatically: in every node of g ranks a ring per chunk offset (the
    rings share the node's connections), a ring across nodes per local rank,
    then the same rings gathering. Chunk c*nodes + o is offset o's c-th."""
    n = p.num_ranks
    nodes = n // g

    def ring(size, ranks, index, gather):
        """Ring number c of ``size`` ranks (``ranks(i)``) moves chunk ``index(c)``."""
        for c in range(size):
            for s in range(size - 1):
                a, b = ranks((s + c + (0 if gather else 1)) % size), ranks((s + c + (1 if gather else 2)) % size)
                if gather:
                    p.chunk(a, "input", index(c)).copy(b, "input", index(c))
                else:
                    p.chunk(b, "input", index(c)).reduce(p.chunk(a, "input", index(c)))

    inside = [(lambda i, a=a: a * g + i, lambda c, o=o: c * nodes + o) for a in range(nodes) for o in range(nodes)]
    across = [(lambda i, l=l: i * g + l, lambda c, l=l: l * nodes + c) for l in range(g)]
    for gather, phases in ((False, (inside, across)), (True, (across, inside))):
        for phase in phases:
            for ranks, index in phase:
                ring(g if phase is inside else nodes, ranks, index, gather)


def test_lowering_for_msccl_fits_where_msc_needs_more_slots():
    prog = msc.trace(two_level_rings, 8)
    msc.verify(prog)
    assert lower(prog).slots == 4                     # msc's own runtime: the depth order, 4 slots
    plan = lower(prog, LowerOptions(runtime="msccl"))  # the trace order needs 1, as MSCCLang's lowering
    assert plan.slots <= 2
    verify_plan(plan)
    assert xml_to_plan(plan_to_xml(plan)).slots == plan.slots


def test_lowering_for_msccl_gives_up_fusion_to_fit():
    prog = msc.trace(burst_ring, 4, inplace=False)
    plan = lower(prog, LowerOptions(threadblocks="manual", runtime="msccl"))
    assert plan.slots <= 2 and not any(s.op in (StepOp.RCS, StepOp.RRCS) for rp in plan.ranks
                                       for tb in rp.threadblocks for s in tb.steps)
    plan_to_xml(plan)


def test_lowering_for_azure_spreads_a_long_ring_over_channels():
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 40), LowerOptions(runtime="azure"))
    assert len({tb.channel for tb in plan.ranks[0].threadblocks}) == 2
    text = plan_to_xml(plan, runtime="azure")
    assert xml_to_plan(text).slots == plan.slots


@msc.algorithm("allgather", inplace=False)
def bounce(p: msc.Program, rounds=70):
    """All-pairs allgather, then every rank copies its chunk to scratch ``rounds`` times."""
    n = p.num_ranks
    for r in range(n):
        for d in range(n):
            p.chunk(r, "input", 0).copy(d, "output", r)
        for k in range(rounds):
            p.chunk(r, "output", r).copy(r, "scratch", k % 2)


def test_lowering_names_the_limit_nothing_fits(capsys, tmp_path):
    prog = msc.trace(bounce, 3)
    with pytest.raises(RuntimeLimitError) as info:
        lower(prog, LowerOptions(runtime="azure"))
    exc = info.value
    assert (exc.limit, exc.value, exc.maximum, exc.runtime) == ("MSCCL_MAX_NUM_STEPS", 72, 64, "azure")
    assert "no plan fits the azure runtime" in str(exc) and "no fusion" in str(exc)
    lower(prog, LowerOptions(runtime="msccl"))        # 256 steps there
    lower(prog)


# -- in-place custom collectives ------------------------------------------------------------
def rotate_xml(n: int) -> str:
    """In place, each rank's chunk 0 goes to the next rank's chunk 1, named o
    (MSCCLang writes a custom collective's output buffer, the input in place)."""
    gpus = [f'  <gpu id="{r}" i_chunks="2" o_chunks="2" s_chunks="0">\n'
            f'    <tb id="0" send="{(r + 1) % n}" recv="{(r - 1) % n}" chan="0">\n'
            + _step(0, "s", ("i", 0), ("o", 1)) + "\n" + _step(1, "r", ("i", 0), ("o", 1)) +
            "\n    </tb>\n  </gpu>" for r in range(n)]
    return _algo("rotate", "custom", n, 2, gpus)


def test_in_place_custom_collective_imports(tmp_path):
    rotate = msc.CustomCollective("rotate", input_chunks=2, output_chunks=2,
                                  postcondition=lambda r, i, n, k: [(r, 0)] if i == 0 else [((r - 1) % n, 0)])
    plan = xml_to_plan(rotate_xml(4))
    assert (plan.collective, plan.inplace, plan.input_chunks, plan.output_chunks) == ("custom", True, 2, 2)
    assert plan.ranks[1].threadblocks[0].steps[1].dst == Slice("input", 1, 1)
    verify_plan(plan, collective=rotate)
    run_collective = pytest.importorskip("msc.executor").run_collective
    x = [np.array([10.0 * r, -1.0]) for r in range(4)]
    for r, out in enumerate(run_collective(plan, x, collective=rotate)):
        assert list(out) == [10.0 * r, 10.0 * ((r - 1) % 4)]
    back = xml_to_plan(plan_to_xml(plan))
    assert (back.input_chunks, back.output_chunks, back.ranks) == (2, 2, plan.ranks)
    path = tmp_path / "rotate.xml"
    path.write_text(rotate_xml(4))
    assert main(["import", str(path), "-o", str(tmp_path / "rotate.plan"), "--no-verify"]) == 0
