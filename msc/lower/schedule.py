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

from msc.lower.dag import Dag
from msc.errors import LoweringError
from msc.ir import Plan, RankPlan, Step, Threadblock
from msc.lower.placement import Placement


PRIORITIES = ("depth", "trace")


def _indegrees(dag: Dag) -> list:
    """Per instruction id: local predecessors plus the message it receives
    (None where fusion removed the instruction)."""
    preds = dag.preds
    return [None if ins is None else len(preds[ins.id]) + (ins.msg_in is not None) for ins in dag.instrs]


def depths(dag: Dag) -> list[int]:
    """Longest path from a source to every instruction (local and message
    edges), by instruction id (0 where fusion removed one)."""
    # Every edge of a DAG from build_dag points to a later id (an instruction
    # depends on earlier ones, a message's receiver comes after its sender, a
    # fused step keeps the first id), so one pass in id order suffices: it
    # reads instructions in memory order, where the walk below jumps around.
    instrs, preds, messages = dag.instrs, dag.preds, dag.messages
    depth = [0] * len(instrs)
    for i, ins in enumerate(instrs):
        if ins is None:
            continue
        d = 0
        for p in preds[i]:
            if p >= i:
                return _depths_by_walk(dag)
            if depth[p] >= d:
                d = depth[p] + 1
        if ins.msg_in is not None:
            p = messages[ins.msg_in][0]
            if p >= i:
                return _depths_by_walk(dag)
            if depth[p] >= d:
                d = depth[p] + 1
        depth[i] = d
    return depth


def _depths_by_walk(dag: Dag) -> list[int]:
    """depths() for any DAG: a walk in topological order (and the error for a cycle)."""
    indeg = _indegrees(dag)
    depth = [0] * len(indeg)
    queue = deque(i for i, d in enumerate(indeg) if d == 0)
    done = 0
    instrs, succs, messages = dag.instrs, dag.succs, dag.messages
    while queue:
        i = queue.popleft()
        done += 1
        di = depth[i] + 1
        m = instrs[i].msg_out
        for s in succs[i] if m is None else succs[i] + (messages[m][1],):
            if depth[s] < di:
                depth[s] = di
            indeg[s] -= 1
            if indeg[s] == 0:
                queue.append(s)
    if done != len(indeg) - indeg.count(None):
        raise LoweringError("the program's dependencies form a cycle")
    return depth


def order(dag: Dag, priority: str = "depth") -> list[int]:
    """The global step order (see the module docstring)."""
    depth = depths(dag) if priority == "depth" else [0] * len(dag.instrs)
    indeg = _indegrees(dag)
    instrs, succs, messages = dag.instrs, dag.succs, dag.messages
    # Per message: its connection and that connection's FIFO as seen by the
    # receiver and by the sender (looked up once here, not once per step).
    conn_of, queues = {}, {}
    recv_queue, send_queue = [None] * len(messages), [None] * len(messages)

    def queue(conn):
        q = queues.get(conn)
        if q is None:
            q = queues[conn] = deque()
        return q

    for m, (sender, receiver) in enumerate(messages):
        s_ins, r_ins = instrs[sender], instrs[receiver]
        conn_of[m] = conn = (r_ins.recv_peer, r_ins.rank, r_ins.channel)
        recv_queue[m] = queue(conn)
        send_queue[m] = queue((s_ins.rank, s_ins.send_peer, s_ins.channel))
    parked: dict[int, int] = {}      # message -> receiver waiting for it to reach the head
    # heap entries are depth * size + id: one int compares faster than a (depth, id) tuple, same order
    size = len(indeg)
    heap = [depth[i] * size + i for i, d in enumerate(indeg) if d == 0]
    heapq.heapify(heap)
    result = []
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        i = pop(heap) % size
        ins = instrs[i]
        m = ins.msg_in
        if m is not None:
            q = recv_queue[m]
            if q[0] != m:
                parked[m] = i
                continue
            q.popleft()
            if q and q[0] in parked:
                r = parked.pop(q[0])
                push(heap, depth[r] * size + r)
        result.append(i)
        for s in succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                push(heap, depth[s] * size + s)
        m = ins.msg_out
        if m is not None:
            send_queue[m].append(m)
            s = messages[m][1]
            indeg[s] -= 1
            if indeg[s] == 0:
                push(heap, depth[s] * size + s)
    if len(result) != len(indeg) - indeg.count(None):
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


def build_plan(dag: Dag, global_order: list[int], tb_of: list, placement: Placement, *,
               name: str, collective: str, num_ranks: int, chunk_factor: int, inplace: bool,
               input_chunks: int, output_chunks: int, scratch: list[int], root: int, protocol: str,
               instances: int, slots: int, tile: int) -> Plan:
    where_tb = [-1] * len(dag.instrs)      # instruction id -> its threadblock and step index
    where_step = [-1] * len(dag.instrs)
    lists = [[[] for _ in tbs] for tbs in placement.tbs]
    instrs, preds = dag.instrs, dag.preds
    for i in global_order:
        tb = tb_of[i]
        steps = lists[instrs[i].rank][tb]
        where_tb[i], where_step[i] = tb, len(steps)
        steps.append(i)
    ranks = []
    for rank, tbs in enumerate(placement.tbs):
        built = []
        for tb in tbs:
            steps = []
            t = tb.id
            for i in lists[rank][t]:
                ins = instrs[i]
                latest: dict[int, int] = {}
                for p in preds[i]:
                    ptb = where_tb[p]
                    if ptb != t and where_step[p] > latest.get(ptb, -1):
                        latest[ptb] = where_step[p]
                op = ins.op
                dst = ins.dst if op.has_dst else None           # the operands its op takes (msc.ir)
                srcs = ins.srcs if op.nsrc != "0" else ()
                steps.append(Step(op, srcs, dst, ins.count, tuple(sorted(latest.items())) if latest else (),
                                  ins.where))
            built.append(Threadblock(t, tb.send, tb.recv, tb.channel, tuple(steps)))
        ranks.append(RankPlan(rank, scratch[rank], tuple(built)))
    return Plan(name, collective, num_ranks, chunk_factor, inplace, input_chunks, output_chunks, tuple(ranks),
                root, protocol, instances, slots, tile)
