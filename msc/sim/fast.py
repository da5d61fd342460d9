"""The fast engine: a plan's timing as a max-plus evaluation, level by
level, in numpy, for many sizes at once.

Without contention every time in the model is a max of sums: a step starts
when its threadblock's previous step, its dependencies, its message (sent +
latency) and its slot (freed + latency) are all there, and ends a fixed
duration later. So the plan unrolled over its tile iterations is a DAG with
weighted edges, evaluated in topological order. The DAG of one iteration is
layered once (Kahn, vectorized); edges from earlier iterations (the
threadblock loop, slot credits) carry an iteration offset, so every
iteration reuses the same layers. A level of a 1024-rank ring is the 1024
ranks' k-th step: a few numpy calls evaluate all of them for every size.

Sizes with fewer iterations than the largest simply have empty iterations:
zero durations and zero latencies, which pass times through unchanged. A
single size with many iterations (large messages, small LL tiles) skips the
iterations of its periodic regime exactly (see _jump).

Contention is not modelled here: a transmission (a message, or a switch
op's bytes over its group's ports) runs at its solo rate. The engine
records the transmissions on shared links that several flows use; if the
transmissions on a link (each weighted by its bytes there, for a switch op)
never want more than its capacity at once, every flow ran at its solo rate
under fair sharing too, so this schedule is exact, and the caller
(msc.sim.simulate) falls back to sim_events for the sizes where they do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msc.errors import DeadlockError
from msc.ir.arrays import ranges
from msc.ir.levels import levels as topological_levels
from msc.sim.sim_plan import SimPlan


@dataclass
class Layers:
    """The one-iteration DAG of a plan at a slot count, layered.

    Edge arrays are sorted by (level of destination, destination); level L's
    edges are ``edge_ptr[L]:edge_ptr[L+1]``, its steps ``nodes[node_ptr[L]:
    node_ptr[L+1]]``, and ``group[L]`` the offsets of each step's first edge
    within the level (for reduceat). ``delta``: how many iterations back the
    edge's source is; ``conn``: the connection whose latency the edge
    carries (-1: none)."""

    num_steps: int
    nodes: np.ndarray
    node_ptr: np.ndarray
    src: np.ndarray
    delta: np.ndarray
    conn: np.ndarray
    edge_ptr: np.ndarray
    group: list
    max_delta: int


def edges(sp: SimPlan, slots: int):
    """(src, dst, delta, conn) of every edge of one iteration."""
    G = sp.num_steps
    starts, ends = sp.tb_start[:-1], sp.tb_start[1:]
    nonempty = ends > starts
    first = np.zeros(G, dtype=bool)
    first[starts[nonempty]] = True
    g = np.arange(G, dtype=np.int64)
    prog = g[~first]
    parts = [
        (prog - 1, prog, 0, -1),                                      # program order
        (ends[nonempty] - 1, starts[nonempty], 1, -1),               # the tile loop: last step -> next first
        (sp.dep_src, sp.dep_dst, 0, -1),                              # dependencies
    ]
    per_conn = np.diff(sp.conn_ptr)
    mconn = np.repeat(np.arange(len(per_conn), dtype=np.int64), per_conn)
    parts.append((sp.msg_send, sp.msg_recv, 0, mconn))                # message: sent -> received
    k = np.arange(len(mconn), dtype=np.int64) - sp.conn_ptr[mconn]
    m = per_conn[mconn]
    j = k - slots                                                     # the message whose slot we reuse
    back = np.floor_divide(j, m)                                      # <= 0: iterations back
    src = sp.msg_recv[sp.conn_ptr[mconn] + (j - back * m)]
    parts.append((src, sp.msg_send, -back, mconn))                    # credit: received -> may send again
    src = np.concatenate([np.asarray(p[0], dtype=np.int64) for p in parts])
    dst = np.concatenate([np.asarray(p[1], dtype=np.int64) for p in parts])
    delta = np.concatenate([np.full(len(p[0]), p[2], dtype=np.int64) if np.ndim(p[2]) == 0 else p[2] for p in parts])
    conn = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int64) if np.ndim(p[3]) == 0 else p[3] for p in parts])
    return src, dst, delta, conn


def layers(sp: SimPlan, slots: int) -> Layers:
    G = sp.num_steps
    src, dst, delta, conn = edges(sp, slots)
    level = _levels(sp, G, src[delta == 0], dst[delta == 0], slots)
    # every step needs an edge for reduceat: give sourceless ones one from the zero row (src -1)
    indeg = np.bincount(dst, minlength=G)
    lonely = np.flatnonzero(indeg == 0)
    src = np.concatenate([src, np.full(len(lonely), -1, dtype=np.int64)])
    dst = np.concatenate([dst, lonely])
    delta = np.concatenate([delta, np.zeros(len(lonely), dtype=np.int64)])
    conn = np.concatenate([conn, np.full(len(lonely), -1, dtype=np.int64)])
    indeg[lonely] = 1
    # edges grouped by destination, destinations in level order: no sort of the edges by a compound key
    by_dst = np.argsort(dst, kind="stable")
    in_ptr = np.concatenate([[0], np.cumsum(indeg)])
    nodes = np.argsort(level, kind="stable")
    order = by_dst[ranges(in_ptr[nodes], indeg[nodes])]
    src, delta, conn = src[order].astype(np.int32), delta[order].astype(np.int32), conn[order].astype(np.int32)
    nlev = int(level.max()) + 1 if G else 0
    node_ptr = np.searchsorted(level[nodes], np.arange(nlev + 1))
    edge_ptr = np.concatenate([[0], np.cumsum(indeg[nodes])])[node_ptr]
    starts = np.concatenate([[0], np.cumsum(indeg[nodes])[:-1]])
    group = [starts[node_ptr[L]:node_ptr[L + 1]] - edge_ptr[L] for L in range(nlev)]
    return Layers(G, nodes, node_ptr, src, delta, conn, edge_ptr, group, int(delta.max(initial=0)))


def _levels(sp: SimPlan, G: int, src: np.ndarray, dst: np.ndarray, slots: int) -> np.ndarray:
    """The steps' levels in one iteration (msc.ir.levels); a DeadlockError
    naming the first step a cycle of waits holds back."""
    level = topological_levels(G, src, dst, partial=True)
    if (level < 0).any():
        stuck = np.flatnonzero(level < 0)
        t = int(sp.step_tb[stuck[0]])
        rank, tb, step = int(sp.tb_rank[t]), int(sp.tb_local[t]), int(stuck[0] - sp.tb_start[t])
        raise DeadlockError(f"the plan deadlocks with {slots} slot(s) per connection: {len(stuck)} steps can never "
                            f"run, the first rank {rank} threadblock {tb} step {step} (the plan needs "
                            f"{sp.plan.slots})", [(rank, tb, step, "waits in a cycle")])
    return level


# Jumps (see _jump) are tried for single-size evaluations of more iterations than this.
JUMP_MIN = 16


def _sources(E, s, d, w, dmax, neg, it, W, G, zero, absent, act):
    """Each edge's source time (plus its latency) for iteration ``it``."""
    if dmax == 0:
        cols = s + (it % W) * G
    else:
        back = it - d
        cols = (back % W) * G + s
        if dmax > it:
            cols[back < 0] = absent          # before the first iteration: no such source
    if neg is not None:
        cols[neg] = zero
    vals = E[cols]
    if w is not None:
        wa = w * act
        vals += wa if vals.ndim == 2 else wa[:, 0]
    return vals


def _jump(levels, E, hist, it, iters, tlen, W, G, zero, absent, uniform) -> int:
    """How many iterations can be skipped exactly after iteration ``it``.

    Once every step's time grows by the same increment d[g] per iteration
    (over the last W + 1 iterations, with full tiles), the schedule repeats
    shifted as long as each step's deciding edge stays the one deciding it:
    an edge whose source grows faster than its destination (rate d[src] -
    d[dst] > 0) catches up after slack / rate iterations. So skip m =
    min(floor(slack / rate)) iterations, adding m * d to the kept times,
    and leave the last iteration (a shorter tile) to be evaluated. With
    watched transmissions (contention check) only when d is the same for
    every step, so that the skipped iterations overlap exactly as the
    evaluated ones did."""
    d = hist[-1]
    room = iters - 2 - it
    if len(hist) < W + 1 or room < 1 or it < W + 1:
        return 0
    scale = float(np.abs(d).max()) or 1.0
    tol = 1e-9 * scale
    if uniform and d.max() - d.min() > tol:      # the cheapest test first: evaluate asks every iteration
        return 0
    if not (tlen[it - W - 1:iters - 1, 0] == tlen[it, 0]).all():
        return 0
    for h in hist[:-1]:
        if np.abs(h - d).max() > tol:
            return 0
    act = np.ones(1)
    m = room
    t_tol = 1e-12 * float(E[:W * G].max(initial=0.0))
    for nodes, s, dl, w, group, cn, tn, dmax, wpos, neg, fx, fl in levels:
        vals = _sources(E, s, dl, w, dmax, neg, it, W, G, zero, absent, act)
        start = np.maximum.reduceat(vals, group)
        counts = np.diff(np.append(group, len(vals)))
        slack = np.repeat(start, counts) - vals
        srcd = np.where(s >= 0, d[np.maximum(s, 0)], 0.0)
        dstd = np.repeat(d[nodes], counts)
        deciding = np.maximum.reduceat(np.where(slack <= t_tol, srcd, -np.inf), group)
        if np.abs(deciding - d[nodes]).max() > tol:
            return 0
        rate = srcd - dstd
        fast = rate > tol
        if fast.any():
            m = min(m, int(np.floor((slack[fast] / rate[fast]).min())))
            if m < 1:
                return 0
    return m


@dataclass
class FastResult:
    seconds: np.ndarray                 # per size
    sends: tuple | None                 # (iteration, step, tx start, end) of watched transmissions
    timeline: np.ndarray | None         # (start, tx start, end) x iterations x sizes x steps


def prepare(lay: Layers, conn_alpha: np.ndarray, comp: np.ndarray, tx: np.ndarray,
            watch: np.ndarray | None = None, fixed: np.ndarray | None = None,
            tx_floor: np.ndarray | None = None) -> list:
    """Per level, what evaluate needs (independent of the sizes: build once
    per plan and model). ``comp``/``tx``: seconds per byte of tile of each
    step's compute and transmission; ``watch``: steps whose transmissions
    evaluate records (for the contention check); ``fixed``: seconds each
    step takes per iteration whatever its size (before it transmits);
    ``tx_floor``: the least seconds a transmission takes (a route's
    per-message time)."""
    padded = np.append(conn_alpha, 0.0)                # index -1: no connection, no latency
    w_all = padded[lay.conn]
    levels = []
    for L in range(len(lay.group)):
        e0, e1 = lay.edge_ptr[L], lay.edge_ptr[L + 1]
        nodes = lay.nodes[lay.node_ptr[L]:lay.node_ptr[L + 1]]
        w = w_all[e0:e1]
        d = lay.delta[e0:e1]
        s = lay.src[e0:e1].astype(np.int64)
        neg = np.flatnonzero(s < 0)
        cn, tn = comp[nodes], tx[nodes]
        fx = fixed[nodes] if fixed is not None else None
        fl = tx_floor[nodes] if tx_floor is not None else None
        wpos = np.flatnonzero(watch[nodes]) if watch is not None else np.zeros(0, dtype=np.int64)
        levels.append((nodes, s, d, w[:, None] if w.any() else None, lay.group[L], cn if cn.any() else None,
                       tn if tn.any() else None, int(d.max(initial=0)), wpos if len(wpos) else None,
                       neg if len(neg) else None, fx if fx is not None and fx.any() else None,
                       fl if fl is not None and fl.any() else None))
    return levels


def evaluate(lay: Layers, levels: list, tlen: np.ndarray, watching: bool = False,
             record: bool = False, jump: bool = True) -> FastResult:
    """End times for every size from ``prepare``d levels; ``tlen[it, s]``:
    bytes per chunk in iteration ``it`` for size ``s`` (0: the size has no
    such iteration); ``watching``: return the watched transmissions;
    ``jump``: skip periodic iterations where it can (_jump)."""
    G = lay.num_steps
    iters, nsz = tlen.shape
    W = min(iters, lay.max_delta + 1)                  # iterations of times kept (a ring buffer)
    zero, absent = W * G, W * G + 1         # rows: a source of time 0, a source that does not exist
    # (iteration, step) x sizes; one size: a vector (numpy indexes those several times faster)
    E = np.zeros((zero + 2, nsz) if nsz > 1 else zero + 2)
    E[absent] = -np.inf
    cols, dests = _columns(levels, W, G, zero)
    terms: dict = {}                         # per distinct row of tlen: _terms (one or two for a single size)
    watched, timeline = [], None
    if record:
        timeline = np.zeros((3, iters, nsz, G))
    jumps = jump and nsz == 1 and not record and iters > JUMP_MIN and W > 1
    hist: list = []                          # per-step increments of the last iterations (jumps)
    it = 0
    while it < iters:
        tl = tlen[it]
        key = tl.tobytes()
        per_level = terms.get(key)
        if per_level is None:
            per_level = terms[key] = _terms(levels, tl, nsz)
        act = per_level[-1]
        r = it % W
        for L, (nodes, s, d, w, group, cn, tn, dmax, wpos, neg, fx, fl) in enumerate(levels):
            wt, on_compute, on_fixed, on_tx = per_level[L]
            if dmax > it:                    # sources before the first iteration do not exist
                vals = _sources(E, s, d, w, dmax, neg, it, W, G, zero, absent, act)
            else:
                vals = E[cols[L][r]]
                if wt is not None:
                    vals += wt
            start = np.maximum.reduceat(vals, group, axis=0)
            if dmax > it:
                np.maximum(start, 0.0, out=start)
            txs = start if on_compute is None else start + on_compute
            if on_fixed is not None:
                txs = txs + on_fixed
            end = txs if on_tx is None else txs + on_tx
            E[dests[L][r]] = end
            if wpos is not None:
                watched.append((it, L, txs[wpos], end[wpos]))
            if record:
                for k, x in enumerate((start, txs, end)):
                    timeline[k, it][:, nodes] = x.reshape(len(nodes), nsz).T
        if jumps and it >= 1:
            base, prev = r * G, ((it - 1) % W) * G
            hist = (hist + [E[base:base + G] - E[prev:prev + G]])[-(W + 1):]
            m = _jump(levels, E, hist, it, iters, tlen, W, G, zero, absent, watching)
            if m:
                old = E[:W * G].copy()
                for k in range(it - W + 1, it + 1):
                    a, b = (k % W) * G, ((k + m) % W) * G
                    E[b:b + G] = old[a:a + G] + m * hist[-1]
                it += m
        it += 1
    last = ((iters - 1) % W) * G
    seconds = E.reshape(-1, nsz)[last:last + G].max(axis=0) if G else np.zeros(nsz)
    return FastResult(seconds, _watched_sends(levels, watched, nsz) if watching else None, timeline)


def _columns(levels, W: int, G: int, zero: int):
    """Per level and iteration modulo W: the columns of E its edges read
    (once every source iteration exists) and the columns it writes."""
    cols, dests = [], []
    for nodes, s, d, w, group, cn, tn, dmax, wpos, neg, fx, fl in levels:
        per_r = []
        for r in range(W):
            c = ((r - d) % W) * G + s if dmax else s + r * G
            if neg is not None:
                c[neg] = zero
            per_r.append(c)
        cols.append(per_r)
        dests.append([r * G + nodes for r in range(W)])
    return cols, dests


def _terms(levels, tl: np.ndarray, nsz: int) -> list:
    """What an iteration moving ``tl`` bytes per chunk (per size) adds, per
    level: (edge latencies, compute, fixed time, transmission) as items x
    sizes (one size: vectors), None where nothing; the last item is the
    sizes' activity (1: the size has this iteration). Made once per
    distinct ``tl``, not per iteration."""
    act = (tl > 0).astype(np.float64)

    def per_size(x):
        return x if nsz > 1 else x[:, 0]
    out = []
    for nodes, s, d, w, group, cn, tn, dmax, wpos, neg, fx, fl in levels:
        tx = np.multiply.outer(tn, tl) if tn is not None else None
        if tx is not None and fl is not None:
            tx = np.maximum(tx, np.multiply.outer(fl, act))
        out.append((per_size(w * act) if w is not None else None,
                    per_size(np.multiply.outer(cn, tl)) if cn is not None else None,
                    per_size(np.multiply.outer(fx, act)) if fx is not None else None,
                    per_size(tx) if tx is not None else None))
    out.append(act)
    return out


def _watched_sends(levels, watched: list, nsz: int) -> tuple:
    """(iteration, step, tx start, end) of the watched transmissions, in the order evaluated."""
    if not watched:
        return (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros((0, nsz)), np.zeros((0, nsz)))
    its, lv, txs, ends = zip(*watched)
    counts = [levels[L][8].shape[0] for L in lv]
    steps = np.concatenate([levels[L][0][levels[L][8]] for L in lv])
    return (np.repeat(np.array(its, dtype=np.int64), counts), steps, np.concatenate(txs).reshape(-1, nsz),
            np.concatenate(ends).reshape(-1, nsz))
