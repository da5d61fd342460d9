"""Switch operations in the DSL: NVLink SHARP (NVLS) reduce and multicast.

On an NVSwitch machine the GPUs of one switch domain can bind buffers to a
multicast object; one GPU then reads the sum of every member's copy of a
chunk in one load (the switch reduces) and writes a chunk to every member in
one store (the switch multicasts)::

    sw = p.switch()                              # every rank; p.switch(ranks) for a subset
    sw.reduce(r, "input", i).store("output", i)  # rank r: every member's output[i] = sum of input[i]
    sw.reduce(r, "input", i).to("output", i)     # rank r: its own output[i] = the sum
    sw.store(p.chunk(r, "output", i), "output", i)   # every member's output[i] = rank r's output[i]

The switch side of an operation (what ``reduce`` reads, what ``store``
writes) is the same chunks on every member, so it names the collective's
input or output buffers, which every rank lays out alike; the other side is
any buffer of the issuing rank. Members are reduced in increasing rank
order (what the executor and the emulated device do; the hardware's order
is the switch's). Lowering puts group barriers where a switch operation
meets another rank's access to the same chunk (msc.lower.switch).
"""
from __future__ import annotations

import itertools

from msc.dsl.source_lines import _integer, user_line
from msc.errors import OperationError
from msc.ir import OpKind


class SwitchGroup:
    """Ranks on one switch domain whose buffers the switch reaches."""

    def __init__(self, program, ranks: tuple[int, ...], channel: int | None):
        self.program, self.ranks, self.channel = program, ranks, channel

    def __repr__(self) -> str:
        return f"SwitchGroup(ranks={list(self.ranks)})"

    def reduce(self, rank: int, buffer: str, index: int, size: int = 1) -> SwitchSum:
        """What rank ``rank`` reads through the switch: the sum (the
        collective's op) of every member's ``buffer[index:index+size]``.
        Nothing happens until the sum is stored (``.store``, ``.to``)."""
        p = self.program
        self._member(rank, "reduce", buffer, index)
        p._check_location(rank, buffer, index, size, "switch reduce")
        return SwitchSum(self, rank, buffer, index, size, user_line())

    def store(self, src, buffer: str | None = None, index: int | None = None) -> list:
        """Write chunks ``src`` (a reference on a member) to every member's
        ``buffer[index]`` (default: the buffer and index of ``src``) in one
        multicast store. Returns the references to the copies."""
        p = self.program
        if getattr(src, "program", None) is not p or not hasattr(src, "size"):
            raise OperationError(f"switch store: source must be a chunk reference of the same program, got {src!r}",
                                 where=user_line())
        self._member(src.rank, "store", src.buffer, src.index)
        buffer = src.buffer if buffer is None else buffer
        index = src.index if index is None else index
        p._record_switch(OpKind.SWITCH_STORE, src.rank, src.buffer, src.index, buffer, index, src.size, self)
        return [p.chunk(m, buffer, index, src.size) for m in self.ranks]

    def _member(self, rank, what, buffer, index) -> None:
        if rank not in self.ranks:
            raise OperationError(f"switch {what}: rank {rank!r} is not a member of the switch group "
                                 f"{list(self.ranks)}", rank=rank if type(rank) is int else None, buffer=buffer,
                                 index=index if type(index) is int else None, where=user_line(3))


class SwitchSum:
    """The sum rank ``rank`` reads through the switch, not yet stored."""

    def __init__(self, group: SwitchGroup, rank: int, buffer: str, index: int, size: int, where):
        self.group, self.rank, self.buffer, self.index, self.size, self.where = group, rank, buffer, index, size, where

    def __repr__(self) -> str:
        return (f"SwitchSum(rank={self.rank}, of ranks {list(self.group.ranks)} "
                f"{self.buffer}[{self.index}:{self.index + self.size}])")

    def store(self, buffer: str | None = None, index: int | None = None) -> list:
        """Write the sum to every member's ``buffer[index]`` (default: where
        it was read) through the switch. Returns the references to them."""
        p = self.group.program
        buffer = self.buffer if buffer is None else buffer
        index = self.index if index is None else index
        p._record_switch(OpKind.SWITCH_REDUCE_STORE, self.rank, self.buffer, self.index, buffer, index, self.size,
                         self.group)
        return [p.chunk(m, buffer, index, self.size) for m in self.group.ranks]

    def to(self, buffer: str, index: int | None = None):
        """Write the sum to the reading rank's own ``buffer[index]`` (default:
        the index it was read at). Returns the reference to it."""
        p = self.group.program
        index = self.index if index is None else index
        p._record_switch(OpKind.SWITCH_REDUCE, self.rank, self.buffer, self.index, buffer, index, self.size,
                         self.group)
        return p.chunk(self.rank, buffer, index, self.size)


def switch_group(program, ranks, channel) -> SwitchGroup:
    """``Program.switch``: the group of ``ranks`` (all when None), checked."""
    n = program.num_ranks
    try:                          # at most n + 1 members read: a longer (or endless) iterable cannot be a group
        members = list(range(n)) if ranks is None else [_integer(r) for r in itertools.islice(ranks, n + 1)]
    except TypeError:
        raise OperationError(f"switch: ranks must be an iterable of ranks, got {ranks!r:.60}", where=user_line()) from None
    if len(members) > n:
        raise OperationError(f"switch: more than the program's {n} ranks in the group", where=user_line())
    bad = [r for r in members if type(r) is not int or not 0 <= r < n]
    if bad:
        raise OperationError(f"switch: {bad[0]!r} is not a rank (ranks are 0..{n - 1})", where=user_line())
    if len(set(members)) != len(members) or len(members) < 2:
        raise OperationError(f"switch: a group needs at least two distinct ranks, got {members!r:.200}",
                             where=user_line())
    channel = _integer(channel)
    if channel is not None and (type(channel) is not int or channel < 0):
        raise OperationError(f"switch: channel {channel!r} must be an int >= 0 or None", where=user_line())
    return SwitchGroup(program, tuple(sorted(members)), channel)
