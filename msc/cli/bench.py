"""``msc bench PLAN --backend cuda ...``: a plan timed on a GPU (or the
emulated device) against PyTorch and copy baselines, in nccl-tests' columns
(the measuring is msc.cuda.bench's)."""
from __future__ import annotations

import argparse
import json

from msc.cuda.bench import DEFAULT_TIMEOUT_S, bench, format_baselines


def add_bench_command(subparsers, load_plan) -> argparse.ArgumentParser:
    """Register ``msc bench PLAN --backend cuda ...`` (exit 1 when any
    element is wrong, 2 without a GPU)."""
    from msc.ir.ops import REDUCE_OP_NAMES as OPS
    from msc.units import TYPES, size_arg

    p = subparsers.add_parser("bench", help="time a plan on a GPU against PyTorch and copy baselines "
                                            "(nccl-tests columns)")
    p.add_argument("plan", help="plan file")
    p.add_argument("--backend", choices=("cuda", "emu"), default="cuda",
                   help="cuda: the msc CUDA runtime on a GPU; emu: the same on the emulated device (checks the "
                        "benchmark, not speed)")
    p.add_argument("-b", "--minbytes", type=size_arg, default=8, help="smallest size (bytes; K, M, G)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=64 * 1024 ** 2, help="largest size (bytes; K, M, G)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between runs")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first")
    p.add_argument("-G", "--cudagraph", type=int, default=0,
                   help="capture the -n iterations in a CUDA graph and replay it this many times (0: no graph)")
    p.add_argument("-d", "--dtype", default="float", help=f"one of {', '.join(TYPES)}")
    p.add_argument("-o", "--op", choices=OPS,
                   help="the reduction (default sum; an error for collectives that do not reduce)")
    p.add_argument("-c", "--check", type=int, default=1, help="1: count wrong elements of one run per size")
    p.add_argument("--device", type=int, help="GPU index (default: the current one)")
    p.add_argument("--no-baselines", action="store_true", help="time msc only")
    p.add_argument("--seed", type=int, default=0, help="seed for the checked run's inputs")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a spin-wait may last before the kernel reports (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")

    def cmd_bench(args) -> int:
        from msc.cli.args import refuse_inapplicable
        from msc.cuda import device as cu
        from msc.units import format_table

        if args.backend == "cuda":
            cu.require_driver()                 # exit 2 with the reason, before reading anything else
        plan = load_plan(args.plan)
        refuse_inapplicable(plan.collective, op=args.op)
        out = bench(plan, min_bytes=args.minbytes, max_bytes=args.maxbytes, factor=args.stepfactor,
                    iters=args.iters, warmup=args.warmup_iters, graphs=args.cudagraph, dtype=args.dtype,
                    op=args.op or "sum", device=args.device, check=bool(args.check), seed=args.seed,
                    baselines=not args.no_baselines, backend=args.backend, timeout_s=args.timeout)
        if args.json:
            print(json.dumps(out))
        else:
            env = out["environment"]
            print(format_table(out["records"], title=f"msc bench {args.plan}: {plan.collective}, {plan.num_ranks} "
                                                     f"virtual ranks on {env['gpu']} ({env['arch']}), "
                                                     f"{plan.protocol}, graph replays {args.cudagraph}"))
            if not args.no_baselines:
                print(format_baselines(out["records"]))
        return 1 if out["wrong"] else 0

    p.set_defaults(func=cmd_bench)
    return p
