"""Cases for tests/test_cuda_runtime.py that run in torch.distributed (gloo)
worker processes (tests/torchdist.Pool): module-level, so spawn finds them.

The torchrun bootstrap with the IPC calls faked: each process "allocates"
its arena at an address of its own, "exports" a handle holding the owner's
rank and address, and "opens" a peer's handle at yet another address of
its own (as real IPC does: the same memory, a different address in every
process). Each process builds its pointer tables and returns them resolved
to (rank, region, offset): the logical layout, which must be the same in
every process and the same as the virtual placement's.
"""
from __future__ import annotations

import functools

FAKE_ARENA = 1 << 40           # a fake arena address space per (process, owner rank)


@functools.cache
def runtime_layout(key: str, n: int, protocol: str = "Simple"):
    """A library plan as the runtime compiles it (8 slots) and its kernel layout."""
    import msc
    from msc.cuda.codegen import kernel_layout
    from msc.cuda.runtime import runtime_plan
    from msc.lower.pipeline import LowerOptions, lower
    from library import algorithms

    plan = runtime_plan(lower(msc.trace(algorithms(switch=False)[key], n), LowerOptions(protocol=protocol)))
    return plan, kernel_layout(plan, "table")


def fake_base(process: int, owner: int) -> int:
    return FAKE_ARENA * (1 + process * 16 + owner)


class FakeIpc:
    def __init__(self, process: int):
        self.process = process
        self.opened = []

    def export(self, ptr: int) -> bytes:
        owner = next(r for r in range(16) if fake_base(self.process, r) == ptr)
        return owner.to_bytes(8, "little") + ptr.to_bytes(8, "little") + bytes(48)

    def open(self, handle: bytes) -> int:
        assert len(handle) == 64
        owner = int.from_bytes(handle[:8], "little")
        self.opened.append(owner)
        return fake_base(self.process, owner)


def deadlock_plan():
    """A 2-rank allgather plan where both ranks receive before they send: it
    deadlocks at any slot count (load such a plan with verify=False; the
    runtime compiles it with allow_deadlock=True)."""
    from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock

    ranks = []
    for r in (0, 1):
        p = 1 - r
        talk = Threadblock(0, p, p, 0, (Step(StepOp.RECV, (), Slice("output", p, 1), 1),
                                         Step(StepOp.SEND, (Slice("input", 0, 1),), None, 1)))
        local = Threadblock(1, None, None, 0, (Step(StepOp.COPY, (Slice("input", 0, 1),), Slice("output", r, 1), 1),))
        ranks.append(RankPlan(r, 0, (talk, local)))
    return Plan("deadlock", "allgather", 2, 1, False, 1, 2, tuple(ranks), slots=1)


def exchange_case(rank: int, n: int, key: str, count: int) -> dict:
    from msc.cuda.bootstrap import exchange, torch_gather
    from msc.cuda.launch import footprint, launch_params
    from msc.cuda.tables import UserBuffers, arena_layout, peers, pointer_tables, resolve

    plan, layout = runtime_layout(key, n)
    params = launch_params(layout, count, dtype="float32", protocol=plan.protocol)
    fp = footprint(layout, params, dtype="float32", protocol=plan.protocol, slots=plan.slots)
    arenas = arena_layout(layout, fp)
    ipc = FakeIpc(rank)
    bases = exchange(rank, n, fake_base(rank, rank), fp, 1, peers(layout, rank), ipc=ipc, gather=torch_gather())
    buffers = [None] * n
    buffers[rank] = UserBuffers(0x1000 + rank, 0x1000 + rank)
    ranks, conns = pointer_tables(layout, arenas, bases, buffers, (rank,))
    logical = {
        "ranks": {r: {f: resolve(v, arenas, bases) if f in ("scratch", "progress") else v for f, v in e.items()}
                  for r, e in enumerate(ranks)},
        "conns": [{f: resolve(v, arenas, bases) for f, v in c.items()} for c in conns],
    }
    return {"logical": logical, "opened": sorted(ipc.opened), "peers": list(peers(layout, rank))}


def mismatch_case(rank: int, n: int) -> str:
    """Ranks that size their buffers differently are told so, on every rank."""
    from msc.cuda.bootstrap import exchange, torch_gather
    from msc.errors import UsageError

    try:
        exchange(rank, n, fake_base(rank, rank), ("capacity", 100 + rank), 1, (), ipc=FakeIpc(rank),
                 gather=torch_gather())
    except UsageError as exc:
        return str(exc)
    return "no error"


def ipc_case(rank: int, n: int) -> dict:
    """GPU only: the torchrun placement's real bootstrap on one GPU. Each
    process allocates its arena (driver memory), exports a CUDA IPC handle,
    opens its peer's; it marks its own scratch with bytes rank+1 and reads
    the peer's mark through the opened mapping. No kernel runs: two
    processes spinning on one GPU time-slice, so only the exchange is tested."""
    import torch
    import torch.distributed as dist

    from msc.cuda import device as cu
    from msc.cuda.launch import footprint, launch_params
    from msc.cuda.runtime import Communicator
    from msc.cuda.tables import UserBuffers, pointer_tables

    plan, layout = runtime_layout("reducescatter/ring:ring", n)
    torch.cuda.set_device(0)
    comm = Communicator(plan, "torchrun")
    comm.backend.shared = lambda: None          # both ranks on GPU 0 on purpose: no kernel runs here
    params = launch_params(comm.layout, 1 << 14, dtype="float32", protocol=plan.protocol)
    comm._reserve(footprint(comm.layout, params, dtype="float32", protocol=plan.protocol, slots=comm.slots))
    arenas, bases = comm._arenas, comm._bases
    own = bases[rank] + arenas[rank].scratch
    stream = torch.cuda.current_stream().cuda_stream
    from cuda.bindings import driver

    cu.call(driver.cuMemsetD8Async, driver.CUdeviceptr(own), rank + 1, 64, driver.CUstream(stream))
    torch.cuda.synchronize()
    dist.barrier()
    peer = 1 - rank
    seen = cu.read(bases[peer] + arenas[peer].scratch, 4)
    buffers = [None] * n
    buffers[rank] = UserBuffers(1, 1)
    ranks, conns = pointer_tables(comm.layout, arenas, bases, buffers, (rank,))
    dist.barrier()
    comm.close()
    return {"seen": list(seen), "opened": sorted(r for r, b in enumerate(bases) if b is not None and r != rank),
            "conns": len([c for c in conns if c["slots"]])}


def shared_gpu_case(rank: int, n: int) -> str:
    """GPU only: both processes on GPU 0 make a call; the bootstrap refuses it on every rank."""
    import torch

    from msc.cuda.runtime import Communicator

    plan, _ = runtime_layout("allreduce/ring:ring", n)
    torch.cuda.set_device(0)
    comm = Communicator(plan, "torchrun", timeout_s=5)
    try:
        comm.all_reduce(torch.ones(1024, device="cuda"))
        comm.synchronize()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        comm.close()


# -- a fake GPU under the runtime (CPU tests of msc.cuda.runtime) -------------------------------
class FakeMemory:
    """Device memory as bytearrays at fake addresses."""

    def __init__(self):
        self.blocks, self.next, self.freed = {}, 0x7000_0000_0000, []

    def alloc(self, n):
        base, self.next = self.next, self.next + (1 << 32)
        self.blocks[base] = bytearray(b"\xee" * n)          # not zero: the runtime must zero it
        return base

    def find(self, ptr):
        for base, b in self.blocks.items():
            if base <= ptr < base + len(b):
                return b, ptr - base
        raise AssertionError(f"{ptr:#x} is not allocated")

    def write(self, ptr, data):
        b, o = self.find(ptr)
        b[o:o + len(data)] = data

    def read(self, ptr, n):
        b, o = self.find(ptr)
        return bytes(b[o:o + n])

    def free(self, ptr):
        del self.blocks[ptr]
        self.freed.append(ptr)


class FakeStream:
    def __init__(self, d):
        self.cuda_stream, self.waited = 0x1000 + d, []

    def wait_event(self, e):
        self.waited.append(e)


class FakeEvent:
    def record(self, stream):
        pass

    def query(self):
        return True


class FakeCuda:
    Event = FakeEvent

    def __init__(self):
        self.current, self.streams, self.synced = 0, {}, []

    def init(self):
        pass

    def current_device(self):
        return self.current

    def device_count(self):
        return 8

    def set_device(self, d):
        self.current = d

    def device(self, d):
        import contextlib

        @contextlib.contextmanager
        def cm():
            old, self.current = self.current, d
            yield
            self.current = old
        return cm()

    def current_stream(self, d=None):
        d = self.current if d is None else d
        return self.streams.setdefault(d, FakeStream(d))

    def is_current_stream_capturing(self):
        return False

    def synchronize(self, d=None):
        self.synced.append(d)


class FakeTorch:
    """The real (CPU) torch, with torch.cuda faked and device/pinning ignored."""

    def __init__(self):
        import torch

        self._torch, self.cuda = torch, FakeCuda()

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *a, pin_memory=False, **kw):
        return self._torch.zeros(*a, **kw)

    def empty(self, *a, device=None, **kw):
        return self._torch.empty(*a, **kw)


def install_fakes(setattr_):
    """Replace, with ``setattr_(obj, name, value)`` (monkeypatch.setattr in a
    test, setattr in a worker), what the CUDA backend (msc.cuda.backend)
    reaches: the driver calls (msc.cuda.device), torch.cuda, cuda.core
    (bind, compile, load, launch, occupancy) and the args upload. Returns
    the state the fakes record: launches (stream, grid, block, kernel, packed
    args), uploads, memory; ``state["on"][data_ptr] = "cuda:N"`` places a
    tensor; ``state["fail"] = words`` makes the next launch write that error
    word; ``state["resident"]`` is what the occupancy API answers."""
    import ctypes
    import dataclasses
    import struct
    import types

    import torch

    from msc.cuda import backend
    from msc.cuda import device as cu
    from msc.cuda.validate import describe

    mem, fake = FakeMemory(), FakeTorch()
    state = {"launches": [], "args": {}, "uploads": 0, "on": {}, "peer": [], "resident": 1 << 20}

    def upload(self, dev, args, capturing):
        ptr = 0x9000_0000 + 0x10000 * len(state["args"])
        if args not in state["args"].values():
            state["uploads"] += 1
        state["args"][ptr] = args
        return ptr, None

    def fake_describe(t):
        return dataclasses.replace(describe(t), device=state["on"].get(t.data_ptr(), "cuda:0"))

    def launch(self, index, stream, grid, block, kernel, ptr, keep=()):
        state["launches"].append((stream.cuda_stream, grid, block, kernel, state["args"][ptr]))
        if state.get("fail"):             # the "kernel" times out: it writes the error word
            error = decode_args(state["layout"], state["args"][ptr]).error
            mem.write(error, struct.pack("<5I", *state.pop("fail")))

    def compile_(self, plan, *, dtype, op, arch, **kw):
        return types.SimpleNamespace(arch=arch, dtype=dtype, op=op)

    setattr_(backend, "_torch", lambda: fake)
    setattr_(backend, "describe", fake_describe)
    setattr_(backend.CudaBackend, "bind", lambda self, d: None)
    setattr_(backend.CudaBackend, "upload", upload)
    setattr_(backend.CudaBackend, "launch", launch)
    setattr_(backend.CudaBackend, "compile", compile_)
    setattr_(backend.CudaBackend, "load", lambda self, c, size: ("kernel", c.arch, c.dtype, c.op))
    setattr_(backend.CudaBackend, "resident_blocks", lambda self, k, threads, d: state["resident"])
    setattr_(backend.CudaBackend, "device_id", lambda self, d: f"0000:{d:02x}:00.0")
    setattr_(backend.CudaBackend, "reach", lambda self, d: None)
    for name, fn in dict(require_driver=lambda: None, arch=lambda d: "sm_90",
                         mem_alloc=mem.alloc, mem_free=mem.free,
                         memset_async=lambda p, n, s: mem.write(p, bytes(n)), read=mem.read,
                         copy_to_host_async=lambda h, d, n, s: ctypes.memmove(h, mem.read(d, n), n),
                         can_access_peer=lambda a, b: True,
                         enable_peer_access=lambda b: state["peer"].append((fake.cuda.current, b))).items():
        setattr_(cu, name, fn)
    state["mem"], state["torch"], state["cuda"] = mem, torch, fake.cuda
    return state


def decode_args(layout, raw):
    from msc.cuda.launch import args_struct

    return args_struct(layout.num_ranks, len(layout.connections), layout.switch).from_buffer_copy(raw)


class FakeMulticast:
    """msc.cuda.multicast's driver for one process on a fake GPU (install_fakes' memory):
    records (call, args); address ranges are FakeMemory blocks, so the runtime can zero and
    read them; the multicast fd is a memory file naming the handle (as tests/test_multicast.py's)."""

    def __init__(self, mem, facts=None):
        import os

        self.mem, self.facts, self.log, self.live, self.next = mem, facts, [], set(), 1000 + 100 * os.getpid()

    def _new(self, kind):
        self.next += 1
        self.live.add((kind, self.next))
        return self.next

    def driver_version(self):
        return 12080

    def device_facts(self, index):
        from msc.cuda.multicast import DeviceFacts

        return self.facts or DeviceFacts(index, "NVIDIA H100 80GB HBM3", (9, 0), True, True, True)

    def mc_granularity(self, size, members, recommended):
        return (8 if recommended else 2) << 20

    def mem_granularity(self, index):
        return 2 << 20

    def mc_create(self, size, members):
        self.log.append(("mc_create", size, members))
        return self._new("handle")

    def export_fd(self, handle):
        import os

        fd = os.memfd_create("fake-mc")
        os.write(fd, str(handle).encode())
        return fd

    def import_fd(self, fd):
        import os

        os.lseek(fd, 0, os.SEEK_SET)
        handle = int(os.read(fd, 64))
        self.log.append(("import_fd", handle))
        self.live.add(("handle", handle))
        return handle

    def mc_add_device(self, handle, index):
        self.log.append(("mc_add_device", handle, index))

    def mem_create(self, size, index):
        self.log.append(("mem_create", size, index))
        return self._new("handle")

    def mc_bind(self, mc, mem, size):
        self.log.append(("mc_bind", mc, mem, size))

    def mc_unbind(self, mc, index, size):
        self.log.append(("mc_unbind", mc, index, size))

    def reserve(self, size, alignment):
        va = self.mem.alloc(size)
        self.live.add(("va", va))
        return va

    def map(self, va, size, handle):
        self.log.append(("map", va, size, handle))

    def set_access(self, va, size, index):
        pass

    def unmap(self, va, size):
        self.log.append(("unmap", va))

    def free_va(self, va, size):
        self.mem.free(va)
        self.live.discard(("va", va))

    def release(self, handle):
        self.live.discard(("handle", handle))


def fake_switch_torchrun_case(rank: int, n: int) -> dict:
    """nvls allreduce under the torchrun placement on a fake GPU: each process opens its group
    memory through msc.cuda.multicast (FakeMulticast; the real fd passing and the job's store),
    stages its tensor in and out, and launches with an MscSwitch table. Returns what the
    launch and the driver saw, as plain data."""
    import ctypes

    import torch

    from msc.cuda import multicast
    from msc.cuda import device as cu
    from msc.cuda.groups import MscSwitchC
    from msc.cuda.runtime import Communicator

    saved = []

    def setattr_(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    state = install_fakes(setattr_)
    state["cuda"].current = rank
    mem, events = state["mem"], []
    driver = FakeMulticast(mem)
    setattr_(multicast, "CudaMulticast", lambda: driver)
    setattr_(cu, "write", lambda dev, host, nbytes: mem.write(dev, ctypes.string_at(host, nbytes)))
    setattr_(cu, "copy_async", lambda dst, src, nbytes, stream: events.append(("copy", dst, src, nbytes)))
    try:
        plan = _emu_plan("allreduce/nvls:nvls", n, "Simple")
        comm = Communicator(plan, "torchrun", ipc=_FakeIpc(rank))
        x = torch.rand(n * 64)
        state["on"][x.data_ptr()] = f"cuda:{rank}"
        before = len(state["launches"])
        comm.all_reduce(x)
        (_, grid, _, _, raw), = state["launches"][before:]
        a = decode_args(comm.layout, raw)
        buf = comm._group_held[0]
        first, count = comm.layout.rank_blocks[rank]
        size = ctypes.sizeof(MscSwitchC)
        entries = [MscSwitchC.from_buffer_copy(mem.read(a.switches + g * size, size)) for g in range(first, first + count)]
        groups = comm._groups
        result = {
            "entries": [(e.mem.mc - buf.mc, e.mem.members or 0, e.mem.n, e.flag.mc - buf.mc, e.flag.members or 0,
                         e.mine - buf.local) for e in entries],
            "channels": [comm.layout.switch_tbs[g][1] for g in range(first, first + count)],
            "counters": [groups.counter(g, c) for g, c in groups.counters], "buffers": groups.buffers,
            "input": (a.rank[rank].input - buf.local, a.rank[rank].output - buf.local),
            "switch_offsets": (a.switch_input, a.switch_output),
            "copies": [(e[1] - buf.local if e[1] != x.data_ptr() else "user", e[2] - buf.local
                        if e[2] != x.data_ptr() else "user", e[3]) for e in events],
            "zeroed": mem.read(buf.local, groups.buffers) == bytes(groups.buffers),
            "created": [c for c in driver.log if c[0] == "mc_create"], "size": buf.size, "members": buf.members,
            "bound": sum(c[0] == "mc_bind" for c in driver.log),
        }
        comm.close()
        result["left"] = sorted(k for k, _ in driver.live)
        return result
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


class _FakeIpc:
    """CUDA IPC handles as (rank, pointer) and opened at an address per rank (fake_torchrun_case's)."""

    def __init__(self, rank: int):
        self.rank = rank

    def export(self, ptr):
        return self.rank.to_bytes(8, "little") + ptr.to_bytes(8, "little") + bytes(48)

    def open(self, handle):
        return 0x5000_0000_0000 + (int.from_bytes(handle[:8], "little") << 36)

    def close(self, ptr):
        pass




def fake_torchrun_case(rank: int, n: int, gpu: int | None = None, mps: bool = False) -> dict:
    """The torchrun placement end to end on a fake GPU: a Communicator per
    process bootstraps over gloo (fake IPC handles), launches its rank's
    blocks; returns what it launched and its connections' pointers resolved
    to (rank, region, offset). Each process on GPU ``rank``, or all on GPU
    ``gpu`` (refused, as on a GPU, unless ``mps``: then allowed): then the
    error's text."""
    import torch

    from msc.cuda.runtime import Communicator
    from msc.cuda.tables import resolve

    saved = []

    def setattr_(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    class Ipc:
        def export(self, ptr):
            return rank.to_bytes(8, "little") + ptr.to_bytes(8, "little") + bytes(48)

        def open(self, handle):
            return 0x5000_0000_0000 + (int.from_bytes(handle[:8], "little") << 36)

        def close(self, ptr):
            pass

    state = install_fakes(setattr_)
    state["cuda"].current = gpu if gpu is not None else rank         # a GPU per process, as torchrun sets it
    try:
        plan, _ = runtime_layout("reducescatter/ring:ring", n)
        comm = Communicator(plan, "torchrun", ipc=Ipc())
        if mps:
            comm.backend.shared = lambda: None                           # as where MPS runs
        x = torch.rand(n * 64)
        state["on"][x.data_ptr()] = f"cuda:{state['cuda'].current}"
        try:
            out = comm.reduce_scatter(None, x)
        except Exception as exc:
            comm.close()
            return f"{type(exc).__name__}: {exc}"
        (_, grid, _, _, raw), = state["launches"]
        a = decode_args(comm.layout, raw)
        conns = {c.id: {f: resolve(getattr(a.conn[c.id], f) or 0, comm._arenas, comm._bases)
                        for f in ("slots", "tail", "head")} for c in comm.layout.connections}
        result = {"grid": grid, "first_block": a.first_block, "rank_blocks": comm.layout.rank_blocks[rank],
                  "error": resolve(a.error, comm._arenas, comm._bases), "conns": conns,
                  "out": (out.data_ptr() - x.data_ptr()) // 4, "count": a.count,
                  "input": a.rank[rank].input == x.data_ptr(),
                  "others": [a.rank[r].input or 0 for r in range(n) if r != rank]}
        comm.close()
        return result
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# -- checking a communicator against the reference executor (emulated device and GPU) ---------
def np_dtype(name):
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# avg: the kernel pre-multiplies every input by 1/n (NCCL's PreMulSum), the executor divides the sum
# once at the end; they agree to a few roundings of the dtype, not bit for bit
AVG_RTOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 4e-2, "float16": 5e-3}


def check_run(comm, count: int, dtype: str, op: str, seed: int, what: str = "") -> None:
    """One run of ``comm`` on random inputs (never zero) with poisoned
    outputs: bit-exact against msc.executor (avg: to AVG_RTOL where the kernel pre-scales; a
    switch plan's avg, the sum divided as the executor divides, bit-exact too)."""
    import numpy as np

    from msc.cuda.codegen import prescales

    from msc.verification import reference
    from msc.cuda.bench import run_numpy
    from msc.cuda.validate import units
    from msc.executor import run_collective

    plan = comm.plan
    inputs = reference.random_inputs(np.random.default_rng(seed), np_dtype(dtype), op, plan.num_ranks,
                                  units(plan)[0] * count)
    got = run_numpy(comm, inputs, count, op, comm.devices[0])
    want = run_collective(plan, [x.copy() for x in inputs], op, count=count)
    spec = reference.expected_outputs(plan.collective, inputs, op=op, root=plan.root)
    for r in range(plan.num_ranks):
        if spec[r] is None:                      # reduce's non-root ranks: unspecified
            continue
        g, w = got[r], want[r]
        if g.size == w.size and prescales(plan, op):
            if np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=AVG_RTOL[dtype], atol=0):
                continue
        elif g.tobytes() == w.tobytes():
            continue
        bad = np.flatnonzero((g.view(np.uint8).reshape(g.size, -1) != w.view(np.uint8).reshape(w.size, -1)).any(1)) \
            if g.size == w.size else np.arange(max(g.size, w.size))
        raise AssertionError(f"{what}{plan.name} n={plan.num_ranks} {plan.protocol} {comm.layout.form} {dtype} {op} "
                             f"count {count} rank {r}: {bad.size} elements differ from msc.executor, first at "
                             f"{bad[:5]}: {g[bad[:5]]} vs {w[bad[:5]]}")


# -- the emulated device under torchrun (gloo processes, memfd arenas) -------------------------
def _emu_plan(key: str, n: int, protocol: str):
    import msc
    from msc.lower.pipeline import LowerOptions, lower
    from library import algorithms

    return lower(msc.trace(algorithms()[key], n), LowerOptions(protocol=protocol, tile=4096))


def emu_torchrun_case(rank: int, n: int, key: str, protocol: str, counts) -> str:
    """Each process runs its rank of the plan on the emulated device; the
    result must be msc.executor's, bit for bit."""
    import numpy as np

    from msc.verification import reference
    from msc.cuda import Communicator
    from msc.cuda.validate import units
    from msc.executor import run_collective

    plan = _emu_plan(key, n, protocol)
    comm = Communicator(plan, "torchrun", device="emu", timeout_s=60)
    try:
        for i, count in enumerate(counts):
            inputs = reference.random_inputs(np.random.default_rng(i), np.dtype("float32"), "sum", n,
                                          units(plan)[0] * count)
            want = run_collective(plan, [x.copy() for x in inputs], "sum", count=count)
            spec = reference.expected_outputs(plan.collective, inputs, op="sum", root=plan.root)
            x = inputs[rank].copy()
            if plan.collective == "allgather":            # in place: the input is unit `rank` of the output
                out = np.full(n * count, np.nan, np.float32)
                out[rank * count:(rank + 1) * count] = x
                got = comm.run(None, out)
            else:
                got = comm.run(x)
            comm.synchronize()
            if spec[rank] is not None and got.tobytes() != want[rank].tobytes():
                return f"rank {rank} count {count}: differs from msc.executor"
        if plan.collective == "allreduce":          # a kernel built at first use: the ranks meet, then launch
            x = np.full(1000, rank + 1, np.float16)
            comm.all_reduce(x, op="max")
            comm.synchronize()
            if not (x == n).all():
                return f"rank {rank}: float16 max gave {x[:4]}"
        return "ok"
    finally:
        comm.close()


def emu_mismatch_case(rank: int, n: int) -> str:
    import numpy as np

    from msc.cuda import Communicator

    plan = _emu_plan("allreduce/ring:ring", n, "Simple")
    comm = Communicator(plan, "torchrun", device="emu", timeout_s=1.5)
    comm.all_reduce(np.ones(100, np.float32))             # both ranks: the same first call
    comm.synchronize()
    try:
        comm.all_reduce(np.ones(100 if rank == 0 else 100_000, np.float32))
        comm.synchronize()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def emu_other_host_case(rank: int, n: int) -> str:
    import numpy as np

    from msc.cuda import Communicator

    plan = _emu_plan("allreduce/ring:ring", n, "Simple")
    comm = Communicator(plan, "torchrun", device="emu", timeout_s=30)
    comm.backend.host_id = lambda: f"host-{'ab'[rank]}"     # as if the processes ran on two machines
    try:
        comm.all_reduce(np.ones(100, np.float32))
    except Exception as exc:
        return str(exc)
    finally:
        del comm.backend.host_id
    return "no error"


def emu_subgroups_case(rank: int, n: int) -> tuple:
    """Two disjoint groups of 2 of 4 processes run the same plan at once: their
    bootstraps share the job's store and must not read each other's keys."""
    import numpy as np
    import torch.distributed as dist

    from msc.cuda import Communicator

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]       # every process makes both, in order
    group = groups[rank // 2]
    plan = _emu_plan("allreduce/ring:ring", 2, "Simple")
    comm = Communicator(plan, "torchrun", device="emu", group=group, timeout_s=30)
    x = np.full(1000, float(10 ** rank), np.float32)
    comm.all_reduce(x)
    comm.synchronize()
    comm.close()
    return float(x[0]), float(x[-1])


def queued_allreduces_are_right(comm, plan, counts, seed: int) -> None:
    """Queue one float32 allreduce per count on ``comm`` (4 ranks, no
    synchronize between calls, each call with buffers of its own), then
    check every result bit for bit against msc.executor."""
    import numpy as np

    from msc.executor import run_collective

    rng = np.random.default_rng(seed)
    calls = []
    for count in counts:
        xs = [rng.uniform(1, 2, count).astype(np.float32) for _ in range(4)]
        calls.append((xs, [x.copy() for x in xs]))
        comm.all_reduce(xs)
    comm.synchronize()
    for i, (xs, inputs) in enumerate(calls):
        want = run_collective(plan, inputs, "sum", count=len(inputs[0]))
        for r in range(4):
            assert xs[r].tobytes() == want[r].tobytes(), f"call {i} rank {r}"
