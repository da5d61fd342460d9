"""msc allreduce plans over gloo versus gloo's own allreduce, on one machine.

For each process count (default 2 and 4) the script starts that many CPU
processes (gloo over loopback TCP) and times, per message size, in-place
float32 allreduce by ``torch.distributed.all_reduce`` and by the library's
ring, allpairs and halving-doubling (hd) plans run with
``msc.torch.run_plan``. The default transport on gloo is "mixed": one
all_to_all_single for each round where most pairs of ranks talk,
point-to-point messages for the others; the ring_p2p and ring_a2a columns
run the ring over only one of them. hand_ring is a ring allreduce written
by hand over gloo's send/recv, without msc: the floor for any schedule
issued from Python as rounds of point-to-point messages. A time is the
slowest rank's mean over a batch of calls; each method is measured in
several interleaved batches and the fastest batch counts (the machine's
noise only ever adds time). Prints one table per process count with the
ratio method / gloo per size and whether the goal (the best msc plan
within 1.25x of gloo from 1 MB up) is met.

    python bench/torch_dist.py [--ranks 2 4] [--min 4K] [--max 64M] [--factor 4] [--json]

``--backend`` measures the "msc" torch.distributed backend instead
(msc.torch.process_group), for allreduce, reducescatter and allgather
(float32; default 1M to 64M, 2 processes): ``gloo`` is the call on a plain
gloo group; ``backend`` the same torch.distributed call on an msc group
whose MSC_PLANS hold the library ring of each collective (served:
msc.torch's torch executor over the wrapped gloo); ``run_plan`` that ring
through ``msc.torch.run_plan`` on the gloo group (the plan without the
backend around it); ``pass`` the call on an msc group with no plan for it
(passed through to its gloo); ``gloo_again`` the gloo call measured a
second time, the run's own noise. Goals: backend within 1.25x of gloo from 1M
up, pass within 5% of gloo.

    python bench/torch_dist.py --backend [--ranks 2] [--min 1M] [--max 64M]

More processes than cores oversubscribe the machine: every process spins
in its own communication, so such timings say little about either side.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

GOAL_RATIO, GOAL_FROM = 1.25, 1 << 20
METHODS = ("gloo", "ring", "allpairs", "hd", "ring_p2p", "ring_a2a", "hand_ring")
MSC_METHODS = ("ring", "allpairs", "hd", "ring_p2p", "ring_a2a")


def hand_ring(pg, x, rank: int, n: int, stage) -> None:
    """A ring allreduce written by hand over gloo's send/recv (no msc): the
    floor for any schedule issued from Python as rounds of point-to-point
    messages. Assumes n divides x's length (the benchmark's sizes do)."""
    chunks = x.view(n, -1)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for t in range(2 * (n - 1)):
        works = [pg.recv([stage], prv, 7), pg.send([chunks[(rank - t) % n]], nxt, 7)]
        for work in works:
            work.wait()
        into = chunks[(rank - t - 1) % n]
        if t < n - 1:
            into.add_(stage)
        else:
            into.copy_(stage)


def _plans(n: int, instances: int):
    import msc
    from msc.lower.pipeline import LowerOptions, lower

    plans = {}
    for name in ("ring", "allpairs", "halving_doubling"):
        [alg] = msc.load_algorithms(f"allreduce/{name}")
        program = msc.trace(alg, n, inplace=True)
        msc.verify(program)
        plans[name] = lower(program, LowerOptions(instances=instances))
    return plans


def _worker(rank: int, n: int, init_file: str, sizes: list[int], args, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    import msc.torch as mt

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n)
    plans = _plans(n, args.instances)
    run = {"gloo": lambda t: dist.all_reduce(t),
           "ring": lambda t: mt.run_plan(plans["ring"], t, transport=args.transport),
           "allpairs": lambda t: mt.run_plan(plans["allpairs"], t, transport=args.transport),
           "hd": lambda t: mt.run_plan(plans["halving_doubling"], t, transport=args.transport),
           "ring_p2p": lambda t: mt.run_plan(plans["ring"], t, transport="p2p"),
           "ring_a2a": lambda t: mt.run_plan(plans["ring"], t, transport="alltoall"),
           "hand_ring": lambda t: hand_ring(pg, t, rank, n, stages[t.numel()])}
    pg = dist.distributed_c10d._get_default_group()
    stages = {size // 4: torch.empty(size // 4 // n) for size in sizes}
    rows = []
    for size in sizes:
        t = torch.rand(size // 4) + 1
        best = _timed(run, lambda m: t, METHODS, args)
        rows.append({"bytes": size, **{f"{m}_us": round(best[m] * 1e6, 1) for m in METHODS}})
        if rank == 0 and not args.json:
            print(f"... {n} processes, {size} bytes: " + ", ".join(f"{m} {best[m] * 1e6:.0f} us" for m in METHODS),
                  file=sys.stderr)
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _timed(run: dict, t_for, methods, args) -> dict:
    """Per method, the fastest of ``args.repeats`` interleaved batches'
    mean call time (the slowest rank's), batch length from one warm call."""
    import torch
    import torch.distributed as dist

    stock = _stock()
    iters, best = {}, {}
    for m in methods:
        run[m](t_for(m))
        start = time.perf_counter()
        run[m](t_for(m))
        spent = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=stock)
        iters[m] = max(2, min(200, int(args.batch_seconds / max(spent.item(), 1e-6))))
    for _ in range(args.repeats):
        for m in methods:
            dist.barrier(group=stock)
            start = time.perf_counter()
            for _ in range(iters[m]):
                run[m](t_for(m))
            spent = torch.tensor([(time.perf_counter() - start) / iters[m]], dtype=torch.float64)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=stock)
            best[m] = min(best.get(m, float("inf")), spent.item())
    return best


_STOCK = []


def _stock():
    import torch.distributed as dist

    return _STOCK[0] if _STOCK else dist.distributed_c10d._get_default_group()


BACKEND_COLLECTIVES = ("allreduce", "reducescatter", "allgather")
BACKEND_METHODS = ("gloo", "gloo_again", "backend", "run_plan", "pass")
PASS_GOAL = 1.05


def _backend_worker(rank: int, n: int, init_file: str, sizes: list[int], args, out_file: str, plans: str,
                    empty: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    import msc.torch as mt

    warnings.simplefilter("ignore", FutureWarning)     # all_gather_into_tensor & co are being renamed
    torch.set_num_threads(args.threads)
    mt.configure(plans=plans)
    dist.init_process_group("msc", init_method=f"file://{init_file}", rank=rank, world_size=n)
    stock = dist.new_group(backend="gloo")
    _STOCK.append(stock)
    mt.configure(plans=empty)
    passing = dist.new_group(backend="msc")
    registry = mt.PlanRegistry.from_dir(plans)
    calls = {
        "allreduce": lambda g, t: dist.all_reduce(t["x"], group=g),
        "reducescatter": lambda g, t: dist.reduce_scatter_tensor(t["part"], t["whole"], group=g),
        "allgather": lambda g, t: dist.all_gather_into_tensor(t["whole"], t["part"], group=g),
    }
    plan_calls = {
        "allreduce": lambda t: mt.all_reduce(registry, t["x"], group=stock),
        "reducescatter": lambda t: mt.reduce_scatter(registry, t["part"], t["whole"], group=stock),
        "allgather": lambda t: mt.all_gather(registry, t["whole"], t["part"], group=stock),
    }
    rows = []
    for coll in BACKEND_COLLECTIVES:
        for size in sizes:
            elems = size // 4
            t = {"x": torch.rand(elems) + 1, "whole": torch.rand(elems) + 1, "part": torch.rand(elems // n) + 1}
            call = calls[coll]
            run = {"gloo": lambda _, c=call: c(stock, t), "gloo_again": lambda _, c=call: c(stock, t),
                   "backend": lambda _, c=call: c(dist.group.WORLD, t),
                   "run_plan": lambda _, c=plan_calls[coll]: c(t), "pass": lambda _, c=call: c(passing, t)}
            best = _timed(run, lambda m: None, BACKEND_METHODS, args)
            rows.append({"collective": coll, "bytes": size,
                         **{f"{m}_us": round(best[m] * 1e6, 1) for m in BACKEND_METHODS}})
            if rank == 0 and not args.json:
                print(f"... {coll} {n} processes, {size} bytes: "
                      + ", ".join(f"{m} {best[m] * 1e6:.0f} us" for m in BACKEND_METHODS), file=sys.stderr)
    totals = mt.served.totals()
    if rank == 0:
        Path(out_file).write_text(json.dumps({"rows": rows, "totals": totals, "report": mt.report()}))
    dist.destroy_process_group(passing)
    dist.destroy_process_group(stock)
    dist.destroy_process_group()


def _backend_plans(folder: Path, n: int) -> None:
    """The library ring of each measured collective, for all sizes."""
    import msc
    from msc.formats.plan_text import save_plan
    from msc.lower.pipeline import LowerOptions, lower

    for coll in BACKEND_COLLECTIVES:
        [alg] = msc.load_algorithms(f"{coll}/ring")
        for inplace in (True, False):
            try:
                program = msc.trace(alg, n, inplace=inplace)
            except msc.MscError:
                continue                          # an algorithm of one form only
            msc.verify(program)
            save_plan(lower(program, LowerOptions(instances=1)), folder / f"{coll}-ring-{'in' if inplace else 'out'}.plan")


def measure_backend(n: int, sizes: list[int], args) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        plans, empty = Path(tmp, "plans"), Path(tmp, "empty")
        plans.mkdir()
        empty.mkdir()
        _backend_plans(plans, n)
        # the pass-through group needs plans of something else: a broadcast it never uses
        import msc
        from msc.formats.plan_text import save_plan
        from msc.lower.pipeline import LowerOptions, lower

        [chain] = msc.load_algorithms("broadcast/chain")
        program = msc.trace(chain, n, inplace=True, root=0)
        msc.verify(program)
        save_plan(lower(program, LowerOptions()), empty / "broadcast-chain.plan")
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "rows.json")
        mp.spawn(_backend_worker, args=(n, init_file, sizes, args, out_file, str(plans), str(empty)), nprocs=n)
        result = json.loads(Path(out_file).read_text())
        result["overhead"] = measure_overhead(str(plans))
        return result


def _overhead_worker(rank: int, init_file: str, plans: str, out_file: str) -> None:
    """One process (world size 1): a 1 KB call passed through the msc backend
    against the same call on gloo, per-call time; the difference is what the
    backend's Python adds to every call it passes through."""
    import warnings

    import torch
    import torch.distributed as dist

    import msc.torch as mt

    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    mt.configure(plans=plans)                      # plans for 2 ranks: every call here passes through
    dist.init_process_group("msc", init_method=f"file://{init_file}", rank=0, world_size=1)
    stock = dist.new_group(backend="gloo")
    x, o = torch.ones(256), torch.empty(256)
    calls = {"allreduce": lambda g: dist.all_reduce(x, group=g),
             "allgather": lambda g: dist.all_gather_into_tensor(o, x, group=g),
             "reducescatter": lambda g: dist.reduce_scatter_tensor(x, o, group=g)}

    def per_call(fn, n=3000):
        for _ in range(200):
            fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    out = {}
    for coll, call in calls.items():
        gloo = min(per_call(lambda: call(stock)) for _ in range(7))
        passed = min(per_call(lambda: call(dist.group.WORLD)) for _ in range(7))
        out[coll] = {"gloo_us": round(gloo, 1), "pass_us": round(passed, 1)}
    Path(out_file).write_text(json.dumps(out))
    dist.destroy_process_group(stock)
    dist.destroy_process_group()


def measure_overhead(plans: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "overhead.json")
        mp.spawn(_overhead_worker, args=(os.path.join(tmp, "init"), plans, out_file), nprocs=1)
        return json.loads(Path(out_file).read_text())


def render_backend(n: int, result: dict) -> str:
    rows = result["rows"]
    lines = [f"{n} processes (gloo, CPU, float32; times in us; ratio = method / gloo): backend = the torch.distributed "
             f"call on the msc backend (ring plans, served), run_plan = msc.torch.run_plan of the same ring on the "
             f"gloo group, pass = the call on an msc group without a plan for it (passed through to gloo)",
             f"{'collective':>13} {'size':>6} {'gloo':>10} " + " ".join(f"{m:>10} {'ratio':>6}"
                                                                        for m in BACKEND_METHODS[1:])]
    for row in rows:
        g = row["gloo_us"]
        lines.append(f"{row['collective']:>13} {_size(row['bytes']):>6} {g:10.1f} "
                     + " ".join(f"{row[m + '_us']:10.1f} {row[m + '_us'] / g:6.2f}" for m in BACKEND_METHODS[1:]))
    big = [r for r in rows if r["bytes"] >= GOAL_FROM]
    if big:
        worst = max(r["backend_us"] / r["gloo_us"] for r in big)
        lines.append(f"goal: the msc backend within {GOAL_RATIO}x of gloo from 1M up: "
                     f"{'met' if worst <= GOAL_RATIO else 'MISSED'} (worst {worst:.2f}x)")
        worst_pass = max(r["pass_us"] / r["gloo_us"] for r in big)
        noise = max(max(r["gloo_again_us"] / r["gloo_us"], r["gloo_us"] / r["gloo_again_us"]) for r in big)
        lines.append(f"goal: pass-through within {PASS_GOAL:.2f}x of gloo: "
                     f"{'met' if worst_pass <= PASS_GOAL else 'MISSED'} (worst {worst_pass:.2f}x; the same gloo call "
                     f"measured twice differs by up to {noise:.2f}x in this run)")
    lines.append(f"calls counted by the msc backend on rank 0 (warm-up included): {result['totals']}")
    over = result.get("overhead", {})
    if over:
        lines.append("pass-through cost per call, one process, 1 KB (us): " + ", ".join(
            f"{c} gloo {v['gloo_us']:.1f} / passed {v['pass_us']:.1f} (+{v['pass_us'] - v['gloo_us']:.1f})"
            for c, v in over.items()))
        for c, v in over.items():
            at = [r for r in rows if r["collective"] == c and r["bytes"] == GOAL_FROM]
            if at:
                lines.append(f"  {c}: that is {100 * (v['pass_us'] - v['gloo_us']) / at[0]['gloo_us']:.1f}% of "
                             f"gloo's 1M time here")
    return "\n".join(lines)


def measure(n: int, sizes: list[int], args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(n, init_file, sizes, args, out_file), nprocs=n)
        return json.loads(Path(out_file).read_text())


def _size(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def render(n: int, rows: list[dict]) -> str:
    lines = [f"{n} processes (gloo, CPU, float32 in-place allreduce; times in us; ratio = method / gloo; ring, "
             f"allpairs and hd (halving-doubling) over the default transport, ring_p2p and ring_a2a over p2p and "
             f"alltoall only, hand_ring: no msc)",
             f"{'size':>6} {'gloo':>10} " + " ".join(f"{m:>10} {'ratio':>6}" for m in METHODS[1:])]
    for row in rows:
        g = row["gloo_us"]
        lines.append(f"{_size(row['bytes']):>6} {g:10.1f} "
                     + " ".join(f"{row[m + '_us']:10.1f} {row[m + '_us'] / g:6.2f}" for m in METHODS[1:]))
    big = [r for r in rows if r["bytes"] >= GOAL_FROM]
    if big:
        worst = max(min(r[m + "_us"] for m in MSC_METHODS) / r["gloo_us"] for r in big)
        verdict = "met" if worst <= GOAL_RATIO else "MISSED"
        lines.append(f"goal: best msc plan within {GOAL_RATIO}x of gloo from 1M up: {verdict} (worst {worst:.2f}x)")
        floor = max(r["hand_ring_us"] / r["gloo_us"] for r in big)
        lines.append(f"hand-written ring over gloo send/recv (no msc), from 1M up: worst {floor:.2f}x of gloo")
    if n > (os.cpu_count() or 1):
        lines.append(f"note: {n} processes on {os.cpu_count()} cores: oversubscribed, every process competes for a core")
    return "\n".join(lines)


def main(argv=None) -> int:
    from msc.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="process counts")
    parser.add_argument("--min", default="4K", help="smallest message (bytes; K/M/G suffixes)")
    parser.add_argument("--max", default="64M", help="largest message")
    parser.add_argument("--factor", type=int, default=4, help="size step factor")
    parser.add_argument("--instances", type=int, default=1, help="instances of the msc plans")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--transport", default="auto", help="msc.torch transport of the ring and allpairs columns")
    parser.add_argument("--repeats", type=int, default=5, help="batches per method and size (fastest counts)")
    parser.add_argument("--batch-seconds", type=float, default=0.1, help="target length of one batch")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--backend", action="store_true",
                        help="measure the msc torch.distributed backend (allreduce, reducescatter, allgather)")
    args = parser.parse_args(argv)
    if args.backend:
        return backend_main(parser, args, argv or sys.argv[1:])
    sizes, size = [], parse_size(args.min)
    while size <= parse_size(args.max):
        sizes.append(size)
        size *= args.factor
    for n in args.ranks:
        if any((size // 4) % n for size in sizes):
            parser.error(f"hand_ring needs every size's element count divisible by {n} processes")
    results = {}
    for n in args.ranks:
        results[n] = measure(n, sizes, args)
        if not args.json:
            print(render(n, results[n]) + "\n", flush=True)
    if args.json:
        print(json.dumps({"cores": os.cpu_count(), "results": results}, indent=2))
    return 0


def backend_main(parser, args, argv) -> int:
    from msc.units import parse_size

    given = " ".join(argv)
    ranks = args.ranks if "--ranks" in given else [2]
    lo = parse_size(args.min if "--min" in given else "1M")
    hi = parse_size(args.max)
    sizes = []
    while lo <= hi:
        sizes.append(lo)
        lo *= args.factor
    results = {}
    for n in ranks:
        if any((size // 4) % n for size in sizes):
            parser.error(f"every size's element count must be divisible by {n} processes")
        results[n] = measure_backend(n, sizes, args)
        if not args.json:
            print(render_backend(n, results[n]) + "\n", flush=True)
    if args.json:
        print(json.dumps({"cores": os.cpu_count(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
