"""bench/first_gpu_run.py's NVLS stage: the switch on one GPU, every outcome a
recorded case and none raised (tests/test_first_gpu_run_nvls.py runs its logic
against fakes).

On a GPU: the multicast attribute and the driver version, as read, and what
msc's capability check says of them; the switch kernels (the library's nvls
plan: float32 sum, bfloat16 avg with its division pass, int32 min; and the
switch probe) compiled for the GPU's arch and loaded through the driver
(cuModuleLoadData); where the GPU has multicast, a multicast object over this
one GPU (numDevices 1) made by msc.cuda.multicast's own code path (create,
add device, cuMemCreate, bind, map), the probe's multimem.ld_reduce,
multimem.st and the fused reduce-and-store run on it and checked (one member:
the reduce is the value), a second multicast object bound to the same
allocation (how a rank in two switch groups is served) read through, then
everything torn down. On the emulated device: the nvls plan bit-exact against
the executor instead.
"""
from __future__ import annotations

from pathlib import Path

from first_gpu_checks import Run, check_counts, plan_of

# The nvls plan's kernels loaded on a GPU (dtype, op, form), the pairs run on the emulated device,
# the switch probes' pairs and sizes.
NVLS = "allreduce/nvls:nvls"
NVLS_KERNELS = (("float32", "sum", "straight"), ("bfloat16", "avg", "table"), ("int32", "min", "table"))
NVLS_EMULATED = (("float32", "sum"), ("bfloat16", "avg"), ("int32", "min"))
PROBE_PAIRS = (("float32", "sum"), ("bfloat16", "max"))
PROBE_ELEMENTS = 4096            # per region of the multicast buffer
PROBE_THREADS = 256


class GpuSwitchTools:
    """What the NVLS stage does to a GPU, through the driver (tests pass fakes with the same methods)."""

    def __init__(self):
        from msc.cuda.backend import CudaBackend
        from msc.cuda.multicast import CudaMulticast

        CudaBackend().bind(0)            # torch's primary context current here: module loads, copies, launches
        self.driver = CudaMulticast()

    def arch(self) -> str:
        from msc.cuda.device import arch

        return arch(0)

    def plan_kernel(self, plan, dtype: str, op: str, form: str, arch: str, cache: Path) -> tuple[bytes, str]:
        from msc.cuda.compiler import compile as compile_cuda

        compiled = compile_cuda(plan, dtype=dtype, op=op, arch=arch, form=form, cache=cache)
        return compiled.cubin, compiled.kernel_name

    def probe_kernel(self, dtype: str, op: str, arch: str) -> tuple[bytes, str]:
        from msc.cuda.switch import nvrtc_ptx
        from msc.cuda.switch_probe import render_probe

        return nvrtc_ptx(render_probe(dtype, op), arch=arch)[1], "msc_switch_probe"

    def load(self, cubin: bytes, name: str):
        """cuModuleLoadData and cuModuleGetFunction: (module, function)."""
        from cuda.bindings import driver

        from msc.cuda.device import call

        module = call(driver.cuModuleLoadData, cubin)
        try:
            return module, call(driver.cuModuleGetFunction, module, name.encode())
        except BaseException:
            call(driver.cuModuleUnload, module)
            raise

    def unload(self, module) -> None:
        from cuda.bindings import driver

        from msc.cuda.device import call

        call(driver.cuModuleUnload, module)

    def launch_probe(self, function, args) -> None:
        """One block of the probe kernel (its ProbeArgs by value), then a synchronize."""
        import ctypes

        from cuda.bindings import driver

        from msc.cuda.device import call

        params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        call(driver.cuLaunchKernel, function, 1, 1, 1, PROBE_THREADS, 1, 1, 0, 0, ctypes.addressof(params), 0)
        call(driver.cuCtxSynchronize)

    def write(self, ptr: int, data: bytes) -> None:
        import ctypes

        from msc.cuda.device import write

        buf = ctypes.create_string_buffer(data, len(data))
        write(ptr, ctypes.addressof(buf), len(data))

    def read(self, ptr: int, nbytes: int) -> bytes:
        from msc.cuda.device import read

        return read(ptr, nbytes)


def nvls_stage(run: Run, stage, tools=None) -> dict:
    """The switch on this GPU (module doc): every outcome a case, none raised.
    ``tools``: GpuSwitchTools on a GPU; the emulated device runs the nvls plan instead."""
    if not run.gpu and tools is None:
        for name in ("multicast capability", "switch kernels loaded", "multicast object over one GPU"):
            stage.skip(name, "the emulated device has no driver or switch")
        stage.case(f"{NVLS}@4 on the emulated device: sum, avg, min", nvls_emulated, run)
        return {}
    tools = tools or GpuSwitchTools()
    found: dict = {}
    stage.case("multicast capability", capability, tools, found)
    if "facts" not in found:
        for name in ("switch kernels loaded", "multicast object over one GPU"):
            stage.skip(name, "the capability query failed")
        return {"nvls": found}
    if tuple(found["facts"]["compute"]) < (9, 0):
        stage.skip("switch kernels loaded", f"sm_{''.join(map(str, found['facts']['compute']))}: no multimem "
                   f"instructions (sm_90+)")
    else:
        stage.case("switch kernels loaded", load_switch_kernels, run, tools, found)
    try:
        if found["problems"]:
            stage.skip("multicast object over one GPU", "not supported: " + "; ".join(found["problems"]))
        elif "probes" not in found:
            stage.skip("multicast object over one GPU", "the probe kernels did not load")
        else:
            stage.case("multicast object over one GPU", multicast_round_trip, tools, found)
    finally:
        for module, _ in found.pop("probes", {}).values():
            tools.unload(module)
    return {"nvls": found}


def capability(tools, found: dict) -> dict:
    """The attributes msc's capability check reads, the driver version, and what the check concludes."""
    from dataclasses import asdict

    from msc.cuda.multicast import capability_problems

    facts, version = tools.driver.device_facts(0), tools.driver.driver_version()
    found.update(facts=asdict(facts), driver_version=version, problems=capability_problems(facts, version))
    return {"CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED": int(facts.multicast), "driver_version": version,
            "compute": list(facts.compute), "posix_fd": facts.posix_fd, "vmm": facts.vmm,
            "supported": not found["problems"], "problems": found["problems"]}


def load_switch_kernels(run: Run, tools, found: dict) -> str:
    """The nvls plan's kernels and the probes, compiled for this GPU and loaded by cuModuleLoadData;
    the plan kernels unloaded again, the probes kept for the multicast case (found["probes"])."""
    from msc.cuda.runtime import runtime_plan

    arch, done, probes = tools.arch(), [], {}
    plan = runtime_plan(plan_of(NVLS, 8, "Simple"))
    try:
        for dtype, op, form in NVLS_KERNELS:
            cubin, name = tools.plan_kernel(plan, dtype, op, form, arch, run.cache)
            module, _ = tools.load(cubin, name)
            tools.unload(module)
            done.append(f"nvls {dtype} {op} {form}: {len(cubin)} bytes")
        for dtype, op in PROBE_PAIRS:
            cubin, name = tools.probe_kernel(dtype, op, arch)
            probes[dtype, op] = tools.load(cubin, name)
            done.append(f"probe {dtype} {op}: {len(cubin)} bytes")
    except BaseException:
        for module, _ in probes.values():
            tools.unload(module)
        raise
    found["probes"] = probes
    return f"{arch}, loaded: " + "; ".join(done)


def multicast_round_trip(tools, found: dict) -> str:
    """msc.cuda.multicast's own path over one GPU, the probes on it, a second object bound to the
    same allocation, then the teardown (always)."""
    from msc.cuda.multicast import open_group_buffer

    nbytes = 8 * PROBE_ELEMENTS * 8                # 5 regions of the widest type, rounded up by the driver
    alone = lambda tag, obj: [obj]                 # noqa: E731  one member: the gather is itself
    buf = second = None
    try:
        buf = open_group_buffer(0, 1, 0, nbytes, gather=alone, driver=tools.driver, tag="first-run-nvls",
                                timeout_s=10)
        done = [f"object of {buf.size} bytes bound and mapped"]
        for (dtype, op), (_, function) in found["probes"].items():
            done.append(probe_checks(tools, function, buf, dtype, op))
        second = open_group_buffer(0, 1, 0, nbytes, gather=alone, driver=tools.driver, tag="first-run-nvls-2",
                                   timeout_s=10, memory=buf)
        dtype, op = PROBE_PAIRS[0]
        done.append("a second object on the same allocation: " + probe_checks(
            tools, found["probes"][dtype, op][1], second, dtype, op, modes=("reduce",)))
        return "; ".join(done)
    finally:
        for b in (second, buf):
            if b is not None:
                b.close()


def probe_checks(tools, function, buf, dtype: str, op: str, modes=("reduce", "store", "reduce_store")) -> str:
    """Each probe mode on ``buf``, in regions of PROBE_ELEMENTS: 0 the values (every member's copy:
    this one), 1 a store's source; the reduce's result goes to 2 (local), the store's to 3 and the
    fused reduce-and-store's to 4 (through the multicast address). Every element checked, bit for bit:
    with one member a reduce is the value itself."""
    import numpy as np

    from cudaboot import np_dtype
    from msc.cuda.switch import SwitchMemC
    from msc.cuda.switch_probe import PROBE_MODES, ProbeArgsC

    np_type = np_dtype(dtype)
    size = np.dtype(np_type).itemsize
    region = -(-PROBE_ELEMENTS * size // 256) * 256
    rng = np.random.default_rng(7)
    values, source = (rng.integers(1, 100, PROBE_ELEMENTS).astype(np_type) for _ in range(2))
    tools.write(buf.local, values.tobytes())
    tools.write(buf.local + region, source.tobytes())
    mc = SwitchMemC(buf.mc, 0, 1)
    plans = {"reduce": (2, values, dict(dst=buf.local + 2 * region)),
             "store": (3, source, dict(src=buf.local + region, out_offset=3 * region // size)),
             "reduce_store": (4, values, dict(out_offset=4 * region // size))}
    for mode in modes:
        at, expect, where = plans[mode]
        tools.write(buf.local + at * region, bytes(region))
        tools.launch_probe(function, ProbeArgsC(in_=mc, out=mc, count=PROBE_ELEMENTS, mode=PROBE_MODES[mode], **where))
        got = np.frombuffer(tools.read(buf.local + at * region, PROBE_ELEMENTS * size), dtype=np_type)
        if got.tobytes() != expect.tobytes():
            bad = np.flatnonzero(got != expect)
            raise AssertionError(f"{dtype} {op} {mode}: {bad.size} of {PROBE_ELEMENTS} elements wrong, first at "
                                 f"{bad[:4].tolist()}: {got[bad[:4]].tolist()} vs {expect[bad[:4]].tolist()}")
    return f"{dtype} {op} {', '.join(modes)}: {PROBE_ELEMENTS} elements exact"


def nvls_emulated(run: Run) -> str:
    """The nvls plan through the runtime on the emulated device, bit-exact against msc.executor
    (half types: chunks of an even count, as the switch moves them in pairs)."""
    plan = plan_of(NVLS, 4, "Simple")
    done = []
    for dtype, op in NVLS_EMULATED:
        counts = (8, 1000) if dtype == "bfloat16" else (1, 1001)
        done.append(f"{dtype} {op} " + check_counts(run, plan, "table", dtype, op, counts))
    return "; ".join(done)
