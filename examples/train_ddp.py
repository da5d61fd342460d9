"""Train a small transformer language model with DDP, gradients reduced by msc plans.

    msc compile allreduce/ring --ranks 2 -o plans/allreduce-ring-n2.plan
    torchrun --nproc_per_node 2 examples/train_ddp.py --plans plans

Synthetic data (next token = a fixed function of the previous one, plus
noise), so the loss falls within a few dozen steps; tiny dimensions, so a
CPU runs it in seconds (gloo; NCCL when CUDA is available).

    --plans DIR        plans for the hook (a directory, with plans.json size ranges or not)
    --on-msc-backend   no hook: the process group is the "msc" torch.distributed backend
                       (msc.torch.process_group), so DDP's own allreduce calls run on the plans
                       (and --check-stock trains again on a stock gloo group)
    --backend B        which engine runs the plans (msc.torch.backends): "torch" the
                       torch.distributed executor, "cuda" the msc CUDA runtime, "auto" (default)
                       the runtime for GPU gradients on one node, else the executor
    --stock            stock DDP allreduce instead of msc (the baseline)
    --check-stock      after the msc run, train again with stock DDP and fail unless the
                       per-step losses agree (to --tolerance)
    --compile-missing  cover sizes DIR has no allreduce plan for with the library ring
                       allreduce, compiled here (msc.lower.pipeline); without it such sizes are an error
    --steps N, --losses FILE (JSON list of per-step losses, written by rank 0), --quiet

Losses are the mean over ranks of each rank's batch loss (an all_reduce that
is not part of training).

Without a GPU, the CUDA runtime runs on its emulated device (msc.cuda.emu:
the same kernel built as host C++, CPU tensors, /dev/shm between the ranks):

    MSC_DEVICE=emu torchrun --nproc_per_node 2 examples/train_ddp.py --plans plans --backend cuda --check-stock

Under MSC_DEVICE=emu the model stays on the CPU even where CUDA is available
(the emulated device takes CPU tensors). The hook divides each bucket by the
world size and sums it (as stock DDP's hook does), so with 2 ranks the
losses equal stock DDP's bit for bit on either engine (one addition per
element, a+b == b+a); with more ranks the plan's summation order is not
gloo's or NCCL's, and gradients differ from stock in the last bits.
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
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TinyLM(nn.Module):
    """Token and position embeddings, causal transformer encoder layers, a linear head."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def batch(args, rank: int, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for (rank, step): x[t+1] = (5 x[t] + 3) mod vocab, 10% noise."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
    seq = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
    for t in range(args.seq):
        seq[:, t + 1] = (5 * seq[:, t] + 3) % args.vocab
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq[noise] = torch.randint(0, args.vocab, (int(noise.sum()),), generator=g)
    seq = seq.to(device)
    return seq[:, :-1], seq[:, 1:]


def plans_for(args, world: int):
    """The registry for the hook; uncovered allreduce sizes are an error
    unless --compile-missing fills them with the library ring."""
    import msc.torch as mt

    registry = mt.PlanRegistry.from_dir(args.plans) if args.plans else mt.PlanRegistry()
    gaps = registry.gaps("allreduce", world, inplace=None)
    if gaps and not args.compile_missing:
        spans = ", ".join(f"[{lo}, {'inf' if hi is None else hi}) bytes" for lo, hi in gaps)
        if dist.get_rank() == 0:
            print(f"train_ddp: {args.plans or '(no --plans)'} has no allreduce plan for {world} ranks covering "
                  f"{spans}.\n  compile one:  msc compile allreduce/ring --ranks {world} -o "
                  f"{args.plans or 'plans'}/allreduce-ring-n{world}.plan\n"
                  f"  or pass --compile-missing to compile the library ring here", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if gaps:
        import msc
        from msc.lower.pipeline import LowerOptions, lower

        [ring] = msc.load_algorithms("allreduce/ring")          # the library's, wherever msc is installed
        program = msc.trace(ring, world, inplace=True)
        msc.verify(program)
        plan = lower(program, LowerOptions())
        for lo, hi in gaps:
            registry.add(plan, min_bytes=lo, max_bytes=hi)
    return registry


def train(args, use_msc: bool, registry, device, group=None, meter=None) -> list[float]:
    """DDP over ``group``, reduced by msc's hook when ``use_msc`` with a
    registry; losses averaged over ``meter`` (default: the world)."""
    torch.manual_seed(args.seed)                       # the same initial weights on every rank and in every run
    model = TinyLM(args.vocab, args.dim, args.heads, args.layers, args.seq).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=args.bucket_cap_mb, process_group=group)
    if use_msc and registry is not None:
        import msc.torch as mt

        ddp.register_comm_hook(None, mt.allreduce_hook(registry, backend=args.backend))
    return train_steps(args, ddp, device, meter, "msc" if use_msc else "stock")


def train_steps(args, model, device, meter, label: str) -> list[float]:
    """AdamW for --steps steps on the deterministic batches; the losses
    averaged over ``meter`` (a group; None: the world), printed on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, y = batch(args, rank, step, device)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=meter)
        losses.append(mean.item() / world)
        if rank == 0 and not args.quiet:
            print(f"{label} step {step:3d} loss {losses[-1]:.6f}", flush=True)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", help="directory of msc plans (see msc.torch.PlanRegistry)")
    p.add_argument("--backend", choices=("auto", "torch", "cuda"), default="auto",
                   help="the engine running the plans: the msc CUDA runtime, the torch.distributed executor, "
                        "or auto")
    p.add_argument("--stock", action="store_true", help="stock DDP allreduce, no msc")
    p.add_argument("--on-msc-backend", action="store_true",
                   help="no hook: run DDP on the 'msc' torch.distributed backend (plans from --plans or MSC_PLANS)")
    p.add_argument("--check-stock", action="store_true", help="compare the msc losses with a stock DDP run")
    p.add_argument("--compile-missing", action="store_true", help="ring allreduce for sizes --plans lacks")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--losses", help="write the per-step losses (JSON) here (rank 0)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="relative loss difference --check-stock accepts")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a rank waits for its peers in a collective (the process group's timeout)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bucket-cap-mb", type=float, default=0.1, help="DDP bucket size (small: several buckets)")
    args = p.parse_args(argv)
    if args.stock and args.check_stock:
        p.error("--check-stock compares an msc run with stock DDP; leave out --stock")
    if args.on_msc_backend and (args.stock or args.compile_missing or args.backend != "auto"):
        p.error("--on-msc-backend takes its engine from MSC_ENGINE and its plans from --plans/MSC_PLANS; "
                "leave out --stock, --compile-missing and --backend")

    cuda = torch.cuda.is_available() and os.environ.get("MSC_DEVICE") != "emu"   # emu: CPU tensors
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # a peer that stalls mid-call is bounded by the group's timeout (msc.torch agrees on each call first)
    if args.on_msc_backend:
        import msc.torch as mt

        mt.configure(plans=args.plans)
    dist.init_process_group("msc" if args.on_msc_backend else "nccl" if cuda else "gloo",
                            timeout=timedelta(seconds=args.timeout))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    rank, world = dist.get_rank(), dist.get_world_size()
    # on the msc backend: the stock run and the loss averaging use a stock group
    stock_group = dist.new_group(backend="nccl" if cuda else "gloo") if args.on_msc_backend else None
    status = 0
    try:
        registry = None if args.stock or args.on_msc_backend else plans_for(args, world)
        losses = train(args, not args.stock, registry, device, meter=stock_group)
        if args.on_msc_backend and rank == 0 and not args.quiet:
            print(mt.report(), flush=True)
        result = {"mode": "stock" if args.stock else "msc", "world": world, "losses": losses}
        if not args.stock:
            from msc.torch import backends

            # which engine ran: a communicator per plan the CUDA runtime ran, none for the executor
            result.update(backend=args.backend, cuda_communicators=len(backends.communicators()))
            if args.on_msc_backend:
                result.update(calls=mt.served.counts(), totals=mt.served.totals())
            if rank == 0 and not args.quiet:
                engine = (f"the msc CUDA runtime, on {backends.cuda_runtime_status()[1]}" if backends.communicators()
                          else "the torch.distributed executor")
                print(f"gradients reduced by {engine}", flush=True)
        if args.check_stock:
            stock = train(args, False, None, device, group=stock_group, meter=stock_group)
            worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, stock)), default=0.0)
            result.update(stock_losses=stock, max_relative_difference=worst)
            if rank == 0:
                verdict = "match" if worst <= args.tolerance else "DIFFER from"
                print(f"msc losses {verdict} stock DDP: max relative difference {worst:.3g} over {args.steps} steps "
                      f"(tolerance {args.tolerance:g})", flush=True)
            if not worst <= args.tolerance or any(math.isnan(x) for x in losses):
                status = 1
        if rank == 0 and args.losses:
            Path(args.losses).write_text(json.dumps(result))
        if not args.stock:
            from msc.torch import backends

            backends.close_communicators()          # every rank, before the process group goes
    finally:
        # DDP models keep the group alive through reference cycles; freed only at interpreter exit, gloo's
        # threads then end in std::terminate (SIGABRT after a successful run): free them while all is alive
        gc.collect()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
