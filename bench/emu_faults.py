"""Does the emulated CUDA device catch synchronization bugs? A ThreadSanitizer
sweep of the library, and faults injected into the kernel templates.

1. Sweep: every library algorithm (4 ranks; some at 3 and 8), Simple and LL,
   straight and table form, float32 and bfloat16, sum (and max), counts 1,
   1001 and one of several tiles per call, each case in a fresh process with
   libtsan preloaded and kernels built with -fsanitize=thread
   (MSC_EMU_SANITIZE=thread). Every output is compared bit for bit with the
   reference executor (msc.executor.run_collective); ThreadSanitizer's reports
   are parsed and named by the kernel functions they point to.
2. Faults: each a small textual edit to one template in a copy of templates/
   (MSC_TEMPLATES_DIR points there; an edit that no longer applies is an
   error, never a silent no-op), run on cases where it can matter, with and
   without ThreadSanitizer, at MSC_EMU_THREADS 1, 2, 4 and 8, several times.
   A run catches the fault by wrong results, a ThreadSanitizer report, a
   DeviceTimeoutError or a crash. The unchanged templates run the same cases
   the same way (the control), so a fault's catches are not the harness's.
3. A summary, printed and written to bench/results/emu-faults-<date>.txt with
   the commit, the compiler and the command.

Every run is a fork of a server process (one per templates folder, sanitizer
and batch) that imported msc and lowered the plans once: a run's
ThreadSanitizer reports are its own (TSan reports a race once per process),
and a crash or a hang ends one run, not the batch. Kernels are built before
the runs, by a process without libtsan preloaded (g++ runs at full speed).

    python bench/emu_faults.py                 # everything (10-15 minutes on 2 cores, kernels included)
    python bench/emu_faults.py --quick         # 2-3 minutes: a sample of the sweep, each fault 4 runs
    python bench/emu_faults.py --tsan-only     # the sweep alone
    python bench/emu_faults.py --faults-only [--fault NAME ...]
    python bench/emu_faults.py --list-faults

Not run in CI. Needs g++ (and its libtsan) and the msc environment.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "msc-emu-faults-cache"
TSAN_OPTIONS = "report_signal_unsafe=0 halt_on_error=0 exitcode=66 die_after_fork=0 history_size=4 atexit_sleep_ms=0"
THREADS = (1, 2, 4, 8)


# -- cases ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One communicator: a library plan, kernel choices, and the calls run on it.
    ``counts``: element counts per data unit, run in this order on one
    communicator (counters and slots persist between them); ``calls``: calls
    per count before one synchronize (back to back, different inputs)."""

    alg: str                         # "allreduce/ring:ring"
    ranks: int
    protocol: str
    form: str
    dtype: str
    op: str = "sum"
    counts: tuple = (1001,)
    tile: int = 0                    # the plan's tile in bytes (0: the runtime's default)
    params: tuple = ()               # algorithm parameters, (name, value) pairs
    placement: str = "virtual"
    calls: int = 1
    inplace: bool | None = None
    probe: bool = False              # calibration: Python reads the outputs while the kernel runs

    @property
    def name(self) -> str:
        p = "".join(f",{k}={v}" for k, v in self.params)
        bits = [f"{self.alg}{p}@{self.ranks}", self.protocol, self.form, self.dtype, self.op,
                "counts=" + "+".join(map(str, self.counts))]
        if self.tile:
            bits.append(f"tile={self.tile}B")
        if self.calls > 1:
            bits.append(f"x{self.calls} calls")
        if self.placement != "virtual":
            bits.append(self.placement)
        if self.inplace is False:
            bits.append("out-of-place")
        if self.probe:
            bits.append("PROBE: outputs read before synchronize")
        return " ".join(bits)

    def to_json(self) -> dict:
        d = asdict(self)
        d["counts"], d["params"] = list(self.counts), [list(p) for p in self.params]
        return d

    @staticmethod
    def from_json(d: dict) -> "Case":
        return Case(**{**d, "counts": tuple(d["counts"]), "params": tuple(tuple(p) for p in d["params"])})


def library() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from library import algorithms

    return algorithms()


def chunk_factor(alg: str, ranks: int, params: tuple) -> int:
    return library()[alg].chunks(ranks, **dict(params))


def tile_elems(tile_bytes: int, dtype: str, protocol: str) -> int:
    from msc.cuda.launch import DEFAULT_TILE_BYTES

    size = {"float32": 4, "bfloat16": 2}[dtype]
    return max(8, ((tile_bytes or DEFAULT_TILE_BYTES[protocol]) // size) // 8 * 8)


def tiles_count(alg: str, ranks: int, params: tuple, dtype: str, protocol: str, tile: int, tiles: float) -> int:
    """A count whose chunks take `tiles` tiles (rounded up; the last chunk one element short)."""
    k = chunk_factor(alg, ranks, params)
    q = int(tile_elems(tile, dtype, protocol) * tiles) + 3
    return k * q - (1 if k > 1 else 0)


def make_plan(case: Case):
    import msc
    from msc.lower.pipeline import LowerOptions, lower

    program = msc.trace(library()[case.alg], case.ranks, inplace=case.inplace, **dict(case.params))
    return lower(program, LowerOptions(protocol=case.protocol, tile=case.tile))


# -- one run: a communicator, its calls, the outputs against the executor -----------------------
def launch_numpy(comm, inputs: list, count: int, op: str) -> list:
    """One call on copies of ``inputs``, outputs poisoned first; the logical
    outputs (read them after comm.synchronize())."""
    from msc.cuda.bench import run_numpy

    return run_numpy(comm, inputs, count, op, synchronize=False)


def run_case(case: Case, plan, timeout_s: float, seed: int) -> dict:
    """Run ``case`` once; {"result": ok | wrong | timeout | error, ...}."""
    import numpy as np

    from msc.verification import reference
    from msc.cli import run as runner
    from msc.cuda import Communicator, DeviceTimeoutError
    from msc.cuda.validate import units
    from msc.executor import run_collective

    rng = np.random.default_rng(seed)
    dt = runner.parse_dtype(case.dtype)[1]
    n = plan.num_ranks
    in_units = units(plan)[0]
    checked = wrong = calls = 0
    first = None
    comm = None
    try:
        comm = Communicator(plan, case.placement, device="emu", form=case.form, dtypes=(case.dtype,),
                            ops=(case.op,), timeout_s=timeout_s)
        for count in case.counts:
            pending = []
            for _ in range(case.calls):
                inputs = reference.random_inputs(rng, dt, case.op, n, in_units * count)
                pending.append((inputs, launch_numpy(comm, inputs, count, case.op)))
                calls += 1
                if case.probe:                 # a host-side race on purpose: ThreadSanitizer must see it
                    time.sleep(0.02)
                    for g in pending[-1][1]:
                        g.tobytes()
            comm.synchronize()
            for inputs, got in pending:
                want = run_collective(plan, [x.copy() for x in inputs], case.op, count=count)
                spec = reference.expected_outputs(plan.collective, inputs, op=case.op, root=plan.root)
                for r in range(n):
                    if spec[r] is None:
                        continue
                    checked += 1
                    a, b = got[r].view(np.uint8), want[r].view(np.uint8)
                    if a.shape != b.shape or a.tobytes() != b.tobytes():
                        wrong += 1
                        if first is None:
                            bad = np.flatnonzero(got[r].view(np.uint16 if got[r].itemsize == 2 else np.uint32)
                                                 != want[r].view(np.uint16 if want[r].itemsize == 2 else np.uint32))
                            first = (f"count {count} rank {r}: {bad.size} of {got[r].size} elements differ, "
                                     f"first at {int(bad[0]) if bad.size else '?'}")
        result = {"result": "wrong" if wrong else "ok", "checked": checked, "wrong": wrong, "calls": calls}
        if first:
            result["detail"] = first
        return result
    except DeviceTimeoutError as exc:
        return {"result": "timeout", "checked": checked, "calls": calls, "detail": str(exc).splitlines()[0][:300]}
    except Exception as exc:                       # reported, never hidden: the control must have none
        return {"result": "error", "checked": checked, "calls": calls,
                "detail": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    finally:
        if comm is not None:
            try:
                comm.close()
            except Exception:
                pass


# -- the worker processes ----------------------------------------------------------------------
def build_main(spec_path: str) -> int:
    """Build every kernel the cases need (plain and/or sanitized), in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    import hashlib

    from msc.cuda.compiler import compile_host, rendered
    from msc.cuda.runtime import runtime_plan
    from msc.cuda.validate import check_op

    spec = json.loads(Path(spec_path).read_text())
    jobs = []
    seen = set()
    sources = {}
    for d in spec["cases"]:
        case = Case.from_json(d)
        plan = runtime_plan(make_plan(case))
        r = rendered(plan, dtype=case.dtype, op=check_op(plan, case.op, case.dtype), form=case.form)
        sources[case.name] = hashlib.sha256(r.source.encode()).hexdigest()
        for sanitize in spec["sanitize"]:
            key = (case.alg, case.ranks, case.params, case.protocol, case.inplace, case.form, case.dtype,
                   check_op(plan, case.op, case.dtype), sanitize)
            if key not in seen:
                seen.add(key)
                jobs.append((plan, case, check_op(plan, case.op, case.dtype), sanitize or None))

    def one(job):
        plan, case, op, sanitize = job
        t = time.perf_counter()
        compiled = compile_host(plan, dtype=case.dtype, op=op, form=case.form, sanitize=sanitize)
        return compiled.cache_hit, time.perf_counter() - t

    if jobs:                                      # the first builds the precompiled headers alone
        one(jobs[0])
    with ThreadPoolExecutor(max(1, spec.get("jobs", 2))) as pool:
        done = list(pool.map(one, jobs[1:]))
    print(json.dumps({"kernels": len(jobs), "built": sum(1 for hit, _ in done if not hit), "sources": sources}))
    return 0


def serve_main(spec_path: str, results_path: str) -> int:
    """Run each run of the spec in a fork of this process; one JSON line per run
    to ``results_path``, "@@RUN id" / "@@END id" around its stderr (where
    ThreadSanitizer writes)."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ.pop("LD_PRELOAD", None)           # libtsan stays loaded here; compilers we start need not
    import numpy  # noqa: F401  (imported before forking, once)
    import msc.cuda  # noqa: F401
    import msc.executor  # noqa: F401

    plans = {}
    runs = []
    for run in spec["runs"]:
        case = Case.from_json(run["case"])
        key = (case.alg, case.ranks, case.params, case.protocol, case.tile, case.inplace)
        if key not in plans:
            plans[key] = make_plan(case)
        runs.append((run, case, plans[key]))
    # Warm up before forking: the imports, renders and library loads a communicator needs (a
    # constructor starts no thread: streams start at the first call), so that a run pays for none.
    from msc.cuda import Communicator

    warmed = set()
    for run, case, plan in runs:
        key = (id(plan), case.placement, case.form, case.dtype, case.op)
        if key not in warmed:
            warmed.add(key)
            Communicator(plan, case.placement, device="emu", form=case.form, dtypes=(case.dtype,), ops=(case.op,),
                         timeout_s=spec["timeout_s"]).close()
    import msc.verification.reference  # noqa: F401
    import msc.dsl.collectives  # noqa: F401
    if len(os.listdir("/proc/self/task")) != 1:
        print(f"emu_faults: the server has {len(os.listdir('/proc/self/task'))} threads before forking",
              file=sys.stderr)
    timeout_s, hang_s = spec["timeout_s"], spec["hang_s"]
    with open(results_path, "a") as out:
        for run, case, plan in runs:
            os.write(2, f"\n@@RUN {run['id']}\n".encode())
            r, w = os.pipe()
            t0 = time.perf_counter()
            pid = os.fork()
            if pid == 0:                         # the run
                os.close(r)
                code = 0
                try:
                    os.environ["MSC_EMU_THREADS"] = str(run["threads"])
                    res = run_case(case, plan, timeout_s, run["seed"])
                    os.write(w, json.dumps(res).encode())
                except BaseException as exc:     # noqa: BLE001
                    os.write(w, json.dumps({"result": "error", "detail": repr(exc)[:300]}).encode())
                    code = 1
                os.close(w)
                os._exit(code)
            os.close(w)
            data, deadline = b"", time.monotonic() + hang_s
            hung = False
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    hung = True
                    os.kill(pid, signal.SIGKILL)
                    break
                ready, _, _ = select.select([r], [], [], left)
                if ready:
                    chunk = os.read(r, 65536)
                    if not chunk:
                        break
                    data += chunk
            os.close(r)
            _, status = os.waitpid(pid, 0)
            res = {}
            if data:
                try:
                    res = json.loads(data)
                except ValueError:
                    res = {}
            if hung:
                res = {"result": "hang", "detail": f"no result after {hang_s:.0f} s (killed)"}
            elif os.WIFSIGNALED(status):
                res = {"result": "crash", "detail": f"signal {signal.Signals(os.WTERMSIG(status)).name}"}
            elif not res:
                res = {"result": "crash", "detail": f"exit status {os.waitstatus_to_exitcode(status)}, no result"}
            res.update(id=run["id"], exit=os.waitstatus_to_exitcode(status), seconds=round(time.perf_counter() - t0, 2))
            os.write(2, f"\n@@END {run['id']}\n".encode())
            out.write(json.dumps(res) + "\n")
            out.flush()
    return 0


# -- ThreadSanitizer's reports ------------------------------------------------------------------
FRAME = re.compile(r"^\s+#(\d+) (.*?) (\S+:\d+(?::\d+)?|<null>) \((\S+?)\+0x[0-9a-f]+\)\s*$")
FRAME_LOOSE = re.compile(r"^\s+#(\d+) (.*) \((\S+?)\+0x[0-9a-f]+\)\s*$")
ACCESS = re.compile(r"^\s+(?:(Previous) )?(atomic )?(read|write|Read|Write|Atomic read|Atomic write)\b.* by "
                    r"(thread T\d+|main thread)", re.I)


def short_function(text: str) -> str:
    """'combine(MscArgs const*, int, ...)' -> 'combine'; keeps template and lambda names readable."""
    text = text.strip()
    depth, out = 0, []
    for ch in text:
        if ch == "(" and depth == 0 and out:
            break
        depth += ch == "<"
        depth -= ch == ">"
        out.append(ch)
    name = "".join(out).strip()
    return name.removeprefix("msc_host::") or text


def parse_reports(text: str) -> list[dict]:
    """ThreadSanitizer's reports in ``text``: kind, the accesses' top frames in
    the kernel (function, source line), whether every access's stack reaches
    kernel code (False: one side is uninstrumented code, e.g. numpy or Python
    calling memcpy), the SUMMARY line."""
    reports, cur = [], None
    for line in text.splitlines():
        if line.startswith("WARNING: ThreadSanitizer:"):
            cur = {"kind": re.sub(r"\s*\(pid=\d+\)\s*$", "", line.split("ThreadSanitizer:", 1)[1]).strip(),
                   "stacks": [], "summary": "", "lines": [line]}
            reports.append(cur)
            continue
        if cur is None:
            continue
        cur["lines"].append(line)
        if line.startswith("SUMMARY: ThreadSanitizer:"):
            cur["summary"] = line.split("SUMMARY: ThreadSanitizer:", 1)[1].strip()
            cur = None
            continue
        if ACCESS.match(line) or re.match(r"^\s+(Mutex|Thread|Location)\b", line):
            cur["stacks"].append({"head": line.strip(), "frames": []})
            continue
        m = FRAME.match(line) or FRAME_LOOSE.match(line)
        if m and cur["stacks"]:
            if FRAME.match(line):
                _, func, where, module = m.groups()
            else:
                _, func, module = m.groups()
                where = ""
            cur["stacks"][-1]["frames"].append({"func": short_function(func), "where": where, "module": module})
    for rep in reports:
        accesses = [s for s in rep["stacks"] if ACCESS.match("  " + s["head"])]
        rep["accesses"] = []
        for s in accesses:
            kernel = [f for f in s["frames"] if is_kernel_module(f["module"])]
            # the first frame in the rendered kernel text (not a libstdc++ header inlined into it)
            ours = [f for f in kernel if re.search(r"kernel\.cpp:\d+", f["where"])] or kernel or s["frames"]
            top = ours[0] if ours else {"func": "?", "where": "", "module": "?"}
            rep["accesses"].append({"head": s["head"], "func": top["func"], "where": top["where"],
                                    "module": top["module"], "in_kernel": bool(kernel)})
        rep["kernel_only"] = bool(rep["accesses"]) and all(a["in_kernel"] for a in rep["accesses"])
        rep["functions"] = sorted({a["func"] for a in rep["accesses"]}) or [rep["summary"].rsplit(" in ", 1)[-1]]
        rep["source"] = [source_line(a["where"]) for a in rep["accesses"]]
        del rep["lines"]
    return reports


def is_kernel_module(module: str) -> bool:
    """A frame in the kernel library: msc.cuda.emu loads it from a memory file,
    /proc/self/fd/N, which TSan names by its last part (N); or from a file kernel.so."""
    return module.isdigit() or module.endswith("kernel.so") or module.startswith("msc-kernel-")


def source_line(where: str) -> str:
    """The text of kernel.cpp:LINE (the cache keeps the built source), shortened."""
    m = re.match(r"(.*):(\d+)(?::\d+)?$", where)
    if not m:
        return ""
    try:
        lines = Path(m.group(1)).read_text().splitlines()
        return f"{Path(m.group(1)).name}:{m.group(2)}: {lines[int(m.group(2)) - 1].strip()[:110]}"
    except (OSError, IndexError):
        return f"{Path(m.group(1)).name}:{m.group(2)}"


def split_runs(stderr: str) -> tuple[dict, str]:
    """{run id: its stderr} and what came outside any run."""
    runs, outside, cur, buf = {}, [], None, []
    for line in stderr.splitlines():
        if line.startswith("@@RUN "):
            if cur is None:
                outside.extend(buf)
            buf, cur = [], line[6:].strip()
        elif line.startswith("@@END ") and cur is not None:
            runs[cur] = "\n".join(buf)
            buf, cur = [], None
        else:
            buf.append(line)
    if cur is not None:
        runs[cur] = "\n".join(buf)
    else:
        outside.extend(buf)
    return runs, "\n".join(outside)


# -- the orchestrator: batches of runs in server processes ---------------------------------------
@dataclass
class Batch:
    label: str
    templates: Path                 # the templates folder the kernels render from
    sanitize: bool
    runs: list                      # [{"id", "case", "threads", "seed"}]
    results: dict = field(default_factory=dict)    # id -> result (with "tsan": [reports])
    outside: list = field(default_factory=list)    # reports outside any run
    seconds: float = 0.0


def worker_env(base: dict, templates: Path, sanitize: bool) -> dict:
    env = dict(base)
    env["OPENBLAS_NUM_THREADS"] = "1"                # no BLAS threads: the server forks
    env.pop("MSC_EMU_SANITIZE", None)
    env.pop("LD_PRELOAD", None)
    env.pop("MSC_TEMPLATES_DIR", None)
    env["MSC_TEMPLATES_DIR"] = str(templates)
    if sanitize:
        env["MSC_EMU_SANITIZE"] = "thread"
        env["LD_PRELOAD"] = libtsan()
        env["TSAN_OPTIONS"] = TSAN_OPTIONS
    return env


def libtsan() -> str:
    cxx = os.environ.get("MSC_CXX") or os.environ.get("CXX") or "g++"
    path = subprocess.run([cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not path or not Path(path).is_file():
        raise SystemExit(f"emu_faults: {cxx} has no libtsan.so (-print-file-name gave {path!r})")
    return path


def build_kernels(cases: list, templates: Path, work: Path, env: dict, jobs: int, sanitize: list) -> dict:
    spec = work / f"build-{len(list(work.iterdir()))}.json"
    spec.write_text(json.dumps({"cases": [c.to_json() for c in cases], "sanitize": sanitize, "jobs": jobs}))
    e = worker_env(env, templates, False)
    done = subprocess.run([sys.executable, __file__, "--build", str(spec)], env=e, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"emu_faults: building kernels for {templates} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_batches(batches: list, work: Path, env: dict, jobs: int, timeout_s: float, hang_s: float,
                progress: str = "") -> None:
    """Run the batches, ``jobs`` server processes at a time, and parse what they report."""
    pending = list(enumerate(batches))
    running = {}
    done_count = 0
    while pending or running:
        while pending and len(running) < jobs:
            i, b = pending.pop(0)
            spec, res, err = work / f"serve-{i}.json", work / f"serve-{i}.jsonl", work / f"serve-{i}.err"
            spec.write_text(json.dumps({"runs": b.runs, "timeout_s": timeout_s, "hang_s": hang_s}))
            res.write_text("")
            fh = open(err, "w")
            p = subprocess.Popen([sys.executable, __file__, "--serve", str(spec), "--results", str(res)],
                                 env=worker_env(env, b.templates, b.sanitize), stdout=subprocess.DEVNULL, stderr=fh)
            running[i] = (p, fh, time.perf_counter(), b, res, err)
        time.sleep(0.2)
        for i in list(running):
            p, fh, t0, b, res, err = running[i]
            if p.poll() is None:
                continue
            fh.close()
            del running[i]
            b.seconds = time.perf_counter() - t0
            stderr = err.read_text(errors="replace")
            per_run, outside = split_runs(stderr)
            for line in res.read_text().splitlines():
                r = json.loads(line)
                r["tsan"] = parse_reports(per_run.get(r["id"], ""))
                b.results[r["id"]] = r
            for run in b.runs:                      # a server that died mid-batch
                if run["id"] not in b.results:
                    b.results[run["id"]] = {"id": run["id"], "result": "harness",
                                            "detail": f"server exited {p.returncode} before this run",
                                            "tsan": parse_reports(per_run.get(run["id"], ""))}
            b.outside = parse_reports(outside)
            if p.returncode != 0 and "Traceback" in outside:
                print(f"  [{b.label}] server failed:\n{outside[-2000:]}", file=sys.stderr)
            done_count += 1
            if progress:
                caught = sum(1 for r in b.results.values() if caught_by(r))
                print(f"  {progress} {done_count}/{len(batches)} {b.label}: {len(b.runs)} runs, "
                      f"{caught} flagged, {b.seconds:.0f} s", flush=True)


def caught_by(r: dict) -> list:
    """How a run caught its fault: wrong results, a timeout, a crash or hang, ThreadSanitizer. A
    Python exception in the harness ("error") or a server that died ("harness") is not a catch:
    those are listed apart, and the control must have none."""
    how = []
    if r["result"] in ("wrong", "timeout", "crash", "hang"):
        how.append(r["result"])
    if r.get("tsan"):
        how.append("tsan")
    return how


# -- the sweep -------------------------------------------------------------------------------------
MAIN_RANKS = 4
EXTRA = {   # a few algorithms at 3 and 8 ranks
    3: ["allreduce/ring:ring", "allreduce/allpairs:allpairs", "allreduce/tree:binomial", "allgather/ring:ring",
        "reducescatter/ring:ring", "broadcast/chain:chain", "alltoall/allpairs:allpairs"],
    8: ["allreduce/ring:ring", "allreduce/hierarchical:hierarchical", "allreduce/torus2d:torus2d",
        "allreduce/halving_doubling:halving_doubling", "allgather/recursive_doubling:recursive_doubling",
        "alltoall/hierarchical:hierarchical", "reduce/tree:tree"],
}
SMALL_TILE = 1024       # bytes: the several-tiles case streams 3.5 tiles per chunk through slots of this size


def case_counts(alg, ranks, params, dtype, protocol) -> list:
    """[(tile, counts)]: the default tile with counts 1, 1001, 1001 on one
    communicator (the second call grows the arenas, the third reuses them with
    the counters the second left); a small tile with 3.5 tiles per chunk."""
    return [(0, (1, 1001, 1001)),
            (SMALL_TILE, (tiles_count(alg, ranks, params, dtype, protocol, SMALL_TILE, 3.5),))]


def sweep_cases(quick: bool) -> list:
    lib = library()
    cases = []

    def add(alg, n, protocol, form, dtype, op="sum", params=(), inplace=None, placement="virtual", calls=1):
        a = lib[alg]
        if not a.supports(n, **dict(params)):
            return
        for tile, counts in case_counts(alg, n, params, dtype, protocol):
            cases.append(Case(alg, n, protocol, form, dtype, op, counts, tile, params, placement, calls, inplace))

    if quick:
        for alg in ("allreduce/ring:ring", "allreduce/allpairs:allpairs", "alltoall/allpairs:allpairs",
                    "broadcast/chain:chain", "reduce/tree:tree"):
            for protocol in ("Simple", "LL"):
                add(alg, 4, protocol, "table", "float32")
        add("allreduce/hierarchical:hierarchical", 4, "LL", "straight", "bfloat16", params=(("gpus_per_node", 2),))
        add("allreduce/ring:ring", 4, "LL", "table", "float32", placement="devices", calls=3)
        return cases
    from msc.dsl.collectives import REDUCING

    for alg in lib:
        for protocol in ("Simple", "LL"):
            for form in ("straight", "table"):
                for dtype in ("float32", "bfloat16"):
                    add(alg, MAIN_RANKS, protocol, form, dtype)
            if alg.split("/")[0] in REDUCING:       # msc.dsl.collectives' registry
                add(alg, MAIN_RANKS, protocol, "table", "float32", "max")
    for alg in ("allreduce/hierarchical:hierarchical", "alltoall/hierarchical:hierarchical"):
        for protocol in ("Simple", "LL"):
            for dtype in ("float32", "bfloat16"):
                add(alg, 4, protocol, "table", dtype, params=(("gpus_per_node", 2),))
    for alg in ("allreduce/ring:ring", "allgather/ring:ring", "alltoall/allpairs:allpairs", "broadcast/chain:chain"):
        for protocol in ("Simple", "LL"):
            add(alg, 4, protocol, "table", "float32", inplace=False)
    # back-to-back calls without synchronize; the devices placement (a launch and a stream per
    # rank: one rank's next call may start while its peers still run the last)
    for alg in ("allreduce/ring:ring", "allreduce/allpairs:allpairs", "alltoall/allpairs:allpairs",
                "broadcast/chain:chain", "reducescatter/ring:ring"):
        for protocol in ("Simple", "LL"):
            add(alg, 4, protocol, "table", "float32", calls=3)
            add(alg, 4, protocol, "table", "bfloat16", placement="devices", calls=3)
    for n, algs in EXTRA.items():
        for alg in algs:
            for protocol in ("Simple", "LL"):
                add(alg, n, protocol, "table", "float32")
            add(alg, n, "LL", "straight", "bfloat16")
    # several default-size tiles (512 KiB Simple, 32 KiB LL per chunk), once each
    for protocol in ("Simple", "LL"):
        alg = "allreduce/ring:ring"
        cases.append(Case(alg, 4, protocol, "table", "float32", "sum",
                          (tiles_count(alg, 4, (), "float32", protocol, 0, 2.5),)))
    return cases


def probe_cases() -> list:
    """Calibration, not counted in the sweep: Python reads the outputs (numpy's
    tobytes, a memcpy) 20 ms into a long launch, without synchronizing. That is
    a race between uninstrumented code and the kernel: ThreadSanitizer must
    report it, or the sweep's zero could be blindness to host-side accesses."""
    alg = "allreduce/ring:ring"
    return [Case(alg, 4, p, "table", "float32", "sum", (tiles_count(alg, 4, (), "float32", p, 256, 150),), 256,
                 probe=True) for p in ("Simple", "LL")]


def run_sweep(args, work: Path, env: dict) -> dict:
    cases = sweep_cases(args.quick)
    t0 = time.perf_counter()
    print(f"sweep: {len(cases)} cases; building kernels (-fsanitize=thread)...", flush=True)
    built = build_kernels(cases, args.base, work, env, args.jobs, ["thread"])
    t_build = time.perf_counter() - t0
    print(f"  {built['kernels']} kernels ({built['built']} built) in {t_build:.0f} s", flush=True)
    cases += probe_cases()
    # 4 threads a block; the several-tiles cases 3 (a count that divides nothing)
    runs = [{"id": f"s{i}", "case": c.to_json(), "threads": 3 if c.tile == SMALL_TILE else 4, "seed": 1000 + i}
            for i, c in enumerate(cases)]
    per = -(-len(runs) // max(1, args.jobs * 3))
    batches = [Batch(f"sweep[{k // per}]", args.base, True, runs[k:k + per]) for k in range(0, len(runs), per)]
    run_batches(batches, work, env, args.jobs, args.sweep_timeout, args.sweep_timeout * 6 + 120, "sweep")
    results = {}
    for b in batches:
        results.update(b.results)
    outside = [r for b in batches for r in b.outside]
    return {"cases": cases, "runs": runs, "results": results, "outside": outside,
            "build_s": t_build, "seconds": time.perf_counter() - t0}


# -- the faults -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    name: str
    letter: str
    file: str                 # the template edited
    edits: tuple              # ((old, new), ...): each old must occur exactly once
    what: str
    expect: str               # how we expect it to be caught (the summary shows what happened)
    cases: tuple              # case makers: fn(quick) -> Case
    control: bool = False     # a harmless edit on the host: it should NOT be caught

    def apply(self, folder: Path) -> None:
        path = folder / self.file
        text = path.read_text()
        for old, new in self.edits:
            n = text.count(old)
            if n != 1:
                raise SystemExit(f"emu_faults: fault {self.name!r} no longer applies: {old!r} occurs {n} times in "
                                 f"templates/{self.file} (update the fault with the template)")
            text = text.replace(old, new)
        path.write_text(text)


def _case(alg, protocol, *, tile, tiles, dtype="float32", ranks=4, params=(), counts=1, calls=1,
          placement="virtual", form="table"):
    c = tiles_count(alg, ranks, params, dtype, protocol, tile, tiles)
    return Case(alg, ranks, protocol, form, dtype, "sum", (c,) * counts, tile, params, placement, calls)


# What the faults run on. Slot reuse needs more than the runtime's 8 slots of messages in flight on a
# connection: a sender that never receives (the broadcast chain's root, alltoall's senders) streaming
# many small tiles. Dependencies: allpairs allreduce, hierarchical, alltoall (local copies).
def RING(protocol, **kw):
    return _case("allreduce/ring:ring", protocol, tile=256, tiles=6.5, **kw)


def CHAIN(protocol, **kw):
    return _case("broadcast/chain:chain", protocol, tile=64, tiles=40, **kw)


def A2A(protocol, **kw):
    return _case("alltoall/allpairs:allpairs", protocol, tile=64, tiles=40, **kw)


def PAIRS(protocol, **kw):
    return _case("allreduce/allpairs:allpairs", protocol, tile=256, tiles=4.5, **kw)


def HIER(protocol, **kw):
    return _case("allreduce/hierarchical:hierarchical", protocol, tile=256, tiles=4.5, ranks=4,
                 params=(("gpus_per_node", 2),), **kw)


SIMPLE_T = "transport_simple.cuh.j2"
LL_T = "transport_ll.cuh.j2"
FAULTS = [
    Fault("simple-no-post-barrier", "a", SIMPLE_T,
          (("  __syncthreads();                 // every thread's reads and writes of this message are done\n",
            "  // FAULT: no barrier before posting head/tail\n"),),
          "Simple: no __syncthreads() before thread 0 posts head (slot read) and tail (slot written)",
          "tsan, wrong (needs >= 2 threads)",
          (lambda q: RING("Simple"), lambda q: CHAIN("Simple"))),
    Fault("simple-no-free-slot-wait", "b", SIMPLE_T,
          (("if (ok && send && b.seq_out + 1 > plan_slots(a))", "if (false && ok && send && b.seq_out + 1 > plan_slots(a))"),),
          "Simple: the sender fills slot seq % slots without waiting on head (the slot may be unread)",
          "tsan, wrong (needs > 8 messages in flight)",
          (lambda q: CHAIN("Simple"), lambda q: A2A("Simple"))),
    Fault("ll-no-free-slot-wait", "b", LL_T,
          (("if (send && b.seq_out + 1 > plan_slots(a)) {", "if (false && send && b.seq_out + 1 > plan_slots(a)) {"),),
          "LL: the sender overwrites packets without waiting on head",
          "timeout or wrong (packets are atomic: no tsan race on them)",
          (lambda q: CHAIN("LL"), lambda q: A2A("LL"))),
    Fault("ll-constant-out-flag", "c", LL_T,
          (("out_flag = (u32)(b.seq_out + 1);", "out_flag = 1u;"),),
          "LL: the sender's flag is always 1 (the receiver still waits for seq + 1)",
          "timeout",
          (lambda q: RING("LL"),)),
    Fault("ll-constant-flags", "c", LL_T,
          (("const u32 in_flag = (u32)(b.seq_in + 1), out_flag = (u32)(b.seq_out + 1);",
            "const u32 in_flag = 1u, out_flag = 1u;"),),
          "LL: both flags always 1: a reader takes a stale packet (previous message, previous call) as new",
          "wrong",
          (lambda q: CHAIN("LL", counts=2), lambda q: RING("LL", counts=2))),
    Fault("ll-head-before-barrier", "d", LL_T,
          (("    if (__syncthreads_or(!ok)) return false;       // every thread has read its packets\n"
            "    if (threadIdx.x == 0) st_release(conn_of(a, b.conn_in).head, b.seq_in + 1, b.local);\n",
            "    if (threadIdx.x == 0 && ok) st_release(conn_of(a, b.conn_in).head, b.seq_in + 1, b.local);  // FAULT\n"
            "    if (__syncthreads_or(!ok)) return false;\n"),),
          "LL: the receiver's thread 0 frees the slot (head) before the other threads have read their packets",
          "timeout (a slow thread sees the next message's flag), needs >= 2 threads and a sender at the slot limit",
          (lambda q: _case("broadcast/chain:chain", "LL", tile=64, tiles=200),
           lambda q: _case("alltoall/allpairs:allpairs", "LL", tile=1024, tiles=40))),
    Fault("no-dependency-wait", "e", "steps.cuh.j2",
          (("for (int d = 0; d < ndeps && ok; ++d) ok = wait_dep(",
            "for (int d = 0; d < 0 && ok; ++d) ok = wait_dep("),),
          "run_step skips wait_dep: a step runs before the steps of other threadblocks it depends on",
          "tsan, wrong",
          (lambda q: PAIRS("Simple"), lambda q: PAIRS("LL"), lambda q: HIER("Simple"))),
    Fault("no-publish-barrier", "f", "steps.cuh.j2",
          (("  if (publish) {       // another threadblock waits for this step\n    __syncthreads();\n",
            "  if (publish) {       // another threadblock waits for this step\n"),),
          "run_step publishes progress without a barrier: thread 0 may publish before the others finish",
          "tsan in LL (needs >= 2 threads); none in Simple, whose transfer() ends with a barrier anyway",
          (lambda q: PAIRS("LL"), lambda q: A2A("LL"), lambda q: PAIRS("Simple"))),
    Fault("relaxed-acquire", "g", "common.cuh.j2",
          (("load(std::memory_order_acquire); }\n__device__ __forceinline__ u64 ld_relaxed",
            "load(std::memory_order_relaxed); }  // FAULT: was acquire\n__device__ __forceinline__ u64 ld_relaxed"),),
          "host ld_acquire loads counters relaxed (no acquire): slot reads are not ordered after the wait",
          "tsan only (x86 orders loads in hardware: results stay right)",
          (lambda q: RING("Simple"), lambda q: PAIRS("Simple"))),
    Fault("simple-slot-off-by-one", "h", SIMPLE_T,
          (("(const elem_t*)conn_of(a, b.conn_in).slots + slot_of(b.seq_in, plan_slots(a))",
            "(const elem_t*)conn_of(a, b.conn_in).slots + slot_of(b.seq_in + 1, plan_slots(a))"),),
          "Simple: the receiver reads slot (seq + 1) % slots, the sender writes seq % slots",
          "wrong, tsan",
          (lambda q: RING("Simple"),)),
    Fault("ll-slot-off-by-one", "h", LL_T,
          (("(const u64*)conn_of(a, b.conn_in).slots + slot_of(b.seq_in, plan_slots(a))",
            "(const u64*)conn_of(a, b.conn_in).slots + slot_of(b.seq_in + 1, plan_slots(a))"),),
          "LL: the receiver polls slot (seq + 1) % slots",
          "timeout (the flag it waits for never comes there)",
          (lambda q: RING("LL"),)),
    Fault("dependency-off-by-one", "i", "steps.cuh.j2",
          (("u64 want = b.epoch + (u64)it * dnsteps + dstep + 1;",
            "u64 want = b.epoch + (u64)it * dnsteps + dstep;"),),
          "wait_dep waits for the step before the one depended on",
          "tsan, wrong",
          (lambda q: PAIRS("Simple"), lambda q: HIER("LL"))),
    Fault("no-epoch-bump", "j", "kernel.cu.j2",
          (("st_release(progress_of(b.a, b.rank, b.tb), b.epoch + (1ULL << 32), true);",
            "(void)0;  // FAULT: the epoch bump is not published"),),
          "a block's launch-end epoch bump is not published: the next launch finds its dependencies met",
          "tsan, wrong (from the second launch on one communicator)",
          (lambda q: PAIRS("Simple", counts=3), lambda q: PAIRS("LL", counts=3))),
    Fault("sequence-not-restored", "k", "kernel.cu.j2",
          (("b.seq_in = b.conn_in >= 0 ? ld_relaxed(conn_of(a, b.conn_in).head, b.local) : 0;", "b.seq_in = 0;"),),
          "a launch's receivers restart their message count at 0 instead of the persisted head",
          "timeout, from the second launch (Simple: head restarts at 1, so the sender never sees a free slot; "
          "LL: the flags differ)",
          (lambda q: RING("Simple", counts=2), lambda q: RING("LL", counts=2))),
    Fault("ll-tail-not-left", "l", LL_T,
          (("if (threadIdx.x == 0 && b.conn_out >= 0) st_relaxed(conn_of(b.a, b.conn_out).tail, b.seq_out, b.local);",
            "if (false) st_relaxed(conn_of(b.a, b.conn_out).tail, b.seq_out, b.local);"),),
          "LL: a block does not record its sent count at the end of a launch (the next launch restarts flags)",
          "timeout, from the second launch",
          (lambda q: RING("LL", counts=2),)),
    Fault("ll-torn-packet", "m", "common.cuh.j2",
          (("__device__ __forceinline__ u64 ld_relaxed(const u64* p, bool local) { return std::atomic_ref<u64>(*(u64*)p)"
            ".load(std::memory_order_relaxed); }",
            "__device__ __forceinline__ u64 ld_relaxed(const u64* p, bool local) {  // FAULT: two 32-bit loads\n"
            "  const volatile u32* q = (const volatile u32*)p; const u32 lo = q[0]; const u32 hi = q[1];\n"
            "  return ((u64)hi << 32) | lo; }"),),
          "host ld_relaxed as two plain 32-bit loads, data word first: an LL packet (data and flag) is no "
          "longer read single-copy atomic, so data and flag may come from different stores",
          "tsan (a plain read racing an atomic store); wrong results only when a read tears",
          (lambda q: RING("LL"), lambda q: CHAIN("LL"))),
    Fault("no-acquire-after-spin", "n", "common.cuh.j2",
          (("  (void)ld_acquire(p, local);\n  return true;", "  return true;  // FAULT: no acquire after the spin"),),
          "wait_counter spins with relaxed loads and returns without its one acquire: what the waiter reads next "
          "(a slot, a dependency's output) is not ordered after the writer's release",
          "tsan only (x86 orders loads in hardware: results stay right)",
          (lambda q: RING("Simple"), lambda q: PAIRS("Simple"))),
    Fault("vector-lanes-once", "o", "combine.cuh.j2",
          (("lane < WARP; lane += lanes)", "lane < WARP; lane += WARP)"),),
          "Simple's element loop: a block of fewer than 32 threads covers only lanes 0..threads-1 of each "
          "group of 4 x 32 vectors (the lanes it should take in turns are skipped)",
          "wrong (at every thread count below 32, the emulated device's)",
          (lambda q: _case("allreduce/ring:ring", "Simple", tile=8192, tiles=2.5),)),
    Fault("ll-line-unchecked-packets", "p", LL_T,
          (("        if ((u32)(packet[w] >> 32) != in_flag)\n          packet[w] = spin_packet(",
            "        if (w == 0 && (u32)(packet[w] >> 32) != in_flag)\n          packet[w] = spin_packet("),
           ("if ((u32)(packet[w] >> 32) != in_flag) return false;",
            "if (w == 0 && (u32)(packet[w] >> 32) != in_flag) return false;  // FAULT"),),
          "LL: a reader checks only the first of the 4 packets of a line it loaded at once: the other 3 may "
          "still hold the previous message",
          "wrong (packets are atomic: no tsan race on them)",
          (lambda q: RING("LL"), lambda q: CHAIN("LL"))),
    Fault("control-acquire-spin", "ctl", "common.cuh.j2",
          (("while ((i64)(ld_relaxed(p, local) - v) < 0) {", "while ((i64)(ld_acquire(p, local) - v) < 0) {"),),
          "CONTROL: wait_counter polls with acquire loads, as before issue 26 (on a GPU each poll invalidates the "
          "SM's L1; on the host it is only stronger ordering)",
          "nothing (a harmless edit on the host: the harness must not flag it)",
          (lambda q: RING("Simple"),), control=True),
]


def fault_matrix(args) -> tuple:
    threads = (2, 8) if args.quick else tuple(args.threads)
    reps = 1 if args.quick else args.reps
    return threads, reps


def run_faults(args, work: Path, env: dict) -> dict:
    faults = [f for f in FAULTS if not args.fault or f.name in args.fault or f.letter in args.fault]
    threads, reps = fault_matrix(args)
    t0 = time.perf_counter()
    plans = {}
    for f in faults:
        cs = [make_case(args.quick) for make_case in f.cases]
        if args.quick:
            cs = cs[:1]
        plans[f.name] = cs
    # patched copies of templates/, one per fault; every edit must apply
    folders = {}
    for f in faults:
        folder = work / f"templates-{f.name}"
        shutil.copytree(args.base, folder)
        f.apply(folder)
        folders[f.name] = folder
    print(f"faults: {len(faults)} faults x {threads} threads x {reps} reps x (plain, tsan); building...", flush=True)
    # the control: the real templates on every case the faults use
    control_cases = list(dict.fromkeys(c for cs in plans.values() for c in cs))
    base = build_kernels(control_cases, args.base, work, env, args.jobs, ["", "thread"])["sources"]
    for f in faults:
        mine = build_kernels(plans[f.name], folders[f.name], work, env, args.jobs, ["", "thread"])["sources"]
        same = [name for name, digest in mine.items() if base[name] == digest]
        if same:                                   # the edit must reach the kernel of every case it runs
            raise SystemExit(f"emu_faults: fault {f.name!r} leaves the kernel of {same[0]} unchanged (an edit in "
                             f"code that case does not render); update the fault")
    t_build = time.perf_counter() - t0
    print(f"  built in {t_build:.0f} s", flush=True)

    def runs_for(tag, cases, sanitize):
        out = []
        for ci, c in enumerate(cases):
            for t in threads:
                for rep in range(reps):
                    out.append({"id": f"{tag}|{ci}|{t}|{rep}|{'tsan' if sanitize else 'plain'}",
                                "case": c.to_json(), "threads": t, "seed": 7919 * rep + 31 * t + ci})
        return out

    batches = []
    for sanitize in (False, True):
        runs = runs_for("control", control_cases, sanitize)
        per = max(1, -(-len(runs) // 2))
        for k in range(0, len(runs), per):
            batches.append(Batch(f"control {'tsan' if sanitize else 'plain'}", args.base, sanitize,
                                 runs[k:k + per]))
    for f in faults:
        for sanitize in (False, True):
            batches.append(Batch(f"{f.name} {'tsan' if sanitize else 'plain'}", folders[f.name], sanitize,
                                 runs_for(f.name, plans[f.name], sanitize)))
    # the long batches first (hang-prone and tsan), so that the jobs end together
    batches.sort(key=lambda b: -len(b.runs) * (3 if b.sanitize else 1))
    run_batches(batches, work, env, args.jobs, args.timeout, args.timeout * 8 + 60, "faults")
    results = defaultdict(dict)
    for b in batches:
        tag = b.label.split(" ")[0]
        results[tag].update(b.results)
    return {"faults": faults, "plans": plans, "control_cases": control_cases, "results": results,
            "threads": threads, "reps": reps, "build_s": t_build, "seconds": time.perf_counter() - t0,
            "outside": [r for b in batches for r in b.outside]}


# -- the summary -------------------------------------------------------------------------------------
def describe_report(rep: dict) -> str:
    acc = "; ".join(f"{a['func']} ({a['where'].rsplit('/', 1)[-1] or a['module']})" for a in rep["accesses"])
    return f"{rep['kind']}: {acc or rep['summary']}"


def sweep_summary(s: dict) -> list:
    lines = []
    cases = {f"s{i}": c for i, c in enumerate(s["cases"])}
    probes = {rid: r for rid, r in s["results"].items() if cases[rid].probe}
    res = {rid: r for rid, r in s["results"].items() if not cases[rid].probe}
    swept = [cases[rid] for rid in res]
    by = Counter(r["result"] for r in res.values())
    warn = sum(len(r["tsan"]) for r in res.values())
    host_side = sum(1 for r in res.values() for rep in r["tsan"] if not rep["kernel_only"])
    warned_cases = sum(1 for r in res.values() if r["tsan"])
    calls = sum(r.get("calls", 0) for r in res.values())
    checked = sum(r.get("checked", 0) for r in res.values())
    lines.append(f"cases {len(res)} ({calls} calls, {checked} rank outputs compared bit for bit with the executor)")
    lines.append(f"wrong {by.get('wrong', 0)}, timeouts {by.get('timeout', 0)}, crashes {by.get('crash', 0)}, "
                 f"hangs {by.get('hang', 0)}, harness errors {by.get('error', 0) + by.get('harness', 0)}")
    lines.append(f"ThreadSanitizer warnings {warn} in {warned_cases} cases ({host_side} with one side outside "
                 f"kernel code); {len(s['outside'])} outside any run")
    algs = sorted({c.alg for c in swept})
    lines.append(f"algorithms {len(algs)}; kernels built in {s['build_s']:.0f} s; sweep {s['seconds']:.0f} s")

    def tally(key):
        return ", ".join(f"{k} {v}" for k, v in sorted(Counter(map(key, swept)).items(), key=str))

    lines.append(f"  by ranks: {tally(lambda c: c.ranks)}; protocol: {tally(lambda c: c.protocol)}; "
                 f"form: {tally(lambda c: c.form)}")
    lines.append(f"  dtype: {tally(lambda c: c.dtype)}; op: {tally(lambda c: c.op)}; placement: "
                 f"{tally(lambda c: c.placement)}; calls before synchronize: {tally(lambda c: c.calls)}; "
                 f"out of place: {sum(1 for c in swept if c.inplace is False)}")
    lines.append(f"  counts: 1, 1001, 1001 on one communicator (default tile, 4 threads a block), and "
                 f"3.5 tiles per chunk with a {SMALL_TILE}-byte tile (3 threads a block)"
                 + ("" if len(swept) < 100 else "; 2 cases with 2.5 default-size tiles (512 KiB Simple, 32 KiB LL)"))
    for rid, r in probes.items():
        side = sum(1 for rep in r["tsan"] if not rep["kernel_only"])
        funcs = sorted({a["func"] for rep in r["tsan"] for a in rep["accesses"]})
        lines.append(f"  calibration probe ({cases[rid].protocol}): Python reads outputs during the launch: "
                     f"{len(r['tsan'])} tsan reports, {side} with one side outside kernel code "
                     f"({', '.join(funcs[:6]) or '-'}); result {r['result']}")
    by_case = Counter()
    for (rid, r) in res.items():
        for rep in r["tsan"]:
            by_case[describe_report(rep)] += 1
    for text, k in by_case.most_common(20):
        lines.append(f"  tsan x{k}: {text}")
    for rid, r in res.items():
        if r["result"] != "ok" or r["tsan"]:
            lines.append(f"  {r['result']}{' + tsan' if r['tsan'] else ''}: {cases[rid].name}: {r.get('detail', '')}")
    return lines


def fault_summary(fr: dict) -> tuple:
    lines, table = [], []
    threads, reps = fr["threads"], fr["reps"]
    ctl = fr["results"].get("control", {})
    ctl_flagged = {rid: r for rid, r in ctl.items() if caught_by(r)}
    lines.append(f"control (unchanged templates, every case below, threads {','.join(map(str, threads))}, "
                 f"{reps} reps, plain and tsan): {len(ctl)} runs, {len(ctl_flagged)} flagged")
    broken = [(tag, rid, r) for tag, rs in fr["results"].items() for rid, r in rs.items()
              if r["result"] in ("error", "harness")]
    lines.append(f"harness errors (not counted as catches): {len(broken)}")
    for tag, rid, r in broken[:10]:
        lines.append(f"  {rid}: {r['result']}: {r.get('detail', '')}")
    for rid, r in list(ctl_flagged.items())[:20]:
        lines.append(f"  control flagged {rid}: {caught_by(r)} {r.get('detail', '')} "
                     f"{'; '.join(describe_report(x) for x in r['tsan'][:2])}")
    for f in fr["faults"]:
        res = fr["results"].get(f.name, {})
        cases = fr["plans"][f.name]
        n = len(res)
        caught = [r for r in res.values() if caught_by(r)]
        how = Counter(h for r in res.values() for h in caught_by(r))
        plain = [r for rid, r in res.items() if rid.endswith("|plain")]
        tsan = [r for rid, r in res.items() if rid.endswith("|tsan")]
        pc = sum(1 for r in plain if caught_by(r))
        tc = sum(1 for r in tsan if caught_by(r))
        verdict = ("NOT CAUGHT" if not caught else "caught") if not f.control else \
            ("not flagged (as expected)" if not caught else "FLAGGED (control!)")
        hows = ", ".join(f"{k} {v}" for k, v in how.most_common())
        table.append((f"{f.letter}", f.name, f"{len(caught)}/{n}", f"{pc}/{len(plain)}", f"{tc}/{len(tsan)}",
                      hows or "-", verdict))
        lines.append("")
        lines.append(f"({f.letter}) {f.name} [templates/{f.file}]: {f.what}")
        lines.append(f"    expected: {f.expect}")
        lines.append(f"    {verdict}: {len(caught)}/{n} runs (plain {pc}/{len(plain)}, tsan {tc}/{len(tsan)}); "
                     f"by {hows or 'nothing'}")
        for ci, c in enumerate(cases):
            cells = []
            for t in threads:
                for mode in ("plain", "tsan"):
                    rs = [r for rid, r in res.items() if rid.split("|")[1] == str(ci) and rid.split("|")[2] == str(t)
                          and rid.endswith("|" + mode)]
                    k = sum(1 for r in rs if caught_by(r))
                    kinds = Counter(h for r in rs for h in caught_by(r))
                    cells.append(f"t{t} {mode} {k}/{len(rs)}" + (f" ({','.join(sorted(kinds))})" if kinds else ""))
            lines.append(f"    case {c.name}")
            lines.append("      " + "; ".join(cells))
        funcs = Counter(describe_report(rep) for r in res.values() for rep in r["tsan"])
        for text, k in funcs.most_common(4):
            lines.append(f"      tsan x{k}: {text}")
        srcs = Counter(s for r in res.values() for rep in r["tsan"] for s in rep["source"] if s)
        for text, k in srcs.most_common(3):
            lines.append(f"      at x{k}: {text}")
        details = Counter(r.get("detail", "") for r in res.values() if r["result"] not in ("ok",) and r.get("detail"))
        for text, k in details.most_common(2):
            lines.append(f"      {k}x: {text[:200]}")
    return lines, table


def format_table(rows, header) -> list:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def environment_lines(argv) -> list:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "msc", "templates"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    cxx = os.environ.get("MSC_CXX") or os.environ.get("CXX") or "g++"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    import platform

    return [f"commit {commit.stdout.strip()}{' (msc/ or templates/ modified in the work tree)' if dirty else ''}",
            f"compiler {version[0] if version else cxx}; libtsan {libtsan()}",
            f"python {platform.python_version()}; {os.cpu_count()} CPUs; {platform.platform()}",
            "command: python " + " ".join(shlex.quote(a) for a in ["bench/emu_faults.py", *argv])]


def templates_line(folder: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for path in sorted(folder.glob("*.j2")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    changed = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", "templates"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    return (f"templates: snapshot sha256 {h.hexdigest()[:16]}; "
            + ("the same as HEAD" if not changed else f"differs from HEAD in {', '.join(changed)}"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a sample: a few minutes")
    ap.add_argument("--faults-only", action="store_true")
    ap.add_argument("--tsan-only", action="store_true", help="the ThreadSanitizer sweep alone")
    ap.add_argument("--fault", action="append", help="only this fault (name or letter; repeatable)")
    ap.add_argument("--list-faults", action="store_true")
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=list(THREADS),
                    help="MSC_EMU_THREADS values for the faults (default 1,2,4,8)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per fault, case and thread count")
    ap.add_argument("--timeout", type=float, default=5.0, help="timeout_s of the fault runs")
    ap.add_argument("--sweep-timeout", type=float, default=60.0, help="timeout_s of the sweep runs")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                    help="server processes (and compilers) at a time")
    ap.add_argument("--out", help="result file (default bench/results/emu-faults-<date>.txt; '-': none)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (servers' stderr, patched templates)")
    ap.add_argument("--build", help=argparse.SUPPRESS)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.build:
        return build_main(args.build)
    if args.serve:
        return serve_main(args.serve, args.results)
    if args.list_faults:
        for f in FAULTS:
            print(f"({f.letter}) {f.name}: {f.what}\n      expected: {f.expect}")
        return 0

    env = dict(os.environ)
    env.setdefault("MSC_CACHE_DIR", str(DEFAULT_CACHE))
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="emu-faults-"))
    # one snapshot of templates/ for the whole run (the sweep, the control and every fault's copy)
    args.base = work / "templates-base"
    shutil.copytree(TEMPLATES, args.base)
    out_lines = ["emu_faults: the emulated CUDA device against synchronization bugs",
                 f"date {datetime.date.today().isoformat()}", *environment_lines(argv), templates_line(args.base),
                 f"MSC_CACHE_DIR {env['MSC_CACHE_DIR']}; TSAN_OPTIONS {TSAN_OPTIONS}; jobs {args.jobs}", ""]
    try:
        sweep = None if args.faults_only else run_sweep(args, work, env)
        faults = None if args.tsan_only else run_faults(args, work, env)
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t0
    if sweep:
        out_lines += ["== ThreadSanitizer sweep (MSC_EMU_THREADS 4, 3 for the several-tiles cases; timeout_s "
                      f"{args.sweep_timeout:g}) ==", *sweep_summary(sweep), ""]
    if faults:
        lines, table = fault_summary(faults)
        out_lines += [f"== injected faults (timeout_s {args.timeout:g}; runs = cases x threads "
                      f"{','.join(map(str, faults['threads']))} x {faults['reps']} reps x plain/tsan) ==",
                      *format_table(table, ("", "fault", "caught", "plain", "tsan", "how (runs)", "verdict")),
                      *lines, "",
                      f"faults: built in {faults['build_s']:.0f} s, {faults['seconds']:.0f} s in all; "
                      f"{len(faults['outside'])} tsan reports outside any run", ""]
    out_lines.append(f"total {total:.0f} s")
    text = "\n".join(out_lines) + "\n"
    print()
    print(text)
    if args.out != "-":
        path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"emu-faults-{datetime.date.today()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"written to {path}")
    bad_sweep = sweep and any(r["result"] != "ok" or r["tsan"] for rid, r in sweep["results"].items()
                              if not sweep["cases"][int(rid[1:])].probe)
    missed = faults and any(not f.control and not any(caught_by(r) for r in faults["results"].get(f.name, {}).values())
                            for f in faults["faults"])
    return 1 if bad_sweep or missed else 0


if __name__ == "__main__":
    sys.exit(main())
