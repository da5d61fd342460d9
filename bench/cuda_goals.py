"""The GPU runtime's benchmark goals (issue 5), for 8 virtual ranks on one GPU:

1. allreduce at 64 MB per rank in bfloat16: the best library schedule's bus
   bandwidth at >= 80% of the measured device copy bandwidth, and >= 1.3x
   faster than the one-GPU PyTorch baseline (stack + sum + copy back);
2. allreduce at 8 KB per rank with LL, replayed from a CUDA graph: <= 8 us
   per call.

Every library allreduce that supports 8 ranks is timed through
msc.cuda.bench (the same code as ``msc bench``), baselines measured in the
same run. Writes bench/results/cuda-goals-<gpu>-<time>.{json,txt} with the
device, driver, CUDA and package versions and the command, and prints the
tables. Needs a GPU; exits 2 without one. Not run yet: written without a GPU.

    python bench/cuda_goals.py [--iters 20] [--graphs 100] [--ranks 8]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--graphs", type=int, default=100, help="graph replays for the small-message goal")
    ap.add_argument("--instances", default="1,4",
                    help="lowering instances to try for the large goal (more channels, more blocks: a ring at "
                         "8 ranks has only 8 blocks)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    import msc
    from msc.cuda import device as cu
    from msc.cuda.bench import bench, format_baselines
    from msc.errors import MscError
    from msc.lower.pipeline import LowerOptions, lower
    from msc.units import format_table

    if not cu.driver_available():
        print(f"cuda_goals: needs a GPU: {cu.probe()[1]}", file=sys.stderr)
        return 2
    library = ROOT / "algorithms" / "allreduce"
    algs = [a for p in sorted(library.glob("*.py")) for a in msc.load_algorithms(p) if a.supports(args.ranks)]
    runs, text = [], []
    instances = [int(x) for x in args.instances.split(",")]
    goals = {"large": ("64M", "bfloat16", "Simple", 0, instances), "small": ("8K", "float", "LL", args.graphs, [1])}
    for goal, (size, dtype, protocol, graphs, tries) in goals.items():
        for alg, inst in ((a, i) for a in algs for i in tries):
            try:
                plan = lower(msc.trace(alg, args.ranks), LowerOptions(protocol=protocol, instances=inst))
                out = bench(plan, min_bytes=size, max_bytes=size, iters=args.iters, warmup=args.warmup,
                            graphs=graphs, dtype=dtype, op="sum")
            except MscError as exc:
                print(f"# {goal} {alg.name} x{inst}: {exc}", file=sys.stderr)
                continue
            out.update(goal=goal, algorithm=f"{alg.name} x{inst}")
            runs.append(out)
            text.append(format_table(out["records"], title=f"{goal}: {alg.name} x{inst} {protocol} {dtype} "
                                                           f"{args.ranks} virtual ranks, graph replays {graphs}"))
            text.append(format_baselines(out["records"]))
    summary = []
    large = [r for r in runs if r["goal"] == "large"]
    if large:
        best = max(large, key=lambda r: r["records"][0]["busbw"])
        rec = best["records"][0]
        frac = rec["busbw"] / rec["copy_bw"] if rec.get("copy_bw") else 0.0
        summary.append(f"# goal 1, 64 MB bf16 allreduce: best {best['algorithm']}: busbw {rec['busbw']:.1f} GB/s = "
                       f"{frac:.0%} of copy {rec.get('copy_bw', 0):.1f} GB/s (goal >= 80%), "
                       f"{rec.get('speedup', 0):.2f}x PyTorch (goal >= 1.3x)")
    small = [r for r in runs if r["goal"] == "small"]
    if small:
        best = min(small, key=lambda r: r["records"][0]["time"])
        summary.append(f"# goal 2, 8 KB LL allreduce from a CUDA graph: best {best['algorithm']}: "
                       f"{best['records'][0]['time']:.2f} us per call (goal <= 8 us)")
    env = runs[0]["environment"] if runs else {}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"cuda-goals-{env.get('gpu', 'gpu').replace(' ', '_')}-{stamp}"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join([sys.executable, *sys.argv])
    (out_dir / f"{name}.json").write_text(json.dumps({"command": command, "environment": env, "summary": summary,
                                                      "runs": runs}, indent=1))
    report = "\n".join([f"# {command}", f"# {json.dumps(env)}", *text, *summary]) + "\n"
    (out_dir / f"{name}.txt").write_text(report)
    print(report)
    print(f"wrote {out_dir / name}.json and .txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
