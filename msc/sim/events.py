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
is recomputed for the flows connected to a flow that starts or ends.
"""
from __future__ import annotations

import heapq

from msc.errors import DeadlockError

_COMPUTED, _FLOW, _ARRIVE, _CREDIT = 0, 1, 2, 3


class _Flow:
    __slots__ = ("t", "rem", "rate", "last", "res", "cap", "ver")

    def __init__(self, t, rem, res, cap, now):
        self.t, self.rem, self.res, self.cap, self.last = t, rem, res, cap, now
        self.rate, self.ver = 0.0, 0


def maxmin(flows, capacity, members) -> dict:
    """Max-min fair rates of ``flows`` (each with ``.cap`` and ``.res``):
    repeatedly give the most constrained flows their bottleneck share."""
    left = {r: capacity[r] for f in flows for r in f.res}
    count = {r: 0 for r in left}
    for f in flows:
        for r in f.res:
            count[r] += 1
    active = set(flows)
    rate = {}
    while active:
        level = min(f.cap for f in active)
        for r, c in count.items():
            if c:
                level = min(level, left[r] / c)
        tol = level * (1 + 1e-12)
        frozen = {f for f in active if f.cap <= tol}
        for r, c in count.items():
            if c and left[r] / c <= tol:
                frozen.update(f for f in members[r] if f in active)
        for f in frozen:
            rate[f] = level
            active.discard(f)
            for r in f.res:
                left[r] -= level
                count[r] -= 1
    return rate


class EventSim:
    """One plan on one topology; ``run(tlen)`` simulates one size.

    ``steps[t]``: per step of threadblock t, (global id, compute seconds per
    tile byte, data bytes per tile byte, send connection, receive
    connection, send ordinal, receive ordinal, deps as (tb, step)) with -1
    for no connection; ``per_iter[c]``: messages of connection c per
    iteration; ``alpha[c]``, ``cap[c]``, ``res[c]``: its latency, private
    rate cap and shared links; ``capacity[r]``: link rates; ``names[t]``:
    (rank, threadblock id) of threadblock t, for errors."""

    def __init__(self, steps, per_iter, alpha, cap, res, capacity, slots, names):
        self.steps, self.per_iter, self.alpha, self.cap, self.res = steps, per_iter, alpha, cap, res
        self.capacity, self.slots, self.names = capacity, slots, names

    def run(self, tlen: list[float], record: bool = False):
        """Makespan (s) for a size whose tile iteration ``it`` moves
        ``tlen[it]`` bytes per chunk; with ``record``, also every step's
        (tb, iteration, step, start, transmit start, end)."""
        steps, per_iter, alpha, slots = self.steps, self.per_iter, self.alpha, self.slots
        iters = len(tlen)
        ntb = len(steps)
        lens = [len(s) for s in steps]
        nxt, done = [0] * ntb, [0] * ntb
        arrived, credits = [0] * len(per_iter), [0] * len(per_iter)
        waiting: dict = {}
        heap, seq = [], 0
        members = {}
        log = [] if record else None
        cur = {}                          # threadblock -> its running step's log row
        dirty = set()                     # shared links whose flows changed at this instant
        now = end = 0.0

        def push(t, kind, data):
            nonlocal seq
            seq += 1
            heapq.heappush(heap, (t, seq, kind, data))

        def try_start(t):
            k = nxt[t]
            if k >= lens[t] * iters or done[t] < k:
                return
            it, s = divmod(k, lens[t])
            g, comp, nbytes, sc, rc, so, ro, deps = steps[t][s]
            for dt, ds in deps:
                if done[dt] < it * lens[dt] + ds + 1:
                    waiting.setdefault(("t", dt), []).append(t)
                    return
            if rc >= 0 and arrived[rc] <= it * per_iter[rc] + ro:
                waiting.setdefault(("m", rc), []).append(t)
                return
            if sc >= 0 and it * per_iter[sc] + so >= credits[sc] + slots:
                waiting.setdefault(("s", sc), []).append(t)
                return
            nxt[t] = k + 1
            if record:
                cur[t] = row = [t, it, s, now, now, now]
                log.append(row)
            c = comp * tlen[it]
            if c > 0:
                push(now + c, _COMPUTED, t)
            else:
                computed(t)

        def computed(t):
            it, s = divmod(nxt[t] - 1, lens[t])
            g, comp, nbytes, sc, rc, so, ro, deps = steps[t][s]
            if record:
                cur[t][4] = now
            if sc < 0:
                finish(t)
                return
            f = _Flow(t, nbytes * tlen[it], self.res[sc], self.cap[sc], now)
            if not f.res:
                f.rate = f.cap
                push(now + f.rem / f.rate, _FLOW, (f, 0))
                return
            for r in f.res:
                members.setdefault(r, set()).add(f)
            dirty.update(f.res)

        def rebalance(seeds):
            flows, seen, stack = set(), set(seeds), list(seeds)
            while stack:
                for f in members.get(stack.pop(), ()):
                    if f not in flows:
                        flows.add(f)
                        for r in f.res:
                            if r not in seen:
                                seen.add(r)
                                stack.append(r)
            if not flows:
                return
            for f in flows:
                f.rem = max(f.rem - f.rate * (now - f.last), 0.0)
                f.last = now
            for f, rate in maxmin(flows, self.capacity, members).items():
                if rate != f.rate:
                    f.rate = rate
                    f.ver += 1
                    push(now + f.rem / rate, _FLOW, (f, f.ver))

        def finish(t):
            nonlocal end
            it, s = divmod(nxt[t] - 1, lens[t])
            g, comp, nbytes, sc, rc, so, ro, deps = steps[t][s]
            done[t] += 1
            end = now
            if record:
                cur[t][5] = now
            if rc >= 0:
                push(now + alpha[rc], _CREDIT, rc)
            if sc >= 0:
                push(now + alpha[sc], _ARRIVE, sc)
            for w in waiting.pop(("t", t), ()):
                try_start(w)
            try_start(t)

        for t in range(ntb):
            try_start(t)
        while heap or dirty:
            if dirty and (not heap or heap[0][0] > now):
                # rates change once per instant, after every start and end at it (lockstep
                # schedules start hundreds of flows at one time)
                rebalance(dirty)
                dirty.clear()
                continue
            now, _, kind, data = heapq.heappop(heap)
            if kind == _FLOW:
                f, ver = data
                if ver != f.ver:
                    continue
                f.rem = 0.0
                f.ver += 1
                for r in f.res:
                    members[r].discard(f)
                dirty.update(f.res)
                finish(f.t)
            elif kind == _COMPUTED:
                computed(data)
            elif kind == _ARRIVE:
                arrived[data] += 1
                for w in waiting.pop(("m", data), ()):
                    try_start(w)
            else:
                credits[data] += 1
                for w in waiting.pop(("s", data), ()):
                    try_start(w)
        stuck = [t for t in range(ntb) if done[t] < lens[t] * iters]
        if stuck:
            rank, tb = self.names[stuck[0]]
            step = nxt[stuck[0]] % lens[stuck[0]]
            raise DeadlockError(f"the plan deadlocks with {slots} slot(s) per connection: {len(stuck)} threadblocks "
                                f"never finish, the first rank {rank} threadblock {tb} at step {step}",
                                [(rank, tb, step, "never finishes")])
        return (end, log) if record else end
