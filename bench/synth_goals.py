"""msc synthesize's goals (issue 17), measured with msc's simulator in one run.

For each topology (the built-ins nvswitch, pcie, ib:2, ib:4, ring:8,
torus:4x4 and the two TOML files in bench/topologies/ with unequal links)
and each of allgather, reducescatter and allreduce, at 64M, 256M and 1G:
- the bound: msc bound's least time at the size (msc.sim.bound);
- the library's best: msc tune over every library algorithm of the
  collective (parameter variations, 1, 2 and 4 instances);
- the synthesized schedule: the best of the programs msc tune --synthesize
  adds (every piece count msc.synth tries, each with its spreads, both
  places to add where the collective sums, 1, 2 and 4 instances), per size;
- msc synthesize's own choice at 1G (pieces, spread, place to add,
  instances simulated there), its time at 1G and how long choosing took.
Simple protocol only: LL has half its bandwidth in this model and never wins
at these sizes (--all-protocols adds LL, and takes twice as long).
Goals: synthesized within 10% of the bound (time <= 1.1 x bound) on every
topology at >= 64M; at least 1.3x the library's best busbw on the
heterogeneous ones (pcie, ib:2, ib:4, the TOML files); generation (the
packing and the program text, without the simulated choice) in seconds at
64 ranks and under a minute at 256.

    python bench/synth_goals.py [--all-protocols] [--collectives C,...] [--jobs N] [--out OUT]

``--collectives alltoall`` measures msc synthesize's alltoall the same way
(its pieces come from the link loads, so the last column has no simulated time).

Writes OUT.json (every number) and OUT.md (the table); OUT defaults to
bench/results/synth-goals-DATE. Nothing runs on a GPU:
these are predictions of msc's cost model (msc simulate), not measurements.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = [("nvswitch", 8), ("pcie", 8), ("ib:2", 16), ("ib:4", 32), ("ring:8", 8), ("torus:4x4", 16),
              (str(ROOT / "bench/topologies/islands.toml"), 8), (str(ROOT / "bench/topologies/nvlink_pairs.toml"), 8)]
HETEROGENEOUS = {"pcie", "ib:2", "ib:4", "islands", "nvlink-pairs"}
COLLECTIVES = ("allgather", "reducescatter", "allreduce")
SIZES = (64 << 20, 256 << 20, 1 << 30)
GENERATION = [("ib:8", 64), ("torus:8x8", 64), ("ib:32", 256), ("torus:16x16", 256)]


def library_files(collective: str) -> list[str]:
    return sorted(str(p) for p in (ROOT / "algorithms" / collective).glob("*.py"))


def best(result) -> list[float]:
    return [result.candidates[w].times[j] for j, w in enumerate(result.winners)]


def measure(job) -> dict:
    from msc.cli.sim import synthesized_files
    from msc.sim.presets import get_topology
    from msc.sim.tune import tune
    from msc.synth import synthesize
    from msc.synth.choose import choose_by_simulation

    spec, n, collective, protocols = job
    topo = get_topology(spec, n)
    lib = tune(library_files(collective), n, topo, list(SIZES), protocols=protocols, refine=False)
    with tempfile.TemporaryDirectory() as tmp:
        files = synthesized_files(library_files(collective)[:1], topo, tmp)
        syn = tune(files, n, topo, list(SIZES), protocols=protocols, refine=False)
    start = time.perf_counter()
    if collective == "alltoall":       # msc synthesize takes its pieces from the link loads (no simulation)
        s, instances, seconds = synthesize(collective, topo), None, None
    else:
        choice = choose_by_simulation(collective, topo, SIZES[-1])
        s, instances, seconds = choice.synthesis, choice.instances, choice.seconds
    chose_s = time.perf_counter() - start
    return {"topology": topo.name, "ranks": n, "collective": collective, "sizes": list(SIZES),
            "bound_s": syn.bounds, "library_s": best(lib),
            "library_winner": [lib.candidates[w].label for w in lib.winners], "synth_s": best(syn),
            "synth_winner": [syn.candidates[w].label for w in syn.winners],
            "chosen": {"pieces": s.pieces, "spread": s.spread, "add_on_arrival": s.add_on_arrival,
                       "instances": instances, "trees": s.trees, "max_depth": s.max_depth,
                       "seconds_at_1G": seconds, "choose_s": chose_s}}


def generation(spec: str, n: int, collectives) -> dict:
    from msc.sim.presets import get_topology
    from msc.synth import synthesize

    topo = get_topology(spec, n)
    out = {"topology": topo.name, "ranks": n}
    for collective in collectives:
        start = time.perf_counter()
        s = synthesize(collective, topo)
        out[collective] = {"seconds": time.perf_counter() - start, "pieces": s.pieces, "trees": s.trees,
                           "chars": len(s.text)}
    return out


def table(rows: list[dict], gens: list[dict]) -> str:
    lines = ["| topology | collective | size | bound busbw | library best | synthesized | synth %bound | "
             "synth / library | goals |", "|---|---|---|---|---|---|---|---|---|"]
    from msc.units import BUSBW_FACTOR

    for r in rows:
        factor = BUSBW_FACTOR[r["collective"]](r["ranks"])
        for j, size in enumerate(r["sizes"]):
            bw = [size / t / 1e9 * factor for t in (r["bound_s"][j], r["library_s"][j], r["synth_s"][j])]
            pct = 100 * r["bound_s"][j] / r["synth_s"][j]
            ratio = r["library_s"][j] / r["synth_s"][j]
            goals = ["within 10%" if pct >= 100 / 1.1 else "NOT within 10%"]
            if r["topology"] in HETEROGENEOUS:
                goals.append(">= 1.3x" if ratio >= 1.3 else "NOT 1.3x")
            lines.append(f"| {r['topology']} ({r['ranks']}) | {r['collective']} | {size >> 20}M | {bw[0]:.1f} | "
                         f"{bw[1]:.1f} ({r['library_winner'][j]}) | {bw[2]:.1f} ({r['synth_winner'][j]}) | "
                         f"{pct:.1f} | {ratio:.2f}x | {', '.join(goals)} |")
    collectives = [c for c in COLLECTIVES + ("alltoall",) if gens and c in gens[0]]
    lines += ["", "| topology | ranks | " + " | ".join(f"{c} (s)" for c in collectives) + " |",
              "|---|---|" + "---|" * len(collectives)]
    for g in gens:
        lines.append(f"| {g['topology']} | {g['ranks']} | "
                     + " | ".join(f"{g[c]['seconds']:.2f} (pieces {g[c]['pieces']})" for c in collectives) + " |")
    return "\n".join(lines)


def spec_list(text: str) -> list[tuple[str, int]]:
    """"ib:8@64,torus:8x8@64" -> [("ib:8", 64), ("torus:8x8", 64)]."""
    return [(spec, int(n)) for spec, n in (item.rsplit("@", 1) for item in text.split(","))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all-protocols", action="store_true", help="LL too (it never wins at these sizes)")
    ap.add_argument("--collectives", type=lambda v: v.split(","), default=list(COLLECTIVES),
                    help="comma-separated (default: the goals' three; alltoall too: msc synthesize makes it)")
    ap.add_argument("--generation", type=spec_list, default=GENERATION,
                    help="SPEC@RANKS,... to time generation on (default: ib:8@64, torus:8x8@64, ib:32@256, "
                         "torus:16x16@256)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="rows measured at once (processes)")
    ap.add_argument("--out", default=str(ROOT / "bench/results" / f"synth-goals-{datetime.date.today()}"))
    args = ap.parse_args()
    protocols = ("Simple", "LL") if args.all_protocols else ("Simple",)
    jobs = [(spec, n, collective, protocols) for spec, n in TOPOLOGIES for collective in args.collectives]
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        rows = []
        for r in pool.imap(measure, jobs):          # in order: the table's order
            rows.append(r)
            c = r["chosen"]
            print(f"{r['topology']:14} {r['collective']:14} " + "  ".join(
                f"{s >> 20}M bound/synth {100 * b / t:5.1f}% lib/synth {lt / t:5.2f}x"
                for s, b, t, lt in zip(r["sizes"], r["bound_s"], r["synth_s"], r["library_s"]))
                + f"  | msc synthesize's choice: pieces {c['pieces']} spread {c['spread']}"
                + (f" x{c['instances']} {100 * r['bound_s'][-1] / c['seconds_at_1G']:.1f}% at 1G"
                   if c["seconds_at_1G"] else " (from the link loads)") + f" in {c['choose_s']:.1f} s", flush=True)
    gens = [generation(spec, n, args.collectives) for spec, n in args.generation]
    for g in gens:
        print(f"generation {g['topology']} ({g['ranks']} ranks): "
              + ", ".join(f"{c} {g[c]['seconds']:.2f} s" for c in args.collectives), flush=True)
    meta = {"date": str(datetime.date.today()), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "command": " ".join(sys.argv), "protocols": protocols}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows, "generation": gens}, indent=1))
    Path(args.out + ".md").write_text(f"# msc synthesize goals ({meta['date']}, predicted by msc simulate)\n\n"
                                      + table(rows, gens) + "\n")
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
