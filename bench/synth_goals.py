"""msc synthesize's goals (issues 17 and 25), judged against NCCL-grade baselines with msc's simulator.

For each topology (nvswitch, pcie, dgx-h100:2, dgx-h100:4, ring:8,
torus:4x4 and the two TOML files in bench/topologies/ with unequal links)
and each of allgather, reducescatter and allreduce, at 1M to 1G (x4):
- the bound: msc bound's least time at the size (msc.sim.cut_bound);
- the library's best: msc tune over every library algorithm of the
  collective (the NCCL-grade baselines nccl_rings and nccl_tree among
  them), with its parameter variations, Simple, LL and LL128, and msc
  tune's instance counts (1 to 32, within its budget of threadblocks);
- NCCL: msc simulate --nccl (msc.sim.nccl_sim.simulate_nccl: NCCL's own
  choice of algorithm, protocol and channels, simulated), where the
  topology has an NCCL model (nvswitch, dgx-h100:N);
- the best baseline: the faster of the two;
- synthesized alone: the best of the programs msc tune --synthesize adds
  (every piece count msc.synth tries, each with its spreads, both places
  to add where the collective sums), tuned the same way;
- the choice: what msc tune --synthesize picks, the faster of the
  library's best and synthesized alone (the same candidates in one tune).
  This is the honest measure of synthesis: where a synthesized program
  loses, msc tune picks the library's.
Goals (issue 25), each judged on the choice: never below 0.97x the best
baseline at any size; within 10% of the bound (time <= 1.1 x bound) at
>= 64M; at >= 64M, at least 1.2x the best baseline on dgx-h100:2 and
dgx-h100:4 allgather and reducescatter, and 1.5x on the heterogeneous
fabrics (pcie, islands, nvlink-pairs), where the room (the bound's busbw
over the best baseline's) allows it.

    python bench/synth_goals.py [--topologies NAME,...] [--collectives C,...] [--jobs N] [--out OUT]

Each (topology, collective) and part (library with NCCL, synthesized) is
written to OUT.d/ as it finishes, and a rerun skips the parts found there
(resumable; --fresh starts over). Then OUT.json (every number) and OUT.md
(the table) are written from all parts there. OUT defaults to
bench/results/synth-goals-DATE. Nothing runs on a GPU: these are
predictions of msc's cost model (msc simulate), not measurements.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = [("dgx-h100:4", 32), ("dgx-h100:2", 16), ("torus:4x4", 16), ("nvswitch", 8), ("pcie", 8),
              ("ring:8", 8), (str(ROOT / "bench/topologies/islands.toml"), 8),
              (str(ROOT / "bench/topologies/nvlink_pairs.toml"), 8)]
COLLECTIVES = ("allgather", "reducescatter", "allreduce")
SIZES = tuple(1 << e for e in range(20, 31, 2))          # 1M, 4M, ..., 1G
PROTOCOLS = ("Simple", "LL", "LL128")
LARGE = 64 << 20                                        # the goals on bandwidth start here
HETEROGENEOUS = {"pcie": 1.5, "islands": 1.5, "nvlink-pairs": 1.5}
MULTINODE = {("dgx-h100:2", "allgather"): 1.2, ("dgx-h100:2", "reducescatter"): 1.2,
             ("dgx-h100:4", "allgather"): 1.2, ("dgx-h100:4", "reducescatter"): 1.2}
NO_LOSS, NEAR_BOUND = 0.97, 1.1
PARTS = ("library", "synthesized")
GENERATION = [("ib:8", 64), ("torus:8x8", 64), ("ib:32", 256), ("torus:16x16", 256)]


def library_files(collective: str) -> list[str]:
    return sorted(str(p) for p in (ROOT / "algorithms" / collective).glob("*.py"))


def winners(result) -> dict:
    """Per swept size: the winner's time (s), label and threadblocks per rank."""
    from msc.sim.tune import threadblocks

    cands = [result.candidates[w] for w in result.winners]
    return {"s": [c.times[j] for j, c in enumerate(cands)], "label": [c.label for c in cands],
            "threadblocks": [threadblocks(c.plan) for c in cands], "candidates": len(result.candidates)}


def measure(job) -> dict:
    """One part of one (topology, collective): the library's best (with NCCL's
    simulated choice and the bound), or the synthesized programs' best."""
    from msc.sim.presets import get_topology
    from msc.sim.tune import tune

    spec, n, collective, part = job
    topo = get_topology(spec, n)
    start = time.perf_counter()
    out = {"topology": topo.name, "spec": spec, "ranks": n, "collective": collective, "part": part,
           "sizes": list(SIZES)}
    if part == "library":
        # each part runs in a (daemonic) worker of its own: its tune simulates in that process
        out["best"] = winners(tune(library_files(collective), n, topo, list(SIZES), protocols=PROTOCOLS,
                                   refine=False, runner_up=False, workers=1))
        out["nccl"] = nccl(collective, topo)
        out["bound_s"] = bounds(collective, topo)
    else:
        from msc.cli.sim import synthesized_files

        with tempfile.TemporaryDirectory() as tmp:
            files = synthesized_files(library_files(collective)[:1], topo, tmp)
            out["best"] = winners(tune(files, n, topo, list(SIZES), protocols=PROTOCOLS, refine=False, workers=1,
                                       runner_up=False))
    out["seconds"] = time.perf_counter() - start
    return out


def nccl(collective: str, topo) -> dict | None:
    """msc simulate --nccl's records (time, NCCL's algorithm, protocol and channels), or None where the
    topology has no NCCL model."""
    from msc.errors import UsageError
    from msc.sim.nccl_sim import simulate_nccl

    try:
        records = simulate_nccl(collective, topo, list(SIZES))
    except UsageError as exc:
        return {"unsupported": str(exc).splitlines()[0]}
    return {"s": [r["time"] * 1e-6 for r in records],
            "label": [f"NCCL {r['algorithm']} {r['protocol']} {r['channels']}ch" for r in records]}


def bounds(collective: str, topo) -> list[float]:
    from msc.sim.cut_bound import lower_bound

    return [b.seconds for b in lower_bound(collective, topo, list(SIZES))]


# -- judging ------------------------------------------------------------------
def cell(lib: dict, syn: dict) -> dict:
    """Per size of one (topology, collective): every time and which plan,
    the choice, the ratios and the goals."""
    from msc.dsl.collectives import BUSBW_FACTOR

    factor = BUSBW_FACTOR[lib["collective"]](lib["ranks"])
    nccl_s = (lib["nccl"] or {}).get("s")
    rows = []
    for j, size in enumerate(lib["sizes"]):
        base, base_label = lib["best"]["s"][j], lib["best"]["label"][j]
        if nccl_s and nccl_s[j] < base:
            base, base_label = nccl_s[j], lib["nccl"]["label"][j]
        synth_s, lib_s = syn["best"]["s"][j], lib["best"]["s"][j]
        choice, source = (synth_s, "synthesized") if synth_s < lib_s else (lib_s, "library")
        bound = lib["bound_s"][j]
        rows.append({"size": size, "bound_s": bound, "library_s": lib_s, "library": lib["best"]["label"][j],
                     "nccl_s": nccl_s[j] if nccl_s else None,
                     "nccl": lib["nccl"]["label"][j] if nccl_s else None,
                     "baseline_s": base, "baseline": base_label, "synth_s": synth_s,
                     "synth": syn["best"]["label"][j], "synth_threadblocks": syn["best"]["threadblocks"][j],
                     "choice_s": choice, "choice": source,
                     "busbw": {k: size / t / 1e9 * factor for k, t in (("bound", bound), ("baseline", base),
                                                                      ("synth", synth_s), ("choice", choice))},
                     "vs_baseline": base / choice, "synth_vs_baseline": base / synth_s,
                     "pct_bound": 100 * bound / choice, "room": base / bound})
    return {"topology": lib["topology"], "ranks": lib["ranks"], "collective": lib["collective"], "rows": rows,
            "goals": goals(lib["topology"], lib["collective"], rows),
            "seconds": {"library": lib["seconds"], "synthesized": syn["seconds"]}}


def goals(topology: str, collective: str, rows: list[dict]) -> list[dict]:
    """Each goal of the (topology, collective): met or not, with the numbers that decide it."""
    from msc.units import format_size

    large = [r for r in rows if r["size"] >= LARGE]
    worst = min(rows, key=lambda r: r["vs_baseline"])
    out = [{"goal": f">= {NO_LOSS}x the best baseline at every size", "met": worst["vs_baseline"] >= NO_LOSS,
            "detail": f"least {worst['vs_baseline']:.2f}x at {format_size(worst['size'])}"},
           {"goal": "within 10% of the bound at >= 64M",
            "met": all(r["pct_bound"] >= 100 / NEAR_BOUND for r in large),
            "detail": " / ".join(f"{r['pct_bound']:.1f}%" for r in large)}]
    target = MULTINODE.get((topology, collective)) or HETEROGENEOUS.get(topology)
    if target:
        short = [r for r in large if r["vs_baseline"] < target]
        cramped = [r for r in short if r["room"] < target]
        out.append({"goal": f">= {target}x the best baseline at >= 64M", "met": not short,
                    "room_limits": bool(short) and len(cramped) == len(short),
                    "detail": " / ".join(f"{r['vs_baseline']:.2f}x (room {r['room']:.2f}x)" for r in large)})
    return out


def table(cells: list[dict], gens: list[dict]) -> str:
    from msc.units import format_size

    lines = ["Predicted by msc's cost model (msc simulate), no GPU. busbw in GB/s. baseline: the faster of the "
             "library's best (msc tune over every library algorithm, NCCL-grade ones included) and msc simulate "
             "--nccl; synth: the best synthesized program alone; choice: msc tune --synthesize's pick (the faster "
             "of the library's best and synth); room: the bound's busbw over the baseline's.", "",
             "| topology | collective | size | bound | baseline (which) | NCCL | synth (which, threadblocks) | "
             "choice | choice / baseline | synth / baseline | %bound | room |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        for r in c["rows"]:
            bw = r["busbw"]
            nccl = f"{c_busbw(r, 'nccl_s', c):.1f}" if r["nccl_s"] else "-"
            lines.append(f"| {c['topology']} ({c['ranks']}) | {c['collective']} | {format_size(r['size'])} | "
                         f"{bw['bound']:.1f} | {bw['baseline']:.1f} ({r['baseline']}) | {nccl} | "
                         f"{bw['synth']:.1f} ({r['synth']}, {r['synth_threadblocks']}) | {bw['choice']:.1f} "
                         f"({r['choice']}) | {r['vs_baseline']:.2f}x | {r['synth_vs_baseline']:.2f}x | "
                         f"{r['pct_bound']:.1f} | {r['room']:.2f}x |")
    lines += ["", "| topology | collective | goal | met | numbers |", "|---|---|---|---|---|"]
    for c in cells:
        for g in c["goals"]:
            met = "yes" if g["met"] else ("no: the room is too small" if g.get("room_limits") else "no")
            lines.append(f"| {c['topology']} | {c['collective']} | {g['goal']} | {met} | {g['detail']} |")
    if gens:
        collectives = [k for k in COLLECTIVES if k in gens[0]]
        lines += ["", "Generation (the packing and the program text), seconds (pieces):", "",
                  "| topology | ranks | " + " | ".join(collectives) + " |", "|---|---|" + "---|" * len(collectives)]
        for g in gens:
            lines.append(f"| {g['topology']} | {g['ranks']} | "
                         + " | ".join(f"{g[k]['seconds']:.2f} ({g[k]['pieces']})" for k in collectives) + " |")
    return "\n".join(lines)


def c_busbw(row: dict, key: str, c: dict) -> float:
    from msc.dsl.collectives import BUSBW_FACTOR

    return row["size"] / row[key] / 1e9 * BUSBW_FACTOR[c["collective"]](c["ranks"])


def generation(spec: str, n: int, collectives) -> dict:
    from msc.sim.presets import get_topology
    from msc.synth import synthesize

    topo = get_topology(spec, n)
    out = {"topology": topo.name, "ranks": n}
    for collective in collectives:
        start = time.perf_counter()
        s = synthesize(collective, topo)
        out[collective] = {"seconds": time.perf_counter() - start, "pieces": s.pieces, "trees": s.trees}
    return out


# -- running ------------------------------------------------------------------
def part_path(folder: Path, spec: str, collective: str, part: str) -> Path:
    return folder / f"{Path(spec).stem.replace(':', '-')}-{collective}-{part}.json"


def run_parts(jobs: list, folder: Path, processes: int) -> None:
    """Measure the parts not in ``folder`` yet, each written there as it finishes."""
    from msc.units import format_size

    todo = [j for j in jobs if not part_path(folder, j[0], j[2], j[3]).exists()]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} parts found in {folder}; measuring {len(todo)}", flush=True)
    from msc.progress import steps

    with multiprocessing.get_context("spawn").Pool(max(1, processes), maxtasksperchild=1) as pool:
        for r in steps(pool.imap_unordered(measure, todo), f"measuring {len(todo)} parts (tune and synthesize)",
                       total=len(todo), unit="part"):
            part_path(folder, r["spec"], r["collective"], r["part"]).write_text(json.dumps(r))
            print(f"{r['topology']:14} {r['collective']:14} {r['part']:12} {r['seconds']:7.1f} s  "
                  + ", ".join(f"{format_size(s)} {lbl}" for s, lbl in zip(r["sizes"], r["best"]["label"])), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", type=lambda v: v.split(","),
                    help="comma-separated names to measure (default: all eight; a TOML file by its stem)")
    ap.add_argument("--collectives", type=lambda v: v.split(","), default=list(COLLECTIVES))
    ap.add_argument("--generation", type=spec_list, default=GENERATION,
                    help="SPEC@RANKS,... to time generation on ('' for none)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parts measured at once")
    ap.add_argument("--out", default=str(ROOT / "bench/results" / f"synth-goals-{datetime.date.today()}"))
    ap.add_argument("--fresh", action="store_true", help="discard the parts measured before")
    args = ap.parse_args()
    folder = Path(args.out + ".d")
    if args.fresh and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chosen = [(spec, n) for spec, n in TOPOLOGIES
              if not args.topologies or Path(spec).stem.replace("_", "-") in args.topologies
              or spec in args.topologies]
    jobs = [(spec, n, c, part) for spec, n in chosen for c in args.collectives for part in PARTS]
    run_parts(jobs, folder, args.jobs)
    from msc.progress import steps

    gens = [generation(spec, n, args.collectives)
            for spec, n in steps(args.generation, "timing msc synthesize", unit="topology",
                                 label=lambda g: f"{g[0]} n={g[1]}")]
    cells = []
    for spec, n in TOPOLOGIES:                  # every topology measured so far, in the table's order
        for collective in COLLECTIVES:
            paths = [part_path(folder, spec, collective, p) for p in PARTS]
            if all(p.exists() for p in paths):
                cells.append(cell(*(json.loads(p.read_text()) for p in paths)))
    meta = {"date": str(datetime.date.today()), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "command": " ".join(sys.argv), "protocols": PROTOCOLS, "sizes": SIZES,
            "predicted": "msc's cost model (msc simulate); nothing ran on a GPU"}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "cells": cells, "generation": gens}, indent=1))
    Path(args.out + ".md").write_text(f"# msc synthesize goals ({meta['date']}, predicted by msc simulate)\n\n"
                                      + table(cells, gens) + "\n")
    print(f"wrote {args.out}.json and {args.out}.md ({len(cells)} of {len(TOPOLOGIES) * len(COLLECTIVES)} "
          "topology x collective cells)")
    return 0


def spec_list(text: str) -> list[tuple[str, int]]:
    """"ib:8@64,torus:8x8@64" -> [("ib:8", 64), ("torus:8x8", 64)]; "" -> []."""
    return [(spec, int(n)) for spec, n in (item.rsplit("@", 1) for item in text.split(",") if item)]


if __name__ == "__main__":
    sys.exit(main())
