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
    from msc.lower import LowerOptions, lower
    from library import algorithms

    plan = runtime_plan(lower(msc.trace(algorithms()[key], n), LowerOptions(protocol=protocol)))
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
