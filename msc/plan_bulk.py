"""The plan verifier's fast path: is a plan certainly correct? Answered in
bulk (numpy) from the static happens-before graph, without running the
threadblocks one step at a time.

``accepts(plan, layout, capacity)`` is True only when the executor of
``msc.plan_verify`` (execute, then check_outputs) would succeed on the plan at
that connection capacity; False on anything else or anything doubtful. It
never raises a verification error: on False the caller runs the executor,
which finds the error and words it.

How. Each threadblock is sequential and each connection a FIFO with blocking
ends (a Kahn network), so the executor's blocking rules are edges of a static
graph over steps: program order, dependencies, the k-th send of a connection
before its k-th receive, and (capacity c) the (k-c)-th receive before the
k-th send. The plan runs to completion iff that graph is acyclic and every
receive has its send and every send the receive that frees its slot.
``msc.levels`` sorts the steps into a topological order.

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
from operator import attrgetter, is_not

import os

import numpy as np

from msc.ir import STEP_SHAPE, Plan, StepOp
from msc.levels import levels
from msc.perf import pause_gc

# Tests (MSC_CHECK=1, tests/conftest.py) also run the executor on every plan
# this accepts, and want to see a crash here rather than a declined plan.
CHECK = os.environ.get("MSC_CHECK") == "1"

_OPS = list(StepOp)
_CODE = {id(op): i for i, op in enumerate(_OPS)}
_SENDS = np.array([op.sends for op in _OPS])
_RECEIVES = np.array([op.receives for op in _OPS])
_HAS_DST = np.array([STEP_SHAPE[op][1] for op in _OPS])
_MIN_SRCS = np.array([{"0": 0, "1": 1, "2+": 2}[STEP_SHAPE[op][0]] for op in _OPS])
_MAX_SRCS = np.array([{"0": 0, "1": 1, "2+": 1 << 30}[STEP_SHAPE[op][0]] for op in _OPS])
(_SEND, _RECV, _RCS, _RRS, _RRC, _RRCS, _COPY, _REDUCE, _NOP) = (
    _OPS.index(op) for op in (StepOp.SEND, StepOp.RECV, StepOp.RCS, StepOp.RRS, StepOp.RRC, StepOp.RRCS,
                              StepOp.COPY, StepOp.REDUCE, StepOp.NOP))
# Multiplicities are counted in float64 (np.bincount): exact below this.
_EXACT = float(1 << 52)

_op, _srcs, _dst, _deps, _count = (attrgetter(a) for a in ("op", "srcs", "dst", "deps", "count"))
_buffer, _index = attrgetter("buffer"), attrgetter("index")


class _Decline(Exception):
    """Internal: the fast path cannot vouch for this plan."""


@pause_gc
def accepts(plan: Plan, layout, capacity: int) -> bool:
    """True only if executing ``plan`` with ``capacity`` slots per connection
    succeeds and its outputs are right (see the module docstring)."""
    try:
        return _accepts(plan, layout, capacity)
    except _Decline:
        return False
    except Exception:
        if CHECK:          # in tests a crash here is a bug to see, not a plan to decline
            raise
        return False       # a malformed plan (verify_plan(checked=True) skips check_plan): the executor words it


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


def _need(ok) -> None:
    if not ok:
        raise _Decline


def _expand(first, counts):
    """Per row, ``first + j`` for j < count: (row of each, j of each, value)."""
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    j = np.arange(int(counts.sum()), dtype=np.int64) - starts[rows]
    return rows, j, first[rows] + j


def _accepts(plan: Plan, layout, capacity: int) -> bool:
    n, k = plan.num_ranks, plan.chunk_factor
    _need(type(capacity) is int and capacity >= 1 and len(plan.ranks) == n)
    _need(all(rp.rank == r for r, rp in enumerate(plan.ranks)))

    # -- buffers: one cell per (rank, buffer, chunk) ---------------------------
    names = list(dict.fromkeys([*layout.physical_sizes, "scratch"]))
    nb = len(names)
    code = {b: i for i, b in enumerate(names)}
    sizes = np.zeros((n, nb), dtype=np.int64)
    sizes[:, :] = [layout.physical_sizes.get(b, 0) for b in names]
    sizes[:, code["scratch"]] = [rp.scratch for rp in plan.ranks]
    _need((sizes >= 0).all())
    cellbase = np.zeros(n * nb + 1, dtype=np.int64)
    np.cumsum(sizes.ravel(), out=cellbase[1:])
    ncells = int(cellbase[-1])
    scratch = code["scratch"]

    # -- threadblocks and their connections ------------------------------------
    conn_id: dict = {}
    tb_rank, tb_len, tb_out, tb_in, tb_base = [], [], [], [], []
    ends: set = set()
    steps: list = []
    for rp in plan.ranks:
        row = []
        for t, tb in enumerate(rp.threadblocks):
            _need(tb.id == t)
            row.append(len(steps))
            out = inn = -1
            if tb.send is not None:
                out = conn_id.setdefault((rp.rank, tb.send, tb.channel), len(conn_id))
                _need(("s", out) not in ends)        # one threadblock per end, or the FIFO order depends on timing
                ends.add(("s", out))
            if tb.recv is not None:
                inn = conn_id.setdefault((tb.recv, rp.rank, tb.channel), len(conn_id))
                _need(("r", inn) not in ends)
                ends.add(("r", inn))
            tb_rank.append(rp.rank)
            tb_len.append(len(tb.steps))
            tb_out.append(out)
            tb_in.append(inn)
            steps.extend(tb.steps)
        tb_base.append(row)
    N = len(steps)
    tb_len = np.array(tb_len, dtype=np.int64)
    step_tb = np.repeat(np.arange(len(tb_len)), tb_len)
    step_rank = np.array(tb_rank, dtype=np.int64)[step_tb]
    first_of_tb = np.cumsum(tb_len) - tb_len
    step_s = np.arange(N, dtype=np.int64) - first_of_tb[step_tb]

    # -- steps, one attribute at a time ------------------------------------------
    op = np.fromiter(map(_CODE.__getitem__, map(id, map(_op, steps))), np.int64, N)
    count = np.fromiter(map(_count, steps), np.int64, N)
    _need((count >= 1).all())
    srcs = list(map(_srcs, steps))
    nsrc = np.fromiter(map(len, srcs), np.int64, N)
    dsts = list(map(_dst, steps))
    has_dst = np.fromiter(map(is_not, dsts, repeat(None)), bool, N)
    _need((has_dst == _HAS_DST[op]).all())
    _need(((nsrc >= _MIN_SRCS[op]) & (nsrc <= _MAX_SRCS[op])).all())
    sends, receives = _SENDS[op], _RECEIVES[op]
    out_conn = np.array(tb_out, dtype=np.int64)[step_tb]
    in_conn = np.array(tb_in, dtype=np.int64)[step_tb]
    _need((out_conn[sends] >= 0).all() and (in_conn[receives] >= 0).all())

    def slices(flat, owner):
        """Cells of each slice's first chunk, checked to lie in its buffer."""
        try:
            buf = np.fromiter(map(code.__getitem__, map(_buffer, flat)), np.int64, len(flat))
        except KeyError:
            raise _Decline from None
        index = np.fromiter(map(_index, flat), np.int64, len(flat))
        cnt = np.fromiter(map(_count, flat), np.int64, len(flat))
        _need((cnt == count[owner]).all() and (index >= 0).all())
        _need((index + cnt <= sizes[step_rank[owner], buf]).all())
        return buf, index, cellbase[step_rank[owner] * nb + buf] + index

    src_owner = np.repeat(np.arange(N, dtype=np.int64), nsrc)
    src_pos = np.arange(len(src_owner), dtype=np.int64) - np.repeat(np.cumsum(nsrc) - nsrc, nsrc)
    _, _, src_cell = slices(list(chain.from_iterable(srcs)), src_owner)
    dst_owner = np.flatnonzero(has_dst)
    dst_buf, dst_index, dst_cell = slices(list(compress(dsts, has_dst)), dst_owner)

    # -- the static graph: program order, dependencies, messages, capacity -------
    src_e, dst_e = [], []
    later = np.flatnonzero(step_s > 0)
    src_e.append(later - 1)
    dst_e.append(later)
    deps = list(map(_deps, steps))
    dep_from, dep_to = [], []
    for g in compress(range(N), deps):
        rank, row = tb_rank[step_tb[g]], tb_base[tb_rank[step_tb[g]]]
        tbs = plan.ranks[rank].threadblocks
        for dep in deps[g]:
            _need(len(dep) == 2)
            dt, ds = dep
            _need(type(dt) is int and type(ds) is int and 0 <= dt < len(tbs) and 0 <= ds < len(tbs[dt].steps))
            dep_from.append(row[dt] + ds)
            dep_to.append(g)
    src_e.append(np.array(dep_from, dtype=np.int64))
    dst_e.append(np.array(dep_to, dtype=np.int64))

    nconn = len(conn_id)
    snd = np.flatnonzero(sends)
    snd = snd[np.argsort(out_conn[snd], kind="stable")]        # by connection, then program order
    rcv = np.flatnonzero(receives)
    rcv = rcv[np.argsort(in_conn[rcv], kind="stable")]
    nsnd = np.bincount(out_conn[snd], minlength=nconn)
    nrcv = np.bincount(in_conn[rcv], minlength=nconn)
    snd_start = np.cumsum(nsnd) - nsnd
    rcv_start = np.cumsum(nrcv) - nrcv
    rk = np.arange(len(rcv), dtype=np.int64) - rcv_start[in_conn[rcv]]       # k of each receive
    _need((rk < nsnd[in_conn[rcv]]).all())                                  # else it waits forever
    sender = snd[snd_start[in_conn[rcv]] + rk]                                # k-th send -> k-th receive
    _need((count[sender] == count[rcv]).all())
    src_e.append(sender)
    dst_e.append(rcv)
    sk = np.arange(len(snd), dtype=np.int64) - snd_start[out_conn[snd]]
    blocked = sk >= capacity                                                  # waits for the (k - c)-th receive
    _need((sk[blocked] - capacity < nrcv[out_conn[snd[blocked]]]).all())
    src_e.append(rcv[rcv_start[out_conn[snd[blocked]]] + sk[blocked] - capacity])
    dst_e.append(snd[blocked])
    level = levels(N, np.concatenate(src_e), np.concatenate(dst_e))
    if level is None:
        return False                                                          # a deadlock

    # -- initial values: one leaf per distinct label -----------------------------
    cells, all_labels, classes = [], [], []
    for rank in range(n):
        buf, off, got = layout.initial_labels(rank)
        if not got:
            continue
        b = code.get(buf)
        _need(b is not None and 0 <= off and off + len(got) <= sizes[rank, b])
        index = off + np.flatnonzero(np.fromiter(map(is_not, got, repeat(None)), bool, len(got)))
        if len(index) < len(got):
            got = [label for label in got if label is not None]
        cells.append(cellbase[rank * nb + b] + index)
        classes.append(index % k)
        all_labels.extend(got)
    distinct = list(dict.fromkeys(all_labels))          # leaf i: the i-th distinct label, first come first
    L = len(distinct)
    classes = np.concatenate(classes) if classes else np.zeros(0, dtype=np.int64)
    if L == len(all_labels):                             # the usual case: each label starts in one place
        labels, leaf_ids, leaf_class = all_labels, np.arange(L, dtype=np.int64), classes
    else:
        labels = distinct
        leaf_of = dict(zip(distinct, range(L)))
        start_class = dict(zip(all_labels, classes.tolist()))   # the last one wins, as in the executor
        leaf_class = np.fromiter(map(start_class.__getitem__, labels), np.int64, L)
        leaf_ids = np.fromiter(map(leaf_of.__getitem__, all_labels), np.int64, len(all_labels))
    initial = np.full(ncells, -1, dtype=np.int64)
    if cells:   # the last label put in a cell stays there, as in the executor
        cells = np.concatenate(cells)[::-1]
        uniq, pos = np.unique(cells, return_index=True)
        initial[uniq] = leaf_ids[::-1][pos]

    # -- lanes, reads and writes -----------------------------------------------
    lane_start = np.cumsum(count) - count
    NL = int(count.sum())
    r_src, r_j, r_cell = _expand(src_cell, count[src_owner])
    r_step = src_owner[r_src]
    r_lane = lane_start[r_step] + r_j
    r_pos = src_pos[r_src]
    w_row, w_j, w_cell = _expand(dst_cell, count[dst_owner])
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
    idx = np.arange(ne, dtype=np.int64)
    # Same chunk, same level: a write must be the only access there, but for
    # its own step's reads (a race otherwise, which the order cannot settle).
    group_start = np.ones(ne, bool)
    if ne:
        group_start[1:] = (s_cell[1:] != s_cell[:-1]) | (s_level[1:] != s_level[:-1])
    gid = np.cumsum(group_start) - 1
    glast = np.flatnonzero(np.append(group_start[1:], True))[:len(group_start)]   # last event of each group
    writes_in = np.bincount(gid, weights=s_write, minlength=len(glast))
    _need((writes_in <= 1).all())
    lw = glast[gid]                                                            # writes sort last in a group
    _need(not (s_write[lw] & (s_step[lw] != s_step)).any())
    # Each read: the last write to its cell before it, else the cell's initial value.
    cell_start = np.ones(ne, bool)
    if ne:
        cell_start[1:] = s_cell[1:] != s_cell[:-1]
    first = np.maximum.accumulate(np.where(cell_start, idx, 0))
    last_w = np.maximum.accumulate(np.where(s_write, idx, -1))
    w_of_event = np.full(ne, -1, dtype=np.int64)                               # write events: their lane
    w_of_event[s_write] = (w_lane[order[s_write] - nr]) + L
    seen = np.where(last_w >= first, w_of_event[np.maximum(last_w, 0)], initial[s_cell])
    read_ref = np.empty(nr, dtype=np.int64)
    is_read = ~s_write
    read_ref[order[is_read]] = seen[is_read]
    _need((read_ref >= 0).all())                                               # a read of an unwritten chunk
    final = initial.copy()                                                     # each cell's last value
    cell_last = np.flatnonzero(np.append(cell_start[1:], True))[:ne]
    final[s_cell[cell_last]] = np.where(last_w[cell_last] >= first[cell_last],
                                        w_of_event[np.maximum(last_w[cell_last], 0)], initial[s_cell[cell_last]])

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
    rep = _jump(np.where(kind == 1, A, np.arange(len(A))))
    ca, cb = rep[A], np.where(B >= 0, rep[np.maximum(B, 0)], -1)
    left = _jump(np.where(kind == 2, ca, np.arange(len(A))))
    cls = np.full(len(A), -1, dtype=np.int64)
    cls[:L] = leaf_class
    cls = cls[left]                                                           # per leaf and sum
    sums = kind == 2
    _need((cls[ca[sums]] == cls[cb[sums]]).all())                             # one class per reduction
    user = dst_buf[w_row] != scratch
    _need((cls[rep[L + w_lane[user]]] == (dst_index[w_row[user]] + w_j[user]) % k).all())

    # -- outputs ----------------------------------------------------------------
    out_cells, out_exp, exps, exp_index = [], [], [], {}
    for rank in range(n):
        buf, off, expected = layout.expected_list(rank)
        pidx = off + np.flatnonzero(np.fromiter(map(is_not, expected, repeat(None)), bool, len(expected)))
        if not len(pidx):
            continue
        if len(pidx) < len(expected):
            expected = [e for e in expected if e is not None]
        b = code.get(buf)
        _need(b is not None and 0 <= off and pidx[-1] < sizes[rank, b])
        out_cells.append(cellbase[rank * nb + b] + pidx)
        for i, e in dict(zip(map(id, expected), expected)).items():   # exps keeps them alive: ids stay unique
            if i not in exp_index:
                exp_index[i] = len(exps)
                exps.append(e)
        out_exp.append(np.fromiter(map(exp_index.__getitem__, map(id, expected)), np.int64, len(expected)))
    if not out_cells:
        return True
    out_cells, out_exp = np.concatenate(out_cells), np.concatenate(out_exp)
    value = final[out_cells]
    _need((value >= 0).all())                                                  # an output never written
    pairs = np.unique(rep[value] * len(exps) + out_exp)
    roots, which = pairs // len(exps), pairs % len(exps)
    found = _contributions(np.unique(roots), kind, ca, cb)
    for root, e in zip(roots.tolist(), which.tolist()):
        leaves, mult = found[root]
        if dict(zip(map(labels.__getitem__, leaves), mult)) != exps[e].counts:
            return False
    return True


def _jump(ptr):
    """Pointer jumping to the end of every chain (entries at a fixed point end one)."""
    while True:
        nxt = ptr[ptr]
        if np.array_equal(nxt, ptr):
            return ptr
        ptr = nxt


def _contributions(roots, kind, ca, cb) -> dict:
    """Per root value, its leaves and their multiplicities (lists), expanding
    all roots together one depth at a time; shared nodes are merged per root."""
    R = len(roots)
    T = len(kind)
    fr_r = np.arange(R, dtype=np.int64)
    fr_n = roots
    fr_m = np.ones(R)
    got_r, got_n, got_m = [], [], []
    while fr_n.size:
        leaf = kind[fr_n] == 0
        got_r.append(fr_r[leaf])
        got_n.append(fr_n[leaf])
        got_m.append(fr_m[leaf])
        s = ~leaf
        r, nd, m = fr_r[s], fr_n[s], fr_m[s]
        key = np.concatenate([r * T + ca[nd], r * T + cb[nd]])
        uk, inv = np.unique(key, return_inverse=True)
        fr_m = np.bincount(inv, weights=np.concatenate([m, m]))
        fr_r, fr_n = uk // T, uk % T
        _need(fr_m.size == 0 or fr_m.max() < _EXACT)
    key = np.concatenate(got_r) * T + np.concatenate(got_n)
    uk, inv = np.unique(key, return_inverse=True)
    mult = np.bincount(inv, weights=np.concatenate(got_m))
    _need(mult.size == 0 or mult.max() < _EXACT)
    rr, leaves, mult = uk // T, (uk % T).tolist(), mult.astype(np.int64).tolist()
    bounds = np.flatnonzero(np.diff(rr)) + 1
    starts = [0, *bounds.tolist()]
    ends = [*bounds.tolist(), len(leaves)]
    return {int(roots[rr[a]]): (leaves[a:b], mult[a:b]) for a, b in zip(starts, ends)}
