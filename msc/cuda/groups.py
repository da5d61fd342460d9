"""Switch group memory (NVLS) for the runtime: where each member's copy of the
buffers the switch reaches lives, and the MscSwitch table a switch plan's
kernel reads (templates/steps.cuh.j2). Pure Python, no GPU.

A member of a switch group runs its call on *group memory* laid out by
``group_layout``:

    counters   a u64 barrier counter per channel of the group's threadblocks
               (the group barrier's, every member's copy written by every member),
               each on a cache line of its own
    buffers    the rank's input and output, as the call lays them out (in place:
               one span holding both, at the user's offsets)

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
    """Byte offsets in one member's group memory (see the module doc)."""

    channels: tuple[int, ...]     # a counter per channel, in this order
    buffers: int                  # where the span of the input and output starts
    size: int

    def counter(self, channel: int) -> int:
        return self.channels.index(channel) * COUNTER_STRIDE


def group_layout(layout: KernelLayout, group: int, span_bytes: int) -> GroupLayout:
    """Group ``group``'s memory. The buffers start at the same offset in every group's (after
    the counters of the group with the most channels): one offset in MscArgs serves all."""
    most = max(len(layout.group_channels(g)) for g in range(len(layout.groups)))
    buffers = _up(COUNTER_STRIDE * most)
    return GroupLayout(layout.group_channels(group), buffers, _up(buffers + span_bytes))


def group_bytes(layout: KernelLayout, span_bytes: int) -> int:
    """Bytes of the largest member's group memory for a call of ``span_bytes`` (0: no switch ops)."""
    return max((group_layout(layout, g, span_bytes).size for g in range(len(layout.groups))), default=0)


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
    copy (0: not mapped here), ``mc`` the group's multicast address (a GPU; 0 on the emulated
    device)."""

    local: int
    mc: int = 0


def switch_table(layout: KernelLayout, memory: list[MemberMemory | None], groups: list[GroupLayout],
                 base: int) -> bytes:
    """The MscSwitch table at device address ``base``: an entry per global threadblock (zeros
    for those without switch ops or run elsewhere), then the address arrays the entries point to
    (the emulated device: each member's group memory and barrier counter; a GPU uses the
    multicast address instead). ``memory[r]``: rank r's group memory as this process sees it
    (None: not mapped here); ``groups[g]``: group g's layout. It depends on neither the call's
    count nor its buffers: written once per allocation."""
    entries = (MscSwitchC * max(len(layout.blocks), 1))()
    arrays: list[int] = []
    at = base + ctypes.sizeof(entries)
    for gid, ((rank, _), (g, channel)) in enumerate(zip(layout.blocks, layout.switch_tbs)):
        if g < 0 or memory[rank] is None:
            continue
        members, mine, counter = layout.groups[g], memory[rank], groups[g].counter(channel)
        if mine.mc:
            entries[gid] = MscSwitchC(SwitchMemC(mine.mc, 0, len(members)),
                                      SwitchMemC(mine.mc + counter, 0, len(members)), mine.local + counter)
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


def staged_offsets(layout: KernelLayout, rank: int, span: Span, groups: list[GroupLayout]) -> tuple[int, int]:
    """Byte offsets of ``rank``'s input and output copies in its group memory."""
    at = groups[layout.group_of(rank)].buffers
    return at + span.input, at + span.output
