"""A plan as flat numpy arrays, the form both simulator engines read.

Built from the plan's columns (msc.ir.arrays, read once per plan): steps
have global ids ``g`` in rank, threadblock, step order, so a threadblock's
steps are the contiguous range ``tb_start[t]:tb_start[t+1]``; connections
are numbered in sorted (sender, receiver, channel) order.

Messages: a connection (sender, receiver, channel) has one sending and one
receiving threadblock (msc.verification.plan_values' rule), so its k-th message is the k-th
sending step of the one and the k-th receiving step of the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msc.errors import PlanError
from msc.ir import Plan, StepOp
from msc.ir.arrays import OPS, RECEIVES, SENDS, PlanArrays, plan_arrays

_REDUCES = np.array([op.reduces for op in OPS], dtype=np.float64)
_COPIES = np.array([op is StepOp.COPY for op in OPS], dtype=np.float64)
_REDUCE = OPS.index(StepOp.REDUCE)
SWITCH_READS, SWITCH_WRITES = 1, 2      # SimPlan.switch_op's bits: a reduce-load, a multicast store


@dataclass
class SimPlan:
    """Arrays of a plan (see the module doc). ``nred``: operands added per
    chunk byte (1 for rrs/rrc/rrcs, sources - 1 for reduce); ``ncopy``: 1 for
    a local copy. ``dep_src``/``dep_dst``: dependency edges between global
    step ids (same iteration). Connection c (``conn_src``, ``conn_dst``,
    ``conn_ch``, in sorted order) has its messages, in order, in
    ``msg_send[conn_ptr[c]:conn_ptr[c+1]]`` (sending steps) and the same
    slice of ``msg_recv`` (receiving steps). Arrays taken from the plan's
    PlanArrays are theirs, read-only."""

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
    switch_op: np.ndarray | None = None     # per step: its switch op (_switch_steps: 1 reads, 2 writes, 3 both), 0: none
    barrier: np.ndarray | None = None       # per step: a barrier of its switch group
    tb_group: list | None = None            # per threadblock: its switch group (a tuple of ranks), () if none

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
    """The arrays of ``plan`` (a checked plan: load_plan and lower check it);
    PlanError where its connections or dependencies cannot be simulated."""
    arrays = plan_arrays(plan)
    _check(arrays)
    code = arrays.op
    nred = _REDUCES[code]
    reduces = code == _REDUCE
    if reduces.any():                                          # (nsrc reads every step's sources)
        nred[reduces] = arrays.nsrc[reduces] - 1              # a reduce adds every source past the first
    dep_src, dep_dst = arrays.dep_step, arrays.dep_owner
    switch = barrier = groups = None
    if plan.first_switch_step() is not None:
        switch, barrier, extra = _switch_steps(plan, arrays)
        groups = [tb.group or () for rp in plan.ranks for tb in rp.threadblocks]
        nred = np.where(switch > 0, 0.0, nred)              # the switch adds, not the threadblock
        dep_src = np.concatenate([dep_src, extra[0]]).astype(np.int64)
        dep_dst = np.concatenate([dep_dst, extra[1]]).astype(np.int64)
    return SimPlan(plan, arrays.tb_start, arrays.tb_rank.astype(np.int32), arrays.tb_id.astype(np.int32),
                   arrays.step_tb.astype(np.int32), code, arrays.count.astype(np.float64), SENDS[code], RECEIVES[code],
                   nred, _COPIES[code], dep_src, dep_dst, arrays.conn_sender, arrays.conn_receiver,
                   arrays.conn_channel, arrays.send_ptr, arrays.send_steps, arrays.recv_steps, arrays.tb_send_conn,
                   arrays.tb_recv_conn, switch, barrier, groups)


def _switch_steps(plan: Plan, arrays: PlanArrays):
    """Per step, its switch op: SWITCH_READS for a reduce-load (it reads the
    chunk from every member: the members' ports carry it out, the issuing
    rank's carries the sum in), SWITCH_WRITES for a multicast store (the
    issuing rank's port carries it out, every member's in), both for the
    fused op (msc.sim.simulate.Simulator._switch_flows prices them); 0 for
    other steps. Per step, whether it is a barrier; and the barriers'
    edges: the k-th barrier of a (group, channel) starts when every member
    has finished the step before its own k-th barrier."""
    from msc.ir.worklist import GroupBarriers

    switch = np.zeros(len(arrays.op), dtype=np.int8)
    barrier = np.zeros(len(arrays.op), dtype=bool)
    base = {(int(r), int(t)): int(g) for r, t, g in zip(arrays.tb_rank, arrays.tb_id, arrays.tb_start[:-1])}
    bars = GroupBarriers(plan)
    src, dst = [], []
    for rp in plan.ranks:
        for tb in rp.threadblocks:
            if not tb.group:
                continue
            g0 = base[(rp.rank, tb.id)]
            for s, step in enumerate(tb.steps):
                if step.op.group_reads or step.op.group_writes:
                    switch[g0 + s] = SWITCH_READS * step.op.group_reads + SWITCH_WRITES * step.op.group_writes
                elif step.op is StepOp.BARRIER:
                    barrier[g0 + s] = True
                    for m, t, b in bars.peers(rp.rank, tb, s):
                        if b:
                            src.append(base[(m, t)] + b - 1)
                            dst.append(g0 + s)
    return switch, barrier, (np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))


def _check(arrays: PlanArrays) -> None:
    """PlanError where the plan cannot be simulated: a dependency that
    names no step; a connection with a receiving threadblock but no sending
    one (the first by its receiving threadblock); a step that sends or
    receives on a side its threadblock has no peer; a connection with more
    sends than receives or fewer (the first by its sending threadblock)."""
    if not arrays.deps_in_range:
        _raise_at(arrays, int(arrays.dep_owner[np.argmax(arrays.dep_step < 0)]),
                  "a dependency names no step of its rank")
    no_sender = np.flatnonzero(arrays.conn_senders == 0)
    if no_sender.size:
        c = int(no_sender[np.argmin(arrays.conn_recv_tb[no_sender])])
        raise PlanError(f"connection {_describe(arrays, c)} has a receiving threadblock but no sending one")
    if arrays.unconnected.size:
        _raise_at(arrays, int(arrays.unconnected[0]), "it sends or receives, but its threadblock has no such peer")
    sends, receives = arrays.sends_per_conn, arrays.receives_per_conn
    unequal = np.flatnonzero(sends != receives)
    if unequal.size:
        c = int(unequal[np.argmin(arrays.conn_send_tb[unequal])])
        raise PlanError(f"connection {_describe(arrays, c)}: {sends[c]} sends but {receives[c]} receives")


def _describe(arrays: PlanArrays, c: int) -> str:
    return f"rank {arrays.conn_sender[c]} -> rank {arrays.conn_receiver[c]} channel {arrays.conn_channel[c]}"


def _raise_at(arrays: PlanArrays, g: int, what: str):
    t = int(arrays.step_tb[g])
    rank, tb, step = int(arrays.tb_rank[t]), int(arrays.tb_id[t]), g - int(arrays.tb_start[t])
    raise PlanError(what, rank=rank, tb=tb, step=step)
