"""msc.torch: the torch.distributed executor against msc.executor (bit for
bit) and torch.distributed's own collectives (gloo, CPU processes), the DDP
hook against stock DDP, and examples/train_ddp.py under torchrun.

In-process tests run every rank in one process (msc.torch.run_local: the
same compiled rounds, messages copied); the rest run on pools of gloo
worker processes started once per process count (tests/torchdist.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import torchdist  # noqa: E402  (tests/ helper: the worker pool and the cases it runs)
from torchdist import COMBOS, algorithms, library_plan, np_dtype, to_numpy, to_torch  # noqa: E402
from library import rotated  # noqa: E402
from patience import patience  # noqa: E402

import msc  # noqa: E402
import msc.torch as mt  # noqa: E402
from msc.verification import reference  # noqa: E402
from msc.executor import Executor, load_inputs  # noqa: E402
from msc.formats.plan_text import save_plan  # noqa: E402
from msc.torch.execute import OPS, prepare  # noqa: E402
from msc.torch.rank_program import TRANSPORTS, comm_conflicts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def library_keys(n: int):
    return [key for key, alg in algorithms().items() if alg.supports(n)]


def counts(k: int) -> list[int]:
    """0, 1, counts no chunk factor divides, and one every class is full."""
    return sorted({0, 1, k - 1, k + 1, 3 * k + k // 2 + 1, 1009})


# -- every rank in one process ------------------------------------------------------------------------

def run_both(plan, dtype: str, op: str, count: int, seed: int = 0, transport: str = "p2p"):
    """msc.executor and msc.torch.run_local on the same inputs: physical buffers of both."""
    ex = Executor(plan)
    inputs = reference.random_inputs(np.random.default_rng(seed), np_dtype(dtype), op, plan.num_ranks,
                                  plan.input_chunks // plan.chunk_factor * count)
    buffers, _ = load_inputs(ex, inputs, count)
    tensors = [{k: to_torch(v) for k, v in b.items()} for b in buffers]
    ex.run(buffers, count=count, op=op)
    mt.run_local(plan, tensors, count=count, op=op, transport=transport)
    return buffers, tensors


LOCAL = [(key, n, inplace, inst) for n in (2, 3, 4) for key in library_keys(n)
         for inplace in (True, False) for inst in (1, 2)]


# every third case of each algorithm by default (tests/library.py rotated), the rest under -m slow
@pytest.mark.parametrize("key,n,inplace,instances", list(rotated(
    LOCAL, lambda c: f"{c[0]}-n{c[1]}-{'in' if c[2] else 'out'}-i{c[3]}")))
def test_rounds_match_reference_executor_bit_for_bit(key, n, inplace, instances):
    """Every library plan, its whole physical buffers (not only the outputs),
    for counts no chunk factor divides, over both transports; and no
    round's communication touches memory twice."""
    roots = (0, n - 1) if algorithms()[key].collective.has_root else (0,)
    for root in roots:
        plan = library_plan(key, n, inplace, instances, root)
        for i, count in enumerate(counts(plan.chunk_factor)):
            dtype, op = COMBOS[(i + len(key)) % len(COMBOS)]
            transport = TRANSPORTS[i % len(TRANSPORTS)]
            buffers, tensors = run_both(plan, dtype, op, count, seed=i, transport=transport)
            for r in range(n):
                for name, arr in buffers[r].items():
                    assert to_numpy(tensors[r][name]).tobytes() == arr.tobytes(), \
                        (root, count, dtype, op, transport, r, name)
            for r in range(n):
                for tr in TRANSPORTS:
                    assert comm_conflicts(prepare(plan).program(r, count, tr)) == []


@pytest.mark.parametrize("n, inplace, instances", [(4, True, 1), (6, False, 2)])
def test_nvls_ring_in_nodes_of_two_matches_reference_executor_bit_for_bit(n, inplace, instances):
    """nvls_ring needs 8 GPUs a node by default (not in LOCAL's 2-4 ranks): nodes of 2 here, 2 and 3
    of them, its switch ops run as messages (msc.lower.switch_expand) beside the rings' copies."""
    from msc.lower.pipeline import LowerOptions, lower

    program = msc.trace(algorithms()["allreduce/nvls_ring:nvls_ring"], n, inplace=inplace, gpus_per_node=2)
    plan = lower(program, LowerOptions(instances=instances))
    assert plan.first_switch_step() is not None
    for i, count in enumerate(counts(plan.chunk_factor)):
        dtype, op = COMBOS[(i + n) % len(COMBOS)]
        buffers, tensors = run_both(plan, dtype, op, count, seed=i, transport=TRANSPORTS[i % len(TRANSPORTS)])
        for r in range(n):
            for name, arr in buffers[r].items():
                assert to_numpy(tensors[r][name]).tobytes() == arr.tobytes(), (count, dtype, op, r, name)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16", "int32", "int64", "uint8"])
def test_every_dtype_and_op(dtype):
    plan = library_plan("allreduce/ring:ring", 3, False)
    for op in OPS:
        for count in (1, 4, 1009):
            buffers, tensors = run_both(plan, dtype, op, count)
            for r in range(3):
                assert to_numpy(tensors[r]["output"]).tobytes() == buffers[r]["output"].tobytes(), (op, count)


def test_big_messages_move_without_copies():
    """Ring allreduce: no copies at all (messages go out from the buffer or
    the staging area they were reduced in; the allgather half lands in
    place: n-1 direct receives per rank), one reduction per step."""
    n = 4
    for inplace in (True, False):
        for transport in TRANSPORTS:
            prog = prepare(library_plan("allreduce/ring:ring", n, inplace)).program(1, 1 << 20, transport)
            assert prog.direct == n - 1
            assert [op[0] for r in prog.rounds for op in r.ops] == ["op"] * (n - 1)
            assert len(prog.rounds) == 2 * (n - 1)      # the last receive lands directly: no round of its own
            # the only workspace: one chunk of staging per reduce-scatter step
            assert prog.arena == (n - 1) * (1 << 20) // n


def test_mixed_transport_uses_the_collective_only_for_dense_rounds():
    """allpairs: every round where all pairs talk runs one all_to_all_single;
    ring at 4 ranks: its rounds (4 of 12 pairs talk) go point to point."""
    for key, collective_rounds in (("allreduce/allpairs:allpairs", True), ("allreduce/ring:ring", False)):
        prog = prepare(library_plan(key, 4, True)).program(1, 4096, "mixed")
        talking = [r for r in prog.rounds if r.alltoall is not None or r.sends or r.recvs]
        assert talking and all((r.alltoall is not None) is collective_rounds for r in talking), key


def test_prepared_plans_and_programs_are_cached():
    plan = library_plan("allreduce/ring:ring", 2, True)
    assert prepare(plan) is prepare(plan)
    assert prepare(plan).program(0, 100) is prepare(plan).program(0, 100)


def test_stuck_plan_is_an_error_not_a_hang():
    from dataclasses import replace

    from msc.errors import ExecutionError
    from msc.ir import RankPlan, Slice, Step, StepOp, Threadblock

    plan = library_plan("allreduce/ring:ring", 2, True)
    # each rank receives before it sends, from the other: no round can start
    ranks = tuple(RankPlan(r, 0, (Threadblock(0, 1 - r, 1 - r, 0, (
        Step(StepOp.RECV, (), Slice("input", 0, 1), 1), Step(StepOp.SEND, (Slice("input", 1, 1),), None, 1))),))
        for r in range(2))
    with pytest.raises(ExecutionError, match="stuck"):
        prepare(replace(plan, ranks=ranks, name="stuck"))


def test_op_names():
    from msc.errors import UsageError
    from msc.torch.execute import op_name

    assert op_name(dist.ReduceOp.SUM) == "sum" and op_name(dist.ReduceOp.PRODUCT) == "prod"
    assert op_name("MAX") == "max" and op_name(dist.ReduceOp.AVG) == "avg"
    with pytest.raises(UsageError):
        op_name(dist.ReduceOp.BAND)


def test_a_call_is_served_by_the_plan_of_its_nccl_tests_size(tmp_path, monkeypatch):
    """The size a registry picks a plan by is nccl-tests': the larger buffer (an allgather's output, a
    reducescatter's input), here an allgather of 4 x 4096 float32 elements: 64 KiB, its input 16 KiB
    (bench/mutation_check.py's torch-bytes mutation picked by the input)."""
    from msc.torch import calls

    save_plan(library_plan("allgather/allpairs:allpairs", 4, False), tmp_path / "small.plan")
    save_plan(library_plan("allgather/ring:ring", 4, False), tmp_path / "large.plan")
    (tmp_path / "plans.json").write_text(json.dumps([{"file": "small.plan", "max_bytes": "64K"},
                                                     {"file": "large.plan", "min_bytes": "64K"}]))
    monkeypatch.setattr(calls, "_group_info", lambda group: (0, 4))       # rank 0 of 4, no process group
    for count, name in ((4095, "allpairs"), (4096, "ring")):
        got = calls.pick(str(tmp_path), "allgather", None, torch.ones(count), torch.empty(4 * count))
        assert got.name == name, (count, got.name)
    for collective, units_in, units_out in (("allreduce", 1, 1), ("reducescatter", 4, 1), ("alltoall", 4, 4),
                                            ("broadcast", 1, 1)):
        from msc.dsl.collectives import get_collective

        call = calls._Call(get_collective(collective), 4, 1, 0, torch.ones(units_in * 10), torch.empty(units_out * 10))
        assert call.nbytes() == max(units_in, units_out) * 10 * 4, collective


# -- gloo processes -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pools():
    started = {}

    def get(n: int) -> torchdist.Pool:
        if n not in started:
            saved = os.environ.pop("MSC_DEVICE", None)     # the workers: no emulated CUDA runtime (error_cases)
            try:
                started[n] = torchdist.Pool(n, timeout=120)
            finally:
                if saved is not None:
                    os.environ["MSC_DEVICE"] = saved
        return started[n]
    yield get
    for pool in started.values():
        pool.close()


def collective_cases(n: int, keys) -> list:
    cases = []
    for key in keys:
        alg = algorithms()[key]
        for root in ((0, n - 1) if alg.collective.has_root else (0,)):
            k = library_plan(key, n, True, 1, root).chunk_factor
            for plan_inplace in (True, False):
                for call_inplace in (True, False):
                    for j, count in enumerate((0, 1, k + 1, 1009)):
                        dtype, op = COMBOS[(j + 2 * plan_inplace + call_inplace + len(cases)) % len(COMBOS)]
                        cases.append((key, plan_inplace, 1, root, call_inplace, count, dtype, op))
    return cases


from msc.dsl.collectives import COLLECTIVE_NAMES as COLLECTIVES  # noqa: E402  (sendrecv: against torch's p2p)


# 4 ranks of allreduce (every allreduce algorithm, 4 s on 2 cores) under -m slow; the other collectives at 4 here
@pytest.mark.parametrize("collective, n", [pytest.param(c, n, marks=pytest.mark.slow if (c, n) == ("allreduce", 4) else ())
                                          for c in COLLECTIVES for n in (2, 3, 4)])
def test_collectives_match_torch_distributed(pools, n, collective):
    """Every library algorithm of the collective that supports n ranks, in
    both plan forms and both call forms, at counts 0, 1, k+1 and 1009, over
    the dtype/op combinations (every dtype and op appears)."""
    keys = [k for k in library_keys(n) if k.startswith(collective + "/")]
    if not keys:
        pytest.skip(f"no library {collective} for {n} ranks")
    cases = collective_cases(n, keys)
    checks = pools(n).run(torchdist.collective_cases, cases)
    assert sum(checks) > 0


def test_instances_and_large_counts(pools):
    cases = [("allreduce/ring:ring", True, 2, 0, True, 100_003, "float32", "sum"),
             ("allreduce/allpairs:allpairs", False, 1, 0, True, 65_537, "bfloat16", "avg"),
             ("alltoall/allpairs:allpairs", True, 2, 0, False, 20_001, "int64", "sum"),
             ("reducescatter/ring:ring", True, 2, 0, True, 30_011, "float16", "max")]
    pools(2).run(torchdist.collective_cases, cases)


def test_misuse_raises_typed_errors_on_every_rank(pools):
    messages = pools(2).run(torchdist.error_cases)
    assert messages[0] == messages[1]
    text = "\n".join(messages[0])
    assert "is for 3 ranks, the group has 2" in text
    assert "contiguous" in text and "unsupported dtype" in text and "unknown reduction op" in text
    assert "no msc plan for allreduce 2 ranks in place at 4096 bytes (4K)" in text
    assert "[0, 1K)" in text                                     # and it says what exists
    assert "msc CUDA runtime" in text


def test_one_rooted_plan_serves_every_root(pools):
    """broadcast(src=r) and reduce(dst=r) for every r from a root-0 plan
    (its ranks rotated, verified per root), as torch.distributed computes."""
    assert pools(3).run(torchdist.any_root_cases) == [[0, 1, 2, 0, 1, 2]] * 3


def test_uneven_alltoall_runs_the_plan_on_padded_units(pools):
    """all_to_all_single with split sizes (MoE's dispatch): gloo's results
    bit for bit on 3 ranks, with or without the agreement; splits that do
    not pair up are refused on every rank, naming the pair."""
    for r in pools(3).run(torchdist.uneven_cases):
        wrong = [k for k, v in r.items() if v is False]
        assert not wrong, wrong
        assert r["mismatch"].startswith("all_to_all_single: the ranks' split sizes do not pair up: rank 0 sends 2 "
                                        "rows to rank 0, which expects 3"), r["mismatch"]
        assert r["untouched"]


def test_registry_picks_by_size_in_a_run(pools):
    names = pools(2).run(torchdist.registry_cases)
    assert names[0] == names[1] == ["ring", "ring", "allpairs", "allpairs"]


def test_ddp_hook_trains_like_stock_ddp(pools, tmp_path):
    save_plan(library_plan("allreduce/ring:ring", 2, True), tmp_path / "allreduce-ring-n2.plan")
    results = pools(2).run(torchdist.ddp_case, 4, str(tmp_path))
    for r in results:
        assert r["hook_calls"] >= 2 * 4 and len(r["bucket_sizes"]) >= 2     # several buckets, every step
        # 2 ranks: dividing by 2 is exact and a two-term sum has one rounding: the same bits
        assert r["msc"] == r["stock"]
        assert r["msc"][-1] < r["msc"][0]


# -- the example under torchrun -------------------------------------------------------------------------

@pytest.mark.slow        # docs/training.md's walkthrough (-m slow) runs this example too
def test_train_ddp_example_under_torchrun(tmp_path):
    save_plan(library_plan("allreduce/ring:ring", 2, True), tmp_path / "allreduce-ring-n2.plan")
    out = tmp_path / "losses.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "examples" / "train_ddp.py"), "--plans", str(tmp_path), "--backend", "torch", "--steps", "3",
         "--check-stock",
         "--losses", str(out), "--quiet"],
        capture_output=True, text=True, timeout=patience(240), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and len(result["losses"]) == 3
    assert result["losses"] == result["stock_losses"]
    assert "msc losses match stock DDP" in done.stdout
