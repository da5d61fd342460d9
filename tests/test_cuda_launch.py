"""The kernel ABI on the host side: MscArgs packed by ctypes must match the C
struct the kernel is compiled with (checked by compiling the struct from the
rendered source with the machine's C++ compiler), and launch parameters and
buffer sizes must follow the chunk geometry."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

import msc
from msc.cuda import render
from msc.cuda.launch import MscArgsHeader, MscConn, MscRank, args_struct, footprint, launch_params, pack_args
from msc.errors import UsageError
from msc.lower.pipeline import LowerOptions, lower
from library import algorithms


def _plan(key="allreduce/ring:ring", n=3, **opts):
    return lower(msc.trace(algorithms(switch=False)[key], n), LowerOptions(**opts))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("form", ["table", "straight"])
def test_packed_layout_matches_the_kernels_struct(tmp_path, form):
    """The header's fields where ctypes puts them, and the kernel's own rank_of and
    conn_of (compiled from the rendered text) finding rank 1 and connection 2 where
    pack_args wrote them."""
    plan = _plan("allreduce/allpairs:allpairs", 4)
    source, layout = render(plan, form=form)
    structs = source[source.index("struct MscConn {"):source.index("enum { BUF_INPUT")]
    head = "\n".join(line for line in source.splitlines() if line.startswith(("#define NRANKS", "#define NTB",
                                                                              "#define K ", "#define SLOTS")))
    fields = [name for name, _ in MscArgsHeader._fields_]
    probe = "\n".join([
        "#include <stdio.h>", "#include <stddef.h>", "#include <stdlib.h>", head,
        "#define __device__", "#define __forceinline__ inline",
        "typedef unsigned long long u64; typedef long long i64; typedef unsigned int u32;", structs,
        "int main(void) {",
        '  printf("size %zu\\n", sizeof(struct MscArgs));',
        *[f'  printf("{f} %zu\\n", offsetof(struct MscArgs, {f}));' for f in fields],
        "  MscArgs* a = (MscArgs*)calloc(1, 4096); a->nranks = 4;",
        '  printf("rank1 %zu\\n", (size_t)((const char*)&rank_of(a, 1).scratch - (const char*)a));',
        '  printf("conn2 %zu\\n", (size_t)((const char*)&conn_of(a, 2).head - (const char*)a));',
        *[f'  printf("slot_{i} %lld\\n", (long long)slot_of({seq}ULL, {slots}));' for i, (seq, slots) in enumerate(SLOT_CASES)],
        "  return 0; }"])
    (tmp_path / "probe.cc").write_text(probe)
    subprocess.run(["g++", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.cc")], check=True)
    out = dict(line.split() for line in subprocess.run([str(tmp_path / "probe")], capture_output=True,
                                                       text=True, check=True).stdout.splitlines())
    assert int(out["size"]) == ctypes.sizeof(MscArgsHeader)
    block = args_struct(layout.num_ranks, len(layout.connections))
    for f in fields:
        assert int(out[f]) == getattr(MscArgsHeader, f).offset == getattr(block, f).offset, f
    assert block.rank.offset == ctypes.sizeof(MscArgsHeader)
    assert int(out["rank1"]) == block.rank.offset + ctypes.sizeof(MscRank) + MscRank.scratch.offset
    assert int(out["conn2"]) == block.conn.offset + 2 * ctypes.sizeof(MscConn) + MscConn.head.offset
    # the slot a message takes, in the kernel's 32-bit arithmetic
    assert [int(out[f"slot_{i}"]) for i in range(len(SLOT_CASES))] == [seq % slots for seq, slots in SLOT_CASES]


SLOT_CASES = [(0, 1), (7, 8), (9, 8), ((1 << 32) + 5, 3), ((1 << 64) - 1, 4096), ((1 << 64) - 1, 4095),
              (123456789012345, 7), ((1 << 40) + 999, 1000), (1 << 63, 12)]


def test_pack_args_writes_the_pointers_where_the_struct_says():
    plan = _plan()
    _, layout = render(plan, form="table")
    params = launch_params(layout, 1000, dtype="float32", protocol="Simple")
    ranks = [dict(input=0x1000 * (r + 1), output=0, scratch=0x10, progress=0x20 + r) for r in range(3)]
    conns = [dict(slots=0x5000 + c, tail=0x6000 + c, head=0x7000 + c) for c in range(len(layout.connections))]
    raw = pack_args(layout, params, ranks=ranks, connections=conns, error=0xE0, first_block=1, slot_room=4160,
                    tables=(0xA000, 0xA100))
    cls = args_struct(3, len(layout.connections))
    back = cls.from_buffer_copy(raw)
    assert (back.count, back.chunk, back.first_block, back.error, back.slot_room) == (1000, 334, 1, 0xE0, 4160)
    assert (back.threadblocks, back.steps) == (0xA000, 0xA100)
    assert (back.nranks, back.nthreadblocks, back.k, back.slots) == (3, len(layout.blocks), plan.chunk_factor,
                                                                     plan.slots)
    assert back.rank[2].input == 0x3000 and back.conn[1].head == 0x7001
    assert abs(back.inv_n - 1 / 3) < 1e-7
    with pytest.raises(UsageError, match="pointer tables"):
        pack_args(layout, params, ranks=ranks[:2], connections=conns, error=0, slot_room=4160, tables=(1, 2))
    with pytest.raises(UsageError, match="needs the plan's tables"):
        pack_args(layout, params, ranks=ranks, connections=conns, error=0, slot_room=4160)


@pytest.mark.parametrize("count, k, expect_chunk", [(0, 3, 0), (1, 3, 1), (7, 3, 3), (3000, 3, 1000)])
def test_launch_params_follow_the_chunk_geometry(count, k, expect_chunk):
    plan = _plan(n=k)
    _, layout = render(plan, form="table")
    p = launch_params(layout, count, dtype="bfloat16", protocol="LL")
    assert p.chunk == expect_chunk
    assert p.tile % 8 == 0 and p.tile >= 8
    assert p.iterations == (0 if expect_chunk == 0 else -(-expect_chunk // p.tile))
    big = launch_params(layout, 10 ** 8, dtype="float32", protocol="Simple", tile_bytes=4096)
    assert big.tile == 1024 and big.iterations == -(-big.chunk // 1024)


def test_footprint_sizes_scratch_slots_and_counters():
    plan = _plan("reducescatter/ring:ring", 3)
    _, layout = render(plan, form="table")
    params = launch_params(layout, 4099, dtype="float32", protocol="Simple")
    fp = footprint(layout, params, dtype="float32", protocol="Simple", slots=8)
    # a scratch chunk, and every chunk-tile of a Simple slot, has room to start at its class's offset within
    # 16 bytes (4 floats): a chunk of 4099 floats takes 4104 (a multiple of 4 holding 4099 + 3)
    assert params.chunk == 4099 and params.vec == 4 and params.scratch_stride == 4104
    assert fp.scratch == tuple(c * 4104 * 4 for c in layout.scratch_chunks)
    assert fp.room == (params.tile + 4) * 4 and fp.room % 16 == 0
    assert fp.slots == tuple(8 * c.max_count * fp.room for c in layout.connections)
    ll = footprint(layout, params, dtype="float32", protocol="LL", slots=8)
    assert ll.slots == tuple(8 * c.max_count * params.tile * 8 for c in layout.connections)   # a flag per word
    with pytest.raises(UsageError, match="deadlock"):
        footprint(layout, params, dtype="float32", protocol="Simple", slots=layout.slots - 1 or 0)
