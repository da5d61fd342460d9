"""``msc diff`` (msc.formats.diff): exact comparison names the first differing
header field, rank, threadblock or step; equivalence compares each rank's
operations and happens-before order, so nops, implied waits, threadblock
numbering and MSCCL's spelling of a reduce do not count, and every library
plan equals its XML round trip; the command's output, lines and exit codes."""
from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest

import msc
from msc.formats.diff import diff_plans
from msc.dsl.collectives import COLLECTIVES
from msc.errors import FormatError, PlanError
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.lower.pipeline import LowerOptions, lower
from msc.formats.plan_text import dump_plan, save_plan
from msc.formats.xml_export import plan_to_xml
from msc.formats.xml_import import xml_to_plan
from library import algorithms, rank_counts

ALGORITHMS = algorithms(switch=False)


@functools.lru_cache(maxsize=None)
def library_plan(key: str, n: int, inplace: bool, instances: int) -> Plan:
    return lower(msc.trace(ALGORITHMS[key], n, inplace=inplace), LowerOptions(instances=instances))


def through_xml(plan: Plan) -> tuple[Plan, Plan]:
    """The plan and its export/import round trip; as LL when it needs more
    messages in flight than a Simple connection of the MSCCL runtime holds
    (any other error the LL export raises too)."""
    try:
        return plan, xml_to_plan(plan_to_xml(plan))
    except PlanError:
        plan = replace(plan, protocol="LL")
        return plan, xml_to_plan(plan_to_xml(plan))

# rank 1 of the in-place 4-rank halving-doubling plan, as mutated below:
#   tb 0 send 0 recv 0:  0: send input[0] after 1.0   1: rrcs input[1] -> input[1] after 1.0
#                        2: recv -> input[0] after 1.0
#   tb 1 recv 3:         0: rrc input[0:2] -> input[0:2]   1: recv -> input[2:4] after 2.0
#   tb 2 send 3:         0: send input[2:4]   1: send input[0:2] after 0.2
KEY = "allreduce/halving_doubling:halving_doubling"


@pytest.fixture
def base() -> Plan:
    plan = library_plan(KEY, 4, True, 1)
    tb0, tb1, tb2 = plan.ranks[1].threadblocks
    assert (tb2.steps[1].deps, tb1.steps[1].deps, tb0.steps[0].deps) == (((0, 2),), ((2, 0),), ((1, 0),))
    return plan


def with_threadblocks(plan: Plan, r: int, tbs) -> Plan:
    ranks = list(plan.ranks)
    ranks[r] = replace(ranks[r], threadblocks=tuple(tbs))
    return replace(plan, ranks=tuple(ranks))


def with_steps(plan: Plan, r: int, t: int, steps) -> Plan:
    tbs = list(plan.ranks[r].threadblocks)
    tbs[t] = replace(tbs[t], steps=tuple(steps))
    return with_threadblocks(plan, r, tbs)


def edit_step(plan: Plan, r: int, t: int, s: int, **fields) -> Plan:
    steps = list(plan.ranks[r].threadblocks[t].steps)
    steps[s] = replace(steps[s], **fields)
    return with_steps(plan, r, t, steps)


def renumbered(plan: Plan, r: int, new) -> Plan:
    """Rank r with every dependency (t, s) renamed new((t, s))."""
    tbs = [replace(tb, steps=tuple(replace(st, deps=tuple(new(d) for d in st.deps)) for st in tb.steps))
           for tb in plan.ranks[r].threadblocks]
    return with_threadblocks(plan, r, tbs)


def insert_step(plan: Plan, r: int, t: int, s: int, step: Step) -> Plan:
    """``step`` becomes step s of threadblock t; the dependencies on the steps after it follow them."""
    moved = renumbered(plan, r, lambda d: (d[0], d[1] + 1) if d[0] == t and d[1] >= s else d)
    steps = list(moved.ranks[r].threadblocks[t].steps)
    return with_steps(moved, r, t, steps[:s] + [replace(step, deps=step.deps)] + steps[s:])


def where(d):
    return [(side.rank, side.tb, side.step) for side in (d.a, d.b)]


# -- equal ---------------------------------------------------------------------------------------
def test_a_plan_equals_itself_and_its_text(base):
    from msc.formats.plan_text import parse_plan

    assert diff_plans(base, base) is None
    assert diff_plans(base, parse_plan(dump_plan(base))) is None
    # a name, source lines and the order of a step's dependencies change nothing
    stripped = replace(base, name="other", ranks=tuple(
        replace(rp, threadblocks=tuple(replace(tb, steps=tuple(replace(s, where=None, deps=s.deps[::-1] + s.deps)
                                                                 for s in tb.steps)) for tb in rp.threadblocks))
        for rp in base.ranks))
    assert diff_plans(base, stripped) is None


@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_every_library_plan_equals_its_xml_round_trip_up_to_equivalence(key):
    cases = [(n, inplace, instances) for n in rank_counts(ALGORITHMS[key], (4, 8))
             for inplace in (True, False) for instances in (1, 2)]
    assert cases
    for n, inplace, instances in cases:
        plan = library_plan(key, n, inplace, instances)
        spec = COLLECTIVES[plan.collective]
        if not spec.msccl and not inplace and len(set(spec.units(n))) > 1:
            # coll="custom" sizes both buffers from one count: out-of-place gather and scatter do not fit
            with pytest.raises(FormatError, match="MSCCL XML cannot describe this plan's buffers"):
                through_xml(plan)
            continue
        plan, back = through_xml(plan)
        assert diff_plans(plan, back, equivalent=True) is None, (n, inplace, instances)
        assert diff_plans(back, plan, equivalent=True) is None
        assert diff_plans(back, xml_to_plan(plan_to_xml(back))) is None       # XML -> plan -> XML: exact


def test_the_round_trip_is_not_exactly_equal_where_xml_drops_implied_waits(base):
    d = diff_plans(base, xml_to_plan(plan_to_xml(base)), names=("p.plan", "p.xml"))
    assert d.kind == "step" and d.summary == "rank 0, threadblock 0, step 1: the dependencies differ"
    assert (d.a.text, d.b.text) == ("rrcs input[0] -> input[0] after 1.0", "rrcs input[0] -> input[0]")


def reduce3(inplace: bool, nops: bool) -> Plan:
    """Allreduce of 3 ranks: both peers' chunks into scratch, then one reduce
    of three sources (into the input itself in place), after both receives,
    or through two nops that a fourth threadblock also waits on."""
    out = Slice("input" if inplace else "output", 0, 1)
    ranks = []
    for r in range(3):
        tbs = [Threadblock(t, (r + 1 + t) % 3, (r + 2 - t) % 3, 0,
                           (Step(StepOp.SEND, (Slice("input", 0, 1),), None, 1),
                            Step(StepOp.RECV, (), Slice("scratch", t, 1), 1))) for t in (0, 1)]
        reduce = Step(StepOp.REDUCE, (Slice("input", 0, 1), Slice("scratch", 0, 1), Slice("scratch", 1, 1)), out, 1)
        if nops:
            nop = functools.partial(Step, StepOp.NOP, (), None, 1)
            tbs += [Threadblock(2, None, None, 0, (nop(((0, 1),)), nop(((1, 1),)), reduce)),
                    Threadblock(3, None, None, 0, (Step(StepOp.COPY, (out,), Slice("scratch", 2, 1), 1, ((2, 1),)),))]
        else:
            tbs.append(Threadblock(2, None, None, 0, (replace(reduce, deps=((0, 1), (1, 1))),)))
        ranks.append(RankPlan(r, 3 if nops else 2, tuple(tbs)))
    return Plan("reduce3", "allreduce", 3, 1, inplace, 1, 1, tuple(ranks))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("nops", [False, True])
def test_a_multi_source_reduce_equals_its_cpy_and_re_steps(inplace, nops):
    plan = reduce3(inplace, nops)
    back = xml_to_plan(plan_to_xml(plan))
    assert diff_plans(plan, back, equivalent=True) is None
    assert diff_plans(plan, back).kind == "step"
    # a reduce into one of its sources: the order of the sources does not count
    if inplace and not nops:
        (src, s0, s1), = {s.srcs for *_, s in plan.steps() if s.op is StepOp.REDUCE}
        swapped = edit_step(plan, 0, 2, 0, srcs=(s0, src, s1))
        assert diff_plans(plan, swapped, equivalent=True) is None
        assert diff_plans(plan, swapped).summary == "rank 0, threadblock 2, step 0: the sources differ"


# -- mutations: exact and equivalent modes name the same place --------------------------------------
def test_a_changed_slice(base):
    mutated = edit_step(base, 1, 2, 0, srcs=(Slice("input", 0, 2),))
    d = diff_plans(base, mutated)
    assert (d.kind, d.summary, where(d)) == ("step", "rank 1, threadblock 2, step 0: the sources differ",
                                             [(1, 2, 0)] * 2)
    assert (d.a.text, d.b.text) == ("send input[2:4]", "send input[0:2]")
    e = diff_plans(base, mutated, equivalent=True)
    assert (e.kind, where(e)) == ("operation", [(1, 2, 0)] * 2)
    assert e.summary == "rank 1: send input[2:4] (to rank 3, channel 0) is in a (threadblock 2, step 0), not in b"
    assert e.b.text == "no send input[2:4] (to rank 3, channel 0); here: send input[0:2] (to rank 3, channel 0)"


def test_a_changed_peer(base):
    tbs = list(base.ranks[1].threadblocks)
    tbs[2] = replace(tbs[2], send=2)
    mutated = with_threadblocks(base, 1, tbs)
    d = diff_plans(base, mutated)
    assert (d.kind, d.summary) == ("threadblock", "rank 1, threadblock 2: the send peer differs")
    assert (d.a.text, d.b.text) == ("tb 2 send 3 recv - channel 0", "tb 2 send 2 recv - channel 0")
    e = diff_plans(base, mutated, equivalent=True)
    assert (e.kind, where(e)) == ("operation", [(1, 2, 0)] * 2) and "to rank 2" in e.b.text


def test_a_changed_op(base):
    mutated = edit_step(base, 1, 0, 1, op=StepOp.RRC)
    d = diff_plans(base, mutated)
    assert (d.summary, where(d)) == ("rank 1, threadblock 0, step 1: the op differs", [(1, 0, 1)] * 2)
    e = diff_plans(base, mutated, equivalent=True)
    assert (e.kind, where(e)) == ("operation", [(1, 0, 1)] * 2)


def test_a_changed_dependency(base):
    mutated = edit_step(base, 1, 2, 1, deps=((0, 1),))            # waits for step 1 of tb 0, not step 2
    d = diff_plans(base, mutated)
    assert (d.summary, where(d)) == ("rank 1, threadblock 2, step 1: the dependencies differ", [(1, 2, 1)] * 2)
    e = diff_plans(base, mutated, equivalent=True)
    assert (e.kind, where(e)) == ("order", [(1, 2, 1)] * 2)
    assert e.summary == ("rank 1: send input[0:2] (to rank 3, channel 0) comes after recv -> input[0] (from rank 0, "
                         "channel 0) in a, not in b")
    assert e.a.text.endswith("comes after threadblock 0, step 2")
    assert e.b.text.endswith("does not come after threadblock 0, step 2")


def test_a_removed_dependency_is_not_equivalent(base):
    mutated = edit_step(base, 1, 2, 1, deps=())
    e = diff_plans(base, mutated, equivalent=True, names=("old", "new"))
    assert (e.kind, where(e)) == ("order", [(1, 2, 1)] * 2) and e.summary.endswith(" in old, not in new")
    e = diff_plans(mutated, base, equivalent=True, names=("new", "old"))     # the other way round: b waits
    assert (e.kind, where(e)) == ("order", [(1, 2, 1)] * 2) and e.summary.endswith(" in old, not in new")


def test_a_reordered_step(base):
    s0, s1 = base.ranks[1].threadblocks[2].steps
    swapped = with_steps(base, 1, 2, (s1, s0))                    # as in a text editor
    d = diff_plans(base, swapped)
    assert (d.summary, where(d)) == ("rank 1, threadblock 2, step 0: the sources and dependencies differ",
                                     [(1, 2, 0)] * 2)
    swap = {(2, 0): (2, 1), (2, 1): (2, 0)}                       # the waits on them follow them
    moved = with_steps(renumbered(base, 1, lambda d: swap.get(d, d)), 1, 2, (s1, s0))
    d = diff_plans(base, moved)
    assert (d.summary, where(d)) == ("rank 1, threadblock 1, step 1: the dependencies differ", [(1, 1, 1)] * 2)
    for mutated in (swapped, moved):
        e = diff_plans(base, mutated, equivalent=True)
        assert e.kind == "order" and e.a.rank == e.b.rank == 1 and 2 in (e.a.tb, e.b.tb)


def test_an_extra_step(base):
    steps = base.ranks[1].threadblocks[2].steps + (Step(StepOp.SEND, (Slice("input", 0, 1),), None, 1),)
    mutated = with_steps(base, 1, 2, steps)
    d = diff_plans(base, mutated)
    assert (d.summary, where(d)) == ("rank 1, threadblock 2, step 2: only in b (a has 2 steps there)",
                                     [(1, 2, None), (1, 2, 2)])
    e = diff_plans(base, mutated, equivalent=True)
    assert (e.kind, e.b.tb, e.b.step) == ("operation", 2, 2)
    assert e.summary == "rank 1: send input[0] (to rank 3, channel 0) is in b (threadblock 2, step 2), not in a"


def test_an_extra_threadblock_and_header_fields(base):
    tbs = base.ranks[3].threadblocks + (Threadblock(3, None, None, 1, ()),)
    d = diff_plans(with_threadblocks(base, 3, tbs), base)
    assert (d.summary, where(d)) == ("rank 3, threadblock 3: only in a (b has 3 threadblocks)",
                                     [(3, 3, None), (3, None, None)])
    assert diff_plans(with_threadblocks(base, 3, tbs), base, equivalent=True) is None    # it does nothing
    d = diff_plans(base, replace(base, slots=4))
    assert (d.kind, d.summary, d.a.field) == ("header", "slots: 2 in a, 4 in b", "slots")
    assert diff_plans(base, replace(base, slots=4, instances=2, tile=4096), equivalent=True) is None
    assert diff_plans(base, replace(base, protocol="LL"), equivalent=True).summary == "protocol: Simple in a, LL in b"
    assert diff_plans(base, replace(base, inplace=False)).summary == "inplace: true in a, false in b"


# -- what equivalence folds -------------------------------------------------------------------------
def test_a_nop_carrying_the_dependency_is_equivalent_not_equal(base):
    step = base.ranks[1].threadblocks[2].steps[1]
    nop = Step(StepOp.NOP, (), None, 1, step.deps)
    inline = edit_step(insert_step(base, 1, 2, 1, nop), 1, 2, 2, deps=())
    assert [s.op for s in inline.ranks[1].threadblocks[2].steps] == [StepOp.SEND, StepOp.NOP, StepOp.SEND]
    # a nop in a threadblock of its own, waited for through a second nop
    tbs = base.ranks[1].threadblocks + (Threadblock(3, None, None, 0, (Step(StepOp.NOP, (), None, 1, ((0, 1),)),
                                                                       nop)),)
    apart = edit_step(with_threadblocks(base, 1, tbs), 1, 2, 1, deps=((3, 1),))
    for other in (inline, apart):
        assert diff_plans(base, other).kind in ("step", "threadblock")
        assert diff_plans(base, other, equivalent=True) is None
    # a nop that waits for less is not
    weaker = edit_step(inline, 1, 2, 1, deps=((0, 1),))
    assert diff_plans(base, weaker, equivalent=True).kind == "order"


def test_an_implied_wait_is_equivalent(base):
    # step 1 of tb 2 already comes after its own step 0, and after tb 1 step 0 (through tb 0 step 0)
    for extra in ((2, 0),), ((1, 0),), ((0, 0), (0, 1)):
        mutated = edit_step(base, 1, 2, 1, deps=((0, 2),) + extra)
        assert diff_plans(base, mutated).summary == "rank 1, threadblock 2, step 1: the dependencies differ"
        assert diff_plans(base, mutated, equivalent=True) is None


def test_threadblock_numbering_does_not_count_when_equivalent(base):
    order = [2, 0, 1]                               # new threadblock i is old order[i]
    new = {old: i for i, old in enumerate(order)}
    moved = renumbered(base, 1, lambda d: (new[d[0]], d[1]))
    tbs = moved.ranks[1].threadblocks
    mutated = with_threadblocks(moved, 1, [replace(tbs[old], id=i) for i, old in enumerate(order)])
    assert diff_plans(base, mutated).summary == "rank 1, threadblock 0: the send peer and receive peer differ"
    assert diff_plans(base, mutated, equivalent=True) is None


def test_a_dependency_cycle_is_bad_input_when_equivalent(base):
    cyclic = edit_step(base, 1, 1, 0, deps=((2, 1),))
    assert diff_plans(base, cyclic).kind == "step"
    with pytest.raises(PlanError, match=r"b: .*cycle of dependencies"):
        diff_plans(base, cyclic, equivalent=True)
    with pytest.raises(PlanError, match="does not exist"):
        diff_plans(base, edit_step(base, 1, 1, 0, deps=((2, 7),)), equivalent=True)


# -- the command --------------------------------------------------------------------------------------
def run(capsys, *args) -> tuple[int, str, str]:
    from msc.cli.main import main

    code = main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def files(tmp_path, base):
    plan, xml, back, changed = (tmp_path / name for name in ("hd.plan", "hd.xml", "back.plan", "changed.plan"))
    save_plan(base, plan)
    xml.write_text(plan_to_xml(base))
    save_plan(xml_to_plan(xml.read_text()), back)
    save_plan(edit_step(base, 1, 2, 0, srcs=(Slice("input", 0, 2),)), changed)
    return plan, xml, back, changed


def test_the_command_compares_plans_and_xml_in_any_mix(capsys, files):
    plan, xml, back, _ = files
    assert run(capsys, xml, back) == (0, "equal\n", "")
    assert run(capsys, plan, xml, "--equivalent") == (0, "equal (up to dependency equivalence)\n", "")
    code, out, _ = run(capsys, plan, xml)
    head, a, b = out.splitlines()
    assert code == 1 and head == "differ: rank 0, threadblock 0, step 1: the dependencies differ"
    assert a.startswith(f"  {plan}:9: rank 0, threadblock 0, step 1: rrcs input[0] -> input[0] after 1.0 (from ")
    assert b == f"  {xml}:5: rank 0, threadblock 0, step 1: rrcs input[0] -> input[0]"


def test_the_command_names_each_files_line(capsys, files):
    plan, xml, _, changed = files
    code, out, err = run(capsys, xml, changed, "--equivalent")
    assert (code, err) == (1, "")
    head, a, b = out.splitlines()
    assert head == f"differ: rank 1: send input[2:4] (to rank 3, channel 0) is in {xml} (threadblock 2, step 0), " \
                   f"not in {changed}"
    xml_line, plan_line = int(a.split(":")[1]), int(b.split(":")[1])
    assert '<step s="0" type="s" srcbuf="i" srcoff="2"' in xml.read_text().splitlines()[xml_line - 1]
    assert changed.read_text().splitlines()[plan_line - 1].strip().startswith("0: send input[0:2]")
    code, out, _ = run(capsys, plan, changed, "--json")
    answer = json.loads(out)
    assert code == 1 and (answer["equal"], answer["mode"]) == (False, "exact")
    assert answer["difference"]["b"] == {"rank": 1, "threadblock": 2, "step": 0, "value": "send input[0:2]",
                                         "field": None, "source": answer["difference"]["b"]["source"],
                                         "file": str(changed), "line": plan_line}
    code, out, _ = run(capsys, plan, plan, "--json", "--equivalent")
    assert (code, json.loads(out)) == (0, {"equal": True, "mode": "equivalent", "a": str(plan), "b": str(plan)})
    # a header field: the line that holds it
    save_plan(replace(xml_to_plan(xml.read_text()), slots=3), changed)
    code, out, _ = run(capsys, xml, changed)
    assert out.splitlines() == ["differ: slots: 2 in {}, 3 in {}".format(xml, changed),
                                f"  {xml}:1: slots 2", f"  {changed}:4: slots 3"]


def test_the_command_exits_2_on_bad_input(capsys, files, tmp_path):
    plan, xml, _, changed = files
    code, out, err = run(capsys, plan, tmp_path / "missing.plan")
    assert (code, out) == (2, "") and err.startswith("msc: error: cannot read ")
    bad = tmp_path / "bad.plan"
    bad.write_text("msc-plan 1\nname")
    code, _, err = run(capsys, plan, bad)
    assert code == 2 and f"{bad}:" in err
    assert run(capsys, plan, xml, "--verify", "--equivalent")[0] == 0
    code, _, err = run(capsys, plan, changed, "--verify")            # reads, but computes the wrong sums
    assert code == 2 and err.startswith(f"msc: error: {changed} does not verify (--verify): ")
    assert run(capsys, plan, changed)[0] == 1                         # without --verify it is a difference
