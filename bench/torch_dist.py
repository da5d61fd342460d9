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
        best = {}
        # batch length from one warm call per method, the same on every rank (slowest rank's)
        iters = {}
        for m in METHODS:
            run[m](t)
            start = time.perf_counter()
            run[m](t)
            spent = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            iters[m] = max(2, min(200, int(args.batch_seconds / max(spent.item(), 1e-6))))
        for _ in range(args.repeats):
            for m in METHODS:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters[m]):
                    run[m](t)
                spent = torch.tensor([(time.perf_counter() - start) / iters[m]], dtype=torch.float64)
                dist.all_reduce(spent, op=dist.ReduceOp.MAX)
                best[m] = min(best.get(m, float("inf")), spent.item())
        rows.append({"bytes": size, **{f"{m}_us": round(best[m] * 1e6, 1) for m in METHODS}})
        if rank == 0 and not args.json:
            print(f"... {n} processes, {size} bytes: " + ", ".join(f"{m} {best[m] * 1e6:.0f} us" for m in METHODS),
                  file=sys.stderr)
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
