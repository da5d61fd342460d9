"""Reading the kernel's error word, and saying what a stuck block waited on.

The kernel (templates/common.cuh.j2) bounds every spin-wait; the first
block to give up writes [code, rank, threadblock, step, iteration] (five
u32) and every other block gives up when it sees the code. ``decode``
turns those words into a DeviceTimeoutError naming the rank, threadblock,
step, iteration and the step's waits: its dependencies (other threadblocks
of its rank), a message from its receive peer, a free slot at its send
peer. With a snapshot of the device counters (``Counters``: read after the
launch ended) it says which of those waits was still unmet. Pure Python.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from msc.cuda.codegen import COUNTER_STRIDE, KernelLayout
from msc.errors import ExecutionError, MscError, UsageError
from msc.ir import Plan

MSC_OK, MSC_TIMEOUT = 0, 1               # the kernel's codes (common.cuh.j2)
CODES = {MSC_TIMEOUT: "timed out in a spin-wait"}
EPOCH_MASK = ~0xFFFFFFFF


class DeviceTimeoutError(ExecutionError):
    """A launch gave up waiting: ``rank``, ``tb``, ``step``, ``iteration``
    name the first block that timed out, ``waits`` what it waited on."""

    def __init__(self, message: str, *, rank, tb, step, iteration, code, waits, where=None):
        self.iteration, self.code, self.waits = iteration, code, waits
        super().__init__(message, rank=rank, tb=tb, step=step, where=where)


class BrokenCommunicatorError(UsageError):
    """A communicator whose launch failed refuses further use."""


class LaunchError(MscError):
    """The driver refused a launch for a reason other than its size: ``where`` (the device),
    ``grid`` and ``block`` (the launch), ``cause`` (the driver's or cuda.core's error)."""

    def __init__(self, message: str, *, where: str, grid: int, block: int, cause: str):
        self.where, self.grid, self.block, self.cause = where, grid, block, cause
        super().__init__(message)


def parse_words(raw: bytes) -> tuple[int, int, int, int, int]:
    """The five u32 of an error word (little-endian, as the GPU writes them)."""
    return struct.unpack_from("<5I", raw)


@dataclass(frozen=True)
class Counters:
    """Device counters after a launch: progress[(rank, tb)], and per
    connection id the sender's posted count (tail) and the receiver's
    consumed count (head). Missing entries: not readable here."""

    progress: dict[tuple[int, int], int] = field(default_factory=dict)
    tail: dict[int, int] = field(default_factory=dict)
    head: dict[int, int] = field(default_factory=dict)


def waits(plan: Plan, layout: KernelLayout, rank: int, tb: int, step: int, iteration: int,
          counters: Counters | None, slots: int) -> list[tuple[str, bool | None]]:
    """What (rank, tb, step) waits on at ``iteration``: (description, met?)
    where met is None when the counters cannot tell."""
    rp = plan.ranks[rank]
    block = rp.threadblocks[tb]
    s = block.steps[step]
    conn = {(c.sender, c.receiver, c.channel): c.id for c in layout.connections}
    out = []
    epoch = None
    if counters is not None and (rank, tb) in counters.progress:
        epoch = counters.progress[(rank, tb)] & EPOCH_MASK
    for dt, ds in s.deps:
        met = None
        if epoch is not None and (rank, dt) in counters.progress:
            want = epoch + iteration * len(rp.threadblocks[dt].steps) + ds + 1
            met = counters.progress[(rank, dt)] >= want
        out.append((f"threadblock {dt} step {ds} of rank {rank}", met))
    if s.op.receives:
        c = conn[(block.recv, rank, block.channel)]
        met = None
        if counters is not None and c in counters.tail and c in counters.head:
            met = counters.tail[c] > counters.head[c]          # a message posted and not yet consumed
        out.append((f"a message from rank {block.recv} on channel {block.channel} (connection {c})", met))
    if s.op.sends:
        c = conn[(rank, block.send, block.channel)]
        met = None
        if counters is not None and c in counters.tail and c in counters.head:
            met = counters.tail[c] - counters.head[c] < slots
        out.append((f"a free slot at rank {block.send} on channel {block.channel} (connection {c}, {slots} slots)",
                    met))
    return out


def decode(words, plan: Plan, layout: KernelLayout, *, counters: Counters | None = None, slots: int | None = None,
           timeout_s: float | None = None) -> DeviceTimeoutError | None:
    """None for a clean error word; else the error to raise."""
    code, rank, tb, step, iteration = (int(w) for w in words)
    if code == MSC_OK:
        return None
    slots = plan.slots if slots is None else slots
    try:
        s = plan.ranks[rank].threadblocks[tb].steps[step]
    except IndexError:
        return DeviceTimeoutError(f"the kernel reported error code {code} at rank {rank} threadblock {tb} step "
                                  f"{step} iteration {iteration}, which the plan does not have (corrupt error word?)",
                                  rank=rank, tb=tb, step=step, iteration=iteration, code=code, waits=[])
    what = CODES.get(code, f"failed with unknown error code {code}")
    found = waits(plan, layout, rank, tb, step, iteration, counters, slots)
    unmet = [d for d, met in found if met is False]
    if unmet:
        on = "; still unmet: " + "; ".join(unmet)
    elif found:
        on = "; it waits on: " + "; ".join(d for d, _ in found)
    else:
        on = ""
    after = f" after {timeout_s:g} s" if timeout_s else ""
    text = (f"rank {rank} threadblock {tb} step {step} ({s.op.value}) {what}{after} at iteration {iteration}{on}. "
            f"The communicator is now unusable; the plan may deadlock (was it verified?) or a peer never launched")
    return DeviceTimeoutError(text, rank=rank, tb=tb, step=step, iteration=iteration, code=code, waits=found,
                              where=s.where)


def counters_from_arena(raw: bytes, arena, layout: KernelLayout) -> Counters:
    """Counters of one rank from the first ``arena.counters_end`` bytes of its arena."""
    def u64(off):
        return struct.unpack_from("<Q", raw, off)[0]

    r = arena.rank
    progress = {(r, t): u64(arena.progress + COUNTER_STRIDE * t) for t in range(layout.threadblocks_per_rank[r])}
    return Counters(progress, {c: u64(o) for c, o in arena.tail.items()}, {c: u64(o) for c, o in arena.head.items()})


def merge(parts) -> Counters:
    out = Counters()
    for p in parts:
        out.progress.update(p.progress)
        out.tail.update(p.tail)
        out.head.update(p.head)
    return out
