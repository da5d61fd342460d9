"""Fingerprints of msc's outputs, to show a speed change changed nothing:
every library algorithm's plan text (at 8, 16 and 32 ranks, in place and
out of place, 1 and 2 instances), the DSL verifier's report, simulated
times of the 16-rank plans on dgx-h100:2, ``simulate --nccl`` records and an
8-rank tune, each hashed (sha256 of its text or JSON).

    python bench/fingerprints.py -o before.json           # on one checkout
    python bench/fingerprints.py -o after.json --compare before.json

``--compare`` prints the keys whose fingerprints differ (exit 1 if any).
Run it from the repository root with PYTHONPATH there: the plans' source
line notes name files relative to it, so two checkouts compare alike.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = (8, 16, 32)
SIM_SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 25]
NCCL_TOPOLOGIES = ("dgx-h100:2", "dgx-a100:4", "dgx-h100:16")


def _digest(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _failure(exc: Exception) -> str:
    return f"error {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def plans(out: dict, plans16: dict) -> None:
    import msc
    from msc.formats.plan_text import dump_plan
    from msc.lower.pipeline import LowerOptions, lower

    for path in sorted((ROOT / "algorithms").glob("*/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for alg in msc.load_algorithms(rel):
            for n in RANKS:
                for inplace in (True, False):
                    key = f"{rel}:{alg.name} n{n} {'in' if inplace else 'out'}"
                    try:
                        if not alg.supports(n):
                            continue
                        prog = msc.trace(alg, n, inplace=inplace)
                        out["verify " + key] = _digest(msc.verify(prog).to_dict() | {"seconds": 0})
                    except Exception as exc:              # noqa: BLE001 - the failure is the fingerprint
                        out["verify " + key] = _failure(exc)
                        continue
                    for instances in (1, 2):
                        try:
                            plan = lower(prog, LowerOptions(instances=instances))
                            out[f"plan {key} x{instances}"] = _digest(dump_plan(plan))
                            if n == 16 and not inplace and instances == 1:
                                plans16[key] = plan
                        except Exception as exc:          # noqa: BLE001
                            out[f"plan {key} x{instances}"] = _failure(exc)


LARGE = ("allreduce/ring.py", "allreduce/halving_doubling.py", "allreduce/hierarchical.py", "allgather/ring.py",
         "reducescatter/ring.py", "alltoall/allpairs.py", "allreduce/nccl_tree.py")


def large(out: dict) -> None:
    """Library plans at 128 ranks (the verifiers' and lowering's bulk paths), 1 and 4 instances."""
    import msc
    from msc.formats.plan_text import dump_plan
    from msc.lower.pipeline import LowerOptions, lower

    for rel in LARGE:
        for alg in msc.load_algorithms(f"algorithms/{rel}"):
            prog = msc.trace(alg, 128)
            key = f"algorithms/{rel}:{alg.name} n128"
            out["verify " + key] = _digest(msc.verify(prog).to_dict() | {"seconds": 0})
            for instances in (1, 4):
                try:
                    out[f"plan {key} x{instances}"] = _digest(dump_plan(lower(prog, LowerOptions(instances=instances))))
                except Exception as exc:                  # noqa: BLE001
                    out[f"plan {key} x{instances}"] = _failure(exc)


def simulations(out: dict, plans16: dict) -> None:
    from msc.sim.presets import get_topology
    from msc.sim.simulate import Simulator

    topo = get_topology("dgx-h100:2", None)
    for key, plan in plans16.items():
        try:
            records = Simulator(plan, topo).records(SIM_SIZES)
            out[f"simulate {key}"] = _digest([{k: r[k] for k in ("size", "time", "engine", "contended")}
                                              for r in records])
        except Exception as exc:                          # noqa: BLE001
            out[f"simulate {key}"] = _failure(exc)


def nccl(out: dict) -> None:
    from msc.sim.nccl_sim import simulate_nccl
    from msc.sim.presets import get_topology

    sizes = [1 << k for k in range(3, 28, 2)]
    for name in NCCL_TOPOLOGIES:
        records = simulate_nccl("allreduce", get_topology(name, None), sizes)
        for r in records:
            out[f"nccl {name} {r['size']}"] = _digest(r)


def tune(out: dict) -> None:
    from msc.sim.presets import get_topology
    from msc.sim.tune import tune as run_tune

    files = [str(ROOT / "algorithms/allreduce" / f) for f in ("ring.py", "halving_doubling.py", "hierarchical.py")]
    result = run_tune(files, 8, get_topology("dgx-h100", None), [1 << k for k in range(10, 29, 3)], workers=1)
    out["tune 8"] = _digest([[c.label, c.times] for c in result.candidates] + [result.ranges])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--only", default="plans,large,simulate,nccl,tune")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    out: dict = {}
    plans16: dict = {}
    if only & {"plans", "simulate"}:
        plans(out, plans16)
    if "large" in only:
        large(out)
    if "simulate" in only:
        simulations(out, plans16)
    if "nccl" in only:
        nccl(out)
    if "tune" in only:
        tune(out)
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(out)} fingerprints -> {args.out}")
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = sorted(k for k in set(before) | set(out) if before.get(k) != out.get(k))
    for k in differ:
        print(f"differs: {k}: {before.get(k)} -> {out.get(k)}")
    print(f"{len(differ)} of {len(set(before) | set(out))} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
