"""The CUDA runtime's host side, on CPU (no GPU, no driver needed).

What is proven here: call validation (msc.cuda.validate) with exact
messages; arena layout, growth and the pointer tables of the three
placements (the same logical layout, slots and tail with the receiver, head
with the sender, as the kernel polls them); launch shapes; error-word
decoding; the torchrun bootstrap's handle exchange between two gloo
processes with the IPC calls faked; compile-at-first-use for sm_90; the
PyTorch baseline of msc bench; msc bench's exit without a GPU. What needs a
GPU is in tests/test_cuda_gpu.py.
"""
from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import msc
from msc.cuda.device import driver_available, probe, timeout_ns
from msc.cuda.diagnose import Counters, DeviceTimeoutError, counters_from_arena, decode, parse_words
from msc.cuda.backend import CudaBackend
from msc.cuda.codegen import COUNTER_STRIDE
from msc.cuda.launch import ERROR_WORDS, Footprint, footprint, launch_params
from msc.cuda.runtime import Kernels, launches, resolve_devices, runtime_plan
from msc.cuda.tables import (UserBuffers, arena_layout, error_pointer, grow, peers, pointer_tables, resolve,
                             total_bytes)
from msc.cuda.validate import TensorDesc, check_call, check_collective, check_op, describe
from msc.dsl.collectives import COLLECTIVE_NAMES, COLLECTIVES
from msc.errors import ExecutionError, UsageError
from msc.ir.ops import REDUCE_OP_NAMES
from msc.lower.pipeline import LowerOptions, lower
from cudaboot import runtime_layout
from library import algorithms
from patience import patience

REPO = Path(__file__).resolve().parent.parent


def _plan(key: str, n: int, inplace: bool | None = None, protocol: str = "Simple", instances: int = 1):
    return lower(msc.trace(algorithms(switch=False)[key], n, inplace=inplace), LowerOptions(protocol=protocol, instances=instances))


def _t(numel=8, dtype="float32", device="cuda:0", contiguous=True, ptr=0x10000, itemsize=4):
    return TensorDesc(dtype, device, numel, contiguous, ptr, itemsize)


def _ranks(n, numel=8, **kw):
    return [_t(numel, ptr=0x100000 * (r + 1), **kw) for r in range(n)]


DEV4 = ("cuda:0",) * 4


# -- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (lambda xs: xs[:3], r"^inputs: 3 tensor\(s\) for 4 rank\(s\)"),
    (lambda xs: xs[:2] + [_t(8, "int64", ptr=0x300000)] + xs[3:],
     r"^rank 2 input: dtype int64 is not one the CUDA kernels take"),
    (lambda xs: xs[:1] + [_t(8, device="cuda:1", ptr=0x200000)] + xs[2:],
     r"^rank 1 input: tensor is on cuda:1, expected cuda:0 \(rank 1's GPU\)"),
    (lambda xs: xs[:3] + [_t(8, contiguous=False, ptr=0x400000)],
     r"^rank 3 input: tensor is not contiguous"),
    (lambda xs: xs[:2] + [_t(12, ptr=0x300000)] + xs[3:],
     r"^rank 2 input: 12 elements, rank 0 has 8; every rank must pass the same size"),
    (lambda xs: xs[:1] + [_t(8, "float16", ptr=0x200000, itemsize=2)] + xs[2:],
     r"^rank 1 input: dtype float16, rank 0's is float32"),
])
def test_bad_calls_name_the_rank_and_the_problem(change, message):
    plan = _plan("allreduce/ring:ring", 4)
    with pytest.raises(UsageError, match=message):
        check_call(plan, change(_ranks(4)), None, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)


def test_sizes_the_layout_cannot_take():
    rs = _plan("reducescatter/ring:ring", 4, inplace=False)
    with pytest.raises(UsageError, match=r"^rank 0 input: 10 elements is not 4 equal units \(reducescatter over 4"):
        check_call(rs, _ranks(4, 10), _ranks(4, 2), op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    ag = _plan("allgather/ring:ring", 4, inplace=False)
    outs = [_t(16, ptr=0x900000 * (r + 1)) for r in range(4)]
    outs[1] = _t(15, ptr=0x1200000)
    with pytest.raises(UsageError, match=r"^rank 1 output: 15 elements, expected 16 \(4 unit\(s\) of 4"):
        check_call(ag, _ranks(4, 4), outs, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)


def test_ops_are_checked_and_data_movement_uses_one_kernel():
    ar, ag = _plan("allreduce/ring:ring", 4), _plan("allgather/ring:ring", 4)
    with pytest.raises(UsageError, match="unknown reduction op 'xor'"):
        check_call(ar, _ranks(4), None, op="xor", ranks=(0, 1, 2, 3), devices=DEV4)
    with pytest.raises(UsageError, match="avg .* floating type .* not int32"):
        check_call(ar, _ranks(4, dtype="int32"), None, op="avg", ranks=(0, 1, 2, 3), devices=DEV4)
    assert check_op(ag, "max") == "sum" and check_op(ar, "max") == "max"
    with pytest.raises(UsageError, match="is a allgather plan; this call is allreduce"):
        check_collective(ag, "allreduce")


def test_in_place_forms():
    ar = _plan("allreduce/ring:ring", 4)
    spec = check_call(ar, _ranks(4, 10), None, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    assert spec.count == 10 and spec.buffers[2] == UserBuffers(0x300000, 0x300000)
    same = check_call(ar, _ranks(4, 10), _ranks(4, 10), op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    assert same == spec
    with pytest.raises(UsageError, match=r"^rank 0 output: plan .* runs in place, so the output must be unit 0"):
        check_call(ar, _ranks(4, 10), [_t(10, ptr=0x5)] * 4, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    # in-place allgather runs on the outputs; each input is unit `rank` of its output
    ag = _plan("allgather/ring:ring", 4)
    outs = [_t(12, ptr=0x100000 * (r + 1)) for r in range(4)]
    ins = [_t(3, ptr=0x100000 * (r + 1) + r * 3 * 4) for r in range(4)]
    spec = check_call(ag, ins, outs, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    assert spec.count == 3 and spec.buffers[1] == UserBuffers(0x200000, 0x200000)
    with pytest.raises(UsageError, match="runs allgather in place on each rank's output buffer: pass the outputs"):
        check_call(ag, ins, None, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    bad = ins[:2] + [_t(3, ptr=0x300000)] + ins[3:]
    with pytest.raises(UsageError, match=r"^rank 2 input: .* must be unit 2 of the output \(3 elements at element 6\)"):
        check_call(ag, bad, outs, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)


def test_out_of_place_buffers_must_not_overlap_and_one_rank_under_torchrun():
    ar = _plan("allreduce/ring:ring", 4, inplace=False)
    with pytest.raises(UsageError, match="pass inputs and outputs"):
        check_call(ar, _ranks(4), None, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    outs = [_t(8, ptr=0x100000 * (r + 1) + 16) for r in range(4)]
    with pytest.raises(UsageError, match="^rank 0: input and output overlap"):
        check_call(ar, _ranks(4), outs, op="sum", ranks=(0, 1, 2, 3), devices=DEV4)
    spec = check_call(ar, [_t(8, device="cuda:2", ptr=0x10)], [_t(8, device="cuda:2", ptr=0x1000)], op="max",
                      ranks=(2,), devices=("cuda:2",))
    assert spec.buffers == (UserBuffers(0x10, 0x1000),) and spec.op == "max"


def test_real_cpu_tensors_are_described_and_refused():
    torch = pytest.importorskip("torch")
    plan = _plan("allreduce/ring:ring", 2)
    xs = [torch.ones(8), torch.ones(8, 2)[:, 0]]
    assert describe(xs[1]) == TensorDesc("float32", "cpu", 8, False, xs[1].data_ptr(), 4)
    with pytest.raises(UsageError, match=r"^rank 0 input: tensor is on cpu, expected cuda:0"):
        check_call(plan, [describe(x) for x in xs], None, op="sum", ranks=(0, 1), devices=("cuda:0",) * 2)
    assert describe(torch.ones(4, dtype=torch.bfloat16)).dtype == "bfloat16"


# -- arenas and pointer tables ------------------------------------------------------------
def _arenas(key="alltoall/hierarchical:hierarchical", n=4, count=1 << 16, dtype="float32"):
    # the two-step alltoall stages data in scratch on every rank (library plans declare only scratch they use)
    plan, layout = runtime_layout(key, n)
    params = launch_params(layout, count, dtype=dtype, protocol=plan.protocol)
    fp = footprint(layout, params, dtype=dtype, protocol=plan.protocol, slots=plan.slots)
    return plan, layout, fp, arena_layout(layout, fp)


def test_arena_regions_are_disjoint_aligned_and_sized():
    plan, layout, fp, arenas = _arenas()
    assert plan.slots == 8
    for a in arenas:
        regions = [(a.error, 4 * ERROR_WORDS), (a.progress, COUNTER_STRIDE * layout.threadblocks_per_rank[a.rank])]
        regions += [(o, COUNTER_STRIDE) for o in a.tail.values()] + [(o, COUNTER_STRIDE) for o in a.head.values()]
        regions += [(a.slots[c], fp.slots[c]) for c in a.slots] + [(a.scratch, fp.scratch[a.rank])]
        regions.sort()
        for (o1, s1), (o2, _) in zip(regions, regions[1:]):
            assert o1 + s1 <= o2
        assert regions[-1][0] + regions[-1][1] <= a.size
        assert all(o % 256 == 0 for o in list(a.slots.values()) + [a.scratch])
        counters = [a.progress + COUNTER_STRIDE * t for t in range(layout.threadblocks_per_rank[a.rank])]
        counters += list(a.tail.values()) + list(a.head.values())
        assert all(o % COUNTER_STRIDE == 0 for o in counters)          # a cache line each
        assert a.counters_end <= min(a.slots.values()) and a.counters_end <= a.scratch
        assert set(a.tail) == set(a.slots) == {c.id for c in layout.connections if c.receiver == a.rank}
        assert set(a.head) == {c.id for c in layout.connections if c.sender == a.rank}
    assert all(fp.scratch) and total_bytes(arenas) == sum(a.size for a in arenas)


def test_growth_reallocates_only_for_a_larger_call():
    plan, layout, small, _ = _arenas(count=1000)
    _, _, big, _ = _arenas(count=1 << 22)
    assert grow(None, small) == small
    assert grow(big, small) is None and grow(small, small) is None
    assert grow(small, big) == big
    # a different dtype can need more of one region and less of another: the max of both
    ll = Footprint(scratch=tuple(s // 2 for s in big.scratch), slots=tuple(s * 2 for s in big.slots),
                   progress=big.progress, room=big.room * 2)
    both = grow(big, ll)
    assert both.scratch == big.scratch and both.slots == ll.slots and both.room == ll.room
    assert grow(both, big) is None and grow(both, ll) is None
    # the slots' room per chunk-tile is part of the capacity: calls share one slot geometry
    assert grow(small, big).room == big.room > small.room


def test_the_kernel_polls_tail_as_receiver_and_head_as_sender():
    """The template's contract that the tables follow: a receiver spins on
    its connection's tail, a sender on its head; each must be local."""
    from msc.cuda import render

    for protocol in ("Simple", "LL"):
        source, _ = render(runtime_plan(_plan("allreduce/ring:ring", 2, protocol=protocol)), form="table")
        waits = re.findall(r"wait_counter\(conn_of\(a, b\.conn_(in|out)\)\.(tail|head)", source)
        assert set(waits) <= {("in", "tail"), ("out", "head")} and ("out", "head") in waits
        assert ("in", "tail") in waits or protocol == "LL"          # LL receivers poll packet flags in slots
        assert "st_release(conn_of(a, b.conn_in).head" in source
        # Simple posts every message on tail; LL's receivers never read it: its count is stored once, at the end
        posted = "st_release(conn_of(a, b.conn_out).tail" in source
        stored = "st_relaxed(conn_of(b.a, b.conn_out).tail, b.seq_out, b.local)" in source
        assert (posted, stored) == ((True, False) if protocol == "Simple" else (False, True))


def _logical(ranks, conns, arenas, bases):
    return ({r: {f: resolve(v, arenas, bases) if f in ("scratch", "progress") else v for f, v in e.items()}
             for r, e in enumerate(ranks)},
            [{f: resolve(v, arenas, bases) for f, v in c.items()} for c in conns])


@pytest.mark.parametrize("key", ["allreduce/ring:ring", "reducescatter/ring:ring", "alltoall/allpairs:allpairs"])
def test_pointer_tables_of_the_three_placements_agree(key):
    plan, layout, fp, arenas = _arenas(key)
    n = plan.num_ranks
    user = [UserBuffers(0x1000 + r, 0x2000 + r) for r in range(n)]
    # virtual: every arena on one GPU; devices: one per GPU (other addresses, same process)
    virtual = [0x10_0000_0000 + r * 0x1_0000_0000 for r in range(n)]
    devices = [0x7f00_0000_0000 + r * 0x10_0000_0000 for r in range(n)]
    want = _logical(*pointer_tables(layout, arenas, virtual, user, tuple(range(n))), arenas, virtual)
    assert want == _logical(*pointer_tables(layout, arenas, devices, user, tuple(range(n))), arenas, devices)
    for c, entry in zip(layout.connections, want[1]):
        assert entry["slots"] == (c.receiver, f"slots{c.id}", 0)
        assert entry["tail"] == (c.receiver, f"tail{c.id}", 0)
        assert entry["head"] == (c.sender, f"head{c.id}", 0)
    for r in range(n):
        assert want[0][r] == {"input": 0x1000 + r, "output": 0x2000 + r, "scratch": (r, "scratch", 0),
                              "progress": (r, "progress", 0)}
    # torchrun: each process sees its own arena and its peers' at addresses of its own
    for me in range(n):
        bases = [None] * n
        bases[me] = 0x5000_0000_0000
        for p in peers(layout, me):
            bases[p] = 0x6000_0000_0000 + p * 0x10_0000_0000
        mine = [user[r] if r == me else None for r in range(n)]
        got = _logical(*pointer_tables(layout, arenas, bases, mine, (me,)), arenas, bases)
        assert got[0][me] == want[0][me]
        assert all(got[0][r] == {"input": 0, "output": 0, "scratch": None, "progress": None}
                   for r in range(n) if r != me)
        for c, g, w in zip(layout.connections, got[1], want[1]):
            assert g == (w if me in (c.sender, c.receiver) else {"slots": None, "tail": None, "head": None})
        assert resolve(error_pointer(arenas, bases, me), arenas, bases) == (me, "error", 0)


def test_pointer_tables_refuse_what_a_local_rank_cannot_reach():
    plan, layout, fp, arenas = _arenas("allreduce/ring:ring")
    bases = [0x1000_0000, None, None, None]
    with pytest.raises(UsageError, match=r"connection \d+ \(rank 0 -> rank 1.* arena of rank 1 is not mapped"):
        pointer_tables(layout, arenas, bases, [UserBuffers(1, 1), None, None, None], (0,))
    with pytest.raises(UsageError, match="rank 0 runs here but its arena or buffers are unknown"):
        pointer_tables(layout, arenas, bases, [None] * 4, (0,))


def test_launch_shapes_and_devices():
    plan, layout = runtime_layout("allreduce/allpairs:allpairs", 4)
    (v,) = launches(layout, "virtual", (3,))
    assert (v.device, v.first_block, v.grid, v.error_rank) == (3, 0, len(layout.blocks), 0)
    per = launches(layout, "devices", (4, 5, 6, 7))
    assert [(L.device, L.first_block, L.grid) for L in per] == [(4 + r, *layout.rank_blocks[r]) for r in range(4)]
    assert sum(L.grid for L in per) == len(layout.blocks)
    (t,) = launches(layout, "torchrun", (0,), rank=2)
    assert (t.ranks, t.first_block, t.grid, t.error_rank) == ((2,), *layout.rank_blocks[2], 2)
    assert resolve_devices("devices", None, 4, 0) == (0, 1, 2, 3)
    assert resolve_devices("virtual", "cuda:2", 4, 0) == (2,) and resolve_devices("torchrun", None, 4, 1) == (1,)
    with pytest.raises(UsageError, match="distinct GPU per rank"):
        resolve_devices("devices", [0, 0, 1, 2], 4, 0)
    with pytest.raises(UsageError, match="a GPU per rank: 4 ranks"):
        resolve_devices("devices", [0, 1], 4, 0)
    with pytest.raises(UsageError, match="placement must be one of"):
        resolve_devices("nvlink", None, 4, 0)


def test_timeout_is_in_global_timer_nanoseconds():
    assert timeout_ns(2.5) == 2_500_000_000 and timeout_ns(1e-12) == 1
    with pytest.raises(UsageError, match="timeout_s must be a number of seconds > 0"):
        timeout_ns(0)


# -- error words --------------------------------------------------------------------------
def test_error_words_decode_to_rank_threadblock_step_and_waits():
    plan, layout = runtime_layout("allreduce/ring:ring", 4)
    assert decode((0, 0, 0, 0, 0), plan, layout) is None
    raw = struct.pack("<5I", 1, 2, 0, 3, 7)
    words = parse_words(raw)
    step = plan.ranks[2].threadblocks[0].steps[3]
    err = decode(words, plan, layout, timeout_s=5)
    assert isinstance(err, DeviceTimeoutError) and isinstance(err, ExecutionError)
    assert (err.rank, err.tb, err.step, err.iteration) == (2, 0, 3, 7)
    text = str(err)
    head = f"{step.where}: " if step.where else ""          # the user's algorithm line, where known
    assert text.startswith(f"{head}rank 2 threadblock 0 step 3 ({step.op.value}) timed out in a spin-wait after 5 s "
                           f"at iteration 7")
    assert "a message from rank 1 on channel 0" in text or not step.op.receives
    assert "communicator is now unusable" in text
    # with counters: the receive is unmet (nothing posted beyond what was consumed), the slot is free
    tb = plan.ranks[2].threadblocks[0]
    conn = {(c.sender, c.receiver, c.channel): c.id for c in layout.connections}
    cin, cout = conn[(tb.recv, 2, tb.channel)], conn[(2, tb.send, tb.channel)]
    counters = Counters({(2, 0): 5 << 32}, {cin: 40, cout: 41}, {cin: 40, cout: 40})
    err = decode(words, plan, layout, counters=counters, slots=8)
    assert "still unmet: a message from rank 1 on channel 0" in str(err)
    assert all(met is not False for d, met in err.waits if d.startswith("a free slot"))


def test_dependency_waits_are_checked_against_the_launch_epoch():
    plan, layout = runtime_layout("allreduce/allpairs:allpairs", 4)
    found = next(((r.rank, tb.id, i, s) for r in plan.ranks for tb in r.threadblocks
                  for i, s in enumerate(tb.steps) if s.deps), None)
    if found is None:
        pytest.skip("no dependency in this plan")
    rank, tb, i, s = found
    dt, ds = s.deps[0]
    epoch = 3 << 32
    nsteps = len(plan.ranks[rank].threadblocks[dt].steps)
    progress = {(rank, tb): epoch + 1, (rank, dt): epoch + 2 * nsteps + ds}        # one short, at iteration 2
    err = decode((1, rank, tb, i, 2), plan, layout, counters=Counters(progress))
    assert f"still unmet: threadblock {dt} step {ds} of rank {rank}" in str(err)
    progress[(rank, dt)] += 1
    err = decode((1, rank, tb, i, 2), plan, layout, counters=Counters(progress))
    assert (f"threadblock {dt} step {ds} of rank {rank}", True) in err.waits


def test_counters_are_read_from_an_arena_image():
    plan, layout, fp, arenas = _arenas("allreduce/ring:ring")
    a = arenas[1]
    image = bytearray(a.counters_end)
    struct.pack_into("<Q", image, a.progress, 9 << 32)
    (cin,) = a.tail
    struct.pack_into("<Q", image, a.tail[cin], 17)
    got = counters_from_arena(bytes(image), a, layout)
    assert got.progress[(1, 0)] == 9 << 32 and got.tail == {cin: 17} and set(got.head) == set(a.head)


# -- the torchrun bootstrap between two processes (gloo, fake IPC) ---------------------------
def test_torchrun_bootstrap_exchanges_handles_and_builds_the_same_tables(gloo2):
    import cudaboot

    key = "reducescatter/ring:ring"
    got = gloo2.run(cudaboot.exchange_case, key, 4096)
    plan, layout = runtime_layout(key, 2)
    params = launch_params(layout, 4096, dtype="float32", protocol=plan.protocol)
    arenas = arena_layout(layout, footprint(layout, params, dtype="float32", protocol=plan.protocol, slots=8))
    virtual = [0x10_0000_0000, 0x20_0000_0000]
    want = _logical(*pointer_tables(layout, arenas, virtual, [UserBuffers(0x1000 + r, 0x1000 + r) for r in range(2)],
                                    (0, 1)), arenas, virtual)
    for rank, out in enumerate(got):
        assert out["opened"] == out["peers"] == [1 - rank]            # each opened its one peer's handle
        assert out["logical"]["conns"] == want[1]                     # both ends of every connection are local
        assert out["logical"]["ranks"][rank] == want[0][rank]
    messages = gloo2.run(cudaboot.mismatch_case)
    assert all("every rank must make the same call" in m for m in messages), messages


def test_torchrun_ranks_sharing_a_gpu_are_refused_unless_mps_runs(gloo2):
    """Two torchrun processes on one GPU: their spinning kernels would only take turns, so
    every rank is told, at its first call, which ranks share which GPU; where MPS runs, they
    may."""
    import cudaboot

    got = gloo2.run(cudaboot.fake_torchrun_case, 3)
    for text in got:
        assert isinstance(text, str) and text.startswith("UsageError: the torchrun placement runs one rank per GPU, "
                                                         "and ranks 0, 1 on 0000:03:00.0: "), text
        assert "time-slicing" in text and "MPS" in text and "torch.cuda.set_device(local_rank)" in text
    allowed = gloo2.run(cudaboot.fake_torchrun_case, 3, True)
    assert all(isinstance(out, dict) and out["grid"] > 0 for out in allowed), allowed


def test_mps_is_seen_by_its_control_pipe(tmp_path, monkeypatch):
    from msc.cuda import device as cu

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not cu.mps_active()
    (tmp_path / "control").touch()
    assert cu.mps_active()


def test_torchrun_communicator_on_a_fake_gpu(gloo2):
    import cudaboot

    got = gloo2.run(cudaboot.fake_torchrun_case)
    plan, layout = runtime_layout("reducescatter/ring:ring", 2)
    for rank, out in enumerate(got):
        assert (out["first_block"], out["grid"]) == tuple(out["rank_blocks"]) == layout.rank_blocks[rank]
        assert out["error"] == (rank, "error", 0) and out["input"] and out["others"] == [0]
        assert out["out"] == rank * 64 and out["count"] == 64          # in-place reducescatter: unit `rank`
        for c in layout.connections:                                     # both ends local on 2 ranks
            assert out["conns"][c.id] == {"slots": (c.receiver, f"slots{c.id}", 0),
                                          "tail": (c.receiver, f"tail{c.id}", 0),
                                          "head": (c.sender, f"head{c.id}", 0)}


# -- compiling at first use, without a driver ----------------------------------------------
def test_kernels_compile_at_first_use_for_sm90(tmp_path):
    pytest.importorskip("cuda.core")
    plan = runtime_plan(_plan("allreduce/ring:ring", 4, protocol="LL"))
    kernels = Kernels(CudaBackend(), plan, "sm_90", cache=tmp_path)
    assert not kernels._compiled
    k = kernels.compiled("bfloat16", "max")
    assert k.cubin[:4] == b"\x7fELF" and k.arch == "sm_90" and not k.cache_hit
    assert "#define SLOTS 8" in k.source
    assert kernels.compiled("bfloat16", "max") is k                       # once per (dtype, op)
    assert Kernels(CudaBackend(), plan, "sm_90", cache=tmp_path).compiled("bfloat16", "max").cache_hit   # on disk


def test_a_deadlocking_plan_compiles_only_when_asked(tmp_path):
    pytest.importorskip("cuda.core")
    from msc.cuda import compile as compile_cuda
    from msc.errors import DeadlockError
    from cudaboot import deadlock_plan

    plan = runtime_plan(deadlock_plan())
    with pytest.raises(DeadlockError):
        compile_cuda(plan, cache=tmp_path)
    assert compile_cuda(plan, cache=tmp_path, allow_deadlock=True).cubin[:4] == b"\x7fELF"


# -- without a GPU ---------------------------------------------------------------------------
def test_probe_never_raises():
    ok, why = probe()
    assert driver_available() is ok and isinstance(why, str) and why


@pytest.mark.skipif(driver_available(), reason="checks the no-driver path")
def test_communicator_without_a_gpu_is_a_clear_usage_error():
    pytest.importorskip("torch")
    with pytest.raises(UsageError, match="needs an NVIDIA GPU and driver"):
        msc.cuda.Communicator(_plan("allreduce/ring:ring", 2))


@pytest.mark.skipif(driver_available(), reason="checks the no-driver path")
def test_bench_without_a_gpu_exits_2(tmp_path):
    plan = tmp_path / "ring.plan"
    from msc.formats.plan_text import save_plan

    save_plan(_plan("allreduce/ring:ring", 4), plan)
    done = subprocess.run([sys.executable, "-m", "msc.cli", "bench", str(plan), "--backend", "cuda", "-e", "1M"],
                          cwd=REPO, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 2, done.stderr
    assert "msc: error: the msc CUDA runtime needs an NVIDIA GPU and driver" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("collective", COLLECTIVE_NAMES)
def test_pytorch_baseline_is_the_collective(collective):
    """The bench's one-GPU PyTorch baseline, on CPU tensors, against msc.verification.reference."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from msc.verification import reference
    from msc.cuda.bench import torch_collective

    n, count = 4, 6
    ins_units, outs_units = COLLECTIVES[collective].units(n)
    for op in (REDUCE_OP_NAMES if collective in reference.REDUCING else ("sum",)):
        g = torch.Generator().manual_seed(0)
        ins = [torch.rand(ins_units * count, generator=g) + 1 for _ in range(n)]
        outs = [torch.full((outs_units * count,), 7.0) for _ in range(n)]
        torch_collective(collective, ins, outs, op, root=1)
        want = reference.expected_outputs(collective, [x.numpy() for x in ins], op=op, root=1)
        for r in range(n):
            if want[r] is not None:
                np.testing.assert_allclose(outs[r].numpy(), want[r], rtol=1e-6)


# -- the Communicator end to end with a fake driver --------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """Everything below the runtime faked (cudaboot.install_fakes): driver
    calls, torch.cuda, cuda.core."""
    pytest.importorskip("torch")
    import cudaboot

    return cudaboot.install_fakes(monkeypatch.setattr)


from cudaboot import decode_args as _decode_args  # noqa: E402


def test_communicator_virtual_with_a_fake_driver(fake_gpu):
    from msc.cuda import BrokenCommunicatorError, Communicator

    torch, mem = fake_gpu["torch"], fake_gpu["mem"]
    plan = _plan("allreduce/ring:ring", 4)
    comm = Communicator(plan, "virtual", 0, timeout_s=2.0)
    xs = [torch.ones(1000) * (r + 1) for r in range(4)]
    out = comm.all_reduce(xs)
    assert out == xs                                           # in place: the tensors themselves
    (stream, grid, block, kernel, raw), = fake_gpu["launches"]
    layout = comm.layout
    assert (grid, block, kernel) == (len(layout.blocks), layout.nthreads, ("kernel", "sm_90", "float32", "sum"))
    a = _decode_args(layout, raw)
    assert (a.count, a.first_block, a.timeout) == (1000, 0, 2_000_000_000)
    assert [a.rank[r].input for r in range(4)] == [x.data_ptr() for x in xs]
    assert all(a.rank[r].output == a.rank[r].input for r in range(4))
    arenas, bases = comm._arenas, comm._bases
    assert a.error == bases[0] + arenas[0].error
    for c in layout.connections:
        assert a.conn[c.id].slots == bases[c.receiver] + arenas[c.receiver].slots[c.id]
        assert a.conn[c.id].head == bases[c.sender] + arenas[c.sender].head[c.id]
    assert all(mem.read(b, arenas[r].size) == bytes(arenas[r].size) for r, b in enumerate(bases))   # zeroed
    # the same call again: no new memory, no new upload; a larger one grows (old arenas freed)
    comm.all_reduce(xs)
    assert fake_gpu["uploads"] == 1 and not mem.freed and comm._generation == 1
    comm.all_reduce([torch.ones(1 << 20) for _ in range(4)])
    assert comm._generation == 2 and sorted(mem.freed) == sorted(bases)
    # a launch that times out returns (nothing waits for it); the next call reads its error word, raises,
    # and the communicator is broken
    fake_gpu.update(fail=(1, 2, 0, 3, 7), layout=layout)
    comm.all_reduce(xs)
    with pytest.raises(DeviceTimeoutError, match="rank 2 threadblock 0 step 3 .* at iteration 7"):
        comm.all_reduce(xs)
    assert comm.broken and len(fake_gpu["launches"]) == 4
    with pytest.raises(BrokenCommunicatorError, match="unusable after a failed launch"):
        comm.all_reduce(xs)
    with pytest.raises(BrokenCommunicatorError):
        comm.synchronize()


def test_communicator_devices_and_out_of_place_with_a_fake_driver(fake_gpu):
    from msc.cuda import Communicator

    torch = fake_gpu["torch"]
    plan = _plan("reducescatter/ring:ring", 4, inplace=False)
    comm = Communicator(plan, "devices", [4, 5, 6, 7])
    assert sorted(fake_gpu["peer"]) == sorted((a, b) for a in range(4, 8) for b in range(4, 8) if a != b)
    xs = [torch.rand(4 * 50) for _ in range(4)]
    for r, x in enumerate(xs):
        fake_gpu["on"][x.data_ptr()] = f"cuda:{4 + r}"
    with pytest.raises(UsageError, match="rank 0 output: tensor is on cuda:0, expected cuda:4"):
        comm.reduce_scatter(None, xs)                           # outputs allocated where the fake torch puts them
    outs = [torch.empty(50) for _ in range(4)]
    for r, o in enumerate(outs):
        fake_gpu["on"][o.data_ptr()] = f"cuda:{4 + r}"
    assert comm.reduce_scatter(outs, xs, op="max") == outs
    launches = fake_gpu["launches"]
    assert [(s, g) for s, g, *_ in launches] == [(0x1000 + 4 + r, comm.layout.rank_blocks[r][1]) for r in range(4)]
    for r, (*_, kernel, raw) in enumerate(launches):
        a = _decode_args(comm.layout, raw)
        assert a.first_block == comm.layout.rank_blocks[r][0] and kernel[3] == "max"
        assert a.error == comm._bases[r] + comm._arenas[r].error
        assert (a.rank[r].input, a.rank[r].output) == (xs[r].data_ptr(), outs[r].data_ptr())
    comm.synchronize()                                         # clean error words: no error
    comm.close()
    assert not fake_gpu["mem"].blocks


def test_table_form_tables_go_to_each_gpu_once_per_kind_of_op_with_a_fake_driver(fake_gpu, monkeypatch, tmp_path):
    """The table-form kernel reads the plan from device memory: the tables are copied
    to every GPU that launches (once, however many calls), a launch's arguments point
    at its own GPU's copy, an averaging op gets its own tables (which inputs it
    pre-scales), and a copy that would happen during CUDA graph capture is refused."""
    from msc.cuda import Communicator
    from msc.cuda.codegen import plan_tables

    torch = fake_gpu["torch"]
    plan = _plan("allreduce/ring:ring", 4)
    tables, averaging = plan_tables(runtime_plan(plan)), plan_tables(runtime_plan(plan), op="avg")
    want, want_avg = tables.device_image(), averaging.device_image()
    assert want != want_avg

    def copies(image):
        return sorted(ptr for ptr, data in fake_gpu["args"].items() if data == image)

    comm = Communicator(plan, "devices", [0, 1, 2, 3], form="table", cache=tmp_path)
    assert comm.layout.form == "table" and len(copies(want)) == 4 and not copies(want_avg)    # one per GPU
    xs = [torch.rand(64) for _ in range(4)]
    for r, x in enumerate(xs):
        fake_gpu["on"][x.data_ptr()] = f"cuda:{r}"
    comm.all_reduce(xs)
    comm.all_reduce(xs, op="max")                                  # max reads the same tables as sum
    assert len(copies(want)) == 4
    seen = [_decode_args(comm.layout, raw) for *_, raw in fake_gpu["launches"]]
    assert sorted({a.threadblocks for a in seen}) == copies(want)   # each launch its own GPU's copy
    assert all(a.steps - a.threadblocks == tables.steps_offset for a in seen)
    comm.all_reduce(xs, op="avg")
    assert len(copies(want_avg)) == 4 and {_decode_args(comm.layout, raw).threadblocks
                                           for *_, raw in fake_gpu["launches"][-4:]} == set(copies(want_avg))
    capturing = Communicator(plan, "virtual", 0, form="table", cache=tmp_path)
    capturing.all_reduce(xs[:1] * 4)
    from msc.cuda import backend

    monkeypatch.setattr(backend._torch().cuda, "is_current_stream_capturing", lambda: True)    # the fake torch.cuda
    with pytest.raises(UsageError, match="tables for 'avg' are not on the device yet.*during CUDA graph capture"):
        capturing.all_reduce(xs[:1] * 4, op="avg")


def test_synchronize_reads_the_error_word_with_a_fake_driver(fake_gpu):
    from msc.cuda import Communicator

    torch = fake_gpu["torch"]
    comm = Communicator(_plan("allgather/ring:ring", 2), "virtual", 0, timeout_s=1)
    fake_gpu.update(fail=(1, 1, 0, 0, 0), layout=comm.layout)
    outs = [torch.zeros(20) for _ in range(2)]
    comm.all_gather(outs)                                      # in place: each input is unit `rank` of its output
    with pytest.raises(DeviceTimeoutError, match=r"^.*rank 1 threadblock 0 step 0 .* after 1 s at iteration 0"):
        comm.synchronize()
    assert comm.broken


def test_bench_tables_reuse_the_runner_columns():
    from msc.cuda.bench import format_baselines
    from msc.units import format_table

    rec = {"size": 1 << 20, "count": 1 << 18, "type": "float", "redop": "sum", "root": -1, "time": 50.0,
           "algbw": 20.97, "busbw": 31.46, "wrong": 0, "wrong_per_rank": [0] * 4, "inplace": True,
           "requested_size": 1 << 20, "rounded": False, "torch_time": 80.0, "torch_algbw": 13.1, "copy_time": 1.0,
           "copy_bw": 1048.6, "speedup": 1.6}
    table = format_table([rec], title="msc bench")
    assert "#wrong" in table and "1048576" in table and "Out of bounds values : 0 OK" in table
    base = format_baselines([rec]).splitlines()
    assert "speedup" in base[1] and base[-1].split()[:4] == ["1048576", "50.00", "80.00", "1.60"]


def test_a_grid_the_gpu_cannot_hold_at_once_is_refused_when_the_communicator_is_built(fake_gpu):
    """A cooperative launch needs every block resident: the occupancy API
    times the SMs is checked when the kernels compile, in the constructor."""
    from msc.cuda import Communicator
    from msc.cuda.runtime import check_resident

    plan = _plan("allreduce/allpairs:allpairs", 8)
    fake_gpu["resident"] = 100
    with pytest.raises(UsageError, match=r"^GPU 0 \(float32, sum kernel\) holds at most 100 blocks of 256 threads of "
                                         r"this kernel at once, and a launch of this plan needs 104"):
        Communicator(plan, "virtual", 0)
    assert not fake_gpu["launches"]
    fake_gpu["resident"] = 104
    Communicator(plan, "virtual", 0).close()
    check_resident(5, 256, None, "the emulated device")         # no limit: threads, not SMs
    with pytest.raises(UsageError, match="holds at most 4 blocks"):
        check_resident(5, 256, 4, "GPU 3")


def test_the_bootstrap_names_a_peer_this_process_cannot_reach():
    """Before any handle is opened: a peer on another machine, or a GPU with no
    path to ours, is named (not a raw driver error at the first open)."""
    from msc.cuda.bootstrap import Published, exchange

    class Ipc:
        def export(self, ptr):
            return bytes(64)

        def open(self, handle):
            raise AssertionError("no handle may be opened")

    def gather_from(peer):
        return lambda tag, mine: [mine, peer]

    mine = dict(ipc=Ipc(), host="node-a", device="0000:01:00.0")
    far = Published(1, 1, "cap", bytes(64), "node-b", "0000:02:00.0")
    with pytest.raises(UsageError, match=r"rank 1 runs on node-b, rank 0 on node-a: .* every rank must run on one "
                                         r"machine"):
        exchange(0, 2, 0x1000, "cap", 1, (1,), gather=gather_from(far), **mine)
    near = Published(1, 1, "cap", bytes(64), "node-a", "0000:02:00.0")
    with pytest.raises(UsageError, match=r"rank 0 cannot reach the memory of rank 1 \(0000:02:00.0\): no P2P"):
        exchange(0, 2, 0x1000, "cap", 1, (1,), gather=gather_from(near), reach=lambda d: "no P2P", **mine)


def test_a_launch_on_another_stream_waits_for_the_tables_copy(fake_gpu, monkeypatch, tmp_path):
    """The table form's tables are copied on the stream current at construction; a launch on
    another stream waits on the copy's event (until the event is seen complete)."""
    import cudaboot
    from msc.cuda import Communicator

    torch = fake_gpu["torch"]
    monkeypatch.setattr(cudaboot.FakeEvent, "query", lambda self: False)          # the copy is still queued
    comm = Communicator(_plan("allreduce/ring:ring", 4), "virtual", 0, form="table", cache=tmp_path)
    side = cudaboot.FakeStream(0)
    side.cuda_stream = 0x2000
    fake_gpu["cuda"].streams[0] = side                                             # torch's current stream now
    xs = [torch.ones(256) for _ in range(4)]
    comm.all_reduce(xs)
    assert fake_gpu["launches"][-1][0] == 0x2000 and len(side.waited) == 1
    comm.all_reduce(xs)
    assert len(side.waited) == 2                                                   # not yet seen complete
    monkeypatch.setattr(cudaboot.FakeEvent, "query", lambda self: True)
    comm.all_reduce(xs)
    comm.all_reduce(xs)
    assert len(side.waited) == 2                                                   # seen complete once: no more waits
    straight = Communicator(_plan("allreduce/ring:ring", 4), "virtual", 0, form="straight", cache=tmp_path)
    straight.all_reduce(xs)
    assert len(side.waited) == 2                                                   # no tables, nothing to wait on


def test_the_launch_says_whether_peers_share_its_gpu(fake_gpu):
    """MscArgs.local: 1 for the virtual placement (connection counters and LL packets at .gpu
    scope), 0 where peers are other GPUs, and 0 in the virtual placement when the first GPU run
    forces .sys scope (_system_scope) to check the scope separate GPUs use on one GPU."""
    from msc.cuda import Communicator

    torch = fake_gpu["torch"]
    virtual = Communicator(_plan("allgather/ring:ring", 2), "virtual", 0)
    virtual.all_gather([torch.zeros(20) for _ in range(2)])
    devices = Communicator(_plan("allgather/ring:ring", 2), "devices", [0, 1])
    outs = [torch.zeros(20) for _ in range(2)]
    fake_gpu["on"][outs[1].data_ptr()] = "cuda:1"
    devices.all_gather(outs)
    forced = Communicator(_plan("allgather/ring:ring", 2), "virtual", 0, _system_scope=True)
    forced.all_gather([torch.zeros(20) for _ in range(2)])
    flags = [_decode_args(c.layout, raw).local for c, (*_, raw) in zip((virtual, devices, devices, forced),
                                                                        fake_gpu["launches"])]
    assert flags == [1, 0, 0, 0]


_CUDA_LAUNCH = CudaBackend.launch        # before any fixture fakes it


def test_launch_failures_are_classified(fake_gpu, monkeypatch):
    """Only the driver's COOPERATIVE_LAUNCH_TOO_LARGE means the grid does not fit (a UsageError);
    any other failure is a LaunchError with the driver's words, not "cannot hold"; a failed launch
    breaks the communicator, unless it is a call's first launch refused for its size."""
    pytest.importorskip("cuda.core")
    import cuda.core

    from msc.cuda import BrokenCommunicatorError, Communicator, LaunchError
    from msc.cuda.backend import CudaBackend, launch_failure

    too_large = RuntimeError("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: too many blocks in cooperative launch")
    assert isinstance(launch_failure(too_large, "GPU 1", 300, 256), UsageError)
    other = launch_failure(RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources requested"),
                           "GPU 1", 8, 256)
    assert isinstance(other, LaunchError) and not isinstance(other, UsageError)
    assert "cannot hold" not in str(other) and "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" in other.cause
    assert (other.where, other.grid, other.block) == ("GPU 1", 8, 256)
    bad_arg = launch_failure(ValueError("unsupported kernel argument type"), "GPU 0", 8, 256)
    assert isinstance(bad_arg, LaunchError) and "ValueError: unsupported kernel argument type" in str(bad_arg)

    raised = []

    def refuse(stream, config, kernel, *args):
        raise raised[-1]

    monkeypatch.setattr(cuda.core, "LaunchConfig", lambda **kw: kw)                 # no driver to ask
    monkeypatch.setattr(cuda.core, "launch", refuse)
    monkeypatch.setattr(CudaBackend, "launch", _CUDA_LAUNCH)                       # the real one, faked below it
    torch = fake_gpu["torch"]
    xs = [torch.ones(64) for _ in range(2)]
    comm = Communicator(_plan("allreduce/ring:ring", 2), "virtual", 0)
    raised.append(too_large)
    with pytest.raises(UsageError, match=r"GPU 0 cannot hold the \d+ blocks of 256 threads of this launch at once"):
        comm.all_reduce(xs)
    assert not comm.broken                                                          # nothing ran: retry is fine
    raised.append(RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"))
    with pytest.raises(LaunchError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        comm.all_reduce(xs)
    assert comm.broken
    with pytest.raises(BrokenCommunicatorError):
        comm.all_reduce(xs)



def test_the_one_gpu_bound_counts_every_byte_the_kernel_moves():
    """bench/cuda_goals.py: the ring's kernel reads and writes 6n-4 rank-buffers of device memory per
    call (5.5 bytes per byte per rank at n = 8), so the virtual placement's busbw is at most
    4(n-1)/(n(6n-4)) of the copy bandwidth; the reviewer's 2(n-1)/n^2 is the bound for T = 2n."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_goals", Path(__file__).parent.parent / "bench" / "cuda_goals.py")
    goals = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(goals)
    for n in (2, 4, 8):
        bounds = goals.one_gpu_bounds(_plan("allreduce/ring:ring", n))
        assert bounds["traffic"] == 6 * n - 4
        assert bounds["kernel"] == pytest.approx(4 * (n - 1) / (n * (6 * n - 4)))
        assert bounds["ideal"] == pytest.approx(2 * (n - 1) / n ** 2)
    assert goals.one_gpu_bounds(_plan("allreduce/ring:ring", 8))["ideal"] == pytest.approx(0.21875)
    # instances split chunks, not bytes: the same traffic
    assert goals.kernel_traffic(_plan("allreduce/ring:ring", 8, instances=4)) == 44
