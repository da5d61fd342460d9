"""Static facts about the generated kernels, read from their cubins (no GPU).

The ring allreduce at 4 ranks, as the Communicator compiles it (runtime_plan:
8 slots), in {Simple, LL} x {straight, table} x {float32, bfloat16}, for
sm_90, read with cuobjdump and nvdisasm (pip wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm, in the ``test`` extra; bench/cubin_facts.py reads
them). The goals: no register spills; no local-memory traffic (LDL/STL) in
the element loops (``combine`` for Simple, ``ll_chunk`` for LL); at least 2
blocks per SM for Simple at its launch shape; 128-bit loads and stores in
Simple's ``combine`` loops; at least 8 128-bit loads issued before the first
instruction that uses loaded data in ``combine`` (4 per operand: memory-level
parallelism); at most one system-scope fence (MEMBAR.SYS) before any counter
release, so one per Simple message; no L1 invalidation (an acquire) inside a
spin loop. bench/cuda_static.py reports the same facts for more plans and
sm_80.

The detectors are themselves tested on small kernels with known answers
(a dynamically indexed array in a loop, a spilling kernel, a float4 copy),
so that a reading that finds nothing cannot pass for a clean kernel.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

pytest.importorskip("cuda.core")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cubin_facts", ROOT / "bench" / "cubin_facts.py")
cf = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cubin_facts", cf)
_spec.loader.exec_module(cf)

if cf.missing_tools():
    pytest.skip(f"needs {' and '.join(cf.missing_tools())} (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                f"in msc's test extra) to read cubins", allow_module_level=True)

import msc  # noqa: E402
from msc.cuda import compile as compile_cuda  # noqa: E402
from msc.cuda.compiler import rendered  # noqa: E402
from msc.cuda.runtime import runtime_plan  # noqa: E402
from msc.lower.pipeline import LowerOptions, lower  # noqa: E402

ARCH = "sm_90"
RING = ROOT / "algorithms" / "allreduce" / "ring.py"
CASES = [(p, f, d) for p in ("Simple", "LL") for f in ("straight", "table") for d in ("float32", "bfloat16")]
SIMPLE = [c for c in CASES if c[0] == "Simple"]


def _ids(case):
    return "-".join(case)


@lru_cache(maxsize=None)
def _plan(protocol: str):
    [ring] = [a for a in msc.load_algorithms(RING) if a.name == "ring"]
    return runtime_plan(lower(msc.trace(ring, 4), LowerOptions(protocol=protocol)))


@pytest.fixture(scope="module")
def cache(kernel_cache):
    return kernel_cache


_FACTS: dict = {}


def facts_of(case, cache) -> dict:
    """The cubin facts of one case, compiled once per module (msc.cuda.compile, as the Communicator)."""
    if case not in _FACTS:
        protocol, form, dtype = case
        kernel = compile_cuda(_plan(protocol), dtype=dtype, op="sum", arch=ARCH, form=form, cache=cache)
        _FACTS[case] = (kernel, cf.cubin_facts(kernel.cubin, arch=ARCH, protocol=protocol,
                                               nthreads=kernel.layout.nthreads))
    return _FACTS[case][1]


def _loop_function(facts: dict) -> dict:
    """The element-loop function's facts. pytest.fail, not assert, when it is missing or has no
    loop: an xfail below expects an AssertionError from its goal, never from a failed reading."""
    name = facts["loop_function"]
    if name not in facts["sass"]:
        pytest.fail(f"{name} not found in the SASS (functions: {facts['functions']})")
    fn = facts["sass"][name]
    if fn["instructions"] < 50 or fn["loops"] < 1:
        pytest.fail(f"{name}: {fn['instructions']} instructions, {fn['loops']} loops: not an element loop")
    return fn


# -- the goals ------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol, form, dtype", CASES, ids=[_ids(c) for c in CASES])
def test_no_register_spills(protocol, form, dtype, cache):
    facts = facts_of((protocol, form, dtype), cache)
    if not (facts["registers"] > 0 and facts["sass"]["msc_kernel"]["instructions"] > 50):
        pytest.fail(f"no kernel read: {facts['registers']} registers, functions {facts['functions']}")
    spilled = {n: (s["spill_store_bytes"], s["spill_load_bytes"]) for n, s in facts["sass"].items()
               if s["spill_store_bytes"] or s["spill_load_bytes"]}
    assert not spilled, f"spill bytes (stored, loaded) per function: {spilled}"


@pytest.mark.parametrize("protocol, form, dtype", CASES, ids=[_ids(c) for c in CASES])
def test_no_local_memory_in_element_loops(protocol, form, dtype, cache):
    fn = _loop_function(facts_of((protocol, form, dtype), cache))
    assert fn["ldl_in_loops"] == 0 and fn["stl_in_loops"] == 0, \
        f"LDL {fn['ldl_in_loops']}, STL {fn['stl_in_loops']} inside the element loops"


@pytest.mark.parametrize("protocol, form, dtype", SIMPLE, ids=[_ids(c) for c in SIMPLE])
def test_simple_fits_two_blocks_per_sm(protocol, form, dtype, cache):
    from msc.ir.ops import PROTOCOLS

    facts = facts_of((protocol, form, dtype), cache)
    kernel = _FACTS[(protocol, form, dtype)][0]
    threads = PROTOCOLS[protocol].threads
    assert facts["nthreads"] == kernel.layout.nthreads == threads
    assert cf.source_defines(kernel.source)["MIN_BLOCKS"] == 2
    assert 0 < facts["registers"] <= 65536 // (2 * threads), f"__launch_bounds__({threads}, 2)'s register budget"
    assert facts["blocks_per_sm"] >= 2, (facts["blocks_per_sm"], facts["occupancy_limits"])


@pytest.mark.parametrize("protocol, form, dtype", SIMPLE, ids=[_ids(c) for c in SIMPLE])
def test_simple_keeps_eight_loads_in_flight_before_reducing(protocol, form, dtype, cache):
    fn = _loop_function(facts_of((protocol, form, dtype), cache))
    assert fn["ld128_before_first_use"] >= cf.MIN_LOADS_IN_FLIGHT, \
        f"{fn['ld128_before_first_use']} 128-bit loads before the first use of loaded data ({fn['loops']} loops)"


@pytest.mark.parametrize("protocol, form, dtype", CASES, ids=[_ids(c) for c in CASES])
def test_one_system_fence_per_release_and_none_in_spin_loops(protocol, form, dtype, cache):
    facts = facts_of((protocol, form, dtype), cache)
    releases = {n: s["releases"] for n, s in facts["sass"].items() if s["releases"]}
    assert any(op.endswith("STRONG.SYS") for ops in releases.values() for op in ops), releases
    assert any(op.endswith("STRONG.GPU") for ops in releases.values() for op in ops), releases
    assert facts["membar_sys_per_release"] <= 1, {n: s["membar_sys_per_release"] for n, s in facts["sass"].items()}
    spins = [n for n in facts["sass"] if n.startswith(("wait_counter", "spin_packet"))]
    assert spins and facts["spin_l1_invalidations"] == 0, {n: facts["sass"][n]["l1_invalidations_in_loops"]
                                                           for n in spins}


@pytest.mark.parametrize("protocol, form, dtype", SIMPLE, ids=[_ids(c) for c in SIMPLE])
def test_simple_combine_moves_128_bits(protocol, form, dtype, cache):
    fn = _loop_function(facts_of((protocol, form, dtype), cache))
    assert fn["ld128_in_loops"] > 0, f"no 128-bit load in combine's loops (128-bit ops: {fn['ld128']})"
    assert fn["st128_in_loops"] > 0, f"no 128-bit store in combine's loops (128-bit ops: {fn['st128']})"


# -- the readings are right --------------------------------------------------------------------
def test_ptxas_report_agrees_with_the_cubin_reading(cache):
    """ptxas -v (a second compile of the same source) reports the registers and spill bytes the
    SASS reading finds, and its cubin has the same SASS as msc's (only the recorded command line
    differs)."""
    case = ("Simple", "table", "bfloat16")
    facts = facts_of(case, cache)
    kernel = _FACTS[case][0]
    src = rendered(_plan("Simple"), dtype="bfloat16", op="sum", form="table", cache=cache)
    cubin, log = cf.nvrtc_verbose(src.source, arch=ARCH, name=src.source_path.name)
    report = cf.parse_ptxas(log)
    assert report.registers == facts["registers"]
    assert report.cumulative_stack == facts["stack"]
    for name, s in facts["sass"].items():
        if name == "msc_kernel":
            continue
        assert name in report.functions, f"{name} in the SASS but not in ptxas's report {sorted(report.functions)}"
        assert (s["spill_store_bytes"], s["spill_load_bytes"]) == (report.functions[name]["spill_stores"],
                                                                     report.functions[name]["spill_loads"]), name
    assert report.functions, "ptxas reported no function"
    paths = [cache / "verbose.cubin", kernel.cubin_path]
    paths[0].write_bytes(cubin)
    sass = [subprocess.run([str(cf.find_tool("cuobjdump")), "-sass", str(p)], capture_output=True, text=True,
                           check=True).stdout for p in paths]
    assert sass[0] == sass[1] and "LD.E.128" in sass[0]


def test_detectors_on_kernels_with_known_answers(tmp_path):
    """A dynamically indexed array lives in local memory (LDL/STL in the loop); a float4 copy is
    a 128-bit global load and store; the occupancy rules give the calculator's numbers."""
    source = r'''
    extern "C" __global__ void __launch_bounds__(256) local_loop(float* out, const int* idx, int n) {
      float a[32];
      for (int i = 0; i < 32; ++i) a[i] = out[i];
      for (int i = threadIdx.x; i < n; i += blockDim.x) { a[idx[i] & 31] += 1.0f; out[i] = a[idx[i + 1] & 31]; }
    }
    extern "C" __global__ void copy4(float4* out, const float4* in, int n) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = in[i];
    }
    extern "C" __global__ void __launch_bounds__(1024, 2) spills(float* out, const float* in, int n) {
      float a[48];
    #pragma unroll
      for (int k = 0; k < 48; ++k) a[k] = in[k * n + threadIdx.x];
      for (int i = 0; i < n; ++i)
    #pragma unroll
        for (int k = 0; k < 48; ++k) a[k] = a[k] * a[(k + 7) % 48] + in[i];
    #pragma unroll
      for (int k = 0; k < 48; ++k) out[k * n + threadIdx.x] = a[k];
    }'''
    cubin, log = cf.nvrtc_verbose(source, arch=ARCH, name="probe.cu")
    path = tmp_path / "probe.cubin"
    path.write_bytes(cubin)
    funcs = cf.disassemble(path)
    loop = cf.memory_facts(funcs["local_loop"])
    assert loop["ldl_in_loops"] > 0 and loop["stl_in_loops"] > 0
    copy = cf.memory_facts(funcs["copy4"])
    assert copy["ld128_in_loops"] > 0 and copy["st128_in_loops"] > 0 and copy["ld128_global"] > 0
    assert copy["ldl"] == copy["stl"] == 0
    spill = cf.memory_facts(funcs["spills"])                # 32 registers for 48 live floats
    report = cf.parse_ptxas(log)
    assert spill["spill_store_bytes"] > 0 and spill["spill_load_bytes"] > 0
    assert (spill["spill_store_bytes"], spill["spill_load_bytes"]) == (
        report.functions["spills"]["spill_stores"], report.functions["spills"]["spill_loads"])
    usage = cf.resource_usage(path)
    assert set(usage) >= {"local_loop", "copy4"} and usage["local_loop"]["STACK"] >= 128
    assert cf.short_name("$msc_kernel$_Z10wait_untilILb1EEbPKyyxPjiiix") == "wait_until<true>"
    assert re.search(r"Used \d+ registers", log)
    # cuda_occupancy.h on sm_90: (registers, threads) -> blocks per SM
    for regs, threads, blocks in ((64, 512, 2), (65, 512, 1), (128, 256, 2), (129, 256, 1), (32, 256, 8),
                                  (16, 128, 16), (16, 32, 32), (255, 256, 1)):
        assert cf.blocks_per_sm("sm_90", regs, threads)[0] == blocks, (regs, threads)


def test_flight_fence_and_spin_detectors_on_kernels_with_known_answers(tmp_path):
    """Loads in flight: 4 float4 loads from each of two arrays before the sums (8), against a
    pointer chase (each load needs the last: 1). Fences: a fence and a release (2 system fences),
    a release alone (1), a .gpu release (0). Spins: an acquire poll invalidates L1 in the loop, a
    relaxed poll does not."""
    source = r'''
    extern "C" __global__ void batched(float4* out, const float4* a, const float4* b, int n) {
    #pragma unroll 1
      for (int i = threadIdx.x; i + 3 * 256 < n; i += 4 * 256) {
        float4 x[4], y[4];
    #pragma unroll
        for (int u = 0; u < 4; ++u) { x[u] = a[i + u * 256]; y[u] = b[i + u * 256]; }
    #pragma unroll
        for (int u = 0; u < 4; ++u)
          out[i + u * 256] = make_float4(x[u].x + y[u].x, x[u].y + y[u].y, x[u].z + y[u].z, x[u].w + y[u].w);
      }
    }
    extern "C" __global__ void chase(float4* out, const float4* a, int n) {
      int i = threadIdx.x;
      float4 acc = make_float4(0, 0, 0, 0);
      for (int k = 0; k < n; ++k) {
        const float4 v = a[i];
        acc.x += v.x; acc.z += v.z; acc.w += v.w;
        i = __float_as_int(v.y) & 1023;
      }
      out[threadIdx.x] = acc;
    }
    extern "C" __global__ void releases(unsigned long long* c, unsigned long long v) {
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();
        asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(c), "l"(v) : "memory");
      }
      __syncthreads();
      if (threadIdx.x == 0) asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(c + 16), "l"(v) : "memory");
      __syncthreads();
      if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(c + 32), "l"(v) : "memory");
    }
    extern "C" __global__ void acquire_spin(unsigned long long* c, unsigned long long v) {
      unsigned long long x;
      do { asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(c) : "memory"); } while (x < v);
      c[1] = x;
    }
    extern "C" __global__ void relaxed_spin(unsigned long long* c, unsigned long long v) {
      unsigned long long x;
      do { asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(c) : "memory"); } while (x < v);
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(c) : "memory");
      c[1] = x;
    }'''
    cubin, _ = cf.nvrtc_verbose(source, arch=ARCH, name="probe2.cu")
    path = tmp_path / "probe2.cubin"
    path.write_bytes(cubin)
    facts = {name: cf.memory_facts(fn) for name, fn in cf.disassemble(path).items()}
    # ptxas issues 7 of the 8 loads, then reuses a register of the first pair for the eighth
    assert facts["batched"]["ld128_before_first_use"] >= 6
    assert facts["chase"]["ld128_before_first_use"] == 1
    assert [n for _, n in cf.release_fences(cf.disassemble(path)["releases"])] == [2, 1, 0]
    assert facts["releases"]["membar_sys_per_release"] == 2
    assert facts["acquire_spin"]["l1_invalidations_in_loops"] >= 1
    assert facts["relaxed_spin"]["l1_invalidations_in_loops"] == 0


def _sass(*lines: str) -> str:
    """A function of nvdisasm text from instruction lines (addresses 16 apart) and ``.L_x_N:`` labels."""
    out, addr = ["        .type           f,@function"], 0
    for line in lines:
        if line.startswith(".L"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line} ;")
            addr += 16
    return "\n".join(out)


def test_loads_in_flight_follow_paths_and_registers():
    """Known answers on hand-written SASS: loads until the first use of what they loaded (a
    register a non-load overwrites is no longer loaded data), the most on one path through a
    loop (a predicated branch both ways; the path that skips a load issues fewer)."""
    straight = cf.parse_sass(_sass(".L_x_1:", *[f"LDG.E.128 R{4 * k}, desc[UR4][R40.64+0x{k:x}0]" for k in range(8)],
                                   "FADD R0, R0, R4", "STG.E.128 desc[UR4][R42.64], R0", "@!P0 BRA `(.L_x_1)"))["f"]
    assert cf.loads_before_first_use(straight) == [8]
    overwritten = cf.parse_sass(_sass(".L_x_1:", "LDG.E.128 R4, desc[UR4][R40.64]", "MOV R4, R20", "MOV R5, R21",
                                      "LDG.E.128 R8, desc[UR4][R4.64]", "FADD R0, R0, R8",
                                      "@!P0 BRA `(.L_x_1)"))["f"]
    assert cf.loads_before_first_use(overwritten) == [2]      # R4, R5 rewritten: the address is no loaded data
    used = cf.parse_sass(_sass(".L_x_1:", "LDG.E.128 R4, desc[UR4][R40.64]", "LDG.E.128 R8, desc[UR4][R4.64]",
                               "FADD R0, R0, R8", "@!P0 BRA `(.L_x_1)"))["f"]
    assert cf.loads_before_first_use(used) == [1]             # the second load's address is the first's data
    branches = cf.parse_sass(_sass(".L_x_1:", "@P1 BRA `(.L_x_2)", "LDG.E.128 R4, desc[UR4][R40.64]",
                                   "BRA `(.L_x_3)", ".L_x_2:", "LDG.E.128 R4, desc[UR4][R40.64]",
                                   "LDG.E.128 R8, desc[UR4][R44.64]", "LDG.E.128 R12, desc[UR4][R46.64]",
                                   ".L_x_3:", "FADD R0, R4, R8", "@!P0 BRA `(.L_x_1)"))["f"]
    assert cf.loads_before_first_use(branches) == [3]         # not 4: no path issues every load
