"""The NCCL-grade baselines against the library's ring, predicted by msc's simulator in one run.

For each topology (nvswitch, ib:2, ib:4, ring:8, torus:4x4), each of
allgather, reducescatter and allreduce, and each algorithm among the
library's ring and the NCCL-grade baselines (algorithms/*/nccl_rings.py:
rail_rings, bidir_rings, torus_rings; allreduce/nccl_tree.py) that supports
the topology's rank count, with its default parameters: Simple and LL128
(``--protocols`` for others: LL, at half Simple's bandwidth in this model,
won no cell of the table when tried) and every instance count that keeps
its channels at or under 32 (NCCL's MAXCHANNELS), simulated at 64M, 256M
and 1G by `msc simulate`'s engine. Per size it prints each algorithm's best
busbw, the protocol and instances that give it, its ratio to the library
ring's best over the same sweep, and `msc bound`'s busbw (no plan can beat
it). Then the time to generate (trace and verify) each baseline at 256 ranks.

    python bench/nccl_baselines.py [--protocols Simple,LL128] [--jobs N] [--out OUT]

Any row can be rerun alone, e.g. rail_rings allgather on ib:2 with 2 instances:

    msc compile allgather/nccl_rings --name rail_rings --ranks 16 --instances 2 -o rail.plan
    msc simulate rail.plan --topology ib:2 -b 64M -e 1G -f 4

Writes OUT.json (every number) and OUT.md (the table); OUT defaults to
bench/results/nccl-baselines-DATE. Nothing runs on a GPU: these are
predictions of msc's cost model, not measurements.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = [("nvswitch", 8), ("ib:2", 16), ("ib:4", 32), ("ring:8", 8), ("torus:4x4", 16)]
COLLECTIVES = ("allgather", "reducescatter", "allreduce")
SIZES = (64 << 20, 256 << 20, 1 << 30)
MAX_CHANNELS = 32
INSTANCES = (1, 2, 4, 8, 16, 32)
BASELINES = ("nccl_rings:rail_rings", "nccl_rings:bidir_rings", "nccl_rings:torus_rings", "nccl_tree:nccl_tree")
GENERATION = [("nccl_rings:rail_rings", 256, {}), ("nccl_rings:torus_rings", 256, {}),
              ("nccl_rings:bidir_rings", 256, {}), ("nccl_tree:nccl_tree", 256, {})]


def algorithm(collective: str, key: str):
    import msc

    file, name = key.split(":")
    path = ROOT / "algorithms" / collective / f"{file}.py"
    if not path.is_file():
        return None
    return next(a for a in msc.load_algorithms(path) if a.name == name)


def measure(job) -> dict:
    """Every protocol and instance count of one algorithm on one topology: seconds per size."""
    import msc
    from msc.lower.pipeline import LowerOptions, lower
    from msc.sim.cut_bound import lower_bound
    from msc.sim.simulate import Simulator
    from msc.sim.presets import get_topology

    spec, n, collective, key, protocols = job
    alg = algorithm(collective, key)
    program = msc.trace(alg, n)
    msc.verify(program)
    channels = 1 + max((op.channel or 0 for op in program.ops), default=0)
    topo = get_topology(spec, n)
    runs = []
    for protocol in protocols:
        for instances in (i for i in INSTANCES if i * channels <= MAX_CHANNELS):
            plan = lower(program, LowerOptions(protocol=protocol, instances=instances))
            seconds = [r.seconds for r in Simulator(plan, topo).run(list(SIZES))]
            runs.append({"protocol": protocol, "instances": instances, "channels": instances * channels,
                         "seconds": seconds})
    return {"topology": topo.name, "spec": spec, "ranks": n, "collective": collective, "algorithm": key,
            "bound_s": [b.seconds for b in lower_bound(collective, topo, list(SIZES))], "runs": runs}


def best_runs(row: dict) -> list[dict]:
    """Per size, the fastest run (ties: fewer channels, then the protocol listed first)."""
    return [min(row["runs"], key=lambda r: (r["seconds"][j], r["channels"])) for j in range(len(SIZES))]


def busbw(collective: str, n: int, size: int, seconds: float) -> float:
    from msc.dsl.collectives import BUSBW_FACTOR

    return size / seconds / 1e9 * BUSBW_FACTOR[collective](n)


def table(rows: list[dict]) -> str:
    """Per topology and collective: msc bound's busbw, then each algorithm's best and its ratio to the ring's."""
    header = " | ".join(f"{s >> 20}M busbw (setting) | vs ring" for s in SIZES)
    lines = [f"| topology | collective | algorithm | {header} |", "|---|---|---|" + "---|---|" * len(SIZES)]
    rings = {(r["spec"], r["collective"]): best_runs(r) for r in rows if r["algorithm"] == "ring:ring"}
    for r in rows:
        where = f"| {r['topology']} ({r['ranks']}) | {r['collective']} |"
        if r["algorithm"] == "ring:ring":
            bounds = [f"{busbw(r['collective'], r['ranks'], s, t):.1f} | -" for s, t in zip(SIZES, r["bound_s"])]
            lines.append(f"{where} msc bound | {' | '.join(bounds)} |")
        ring, cells = rings[(r["spec"], r["collective"])], []
        for j, (size, run) in enumerate(zip(SIZES, best_runs(r))):
            bw = busbw(r["collective"], r["ranks"], size, run["seconds"][j])
            ratio = ring[j]["seconds"][j] / run["seconds"][j]
            cells.append(f"{bw:.1f} ({run['protocol']} x{run['instances']}) | {ratio:.2f}x")
        lines.append(f"{where} {r['algorithm']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def generation_table(gens: list[dict]) -> str:
    lines = ["| algorithm | ranks | " + " | ".join(f"{c} trace + verify (s)" for c in COLLECTIVES) + " |",
             "|---|---|" + "---|" * len(COLLECTIVES)]
    for g in gens:
        cells = [f"{g[c]['trace_s'] + g[c]['verify_s']:.2f} ({g[c]['ops']} ops)" if c in g else "-"
                 for c in COLLECTIVES]
        lines.append(f"| {g['algorithm']} | {g['ranks']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def generation(key: str, n: int, params: dict) -> dict:
    """Seconds to trace and verify each collective's form of a baseline at n ranks."""
    import msc

    out = {"algorithm": key, "ranks": n}
    for collective in COLLECTIVES:
        alg = algorithm(collective, key)
        if alg is None:
            continue
        start = time.perf_counter()
        program = msc.trace(alg, n, **params)
        traced = time.perf_counter()
        msc.verify(program)
        out[collective] = {"trace_s": traced - start, "verify_s": time.perf_counter() - traced, "ops": len(program.ops)}
    return out


def jobs_for(protocols) -> list[tuple]:
    jobs = []
    for spec, n in TOPOLOGIES:
        for collective in COLLECTIVES:
            for key in ("ring:ring",) + BASELINES:
                alg = algorithm(collective, key)
                if alg is not None and alg.supports(n):
                    jobs.append((spec, n, collective, key, protocols))
    return jobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from msc.cli.args import protocol_arg

    ap.add_argument("--protocols", type=lambda v: tuple(protocol_arg(p) for p in v.split(",")),
                    default=("Simple", "LL128"), help="comma-separated: Simple, LL, LL128 (any case)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="algorithms measured at once (processes)")
    ap.add_argument("--out", default=str(ROOT / "bench/results" / f"nccl-baselines-{datetime.date.today()}"))
    args = ap.parse_args()
    from msc.progress import steps

    rows = []
    jobs = jobs_for(args.protocols)
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        for r in steps(pool.imap(measure, jobs), f"simulating {len(jobs)} algorithms x protocols x instances",
                       total=len(jobs), unit="algorithm"):
            rows.append(r)
            print(f"{r['topology']:10} {r['collective']:14} {r['algorithm']:24} " + "  ".join(
                f"{s >> 20}M {busbw(r['collective'], r['ranks'], s, run['seconds'][j]):6.1f} GB/s "
                f"({run['protocol']} x{run['instances']})" for j, (s, run) in enumerate(zip(SIZES, best_runs(r)))),
                flush=True)
    gens = [generation(key, n, params) for key, n, params in steps(GENERATION, "timing trace + verify at scale",
                                                                     unit="algorithm", label=lambda g: f"{g[0]} n={g[1]}")]
    for g in gens:
        print(f"generation {g['algorithm']} at {g['ranks']} ranks: " + ", ".join(
            f"{c} {g[c]['trace_s'] + g[c]['verify_s']:.2f} s ({g[c]['ops']} ops)" for c in COLLECTIVES if c in g))
    meta = {"date": str(datetime.date.today()), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "command": " ".join(sys.argv), "protocols": args.protocols}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows, "generation": gens}, indent=1))
    Path(args.out + ".md").write_text(f"# NCCL-grade baselines ({meta['date']}, predicted by msc simulate)\n\n"
                                      + table(rows) + "\n\n" + generation_table(gens) + "\n")
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
