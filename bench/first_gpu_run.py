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
5. headline numbers (bench/cuda_goals.py's goals, baselines measured in the
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
CAPS = {"environment": 20, "compile": 150, "correctness": 120, "behaviour": 50, "headline": 140}
SMALL_TILE = 4096                # bytes: several tiles per chunk at small counts
TIMEOUT_S = 20.0                 # a spin-wait's budget in the sweep (a hang ends quickly)
KERNEL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32")
KERNEL_OPS = ("sum", "prod", "max", "min", "avg")
OTHERS = ("allgather/ring:ring", "reducescatter/ring:ring", "alltoall/allpairs:allpairs", "broadcast/chain:chain",
          "reduce/tree:tree")
RING = "allreduce/ring:ring"


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


# -- stage 5: headline numbers ------------------------------------------------------------------------
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
                       ("behaviour", behaviour_stage), ("headline", headline_stage)):
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
