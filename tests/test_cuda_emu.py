"""msc's CUDA kernels, run on the emulated device (msc.cuda.emu), driven by the
real Communicator: no GPU needed.

The kernel is the text NVRTC compiles, built as host C++ (each CUDA thread
a std::thread, acquire/release through std::atomic_ref), so what runs here
is the kernel's own code: its steps, protocols (Simple, LL), tile loops,
counters that persist across launches, error words and timeouts; and the
runtime's own code above it: arenas, pointer tables, argument packing,
growth, deferred error reads, the broken state, the torchrun bootstrap
(over gloo, with memory files where CUDA IPC would be).

Every result is compared with msc.executor on random inputs (never zero)
with poisoned outputs: bit-exact, but for avg (the kernel pre-multiplies by
1/n as NCCL does; the executor divides once: within a few roundings), except
in switch plans, whose avg is the executor's own division (bit-exact).

- default run: every library algorithm at 4 ranks x Simple/LL (one that
  needs more ranks at its smallest count, one protocol), the table
  form, a (dtype, op) pair per case from a rotation covering float32,
  bfloat16, float16 x sum, max, avg, counts 1, 3, 1001 and a count of
  several tiles per call; the straight-line form on a subset; 3 and 8 ranks
  on a subset; and the runtime's behaviours (back-to-back launches, growth,
  timeouts, torchrun in 2 processes, numerics of the half types, the
  vector path on misaligned chunks, LL flags across 2^32, the build cache);
- ``-m slow``: the cross product, every algorithm x Simple/LL x the table
  form x float32/bfloat16/float16 x sum/max/avg (data-movement collectives:
  one kernel for every op) x the four counts, and the straight-line form x
  each dtype with an op that rotates over the cases (every (dtype, op) in
  the straight form in several algorithms: straight_share); and the
  library's switch algorithms (NVLS) x rank counts x in place or not x 1 or
  2 instances x the table form x every (dtype, op) the switch reduces, the
  straight form x each dtype, the op rotating (tests/test_switch_runtime.py
  has their default cases). A table-form kernel holds no plan (one build per
  protocol, dtype and op serves every plan); a straight-line kernel is one
  build per plan, dtype and op (0.7-1.1 CPU-s with g++ 12 -O1 and the
  precompiled headers): the full straight product was 1,098 builds, most of
  the slow run's kernel builds; it is 338 now.

What emulation cannot show: speed, occupancy, and what only GPU hardware
does (.gpu vs .sys scopes, stale L1 lines, warp scheduling): see docs/cuda.md.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import struct
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import msc
from cudaboot import check_run, deadlock_plan, np_dtype, queued_allreduces_are_right
from library import algorithms
from patience import patience
from msc.cuda import Communicator, DeviceTimeoutError
from msc.cuda.compiler import compile_host
from msc.cuda.diagnose import BrokenCommunicatorError
from msc.cuda.hostbuild import find_compiler
from msc.cuda.runtime import runtime_plan
from msc.cuda.validate import check_op
from msc.errors import UsageError
from msc.ir.ops import REDUCE_OP_NAMES
from msc.lower.pipeline import LowerOptions, lower

try:
    find_compiler()
    NO_COMPILER = None
except UsageError as exc:
    NO_COMPILER = str(exc)
pytestmark = pytest.mark.skipif(NO_COMPILER is not None, reason=NO_COMPILER or "")

ALGORITHMS = algorithms(switch=False)
KEYS = sorted(ALGORITHMS)
PROTOCOLS = ("Simple", "LL")
FORMS = ("straight", "table")
DTYPES = ("float32", "bfloat16", "float16")
OPS = REDUCE_OP_NAMES                      # every op of the registry (msc.ir.ops)
TILE = 4096                                # bytes per chunk and iteration: several tiles per call at small counts
COUNTS = (1, 3, 1001, 8197)                # 8197: 2-9 tiles per chunk, by dtype and chunk factor
N = 4


@lru_cache(maxsize=None)
def plan_for(key: str, n: int, protocol: str, tile: int = TILE):
    return lower(msc.trace(ALGORITHMS[key], n), LowerOptions(protocol=protocol, tile=tile))


def kernels_of(key: str, n: int, protocol: str) -> list[tuple[str, str]]:
    """(dtype, op) of the kernels a plan needs: data-movement collectives use one for every op."""
    plan = plan_for(key, n, protocol)
    return sorted({(d, check_op(plan, op, d)) for d in DTYPES for op in OPS})


def build_all(jobs, cache: Path) -> None:
    """Build host kernels in parallel (the compiler runs outside the GIL); the
    first alone, so that the precompiled headers are made once."""
    def one(job):
        key, n, protocol, form, dtype, op = job
        compile_host(runtime_plan(plan_for(key, n, protocol)), dtype=dtype, op=op, form=form, cache=cache)
    jobs = sorted(set(jobs))
    if jobs:
        one(jobs[0])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(one, jobs[1:]))


def comm_for(key, n, protocol, form, dtype, op, cache, **kw):
    return Communicator(plan_for(key, n, protocol), "virtual", device="emu", form=form, cache=cache,
                        dtypes=(dtype,), ops=(op,), timeout_s=kw.pop("timeout_s", 60), **kw)


# -- the library, bit-exact -------------------------------------------------------------------
ROTATION = [(d, o) for o in OPS for d in DTYPES]            # 15 pairs; a case takes the next


def default_cases():
    out = []
    for i, key in enumerate(k for k in KEYS if ALGORITHMS[k].supports(N)):
        for j, protocol in enumerate(PROTOCOLS):
            plan = plan_for(key, N, protocol)
            dtype, op = ROTATION[(2 * i + j) % len(ROTATION)]
            out.append((key, protocol, dtype, check_op(plan, op, dtype)))
    return out


STRAIGHT = [("allreduce/ring:ring", "LL"), ("allreduce/allpairs:allpairs", "Simple"), ("allgather/ring:ring", "Simple"),
            ("reducescatter/allpairs:allpairs", "LL"), ("alltoall/hierarchical:hierarchical", "Simple"),
            ("broadcast/binomial_tree:binomial_tree", "LL"), ("reduce/tree:tree", "Simple")]
OTHER_RANKS = [("allreduce/ring:ring", 8, "Simple"), ("allreduce/hierarchical:hierarchical", 8, "LL"),
               ("allgather/allpairs:allpairs", 3, "LL"), ("reducescatter/ring:ring", 3, "Simple"),
               ("alltoall/allpairs:allpairs", 8, "Simple"), ("allreduce/tree:double_binary", 3, "LL")]


def ranks_for(key: str) -> int:
    """N, or the smallest count above it the algorithm supports (nodes of 8, a 3x3 torus)."""
    return next(n for n in range(N, 65) if ALGORITHMS[key].supports(n))


# algorithms that need more ranks than N: their smallest count, one protocol each
OTHER_RANKS += [(key, ranks_for(key), PROTOCOLS[i % 2]) for i, key in enumerate(k for k in KEYS if ranks_for(k) != N)]


@pytest.fixture(scope="module")
def cache(kernel_cache):
    folder = kernel_cache
    jobs = [(key, N, protocol, "table", dtype, op) for key, protocol, dtype, op in default_cases()]
    jobs += [(key, N, protocol, "straight", "bfloat16", "sum") for key, protocol in STRAIGHT]
    jobs += [(key, n, protocol, "table", "float32", "sum") for key, n, protocol in OTHER_RANKS]
    build_all(jobs, folder)
    return folder


@pytest.mark.parametrize("key, protocol, dtype, op", default_cases())
def test_library_matches_the_reference_executor(key, protocol, dtype, op, cache):
    comm = comm_for(key, N, protocol, "table", dtype, op, cache)
    for i, count in enumerate(COUNTS):
        check_run(comm, count, dtype, op, seed=i)
    comm.close()


@pytest.mark.parametrize("key, protocol", STRAIGHT)
def test_straight_line_form_matches_too(key, protocol, cache):
    comm = comm_for(key, N, protocol, "straight", "bfloat16", "sum", cache)
    assert comm.layout.form == "straight"
    for i, count in enumerate(COUNTS):
        check_run(comm, count, "bfloat16", "sum", seed=10 + i)
    comm.close()


@pytest.mark.parametrize("key, n, protocol", OTHER_RANKS)
def test_other_rank_counts(key, n, protocol, cache):
    comm = comm_for(key, n, protocol, "table", "float32", "sum", cache)
    for i, count in enumerate((5, 8197)):
        check_run(comm, count, "float32", "sum", seed=20 + i)
    comm.close()


def sweep_cases():
    return [(key, protocol) for key in KEYS for protocol in PROTOCOLS]


def straight_share(kernels: list[tuple[str, str]], case: int) -> list[tuple[str, str]]:
    """The straight-line form's kernels of a sweep case: one per dtype, its op the case's turn
    (``case``-th, shifted by the dtype) among that dtype's kernels, so that across the cases each
    (dtype, op) is built straight in several algorithms (test_straight_share_covers_every_kernel)."""
    by_dtype: dict[str, list[tuple[str, str]]] = {}
    for kernel in kernels:
        by_dtype.setdefault(kernel[0], []).append(kernel)
    return [group[(case + j) % len(group)] for j, group in enumerate(by_dtype.values())]


def sweep_kernels(key: str, protocol: str) -> dict[str, list[tuple[str, str]]]:
    """A sweep case's (dtype, op) kernels by form: the table form all of them, the straight form its share."""
    kernels = kernels_of(key, ranks_for(key), protocol)
    return {"table": kernels, "straight": straight_share(kernels, sweep_cases().index((key, protocol)))}


def test_straight_share_covers_every_kernel():
    """The slow sweep builds every (dtype, op) kernel in the straight-line form in two algorithms at
    least (where two need it), and every dtype in every case; the switch sweep every pair it reduces."""
    need: dict[tuple[str, str], set[str]] = {}
    built: dict[tuple[str, str], set[str]] = {}
    for key, protocol in sweep_cases():
        kernels = sweep_kernels(key, protocol)
        assert {d for d, _ in kernels["straight"]} == {d for d, _ in kernels["table"]}, (key, protocol)
        for kernel in kernels["table"]:
            need.setdefault(kernel, set()).add(key)
        for kernel in kernels["straight"]:
            built.setdefault(kernel, set()).add(key)
    few = {k: sorted(built.get(k, ())) for k, keys in need.items() if len(built.get(k, ())) < min(2, len(keys))}
    assert not few, f"built straight in fewer than two algorithms: {few}"
    from test_switch_runtime import SWITCH_PAIRS

    switch = {pair for i in range(len(switch_sweep_cases())) for pair in straight_share(SWITCH_PAIRS, i)}
    assert switch == set(SWITCH_PAIRS)


@pytest.mark.slow
@pytest.mark.parametrize("key, protocol", sweep_cases())
def test_sweep_every_form_dtype_op_and_count(key, protocol, kernel_cache):
    """The table form's cross product for one algorithm and protocol, and the straight form's share."""
    seed, n, kernels = 0, ranks_for(key), sweep_kernels(key, protocol)
    # this case's kernels, in parallel; xdist shards the cases, and a kernel another case built (the
    # table form's, shared by every plan) is a hit in the session's cache
    build_all([(key, n, protocol, form, dtype, op) for form in FORMS for dtype, op in kernels[form]], kernel_cache)
    for form in FORMS:
        for dtype, op in kernels[form]:
            comm = comm_for(key, n, protocol, form, dtype, op, kernel_cache)
            ops = [o for o in OPS if check_op(comm.plan, o, dtype) == op]       # one data-movement kernel: all ops
            for o in ops:
                for count in COUNTS:
                    check_run(comm, count, dtype, o, seed)
                    seed += 1
            comm.close()


# -- switch plans (NVLS): every (dtype, op) the switch reduces ------------------------------------
def switch_sweep_cases():
    """The library's switch algorithms x rank counts x in place or not x 1 or 2 instances."""
    from test_switch_runtime import SWITCH_KEYS, switch_plan

    out = []
    for key, counts in SWITCH_KEYS.items():
        for n in counts:
            out += [(key, n, inplace, instances) for inplace in (True, False) for instances in (1, 2)]
    assert all(switch_plan(*case).first_switch_step() for case in out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("key, n, inplace, instances", switch_sweep_cases())
def test_switch_sweep_every_form_dtype_and_op_the_switch_reduces(key, n, inplace, instances, kernel_cache):
    """Bit-exact against msc.executor for every (dtype, op) of msc.cuda.switch.supported_pairs
    (avg included: the switch's sum, then the division pass) in the table form, each dtype in the
    straight form (the op rotating over the cases: straight_share), counts that leave tails."""
    from test_switch_runtime import SWITCH_PAIRS, counts_for, switch_plan

    plan, seed = switch_plan(key, n, inplace, instances), 100
    pairs = {"table": SWITCH_PAIRS, "straight": straight_share(SWITCH_PAIRS, switch_sweep_cases().index(
        (key, n, inplace, instances)))}
    for form in FORMS:
        for dtype, op in pairs[form]:
            comm = Communicator(plan, "virtual", device="emu", form=form, cache=kernel_cache, dtypes=(dtype,),
                                ops=(op,), timeout_s=60)
            for count in counts_for(plan, dtype):
                check_run(comm, count, dtype, op, seed)
                seed += 1
            comm.close()


# -- the runtime's behaviours ---------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_back_to_back_launches_without_a_sync_under_devices(protocol, cache):
    """100 launches queue on 4 emulated devices (a stream each) with no
    synchronize between them; each call has buffers of its own and a count
    of its own, so tiles, slot positions and flags move between launches.
    The counters persist across launches: every result must be right."""
    plan = plan_for("allreduce/ring:ring", 4, protocol)
    comm = Communicator(plan, "devices", [0, 1, 2, 3], device="emu", cache=cache, timeout_s=60)
    queued_allreduces_are_right(comm, plan, [500 - 37 * (i % 7) for i in range(100)], seed=0)
    comm.close()


def test_buffers_grow_between_calls_and_results_stay_right(cache):
    plan = plan_for("reducescatter/ring:ring", 4, "LL", 0)          # the default tile: 8192 floats a chunk
    comm = Communicator(plan, device="emu", cache=cache)
    for i, count in enumerate((100, 2000, 100, 6001, 7)):
        check_run(comm, count, "float32", "sum", seed=i)
    assert comm._generation == 3                 # grew twice after the first allocation
    comm.close()


def test_out_of_place_with_torch_cpu_tensors_and_outputs_allocated(cache):
    torch = pytest.importorskip("torch")
    plan = lower(msc.trace(ALGORITHMS["allgather/ring:ring"], 4, inplace=False), LowerOptions())
    comm = Communicator(plan, "virtual", device="emu", cache=cache)
    xs = [torch.full((333,), float(r + 1)) for r in range(4)]
    outs = comm.all_gather(None, xs)
    comm.synchronize()
    want = torch.cat([torch.full((333,), float(r + 1)) for r in range(4)])
    assert all(torch.equal(o, want) for o in outs)
    with pytest.raises(UsageError, match="rank 1 input: tensor is on meta, expected cpu"):
        comm.all_gather(None, [xs[0], torch.empty(333, device="meta"), xs[2], xs[3]])
    comm.close()


def test_a_deadlocking_plan_times_out_naming_rank_threadblock_and_step(cache):
    comm = Communicator(deadlock_plan(), "virtual", device="emu", timeout_s=0.3, allow_deadlock=True, cache=cache)
    xs = [np.ones(64, np.float32) for _ in range(2)]
    outs = [np.zeros(128, np.float32) for _ in range(2)]
    comm.all_gather(outs, xs)
    with pytest.raises(DeviceTimeoutError) as info:
        comm.synchronize()
    err = info.value
    assert err.rank in (0, 1) and (err.tb, err.step, err.iteration) == (0, 0, 0)
    assert f"rank {err.rank} threadblock 0 step 0 (recv) timed out in a spin-wait after 0.3 s" in str(err)
    assert f"still unmet: a message from rank {1 - err.rank} on channel 0" in str(err)
    assert comm.broken
    with pytest.raises(BrokenCommunicatorError, match="unusable after a failed launch"):
        comm.all_gather(outs, xs)
    comm.close()


def test_a_rank_that_never_launches_makes_its_peers_time_out(cache):
    comm = Communicator(plan_for("allreduce/ring:ring", 4, "Simple"), "virtual", device="emu", timeout_s=0.3,
                        _omit_ranks=(3,), cache=cache)
    comm.all_reduce([np.ones(4096, np.float32) for _ in range(4)])
    with pytest.raises(DeviceTimeoutError, match=r"still unmet: a message from rank \d") as info:
        comm.synchronize()
    # whichever of ranks 0-2 gave up first: each waits on its ring predecessor, rank 0 on rank 3
    err = info.value
    assert err.rank in (0, 1, 2) and err.step is not None
    assert f"a message from rank {(err.rank - 1) % 4} on channel" in str(err)
    comm.close()


def test_the_next_call_reports_a_timeout_without_a_synchronize(cache):
    comm = Communicator(deadlock_plan(), "virtual", device="emu", timeout_s=0.2, allow_deadlock=True, cache=cache)
    xs, outs = [np.ones(8, np.float32)] * 2, [np.zeros(16, np.float32) for _ in range(2)]
    comm.all_gather(outs, xs)
    comm.backend.synchronize(0)                  # the launch has finished; nothing read its error word yet
    with pytest.raises(DeviceTimeoutError):
        comm.all_gather(outs, xs)                # deferred read at the next call
    assert comm.broken
    comm.close()


# -- numerics and the element loops -----------------------------------------------------------------
def _special_floats(rng) -> np.ndarray:
    edges = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, 6.1035156e-05, 6.0975552e-05, 5.9604645e-08,
             2.9802322e-08, 2.9802326e-08, 1e-10, 3.3895314e38, 3.4028235e38, np.inf, -np.inf, 1.00390625, 1.0039063,
             1.01171875, 2.0 ** -133, 2.0 ** -126]
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    rnd = bits.view(np.float32)
    rnd = rnd[np.isfinite(rnd)]
    near = (np.float32(1.5) * (1 + rng.standard_normal(20000).astype(np.float32) * np.float32(1e-3)))
    return np.concatenate([np.array(edges, np.float32), rnd, near, -near]).astype(np.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_rounding_is_numpys(dtype, cache):
    """The kernel's float -> half rounding (software on the host, and for
    bfloat16 below sm_80) against numpy/ml_dtypes, on edge cases, random bit
    patterns and ties."""
    comm = Communicator(plan_for("allreduce/ring:ring", 2, "Simple"), device="emu", dtypes=(dtype,), cache=cache)
    kernel = comm._kernels["host"].loaded(dtype, "sum")
    x = _special_floats(np.random.default_rng(1))
    out = np.zeros(x.size, np.uint16)
    kernel.lib.msc_round(x.ctypes.data, out.ctypes.data, x.size)
    with np.errstate(over="ignore"):                        # values past the largest half round to inf
        want = x.astype(np_dtype(dtype)).view(np.uint16)
    bad = np.flatnonzero(out != want)
    assert bad.size == 0, f"{bad.size} of {x.size} differ, e.g. {x[bad[:5]]}: {out[bad[:5]]} vs {want[bad[:5]]}"
    comm.close()


@pytest.mark.parametrize("key, share", [("allreduce/ring:ring", 0.99), ("reducescatter/ring:ring", 0.24)])
def test_the_vector_path_serves_misaligned_chunks(key, share, cache):
    """An odd bfloat16 count puts chunks mid-vector: the 16-byte path still
    serves the bulk once head and tail are peeled, wherever a step's
    operands sit at one offset within 16 bytes (slots and scratch place a
    chunk at its class's offset). Where they cannot (the data changes unit
    between a rank's buffers, as in reduce-scatter's last step), the step
    takes scalars."""
    plan = lower(msc.trace(ALGORITHMS[key], 4), LowerOptions())
    comm = Communicator(plan, device="emu", dtypes=("bfloat16",), cache=cache)
    kernel = comm._kernels["host"].loaded("bfloat16", "sum")
    before = kernel.path_counts()
    check_run(comm, 100_001, "bfloat16", "sum", seed=3)
    vector, scalar = (a - b for a, b in zip(kernel.path_counts(), before))
    assert vector + scalar > 0 and vector / (vector + scalar) >= share, (vector, scalar)
    comm.close()


def test_ll_flags_wrap_around_2_to_the_32(cache):
    """LL's flag is the low 32 bits of a message's sequence number + 1, and
    a message's slot its sequence number modulo the slots. After a first
    call fills every slot, shift every connection's counters and every
    packet's flag as if messages had passed until the counters stand 5 below
    2^32: the next call crosses the wrap (the flags' and the slot index's,
    whose 64-bit remainder the kernel computes in 32-bit halves) and every
    call must still be right."""
    plan = plan_for("allreduce/ring:ring", 4, "LL", 256)          # 64 floats a tile: many messages a call
    comm = Communicator(plan, "virtual", device="emu", cache=cache, timeout_s=30)
    check_run(comm, 4099, "float32", "sum", seed=0)
    comm.synchronize()
    be, arenas, bases = comm.backend, comm._arenas, comm._bases
    for c in comm.layout.connections:
        ends = (bases[c.receiver] + arenas[c.receiver].tail[c.id], bases[c.sender] + arenas[c.sender].head[c.id])
        (v,), (w,) = (struct.unpack("<Q", be.read(0, where, 8)) for where in ends)
        assert v == w >= comm.slots                             # every message read, every slot holds one's packet
        shift = (1 << 32) - 5 - v
        for where in ends:
            be.write(0, where, struct.pack("<Q", v + shift))
        start = bases[c.receiver] + arenas[c.receiver].slots[c.id]
        size = comm._capacity.slots[c.id]
        packets = np.frombuffer(be.read(0, start, size), np.uint64).copy()
        flags = packets >> np.uint64(32)
        written = flags != 0
        flags[written] = (flags[written] + np.uint64(shift)) % np.uint64(1 << 32)
        packets = (flags << np.uint64(32)) | (packets & np.uint64(0xFFFFFFFF))
        be.write(0, start, packets.tobytes())
    for i in range(3):
        check_run(comm, 4099, "float32", "sum", seed=1 + i)
    tail = arenas[comm.layout.connections[0].receiver].tail[0]
    (after,) = struct.unpack("<Q", be.read(0, bases[comm.layout.connections[0].receiver] + tail, 8))
    assert after > 1 << 32                                      # the counters did cross 2^32
    comm.close()


# -- the host build ---------------------------------------------------------------------------------
def test_a_second_build_is_a_cache_hit_and_a_damaged_library_is_rebuilt(cold_cache):
    plan = runtime_plan(plan_for("allgather/ring:ring", 2, "LL"))
    first = compile_host(plan, cache=cold_cache)
    assert not first.cache_hit and first.library.is_file()
    again = compile_host(plan, cache=cold_cache)
    assert again.cache_hit and again.library == first.library
    first.library.write_bytes(b"")                           # a truncated or forged entry is never loaded
    rebuilt = compile_host(plan, cache=cold_cache)
    assert not rebuilt.cache_hit and rebuilt.library.stat().st_size > 1000
    assert first.library.with_name("kernel.cpp").read_text().startswith("// Generated by msc")


def test_table_form_plans_share_one_library_and_a_new_plan_needs_no_build(cache):
    """One table-form library per (protocol, dtype, op) runs every plan: a plan the
    cache has never seen (another collective, rank count and shape) builds nothing
    and still matches the reference executor, next to the first plan's communicator."""
    first = comm_for("allreduce/ring:ring", 8, "Simple", "table", "float32", "sum", cache)
    fresh = runtime_plan(plan_for("reducescatter/allpairs:allpairs", 5, "Simple"))
    compiled = compile_host(fresh, form="table", cache=cache)
    assert compiled.cache_hit and compiled.library == compile_host(
        runtime_plan(plan_for("allreduce/ring:ring", 8, "Simple")), form="table", cache=cache).library
    second = comm_for("reducescatter/allpairs:allpairs", 5, "Simple", "table", "float32", "sum", cache)
    for i, count in enumerate((7, 8197)):
        check_run(second, count, "float32", "sum", seed=40 + i)
        check_run(first, count, "float32", "sum", seed=50 + i)
    first.close()
    second.close()



def test_a_constructor_starts_no_thread(cache):
    """Building a communicator (kernels, and the table form's tables) starts
    no thread: streams start at the first call, so a process may build
    communicators and then fork (bench/emu_faults.py's servers do)."""
    import subprocess
    import sys

    code = (
        "import sys, threading; sys.path.insert(0, {tests!r})\n"
        "from pathlib import Path\n"
        "from test_cuda_emu import plan_for\n"
        "from msc.cuda import Communicator\n"
        "plan = plan_for('allreduce/ring:ring', 4, 'Simple')\n"
        "before = threading.active_count()\n"
        "Communicator(plan, 'virtual', device='emu', form='table', cache=Path({cache!r})).close()\n"
        "print(before, threading.active_count())\n"
    ).format(tests=str(Path(__file__).parent), cache=str(cache))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patience(300))
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split())
    assert after == before


def test_a_forked_child_gets_streams_of_its_own(cache):
    """fork copies the emulated device's streams but not their worker threads:
    in the child, communicators made before and after the fork run bit-exact
    on new streams, and a stream object kept from before the fork refuses
    work with an error instead of queueing it for a worker that is not there."""
    from msc.cuda import emu

    before = comm_for("allreduce/ring:ring", 4, "Simple", "table", "float32", "sum", cache)
    check_run(before, 33, "float32", "sum", seed=1)           # its streams and their workers exist now
    old_stream = emu.backend().streams[before.devices[0]]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                              # the child: report through the pipe, never return
        try:
            check_run(before, 33, "float32", "sum", seed=2)
            after = comm_for("allreduce/ring:ring", 4, "Simple", "table", "float32", "sum", cache)
            check_run(after, 1001, "float32", "sum", seed=3)
            try:
                old_stream.submit(lambda: None)
                outcome = "the pre-fork stream took work"
            except UsageError as exc:
                outcome = "ok" if "before a fork" in str(exc) else f"unexpected message: {exc}"
        except BaseException as exc:                          # noqa: BLE001 (reported to the parent)
            outcome = f"{type(exc).__name__}: {exc}"
        os.write(write, outcome.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        if select.select([pipe], [], [], 120)[0]:
            outcome = pipe.read().decode()
        else:                                                 # a launch queued for a missing worker hangs
            os.kill(pid, signal.SIGKILL)
            outcome = "the child hung for 120 s"
    _, status = os.waitpid(pid, 0)
    assert outcome == "ok" and os.waitstatus_to_exitcode(status) == 0, outcome
    check_run(before, 33, "float32", "sum", seed=4)          # the parent's streams still work
    before.close()

def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    from msc.cuda import hostbuild

    monkeypatch.setenv("MSC_CXX", "/nonexistent/g++")
    hostbuild._identify.cache_clear()
    with pytest.raises(UsageError, match=r"builds kernels with a C\+\+20 compiler and found none \(looked for "
                                         r"/nonexistent/g\+\+"):
        compile_host(runtime_plan(plan_for("allgather/ring:ring", 2, "LL")), cache=tmp_path)
    hostbuild._identify.cache_clear()


def test_an_args_block_of_another_size_is_refused(cache):
    from msc.cuda import emu
    from msc.cuda.launch import MscArgsHeader

    compiled = compile_host(runtime_plan(plan_for("allreduce/allpairs:allpairs", 4, "Simple")), cache=cache)
    size = ctypes.sizeof(MscArgsHeader)
    assert emu.load(compiled.library, compiled.layout, "float32", "sum", True, size).lib.msc_args_size() == size
    with pytest.raises(UsageError, match=f"takes a {size}-byte MscArgs, msc packs {size + 8}"):
        emu.load(compiled.library, compiled.layout, "float32", "sum", True, size + 8)


def test_a_call_too_long_for_the_progress_counters_is_refused():
    from msc.cuda.codegen import kernel_layout
    from msc.cuda.launch import PROGRESS_LIMIT, launch_params

    plan = runtime_plan(plan_for("allreduce/ring:ring", 4, "Simple", 32))       # 8 floats a tile
    layout = kernel_layout(plan, "table")
    ok = launch_params(layout, 4 * 8 * 1000, dtype="float32", protocol="Simple", tile_bytes=32)
    assert ok.iterations == 1000
    count = 4 * 8 * (PROGRESS_LIMIT // layout.max_steps + 1)
    with pytest.raises(UsageError, match=r"moves \d+ tiles per chunk through threadblocks of up to \d+ steps.*"
                                         r"counts at most 4294967295"):
        launch_params(layout, count, dtype="float32", protocol="Simple", tile_bytes=32)


# -- torchrun: one process per rank, memory files where CUDA IPC would be -------------------------------
@pytest.mark.parametrize("key, protocol", [("allreduce/ring:ring", "Simple"), ("allreduce/allpairs:allpairs", "LL"),
                                           ("allgather/ring:ring", "LL"), ("reducescatter/allpairs:allpairs", "Simple"),
                                           ("alltoall/allpairs:allpairs", "LL"), ("reduce/tree:tree", "Simple"),
                                           ("allreduce/nvls:nvls", "Simple")])      # switch: the peers' arenas
def test_torchrun_placement_in_two_processes(key, protocol, gloo2):
    import cudaboot

    got = gloo2.run(cudaboot.emu_torchrun_case, key, protocol, (1, 1001, 70001))
    assert got[0] == got[1] == "ok", got


def test_torchrun_ranks_that_make_different_calls_get_errors_not_a_hang(gloo2):
    """Rank 1 makes a larger call than rank 0: it grows its buffers and waits
    for rank 0 at the bootstrap, which never comes; rank 0 launches on its old
    buffers and its kernel waits for rank 1's blocks. Both end with an error
    within their timeouts."""
    import cudaboot

    got = gloo2.run(cudaboot.emu_mismatch_case)
    assert got[0].startswith("DeviceTimeoutError") and "still unmet: a message from rank 1" in got[0], got[0]
    assert got[1].startswith("UsageError") and "for rank(s) 0 (process group ranks 0), which never came" in got[1]
    assert "every rank must make the same calls" in got[1]


def test_torchrun_peers_on_another_machine_are_named(gloo2):
    import cudaboot

    got = gloo2.run(cudaboot.emu_other_host_case)
    assert "rank 1 runs on host-b" in got[0] and "every rank must run on one machine" in got[0], got
    assert "rank 0 runs on host-a" in got[1], got


# -- msc run --backend emu ----------------------------------------------------------------------------
def test_msc_run_on_the_emulated_device(tmp_path):
    from clirun import msc as run_msc          # in this process (tests/test_cli_processes.py: as a process)
    from msc.formats.plan_text import save_plan

    save_plan(plan_for("reducescatter/allpairs:allpairs", 4, "LL"), tmp_path / "rs.plan")
    done = run_msc("run", tmp_path / "rs.plan", "--backend", "emu", "-b", "64", "-e", "64K", "-f", "32", "-d", "bf16",
                   "-o", "max")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "backend emu (the plan's CUDA kernel on the emulated device" in lines[0]
    assert "4 threads per block where a GPU runs 256" in lines[0]
    assert lines[2].split() == ["#", "size", "count", "type", "redop", "root", "host", "#wrong"]
    rows = [x.split() for x in lines if not x.startswith("#")]
    assert [r[0] for r in rows] == ["64", "2048", "65536"] and all(r[-1] == "0" for r in rows)
    assert "Out of bounds values : 0 OK" in done.stdout and "no bandwidth" in done.stdout
    bad = run_msc("run", tmp_path / "rs.plan", "--backend", "emu", "-d", "int64")
    assert bad.returncode == 2 and "no data type 'int64'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow          # 7-14 s: CI's slow run; the default run stays short
def test_torchrun_communicators_of_disjoint_subgroups_stay_apart():
    pytest.importorskip("torch")
    import cudaboot
    import torchdist

    pool = torchdist.Pool(4, timeout=180)
    try:
        got = pool.run(cudaboot.emu_subgroups_case)
    finally:
        pool.close()
    assert got == [(11.0, 11.0)] * 2 + [(1100.0, 1100.0)] * 2


def test_kernels_compile_in_the_constructor_and_waits_last_minutes(cache):
    """Compiling before any rendezvous: the constructor builds the kernels it
    is asked for, so first-call compile skew between ranks is not spent in
    spin-waits; the default timeout outlasts first-iteration skew."""
    comm = Communicator(plan_for("allreduce/ring:ring", 4, "LL"), device="emu", dtypes=("float32", "bfloat16"),
                        ops=("sum", "max"), cache=cache)
    kernels = comm._kernels["host"]
    assert all(kernels.has(d, o) for d in ("float32", "bfloat16") for o in ("sum", "max"))
    assert not kernels.has("float16", "sum") and comm.timeout_s == 300
    comm.close()


def test_msc_bench_on_the_emulated_device_counts_wrong_elements(monkeypatch, tmp_path):
    """msc.cuda.bench on the emulated device: it compiles only its kernel, times, measures the
    baselines, and its on-device check (random small integers against PyTorch's collective) counts
    an element changed after the kernel ran."""
    pytest.importorskip("torch")
    from msc.cuda import bench as mb

    plan = plan_for("allreduce/ring:ring", N, "Simple")
    out = mb.bench(plan, min_bytes="4K", max_bytes="16K", factor=4, iters=1, warmup=0, dtype="bf16", check="device",
                   backend="emu", timeout_s=30)
    assert out["backend"] == "emu" and out["wrong"] == 0
    assert [r["size"] for r in out["records"]] == [4096, 16384]
    assert all(r["time"] > 0 and r["copy_bw"] > 0 and r["torch_time"] > 0 for r in out["records"])
    real = mb.run_once

    def corrupted(comm, ins, outs, count, op):
        got = real(comm, ins, outs, count, op)
        comm.synchronize()
        got[1][count // 2] += 1
        return got

    monkeypatch.setattr(mb, "run_once", corrupted)
    out = mb.bench(plan, min_bytes="4K", max_bytes="4K", iters=1, warmup=0, dtype="bf16", check="device",
                   backend="emu", baselines=False)
    assert out["wrong"] == 1 and out["records"][0]["wrong_per_rank"] == [0, 1, 0, 0]
    with pytest.raises(UsageError, match="an on-device check needs an op exact in any order"):
        mb.bench(plan, min_bytes="4K", max_bytes="4K", iters=1, warmup=0, dtype="bf16", op="prod", check="device",
                 backend="emu")
