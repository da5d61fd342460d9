"""The CUDA runtime on a GPU: outputs equal the reference executor's.

Every test here is marked ``gpu`` and skipped, with the reason, where
msc.cuda.driver_available() finds no driver and GPU (or torch has no
CUDA). Written on a machine without one: none of these has run on a GPU
yet; the same cases run on the emulated device (tests/test_cuda_emu.py).

- every library algorithm at 2, 4, 8 virtual ranks, Simple and LL,
  float32 / bfloat16 / float16, sum and max, counts 1, 3, 1000, 65537 (and
  2**20 + 5 in float32), most not divisible by the chunk count; random
  inputs (never zero), outputs poisoned; bit-exact against msc.executor
  (the kernel reduces in the plan's order and rounds after every operation
  in the dtype, as the executor does); one 256 MB case on the largest
  plan;
- 100 back-to-back launches without a sync, CUDA graph capture and replay,
  growth of the buffers between calls, a side stream;
- a deadlocking plan (verify=False, compiled with allow_deadlock) and a
  rank that never launches both end with DeviceTimeoutError, then the
  communicator is broken;
- the torchrun bootstrap's real CUDA IPC exchange between two processes on
  one GPU (no kernel: two processes spinning on one GPU time-slice), and
  two torchrun ranks on one GPU refused without MPS;
- a table-form launch on a side stream ordered after the tables' copy;
- msc bench end to end.

Kernels for the sweep are compiled first, in parallel (a module fixture),
into a shared disk cache; the sweep uses the table form (the straight-line
form is covered by a smaller set).
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

import msc
from msc.cuda.device import probe
from library import algorithms

REPO = Path(__file__).resolve().parent.parent


def _gpu_reason() -> str | None:
    ok, why = probe()
    if not ok:
        return f"no CUDA GPU: {why}"
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


REASON = _gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

ALGORITHMS = algorithms(switch=False)
RANKS = (2, 4, 8)
PROTOCOLS = ("Simple", "LL")
DTYPES = ("float32", "bfloat16", "float16")
OPS = ("sum", "max")
COUNTS = (1, 3, 1000, 65537)          # every dtype and op; one larger count below, float32 sum
LARGE = (1 << 20) + 5


@lru_cache(maxsize=None)
def plan_for(key: str, n: int, protocol: str):
    from msc.lower.pipeline import LowerOptions, lower

    return lower(msc.trace(ALGORITHMS[key], n), LowerOptions(protocol=protocol))


def sweep_cases():
    return [(key, n, protocol) for key in sorted(ALGORITHMS) for n in RANKS if ALGORITHMS[key].supports(n)
            for protocol in PROTOCOLS]


def _compile_one(job):
    """NVRTC only (no driver call: the arch comes from the parent)."""
    key, n, protocol, dtype, op, arch, cache = job
    from msc.cuda import compile as compile_cuda
    from msc.cuda.runtime import runtime_plan

    plan = runtime_plan(plan_for(key, n, protocol))
    compile_cuda(plan, dtype=dtype, op=op, arch=arch, form="table", cache=Path(cache))
    return job


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A disk cache holding every sweep kernel, compiled in parallel first
    (spawned workers: a forked child of a process that initialized CUDA
    must not touch it)."""
    import multiprocessing

    from msc.cuda.device import arch
    from msc.cuda.validate import check_op

    folder = tmp_path_factory.mktemp("kernels")
    target = arch(0)
    jobs = {(key, n, protocol, dtype, check_op(plan_for(key, n, protocol), op), target, str(folder))
            for key, n, protocol in sweep_cases() for dtype in DTYPES for op in OPS}
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 4, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_one, sorted(jobs), chunksize=4))
    return folder


def _check(comm, count: int, dtype: str, op: str, seed: int) -> None:
    """One run on random inputs with poisoned outputs: bit-exact against msc.executor
    (the same check the emulated device's tests make: cudaboot.check_run)."""
    from cudaboot import check_run

    check_run(comm, count, dtype, op, seed)


@pytest.mark.parametrize("key, n, protocol", sweep_cases())
def test_library_matches_the_reference_executor(key, n, protocol, cache):
    from msc.cuda import Communicator

    plan = plan_for(key, n, protocol)
    comm = Communicator(plan, "virtual", 0, form="table", cache=cache)
    seed = 0
    for dtype in DTYPES:
        for op in OPS:
            for count in COUNTS:
                _check(comm, count, dtype, op, seed)
                seed += 1
    _check(comm, LARGE, "float32", "sum", seed)
    comm.close()


@pytest.mark.parametrize("key", ["allreduce/ring:ring", "allgather/ring:ring", "reducescatter/ring:ring",
                                 "alltoall/allpairs:allpairs", "broadcast/chain:chain", "reduce/tree:tree"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_straight_line_form_matches_too(key, protocol, tmp_path):
    from msc.cuda import Communicator

    comm = Communicator(plan_for(key, 4, protocol), "virtual", 0, form="straight", cache=tmp_path)
    for i, count in enumerate((1, 1001, 65536)):
        _check(comm, count, "bfloat16", "sum", i)


def test_256_megabytes_per_rank(cache):
    from msc.cuda import Communicator

    comm = Communicator(plan_for("allreduce/ring:ring", 8, "Simple"), "virtual", 0, form="table", cache=cache)
    _check(comm, (256 << 20) // 4 + 3, "float32", "sum", 7)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_100_back_to_back_launches_stay_right(protocol):
    """Launches queue without a sync; each sees fresh inputs and its output
    is snapshotted in-stream; all 100 are compared at the end. Counts vary,
    so tiles and slot positions change between launches."""
    import torch

    from msc.cuda import Communicator

    plan = plan_for("allreduce/ring:ring", 4, protocol)
    comm = Communicator(plan, "virtual", 0)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.empty(5000, device="cuda") for _ in range(4)]
    snaps, wants = [], []
    for i in range(100):
        count = 5000 - 37 * (i % 7)
        src = [torch.rand(count, generator=g, device="cuda") + 1 for _ in range(4)]
        for t, s in zip(tensors, src):
            t[:count].copy_(s)
        comm.all_reduce([t[:count] for t in tensors])
        snaps.append([t[:count].clone() for t in tensors])
        wants.append(torch.stack(src).sum(0))
    comm.synchronize()
    for i, (snap, want) in enumerate(zip(snaps, wants)):
        for r in range(4):
            torch.testing.assert_close(snap[r], want, rtol=4 * 2 ** -24 * 6, atol=0, msg=f"launch {i} rank {r}")


def test_cuda_graph_capture_and_replay():
    import torch

    from msc.cuda import Communicator

    comm = Communicator(plan_for("allreduce/allpairs:allpairs", 8, "LL"), "virtual", 0)
    xs = [torch.full((2048,), float(r + 1), device="cuda") for r in range(8)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_reduce(xs)                       # warm up: buffers, kernel, args block
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce(xs)
    for _ in range(5):
        for r, x in enumerate(xs):
            x.fill_(float(r + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.all(x == 36.0) for x in xs)
    comm.synchronize()


def test_growing_buffers_between_calls():
    """alltoall/hierarchical has scratch, which grows with the count (a ring's arena grows only
    until its tile is whole: reducescatter/ring allocated twice here, not three times)."""
    from msc.cuda import Communicator

    comm = Communicator(plan_for("alltoall/hierarchical:hierarchical", 4, "LL"), "virtual", 0)
    for i, count in enumerate((100, 1 << 18, 100, (1 << 19) + 1, 7)):
        _check(comm, count, "float32", "sum", i)
    assert comm._generation == 3                 # grew twice after the first allocation


def test_a_side_stream_and_out_of_place_outputs_allocated():
    import torch

    from msc.cuda import Communicator
    from msc.lower.pipeline import LowerOptions, lower

    plan = lower(msc.trace(ALGORITHMS["allgather/ring:ring"], 4, inplace=False), LowerOptions())
    comm = Communicator(plan, "virtual", 0)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xs = [torch.full((333,), float(r), device="cuda") for r in range(4)]
        outs = comm.all_gather(None, xs)
    s.synchronize()
    want = torch.cat([torch.full((333,), float(r), device="cuda") for r in range(4)])
    assert all(torch.equal(o, want) for o in outs)


def test_a_table_form_launch_on_another_stream_waits_for_the_tables():
    """The tables are copied on the stream current at construction; the first call, on a new
    stream, must be ordered after that copy (an event the launch stream waits on)."""
    import torch

    from msc.cuda import Communicator

    comm = Communicator(plan_for("allreduce/allpairs:allpairs", 8, "Simple"), "virtual", 0, form="table")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xs = [torch.full((4099,), float(r + 1), device="cuda") for r in range(8)]
        comm.all_reduce(xs)
    s.synchronize()
    assert all(torch.all(x == 36.0) for x in xs)
    comm.close()


def test_two_torchrun_ranks_on_one_gpu_are_refused():
    """Without MPS, two processes' kernels on one GPU take turns: every rank is told at its first
    call (the bootstrap), before any kernel spins."""
    import torchdist

    from msc.cuda.device import mps_active

    if mps_active():
        pytest.skip("MPS runs here: two ranks may share the GPU")
    pool = torchdist.Pool(2, timeout=120)
    try:
        got = pool.run(__import__("cudaboot").shared_gpu_case)
    finally:
        pool.close()
    assert all("runs one rank per GPU, and ranks 0, 1 on" in text for text in got), got


def test_a_deadlocking_plan_times_out_and_breaks_the_communicator():
    import torch

    from cudaboot import deadlock_plan
    from msc.cuda import BrokenCommunicatorError, Communicator, DeviceTimeoutError

    comm = Communicator(deadlock_plan(), "virtual", 0, timeout_s=0.2, allow_deadlock=True)
    xs = [torch.ones(64, device="cuda") for _ in range(2)]
    outs = [torch.empty(128, device="cuda") for _ in range(2)]
    comm.all_gather(outs, xs)
    with pytest.raises(DeviceTimeoutError) as info:
        comm.synchronize()
    err = info.value
    assert err.rank in (0, 1) and (err.tb, err.step) == (0, 0)
    assert f"a message from rank {1 - err.rank} on channel 0" in str(err)
    assert comm.broken
    with pytest.raises(BrokenCommunicatorError, match="unusable after a failed launch"):
        comm.all_gather(outs, xs)


def test_a_rank_that_never_launches_makes_its_peers_time_out():
    import torch

    from msc.cuda import Communicator, DeviceTimeoutError

    comm = Communicator(plan_for("allreduce/ring:ring", 4, "Simple"), "virtual", 0, timeout_s=0.2, _omit_ranks=(3,))
    comm.all_reduce([torch.ones(4096, device="cuda") for _ in range(4)])
    with pytest.raises(DeviceTimeoutError, match="still unmet"):
        comm.synchronize()


def test_errors_before_launch_on_real_tensors():
    import torch

    from msc.cuda import Communicator
    from msc.errors import UsageError

    comm = Communicator(plan_for("allreduce/ring:ring", 2, "Simple"), "virtual", 0)
    good = torch.ones(8, device="cuda")
    with pytest.raises(UsageError, match="rank 1 input: tensor is on cpu"):
        comm.all_reduce([good, torch.ones(8)])
    with pytest.raises(UsageError, match="rank 0 input: dtype int64"):
        comm.all_reduce([torch.ones(8, dtype=torch.int64, device="cuda"), good])
    with pytest.raises(UsageError, match="rank 1 input: tensor is not contiguous"):
        comm.all_reduce([good, torch.ones(8, 2, device="cuda")[:, 0]])
    with pytest.raises(UsageError, match="is a allreduce plan; this call is allgather"):
        comm.all_gather([good, good], [good, good])
    assert comm._arenas is None                  # nothing was allocated or launched


def test_torchrun_bootstrap_exchanges_real_ipc_handles_on_one_gpu():
    import torchdist

    pool = torchdist.Pool(2, timeout=120)
    try:
        got = pool.run(__import__("cudaboot").ipc_case)
    finally:
        pool.close()
    for rank, out in enumerate(got):
        assert out["seen"] == [2 - rank] * 4, out            # the peer's mark, read through IPC
        assert out["opened"] == [1 - rank] and out["conns"] == 2


def test_msc_bench_runs(tmp_path):
    from msc.formats.plan_text import save_plan

    plan = tmp_path / "ring.plan"
    save_plan(plan_for("allreduce/ring:ring", 4, "LL"), plan)
    done = subprocess.run([sys.executable, "-m", "msc.cli", "bench", str(plan), "--backend", "cuda", "-b", "8",
                           "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "-G", "2", "-d", "bf16"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "#wrong" in done.stdout and "Out of bounds values : 0 OK" in done.stdout and "speedup" in done.stdout
