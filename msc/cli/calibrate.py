"""Command-line registration of ``msc calibrate`` (msc.sim.calibrate: a
topology's parameters fitted to nccl-tests output, written as a TOML
topology). Registering imports nothing heavy."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from msc.errors import UsageError
from msc.cli.args import check_not_input, noted


def add_calibrate_command(subparsers) -> argparse.ArgumentParser:
    """``msc calibrate NCCL_TESTS_OUTPUT... --topology PRESET_OR_TOML -o FILE.toml``."""
    p = subparsers.add_parser("calibrate", help="fit a topology's latencies, protocol shares and NIC rates to "
                                                "nccl-tests output, and write it as a TOML topology")
    p.add_argument("logs", nargs="+", metavar="NCCL_TESTS_OUTPUT",
                   help="text printed by all_reduce_perf, all_gather_perf, reduce_scatter_perf, alltoall_perf, "
                        "broadcast_perf, reduce_perf or sendrecv_perf (one or several tests per file)")
    p.add_argument("--topology", "-t", required=True, metavar="NAME|FILE",
                   help="the machine the tests ran on: a preset (dgx-h100:2, hgx-b200, ...) or a TOML file of "
                        "nodes; its values are where the fit starts")
    p.add_argument("-o", "--output", required=True, metavar="FILE.toml", help="the fitted topology to write")
    p.add_argument("--name", help="the fitted topology's name (default: the output file's stem)")
    p.add_argument("--rounds", type=int, default=3,
                   help="fits at most, each from the last one's simulated point (default 3)")
    p.add_argument("--json", action="store_true", help="print the parameters and rows as JSON")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")
    p.set_defaults(func=_run)
    return p


def _run(args) -> int:
    from msc.files import write_output
    from msc.formats.nccl_tests import machine_of, read_logs
    from msc.sim.calibrate import fit, summary, to_toml
    from msc.sim.presets import get_topology

    if not str(args.output).endswith(".toml"):
        raise UsageError(f"-o {args.output}: the fitted topology is TOML, name it FILE.toml")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    check_not_input(args.output, [*args.logs, args.topology], "-o")
    logs = read_logs(args.logs)
    topology = noted(args, _topology(args.topology, logs, get_topology))
    _check_devices(logs, topology, machine_of)
    result = fit(logs, topology, rounds=args.rounds)
    name = args.name or Path(args.output).stem
    write_output(args.output, to_toml(result, name=name, sources=[Path(p).name for p in args.logs]))
    ok, held, before = summary(result)
    if args.json:
        print(json.dumps(_records(result, args, ok, held, before)))
    else:
        print(_table(result, args, logs, ok, held, before))
    return 0


def _topology(spec: str, logs, get_topology):
    """The topology ``spec`` names, sized by the logs' ranks where it leaves its size out (dgx-h100 for
    16 ranks: dgx-h100:2)."""
    from msc.sim.presets import what_fits

    counts = sorted({log.ranks for log in logs if log.ranks})
    if len(counts) > 1:
        raise UsageError(f"the logs ran on {' and '.join(map(str, counts))} ranks: calibrate one machine at a time")
    topology = get_topology(spec, None)
    if counts and topology.num_ranks != counts[0]:
        try:
            sized = get_topology(spec, counts[0])
        except UsageError:
            sized = None
        if sized is None or ":" in spec or spec.endswith(".toml"):
            raise UsageError(f"the logs ran on {counts[0]} ranks, topology {topology.name!r} has {topology.num_ranks}"
                             + what_fits(counts[0]))
        topology = sized
    return topology


def _check_devices(logs, topology, machine_of) -> None:
    """The GPUs the logs name must be the topology's (a log that names none, or a GPU msc has no
    machine for, is taken as run on the topology's)."""
    for log in logs:
        for device in log.devices:
            machine = machine_of(device)
            if machine is not None and machine != topology.machine:
                raise UsageError(f"{log.path}: the test ran on {device} ({machine}), but topology {topology.name!r} "
                                 f"is of {topology.machine}: give a topology of {machine} GPUs (a preset, or a TOML "
                                 f"file with machine = \"{machine}\")")


def _records(result, args, ok, held, before) -> dict:
    params = [{"parameter": k.label, "key": k.key, "before": result.before[k.key], "after": result.after[k.key],
               "low": k.low, "high": k.high, "fitted": k.key in result.free, "range": k.why} for k in result.knobs]
    rows = []
    for i, m in enumerate(result.measured):
        rec = result.choice[m.collective, m.size]
        rows.append({"where": m.where, "column": m.column, "collective": m.collective, "size": m.size,
                     "algorithm": rec["algorithm"], "protocol": rec["protocol"], "channels": rec["channels"],
                     "measured_us": m.time_us, "predicted_us": result.predicted[i], "ratio": result.ratio(i),
                     "before_ratio": result.ratio(i, result.before_predicted), "tolerance": m.tolerance,
                     "within": result.within(i), "host_bound": m.host_bound})
    return {"topology": result.topology.name, "output": str(args.output), "parameters": params, "rows": rows,
            "within": ok, "held": held, "within_before": before, "simulations": result.simulations,
            "rounds": result.rounds}


def _table(result, args, logs, ok, held, before) -> str:
    from msc.units import format_size

    t = result.topology
    lines = [f"# msc calibrate: {len(result.measured)} measurements of {len(logs)} nccl-tests log(s) on "
             f"{t.summary()} (predicted: msc simulate --nccl's model, fitted; nothing run)"]
    for log in logs:
        tests = sorted({r.collective for r in log.rows})
        facts = [f"{', '.join(tests)}, {len(log.rows)} sizes"]
        facts.append(f"{log.ranks} ranks on {len(log.hosts)} host(s)" if log.ranks else
                     f"no '#  Rank' lines: taken as run on the topology's {t.num_ranks} ranks")
        facts += list(log.devices)
        if log.nccl_version:
            facts.append(f"NCCL {log.nccl_version}")
        if log.gpus_per_process > 1:
            facts.append(f"one process drove {log.gpus_per_process} GPUs" + (", CUDA graphs" if log.graph else ""))
        lines.append(f"#   {log.path}: {'; '.join(facts)}")
    lines += ["#", f"# {'parameter':<34} {'was':>9} {'now':>9}  range"]
    for k in result.knobs:
        after = result.after[k.key]
        state = "fitted" if k.key in result.free else "not constrained by these rows: kept"
        if k.key in result.free and (abs(after - k.low) <= 1e-9 * max(1, k.low) or abs(after - k.high) <= 1e-9 * k.high):
            state += ", at the range's end"
        lines.append(f"  {k.label:<34} {result.before[k.key]:9.4g} {after:9.4g}  {k.low:.4g}-{k.high:.4g} {k.unit}"
                     f" ({state})")
    width = max(len(m.where) for m in result.measured)
    lines += ["#", f"# {'where':<{width}} {'column':>6} {'collective':>13} {'size':>6} {'algo':>8} {'proto':>6} "
                   f"{'chan':>4} {'measured':>9} {'predicted':>9} {'pred/meas':>9} {'before':>6}",
              f"# {'':<{width}} {'':>6} {'':>13} {'':>6} {'':>8} {'':>6} {'':>4} {'(us)':>9} {'(us)':>9}"]
    for i, m in enumerate(result.measured):
        rec = result.choice[m.collective, m.size]
        mark = "host-bound" if m.host_bound else ("" if result.within(i) else f"outside +-{m.tolerance:.0%}")
        lines.append(f"  {m.where:<{width}} {m.column.split('-')[0]:>6} {m.collective:>13} {format_size(m.size):>6} "
                     f"{rec['algorithm']:>8} {rec['protocol']:>6} {rec['channels']:4d} {m.time_us:9.2f} "
                     f"{result.predicted[i]:9.2f} {result.ratio(i):9.2f} {result.ratio(i, result.before_predicted):6.2f}"
                     f"  {mark}".rstrip())
    host = len(result.measured) - held
    lines += ["#", f"# within the bar (10% from 1 MB, 20% below): {ok} of {held} measurements after the fit, "
                   f"{before} before it" + (f"; {host} host-bound aside (one process launched every GPU's kernels: "
                                            f"the host's pace, not the GPUs'; rerun with a process per GPU or -G 1)"
                                            if host else ""),
              f"# {result.simulations} simulations in {result.rounds} round(s)",
              f"# wrote {args.output}: any command takes it, e.g. msc simulate --nccl allreduce --topology {args.output}"]
    return "\n".join(lines)
