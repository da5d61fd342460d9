"""Static facts about msc's CUDA kernels, read from their cubins without a GPU.

For library plans at 8 ranks (allreduce ring and allpairs, allgather ring,
reducescatter ring, alltoall allpairs) x {Simple, LL} x {straight, table}
x {float32, bfloat16} on sm_90, and a subset on sm_80, compiles the kernel
the Communicator builds (``msc.cuda.compile`` of
``msc.cuda.runtime.runtime_plan(plan)``: 8 slots, op sum) with NVRTC and
reads the cubin with cuobjdump and nvdisasm from pip wheels
(nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm; helpers in bench/cubin_facts.py):

- registers per thread, stack frame and local memory of ``msc_kernel``
  (``cuobjdump --dump-resource-usage``). msc compiles whole programs, so the
  cubin has one entry, ``msc_kernel``, and its non-inlined callees
  (``combine``, ``ll_chunk``, ``wait_until<..>``, ``spin_packet``,
  ``msc_fail``, ``tb_N``, ``run_threadblock``) are local functions in the
  entry's text section, which cuobjdump does not list on their own: ptxas
  allocates registers over the whole call tree within the entry's budget
  (__launch_bounds__(NTHREADS, MIN_BLOCKS) caps it at 65536 / (NTHREADS x
  MIN_BLOCKS): 128 for 256 threads and 2 blocks), and the
  entry's count (the cubin's only EIATTR_REGCOUNT) is what the hardware
  allocates per thread and what occupancy uses;
- register spills per function: the bytes of the SASS instructions ptxas
  marks ``SpillRefill`` (nvdisasm), cross-checked against ptxas's own ``-v``
  report (stack frame, spill stores and loads per function) from a second
  NVRTC compile of the same source for every table-form kernel, and for
  every kernel with ``--ptxas-all`` (the straight form costs NVRTC 2-16 s a
  kernel);
- blocks per SM at the launch shape (NTHREADS: 256), from the
  register count by the rules of cuda_occupancy.h (256-register units per
  warp in 4 sub-partitions, 2048 threads, 32 blocks, shared memory plus the
  1 KB the system reserves per block out of 164 KB (sm_80) / 228 KB (sm_90));
- LDL/STL instructions in the element-loop function (``combine`` for Simple,
  ``ll_chunk`` for LL), inside its loops (ranges closed by a backward branch)
  and in all, and in the whole kernel;
- 128-bit global or generic loads and stores (``LDG.E.128``/``LD.E.128``,
  ``STG.E.128``/``ST.E.128``, with any further suffixes) inside ``combine``'s
  loops, and the other loads in its innermost vector loop (per-16-byte
  overhead: operand tables, MscArgs fields);
- loads in flight: the 128-bit loads a thread issues in ``combine``'s loops
  before the first instruction that reads a loaded register (the most on one
  path through a loop, branches followed both ways; register use read from
  the SASS operands);
- fences per release: ``MEMBAR.*.SYS`` instructions between the previous
  barrier (or release) and each 64-bit strong store of a counter
  (``STG.E.64.STRONG.SYS``/``.GPU``), the most for one release, over the
  kernel's functions;
- L1 invalidations per spin: ``CCTL.IVALL`` inside the loops of the spin
  functions (``wait_until<..>``, now ``wait_counter``, and ``spin_packet``): an acquire load in a spin
  loop invalidates the SM's L1 at every poll.

Goals, PASS/FAIL per kernel: no spills; no LDL/STL in the element loops;
>= 2 blocks per SM (Simple); 128-bit loads and stores in combine's loops
(Simple); >= 8 128-bit loads in flight before the first use (Simple: 4 per
operand, a slot and a source); <= 1 MEMBAR.SYS per release. Prints the table and writes bench/results/cuda-static-<date>.json
and .md (with the tool, NVRTC and package versions, the commit and the
command). Exits 0 whatever the goals say (it reports them), 2 when the tools
are missing, 3 when the templates changed while it ran (the kernels would mix
versions).

    python bench/cuda_static.py [--jobs N] [--cache DIR] [--ptxas-all] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cubin_facts as cf  # noqa: E402

PLANS = ("allreduce/ring:ring", "allreduce/allpairs:allpairs", "allgather/ring:ring", "reducescatter/ring:ring",
         "alltoall/allpairs:allpairs")
PROTOCOLS = ("Simple", "LL")
FORMS = ("straight", "table")
DTYPES = ("float32", "bfloat16")
RANKS = 8
GOALS = ("no_spills", "no_local_in_loop", "blocks_ge_2", "vec128", "loads_in_flight", "one_sys_fence")
GOAL_TITLES = {"no_spills": "no spills", "no_local_in_loop": "no LDL/STL in element loop",
               "blocks_ge_2": ">= 2 blocks/SM (Simple)", "vec128": "128-bit ld/st in combine (Simple)",
               "loads_in_flight": ">= 8 128-bit loads before the first use in combine (Simple)",
               "one_sys_fence": "<= 1 MEMBAR.SYS per counter release"}
GOAL_SHORT = {"no_spills": "spills", "no_local_in_loop": "loop", "blocks_ge_2": "2", "vec128": "vec128",
              "loads_in_flight": "mlp8", "one_sys_fence": "fence1"}


def cases(quick: bool) -> list[tuple]:
    """(plan key, ranks, protocol, form, dtype, arch), the slowest NVRTC jobs first."""
    out = []
    plans = PLANS[:1] if quick else PLANS
    for key in plans:
        for protocol in PROTOCOLS:
            for form in FORMS:
                for dtype in DTYPES:
                    out.append((key, RANKS, protocol, form, dtype, "sm_90"))
    # sm_80: the two allreduces in bfloat16 (its conversion instruction is sm_80's), both forms of the
    # ring, the table form of allpairs (its straight form costs NVRTC 15 s a kernel)
    for key in plans[:2]:
        for protocol in PROTOCOLS:
            for form in (FORMS if key.endswith(":ring") else ("table",)):
                out.append((key, RANKS, protocol, form, "bfloat16", "sm_80"))
    cost = {"allreduce/allpairs:allpairs": 16, "alltoall/allpairs:allpairs": 12}
    return sorted(out, key=lambda c: -(cost.get(c[0], 4) if c[3] == "straight" else 0.5))


@lru_cache(maxsize=None)
def _algorithm(key: str):
    import msc

    path, name = key.split(":")
    [alg] = [a for a in msc.load_algorithms(ROOT / "algorithms" / f"{path}.py") if a.name == name]
    return alg


@lru_cache(maxsize=None)
def runtime_plan_for(key: str, n: int, protocol: str):
    """The plan as the Communicator compiles it (msc.cuda.runtime.runtime_plan: 8 slots)."""
    import msc
    from msc.cuda.runtime import runtime_plan
    from msc.lower.pipeline import LowerOptions, lower

    return runtime_plan(lower(msc.trace(_algorithm(key), n), LowerOptions(protocol=protocol)))


def kernel_facts(case: tuple, cache: str, ptxas: bool) -> dict:
    """Compile one case (msc.cuda.compile, cached) and read its cubin."""
    import msc.cuda
    from msc.cuda.compiler import rendered

    key, n, protocol, form, dtype, arch = case
    cpu0 = _cpu()
    plan = runtime_plan_for(key, n, protocol)
    t0 = time.perf_counter()
    kernel = msc.cuda.compile(plan, dtype=dtype, op="sum", arch=arch, form=form, cache=Path(cache))
    t1 = time.perf_counter()
    defines = cf.source_defines(kernel.source)
    assert defines["NTHREADS"] == kernel.layout.nthreads, "the source's NTHREADS is the launch's"
    log = None
    if ptxas:
        src = rendered(plan, dtype=dtype, op="sum", form=form, cache=Path(cache))
        _, log = cf.nvrtc_verbose(src.source, arch=arch, name=src.source_path.name)
    facts = cf.cubin_facts(kernel.cubin, arch=arch, protocol=protocol, nthreads=kernel.layout.nthreads, ptxas_log=log)
    facts.update(plan=key, ranks=n, protocol=protocol, form=form, dtype=dtype, arch=arch,
                 min_blocks=defines["MIN_BLOCKS"], steps=plan.num_steps(), slots=plan.slots,
                 cubin_bytes=len(kernel.cubin), compile_s=round(t1 - t0, 3), cache_hit=kernel.cache_hit)
    if ptxas:
        facts["ptxas_agrees"] = (facts["spill_store_bytes"] == facts["spill_store_bytes_sass"]
                                 and facts["spill_load_bytes"] == facts["spill_load_bytes_sass"]
                                 and facts["ptxas_registers"] == facts["registers"])
    facts["goals"] = cf.goals(facts, protocol)
    facts["cpu_s"] = round(_cpu() - cpu0, 3)
    return facts


def _cpu() -> float:
    """CPU seconds of this process and its finished children (NVRTC runs in-process, the tools as children)."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def compact(facts: dict) -> dict:
    """The facts for the JSON file: the straight form's hundred tb_N functions summed into one entry."""
    out = dict(facts)
    sass = {k: v for k, v in facts["sass"].items() if not k.startswith("tb_")}
    tbs = [v for k, v in facts["sass"].items() if k.startswith("tb_")]
    if tbs:
        sass[f"tb_* ({len(tbs)} functions, summed)"] = {
            k: sum(t[k] for t in tbs) for k, v in tbs[0].items() if isinstance(v, int)}
    out["sass"] = sass
    out["functions"] = [f for f in facts["functions"] if not f.startswith("tb_")] + (
        [f"tb_0..tb_{len(tbs) - 1}"] if tbs else [])
    if "ptxas_functions" in facts:
        pf = {k: v for k, v in facts["ptxas_functions"].items() if not k.startswith("tb_")}
        ptbs = [v for k, v in facts["ptxas_functions"].items() if k.startswith("tb_")]
        if ptbs:
            pf["tb_* (summed)"] = {k: sum(t[k] for t in ptbs) for k in ptbs[0]}
        out["ptxas_functions"] = pf
    return out


# -- the table ---------------------------------------------------------------------------------
COLUMNS = ("plan", "proto", "form", "dtype", "arch", "thr", "regs", "stack B", "local B", "spill st/ld B",
           "spilled in", "blocks/SM", "loop fn LDL/STL in loops (all)", "kernel LDL/STL", "combine 128-bit ld/st",
           "vector-loop other loads", "ld128 before use", "MEMBAR.SYS/release", "L1 inval/spin", "goals")


def _mark(v) -> str:
    return "-" if v is None else ("PASS" if v else "FAIL")


def row(f: dict) -> list[str]:
    loop = f["sass"].get(f["loop_function"], {})
    where = sorted({name for name, s in f["sass"].items() if s["spill_store_bytes"] or s["spill_load_bytes"]})
    if "ptxas_functions" in f:
        where = sorted(name for name, s in f["ptxas_functions"].items() if s["spill_stores"] or s["spill_loads"])
    vec = "-"
    comb = f["sass"].get("combine")
    if f["protocol"] == "Simple" and comb:
        kinds = "/".join(sorted(set(comb["ld128"]) | set(comb["st128"]))) or "none"
        vec = f"{comb['ld128_in_loops']}/{comb['st128_in_loops']} ({kinds})"
    other = (f"{comb['vector_loop_other_loads']} ({', '.join(comb['vector_loop_other_load_ops'])})"
             if f["protocol"] == "Simple" and comb else "-")
    goals = " ".join(f"{GOAL_SHORT[g]}:{_mark(v)}" for g, v in f["goals"].items() if v is not None)
    return [f["plan"].split(":")[0], f["protocol"], f["form"], f["dtype"], f["arch"], str(f["nthreads"]),
            str(f["registers"]), str(f["stack"]), str(f["local"]),
            f"{f['spill_store_bytes']}/{f['spill_load_bytes']}", ", ".join(where) or "-",
            f"{f['blocks_per_sm']} ({f['occupancy_limiter']})",
            f"{f['loop_function']}: {loop.get('ldl_in_loops', '?')}/{loop.get('stl_in_loops', '?')} "
            f"({loop.get('ldl', '?')}/{loop.get('stl', '?')})",
            f"{f['ldl']}/{f['stl']}", vec, other,
            str(f["ld128_before_first_use"]) if f["protocol"] == "Simple" else "-",
            str(f["membar_sys_per_release"]), str(f["spin_l1_invalidations"]), goals]


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def md_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(x.replace("|", "\\|") for x in r) + " |" for r in rows]
    return "\n".join(lines)


def goal_summary(kernels: list[dict]) -> list[str]:
    out = []
    for g in GOALS:
        judged = [k for k in kernels if k["goals"][g] is not None]
        failed = [k for k in judged if not k["goals"][g]]
        names = sorted({f"{k['plan'].split(':')[0]} {k['protocol']} {k['form']} {k['dtype']} {k['arch']}"
                        for k in failed})
        out.append(f"{GOAL_TITLES[g]}: {len(judged) - len(failed)}/{len(judged)} PASS"
                   + (f"; FAIL: {'; '.join(names)}" if names else ""))
    return out


def kernel_inputs_digest() -> str:
    """SHA-256 of what the kernel source is rendered from (the templates, msc/cuda/codegen.py):
    compared before and after the run, to catch a template edited while it compiled."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((ROOT / "templates").glob("*.j2")) + [ROOT / "msc" / "cuda" / "codegen.py"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from msc.cuda.compiler import nvrtc_version

    pkgs = {}
    for p in ("nvidia-cuda-nvrtc", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm", "cuda-core", "cuda-bindings"):
        try:
            pkgs[p] = version(p)
        except PackageNotFoundError:
            pkgs[p] = "missing"
    return dict(nvrtc=nvrtc_version(), cuobjdump=cf.tool_version("cuobjdump"), nvdisasm=cf.tool_version("nvdisasm"),
                packages=pkgs, python=platform.python_version())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="NVRTC processes at once")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "msc-cuda-static"),
                    help="msc's kernel cache for the compiles (a rerun reads it)")
    ap.add_argument("--ptxas-all", action="store_true",
                    help="ptxas -v cross-check for every kernel, not only the table form (NVRTC twice)")
    ap.add_argument("--quick", action="store_true", help="allreduce ring only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    missing = cf.missing_tools()
    if missing:
        print(f"cuda_static: missing {', '.join(missing)}: pip install "
              + " ".join(f"nvidia-cuda-{m}" for m in missing), file=sys.stderr)
        return 2
    todo = cases(args.quick)
    commit = _git("rev-parse", "--short", "HEAD")
    # what shapes the kernels: the templates and msc's code (others may be editing msc/torch etc.)
    dirty = [line[3:] for line in _git("status", "--porcelain", "--", "templates", "msc").splitlines()
             if line[3:].startswith(("templates/", "msc/cuda/", "msc/verified", "msc/plan_verify", "msc/lower"))]
    digest_start = kernel_inputs_digest()
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(kernel_facts, c, args.cache, args.ptxas_all or c[3] == "table") for c in todo]
        kernels = [f.result() for f in futures]
    elapsed = time.perf_counter() - t0
    digest_end = kernel_inputs_digest()
    order = {k: i for i, k in enumerate(PLANS)}
    kernels.sort(key=lambda k: (k["arch"] != "sm_90", order[k["plan"]], PROTOCOLS.index(k["protocol"]),
                                FORMS.index(k["form"]), DTYPES.index(k["dtype"])))
    rows = [row(k) for k in kernels]
    summary = goal_summary(kernels)
    disagree = [k for k in kernels if k.get("ptxas_agrees") is False]
    today = datetime.date.today().isoformat()
    command = "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])
    meta = dict(date=today, commit=commit, modified=dirty, templates_digest=digest_start,
                templates_changed_during_run=digest_start != digest_end,
                command=command, versions=versions(), seconds=round(elapsed, 1), jobs=args.jobs,
                cache_hits=sum(k["cache_hit"] for k in kernels), kernels=len(kernels),
                cpu_s=round(sum(k["cpu_s"] for k in kernels), 1),
                load_average=[round(load_start, 1), round(os.getloadavg()[0], 1)],
                ptxas_checked=sum("ptxas_agrees" in k for k in kernels), ptxas_disagreements=len(disagree))

    print(text_table(rows))
    print()
    for line in summary:
        print("#", line)
    print(f"# ptxas -v cross-check: {meta['ptxas_checked']} kernels, {len(disagree)} disagree with the SASS reading")
    print(f"# {len(kernels)} kernels in {elapsed:.1f} s wall, {meta['cpu_s']:.1f} s CPU in the workers "
          f"({args.jobs} processes, {meta['cache_hits']} kernels from the cache), commit {commit}"
          + (f" (modified: {', '.join(dirty)})" if dirty else ""))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"cuda-static-{today}"
    # one kernel a line: diffable, and a third of the size of an indented dump
    base.with_suffix(".json").write_text(
        '{"meta": ' + json.dumps(meta, indent=1) + ',\n"goals": ' + json.dumps(summary, indent=1) + ',\n"kernels": [\n'
        + ",\n".join(json.dumps(compact(k), separators=(",", ":")) for k in kernels) + "\n]}\n")
    v = meta["versions"]
    md = [f"# Static facts of msc's CUDA kernels ({today})", "",
          f"Commit {commit}" + (f" with {', '.join(dirty)} modified (templates digest {digest_start})" if dirty else "")
          + f"; `{command}`; NVRTC {v['nvrtc']}, cuobjdump {v['cuobjdump']}, nvdisasm {v['nvdisasm']}, "
          f"cuda-core {v['packages']['cuda-core']}, Python {v['python']}; {len(kernels)} kernels in "
          f"{elapsed:.1f} s wall, {meta['cpu_s']:.1f} s CPU ({meta['cache_hits']} from the cache, {args.jobs} "
          f"processes; 1-minute load average {meta['load_average'][0]} at the start, {meta['load_average'][1]} at "
          f"the end, on {os.cpu_count()} cores).", "",
          "Plans at 8 ranks as the Communicator compiles them (`runtime_plan`: 8 slots), op sum. "
          "Registers, stack and local memory of `msc_kernel` from `cuobjdump --dump-resource-usage`; spills "
          "(bytes stored/loaded) from ptxas's `SpillRefill` marks in the SASS (cross-checked against `ptxas -v` "
          f"for {meta['ptxas_checked']} kernels: {len(disagree)} disagree); blocks/SM from the register count "
          "(cuda_occupancy.h rules); LDL/STL of the element-loop function (`combine` Simple, `ll_chunk` LL) inside "
          "its loops and in all; 128-bit loads/stores inside `combine`'s loops (count and opcodes); other loads "
          "in `combine`'s innermost vector loop (per-16-byte overhead); 128-bit loads a thread issues in "
          "`combine`'s loops before the first instruction that uses loaded data (the most on one path through a "
          "loop); system fences (`MEMBAR.*.SYS`) before a counter's release store (the most for one release); "
          "L1 invalidations (`CCTL.IVALL`) inside the spin loops of `wait_counter` (`wait_until` before issue 26) and `spin_packet`.", "",
          md_table(rows), "", "Goals:", ""] + [f"- {line}" for line in summary] + [""]
    base.with_suffix(".md").write_text("\n".join(md))
    print(f"# wrote {base}.json and .md")
    if digest_start != digest_end:
        print("# WARNING: the templates or msc/cuda/codegen.py changed during the run: the kernels mix versions; "
              "run again with a fresh --cache", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
