"""Ordering the steps of every threadblock, and building the plan.

All instructions get one global order: a topological order of the local
edges and the messages, by a priority. ``PRIORITIES`` lists the ones tried:
smallest depth first (depth = longest path from a source: the ring's hops
interleave as they should, every link busy from the first step), then trace
order (the user's own order: never stuck on a connection's order, and it
keeps trees and chunked pipelines from sending in bursts that need many
slots). Ties go to trace order.
A receive is taken only when its message is the oldest one on its
connection, so every connection is sent and received in the same order
(connections are FIFO). Each threadblock's steps are the global order
restricted to it, which makes the plan free of dependency cycles; a
dependency on another threadblock of the rank becomes an explicit
(threadblock, step) wait.
"""
from __future__ import annotations

import heapq
from collections import deque

from msc.dag import Dag
from msc.errors import LoweringError
from msc.ir import Plan, RankPlan, Step, StepOp, Threadblock
from msc.placement import Placement


PRIORITIES = ("depth", "trace")


def _message_edges(dag: Dag):
    out = {}
    for sender, receiver in dag.messages:
        out[sender] = out.get(sender, ()) + (receiver,)
    return out


def depths(dag: Dag) -> dict[int, int]:
    """Longest path from a source to every instruction (local and message edges)."""
    msg_succ = _message_edges(dag)
    indeg = {}
    for ins in dag.live():
        indeg[ins.id] = len(dag.preds[ins.id]) + (1 if ins.msg_in is not None else 0)
    depth = {i: 0 for i, d in indeg.items() if d == 0}
    queue = deque(depth)
    while queue:
        i = queue.popleft()
        for s in list(dag.succs[i]) + list(msg_succ.get(i, ())):
            depth[s] = max(depth.get(s, 0), depth[i] + 1)
            indeg[s] -= 1
            if indeg[s] == 0:
                queue.append(s)
    if len(depth) != len(indeg):
        raise LoweringError("the program's dependencies form a cycle")
    return depth


def order(dag: Dag, priority: str = "depth") -> list[int]:
    """The global step order (see the module docstring)."""
    depth = depths(dag) if priority == "depth" else {i.id: 0 for i in dag.live()}
    msg_succ = _message_edges(dag)
    indeg, conn_of = {}, {}
    for ins in dag.live():
        indeg[ins.id] = len(dag.preds[ins.id]) + (1 if ins.msg_in is not None else 0)
        if ins.msg_in is not None:
            conn_of[ins.msg_in] = (ins.recv_peer, ins.rank, ins.channel)
    queues: dict[tuple, deque] = {}
    parked: dict[int, int] = {}      # message -> receiver waiting for it to reach the head
    heap = [(depth[i], i) for i, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    result = []
    while heap:
        _, i = heapq.heappop(heap)
        ins = dag.instrs[i]
        if ins.msg_in is not None:
            q = queues[conn_of[ins.msg_in]]
            if q[0] != ins.msg_in:
                parked[ins.msg_in] = i
                continue
            q.popleft()
            if q and q[0] in parked:
                r = parked.pop(q[0])
                heapq.heappush(heap, (depth[r], r))
        if ins.msg_out is not None:
            conn = (ins.rank, ins.send_peer, ins.channel)
            queues.setdefault(conn, deque()).append(ins.msg_out)
        result.append(i)
        for s in list(dag.succs[i]) + list(msg_succ.get(i, ())):
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (depth[s], s))
    if len(result) != len(indeg):
        _stuck(dag, parked, queues, conn_of)
    return result


def _stuck(dag: Dag, parked, queues, conn_of):
    for msg, receiver in parked.items():
        sender_rank, rank, channel = conn_of[msg]
        head = queues[conn_of[msg]][0]
        first = dag.instrs[dag.messages[head][1]]
        raise LoweringError(
            f"no order of connection rank {sender_rank} -> rank {rank} (channel {channel}) works: rank {rank} must "
            f"receive a later message (from {dag.instrs[receiver].where}) before the earlier one "
            f"(from {first.where}), which it can only take afterwards; put them on different channels "
            f"(channel= hints)", dag.instrs[receiver].where)
    raise LoweringError("the program cannot be scheduled: its dependencies wait on each other")


def build_plan(dag: Dag, global_order: list[int], tb_of: dict[int, int], placement: Placement, *,
               name: str, collective: str, num_ranks: int, chunk_factor: int, inplace: bool,
               input_chunks: int, output_chunks: int, scratch: list[int], root: int, protocol: str,
               instances: int, slots: int, tile: int) -> Plan:
    position: dict[int, tuple[int, int]] = {}
    lists = [[[] for _ in tbs] for tbs in placement.tbs]
    for i in global_order:
        ins = dag.instrs[i]
        tb = tb_of[i]
        position[i] = (tb, len(lists[ins.rank][tb]))
        lists[ins.rank][tb].append(i)
    ranks = []
    for rank, tbs in enumerate(placement.tbs):
        built = []
        for tb in tbs:
            steps = []
            for i in lists[rank][tb.id]:
                ins = dag.instrs[i]
                latest: dict[int, int] = {}
                for p in dag.preds[i]:
                    ptb, pstep = position[p]
                    if ptb != tb.id and pstep > latest.get(ptb, -1):
                        latest[ptb] = pstep
                dst = None if ins.op is StepOp.RRS else ins.dst
                srcs = () if ins.op in (StepOp.RECV, StepOp.RCS) else ins.srcs
                steps.append(Step(ins.op, srcs, dst, ins.count, tuple(sorted(latest.items())), ins.where))
            built.append(Threadblock(tb.id, tb.send, tb.recv, tb.channel, tuple(steps)))
        ranks.append(RankPlan(rank, scratch[rank], tuple(built)))
    return Plan(name, collective, num_ranks, chunk_factor, inplace, input_chunks, output_chunks, tuple(ranks),
                root, protocol, instances, slots, tile)
