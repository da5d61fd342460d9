"""``msc run X.json --backend sim``: an MSCCL++ execution plan, of any shape
msc checks (memory channels), run in msc's model of the MSCCL++ executor
(msc.verification.onesided_run) at each size and checked against numpy, in
the columns of ``msc run``.

Sizes follow the executor: a rank's buffers are whole 16-byte units per
chunk (its checkMessageSize), so a size is rounded down to a multiple of
16 bytes times the chunks of the largest buffer, and the record says so. The
executor reduces with sum only.
"""
from __future__ import annotations

import json
import time

from msc.cli.args import collective_kw
from msc.errors import UsageError
from msc.units import format_table, parse_dtype, parse_size, sizes

UNIT = 16


def cmd_run_mscclpp(args) -> int:
    from msc.files import read_input
    from msc.formats.mscclpp.check import stated_collective
    from msc.formats.mscclpp.limits import check_limits
    from msc.formats.mscclpp.reader import parse_mscclpp
    from msc.errors import PlanError
    from msc.ir.limits import MAX_PLAN_FILE_BYTES

    for flag, value in (("--slots", args.slots), ("--runtime", args.runtime)):
        if value is not None:
            raise UsageError(f"{flag} applies to msc plans and MSCCL XML; {args.plan} is an MSCCL++ execution plan")
    plan = parse_mscclpp(read_input(args.plan, MAX_PLAN_FILE_BYTES, what="plan", error=PlanError), path=args.plan)
    check_limits(plan)
    records = sweep_mscclpp(plan, min_bytes=args.minbytes, max_bytes=args.maxbytes, factor=args.stepfactor,
                            dtype=args.dtype, op=args.op, iters=args.iters, seed=args.seed, root=args.root,
                            collective=stated_collective(plan, collective_kw(args).get("collective")))
    wrong = sum(r["wrong"] for r in records)
    if args.json:
        print(json.dumps({"plan": plan.name, "collective": plan.collective, "ranks": plan.num_ranks,
                          "backend": "sim", "format": "mscclpp", "inplace": plan.inplace, "wrong": wrong,
                          "records": records}))
    else:
        print(format_table(records, title=f"msc run {args.plan}: {plan.collective}, {plan.num_ranks} ranks, "
                                          f"backend sim (msc's model of the MSCCL++ executor, numpy)"))
    return 1 if wrong else 0


def sweep_mscclpp(plan, *, min_bytes, max_bytes, factor: int, dtype: str, op: str | None, iters: int, seed: int,
                  root: int | None, collective=None) -> list[dict]:
    """One record per size, as msc.cli.run.sweep writes them."""
    import numpy as np

    from msc.dsl.collectives import REDUCING
    from msc.verification import reference
    from msc.verification.onesided import execute_onesided
    from msc.verification.onesided_run import Layout, check_inputs_fit

    layout = Layout(plan, collective, root)
    if not layout.checkable:
        raise UsageError(f"collective {plan.collective!r}: msc has no reference for it, so msc run cannot check the "
                         f"results; msc verify checks the plan's synchronisation")
    name = layout.collective.name
    if op not in (None, "sum") and name in REDUCING:
        raise UsageError(f"-o {op}: the MSCCL++ executor reduces with sum only (its loader does not read reduce_op)")
    if op not in (None, "sum") or (root is not None and not layout.collective.has_root):
        from msc.cli.args import refuse_inapplicable

        refuse_inapplicable(name, op=op, root=root)
    tname, dt = parse_dtype(dtype)
    gpu = plan.gpus[0]
    big = max(gpu.input_chunks, gpu.output_chunks)
    least = UNIT * big
    low = least if min_bytes is None else parse_size(min_bytes)
    if low < least:
        raise UsageError(f"size {low} B is too small for {plan.name!r}: the executor needs whole {UNIT}-byte units in "
                         f"each of its {big} chunks; the smallest size that runs is {least} B (-b {least})")
    rng = np.random.default_rng(seed)
    records = []
    for requested in sizes(low, parse_size(max_bytes), factor):
        chunk = requested // big // UNIT * UNIT
        check_inputs_fit(plan, chunk)
        inputs = reference.random_inputs(rng, dt, "sum", plan.num_ranks, gpu.input_chunks * chunk // dt.itemsize)
        seconds = 0.0
        for _ in range(iters):
            start = time.perf_counter()
            outputs, _, _ = execute_onesided(plan, layout, chunk, [x.copy() for x in inputs])
            seconds += time.perf_counter() - start
        wrong = layout.wrong(inputs, outputs, layout.k * chunk // dt.itemsize)
        records.append({"size": chunk * big, "count": layout.k * chunk // dt.itemsize, "type": tname,
                        "redop": "sum" if name in REDUCING else "none",
                        "root": layout.root if layout.collective.has_root else -1,
                        "host_time": seconds / iters * 1e6, "wrong": sum(wrong), "wrong_per_rank": wrong,
                        "inplace": plan.inplace, "requested_size": requested, "rounded": chunk * big != requested})
    return records
