"""Where each rank's runtime memory lives, and the kernel's pointer tables.

Pure Python, no GPU: the runtime (msc.cuda.runtime) feeds real addresses,
tests feed fake integers.

Every rank owns one device allocation, its *arena*, laid out by
``arena_layout``:

    error word   [code, rank, threadblock, step, iteration] (u32 each), at 0
    progress     a u64 per threadblock of the rank (dependency counters)
    tail         a u64 per connection the rank RECEIVES on (the sender writes it)
    head         a u64 per connection the rank SENDS on (the receiver writes it)

(every counter on a cache line of its own, COUNTER_STRIDE bytes, so that
writers of different counters never contend for a line)
    slots        per connection the rank receives on: SLOTS messages
    scratch      the rank's scratch chunks

as templates/steps.cuh.j2 wants them (MscConn: ``slots`` and ``tail`` in the
receiver's memory, ``head`` in the sender's), so every spin-wait polls local
memory and every remote access is a store. The whole arena is zeroed when it
is allocated; the counters then only grow, across launches and CUDA-graph
replays (the kernel reads where the last launch left them), so a launch
needs no reset. Growing the arena (a call larger than any before) means a
fresh, zeroed arena for every rank at once: counters of the old one must
not be carried over (LL slots hold flags numbered by those counters).

``pointer_tables`` turns arenas (a base address per rank, as this process
sees it; None where it cannot see one) and the user's buffers into the
``ranks`` and ``connections`` lists of launch.pack_args. The three
placements differ only in those bases: virtual ranks (all arenas on one
GPU), one process driving several GPUs (every arena visible through peer
access), and one process per GPU (its own arena, and its peers' opened from
CUDA IPC handles, at addresses of its own).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from msc.cuda.codegen import COUNTER_STRIDE, KernelLayout
from msc.cuda.launch import ERROR_WORDS, Footprint
from msc.errors import UsageError

ALIGN = 256            # slot and scratch regions: any vector width, and a cache line


def _up(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class RankArena:
    """Byte offsets inside one rank's arena (see the module doc)."""

    rank: int
    size: int
    error: int
    progress: int
    tail: dict[int, int]          # connection id -> offset (connections this rank receives on)
    head: dict[int, int]          # connection id -> offset (connections this rank sends on)
    slots: dict[int, int]         # connection id -> offset (connections this rank receives on)
    scratch: int
    counters_end: int             # [0, counters_end): error word and counters
    group: int = -1               # its switch group memory (msc.cuda.groups) in the arena, -1: none here


def arena_layout(layout: KernelLayout, fp: Footprint, *, group_in_arena: bool = True) -> tuple[RankArena, ...]:
    """Every rank's arena for buffers of footprint ``fp``. ``group_in_arena``: a switch group
    member's group memory (fp.group bytes) goes at the end of its arena (the emulated device;
    a GPU binds a separate allocation to a multicast object)."""
    out = []
    for rank in range(layout.num_ranks):
        at = _up(4 * ERROR_WORDS, COUNTER_STRIDE)
        progress = at
        at += COUNTER_STRIDE * layout.threadblocks_per_rank[rank]
        tail, head = {}, {}
        for c in layout.connections:
            if c.receiver == rank:
                tail[c.id] = at
                at += COUNTER_STRIDE
        for c in layout.connections:
            if c.sender == rank:
                head[c.id] = at
                at += COUNTER_STRIDE
        counters_end = at
        at = _up(at)
        slots = {}
        for c in layout.connections:
            if c.receiver == rank:
                slots[c.id] = at
                at = _up(at + fp.slots[c.id])
        scratch = at
        at = _up(at + fp.scratch[rank])
        group = -1
        if group_in_arena and fp.group and layout.groups_of(rank):
            group, at = at, _up(at + fp.group)
        out.append(RankArena(rank, at, 0, progress, tail, head, slots, scratch, counters_end, group))
    return tuple(out)


def grow(capacity: Footprint | None, need: Footprint) -> Footprint | None:
    """The footprint to reallocate to, or None when ``capacity`` holds ``need``
    (every region, and the slots' room per chunk-tile, at least as large). A
    new capacity is the larger of the two field by field, so sizes seen
    before keep fitting."""
    if capacity is None:
        return need

    def larger(a, b):
        return tuple(max(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else max(a, b)

    new = Footprint(**{f.name: larger(getattr(capacity, f.name), getattr(need, f.name)) for f in fields(Footprint)})
    return None if new == capacity else new


def total_bytes(arenas: tuple[RankArena, ...]) -> int:
    return sum(a.size for a in arenas)


@dataclass(frozen=True)
class UserBuffers:
    """A rank's physical buffers for one call: device addresses of its input
    and output (the same address for a plan that runs in place)."""

    input: int
    output: int


def pointer_tables(layout: KernelLayout, arenas: tuple[RankArena, ...], bases: list[int | None],
                   buffers: list[UserBuffers | None], local: tuple[int, ...]) -> tuple[list[dict], list[dict]]:
    """(ranks, connections) for launch.pack_args.

    ``bases[r]``: rank r's arena as this process addresses it (None: not
    mapped here); ``buffers[r]``: rank r's user buffers (None for ranks
    another process runs); ``local``: the ranks this process launches. A
    connection with a local end needs both ends' arenas; other entries are
    left 0 (the kernel never reads them: a block only touches its own rank
    and its own connections)."""
    n = layout.num_ranks
    if len(bases) != n or len(buffers) != n or len(arenas) != n:
        raise UsageError(f"pointer tables for {n} ranks need {n} arenas, bases and buffers; got "
                         f"{len(arenas)}, {len(bases)} and {len(buffers)}")
    ranks = []
    for r in range(n):
        base, buf = bases[r], buffers[r]
        if r in local and (base is None or buf is None):
            raise UsageError(f"rank {r} runs here but its arena or buffers are unknown")
        if base is None or buf is None:
            ranks.append(dict(input=0, output=0, scratch=0, progress=0))
            continue
        a = arenas[r]
        ranks.append(dict(input=buf.input, output=buf.output, scratch=base + a.scratch, progress=base + a.progress))
    conns = []
    for c in layout.connections:
        s, r = c.sender, c.receiver
        if s not in local and r not in local:
            conns.append(dict(slots=0, tail=0, head=0))
            continue
        missing = [x for x in (s, r) if bases[x] is None]
        if missing:
            raise UsageError(f"connection {c.id} (rank {s} -> rank {r}, channel {c.channel}) runs here but the "
                             f"arena of rank {missing[0]} is not mapped in this process")
        conns.append(dict(slots=bases[r] + arenas[r].slots[c.id], tail=bases[r] + arenas[r].tail[c.id],
                          head=bases[s] + arenas[s].head[c.id]))
    return ranks, conns


def error_pointer(arenas: tuple[RankArena, ...], bases: list[int | None], rank: int) -> int:
    """The error word a launch of ``rank``'s blocks reports to: in that
    rank's own arena (a virtual launch of all ranks uses rank 0's)."""
    if bases[rank] is None:
        raise UsageError(f"rank {rank}'s arena is not mapped here")
    return bases[rank] + arenas[rank].error


def peers(layout: KernelLayout, rank: int) -> tuple[int, ...]:
    """The ranks whose arenas ``rank`` must map: the other ends of its connections, and the
    other members of its switch groups."""
    found = {c.receiver for c in layout.connections if c.sender == rank}
    found |= {c.sender for c in layout.connections if c.receiver == rank}
    for g in layout.groups_of(rank):    # the emulated device's switch reaches the members' arenas
        found |= set(layout.groups[g])
    found.discard(rank)
    return tuple(sorted(found))


def resolve(ptr: int, arenas: tuple[RankArena, ...], bases: list[int | None]) -> tuple[int, str, int] | None:
    """(rank, region, offset in region) of an arena address; None for 0.
    For tests and diagnostics: tables built by different processes, at
    different addresses, must resolve to the same places."""
    if ptr == 0:
        return None
    for r, (a, base) in enumerate(zip(arenas, bases)):
        if base is None or not base <= ptr <= base + a.size:
            continue
        off = ptr - base
        regions = [("error", a.error), ("progress", a.progress), ("scratch", a.scratch)]
        regions += [(f"tail{c}", o) for c, o in a.tail.items()] + [(f"head{c}", o) for c, o in a.head.items()]
        regions += [(f"slots{c}", o) for c, o in a.slots.items()]
        if a.group >= 0:                 # first: it wins a tie with an empty scratch region before it
            regions.insert(0, ("group", a.group))
        name, start = max(((n, o) for n, o in regions if o <= off), key=lambda x: x[1])
        return r, name, off - start
    raise UsageError(f"address {ptr:#x} is in no known arena")
