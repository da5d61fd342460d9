"""Plans with switch ops (NVLS) on msc's CUDA runtime: the emulated device runs
the real kernels (swred/swst/swrs through templates/multimem.cuh.j2 on the
members' copies, group barriers on per-(group, channel) counters) and the
real Communicator (group memory in the arenas, the callers' buffers staged in
and out); every result bit-exact against msc.executor on random inputs
(never zero), avg included (the switch's sum, then a second launch divides each
output chunk as the executor does). The default run takes a case per (dtype, op) the switch reduces;
tests/test_cuda_emu.py's slow sweep takes the cross product.

Also here: a rank in two switch groups; what is refused before anything launches (an op or
dtype the switch cannot reduce, half types on odd chunks, a GPU
placement other than torchrun, a GPU without multicast), and the GPU path's
orchestration with the driver and multicast faked (cudaboot).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
import pytest

import msc
from cudaboot import check_run, queued_allreduces_are_right
from library import algorithms
from msc.cuda import Communicator
from msc.cuda.switch import supported_pairs
from msc.errors import UsageError
from msc.ir.ops import REDUCE_OPS
from msc.lower.pipeline import LowerOptions, lower

# The library's switch algorithms and the rank counts they run at here (nvls_tree, nvls_ring: nodes of 2 GPUs).
SWITCH_KEYS = {"allreduce/nvls:nvls": (2, 3, 5), "allreduce/nvls_tree:nvls_tree": (4, 8),
               "allreduce/nvls_ring:nvls_ring": (4, 6)}
TREE_NODE = {"gpus_per_node": 2}
# What the switch reduces (avg: the switch's sum, then the runtime's division pass).
SWITCH_PAIRS = supported_pairs()


@lru_cache(maxsize=None)
def switch_plan(key: str, n: int, inplace: bool = True, instances: int = 1):
    alg = algorithms()[key]
    if "nvls_tree" in key or "nvls_ring" in key:
        alg = dataclasses.replace(alg, params={**alg.params, **TREE_NODE})
    return lower(msc.trace(alg, n, inplace=inplace), LowerOptions(instances=instances, tile=4096))


def counts_for(plan, dtype: str) -> tuple[int, ...]:
    """Counts per data unit: one, a few, several tiles per chunk, with short last chunks. The switch
    moves half types in pairs: their chunks even, and the last one shorter by two."""
    if dtype in ("float16", "bfloat16"):
        return tuple(_pairs_count(plan.chunk_factor, near) for near in (2, 250, 2050))
    return 1, 3, 1001, 8197


def _pairs_count(k: int, chunk: int) -> int:
    """The smallest count per unit (even) whose chunks (ceil(count / k)) have ``chunk`` elements
    (even): the last chunk as short as that allows (k = 2 leaves none shorter)."""
    chunk += chunk % 2
    return min(e for e in range(k * (chunk - 1), k * chunk + 1) if e % 2 == 0 and -(-e // k) == chunk)


# One case per (dtype, op) the switch reduces, rotating algorithm, ranks, in place, instances and form.
CASES = [("allreduce/nvls:nvls", 4, True, 1, "table"), ("allreduce/nvls:nvls", 3, False, 2, "straight"),
         ("allreduce/nvls_tree:nvls_tree", 4, True, 2, "table"), ("allreduce/nvls:nvls", 5, False, 1, "table"),
         ("allreduce/nvls_tree:nvls_tree", 8, False, 1, "straight"), ("allreduce/nvls:nvls", 2, True, 2, "straight"),
         ("allreduce/nvls_ring:nvls_ring", 6, False, 2, "table"), ("allreduce/nvls_ring:nvls_ring", 4, True, 1, "straight")]
DEFAULT = [CASES[i % len(CASES)] + pair for i, pair in enumerate(SWITCH_PAIRS)]


@pytest.fixture(scope="module")
def cache(kernel_cache):
    return kernel_cache


def test_the_cases_cover_every_pair_the_switch_reduces():
    assert {(d, o) for *_, d, o in DEFAULT} == set(SWITCH_PAIRS)
    assert len(SWITCH_PAIRS) == 15 and ("int32", "min") in SWITCH_PAIRS and ("float64", "sum") in SWITCH_PAIRS
    assert {d for d, o in SWITCH_PAIRS if REDUCE_OPS[o].average} == {"float32", "float64", "float16", "bfloat16"}


@pytest.mark.parametrize("key, n, inplace, instances, form, dtype, op", DEFAULT)
def test_library_switch_algorithms_match_the_reference_executor(key, n, inplace, instances, form, dtype, op, cache):
    plan = switch_plan(key, n, inplace, instances)
    assert plan.first_switch_step() is not None
    comm = Communicator(plan, "virtual", device="emu", form=form, cache=cache, dtypes=(dtype,), ops=(op,),
                        timeout_s=60)
    assert comm.layout.form == form and comm.layout.switch
    for i, count in enumerate(counts_for(plan, dtype)):
        check_run(comm, count, dtype, op, seed=1000 * n + i)
    comm.close()


def test_calls_back_to_back_on_several_devices_and_growing_buffers(cache):
    """Calls queue on 4 emulated devices with no synchronize between them: the group barriers'
    counters persist across launches (each call's targets follow from where the last left them),
    and a larger call grows the arenas, counters restarting from zero."""
    plan = switch_plan("allreduce/nvls:nvls", 4, True, 2)
    comm = Communicator(plan, "devices", [0, 1, 2, 3], device="emu", cache=cache, timeout_s=60)
    queued_allreduces_are_right(comm, plan, [(300, 7, 5000, 1)[i % 4] + i for i in range(30)], seed=7)
    assert comm._generation >= 2
    from msc.cuda.tables import resolve

    at = comm._groups.buffers                   # each rank's staged buffers: in its own arena's group memory
    assert [resolve(comm._group_memory(r).local + at, comm._arenas, comm._bases) for r in range(4)] == \
        [(r, "group", at) for r in range(4)]
    comm.close()


# -- refused before anything launches ---------------------------------------------------------------
@pytest.mark.parametrize("dtype, op, message", [
    ("float32", "prod", "cannot reduce float32 with prod \\(multimem.ld_reduce does sum on float32\\)"),
    ("float32", "max", "cannot reduce float32 with max"),
    ("int32", "avg", "avg on the msc CUDA runtime needs a floating type"),
    ("bfloat16", "prod", "cannot reduce bfloat16 with prod"),
    ("float16", "prod", "cannot reduce float16 with prod"),
])
def test_ops_the_switch_cannot_do_are_refused_with_the_tables_message(dtype, op, message, cache):
    plan = switch_plan("allreduce/nvls:nvls", 4)
    with pytest.raises(UsageError, match=message):
        Communicator(plan, device="emu", cache=cache, dtypes=(dtype,), ops=(op,))
    comm = Communicator(plan, device="emu", cache=cache)       # float32 sum: fine; then a call asks for more
    xs = [np.ones(64, np.dtype(dtype)) for _ in range(4)]
    with pytest.raises(UsageError, match=message):
        comm.all_reduce(xs, op=op)
    assert comm._arenas is None                                 # refused before any memory or launch
    comm.close()


def test_half_types_on_odd_chunks_are_refused(cache):
    plan = switch_plan("allreduce/nvls:nvls", 2)               # 2 chunks a unit
    comm = Communicator(plan, device="emu", cache=cache, dtypes=("bfloat16",))
    xs = [np.ones(6, np.uint16).view(__import__("ml_dtypes").bfloat16) for _ in range(2)]
    with pytest.raises(UsageError, match="elements per chunk \\(3\\).*moves bfloat16 in pairs of elements"):
        comm.all_reduce(xs)
    comm.close()


# A rank in two switch groups: pairs {0,1} and {2,3} sum their halves in the switch, then the cross
# pairs {0,2} and {1,3} sum the pairs' sums. Each threadblock: a first barrier, its op, a barrier at
# every tile (the cross pair's threadblock waits for it, so a member's second op follows its first
# group's writes tile by tile), a last barrier. Written as plan text (a barrier per tile, which msc's
# lowering does not write: it orders the phases with two rounds of barriers, the test after this).
TWO_GROUPS = {0: ((0, 1), "input[0] -> output[0]", (0, 2), "output[0] -> output[0]"),
              1: ((0, 1), "input[1] -> output[1]", (1, 3), "output[0] -> output[0]"),
              2: ((2, 3), "input[0] -> output[0]", (0, 2), "output[1] -> output[1]"),
              3: ((2, 3), "input[1] -> output[1]", (1, 3), "output[1] -> output[1]")}


def two_groups_plan(*, ordered: bool = True):
    from msc.formats.plan_text import parse_plan

    lines = ['msc-plan 1', 'name "two_groups" collective allreduce ranks 4 chunk_factor 2',
             'input_chunks 2 output_chunks 2 inplace false root 0', 'protocol Simple instances 1 slots 1 tile 0', '']
    for r, (first, op1, second, op2) in TWO_GROUPS.items():
        lines += [f"rank {r} scratch 0", f"  tb 0 send - recv - channel 0 group {','.join(map(str, first))}",
                  "    0: barrier", f"    1: swrs {op1}", "    2: barrier", "    3: barrier",
                  f"  tb 1 send - recv - channel 0 group {','.join(map(str, second))}",
                  "    0: barrier", "    1: barrier" + (" after 0.2" if ordered else ""), f"    2: swrs {op2}",
                  "    3: barrier", ""]
    return parse_plan("\n".join(lines))


def test_the_two_group_plan_verifies_and_races_without_its_cross_group_order():
    from msc.errors import RaceError
    from msc.verification.plan import check_races, verify_plan

    assert verify_plan(two_groups_plan()).results_checked
    check_races(two_groups_plan())
    with pytest.raises(RaceError, match="race on rank"):
        check_races(two_groups_plan(ordered=False))


@pytest.mark.parametrize("placement, form", [("virtual", "straight"), ("devices", "table")])
def test_a_rank_in_two_switch_groups_matches_the_reference_executor(placement, form, cache):
    """Every rank is in two groups: one group memory per rank that both its groups reach, a
    barrier counter per (group, channel); bit-exact against msc.executor, counts of one and of
    several tiles per chunk, sum and avg."""
    from msc.cuda.codegen import kernel_layout

    plan = two_groups_plan()
    layout = kernel_layout(plan, form)
    assert layout.groups == ((0, 1), (0, 2), (1, 3), (2, 3)) and layout.groups_of(0) == (0, 1)
    assert len(layout.group_counters()) == 4
    devices = [0, 1, 2, 3] if placement == "devices" else None
    comm = Communicator(plan, placement, devices, device="emu", form=form, cache=cache, timeout_s=60)
    for i, count in enumerate((1, 3, 1001, 300_002)):              # 300002: two tiles a chunk
        check_run(comm, count, "float32", "sum", seed=50 + i)
    for i, count in enumerate((4, 1004, 300_004)):                 # half types: even chunks
        check_run(comm, count, "bfloat16", "avg", seed=60 + i)
    at = comm._groups.buffers
    counters = {comm._groups.counter(g, 0) for g in range(4)}
    assert len(counters) == 4 and max(counters) < at              # four counters, then the buffers
    comm.close()


def test_the_lowered_two_group_program_runs_on_the_emulated_device(tmp_path, cache):
    """The DSL form of the same collective, lowered by msc (tests/test_switch.py checks its
    barriers), bit-exact against msc.executor."""
    from test_switch import TWO_GROUPS_BODY, _algorithm

    alg = _algorithm(tmp_path, TWO_GROUPS_BODY.replace("{out}", "output"), chunk_factor="lambda n: 2")
    plan = lower(msc.trace(alg, 4, inplace=False), LowerOptions())
    comm = Communicator(plan, "virtual", None, device="emu", form="table", cache=cache, timeout_s=60)
    for i, count in enumerate((3, 1001, 300_002)):
        check_run(comm, count, "float32", "sum", seed=70 + i)
    comm.close()


def test_switch_table_points_each_group_at_its_own_multicast_object_and_counter():
    """A GPU member of two groups: both its threadblocks' entries use the one memory, each its
    group's multicast address and its (group, channel) counter."""
    import ctypes

    from msc.cuda.codegen import kernel_layout
    from msc.cuda.groups import MemberMemory, MscSwitchC, group_layout, switch_table

    layout = kernel_layout(two_groups_plan(), "table")
    groups = group_layout(layout, 4096)
    mine = MemberMemory(1 << 40, (5 << 40, 6 << 40, 0, 0))          # rank 0: in groups 0 and 1 only
    raw = switch_table(layout, [mine, None, None, None], groups, 1 << 44)
    size = ctypes.sizeof(MscSwitchC)
    entries = [MscSwitchC.from_buffer_copy(raw[g * size:(g + 1) * size]) for g in range(len(layout.blocks))]
    first, count = layout.rank_blocks[0]
    got = [(e.mem.mc, e.flag.mc, e.mine, e.mem.n) for e in entries[first:first + count]]
    assert got == [(5 << 40, (5 << 40) + groups.counter(0, 0), (1 << 40) + groups.counter(0, 0), 2),
                   (6 << 40, (6 << 40) + groups.counter(1, 0), (1 << 40) + groups.counter(1, 0), 2)]
    assert all(not e.mem.mc and not e.mine for e in entries[count:])   # other ranks: not run here


def test_avg_divides_what_the_executor_divides_in_a_second_launch():
    """A switch plan's avg: no input pre-scaled (the switch reads members' memory as it is), the
    kernel run as a sum, then a division pass over exactly the executor's averaged chunks."""
    from msc.cuda.codegen import average_table, plan_tables, prescales, render
    from msc.executor import Executor

    plan = switch_plan("allreduce/nvls:nvls", 4, False)
    assert not prescales(plan, "avg") and prescales(lower(msc.trace(algorithms()["allreduce/ring:ring"], 4),
                                                          LowerOptions()), "avg")
    assert plan_tables(plan, op="avg") == plan_tables(plan, op="sum")          # no fresh flags set
    table = average_table(plan)
    head, entries = table[:12], table[12:]
    averaged = Executor(plan).averaged
    assert len(averaged) == 4 * 4 and {m for *_, m in averaged} == {4}
    for rank in range(4):
        first, end, tbs = head[3 * rank:3 * rank + 3]
        assert tbs == len(plan.ranks[rank].threadblocks)
        assert [tuple(entries[3 * e:3 * e + 3]) for e in range(first, end)] == \
            [(1, index, m) for r, buf, index, m in averaged if r == rank and buf == "output"]
    source = render(plan, dtype="bfloat16", op="avg", form="straight")[0]
    assert "divide_outputs(a, g)" in source and "divide_outputs" not in render(plan, op="sum", form="straight")[0]


def test_kernels_without_switch_ops_include_none_of_it():
    from msc.cuda.codegen import render, render_table_kernel

    ring = lower(msc.trace(algorithms()["allreduce/ring:ring"], 4), LowerOptions())
    for source in (render(ring, form="straight")[0], render_table_kernel("Simple")):
        assert "SwitchMem" not in source and "switch_step" not in source and "switches" not in source
    source = render(switch_plan("allreduce/nvls:nvls", 4), form="straight")[0]
    assert "multimem.ld_reduce" in source and "switch_step(b, it" in source


# -- the GPU path, with the driver and multicast faked ------------------------------------------------
def test_gpu_torchrun_binds_group_memory_stages_buffers_and_fills_the_switch_table(gloo2):
    """Each process opens its group memory through msc.cuda.multicast (member 0 creates the object,
    each binds its own memory), zeroes the barrier counters, points the kernel's buffers at its
    copy, copies its tensor in before the launch and out after, and hands the kernel multicast
    addresses only (members[] null); close() releases everything."""
    import cudaboot

    got = gloo2.run(cudaboot.fake_switch_torchrun_case)
    for rank, out in enumerate(got):
        assert isinstance(out, dict), out
        at, counters = out["buffers"], dict(zip(sorted(set(out["channels"])), out["counters"]))
        assert out["members"] == 2 and out["bound"] == 1 and out["zeroed"]
        assert out["created"] == ([("mc_create", out["size"], 2)] if rank == 0 else [])
        assert out["size"] % (2 << 20) == 0 and out["size"] >= at + 2 * 64 * 4
        assert out["input"] == (at, at) and out["switch_offsets"] == (at // 4, at // 4)
        assert out["entries"] == [(0, 0, 2, counters[c], 0, counters[c]) for c in out["channels"]]
        nbytes = 2 * 64 * 4                           # in place: the whole tensor in, then out
        assert out["copies"] == [(at, "user", nbytes), ("user", at, nbytes)]
        assert out["left"] == []


def test_gpu_placements_other_than_torchrun_and_gpus_without_multicast_are_refused(monkeypatch):
    pytest.importorskip("torch")
    import cudaboot
    from msc.cuda import multicast
    from msc.cuda.backend import CudaBackend
    from msc.errors import CapabilityError

    state = cudaboot.install_fakes(monkeypatch.setattr)
    with pytest.raises(UsageError, match="runs on GPUs under placement 'torchrun'.*not 'virtual'"):
        Communicator(switch_plan("allreduce/nvls:nvls", 2), "virtual")
    pcie = multicast.DeviceFacts(0, "NVIDIA H100 PCIe", (9, 0), False, True, True)
    monkeypatch.setattr(multicast, "CudaMulticast", lambda: cudaboot.FakeMulticast(state["mem"], pcie))
    with pytest.raises(CapabilityError, match="NVIDIA H100 PCIe.*MULTICAST_SUPPORTED"):
        CudaBackend().check_switch("torchrun", (0,))


# -- static gate: the whole kernel through NVRTC and ptxas for sm_90 (no GPU) -----------------------
@pytest.mark.parametrize("form, dtype, op", [("straight", "float32", "sum"), ("table", "bfloat16", "max"),
                                             ("table", "int32", "min"), ("straight", "float16", "avg")])
def test_switch_kernels_compile_for_sm90_with_multimem_and_no_spills(form, dtype, op, tmp_path):
    """The Communicator's kernel of nvls (runtime_plan) for sm_90: ptxas accepts it, its PTX holds
    the (dtype, op)'s multimem forms (tests/test_switch_static.py's table) and the barrier's release
    red, and ptxas reports no spill bytes."""
    pytest.importorskip("cuda.bindings")
    import re

    from msc.cuda.compiler import rendered
    from msc.cuda.runtime import runtime_plan
    from msc.cuda.switch import nvrtc_ptx
    from test_switch_static import expected_forms

    source = rendered(runtime_plan(switch_plan("allreduce/nvls:nvls", 4, True, 2)), dtype=dtype, op=op,
                      form=form, cache=tmp_path).source
    ptx, cubin, log = nvrtc_ptx(source, name="kernel.cu")
    loads, stores = expected_forms(dtype, op)
    assert set(re.findall(r"multimem\.ld_reduce\S*", ptx)) == loads
    assert set(re.findall(r"multimem\.st\S*", ptx)) == stores
    assert set(re.findall(r"multimem\.red\S*", ptx)) == {"multimem.red.release.sys.global.add.u64"}
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert len(cubin) > 0 and spills and not any(spills), log
