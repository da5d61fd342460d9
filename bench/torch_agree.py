"""What msc.torch's agreement (msc.torch.agree) costs per call.

    python bench/torch_agree.py [--ranks 2] [--calls 1000] [--store tcp|file]

Starts ``--ranks`` gloo processes on this machine (a TCP store as under
torchrun, or a FileStore) and times, per call, in alternating blocks (the
fastest block: the least disturbed by whatever else the machine runs):

- msc all_reduce calls (ring and allpairs plans; 64 B, 1 MiB, 32 MiB) with
  the check on and off (MSC_TORCH_AGREE=0): the overhead is the difference;
- the check alone (``Gate.agree`` with a cached signature);
- what a check over the process group would cost instead: a gloo
  all_gather_into_tensor of one int64 per rank.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(rank: int, n: int, init: str, calls: int, blocks: int, results) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests"))
    from torchdist import library_plan

    import msc.torch as mt
    from msc.torch import agree

    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n)
    plans = {"ring": library_plan("allreduce/ring:ring", n, True),
             "allpairs": library_plan("allreduce/allpairs:allpairs", n, True)}

    def timed(fn, reps: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6

    rows = []
    for name, plan in plans.items():
        for numel in (16, 1 << 18, 1 << 23):
            t = torch.ones(numel)
            reps = calls if numel < 1024 else max(10, calls // 20) if numel < 1 << 20 else max(4, calls // 200)
            on, off = [], []
            for b in range(blocks):
                for mode in (("on", "off") if b % 2 == 0 else ("off", "on")):
                    os.environ["MSC_TORCH_AGREE"] = "1" if mode == "on" else "0"
                    (on if mode == "on" else off).append(timed(lambda: mt.all_reduce(plan, t), reps))
            os.environ["MSC_TORCH_AGREE"] = "1"
            rows.append((f"msc all_reduce {name}, {_size(numel * 4)}", min(off), min(on)))
    # the check alone, with a cached signature
    from msc.torch.execute import prepare

    prepared = prepare(plans["ring"])
    sig = agree.signature(prepared, 16, torch.float32, "sum", "mixed", "torch", "cpu")
    gate = agree.gate(None, rank, n)
    alone = [timed(lambda: gate.agree(sig, "bench"), calls) for _ in range(blocks)]
    rows.append(("the check alone (Gate.agree)", None, min(alone)))
    mine, out = torch.tensor([12345], dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    gathered = [timed(lambda: dist.all_gather_into_tensor(out, mine), calls) for _ in range(blocks)]
    rows.append(("gloo all_gather_into_tensor, 8 bytes per rank", None, min(gathered)))
    barriers = [timed(lambda: dist.barrier(), calls) for _ in range(blocks)]
    rows.append(("gloo barrier", None, min(barriers)))
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1000, help="calls per block (small messages)")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--store", choices=("tcp", "file"), default="tcp")
    args = ap.parse_args()
    import socket

    import torch.multiprocessing as mp

    if args.store == "tcp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    else:
        init = f"file://{tempfile.mktemp(prefix='msc-agree-bench-')}"
    os.environ.setdefault("MSC_CACHE_DIR", tempfile.mkdtemp(prefix="msc-bench-cache-"))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, init, args.calls, args.blocks, results))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = results.get(timeout=3600)
    for p in procs:
        p.join()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.ranks} gloo processes, {args.store} store, {os.cpu_count()} CPUs (load average {load:.1f} after); "
          f"microseconds per call, fastest of {args.blocks} blocks")
    print(f"| {'call':<48} | {'check off':>9} | {'check on':>9} | {'overhead':>9} |")
    print(f"|{'-' * 50}|{'-' * 11}|{'-' * 11}|{'-' * 11}|")
    for name, off, on in rows:
        if off is None:
            print(f"| {name:<48} | {'':>9} | {on:9.1f} | {'':>9} |")
        else:
            print(f"| {name:<48} | {off:9.1f} | {on:9.1f} | {on - off:+9.1f} |  {100 * (on - off) / off:+.0f}%")


if __name__ == "__main__":
    main()
