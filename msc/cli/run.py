"""``msc run``: run a plan over a range of sizes, check every result against
msc.verification.reference and report nccl-tests columns.

Backends: ``sim``, the reference executor (numpy, one process); ``emu``, the
plan's CUDA kernel on the emulated device (msc.cuda.emu: the rendered source
built as host C++, every rank's blocks as threads on the CPU, driven by
msc.cuda.Communicator). Both run on the host, so their times say nothing
about a GPU: the table shows host wall time per call and no bandwidth.

Sizes are nccl-tests sizes: bytes per rank of the largest buffer, i.e. the
per-rank buffer for allreduce/broadcast/reduce and the whole gathered array
(count * nranks * typesize) for allgather, reducescatter and alltoall. The
count column is the element count per data unit (the NCCL count). A size
below one element per unit (a run of 0 bytes) is an error naming the smallest
size that runs; a size that is not a whole number of elements per unit is
rounded down, and the record keeps the requested size and says ``rounded``.

Inputs are random and never zero (msc.verification.reference.random_inputs,
seeded). Outputs start poisoned (bytes 0xA5).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

from msc.cli.args import add_collective_arg, collective_kw, refuse_inapplicable
from msc.dsl.collectives import BUILTIN, REDUCING
from msc.errors import UsageError
from msc.ir.ops import REDUCE_OP_NAMES, reduce_op
from msc.lower.runtimes import add_capacity_args, capacity_args
from msc.progress import steps
from msc.units import TYPES, format_size, format_table, parse_dtype, parse_size, size_arg, sizes

# numpy (and the executor) are imported where used: registering the command
# must not import them, the CLI starts without numpy.

OPS = REDUCE_OP_NAMES


def _sim(plan, collective=None):
    from msc.executor import Executor, load_inputs, read_outputs

    ex = Executor(plan, collective=collective)

    def run(inputs, *, count, op):
        buffers, _ = load_inputs(ex, inputs, count)      # fresh: in-place runs overwrite their input
        ex.run(buffers, count=count, op=op)
        return read_outputs(ex, buffers, count)
    return run


def _emu(plan, collective=None):
    from msc.cuda.bench import run_numpy
    from msc.cuda.runtime import Communicator

    comm = Communicator(plan, "virtual", device="emu", dtypes=(), ops=(), collective=collective)

    def run(inputs, *, count, op):
        return run_numpy(comm, inputs, count, op)

    def prepare(dtype: str, op: str) -> None:        # build the kernel before anything is timed
        from msc.cuda.validate import check_op

        comm._kernel(comm.devices[0], dtype, check_op(plan, op, dtype))
    run.prepare = prepare
    return run


# Backend name -> factory(plan, collective) -> run(inputs, *, count, op) -> outputs, on per-rank logical numpy arrays.
BACKENDS: dict[str, Callable] = {"sim": _sim, "emu": _emu}
BACKEND_HELP = {"sim": "the reference executor (numpy, one process)",
                "emu": "the plan's CUDA kernel on the emulated device (host threads; no GPU needed)"}


def sweep(plan, *, min_bytes=None, max_bytes, factor: int = 2, dtype="float", op: str = "sum", iters: int = 1,
          seed: int = 0, backend: str = "sim", collective=None) -> list[dict]:
    """One record per size (JSON-ready dicts, see format_table). ``min_bytes``
    None: 8, or the plan's smallest size (smallest_size) where that is more; a
    size below the smallest is an error saying it. A size that is not whole
    elements per unit is rounded down (the record says ``rounded``)."""
    import numpy as np

    from msc.verification import reference
    from msc.verification.plan import plan_collective
    from msc.units import buffer_elements

    reduce_op(op)
    if type(iters) is not int or iters < 1:
        raise UsageError(f"iterations must be an int >= 1, got {iters!r}")
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r} (available: {', '.join(BACKENDS)})")
    tname, dt = parse_dtype(dtype)
    coll = plan_collective(plan, collective)
    builtin = coll.name in BUILTIN and type(coll) is BUILTIN[coll.name]
    n, k = plan.num_ranks, plan.chunk_factor
    chunks_in, chunks_big = plan.input_chunks, max(plan.input_chunks, plan.output_chunks)
    least = smallest_size(plan, dt.itemsize)
    min_bytes = max(DEFAULT_MIN_BYTES, least) if min_bytes is None else parse_size(min_bytes)
    if min_bytes < least:
        raise UsageError(f"size {min_bytes} B is too small for plan {plan.name!r} ({n}-rank {plan.collective}, "
                         f"{chunks_big} chunks of {tname} per rank in its largest buffer): it would hold no "
                         f"element, and run 0 bytes; the smallest size that runs is {least} B (-b {least})")
    _check_memory(plan, max(sizes(min_bytes, parse_size(max_bytes), factor), default=0), dt.itemsize)
    run = BACKENDS[backend](plan, collective)
    if hasattr(run, "prepare"):
        run.prepare(dt.name, op)
    reducing = coll.name in REDUCING if builtin else \
        any(step.op.reduces for _, _, _, step in plan.steps())
    rng = np.random.default_rng(seed)
    records = []
    for requested in steps(sizes(min_bytes, parse_size(max_bytes), factor),
                           f"running {plan.name} ({backend}) and checking it against numpy", unit="size"):
        count = requested * k // (dt.itemsize * chunks_big) if chunks_big else 0
        size = buffer_elements(chunks_big, count, k) * dt.itemsize
        inputs = reference.random_inputs(rng, dt, op, n, buffer_elements(chunks_in, count, k))
        seconds = 0.0
        for _ in range(iters):
            start = time.perf_counter()
            outputs = run([x.copy() for x in inputs], count=count, op=op)
            seconds += time.perf_counter() - start
        wrong = reference.check(coll.name, inputs, outputs, op=op, root=plan.root) if builtin else \
            reference.check_stated(coll, inputs, outputs, k=k, count=count, op=op, root=plan.root)
        records.append({
            "size": size, "count": count, "type": tname, "redop": op if reducing else "none",
            "root": plan.root if coll.has_root else -1, "host_time": seconds / iters * 1e6,
            "wrong": sum(wrong), "wrong_per_rank": wrong, "inplace": plan.inplace,
            "requested_size": requested, "rounded": size != requested,
        })
    return records


DEFAULT_MIN_BYTES = 8             # msc run's -b where the plan runs it


def smallest_size(plan, itemsize: int) -> int:
    """The least size (bytes, as -b takes it) that gives ``plan`` one element
    per data unit: below it the count is 0 and a run moves nothing."""
    chunks_big = max(plan.input_chunks, plan.output_chunks)
    return -(-itemsize * chunks_big // plan.chunk_factor) if chunks_big else 0


# Arrays of a run at its largest size, in multiples of one rank's largest buffer: the inputs, a
# copy per call, the physical buffers and the outputs (a copy), the reference's result, and slack.
RUN_COPIES = 6


def _check_memory(plan, largest: int, itemsize: int) -> None:
    """Refuse a sweep whose largest size would not fit in this machine's memory (before allocating)."""
    need = RUN_COPIES * plan.num_ranks * largest
    total = _physical_memory()
    if total and need > total // 2:
        raise UsageError(f"the largest size ({format_size(largest)} per rank x {plan.num_ranks} ranks) needs about "
                         f"{need / 2 ** 30:.1f} GiB of host memory here, over half of this machine's "
                         f"{total / 2 ** 30:.1f} GiB: lower -e")


def _physical_memory() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):      # not POSIX: no estimate
        return 0


def add_run_command(subparsers, load_plan: Callable) -> argparse.ArgumentParser:
    """Register ``msc run PLAN --backend sim [-b MIN -e MAX -f FACTOR] ...``;
    ``load_plan(path, **capacity)`` returns a Plan (``slots=``, ``runtime=``
    when given: msc.lower.runtimes.capacity_args). The command exits 1 when any element
    is wrong, else 0."""
    p = subparsers.add_parser("run", help="run a plan over a range of sizes and check it (nccl-tests columns)")
    p.add_argument("plan", help="plan file")
    p.add_argument("--backend", choices=tuple(BACKENDS), default="sim",
                   help="; ".join(f"{name}: {text}" for name, text in BACKEND_HELP.items()))
    p.add_argument("-b", "--minbytes", type=size_arg,
                   help=f"smallest size (bytes; K, M, G; default {DEFAULT_MIN_BYTES}, or the plan's smallest if "
                        "more: one element per data unit; a smaller -b is an error saying it)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=1024 ** 2, help="largest size (bytes; K, M, G)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between runs")
    p.add_argument("-n", "--iters", type=int, default=1, help="runs per size (host time is their mean)")
    p.add_argument("-d", "--dtype", default="float", help=f"one of {', '.join(TYPES)}")
    p.add_argument("-o", "--op", choices=OPS,
                   help="the reduction (default sum; an error for collectives that do not reduce)")
    p.add_argument("-r", "--root", type=int,
                   help="rooted collectives: must match the plan's root (a plan is built for one root; an error "
                        "for the others)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random inputs")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")
    add_capacity_args(p)
    add_collective_arg(p)

    def cmd_run(args) -> int:
        from pathlib import Path

        from msc.formats.load import plan_reader
        from msc.verification.plan import plan_collective

        if args.backend == "sim" and Path(args.plan).is_file() and plan_reader(args.plan) == "mscclpp":
            # an MSCCL++ plan of any shape: run in its executor's model
            from msc.cli.run_mscclpp import cmd_run_mscclpp

            return cmd_run_mscclpp(args)
        coll = collective_kw(args)
        plan = load_plan(args.plan, **capacity_args(args), **coll)
        refuse_inapplicable(plan.collective, op=args.op, root=args.root)
        if args.root is not None and plan_collective(plan, coll.get("collective")).has_root and \
                args.root != plan.root:
            raise UsageError(f"the plan was built for root {plan.root}, not {args.root}; compile one for that root")
        records = sweep(plan, min_bytes=args.minbytes, max_bytes=args.maxbytes, factor=args.stepfactor,
                        dtype=args.dtype, op=args.op or "sum", iters=args.iters, seed=args.seed,
                        backend=args.backend, **coll)
        wrong = sum(r["wrong"] for r in records)
        if args.json:
            print(json.dumps({"plan": plan.name, "collective": plan.collective, "ranks": plan.num_ranks,
                              "backend": args.backend, "inplace": plan.inplace, "wrong": wrong,
                              "records": records}))
        else:
            about = BACKEND_HELP[args.backend]
            if args.backend == "emu":
                from msc.cuda.codegen import NTHREADS
                from msc.cuda.emu import threads_per_block

                gpu = NTHREADS[plan.protocol]
                about += f"; {threads_per_block(gpu)} threads per block where a GPU runs {gpu}"
            print(format_table(records, title=f"msc run {args.plan}: {plan.collective}, {plan.num_ranks} ranks, "
                                              f"backend {args.backend} ({about})"))
        return 1 if wrong else 0

    p.set_defaults(func=cmd_run)
    return p
