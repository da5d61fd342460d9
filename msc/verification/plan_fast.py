"""The plan verifier's fast path: is a plan certainly correct? Answered in
bulk (numpy) from the static happens-before graph, without running the
threadblocks one step at a time.

``accepts(plan, layout, capacity)`` is True only when the executor of
``msc.verification.plan`` (execute, then check_outputs) would succeed on the plan at
that connection capacity; False on anything else or anything doubtful. It
never raises a verification error: on False the caller runs the executor,
which finds the error and words it. ``fewest_slots(plan, most)`` is the
smallest capacity (a power of two) the plan runs at without deadlock.

Both start from ``prepare(plan)``: the plan read into arrays once (steps,
slices, threadblocks, and the graph edges that do not depend on the
capacity), so that lowering, which asks for the fewest slots and then
verifies at that capacity, reads a plan of millions of steps once. Plans
share objects (bulk lowering repeats a few Step objects over millions of
positions, the plan parser shares Slice objects): attributes are read once
per distinct object where objects repeat.

How. Each threadblock is sequential and each connection a FIFO with blocking
ends (a Kahn network), so the executor's blocking rules are edges of a static
graph over steps: program order, dependencies, the k-th send of a connection
before its k-th receive, and (capacity c) the (k-c)-th receive before the
k-th send. The plan runs to completion iff that graph is acyclic and every
receive has its send and every send the receive that frees its slot; that
depends on neither the data nor the order the threadblocks run in, so the
fewest slots found here are exactly the executor's. ``msc.ir.levels`` sorts the
steps into a topological order.

Values are then resolved in SSA form, chunk by chunk ("lanes": a step moving
c chunks has c lanes): a read of a chunk gets the last write before it in
that order, or the chunk's initial label. This is the value every execution
reads only when the accesses of a chunk are ordered by happens-before, so
the plan must be race-free (the callers of verify_plan establish it: the race
check runs first, or every rank has one threadblock). Two accesses of one
chunk in the same level, one a write, are a race that shows here: then
accepts() declines; a race between levels cannot be seen here.

Then, as the executor does: no read of an unwritten chunk, only chunks of one
class reduced together (a sum's class is its left operand's), data written
into a user buffer only at positions of its class, and every output holding
its expected multiset of contributions (counted once per distinct final value).
"""
from __future__ import annotations

from itertools import chain, compress, repeat
from operator import attrgetter, is_not, itemgetter

import numpy as np

from msc.ir.accesses import last_of_each, writes_around
from msc.ir import Plan, StepOp
from msc.ir.levels import levels
from msc.verification.multisets import Decline, Leaves, expand, expectations, holds, jump, need
from msc.perf import pause_gc
from msc.verification import crosscheck


_OPS = list(StepOp)
_CODE = {id(op): i for i, op in enumerate(_OPS)}
_SENDS = np.array([op.sends for op in _OPS])
_RECEIVES = np.array([op.receives for op in _OPS])
_HAS_DST = np.array([op.has_dst for op in _OPS])
_MIN_SRCS = np.array([{"0": 0, "1": 1, "2+": 2}[op.nsrc] for op in _OPS])
_MAX_SRCS = np.array([{"0": 0, "1": 1, "2+": 1 << 30}[op.nsrc] for op in _OPS])
(_SEND, _RECV, _RCS, _RRS, _RRC, _RRCS, _COPY, _REDUCE, _NOP) = (
    _OPS.index(op) for op in (StepOp.SEND, StepOp.RECV, StepOp.RCS, StepOp.RRS, StepOp.RRC, StepOp.RRCS,
                              StepOp.COPY, StepOp.REDUCE, StepOp.NOP))
# Objects are read once per distinct one when a sample of this many has at
# most half distinct (np.unique over their ids costs less than the reading).
_SAMPLE = 1 << 16

_op, _srcs, _dst, _deps, _count = (attrgetter(a) for a in ("op", "srcs", "dst", "deps", "count"))
_buffer, _index = attrgetter("buffer"), attrgetter("index")


def _judged(fn, *args, fallback):
    """fn(*args), or ``fallback`` where the fast path cannot tell."""
    try:
        return fn(*args)
    except Decline:
        return fallback
    except Exception:
        if crosscheck.ENABLED:     # in tests a crash here is a bug to see, not a plan to decline
            raise
        return fallback    # a malformed plan (verify_plan(checked=True) skips check_plan): the executor words it


def accepts(plan: Plan, layout, capacity: int) -> bool:
    """True only if executing ``plan`` with ``capacity`` slots per connection
    succeeds and its outputs are right (see the module docstring)."""
    return prepare(plan).accepts(plan, layout, capacity)


def fewest_slots(plan: Plan, most: int) -> int | None:
    """The smallest power of two c <= ``most`` at which ``plan`` runs
    without deadlock; ``most * 2`` when it deadlocks at every one of them;
    None when the fast path cannot tell (a malformed plan)."""
    return prepare(plan).fewest_slots(most)


@pause_gc
def prepare(plan: Plan) -> Prepared:
    """``plan`` read for accepts() and fewest_slots(), to ask both (and at
    several capacities) for the price of one reading."""
    return Prepared(plan)


def connections(plan: Plan) -> int:
    """Distinct connections (sender, receiver, channel) the plan's threadblocks name."""
    conns = set()
    for rp in plan.ranks:
        for tb in rp.threadblocks:
            if tb.send is not None:
                conns.add((rp.rank, tb.send, tb.channel))
            if tb.recv is not None:
                conns.add((tb.recv, rp.rank, tb.channel))
    return len(conns)


def _distinct(objs: list):
    """(the distinct objects, index of each position's among them), or
    (objs, None) where too few repeat to pay for finding them (judged on a
    sample of positions: repeats may be far apart, between ranks)."""
    n = len(objs)
    if n > _SAMPLE:
        sample = np.random.default_rng(0).integers(0, n, _SAMPLE).tolist()
        if len(set(map(id, map(objs.__getitem__, sample)))) * 2 > _SAMPLE:
            return objs, None
    ids = np.fromiter(map(id, objs), np.int64, n)    # the objects are alive: their ids are distinct
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    if len(first) * 2 > n:
        return objs, None
    return list(map(objs.__getitem__, first.tolist())), inverse.reshape(-1)


class _Slices:
    """Buffer (a code into ``names``), index and count of each slice of ``flat``."""

    def __init__(self, flat: list, names: dict):
        objs, inverse = _distinct(flat)
        bufs = list(map(_buffer, objs))
        for b in dict.fromkeys(bufs):
            names.setdefault(b, len(names))
        m = len(objs)
        self.buf = np.fromiter(map(names.__getitem__, bufs), np.int64, m)
        self.index = np.fromiter(map(_index, objs), np.int64, m)
        self.count = np.fromiter(map(_count, objs), np.int64, m)
        if inverse is not None:
            self.buf, self.index, self.count = self.buf[inverse], self.index[inverse], self.count[inverse]


class _Steps:
    """Per step of ``steps``: op code, count, sources (rows of ``src``, owned
    by ``src_owner``), destination (``dst``, owned by ``dst_owner``) and
    dependencies (dep_owner, dep_t, dep_s)."""

    def __init__(self, steps: list, names: dict):
        m = len(steps)
        self.op = np.fromiter(map(_CODE.__getitem__, map(id, map(_op, steps))), np.int64, m)
        self.count = np.fromiter(map(_count, steps), np.int64, m)
        srcs = list(map(_srcs, steps))
        self.nsrc = np.fromiter(map(len, srcs), np.int64, m)
        self.src = _Slices(list(chain.from_iterable(srcs)), names)
        dsts = list(map(_dst, steps))
        self.has_dst = np.fromiter(map(is_not, dsts, repeat(None)), bool, m)
        self.dst = _Slices(list(compress(dsts, self.has_dst)), names)
        deps = list(map(_deps, steps))
        self.ndep = np.fromiter(map(len, deps), np.int64, m)
        pairs = list(chain.from_iterable(deps))
        need(all(len(d) == 2 and type(d[0]) is int and type(d[1]) is int for d in pairs))
        self.dep_t = np.fromiter(map(itemgetter(0), pairs), np.int64, len(pairs))
        self.dep_s = np.fromiter(map(itemgetter(1), pairs), np.int64, len(pairs))


def _rows(counts, inverse, n: int):
    """Rows owned per distinct object (``counts`` each, in order) -> rows
    owned per position: (position of each row, j within its position's rows,
    its row in the distinct table)."""
    first = np.cumsum(counts) - counts
    if inverse is None:
        return expand(first, counts)
    return expand(first[inverse], counts[inverse])


class Prepared:
    """A plan read into arrays: what neither the collective nor the capacity
    changes. Holds the plan's ranks (``plan.ranks``): its answers are for
    plans with these ranks (``replace(plan, slots=..)`` keeps them)."""

    def __init__(self, plan: Plan):
        self.ranks = plan.ranks
        self._levels: dict[int, np.ndarray | None] = {}     # capacity -> step levels, None: deadlock
        self.readable = _judged(self._read, plan, fallback=False)

    @pause_gc
    def accepts(self, plan: Plan, layout, capacity: int) -> bool:
        """accepts() of the module, for ``plan`` (whose ranks these are)."""
        if plan.ranks is not self.ranks:
            raise ValueError("Prepared.accepts: a plan with other ranks than the prepared one")
        return self.readable and _judged(self._accepts, plan, layout, capacity, fallback=False)

    @pause_gc
    def fewest_slots(self, most: int) -> int | None:
        """fewest_slots() of the module."""
        if not self.readable:
            return None
        return _judged(self._fewest, most, fallback=None)

    def _fewest(self, most: int) -> int:
        c = 1
        while c <= most:
            if self._level(c) is not None:
                return c
            c *= 2
        return most * 2

    # -- reading ------------------------------------------------------------------
    def _read(self, plan: Plan) -> bool:
        n = plan.num_ranks
        need(len(plan.ranks) == n and all(rp.rank == r for r, rp in enumerate(plan.ranks)))
        conn_id: dict = {}
        tb_rank, tb_len, tb_out, tb_in, rank_tb = [], [], [], [], [0]
        ends: set = set()
        steps: list = []
        for rp in plan.ranks:
            for t, tb in enumerate(rp.threadblocks):
                need(tb.id == t)
                out = inn = -1
                if tb.send is not None:
                    out = conn_id.setdefault((rp.rank, tb.send, tb.channel), len(conn_id))
                    need(("s", out) not in ends)        # one threadblock per end, or the FIFO order depends on timing
                    ends.add(("s", out))
                if tb.recv is not None:
                    inn = conn_id.setdefault((tb.recv, rp.rank, tb.channel), len(conn_id))
                    need(("r", inn) not in ends)
                    ends.add(("r", inn))
                tb_rank.append(rp.rank)
                tb_len.append(len(tb.steps))
                tb_out.append(out)
                tb_in.append(inn)
                steps.extend(tb.steps)
            rank_tb.append(len(tb_len))
        self.n = n
        self.scratch = np.array([rp.scratch for rp in plan.ranks], dtype=np.int64)
        self.N = N = len(steps)
        tb_len = np.array(tb_len, dtype=np.int64)
        rank_tb = np.array(rank_tb, dtype=np.int64)
        step_tb = np.repeat(np.arange(len(tb_len)), tb_len)
        self.step_rank = step_rank = np.array(tb_rank, dtype=np.int64)[step_tb]
        tb_first = np.cumsum(tb_len) - tb_len
        step_s = np.arange(N, dtype=np.int64) - tb_first[step_tb]

        # -- steps, one attribute at a time, once per distinct Step object ----------
        self.names: dict[str, int] = {}                  # buffer names as the slices spell them
        objs, inverse = _distinct(steps)
        del steps
        table = _Steps(objs, self.names)
        del objs

        def per_step(values):
            return values if inverse is None else values[inverse]

        self.op = op = per_step(table.op)
        self.count = count = per_step(table.count)
        self.nsrc = nsrc = per_step(table.nsrc)
        self.has_dst = has_dst = per_step(table.has_dst)
        self.src_owner, self.src_pos, row = _rows(table.nsrc, inverse, N)
        self.src_buf, self.src_index, self.src_count = table.src.buf[row], table.src.index[row], table.src.count[row]
        dst_rows = np.cumsum(table.has_dst) - 1                 # a step's row in the dst table
        self.dst_owner = np.flatnonzero(has_dst)
        row = dst_rows[inverse[self.dst_owner]] if inverse is not None else np.arange(len(self.dst_owner))
        self.dst_buf, self.dst_index, self.dst_count = table.dst.buf[row], table.dst.index[row], table.dst.count[row]
        # Shapes: as check_plan has them (else accepts() declines; fewest_slots needs none of them).
        self.well_formed = bool(
            (count >= 1).all() and (has_dst == _HAS_DST[op]).all()
            and ((nsrc >= _MIN_SRCS[op]) & (nsrc <= _MAX_SRCS[op])).all()
            and (self.src_count == count[self.src_owner]).all() and (self.dst_count == count[self.dst_owner]).all())
        sends, receives = _SENDS[op], _RECEIVES[op]
        self.receives = receives
        out_conn = np.array(tb_out, dtype=np.int64)[step_tb]
        in_conn = np.array(tb_in, dtype=np.int64)[step_tb]
        need((out_conn[sends] >= 0).all() and (in_conn[receives] >= 0).all())

        # -- the static graph: program order, dependencies, messages ------------------
        src_e, dst_e = [], []
        later = np.flatnonzero(step_s > 0)
        src_e.append(later - 1)
        dst_e.append(later)
        dep_owner, _, row = _rows(table.ndep, inverse, N)
        dep_t, dep_s = table.dep_t[row], table.dep_s[row]
        rank = step_rank[dep_owner]
        need(((dep_t >= 0) & (dep_t < rank_tb[rank + 1] - rank_tb[rank])).all())
        dep_tb = rank_tb[rank] + dep_t
        need(((dep_s >= 0) & (dep_s < tb_len[dep_tb])).all())
        src_e.append(tb_first[dep_tb] + dep_s)
        dst_e.append(dep_owner)

        # Sends of a connection are one threadblock's (one per end), so they
        # lie together, in program order, among all sends in step order.
        nconn, ntb = len(conn_id), len(tb_len)
        tb_out, tb_in = np.array(tb_out, dtype=np.int64), np.array(tb_in, dtype=np.int64)

        def by_connection(steps, tb_conn):
            """Per connection: its first entry in ``steps`` and how many."""
            per_tb = np.bincount(step_tb[steps], minlength=ntb)
            start, many = np.zeros(nconn, dtype=np.int64), np.zeros(nconn, dtype=np.int64)
            has = tb_conn >= 0
            start[tb_conn[has]] = (np.cumsum(per_tb) - per_tb)[has]
            many[tb_conn[has]] = per_tb[has]
            return start, many

        snd, rcv = np.flatnonzero(sends), np.flatnonzero(receives)
        snd_start, nsnd = by_connection(snd, tb_out)
        rcv_start, nrcv = by_connection(rcv, tb_in)
        rcv_conn = in_conn[rcv]
        rk = np.arange(len(rcv), dtype=np.int64) - rcv_start[rcv_conn]           # k of each receive
        # A receive without its send waits forever: a deadlock at every capacity.
        self.unmatched = not (rk < nsnd[rcv_conn]).all()
        if not self.unmatched:
            self.sender = sender = snd[snd_start[rcv_conn] + rk]                # k-th send -> k-th receive
            self.well_formed &= bool((count[sender] == count[rcv]).all())
            src_e.append(sender)
            dst_e.append(rcv)
        self.rcv, self.snd, self.rk, self.rcv_conn = rcv, snd, rk, rcv_conn
        self.nsnd, self.nrcv, self.snd_start = nsnd, nrcv, snd_start
        # Sorted by source once: levels() sorts its edges stably, quickly when
        # they come in few sorted runs (these, then the capacity's).
        src, dst = np.concatenate(src_e), np.concatenate(dst_e)
        order = np.argsort(src, kind="stable")
        self.edges = (src[order], dst[order])
        return True

    def _level(self, capacity: int):
        """Levels of the steps in the graph with capacity edges; None when
        the plan deadlocks at ``capacity``."""
        if capacity not in self._levels:
            self._levels[capacity] = self._levels_at(capacity)
        return self._levels[capacity]

    def _levels_at(self, capacity: int):
        # The k-th send of a connection waits for its (k - c)-th receive; a
        # send that has none waits forever.
        if self.unmatched or (self.nsnd - capacity > self.nrcv).any():
            return None
        frees = self.rk + capacity < self.nsnd[self.rcv_conn]                  # the receives that free a send
        conn = self.rcv_conn[frees]
        src, dst = self.edges
        return levels(self.N, np.concatenate([src, self.rcv[frees]]),          # in step order, as rcv is
                      np.concatenate([dst, self.snd[self.snd_start[conn] + self.rk[frees] + capacity]]))

    # -- the values -----------------------------------------------------------------
    def _accepts(self, plan: Plan, layout, capacity: int) -> bool:
        need(type(capacity) is int and capacity >= 1 and plan.num_ranks == self.n and self.well_formed)
        level = self._level(capacity)
        if level is None:
            return False                                                      # a deadlock
        n, k, N = self.n, plan.chunk_factor, self.N
        op, count, nsrc = self.op, self.count, self.nsrc
        src_owner, src_pos, dst_owner = self.src_owner, self.src_pos, self.dst_owner
        receives, rcv, sender = self.receives, self.rcv, self.sender
        step_rank = self.step_rank

        # -- buffers: one cell per (rank, buffer, chunk) ---------------------------
        names = list(dict.fromkeys([*layout.physical_sizes, "scratch"]))
        nb = len(names)
        code = {b: i for i, b in enumerate(names)}
        need(all(b in code for b in self.names))
        to_layout = np.array([code[b] for b in self.names] or [0], dtype=np.int64)
        sizes = np.zeros((n, nb), dtype=np.int64)
        sizes[:, :] = [layout.physical_sizes.get(b, 0) for b in names]
        sizes[:, code["scratch"]] = self.scratch
        need((sizes >= 0).all())
        cellbase = np.zeros(n * nb + 1, dtype=np.int64)
        np.cumsum(sizes.ravel(), out=cellbase[1:])
        ncells = int(cellbase[-1])
        scratch = code["scratch"]

        def slice_cells(buf, index, owner):
            """Cells of each slice's first chunk, checked to lie in its buffer."""
            buf = to_layout[buf]
            need((index >= 0).all() and (index + count[owner] <= sizes[step_rank[owner], buf]).all())
            return buf, cellbase[step_rank[owner] * nb + buf] + index

        _, src_cell = slice_cells(self.src_buf, self.src_index, src_owner)
        dst_buf, dst_cell = slice_cells(self.dst_buf, self.dst_index, dst_owner)
        dst_index = self.dst_index

        # -- initial values: one leaf per distinct label -----------------------------
        def cells_of(rank, buf, off, width, index):
            b = code.get(buf)
            need(b is not None and 0 <= off and off + width <= sizes[rank, b])
            return cellbase[rank * nb + b] + index

        leaves = Leaves(layout, k, cells_of)
        L, leaf_class = leaves.count, leaves.leaf_class
        initial = np.full(ncells, -1, dtype=np.int64)
        if leaves.cells.size:   # the last label put in a cell stays there, as in the executor
            uniq, pos = np.unique(leaves.cells[::-1], return_index=True)
            initial[uniq] = leaves.leaf_ids[::-1][pos]

        # -- lanes, reads and writes -----------------------------------------------
        lane_start = np.cumsum(count) - count
        NL = int(count.sum())
        r_src, r_j, r_cell = expand(src_cell, count[src_owner])
        r_step = src_owner[r_src]
        r_lane = lane_start[r_step] + r_j
        r_pos = src_pos[r_src]
        w_row, w_j, w_cell = expand(dst_cell, count[dst_owner])
        w_step = dst_owner[w_row]
        w_lane = lane_start[w_step] + w_j
        nr = len(r_cell)
        ev_cell = np.concatenate([r_cell, w_cell])
        ev_level = level[np.concatenate([r_step, w_step])]
        ev_step = np.concatenate([r_step, w_step])
        ev_write = np.concatenate([np.zeros(nr, bool), np.ones(len(w_cell), bool)])
        nlev = int(level.max()) + 1 if N else 1
        if ncells * nlev * 2 < (1 << 62):
            order = np.argsort((ev_cell * nlev + ev_level) * 2 + ev_write, kind="stable")
        else:
            order = np.lexsort((ev_write, ev_level, ev_cell))
        s_cell, s_level, s_step, s_write = ev_cell[order], ev_level[order], ev_step[order], ev_write[order]
        ne = len(order)
        # Same chunk, same level: a write must be the only access there, but for
        # its own step's reads (a race otherwise, which the order cannot settle).
        group_start = np.ones(ne, bool)
        if ne:
            group_start[1:] = (s_cell[1:] != s_cell[:-1]) | (s_level[1:] != s_level[:-1])
        gid = np.cumsum(group_start) - 1
        glast = np.flatnonzero(np.append(group_start[1:], True))[:len(group_start)]   # last event of each group
        writes_in = np.bincount(gid, weights=s_write, minlength=len(glast))
        need((writes_in <= 1).all())
        lw = glast[gid]                                                            # writes sort last in a group
        need(not (s_write[lw] & (s_step[lw] != s_step)).any())
        # Each read: the last write to its cell before it, else the cell's initial value.
        before, _ = writes_around(s_cell, s_write, following=False)
        w_of_event = np.full(ne, -1, dtype=np.int64)                               # write events: their lane
        w_of_event[s_write] = (w_lane[order[s_write] - nr]) + L
        is_read = ~s_write
        seen = np.where(before >= 0, w_of_event[np.maximum(before, 0)], initial[s_cell])
        read_ref = np.empty(nr, dtype=np.int64)
        read_ref[order[is_read]] = seen[is_read]
        need((read_ref >= 0).all())                                               # a read of an unwritten chunk
        final = initial.copy()                                                     # each cell's last value
        cell_last = last_of_each(s_cell)
        last_write = np.where(s_write[cell_last], cell_last, before[cell_last])
        final[s_cell[cell_last]] = np.where(last_write >= 0, w_of_event[np.maximum(last_write, 0)],
                                            initial[s_cell[cell_last]])

        # -- values: leaves, then one entry per lane (an alias or a sum), then sums
        # of reductions with more than two sources -----------------------------------
        lane_step = np.repeat(np.arange(N, dtype=np.int64), count)
        lane_op = op[lane_step]
        lane_j = np.arange(NL, dtype=np.int64) - lane_start[lane_step]
        op0 = np.full(NL, -1, dtype=np.int64)
        op1 = np.full(NL, -1, dtype=np.int64)
        op0[r_lane[r_pos == 0]] = read_ref[r_pos == 0]
        op1[r_lane[r_pos == 1]] = read_ref[r_pos == 1]
        got = np.full(NL, -1, dtype=np.int64)
        recv_lane_step = lane_step[receives[lane_step]]
        match = np.full(N, -1, dtype=np.int64)
        match[rcv] = sender
        got_l = np.flatnonzero(receives[lane_step])
        got[got_l] = L + lane_start[match[recv_lane_step]] + lane_j[got_l]
        kind = np.zeros(L + NL, dtype=np.int8)                                     # 0 leaf, 1 alias, 2 sum
        A = np.arange(L + NL, dtype=np.int64)
        B = np.full(L + NL, -1, dtype=np.int64)
        lanes = np.arange(NL, dtype=np.int64)
        for ops, a, b in (((_SEND, _COPY), op0, None), ((_RECV, _RCS), got, None),
                          ((_RRS, _RRC, _RRCS), op0, got), ((_REDUCE,), op0, op1)):
            sel = np.isin(lane_op, ops)
            kind[L + lanes[sel]] = 1 if b is None else 2
            A[L + lanes[sel]] = a[sel]
            if b is not None:
                B[L + lanes[sel]] = b[sel]
        wide = np.flatnonzero((op == _REDUCE) & (nsrc > 2))
        if wide.size:   # reduce(s0, s1, s2, ..): ((s0 + s1) + s2) + ..: the lane's own entry is the last sum
            more = r_pos >= 2
            refs = {(int(ln), int(p)): int(v) for ln, p, v in zip(r_lane[more], r_pos[more], read_ref[more])}
            extra_a, extra_b = [], []
            nxt = L + NL
            for g in wide.tolist():
                m = int(nsrc[g])
                for lane in range(int(lane_start[g]), int(lane_start[g] + count[g])):
                    acc = nxt
                    extra_a.append(int(A[L + lane]))
                    extra_b.append(int(B[L + lane]))
                    nxt += 1
                    for p in range(2, m - 1):
                        extra_a.append(acc)
                        extra_b.append(refs[(lane, p)])
                        acc = nxt
                        nxt += 1
                    A[L + lane], B[L + lane] = acc, refs[(lane, m - 1)]
            kind = np.concatenate([kind, np.full(len(extra_a), 2, np.int8)])
            A = np.concatenate([A, np.array(extra_a, dtype=np.int64)])
            B = np.concatenate([B, np.array(extra_b, dtype=np.int64)])
        # Aliases point at their value, sums at their left operand's leaf (their class).
        rep = jump(np.where(kind == 1, A, np.arange(len(A))))
        ca, cb = rep[A], np.where(B >= 0, rep[np.maximum(B, 0)], -1)
        left = jump(np.where(kind == 2, ca, np.arange(len(A))))
        cls = np.full(len(A), -1, dtype=np.int64)
        cls[:L] = leaf_class
        cls = cls[left]                                                           # per leaf and sum
        sums = kind == 2
        need((cls[ca[sums]] == cls[cb[sums]]).all())                             # one class per reduction
        user = dst_buf[w_row] != scratch
        need((cls[rep[L + w_lane[user]]] == (dst_index[w_row[user]] + w_j[user]) % k).all())

        # -- outputs ----------------------------------------------------------------
        out_cells, out_exp, exps = expectations(layout, cells_of)
        if not out_cells.size:
            return True
        value = final[out_cells]
        need((value >= 0).all())                                                  # an output never written
        return holds(rep[value], out_exp, exps, leaves, kind, ca, cb)
