"""The reference executor runs every library plan to the numbers msc.verification.reference
computes directly; its errors; the reference itself; and msc run's sweep."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import msc
from msc.verification import reference
from msc.cli import run as runner
from msc.errors import PlanError, UsageError
from msc.executor import (ExecutionError, Executor, chunk_bounds, load_inputs, poison, read_outputs,
                          run_collective, run_plan)
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.lower.pipeline import LowerOptions, lower
from library import rotated

LIBRARY = Path(__file__).resolve().parent.parent / "algorithms"
ALL_DTYPES = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.uint8)
ALGORITHMS = {f"{path.relative_to(LIBRARY).with_suffix('').as_posix()}:{alg.name}": alg
              for path in sorted(LIBRARY.rglob("*.py")) for alg in msc.load_algorithms(path)}


@cache
def plan_for(key: str, n: int, inplace: bool, instances: int = 1, root: int = 0) -> Plan:
    alg = ALGORITHMS[key]
    params = {"root": root} if alg.collective.has_root else {}
    program = msc.trace(alg, n, inplace=inplace, **params)
    msc.verify(program)
    return lower(program, LowerOptions(protocol="Simple", instances=instances))


def inputs_for(plan: Plan, dtype, op: str, count: int, seed: int = 0) -> list[np.ndarray]:
    length = plan.input_chunks // plan.chunk_factor * count
    return reference.random_inputs(np.random.default_rng(seed), np.dtype(dtype), op, plan.num_ranks, length)


def assert_runs_right(plan: Plan, dtype, op: str, count: int, seed: int = 0) -> None:
    inputs = inputs_for(plan, dtype, op, count, seed)
    assert all(np.all(x != 0) for x in inputs)
    outputs = run_collective(plan, inputs, op)
    wrong = reference.check(plan.collective, inputs, outputs, op=op, root=plan.root)
    assert wrong == [0] * plan.num_ranks, (plan.name, np.dtype(dtype).name, op, count, wrong)


def counts(k: int) -> list[int]:
    """0, 1, around k, a prime, and a count not divisible by k (when k > 1)."""
    return sorted({0, 1, k - 1, k, k + 1, 1009, 3 * k + k // 2 + 1})


CASES = [(key, n, inplace, inst, root)
         for key, alg in ALGORITHMS.items() for n in (2, 3, 4, 8) if alg.supports(n)
         for inplace in (True, False) for inst in (1, 2)
         for root in ((0, n - 1) if alg.collective.has_root else (0,))]


# every third case of each algorithm by default (tests/library.py rotated), the rest under -m slow
@pytest.mark.parametrize("key,n,inplace,instances,root", list(rotated(
    CASES, lambda c: f"{c[0]}-n{c[1]}-{'in' if c[2] else 'out'}-i{c[3]}-r{c[4]}")))
def test_library_plan_matches_reference(key, n, inplace, instances, root):
    plan = plan_for(key, n, inplace, instances, root)
    k = plan.chunk_factor
    for i, count in enumerate(counts(k)):
        for dtype, op in ((np.float32, "sum"), (ml_dtypes.bfloat16, "sum"), (np.int32, "max")):
            assert_runs_right(plan, dtype, op, count, seed=i)
    # the other ops and dtypes, at counts no chunk factor divides
    for count in (k + 1, 1009):
        for dtype, op in ((np.int32, "prod"), (np.float32, "min"), (np.int64, "avg"), (np.float16, "avg"),
                          (np.uint8, "sum"), (np.float64, "prod")):
            assert_runs_right(plan, dtype, op, count)


@pytest.mark.parametrize("n,inplace", [(3, True), (4, False), (8, True)])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_ring_allreduce_every_dtype_and_op(dtype, n, inplace):
    plan = plan_for("allreduce/ring:ring", n, inplace)
    for op in reference.OPS:
        for count in (0, 1, n + 1, 1009):
            assert_runs_right(plan, dtype, op, count)


def test_large_count():
    assert_runs_right(plan_for("allreduce/ring:ring", 8, False, 2), np.float32, "sum", 100_003)


def test_results_do_not_depend_on_schedule_or_slots():
    """A Kahn network: any pick order and any capacity >= the plan's give
    the same bits (each chunk's reduction order is fixed by the plan)."""
    for key, n in (("allreduce/tree:double_binary", 8), ("allreduce/halving_doubling:halving_doubling", 8),
                   ("alltoall/hierarchical:hierarchical", 8), ("reducescatter/ring:ring", 4)):
        plan = plan_for(key, n, False)
        inputs = inputs_for(plan, np.float32, "sum", 1009)
        base = run_collective(plan, inputs)
        ex = Executor(plan, slots=8)
        for seed in range(3):
            buffers, count = load_inputs(ex, inputs)
            ex.run(buffers, count=count, seed=seed)
            for a, b in zip(read_outputs(ex, buffers, count), base):
                assert a.tobytes() == b.tobytes(), (key, seed)


# -- layouts ------------------------------------------------------------------------------------------

def test_inplace_allgather_input_lives_at_unit_rank():
    n, count = 3, 5
    plan = plan_for("allgather/ring:ring", n, True)
    ex = Executor(plan)
    assert ex.buffer_sizes(count) == {"output": n * count}
    data = [np.arange(count, dtype=np.int32) + 100 * (r + 1) for r in range(n)]
    buffers = [{"output": np.full(n * count, -1, np.int32)} for _ in range(n)]
    for r in range(n):
        buffers[r]["output"][r * count:(r + 1) * count] = data[r]
    run_plan(plan, buffers, count=count)
    for r in range(n):
        assert buffers[r]["output"].tolist() == np.concatenate(data).tolist()
    # the same data at unit 0 of every rank is not what the plan reads
    wrong = [{"output": np.full(n * count, -1, np.int32)} for _ in range(n)]
    for r in range(n):
        wrong[r]["output"][:count] = data[r]
    run_plan(plan, wrong, count=count)
    assert wrong[1]["output"].tolist() != np.concatenate(data).tolist()


def test_inplace_reducescatter_output_is_unit_rank_of_input():
    n, count = 4, 3
    plan = plan_for("reducescatter/ring:ring", n, True)
    ex = Executor(plan)
    assert ex.buffer_sizes(count) == {"input": n * count}
    data = [np.arange(n * count, dtype=np.int64) * (r + 1) for r in range(n)]
    buffers = [{"input": d.copy()} for d in data]
    ex.run(buffers, count=count)
    total = sum(data)
    for r in range(n):
        assert buffers[r]["input"][r * count:(r + 1) * count].tolist() == total[r * count:(r + 1) * count].tolist()


def test_chunk_geometry():
    # E = 5, k = 4: q = 2, classes hold 2, 2, 1, 0 elements; unit 1 starts at 5
    assert [chunk_bounds(p, 5, 4) for p in range(8)] == [(0, 2), (2, 4), (4, 5), (5, 5),
                                                         (5, 7), (7, 9), (9, 10), (10, 10)]
    assert chunk_bounds(3, 0, 4) == (0, 0)


def test_one_rank_plan_by_hand_and_unwritten_scratch():
    def plan(src: Slice) -> Plan:
        step = Step(StepOp.COPY, (src,), Slice("output", 0, 1), 1)
        return Plan("copy", "allreduce", 1, 1, False, 1, 1,
                    (RankPlan(0, 1, (Threadblock(0, None, None, 0, (step,)),)),))

    assert [x.tolist() for x in run_collective(plan(Slice("input", 0, 1)), [np.array([1.5, 2.5])])] == [[1.5, 2.5]]
    with pytest.raises(ExecutionError, match=r"rank 0 threadblock 0 step 0 \(copy\): reads scratch\[0\]"):
        run_collective(plan(Slice("scratch", 0, 1)), [np.array([1.5, 2.5])])


# -- errors -------------------------------------------------------------------------------------------

def test_rejects_bad_buffers_with_clear_errors():
    plan = plan_for("allreduce/ring:ring", 2, False)
    ex = Executor(plan)

    def bufs(dtype=np.float32, size=6):
        return [{"input": np.ones(size, dtype), "output": np.ones(size, dtype)} for _ in range(2)]

    ex.run(bufs(), count=6)
    for dtype in (np.int16, np.complex64, np.float128 if hasattr(np, "float128") else np.int8):
        with pytest.raises(UsageError, match="unsupported dtype"):
            ex.run(bufs(dtype), count=6)
    with pytest.raises(UsageError, match=r"rank 0 input: 5 elements, the plan needs 6"):
        ex.run(bufs(size=5), count=6)
    mixed = bufs()
    mixed[1]["output"] = np.ones(6, np.float64)
    with pytest.raises(UsageError, match="rank 1 output: dtype float64"):
        ex.run(mixed, count=6)
    with pytest.raises(UsageError, match="physical buffers"):
        ex.run([{"input": np.ones(6, np.float32)}] * 2, count=6)
    with pytest.raises(UsageError, match="1-D"):
        ex.run([{"input": np.ones((2, 3), np.float32), "output": np.ones(6, np.float32)}] * 2, count=6)
    with pytest.raises(UsageError, match="reduction op"):
        ex.run(bufs(), count=6, op="xor")
    with pytest.raises(UsageError, match="count"):
        ex.run(bufs(), count=-1)
    with pytest.raises(UsageError, match="2 ranks"):
        ex.run(bufs()[:1], count=6)
    with pytest.raises(UsageError, match="input of 5 elements"):
        run_collective(plan, [np.ones(6, np.float32), np.ones(5, np.float32)])


def _corrupt(plan: Plan, pick) -> tuple[Plan, tuple]:
    """The plan with the first step ``pick(step)`` accepts replaced by what it returns."""
    for rp in plan.ranks:
        for tb in rp.threadblocks:
            for s, step in enumerate(tb.steps):
                new = pick(step)
                if new is not None:
                    steps = tb.steps[:s] + (new,) + tb.steps[s + 1:]
                    tbs = tuple(replace(t, steps=steps) if t.id == tb.id else t for t in rp.threadblocks)
                    ranks = tuple(replace(r, threadblocks=tbs) if r.rank == rp.rank else r for r in plan.ranks)
                    return replace(plan, ranks=ranks), (rp.rank, tb.id, s)
    raise AssertionError("nothing to corrupt")


def _other_class(sl: Slice, k: int) -> Slice:
    return replace(sl, index=sl.index - sl.index % k + (sl.index + 1) % k)


def test_length_mismatch_names_rank_threadblock_step():
    plan = plan_for("allreduce/ring:ring", 4, False)           # k = 4
    k = plan.chunk_factor
    bad, (r, t, s) = _corrupt(plan, lambda st: replace(st, srcs=(_other_class(st.srcs[0], k),))
                              if st.op is StepOp.RRS and st.srcs[0].index % k == 1 else None)
    inputs = inputs_for(plan, np.float32, "sum", 5)              # classes of 2, 2, 1, 0 elements
    with pytest.raises(ExecutionError, match=f"rank {r} threadblock {t} step {s} \\(rrs\\): reduces chunks of 1 "
                                             f"and 2 elements") as info:
        run_collective(bad, inputs)
    assert (info.value.rank, info.value.tb, info.value.step) == (r, t, s)
    assert isinstance(info.value, msc.MscError)
    # a receive written into a chunk of another class
    bad, (r, t, s) = _corrupt(plan, lambda st: replace(st, dst=_other_class(st.dst, k))
                              if st.op is StepOp.RECV and st.dst.index % k == 1 else None)
    with pytest.raises(ExecutionError, match=f"rank {r} threadblock {t} step {s} \\(recv\\): writes a chunk"):
        run_collective(bad, inputs)


def test_too_few_slots_is_stuck_not_silent():
    plan = plan_for("allgather/ring:ring", 3, False)
    assert plan.slots == 2
    ex = Executor(plan, slots=1)
    buffers, count = load_inputs(ex, inputs_for(plan, np.int32, "sum", 4))
    with pytest.raises(ExecutionError, match="stuck with 1 slot"):
        ex.run(buffers, count=count)


# -- avg ----------------------------------------------------------------------------------------------

def test_avg_truncates_integers_toward_zero_and_only_divides_reductions():
    plan = plan_for("allreduce/ring:ring", 3, False)
    ins = [np.array([-1, 1, 7, -7, 2], np.int32), np.array([-1, 1, 0, 0, 2], np.int32),
           np.array([-2, 3, 0, 0, 3], np.int32)]
    out = run_collective(plan, ins, "avg")
    assert out[0].tolist() == [-1, 1, 2, -2, 2]            # -4/3, 5/3, 7/3, -7/3, 7/3
    floats = run_collective(plan, [x.astype(np.float64) for x in ins], "avg")
    assert np.allclose(floats[2], sum(x.astype(np.float64) for x in ins) / 3, rtol=0, atol=1e-15)
    gather = plan_for("allgather/ring:ring", 3, False)
    assert run_collective(gather, ins, "avg")[1].tolist() == np.concatenate(ins).tolist()
    red = plan_for("reduce/ring:ring", 3, False, root=2)
    out = run_collective(red, [x.astype(np.float32) for x in ins], "avg")
    assert np.allclose(out[2], sum(x.astype(np.float32) for x in ins) / 3)


def test_custom_collective_runs_and_avg_divides_by_its_contributions():
    allsum = msc.CustomCollective("allsum", input_chunks=1, output_chunks=1,
                                  postcondition=lambda r, i, n, k: [(j, 0) for j in range(n)])

    @msc.algorithm(allsum, chunk_factor=1, inplace=False)
    def gather_then_spread(p):
        p.chunk(0, "input", 0).copy(0, "output", 0)
        for r in range(1, p.num_ranks):
            p.chunk(0, "output", 0).reduce(p.chunk(r, "input", 0))
        for r in range(1, p.num_ranks):
            p.chunk(0, "output", 0).copy(r, "output", 0)

    plan = lower(msc.trace(gather_then_spread, 3), collective=allsum)
    ins = [np.array([-7, 1, 30], np.int64) * (r + 1) for r in range(3)]
    assert [x.tolist() for x in run_collective(plan, ins, "avg", collective=allsum)] == [[-14, 2, 60]] * 3
    # the plan states its collective (msc.ir.Contract): no definition needed, the same result
    assert plan.contract is not None
    assert [x.tolist() for x in run_collective(plan, ins, "avg")] == [[-14, 2, 60]] * 3
    with pytest.raises(PlanError, match="not built in, and does not state what it requires"):
        Executor(replace(plan, contract=None))


# -- reference ----------------------------------------------------------------------------------------

def test_reference_by_hand():
    a, b = np.array([1, 2, 3, 4], np.int32), np.array([10, 20, 30, 40], np.int32)
    exp = reference.expected_outputs
    assert [x.tolist() for x in exp("allreduce", [a, b])] == [[11, 22, 33, 44]] * 2
    assert [x.tolist() for x in exp("allreduce", [a, b], op="prod")] == [[10, 40, 90, 160]] * 2
    assert [x.tolist() for x in exp("allgather", [a, b])] == [[1, 2, 3, 4, 10, 20, 30, 40]] * 2
    assert [x.tolist() for x in exp("reducescatter", [a, b], op="max")] == [[10, 20], [30, 40]]
    assert [x.tolist() for x in exp("alltoall", [a, b])] == [[1, 2, 10, 20], [3, 4, 30, 40]]
    assert [x.tolist() for x in exp("broadcast", [a, b], root=1)] == [[10, 20, 30, 40]] * 2
    red = exp("reduce", [a, b], op="min", root=1)
    assert red[0] is None and red[1].tolist() == [1, 2, 3, 4]
    # integers wrap; avg truncates toward zero
    assert exp("allreduce", [np.array([200], np.uint8)] * 2)[0].tolist() == [144]
    assert exp("allreduce", [np.array([2 ** 30], np.int32)] * 4)[0].tolist() == [0]
    assert exp("allreduce", [np.array([-4, 4, np.iinfo(np.int64).min], np.int64),
                             np.array([-1, 1, 0], np.int64)], op="avg")[0].tolist() == [-2, 2, -2 ** 62]
    assert exp("allreduce", [np.array([1.0], ml_dtypes.bfloat16)] * 3, op="avg")[0].dtype == ml_dtypes.bfloat16


def test_reference_tolerances_and_counting():
    f32 = np.dtype(np.float32)
    assert reference.tolerance(f32, 8, "sum", "allreduce") == 10 * 2.0 ** -24
    assert reference.tolerance(np.float64, 2, "sum", "allreduce") == 8 * 2.0 ** -53
    assert reference.tolerance(ml_dtypes.bfloat16, 8, "avg", "reduce") == 10 * 2.0 ** -8
    for args in ((f32, 8, "max", "allreduce"), (np.int32, 8, "sum", "allreduce"), (f32, 8, "sum", "allgather")):
        assert reference.tolerance(*args) == 0.0
    e = [np.array([1.0, 2.0, 3.0], np.float32), None]
    assert reference.count_wrong([np.array([1.0, 2.0, 3.5], np.float32), np.zeros(9)], e) == [1, 0]
    assert reference.count_wrong([np.array([1.0, 2.0, 3.0 + 1e-6], np.float32), None], e, rtol=1e-6) == [0, 0]
    assert reference.count_wrong([np.array([1.0, 2.0]), None], e) == [3, 0]
    poisoned = np.empty(3, np.float32)
    poison(poisoned)
    assert poisoned.view(np.uint32)[0] == 0xA5A5A5A5
    assert reference.count_wrong([poisoned, None], e, rtol=0.1) == [3, 0]


def test_bfloat16_tolerance_still_catches_a_missing_contribution():
    rng = np.random.default_rng(1)
    ins = [rng.uniform(1, 2, 4096).astype(ml_dtypes.bfloat16) for _ in range(8)]
    short = reference.expected_outputs("allreduce", ins[:7])[:1] * 8
    assert reference.check("allreduce", ins, short) == [4096] * 8


# -- runner -------------------------------------------------------------------------------------------

def test_parse_size_and_sizes():
    assert [runner.parse_size(s) for s in ("8", "1K", "64M", "2g", " 3k ")] == [8, 1024, 64 << 20, 2 << 30, 3072]
    for bad in ("", "1X", "-8", "1.5K"):
        with pytest.raises(UsageError):
            runner.parse_size(bad)
    assert runner.sizes(8, 64, 2) == [8, 16, 32, 64]
    assert runner.sizes(0, 4, 4) == [0, 1, 4]
    with pytest.raises(UsageError):
        runner.sizes(8, 64, 1)


# key, size counts all ranks' units, rooted, reducing
SWEEPS = [("allreduce/ring:ring", False, False, True),
          ("allgather/ring:ring", True, False, False),
          ("reducescatter/ring:ring", True, False, True),
          ("alltoall/allpairs:allpairs", True, False, False),
          ("broadcast/chain:chain", False, True, False),
          ("reduce/tree:tree", False, True, True)]


@pytest.mark.parametrize("key,gathered,rooted,reducing", SWEEPS, ids=[s[0] for s in SWEEPS])
def test_sweep_records(key, gathered, rooted, reducing):
    n = 4
    plan = plan_for(key, n, False, root=n - 1 if rooted else 0)
    records = runner.sweep(plan, min_bytes="64", max_bytes="1K", factor=4, dtype="half", op="sum", iters=2)
    assert [r["size"] for r in records] == [64, 256, 1024]
    for r in records:
        assert r["count"] * (n if gathered else 1) * 2 == r["size"] and r["type"] == "half" and r["wrong"] == 0
        # a host backend's time is host time: no bandwidth that would pass for a GPU's
        assert r["host_time"] > 0 and not {"time", "algbw", "busbw"} & set(r)
        assert r["redop"] == ("sum" if reducing else "none") and r["root"] == (n - 1 if rooted else -1)
        json.dumps(r)


def test_sweep_rounds_down_and_format_table():
    plan = plan_for("allgather/ring:ring", 3, True)
    records = runner.sweep(plan, min_bytes=100, max_bytes=100, factor=2, dtype="int32", op="max")
    [r] = records
    assert (r["size"], r["count"], r["requested_size"], r["rounded"], r["inplace"]) == (96, 8, 100, True, True)
    text = runner.format_table(records, title="t")
    head = text.splitlines()
    assert head[0] == "# t" and head[1].strip().endswith("in-place")
    assert head[2].split() == ["#", "size", "count", "type", "redop", "root", "host", "#wrong"]
    assert head[3].split() == ["#", "(B)", "(elements)", "(us)"]
    row = head[4].split()
    assert row[:5] == ["96", "8", "int32", "none", "-1"] and row[-1] == "0" and len(row) == 7
    assert "Out of bounds values : 0 OK" in text and "100 -> 96" in text
    assert "not a GPU's time; no bandwidth" in text and "bus bandwidth" not in text


def _corrupt_allgather():
    """Allgather (k = 1: every chunk one class) whose first send reads another
    valid chunk: the verifier rejects it; the executor runs it to wrong numbers."""
    plan = plan_for("allgather/ring:ring", 4, False)
    bad, _ = _corrupt(plan, lambda st: replace(st, srcs=(replace(st.srcs[0], buffer="output", index=3),))
                      if st.op is StepOp.SEND else None)
    from msc.verification.plan import verify_plan
    with pytest.raises(msc.VerificationError):
        verify_plan(bad)
    return bad


def test_sweep_counts_wrong_elements_of_a_corrupt_plan():
    records = runner.sweep(_corrupt_allgather(), min_bytes="1K", max_bytes="4K", factor=2, dtype="float", op="sum")
    assert all(r["wrong"] > 0 for r in records)
    assert "FAILED" in runner.format_table(records)


def test_run_command(capsys):
    good, bad = plan_for("reduce/ring:ring", 4, True, root=2), _corrupt_allgather()
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    runner.add_run_command(sub, lambda path: {"good.plan": good, "bad.plan": bad}[path])

    def run(*argv):
        args = parser.parse_args(["run", *argv])
        return args.func(args)

    assert run("good.plan", "--backend", "sim", "-b", "1K", "-e", "4K", "-f", "2", "-d", "int32", "-o", "max") == 0
    out = capsys.readouterr().out
    assert "in-place" in out and len([x for x in out.splitlines() if not x.startswith("#")]) == 3
    assert run("good.plan", "-b", "8", "-e", "8", "-r", "2", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["wrong"] == 0 and doc["records"][0]["count"] == 2 and doc["records"][0]["root"] == 2
    assert run("bad.plan", "-b", "1K", "-e", "1K") == 1
    with pytest.raises(UsageError, match="root 2, not 0"):
        run("good.plan", "-r", "0")
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "good.plan", "--backend", "cuda"])


def test_runner_executor_and_reference_share_ops():
    from msc import executor

    assert runner.OPS == executor.OPS == reference.OPS
