"""A plan as flat numpy arrays, the form both simulator engines read.

One pass of Python over the steps (a 1024-rank ring has two million; list
comprehensions keep it near a second), everything after that in numpy.
Steps get global ids ``g`` in rank, threadblock, step order, so a
threadblock's steps are the contiguous range ``tb_start[t]:tb_start[t+1]``.

Messages: a connection (sender, receiver, channel) has one sending and one
receiving threadblock (msc.verification.plan_values' rule), so its k-th message is the k-th
sending step of the one and the k-th receiving step of the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msc.errors import PlanError
from msc.ir import Plan, StepOp

_CODE = {id(op): i for i, op in enumerate(StepOp)}      # id(): hashing an Enum member is slow
_SENDS = np.array([op.sends for op in StepOp])
_RECVS = np.array([op.receives for op in StepOp])
_REDUCES = np.array([op.reduces for op in StepOp], dtype=np.float64)
_COPIES = np.array([op is StepOp.COPY for op in StepOp], dtype=np.float64)
_REDUCE = StepOp.REDUCE


@dataclass
class SimPlan:
    """Arrays of a plan (see the module doc). ``nred``: operands added per
    chunk byte (1 for rrs/rrc/rrcs, sources - 1 for reduce); ``ncopy``: 1 for
    a local copy. ``dep_src``/``dep_dst``: dependency edges between global
    step ids (same iteration). Connection c's messages, in order, are
    ``msg_send[conn_ptr[c]:conn_ptr[c+1]]`` (sending steps) and the same
    slice of ``msg_recv`` (receiving steps)."""

    plan: Plan
    tb_start: np.ndarray
    tb_rank: np.ndarray
    tb_local: np.ndarray
    step_tb: np.ndarray
    code: np.ndarray
    count: np.ndarray
    sends: np.ndarray
    recvs: np.ndarray
    nred: np.ndarray
    ncopy: np.ndarray
    dep_src: np.ndarray
    dep_dst: np.ndarray
    conn_src: np.ndarray
    conn_dst: np.ndarray
    conn_ch: np.ndarray
    conn_ptr: np.ndarray
    msg_send: np.ndarray
    msg_recv: np.ndarray
    tb_send_conn: np.ndarray      # per threadblock: the connection it sends on, -1 if none
    tb_recv_conn: np.ndarray

    @property
    def num_steps(self) -> int:
        return len(self.code)

    @property
    def num_tbs(self) -> int:
        return len(self.tb_rank)

    @property
    def chunks_big(self) -> int:
        """Chunks of the larger user buffer: the nccl-tests size covers it."""
        return max(self.plan.input_chunks, self.plan.output_chunks)


def compile_plan(plan: Plan) -> SimPlan:
    """The arrays of ``plan`` (a checked plan: load_plan and lower check it)."""
    code, count = [], []
    tb_start, tb_rank, tb_local = [0], [], []
    dep_pairs, reduce_at = [], []
    conns: dict[tuple, int] = {}
    send_conn, recv_conn = [], []
    gid = 0
    cmap = _CODE
    for rp in plan.ranks:
        base, rank_deps = [], []
        for tb in rp.threadblocks:
            base.append(gid)
            steps = tb.steps
            code += [cmap[id(s.op)] for s in steps]
            count += [s.count for s in steps]
            for i, s in [(i, s) for i, s in enumerate(steps) if s.deps or s.op is _REDUCE]:
                if s.deps:
                    rank_deps.append((gid + i, s.deps))
                if s.op is _REDUCE:
                    reduce_at.append((gid + i, len(s.srcs) - 1))
            gid += len(steps)
            tb_start.append(gid)
            tb_rank.append(rp.rank)
            tb_local.append(tb.id)
            send_conn.append(conns.setdefault((rp.rank, tb.send, tb.channel), len(conns))
                             if tb.send is not None else -1)
            recv_conn.append((tb.recv, rp.rank, tb.channel) if tb.recv is not None else None)
        dep_pairs += [(base[t] + s, g) for g, deps in rank_deps for t, s in deps]   # (tb, step) -> global id
    recv_ids = []
    for key in recv_conn:
        if key is None:
            recv_ids.append(-1)
        elif key not in conns:
            raise PlanError(f"connection rank {key[0]} -> rank {key[1]} channel {key[2]} has a receiving "
                            f"threadblock but no sending one")
        else:
            recv_ids.append(conns[key])
    code = np.array(code, dtype=np.int8)
    tb_start = np.array(tb_start, dtype=np.int64)
    step_tb = np.repeat(np.arange(len(tb_rank), dtype=np.int32), np.diff(tb_start))
    sends, recvs = _SENDS[code], _RECVS[code]
    nred = _REDUCES[code]
    for g, extra in reduce_at:
        nred[g] = extra
    dep = np.array(dep_pairs, dtype=np.int64).reshape(-1, 2)
    tb_send_conn = np.array(send_conn, dtype=np.int64)
    tb_recv_conn = np.array(recv_ids, dtype=np.int64)
    keys = sorted(conns, key=conns.get)
    nconn = len(keys)
    conn_arr = np.array(keys, dtype=np.int64).reshape(-1, 3)
    # messages: sending steps grouped by connection, stable (tb order = step order)
    s_gid = np.flatnonzero(sends)
    s_conn = tb_send_conn[step_tb[s_gid]]
    order = np.argsort(s_conn, kind="stable")
    msg_send, s_conn = s_gid[order], s_conn[order]
    r_gid = np.flatnonzero(recvs)
    r_conn = tb_recv_conn[step_tb[r_gid]]
    order = np.argsort(r_conn, kind="stable")
    msg_recv, r_conn = r_gid[order], r_conn[order]
    ns, nr = np.bincount(s_conn, minlength=nconn), np.bincount(r_conn, minlength=nconn)
    if len(ns) != nconn or not np.array_equal(ns, nr):
        c = int(np.flatnonzero(ns != nr)[0]) if len(ns) == len(nr) else 0
        raise PlanError(f"connection rank {keys[c][0]} -> rank {keys[c][1]} channel {keys[c][2]}: "
                        f"{ns[c]} sends but {nr[c]} receives")
    conn_ptr = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    return SimPlan(plan, tb_start, np.array(tb_rank, dtype=np.int32), np.array(tb_local, dtype=np.int32), step_tb,
                   code, np.array(count, dtype=np.float64), sends, recvs, nred, _COPIES[code],
                   dep[:, 0].copy(), dep[:, 1].copy(), conn_arr[:, 0].copy(), conn_arr[:, 1].copy(),
                   conn_arr[:, 2].copy(), conn_ptr, msg_send, msg_recv, tb_send_conn, tb_recv_conn)
