"""Everything a first run of msc's CUDA runtime on a GPU must establish, in at
most 8 minutes on one H100, in stages with time caps:

1. environment: Python, torch, cuda-core, cuda-bindings, NVRTC, the driver,
   the GPU (name, arch, SMs, memory), whether MPS runs, and a digest of the
   templates the kernels come from;
2. compile: every kernel the later stages use, in parallel (NVRTC in worker
   processes; g++ threads on the emulated device), into one kernel cache;
3. correctness, on the virtual placement (every rank on this GPU), bit for
   bit against msc.executor on random inputs (never zero) with poisoned
   outputs (avg: to a few roundings): the ring allreduce at 8 ranks in both
   protocols and both forms, for every kernel dtype and op; counts 1, 3,
   1001 and one crossing 2.5 tiles per chunk (a 4 KiB tile), and 2.5 of the
   default tiles checked on the device; the other collectives (allgather,
   reducescatter, alltoall, broadcast, reduce) in the table form;
4. behaviour only a device shows: back-to-back launches without a
   synchronize, CUDA graph capture and replay, buffers growing between
   calls, a table-form launch on a side stream (ordered after the tables'
   copy), a deadlocking plan and a rank that never launches ending in
   DeviceTimeoutError (0.5 s timeouts);
5. NVLS (the switch; ``nvls_stage``): the GPU's multicast attribute and the
   driver version, as read (and what msc's capability check says of them);
   the switch kernels (the library's nvls plan: float32 sum, bfloat16 avg
   with its division pass, int32 min; and the switch probe) compiled for the
   GPU's arch and loaded through the driver (cuModuleLoadData); where the GPU
   has multicast, a multicast object over this one GPU (numDevices 1) made by
   msc.cuda.multicast's own code path (create, add device, cuMemCreate, bind,
   map), the probe's multimem.ld_reduce, multimem.st and the fused
   reduce-and-store run on it and checked (one member: the reduce is the
   value), a second multicast object bound to the same allocation (how a rank
   in two switch groups is served) read through, then everything torn down.
   Each outcome is recorded: supported, not supported (with the attribute
   read), or failed (with the error); none stops the script. On the emulated
   device: the nvls plan bit-exact against the executor instead;
6. headline numbers (bench/cuda_goals.py's goals, baselines measured in the
   same run): 8-rank bfloat16 allreduce at 64 MB and 1 GB per rank against
   the one-GPU bound of each schedule's kernel, 8 KB LL allreduce from a
   CUDA graph, and the devices placement against the NVLink line rate where
   there is a GPU per rank.

Results go to DIR/first-gpu-run.json (every case) and DIR/summary.txt; the
exit status is 0 when every stage passed, 1 when any failed or hit its cap,
2 without a device. ``--device emu --quick`` runs the same stages on the
emulated device (msc.cuda.emu) with smaller sets and sizes (no graphs or
side streams there: those cases say so), so the script is known to work
before a GPU sees it (CI runs it). bench/README.md says how to carry msc to a
GPU machine without internet and run this.

    python bench/first_gpu_run.py --out DIR [--device cuda|emu] [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))          # library plans and the executor check (tests/cudaboot.py)
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))                    # this checkout's msc, installed or not (a GPU machine without pip)

TOTAL_S = 480                    # the whole run: 8 minutes
CAPS = {"environment": 20, "compile": 150, "correctness": 120, "behaviour": 50, "nvls": 30, "headline": 110}
SMALL_TILE = 4096                # bytes: several tiles per chunk at small counts
TIMEOUT_S = 20.0                 # a spin-wait's budget in the sweep (a hang ends quickly)
KERNEL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32")
KERNEL_OPS = ("sum", "prod", "max", "min", "avg")
OTHERS = ("allgather/ring:ring", "reducescatter/ring:ring", "alltoall/allpairs:allpairs", "broadcast/chain:chain",
          "reduce/tree:tree")
RING = "allreduce/ring:ring"
# The NVLS stage: the nvls plan's kernels it loads on a GPU (dtype, op, form), the pairs it runs on
# the emulated device, the switch probes' pairs and sizes.
NVLS = "allreduce/nvls:nvls"
NVLS_KERNELS = (("float32", "sum", "straight"), ("bfloat16", "avg", "table"), ("int32", "min", "table"))
NVLS_EMULATED = (("float32", "sum"), ("bfloat16", "avg"), ("int32", "min"))
PROBE_PAIRS = (("float32", "sum"), ("bfloat16", "max"))
PROBE_ELEMENTS = 4096            # per region of the multicast buffer
PROBE_THREADS = 256


@dataclass
class Run:
    """What the stages share: the device, the options, the cache, the clock and the record."""

    device: str
    quick: bool
    out: Path
    cache: Path
    ranks: int = 8
    start: float = field(default_factory=time.perf_counter)
    stages: dict = field(default_factory=dict)

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Capped(Exception):
    """A stage ran out of its time."""


class Stage:
    """One stage's record: cases (name, ok, seconds, detail) under a time cap."""

    def __init__(self, run: Run, name: str):
        self.run, self.name, self.cap = run, name, CAPS[name]
        self.t0 = time.perf_counter()
        self.cases: list[dict] = []
        self.status, self.error = "pass", None

    def left(self) -> float:
        return self.cap - (time.perf_counter() - self.t0)

    def case(self, name: str, fn, *args, **kw):
        """Run one case; a failure is recorded (and the stage fails), not raised."""
        if self.left() <= 0:
            raise Capped(f"{self.name}: cap of {self.cap} s reached before {name}")
        t0 = time.perf_counter()
        try:
            detail = fn(*args, **kw)
            ok = True
        except Exception as exc:        # a wrong result, a device error: the record says which
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:2000]
        self.cases.append({"case": name, "ok": ok, "seconds": round(time.perf_counter() - t0, 3), "detail": detail})
        if not ok:
            self.status = "fail"
        return ok

    def skip(self, name: str, why: str) -> None:
        self.cases.append({"case": name, "ok": None, "seconds": 0.0, "detail": f"skipped: {why}"})

    def record(self) -> dict:
        return {"status": self.status, "seconds": round(time.perf_counter() - self.t0, 1), "cap_s": self.cap,
                "error": self.error, "cases": self.cases}


# -- plans --------------------------------------------------------------------------------------
def plan_of(key: str, n: int, protocol: str, tile: int = 0, instances: int = 1):
    import msc
    from library import algorithms
    from msc.lower.pipeline import LowerOptions, lower

    return lower(msc.trace(algorithms()[key], n), LowerOptions(protocol=protocol, tile=tile, instances=instances))


def kinds(quick: bool) -> list[tuple[str, str]]:
    """(dtype, op) of the kernels the ring sweep checks: every pair the kernels take, or a sample."""
    if quick:
        return [("float32", "sum"), ("bfloat16", "max"), ("float16", "avg")]
    return [(d, o) for d in KERNEL_DTYPES for o in KERNEL_OPS if not (o == "avg" and d == "int32")]


def sweep(run: Run) -> list[tuple]:
    """(key, protocol, form, dtype, op, tile) of the correctness stage's communicators."""
    cases = [(RING, p, f, d, o, SMALL_TILE) for p in ("Simple", "LL") for f in ("straight", "table")
             for d, o in kinds(run.quick)]
    others = OTHERS[:2] if run.quick else OTHERS
    cases += [(k, p, "table", d, "sum", SMALL_TILE) for k in others for p in ("Simple", "LL")
              for d in (("float32",) if run.quick else ("float32", "bfloat16"))]
    return cases


def headline_plans(run: Run) -> list[tuple]:
    """(key, protocol, instances, dtype, op) the headline stage times."""
    from library import algorithms

    keys = [k for k in sorted(algorithms()) if k.startswith("allreduce/") and algorithms()[k].supports(run.ranks)]
    if run.quick:
        keys = [RING, "allreduce/allpairs:allpairs"]
    large = [(k, "Simple", i, "bfloat16", "sum") for k in keys for i in ((1,) if run.quick else (1, 4))]
    return large + [(k, "LL", 1, "float32", "sum") for k in keys]


# -- stage 1: environment -------------------------------------------------------------------------
def environment(run: Run) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env = {"python": platform.python_version(), "machine": platform.platform(), "cpus": os.cpu_count(),
           "device": run.device, "templates_sha256": _templates_digest()}
    for pkg in ("torch", "cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc", "numpy", "jinja2", "ml_dtypes", "lark",
                "msc"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = "missing"
    if run.gpu:
        env.update(_gpu_environment())
    return env


def _templates_digest() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT / "templates").glob("*.j2")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _gpu_environment() -> dict:
    import torch

    from msc.cuda import device as cu
    from msc.cuda.compiler import nvrtc_version

    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "arch": cu.arch(0), "sms": props.multi_processor_count,
           "memory_gib": round(props.total_memory / 2 ** 30, 1), "gpus": cu.device_count(),
           "torch_cuda": torch.version.cuda, "nvrtc": nvrtc_version(), "mps": cu.mps_active()}
    from cuda.bindings import driver

    env["driver_api"] = cu.call(driver.cuDriverGetVersion)
    try:
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,"
                                            "clocks.max.mem,power.limit", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    return env


# -- stage 2: compile -----------------------------------------------------------------------------
def compile_jobs(run: Run) -> list[tuple]:
    """(key, n, protocol, tile, instances, form, dtype, kernel op) of every kernel the run uses."""
    from msc.cuda.validate import check_op

    jobs = set()
    for key, protocol, form, dtype, op, tile in sweep(run):
        jobs.add((key, run.ranks, protocol, tile, 1, form, dtype, check_op(plan_of(key, run.ranks, protocol), op,
                                                                            dtype)))
    for key, protocol, inst, dtype, op in headline_plans(run):
        jobs.add((key, run.ranks, protocol, 0, inst, None, dtype, op))
    jobs |= {("allreduce/allpairs:allpairs", run.ranks, "LL", 0, 1, None, "float32", "sum"),     # behaviour
             ("allreduce/allpairs:allpairs", run.ranks, "Simple", 0, 1, "table", "float32", "sum"),
             ("alltoall/hierarchical:hierarchical", run.ranks, "LL", 0, 1, None, "float32", "sum"),
             (RING, 4, "Simple", 0, 1, None, "float32", "sum")}
    if run.gpu:                                   # the NVLS stage's kernels (it loads them from this cache)
        jobs |= {(NVLS, 8, "Simple", 0, 1, form, dtype, op) for dtype, op, form in NVLS_KERNELS}
    else:                                         # the plan it runs on the emulated device
        jobs |= {(NVLS, 4, "Simple", 0, 1, "table", dtype, op) for dtype, op in NVLS_EMULATED}
    return sorted(jobs, key=str)


def compile_one(job: tuple, device: str, arch: str, cache: str) -> str:
    from msc.cuda.compiler import compile as compile_cuda
    from msc.cuda.compiler import compile_host
    from msc.cuda.runtime import runtime_plan

    key, n, protocol, tile, inst, form, dtype, op = job
    plan = runtime_plan(plan_of(key, n, protocol, tile, inst))
    if device == "emu":
        compile_host(plan, dtype=dtype, op=op, form=form, cache=Path(cache))
    else:
        compile_cuda(plan, dtype=dtype, op=op, arch=arch, form=form, cache=Path(cache))
    return f"{key}@{n} {protocol} tile={tile} x{inst} {form or 'auto'} {dtype} {op}"


def compile_stage(run: Run, stage: Stage) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = compile_jobs(run)
    arch = "host"
    if run.gpu:
        from msc.cuda.device import arch as gpu_arch

        arch = gpu_arch(0)
    if run.device == "emu":           # g++ runs outside the GIL; the first alone builds the precompiled headers
        stage.case(f"build {len(jobs)} host kernels", _build_all, jobs, run)
        return
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(compile_one, j, run.device, arch, str(run.cache)) for j in jobs]
        for job, f in zip(jobs, futures):
            stage.case(f"compile {job}", f.result, timeout=max(1.0, stage.left()))


def _build_all(jobs, run: Run) -> str:
    from concurrent.futures import ThreadPoolExecutor

    compile_one(jobs[0], "emu", "host", str(run.cache))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda j: compile_one(j, "emu", "host", str(run.cache)), jobs[1:]))
    return f"{len(jobs)} kernels"


# -- stage 3: correctness -------------------------------------------------------------------------
def tile_count(plan, dtype: str, tiles: float) -> int:
    """A count whose chunks take ``tiles`` tiles of the plan's tile (the runtime's default where 0)."""
    from msc.cuda.codegen import DTYPES
    from msc.cuda.launch import DEFAULT_TILE_BYTES

    per_tile = max(8, ((plan.tile or DEFAULT_TILE_BYTES[plan.protocol]) // DTYPES[dtype].size) // 8 * 8)
    return plan.chunk_factor * int(per_tile * tiles) + 3


def communicator(run: Run, plan, **kw):
    from msc.cuda import Communicator

    kw.setdefault("timeout_s", TIMEOUT_S)
    return Communicator(plan, "virtual", None if not run.gpu else 0, device=run.device, cache=run.cache, **kw)


def check_counts(run: Run, plan, form: str, dtype: str, op: str, counts) -> str:
    """Every count on one communicator, bit-exact against msc.executor (cudaboot.check_run)."""
    from cudaboot import check_run

    comm = communicator(run, plan, form=form, dtypes=(dtype,), ops=(op,))
    try:
        for i, count in enumerate(counts):
            check_run(comm, count, dtype, op, seed=i)
    finally:
        comm.close()
    return f"counts {', '.join(map(str, counts))}: bit-exact"


def check_large(run: Run, plan, form: str, dtype: str, tiles: float) -> str:
    """``tiles`` tiles per chunk, checked on the device (msc.cuda.bench.check_on_device)."""
    import torch

    from msc.cuda.bench import check_on_device

    count = tile_count(plan, dtype, tiles)
    comm = communicator(run, plan, form=form, dtypes=(dtype,), ops=("sum",))
    try:
        wrong = check_on_device(comm, count, "sum", getattr(torch, dtype), "cuda:0" if run.gpu else "cpu")
    finally:
        comm.close()
    if any(wrong):
        raise AssertionError(f"count {count}: wrong elements per rank {wrong}")
    size = count * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return f"count {count} ({size / 2 ** 20:.1f} MiB per rank): 0 wrong"


def correctness_stage(run: Run, stage: Stage) -> None:
    for key, protocol, form, dtype, op, tile in sweep(run):
        plan = plan_of(key, run.ranks, protocol, tile)
        counts = (1, 1001, tile_count(plan, dtype, 2.5)) if run.quick else (1, 3, 1001, tile_count(plan, dtype, 2.5))
        stage.case(f"{key}@{run.ranks} {protocol} {form} {dtype} {op}", check_counts, run, plan, form, dtype, op,
                   counts)
    tiles = 1.2 if run.quick else 2.5            # the emulated device moves megabytes slowly
    for protocol in ("Simple", "LL"):
        for form in (("table",) if run.quick else ("straight", "table")):
            stage.case(f"{RING}@{run.ranks} {protocol} {form} bfloat16 {tiles} default tiles", check_large, run,
                       plan_of(RING, run.ranks, protocol), form, "bfloat16", tiles)


# -- stage 4: behaviour -----------------------------------------------------------------------------
def back_to_back(run: Run, calls: int) -> str:
    """Calls queued without a synchronize, each on its own fresh tensors, counts varying (tiles and
    slot positions move between launches); all checked after one synchronize."""
    import torch

    plan = plan_of(RING, run.ranks, "Simple", SMALL_TILE)
    comm = communicator(run, plan)
    where = "cuda:0" if run.gpu else "cpu"
    gen = torch.Generator(device=where).manual_seed(0)
    sets, wants = [], []
    for i in range(calls):
        count = 5000 - 37 * (i % 7)
        xs = [torch.randint(1, 9, (count,), generator=gen, device=where).float() for _ in range(run.ranks)]
        wants.append(torch.stack(xs).sum(0))
        comm.all_reduce(xs)
        sets.append(xs)
    comm.synchronize()
    comm.close()
    bad = [(i, r) for i, (xs, want) in enumerate(zip(sets, wants)) for r, x in enumerate(xs) if not torch.equal(x, want)]
    if bad:
        raise AssertionError(f"{len(bad)} (call, rank) outputs wrong, first {bad[:4]}")
    return f"{calls} calls, {calls * run.ranks} outputs exact"


def graph_replay(run: Run) -> str:
    import torch

    plan = plan_of("allreduce/allpairs:allpairs", run.ranks, "LL")
    comm = communicator(run, plan)
    xs = [torch.full((2048,), float(r + 1), device="cuda") for r in range(run.ranks)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_reduce(xs)                     # warm up: buffers, kernel, arguments
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce(xs)
    want = float(sum(range(1, run.ranks + 1)))
    for i in range(5):
        for r, x in enumerate(xs):
            x.fill_(float(r + 1))
        graph.replay()
        torch.cuda.synchronize()
        if not all(torch.all(x == want) for x in xs):
            raise AssertionError(f"replay {i}: outputs differ from {want}")
    comm.synchronize()
    comm.close()
    return "5 replays exact"


def growth(run: Run) -> str:
    """Calls of changing sizes on one communicator (alltoall/hierarchical: scratch grows with the
    count): exact results, and the arenas reallocated whenever a call needs more than the last."""
    from cudaboot import check_run

    plan = plan_of("alltoall/hierarchical:hierarchical", run.ranks, "LL")
    comm = communicator(run, plan)
    counts = (100, 1 << 14, 100, (1 << 15) + 1, 7)
    for i, count in enumerate(counts):
        check_run(comm, count, "float32", "sum", seed=i)
    allocated, want = comm._generation, allocations(comm, counts)
    comm.close()
    if allocated != want or want < 3:
        raise AssertionError(f"the arenas were allocated {allocated} times; the footprints need {want}")
    return f"counts {counts}: exact, arenas allocated {allocated} times"


def allocations(comm, counts) -> int:
    """How many arena allocations ``counts`` need, by the runtime's footprint and growth rules."""
    from msc.cuda.launch import footprint, launch_params
    from msc.cuda.tables import grow

    capacity, n = None, 0
    for count in counts:
        params = launch_params(comm.layout, count, dtype="float32", protocol=comm.kplan.protocol,
                               tile_bytes=comm.kplan.tile)
        bigger = grow(capacity, footprint(comm.layout, params, dtype="float32", protocol=comm.kplan.protocol,
                                          slots=comm.slots))
        if bigger is not None:
            capacity, n = bigger, n + 1
    return n


def side_stream(run: Run) -> str:
    """A table-form communicator built on the default stream, its first call on a new stream:
    the launch must wait for the tables' copy."""
    import torch

    plan = plan_of("allreduce/allpairs:allpairs", run.ranks, "Simple")
    comm = communicator(run, plan, form="table")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xs = [torch.full((4099,), float(r + 1), device="cuda") for r in range(run.ranks)]
        comm.all_reduce(xs)
    s.synchronize()
    comm.synchronize()
    comm.close()
    want = float(sum(range(1, run.ranks + 1)))
    if not all(torch.all(x == want) for x in xs):
        raise AssertionError("outputs of the side-stream call differ")
    return "exact"


def timeouts(run: Run) -> str:
    """A deadlocking plan, and a rank that never launches: DeviceTimeoutError, then broken."""
    import torch

    from cudaboot import deadlock_plan
    from msc.cuda import BrokenCommunicatorError, DeviceTimeoutError

    where = "cuda:0" if run.gpu else "cpu"
    found = []
    comm = communicator(run, deadlock_plan(), timeout_s=0.5, allow_deadlock=True)
    outs, ins = [torch.empty(128, device=where) for _ in range(2)], [torch.ones(64, device=where) for _ in range(2)]
    comm.all_gather(outs, ins)
    try:
        comm.synchronize()
        raise AssertionError("the deadlocking plan did not time out")
    except DeviceTimeoutError as exc:
        found.append(f"deadlock: rank {exc.rank} tb {exc.tb} step {exc.step}")
    try:
        comm.all_gather(outs, ins)
        raise AssertionError("a broken communicator accepted a call")
    except BrokenCommunicatorError:
        found.append("then broken")
    comm.close()
    lone = communicator(run, plan_of(RING, 4, "Simple"), timeout_s=0.5, _omit_ranks=(3,))
    lone.all_reduce([torch.ones(4096, device=where) for _ in range(4)])
    try:
        lone.synchronize()
        raise AssertionError("peers of a rank that never launched did not time out")
    except DeviceTimeoutError as exc:
        found.append(f"missing rank: rank {exc.rank} timed out")
    lone.close()
    return "; ".join(found)


def behaviour_stage(run: Run, stage: Stage) -> None:
    stage.case("back-to-back launches", back_to_back, run, 6 if run.quick else 50)
    if run.gpu:
        stage.case("CUDA graph capture and replay", graph_replay, run)
        stage.case("a table-form call on a side stream", side_stream, run)
    else:
        stage.skip("CUDA graph capture and replay", "the emulated device has no CUDA graphs")
        stage.skip("a table-form call on a side stream", "an emulated device has one stream")
    stage.case("buffers growing between calls", growth, run)
    stage.case("timeouts (0.5 s)", timeouts, run)


# -- stage 5: NVLS, the switch ----------------------------------------------------------------------------


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


def nvls_stage(run: Run, stage: Stage, tools=None) -> dict:
    """The switch on this GPU (module doc, stage 5): every outcome a case, none raised.
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


# -- stage 6: headline numbers ------------------------------------------------------------------------
@dataclass
class GoalArgs:
    """bench/cuda_goals.py's options, for its run_* functions."""

    ranks: int
    iters: int
    warmup: int
    instances: list
    timeout: float


def headline_stage(run: Run, stage: Stage) -> dict:
    import cuda_goals as goals
    from library import algorithms

    from msc.cuda import device as cu

    gpus = cu.device_count() if run.gpu else run.ranks
    args = GoalArgs(run.ranks, 3 if run.quick else 20, 1 if run.quick else 5, [1] if run.quick else [1, 4], 30.0)
    keys = sorted({k for k, *_ in headline_plans(run)})
    algs = [algorithms()[k] for k in keys]
    sizes = ("64K",) if run.quick else goals.LARGE
    runs = []

    def collect(what, fn, *a, **kw):
        out = fn(*a, **kw)
        runs.extend(out)
        wrong = sum(r["wrong"] for r in out)
        if wrong or not out:
            raise AssertionError(f"{what}: {wrong} wrong elements in {len(out)} runs" if out else f"{what}: no run")
        return f"{len(out)} runs: " + "; ".join(f"{r['algorithm']} " + ", ".join(
            f"{rec['size']} B {rec['busbw']:.2f} GB/s" for rec in r["records"]) for r in out)

    stage.case("goal 1: virtual placement, bf16 allreduce", collect, "large", goals.run_large, args, algs, run.device,
               sizes=sizes, log=lambda line: stage.cases.append({"case": "log", "ok": None, "detail": line}))
    stage.case("goal 3: 8 KB LL allreduce", collect, "small", goals.run_small, args, algs, run.device,
               0 if not run.gpu else 100)
    if gpus >= run.ranks:
        stage.case("goal 2: devices placement", collect, "devices", goals.run_devices, args, algs, run.device,
                   sizes=sizes)
    else:
        stage.skip("goal 2: devices placement", f"{gpus} GPU(s), {run.ranks} ranks need one each")
    summary, verdicts = goals.summarize(runs, run.ranks, gpus, goals.nvlink_line_rate() if run.gpu
                                        else (None, "emulated device"))
    return {"summary": summary, "verdicts": verdicts, "runs": runs}


# -- the run --------------------------------------------------------------------------------------------
def run_stages(run: Run) -> dict:
    extra = {}
    for name, body in (("environment", None), ("compile", compile_stage), ("correctness", correctness_stage),
                       ("behaviour", behaviour_stage), ("nvls", nvls_stage), ("headline", headline_stage)):
        stage = Stage(run, name)
        print(f"== {name} (cap {stage.cap} s; {run.elapsed():.0f} s so far)", flush=True)
        try:
            if body is None:
                extra["environment"] = environment(run)
            else:
                got = body(run, stage)
                if isinstance(got, dict):
                    extra[name] = got
        except Capped as exc:
            stage.status, stage.error = "capped", str(exc)
        except Exception as exc:                 # a stage that breaks is recorded; the next still runs
            stage.status, stage.error = "fail", traceback.format_exc()[-3000:]
            print(f"   {name}: {type(exc).__name__}: {exc}", flush=True)
        run.stages[name] = stage.record()
        print(f"   {name}: {run.stages[name]['status']} in {run.stages[name]['seconds']} s", flush=True)
    return extra


def summary_text(run: Run, extra: dict) -> str:
    lines = [f"msc first GPU run: device {run.device}{' (quick)' if run.quick else ''}, {run.elapsed():.1f} s"]
    env = extra.get("environment", {})
    lines.append("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    for name, st in run.stages.items():
        ok = sum(1 for c in st["cases"] if c["ok"])
        bad = [c for c in st["cases"] if c["ok"] is False]
        skipped = sum(1 for c in st["cases"] if c["ok"] is None and c["case"] != "log")
        lines.append(f"{name}: {st['status'].upper()} in {st['seconds']} s (cap {st['cap_s']} s): {ok} passed, "
                     f"{len(bad)} failed, {skipped} skipped" + (f"; {st['error'].splitlines()[-1]}" if st["error"]
                                                                 else ""))
        lines += [f"  FAIL {c['case']}: {c['detail']}" for c in bad[:10]]
    if run.device == "emu":
        lines.append("(emulated device: its times are host threads', so the goals' verdicts below say nothing about "
                     "a GPU; the stages check that the script and the runtime work)")
    lines += extra.get("headline", {}).get("summary", [])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for first-gpu-run.json and summary.txt")
    ap.add_argument("--device", choices=("cuda", "emu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="smaller sets and sizes (the emulated device in CI)")
    args = ap.parse_args(argv)
    import tempfile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(args.device, args.quick, out, Path(tempfile.mkdtemp(prefix="msc-first-run-kernels-")))
    from msc.cuda.backend import choose
    from msc.errors import UsageError

    try:
        choose(args.device).require()
    except UsageError as exc:
        print(f"first_gpu_run: no {args.device} device: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(TOTAL_S)
    extra = {}
    try:
        extra = run_stages(run)
    except OutOfTime as exc:
        run.stages.setdefault("total", {"status": "capped", "seconds": run.elapsed(), "cap_s": TOTAL_S,
                                        "error": str(exc), "cases": []})
    finally:
        signal.alarm(0)
        passed = bool(run.stages) and all(s["status"] == "pass" for s in run.stages.values())
        (out / "first-gpu-run.json").write_text(json.dumps({"command": " ".join([sys.executable, *sys.argv]),
                                                            "passed": passed, "seconds": round(run.elapsed(), 1),
                                                            "stages": run.stages, **extra}, indent=1, default=str))
        text = summary_text(run, extra)
        (out / "summary.txt").write_text(text)
        print(text)
    return 0 if passed else 1


class OutOfTime(Exception):
    pass


def _out_of_time(signum, frame):
    raise OutOfTime(f"the run passed its {TOTAL_S} s")


if __name__ == "__main__":
    sys.exit(main())
