"""``msc calibrate`` on the published nccl-tests logs under tests/data/nccl_tests
(their SOURCES.md): per case, how many measurements the fitted model holds
within the bar (10% from 1 MB, 20% below) against the topology's own
numbers in the same run (the baseline), the worst ratio from 1 MB, the
parameters that ended at a range's end, the simulations and the CPU
seconds the fit took (user + sys of this process, which the machine's other
load disturbs less than wall time).

No GPU: every prediction is msc's cost model (msc simulate --nccl's, fitted),
every measurement a published number.

    python bench/calibrate_logs.py [--out bench/results/calibrate-logs-DATE.txt]
"""
from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "nccl_tests"
NODE4 = {"machine": "h100", "nodes": 1, "gpus_per_node": 4}
CASES = (("4 H100 of one node (NCCL 2.29.2, -g 4)", sorted(DATA.glob("h100x4-*.txt")), NODE4),
         ("2 nodes of 8 H100, Nebius InfiniBand (-g 1)", [DATA / "nebius-h100x16-all_reduce_perf.txt"], "dgx-h100:2"))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args(argv)

    from msc.formats.nccl_tests import read_logs
    from msc.sim.calibrate import MB, fit, summary
    from msc.sim.presets import get_topology
    from msc.sim.topology import topology_from_dict

    lines = ["# msc calibrate on published nccl-tests logs (tests/data/nccl_tests; msc's cost model, no GPU)",
             "# case | measurements held (host-bound aside) | within the bar: fitted / the topology's numbers | "
             "worst pred/meas from 1 MB: fitted (numbers) | simulations | CPU s"]
    for title, paths, spec in CASES:
        topology = topology_from_dict(dict(spec), "h100x4") if isinstance(spec, dict) else get_topology(spec, None)
        started = _cpu()
        result = fit(read_logs(paths), topology)
        cpu = _cpu() - started
        ok, held, before = summary(result)
        big = [i for i, m in enumerate(result.measured) if m.size >= MB and not m.host_bound]
        worst = max(big, key=lambda i: abs(result.ratio(i) - 1), default=None)
        worst_before = max(big, key=lambda i: abs(result.ratio(i, result.before_predicted) - 1), default=None)
        ends = [k.label for k in result.knobs if k.key in result.free
                and min(abs(result.after[k.key] - k.low), abs(result.after[k.key] - k.high)) <= 1e-9 * k.high]
        lines.append(f"{title} | {held} | {ok} / {before} | "
                     f"{result.ratio(worst) if worst is not None else float('nan'):.2f} "
                     f"({result.ratio(worst_before, result.before_predicted) if worst_before is not None else float('nan'):.2f}) | "
                     f"{result.simulations} | {cpu:.1f}")
        lines.append(f"#   at a range's end: {', '.join(ends) or 'none'}")
        for i, m in enumerate(result.measured):
            if not m.host_bound and not result.within(i):
                rec = result.choice[m.collective, m.size]
                lines.append(f"#   outside: {m.collective} {m.size} B {m.column} ({rec['algorithm']} {rec['protocol']}): "
                             f"{result.ratio(i):.2f} (before {result.ratio(i, result.before_predicted):.2f})")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
