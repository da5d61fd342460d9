"""msc's own cost at cluster scale: each command at 8 to 4096 ranks (16384
where it fits), each run in a fresh process, CPU seconds (user + system,
the process and its workers), wall seconds and peak resident memory, with
the growth exponent fitted over the rank counts; optionally against a
baseline checkout in the same run, every output checked identical.

    python bench/scale.py [--baseline DIR] [--commands compile,verify,...]
                          [--max-ranks N] [--timeout S] [--out bench/results]

Commands (issue 38, part 2; N ranks, dgx-h100:N/8 where a topology is named):
- compile:   msc compile allreduce/ring -n N (trace, verify, lower, verify the plan, write it)
- verify:    msc verify allreduce/ring -n N (trace and the symbolic verifier)
- hier:      msc compile allreduce/hierarchical -n N (its default 4 GPUs per node)
- simulate:  msc simulate RING.plan -t dgx-h100:N/8 -b 64M -e 64M (one size; the plan: this side's compile's)
- nccl:      msc simulate --nccl allreduce -t dgx-h100:N/8 (NCCL's choice per size, 8 B to 128 MB)
- tune:      msc tune allreduce/ring allreduce/halving_doubling allreduce/hierarchical --ranks N
             -t dgx-h100:N/8 (1 KB to 256 MB, Simple and LL, 1 to 32 instances)

``--baseline DIR``: a checkout of the commit to compare with (``git worktree
add --detach /tmp/scale-base e03660d``); its msc runs with PYTHONPATH=DIR, this
checkout's with PYTHONPATH at the repository root, baseline first at each
size. Outputs must be identical: the plan files byte for byte (the checkout's
path in the source-line notes aside) and simulate's and tune's --json
records. A command that runs past ``--timeout`` is killed and reported as
over it; larger sizes of that command on that side are then not tried (the
costs grow with the rank count). Measurements are CPU seconds because the
development machine is shared: its wall times vary with the others' load.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = (8, 64, 256, 1024, 4096, 16384)
TUNED = ["allreduce/ring", "allreduce/halving_doubling", "allreduce/hierarchical"]


def _topology(n) -> str:
    if not isinstance(n, int):          # the table's heading: the command for N ranks
        return "dgx-h100:N/8"
    return "dgx-h100" if n == 8 else f"dgx-h100:{n // 8}"


# name -> (rank counts, argv for N ranks in folder OUT, the goal as (ranks, CPU s, peak MB or None))
COMMANDS = {
    "compile": (RANKS[:5], lambda n, out: ["compile", "allreduce/ring", "-n", str(n), "-o", f"{out}/ring-{n}.plan"],
                (1024, 10.0, 1024.0)),
    "verify": (RANKS[:5], lambda n, out: ["verify", "allreduce/ring", "-n", str(n)], None),
    "hier": (RANKS[:5], lambda n, out: ["compile", "allreduce/hierarchical", "-n", str(n), "-o",
                                        f"{out}/hier-{n}.plan"], (4096, 60.0, 8192.0)),
    "simulate": (RANKS[:5], lambda n, out: ["simulate", f"{out}/ring-{n}.plan", "-t", _topology(n), "-b", "64M",
                                            "-e", "64M", "--json"], None),
    "nccl": (RANKS, lambda n, out: ["simulate", "--nccl", "allreduce", "-t", _topology(n), "--json"],
             (1024, 10.0, None)),
    "tune": (RANKS[:4], lambda n, out: ["tune", *TUNED, "--ranks", str(n), "-t", _topology(n), "--json"],
             (256, 300.0, None)),
}
# the second goal of a command: simulate --nccl at 16384 ranks
EXTRA_GOALS = {"nccl": (16384, 60.0, None)}


def run_one(code: Path, argv: list[str], timeout: float) -> dict:
    """One msc command in a fresh process (and its workers): CPU, wall, peak
    MB (the largest resident size of the process or any worker), stdout."""
    env = dict(os.environ, PYTHONPATH=str(code))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        # a wrapper that reports its children's usage: os.wait4 gives the usage of one child only,
        # and tune's workers are the command's grandchildren
        proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, *argv], stdout=out, stderr=err, env=env,
                                cwd=code, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": "timeout", "wall": round(time.perf_counter() - start, 2), "cpu": None,
                    "peak_mb": None}
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        text, log = out.read().decode(), err.read().decode()
    usage = json.loads(log.strip().splitlines()[-1]) if log.strip() else {}
    row = {"status": "ok" if proc.returncode == 0 else f"exit {proc.returncode}", "wall": round(wall, 2),
           "cpu": usage.get("cpu"), "peak_mb": usage.get("peak_mb"), "stdout": text}
    if proc.returncode != 0:
        row["error"] = "\n".join(log.strip().splitlines()[-4:-1])[-400:]
    return row


# Runs msc's CLI as a child and prints its (and its workers') CPU seconds and peak MB as JSON on stderr.
_WRAPPER = r"""
import json, resource, subprocess, sys
code = subprocess.call([sys.executable, "-m", "msc.cli", *sys.argv[1:]])
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"cpu": round(u.ru_utime + u.ru_stime, 2), "peak_mb": round(u.ru_maxrss / 1024, 1)}),
      file=sys.stderr)
sys.exit(code)
"""


def fingerprint(name: str, row: dict, out: Path, n: int, code: Path) -> str | None:
    """What must be identical across sides: the plan's bytes (the
    checkout's path in source-line notes made neutral), else the stdout."""
    if row["status"] != "ok":
        return None
    if name in ("compile", "hier"):
        path = out / f"{'ring' if name == 'compile' else 'hier'}-{n}.plan"
        data = path.read_bytes().replace(str(code).encode(), b"ROOT")
        return hashlib.sha256(re.sub(rb'@ "[^"]*/algorithms/', b'@ "ALGS/', data)).hexdigest()
    text = row["stdout"]
    text = re.sub(r"\bin [0-9.]+ s\b", "in T s", text)        # verify's own timing
    if name in ("simulate", "nccl", "tune"):
        text = re.sub(r'"[^"]*/(ring|hier)-(\d+)\.plan"', r'"\1-\2.plan"', text)
        text = text.replace(str(code), "ROOT").replace(str(out), "OUT")
    return hashlib.sha256(text.encode()).hexdigest()


def exponent(rows: list[dict]) -> float | None:
    """The growth exponent k of CPU ~ N^k between the two largest rank counts
    that finished (at the small ones the interpreter's start dominates)."""
    done = [r for r in rows if r["status"] == "ok" and r.get("cpu")]
    if len(done) < 2:
        return None
    (n0, c0), (n1, c1) = [(r["ranks"], r["cpu"]) for r in sorted(done, key=lambda r: r["ranks"])[-2:]]
    return round(math.log(c1 / c0) / math.log(n1 / n0), 2)


def measure(sides: dict[str, Path], names: list[str], max_ranks: int, timeout: float, log) -> dict:
    results: dict = {side: {name: [] for name in names} for side in sides}
    same: dict = {name: {} for name in names}
    kept: dict = {side: {name: {} for name in names} for side in sides}      # fingerprints, for --merge
    stopped: dict = {(side, name): None for side in sides for name in names}
    with tempfile.TemporaryDirectory(prefix="msc-scale-") as tmp:
        folders = {side: Path(tmp) / side for side in sides}
        for folder in folders.values():
            folder.mkdir()
        for name in names:
            counts, argv, _ = COMMANDS[name]
            for n in [n for n in counts if n <= max_ranks]:
                prints = {}
                for side, code in sides.items():
                    out = folders[side]
                    if stopped[(side, name)] is not None:
                        row = {"status": f"not run: {stopped[(side, name)]} ranks took over {timeout:g} s",
                               "cpu": None, "wall": None, "peak_mb": None}
                    elif name == "simulate" and not (out / f"ring-{n}.plan").exists():
                        row = {"status": "not run: no plan (compile did not finish)", "cpu": None, "wall": None,
                               "peak_mb": None}
                    else:
                        row = run_one(code, argv(n, out), timeout)
                        if row["status"] == "timeout":
                            stopped[(side, name)] = n
                        prints[side] = kept[side][name][str(n)] = fingerprint(name, row, out, n, code)
                    row.pop("stdout", None)
                    row["ranks"] = n
                    results[side][name].append(row)
                    log(f"{side:8s} {name:8s} {n:6d} ranks: {row['status']:10s} cpu {row['cpu']} s, "
                        f"wall {row['wall']} s, peak {row['peak_mb']} MB")
                if len(prints) == 2 and None not in prints.values():
                    same[name][n] = len(set(prints.values())) == 1
    return {"results": results, "identical": {k: {str(n): v for n, v in d.items()} for k, d in same.items()},
            "prints": kept}


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"] == "ok":
        return f"{row['cpu']:.2f} / {row['peak_mb']:.0f}"
    if row["status"] == "timeout":
        return f"> {row['wall']:.0f} s"
    if "over msc's limit" in row.get("error", ""):
        return "refused: a limit"           # msc.ir.limits (the message is in the JSON)
    return row["status"].split(":")[0]


def render(data: dict, timeout: float) -> str:
    sides = list(data["results"])
    lines = [f"CPU seconds / peak MB per command and rank count ({', '.join(sides)}); "
             f"k: growth exponent of CPU between the two largest rank counts that finished; timeout {timeout:g} s", ""]
    for name, (counts, argv, goal) in COMMANDS.items():
        if name not in data["results"][sides[0]]:
            continue
        rows = {side: {r["ranks"]: r for r in data["results"][side][name]} for side in sides}
        measured = sorted({n for side in sides for n in rows[side]})
        shown = " ".join(argv("N", "OUT"))
        lines.append(f"### {name}: `msc {shown}`")
        lines.append("")
        lines.append("| side | " + " | ".join(str(n) for n in measured) + " | k |")
        lines.append("|---|" + "---:|" * (len(measured) + 1))
        for side in sides:
            k = exponent(list(rows[side].values()))
            lines.append(f"| {side} | " + " | ".join(_cell(rows[side].get(n)) for n in measured)
                         + f" | {'' if k is None else k} |")
        same = data["identical"].get(name, {})
        if same:
            lines.append("")
            lines.append("outputs identical: " + ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in same.items()))
        for g in [goal, EXTRA_GOALS.get(name)]:
            if g is None:
                continue
            n, cpu, mb = g
            row = rows[sides[-1]].get(n)
            met = (row is not None and row["status"] == "ok" and row["cpu"] <= cpu
                   and (mb is None or row["peak_mb"] <= mb))
            lines.append("")
            lines.append(f"goal at {n} ranks: <= {cpu:g} s" + (f" and <= {mb:g} MB" if mb else "")
                         + f": {'met' if met else 'not met'} ({_cell(row) or 'not measured'})")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="a checkout to compare with, run first at each size")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated, of: " + ", ".join(COMMANDS))
    ap.add_argument("--max-ranks", type=int, default=max(RANKS))
    ap.add_argument("--timeout", type=float, default=330.0, help="seconds a command may run (wall)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder of the results")
    ap.add_argument("--tag", default="", help="appended to the results' file names")
    ap.add_argument("--side", choices=("both", "before", "after"), default="both",
                    help="run only the baseline or only this checkout (--merge joins the halves)")
    ap.add_argument("--merge", nargs=2, type=Path, metavar=("BEFORE.json", "AFTER.json"),
                    help="write the table of two halves measured apart (--side), and nothing else")
    args = ap.parse_args(argv)
    if args.merge:
        return _merge(args)
    names = [n for n in args.commands.split(",") if n]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
        ap.error(f"unknown commands {unknown}; known: {', '.join(COMMANDS)}")
    sides = {"before": args.baseline.resolve()} if args.baseline and args.side != "after" else {}
    if args.side != "before":
        sides["after"] = ROOT
    data = measure(sides, names, args.max_ranks, args.timeout, lambda s: print(s, file=sys.stderr, flush=True))
    data.update(date=datetime.date.today().isoformat(), python=platform.python_version(),
                machine=f"{os.cpu_count()} cores, {platform.machine()}", timeout=args.timeout,
                commits={side: _commit(code) for side, code in sides.items()})
    _write(args.out / f"scale-{data['date']}{args.tag}", data)
    return 0


def _write(stem: Path, data: dict) -> None:
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    table = render(data, data["timeout"])
    stem.with_suffix(".md").write_text(f"# bench/scale.py, {data['date']} ({data['machine']}, Python "
                                       f"{data['python']}; commits {data['commits']})\n\n{table}\n")
    print(table)


def _merge(args) -> int:
    """One table of a baseline half and a checkout's half (--side), measured
    apart; outputs are compared by the fingerprints each half kept."""
    before, after = (json.loads(p.read_text()) for p in args.merge)
    data = dict(after, results={**before["results"], **after["results"]},
                commits={**before["commits"], **after["commits"]}, identical={},
                timeout=max(before["timeout"], after["timeout"]))
    for name in after["prints"].get("after", {}):
        for n, fp in after["prints"]["after"][name].items():
            old = before["prints"].get("before", {}).get(name, {}).get(n)
            if old is not None and fp is not None:
                data["identical"].setdefault(name, {})[n] = old == fp
    _write(args.out / f"scale-{data['date']}{args.tag}", data)
    return 0


def _commit(code: Path) -> str:
    done = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
