"""Compile speed: trace, verify and lower the ring allreduce at growing rank counts.

Each rank count runs in a fresh Python process, so its peak memory is that
process's own ru_maxrss (interpreter and msc included). Prints a table and
whether the goals are met; exits 1 if a measured goal is missed.

    python bench/compile_speed.py [--max-ranks N] [--json]

Stages: trace (run the DSL), verify (the symbolic DSL verifier), lower (the
lowering pipeline, which ends with the plan verifier), reload (the plan
written as text and parsed back, as ``msc.load_plan(..., verify=False)``). To time another
stage, add it to STAGES: the table, the JSON and the totals pick it up.
Each goal names the stages it counts.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

RING = Path(__file__).resolve().parent.parent / "algorithms" / "allreduce" / "ring.py"
SIZES = (8, 32, 64, 128, 256, 512, 1024)
# (ranks, stages counted, total seconds below, peak MB below or None)
GOALS = (
    (128, ("trace", "verify"), 1.0, None),            # issue 2: trace + verify
    (1024, ("trace", "verify"), 30.0, 2048.0),         # issue 2
    (1024, ("verify", "lower"), 30.0, None),            # issue 3: lowered, with both verifications
)


def _load() -> dict:
    """Untimed setup: import msc and load the algorithm file."""
    import msc

    [ring] = [a for a in msc.load_algorithms(RING) if a.name == "ring"]
    return {"algorithm": ring}


def _trace(state: dict) -> None:
    import msc

    state["program"] = msc.trace(state["algorithm"], state["ranks"])
    state["ops"] = len(state["program"].ops)


def _verify(state: dict) -> None:
    import msc

    msc.verify(state["program"])


def _lower(state: dict) -> None:
    from msc.lower.pipeline import lower

    state["plan"] = lower(state["program"])
    state["steps"] = state["plan"].num_steps()


def _reload(state: dict) -> None:
    """What a training process pays to read the plan file (text out and back
    in, values checked; the plan verifier is the lower stage's)."""
    from msc.formats.plan_text import dump_plan, parse_plan

    assert parse_plan(dump_plan(state.pop("plan"))).num_steps() == state["steps"]


# The timed stages, in order: (column name, function of a shared state dict).
STAGES = [
    ("trace", _trace),
    ("verify", _verify),
    ("lower", _lower),
    ("reload", _reload),
]


def measure_one(ranks: int) -> dict:
    """Run every stage at ``ranks`` in this process (call it in a fresh one)."""
    state = {**_load(), "ranks": ranks}
    seconds, peaks = {}, {}
    for name, stage in STAGES:
        start = time.perf_counter()
        stage(state)
        seconds[name] = time.perf_counter() - start
        peaks[name] = round(_peak_mb(), 1)     # the process's peak so far: after this stage
    return {"ranks": ranks, "ops": state.get("ops"), "seconds": seconds, "peak_after": peaks,
            "total": sum(seconds.values()), "peak_mb": peaks[STAGES[-1][0]]}


def _peak_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def measure(ranks: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--one", str(ranks)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{ranks} ranks failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def judge(rows: list[dict]) -> list[dict]:
    by_ranks = {row["ranks"]: row for row in rows}
    verdicts = []
    for ranks, stages, max_seconds, max_mb in GOALS:
        goal = (f"{ranks} ranks: {' + '.join(stages)} < {max_seconds:g} s"
                + (f" and peak < {max_mb:g} MB" if max_mb else ""))
        row = by_ranks.get(ranks)
        spent = None if row is None else sum(row["seconds"][s] for s in stages)
        peak = None if row is None else row["peak_after"][stages[-1]]      # peak by the goal's last stage
        met = None if row is None else spent < max_seconds and (max_mb is None or peak < max_mb)
        verdicts.append({"goal": goal, "met": met, "seconds": None if spent is None else round(spent, 3)})
    return verdicts


def render(rows: list[dict], verdicts: list[dict]) -> str:
    names = [name for name, _ in STAGES]
    head = f"{'ranks':>6} {'ops':>10} " + " ".join(f"{name + ' s':>9}" for name in names)
    lines = [head + f" {'total s':>9} {'peak MB':>8}"]
    for row in rows:
        stages = " ".join(f"{row['seconds'][name]:9.3f}" for name in names)
        lines.append(f"{row['ranks']:>6} {row['ops']:>10} {stages} {row['total']:9.3f} {row['peak_mb']:8.1f}")
    lines.append("")
    for v in verdicts:
        status = "not measured" if v["met"] is None else "met" if v["met"] else "MISSED"
        spent = "" if v["seconds"] is None else f" ({v['seconds']:.2f} s)"
        lines.append(f"goal {v['goal']}: {status}{spent}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=max(SIZES), help="largest rank count to run")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child mode: one size, JSON out
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.one)))
        return 0
    from msc.progress import quiet, steps

    rows = []
    with quiet(args.json):
        for ranks in steps([n for n in SIZES if n <= args.max_ranks], "tracing, verifying and lowering the ring",
                           unit="size", label=lambda n: f"{n} ranks"):
            rows.append(measure(ranks))
            if not args.json:
                print(f"... {ranks} ranks: {rows[-1]['total']:.2f} s", file=sys.stderr)
    verdicts = judge(rows)
    if args.json:
        print(json.dumps({"rows": rows, "goals": verdicts}, indent=2))
    else:
        print(render(rows, verdicts))
    return 1 if any(v["met"] is False for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
