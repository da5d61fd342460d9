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
from msc.ir import StepOp

SHOW_RANKS = 16        # draw every message up to this many ranks
SHOW_LANES = 64        # draw every threadblock's steps up to this many threadblocks
OP_COLORS = {op.value: op.color for op in StepOp}       # from the step ops' registry


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("pictures need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: str, *, dpi: int) -> None:
    """``fig`` rendered in memory, then written whole (msc.files.write_output),
    so that a file that cannot be written (a full disk, /dev/full) is an error
    naming it, not a success; the figure is closed either way. The format is
    the file's extension's (PNG without one)."""
    import io
    from pathlib import Path

    from msc.files import write_output

    data = io.BytesIO()
    try:
        fig.savefig(data, dpi=dpi, format=Path(path).suffix[1:].lower() or "png")
    except ValueError as exc:           # an extension matplotlib does not write
        raise UsageError(f"cannot write {path}: {exc}") from None
    finally:
        plt.close(fig)
    try:
        write_output(path, data.getvalue())
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _size_label(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def plot_busbw(series: list[tuple[str, list[dict]]], path: str, *, title: str = ""):
    """busbw (GB/s) against size (bytes), both axes logarithmic (busbw spans
    orders of magnitude across sizes): a line per (label, records).
    Returns the (closed) figure."""
    plt = _plt()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(9, 5.5))
    found_x, found_y = [], []
    for label, records in series:
        pts = [(r["size"], r["busbw"]) for r in records if r["size"] > 0 and r["busbw"] > 0]
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker="o", markersize=3, label=label)
            found_x += x
            found_y += y
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=10)
    if found_x:
        lo, hi = int(np.log2(min(found_x))), int(np.ceil(np.log2(max(found_x))))
        step = max(1, (hi - lo) // 12)
        ticks = [2 ** e for e in range(lo, hi + 1, step)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([_size_label(t) for t in ticks], rotation=45)
        ax.xaxis.set_minor_formatter(NullFormatter())
    if found_y:
        decades = np.log10(max(found_y) / min(found_y))
        subs = (1.0, 2.0, 3.0, 5.0, 7.0) if decades < 1.5 else (1.0, 2.0, 5.0) if decades < 4 else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(min(found_y) / 1.4, max(found_y) * 1.4)
    ax.set_xlabel("message size (bytes, nccl-tests size)")
    ax.set_ylabel("busbw (GB/s, log scale)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", axis="y", alpha=0.12)
    if found_x:
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save_figure(plt, fig, path, dpi=120)
    return fig


# -- the schedule -------------------------------------------------------------
def _logical_levels(sp, slots):
    """Each step's logical round: its level in the one-iteration DAG."""
    from msc.sim.fast import layers

    lay = layers(sp, slots)
    level = np.empty(sp.num_steps, dtype=np.int64)
    for L in range(len(lay.node_ptr) - 1):
        level[lay.nodes[lay.node_ptr[L]:lay.node_ptr[L + 1]]] = L
    return level


def draw_schedule(plan, path: str):
    """Ranks as lanes, logical rounds left to right, messages as arrows.

    Made for multi-phase schedules. A phase is the source line that made a
    message (a hierarchical allreduce's reduce-scatter, ring and allgather
    lines). Phases one after the other share one panel, arrows coloured by
    phase (the legend names file:line and, where the file can be read, its
    code); phases that run at the same time (pipelined trees) get a panel
    each, arrows coloured by chunk; a plan from one line is coloured by
    chunk. Every arrow spans one round: a message received later waits,
    dotted, in the receiver's lane. The steps a rank runs in one round are
    fanned out across its lane (sorted by peer rank, so arrows cross
    little), busy rounds are wider, and each arrow carries the chunk(s) it
    moves where a label fits. Local reductions and copies are markers.
    Returns the (closed) figure."""
    from msc.sim.sim_plan import compile_plan

    sp = compile_plan(plan)
    level = _logical_levels(sp, plan.slots)
    if plan.num_ranks > SHOW_RANKS:
        return _draw_summary(plan, sp, level, path)
    return _Schedule(_plt(), plan, sp, level).draw(path)


class _Schedule:
    """draw_schedule's pieces: phases, positions, arrows, labels, legends."""

    ROUND_IN = 0.62          # inches per (quiet) logical round
    LABEL_PT = 6.5           # chunk label font size
    MAX_FACETS = 6           # more phases than this at once: one panel, coloured by phase

    def __init__(self, plt, plan, sp, level):
        self.plt, self.plan, self.sp, self.level = plt, plan, sp, level
        self.steps = [s for rp in plan.ranks for tb in rp.threadblocks for s in tb.steps]   # global id order
        self.rank = sp.tb_rank[sp.step_tb]
        ops = list(StepOp)
        self.nop = sp.code == ops.index(StepOp.NOP)
        self.local = np.flatnonzero(~sp.sends & ~sp.recvs & ~self.nop)
        self.reduce_code, self.copy_code = ops.index(StepOp.REDUCE), ops.index(StepOp.COPY)
        self.nlev = int(level.max()) + 1 if len(level) else 1
        # a message's phase is its sending step's line (a fused receive-and-send step keeps the send's line)
        first: dict = {}
        for g in np.concatenate([sp.msg_send, self.local]).tolist():
            if self.steps[g].op is StepOp.BARRIER:      # lowering's, from no line: drawn grey
                continue
            key = self.steps[g].where
            first[key] = min(first.get(key, self.nlev), int(level[g]))
        self.phases = sorted(first, key=lambda k: (first[k], k is None, str(k)))
        index = {k: i for i, k in enumerate(self.phases)}
        self.phase = np.array([index.get(s.where, 0) for s in self.steps], dtype=np.int64)
        sent_at: dict[int, set] = {}
        for g in sp.msg_send.tolist():
            sent_at.setdefault(int(level[g]), set()).add(int(self.phase[g]))
        mixed = sum(len(v) > 1 for v in sent_at.values())
        sending = len(set().union(*sent_at.values()))   # lines that send (others only copy or reduce locally)
        self.facets = 1 < sending <= self.MAX_FACETS and mixed >= 2
        self.by_phase = sending > 1 and not self.facets
        # busy rounds are wider: x of each round, from the messages sent in the round before
        sent = np.bincount(level[sp.msg_send], minlength=self.nlev).astype(float)
        widths = np.clip(np.sqrt(sent / max(plan.num_ranks, 1)), 1.0, 2.6)
        self.x = np.concatenate([[0.0], np.cumsum(widths[:-1])])

    def chunk_of(self, g: int) -> tuple[int, str]:
        """The chunks a step writes (else reads first), as the first index
        and a label: index, or first:end. For a message, its receiving
        step's: where the data lands (an out-of-place allgather sends
        input[0] from every rank into output[rank])."""
        step = self.steps[g]
        sl = step.dst if step.dst is not None else step.srcs[0] if step.srcs else None
        if sl is None:
            return 0, ""
        return sl.index, (str(sl.index) if sl.count == 1 else f"{sl.index}:{sl.index + sl.count}")

    def colour(self, g: int, by_chunk_of: int | None = None):
        """Step g's colour (a message's: its sending step's phase, or the
        chunk of by_chunk_of, its receiving step)."""
        if self.by_phase:
            return _qualitative(self.plt, int(self.phase[g]), len(self.phases))
        return _qualitative(self.plt, self.chunk_of(g if by_chunk_of is None else by_chunk_of)[0], 20)

    # -- layout ------------------------------------------------------------------
    def _groups(self):
        """(title, messages, local steps) per panel."""
        sp = self.sp
        msgs = np.arange(len(sp.msg_send))
        if not self.facets:
            return [(None, msgs, self.local)]
        mp, lp = self.phase[sp.msg_send], self.phase[self.local]
        panels = [i for i in range(len(self.phases)) if (mp == i).any()]
        groups = [(i, msgs[mp == i], self.local[lp == i]) for i in panels]
        alone = self.local[~np.isin(lp, panels)]        # local steps of lines that send nothing: the first panel
        groups[0] = (groups[0][0], groups[0][1], np.sort(np.concatenate([groups[0][2], alone])))
        return groups

    def _place(self, msgs, local):
        """y of each drawn step and of each late message's arrival point:
        its rank, fanned out across the lane where several share a round."""
        sp, level, rank = self.sp, self.level, self.rank
        items: dict[tuple[int, int], list] = {}       # cell -> [(sort key, item)]
        peers: dict[int, list[int]] = {}
        for m in msgs.tolist():
            s, r = int(sp.msg_send[m]), int(sp.msg_recv[m])
            peers.setdefault(s, []).append(int(rank[r]))
            peers.setdefault(r, []).append(int(rank[s]))
            if level[r] > level[s] + 1:               # its arrival point, where the dotted wait starts
                items.setdefault((int(rank[r]), int(level[s]) + 1), []).append((int(rank[s]), ("m", m)))
        for g in local.tolist():
            peers.setdefault(g, [])
        for g, p in peers.items():
            items.setdefault((int(rank[g]), int(level[g])), []).append(
                (sum(p) / len(p) if p else int(rank[g]), ("g", g)))
        crowd = max((len(v) for v in items.values()), default=1)
        pos = {}
        for (r, _), members in items.items():
            members.sort(key=lambda t: (t[0], t[1][0], t[1][1]))
            gap = min(0.26, 0.8 / crowd)
            for j, (_, item) in enumerate(members):
                pos[item] = r + (j - (len(members) - 1) / 2) * gap
        return pos, crowd

    def draw(self, path: str):
        plt, plan = self.plt, self.plan
        n = plan.num_ranks
        groups = [(t, m, loc, *self._place(m, loc)) for t, m, loc in self._groups()]
        crowd = max(g[4] for g in groups)
        lane_in = min(max(0.5, 0.16 * crowd), 1.3)
        top_in, left_in, right_in, title_in = 0.7, 0.85, 0.3, (0.3 if self.facets else 0.0)
        bottom_in = 0.6 + (0.19 * len(self.phases) + 0.3 if self.by_phase else 0.3)
        width = min(left_in + right_in + self.ROUND_IN * (self.x[-1] + 1.2), 40)
        width = max(width, 9.5 if self.by_phase else 8.5)
        panel_in = lane_in * n
        height = top_in + bottom_in + len(groups) * (panel_in + title_in) - (0.0 if not self.facets else 0.1)
        fig = plt.figure(figsize=(width, height))
        axes = []
        for k, (title, msgs, local, pos, _) in enumerate(groups):
            bottom = bottom_in + (len(groups) - 1 - k) * (panel_in + title_in)
            ax = fig.add_axes((left_in / width, bottom / height, 1 - (left_in + right_in) / width, panel_in / height),
                              sharex=axes[0] if axes else None)
            axes.append(ax)
            self._frame(ax, last=k == len(groups) - 1)
            if title is not None:
                ax.set_title(f"phase {k + 1}: {_phase_label(self.phases[title], 100)}", loc="left",
                             fontsize=8.5, pad=3)
            self._arrows(ax, msgs, pos)
            self._markers(ax, msgs, local, pos)
            self._labels(fig, ax, msgs, pos)
        fig.text(0.5, 1 - 0.16 / height, f"{plan.name}: {plan.collective}, {n} ranks, {plan.num_steps()} steps, "
                 f"{len(self.sp.msg_send)} messages", ha="center", va="top", fontsize=11)
        how = ("colour: the source line that sent it (phase)" if self.by_phase else
               "a panel per source line (the phases overlap), colour: chunk" if self.facets else
               "colour: chunk")
        bars = "; bars: switch ops over their group's lanes" if self.plan.first_switch_step() is not None else ""
        fig.text(0.5, 1 - 0.43 / height, f"arrows: messages, {how}; numbers: chunks sent; dotted: waits for "
                 f"its receiver{bars}", ha="center", va="top", fontsize=8.5, color="0.3")
        self._legend(fig)
        save_figure(plt, fig, path, dpi=110)
        return fig

    def _frame(self, ax, last: bool) -> None:
        n = self.plan.num_ranks
        for r in range(0, n, 2):      # lane bands
            ax.axhspan(r - 0.5, r + 0.5, color="0.94", zorder=0, lw=0)
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"rank {r}" for r in range(n)], fontsize=9)
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_xlim(-0.6, self.x[-1] + 0.6)
        ax.set_xticks(self.x)
        ax.set_xticklabels([str(L) for L in range(self.nlev)])
        ax.tick_params(axis="x", labelsize=8, labelbottom=last)
        ax.grid(True, axis="x", alpha=0.3)
        if last:
            ax.set_xlabel("logical round (a step runs once everything it waits for has run)", fontsize=9)

    def _ends(self, m, pos):
        """A message's arrow: from its sender to its arrival point, and the receive step."""
        s, r = int(self.sp.msg_send[m]), int(self.sp.msg_recv[m])
        x, level = self.x, self.level
        head = (x[level[s] + 1], pos[("m", m)]) if ("m", m) in pos else (x[level[r]], pos[("g", r)])
        return (x[level[s]], pos[("g", s)]), head, (x[level[r]], pos[("g", r)])

    def _arrows(self, ax, msgs, pos) -> None:
        sp = self.sp
        for m in msgs.tolist():
            s, r = int(sp.msg_send[m]), int(sp.msg_recv[m])
            tail, head, end = self._ends(m, pos)
            colour = self.colour(s, r)
            late = head != end
            ax.annotate("", xy=head, xytext=tail, zorder=2,
                        arrowprops=dict(arrowstyle="-|>", lw=1.0, color=colour, alpha=0.9, shrinkA=2,
                                        shrinkB=1.5 if late or sp.nred[r] == 0 else 4, mutation_scale=6.5))
            if late:
                ax.plot([head[0], end[0]], [head[1], end[1]], ls=(0, (1.2, 1.6)), lw=1.0, color=colour, alpha=0.8,
                        zorder=2)

    def _markers(self, ax, msgs, local, pos) -> None:
        sp, x, level = self.sp, self.x, self.level
        recv = np.unique(sp.msg_recv[msgs])
        red = recv[sp.nred[recv] > 0]
        if len(red):
            ax.scatter(x[level[red]], [pos[("g", int(g))] for g in red], marker="+", s=26, lw=1.1, color="black",
                       zorder=4)
        send = np.unique(sp.msg_send[msgs])
        if len(send):
            ax.scatter(x[level[send]], [pos[("g", int(g))] for g in send], marker="o", s=6, color="0.2", zorder=4,
                       lw=0)
        for code, marker in ((self.reduce_code, "s"), (self.copy_code, "D")):
            sel = local[sp.code[local] == code]
            if len(sel):
                ax.scatter(x[level[sel]], [pos[("g", int(g))] for g in sel], marker=marker, s=24,
                           color=[self.colour(int(g)) for g in sel], edgecolors="black", linewidths=0.5, zorder=4)
        self._switch(ax, local, pos)

    SWITCH_MARKERS = {StepOp.SWRED: "v", StepOp.SWST: "^", StepOp.SWRS: "*"}

    def _switch(self, ax, local, pos) -> None:
        """Switch ops (NVLS): a bar over the group's lanes at the step's
        round, ticks on the members it reads or writes, the issuing rank's
        marker (v: reduce to itself, ^: store to all, *: both); a group
        barrier: a dashed grey bar."""
        x, level, sp = self.x, self.level, self.sp
        for g in local.tolist():
            op = self.steps[g].op
            if not op.switch:
                continue
            tb = self.plan.ranks[int(self.rank[g])].threadblocks[int(sp.tb_local[sp.step_tb[g]])]
            lo, hi, at = min(tb.group), max(tb.group), x[level[g]]
            if op is StepOp.BARRIER:
                ax.plot([at, at], [lo - 0.35, hi + 0.35], ls=(0, (3, 2)), lw=1.0, color="0.45", zorder=1)
                continue
            colour = self.colour(g)
            ax.plot([at, at], [lo, hi], lw=2.2, color=colour, alpha=0.55, zorder=2, solid_capstyle="round")
            ax.scatter([at] * len(tb.group), list(tb.group), marker="_", s=40, color=colour, zorder=3, lw=1.2)
            ax.scatter([at], [pos[("g", g)]], marker=self.SWITCH_MARKERS[op], s=70, color=colour, edgecolors="black",
                       linewidths=0.5, zorder=5)

    def _labels(self, fig, ax, msgs, pos) -> None:
        """The chunks each message moves, on its arrow where the label fits:
        greedy in pixels, clear of other labels and of arrow ends, short
        arrows first (they have the least room)."""
        sp = self.sp
        px = fig.dpi / 72 * self.LABEL_PT
        h = 1.25 * px
        to_px = ax.transData.transform
        arrows = [(m, *self._ends(m, pos)) for m in msgs.tolist()]
        if not arrows:
            return
        ends = to_px(np.array([p for a in arrows for p in a[1:]], dtype=float))
        placed: list[tuple[float, float, float, float]] = []
        arrows.sort(key=lambda a: (abs(a[2][1] - a[1][1]), a[0]))
        for m, tail, head, _ in arrows:
            s, r = int(sp.msg_send[m]), int(sp.msg_recv[m])
            text = self.chunk_of(r)[1]
            if not text:
                continue
            w = px * (0.6 * len(text) + 0.45)
            (x0, y0), (x1, y1) = to_px(np.array([tail, head], dtype=float))
            along = (0.5, 0.4, 0.6, 0.3, 0.7) if np.hypot(x1 - x0, y1 - y0) < 110 else (0.3, 0.22, 0.4, 0.5, 0.6, 0.7)
            for t in along:
                cx, cy = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
                box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
                if any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                    continue
                if np.any((np.abs(ends[:, 0] - cx) < w / 2 + 4) & (np.abs(ends[:, 1] - cy) < h / 2 + 4)):
                    continue
                placed.append(box)
                tx, ty = ax.transData.inverted().transform((cx, cy))
                ax.text(tx, ty, text, fontsize=self.LABEL_PT, ha="center", va="center", zorder=5,
                        color=self.colour(s, r), fontweight="bold",
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
                break

    def _legend(self, fig) -> None:
        from matplotlib.lines import Line2D

        if self.by_phase:
            handles = [Line2D([], [], color=_qualitative(self.plt, i, len(self.phases)), lw=2.4,
                              label=_phase_label(key, 80)) for i, key in enumerate(self.phases)]
            fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.005, 0.005), fontsize=8,
                       frameon=False, title="source line (phase), in order of first use", title_fontsize=8,
                       alignment="left", handlelength=2.2, labelspacing=0.3)
        sp = self.sp
        kinds = []
        if len(sp.msg_send):
            kinds.append(Line2D([], [], ls="none", marker="o", color="0.2", ms=2.5, label="send"))
        if (sp.nred[sp.msg_recv] > 0).any():
            kinds.append(Line2D([], [], ls="none", marker="+", color="black", ms=7, label="receive and reduce"))
        if (sp.code[self.local] == self.reduce_code).any():
            kinds.append(Line2D([], [], ls="none", marker="s", mfc="white", mec="black", ms=5, label="local reduce"))
        if (sp.code[self.local] == self.copy_code).any():
            kinds.append(Line2D([], [], ls="none", marker="D", mfc="white", mec="black", ms=5, label="local copy"))
        present = {self.steps[g].op for g in self.local.tolist() if self.steps[g].op.switch}
        for op, label in ((StepOp.SWRED, "switch reduce to itself"), (StepOp.SWST, "switch store to all"),
                          (StepOp.SWRS, "switch reduce, store to all")):
            if op in present:
                kinds.append(Line2D([], [], ls="none", marker=self.SWITCH_MARKERS[op], mfc="white", mec="black",
                                    ms=8, label=label))
        if StepOp.BARRIER in present:
            kinds.append(Line2D([], [], ls=(0, (3, 2)), color="0.45", lw=1.0, label="group barrier"))
        if kinds:
            # beside the phase legend, in rows of three: clear of its longest lines
            fig.legend(handles=kinds, loc="lower right", bbox_to_anchor=(0.995, 0.005), fontsize=8, frameon=False,
                       ncol=len(kinds) if len(kinds) <= 4 or not self.by_phase else 2, columnspacing=1.2,
                       handletextpad=0.3)


def _qualitative(plt, i: int, n: int):
    """Colour i of n well-separated colours (tab10; above 10, tab20's dark then light half)."""
    if n <= 10:
        return plt.get_cmap("tab10")(i % 10)
    j = i % 20
    return plt.get_cmap("tab20")(2 * j if j < 10 else 2 * (j - 10) + 1)


def _phase_label(where, width: int = 64) -> str:
    """file:line and, where the file can be read, the code on that line."""
    if where is None:
        return "(no source line)"
    import linecache
    from pathlib import Path

    label = f"{Path(where.file).name}:{where.line}"
    code = linecache.getline(where.file, where.line).strip()
    if code:
        label += "   " + (code if len(code) <= width else code[:width - 3] + "...")
    return label


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
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    im = a1.imshow(np.where(traffic > 0, traffic, np.nan), cmap="viridis", interpolation="nearest",
                   norm=_log_norm(traffic))
    a1.set_title("chunks sent, sender (row) to receiver (column)")
    a1.set_xlabel("receiver rank")
    a1.set_ylabel("sender rank")
    _log_colorbar(fig, im, a1)
    x = np.linspace(0, nlev, bins + 1)
    y = np.arange(1, n + 1) - 0.5                 # distances 1 .. n-1
    im = a2.pcolormesh(x, y, np.where(by_dist[1:] > 0, by_dist[1:], np.nan), cmap="viridis", shading="flat",
                       norm=_log_norm(by_dist[1:]))
    a2.set_yscale("log", base=2)
    a2.set_ylim(0.5, n - 0.5)
    a2.yaxis.set_major_locator(FixedLocator([2 ** e for e in range(int(np.log2(n - 1)) + 1)]))
    a2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a2.yaxis.set_minor_locator(NullLocator())
    a2.yaxis.set_minor_formatter(NullFormatter())
    a2.set_title("chunks sent per logical round, by distance to the receiver")
    a2.set_xlabel("logical round")
    a2.set_ylabel("(receiver - sender) mod ranks")
    _log_colorbar(fig, im, a2)
    fig.suptitle(f"{plan.name}: {plan.collective}, {n} ranks, {plan.num_steps()} steps, {len(s)} messages "
                 f"(summary: more than {SHOW_RANKS} ranks)")
    fig.tight_layout()
    save_figure(plt, fig, path, dpi=110)
    return fig


def _log_norm(values: np.ndarray):
    """A log colour scale over the positive values (a decade wide at least: one value is still a colour)."""
    from matplotlib.colors import LogNorm

    pos = values[values > 0]
    lo, hi = (float(pos.min()), float(pos.max())) if len(pos) else (1.0, 10.0)
    mid = np.sqrt(lo * hi)
    return LogNorm(vmin=min(lo, mid / np.sqrt(10)), vmax=max(hi, mid * np.sqrt(10)))


def _log_colorbar(fig, im, ax) -> None:
    """A colour bar with plain numbers (1, 2, 5, 10, ...) rather than powers of ten."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    norm = im.norm
    ticks = [m * 10 ** e for e in range(int(np.floor(np.log10(norm.vmin))), int(np.ceil(np.log10(norm.vmax))) + 1)
             for m in (1, 2, 5) if norm.vmin <= m * 10 ** e <= norm.vmax]
    cb = fig.colorbar(im, ax=ax, shrink=0.8, label="chunks")
    cb.ax.yaxis.set_major_locator(FixedLocator(ticks))
    cb.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    cb.ax.yaxis.set_minor_formatter(NullFormatter())


# -- the timeline ---------------------------------------------------------------
def draw_timeline(sim, size: int, path: str):
    """Simulated time left to right. Few threadblocks: a lane each, a bar
    per step (light: computing, solid: transmitting or local work, coloured
    by op), a grey band per rank. Many: each rank's number of transmitting
    threadblocks over time. Returns the (closed) figure."""
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
        for r in range(0, plan.num_ranks, 2):          # a band per rank: its threadblocks are consecutive lanes
            tbs = np.flatnonzero(sp.tb_rank == r)
            if len(tbs):
                ax.axhspan(tbs[0] - 0.5, tbs[-1] + 0.5, color="0.94", zorder=0, lw=0)
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
                 f"({res.iterations} tile iteration(s), {plan.protocol}, {res.engine} engine)"
                 + ("; pale: computing, solid: transmitting, gaps: latency and waits" if lanes
                    else f"\n{sp.num_tbs} threadblocks, over {SHOW_LANES}: a row per rank, coloured by how many "
                         f"of its threadblocks transmit"), fontsize=9)
    fig.tight_layout()
    save_figure(plt, fig, path, dpi=110)
    return fig
