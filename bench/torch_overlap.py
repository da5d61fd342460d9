"""FSDP2 with prefetch on the msc backend: do served async calls overlap computation?

Two CPU processes (gloo over loopback) train examples/train_ddp.py's
transformer with FSDP2 (``fully_shard`` per layer and on the model) in four
modes, interleaved over several rounds, each round timing a few steps of
each:

- ``stock``: FSDP on a stock gloo group, FSDP's defaults (on CPU every
  unshard is synchronous);
- ``stock_prefetch``: the same with explicit prefetch: each layer's
  forward all-gathers the next layer's parameters (``set_modules_to_forward_
  prefetch``), each backward the previous layer's, and unshards are
  ``async_op=True`` (``_set_unshard_async_op``), so gloo runs them behind the
  computation;
- ``msc``: FSDP's defaults on the msc backend (ring plans for allgather
  and out-of-place reducescatter: every call served, on the torch executor);
- ``msc_prefetch``: prefetch on the msc backend: the async all-gathers run on
  the group's worker thread (msc.torch.process_group);
- ``msc_prefetch_inline``: the same prefetch on a second msc group whose
  served calls all run inline, async_op or not (the backend before served
  calls could overlap: a Work already complete), so that the gain of
  running behind the caller is told apart from prefetch's reordering.

A step is forward, backward and AdamW. Wall clock (overlap is a
wall-clock effect) on a machine other jobs share drifts between rounds, so
every round runs each mode (in a rotated order) and the ratios are paired:
per round, a mode's median step over ``stock``'s (and ``msc_prefetch``'s
over ``msc``'s) in that round, then the median over rounds; the step times
printed are medians over all rounds. The losses of every mode must be
equal bit for bit (2 ranks: a two-rank sum is one addition), or the run
fails. Also printed: CPU seconds (user+sys) of rank 0 per step, which
overlap cannot lower.

    python bench/torch_overlap.py [--dim 256] [--layers 4] [--seq 64] [--batch 8] [--rounds 5] [--steps 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("stock", "stock_prefetch", "msc", "msc_prefetch", "msc_prefetch_inline")


def _plans(folder: Path, n: int) -> None:
    """The library ring of allgather (in place) and reducescatter (out of place, as FSDP calls it)."""
    import msc
    from msc.formats.plan_text import save_plan
    from msc.lower.pipeline import LowerOptions, lower

    for collective, inplace in (("allgather", True), ("reducescatter", False)):
        [ring] = msc.load_algorithms(f"{collective}/ring")
        program = msc.trace(ring, n, inplace=inplace)
        msc.verify(program)
        save_plan(lower(program, LowerOptions()), folder / f"{collective}-ring-n{n}.plan")


def _model(args, mesh, prefetch: bool):
    import torch
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(ROOT / "examples"))
    from train_ddp import TinyLM

    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.heads, args.layers, args.seq)
    layers = list(model.blocks.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if prefetch:
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
        model._set_unshard_async_op(True)
    return model


def _worker(rank: int, n: int, init: str, args, plans: str, out: str) -> None:
    os.environ["MSC_PLANS"] = plans
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import msc.torch as mt

    sys.path.insert(0, str(ROOT / "examples"))
    from train_ddp import batch

    torch.set_num_threads(1)
    dist.init_process_group("msc", init_method=init, rank=rank, world_size=n)
    stock = dist.new_group(backend="gloo")
    inline = dist.new_group(backend="msc")
    served_here = inline._run_served            # this group: every served call inline, as if synchronous
    inline._run_served = lambda job, result, background: served_here(job, result, False)
    groups = {"stock": stock, "stock_prefetch": stock, "msc": dist.group.WORLD, "msc_prefetch": dist.group.WORLD,
              "msc_prefetch_inline": inline}
    models = {}
    for mode in MODES:
        models[mode] = _model(args, DeviceMesh.from_group(groups[mode], "cpu"), "prefetch" in mode)
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=3e-3) for m in MODES}
    times = {m: [] for m in MODES}              # per round, the steps' times
    cpu = {m: [] for m in MODES}
    losses = {m: [] for m in MODES}
    step = {m: 0 for m in MODES}

    def run(mode, count, record):
        model, opt = models[mode], opts[mode]
        if record:
            times[mode].append([])
        for _ in range(count):
            x, y = batch(args, rank, step[mode], torch.device("cpu"))
            dist.barrier(group=stock)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            step[mode] += 1
            if record:
                times[mode][-1].append(dt)
                cpu[mode].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            losses[mode].append(loss.item())

    for mode in MODES:
        run(mode, 1, False)                                  # warm-up: plans prepared, buffers made
    for k in range(args.rounds):
        for mode in MODES[k % len(MODES):] + MODES[:k % len(MODES)]:       # rotated: no mode always first
            run(mode, args.steps, True)
    mt.close_communicators()
    result = {"times": times, "cpu": cpu, "losses": losses, "report": mt.report(), "totals": mt.served.totals()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="msc-overlap-") as tmp:
        plans = Path(tmp, "plans")
        plans.mkdir()
        _plans(plans, args.ranks)
        init = f"file://{tmp}/store"
        mp.start_processes(_worker, args=(args.ranks, init, args, str(plans), tmp), nprocs=args.ranks,
                           start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    first = ranks[0]
    # a step's time: the slowest rank's; per round, the median step
    rounds = {m: [statistics.median(max(r["times"][m][k][i] for r in ranks) for i in range(args.steps))
                  for k in range(args.rounds)] for m in MODES}
    median = {m: statistics.median(rounds[m]) for m in MODES}

    def paired(m, base):
        return statistics.median(a / b for a, b in zip(rounds[m], rounds[base]))
    cpu = {m: statistics.median(first["cpu"][m]) for m in MODES}
    same = all(r["losses"][m] == r["losses"]["stock"] for r in ranks for m in MODES)
    rows = [{"mode": m, "step_ms": median[m] * 1e3, "vs_stock": paired(m, "stock"),
             "vs_msc": paired(m, "msc"), "cpu_ms_rank0": cpu[m] * 1e3, "rounds_ms": [x * 1e3 for x in rounds[m]]}
            for m in MODES]
    if args.json:
        print(json.dumps({"rows": rows, "losses_equal": same, "totals": first["totals"]}))
    else:
        print(f"# FSDP2 step time, {args.ranks} CPU processes over gloo, dim {args.dim} x {args.layers} layers, "
              f"seq {args.seq}, batch {args.batch}; {args.rounds} rounds x {args.steps} steps per mode, slowest "
              f"rank's wall time; ratios paired per round, median over rounds")
        print(f"{'mode':>20} {'step (ms)':>10} {'vs stock':>9} {'vs msc':>7} {'cpu rank0 (ms)':>15}")
        for r in rows:
            print(f"{r['mode']:>20} {r['step_ms']:10.1f} {r['vs_stock']:9.2f} {r['vs_msc']:7.2f} "
                  f"{r['cpu_ms_rank0']:15.1f}")
        print(f"# losses of every mode equal bit for bit: {same}")
        print(f"# msc backend on rank 0: {first['totals']}")
        print("\n".join("# " + line for line in first["report"].splitlines()))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
