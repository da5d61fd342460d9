"""The event engine: the plan replayed in time, one size at a time, with
transfers sharing links max-min fairly.

Each threadblock runs its steps in order, tile iteration after tile
iteration, as the runtime does. A step starts when its dependencies (same
iteration) are done, its message has arrived and, if it sends, the
connection has a free slot; it then computes (reductions, local copies) and
transmits; the message arrives one route latency after the transmission
ends, and the receiver's release of a slot reaches the sender one latency
after the receiving step ends.

Transmissions are fluid flows. A flow's rate is limited by its private cap
(the threadblock's rate, unshared links) and by the shared links it
crosses, divided max-min fairly among the flows on them (water filling); it
is recomputed for the flows connected to a flow that starts or ends. A
switch op (NVLS) is a flow too, over its group's switch ports, with a weight
per port (the bytes it moves there per byte of its chunk, at the switch's
rate: msc.sim.simulate.Simulator._switch_flows); it ends when its data has
moved, with no message to deliver.
"""
from __future__ import annotations

from dataclasses import dataclass
from heapq import heappop, heappush

import numpy as np

from msc.errors import DeadlockError

_COMPUTED, _FLOW, _ARRIVE, _CREDIT = 0, 1, 2, 3
RATE_CACHE = 65_536          # sets of flows whose max-min rates are kept per EventSim (bounds memory)
SMALL = 64                   # linked flows up to which rates are settled and set in Python, not numpy


class _Flow:
    """A transfer as maxmin, linked_flows and settle take it: its owner ``t``, remaining bytes, shared
    links ``res`` (with bytes per byte ``w`` on each, None for 1), rate cap (the one-sided model's
    flows; EventSim keeps its own in arrays)."""
    __slots__ = ("t", "conn", "rem", "rate", "last", "res", "cap", "ver", "w")

    def __init__(self, t, rem, res, cap, now, conn=-1, w=None):
        self.t, self.conn, self.rem, self.res, self.cap, self.last = t, conn, rem, res, cap, now
        self.rate, self.ver, self.w = 0.0, 0, w


def _uses(f):
    """(link, bytes on it per byte of ``f``) of a flow's shared links (``.w``: None for 1 on each)."""
    return zip(f.res, f.w) if f.w is not None else ((r, 1) for r in f.res)


def linked_flows(members: dict, seeds) -> tuple[set, set]:
    """The flows on the links ``seeds`` and, transitively, on every link
    those flows cross (``members``: link -> its flows), and those links:
    what one change of rates can reach."""
    flows, seen, stack = set(), set(seeds), list(seeds)
    while stack:
        for f in members.get(stack.pop(), ()):
            if f not in flows:
                flows.add(f)
                for r in f.res:
                    if r not in seen:
                        seen.add(r)
                        stack.append(r)
    return flows, seen


def settle(flows, now: float) -> None:
    """Bring each flow's remaining bytes to ``now`` at the rate it had since
    its last change, before its rate changes."""
    for f in flows:
        f.rem = max(f.rem - f.rate * (now - f.last), 0.0)
        f.last = now


def maxmin(flows, capacity, members) -> dict:
    """Max-min fair rates of ``flows`` (each with ``.cap``, ``.res`` and
    ``.w``, the bytes a byte of it puts on each link; a switch op's differ
    from 1): raise every unfrozen flow's rate together until a flow meets
    its cap or a link is full (its flows' rates times their weights fill
    it), freeze those flows, repeat."""
    left = {r: capacity[r] for f in flows for r in f.res}
    count = {r: 0 for r in left}                # unfrozen flows on each link
    weight = {r: 0 for r in left}               # their weights' sum (the count where all are 1)
    for f in flows:
        for r, w in _uses(f):
            count[r] += 1
            weight[r] += w
    active = set(flows)
    rate = {}
    while active:
        level = min(f.cap for f in active)
        for r, c in count.items():
            if c:
                level = min(level, left[r] / weight[r])
        tol = level * (1 + 1e-12)
        frozen = {f for f in active if f.cap <= tol}
        for r, c in count.items():
            if c and left[r] / weight[r] <= tol:
                frozen.update(f for f in members[r] if f in active)
        for f in frozen:
            rate[f] = level
            active.discard(f)
            for r, w in _uses(f):
                left[r] -= level * w
                count[r] -= 1
                weight[r] -= w
    return rate


def maxmin_arrays(flows, cap, ptr, link, wt, capacity) -> np.ndarray:
    """maxmin over arrays: the rates of flows ``flows`` (ids into ``cap``;
    flow f's shared links are ``link[ptr[f]:ptr[f + 1]]`` with bytes per byte
    ``wt`` there), with every float operation of maxmin's, so where a link's
    flows weigh alike (every flow but a switch op's) the rates are the same
    floats (a link's frozen flows are subtracted in another order: only
    differing weights could round otherwise)."""
    nres = ptr[flows + 1] - ptr[flows]
    start = np.repeat(ptr[flows] - (np.cumsum(nres) - nres), nres)
    at = start + np.arange(int(nres.sum()))
    owner = np.repeat(np.arange(len(flows)), nres)            # per use: its flow's position in ``flows``
    used = link[at]
    present = np.zeros(len(capacity), dtype=bool)
    present[used] = True
    links = np.flatnonzero(present)                           # np.unique's sorted links, without its sort
    index = np.empty(len(capacity), dtype=np.int64)
    index[links] = np.arange(len(links))
    use = index[used]                                         # per use: its link's position in ``links``
    w = wt[at]
    L, F = len(links), len(flows)
    left = capacity[links]
    count = np.bincount(use, minlength=L)
    # every weight 1 (all but switch ops): a link's weight is its count, and its frozen flows' subtractions
    # are equal, so their order is free: the same floats a round at a time, without np.subtract.at
    uniform = bool((w == 1.0).all())
    weight = count.astype(np.float64) if uniform else np.bincount(use, weights=w, minlength=L)
    caps = cap[flows]
    if uniform and L and F:
        # the common first round: no link fills below the least cap and every cap is within the
        # tolerance of it, so every flow freezes at that level at once (what the loop gives)
        ratio = left / weight                                 # every link has a flow
        level = min(caps.min(), ratio.min())
        if caps.max() <= level * (1 + 1e-12):
            return np.full(F, level)
    active = np.ones(F, dtype=bool)
    rate = np.empty(F)
    ratio = np.empty(L)
    remaining = F
    while remaining:
        busy = count > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(left, weight, out=ratio)
        ratio[~busy] = np.inf                                 # only links with unfrozen flows fill
        level = min(caps[active].min(), ratio.min())
        tol = level * (1 + 1e-12)
        hit = np.zeros(F, dtype=bool)
        hit[owner[(ratio <= tol)[use]]] = True
        frozen = active & ((caps <= tol) | hit)
        rate[frozen] = level
        active &= ~frozen
        remaining -= int(np.count_nonzero(frozen))
        gone = frozen[owner]
        ug = use[gone]
        if uniform:
            k = np.bincount(ug, minlength=L)
            count -= k
            for j in range(1, int(k.max(initial=0)) + 1):
                left[k >= j] -= level
            weight = count.astype(np.float64)
        else:
            np.subtract.at(left, ug, level * w[gone])
            count -= np.bincount(ug, minlength=L)
            weight -= np.bincount(ug, weights=w[gone], minlength=L)
    return rate


def link_columns(ptr, link, nlinks: int) -> list[np.ndarray]:
    """Flow f's shared links ``link[ptr[f]:ptr[f + 1]]`` as columns: column j
    holds each flow's j-th link, or the sentinel ``nlinks`` (a link of no
    capacity that maxmin_classes never lets fill) where it has fewer."""
    nres = np.diff(ptr)
    pad = np.full((len(nres), max(int(nres.max(initial=1)), 1)), nlinks, dtype=np.int64)
    pad[np.repeat(np.arange(len(nres)), nres), np.arange(len(link)) - np.repeat(ptr[:-1], nres)] = link
    return [np.ascontiguousarray(pad[:, j]) for j in range(pad.shape[1])]


def maxmin_classes(classes, mult, cap, cols, capacity) -> np.ndarray:
    """maxmin_arrays for flows of unit weight, given as classes of alike
    flows (each class one cap ``cap[c]`` and one multiset of links, in
    link_columns' ``cols``) with ``mult`` flows each: the rate of each class.
    A class's flows meet the same caps and links in every round, so they
    freeze together, and each link's count and subtractions are maxmin's,
    one subtraction per frozen flow: the same floats at a fraction of the
    work (a 1024-GPU tree's components of ~350 flows are ~260 classes)."""
    L1 = len(capacity) + 1
    uses = [u[classes] for u in cols]
    count = np.bincount(uses[0], weights=mult, minlength=L1)     # float counts: maxmin's weights, exactly
    for u in uses[1:]:
        count += np.bincount(u, weights=mult, minlength=L1)
    count[-1] = 0.0
    caps = cap[classes]
    left = np.empty(L1)
    left[:-1] = capacity
    left[-1] = np.inf
    ratio = np.empty(L1)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(left, count, out=ratio)
    ratio[count == 0] = np.inf                                    # only links with unfrozen flows fill
    level = min(caps.min(), ratio.min())
    if caps.max() <= level * (1 + 1e-12):     # the common case: every flow freezes in the first round
        return np.full(len(classes), level)
    active = np.ones(len(classes), dtype=bool)
    rate = np.empty(len(classes))
    while True:
        tol = level * (1 + 1e-12)
        full = ratio <= tol
        frozen = caps <= tol
        for u in uses:
            frozen |= full[u]
        frozen &= active
        rate[frozen] = level
        active &= ~frozen
        if not active.any():
            return rate
        k = np.bincount(uses[0][frozen], weights=mult[frozen], minlength=L1)
        for u in uses[1:]:
            k += np.bincount(u[frozen], weights=mult[frozen], minlength=L1)
        k[-1] = 0.0
        count -= k
        # a link with flows left loses its frozen ones' level one at a time, as maxmin subtracts them
        sel = np.flatnonzero((k > 0) & (count > 0))
        if len(sel):
            ks = k[sel]
            left[sel] -= level
            for j in range(2, int(ks.max()) + 1):
                left[sel[ks >= j]] -= level
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(left, count, out=ratio)
        ratio[count == 0] = np.inf
        level = min(caps[active].min(), ratio.min())


@dataclass(frozen=True)
class StepColumns:
    """An EventSim's steps as arrays, for analyses of the plan
    (msc.sim.symmetry): per threadblock its step count ``lens``; per step
    (threadblock order) the fields of its row; per dependency its owner
    step (a global index), the threadblock and step it waits for."""

    lens: np.ndarray
    comp: np.ndarray
    nbytes: np.ndarray
    sc: np.ndarray
    rc: np.ndarray
    so: np.ndarray
    ro: np.ndarray
    fixed: np.ndarray
    fc: np.ndarray
    dep_owner: np.ndarray
    dep_tb: np.ndarray
    dep_step: np.ndarray

    @classmethod
    def of(cls, steps) -> "StepColumns":
        """The columns of EventSim rows ``steps``."""
        lens = np.array([len(r) for r in steps], dtype=np.int64)
        flat = [row for rows in steps for row in rows]
        _, comp, nbytes, sc, rc, so, ro, deps, fixed, fc = list(zip(*flat)) if flat else [()] * 10
        ndeps = [len(d) for d in deps]
        dep_flat = [x for d in deps for x in d]
        dt, dk = (list(x) for x in zip(*dep_flat)) if dep_flat else ([], [])
        i64, f64 = (lambda x: np.array(x, dtype=np.int64)), (lambda x: np.array(x, dtype=np.float64))
        return cls(lens, f64(comp), f64(nbytes), i64(sc), i64(rc), i64(so), i64(ro), f64(fixed), i64(fc),
                   np.repeat(np.arange(len(flat), dtype=np.int64), ndeps), i64(dt), i64(dk))

    def rows(self, tbs=None) -> list:
        """EventSim rows of threadblocks ``tbs`` (default all), in that order."""
        starts = np.concatenate([[0], np.cumsum(self.lens)]).tolist()
        order = np.argsort(self.dep_owner, kind="stable")          # a step's deps in their order here
        dptr = np.searchsorted(self.dep_owner[order], np.arange(len(self.sc) + 1)).tolist()
        dtb, dstep = self.dep_tb[order].tolist(), self.dep_step[order].tolist()
        out = []
        for t in (range(len(self.lens)) if tbs is None else tbs):
            a, b = starts[t], starts[t + 1]
            out.append(list(zip(range(a, b), self.comp[a:b].tolist(), self.nbytes[a:b].tolist(),
                                self.sc[a:b].tolist(), self.rc[a:b].tolist(), self.so[a:b].tolist(),
                                self.ro[a:b].tolist(),
                                [list(zip(dtb[dptr[g]:dptr[g + 1]], dstep[dptr[g]:dptr[g + 1]])) for g in range(a, b)],
                                self.fixed[a:b].tolist(), self.fc[a:b].tolist())))
        return out


class EventSim:
    """One plan on one topology; ``run(tlen)`` simulates one size.

    ``steps[t]``: per step of threadblock t, (global id, compute seconds per
    tile byte, data bytes per tile byte, send connection, receive
    connection, send ordinal, receive ordinal, deps as (tb, step), fixed
    seconds per iteration, flow) with -1 for no connection; ``per_iter[c]``: messages of connection c per
    iteration; ``alpha[c]``: its latency. A step's flow (its send
    connection, or for a switch op a flow of its own, numbered after the
    connections) has ``cap[f]``, ``res[f]`` and ``wts[f]``: its private
    rate cap, shared links and bytes per byte on each (None: 1 each), and
    ``floors[f]`` the least bytes a message of it counts for (its route's
    per-message time at its own rate; None: 0); ``capacity[r]``: link
    rates; ``names[t]``: (rank, threadblock id) of threadblock t, for
    errors; ``columns``: the steps as StepColumns, where the caller has them
    (else made from ``steps`` when asked for); ``steps`` None: made from
    ``columns`` when a run first needs them (a folded run never does)."""

    def __init__(self, steps, per_iter, alpha, cap, res, capacity, slots, names, wts=None, floors=None,
                 columns: StepColumns | None = None):
        self._steps, self.per_iter, self.alpha, self.cap, self.res = steps, per_iter, alpha, cap, res
        self._columns = columns
        self.wts = wts if wts is not None else [None] * len(res)
        self.floors = floors if floors is not None and any(floors) else None
        self.capacity, self.slots, self.names = capacity, slots, names
        # max-min rates per multiset of connections with flows (their sorted ids' bytes -> their
        # rates in that order): a flow's rate depends only on its connection's cap and links and
        # on the others', so the periodic regime's repeated sets of flows are solved once
        self.rates: dict = {}
        self.few_rates: dict = {}        # the same for _Replay._rebalance_few, keyed by tuples
        # the flows' shared links as arrays for maxmin_arrays: flow f's are link[ptr[f]:ptr[f + 1]]
        nres = [len(r) for r in res]
        self.use_ptr = np.concatenate([[0], np.cumsum(nres)]).astype(np.int64)
        self.use_link = np.array([x for r in res for x in r], dtype=np.int64)
        self.use_wt = np.array([float(x) for r, w in zip(res, self.wts) for x in (w if w is not None else [1] * len(r))],
                               dtype=np.float64)
        self.cap_arr = np.asarray(cap, dtype=np.float64)
        self.capacity_arr = np.asarray(capacity, dtype=np.float64)
        # every use of unit weight (all but switch ops'): rates are solved per class of alike flows
        self.uniform = bool((self.use_wt == 1.0).all())
        self._classes = None
        self._pairs = None

    def link_pairs(self) -> list:
        """Per flow, the ordered pairs of distinct shared links it crosses (what _Replay.near counts)."""
        if self._pairs is None:
            self._pairs = [tuple((a, b) for a in set(r) for b in set(r) if a != b) for r in self.res]
        return self._pairs

    def flow_classes(self):
        """(per flow its class, per class its cap, its links as link_columns): flows of one cap and one
        multiset of links get one rate in any max-min solution, so only their classes' counts matter."""
        if self._classes is None:
            seen: dict = {}
            of = [seen.setdefault((c, tuple(sorted(r))), f) for f, (c, r) in enumerate(zip(self.cap, self.res))]
            reps = np.array(list(seen.values()), dtype=np.int64)
            index = np.empty(len(self.cap), dtype=np.int64)
            index[reps] = np.arange(len(reps))
            cols = link_columns(self.use_ptr, self.use_link, len(self.capacity))
            self._classes = (index[np.array(of, dtype=np.int64)], self.cap_arr[reps], [c[reps] for c in cols])
        return self._classes

    @property
    def steps(self) -> list:
        if self._steps is None:
            self._steps = self._columns.rows()
        return self._steps

    @property
    def num_tbs(self) -> int:
        return len(self._steps) if self._steps is not None else len(self._columns.lens)

    @property
    def columns(self) -> StepColumns:
        if self._columns is None:
            self._columns = StepColumns.of(self.steps)
        return self._columns

    def run(self, tlen: list[float], record: bool = False):
        """Makespan (s) for a size whose tile iteration ``it`` moves
        ``tlen[it]`` bytes per chunk; with ``record``, also every step's
        (tb, iteration, step, start, transmit start, end)."""
        replay = _Replay(self, tlen, record)
        for tb in range(len(self.steps)):
            replay.try_start(tb)
        replay.loop()
        replay.raise_if_stuck(self.names)
        return (replay.end, replay.log) if record else replay.end


class _Replay:
    """The state of one ``EventSim.run``: per threadblock its next step
    instance (``nxt``, iteration * steps + step) and finished ones
    (``done``); per connection its arrived messages and returned slots; the
    events (``buckets``: per instant, its events in the order they were
    posted, the order a heap of (time, sequence number) would give; ``times``:
    a heap of the instants: lockstep schedules post about a hundred events
    per instant); the flows on each shared link (``members``)."""

    __slots__ = ("alpha", "arrived", "buckets", "cap", "capacity", "credits", "cur", "dirty", "done", "end",
                 "few_rates", "fkey", "fkey_view", "floors", "fres", "iters", "key_type", "keys", "last",
                 "last_view", "lens", "log", "members", "near", "now", "nxt", "pairs", "per_iter", "rate",
                 "rate_view", "rates", "record", "rem", "rem_view", "res", "running", "sim", "slots", "steps",
                 "times", "tlen", "total", "tpairs", "ver", "wait_m", "wait_s", "wait_t", "wts")

    def __init__(self, sim: EventSim, tlen: list[float], record: bool):
        self.steps, self.per_iter, self.alpha, self.slots = sim.steps, sim.per_iter, sim.alpha, sim.slots
        self.res, self.cap, self.capacity, self.wts = sim.res, sim.cap, sim.capacity, sim.wts
        self.rates, self.floors = sim.rates, sim.floors
        self.tlen, self.iters, self.record = tlen, len(tlen), record
        ntb, nconn = len(sim.steps), len(sim.per_iter)
        self.lens = [len(s) for s in sim.steps]
        self.total = [n * self.iters for n in self.lens]     # per threadblock, its step instances
        self.nxt, self.done = [0] * ntb, [0] * ntb
        self.arrived, self.credits = [0] * nconn, [0] * nconn
        # threadblocks blocked on a threadblock's step (per tb), a message or a slot (per connection)
        self.wait_t = [[] for _ in range(ntb)]
        self.wait_m, self.wait_s = [[] for _ in range(nconn)], [[] for _ in range(nconn)]
        self.running = [None] * ntb      # per threadblock: (iteration, step) and the step's row while it runs
        self.buckets: dict = {}           # instant -> [(kind, data)] in posting order
        self.times: list = []             # heap of the instants with events
        # per shared link, its flows (a flow: its threadblock, which sends one at a time)
        self.members: list = [set() for _ in sim.capacity]
        # per shared link, the links its flows also cross, with how many of its flows cross each: what
        # ties links into the set of flows one change of rates reaches (_linked walks links, not flows)
        self.near: list = [{} for _ in sim.capacity]
        self.pairs = sim.link_pairs()
        self.tpairs = [()] * ntb          # the pairs of each threadblock's flow
        # per threadblock, its flow's remaining bytes, rate, last settled time and version
        self.rem, self.rate, self.last = np.zeros(ntb), np.zeros(ntb), np.zeros(ntb)
        # per threadblock the key its flow's rates are cached by: its class of alike flows, or its flow
        self.fkey = np.zeros(ntb, dtype=np.int64)
        self.keys = sim.flow_classes()[0].tolist() if sim.uniform else range(len(sim.cap))
        # the same arrays as Python floats and ints, item by item (a memoryview's items are)
        self.rem_view, self.rate_view = memoryview(self.rem), memoryview(self.rate)
        self.last_view = memoryview(self.last)
        self.fkey_view = memoryview(self.fkey)
        self.few_rates = sim.few_rates
        self.key_type = np.int16 if len(self.keys) < 1 << 15 else np.int64
        self.ver = [0] * ntb              # a flow end event counts if its version is its threadblock's
        self.fres = [()] * ntb            # the shared links of each threadblock's flow
        self.sim = sim
        self.log = [] if record else None
        self.cur = {}                     # threadblock -> its running step's log row
        self.dirty = set()                # shared links whose flows changed at this instant
        self.now = self.end = 0.0

    def push(self, at, kind, data):
        bucket = self.buckets.get(at)
        if bucket is None:
            self.buckets[at] = [(kind, data)]
            heappush(self.times, at)
        else:
            bucket.append((kind, data))

    def try_start(self, tb):
        """Start threadblock ``tb``'s next step instance, or wait for what it lacks."""
        nxt, done = self.nxt, self.done
        pos = nxt[tb]
        if done[tb] < pos or pos >= self.total[tb]:
            return
        nsteps = self.lens[tb]
        it, step = divmod(pos, nsteps)
        row = self.steps[tb][step]
        g, comp, nbytes, sc, rc, so, ro, deps, fixed, fc = row
        if deps:
            lens = self.lens
            for dep_tb, dep_step in deps:
                if done[dep_tb] < it * lens[dep_tb] + dep_step + 1:
                    self.wait_t[dep_tb].append(tb)
                    return
        if rc >= 0 and self.arrived[rc] <= it * self.per_iter[rc] + ro:
            self.wait_m[rc].append(tb)
            return
        if sc >= 0 and it * self.per_iter[sc] + so >= self.credits[sc] + self.slots:
            self.wait_s[sc].append(tb)
            return
        nxt[tb] = pos + 1
        self.running[tb] = (it, row)
        now = self.now
        if self.record:
            self.cur[tb] = row = [tb, it, step, now, now, now]
            self.log.append(row)
        tl = self.tlen[it]
        compute = comp * tl + (fixed if tl > 0 else 0.0)
        if compute > 0:
            at = now + compute
            bucket = self.buckets.get(at)          # self.push, inline (once per step instance)
            if bucket is None:
                self.buckets[at] = [(_COMPUTED, tb)]
                heappush(self.times, at)
            else:
                bucket.append((_COMPUTED, tb))
        else:
            self.computed(tb)

    def computed(self, tb):
        """Threadblock ``tb``'s running step has computed: transmit, or finish if it moves nothing."""
        it, (g, comp, nbytes, sc, rc, so, ro, deps, fixed, fc) = self.running[tb]
        now = self.now
        if self.record:
            self.cur[tb][4] = now
        if fc < 0:
            self.finish(tb)
            return
        size = nbytes * self.tlen[it]
        if self.floors is not None and size > 0:
            size = max(size, self.floors[fc])
        self.fres[tb] = res = self.res[fc]
        self.rem_view[tb], self.last_view[tb] = size, now
        self.fkey_view[tb] = self.keys[fc]
        if not res:
            self.rate[tb] = rate = self.cap[fc]
            self.push(now + size / rate, _FLOW, (tb, self.ver[tb]))
            return
        self.rate[tb] = 0.0
        members = self.members
        for r in res:
            members[r].add(tb)
        near = self.near
        self.tpairs[tb] = pairs = self.pairs[fc]
        for a, b in pairs:
            links = near[a]
            links[b] = links.get(b, 0) + 1
        self.dirty.update(res)

    def rebalance(self, seeds):
        """New max-min fair rates for the flows on the links ``seeds`` and,
        transitively, on every link those flows cross."""
        flows = self._linked(seeds)
        if not flows:
            return
        if len(flows) <= SMALL:
            self._rebalance_few(flows)
            return
        now = self.now
        tbs = np.fromiter(flows, dtype=np.int64, count=len(flows))
        rem, old = self.rem[tbs], self.rate[tbs]
        rem = np.maximum(rem - old * (now - self.last[tbs]), 0.0)        # settle: bytes left at ``now``
        self.rem[tbs], self.last[tbs] = rem, now
        keys = self.fkey[tbs]
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        key = ordered.astype(self.key_type).tobytes()       # the narrowest ints that hold every key
        sorted_rates = self.rates.get(key)
        if sorted_rates is None:
            if len(self.rates) >= RATE_CACHE:
                self.rates.clear()
            self.rates[key] = sorted_rates = self._solve(ordered)
        new = np.empty(len(tbs))
        new[order] = sorted_rates
        changed = new != old
        if not changed.any():
            return
        tbs, new = tbs[changed], new[changed]
        self.rate[tbs] = new
        self._post_ends(tbs.tolist(), (now + rem[changed] / new).tolist())

    def _rebalance_few(self, flows):
        """rebalance for a few flows in Python floats, without numpy's cost per call: the same
        operations on each flow (np.maximum(x, 0.0) is ``x if x > 0.0 else 0.0``), the same rates
        (cached per sorted tuple of keys) and events posted in the same order."""
        now = self.now
        rem, rate, last, fkey = self.rem_view, self.rate_view, self.last_view, self.fkey_view
        tbs = list(flows)
        keys = [fkey[tb] for tb in tbs]
        order = sorted(range(len(tbs)), key=keys.__getitem__)          # stable, as argsort's
        key = tuple([keys[i] for i in order])
        few = self.few_rates
        sorted_rates = few.get(key)
        if sorted_rates is None:
            if len(few) >= RATE_CACHE:
                few.clear()
            few[key] = sorted_rates = self._solve(np.array(key, dtype=np.int64)).tolist()
        new = [0.0] * len(tbs)
        for j, i in enumerate(order):
            new[i] = sorted_rates[j]
        moved, ends = [], []
        for tb, r in zip(tbs, new):
            old = rate[tb]
            x = rem[tb] - old * (now - last[tb])
            rem[tb] = x = x if x > 0.0 else 0.0
            last[tb] = now
            if r != old:
                rate[tb] = r
                moved.append(tb)
                ends.append(now + x / r)
        if moved:
            self._post_ends(moved, ends)

    def _post_ends(self, tbs, ends):
        """Post the end of each threadblock's flow at its new time, a new version superseding the
        one posted before."""
        push, vers = self.push, self.ver
        for tb, at in zip(tbs, ends):
            vers[tb] = ver = vers[tb] + 1
            push(at, _FLOW, (tb, ver))

    def _solve(self, ordered) -> np.ndarray:
        """Max-min rates of flows whose sorted keys (classes of alike flows, or flows) are ``ordered``."""
        sim = self.sim
        if sim.uniform:
            _, class_cap, class_cols = sim.flow_classes()
            bounds = np.concatenate(([0], np.flatnonzero(ordered[1:] != ordered[:-1]) + 1, [len(ordered)]))
            mult = bounds[1:] - bounds[:-1]
            rates = maxmin_classes(ordered[bounds[:-1]], mult.astype(np.float64), class_cap, class_cols,
                                   sim.capacity_arr)
            return np.repeat(rates, mult)
        return maxmin_arrays(ordered, sim.cap_arr, sim.use_ptr, sim.use_link, sim.use_wt, sim.capacity_arr)

    def _linked(self, seeds) -> set:
        """linked_flows over threadblocks: the flows on ``seeds`` and, transitively, on their flows' links
        (breadth first, a level at a time in set operations: ~3x the per-element walk at 1024 GPUs)."""
        near = self.near
        links = frontier = set(seeds)
        while frontier:
            frontier = set().union(*[near[r] for r in frontier])
            frontier -= links
            links |= frontier
        members = self.members
        return set().union(*[members[r] for r in links])

    def finish(self, tb):
        """Threadblock ``tb``'s running step ends: send its message and slot, wake who waits on it."""
        row = self.running[tb][1]
        sc, rc = row[3], row[4]
        self.done[tb] += 1
        self.end = now = self.now
        if self.record:
            self.cur[tb][5] = now
        if rc >= 0:
            self.push(now + self.alpha[rc], _CREDIT, rc)
        if sc >= 0:
            self.push(now + self.alpha[sc], _ARRIVE, sc)
        waiters = self.wait_t[tb]
        if waiters:
            self.wait_t[tb] = []
            for waiter in waiters:
                self.try_start(waiter)
        self.try_start(tb)

    def loop(self):
        """Process events in time order until none is left."""
        times, buckets, dirty, members = self.times, self.buckets, self.dirty, self.members
        vers, wait_m, wait_s, arrived, credits = self.ver, self.wait_m, self.wait_s, self.arrived, self.credits
        try_start, computed, finish, rem, fres = self.try_start, self.computed, self.finish, self.rem_view, self.fres
        near, tpairs = self.near, self.tpairs
        while times or dirty:
            if dirty and (not times or times[0] > self.now):
                # rates change once per instant, after every start and end at it (lockstep
                # schedules start hundreds of flows at one time)
                self.rebalance(dirty)
                dirty.clear()
                continue
            self.now = now = times[0]
            bucket = buckets[now]
            i = 0
            while i < len(bucket):          # events posted for this instant while it runs join it
                kind, data = bucket[i]
                i += 1
                if kind == _FLOW:
                    tb, ver = data
                    if ver != vers[tb]:
                        continue
                    rem[tb] = 0.0
                    vers[tb] = ver + 1
                    res = fres[tb]
                    for r in res:
                        members[r].discard(tb)
                    for a, b in tpairs[tb]:
                        links = near[a]
                        if links[b] == 1:
                            del links[b]
                        else:
                            links[b] -= 1
                    dirty.update(res)
                    finish(tb)
                elif kind == _COMPUTED:
                    computed(data)
                elif kind == _ARRIVE:
                    arrived[data] += 1
                    waiters = wait_m[data]
                    if waiters:
                        wait_m[data] = []
                        for waiter in waiters:
                            try_start(waiter)
                else:
                    credits[data] += 1
                    waiters = wait_s[data]
                    if waiters:
                        wait_s[data] = []
                        for waiter in waiters:
                            try_start(waiter)
            heappop(times)
            del buckets[now]

    def raise_if_stuck(self, names):
        """DeadlockError if some threadblock did not finish its steps (``names``: (rank, tb) of each)."""
        lens, done, iters = self.lens, self.done, self.iters
        stuck = [tb for tb in range(len(lens)) if done[tb] < lens[tb] * iters]
        if stuck:
            rank, tb = names[stuck[0]]
            step = self.nxt[stuck[0]] % lens[stuck[0]]
            raise DeadlockError(f"the plan deadlocks with {self.slots} slot(s) per connection: {len(stuck)} "
                                f"threadblocks never finish, the first rank {rank} threadblock {tb} at step {step}",
                                [(rank, tb, step, "never finishes")])
