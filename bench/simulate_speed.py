"""Simulator speed at scale: 1024-rank ring and halving-doubling allreduce,
a sweep of 10 sizes, on the uniform model and on InfiniBand nodes.

    python bench/simulate_speed.py [--ranks 1024] [--lower] [--json FILE]

The ring plan is built directly in the IR (``ring_plan``), step for step what
``lower`` produces for algorithms/allreduce/ring.py out of place (checked
here against lower() at a small rank count, and in tests/test_simulate.py),
because lowering a 1024-rank ring takes minutes; halving-doubling is lowered
(seconds). ``--lower`` lowers both instead. Timed: compile_plan (plan ->
arrays), the simulator's setup (routes, layers) and the sweep itself.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import msc
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.progress import steps


def ring_plan(n: int) -> Plan:
    """The lowered out-of-place ring allreduce at n ranks, built directly."""
    ranks = []
    for r in range(n):
        def inp(i):
            return Slice("input", i % n, 1)

        def out(i):
            return Slice("output", i % n, 1)

        steps = [Step(StepOp.SEND, (inp(r - 1),), None, 1)]
        steps += [Step(StepOp.RRS, (inp(r - 1 - k),), None, 1) for k in range(1, n - 1)]
        steps.append(Step(StepOp.RRCS, (inp(r),), out(r), 1))
        steps += [Step(StepOp.RCS, (), out(r - j), 1) for j in range(1, n - 1)]
        steps.append(Step(StepOp.RECV, (), out(r + 1), 1))
        ranks.append(RankPlan(r, 0, (Threadblock(0, (r + 1) % n, (r - 1) % n, 0, tuple(steps)),)))
    return Plan("ring", "allreduce", n, n, False, n, n, tuple(ranks), root=0, protocol="Simple", instances=1,
                slots=2, tile=0)


def lowered(name: str, n: int) -> Plan:
    from msc.lower.pipeline import lower

    [alg] = msc.load_algorithms(f"allreduce/{name}")
    return lower(msc.trace(alg, n, inplace=False))


def bench(plan: Plan, topology, sizes) -> dict:
    from msc.sim.sim_plan import compile_plan
    from msc.sim.simulate import Simulator

    t0 = time.perf_counter()
    sp = compile_plan(plan)
    t1 = time.perf_counter()
    sim = Simulator(sp, topology)
    sim.run(sizes[:1])                       # builds the layers (once per plan and slot count)
    t2 = time.perf_counter()
    results = sim.run(sizes)
    t3 = time.perf_counter()
    return {"plan": plan.name, "ranks": plan.num_ranks, "steps": sp.num_steps, "topology": topology.name,
            "compile_s": round(t1 - t0, 3), "setup_s": round(t2 - t1, 3), "sweep_s": round(t3 - t2, 3),
            "total_s": round(t3 - t0, 3),
            "engines": "".join(r.engine[0] for r in results),
            "us": [round(r.seconds * 1e6, 3) for r in results]}


def main() -> None:
    from msc.sim.presets import infiniband
    from msc.sim.topology import Uniform

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--lower", action="store_true", help="lower the ring too (minutes at 1024 ranks)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    n = args.ranks
    small = 16
    assert ring_plan(small) == lowered("ring", small), "ring_plan no longer matches lower(); update it"
    t = time.perf_counter()
    plans = {"ring": lowered("ring", n) if args.lower else ring_plan(n)}
    built = {"ring": time.perf_counter() - t}
    t = time.perf_counter()
    plans["halving_doubling"] = lowered("halving_doubling", n)
    built["halving_doubling"] = time.perf_counter() - t
    sizes = [1 << e for e in range(20, 30)]          # 1 MiB .. 512 MiB: 10 sizes
    rows = []
    topologies = [Uniform(n, 2.0, 100.0)] + ([infiniband(n // 8)] if n % 8 == 0 else [])
    pairs = [(name, topo) for name in plans for topo in topologies]
    for name, topo in steps(pairs, f"simulating {n}-rank plans at {len(sizes)} sizes", unit="plan",
                            label=lambda pair: f"{pair[0]} on {pair[1].name}"):
        row = bench(plans[name], topo, sizes)
        row["build_s"] = round(built[name], 3)
        rows.append(row)
        print(f"{name:17s} {n} ranks {row['steps']:8d} steps on {topo.name:8s}: compile {row['compile_s']:.2f} s, "
              f"setup {row['setup_s']:.2f} s, sweep of {len(sizes)} sizes {row['sweep_s']:.2f} s "
              f"(total {row['total_s']:.2f} s; plan built in {built[name]:.1f} s) engines {row['engines']}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
