"""CUDA code generation and NVRTC compilation (no GPU needed).

Every library algorithm at 2, 4 and 8 ranks x {Simple, LL} x {float32,
bfloat16} renders and compiles to a cubin for sm_90 (``-m slow``: what these
kernels compute is tested on the emulated device, what NVRTC makes of them
by tests/test_cuda_static.py). The sweep uses the
table form, whose step engine is the same code the straight-line form
inlines; the straight-line form is compiled for every algorithm at 2 ranks
and for larger cases below (it costs NVRTC about 40 ms a step, so a full
straight-line sweep would take CI many minutes). Structure checks assert on
the generated source, CHECK-style.
"""
from __future__ import annotations

import re
from functools import lru_cache

import pytest

import msc
from msc.cuda import compile as compile_cuda
from msc.cuda import nvrtc_compile, render
from msc.cuda.codegen import STRAIGHT_LINE_MAX_STEPS, choose_form
from msc.errors import CompileError, UsageError
from msc.lower.pipeline import LowerOptions, lower
from library import algorithms

pytest.importorskip("cuda.core")
ALGORITHMS = algorithms(switch=False)


def _cubin_facts_module():
    import importlib.util
    import sys
    from pathlib import Path

    if "cubin_facts" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "bench" / "cubin_facts.py"
        spec = importlib.util.spec_from_file_location("cubin_facts", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["cubin_facts"] = module
        spec.loader.exec_module(module)
    return sys.modules["cubin_facts"]


_SOUND: set = set()          # (cubin digest, arch, protocol, threads) found sound: the same bytes, the same facts


def assert_sound(kernel) -> None:
    """What a broken compile would fail: a cubin whose one entry is msc_kernel,
    within its launch bounds' registers, with the element-loop function, no
    spills (read with cuobjdump/nvdisasm where the test extra installed them;
    else the ELF header and the entry's name only). A cubin already found
    sound (the table form's, shared by many plans) is not read again."""
    import hashlib

    from msc.cuda.codegen import MIN_BLOCKS

    assert kernel.cubin[:4] == b"\x7fELF" and b"msc_kernel" in kernel.cubin
    cf = _cubin_facts_module()
    if cf.missing_tools():
        return
    seen = (hashlib.sha256(kernel.cubin).hexdigest(), kernel.arch, kernel.protocol, kernel.layout.nthreads)
    if seen in _SOUND:
        return
    threads = kernel.layout.nthreads
    facts = cf.cubin_facts(kernel.cubin, arch=kernel.arch, protocol=kernel.protocol, nthreads=threads)
    assert 0 < facts["registers"] <= 65536 // (threads * MIN_BLOCKS[kernel.protocol]), facts["registers"]
    assert facts["loop_function_found"], facts["functions"]
    spilled = {n: (f["spill_store_bytes"], f["spill_load_bytes"]) for n, f in facts["sass"].items()
               if f["spill_store_bytes"] or f["spill_load_bytes"]}
    assert not spilled, spilled
    _SOUND.add(seen)


@lru_cache(maxsize=None)
def plan_for(key: str, n: int, protocol: str = "Simple", inplace: bool = True):
    return lower(msc.trace(ALGORITHMS[key], n, inplace=inplace), LowerOptions(protocol=protocol))


@pytest.fixture(scope="module")
def cache(kernel_cache):
    return kernel_cache


def rank_counts(key: str) -> list[int]:
    """2, 4 and 8 ranks where the algorithm takes them; else its smallest count (a torus needs 9)."""
    counts = [n for n in (2, 4, 8) if ALGORITHMS[key].supports(n)]
    return counts or [next(n for n in range(3, 65) if ALGORITHMS[key].supports(n))]


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_library_compiles_for_sm90(key, cache):
    compiled = 0
    for n in rank_counts(key):
        for protocol in ("Simple", "LL"):
            plan = plan_for(key, n, protocol)
            for dtype in ("float32", "bfloat16"):
                kernel = compile_cuda(plan, dtype=dtype, arch="sm_90", form="table", cache=cache)
                assert_sound(kernel)
                compiled += 1
    assert compiled >= 4, f"{key}: too few rank counts supported"


# the default run compiles one algorithm per collective in the straight form; `-m slow` all of them
STRAIGHT_SAMPLE = {"allreduce/hierarchical:hierarchical", "allgather/ring:ring", "reducescatter/allpairs:allpairs",
                   "alltoall/hierarchical:hierarchical", "broadcast/binomial_tree:binomial_tree", "reduce/tree:tree"}


@pytest.mark.parametrize("key", [pytest.param(k, marks=() if k in STRAIGHT_SAMPLE else pytest.mark.slow)
                                 for k in sorted(ALGORITHMS)])
def test_library_straight_line_form_compiles(key, cache):
    n = rank_counts(key)[0]
    kernel = compile_cuda(plan_for(key, n), dtype="float32", arch="sm_90", form="straight", cache=cache)
    assert_sound(kernel)
    assert "straight form" in kernel.source


@pytest.mark.parametrize("dtype, op", [("float16", "avg"), ("int32", "prod"),      # the rest under -m slow
                                       pytest.param("float64", "min", marks=pytest.mark.slow),
                                       pytest.param("bfloat16", "max", marks=pytest.mark.slow),
                                       pytest.param("float32", "avg", marks=pytest.mark.slow)])
def test_other_types_and_ops_compile(dtype, op, cache):
    for protocol in ("Simple", "LL"):
        plan = plan_for("allreduce/ring:ring", 4, protocol, inplace=False)
        assert_sound(compile_cuda(plan, dtype=dtype, op=op, arch="sm_90", form="straight", cache=cache))


def test_sm80_compiles(cache):
    plan = plan_for("allreduce/allpairs:allpairs", 4, "LL")
    kernel = compile_cuda(plan, dtype="bfloat16", arch="sm_80", cache=cache)
    assert kernel.arch == "sm_80"
    assert_sound(kernel)


# -- structure of the generated source ------------------------------------------------
def test_ring_source_has_its_fused_steps_with_constants_folded():
    plan = plan_for("allreduce/ring:ring", 3, "Simple", inplace=False)
    source, layout = render(plan, dtype="bfloat16", op="sum", form="straight")
    # CHECK: the ring's fused steps on rank 0, in order, as straight-line calls with literal operands
    body = source[source.index("__device__ __noinline__ Block tb_0("):source.index("__device__ __noinline__ Block tb_1(")]
    calls = re.findall(r"run_step\(b, it, (\d+), OP_(\w+), (\d+), (\d+), src, Operand\{ (\d), (\d+) \}", body)
    assert [c[1] for c in calls] == ["SEND", "RRS", "RRCS", "RCS", "RECV"]
    assert calls[2] == ("2", "RRCS", "1", "1", "1", "0"), "rrcs input[0] -> output[0]: dst folded to (1, 0)"
    assert "static const Operand src[1] = { { 0, 0 } };" in body      # its source: input[0], folded
    assert "#define K 3" in source and "#define SLOTS 2" in source and "#define NRANKS 3" in source
    assert "struct elem_t { u16 bits; };" in source and "cvt.rn.bf16.f32" in source
    assert "st.release.sys" in source and "ld.acquire.sys" in source
    assert len(layout.connections) == 3 and layout.blocks == ((0, 0), (1, 0), (2, 0))


def test_ll_source_uses_flagged_packets_and_table_form_a_step_table():
    plan = plan_for("allgather/ring:ring", 4, "LL")
    ll, _ = render(plan, dtype="float32", form="straight")
    assert "st_packet(" in ll and "spin_packet(" in ll and "transport_simple" not in ll
    table, _ = render(plan, dtype="float32", form="table")
    assert "const int* p = b.a->steps + b.start;" in table and "tb_0(" not in table and "MSC_TBS" not in table


def test_one_table_form_kernel_serves_every_plan_of_its_kind(tmp_path):
    """The table form's text holds no plan: plans of one protocol share its source,
    key and cubin; what differs between them is their tables."""
    from msc.cuda import compiler
    from msc.cuda.codegen import plan_tables, table_width

    ring = plan_for("allgather/ring:ring", 4, "LL")
    tree = lower(msc.trace(ALGORITHMS["allreduce/tree:double_binary"], 8), LowerOptions(protocol="LL"))
    a, _ = render(ring, dtype="float32", form="table")
    b, layout = render(tree, dtype="float32", form="table")
    assert a == b and tree.name not in a and "allgather" not in a and table_width(ring) == table_width(tree) == 1
    assert compiler.source_key(ring, dtype="float32", op="sum", form="table") == \
        compiler.source_key(tree, dtype="float32", op="sum", form="table")
    first = compile_cuda(ring, dtype="float32", arch="sm_90", form="table", cache=tmp_path)
    second = compile_cuda(tree, dtype="float32", arch="sm_90", form="table", cache=tmp_path)
    assert (first.cache_hit, second.cache_hit) == (False, True) and second.cubin_path == first.cubin_path
    assert second.layout == layout and second.layout.num_ranks == 8
    ring_tables, tree_tables = plan_tables(ring), plan_tables(tree)
    assert ring_tables != tree_tables and len(tree_tables.threadblocks) == 8 * len(layout.blocks)
    # another protocol, data type or op is another kernel; so is a plan whose steps read more sources
    assert len({compiler.source_key(ring, dtype=d, op=o, form="table") for d in ("float32", "bfloat16")
                for o in ("sum", "max")}) == 4
    assert compiler.source_key(plan_for("allgather/ring:ring", 4, "Simple"), dtype="float32", op="sum",
                               form="table") != compiler.source_key(ring, dtype="float32", op="sum", form="table")


def test_plan_tables_are_cached_checked_and_decoded(tmp_path):
    from msc.cuda import compiler
    from msc.cuda.codegen import PlanTables, describe_tables, plan_tables

    plan = plan_for("allreduce/ring:ring", 3, "Simple", inplace=False)
    made = compiler.tables(plan, op="avg", cache=tmp_path)
    assert made == plan_tables(plan, op="avg") != plan_tables(plan, op="sum")     # avg marks what it pre-scales
    (path,) = tmp_path.glob("kernels/tables-*/tables.i32")
    assert PlanTables.from_bytes(path.read_bytes()) == made == compiler.tables(plan, op="avg", cache=tmp_path)
    path.write_bytes(b"\x05\x00\x00\x00")                       # damaged: a miss, computed again
    assert compiler.tables(plan, op="avg", cache=tmp_path) == made
    with pytest.raises(ValueError):
        PlanTables.from_bytes(b"\x09\x00\x00\x00\x01\x00\x00\x00")
    text = describe_tables(made)                    # a row per threadblock and per step
    assert len([ln for ln in text.splitlines() if not ln.startswith("#") and "|" in ln]) == plan.num_steps()
    assert len([ln for ln in text.splitlines() if ln.startswith("# rank ")]) == len(made.threadblocks) // 8


def test_form_is_chosen_by_size():
    small = plan_for("allreduce/ring:ring", 4)
    assert small.num_steps() <= STRAIGHT_LINE_MAX_STEPS and choose_form(small, None) == "straight"
    big = plan_for("allreduce/ring:ring", 16)
    assert big.num_steps() > STRAIGHT_LINE_MAX_STEPS and choose_form(big, None) == "table"


def test_avg_prescales_inputs_read_where_they_started():
    plan = plan_for("allreduce/ring:ring", 3, "Simple", inplace=False)
    source, _ = render(plan, dtype="float32", op="avg", form="straight")
    fresh = re.findall(r"const int fresh\[\d+\] = \{ ([01, ]+) \};", source)
    assert any("1" in f for f in fresh) and any("1" not in f for f in fresh)


# -- the cache and errors --------------------------------------------------------------
def test_second_compile_is_a_cache_hit(tmp_path):
    plan = plan_for("reduce/tree:tree", 4)
    first = compile_cuda(plan, dtype="float32", cache=tmp_path)
    again = compile_cuda(plan, dtype="float32", cache=tmp_path)
    other = compile_cuda(plan, dtype="bfloat16", cache=tmp_path)
    assert (first.cache_hit, again.cache_hit, other.cache_hit) == (False, True, False)
    assert again.cubin == first.cubin and again.layout == first.layout and other.key != first.key


def test_nvrtc_failure_carries_the_log_and_the_source_path(tmp_path):
    source, _ = render(plan_for("allreduce/ring:ring", 2), form="table")
    broken = source.replace("return true;\n}", "return true\n}", 1)
    path = tmp_path / "broken.cu"
    path.write_text(broken)
    with pytest.raises(CompileError) as err:
        nvrtc_compile(broken, arch="sm_90", source_path=path)
    assert "error" in err.value.log and err.value.source_path == str(path) and str(path) in str(err.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="int8"), "no data type"), (dict(op="avg", dtype="int32"), "floating"),
    (dict(op="xor"), "unknown reduction"), (dict(arch="sm_70"), "arch")])
def test_bad_options_are_usage_errors(kwargs, match, tmp_path):
    with pytest.raises(UsageError, match=match):
        compile_cuda(plan_for("allreduce/ring:ring", 2), cache=tmp_path, **kwargs)


def test_ll128_is_refused_clearly(tmp_path):
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 2), LowerOptions(protocol="LL128"))
    with pytest.raises(UsageError, match="LL128"):
        render(plan)


def test_cli_emits_cuda_and_cubin(tmp_path, monkeypatch):
    from msc.cli.main import main

    monkeypatch.setenv("MSC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "ring.plan"
    assert main(["compile", "allreduce/ring", "--ranks", "4", "-o", str(out), "--emit", "cuda", "--arch", "sm_90",
                 "--dtype", "bfloat16"]) == 0
    cu, cubin = tmp_path / "ring.bfloat16-sum.cu", tmp_path / "ring.bfloat16-sum.sm_90.cubin"
    assert cu.read_text().startswith("// Generated by msc") and cubin.read_bytes()[:4] == b"\x7fELF"
    assert not (tmp_path / "ring.bfloat16-sum.tables.txt").exists()          # straight-line: the plan is the code
    # the table form's source holds no plan: its tables are written beside it
    assert main(["compile", "allreduce/ring", "--ranks", "4", "-o", str(out), "--emit", "cuda", "--form", "table"]) == 0
    tables = (tmp_path / "ring.float32-sum.tables.txt").read_text().splitlines()
    plan = msc.load_plan(out)
    assert len([ln for ln in tables if ln and not ln.startswith("#")]) == \
        plan.num_steps() + sum(len(r.threadblocks) for r in plan.ranks)


# -- the GPU review's faults, on the rendered source and the PTX ------------------------------
def _ptx(source: str, arch: str) -> str:
    """NVRTC's PTX for ``arch`` (through cuda.bindings: no driver needed)."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])
    assert err == ok
    opts = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"--std=c++17"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert err == ok, err
    err, size = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * size
    (err,) = nvrtc.nvrtcGetPTX(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    return buf.decode(errors="replace")


def test_bfloat16_compiles_for_sm75_rounding_in_software():
    """sm_75 has no cvt.rn.bf16.f32: the kernel rounds in software there (the
    same code the emulated device runs and tests against ml_dtypes)."""
    source, _ = render(plan_for("allreduce/ring:ring", 4), dtype="bfloat16", form="table")
    old, new = _ptx(source, "sm_75"), _ptx(source, "sm_90")
    assert "cvt.rn.bf16.f32" not in old and "cvt.rn.bf16.f32" in new
    assert_sound(compile_cuda(plan_for("allreduce/ring:ring", 4), dtype="bfloat16", arch="sm_75"))


def test_step_op_codes_come_from_one_table():
    """The kernel's OP_* enum and what each op does are generated from
    msc.ir.StepOp; the step table encodes ops with the same codes."""
    from msc.cuda.codegen import STEP_OPS
    from msc.ir import STEP_SHAPE, StepOp

    source, _ = render(plan_for("allreduce/allpairs:allpairs", 4), form="table")
    line = next(x for x in source.splitlines() if x.startswith("enum { OP_"))
    enum = dict((name, int(code)) for name, code in re.findall(r"OP_(\w+) = (\d+)", line))
    assert enum == {op.name: i for i, op in enumerate(StepOp)} and list(STEP_OPS) == list(StepOp)
    masks = dict(re.findall(r"OP_(RECEIVES|SENDS|STORES) = (\d+)u", source))
    for op in StepOp:
        code = enum[op.name]
        assert (int(masks["RECEIVES"]) >> code & 1, int(masks["SENDS"]) >> code & 1,
                int(masks["STORES"]) >> code & 1) == (op.receives, op.sends, STEP_SHAPE[op][1]), op


def test_ll_packets_are_single_64_bit_accesses_and_ll_posts_no_tail_per_message():
    source, _ = render(plan_for("allgather/ring:ring", 4, "LL"), dtype="bfloat16", form="table")
    assert ".v2.u32 [" not in source and ".v2.u32 {" not in source
    ptx = _ptx(source, "sm_90")
    assert "st.relaxed.sys.global.u64" in ptx and "ld.relaxed.sys.global.u64" in ptx
    assert not re.search(r"\.global(\.\w+)*\.v2\.u32", ptx)          # no packet as two 32-bit halves
    transfer = source[source.index("__device__ __forceinline__ bool transfer("):]
    transfer = transfer[:transfer.index("\n}\n")]
    assert "tail" not in transfer                                # the receiver never reads it
    assert transfer.count("__syncthreads") == 2                  # a free-slot wait, and a receive's end


def test_waits_use_the_global_timer_and_dependency_counters_gpu_scope():
    source, _ = render(plan_for("allreduce/allpairs:allpairs", 4), form="table")
    assert "%globaltimer" in source and "clock64" not in source
    ptx = _ptx(source, "sm_90")
    assert "st.release.gpu.global.u64" in ptx and "ld.acquire.gpu.global.u64" in ptx      # dependencies
    assert "st.release.sys.global.u64" in ptx and "ld.acquire.sys.global.u64" in ptx      # connections
    assert "__launch_bounds__(NTHREADS, MIN_BLOCKS)" in source and "#define MIN_BLOCKS 2" in source


def test_the_cache_key_covers_the_collective_and_msc_sources(monkeypatch):
    """Two custom collectives with one name but different postconditions
    must not share a kernel; nor may two versions of msc's verifier."""
    from msc.dsl.collectives import AllGather, Expected
    from msc.cuda import compiler

    plan = plan_for("allgather/ring:ring", 2)

    class Twisted(AllGather):                   # the same name, another postcondition
        def postcondition(self, rank, index, n, k, root):
            return Expected([((index + 1) % n, 0)])

    base = compiler.source_key(plan, dtype="float32", op="sum", form="straight")
    table = compiler.source_key(plan, dtype="float32", op="sum", form="table")
    assert compiler.source_key(plan, dtype="float32", op="sum", form="straight", collective=AllGather()) != \
        compiler.source_key(plan, dtype="float32", op="sum", form="straight", collective=Twisted())
    assert compiler.tables_key(plan, average=False, collective=AllGather()) != \
        compiler.tables_key(plan, average=False, collective=Twisted())
    tables = compiler.tables_key(plan, average=False)
    monkeypatch.setattr(compiler, "_toolchain_digest", lambda: "another msc")
    assert compiler.source_key(plan, dtype="float32", op="sum", form="straight") != base
    assert compiler.source_key(plan, dtype="float32", op="sum", form="table") != table
    assert compiler.tables_key(plan, average=False) != tables


def test_a_damaged_cache_entry_is_rebuilt_not_trusted(tmp_path):
    plan = plan_for("reduce/tree:tree", 4)
    first = compile_cuda(plan, cache=tmp_path)
    first.cubin_path.write_bytes(b"")                              # empty
    again = compile_cuda(plan, cache=tmp_path)
    assert not again.cache_hit and again.cubin == first.cubin
    first.cubin_path.write_bytes(b"\x7fELF garbage")               # forged: no matching digest
    assert compile_cuda(plan, cache=tmp_path).cubin == first.cubin
    first.source_path.write_text("garbage")                         # the source too
    third = compile_cuda(plan, cache=tmp_path)
    assert third.source == first.source and not third.cache_hit and third.layout == first.layout
