"""Command-line registration of ``msc simulate``, ``msc tune`` and ``msc show``.

Registering imports nothing heavy (no numpy, no matplotlib): msc.cli.main builds
every subcommand's parser on every run, and ``msc verify`` must start fast.
The commands import their modules when they run.
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

from msc.errors import UsageError
from msc.cli.args import (add_collective_arg, add_sweep_args, add_topology_args, check_not_input, collective_kw,
                          param_value, protocol_arg, split_param, topology_from_args)
from msc.units import TYPES, size_arg
from msc.lower.runtimes import add_capacity_args, capacity_args
from msc.sim.tune import DEFAULT_INSTANCES, MAX_THREADBLOCKS


def add_commands(subparsers, load_plan: Callable) -> None:
    """Register simulate, tune and show; ``load_plan(path, **capacity)`` returns a
    Plan (``slots=``, ``runtime=`` when given: msc.lower.runtimes.capacity_args)."""
    add_simulate_command(subparsers, load_plan)
    add_tune_command(subparsers, load_plan)
    add_show_command(subparsers, load_plan)


def simulated_slots(plan, path: str, args) -> int | None:
    """The slots per connection to simulate ``plan`` (read from ``path``)
    with: those it was loaded with where --slots or --runtime set them; for
    MSCCL XML, what the MSCCL runtimes give its protocol (the file's own
    msc_slots where that is more); else None, what msc's own runtime gives
    it (msc.sim.simulate.Simulator's default)."""
    from msc.formats.load import is_xml_file, plan_reader
    from msc.lower.runtimes import xml_capacity

    if capacity_args(args) or plan_reader(path) == "mscclpp":     # MSCCL++: the scratch slots it was exported with
        return plan.slots
    if is_xml_file(path):
        return max(plan.slots, xml_capacity(plan.protocol).slots)
    return None


def add_simulate_command(subparsers, load_plan: Callable) -> argparse.ArgumentParser:
    """``msc simulate PLAN... --topology T [-b MIN -e MAX -f F] [--json] [--plot FILE.png]``,
    or ``msc simulate --nccl COLLECTIVE --topology T ...``: what NCCL would run."""
    p = subparsers.add_parser("simulate", help="predict a plan's time, algbw and busbw per size on a topology "
                                               "(or, with --nccl, NCCL's)")
    p.add_argument("plans", nargs="*", metavar="PLAN", help="plan file(s)")
    p.add_argument("--nccl", metavar="COLLECTIVE",
                   help="instead of plans: what NCCL would run per size (its algorithm, protocol and channels, by "
                        "its tuning model, NCCL 2.30.7) as an msc plan, simulated (the dgx-*, hgx-* and gb200-nvl72 presets, "
                        "nvswitch, ib, and TOML files of nodes)")
    p.add_argument("--nccl-algo", metavar="ALGO", type=lambda t: _list(t, str),
                   help="with --nccl: the algorithms NCCL may use, as NCCL_ALGO (tree, ring, nvls, nvlstree, pat)")
    p.add_argument("--nccl-proto", metavar="PROTO", type=lambda t: _list(t, protocol_arg),
                   help="with --nccl: the protocols NCCL may use, as NCCL_PROTO (LL, LL128, Simple; any case)")
    add_topology_args(p)
    add_sweep_args(p, 8, 128 * 1024 ** 2)
    p.add_argument("-d", "--dtype", default="float", help=f"element type, for the count column ({', '.join(TYPES)})")
    p.add_argument("--tile", type=int, help="bytes per chunk and iteration (default: the plan's, else the protocol's)")
    add_capacity_args(p)       # --slots, --runtime: applied at load, so the plan is verified with them
    add_collective_arg(p)
    p.add_argument("--engine", choices=("auto", "fast", "events"), default="auto",
                   help="auto: max-plus, event-driven where links are contended; fast: ignore contention")
    p.add_argument("--model", choices=("auto", "lifted", "onesided"), default="auto",
                   help="MSCCL++ plans (.json): auto: an export of msc's is lifted back to its msc plan and "
                        "simulated as that, any other plan runs in the one-sided model (msc.sim.onesided); lifted: "
                        "lift (plans in the shape msc's export writes); onesided: the one-sided model for every plan")
    p.add_argument("--splits", metavar="STATS",
                   help="alltoall plans: price an all_to_all_single with uneven splits as msc.torch runs it (padded "
                        "to the largest piece) against the even call: uniform or skewed[:Z] (MoE routing, Zipf "
                        "exponent Z; msc.sim.uneven)")
    p.add_argument("--tokens", type=int, metavar="T",
                   help="with --splits: tokens each rank routes per call (default 4096)")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw against size, a line per plan")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")

    def cmd(args) -> int:
        from msc.units import sizes

        _check_simulate_args(args)
        check_not_input(args.plot, [*args.plans, args.topology], "--plot")
        requested = sizes(args.minbytes, args.maxbytes, args.stepfactor)
        everything, series, topo = (_simulate_nccl(args, requested) if args.nccl
                                    else _simulate_plans(args, requested, load_plan))
        if args.json:
            print(json.dumps(everything))
        if args.plot:
            from msc.cli.pictures import plot_busbw

            plot_busbw(series, args.plot, title=f"predicted busbw on {topo.name}")
            if not args.json:
                print(f"# plot: {args.plot}")
        return 0

    p.set_defaults(func=cmd)
    return p


def _check_simulate_args(args) -> None:
    if args.nccl and args.plans:
        raise UsageError("give plans or --nccl COLLECTIVE, not both")
    if not args.nccl and not args.plans:
        raise UsageError("give one or more plans, or --nccl COLLECTIVE")
    if args.nccl:
        given = [flag for flag, v in (("--tile", args.tile), ("--slots", args.slots), ("--runtime", args.runtime),
                                      ("--engine", args.engine if args.engine != "auto" else None),
                                      ("--model", args.model if args.model != "auto" else None)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} describe a plan's run; --nccl takes NCCL's own "
                             "(its slices, buffers and channels)")
        if args.topology is None:
            raise UsageError("--nccl needs --topology (dgx-h100[:NODES], dgx-a100[:NODES], dgx-h200[:NODES], hgx-h20[:NODES], "
                             "hgx-b200[:NODES], gb200-nvl72, nvswitch, ib:NODES, or a TOML file of nodes)")
    elif args.nccl_algo or args.nccl_proto:
        raise UsageError("--nccl-algo and --nccl-proto go with --nccl")
    if args.splits is None and args.tokens is not None:
        raise UsageError("--tokens goes with --splits")
    if args.splits is not None and (args.nccl or args.model != "auto"):
        raise UsageError("--splits prices msc plans of alltoall (not --nccl, not --model)")


def _simulate_plans(args, requested, load_plan):
    from msc.cli.bound import BOUND_NOTE, add_bound, bound_columns
    from msc.sim.simulate import Simulator
    from msc.units import format_table

    from msc.cli.sim_mscclpp import LIFTED, MODEL_TEXT, onesided_plan, simulate_onesided
    from msc.formats.load import plan_reader

    everything, series, topo = [], [], None
    for path in args.plans:
        mscclpp = plan_reader(path) == "mscclpp"
        if args.model != "auto" and not mscclpp:
            raise UsageError(f"--model {args.model} chooses how an MSCCL++ plan (.json) is simulated; {path} is not one")
        osp = onesided_plan(path, args) if mscclpp else None
        if osp is not None:
            records, label, topo, title = simulate_onesided(args, path, osp, requested)
            everything += records
            series.append((label, records))
            if not args.json:
                columns = bound_columns(records)
                print(format_table(records, columns=columns, title=title) + ("\n" + BOUND_NOTE if columns else ""))
            continue
        plan = load_plan(path, **capacity_args(args), **collective_kw(args))
        topo = topology_from_args(args, plan.num_ranks)
        sim = Simulator(plan, topo, tile=args.tile, slots=simulated_slots(plan, path, args), dtype=args.dtype)
        if args.splits is not None:
            records = _simulate_uneven(args, path, plan, sim, topo, requested)
            everything += records
            series.append((f"{plan.name} ({plan.protocol}, x{plan.instances}), {records[0]['splits']} splits",
                           records))
            continue
        records = sim.records(requested, engine=args.engine)
        add_bound(records, plan.collective, plan.root, topo)     # bound_time, bound_pct (switch plans too)
        if mscclpp:
            for r in records:
                r["model"] = LIFTED
        everything += records
        series.append((f"{plan.name} ({plan.protocol}, x{plan.instances})", records))
        if not args.json:
            columns = bound_columns(records)
            print(format_table(records, columns=columns,
                               title=f"msc simulate {path}: {plan.collective}, {plan.num_ranks} ranks, "
                                     f"{plan.protocol}, x{plan.instances}, "
                                     + (f"MSCCL++ plan {MODEL_TEXT[LIFTED]}, " if mscclpp else "")
                                     + f"on {topo.summary()} (predicted: nothing run)")
                  + ("\n" + BOUND_NOTE if columns else ""))
    return everything, series, topo


def _simulate_uneven(args, path: str, plan, sim, topo, requested) -> list[dict]:
    """``--splits``: the plan priced on padded units against the even call (msc.sim.uneven)."""
    from msc.sim.uneven import COLUMNS, DEFAULT_TOKENS, NOTE, SplitStats, uneven_records
    from msc.units import format_table

    stats = SplitStats.parse(args.splits)
    tokens = DEFAULT_TOKENS if args.tokens is None else args.tokens
    records = uneven_records(sim, requested, stats, tokens, engine=args.engine)
    if not args.json:
        print(format_table(records, columns=COLUMNS,
                           title=f"msc simulate {path} --splits {stats.label()}: alltoall with uneven splits, "
                                 f"{plan.num_ranks} ranks, {tokens} tokens per rank, {plan.protocol}, x{plan.instances}, "
                                 f"on {topo.summary()} (predicted: nothing run)") + "\n" + NOTE)
    return records


NCCL_NOTE = ("# NCCL's algorithm, protocol and channels per size by its tuning model (NCCL 2.30.7), run as "
             "an msc plan and simulated; nccl: NCCL's own model's time")


def _simulate_nccl(args, requested):
    from msc.cli.bound import BOUND_NOTE, add_bound, bound_columns
    from msc.sim.cut_bound import collective_name
    from msc.sim.nccl_sim import simulate_nccl
    from msc.units import format_table

    collective = collective_name(args.nccl)
    topo = topology_from_args(args, None)
    records = simulate_nccl(collective, topo, requested, dtype=args.dtype, algorithms=args.nccl_algo,
                            protocols=args.nccl_proto)
    add_bound(records, collective, 0, topo)
    if not args.json:
        columns = (("algo", "", lambda r: r["algorithm"][:6]), ("proto", "", lambda r: r["protocol"][:6]),
                   ("chan", "", lambda r: str(r["channels"])),
                   ("nccl", "(us)", lambda r: f"{r['nccl_us']:6.1f}" if r["nccl_us"] == r["nccl_us"] else "-"))
        columns += bound_columns(records)
        print(format_table(records, columns=columns,
                           title=f"msc simulate --nccl {collective}: {topo.num_ranks} ranks on {topo.summary()} "
                                 "(predicted: nothing run)") + "\n" + NCCL_NOTE
              + ("\n" + BOUND_NOTE if bound_columns(records) else ""))
    return records, [(f"NCCL {collective}", records)], topo


def _list(text: str, kind):
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None


def add_tune_command(subparsers, load_plan: Callable | None = None) -> argparse.ArgumentParser:
    """``msc tune ALGORITHM_FILES... --ranks N --topology T -b MIN -e MAX [-o DIR] [--plot FILE.png]``."""
    p = subparsers.add_parser("tune", help="pick the fastest algorithm, protocol and instances per size range")
    p.add_argument("files", nargs="+", metavar="ALGORITHM_FILE", help="algorithm files or library names")
    p.add_argument("--ranks", "-n", type=int, required=True, help="number of ranks")
    add_topology_args(p)
    add_sweep_args(p, 1024, 256 * 1024 ** 2)
    p.add_argument("--protocols", type=lambda t: _list(t, protocol_arg), default=("Simple", "LL"),
                   help="comma-separated: Simple, LL, LL128, any case (default Simple,LL)")
    p.add_argument("--instances", type=lambda t: _list(t, int), default=DEFAULT_INSTANCES,
                   help="comma-separated instance counts (default 1,2,4,8,16,32: those within "
                        "--max-threadblocks)")
    p.add_argument("--max-threadblocks", type=int, default=MAX_THREADBLOCKS, metavar="N",
                   help=f"keep a plan only if no rank runs more than N threadblocks (default {MAX_THREADBLOCKS}: "
                        "twice NCCL's 32 channels, fewer than an A100's or H100's SMs)")
    p.add_argument("--param", "-p", action="append", default=[], metavar="NAME=V1,V2",
                   help="values to try for an algorithm parameter (repeatable)")
    p.add_argument("--inplace", choices=("in", "out"), help="tune the in-place or out-of-place form")
    p.add_argument("-o", "--output", metavar="DIR", help="write the chosen plans and plans.json here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="busbw against size: the chosen plans and the ring")
    p.add_argument("--synthesize", action="store_true",
                   help="also tune schedules synthesized for the topology (msc synthesize: 1, 2, 4 and 8 pieces, "
                        "and 16 where they pack better, each with spreads up to its pieces and, where they sum, "
                        "add_on_arrival both ways); with -o DIR their programs are written there too")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")
    p.set_defaults(func=_tune)
    return p


def _tune(args) -> int:
    """``msc tune``: simulate, pick, write the chosen plans, print or plot."""
    import tempfile

    from msc.units import sizes
    from msc.sim.tune import format_tune, index_entries, per_size, tune, write_plans

    # --param names a parameter of the files given; with --synthesize, of the programs made too
    check_not_input(args.plot, [*args.files, args.topology], "--plot")
    user = None if args.synthesize else tune_params(args.files, args.param)
    if args.ranks is None or args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {args.ranks}")
    topo = topology_from_args(args, args.ranks)
    requested = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    inplace = None if args.inplace is None else args.inplace == "in"
    with tempfile.TemporaryDirectory(prefix="msc-tune-") as scratch:
        files = list(args.files)
        if args.synthesize:
            files += synthesized_files(args.files, topo, args.output or scratch)
            user = tune_params(files, args.param)
        result = tune(files, args.ranks, topo, requested, protocols=args.protocols, instances=args.instances,
                      max_threadblocks=args.max_threadblocks, user_params=user, inplace=inplace)
    if args.output:
        write_plans(result, args.output)
    mine = library_rows(result, set(args.files)) if args.synthesize else None
    if args.json:
        extra = {} if mine is None else {"library_best": mine}
        print(json.dumps({"collective": result.collective, "ranks": result.ranks, "topology": result.topology,
                          "per_size": per_size(result), **extra, "chosen": index_entries(result),
                          "candidates": [{"label": c.label, "algorithm": c.algorithm, "params": c.params,
                                          "protocol": c.protocol, "instances": c.instances,
                                          "time_us": [t * 1e6 for t in c.times], "exact": c.known}
                                         for c in result.candidates],
                          "skipped": result.skipped}))
    else:
        print(format_tune(result, args.output))
        if mine is not None:
            print(format_library_rows(mine))
    if args.plot:
        _tune_plot(args, result)
    return 0


def _tune_plot(args, result) -> None:
    """--plot: busbw of the chosen plans, the ring baseline, with --synthesize
    the library's best, and the bound."""
    from msc.cli.pictures import plot_busbw
    from msc.sim.tune import busbw_records, records

    chosen = list(dict.fromkeys(i for _, _, i in result.ranges))
    for i in chosen:                  # exact at every size (the table has them where they won or came 2nd)
        c = result.candidates[i]
        c.times = [c.exact(j, s) for j, s in enumerate(result.sizes)]
    series = [(result.candidates[i].label, records(result, result.candidates[i])) for i in chosen]
    base = result.baseline
    if base is not None and all(base is not result.candidates[i] for i in chosen):
        series.append((base.label + " (ring baseline)", records(result, base)))
    if args.synthesize:
        series.append(("the library's best", busbw_records(result, library_best(result, set(args.files)))))
    if result.bounds:
        series.append(("msc bound (no plan is faster)", busbw_records(result, result.bounds)))
    plot_busbw(series, args.plot, title=f"{result.collective}, {result.ranks} ranks on {result.topology}: "
                                         f"the chosen plans")


def library_best(result, files: set[str]) -> list[float]:
    """Per swept size, the least exact time (s) of the candidates from
    ``files`` (the user's, not the synthesized ones)."""
    return [row["library_us"] / 1e6 for row in library_rows(result, files)]


def library_rows(result, files: set[str]) -> list[dict]:
    """Per swept size, the fastest candidate from ``files`` (the library's or
    the user's, not the synthesized ones; exact) beside the winner: with
    --synthesize the winner may be synthesized everywhere, and the margin is
    what the user wants to see. ``vs_library``: its time / the winner's."""
    from msc.sim.tune import exact_best, per_size

    mine = [c for c in result.candidates if c.file in files]
    if not mine:
        return []
    rows = []
    for j, (size, won) in enumerate(zip(result.sizes, per_size(result))):
        t = exact_best(mine, j, size)[0]
        best = min((c for c in mine if c.known[j]), key=lambda c: c.times[j])
        rows.append({"size": size, "library_best": best.label, "library_us": t * 1e6, "winner": won["winner"],
                     "vs_library": t * 1e6 / won["time_us"] if won["time_us"] > 0 else None})
    return rows


def format_library_rows(rows: list[dict]) -> str:
    """The library's best per size under msc tune --synthesize's table."""
    from msc.units import format_size

    w = max([len(r["library_best"]) for r in rows] + [12])
    lines = ["# the library's best (the files given, no synthesized plan) per size, beside the winner:",
             f"#{'size':>10}  {'library best':<{w}} {'time(us)':>9}  {'winner x':>8}"]
    for r in rows:
        x = f"{r['vs_library']:.2f}x" if r["vs_library"] else "-"
        lines.append(f"{format_size(r['size']):>11}  {r['library_best']:<{w}} {r['library_us']:9.2f}  {x:>8}")
    lines.append("# winner x: the library's best time / the winner's (1.00x: the library's plan is the winner)")
    return "\n".join(lines)


def synthesized_files(files: list[str], topology, folder: str) -> list[str]:
    """Programs synthesized for ``topology`` (msc.synth), one per piece count,
    for the collective of the algorithms in ``files``, written to ``folder``."""
    from pathlib import Path

    from msc.dsl.loader import load_algorithms
    from msc.files import write_output
    from msc.synth import COLLECTIVES, Synthesizer, default_spread

    collective = load_algorithms(files[0])[0].collective.name
    if collective not in COLLECTIVES:
        raise UsageError(f"--synthesize: msc synthesize makes {', '.join(COLLECTIVES)}, not {collective}")
    Path(folder).mkdir(parents=True, exist_ok=True)
    synth = Synthesizer(collective, topology)
    out = []
    for pieces in synth.piece_choices():
        name, spread = f"synthesized_p{pieces}", default_spread(pieces)
        s = synth.program(pieces, spread=spread, name=name,
                          command=f"msc synthesize {collective} --topology {topology.name} --pieces {pieces} "
                                  f"--spread {spread} --name {name} -o {name}.py")
        path = Path(folder) / f"{collective}-{name}.py"
        try:
            check_not_input(path, files, "--synthesize")
        except UsageError:
            raise UsageError(f"--synthesize writes {path}, which is one of the algorithm files given: give "
                             f"-o another folder") from None
        write_output(path, s.text)
        out.append(str(path))
    return out


def tune_params(files: list[str], items: list[str]) -> dict[str, list]:
    """``--param name=v1,v2`` for ``msc tune``: each name a parameter of some
    algorithm in ``files``, its values read as the type of its default."""

    raw = {}
    for item in items:
        key, values = split_param(item, form="name=v1,v2")
        if key in raw:
            raise UsageError(f"--param {key} is given twice (list its values once: {key}=v1,v2)")
        raw[key] = values.split(",")
    if not raw:
        return {}
    from msc.dsl.loader import load_algorithms

    defaults: dict[str, object] = {}
    for path in files:
        for alg in load_algorithms(path):
            for key, value in alg.params.items():
                defaults.setdefault(key, value)
    for key in raw:
        if key not in defaults:
            known = ", ".join(sorted(defaults))
            raise UsageError(f"--param {key}: no algorithm in {', '.join(files)} has a parameter {key} "
                             + (f"(their parameters: {known})" if known else "(they take no parameters)"))
    return {key: [param_value(key, v, defaults[key]) for v in values] for key, values in raw.items()}


def add_show_command(subparsers, load_plan: Callable) -> argparse.ArgumentParser:
    """``msc show PLAN --png FILE [--topology T --size S]``."""
    p = subparsers.add_parser("show", help="draw a plan's schedule, or its simulated timeline on a topology")
    p.add_argument("plan", help="plan file")
    p.add_argument("--png", required=True, metavar="FILE", help="the picture to write")
    add_collective_arg(p)
    add_topology_args(p)
    p.add_argument("--size", type=size_arg, help="message size for the timeline (bytes; K, M, G; default 1M)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")

    def cmd(args) -> int:
        from msc.cli.pictures import draw_schedule, draw_timeline

        check_not_input(args.png, [args.plan, args.topology], "--png")
        plan = load_plan(args.plan, **collective_kw(args))
        timed = args.topology is not None or args.alpha_us is not None or args.bandwidth_gbps is not None
        if args.size is not None and not timed:
            raise UsageError("--size draws a simulated timeline: give --topology (or --alpha-us and --bandwidth-gbps)")
        if timed:
            from msc.sim.simulate import Simulator

            sim = Simulator(plan, topology_from_args(args, plan.num_ranks),
                            slots=simulated_slots(plan, args.plan, args))
            draw_timeline(sim, args.size if args.size is not None else 1024 ** 2, args.png)
            print(f"timeline of {args.plan} on {sim.topology.name} -> {args.png}")
        else:
            draw_schedule(plan, args.png)
            print(f"schedule of {args.plan} -> {args.png}")
        return 0

    p.set_defaults(func=cmd)
    return p
