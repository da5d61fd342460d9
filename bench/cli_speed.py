"""Wall time of the long commands, `msc synthesize` and `msc tune`, against a
baseline checkout in the same run, and whether their results are identical.

    python bench/cli_speed.py --baseline DIR [--cases synth-allreduce,synth-allgather-ib2,tune-allreduce]
                              [--json FILE]

``--baseline DIR``: a checkout of the commit to compare with (e.g.
``git worktree add /tmp/msc-base 5223b6b``); its CLI runs with PYTHONPATH=DIR,
this checkout's with PYTHONPATH at the repository root, each case baseline
first, then new, in fresh processes. A case's results must be identical: the
same stdout (synthesize --json: the choice and its simulated time; tune
--json: every winner, runner-up, time, range and bound) and the same files
written (the synthesized program, the tuned plans and plans.json), the
checkout's path in the plans' source-line notes aside. Beside the wall
times, the CPU seconds of each command and its workers (user + system): the
machine this runs on is often shared, and the wall time of a command that
uses both cores suffers most from the others' load.

Cases (the issue's: issue 29, part 3):
- synth-allreduce: allreduce on bench/topologies/islands.toml (8 ranks, two
  nodes of 4), pieces, spread and instances chosen by simulation at 1G;
- synth-allgather-ib2: allgather on ib:2 (16 ranks), docs/performance.md's
  largest example within 16 ranks;
- tune-allreduce: every library allreduce algorithm at 8 ranks on
  islands.toml, 1K to 1G (x2), protocols Simple, LL and LL128, instances 1 to
  32 (those within the default 64 threadblocks per rank).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from msc.progress import steps

ROOT = Path(__file__).resolve().parents[1]
ISLANDS = str(ROOT / "bench/topologies/islands.toml")
# The allreduce library as of the base commit (5223b6b): the same files on both sides. The switch
# algorithms added since (nvls, nvls_tree) need a topology with NVLS, which islands.toml is not.
LIBRARY = [f"allreduce/{name}" for name in ("allpairs", "halving_doubling", "hierarchical", "nccl_rings",
                                            "nccl_tree", "ring", "torus2d", "tree")]

CASES = {
    "synth-allreduce": ["synthesize", "allreduce", "-t", ISLANDS, "--json", "-o", "{out}/synth.py"],
    "synth-allgather-ib2": ["synthesize", "allgather", "-t", "ib:2", "--json", "-o", "{out}/synth.py"],
    "tune-allreduce": ["tune", *LIBRARY, "--ranks", "8", "-t", ISLANDS, "-b", "1K", "-e", "1G",
                       "--protocols", "Simple,LL,LL128", "--instances", "1,2,4,8,16,32", "--json", "-o", "{out}/plans"],
}


def run_cli(code: Path, argv: list[str], out: Path) -> tuple[float, float, str, dict]:
    """(wall seconds, CPU seconds, stdout, files written) of ``msc ARGV`` with
    msc imported from ``code``. CPU: user + system time of the command and
    the processes it started (its simulation workers), which other work on a
    shared machine changes far less than the wall time."""
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    args = [a.replace("{out}", str(out)) for a in argv]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "msc.cli", *args], env=env, capture_output=True, text=True,
                          cwd=out)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        raise SystemExit(f"msc {' '.join(args)} (from {code}) failed ({proc.returncode}):\n{proc.stderr}")
    files = {str(p.relative_to(out)): same_checkout(p.read_text(), out) for p in sorted(out.rglob("*")) if p.is_file()}
    return seconds, cpu, same_checkout(proc.stdout, out), files


def same_checkout(text: str, out: Path) -> str:
    """``text`` with the output folder and the checkout a plan's source notes
    name (@ "PATH/algorithms/..."; relative or absolute) written alike."""
    return re.sub(r'@ "[^"]*?algorithms/', '@ "algorithms/', text.replace(str(out), "{out}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    cases = args.cases.split(",")
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r} (expected {', '.join(CASES)})")
    rows = []
    print(f"# msc CLI speed, {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}; "
          f"baseline {args.baseline}, new {ROOT}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# {'case':<22} {'baseline s':>10} {'new s':>8} {'speedup':>8}  identical  {'baseline cpu s':>14} "
          f"{'new cpu s':>9} {'cpu ratio':>9}")
    runs = [(case, side) for case in cases for side in ("base", "new")]
    measured = {}
    with tempfile.TemporaryDirectory(prefix="msc-cli-speed-") as tmp:
        for case, side in steps(runs, "timing msc commands, each case's baseline then new", unit="run",
                                label=lambda run: f"{run[0]} ({run[1]})"):
            measured[side] = run_cli(args.baseline if side == "base" else ROOT, CASES[case], Path(tmp) / case / side)
            if side == "base":
                continue
            (base_s, base_cpu, base_out, base_files), (new_s, new_cpu, new_out, new_files) = measured.values()
            same = base_out == new_out and base_files == new_files
            rows.append({"case": case, "argv": CASES[case], "baseline_s": base_s, "new_s": new_s,
                         "speedup": base_s / new_s, "identical": same, "baseline_cpu_s": base_cpu,
                         "new_cpu_s": new_cpu})
            print(f"  {case:<22} {base_s:10.1f} {new_s:8.1f} {base_s / new_s:7.2f}x  {'yes' if same else 'NO ':<9}  "
                  f"{base_cpu:14.1f} {new_cpu:9.1f} {base_cpu / new_cpu:8.2f}x", flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 minutes)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if not all(r["identical"] for r in rows):
        raise SystemExit("results differ from the baseline's")


if __name__ == "__main__":
    main()
