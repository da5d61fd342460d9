"""NVLS in msc's cost model (issue 30): the library's switch allreduces
simulated on the H100 presets, against published NCCL NVLS measurements
and against link-only plans simulated in the same run, and beside msc
bound's least time (switch plans included: msc.sim.cut_bound's "Switch").

One node (dgx-h100, 8 GPUs): algorithms/allreduce/nvls.py with 16 instances
(NCCL's 16 NVLS channels) beside Azure ND H100 v5's forced-NVLS busbw (NCCL
2.18.5, tests/data/nccl_published.toml), and beside NCCL's ring as msc
models it (msc simulate --nccl) and the library ring with 16 instances.
Several nodes (dgx-h100:2, :4, :8 with --nodes): algorithms/allreduce/nvls_tree.py
(pipelined, two trees) with 4 and 16 instances, and algorithms/allreduce/nvls_ring.py
(NVLS in each node, two rings of nodes across) with 4 instances, against NCCL's
own choice (ring or tree: msc does not model NVLSTree) as msc models it; no
NVLSTree measurement on H100 nodes is in the data set, so those rows compare
models only. nvls_tree x16 is left out from 8 nodes (minutes of simulation).

No GPU: every "msc" number is msc's cost model (simulated); "published" is
a measurement from the source named.

    python bench/nvls.py [--nodes 2,4,8] [--out bench/results/nvls-model-DATE.md]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "nccl_published.toml"
ONE_NODE = [1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30, 2 << 30, 4 << 30, 8 << 30]
NODES = [1 << 20, 64 << 20, 1 << 30, 4 << 30]


def _plan(path: str, n: int, instances: int, **params):
    import msc
    from msc.lower.pipeline import LowerOptions, lower

    [alg] = msc.load_algorithms(ROOT / "algorithms" / path)
    program = msc.trace(alg, n, inplace=True, **params)
    msc.verify(program)
    return lower(program, LowerOptions(instances=instances))


def _busbw(plan, topo, sizes) -> dict[int, float]:
    from msc.sim.simulate import Simulator

    return {r["size"]: r["busbw"] for r in Simulator(plan, topo).records(sizes)}


def _bound_busbw(topo, sizes) -> dict[int, float]:
    """msc bound's allreduce busbw (switch plans included) at each size."""
    from msc.sim.cut_bound import lower_bound

    n = topo.num_ranks
    return {b.size: b.size / b.seconds / 1e9 * 2 * (n - 1) / n for b in lower_bound("allreduce", topo, sizes)}


def one_node() -> list[str]:
    from msc.sim.calibration import load_rows
    from msc.sim.nccl_sim import simulate_nccl
    from msc.sim.presets import get_topology

    topo = get_topology("dgx-h100", 8)
    published = {r.compared_size: r.busbw for r in load_rows(DATA)
                 if r.system == "dgx-h100" and r.algorithm == "nvls" and r.forced and "Azure" in r.source}
    nvls = _busbw(_plan("allreduce/nvls.py", 8, 16), topo, ONE_NODE)
    ring = _busbw(_plan("allreduce/ring.py", 8, 16), topo, ONE_NODE)
    nccl = {r["size"]: r["busbw"] for r in simulate_nccl("allreduce", topo, ONE_NODE, algorithms=["ring"])}
    bound = _bound_busbw(topo, ONE_NODE)
    lines = ["## One node: dgx-h100 (8 H100 on NVSwitch), allreduce, busbw GB/s", "",
             "| size | published NCCL NVLS (Azure) | msc nvls x16 (simulated) | msc / published | "
             "NCCL ring (msc's model) | msc ring x16 (simulated) | nvls / NCCL ring | nvls / ring x16 | "
             "msc bound | nvls %bound |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in ONE_NODE:
        pub = published.get(size)
        ratio = f"{nvls[size] / pub:.2f}" if pub else "-"
        lines.append(f"| {_size(size)} | {pub if pub else '-'} | {nvls[size]:.1f} | {ratio} | {nccl[size]:.1f} | "
                     f"{ring[size]:.1f} | {nvls[size] / nccl[size]:.2f} | {nvls[size] / ring[size]:.2f} | "
                     f"{bound[size]:.1f} | {100 * nvls[size] / bound[size]:.1f} |")
    return lines


def several_nodes(node_counts) -> list[str]:
    from msc.sim.nccl_sim import simulate_nccl
    from msc.sim.presets import get_topology

    lines = ["", "## Several nodes: NVLS inside each node, a tree or rings across (busbw GB/s)", "",
             "| topology | size | msc nvls_tree x4 (simulated) | msc nvls_tree x16 (simulated) | "
             "msc nvls_ring x4 (simulated) | NCCL's choice (msc's model) | tree x4 / NCCL | tree x16 / NCCL | "
             "ring x4 / NCCL | ring x4 / tree x4 | msc bound |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for nodes in node_counts:
        topo = get_topology(f"dgx-h100:{nodes}", 8 * nodes)
        tree = {k: _busbw(_plan("allreduce/nvls_tree.py", 8 * nodes, k, gpus_per_node=8), topo, NODES)
                for k in ((4, 16) if nodes <= 4 else (4,))}
        ring = _busbw(_plan("allreduce/nvls_ring.py", 8 * nodes, 4, gpus_per_node=8), topo, NODES)
        bound = _bound_busbw(topo, NODES)
        for rec in simulate_nccl("allreduce", topo, NODES):
            size, nccl = rec["size"], rec["busbw"]
            tree16 = tree.get(16, {}).get(size)
            lines.append(f"| dgx-h100:{nodes} | {_size(size)} | {tree[4][size]:.1f} | "
                         f"{_fmt(tree16, '.1f')} | {ring[size]:.1f} | "
                         f"{rec['algorithm']} {rec['protocol']} x{rec['channels']}: {nccl:.1f} | "
                         f"{tree[4][size] / nccl:.2f} | {_fmt(tree16 and tree16 / nccl, '.2f')} | "
                         f"{ring[size] / nccl:.2f} | {ring[size] / tree[4][size]:.2f} | {bound[size]:.1f} |")
    return lines


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _size(size: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift:
            return f"{size >> shift}{unit}"
    return str(size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the tables (markdown) here")
    ap.add_argument("--nodes", default="2,4", help="node counts of the several-nodes table (default 2,4)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    lines = ["# NVLS in msc's cost model (simulated; published figures where named)", ""]
    lines += one_node() + several_nodes([int(k) for k in args.nodes.split(",")])
    lines += ["", f"# {time.perf_counter() - t0:.1f} s"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
