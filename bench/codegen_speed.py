"""Code generation speed: render time, NVRTC time, source and cubin size of
the ring allreduce at 8, 32 and 64 ranks, in the straight-line form (every
step its own code) and the table form (one interpreter over a step table).

    python bench/codegen_speed.py [--ranks 8,32,64] [--straight-max 32] [--json]

Each kernel is rendered and compiled afresh (no cache). The straight-line
form's NVRTC time grows with the step count (n*(2n-2) steps for the ring),
which is why msc picks the table form above codegen.STRAIGHT_LINE_MAX_STEPS.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import msc
from msc.cuda.codegen import STRAIGHT_LINE_MAX_STEPS, render
from msc.cuda.compiler import nvrtc_compile, nvrtc_version
from msc.lower.pipeline import lower
from msc.progress import quiet, steps

ROOT = Path(__file__).resolve().parent.parent


def measure(plan, form: str, dtype: str, arch: str) -> dict:
    t0 = time.perf_counter()
    source, _ = render(plan, dtype=dtype, form=form)
    t1 = time.perf_counter()
    cubin = nvrtc_compile(source, arch=arch)
    t2 = time.perf_counter()
    return {"ranks": plan.num_ranks, "steps": plan.num_steps(), "form": form, "render_s": round(t1 - t0, 3),
            "nvrtc_s": round(t2 - t1, 3), "source_kb": round(len(source) / 1024, 1),
            "cubin_kb": round(len(cubin) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,32,64")
    parser.add_argument("--straight-max", type=int, default=32, help="largest rank count to try straight-line at")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    [ring] = msc.load_algorithms(ROOT / "algorithms" / "allreduce" / "ring.py")
    rows = []
    runs = [(n, form) for n in (int(x) for x in args.ranks.split(","))
            for form in ("table", "straight") if form == "table" or n <= args.straight_max]
    plans = {}
    with quiet(args.json):                 # --json: its reader wants only the JSON
        for n, form in steps(runs, "rendering and compiling (NVRTC) the ring allreduce kernel", unit="kernel",
                             label=lambda run: f"{run[0]} ranks, {run[1]}"):
            if n not in plans:
                plans[n] = lower(msc.trace(ring, n))
            rows.append(measure(plans[n], form, args.dtype, args.arch))
            if not args.json:
                r = rows[-1]
                print(f"{r['ranks']:>5} {r['steps']:>7} {r['form']:>9} {r['render_s']:>9.3f} {r['nvrtc_s']:>8.2f} "
                      f"{r['source_kb']:>9.1f} {r['cubin_kb']:>8.1f}", flush=True)
    if args.json:
        print(json.dumps({"nvrtc": nvrtc_version(), "dtype": args.dtype, "arch": args.arch,
                          "straight_line_max_steps": STRAIGHT_LINE_MAX_STEPS, "rows": rows}))


if __name__ == "__main__":
    print(f"ring allreduce, NVRTC {nvrtc_version()}; msc uses straight-line code up to "
          f"{STRAIGHT_LINE_MAX_STEPS} steps")
    print(f"{'ranks':>5} {'steps':>7} {'form':>9} {'render s':>9} {'nvrtc s':>8} {'source KB':>9} {'cubin KB':>8}")
    main()
