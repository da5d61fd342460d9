"""Everything a first run of msc's CUDA runtime on a GPU must establish, inside
one budget (``--budget-s``, default 480 s: one 10-minute device command with
the machine's start-up and the wrapper's margins left over), the decisive and
cheap stages first, so that whatever cuts the run short the most is already
proven and on disk:

1. environment: Python, torch, cuda-core, cuda-bindings, NVRTC, the driver,
   the GPU (name, arch, SMs, memory), whether MPS runs, a digest of the
   templates; ``nvidia-smi -q`` and ``nvidia-smi topo -m`` saved beside;
2. compile: every kernel the later stages use, in the order they use them,
   in parallel worker processes (NVRTC on a GPU, g++ on the emulated device;
   a worker per core) into the run's one kernel cache, which every later
   stage and child reads (``$MSC_CACHE_DIR``): nothing is compiled twice; a
   capped compile kills its workers, and later stages build what is missing;
3. correctness (core): the 8-rank ring allreduce on the virtual placement
   (every rank on this GPU), bit for bit against msc.executor on random
   inputs (never zero) with poisoned outputs (avg: to a few roundings), both
   protocols, both forms, float32 sum, bfloat16 max, float16 avg, counts 1,
   1001 and 2.5 tiles per chunk (4 KiB tiles), and 2.5 default tiles checked
   on the device;
4. headline (core): the ring's bfloat16 allreduce at 64 MB and 1 GB per rank
   against the one-GPU bound of its kernel, and the 8 KB LL allreduce from a
   CUDA graph (bench/cuda_goals.py's goals 1 and 3, baselines measured in the
   same run);
5. correctness (rest): every other (dtype, op) pair the kernels take, the
   other collectives (allgather, reducescatter, alltoall, broadcast, reduce)
   in the table form, and the ring with connection counters and packets at
   ``.sys`` scope (what separate GPUs use) beside the virtual placement's
   ``.gpu``;
6. behaviour only a device shows: back-to-back launches without a
   synchronize, CUDA graph capture and replay, buffers growing between
   calls, a table-form launch on a side stream (ordered after the tables'
   copy), a deadlocking plan and a rank that never launches ending in
   DeviceTimeoutError (0.5 s timeouts);
7. NVLS, the switch (bench/first_gpu_nvls.py): the multicast attribute, the
   switch kernels loaded, multimem on a one-GPU multicast object;
8. headline (rest): every other 8-rank allreduce of the library (switch plans
   aside: stage 7 covers them) at 1 and 4 instances, and the devices
   placement against the NVLink line rate where there is a GPU per rank;
9. sanitizer: compute-sanitizer's memcheck and synccheck around the ring at
   4 ranks, Simple and LL, small counts (bench/first_gpu_child.py);
10. torchrun: two processes on this GPU through the torchrun placement's
    bootstrap (CUDA IPC) and kernels (bench/first_gpu_child.py);
11. kernel-cache: no stage or child built a kernel the compile stage had not
    (where that stage finished), so nothing was compiled twice.

A stage takes at most its share of the time left (bench/budgeted.py: each
may use up to its ``max_s`` while every later stage keeps its ``min_s``), an
alarm that no ``except Exception`` can swallow cuts it off at its deadline,
and the case it was running is recorded as cut off. Results, as they come:
DIR/cases.jsonl (a line per case, synced), DIR/summary.json and
DIR/summary.txt (after every stage, at the end, and on SIGTERM or SIGINT).
A hang in a C call is ended by a watchdog; the run ends within budget + 30 s
whatever happens. Exit status: 0 when every stage passed, 1 when any failed
or was cut off, 2 without a device, 128 + the signal when interrupted, 124
when the watchdog had to end it. ``--device emu`` runs the same stages on the
emulated device (msc.cuda.emu; no graphs, side streams or sanitizer there:
those cases say so), ``--quick`` with smaller sets and sizes (CI runs it).
bench/README.md says how to carry msc to the GPU machine and run this there.

    python bench/first_gpu_run.py --out DIR [--device cuda|emu] [--quick] [--budget-s S]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budgeted import Capped, Record, Runner, StageSpec       # noqa: E402
from first_gpu_checks import (RING, ROOT, SMALL_TILE, Run, check_counts, check_large, communicator,  # noqa: E402
                              plan_of, tile_count)
from first_gpu_nvls import NVLS, NVLS_EMULATED, NVLS_KERNELS, nvls_stage                   # noqa: E402

BUDGET_S = 480                   # the default: one 10-minute command, start-up and margins left over
KERNEL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32")
KERNEL_OPS = ("sum", "prod", "max", "min", "avg")
CORE_KINDS = (("float32", "sum"), ("bfloat16", "max"), ("float16", "avg"))
OTHERS = ("allgather/ring:ring", "reducescatter/ring:ring", "alltoall/allpairs:allpairs", "broadcast/chain:chain",
          "reduce/tree:tree")
CHILD = Path(__file__).resolve().parent / "first_gpu_child.py"
DEADLOCK = "cudaboot:deadlock_plan"      # the behaviour stage's deadlocking plan (not a library algorithm)
SANITIZER_TOOLS = ("memcheck", "synccheck")
CHILD_TIMEOUT_S = 60.0           # a child kernel's spin-wait budget (a sanitizer slows kernels many times)


# -- what the stages run --------------------------------------------------------------------------
def kinds(run: Run, core: bool) -> list[tuple[str, str]]:
    """(dtype, op) of the ring sweep: the core three, or every other pair the kernels take (none
    more in the quick form)."""
    if core:
        return list(CORE_KINDS)
    if run.quick:
        return []
    return [(d, o) for d in KERNEL_DTYPES for o in KERNEL_OPS
            if not (o == "avg" and d == "int32") and (d, o) not in CORE_KINDS]


def sweep(run: Run, core: bool) -> list[tuple]:
    """(key, protocol, form, dtype, op, tile, scope) of a correctness stage's communicators."""
    cases = [(RING, p, f, d, o, SMALL_TILE, "gpu") for p in ("Simple", "LL") for f in ("straight", "table")
             for d, o in kinds(run, core)]
    if core:
        return cases
    others = OTHERS[:2] if run.quick else OTHERS
    cases += [(k, p, "table", d, "sum", SMALL_TILE, "gpu") for k in others for p in ("Simple", "LL")
              for d in (("float32",) if run.quick else ("float32", "bfloat16"))]
    forms = ("straight",) if run.quick else ("straight", "table")
    return cases + [(RING, p, f, "float32", "sum", SMALL_TILE, "sys") for p in ("Simple", "LL") for f in forms]


def large_checks(run: Run, core: bool) -> list[tuple[str, str, float]]:
    """(protocol, form, tiles) of the ring's bfloat16 runs of default-size tiles, checked on the device."""
    tiles = 1.2 if run.quick else 2.5            # the emulated device moves megabytes slowly
    forms = ("table",) if core else (() if run.quick else ("straight",))
    return [(p, f, tiles) for f in forms for p in ("Simple", "LL")]


def headline_keys(run: Run, core: bool) -> list[str]:
    """The allreduce schedules the headline stages time: the ring first, the rest after (switch plans
    aside: they run as one process per GPU, and the NVLS stage covers them)."""
    from library import algorithms

    if core:
        return [RING]
    if run.quick:
        return ["allreduce/allpairs:allpairs"]
    library = algorithms(switch=False)
    return [k for k in sorted(library) if k.startswith("allreduce/") and k != RING and library[k].supports(run.ranks)]


def headline_plans(run: Run, core: bool) -> list[tuple]:
    """(key, protocol, instances, dtype, op) a headline stage times."""
    keys = headline_keys(run, core)
    instances = (1,) if core or run.quick else (1, 4)
    large = [(k, "Simple", i, "bfloat16", "sum") for k in keys for i in instances]
    if not core and not run.quick:
        large.append((RING, "Simple", 4, "bfloat16", "sum"))
    return large + [(k, "LL", 1, "float32", "sum") for k in keys]


# -- stage 1: environment -------------------------------------------------------------------------
def environment_stage(run: Run, stage) -> dict:
    env: dict = {}
    stage.record.extra["environment"] = env           # in every summary from now on, as it fills
    stage.case("versions", _versions, run, env)
    stage.case("imports", _imports)
    if run.gpu:
        stage.case("the GPU", lambda: env.update(_gpu_environment()) or env.get("gpu"))
    for argv, file in ((["nvidia-smi", "-q"], "nvidia-smi-q.txt"),
                       (["nvidia-smi", "topo", "-m"], "nvidia-smi-topo.txt")):
        if shutil.which("nvidia-smi") is None:
            stage.skip(" ".join(argv), "nvidia-smi is not on PATH")
        else:
            stage.case(" ".join(argv), _save_output, run, argv, file, env)


def _versions(run: Run, env: dict) -> str:
    from importlib.metadata import PackageNotFoundError, version

    env.update({"python": platform.python_version(), "machine": platform.platform(), "cpus": os.cpu_count(),
                "device": run.device, "templates_sha256": _templates_digest()})
    for pkg in ("torch", "cuda-core", "cuda-bindings", "cuda-pathfinder", "nvidia-cuda-nvrtc", "numpy", "jinja2",
                "ml_dtypes", "lark", "tqdm", "msc"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = "missing"
    if env["msc"] == "missing":                   # imported from this checkout (the GPU image cannot install it)
        env["msc"] = f"checkout {ROOT}" + _commit()
    from carry import needed

    stale = needed({k: None if env[k] == "missing" else env[k] for k in ("lark", "cuda-core", "cuda-bindings",
                                                                         "cuda-pathfinder")})
    if stale:
        raise RuntimeError("older or missing than msc needs: " + "; ".join(sorted({why for _, why in stale}))
                           + " (bench/README.md, 'Carrying msc to the GPU machine')")
    from cuda.core import LaunchConfig, Program, ProgramOptions  # noqa: F401  what msc's runtime imports

    return ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "cuda-core", "cuda-bindings", "lark"))


def _commit() -> str:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f" at {done.stdout.strip()}" if done.returncode == 0 else ""


def _imports() -> str:
    """What the stages import, here at once: an alarm waits for an import to finish (budgeted.py), so
    a first import inside a later stage (torch takes seconds) would run past that stage's cap."""
    t0 = time.monotonic()
    import cuda_goals  # noqa: F401
    import cudaboot  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    from library import algorithms

    import msc.cuda.bench  # noqa: F401
    import msc.cuda.runtime  # noqa: F401
    import msc.executor  # noqa: F401

    return f"torch, numpy, msc's runtime and {len(algorithms())} library algorithms in {time.monotonic() - t0:.1f} s"


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
    return env


def _save_output(run: Run, argv: list[str], name: str, env: dict) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    (run.out / name).write_text(done.stdout + done.stderr)
    env[" ".join(argv)] = name
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[:300]}")
    return f"{len(done.stdout.splitlines())} lines in {name}"


# -- stage 2: compile -----------------------------------------------------------------------------
def compile_jobs(run: Run) -> list[tuple]:
    """(key, n, protocol, tile, instances, form, dtype, kernel op) of every kernel the run uses, once
    each, in the order the stages use them."""
    from msc.cuda.validate import check_op

    jobs: list[tuple] = []

    def add(job):
        if job not in jobs:
            jobs.append(job)

    def sweep_jobs(core):
        for key, protocol, form, dtype, op, tile, _ in sweep(run, core):
            add((key, run.ranks, protocol, tile, 1, form, dtype, check_op(plan_of(key, run.ranks, protocol), op,
                                                                          dtype)))
        for protocol, form, _ in large_checks(run, core):
            add((RING, run.ranks, protocol, 0, 1, form, "bfloat16", "sum"))

    def headline_jobs(core):
        for key, protocol, inst, dtype, op in headline_plans(run, core):
            add((key, run.ranks, protocol, 0, inst, None, dtype, op))

    sweep_jobs(core=True)
    headline_jobs(core=True)
    sweep_jobs(core=False)
    for job in (("allreduce/allpairs:allpairs", run.ranks, "LL", 0, 1, None, "float32", "sum"),     # behaviour
                ("allreduce/allpairs:allpairs", run.ranks, "Simple", 0, 1, "table", "float32", "sum"),
                ("alltoall/hierarchical:hierarchical", run.ranks, "LL", 0, 1, None, "float32", "sum"),
                (RING, 4, "Simple", 0, 1, None, "float32", "sum"),
                (DEADLOCK, 2, "Simple", 0, 1, None, "float32", "sum")):
        add(job)
    if run.gpu:                                   # the NVLS stage's kernels (it loads them from this cache)
        for dtype, op, form in NVLS_KERNELS:
            add((NVLS, 8, "Simple", 0, 1, form, dtype, op))
    else:                                         # the plan it runs on the emulated device
        for dtype, op in NVLS_EMULATED:
            add((NVLS, 4, "Simple", 0, 1, "table", dtype, op))
    headline_jobs(core=False)
    add((RING, 4, "LL", 0, 1, None, "float32", "sum"))                        # the sanitizer's child
    for protocol in ("Simple", "LL"):                                        # the torchrun child
        add((RING, 2, protocol, 0, 1, None, "float32", "sum"))
    return jobs


def describe(job: tuple) -> str:
    key, n, protocol, tile, inst, form, dtype, op = job
    return f"{key}@{n} {protocol} tile={tile} x{inst} {form or 'auto'} {dtype} {op}"


def compile_one(job: tuple, device: str, arch: str, cache: str) -> str:
    from msc.cuda.compiler import compile as compile_cuda
    from msc.cuda.compiler import compile_host
    from msc.cuda.runtime import runtime_plan

    key, n, protocol, tile, inst, form, dtype, op = job
    if key == DEADLOCK:
        from cudaboot import deadlock_plan

        plan, kw = runtime_plan(deadlock_plan()), {"allow_deadlock": True}
    else:
        plan, kw = runtime_plan(plan_of(key, n, protocol, tile, inst)), {}
    if device == "emu":
        hit = compile_host(plan, dtype=dtype, op=op, form=form, cache=Path(cache), **kw).cache_hit
    else:
        hit = compile_cuda(plan, dtype=dtype, op=op, arch=arch, form=form, cache=Path(cache), **kw).cache_hit
    return "cached" if hit else "built"


class KernelCache:
    """The run's kernel binaries (host libraries, cubins): which the compile stage left, and which
    appeared after it (a kernel its job list missed, built again where a stage needed it)."""

    PATTERNS = ("host/*/kernel.so", "kernels/*/*.cubin")

    def __init__(self, run: Run):
        self.run, self.after_compile = run, None

    def binaries(self) -> set[str]:
        root = self.run.cache
        return {str(p.relative_to(root)) for pattern in self.PATTERNS for p in root.glob(pattern)}

    def snapshot(self) -> None:
        self.after_compile = self.binaries()

    def stage(self, stage) -> None:
        """Fails where the compile stage finished and a later stage or child still built a kernel."""
        stage.case("kernels built after the compile stage", self._check, stage.record.stages)

    def _check(self, stages: dict) -> str:
        if self.after_compile is None:
            return "the compile stage did not finish: later stages built what they needed"
        late = sorted(self.binaries() - self.after_compile)
        if late and stages.get("compile", {}).get("status") == "pass":
            raise AssertionError(f"{len(late)} kernels built after a complete compile stage (its job list misses "
                                 f"them): " + ", ".join(f"{p} (in {self._built_in(p, stages)})" for p in late[:8]))
        return f"{len(self.after_compile)} binaries from the compile stage, {len(late)} built later"

    def _built_in(self, binary: str, stages: dict) -> str:
        """The stage under way when ``binary`` was written (its mtime against the stages' starts)."""
        when = (self.run.cache / binary).stat().st_mtime
        started = [(st["started"], name) for name, st in stages.items() if "started" in st and st["started"] <= when]
        return max(started)[1] if started else "?"


def compile_stage(run: Run, stage, kernels: KernelCache) -> dict:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    jobs = compile_jobs(run)
    arch = "host"
    if run.gpu:
        from msc.cuda.device import arch as gpu_arch

        arch = gpu_arch(0)
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    stage.log(f"{len(jobs)} kernels for {arch} on {workers} worker processes")
    # Each worker leads a process group of its own, so a cut-off compile kills its compilers too.
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=os.setsid)
    built = 0
    try:
        # On the emulated device the first build makes the precompiled headers the others use.
        waves = [jobs[:1], jobs[1:]] if run.device == "emu" else [jobs]
        for wave in waves:
            pending = {pool.submit(compile_one, job, run.device, arch, str(run.cache)): job for job in wave}
            while pending:
                done, _ = wait(pending, timeout=max(0.1, stage.left()), return_when=FIRST_COMPLETED)
                if not done:
                    raise Capped(f"compile: its {stage.cap:.0f} s were spent with {len(pending)} kernels to go")
                for future in done:
                    job = pending.pop(future)
                    if stage.case(f"compile {describe(job)}", future.result):
                        built += 1
    except BaseException:
        _kill_pool(pool)
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    kernels.snapshot()
    return {"kernels": len(jobs), "compiled": built, "arch": arch, "workers": workers}


def _kill_pool(pool) -> None:
    """Every worker and what it started (its process group), at once, and wait until they are gone, so
    none writes into the run's kernel cache after it is removed."""
    procs = list(getattr(pool, "_processes", {}).values())
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            # no group yet: a worker still starting (a loaded machine) has not run its initializer
            # (os.setsid) nor started a compiler; kill it alone
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        except PermissionError:
            pass
    for proc in procs:
        proc.join(timeout=10)


# -- stages 3 and 5: correctness -------------------------------------------------------------------
def correctness(run: Run, stage, core: bool) -> None:
    for key, protocol, form, dtype, op, tile, scope in sweep(run, core):
        plan = plan_of(key, run.ranks, protocol, tile)
        counts = (1, 1001, tile_count(plan, dtype, 2.5)) if run.quick else (1, 3, 1001, tile_count(plan, dtype, 2.5))
        stage.case(f"{key}@{run.ranks} {protocol} {form} {dtype} {op} .{scope}", check_counts, run, plan, form, dtype,
                   op, counts, _system_scope=scope == "sys")
    for protocol, form, tiles in large_checks(run, core):
        stage.case(f"{RING}@{run.ranks} {protocol} {form} bfloat16 {tiles} default tiles", check_large, run,
                   plan_of(RING, run.ranks, protocol), form, "bfloat16", tiles)


# -- stage 4: behaviour -----------------------------------------------------------------------------
def back_to_back(run: Run, calls: int) -> str:
    """Calls queued without a synchronize, each on its own fresh tensors, counts varying (tiles and
    slot positions move between launches); all checked after one synchronize."""
    import torch

    plan = plan_of(RING, run.ranks, "Simple", SMALL_TILE)
    comm = communicator(run, plan)
    where = run.where
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

    where = run.where
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


def behaviour_stage(run: Run, stage) -> None:
    stage.case("back-to-back launches", back_to_back, run, 6 if run.quick else 50)
    if run.gpu:
        stage.case("CUDA graph capture and replay", graph_replay, run)
        stage.case("a table-form call on a side stream", side_stream, run)
    else:
        stage.skip("CUDA graph capture and replay", "the emulated device has no CUDA graphs")
        stage.skip("a table-form call on a side stream", "an emulated device has one stream")
    stage.case("buffers growing between calls", growth, run)
    stage.case("timeouts (0.5 s)", timeouts, run)


# -- stages 4 and 8: headline numbers ------------------------------------------------------------------
@dataclass
class GoalArgs:
    """bench/cuda_goals.py's options, for its run_* functions."""

    ranks: int
    iters: int
    warmup: int
    instances: list
    timeout: float


class Headline:
    """Both headline stages' runs, summarized together after each case (cuda_goals.summarize) into
    the record's "headline", so a cut-off stage keeps what it measured."""

    def __init__(self):
        self.runs: list[dict] = []
        self.line_rate = None            # the NVLink line rate, read once (nvidia-smi)

    def stage(self, run: Run, stage, core: bool) -> None:
        import cuda_goals as goals
        from library import algorithms

        # The goals' sizes on a GPU (the rest, 21 schedules, with fewer calls timed); on the emulated
        # device, what checks the script: 1 GB per rank of host threads would take the whole budget
        # and prove nothing a megabyte does not.
        if run.gpu and not run.quick:
            sizes, (iters, warmup) = goals.LARGE, (20, 5) if core else (10, 2)
        else:
            sizes, (iters, warmup) = ("64K",) if run.quick else ("1M",), (3, 1)
        library = algorithms()
        for key, protocol, inst, *_ in headline_plans(run, core):
            args = GoalArgs(run.ranks, iters, warmup, [inst], 30.0)
            if protocol == "Simple":
                stage.case(f"goal 1: {key} x{inst} bf16 allreduce, virtual placement", self._collect, run, stage,
                           "large", goals.run_large, args, [library[key]], run.device, sizes=sizes, log=stage.log)
            else:
                stage.case(f"goal 3: {key} 8 KB LL allreduce", self._collect, run, stage, "small", goals.run_small,
                           args, [library[key]], run.device, 0 if not run.gpu else 100, log=stage.log)
        if not core:
            if self.gpus(run) >= run.ranks:
                args = GoalArgs(run.ranks, iters, warmup, [1], 30.0)
                stage.case("goal 2: devices placement", self._collect, run, stage, "devices", goals.run_devices, args,
                           [library[k] for k in [RING, *headline_keys(run, False)]], run.device, sizes=sizes,
                           log=stage.log)
            else:
                stage.skip("goal 2: devices placement", f"{self.gpus(run)} GPU(s), {run.ranks} ranks need one each")

    @staticmethod
    def gpus(run: Run) -> int:
        from msc.cuda import device as cu

        return cu.device_count() if run.gpu else run.ranks

    def _collect(self, run: Run, stage, what, fn, *a, **kw) -> str:
        import cuda_goals as goals

        out = fn(*a, **kw)
        self.runs.extend(out)
        if self.line_rate is None:
            self.line_rate = goals.nvlink_line_rate() if run.gpu else (None, "emulated device")
        summary, verdicts = goals.summarize(self.runs, run.ranks, self.gpus(run), self.line_rate)
        stage.record.extra["headline"] = {"summary": summary, "verdicts": verdicts, "runs": self.runs}
        wrong = sum(r["wrong"] for r in out)
        if wrong or not out:
            raise AssertionError(f"{what}: {wrong} wrong elements in {len(out)} runs" if out else f"{what}: no run")
        return "; ".join(f"{r['algorithm']} " + ", ".join(f"{rec['size']} B {rec['busbw']:.2f} GB/s"
                                                          for rec in r["records"]) for r in out)


# -- stages 9 and 10: children ------------------------------------------------------------------------
def run_children(commands: list[tuple[list[str], dict]], timeout: float, logs: list[Path]) -> list[int]:
    """Each (argv, extra environment) as a process, its output to its log, all in one process group
    of their own; their exit codes. On a timeout, a cap or an interrupt the whole group is killed
    before the exception goes on, so no child outlives the run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    children, group = [], None
    deadline = time.monotonic() + max(1.0, timeout)
    try:
        for (argv, extra), log in zip(commands, logs):
            with open(log, "w") as sink:
                child = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env={**env, **extra},
                                         process_group=0 if group is None else group)
            group = group if group is not None else child.pid
            children.append(child)
        return [child.wait(timeout=max(0.1, deadline - time.monotonic())) for child in children]
    except BaseException:
        if group is not None:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in children:
            child.wait()
        raise


def sanitizer_stage(run: Run, stage) -> None:
    child = [sys.executable, str(CHILD), "sanitize", "--device", run.device, "--cache", str(run.cache),
             "--timeout", str(CHILD_TIMEOUT_S)]
    if not run.gpu:
        stage.skip("compute-sanitizer", "the emulated device has no compute-sanitizer (the child runs plain)")
        stage.case(f"{RING}@4 Simple and LL in a child, plain", _child_checks, child, stage.left(),
                   run.out / "sanitize-plain.log")
        return
    sanitizer = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if Path(p).exists()), None)
    if sanitizer is None:
        for tool in SANITIZER_TOOLS:
            stage.skip(f"compute-sanitizer --tool {tool}", "compute-sanitizer not found")
        return
    for i, tool in enumerate(SANITIZER_TOOLS):
        argv = [sanitizer, "--tool", tool, "--error-exitcode", "3", "--print-limit", "20", *child]
        stage.case(f"compute-sanitizer --tool {tool}: {RING}@4 Simple and LL", _child_checks, argv,
                   stage.left() / (len(SANITIZER_TOOLS) - i), run.out / f"sanitize-{tool}.log", sanitized=True)


def _child_checks(argv, timeout: float, log: Path, sanitized: bool = False) -> str:
    code, = run_children([(argv, {})], timeout, [log])
    text = log.read_text(errors="replace")
    lines = text.splitlines()
    errors = next((line for line in lines if "ERROR SUMMARY" in line), None)
    if code or "ok" not in lines or "FAILED" in text:
        raise AssertionError(f"exit {code} ({log.name}): {' | '.join(lines[-6:])}"[:2000])
    checks = [line for line in lines if "bit-exact" in line]
    return "; ".join(checks) + (f"; {errors.strip()}" if errors else "")


def torchrun_stage(run: Run, stage) -> None:
    out = run.out / "torchrun"
    out.mkdir(exist_ok=True)
    stage.case("2 processes, torchrun placement (IPC bootstrap and kernels)", _torchrun_checks, run, out,
               stage.left())


def _torchrun_checks(run: Run, out: Path, timeout: float) -> str:
    """The child in two processes with the environment torchrun gives its workers (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), started here rather than by torchrun, whose workers
    lead sessions of their own and would outlive a cut-off run."""
    import socket

    with socket.socket() as s:                  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, str(CHILD), "torchrun", "--device", run.device, "--cache", str(run.cache), "--out",
            str(out), "--timeout", str(CHILD_TIMEOUT_S / 2)]
    envs = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(2)]
    codes = run_children([(argv, env) for env in envs], timeout, [out / f"rank{r}.log" for r in range(2)])
    ranks = []
    for r in range(2):
        path = out / f"rank{r}.json"
        if not path.exists():
            tail = (out / f"rank{r}.log").read_text(errors="replace").splitlines()[-6:]
            raise AssertionError(f"rank {r} wrote nothing; exit {codes[r]}: {' | '.join(tail)}"[:2000])
        ranks.append(json.loads(path.read_text()))
    bad = [f"rank {r['rank']}: {r.get('error')}" for r in ranks if not r["ok"]]
    if bad or any(codes):
        raise AssertionError(f"exits {codes}: " + "; ".join(bad))
    return "; ".join(ranks[0]["checks"])


# -- the run --------------------------------------------------------------------------------------------
def stages(run: Run) -> list[StageSpec]:
    """The stages in order, with the least and most time each takes of the budget (module doc)."""
    headline, kernels = Headline(), KernelCache(run)
    return [StageSpec("environment", lambda s: environment_stage(run, s), 10, 40),
            # 159 kernels: NVRTC on a GPU machine's 16 cores, g++ on the emulated device's (2 in CI)
            StageSpec("compile", lambda s: compile_stage(run, s, kernels), 60, 150 if run.gpu else 240),
            StageSpec("correctness-core", lambda s: correctness(run, s, core=True), 20, 60),
            StageSpec("headline-core", lambda s: headline.stage(run, s, core=True), 20, 60),
            StageSpec("correctness", lambda s: correctness(run, s, core=False), 40, 120),
            StageSpec("behaviour", lambda s: behaviour_stage(run, s), 20, 60),
            StageSpec("nvls", lambda s: nvls_stage(run, s), 10, 40),
            StageSpec("headline", lambda s: headline.stage(run, s, core=False), 30, 120),
            StageSpec("sanitizer", lambda s: sanitizer_stage(run, s), 20, 90),
            StageSpec("torchrun", lambda s: torchrun_stage(run, s), 15, 60),
            StageSpec("kernel-cache", kernels.stage, 1, 10)]


def summary_text(data: dict) -> str:
    lines = [f"msc first GPU run: device {data['device']}{' (quick)' if data['quick'] else ''}, "
             f"{data['seconds']} s of a {data['budget_s']} s budget; ended: {data['ended']}; "
             f"{'PASSED' if data['passed'] else 'NOT PASSED'}"]
    env = data.get("environment", {})
    if env:
        lines.append("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    if data.get("running"):
        lines.append(f"running when it ended: {' / '.join(data['running'])}")
    for name, st in data["stages"].items():
        counts = (f": {st['passed']} passed, {st['failed']} failed, {st['skipped']} skipped, {st['cut']} cut off"
                  if "passed" in st else "")
        error = (st.get("error") or "").strip().splitlines()
        lines.append(f"{name}: {st['status'].upper()} in {st['seconds']} s (cap {st['cap_s']} s){counts}"
                     + (f"; {error[-1]}" if error else ""))
        lines += [f"  FAIL {f}" for f in st.get("failures", [])]
    if data["device"] == "emu":
        lines.append("(emulated device: its times are host threads', so the goals' verdicts below say nothing about "
                     "a GPU; the stages check that the script and the runtime work)")
    lines += data.get("headline", {}).get("summary", [])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for cases.jsonl, summary.json and summary.txt")
    ap.add_argument("--device", choices=("cuda", "emu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="smaller sets and sizes (the emulated device in CI)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="leave the run's kernel cache (its path is in the summary)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"seconds for the whole run (default {BUDGET_S}); it ends within this + 30 s")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(args.device, args.quick, out, Path(tempfile.mkdtemp(prefix="msc-first-run-kernels-")))
    os.environ["MSC_CACHE_DIR"] = str(run.cache)       # one kernel cache for every stage and child
    from msc.cuda.backend import choose
    from msc.errors import UsageError

    try:
        choose(args.device).require()
    except UsageError as exc:
        print(f"first_gpu_run: no {args.device} device: {exc}", file=sys.stderr)
        shutil.rmtree(run.cache, ignore_errors=True)
        return 2
    record = Record(out, {"command": " ".join([sys.executable, *sys.argv]), "device": args.device,
                          "quick": args.quick, "budget_s": args.budget_s, "cache": str(run.cache)}, summary_text)
    runner = Runner(record, args.budget_s, log=lambda line: print(line, flush=True))
    ended = "finished"
    try:
        ended = runner.run(stages(run))
    finally:
        data = runner.finish(ended)
        print(summary_text(data), flush=True)
        if not args.keep_cache:
            shutil.rmtree(run.cache, ignore_errors=True)
    if ended in ("SIGTERM", "SIGINT"):
        return 128 + getattr(signal, ended)
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
