"""Switch group memory (NVLS) for the runtime: where each member's copy of the
buffers the switch reaches lives, and the MscSwitch table a switch plan's
kernel reads (templates/steps.cuh.j2). Pure Python, no GPU.

A member of a switch group runs its call on *group memory* laid out by
``group_layout``, the same on every rank:

    counters   a u64 barrier counter per (group, channel) of the plan's switch
               threadblocks (the group barrier's, every member's copy written by
               every member), each on a cache line of its own
    buffers    the rank's input and output, as the call lays them out (in place:
               one span holding both, at the user's offsets)

A rank in several groups (e.g. groups {0,1} and {2,3}, then {0,2} and {1,3}) has
one group memory that each of its groups reaches, so every group's switch reads
and writes the same copy of its buffers, and each group barriers on counters of
its own. On a GPU that is one multicast object per group, the rank's one
allocation bound to each (msc.cuda.multicast, ``memory=``).

The switch reaches only memory that was bound to the group (on a GPU a
multicast object: msc.cuda.multicast), never the caller's tensors, so the
runtime stages: it copies the caller's input and output into the group
memory before the launch, points the kernel's input and output there, and
copies the output back after (stream-ordered). A member's copies are read and
written by the others only between its call's first and last group barriers,
which its launch passes after its copy-in and before its copy-out.

Where the memory is depends on the device: the emulated device places it in
each rank's arena (msc.cuda.tables: the bootstrap already maps the peers'
arenas), so ``SwitchMem.members[]`` lists the members' copies; a GPU binds a
separate allocation per member to a multicast object, and ``SwitchMem.mc``
is its multicast address (``members`` null).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from msc.cuda.codegen import COUNTER_STRIDE, KernelLayout
from msc.cuda.switch import SwitchMemC, switch_slice_problem
from msc.errors import UsageError

ALIGN = 256            # each region: any vector width, a cache line


def _up(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


class MscSwitchC(ctypes.Structure):
    """templates/steps.cuh.j2's MscSwitch: one per global threadblock."""

    _fields_ = [("mem", SwitchMemC), ("flag", SwitchMemC), ("mine", ctypes.c_void_p)]


@dataclass(frozen=True)
class Span:
    """A rank's user buffers for one call as byte offsets from ``lo`` (the
    lower of the two addresses): in place the input and output overlap."""

    input: int           # offset of the input from lo
    output: int          # offset of the output from lo
    size: int            # bytes from lo to the end of the later buffer


def span_of(inp: int, in_bytes: int, out: int, out_bytes: int, inplace: bool) -> Span:
    """The span of one rank's buffers (addresses ``inp``, ``out``): in place
    one region (the user's layout kept), else the input then the output."""
    if inplace:
        lo = min(inp, out)
        return Span(inp - lo, out - lo, max(inp + in_bytes, out + out_bytes) - lo)
    return Span(0, _up(in_bytes), _up(in_bytes) + out_bytes)


@dataclass(frozen=True)
class GroupLayout:
    """Byte offsets in a member's group memory, the same on every rank (see the module doc)."""

    counters: tuple[tuple[int, int], ...]     # a counter per (group, channel), in this order
    buffers: int                              # where the span of the input and output starts
    size: int

    def counter(self, group: int, channel: int) -> int:
        return self.counters.index((group, channel)) * COUNTER_STRIDE


def group_layout(layout: KernelLayout, span_bytes: int) -> GroupLayout:
    """Every member's group memory: the counters of every (group, channel), then the buffers,
    at one offset on every rank (one offset in MscArgs serves all)."""
    counters = layout.group_counters()
    buffers = _up(COUNTER_STRIDE * len(counters))
    return GroupLayout(counters, buffers, _up(buffers + span_bytes))


def group_bytes(layout: KernelLayout, span_bytes: int) -> int:
    """Bytes of a member's group memory for a call of ``span_bytes`` (0: no switch ops)."""
    return group_layout(layout, span_bytes).size if layout.switch else 0


def check_units(layout: KernelLayout, dtype: str, count: int, chunk: int) -> None:
    """UsageError unless every chunk-tile of a call starts and ends on a whole multimem unit
    (half types: pairs of elements): counts per unit ``count`` and chunks ``chunk`` even."""
    if not layout.switch:
        return
    for what, n in (("elements per data unit", count), ("elements per chunk", chunk)):
        problem = switch_slice_problem(dtype, 0, n, what=f"call's {what} ({n}):")
        if problem:
            raise UsageError(f"{problem}; call with an even count per chunk")


@dataclass(frozen=True)
class MemberMemory:
    """Where one member's group memory is, as this process addresses it: ``local`` its own
    copy (0: not mapped here), ``mc`` per group index the group's multicast address (a GPU;
    empty on the emulated device, 0 for a group the rank is not in)."""

    local: int
    mc: tuple[int, ...] = ()

    def mc_of(self, group: int) -> int:
        return self.mc[group] if group < len(self.mc) else 0


def switch_table(layout: KernelLayout, memory: list[MemberMemory | None], groups: GroupLayout,
                 base: int) -> bytes:
    """The MscSwitch table at device address ``base``: an entry per global threadblock (zeros
    for those without switch ops or run elsewhere), then the address arrays the entries point to
    (the emulated device: each member's group memory and barrier counter; a GPU uses the
    multicast address instead). ``memory[r]``: rank r's group memory as this process sees it
    (None: not mapped here); ``groups``: the group memory's layout. It depends on neither the call's
    count nor its buffers: written once per allocation."""
    entries = (MscSwitchC * max(len(layout.blocks), 1))()
    arrays: list[int] = []
    at = base + ctypes.sizeof(entries)
    for gid, ((rank, _), (g, channel)) in enumerate(zip(layout.blocks, layout.switch_tbs)):
        if g < 0 or memory[rank] is None:
            continue
        members, mine, counter = layout.groups[g], memory[rank], groups.counter(g, channel)
        mc = mine.mc_of(g)
        if mc:
            entries[gid] = MscSwitchC(SwitchMemC(mc, 0, len(members)), SwitchMemC(mc + counter, 0, len(members)),
                                      mine.local + counter)
            continue
        missing = [m for m in members if memory[m] is None]
        if missing:
            raise UsageError(f"rank {rank} runs here but the group memory of rank {missing[0]} (in its switch "
                             f"group {','.join(map(str, members))}) is not mapped in this process")
        arrays.extend(memory[m].local for m in members)
        arrays.extend(memory[m].local + counter for m in members)
        entries[gid] = MscSwitchC(SwitchMemC(0, at, len(members)), SwitchMemC(0, at + 8 * len(members), len(members)),
                                  mine.local + counter)
        at += 16 * len(members)
    return bytes(entries) + bytes((ctypes.c_uint64 * len(arrays))(*arrays))


def switch_table_bytes(layout: KernelLayout) -> int:
    """The most bytes switch_table can take for ``layout``: entries, and two address arrays per
    switch threadblock."""
    arrays = sum(2 * 8 * len(layout.groups[g]) for g, _ in layout.switch_tbs if g >= 0)
    return ctypes.sizeof(MscSwitchC) * max(len(layout.blocks), 1) + arrays


def staged_offsets(span: Span, groups: GroupLayout) -> tuple[int, int]:
    """Byte offsets of a rank's input and output copies in its group memory."""
    return groups.buffers + span.input, groups.buffers + span.output
