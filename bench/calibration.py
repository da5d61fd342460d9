"""The cost model against published NCCL measurements (issue 25): every row of
tests/data/nccl_published.toml beside ``msc simulate --nccl``'s prediction for
the same machine, collective, size and forced algorithm or protocol, and
NCCL's own tuning model's (msc.sim.calibration). Prints the table, the
counts per system and the rows the model cannot be held to yet (with why),
and draws measured against predicted busbw by size per system.

No GPU: every prediction is msc's cost model (simulated), every measurement
a published number (sources in the TOML).

    python bench/calibration.py [--png bench/results/calibration.png] [--json OUT.json] [--use calibrate|check|all]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "nccl_published.toml"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default=str(ROOT / "bench" / "results" / "calibration.png"))
    ap.add_argument("--json", help="write every comparison here")
    ap.add_argument("--use", choices=("calibrate", "check", "all"), default="all")
    args = ap.parse_args(argv)

    from msc.progress import steps
    from msc.sim.calibration import compare, known_gap, load_rows

    t0 = time.perf_counter()
    rows = [r for r in load_rows(DATA) if args.use in ("all", r.use)]
    cache: dict = {}                      # compare_all's: topologies and plans shared by rows
    results = [compare(r, cache) for r in steps(rows, "simulating the published rows (msc simulate --nccl)",
                                                unit="row")]
    print(f"# {len(rows)} published rows against msc simulate --nccl ({time.perf_counter() - t0:.1f} s); "
          "ratio = predicted / measured speed, nccl = the same for NCCL's own tuning model")
    print(f"{'use':9} {'row':52} {'NCCL choice':24} {'measured':>10} {'msc':>10} {'ratio':>6} {'nccl':>6}  status")
    for c in results:
        print(_line(c, known_gap(c.row)))
    _summary(results, known_gap)
    if args.json:
        Path(args.json).write_text(json.dumps([_record(c, known_gap(c.row)) for c in results], indent=1))
    if args.png:
        _plot([c for c in results if c.predicted is not None], args.png)
        print(f"# plot: {args.png}")
    bad = [c for c in results if (not c.ok and c.blocked is None) != (known_gap(c.row) is not None)]
    if bad:
        print(f"# {len(bad)} rows disagree with the known gaps (outside the bar and not listed, or listed and "
              "within it)", file=sys.stderr)
    return 1 if bad else 0


def _measured(row) -> str:
    if row.busbw is not None:
        return f"{row.busbw:g} GB/s"
    if row.algbw is not None:
        return f"{row.algbw:g} alg"
    if row.time_us is not None:
        return f"{row.time_us:g} us"
    return "-"


def _predicted(c) -> str:
    p, row = c.predicted, c.row
    if p is None:
        return "-"
    if row.busbw is not None:
        return f"{p['busbw']:.4g}"
    if row.algbw is not None:
        return f"{p['algbw']:.4g}"
    return f"{p['time']:.4g} us"


def _status(c, gap) -> str:
    if c.ok:
        return "ok" if gap is None else f"XPASS (listed: {gap})"
    if c.blocked:
        return f"not modelled: {c.blocked}"
    return f"{'gap' if gap else 'FAIL'}: {gap or 'outside the bar'}"


def _line(c, gap) -> str:
    p = c.predicted
    choice = f"{p['algorithm']} {p['protocol']} x{p['channels']}" if p else "-"
    ratio = f"{c.ratio:.2f}" if c.ratio is not None else "-"
    nccl = f"{c.nccl_ratio:.2f}" if c.nccl_ratio is not None and c.nccl_ratio == c.nccl_ratio else "-"
    return f"{c.row.use:9} {c.row.label[:52]:52} {choice:24} {_measured(c.row):>10} {_predicted(c):>10} " \
           f"{ratio:>6} {nccl:>6}  {_status(c, gap)}"


def _summary(results, known_gap) -> None:
    by = defaultdict(lambda: [0, 0, 0, 0])
    for c in results:
        k = by[(c.row.use, c.row.system)]
        k[0] += 1
        k[1] += c.ok
        k[2] += c.blocked is not None
        k[3] += (not c.ok and c.blocked is None)
    print("\n# per system: rows, within the bar, not modelled, outside the bar (known gaps)")
    for (use, system), (n, ok, blocked, off) in sorted(by.items()):
        print(f"#   {use:9} {system:18} {n:4} {ok:4} {blocked:4} {off:4}")
    gaps = defaultdict(list)
    for c in results:
        if not c.ok:
            gaps[c.blocked or known_gap(c.row) or "NOT LISTED"].append(c)
    print("\n# rows the model is not held to yet, by reason (ratios: msc / NCCL's own model)")
    for reason, cs in sorted(gaps.items(), key=lambda kv: -len(kv[1])):
        ratios = ", ".join(f"{c.row.label.split(' ', 1)[1]} {c.ratio:.2f}/{c.nccl_ratio:.2f}"
                           for c in cs if c.ratio is not None and c.nccl_ratio == c.nccl_ratio)
        print(f"# {len(cs):3} {reason}" + (f"\n#       {ratios}" if ratios else ""))


def _record(c, gap) -> dict:
    return {"row": c.row.index, "use": c.row.use, "system": c.row.system, "collective": c.row.collective,
            "size": c.row.compared_size, "measured_busbw": c.row.busbw, "measured_time_us": c.row.time_us,
            "predicted": c.predicted, "ratio": c.ratio, "nccl_ratio": c.nccl_ratio, "ok": c.ok,
            "blocked": c.blocked, "gap": gap, "source": c.row.source}


def _plot(results, path: str) -> None:
    """Measured (circles) and predicted (crosses on a line) busbw by size, a panel per system, a colour
    per collective and forced algorithm or protocol."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = defaultdict(list)
    for c in results:
        if c.row.busbw is not None and c.row.busbw > 0:
            panels[c.row.system].append(c)
    keys = sorted(panels, key=lambda k: (panels[k][0].row.use != "calibrate", k))
    cols = 3
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.9 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        _panel(ax, key, panels[key])
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle("msc simulate --nccl against published NCCL busbw: o measured, x on a line msc's prediction "
                 "(simulated, no GPU)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _panel(ax, system, cs) -> None:
    series = defaultdict(list)
    for c in cs:
        forced = "/".join(x for x in (c.row.algorithm, c.row.protocol) if x) if c.row.forced else ""
        series[f"{c.row.collective}{' ' + forced if forced else ''}"].append(c)
    values = []
    for label, group in sorted(series.items()):
        group = sorted(group, key=lambda c: c.row.compared_size)
        x = [c.row.compared_size for c in group]
        measured, predicted = [c.row.busbw for c in group], [c.predicted["busbw"] for c in group]
        values += measured + predicted
        line, = ax.plot(x, predicted, "x-", ms=5, lw=1.2, label=label)
        ax.plot(x, measured, "o", ms=4, color=line.get_color(), mfc="none")
    ax.set_xscale("log", base=2)
    if max(values) / min(values) > 4:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(values) * 1.15)
    use = cs[0].row.use
    ax.set_title(f"{system} ({'calibrated' if use == 'calibrate' else 'kept to check'})", fontsize=10)
    ax.set_xlabel("size (bytes)", fontsize=8)
    ax.set_ylabel("busbw (GB/s)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right" if max(values) / min(values) > 4 else "lower left")


if __name__ == "__main__":
    sys.exit(main())
