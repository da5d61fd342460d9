"""The fast engine on a plan folded by its symmetry: one threadblock per
class of threadblocks that run alike (msc tune's candidates at hundreds of
ranks: a ring's nodes and instances are relabelings of one another).

Max-plus needs less than the event engine's max-min sharing: if every
member of a class has its representative's step durations, latencies,
message partners and dependencies (each mapped to its class), then by
induction over the levels every member's step ends at its
representative's float (a max of the same sums; max is exact), so the
quotient's makespan is the full plan's. The contention check
(Simulator._overloaded) sums, per shared link, the rates of the
transmissions on it; where every link of a class carries the same multiset
of (flow class, weight), a representative link's sorted events are the
full run's, value for value, and the links of its class see the same loads.

The partition is a hint (msc.sim.symmetry's color refinement of the event
engine's graph, computed once per lowered plan and shared by its
protocols): ``quotient`` checks all of the above exactly, on the arrays the
fast engine reads, and returns None where any of it fails (the caller then
runs the full plan). tests/test_fast_fold.py holds it to the full engine.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from msc.ir.arrays import ranges
from msc.sim.simulate import Simulator
from msc.sim.symmetry import MIN_FOLD, RefinementGraph, remember_partition

# a fold keeping more than this share of the steps is not worth building (the full run goes)
MAX_SHARE = MIN_FOLD


def partition(sim: Simulator):
    """Classes of the nodes (threadblocks, connections, flows, links) of
    ``sim``'s event graph, or None where refinement folds too little. The
    event engine's fold of ``sim`` (msc.sim.symmetry.fold) is told it, so
    it need not refine again."""
    g = RefinementGraph(sim.event_sim())
    sim._engines.pop("events")        # cheap to build again where a size needs it, and large at scale
    cls = g.refine()
    if len(np.unique(cls[:g.T])) > MAX_SHARE * g.T:
        return None
    remember_partition(sim.sp, cls)
    return cls


def _reps(cls: np.ndarray):
    """(per node its class's index, per class its first node), classes in the order of their first node."""
    _, first, inverse = np.unique(cls, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    index = np.empty(len(order), dtype=np.int64)
    index[order] = np.arange(len(order))
    return index[inverse.reshape(-1)], first[order]


def quotient(sim: Simulator, cls: np.ndarray) -> Simulator | None:
    """A Simulator whose fast engine (``run(sizes, engine="fast")``) runs one
    threadblock per class of ``cls`` and gives ``sim``'s results float for
    float, or None where ``cls`` does not fold ``sim`` exactly."""
    sp = sim.sp
    T, C, F = sp.num_tbs, len(sp.conn_src), len(sim.rate)
    if len(cls) != T + C + F + len(sim.capacity):
        return None
    qt, rep_tb = _reps(cls[:T])
    lens = np.diff(sp.tb_start)
    if len(rep_tb) > MAX_SHARE * T or (lens != lens[rep_tb][qt]).any():
        return None
    qlens = lens[rep_tb]
    qstart = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64)
    step_tb = sp.step_tb.astype(np.int64)
    qstep = qstart[qt[step_tb]] + (np.arange(sp.num_steps) - sp.tb_start[step_tb])   # per step, its quotient's
    rep = ranges(sp.tb_start[rep_tb], qlens)                  # per quotient step, the full step it is
    same = lambda x: x is None or np.array_equal(x, x[rep][qstep])      # noqa: E731 (every step as its representative)
    if not all(same(x) for x in (sim.comp, sim.fixed, sim.tx, sim.tx_floor, sim.watch)):
        return None
    messages = _messages(sp, sim.alpha, cls[T:T + C], qstep)
    deps = _deps(sp, qstep, rep)
    flows = _flows(sim, cls[T + C:T + C + F], cls[T + C + F:], qstep, rep, step_tb, qt)
    if messages is None or deps is None or flows is None:
        return None
    conn_rep, conn_ptr, msg_send, msg_recv = messages
    qflow, rate, watch_len, watch_flat, watch_wt = flows
    qsp = replace(sp, tb_start=qstart, tb_rank=sp.tb_rank[rep_tb], tb_local=sp.tb_local[rep_tb],
                  step_tb=np.repeat(np.arange(len(rep_tb), dtype=np.int32), qlens), code=sp.code[rep],
                  count=sp.count[rep], sends=sp.sends[rep], recvs=sp.recvs[rep], nred=sp.nred[rep],
                  ncopy=sp.ncopy[rep], dep_src=deps[0], dep_dst=deps[1], conn_src=sp.conn_src[conn_rep],
                  conn_dst=sp.conn_dst[conn_rep], conn_ch=sp.conn_ch[conn_rep], conn_ptr=conn_ptr,
                  msg_send=msg_send, msg_recv=msg_recv, tb_send_conn=np.full(len(rep_tb), -1),
                  tb_recv_conn=np.full(len(rep_tb), -1),
                  switch_op=None if sp.switch_op is None else sp.switch_op[rep],
                  barrier=None if sp.barrier is None else sp.barrier[rep],
                  tb_group=None if sp.tb_group is None else [sp.tb_group[t] for t in rep_tb.tolist()])
    q = _Quotient.__new__(_Quotient)
    q.__dict__.update(sim.__dict__)
    q.sp, q._layers, q._engines = qsp, None, {}          # its own layers; never the full plan's event engine
    q.alpha = sim.alpha[conn_rep]
    q.comp, q.fixed, q.tx = sim.comp[rep], sim.fixed[rep], sim.tx[rep]
    q.tx_floor = None if sim.tx_floor is None else sim.tx_floor[rep]
    q.watch = None if sim.watch is None else sim.watch[rep]
    q.flow_conn = qflow
    q.rate = rate
    q._watch_len, q._watch_flat, q._watch_wt = watch_len, watch_flat, watch_wt
    q._watch_ptr = np.concatenate([[0], np.cumsum(watch_len)]).astype(np.int64)
    return q


class _Quotient(Simulator):
    """A quotient's fast engine only: its contended sizes are the full plan's event engine's."""

    def event_sim(self):
        raise TypeError("a folded plan runs the fast engine only: simulate contention on the full Simulator")


def _messages(sp, alpha, ccls, qstep):
    """(per quotient connection its full one, conn_ptr, msg_send, msg_recv) of
    the quotient, or None unless every connection's messages are its
    representative's, step for step (in quotient steps), at its latency."""
    qc, conn_rep = _reps(ccls)
    per = np.diff(sp.conn_ptr)
    if (per != per[conn_rep][qc]).any() or not np.array_equal(alpha, alpha[conn_rep][qc]):
        return None
    qper = per[conn_rep]
    conn_ptr = np.concatenate([[0], np.cumsum(qper)]).astype(np.int64)
    mconn = np.repeat(np.arange(len(per), dtype=np.int64), per)
    pos = conn_ptr[qc[mconn]] + np.arange(len(mconn)) - sp.conn_ptr[mconn]     # each message's quotient slot
    out = []
    for steps in (sp.msg_send, sp.msg_recv):
        mine = qstep[steps]
        q = np.empty(int(conn_ptr[-1]), dtype=np.int64)
        q[pos] = mine
        if not np.array_equal(q[pos], mine):
            return None
        out.append(q)
    return conn_rep, conn_ptr, out[0], out[1]


def _deps(sp, qstep, rep):
    """The quotient's dependency edges (its representatives'), or None unless
    every step waits for the classes of steps its representative waits for."""
    G, Q = len(qstep), len(rep)
    src, dst = qstep[sp.dep_src], sp.dep_dst.astype(np.int64)
    per_step = np.unique(dst * Q + src)                       # (full step, quotient source), once each
    count = np.bincount(per_step // Q, minlength=G)
    pairs = np.unique(qstep[per_step // Q] * Q + per_step % Q)     # (quotient step, quotient source)
    if (count != count[rep][qstep]).any() or len(pairs) != int(count[rep].sum()):
        return None
    return (pairs % Q).astype(np.int64), (pairs // Q).astype(np.int64)


def _flows(sim, fcls, xcls, qstep, rep, step_tb, qt):
    """Per quotient step its quotient flow, per quotient flow its rate and
    watched (link, weight) uses on representative links; None unless every
    step's flow is of its representative's flow class, one flow per
    threadblock and class, one threadblock class per flow class, every flow
    of a class at one rate, and every link of a class loaded alike (the same
    (flow class, weight) multiset, all of a class watched or none)."""
    qf, flow_rep = _reps(fcls)
    xq, link_rep = _reps(xcls)
    flow = sim.flow_conn
    has = flow >= 0
    qflow = np.where(has[rep], qf[np.maximum(flow[rep], 0)], -1)
    if not np.array_equal(np.where(has, qf[np.maximum(flow, 0)], -1), qflow[qstep]):
        return None
    tb_flow = np.unique(step_tb[has] * len(fcls) + flow[has])
    tb_q = np.unique(tb_flow // len(fcls) * len(flow_rep) + qf[tb_flow % len(fcls)])
    tbclass_q = np.unique(qt[tb_q // len(flow_rep)] * len(flow_rep) + tb_q % len(flow_rep))
    if len(tb_q) != len(tb_flow) or len(np.unique(tbclass_q % len(flow_rep))) != len(tbclass_q):
        return None
    if not np.array_equal(sim.rate, sim.rate[flow_rep][qf]):
        return None
    rlink = link_rep[xq]                                       # per link, its class's representative
    uf = np.repeat(np.arange(len(fcls), dtype=np.int64), sim._watch_len)
    ur, uw, uq = sim._watch_flat, sim._watch_wt, qf[uf]
    watched = np.zeros(len(xcls), dtype=bool)
    watched[ur] = True
    if not np.array_equal(watched, watched[rlink]):
        return None
    o = np.lexsort((uw, uq, ur))
    ur, uq, uw = ur[o], uq[o], uw[o]
    n = np.bincount(ur, minlength=len(xcls))
    ptr = np.concatenate([[0], np.cumsum(n)])
    theirs = ptr[rlink[ur]] + np.arange(len(ur)) - ptr[ur]     # the same place in the representative link's uses
    if (n != n[rlink]).any() or not (np.array_equal(uq, uq[theirs]) and np.array_equal(uw, uw[theirs])):
        return None
    mine = rlink[ur] == ur
    by_flow = np.argsort(uq[mine], kind="stable")
    flat, wt = ur[mine][by_flow], uw[mine][by_flow]
    return qflow, sim.rate[flow_rep], np.bincount(uq[mine], minlength=len(flow_rep)).astype(np.int64), flat, wt
