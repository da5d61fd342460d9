"""Switch ops (NVLS): the DSL, lowering, the plan's checks and verifier, the
reference executor, the plan text, the simulator, and the backends that
refuse them by name."""
from __future__ import annotations

import dataclasses
import textwrap

import ml_dtypes
import numpy as np
import pytest

import msc
from msc.errors import DeadlockError, OperationError, PlanError, RaceError, UsageError
from msc.executor import run_collective
from msc.formats.plan_text import _parse_with_grammar, dump_plan, parse_plan
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.lower.pipeline import LowerOptions, lower
from msc.verification.plan import verify_plan
from msc.verification.plan_values import check_plan
from library import algorithms

NVLS = algorithms()["allreduce/nvls:nvls"]
NVLS_TREE = algorithms()["allreduce/nvls_tree:nvls_tree"]
NVLS_RING = algorithms()["allreduce/nvls_ring:nvls_ring"]


def _plan(alg, n, inplace=False, instances=1, **params):
    program = msc.trace(alg, n, inplace=inplace, **params)
    msc.verify(program)
    return lower(program, LowerOptions(instances=instances))


def _algorithm(tmp_path, body: str, collective="allreduce", chunk_factor="lambda n: n"):
    path = tmp_path / "alg.py"
    path.write_text("import msc\n\n\n" + f"@msc.algorithm({collective!r}, chunk_factor={chunk_factor})\n"
                    "def alg(p):\n" + textwrap.indent(textwrap.dedent(body), "    "))
    [alg] = msc.load_algorithms(path)
    return alg


# -- the DSL ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    ("p.switch([0, 1]).reduce(2, 'input', 0).store('output', 0)", "rank 2 is not a member of the switch group"),
    ("p.switch([1])", "at least two distinct ranks"),
    ("p.switch([0, 0, 1])", "at least two distinct ranks"),
    ("p.switch([0, 9])", "9 is not a rank"),
    ("p.switch().reduce(0, 'tmp', 0).store('output', 0)", "not scratch buffers"),
    ("p.switch().reduce(0, 'input', 0).store('input', 0)", "read-only in the out-of-place form"),
    ("p.switch().reduce(0, 'input', 7)", "index out of range"),
    ("p.switch().store(p.chunk(0, 'input', 0), 'tmp', 0)", "not scratch buffers"),
])
def test_switch_mistakes_are_named_at_the_users_line(tmp_path, body, message):
    alg = _algorithm(tmp_path, body)
    with pytest.raises(OperationError, match=message) as exc:
        msc.trace(alg, 4, inplace=False)
    assert exc.value.where is not None and exc.value.where.line >= 6


def test_in_place_switch_side_at_rank_dependent_offsets_is_refused(tmp_path):
    alg = _algorithm(tmp_path, "p.switch().store(p.chunk(0, 'input', 0), 'input', 0)", collective="allgather",
                     chunk_factor="1")
    with pytest.raises(OperationError, match="different offset of output on each rank"):
        msc.trace(alg, 4, inplace=True)


def test_a_switch_program_verifies_and_a_wrong_one_does_not(tmp_path):
    msc.verify(msc.trace(NVLS, 4))
    wrong = _algorithm(tmp_path, """
        sw = p.switch()
        for r in range(p.num_ranks):
            sw.reduce(r, 'input', r).to('output', r)     # only the reading rank gets the sum
        """)
    with pytest.raises(msc.VerificationError, match="rank 0 output\\[1\\]"):
        msc.verify(msc.trace(wrong, 4, inplace=False))


# -- lowering, the plan, the executor ----------------------------------------------------------------
KEEP_AND_SUM = msc.CustomCollective("keep_and_sum", input_chunks=1, output_chunks=2,
                                   postcondition=lambda r, i, n, k: [(r, 0)] if i == 0 else [(m, 0) for m in range(n)])


@msc.algorithm(KEEP_AND_SUM, inplace=False)
def keep_then_sum_through_the_switch(p):
    """Each rank copies its input to output[0]; then rank 0 reads every
    member's output[0] through the switch into its own output[1] and
    multicasts that: the read comes after other ranks' writes (and nothing
    else the switch writes meets them), which only a barrier orders."""
    for r in range(p.num_ranks):
        p.chunk(r, "input", 0).copy(r, "output", 0)
    sw = p.switch()
    sw.reduce(0, "output", 0).to("output", 1)
    sw.store(p.chunk(0, "output", 1), "output", 1)


def test_lowering_puts_a_barrier_between_members_writes_and_the_switch_reading_them():
    plan = _plan(keep_then_sum_through_the_switch, 4)
    for rp in plan.ranks:
        [tb] = [tb for tb in rp.threadblocks if tb.group]
        ops = [st.op for st in tb.steps]
        assert ops.count(StepOp.BARRIER) == 3, (rp.rank, ops)     # the call's two and one before the read
    verify_plan(plan)


def test_nvls_lowers_to_one_switch_step_between_two_barriers_per_rank():
    plan = _plan(NVLS, 8)
    for rp in plan.ranks:
        [tb] = rp.threadblocks
        assert tb.group == tuple(range(8)) and [s.op for s in tb.steps] == [StepOp.BARRIER, StepOp.SWRS, StepOp.BARRIER]
        assert tb.steps[1].srcs == (Slice("input", rp.rank, 1),) and tb.steps[1].dst == Slice("output", rp.rank, 1)


def test_nvls_tree_needs_no_barrier_where_each_rank_only_orders_itself():
    """Between the node reduce and the tree, and the tree and the multicast,
    every conflict is a rank's own: dependencies, not barriers. The reduce
    and the store run on switch threadblocks of their own (pipelined), and
    neither the tree nor the last barriers wait for a first barrier or for
    the rank's copies (which would hold the phases to one pace per tile)."""
    plan = _plan(NVLS_TREE, 8, gpus_per_node=4)
    for rp in plan.ranks:
        node = tuple(range(rp.rank // 4 * 4, rp.rank // 4 * 4 + 4))
        switch = [tb for tb in rp.threadblocks if tb.group]
        assert [(tb.id, tb.group, tb.channel) for tb in switch] == [(0, node, 0), (1, node, 1)]
        reducing, storing = switch
        assert [s.op for s in reducing.steps] == [StepOp.BARRIER, StepOp.SWRED, StepOp.BARRIER]
        assert [s.op for s in storing.steps] == [StepOp.BARRIER, StepOp.SWST, StepOp.BARRIER]
        tree_tbs = {tb.id for tb in rp.threadblocks if not tb.group}
        assert {t for t, _ in storing.steps[1].deps} & tree_tbs, "the multicast waits for the rank's tree steps"
        assert reducing.steps[2].deps == storing.steps[2].deps == ()
        for tb in rp.threadblocks:
            for step in tb.steps:
                assert all(not (t in (0, 1) and s == 0) for t, s in step.deps), (rp.rank, tb.id, step)


def test_switch_threadblocks_of_one_rank_order_each_other():
    """With one node the store (channel 1) meets the reduce (channel 0) with
    no copy between: the store waits for the reduce on its own rank."""
    plan = _plan(NVLS_TREE, 4, gpus_per_node=4)
    verify_plan(plan)
    for rp in plan.ranks:
        reducing, storing = rp.threadblocks
        assert storing.steps[1].op is StepOp.SWST and (reducing.id, 1) in storing.steps[1].deps


def _member_order(inputs, op):
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    acc = inputs[0]
    for x in inputs[1:]:
        acc = ufunc(acc, x)
    return acc


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("n, inplace, instances", [(2, False, 1), (4, True, 2), (8, False, 1)])
def test_nvls_executes_bit_exact_in_member_order(dtype, op, n, inplace, instances):
    plan = _plan(NVLS, n, inplace=inplace, instances=instances)
    rng = np.random.default_rng(n * 31 + instances)
    count = plan.chunk_factor * 5 + 3                  # tail chunks of another length too
    inputs = [(rng.integers(1, 5, count) if dtype == np.int32 else rng.uniform(0.5, 2.0, count)).astype(dtype)
              for _ in range(n)]
    outputs = run_collective(plan, inputs, op)
    want = _member_order(inputs, op)
    for out in outputs:
        assert out.dtype == want.dtype and out.tobytes() == want.tobytes()


@pytest.mark.parametrize("n, g, inplace, instances", [(4, 2, False, 1), (8, 4, True, 2), (12, 4, False, 1)])
def test_nvls_tree_matches_the_sum(n, g, inplace, instances):
    plan = _plan(NVLS_TREE, n, inplace=inplace, instances=instances, gpus_per_node=g)
    verify_plan(plan)
    rng = np.random.default_rng(n)
    inputs = [rng.standard_normal(plan.chunk_factor * 3 + 1) for _ in range(n)]
    for out in run_collective(plan, inputs, "sum"):
        np.testing.assert_allclose(out, np.sum(inputs, axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, g, rings, inplace, instances",
                         [(4, 2, 2, False, 1), (8, 4, 2, True, 2), (12, 4, 1, False, 1), (16, 4, 3, True, 1)])
def test_nvls_ring_is_bit_exact_on_integers_and_sums_floats(n, g, rings, inplace, instances):
    """Integers: the exact sum, whatever order the rings add in; floats: the sum, to rounding."""
    plan = _plan(NVLS_RING, n, inplace=inplace, instances=instances, gpus_per_node=g, rings=rings)
    verify_plan(plan)
    rng = np.random.default_rng(n + rings)
    count = plan.chunk_factor * 3 + 1
    ints = [rng.integers(-1000, 1000, count).astype(np.int32) for _ in range(n)]
    want = np.sum(ints, axis=0, dtype=np.int32)
    for out in run_collective(plan, ints, "sum"):
        assert out.tobytes() == want.tobytes()
    floats = [rng.standard_normal(count) for _ in range(n)]
    for out in run_collective(plan, floats, "sum"):
        np.testing.assert_allclose(out, np.sum(floats, axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nodes, rings", [(2, 2), (3, 2), (4, 2), (4, 1), (5, 3)])
def test_nvls_ring_sends_each_nic_2_n_minus_1_over_n_of_its_shard_each_way(nodes, rings):
    """Across nodes only rank l of each node moves shard l (its NIC), and it
    sends and receives 2(N-1) of the shard's N * rings pieces per ring:
    2(N-1)/N of the shard each way, where a binary tree's inner node moves
    it three times; inside a node only the switch moves data."""
    g = 4
    program = msc.trace(NVLS_RING, nodes * g, gpus_per_node=g, rings=rings)
    sent, received = [0] * (nodes * g), [0] * (nodes * g)
    for op in program.ops:
        if op.kind in (msc.ir.OpKind.COPY, msc.ir.OpKind.REDUCE) and op.src_rank != op.dst_rank:
            assert op.src_rank // g != op.dst_rank // g and op.src_rank % g == op.dst_rank % g, op
            assert op.src_index // (rings * nodes) == op.src_rank % g, op       # shard l stays on local index l
            sent[op.src_rank] += op.size
            received[op.dst_rank] += op.size
    assert sent == received == [2 * (nodes - 1) * rings] * (nodes * g)


@pytest.mark.parametrize("n, g, instances", [(8, 4, 1), (8, 4, 2), (12, 4, 1)])
def test_nvls_ring_runs_with_2_slots_per_connection(n, g, instances):
    """Each ring on a channel of its own: with two nodes both rings join the same two ranks, and on one
    connection their steps would need 4 slots; the plan runs with 2 (the msccl runtimes' Simple)."""
    plan = _plan(NVLS_RING, n, instances=instances, gpus_per_node=g)
    assert verify_plan(plan, slots=2)
    ring_channels = {tb.channel for rp in plan.ranks for tb in rp.threadblocks if not tb.group}
    assert len(ring_channels) == 2 * instances, ring_channels        # rings=2 per instance


def test_nvls_ring_with_one_node_is_nvls_in_two_steps():
    """One node: no ring, the reduce-load and the multicast store on the two switch threadblocks."""
    plan = _plan(NVLS_RING, 4, gpus_per_node=4)
    verify_plan(plan)
    for rp in plan.ranks:
        assert [[s.op for s in tb.steps] for tb in rp.threadblocks] == [
            [StepOp.BARRIER, StepOp.SWRED, StepOp.BARRIER], [StepOp.BARRIER, StepOp.SWST, StepOp.BARRIER]]


TWO_GROUPS_BODY = """
    for group in (p.switch([0, 1]), p.switch([2, 3])):      # pairs, then across the pairs
        for i, r in enumerate(group.ranks):
            group.reduce(r, 'input', i).store('{out}', i)
    for group in (p.switch([0, 2]), p.switch([1, 3])):
        for i, r in enumerate(group.ranks):
            group.reduce(r, '{out}', i).store('{out}', i)
    """


@pytest.mark.parametrize("inplace", [False, True])
def test_a_rank_in_two_groups_is_ordered_through_both_groups_barriers(tmp_path, inplace):
    """A member m of groups F and G orders an op of F before one of G by passing F's barrier
    before arriving at G's: two rounds of barriers between the phases, in one order on every rank
    (no deadlock); a rank in one group keeps one barrier (the NVLS tests above)."""
    body = TWO_GROUPS_BODY.replace("{out}", "input" if inplace else "output")
    alg = _algorithm(tmp_path, body, chunk_factor="lambda n: 2")
    plan = _plan(alg, 4, inplace=inplace)
    verify_plan(plan)
    for rp in plan.ranks:
        switch = [tb for tb in rp.threadblocks if tb.group]
        assert len(switch) == 2
        for tb in switch:                                      # first, between the phases (two rounds), last
            assert [s.op for s in tb.steps].count(StepOp.BARRIER) == 4, (rp.rank, tb.steps)
    rng = np.random.default_rng(7)
    inputs = [rng.uniform(0.5, 2.0, 2 * 5 + 1) for _ in range(4)]
    for out in run_collective(plan, inputs, "sum"):
        np.testing.assert_allclose(out, np.sum(inputs, axis=0), rtol=1e-12)


def test_plan_text_round_trips_switch_groups_both_readers():
    plan = _plan(NVLS_TREE, 8, gpus_per_node=4, instances=2)
    text = dump_plan(plan)
    assert "group 0,1,2,3" in text and "swred" in text and "swst" in text and "barrier" in text
    assert parse_plan(text) == plan
    assert _parse_with_grammar(text, {}, None) == plan


# -- the plan's checks ---------------------------------------------------------------------------
def _hand(steps_of, groups=None, n=4) -> Plan:
    """An allreduce plan of one threadblock per rank with switch ``groups``."""
    groups = groups or {r: tuple(range(n)) for r in range(n)}
    ranks = tuple(RankPlan(r, 2, (Threadblock(0, None, None, 0, tuple(steps_of(r)), groups[r]),)) for r in range(n))
    return Plan("hand", "allreduce", n, n, False, n, n, ranks)


def _nvls_steps(r, before=True, after=True):
    bar = Step(StepOp.BARRIER, (), None, 1)
    swrs = Step(StepOp.SWRS, (Slice("input", r, 1),), Slice("output", r, 1), 1)
    return [bar] * before + [swrs] + [bar] * after


def test_the_hand_written_nvls_plan_verifies():
    verify_plan(_hand(_nvls_steps))


@pytest.mark.parametrize("groups, message", [
    ({0: (1, 2, 3), 1: (0, 1, 2, 3), 2: (0, 1, 2, 3), 3: (0, 1, 2, 3)}, "does not hold the threadblock's own rank 0"),
    ({0: (1, 0, 2, 3), 1: (0, 1, 2, 3), 2: (0, 1, 2, 3), 3: (0, 1, 2, 3)}, "increasing"),
    ({0: (0, 1, 2, 9), 1: (0, 1, 2, 3), 2: (0, 1, 2, 3), 3: (0, 1, 2, 3)}, "ranks of 0..3"),
])
def test_bad_groups_are_named(groups, message):
    with pytest.raises(PlanError, match=message) as exc:
        check_plan(_hand(_nvls_steps, groups))
    assert (exc.value.rank, exc.value.tb) == (0, 0)


def test_a_switch_step_needs_a_group_and_members_must_pass_as_many_barriers():
    plan = _hand(_nvls_steps)
    no_group = dataclasses.replace(plan, ranks=(RankPlan(0, 2, (dataclasses.replace(plan.ranks[0].threadblocks[0],
                                                                                     group=()),)),) + plan.ranks[1:])
    with pytest.raises(PlanError, match="switch op, but threadblock 0 has no switch group"):
        check_plan(no_group)
    with pytest.raises(PlanError, match="pass different numbers of barriers \\(rank 0: 1, rank 1: 2"):
        check_plan(_hand(lambda r: _nvls_steps(r, after=r != 0)))


def test_a_slice_beyond_a_members_scratch_is_named():
    plan = _hand(lambda r: [Step(StepOp.SWST, (Slice("input", r, 1),), Slice("scratch", 1, 1), 1)])
    small = dataclasses.replace(plan, ranks=plan.ranks[:2] + (dataclasses.replace(plan.ranks[2], scratch=1),)
                                + plan.ranks[3:])
    with pytest.raises(PlanError, match="rank 2's scratch has 1 chunks"):
        check_plan(small)


# -- the verifier -----------------------------------------------------------------------------------
@pytest.mark.parametrize("before, after, when", [(False, True, "started"), (True, False, "returned")])
def test_a_missing_call_barrier_is_a_race(before, after, when):
    with pytest.raises(RaceError, match=f"through the switch.*call may not have {when}") as exc:
        verify_plan(_hand(lambda r: _nvls_steps(r, before, after)))
    assert exc.value.buffer == "input"


def test_two_ranks_multicasting_into_one_chunk_unordered_race():
    def steps(r):
        bar = Step(StepOp.BARRIER, (), None, 1)
        both = Step(StepOp.SWST, (Slice("input", r, 1),), Slice("output", 0, 1), 1)
        rest = Step(StepOp.SWRS, (Slice("input", r, 1),), Slice("output", r, 1), 1) if r else None
        return [bar, both] + ([rest] if rest else []) + [bar]
    with pytest.raises(RaceError, match="race on rank \\d output\\[0\\].*writes it.*writes it"):
        verify_plan(_hand(steps))


BAR = Step(StepOp.BARRIER, (), None, 1)
SCRATCH = Slice("scratch", 0, 1)


@pytest.mark.parametrize("case", ["switch read, member writes", "switch write, member reads",
                                  "switch read, switch write"])
def test_a_switch_read_unordered_with_a_write_races(case):
    """One side only reads: rank 0 reaches every member's scratch[0] through
    the switch while rank 1 (or, last case, rank 1 through the switch) does
    the other half of a read-write pair there, with no barrier between."""
    reads = Step(StepOp.SWRS, (SCRATCH,), Slice("output", 0, 1), 1)         # reads scratch[0] on every member
    writes = Step(StepOp.SWST, (Slice("input", 0, 1),), SCRATCH, 1)          # writes it on every member
    local_write = Step(StepOp.COPY, (Slice("input", 1, 1),), SCRATCH, 1)
    local_read = Step(StepOp.COPY, (SCRATCH,), Slice("output", 1, 1), 1)
    first, second = {"switch read, member writes": (reads, local_write),
                     "switch write, member reads": (writes, local_read),
                     "switch read, switch write": (reads, writes)}[case]

    def steps(r):
        return [BAR] + ([first] if r == 0 else [second] if r == 1 else []) + [BAR]
    with pytest.raises(RaceError, match=r"race on rank 1 scratch\[0\]: rank [01] threadblock 0 step 1 \(\w+\) "
                                        r"(reads|writes) it.* and rank [01] threadblock 0 step 1 .*(reads|writes) it") as exc:
        verify_plan(_hand(steps))
    assert "reads it" in str(exc.value) and "writes it" in str(exc.value)


def test_barriers_waiting_on_each_other_across_channels_deadlock():
    """Rank 0 passes channel 1's barrier before channel 0's, rank 1 the other way round."""
    g = (0, 1)
    bar = Step(StepOp.BARRIER, (), None, 1)
    first = [Threadblock(0, None, None, 0, (bar,), g), Threadblock(1, None, None, 1, (Step(StepOp.BARRIER, (), None, 1,
                                                                                            ((0, 0),)),), g)]
    second = [Threadblock(0, None, None, 0, (Step(StepOp.BARRIER, (), None, 1, ((1, 0),)),), g),
              Threadblock(1, None, None, 1, (bar,), g)]
    plan = Plan("cross", "allreduce", 2, 2, False, 2, 2,
                (RankPlan(0, 0, tuple(first)), RankPlan(1, 0, tuple(second))))
    with pytest.raises(DeadlockError, match="waits at barrier 0 of switch group 0,1"):
        verify_plan(plan, check_races=False)


# -- what does not run them (yet), by name ---------------------------------------------------------------
def test_backends_without_switch_ops_refuse_by_name(tmp_path):
    from msc.formats.xml_export import plan_to_xml

    plan = _plan(NVLS, 4)       # the CUDA runtime runs it: tests/test_switch_runtime.py
    with pytest.raises(PlanError, match="MSCCL-IR has no step type"):
        plan_to_xml(plan)
    with pytest.raises(UsageError, match="msccl runtime"):
        lower(msc.trace(NVLS, 4), LowerOptions(runtime="msccl"))
    with pytest.raises(UsageError, match="Simple protocol only, not LL"):
        lower(msc.trace(NVLS, 4), LowerOptions(protocol="LL"))


@pytest.mark.parametrize("key, n, params, inplace, instances", [
    ("allreduce/nvls:nvls", 2, {}, True, 1), ("allreduce/nvls:nvls", 4, {}, False, 2),
    ("allreduce/nvls:nvls", 8, {}, True, 1), ("allreduce/nvls_tree:nvls_tree", 8, {"gpus_per_node": 4}, True, 2),
    ("allreduce/nvls_tree:nvls_tree", 12, {"gpus_per_node": 4}, False, 1),
    ("allreduce/nvls_ring:nvls_ring", 8, {"gpus_per_node": 4}, True, 2),
    ("allreduce/nvls_ring:nvls_ring", 12, {"gpus_per_node": 4, "rings": 1}, False, 1)])
def test_switch_ops_as_messages_verify_and_compute_the_same_bits(key, n, params, inplace, instances):
    """The expansion the torch executor runs (msc.lower.switch_expand):
    no switch left, verified (races, deadlock at 1 slot, results), and the
    reference executor gives the very same bytes as on the original."""
    from msc.lower.switch_expand import expand_switch_ops

    plan = _plan(algorithms()[key], n, inplace=inplace, instances=instances, **params)
    expanded = expand_switch_ops(plan)
    assert expanded.first_switch_step() is None and not any(tb.group for rp in expanded.ranks for tb in rp.threadblocks)
    verify_plan(expanded)
    rng = np.random.default_rng(n + instances)
    inputs = [rng.uniform(-1, 1, plan.chunk_factor * 4 + 3).astype(np.float32) for _ in range(n)]
    for op in ("sum", "max"):
        for a, b in zip(run_collective(plan, inputs, op), run_collective(expanded, inputs, op)):
            assert a.tobytes() == b.tobytes()


# -- the simulator ----------------------------------------------------------------------------------
def test_simulated_nvls_beats_the_ring_on_dgx_h100_and_needs_a_switch():
    from msc.sim.presets import get_topology
    from msc.sim.simulate import Simulator

    ring = lower(msc.trace(algorithms()["allreduce/ring:ring"], 8), LowerOptions(instances=16))
    nvls = _plan(NVLS, 8, instances=16)
    topo = get_topology("dgx-h100", 8)
    [r], [v] = Simulator(ring, topo).records([1 << 30]), Simulator(nvls, topo).records([1 << 30])
    assert v["busbw"] > 1.2 * r["busbw"] and 440 < v["busbw"] < 500     # Azure's 466 GB/s at 1 GiB, NCCL's NVLS
    with pytest.raises(UsageError, match="has no switch that does"):
        Simulator(nvls, get_topology("ring:8", 8))
    with pytest.raises(UsageError, match="spans more than one NVSwitch domain"):
        Simulator(_plan(NVLS, 16), get_topology("dgx-h100:2", 16))


@pytest.mark.parametrize("make", [
    lambda: _plan(NVLS_TREE, 8, gpus_per_node=4),
    lambda: _plan(NVLS_TREE, 12, instances=2, gpus_per_node=4),
    lambda: _plan(NVLS_RING, 16, gpus_per_node=4, rings=3),
    lambda: _hand(lambda r: _nvls_steps(r, True, False)),
    lambda: _hand(lambda r: _nvls_steps(r, False, True)),
    lambda: _hand(lambda r: _nvls_steps(r, r % 2 == 0, r % 2 == 1)),
])
def test_the_rank_masks_of_the_switch_check_agree_with_the_graph_search(make):
    """The call-bounds check reads per-step rank masks (one pass over the
    happens-before order); the graph search it replaced, per (step, rank), is
    the definition: both must answer alike for every step and rank."""
    from msc.verification.plan import _Execution, plan_collective
    plan = make()
    run = _Execution(plan, plan_collective(plan).layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root),
                     plan.slots)
    assert run.static_order()
    before, after = run._rank_reach()
    answers = set()
    for g in range(run.total_steps):
        for m in range(plan.num_ranks):
            for forward, masks in ((False, before), (True, after)):
                got = bool((masks[g] >> m) & 1)
                assert got == run._meets_rank(g, m, forward), (g, m, forward)
                answers.add(got)
    assert answers == {True, False}
