"""The event engine's plan folded by its symmetry: threadblocks that do the
same thing at the same instants simulated once per class.

Color refinement (1-dimensional Weisfeiler-Leman) of the graph an EventSim
reads: threadblocks (their steps' compute, bytes, fixed time, ordinals),
connections (messages per iteration, latency), flows (rate cap, per-message
floor) and shared links (capacity), joined by what ties their times: a step
sends, receives or transmits on a connection or flow, depends on another
threadblock's step, a flow crosses a link with a weight. The coarsest
partition where every member of a class has the same attributes and the same
multiset of (relation, class of neighbour) is equitable, and the replay keeps
it: by induction over events, members of a class start, transmit and end each
step instance at the same floats, since every time is the same arithmetic on
equal inputs, and max-min water filling on an equitable partition of flows
and links gives every flow of a class the same rate (the lifted rates of the
quotient are feasible and have the bottleneck property, and max-min rates are
unique). So one representative per class, with each link class's flows
counted as a representative link carries them (_quotient's uses), gives the
full run's makespan. The one float that can differ: a link's frozen flows
are subtracted from its capacity in the folded order, the same floats
where they weigh alike (every flow but a switch op's; tests/test_symmetry.py
compares NVLSTree's makespans exactly too).

Exact where refinement is: its per-node signatures are 64-bit hashes, so the
partition is then checked exactly (every member's attributes and sorted
neighbour classes equal its representative's), and the folded sim's messages
are checked to pair one sender and one receiver per connection class.
Anything that fails, or a partition that folds nothing, is refused with the
reason, and the caller runs the full plan (Simulator._events_time).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from msc.sim.events import EventSim

# folding that keeps more than this share of the threadblocks is not worth its overhead
MIN_FOLD = 0.5
_PARTITIONS: dict = {}       # id of a plan -> its last equitable partition, or its refusal (while it lives)


@dataclass(frozen=True)
class Folded:
    """``sim``: the folded EventSim (None where refused, ``reason`` says why);
    ``classes``/``threadblocks``: its threadblocks and the full run's."""

    sim: EventSim | None
    classes: int
    threadblocks: int
    reason: str = ""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a well-spread 64-bit hash of each value."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _exact_ids(*columns) -> np.ndarray:
    """An id per row of ``columns`` (equal rows, equal ids; floats compared exactly)."""
    n = len(columns[0])
    if not n:
        return np.zeros(0, dtype=np.int64)
    # np.unique(axis=0)'s ids (ranks of the distinct rows in lexicographic order), by a lexsort:
    # np.unique sorts the rows as structured scalars, several times slower
    cols = [np.asarray(c, dtype=np.float64) for c in columns]
    order = np.lexsort(cols[::-1])
    new = np.zeros(n, dtype=bool)
    for c in cols:
        s = c[order]
        new[1:] |= s[1:] != s[:-1]
    ids = np.empty(n, dtype=np.int64)
    ids[order] = np.cumsum(new)
    return ids


class RefinementGraph:
    """The relations of an EventSim as labelled edges ``u -label-> v`` over
    nodes numbered tb, conn, flow, link (each block after the previous), and
    each node's attributes as an exact id (``init``)."""

    def __init__(self, sim: EventSim):
        T, C, F, X = sim.num_tbs, len(sim.per_iter), len(sim.cap), len(sim.capacity)
        self.T, self.C, self.F, self.X = T, C, F, X
        self.off = t0, c0, f0, x0 = (0, T, T + C, T + C + F)
        col = sim.columns
        lens, sc, rc, fc = col.lens, col.sc, col.rc, col.fc
        S = len(sc)
        ndeps = np.bincount(col.dep_owner, minlength=S)
        tb = np.repeat(np.arange(T, dtype=np.int64), lens)
        k = np.arange(S, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        M = int(lens.max(initial=0)) + 1
        # per step its attributes as an id; per threadblock the sequence of those, exactly
        step_id = _exact_ids(col.comp, col.nbytes, sc >= 0, rc >= 0, col.so, col.ro, col.fixed, fc >= 0, ndeps)
        bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
        seqs: dict = {}
        tb_init = [seqs.setdefault(step_id[a:b].tobytes(), len(seqs)) for a, b in zip(bounds[:-1], bounds[1:])]
        floors = sim.floors if sim.floors is not None else [0.0] * F
        blocks = [np.array(tb_init, dtype=np.int64), _exact_ids(sim.per_iter, sim.alpha), _exact_ids(sim.cap, floors),
                  _exact_ids(sim.capacity)]
        base = 0
        for i, b in enumerate(blocks):                 # kinds apart: each block's ids after the previous'
            blocks[i] = b + base
            base += int(b.max()) + 1 if len(b) else 0
        self.init = np.concatenate(blocks)
        # edges, each with its reverse; labels: (relation, step, [dep step or weight]) as one int
        us, ls, vs = [], [], []

        def edge(u, label, v, back):
            us.extend((u, v)); vs.extend((v, u)); ls.extend((label, back))

        s = sc >= 0
        edge(tb[s], 0 * M + k[s], c0 + sc[s], 1 * M + k[s])
        r = rc >= 0
        edge(tb[r], 2 * M + k[r], c0 + rc[r], 3 * M + k[r])
        f = fc >= 0
        edge(tb[f], 4 * M + k[f], f0 + fc[f], 5 * M + k[f])
        if len(col.dep_owner):
            owner, ok = tb[col.dep_owner], k[col.dep_owner]
            edge(owner, (6 * M + ok) * M + col.dep_step, col.dep_tb, (7 * M + ok) * M + col.dep_step)
        if len(sim.use_link):               # the engine's flat link uses: flow, link, weight
            w_id = _exact_ids(sim.use_wt)
            edge(f0 + _use_flows(sim), 8 * M * M + 2 * w_id, x0 + sim.use_link, 8 * M * M + 2 * w_id + 1)
        u = np.concatenate(us) if us else np.zeros(0, dtype=np.int64)
        lab = np.concatenate(ls) if ls else np.zeros(0, dtype=np.int64)
        v = np.concatenate(vs) if vs else np.zeros(0, dtype=np.int64)
        order = np.argsort(u, kind="stable")
        self.u, self.lab, self.v = u[order], lab[order], v[order]
        n = len(self.init)
        self.deg = np.bincount(self.u, minlength=n)
        self.ptr = np.concatenate([[0], np.cumsum(self.deg)])

    def refine(self) -> np.ndarray:
        """The coarsest equitable partition refining the attributes: a class id per node."""
        color = self.init
        n = len(color)
        has = self.deg > 0
        starts = self.ptr[:-1][has]
        count = len(np.unique(color))
        while True:
            key = _mix(self.lab.astype(np.uint64) * np.uint64(0x100000001B3) ^ _mix(color[self.v]))
            acc = np.zeros(n, dtype=np.uint64)
            if len(key):
                acc[has] = np.add.reduceat(key, starts)
            with np.errstate(over="ignore"):
                sig = _mix(_mix(color) * np.uint64(31) + acc)
            _, new = np.unique(sig, return_inverse=True)
            new = new.astype(np.int64)
            found = int(new.max()) + 1 if n else 0
            if found == count:
                return new
            color, count = new, found

    def equitable(self, cls: np.ndarray, rep: np.ndarray) -> bool:
        """Exactly: every node has its class representative's attributes and
        the same sorted (label, neighbour class) sequence."""
        mine = rep[cls]
        if not (self.init == self.init[mine]).all() or not (self.deg == self.deg[mine]).all():
            return False
        order = np.lexsort((cls[self.v], self.lab, self.u))
        lab, vc = self.lab[order], cls[self.v[order]]
        pos = np.arange(len(order)) - self.ptr[self.u]         # u is sorted: order keeps each node's block
        theirs = self.ptr[mine[self.u]] + pos
        return bool((lab == lab[theirs]).all() and (vc == vc[theirs]).all())


def fold(sim: EventSim, plan=None) -> Folded:
    """``sim`` folded by its symmetry (see the module doc), or refused with
    the reason. ``plan``: the object whose structure ``sim`` replays (a
    SimPlan): a partition found for it before is tried first, and kept if
    it is exactly equitable for ``sim`` too (sims of one plan with other
    latencies, slots or step times mostly share it), sparing the
    refinement; a plan refused for too little symmetry is refused again
    without a look (its other sims then run in full, as it did)."""
    known = _PARTITIONS.get(id(plan)) if plan is not None else None
    if isinstance(known, Folded):
        return known
    g = RefinementGraph(sim)
    T, n = g.T, len(g.init)
    tried = [known] if known is not None and len(known) == n else []
    for cls in tried + [None]:
        cls = g.refine() if cls is None else cls
        rep = np.full(int(cls.max()) + 1 if n else 0, n, dtype=np.int64)
        np.minimum.at(rep, cls, np.arange(n))
        tb_classes = len(np.unique(cls[:T]))
        if tb_classes > MIN_FOLD * T:
            refused = Folded(None, tb_classes, T, f"{tb_classes} classes of {T} threadblocks: too little symmetry "
                                                  f"to fold")
            remember_partition(plan, refused)
            return refused
        if g.equitable(cls, rep):
            break
    else:
        return Folded(None, tb_classes, T, "color refinement's hashed partition is not equitable")
    remember_partition(plan, cls)
    return _quotient(sim, g, cls, tb_classes)


def remember_partition(plan, found) -> None:
    """Keep ``found`` (a partition, or a refusal) for ``plan`` while it lives."""
    if plan is None:
        return
    if id(plan) not in _PARTITIONS:
        weakref.finalize(plan, _PARTITIONS.pop, id(plan), None)
    _PARTITIONS[id(plan)] = found


def _use_flows(sim: EventSim) -> np.ndarray:
    """Per entry of the engine's link uses (use_link, use_wt): its flow."""
    return np.repeat(np.arange(len(sim.cap), dtype=np.int64), np.diff(sim.use_ptr))


def _ids(cls: np.ndarray, lo: int, hi: int):
    """Per node in [lo, hi): its class's index among the block's classes, and each class's representative."""
    block = cls[lo:hi]
    reps_cls, first = np.unique(block, return_index=True)
    index = np.searchsorted(reps_cls, block)
    return index, first


def _quotient(sim: EventSim, g: RefinementGraph, cls: np.ndarray, tb_classes: int) -> Folded:
    """The folded EventSim: per class its representative (the class's first
    member), every index into the full sim's threadblocks, connections,
    flows and links taken to its class's."""
    _, c0, f0, x0 = g.off
    T = g.T
    qtb, tb_rep = _ids(cls, 0, T)
    qconn, conn_rep = _ids(cls, c0, f0)
    qflow, flow_rep = _ids(cls, f0, x0)
    _, link_rep = _ids(cls, x0, x0 + g.X)
    order = np.argsort(tb_rep, kind="stable")           # classes in the order of their first threadblock
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.arange(len(order))
    sends = np.zeros(len(conn_rep), dtype=np.int64)     # per conn class: messages per iteration, as folded
    recvs = np.zeros(len(conn_rep), dtype=np.int64)
    reps = [int(tb_rep[q]) for q in order.tolist()]
    steps = []
    for rows in sim.columns.rows(reps):
        folded = []
        for g_, comp, nbytes, sc, rc, so, ro, deps, fixed, fc in rows:
            if sc >= 0:
                sc = int(qconn[sc])
                sends[sc] += 1
            if rc >= 0:
                rc = int(qconn[rc])
                recvs[rc] += 1
            folded.append((g_, comp, nbytes, sc, rc, so, ro, [(int(where[qtb[dt]]), dk) for dt, dk in deps],
                           fixed, int(qflow[fc]) if fc >= 0 else -1))
        steps.append(folded)
    per_iter = [sim.per_iter[int(c)] for c in conn_rep]
    if (sends != per_iter).any() or (recvs != per_iter).any():
        return Folded(None, tb_classes, T, "a connection class's messages do not pair one sender with one receiver")
    # per flow class: for each link class, a use per flow of the class on the representative link
    res = [[] for _ in flow_rep]
    wts = [[] for _ in flow_rep]
    users: dict = {}
    for f, x, w in zip(_use_flows(sim).tolist(), sim.use_link.tolist(), sim.use_wt.tolist()):
        users.setdefault(x, []).append((f, w))
    for q, x in enumerate(link_rep.tolist()):
        for f, w in users.get(x, ()):
            res[qflow[f]].append(q)
            wts[qflow[f]].append(w)
    weighted = any(w is not None for w in sim.wts)
    floors = [sim.floors[int(f)] for f in flow_rep] if sim.floors is not None else None
    folded = EventSim(steps, per_iter, [sim.alpha[int(c)] for c in conn_rep], [sim.cap[int(f)] for f in flow_rep],
                      [tuple(r) for r in res], [sim.capacity[int(x)] for x in link_rep], sim.slots,
                      [sim.names[t] for t in reps],
                      [tuple(w) for w in wts] if weighted else None, floors)
    return Folded(folded, tb_classes, T)
