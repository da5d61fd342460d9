"""Train a small transformer language model with FSDP2 (ZeRO-3) on the "msc" torch.distributed backend.

    msc tune allgather reducescatter allreduce --ranks 2 -o plans     (or msc compile ... -o plans/X.plan)
    MSC_PLANS=plans torchrun --nproc_per_node 2 examples/train_fsdp.py --check-stock

The model code is stock PyTorch: ``fully_shard`` on each transformer layer
and on the whole model, AdamW. Only the process group differs:
``dist.init_process_group("msc")`` after ``import msc.torch``, so every
all-gather of parameters and reduce-scatter of gradients FSDP makes runs on
an msc plan (from MSC_PLANS, or --plans) where one covers it, and passes
through to gloo (NCCL for CUDA tensors) otherwise; the report at the end
says which.

    --plans DIR        the plans (instead of MSC_PLANS)
    --check-stock      train again, from the same weights and data, with FSDP on a stock gloo
                       group, and fail unless the per-step losses agree (to --tolerance)
    --tolerance T      relative loss difference accepted (default 0 with 2 ranks: a two-rank sum
                       is one addition, so msc and gloo give the same bits; 1e-5 otherwise: a plan
                       adds in its own order)
    --strict           MSC_STRICT: a call of a collective that has plans but is not served is an error
    --steps N, --losses FILE (JSON: losses, stock losses, served/passed counts; rank 0), --quiet

The batches and the model are train_ddp.py's (synthetic next-token data;
tiny dimensions: a CPU trains it in seconds). Under MSC_DEVICE=emu the
served calls run on the msc CUDA runtime's emulated device (the same
kernels a GPU would run, as host threads on CPU tensors).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import msc.torch as mt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_ddp import TinyLM, train_steps  # noqa: E402  (the sibling example's model and data)


def train(args, mesh: DeviceMesh, meter, label: str) -> list[float]:
    """FSDP2 training over ``mesh``; losses averaged over ``meter`` (a gloo group, outside training)."""
    torch.manual_seed(args.seed)                       # the same initial weights on every rank and in every run
    model = TinyLM(args.vocab, args.dim, args.heads, args.layers, args.seq)
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return train_steps(args, model, torch.device("cpu"), meter, label)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", help="directory of msc plans (default: $MSC_PLANS)")
    p.add_argument("--check-stock", action="store_true", help="compare the losses with FSDP on stock gloo")
    p.add_argument("--tolerance", type=float, help="relative loss difference --check-stock accepts")
    p.add_argument("--strict", action="store_true", help="refuse pass-through of collectives that have plans")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--losses", help="write losses and the served/passed counts (JSON) here (rank 0)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for its peers")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)

    mt.configure(plans=args.plans, strict=args.strict or None)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("msc", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    tolerance = args.tolerance if args.tolerance is not None else (0.0 if world == 2 else 1e-5)
    stock_group = dist.new_group(backend="gloo")        # loss averaging, and the stock run
    status = 0
    try:
        losses = train(args, DeviceMesh.from_group(dist.group.WORLD, "cpu"), stock_group, "msc")
        result = {"world": world, "losses": losses, "calls": mt.served.counts(), "totals": mt.served.totals()}
        if rank == 0 and not args.quiet:
            print(mt.report(), flush=True)
        if args.check_stock:
            stock = train(args, DeviceMesh.from_group(stock_group, "cpu"), stock_group, "stock")
            worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, stock)), default=0.0)
            result.update(stock_losses=stock, max_relative_difference=worst, tolerance=tolerance)
            if rank == 0:
                verdict = "match" if worst <= tolerance else "DIFFER from"
                print(f"msc losses {verdict} stock FSDP on gloo: max relative difference {worst:.3g} over "
                      f"{args.steps} steps (tolerance {tolerance:g})", flush=True)
            if not worst <= tolerance:
                status = 1
        if any(math.isnan(x) for x in losses):
            status = 1
        if rank == 0 and args.losses:
            Path(args.losses).write_text(json.dumps(result))
        mt.close_communicators()                       # every rank (the CUDA runtime's, under MSC_DEVICE=emu)
    finally:
        gc.collect()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
