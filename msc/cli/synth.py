"""Command-line registration of ``msc synthesize`` (msc.synth: a schedule
for a topology, written as an msc DSL program). Registering imports
nothing heavy; the command imports numpy when it runs."""
from __future__ import annotations

import argparse
import json
import shlex

from msc.dsl.collectives import ROOTED
from msc.errors import UsageError
from msc.units import format_size, size_arg
from msc.cli.args import add_collective_on_topology_args, check_not_input, refuse_inapplicable
from msc.synth import COLLECTIVES, SUMS, check_collective, check_name

SIMULATE_UP_TO = 64          # ranks: above this the pieces come from the packing alone (simulating takes minutes)


def add_synthesize_command(subparsers) -> argparse.ArgumentParser:
    """``msc synthesize COLLECTIVE --topology T [--ranks N] -o FILE.py``."""
    p = subparsers.add_parser("synthesize", help="write a schedule for a topology as an msc program (spanning-tree "
                                                 "packing; relayed paths for alltoall), verified")
    add_collective_on_topology_args(p, COLLECTIVES)
    p.add_argument("--pieces", type=int,
                   help="pieces per shard, each with a tree of its own (default: chosen, see --size)")
    p.add_argument("--spread", type=int,
                   help="channels the pieces are spread over: the program's default for its spread parameter "
                        "(default: chosen with the pieces; where they are not simulated, pieces / 4, at least 1)")
    p.add_argument("--add-on-arrival", action=argparse.BooleanOptionalAction,
                   help="reducescatter, reduce, allreduce: a rank adds each child's part as it arrives, on the "
                        "threadblock that received it (--no-add-on-arrival: all after the last, on one); the "
                        "program's default for its add_on_arrival parameter (default: chosen with the pieces)")
    p.add_argument("--size", type=size_arg, default=1 << 30,
                   help=f"the size the choice of pieces and spread is simulated at, up to {SIMULATE_UP_TO} ranks "
                        "(bytes; K, M, G; default 1G); above that, for alltoall (whose plans hold n (n - 1) "
                        "pieces: simulating them takes minutes) and with --pieces, they come from the "
                        "packing's link loads")
    p.add_argument("--name", default="synthesized", help="the algorithm's name (a Python identifier)")
    p.add_argument("-o", "--output", required=True, metavar="FILE.py", help="the program to write")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")
    p.set_defaults(func=_run)
    return p


def _run(args) -> int:
    from msc.cli.bound import bound_topology
    from msc.sim.cut_bound import collective_name

    collective = collective_name(args.collective)
    check_collective(collective)
    refuse_inapplicable(collective, root=args.root)
    args.root = args.root or 0
    if args.add_on_arrival is not None and collective not in SUMS:
        flag = "--add-on-arrival" if args.add_on_arrival else "--no-add-on-arrival"
        raise UsageError(f"{flag}: a {collective} adds nothing up (it is for {', '.join(SUMS)})")
    if not str(args.output).endswith(".py"):
        raise UsageError(f"-o {args.output}: the program is Python, name it FILE.py")
    try:
        check_name(args.name)                # before minutes of packing, not in the file written after
    except UsageError as exc:
        raise UsageError(f"--name: {exc}") from None
    check_not_input(args.output, [args.topology], "-o")
    topo = bound_topology(args)
    # the words main() parsed (not sys.argv: msc.cli.main.main(argv) may run inside another program)
    words = [w for w in args.argv if w != "--debug"]
    if args.command in words:
        words.remove(args.command)
    command = "msc synthesize " + " ".join(shlex.quote(a) for a in words) if words else ""
    summary = _synthesize(args, collective, topo, command)
    _write_and_verify(args, collective, topo, summary)
    if args.json:
        print(json.dumps(summary))
    else:
        print(_describe(summary))
    return 0


def _synthesize(args, collective, topo, command) -> dict:
    from msc.synth import synthesize

    n = topo.num_ranks
    summary = {"collective": collective, "topology": topo.name, "ranks": n, "output": str(args.output),
               "topology_flags": _topology_flags(args)}
    if args.pieces is None and n <= SIMULATE_UP_TO and collective != "alltoall":
        from msc.synth.choose import choose_by_simulation

        # --spread and --add-on-arrival shape the tree programs: given, the switch schedule is not a candidate
        choice = choose_by_simulation(collective, topo, args.size, root=args.root, name=args.name, command=command,
                                      switch=args.spread is None and args.add_on_arrival is None)
        s = choice.synthesis
        spread = s.spread if args.spread is None else args.spread
        on_arrival = s.add_on_arrival if args.add_on_arrival is None else args.add_on_arrival
        if (spread, on_arrival) != (s.spread, s.add_on_arrival):
            s = choice.synthesizer.program(s.pieces, spread=spread, add_on_arrival=bool(on_arrival), name=args.name,
                                           command=command)
        summary.update(chosen_by="simulation", size=args.size, instances=choice.instances,
                       simulated_us=choice.seconds * 1e6, candidates=len(choice.tried))
    else:
        s = synthesize(collective, topo, pieces=args.pieces, spread=args.spread,
                       add_on_arrival=args.add_on_arrival is not False, root=args.root, name=args.name,
                       command=command)
        summary.update(chosen_by="given" if args.pieces is not None else "packing")
    summary.update(switch=s.switch, pieces=s.pieces, spread=s.spread, add_on_arrival=s.add_on_arrival,
                   **{"relayed" if collective == "alltoall" else "trees": s.trees}, max_depth=s.max_depth,
                   busiest_link=s.busiest, packing_gbps=(1 / s.bandwidth_s_per_byte / 1e9
                                                         if s.bandwidth_s_per_byte > 0 else None))
    summary["text"] = s.text
    return summary


def _topology_flags(args) -> str:
    """The topology as the user gave it, for the commands the summary suggests."""
    if args.topology:
        return f"-t {shlex.quote(args.topology)}"
    return f"--alpha-us {args.alpha_us:g} --bandwidth-gbps {args.bandwidth_gbps:g}"


def _write_and_verify(args, collective, topo, summary) -> None:
    """Write the program, then load, trace (in place and out of place) and
    verify what was written: the file is what msc vouches for."""
    import msc
    from msc.files import write_output

    text = summary.pop("text")
    write_output(args.output, text)
    [alg] = msc.load_algorithms(args.output)
    kw = {"root": args.root} if collective in ROOTED else {}
    for inplace in (True, False):
        msc.verify(msc.trace(alg, topo.num_ranks, inplace=inplace, **kw))
    summary["verified"] = True


def _adding(on_arrival: bool | None) -> str:
    if on_arrival is None:
        return ""
    return ", children's parts added " + ("as they arrive" if on_arrival else "after the last arrives")


def _describe(s: dict) -> str:
    flags = f"{s['topology_flags']} --ranks {s['ranks']}"
    hops = f"{s['max_depth']} hop{'s' if s['max_depth'] != 1 else ''}"
    if s.get("switch"):
        shape = ("reduced and multicast in the switch (NVLS)" if not s["trees"] else
                 f"reduced and multicast in each node's switch (NVLS), {s['trees']} trees across nodes, at most "
                 f"{hops} deep")
    elif s["collective"] == "alltoall":
        shape = f"{s['pieces']} piece(s) per pair, {s['relayed']} relayed, at most {hops}"
    else:
        shape = f"{s['trees']} trees of {s['pieces']} piece(s) per shard, at most {hops} deep"
    spread = "" if s.get("switch") else f", spread over {s['spread']} channel(s){_adding(s['add_on_arrival'])}"
    lines = [f"synthesized: {s['collective']} for {s['topology']} ({s['ranks']} ranks) -> {s['output']}: {shape}"
             f"{spread}; verified in place and out of place"]
    if s["chosen_by"] == "simulation":
        lines.append(f"  chosen by simulating {s['candidates']} candidates at {format_size(s['size'])}: "
                     f"{s['simulated_us']:.1f} us with {s['instances']} instance(s), Simple "
                     f"(msc tune {s['output']} {flags} compares it with others)")
    else:
        lines.append(f"  pieces {'as given' if s['chosen_by'] == 'given' else 'from the packing'}; "
                     f"msc tune {s['output']} {flags} tries its spread and instances")
    if s["packing_gbps"]:
        lines.append(f"  the packing's busiest link ({s['busiest_link']}) allows {s['packing_gbps']:.1f} GB/s of "
                     f"size at large sizes; msc bound {s['collective']} {flags} gives the least time")
    return "\n".join(lines)
