"""The host side of the kernel's ABI: launch parameters for an element count,
the device memory a placement must provide, and the MscArgs block (the
struct in templates/steps.cuh.j2) packed with ctypes. Pure Python: the GPU
runtime fills in real pointers; tests check this layout against the C
struct compiled by a C compiler.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

from msc.cuda.codegen import COUNTER_STRIDE, DTYPES, KernelLayout
from msc.errors import UsageError
from msc.ir.limits import MAX_SLOTS, check
from msc.ir.ops import PROTOCOLS

# Pipelining tile per chunk and iteration, by protocol (bytes; msc.ir.ops, as the
# simulator's defaults). A plan's `tile` overrides them.
DEFAULT_TILE_BYTES = {p.name: p.tile for p in PROTOCOLS.values()}
ERROR_WORDS = 5          # code, rank, threadblock, step, iteration


# A launch publishes dependency counters as (launch << 32) + iteration * steps + step + 1
# (templates/kernel.cu.j2): iterations x steps of one threadblock must stay below 2^32.
PROGRESS_LIMIT = 1 << 32


@dataclass(frozen=True)
class LaunchParams:
    """What one launch computes from the element count E (per data unit)."""

    count: int           # E
    chunk: int           # q = ceil(E / K): elements of a full chunk
    tile: int            # elements of a chunk per iteration (a multiple of 8)
    iterations: int      # ceil(q / tile); 0 when there is nothing to move
    vec: int = 1         # elements of a 16-byte vector (slots and scratch leave room to align chunks)

    @property
    def scratch_stride(self) -> int:
        """Elements from one scratch chunk to the next: a chunk and room to
        start it at its class's offset within 16 bytes, a multiple of ``vec``."""
        return -(-(self.chunk + self.vec - 1) // self.vec) * self.vec if self.chunk else 0


def launch_params(layout: KernelLayout, count: int, *, dtype: str, protocol: str, tile_bytes: int = 0) -> LaunchParams:
    if type(count) is not int or count < 0:
        raise UsageError(f"element count must be an int >= 0, got {count!r}")
    size = DTYPES[dtype].size
    q = -(-count // layout.chunk_factor)
    want = tile_bytes or DEFAULT_TILE_BYTES[protocol]
    tile = max(8, (want // size) // 8 * 8)
    tile = min(tile, max(8, -(-q // 8) * 8))        # no larger than a chunk needs
    params = LaunchParams(count, q, tile, 0 if q == 0 else math.ceil(q / tile), max(1, 16 // size))
    steps = layout.max_steps
    if params.iterations * steps >= PROGRESS_LIMIT:
        raise UsageError(f"a call of {count} elements per unit moves {params.iterations} tiles per chunk through "
                         f"threadblocks of up to {steps} steps: {params.iterations * steps} steps per launch, and "
                         f"the kernel counts at most {PROGRESS_LIMIT - 1}; use a plan with a larger tile or split "
                         f"the call")
    return params


@dataclass(frozen=True)
class Footprint:
    """Bytes of device memory a rank's buffers need for one launch shape.

    ``room``: bytes a chunk-tile takes in a slot. The kernel lays out slots
    with the arena's room, not the call's: under the devices and torchrun
    placements consecutive calls overlap on a connection (a sender may start
    call k+1 while its receiver still reads call k), so every call must see
    the slots where the others do."""

    scratch: tuple[int, ...]           # per rank
    slots: tuple[int, ...]             # per connection (in its receiver's memory)
    progress: tuple[int, ...]          # per rank: a counter (a cache line) per threadblock
    counters: int = 2 * COUNTER_STRIDE  # per connection: tail (receiver) and head (sender), a line each
    error: int = 4 * ERROR_WORDS
    room: int = 0                      # bytes of a chunk-tile in a slot (a multiple of 16)
    group: int = 0                     # bytes of a switch group member's memory (msc.cuda.groups), 0: none


def footprint(layout: KernelLayout, params: LaunchParams, *, dtype: str, protocol: str, slots: int,
              group: int = 0) -> Footprint:
    """Device memory for ``params``; ``slots`` per connection (at least the plan's); ``group``:
    bytes of a switch group member's memory (msc.cuda.groups.group_bytes)."""
    if slots < layout.slots:
        raise UsageError(f"the plan was verified deadlock-free with {layout.slots} slots per connection; "
                         f"{slots} may deadlock")
    size = DTYPES[dtype].size
    if PROTOCOLS[protocol].transport == "ll":     # 4 flag bytes per 4 data bytes
        room = 2 * size * params.tile
    else:                         # a tile and the room to start it at its class's offset (transport_simple)
        room = size * (params.tile + params.vec)
    return Footprint(
        scratch=tuple(c * params.scratch_stride * size for c in layout.scratch_chunks),
        slots=tuple(slots * c.max_count * room for c in layout.connections),
        progress=tuple(COUNTER_STRIDE * n for n in layout.threadblocks_per_rank), room=room, group=group)


# -- MscArgs and its arrays, as in templates/steps.cuh.j2 -----------------------------
class MscConn(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_void_p), ("tail", ctypes.c_void_p), ("head", ctypes.c_void_p)]


class MscRank(ctypes.Structure):
    _fields_ = [("input", ctypes.c_void_p), ("output", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("progress", ctypes.c_void_p)]


_HEADER_FIELDS = [
    ("count", ctypes.c_int64), ("chunk", ctypes.c_int64), ("tile", ctypes.c_int64),
    ("iterations", ctypes.c_int64), ("timeout", ctypes.c_int64), ("scratch_stride", ctypes.c_int64),
    ("slot_room", ctypes.c_int64), ("inv_n", ctypes.c_float),
    ("first_block", ctypes.c_int32), ("error", ctypes.c_void_p),
    ("threadblocks", ctypes.c_void_p), ("steps", ctypes.c_void_p),
    ("nranks", ctypes.c_int32), ("nthreadblocks", ctypes.c_int32), ("k", ctypes.c_int32), ("slots", ctypes.c_int32),
    ("local", ctypes.c_int32)]


class MscArgsHeader(ctypes.Structure):
    """MscArgs itself: the fields before the rank and connection arrays."""
    _fields_ = _HEADER_FIELDS


# A switch plan's MscArgs ends with a pointer to its MscSwitch table (templates/steps.cuh.j2).
_SWITCH_FIELDS = [("switches", ctypes.c_void_p), ("switch_input", ctypes.c_int64), ("switch_output", ctypes.c_int64),
                  ("averages", ctypes.c_void_p), ("divide", ctypes.c_int32)]


def args_struct(num_ranks: int, num_connections: int, switch: bool = False) -> type[ctypes.Structure]:
    """The block a launch reads: MscArgs, then an MscRank per rank and an MscConn
    per connection (what the kernel's rank_of and conn_of index)."""
    return type("MscArgsBlock", (ctypes.Structure,), {"_fields_": _HEADER_FIELDS + (_SWITCH_FIELDS if switch else []) + [
        ("rank", MscRank * num_ranks), ("conn", MscConn * max(num_connections, 1))]})


def args_header_size(switch: bool) -> int:
    """sizeof(MscArgs) of a kernel with (``switch``) or without switch ops."""
    return ctypes.sizeof(args_struct(0, 0, switch)) - ctypes.sizeof(MscConn)


def pack_args(layout: KernelLayout, params: LaunchParams, *, ranks: list[dict], connections: list[dict],
              error: int, slot_room: int, first_block: int = 0, timeout_ns: int = 300 * 10 ** 9,
              tables: tuple[int, int] = (0, 0), local: bool = False, switches: tuple[int, int, int] = (0, 0, 0),
              divide: int = 0) -> bytes:
    """MscArgs and its arrays as bytes to copy to the device. ``ranks[r]``:
    pointers input, output, scratch, progress (0 for a rank this process does
    not run); ``connections[c]``: pointers slots, tail, head, in
    layout.connections order; ``slot_room``: the arena's bytes per chunk-tile
    in a slot (Footprint.room); ``timeout_ns``: how long a spin-wait may last
    (the GPU's global timer); ``tables``: device pointers to the plan's
    threadblock and step tables (the table form; codegen.PlanTables);
    ``local``: every peer of the launch's blocks is on its GPU (the virtual
    placement), so connection counters and LL packets need only .gpu scope;
    ``switches``: a switch plan's MscSwitch table (msc.cuda.groups) and the element offsets of
    the input and output in group memory, required there; ``divide``: a switch plan's average,
    the device pointer of its division table (msc.cuda.codegen.average_table): this launch is the
    division pass (templates/switch_average.cuh.j2)."""
    if len(ranks) != layout.num_ranks or len(connections) != len(layout.connections):
        raise UsageError(f"pointer tables for {len(ranks)} ranks and {len(connections)} connections; the kernel "
                         f"has {layout.num_ranks} and {len(layout.connections)}")
    check(layout.slots, MAX_SLOTS, "slots per connection")      # the kernel's slot_of assumes it
    if layout.form == "table" and not all(tables):
        raise UsageError("a table-form launch needs the plan's tables in device memory (tables=...)")
    if layout.switch and not switches[0]:
        raise UsageError("a launch of a plan with switch ops needs its group memory table (switches=...)")
    cls = args_struct(layout.num_ranks, len(layout.connections), layout.switch)
    if divide and not layout.switch:
        raise UsageError("only a plan with switch ops has a division pass (divide=...)")
    extra = dict(zip(("switches", "switch_input", "switch_output"), switches), averages=divide,
                 divide=int(bool(divide))) if layout.switch else {}
    args = cls(**extra, count=params.count, chunk=params.chunk, tile=params.tile, iterations=params.iterations,
               timeout=timeout_ns, scratch_stride=params.scratch_stride, slot_room=slot_room,
               inv_n=1.0 / layout.num_ranks, first_block=first_block, error=error,
               threadblocks=tables[0], steps=tables[1], nranks=layout.num_ranks,
               nthreadblocks=len(layout.blocks), k=layout.chunk_factor, slots=layout.slots, local=int(local))
    for r, ptrs in enumerate(ranks):
        args.rank[r] = MscRank(**ptrs)
    for c, ptrs in enumerate(connections):
        args.conn[c] = MscConn(**ptrs)
    return bytes(args)
