"""Bulk lowering (msc/lower/bulk.py) builds the plans the pass-by-pass pipeline
builds: compared as plan text over the library and on random programs of
multi-chunk transfers, where it applies, and it declines (None) where it
does not."""
from __future__ import annotations

import random
from collections import Counter

import pytest

import msc
from msc.lower.dag import allocate_scratch, replicate
from msc.errors import MscError
from msc.errors import SourceLine
from msc.ir import Op, OpKind, StepOp
from msc.ir.columns import OpColumns
from msc.lower.bulk_trace import allocate_scratch_columns, replicate_columns
from msc.lower.pipeline import LowerOptions, _pipeline_plans, lower
from msc.formats.plan_text import dump_plan
from msc.lower.bulk import bulk_plans, fits
from library import algorithms

OPTIONS = (LowerOptions(), LowerOptions(instances=2), LowerOptions(instances=3, protocol="LL", tile=4096))
RANKS = (1, 2, 3, 4, 5, 8, 9, 16)


def _between_ranks(ops) -> bool:
    return bool(ops) and all(op.src_rank != op.dst_rank for op in ops)


def _cases(ranks=RANKS, keys=None):
    """(name, program, options, ops, scratch, fields) for every library
    program in bulk's scope (a program of transfers between ranks)."""
    for key, alg in algorithms(switch=False).items():
        if keys is not None and key not in keys:
            continue
        for n in ranks:
            for inplace in (True, False):
                try:
                    program = msc.trace(alg, n, inplace=inplace)
                except MscError:
                    continue                 # a rank count or placement the algorithm does not take
                for options in OPTIONS:
                    layout = program.layout
                    ops, sizes = replicate(program.ops, options.instances, program.scratch_sizes)
                    ops, scratch = allocate_scratch(ops, set(layout.physical_sizes), sizes, n)
                    if not _between_ranks(ops):
                        continue
                    k = options.instances
                    fields = dict(name=program.name, collective=layout.name, chunk_factor=layout.chunk_factor * k,
                                  inplace=layout.inplace, input_chunks=layout.logical_sizes["input"] * k,
                                  output_chunks=layout.logical_sizes["output"] * k, root=layout.root,
                                  protocol=options.protocol, instances=k, slots=1, tile=options.tile)
                    yield f"{key} n={n} inplace={inplace} {options}", program, options, ops, scratch, fields


def _text_or_error(fn):
    try:
        return dump_plan(fn())
    except MscError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.slow          # 7-14 s: CI's slow run; the default run stays short
def test_bulk_lowering_gives_the_pipelines_plans_on_the_library():
    seen, taken, multi = Counter(), 0, set()
    for name, program, options, *_ in _cases():
        pipeline = _text_or_error(lambda: lower(program, options, bulk=False))
        assert _text_or_error(lambda: lower(program, options)) == pipeline, name
        seen[name.split(" ")[0]] += 1
        taken += 1
        if options.instances == 1 and any(op.size > 1 for op in program.ops):
            multi.add(name.split(" ")[0])            # steps of several chunks (instances split them)
    # the comparison covers most of the library, not a handful of programs
    assert taken > 250 and len(seen) >= 14, seen
    assert {"allreduce/hierarchical:hierarchical", "allreduce/halving_doubling:halving_doubling"} <= multi, multi


@pytest.mark.parametrize("priority", ["depth", "trace"])
def test_each_step_order_is_the_pipelines(priority):
    """Both priorities, each on its own: lowering tries the trace order only
    where the depth order deadlocks, which no library program does."""
    built = declined = cross_threadblock = 0
    for name, _, options, ops, scratch, fields in _cases(ranks=(2, 3, 4, 8)):
        [(_, plan)] = bulk_plans(ops, scratch, fields_ranks(fields, ops), (priority,), fields)
        if plan is None:
            declined += 1
            continue
        [(_, expected)] = _pipeline_plans(ops, scratch, fields_ranks(fields, ops), options, fields, (priority,))
        assert dump_plan(plan) == dump_plan(expected), name
        built += 1
        cross_threadblock += any(step.deps for _, _, _, step in plan.steps())
    assert built > 100 and cross_threadblock > 10, (built, cross_threadblock)
    if priority == "depth":
        assert declined > 0       # some programs need the pipeline's heap (a receive waits behind a message)


@pytest.mark.parametrize("n", [16, 64])
def test_equal_steps_that_wait_are_one_object(n):
    """Steps that wait on other threadblocks are shared where equal, as the
    others are (the writer and plan_arrays read each distinct object once),
    and the plan is still the pipeline's."""
    program = msc.trace(algorithms(switch=False)["allreduce/hierarchical:hierarchical"], n)
    plan = lower(program)
    waiting = [step for _, _, _, step in plan.steps() if step.deps]
    assert len(waiting) > 2 * len(set(waiting)), (len(waiting), len(set(waiting)))    # they do repeat
    assert len({id(step) for step in waiting}) == len(set(waiting))
    assert dump_plan(plan) == dump_plan(lower(program, bulk=False))


def test_the_second_order_is_built_again_as_if_alone():
    """bulk_plans frees each plan's arrays before yielding it, and a second
    order asked for after the first plan computes them again: the same plans
    as each order lowered on its own."""
    compared = 0
    for name, _, _, ops, scratch, fields in _cases(ranks=(3, 8)):
        n = fields_ranks(fields, ops)
        both = list(bulk_plans(ops, scratch, n, ("depth", "trace"), fields))
        if both[0][1] is None:
            continue
        alone = [bulk_plans(ops, scratch, n, (p,), fields) for p in ("depth", "trace")]
        def text(plan):
            return None if plan is None else dump_plan(plan)

        assert [(p, text(plan)) for p, plan in both] == [(p, text(plan)) for [(p, plan)] in alone], name
        compared += both[1][1] is not None
    assert compared > 20


def fields_ranks(fields, ops) -> int:
    return 1 + max(max(op.src_rank, op.dst_rank) for op in ops)


def test_spread_channels_past_32_peers():
    keys = {"allgather/allpairs:allpairs", "alltoall/allpairs:allpairs", "reducescatter/allpairs:allpairs"}
    compared = 0
    for name, program, options, *_ in _cases(ranks=(34,), keys=keys):
        if options.instances > 1:
            continue
        plan = lower(program, options)
        assert max(tb.channel for _, tb, _, _ in plan.steps()) > 0, name
        assert dump_plan(plan) == dump_plan(lower(program, options, bulk=False)), name
        compared += 1
    assert compared >= 2


def test_bulk_declines_what_it_does_not_cover():
    [ring] = [a for key, a in algorithms(switch=False).items() if key == "allreduce/ring:ring"]
    program = msc.trace(ring, 4, inplace=False)         # out of place: local copies input -> output
    assert any(op.src_rank == op.dst_rank for op in program.ops)
    ops, scratch = allocate_scratch(list(program.ops), {"input", "output"}, {}, 4)
    fields = dict(name="ring", collective="allreduce", chunk_factor=4, inplace=False, input_chunks=4,
                  output_chunks=4, root=0, protocol="Simple", instances=1, slots=1, tile=0)
    assert list(bulk_plans(ops, scratch, 4, ("depth", "trace"), fields)) == [("depth", None)]
    local = [op for op in program.ops if op.src_rank == op.dst_rank][:1]
    wide = [op._replace(size=2) for op in msc.trace(ring, 4).ops if op.kind is OpKind.COPY]
    [(_, plan)] = bulk_plans(wide, [0] * 4, 4, ("depth",), fields)       # multi-chunk transfers: taken
    assert plan is not None and {step.count for _, _, _, step in plan.steps()} == {2}
    assert list(bulk_plans(wide + local, [0] * 4, 4, ("depth",), fields)) == [("depth", None)]   # one local op
    assert list(bulk_plans([], [0] * 4, 4, ("depth",), fields)) == [("depth", None)]
    far = [op._replace(dst_index=op.dst_index + 2 ** 40) for op in msc.trace(ring, 4).ops]   # keys past int64
    assert list(bulk_plans(far, [0] * 4, 4, ("depth",), fields)) == [("depth", None)]
    assert not fits(LowerOptions(threadblocks="manual")) and not fits(LowerOptions(fuse=False))
    assert fits(LowerOptions(instances=4, protocol="LL"))


ANY = msc.CustomCollective("anything", input_chunks=lambda n, k: 4 * k, output_chunks=lambda n, k: 4 * k,
                           postcondition=lambda r, i, n, k: None)


@msc.algorithm(ANY, chunk_factor=1, inplace=False)
def relays_through_scratch(p, channels=1):
    """Every rank relays its left neighbour's chunks to the right through
    scratch t[5], t[2] and t[7] (declared t[0..7]: five never touched); t[2]
    is overwritten before it is read, and t[7] holds a partial sum that is
    forwarded and never read again (a dead store: rrs)."""
    n = p.num_ranks
    for r in range(n):
        mid, right = (r + 1) % n, (r + 2) % n
        ch = r % channels
        p.chunk(r, "input", 0).copy(mid, "t", 5, channel=ch).copy(right, "output", 0, channel=ch)
        p.chunk(r, "input", 1).copy(mid, "t", 2, channel=ch)
        p.chunk(right, "input", 2).copy(mid, "t", 2, channel=ch)       # overwrites t[2]: the first store is dead
        p.chunk(mid, "t", 2).copy(right, "output", 1 + (r % 2), channel=ch)
        p.chunk(r, "input", 3).copy(mid, "t", 7).reduce(p.chunk(right, "input", 3))
        p.chunk(mid, "t", 7).copy(right, "output", 3)


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("channels", [1, 2])
def test_scratch_relays_compact_the_same(n, channels):
    program = msc.trace(relays_through_scratch, n, channels=channels)
    assert _between_ranks(program.ops) and all(op.size == 1 for op in program.ops)
    for options in OPTIONS:
        plan = lower(program, options)
        assert plan.scratch_chunks == 3 * options.instances               # compacted from 8
        assert any(step.op is StepOp.RRS for _, _, _, step in plan.steps())
        assert dump_plan(plan) == dump_plan(lower(program, options, bulk=False)), options


def _same_columns(a, b, what) -> None:
    for name in ("count", "names"):
        assert getattr(a, name) == getattr(b, name), f"{what}: {name}"
    for name in ("srank", "sidx", "drank", "didx", "size", "sbuf", "dbuf", "kind", "reduce", "channel"):
        assert (getattr(a, name) == getattr(b, name)).all(), f"{what}: {name}"
    assert [a.lines[i] for i in a.line_id.tolist()] == [b.lines[i] for i in b.line_id.tolist()], f"{what}: lines"


def test_a_traces_table_gives_the_ops_and_columns_of_its_op_tuples():
    """A program records rows (msc.ir.trace); its Op tuples, its columns and
    the Op tuples rebuilt from its columns (the rows dropped) must agree."""
    checked = 0
    for key, alg in algorithms().items():
        for n in (3, 4, 8):
            for inplace in (True, False):
                try:
                    program = msc.trace(alg, n, inplace=inplace)
                except MscError:
                    continue
                ops = program.ops
                assert isinstance(ops, tuple) and all(type(op) is Op for op in ops)
                from_rows = program.columns()
                _same_columns(from_rows, OpColumns(ops), f"{key} n={n}")
                again = msc.trace(alg, n, inplace=inplace)
                again.columns()                      # sealed: read once, the rows dropped
                assert again.ops == ops and again.num_ops == len(ops) and again.chunk_ops() == program.chunk_ops()
                checked += 1
    assert checked > 120


def test_replicate_and_allocate_scratch_in_bulk_are_the_op_passes():
    """msc.lower.bulk_trace against msc.lower.dag's replicate and
    allocate_scratch: the same columns and scratch, over the library."""
    checked = Counter()
    for key, alg in algorithms(switch=False).items():
        for n in (3, 4, 8):
            try:
                program = msc.trace(alg, n)
            except MscError:
                continue
            physical = set(program.layout.physical_sizes)
            for k in (1, 2, 3):
                ops, sizes = replicate(program.ops, k, program.scratch_sizes)
                ops, scratch = allocate_scratch(ops, physical, sizes, n)
                c, bulk_sizes = replicate_columns(program.columns(), k, program.scratch_sizes)
                assert bulk_sizes == sizes, key
                c, bulk_scratch = allocate_scratch_columns(c, physical, bulk_sizes, n)
                assert bulk_scratch == scratch, f"{key} n={n} x{k}"
                _same_columns(c, OpColumns(ops), f"{key} n={n} x{k}")
                checked[bool(program.scratch_sizes)] += 1
    assert checked[True] > 20 and checked[False] > 100, checked


def _random_transfers(rng: random.Random, n: int) -> list[Op]:
    """Copies and reduces of 1 to 4 chunks between ranks over input, output
    and scratch, overlapping at random (reads of never-written chunks
    included: lowering does not verify), on one or two channels."""
    lines = [SourceLine("alg.py", k) for k in range(1, 4)]
    ops = []
    for _ in range(rng.randint(1, 24)):
        src, dst = rng.sample(range(n), 2)
        size = rng.choice((1, 1, 2, 3, 4))
        sbuf, dbuf = rng.choice(("input", "output", "scratch")), rng.choice(("output", "scratch"))
        sidx = rng.randrange(8 - size + 1)
        if ops and rng.random() < 0.5:      # forward what the last op wrote: all of it (fusable), or a part
            last = ops[-1]
            src, sbuf, sidx, size = last.dst_rank, last.dst_buffer, last.dst_index, last.size
            if rng.random() < 0.25 and size > 1:
                size -= 1
            dst = rng.choice([r for r in range(n) if r != src])
        ops.append(Op(rng.choice((OpKind.COPY, OpKind.REDUCE)), src, sbuf, sidx, dst, dbuf,
                      rng.randrange(8 - size + 1), size, rng.choice((None, None, 1)), None, None, rng.choice(lines),
                      ()))
    return ops


@pytest.mark.parametrize("priority", ["depth", "trace"])
def test_random_multi_chunk_programs_lower_as_the_pipeline_does(priority):
    """Random transfers of several chunks: whatever bulk lowering builds is
    the pipeline's plan, text for text; where it leaves the order to the
    pipeline, it says so (None)."""
    rng = random.Random(38)
    built = multi = fused = 0
    for case in range(300):
        n = rng.randint(2, 5)
        ops = _random_transfers(rng, n)
        # scratch as allocate_scratch gives it: eight chunks on each rank that names any
        scratch = [8 if any((op.src_rank, op.src_buffer) == (r, "scratch") or (op.dst_rank, op.dst_buffer) ==
                            (r, "scratch") for op in ops) else 0 for r in range(n)]
        fields = dict(name="random", collective="anything", chunk_factor=1, inplace=False, input_chunks=8,
                      output_chunks=8, root=0, protocol="Simple", instances=1, slots=1, tile=0)
        [(_, plan)] = bulk_plans(ops, scratch, n, (priority,), fields)
        if plan is None:
            continue
        [(_, expected)] = _pipeline_plans(ops, scratch, n, LowerOptions(), fields, (priority,))
        assert dump_plan(plan) == dump_plan(expected), (case, ops)
        built += 1
        steps = [step for _, _, _, step in plan.steps()]
        multi += any(step.count > 1 for step in steps)
        fused += any(step.op in (StepOp.RCS, StepOp.RRCS, StepOp.RRS) and step.count > 1 for step in steps)
    assert built > 150 and multi > 100 and fused > 10, (built, multi, fused)
