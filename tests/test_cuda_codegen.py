"""CUDA code generation and NVRTC compilation (no GPU needed).

Every library algorithm at 2, 4 and 8 ranks x {Simple, LL} x {float32,
bfloat16} renders and compiles to a cubin for sm_90. The sweep uses the
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
from msc.lower import LowerOptions, lower
from library import algorithms

pytest.importorskip("cuda.core")
ALGORITHMS = algorithms()


@lru_cache(maxsize=None)
def plan_for(key: str, n: int, protocol: str = "Simple", inplace: bool = True):
    return lower(msc.trace(ALGORITHMS[key], n, inplace=inplace), LowerOptions(protocol=protocol))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_library_compiles_for_sm90(key, cache):
    compiled = 0
    for n in (2, 4, 8):
        if not ALGORITHMS[key].supports(n):
            continue
        for protocol in ("Simple", "LL"):
            plan = plan_for(key, n, protocol)
            for dtype in ("float32", "bfloat16"):
                kernel = compile_cuda(plan, dtype=dtype, arch="sm_90", form="table", cache=cache)
                assert kernel.cubin[:4] == b"\x7fELF", "a cubin is an ELF image"
                compiled += 1
    assert compiled >= 4, f"{key}: too few rank counts supported"


@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_library_straight_line_form_compiles(key, cache):
    n = next(n for n in (2, 4, 8) if ALGORITHMS[key].supports(n))
    kernel = compile_cuda(plan_for(key, n), dtype="float32", arch="sm_90", form="straight", cache=cache)
    assert kernel.cubin[:4] == b"\x7fELF"
    assert "straight form" in kernel.source


@pytest.mark.parametrize("dtype, op", [("float16", "avg"), ("float64", "min"), ("int32", "prod"),
                                       ("bfloat16", "max"), ("float32", "avg")])
def test_other_types_and_ops_compile(dtype, op, cache):
    for protocol in ("Simple", "LL"):
        plan = plan_for("allreduce/ring:ring", 4, protocol, inplace=False)
        assert compile_cuda(plan, dtype=dtype, op=op, arch="sm_90", form="straight", cache=cache).cubin


def test_sm80_compiles(cache):
    plan = plan_for("allreduce/allpairs:allpairs", 4, "LL")
    kernel = compile_cuda(plan, dtype="bfloat16", arch="sm_80", cache=cache)
    assert kernel.arch == "sm_80" and kernel.cubin[:4] == b"\x7fELF"


# -- structure of the generated source ------------------------------------------------
def test_ring_source_has_its_fused_steps_with_constants_folded():
    plan = plan_for("allreduce/ring:ring", 3, "Simple", inplace=False)
    source, layout = render(plan, dtype="bfloat16", op="sum", form="straight")
    # CHECK: the ring's fused steps on rank 0, in order, as straight-line calls with literal operands
    body = source[source.index("__device__ __noinline__ bool tb_0("):source.index("__device__ __noinline__ bool tb_1(")]
    calls = re.findall(r"run_step\(b, it, (\d+), OP_(\w+), (\d+), (\d+), src, Operand\{ (\d), (\d+) \}", body)
    assert [c[1] for c in calls] == ["SEND", "RRS", "RRCS", "RCS", "RECV"]
    assert calls[2] == ("2", "RRCS", "1", "1", "1", "0"), "rrcs input[0] -> output[0]: dst folded to (1, 0)"
    assert "const Operand src[1] = { { 0, 0 } };" in body      # its source: input[0], folded
    assert "#define K 3" in source and "#define SLOTS 2" in source and "#define NRANKS 3" in source
    assert "struct elem_t { u16 bits; };" in source and "cvt.rn.bf16.f32" in source
    assert "st.release.sys" in source and "ld.acquire.sys" in source
    assert len(layout.connections) == 3 and layout.blocks == ((0, 0), (1, 0), (2, 0))


def test_ll_source_uses_flagged_packets_and_table_form_a_step_table():
    plan = plan_for("allgather/ring:ring", 4, "LL")
    ll, _ = render(plan, dtype="float32", form="straight")
    assert "st_packet(" in ll and "wait_packet(" in ll and "transport_simple" not in ll
    table, _ = render(plan, dtype="float32", form="table")
    assert "__device__ const int MSC_STEPS[" in table and "tb_0(" not in table


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
    from msc.cli import main

    monkeypatch.setenv("MSC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "ring.plan"
    assert main(["compile", "allreduce/ring", "--ranks", "4", "-o", str(out), "--emit", "cuda", "--arch", "sm_90",
                 "--dtype", "bfloat16"]) == 0
    cu, cubin = tmp_path / "ring.bfloat16-sum.cu", tmp_path / "ring.bfloat16-sum.sm_90.cubin"
    assert cu.read_text().startswith("// Generated by msc") and cubin.read_bytes()[:4] == b"\x7fELF"
