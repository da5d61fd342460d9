"""Bulk lowering: the passes of lower.py computed over numpy arrays.

For a program whose every operation moves chunks from one rank to another
(the ring, all-pairs, tree and hierarchical schedules that reach thousands
of ranks), lowered with automatic threadblocks and fusion, ``bulk_plans``
yields the very plans the pass-by-pass pipeline yields (tests/test_bulk.py
compares the two on the library, text for text), with numpy doing per pass
what Python did per instruction: a 1024-rank ring has four million.

The passes, on these programs, reduce to:

- build_dag: operation j is send 2j on its source rank and receive 2j+1
  (recv, or rrc for a reduce) on its destination, each of the operation's
  size. Accesses of one chunk (an instruction of c chunks makes c, one per
  "lane"), in id order, give the edges: a read follows the chunk's previous
  write (read-after-write), precedes its next write (write-after-read), and
  a write follows the previous write; an edge two instructions share in
  several lanes is one edge.
- forwarding pairs: each receive pairs with the first send whose only
  predecessor it is and that reads exactly the chunks it wrote (every lane
  of the send reads a chunk the receive wrote last, and both have one size).
- placement: placement.spread_rule and placement.place_connections, shared.
- fuse_forwarding: the send of an allowed pair merges into its receive
  (rcs, rrcs, taking the send's message and source line); drop_dead_stores,
  compact_scratch and assign follow.
- order: with depth the longest path (msc.ir.levels), the heap in
  schedule.order pops the instructions in (depth, id) order as long as no
  receive waits behind an older message on its connection; where one would,
  the plan is left to the pipeline (``None``).
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from msc.ir.accesses import writes_around
from msc.ir.columns import OpColumns
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.ir.levels import levels
from msc.lower.placement import place_connections, spread_rule
from msc.verification.multisets import expand

# Instruction kinds, as small ints in arrays
_SEND, _RECV, _RRC, _RCS, _RRCS, _RRS = range(6)
_STEP_OPS = (StepOp.SEND, StepOp.RECV, StepOp.RRC, StepOp.RCS, StepOp.RRCS, StepOp.RRS)


def fits(options) -> bool:
    """Whether bulk lowering takes these options (the program is checked as it goes)."""
    return options.threadblocks == "auto" and options.fuse


def bulk_plans(ops, scratch: list[int], num_ranks: int, priorities, plan_fields: dict, columns=None):
    """For each priority of ``priorities``, (priority, plan), or (priority,
    None) from the first order it leaves to the pipeline (a program it does
    not cover is left at the first). ``scratch``: chunks per rank from
    allocate_scratch; ``plan_fields``: the Plan's other fields; ``columns``:
    a function giving ``ops`` as OpColumns, where the caller has them (then ``ops`` may be None)."""
    c = columns() if columns is not None else OpColumns(ops) if ops else None
    # every operation between two ranks (a local copy or reduce is an instruction of its own: the pipeline's)
    if c is None or not c.count or np.any(c.srank == c.drank) or not _fits_int64(c, num_ranks):
        yield priorities[0], None
        return
    for priority in priorities:
        plan = _bulk_plan(c, scratch, num_ranks, priority, plan_fields)
        yield priority, plan          # (this generator holds none of the arrays while the caller verifies)


def _bulk_plan(c: OpColumns, scratch: list[int], num_ranks: int, priority: str, plan_fields: dict):
    """The plan in ``priority``'s order, or None where the pipeline must
    order it. Its arrays are freed on return, before the plan verifier reads
    the plan (a 1024-rank ring's are hundreds of MB): a second order, rarely
    asked for, computes them again."""
    n_ins = 2 * c.count
    send_id = np.arange(0, n_ins, 2, dtype=np.int64)
    recv_id = send_id + 1
    edges = _chunk_edges(c)
    channel, recv_conns, send_conns = _spread(c, num_ranks)
    firsts, seconds = _forwarding_pairs(c, edges)
    placement = place_connections(recv_conns, send_conns, _wanted(c, channel, firsts, seconds, num_ranks), num_ranks)
    del recv_conns, send_conns
    conn_code, tb_of = _assign(c, channel, placement, num_ranks, send_id, recv_id)
    del channel
    fused = _fuse(c, edges, tb_of, firsts, seconds, send_id, recv_id)
    del edges, firsts, seconds, send_id

    sidx, didx, scratch = _compact_scratch(c, scratch, num_ranks)
    global_order = _order(priority, n_ins, fused.live, fused.edge_src, fused.edge_dst, fused.sender, recv_id,
                          conn_code)
    del recv_id, conn_code
    if global_order is None:
        return None
    rank = np.empty(n_ins, dtype=np.int64)
    rank[0::2], rank[1::2] = c.srank, c.drank
    fields = dict(plan_fields, num_ranks=num_ranks, scratch=scratch)
    return _build_plan(c, global_order, fused.kind, rank, tb_of, fused.where_op, sidx, didx,
                       fused.edge_src, fused.edge_dst, placement, fields)


def _assign(c: OpColumns, channel, placement, num_ranks: int, send_id, recv_id):
    """assign: per operation its connection's code, and per instruction
    (sends ``send_id``, receives ``recv_id``) its threadblock."""
    channels = int(channel.max()) + 1
    conn_code = (c.srank * num_ranks + c.drank) * channels + channel
    tb_of = np.empty(2 * c.count, dtype=np.int64)
    tb_of[recv_id] = _lookup(placement.recv_tb, num_ranks, channels, receiving=True)(conn_code)
    tb_of[send_id] = _lookup(placement.send_tb, num_ranks, channels, receiving=False)(conn_code)
    return conn_code, tb_of


class _Fused(NamedTuple):
    """Per instruction after fuse_forwarding and drop_dead_stores (by
    pre-fusion id; a fused send is not ``live``), and the local edges."""

    kind: np.ndarray                 # _SEND ... _RRS
    live: np.ndarray
    where_op: np.ndarray             # the operation whose source line a step shows
    sender: np.ndarray               # per message, the instruction that sends it
    edge_src: np.ndarray
    edge_dst: np.ndarray


def _fuse(c: OpColumns, edges: _Edges, tb_of, firsts, seconds, send_id, recv_id) -> _Fused:
    """fuse_forwarding, then drop_dead_stores: a pair fuses where one
    threadblock holds both."""
    n_ins = 2 * c.count
    allowed = tb_of[firsts] == tb_of[seconds]
    firsts, seconds = firsts[allowed], seconds[allowed]
    alias = np.arange(n_ins, dtype=np.int64)         # a fused send's id -> its receive's
    alias[seconds] = firsts
    live = np.ones(n_ins, dtype=bool)
    live[seconds] = False
    kind = np.empty(n_ins, dtype=np.int64)
    kind[send_id] = _SEND
    kind[recv_id] = np.where(c.reduce, _RRC, _RECV)
    kind[firsts] = np.where(kind[firsts] == _RRC, _RRCS, _RCS)
    where_op = np.arange(n_ins, dtype=np.int64) // 2  # the operation whose source line a step shows
    where_op[firsts] = seconds // 2
    sender = alias[send_id]                           # per message, after fusion
    # the local edges after fusion (repeats are harmless to what follows)
    edge_src = alias[np.concatenate([edges.dep_src, edges.war_src])]
    edge_dst = alias[np.concatenate([edges.dep_dst, edges.war_dst])]
    keep = edge_src != edge_dst
    edge_src, edge_dst = edge_src[keep], edge_dst[keep]

    # drop_dead_stores: an rrcs whose value nobody reads and that does not last
    has_reader = np.zeros(n_ins, dtype=bool)
    has_reader[edges.raw_src[alias[edges.raw_dst] != edges.raw_src]] = True
    in_scratch = np.repeat(c.dbuf, 2) == c.buffer_number("scratch")
    kind[(kind == _RRCS) & ~has_reader & (edges.overwritten | in_scratch)] = _RRS
    return _Fused(kind, live, where_op, sender, edge_src, edge_dst)


class _Edges(NamedTuple):
    """build_dag's local edges, by pre-fusion instruction id: ``dep`` a read
    or write after the chunk's last write (``raw`` the reads among them,
    ``raw_lanes`` the lanes each joins), ``war`` a plain read before the
    chunk's next write. Each edge once, sorted by (source, destination)."""

    dep_src: np.ndarray
    dep_dst: np.ndarray
    raw_src: np.ndarray
    raw_dst: np.ndarray
    raw_lanes: np.ndarray
    war_src: np.ndarray
    war_dst: np.ndarray
    overwritten: np.ndarray          # per instruction: every chunk it wrote is written again later


def _chunk_edges(c: OpColumns) -> _Edges:
    """Each operation makes two accesses per chunk: its send reads the
    source chunk; its receive writes the destination (and reads it first
    when it reduces). Sorted by chunk, then id, they give every edge at once."""
    m = 2 * c.count                   # instructions: send 2j, receive 2j+1
    single = bool((c.size == 1).all())
    stride = int(max((c.sidx + c.size).max(), (c.didx + c.size).max()))
    nb = len(c.names)
    first = np.empty(m, dtype=np.int64)   # each instruction's first chunk
    first[0::2] = (c.srank * nb + c.sbuf) * stride + c.sidx
    first[1::2] = (c.drank * nb + c.dbuf) * stride + c.didx
    if single:                        # access a is made by instruction a
        code = first
    else:                             # an instruction's accesses are its lanes, chunk after chunk
        ins, _, code = expand(first, np.repeat(c.size, 2))
        del first
    code *= m
    code += np.arange(m, dtype=np.int64) if single else ins
    if not single:
        del ins
    code.sort()                       # by chunk, then id: one sort of distinct ints
    key, ins = np.divmod(code, m)
    del code
    accesses = ins.size
    write = (ins & 1).astype(bool)
    reads = ~write
    reads[write] = c.reduce[ins[write] // 2]       # an rrc reads before it writes
    prev_write, next_write = writes_around(key, write)
    del key

    after = prev_write >= 0
    dep_src, dep_dst = ins[prev_write[after]], ins[after]
    raw = reads[after]
    war = ~write & (next_write < accesses)   # an rrc's next write is its own
    raw_src, raw_dst, war_src, war_dst = dep_src[raw], dep_dst[raw], ins[war], ins[next_write[war]]
    if single:                        # one access per instruction: every edge is there once, each a lane
        overwritten = np.zeros(m, dtype=bool)
        overwritten[ins[write & (next_write < accesses)]] = True
        return _Edges(dep_src, dep_dst, raw_src, raw_dst, np.ones(raw_src.size, dtype=np.int64), war_src, war_dst,
                      overwritten)
    overwritten = np.bincount(ins[write & (next_write < accesses)], minlength=m) == np.repeat(c.size, 2)
    del ins, write, reads, prev_write, next_write, after, raw, war
    dep_src, dep_dst, _ = _distinct(dep_src, dep_dst, m)
    raw_src, raw_dst, raw_lanes = _distinct(raw_src, raw_dst, m)
    war_src, war_dst, _ = _distinct(war_src, war_dst, m)
    return _Edges(dep_src, dep_dst, raw_src, raw_dst, raw_lanes, war_src, war_dst, overwritten)


def _distinct(src, dst, m: int):
    """The edges ``src -> dst`` once each, sorted, with how many times each was given."""
    pairs, times = np.unique(src * m + dst, return_counts=True)
    src, dst = np.divmod(pairs, m)
    return src, dst, times


def _spread(c: OpColumns, num_ranks: int):
    """spread_channels: each operation's channel, and the receiving and
    sending connections on them."""
    recv_conns, send_conns = _connections(c.srank, c.drank, c.channel, num_ranks)
    spread = spread_rule(recv_conns, send_conns, num_ranks)
    if spread is None:
        return c.channel, recv_conns, send_conns
    channel = spread(c.srank, c.drank, c.channel)
    return (channel, *_connections(c.srank, c.drank, channel, num_ranks))


def _forwarding_pairs(c: OpColumns, edges: _Edges):
    """forwarding_pairs: each receive (by id) with the first send whose only
    predecessor it is and that reads the very chunks it wrote: every lane of
    the send reads a chunk the receive wrote last, and the two have one
    size (a single-chunk send's one predecessor is the write it reads)."""
    src, dst = edges.raw_src, edges.raw_dst
    to_send = (dst & 1) == 0
    if not (c.size == 1).all():
        size = c.size[dst // 2]
        to_send &= (edges.raw_lanes == size) & (c.size[src // 2] == size)
    # the edges are sorted: a write's readers are contiguous, in id order, and the first is the smallest
    firsts, at = np.unique(src[to_send], return_index=True)
    return firsts, dst[to_send][at]


def _wanted(c: OpColumns, channel, firsts, seconds, num_ranks: int) -> Counter:
    """place_auto's count of fusable pairs per (rank, channel, receive peer, send peer)."""
    fj, sj = firsts // 2, seconds // 2                # their operations
    same = channel[fj] == channel[sj]
    wanted = Counter()
    if not np.any(same):
        return wanted
    ranks = np.int64(num_ranks)
    channels = np.int64(channel.max() + 1)
    code = ((c.drank[fj] * channels + channel[fj]) * ranks + c.srank[fj]) * ranks + c.drank[sj]
    found, times = np.unique(code[same], return_counts=True)
    rest, send_peer = np.divmod(found, ranks)
    rest, recv_peer = np.divmod(rest, ranks)
    rank, ch = np.divmod(rest, channels)
    wanted.update(dict(zip(zip(rank.tolist(), ch.tolist(), recv_peer.tolist(), send_peer.tolist()),
                           times.tolist())))
    return wanted


def _fits_int64(c: OpColumns, num_ranks: int) -> bool:
    """Whether the int codes below (chunk, connection, edge and order keys
    times an id) stay within int64."""
    ids = 4 * c.count + 4
    chunks = num_ranks * len(c.names) * int(max((c.sidx + c.size).max(), (c.didx + c.size).max()))
    channels = (int(c.channel.max()) + 1) * (num_ranks // 32 + 2)                # spread channels too
    connections = num_ranks * num_ranks * channels
    threadblocks = num_ranks * (2 * num_ranks * channels + 1)                    # (rank, threadblock) keys
    signatures = 6 * chunks * len(np.unique(c.size)) * max(len(c.lines), 1)      # _build_plan's step keys
    return max(chunks, connections, threadblocks, ids) * ids < 2 ** 62 and signatures < 2 ** 62


def _connections(srank, drank, channel, num_ranks: int):
    """Receiving and sending connections as sets of (rank, peer, channel)."""
    channels = int(channel.max()) + 1
    code = np.unique((srank * num_ranks + drank) * channels + channel)
    rest, ch = np.divmod(code, channels)
    src, dst = np.divmod(rest, num_ranks)
    triples = list(zip(src.tolist(), dst.tolist(), ch.tolist()))
    return {(d, s, c) for s, d, c in triples}, set(triples)


def _step(k: int, sl: Slice, deps: tuple, where) -> Step:
    """The step of kind ``k`` on chunks ``sl`` (as schedule.build_plan writes it)."""
    if k == _SEND:
        return Step(StepOp.SEND, (sl,), None, sl.count, deps, where)
    if k == _RECV or k == _RCS:
        return Step(_STEP_OPS[k], (), sl, sl.count, deps, where)
    if k == _RRS:
        return Step(StepOp.RRS, (sl,), None, sl.count, deps, where)
    return Step(_STEP_OPS[k], (sl,), sl, sl.count, deps, where)


def _lookup(table: dict, num_ranks: int, channels: int, receiving: bool):
    """A vectorized ``table[(rank, peer, channel)]`` by connection code
    (sender * n + receiver) * channels + channel."""
    codes, tbs = [], []
    for (r, peer, ch), tb in table.items():
        s, d = (peer, r) if receiving else (r, peer)
        codes.append((s * num_ranks + d) * channels + ch)
        tbs.append(tb)
    codes = np.asarray(codes, dtype=np.int64)
    tbs = np.asarray(tbs, dtype=np.int64)
    by_code = np.argsort(codes)
    codes, tbs = codes[by_code], tbs[by_code]

    def find(keys):
        return tbs[np.searchsorted(codes, keys)]

    return find


def _compact_scratch(c: OpColumns, scratch: list[int], num_ranks: int):
    """compact_scratch: source and destination chunk indices with the scratch
    chunks no step touches dropped and the rest renumbered in order, and
    scratch chunks per rank. Every chunk an operation names stays touched
    (a fused send's chunk is its receive's), so the used ones are those;
    an operation's chunks stay contiguous (all used), so its first moves."""
    s = c.buffer_number("scratch")
    if s < 0 or not any(scratch):
        return c.sidx, c.didx, list(scratch)
    width = max(scratch) + 1
    in_s, in_d = c.sbuf == s, c.dbuf == s
    s_code, d_code = c.srank[in_s] * width + c.sidx[in_s], c.drank[in_d] * width + c.didx[in_d]
    used = np.unique(np.concatenate([_spans(s_code, c.size[in_s]), _spans(d_code, c.size[in_d])]))
    first_of_rank = np.searchsorted(used, np.arange(num_ranks, dtype=np.int64) * width)
    sidx, didx = c.sidx.copy(), c.didx.copy()
    sidx[in_s] = np.searchsorted(used, s_code) - first_of_rank[c.srank[in_s]]
    didx[in_d] = np.searchsorted(used, d_code) - first_of_rank[c.drank[in_d]]
    return sidx, didx, np.diff(np.append(first_of_rank, used.size)).tolist()


def _spans(first, size):
    """Every chunk code of the runs ``first[i] .. first[i] + size[i] - 1``."""
    if not size.size or (size == 1).all():
        return first
    return expand(first, size)[2]


def _order(priority: str, n_ins: int, live, edge_src, edge_dst, sender, receiver, conn_code):
    """schedule.order's global order as live instruction ids, or None where
    its heap would hold a receive back behind an older message."""
    # Every edge runs from a lower id to a higher one (a merged send's edges
    # now start at its receive, which comes earlier), so id order, the trace
    # priority's, is topological as it stands.
    ids = np.flatnonzero(live)
    if priority == "depth":
        depth = levels(n_ins, np.concatenate([edge_src, sender]), np.concatenate([edge_dst, receiver]))
        if depth is None:
            return None              # a cycle: the pipeline's order reports it
        ids = np.sort(depth[ids] * n_ins + ids) % n_ins     # by (depth, id)
    position = np.empty(n_ins, dtype=np.int64)
    position[ids] = np.arange(ids.size, dtype=np.int64)
    # every connection must deliver in the order it sends (a sender sends one message)
    sent_at = position[sender]
    message_at = np.empty(n_ins, dtype=np.int64)
    message_at[sent_at] = np.arange(sent_at.size, dtype=np.int64)
    by_send = np.sort(conn_code * n_ins + sent_at)        # per connection, in send order
    conn, got = by_send // n_ins, position[receiver[message_at[by_send % n_ins]]]
    if np.any((conn[1:] == conn[:-1]) & (got[1:] < got[:-1])):
        return None
    return ids


def _build_plan(c: OpColumns, global_order, kind, rank, tb_of, where_op, sidx, didx, edge_src, edge_dst,
                placement, fields) -> Plan:
    n_ins = kind.size
    num_ranks = fields["num_ranks"]
    width = max((len(t) for t in placement.tbs), default=0) + 1
    group = rank[global_order] * width + tb_of[global_order]
    size = np.int64(group.size)
    by_tb = np.sort(group * size + np.arange(size)) % size     # each threadblock's steps, in global order
    sorted_group = group[by_tb]
    starts = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]])
    step_of = np.empty(n_ins, dtype=np.int64)
    run_start = np.repeat(starts, np.diff(np.append(starts, sorted_group.size)))
    step_of[global_order[by_tb]] = np.arange(sorted_group.size) - run_start
    # cross-threadblock dependencies: per step, the latest step it waits for in each other threadblock
    cross = tb_of[edge_src] != tb_of[edge_dst]
    deps: dict[int, tuple] = {}
    if np.any(cross):
        d_on, d_tb, d_step = edge_dst[cross], tb_of[edge_src[cross]], step_of[edge_src[cross]]
        o = np.lexsort((d_step, d_tb, d_on))
        d_on, d_tb, d_step = d_on[o], d_tb[o], d_step[o]
        last = np.r_[(d_on[1:] != d_on[:-1]) | (d_tb[1:] != d_tb[:-1]), True]
        for i, t, s in zip(d_on[last].tolist(), d_tb[last].tolist(), d_step[last].tolist()):
            deps[i] = deps.get(i, ()) + ((t, s),)

    # Steps that agree in kind, chunk, source line and dependencies are one
    # (immutable) Step object: a ring's steps repeat the same few across ranks.
    stride = int(max(sidx.max(), didx.max())) + 1
    is_send = kind == _SEND
    # a step's chunk: a send reads its operation's source, every receiving step its destination
    code = np.where(is_send, np.repeat(c.sbuf * stride + sidx, 2), np.repeat(c.dbuf * stride + didx, 2))
    lines = c.line_id[where_op]
    sizes, size_id = np.unique(c.size, return_inverse=True)      # (every step's count is its operation's size)
    signature = ((kind * (len(c.names) * stride) + code) * sizes.size + np.repeat(size_id, 2)) * len(c.lines) + lines
    ordered = global_order[by_tb]
    found, index = np.unique(signature[ordered], return_inverse=True)
    table = []
    sizes = sizes.tolist()
    for sig in found.tolist():
        rest, line = divmod(sig, len(c.lines))
        rest, size = divmod(rest, len(sizes))
        k, chunk = divmod(rest, len(c.names) * stride)
        table.append(_step(k, Slice(c.names[chunk // stride], chunk % stride, sizes[size]), (), c.lines[line]))
    cuts = np.append(starts, sorted_group.size).tolist()
    # (a threadblock's indices to Python ints at a time: millions at once were 80 MB at the peak)
    lists = {g: list(map(table.__getitem__, index[lo:hi].tolist()))
             for g, lo, hi in zip(sorted_group[starts].tolist(), cuts, cuts[1:])}
    del index
    # The steps that wait on other threadblocks, one object per distinct (step, dependencies) too:
    # the hierarchical allreduce's 271,360 such steps at 1024 ranks are 4,114 distinct lines, and the
    # plan writer and the plan verifier's reading do their work once per distinct object.
    waiting: dict = {}
    for i, dep in deps.items():
        steps = lists[int(rank[i]) * width + int(tb_of[i])]
        plain = steps[step_of[i]]
        key = (id(plain), dep)        # (plain lives in table for as long as waiting)
        step = waiting.get(key)
        if step is None:
            step = waiting[key] = _step(int(kind[i]), plain.dst or plain.srcs[0], dep, plain.where)
        steps[step_of[i]] = step
    ranks = []
    for r, tbs in enumerate(placement.tbs):
        built = tuple(Threadblock(tb.id, tb.send, tb.recv, tb.channel, tuple(lists.get(r * width + tb.id, ())))
                      for tb in tbs)
        ranks.append(RankPlan(r, fields["scratch"][r], built))
    return Plan(fields["name"], fields["collective"], num_ranks, fields["chunk_factor"], fields["inplace"],
                fields["input_chunks"], fields["output_chunks"], tuple(ranks), fields["root"], fields["protocol"],
                fields["instances"], fields["slots"], fields["tile"])
