"""Command-line registration of ``msc bound`` (msc.sim.cut_bound: the lower bound on
a collective's time from the topology alone). Registering imports nothing
heavy; the command imports numpy when it runs."""
from __future__ import annotations

import argparse
import json

from msc.dsl.collectives import COLLECTIVE_NAMES, COLLECTIVES
from msc.errors import UsageError
from msc.ir.ops import PROTOCOL_NAMES
from msc.units import TYPES
from msc.cli.args import add_collective_on_topology_args, add_sweep_args, noted, protocol_arg, refuse_inapplicable


def add_bound_command(subparsers) -> argparse.ArgumentParser:
    """``msc bound COLLECTIVE --topology T [--ranks N] [-b MIN -e MAX -f F] [--json]``."""
    p = subparsers.add_parser("bound", help="the least time any plan of a collective can take on a topology, "
                                            "per size (predicted, from cuts and latencies)")
    add_collective_on_topology_args(p, COLLECTIVE_NAMES)
    add_sweep_args(p, 8, 128 * 1024 ** 2)
    p.add_argument("-d", "--dtype", default="float",
                   help=f"element type: sizes round down to whole elements per rank ({', '.join(TYPES)})")
    p.add_argument("--protocol", action="append", type=protocol_arg, choices=PROTOCOL_NAMES, metavar="PROTOCOL",
                   help=f"bound plans of this protocol only (repeatable; {', '.join(PROTOCOL_NAMES)}, any case; "
                        "default: whichever of the topology's protocols allows the least time)")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")

    def cmd(args) -> int:
        from msc.sim.cut_bound import collective_name, cut_model, lower_bound, nccl_size
        from msc.dsl.collectives import BUSBW_FACTOR
        from msc.units import parse_dtype, sizes

        collective = collective_name(args.collective)
        refuse_inapplicable(collective, root=args.root)
        args.root = args.root or 0
        topo = bound_topology(args)
        n = topo.num_ranks
        type_name, dt = parse_dtype(args.dtype)
        requested = sizes(args.minbytes, args.maxbytes, args.stepfactor)
        rounded = [nccl_size(collective, n, s, dt.itemsize) for s in requested]
        bounds = lower_bound(collective, topo, [s for s, _ in rounded], root=args.root,      # checks the root
                             protocols=tuple(args.protocol) if args.protocol else None)
        rooted = COLLECTIVES[collective].has_root
        exact = cut_model(topo, args.root if rooted else 0).exact
        factor = BUSBW_FACTOR[collective](n)
        records = []
        for req, (size, count), b in zip(requested, rounded, bounds):
            us = b.seconds * 1e6
            algbw = size / us / 1e3 if us > 0 else 0.0
            records.append({"collective": collective, "topology": topo.name, "ranks": n, "size": size,
                            "count": count, "type": type_name,
                            "root": args.root if rooted else -1,
                            "time": us, "algbw": algbw, "busbw": algbw * factor, "term": b.term, "limit": b.limit,
                            "protocol": b.protocol, "requested_size": req, "rounded": size != req,
                            "exact": exact})
        if args.json:
            print(json.dumps(records))
        else:
            print(format_bound(records, title=f"msc bound {collective}: {n} ranks on {topo.summary()}"))
        return 0

    p.set_defaults(func=cmd)
    return p


def bound_topology(args):
    """The topology of --topology (or the uniform model), sized by itself or
    by --ranks, which must then agree with it."""
    from msc.sim.presets import get_topology, what_fits

    n = args.ranks
    if n is not None and n < 1:
        raise UsageError(f"--ranks must be >= 1, got {n}")
    kw = dict(alpha_us=args.alpha_us, bandwidth_gbps=args.bandwidth_gbps)
    try:
        topo = get_topology(args.topology, None, **kw)
    except UsageError:
        if n is None:
            raise                          # the message says what is missing (a size, --ranks)
        topo = get_topology(args.topology, n, **kw)
    if n is not None and topo.num_ranks != n:
        raise UsageError(f"--ranks {n} does not match topology {topo.name!r}, which has {topo.num_ranks} ranks"
                         + what_fits(n))
    return noted(args, topo)


def format_bound(records: list[dict], *, title: str) -> str:
    lines = [f"# {title}",
             "# the least time of any plan in msc's cost model (nothing run): the most data a cut must carry over "
             "its links, plus a hop, or the farthest ranks' latency",
             f"#{'size':>11}  {'count':>12}  {'type':>8}  {'root':>4}  {'time':>9}  {'algbw':>7}  {'busbw':>7}  "
             f"{'bound by':>9}  {'protocol':>8}  limit",
             f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>4}  {'(us)':>9}  {'(GB/s)':>7}  {'(GB/s)':>7}"]
    for r in records:
        lines.append(f"{r['size']:12d}  {r['count']:12d}  {r['type']:>8}  {r['root']:4d}  {r['time']:9.2f}  "
                     f"{r['algbw']:7.2f}  {r['busbw']:7.2f}  {r['term']:>9}  {r['protocol']:>8}  {r['limit']}")
    if records:
        lines.append("# cuts: every cut that matters (exact)" if records[0]["exact"] else
                     "# cuts: a subset of them (a certified bound: any cut's is valid, the best may be higher)")
    rounded = [f"{r['requested_size']} -> {r['size']}" for r in records if r["rounded"]]
    if rounded:
        lines.append(f"# sizes rounded down to whole elements per rank (B): {', '.join(rounded)}")
    return "\n".join(lines)


# -- the "% of bound" of msc simulate and msc tune ----------------------------------------
def add_bound(records: list[dict], collective: str, root: int, topology) -> list[dict]:
    """Give simulated records ``bound_time`` (us, msc bound's at the record's
    size) and ``bound_pct`` (100 x bound / predicted time: 100 = no plan can
    be faster); none for a collective msc bound does not know."""
    from msc.sim.cut_bound import COLLECTIVES, lower_bound

    if collective not in COLLECTIVES or not records:
        return records
    bounds = lower_bound(collective, topology, [r["size"] for r in records], root=root)
    for r, b in zip(records, bounds):
        r["bound_time"] = b.seconds * 1e6
        r["bound_pct"] = 100 * r["bound_time"] / r["time"] if r["time"] > 0 else None
    return records


def bound_columns(records: list[dict]) -> tuple:
    """The ``%bound`` column for msc.units.format_table, where ``add_bound``
    gave the records one."""
    if not records or "bound_time" not in records[0]:
        return ()
    return (("%bound", "", lambda r: f"{r['bound_pct']:6.1f}" if r["bound_pct"] is not None else "-"),)


BOUND_NOTE = ("# %bound: msc bound's least time for this size as a percent of the predicted time "
              "(100: no plan can be faster)")
