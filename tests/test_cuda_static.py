"""Static facts about the generated kernels, read from their cubins (no GPU).

The ring allreduce at 4 ranks, as the Communicator compiles it (runtime_plan:
8 slots), in {Simple, LL} x {straight, table} x {float32, bfloat16}, for
sm_90, read with cuobjdump and nvdisasm (pip wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm, in the ``test`` extra; bench/cubin_facts.py reads
them). The goals: no register spills; no local-memory traffic (LDL/STL) in
the element loops (``combine`` for Simple, ``ll_chunk`` for LL); at least 2
blocks of 256 threads per SM for Simple; 128-bit loads and stores in
Simple's ``combine`` loops. bench/cuda_static.py reports the same facts for
more plans and sm_80.

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
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("static-kernels")


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
    facts = facts_of((protocol, form, dtype), cache)
    kernel = _FACTS[(protocol, form, dtype)][0]
    assert facts["nthreads"] == kernel.layout.nthreads == 256
    assert cf.source_defines(kernel.source)["MIN_BLOCKS"] == 2
    assert 0 < facts["registers"] <= 128, "__launch_bounds__(256, 2) allows 128 registers"
    assert facts["blocks_per_sm"] >= 2, (facts["blocks_per_sm"], facts["occupancy_limits"])


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
