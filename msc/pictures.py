"""Pictures: busbw against size, a plan's schedule, a simulated timeline.

matplotlib is imported here only (the Agg backend: files, no display), so
the rest of msc never needs it. Large plans are summarized rather than
drawn step by step: above SHOW_RANKS ranks the schedule becomes a traffic
matrix and per-rank activity, above SHOW_LANES threadblocks the timeline
becomes per-rank busy time.
"""
from __future__ import annotations

import numpy as np

from msc.errors import UsageError

SHOW_RANKS = 16        # draw every message up to this many ranks
SHOW_LANES = 64        # draw every threadblock's steps up to this many threadblocks
OP_COLORS = {"send": "tab:blue", "recv": "tab:green", "rcs": "tab:cyan", "rrs": "tab:purple", "rrc": "tab:olive",
             "rrcs": "tab:pink", "copy": "tab:gray", "reduce": "tab:orange", "nop": "lightgray"}


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("pictures need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size_label(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def plot_busbw(series: list[tuple[str, list[dict]]], path: str, *, title: str = "") -> None:
    """busbw (GB/s) against size (bytes, log 2 axis): a line per (label, records)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, records in series:
        pts = [(r["size"], r["busbw"]) for r in records if r["size"] > 0]
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    found = [r["size"] for _, records in series for r in records if r["size"] > 0]
    if found:
        lo, hi = int(np.log2(min(found))), int(np.ceil(np.log2(max(found))))
        step = max(1, (hi - lo) // 12)
        ticks = [2 ** e for e in range(lo, hi + 1, step)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([_size_label(t) for t in ticks], rotation=45)
    ax.set_xlabel("message size (bytes, nccl-tests size)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the schedule -------------------------------------------------------------
def _logical_levels(sp, slots):
    """Each step's logical round: its level in the one-iteration DAG."""
    from msc.sim_fast import layers

    lay = layers(sp, slots)
    level = np.empty(sp.num_steps, dtype=np.int64)
    for L in range(len(lay.node_ptr) - 1):
        level[lay.nodes[lay.node_ptr[L]:lay.node_ptr[L + 1]]] = L
    return level


def draw_schedule(plan, path: str) -> None:
    """Ranks as lanes, logical rounds left to right, messages as arrows
    (coloured by chunk), local reductions and copies as markers."""
    from msc.simplan import compile_plan
    from msc.ir import StepOp

    sp = compile_plan(plan)
    level = _logical_levels(sp, plan.slots)
    if plan.num_ranks > SHOW_RANKS:
        return _draw_summary(plan, sp, level, path)
    plt = _plt()
    n = plan.num_ranks
    nlev = int(level.max()) + 1 if len(level) else 1
    fig, ax = plt.subplots(figsize=(min(4 + 0.45 * nlev, 40), 1.2 + 0.55 * n))
    cmap = plt.get_cmap("tab20")
    first_chunk = _first_chunks(plan)
    ops = list(StepOp)
    rank = sp.tb_rank[sp.step_tb]
    for m in range(len(sp.msg_send)):
        s, r = sp.msg_send[m], sp.msg_recv[m]
        x0, y0, x1, y1 = level[s], rank[s], level[r], rank[r]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="-|>", lw=0.9, color=cmap(first_chunk[s] % 20), alpha=0.85,
                                    shrinkA=3, shrinkB=3))
    local = np.flatnonzero(~sp.sends & ~sp.recvs)
    for code, marker in ((ops.index(StepOp.REDUCE), "s"), (ops.index(StepOp.COPY), "D"), (ops.index(StepOp.NOP), ".")):
        sel = local[sp.code[local] == code]
        if len(sel):
            ax.scatter(level[sel], rank[sel], marker=marker, s=28, color=OP_COLORS[ops[code].value],
                       label=ops[code].value, zorder=3)
    red = np.flatnonzero(sp.recvs & (sp.nred > 0))
    if len(red):
        ax.scatter(level[red], rank[red], marker="+", s=40, color="black", label="receive + reduce", zorder=3)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(-0.5, nlev - 0.5)
    ax.set_xlabel("logical round (a step runs once everything it waits for has run)")
    ax.set_title(f"{plan.name}: {plan.collective}, {n} ranks, {plan.num_steps()} steps, "
                 f"{len(sp.msg_send)} messages (arrows coloured by chunk)")
    ax.grid(True, axis="x", alpha=0.2)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _first_chunks(plan) -> np.ndarray:
    out = []
    for rp in plan.ranks:
        for tb in rp.threadblocks:
            out += [(s.dst.index if s.dst is not None else s.srcs[0].index if s.srcs else 0) for s in tb.steps]
    return np.array(out, dtype=np.int64)


def _draw_summary(plan, sp, level, path):
    """Many ranks: chunks sent between each pair of ranks, and per logical
    round the distances (receiver - sender mod n) messages travel: a ring
    is a line at distance 1, halving-doubling a staircase of powers of two."""
    plt = _plt()
    n = plan.num_ranks
    rank = sp.tb_rank[sp.step_tb]
    s, r = sp.msg_send, sp.msg_recv
    traffic = np.zeros((n, n))
    np.add.at(traffic, (rank[s], rank[r]), sp.count[s])
    nlev = int(level.max()) + 1
    bins = min(nlev, 400)
    dist = (rank[r] - rank[s]) % n
    by_dist = np.zeros((n, bins))
    np.add.at(by_dist, (dist, level[s] * bins // nlev), sp.count[s])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1, 1.5]})
    from matplotlib.colors import LogNorm

    im = a1.imshow(np.where(traffic > 0, traffic, np.nan), cmap="viridis", interpolation="nearest", norm=LogNorm())
    a1.set_title("chunks sent, sender (row) to receiver (column)")
    a1.set_xlabel("receiver rank")
    a1.set_ylabel("sender rank")
    fig.colorbar(im, ax=a1, shrink=0.8)
    x = np.linspace(0, nlev, bins + 1)
    y = np.arange(1, n + 1) - 0.5                 # distances 1 .. n-1
    im = a2.pcolormesh(x, y, np.where(by_dist[1:] > 0, by_dist[1:], np.nan), cmap="viridis", shading="flat",
                       norm=LogNorm())
    a2.set_yscale("log")
    a2.set_ylim(0.5, n - 0.5)
    a2.set_title("chunks sent per logical round, by distance to the receiver")
    a2.set_xlabel("logical round")
    a2.set_ylabel("(receiver - sender) mod ranks")
    fig.colorbar(im, ax=a2, shrink=0.8)
    fig.suptitle(f"{plan.name}: {plan.collective}, {n} ranks, {plan.num_steps()} steps, {len(s)} messages "
                 f"(summary: more than {SHOW_RANKS} ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the timeline ---------------------------------------------------------------
def draw_timeline(sim, size: int, path: str) -> None:
    """Simulated time left to right. Few threadblocks: a lane each, a bar
    per step (light: computing, solid: transmitting or local work, coloured
    by op). Many: each rank's number of transmitting threadblocks over time."""
    from msc.ir import StepOp

    plt = _plt()
    res, tl = sim.timeline(size)
    sp, plan = sim.sp, sim.plan
    ops = [op.value for op in StepOp]
    us = 1e6
    total = res.seconds * us
    lanes = sp.num_tbs <= SHOW_LANES
    if lanes:
        fig, ax = plt.subplots(figsize=(13, 1.2 + 0.32 * sp.num_tbs))
        lane = tl["tb"]
        code = sp.code[tl["step"]]
        for op_i, name in enumerate(ops):
            sel = code == op_i
            if not sel.any():
                continue
            a, b, c = tl["start"][sel] * us, tl["txs"][sel] * us, tl["end"][sel] * us
            ax.barh(lane[sel], b - a, left=a, height=0.7, color=OP_COLORS[name], alpha=0.35)
            ax.barh(lane[sel], np.maximum(c - b, total * 3e-3), left=b, height=0.7, color=OP_COLORS[name],
                    label=name)
        ax.set_yticks(range(sp.num_tbs))
        ax.set_yticklabels([f"r{r} tb{t}" for r, t in zip(sp.tb_rank, sp.tb_local)], fontsize=7)
        ax.set_ylim(sp.num_tbs - 0.5, -0.5)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_ylabel("rank, threadblock")
    else:
        bins = 300
        busy = np.zeros((plan.num_ranks, bins))
        t0, t1 = tl["txs"], tl["end"]
        rank = sp.tb_rank[sp.step_tb[tl["step"]]]
        for k in range(bins):       # threadblocks transmitting at the middle of each time bin
            mid = (k + 0.5) / bins * res.seconds
            on = (t0 <= mid) & (t1 > mid)
            busy[:, k] = np.bincount(rank[on], minlength=plan.num_ranks)
        fig, ax = plt.subplots(figsize=(13, 6.5))
        im = ax.imshow(busy, aspect="auto", cmap="magma", interpolation="nearest",
                       extent=(0, total, plan.num_ranks - 0.5, -0.5))
        fig.colorbar(im, ax=ax, label="threadblocks transmitting")
        ax.set_ylabel("rank")
    ax.set_xlabel("time (us)")
    ax.set_title(f"{plan.name} on {sim.topology.name}, {_size_label(res.size)}B: {total:.1f} us "
                 f"({res.iterations} tile iteration(s), {plan.protocol}, {res.engine} engine); "
                 + ("pale: computing, solid: transmitting, gaps: latency and waits" if lanes
                    else "threadblocks transmitting per rank"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
