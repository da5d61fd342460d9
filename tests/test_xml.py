"""MSCCL-IR XML: every library plan exports to XML the MSCCL runtimes accept
(structure and limits), imports back to a plan that verifies and computes the
same outputs; hand-written XML imports; runtime limits are named; malformed
XML only ever raises msc errors."""
import dataclasses
import functools
import xml.etree.ElementTree as ET
from copy import deepcopy
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import msc
from msc.dsl.collectives import COLLECTIVES
from msc.errors import FormatError, PlanError, UsageError
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.lower.pipeline import LowerOptions, lower
from msc.verification.plan import verify_plan
from msc.lower.runtimes import RUNTIMES
from msc.formats.xml_export import RuntimeLimitError, plan_to_xml
from msc.formats.xml_import import xml_to_plan
from library import algorithms, rank_counts

STEP_ATTRS = ("s", "type", "srcbuf", "srcoff", "dstbuf", "dstoff", "cnt", "depid", "deps", "hasdep")
USES_SRC = {"s", "rrs", "rrc", "rrcs", "cpy", "re"}
USES_DST = {"r", "rcs", "rrc", "rrcs", "cpy", "re"}


ALGORITHMS = algorithms(switch=False)


@functools.lru_cache(maxsize=None)
def library_plan(key: str, n: int, inplace: bool, instances: int) -> Plan:
    return lower(msc.trace(ALGORITHMS[key], n, inplace=inplace), LowerOptions(instances=instances))


def library_cases(key):
    return [(n, inplace, inst) for n in rank_counts(ALGORITHMS[key], (4, 8))
            for inplace in (True, False) for inst in (1, 2)]


# -- what the runtimes' readers need -------------------------------------------------
def check_structure(text: str, runtime: str) -> ET.Element:
    """The invariants the MSCCL runtimes rely on (see msc/formats/xml_export.py)."""
    assert not text.lstrip().startswith("<?xml") and "\t" not in text and " />" not in text
    algo = ET.fromstring(text)
    assert algo.tag == "algo"
    for attr in ("name", "proto", "nchannels", "nchunksperloop", "ngpus", "coll", "inplace", "outofplace",
                 "minBytes", "maxBytes"):
        assert attr in algo.attrib, attr
    assert algo.get("coll") != ("reduce_scatter" if runtime == "azure" else "reducescatter")
    assert algo.get("inplace") != algo.get("outofplace")
    n, nchunks = int(algo.get("ngpus")), int(algo.get("nchunksperloop"))
    mult_in = n if algo.get("coll") == "allgather" else 1
    mult_out = n if algo.get("coll") in ("reduce_scatter", "reducescatter") else 1
    assert [int(g.get("id")) for g in algo] == list(range(n))
    channels = set()
    for gpu in algo:
        # the runtimes read 16 attributes an element (MAX_ATTR_COUNT) and drop the rest: only msc's own may
        # come after them (a custom collective's msc_* attributes, which the runtimes ignore anyway)
        assert all(len(el.attrib) <= 16 for el in gpu.iter())
        assert all(key.startswith("msc_") for key in list(algo.attrib)[16:])
        for attr, mult in (("i_chunks", mult_in), ("o_chunks", mult_out)):
            assert int(gpu.get(attr)) in (0, nchunks // mult) and nchunks % mult == 0
        declared = {"i": int(gpu.get("i_chunks")), "o": int(gpu.get("o_chunks")), "s": int(gpu.get("s_chunks"))}
        tbs = list(gpu)
        assert [int(tb.get("id")) for tb in tbs] == list(range(len(tbs)))
        assert len(tbs) <= (216 if runtime == "msccl" else 1024)
        per_channel: dict = {}
        waited = set()
        for tb in tbs:
            chan = int(tb.get("chan"))
            channels.add(chan)
            assert 0 <= chan < 32
            for side in ("send", "recv"):
                if int(tb.get(side)) >= 0:
                    per_channel[(side, chan)] = per_channel.get((side, chan), 0) + 1
                    assert per_channel[(side, chan)] <= 32
            steps = list(tb)
            assert len(steps) <= 256
            nop_run = False
            for i, st_el in enumerate(steps):
                assert st_el.tag == "step" and tuple(st_el.attrib) == STEP_ATTRS
                a = {k: st_el.get(k) for k in STEP_ATTRS}
                assert int(a["s"]) == i
                kind, cnt, depid, deps = a["type"], int(a["cnt"]), int(a["depid"]), int(a["deps"])
                for side, used in (("src", kind in USES_SRC), ("dst", kind in USES_DST)):
                    buf, off = a[side + "buf"], int(a[side + "off"])
                    if used:
                        assert 0 <= off and off + cnt <= declared[buf] and off <= 32767
                    else:
                        assert (buf, off) == ("i" if side == "src" else "o", -1)
                assert (cnt == 0) if kind == "nop" else (1 <= cnt <= 71)
                assert (depid == -1) == (deps == -1)      # one dependency per step at most
                if depid >= 0:
                    assert depid <= 127 and depid != int(tb.get("id"))
                    target = tbs[depid][deps]
                    assert target.get("type") != "nop" and target.get("hasdep") == "1"
                    waited.add((depid, deps))
                if kind == "nop":
                    assert depid >= 0 and a["hasdep"] == "0"
                elif nop_run:
                    assert depid >= 0                      # a run of nops ends in a step with a dependency
                nop_run = kind == "nop"
            assert not nop_run
        flagged = {(t, i) for t, tb in enumerate(tbs) for i, s_el in enumerate(tb) if s_el.get("hasdep") == "1"}
        assert flagged == waited                           # hasdep exactly where waited on
    assert int(algo.get("nchannels")) == max(channels, default=0) + 1
    return algo


def same_outputs(a: Plan, b: Plan, seed: int = 0) -> None:
    """Both plans compute the same outputs from the same random inputs
    (a count that is not a multiple of the chunk factor)."""
    run_collective = pytest.importorskip("msc.executor").run_collective
    rng = np.random.default_rng(seed)
    k = a.chunk_factor
    count = 2 * k + 1
    inputs = [rng.integers(-1000, 1000, a.input_chunks // k * count).astype(np.int64) for _ in range(a.num_ranks)]
    for x, y in zip(run_collective(a, inputs, count=count), run_collective(b, inputs, count=count)):
        assert np.array_equal(x, y)


# -- every library algorithm -------------------------------------------------------------
@pytest.mark.parametrize("key, every", [(key, False) for key in sorted(ALGORITHMS)] +
                         [pytest.param(key, True, marks=pytest.mark.slow) for key in sorted(ALGORITHMS)])
def test_library_round_trip(key, every):
    """Every algorithm at its first and last case by default (fewest ranks in place with 1 instance,
    most ranks out of place with 2), all its cases under -m slow."""
    cases = library_cases(key)
    assert cases
    if not every:
        cases = sorted({cases[0], cases[-1]})
    for n, inplace, instances in cases:
        plan = library_plan(key, n, inplace, instances)
        if plan.slots > RUNTIMES["msccl"].connection_slots("Simple"):
            # more messages in flight than a Simple connection of the runtime holds: refused, LL fits
            with pytest.raises(RuntimeLimitError, match="messages per connection"):
                plan_to_xml(plan)
            plan = dataclasses.replace(plan, protocol="LL")
        spec = COLLECTIVES[plan.collective]
        if not spec.msccl and not plan.inplace and len(set(spec.units(n))) > 1:
            # coll="custom" sizes both buffers from nchunksperloop: out-of-place gather and scatter do not fit
            with pytest.raises(FormatError, match="MSCCL XML cannot describe this plan's buffers"):
                plan_to_xml(plan)
            continue
        for runtime in ("msccl", "azure"):
            if not spec.msccl and not RUNTIMES[runtime].custom:
                with pytest.raises(PlanError, match=f"the {runtime} runtime has no custom collectives"):
                    plan_to_xml(plan, runtime=runtime)          # MSCCL lacks it: msc exports it as custom
                continue
            text = plan_to_xml(plan, runtime=runtime)
            check_structure(text, runtime)
            back = xml_to_plan(text)
            assert (back.collective, back.num_ranks, back.chunk_factor, back.inplace, back.input_chunks,
                    back.output_chunks, back.root, back.protocol, back.instances, back.slots) == \
                   (plan.collective, plan.num_ranks, plan.chunk_factor, plan.inplace, plan.input_chunks,
                    plan.output_chunks, plan.root, plan.protocol, plan.instances, plan.slots)
            verify_plan(back)
            assert plan_to_xml(back, runtime=runtime) == text      # export . import is the identity on XML
        same_outputs(plan, back)


@pytest.mark.parametrize("key, n, root", [("gather/direct:direct", 4, 0), ("scatter/direct:direct", 3, 0)])
def test_a_builtin_exported_as_custom_keeps_its_in_place_layout(key, n, root):
    """In-place gather (and scatter) go out as coll="custom"; the reader
    took the custom collectives' one buffer read from chunk 0 instead of
    the built-in's aliasing (the input is unit ``rank`` of the output), and
    the plan read back was wrong."""
    plan = lower(msc.trace(ALGORITHMS[key], n, inplace=True, root=root), LowerOptions())
    text = plan_to_xml(plan)
    assert 'coll="custom"' in text
    back = xml_to_plan(text)
    verify_plan(back)
    assert (back.collective, back.inplace, back.input_chunks, back.output_chunks) == \
        (plan.collective, True, plan.input_chunks, plan.output_chunks)
    same_outputs(plan, back)
    assert plan_to_xml(back) == text


@pytest.mark.parametrize("key", ["gather/direct:direct", "scatter/direct:direct"])
def test_a_builtin_exported_as_custom_keeps_its_root(key):
    """msc_root was written only for collectives MSCCL roots (coll=), so a
    gather's root 2, exported as coll="custom", came back as root 0."""
    plan = lower(msc.trace(ALGORITHMS[key], 4, inplace=True, root=2), LowerOptions())
    text = plan_to_xml(plan)
    assert 'msc_root="2"' in text
    back = xml_to_plan(text)
    assert back.root == 2
    verify_plan(back)
    same_outputs(plan, back)


def test_rooted_collectives_keep_their_root():
    for key in ("broadcast/chain:chain", "reduce/tree:tree"):
        prog = msc.trace(ALGORITHMS[key], 5, root=3)
        plan = lower(prog, LowerOptions(protocol="LL128", tile=4096))
        back = xml_to_plan(plan_to_xml(plan))
        assert (back.root, back.protocol, back.tile) == (3, "LL128", 4096)
        verify_plan(back)
        same_outputs(plan, back)


def test_options_and_spellings():
    plan = library_plan("reducescatter/ring:ring", 4, False, 1)
    msccl_xml = ET.fromstring(plan_to_xml(plan, min_bytes=1024, max_bytes=1 << 20, name="rs"))
    assert msccl_xml.get("coll") == "reduce_scatter" and msccl_xml.get("name") == "rs"
    assert (msccl_xml.get("minBytes"), msccl_xml.get("maxBytes")) == ("1024", str(1 << 20))
    assert (msccl_xml.get("minbytes"), msccl_xml.get("maxbytes")) == ("1024", str(1 << 20))
    azure = ET.fromstring(plan_to_xml(plan, runtime="azure"))
    assert azure.get("coll") == "reducescatter" and azure.get("maxBytes") == "0" and "minbytes" not in azure.attrib
    assert ET.fromstring(plan_to_xml(plan)).get("maxBytes") == str((1 << 63) - 1)
    for kw in ({"runtime": "nccl"}, {"min_bytes": -1}, {"max_bytes": 0}, {"min_bytes": 10, "max_bytes": 5},
               {"name": "x" * 256}):
        with pytest.raises(UsageError):
            plan_to_xml(plan, **kw)


# -- hand-built plans: multi-source reduce, nops, renumbering ---------------------------------
def three_rank_reduce(inplace: bool, nops: bool) -> Plan:
    """Allreduce of 3 ranks: receive both peers' chunks into scratch, then one
    local reduce of three sources (into the input itself when in place).
    With ``nops`` the reduce waits through two msc nops, and a fourth
    threadblock waits on a nop and on the reduce."""
    out = "input" if inplace else "output"
    ranks = []
    for r in range(3):
        p1, p2 = (r + 1) % 3, (r + 2) % 3
        tbs = [Threadblock(0, p1, p2, 0, (Step(StepOp.SEND, (Slice("input", 0, 1),), None, 1),
                                          Step(StepOp.RECV, (), Slice("scratch", 0, 1), 1))),
               Threadblock(1, p2, p1, 0, (Step(StepOp.SEND, (Slice("input", 0, 1),), None, 1),
                                          Step(StepOp.RECV, (), Slice("scratch", 1, 1), 1)))]
        reduce = Step(StepOp.REDUCE, (Slice("input", 0, 1), Slice("scratch", 0, 1), Slice("scratch", 1, 1)),
                      Slice(out, 0, 1), 1)
        if nops:
            tbs.append(Threadblock(2, None, None, 0, (Step(StepOp.NOP, (), None, 1, ((0, 1),)),
                                                      Step(StepOp.NOP, (), None, 1, ((1, 1),)), reduce)))
            tbs.append(Threadblock(3, None, None, 0, (
                Step(StepOp.COPY, (Slice("scratch", 0, 1),), Slice("scratch", 2, 1), 1, ((2, 1),)),
                Step(StepOp.COPY, (Slice(out, 0, 1),), Slice("scratch", 3, 1), 1, ((2, 2),)))))
        else:
            tbs.append(Threadblock(2, None, None, 0, (replace(reduce, deps=((0, 1), (1, 1))),)))
        ranks.append(RankPlan(r, 4 if nops else 2, tuple(tbs)))
    return Plan("reduce3", "allreduce", 3, 1, inplace, 1, 1, tuple(ranks))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("nops", [False, True])
def test_multi_source_reduce_becomes_cpy_and_re(inplace, nops):
    plan = three_rank_reduce(inplace, nops)
    verify_plan(plan)
    text = plan_to_xml(plan)
    algo = check_structure(text, "msccl")
    tb2 = algo[0][2]
    head = [] if inplace else ["cpy"]              # in place the destination is a source: no copy
    assert [s.get("type") for s in tb2] == ["nop"] + head + ["re", "re"]
    assert [(s.get("depid"), s.get("deps")) for s in tb2][:2] == [("1", "1"), ("0", "1")]
    assert [s.get("srcbuf") + s.get("srcoff") for s in tb2 if s.get("type") == "re"] == ["s0", "s1"]
    if nops:
        # the wait on a nop became waits on what the nop waited for; the wait on
        # the reduce (msc step 2) points at its last <step>
        tb3 = algo[0][3]
        assert [(s.get("type"), s.get("depid"), s.get("deps")) for s in tb3] == \
               [("nop", "1", "1"), ("cpy", "0", "1"), ("cpy", "2", str(len(tb2) - 1))]
        assert tb2[-1].get("hasdep") == "1"
    back = xml_to_plan(text)
    verify_plan(back)
    same_outputs(plan, back)


def test_steps_that_cannot_be_expressed():
    plan = three_rank_reduce(False, False)
    tbs = plan.ranks[0].threadblocks[:2]
    for step, message in [
        (Step(StepOp.REDUCE, (Slice("scratch", 1, 1), Slice("scratch", 0, 1), Slice("scratch", 1, 1)),
              Slice("scratch", 1, 1), 1), "overlaps the destination"),
        (Step(StepOp.COPY, (Slice("scratch", 0, 2),), Slice("scratch", 1, 2), 2), "overlap partly"),
    ]:
        rank0 = RankPlan(0, 3, tbs + (Threadblock(2, None, None, 0, (step,)),))
        with pytest.raises(PlanError, match=message):
            plan_to_xml(replace(plan, ranks=(rank0,) + plan.ranks[1:]))


def test_re_steps_of_different_counts_are_not_fused():
    """Two reduces into the same destination offset with different counts: the
    runtime would fuse them (with the last cnt), so the first gets hasdep."""
    steps = (Step(StepOp.REDUCE, (Slice("output", 0, 2), Slice("input", 0, 2)), Slice("output", 0, 2), 2),
             Step(StepOp.REDUCE, (Slice("output", 0, 1), Slice("input", 2, 1)), Slice("output", 0, 1), 1))
    plan = Plan("chain", "allreduce", 1, 4, False, 4, 4, (RankPlan(0, 0, (Threadblock(0, None, None, 0, steps),)),))
    text = plan_to_xml(plan)
    tb = ET.fromstring(text)[0][0]
    assert [(s.get("type"), s.get("cnt"), s.get("hasdep")) for s in tb] == [("re", "2", "1"), ("re", "1", "0")]
    assert xml_to_plan(text).ranks[0].threadblocks[0].steps[1].count == 1
    with pytest.raises(PlanError, match="fuses"):
        xml_to_plan(text.replace('hasdep="1"', 'hasdep="0"'))


# -- runtime limits ----------------------------------------------------------------------
def local_plan(tbs, k=1, scratch=0, collective="allreduce") -> Plan:
    return Plan("local", collective, 1, k, False, k, k, (RankPlan(0, scratch, tuple(tbs)),))


def copy(i=0, count=1, deps=()):
    return Step(StepOp.COPY, (Slice("input", i, count),), Slice("output", i, count), count, deps)


def sends_from_rank0(peers: int) -> Plan:
    """Rank 0 sends to ``peers`` ranks, each from its own threadblock on channel 0."""
    ranks = [RankPlan(0, 0, tuple(Threadblock(t, t + 1, None, 0, (Step(StepOp.SEND, (Slice("input", 0, 1),),
                                                                        None, 1),)) for t in range(peers)))]
    ranks += [RankPlan(r, 1, (Threadblock(0, None, 0, 0, (Step(StepOp.RECV, (), Slice("scratch", 0, 1), 1),)),))
              for r in range(1, peers + 1)]
    return Plan("fan", "allreduce", peers + 1, 1, False, 1, 1, tuple(ranks))


@pytest.mark.parametrize("plan, runtime, limit, value, where", [
    (local_plan([Threadblock(0, None, None, 0, (copy(),) * 257)]), "msccl", "MSCCL_MAX_NUM_STEPS", 257,
     "rank 0, threadblock 0"),
    (local_plan([Threadblock(0, None, None, 0, (copy(0, 72),))], k=80), "azure", "MSCCL_MAX_COUNT", 72,
     "rank 0, threadblock 0, step 0"),
    (local_plan([Threadblock(0, None, None, 0, (copy(), copy(32768)))], k=40000), "msccl", "int16 offsets",
     32768, "step 1"),
    (local_plan([Threadblock(t, None, None, 0, (copy(),)) for t in range(217)]), "msccl",
     "MSCCL_MAX_NUM_THREAD_BLOCKS", 217, "rank 0"),
    (local_plan([Threadblock(t, None, None, 0, (copy(),)) for t in range(1025)]), "azure",
     "MSCCL_MAX_NUM_THREAD_BLOCKS", 1025, "rank 0"),
    (local_plan([Threadblock(0, None, None, 32, (copy(),))]), "msccl", "MAXCHANNELS", 33, "threadblock 0"),
    (local_plan([Threadblock(0, None, None, 0, (copy(deps=((129, 0),)),))] +
                [Threadblock(t, None, None, 0, (copy(),)) for t in range(1, 130)]), "azure", "int8 depid", 129,
     "rank 0, threadblock 0, step 0"),
    (sends_from_rank0(33), "msccl", "MSCCL_MAX_NUM_THREAD_BLOCKS_PER_CHANNEL", 33, "rank 0, threadblock 32"),
    (local_plan([Threadblock(t, None, None, 0, (copy(),) * 256) for t in range(16)]), "msccl",
     "MAX_NODES (XML elements read per rank)", 1 + 1 + 16 + 16 * 256, "rank 0"),
])
def test_runtime_limits_are_named(plan, runtime, limit, value, where):
    with pytest.raises(RuntimeLimitError) as info:
        plan_to_xml(plan, runtime=runtime)
    exc = info.value
    assert (exc.limit, exc.value) == (limit, value) and exc.maximum < value
    assert limit in str(exc) and where in str(exc) and runtime in str(exc)
    assert isinstance(exc, msc.MscError)


def test_limits_at_the_boundary_pass():
    plan_to_xml(local_plan([Threadblock(0, None, None, 31, (copy(),) * 256)]))
    plan_to_xml(local_plan([Threadblock(0, None, None, 0, (copy(0, 71), copy(32767)))], k=40000))
    plan_to_xml(local_plan([Threadblock(t, None, None, 0, (copy(),)) for t in range(217)]), runtime="azure")
    plan_to_xml(sends_from_rank0(32))


def test_custom_collectives_only_on_the_msccl_runtime():
    plan = local_plan([Threadblock(0, None, None, 0, (copy(),))], collective="send_next")
    assert ET.fromstring(plan_to_xml(plan)).get("coll") == "custom"
    back = xml_to_plan(plan_to_xml(plan))
    assert (back.collective, back.input_chunks, back.output_chunks) == ("custom", 1, 1)
    with pytest.raises(PlanError, match="no custom collectives"):
        plan_to_xml(plan, runtime="azure")


# -- the MSCCLang compatibility layer ----------------------------------------------------
def test_mscclang_program_prints_xml_that_imports(capsys):
    from msc.compat.msccl import AllReduce, Buffer, Check, MSCCLProgram, XML, chunk, fully_connected

    size = 4
    with MSCCLProgram("allreduce_ring", fully_connected(size), AllReduce(size, size, True), 2, protocol="LL"):
        for step in range(size - 1):
            for index in range(size):
                rank, nxt = (index + step) % size, (index + step + 1) % size
                chunk(nxt, Buffer.input, index).reduce(chunk(rank, Buffer.input, index))
        for step in range(-1, size - 2):
            for index in range(size):
                rank, nxt = (index + step) % size, (index + step + 1) % size
                chunk(rank, Buffer.input, index).copy(nxt, Buffer.input, index)
        Check()
        XML()
    text = capsys.readouterr().out
    check_structure(text, "msccl")
    plan = xml_to_plan(text)
    assert (plan.name, plan.protocol, plan.instances, plan.chunk_factor, plan.inplace) == \
           ("allreduce_ring", "LL", 2, 8, True)
    verify_plan(plan)


def test_lowering_for_azure_exports_azure_xml():
    prog = msc.trace(ALGORITHMS["alltoall/allpairs:allpairs"], 4)
    plan = lower(prog, LowerOptions(protocol="Simple", fuse=False, runtime="azure"))
    text = plan_to_xml(plan, runtime="azure", min_bytes=64)
    algo = check_structure(text, "azure")
    assert algo.get("minBytes") == "64" and algo.get("coll") == "alltoall"
    verify_plan(xml_to_plan(text))


# -- hand-written XML ----------------------------------------------------------------------
# A 2-rank allreduce as MSCCLang writes it (out of place, chunk factor 2): each
# rank reduces its own chunk (rrc) and sends it back; a local copy threadblock
# and a scratch copy are waited on through a nop. Unused operands name the
# remote end, as MSCCLang does.
HAND_ALLREDUCE = """<?xml version="1.0" encoding="utf-8"?>
<!-- written by hand -->
<algo name="allreduce_pairs" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allreduce" inplace="0">
{gpus}
</algo>
"""
HAND_GPU = """  <gpu id="{r}" i_chunks="2" o_chunks="2" s_chunks="1">
    <tb id="0" send="{p}" recv="{p}" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="{p}" dstbuf="o" dstoff="{p}" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="nop" srcbuf="i" srcoff="-1" dstbuf="o" dstoff="-1" cnt="0" depid="2" deps="0" hasdep="0"/>
      <step s="2" type="rrc" srcbuf="o" srcoff="{r}" dstbuf="o" dstoff="{r}" cnt="1" depid="1" deps="0" hasdep="0"/>
      <step s="3" type="s" srcbuf="o" srcoff="{r}" dstbuf="o" dstoff="{r}" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="4" type="r" srcbuf="o" srcoff="{p}" dstbuf="o" dstoff="{p}" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="1" send="-1" recv="-1" chan="0">
      <step s="0" type="cpy" srcbuf="i" srcoff="{r}" dstbuf="o" dstoff="{r}" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="2" send="-1" recv="-1" chan="0">
      <step s="0" type="cpy" srcbuf="i" srcoff="{p}" dstbuf="s" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
  </gpu>"""


def hand_allreduce() -> str:
    return HAND_ALLREDUCE.format(gpus="\n".join(HAND_GPU.format(r=r, p=1 - r) for r in range(2)))


def test_hand_written_allreduce_imports_and_verifies():
    plan = xml_to_plan(hand_allreduce())      # no msc_slots: what a Simple connection holds on the runtimes
    assert (plan.collective, plan.num_ranks, plan.chunk_factor, plan.inplace, plan.slots) == \
           ("allreduce", 2, 2, False, 2)
    tb0 = plan.ranks[0].threadblocks[0]
    assert [s.op for s in tb0.steps] == [StepOp.SEND, StepOp.NOP, StepOp.RRC, StepOp.SEND, StepOp.RECV]
    assert tb0.steps[1].deps == ((2, 0),) and tb0.steps[2].srcs == (Slice("output", 0, 1),)
    verify_plan(plan)
    run_collective = pytest.importorskip("msc.executor").run_collective
    x = [np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0])]
    for out in run_collective(plan, x):
        assert np.array_equal(out, x[0] + x[1])
    check_structure(plan_to_xml(plan), "msccl")


def test_in_place_allgather_written_with_the_input_buffer():
    """NCCL's in-place allgather: sendbuff = recvbuff + rank * count, so input
    chunk 0 of rank r is output chunk r."""
    gpu = """<gpu id="{r}" i_chunks="1" o_chunks="2" s_chunks="0"><tb id="0" send="{p}" recv="{p}" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="o" dstoff="{r}" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="i" srcoff="0" dstbuf="o" dstoff="{p}" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      </tb></gpu>"""
    text = ('<algo name="ag" proto="LL" nchannels="1" nchunksperloop="2" ngpus="2" coll="allgather" inplace="1">' +
            "".join(gpu.format(r=r, p=1 - r) for r in range(2)) + "</algo>")
    plan = xml_to_plan(text)
    assert plan.chunk_factor == 1 and plan.ranks[1].threadblocks[0].steps[0].srcs == (Slice("output", 1, 1),)
    verify_plan(plan)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace(' cnt="1" depid="1"', ' depid="1"', 1), "has no attribute 'cnt'"),
    (lambda t: t.replace('type="rrc"', 'type="rrx"', 1), "not an MSCCL step type"),
    (lambda t: t.replace('depid="1" deps="0"', 'depid="1" deps="5"', 1), "which has 1 steps"),
    (lambda t: t.replace('depid="1" deps="0"', 'depid="7" deps="0"', 1), "depid=7 must be in -1..2"),
    (lambda t: t.replace('hasdep="1"', 'hasdep="0"', 1), "lacks hasdep"),
    (lambda t: t.replace('cnt="0" depid="2"', 'cnt="0" depid="-1"', 1), "nop without a dependency"),
    (lambda t: t.replace('srcoff="{}"'.format(0), 'srcoff="x"', 1), "is not an integer"),
    (lambda t: t.replace('s_chunks="1"', 's_chunks="0"', 1), "outside the 0 chunks"),
    (lambda t: t.replace('ngpus="2"', 'ngpus="3"'), "ngpus=3 but 2 <gpu>"),
    (lambda t: t.replace('<tb id="2"', '<tb id="3"', 1), "<tb id=2> is missing"),
    (lambda t: t.replace('s="4"', 's="5"', 1), "s must count"),
    (lambda t: t.replace('coll="allreduce"', 'coll="gather"'), "not a collective msc knows"),
    (lambda t: t.replace("</algo>", ""), "not well-formed XML"),
    (lambda t: t.replace("<!-- written by hand -->", '<!DOCTYPE algo [<!ENTITY x "y">]>'), "DTD"),
    (lambda t: t.replace('send="1" recv="1"', 'send="1" recv="0"', 1), "its own gpu"),
])
def test_malformed_xml_names_what_and_where(edit, message):
    text = edit(hand_allreduce())
    assert text != hand_allreduce()
    with pytest.raises(PlanError) as info:
        xml_to_plan(text, path="hand.xml")
    assert message in str(info.value)
    assert info.value.line is not None and str(info.value).startswith(f"hand.xml:{info.value.line}")


def test_plan_check_errors_get_the_line():
    """plan_check's error (a send in a threadblock without a send peer) is
    reported at the <step> it names."""
    text = hand_allreduce().replace('type="cpy" srcbuf="i" srcoff="0" dstbuf="o"', 'type="s" srcbuf="i" srcoff="0" '
                                    'dstbuf="o"', 1)
    line = text[:text.index('type="s" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0"')].count("\n") + 1
    with pytest.raises(PlanError, match="no send peer") as info:
        xml_to_plan(text, path="x.xml")
    assert (info.value.line, info.value.rank, info.value.tb, info.value.step) == (line, 0, 1, 0)


def re_chain_xml(first: str, second: str) -> str:
    """Two re steps on one threadblock; the runtime fuses them when their
    destination and source buffer agree (nothing else in between)."""
    steps = "".join(f'<step s="{s}" type="re" {ops} depid="-1" deps="-1" hasdep="0"/>'
                    for s, ops in enumerate((first, second)))
    return ('<algo name="c" proto="LL" nchannels="1" nchunksperloop="4" ngpus="1" coll="allreduce" inplace="0">'
            '<gpu id="0" i_chunks="4" o_chunks="4" s_chunks="0"><tb id="0" send="-1" recv="-1" chan="0">' + steps +
            '</tb></gpu></algo>')


I0, I1, O0, O1 = ('srcbuf="i" srcoff="0"', 'srcbuf="i" srcoff="1"', 'srcbuf="o" srcoff="0"', 'srcbuf="o" srcoff="1"')


@pytest.mark.parametrize("first, second, message", [
    (I0, I1, None),                                     # fused: one pass reading o[0] once, as in turn
    (I0, I0.replace('"0"', '"2"'), None),
    (O1, I1, None),                                     # another source buffer: not fused
    (O0, O1, None),                                     # o[0] += o[0] alone is elementwise
    (I0, I1 + ' cnt="2"', "fuses"),                     # fused, but run with the last cnt for both
    (O1, O0, "overlaps its destination"),               # fused pass reads o[0] before the first re wrote it
    (O1 + ' cnt="2"', O0, "overlaps its destination"),  # o[0:2] += o[1:3]: partly overlapping
])
def test_runtime_fusion_of_re_steps(first, second, message):
    ops = [op if "cnt" in op else op + ' cnt="1"' for op in (first, second)]
    text = re_chain_xml(*(op.replace(' cnt', ' dstbuf="o" dstoff="0" cnt') for op in ops))
    if message is None:
        xml_to_plan(text)
    else:
        with pytest.raises(PlanError, match=message):
            xml_to_plan(text)


def test_dependency_cycle_through_a_nop():
    tbs = [Threadblock(0, None, None, 0, (copy(deps=((1, 0),)),)),
           Threadblock(1, None, None, 0, (Step(StepOp.NOP, (), None, 1, ((0, 0),)), copy()))]
    with pytest.raises(PlanError, match="through nops"):
        plan_to_xml(local_plan(tbs))


# -- fuzzing: only msc errors come out ---------------------------------------------------------
SEEDS = [hand_allreduce(),
         plan_to_xml(library_plan("allreduce/allpairs:allpairs", 4, True, 1)),
         plan_to_xml(library_plan("allgather/ring:ring", 4, True, 2), runtime="azure"),
         plan_to_xml(three_rank_reduce(False, True))]
VALUES = st.one_of(st.integers(-3, 12).map(str),
                   st.sampled_from(["", "-1", "x", "0x10", "1e3", " 3 ", "nop", "re", "rrc", "i", "o", "s",
                                    "99999999999999999999", "\u0663", "2147483648", "LL", "allgather",
                                    "reduce_scatter", "custom", "broadcast"]),
                   st.text(max_size=4))


def _import_only_raises_msc_errors(text):
    try:
        plan = xml_to_plan(text)
        if plan.scratch_chunks + plan.input_chunks + plan.output_chunks < 10_000:
            verify_plan(plan)
            plan_to_xml(plan)
    except Exception as exc:  # noqa: BLE001 - the point: nothing but msc errors
        assert isinstance(exc, msc.MscError), f"{type(exc).__name__}: {exc}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_fuzz_arbitrary_text(text):
    _import_only_raises_msc_errors(text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(range(len(SEEDS))), data=st.data())
def test_fuzz_mutated_exports(seed, data):
    root = ET.fromstring(SEEDS[seed])
    for _ in range(data.draw(st.integers(1, 3))):
        elements = list(root.iter())
        el = elements[data.draw(st.integers(0, len(elements) - 1))]
        kind = data.draw(st.sampled_from(["del_attr", "set_attr", "set_attr", "del_el", "dup_el"]))
        if kind in ("del_attr", "set_attr") and el.attrib:
            attr = data.draw(st.sampled_from(sorted(el.attrib)))
            if kind == "del_attr":
                del el.attrib[attr]
            else:
                el.set(attr, data.draw(VALUES))
        elif kind in ("del_el", "dup_el") and el is not root:
            parent = next(p for p in root.iter() if el in list(p))
            if kind == "del_el":
                parent.remove(el)
            else:
                parent.append(deepcopy(el))
    text = ET.tostring(root, encoding="unicode")
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    _import_only_raises_msc_errors(text)


# -- issue 14, item 7: bounded quotes, declared encodings, bytes that are not UTF-8 --
BIG = 1_000_000


def exported() -> str:
    return plan_to_xml(lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 3)))


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("<algo", "<" + "x" * BIG, 1).replace("</algo>", "</" + "x" * BIG + ">"),
    lambda t: t.replace('<gpu id="0"', "<" + "g" * BIG + ' id="0"', 1).replace("</gpu>", "</" + "g" * BIG + ">", 1),
    lambda t: t.replace('<step s="0"', '<step s="' + " " * BIG + '7"', 1),
    lambda t: t.replace('proto="Simple"', 'proto="' + "P" * BIG + '"'),
    lambda t: t.replace('ngpus="3"', 'ngpus="' + "3" * BIG + '"'),
], ids=["root tag", "child tag", "padded step number", "protocol", "number"])
def test_a_huge_name_or_value_is_not_echoed_whole(edit):
    text = edit(exported())
    for data in (text, text.encode()):
        with pytest.raises(PlanError) as info:
            xml_to_plan(data, path="big.xml")
        assert str(info.value).startswith("big.xml:") and len(str(info.value)) < 300, str(info.value)[:400]
    if "<algo" not in text:
        from msc.formats.xml_import import xml_byte_range

        with pytest.raises(PlanError) as info:
            xml_byte_range(text.encode(), path="big.xml")
        assert len(str(info.value)) < 300


@pytest.mark.parametrize("encoding", ["bogus", "x" * 200, "shift_jis"])
def test_an_encoding_expat_cannot_read_is_named(encoding):
    from msc.formats.xml_import import xml_byte_range

    data = f'<?xml version="1.0" encoding="{encoding}"?>\n{exported()}'.encode()
    for read in (xml_to_plan, xml_byte_range):
        with pytest.raises(PlanError) as info:
            read(data, path="enc.xml")
        message = str(info.value)
        assert message.startswith("enc.xml:1: ") and repr(encoding[:80])[:-1] in message and len(message) < 300


def test_declared_single_byte_encodings_still_read():
    text = exported().replace('name="ring"', 'name="ring\u00e9"')
    plan = xml_to_plan(f'<?xml version="1.0" encoding="windows-1252"?>\n{text}'.encode("cp1252"))
    assert plan.name == "ring\u00e9"


def test_xml_that_is_not_utf8_names_the_file_and_byte_offset():
    text = exported().encode()
    at = text.index(b'name="') + 6
    for head in (b"", b'<?xml version="1.0" encoding="UTF-8"?>\n'):
        data = head + text[:at] + b"\xc3(" + text[at:]
        with pytest.raises(PlanError) as info:
            xml_to_plan(data, path="bad.xml")
        assert f"byte 0xc3 at byte offset {len(head) + at}" in str(info.value)
        line = 1 + head.count(b"\n")
        assert str(info.value).startswith(f"bad.xml:{line}: ")
