"""Threadblock and channel assignment.

A connection is (sender rank, receiver rank, channel). The rule, as in
MSCCL: a threadblock has at most one send peer and one receive peer, on one
channel, and each end of a connection belongs to exactly one threadblock, so
the messages of a connection are sent and received in one program order.

Auto policy: where a rank has more than 32 peers on a channel (the MSCCL
runtimes' limit), connections first spread over more channels
(``spread_channels``). Then on every rank, pair a receiving connection with a sending one
where fused forwarding steps (rcs, rrcs) want them together, the most
wanted pairs first; every other connection gets a threadblock of its own.
Local steps go where their input is produced (or to the least loaded
threadblock). Manual policy: the DSL's ``sendtb``/``recvtb`` hints decide,
and hints that give one threadblock two peers or two channels are an error.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from msc.lower.dag import Dag, Instr
from msc.errors import LoweringError


@dataclass(frozen=True)
class Tb:
    rank: int
    id: int
    send: int | None
    recv: int | None
    channel: int


@dataclass(frozen=True)
class Placement:
    tbs: tuple[tuple[Tb, ...], ...]             # per rank
    recv_tb: dict                                # (rank, peer, channel) -> tb id
    send_tb: dict
    hinted: dict = None                          # manual: (rank, sendtb/recvtb hint) -> tb id

    def allows(self, first: Instr, second: Instr) -> bool:
        """Whether a receive and a send may fuse into one step."""
        r = self.recv_tb.get((first.rank, first.recv_peer, first.channel))
        return r is not None and r == self.send_tb.get((second.rank, second.send_peer, second.channel))


def _connections(dag: Dag):
    recv_conns, send_conns = set(), set()
    for ins in dag.live():
        if ins.msg_in is not None:
            recv_conns.add((ins.rank, ins.recv_peer, ins.channel))
        if ins.msg_out is not None:
            send_conns.add((ins.rank, ins.send_peer, ins.channel))
    return recv_conns, send_conns


# The MSCCL runtimes take at most 32 sending and 32 receiving threadblocks per
# channel (MSCCL_MAX_NUM_THREAD_BLOCKS_PER_CHANNEL); auto placement keeps to it.
MAX_PEERS_PER_CHANNEL = 32


def spread_channels(dag: Dag, num_ranks: int, limit: int = MAX_PEERS_PER_CHANNEL) -> Dag:
    """Move connections to more channels where a rank would send to, or
    receive from, more than ``limit`` peers on one channel (an all-pairs
    schedule beyond 33 ranks). Connection s -> r of channel c goes to channel
    c + g * C (C: channels in use) with group g = (d - 1) // limit of its
    distance d = (r - s) mod n: a rank's peers all lie at different
    distances, as sender and as receiver, so no group holds more than
    ``limit`` of them. Both ends of a message move together. Runs before
    any fusion, while every instruction has at most one message."""
    recv_conns, send_conns = _connections(dag)
    channel = spread_rule(recv_conns, send_conns, num_ranks, limit)
    if channel is None:
        return dag
    dag = dag.copy()
    for ins in dag.live():
        if ins.msg_out is not None:
            moved = channel(ins.rank, ins.send_peer, ins.channel)
        elif ins.msg_in is not None:
            moved = channel(ins.recv_peer, ins.rank, ins.channel)
        else:
            continue
        if moved != ins.channel:
            dag.instrs[ins.id] = ins._replace(channel=moved)
    return dag


def spread_rule(recv_conns, send_conns, num_ranks: int, limit: int = MAX_PEERS_PER_CHANNEL):
    """spread_channels' new channel as a function ``channel(src, dst, ch)`` of
    a connection, or None when no rank has more than ``limit`` peers on a
    channel. Connections are (rank, peer, channel) triples."""
    busiest = max((Counter((rank, ch) for rank, _, ch in conns).most_common(1) or [(None, 0)])[0][1]
                  for conns in (recv_conns, send_conns))
    if busiest <= limit:
        return None
    channels = 1 + max(ch for _, _, ch in recv_conns | send_conns)

    def channel(src, dst, ch):
        return ch + (((dst - src) % num_ranks - 1) // limit) * channels

    return channel


def spread_flows(dag: Dag, pairs, ways: int) -> Dag:
    """Split every channel into ``ways`` channels by flow, as MSCCLang's
    channel assignment does. A flow is a chain of messages that ranks
    forward (joined by the receive-then-send ``pairs`` of
    fusion.forwarding_pairs); in trace order, each flow moves whole to the
    sub-channel whose links it uses carry the fewest messages so far (ties:
    the lowest). Flows that shared a connection then share it less, so
    fewer messages queue behind one another: fewer slots per connection and
    fewer steps per threadblock, for more threadblocks. Sub-channel j of
    channel c is channel c * ways + j; both ends of a message move together.
    Runs before forwarding fusion (one message per instruction)."""
    instrs, messages = dag.instrs, dag.messages
    parent = list(range(len(messages)))

    def root(m):
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    for first, second, _ in pairs:
        if first.channel == second.channel and first.msg_in is not None and second.msg_out is not None:
            a, b = root(first.msg_in), root(second.msg_out)
            if a != b:
                parent[max(a, b)] = min(a, b)
    flows: dict[int, list[int]] = {}
    for m in range(len(messages)):
        flows.setdefault(root(m), []).append(m)
    load: Counter = Counter()                  # (sender, receiver, channel, sub-channel) -> messages
    moved = dag.copy()
    for _, members in sorted(flows.items()):
        links = Counter()
        for m in members:
            sender = instrs[messages[m][0]]
            links[(sender.rank, sender.send_peer, sender.channel)] += 1
        j = min(range(ways), key=lambda j: (max(load[link + (j,)] for link in links), j))
        for link, count in links.items():
            load[link + (j,)] += count
        for m in members:
            for i in messages[m]:
                ins = moved.instrs[i]
                moved.instrs[i] = ins._replace(channel=ins.channel * ways + j)
    for ins in dag.live():                     # local steps keep sub-channel 0 of theirs
        if ins.msg_in is None and ins.msg_out is None:
            moved.instrs[ins.id] = ins._replace(channel=ins.channel * ways)
    return moved


def place_auto(dag: Dag, pairs, num_ranks: int) -> Placement:
    recv_conns, send_conns = _connections(dag)
    wanted = Counter()
    for first, second, _ in pairs:
        if first.channel == second.channel:
            wanted[(first.rank, first.channel, first.recv_peer, second.send_peer)] += 1
    return place_connections(recv_conns, send_conns, wanted, num_ranks)


def place_connections(recv_conns, send_conns, wanted: Counter, num_ranks: int) -> Placement:
    """The auto policy on connections: ``wanted`` counts the fusable
    (rank, channel, receive peer, send peer) pairs."""
    tbs = [[] for _ in range(num_ranks)]
    recv_tb, send_tb = {}, {}

    def new_tb(rank, send, recv, channel):
        tb = Tb(rank, len(tbs[rank]), send, recv, channel)
        tbs[rank].append(tb)
        if recv is not None:
            recv_tb[(rank, recv, channel)] = tb.id
        if send is not None:
            send_tb[(rank, send, channel)] = tb.id

    for (rank, ch, rp, sp), _ in sorted(wanted.items(), key=lambda kv: (-kv[1], kv[0])):
        if (rank, rp, ch) not in recv_tb and (rank, sp, ch) not in send_tb:
            new_tb(rank, sp, rp, ch)
    for rank, peer, ch in sorted(recv_conns):
        if (rank, peer, ch) not in recv_tb:
            new_tb(rank, None, peer, ch)
    for rank, peer, ch in sorted(send_conns):
        if (rank, peer, ch) not in send_tb:
            new_tb(rank, peer, None, ch)
    return Placement(tuple(tuple(t) for t in tbs), recv_tb, send_tb)


def place_manual(dag: Dag, num_ranks: int) -> Placement:
    """Threadblocks from the hints; dense ids in the order the hints name them."""
    found: dict[tuple[int, int], dict] = {}
    for ins in dag.live():
        for side, tb, peer in (("recv", ins.recvtb, ins.recv_peer if ins.msg_in is not None else None),
                               ("send", ins.sendtb, ins.send_peer if ins.msg_out is not None else None)):
            if peer is None:
                continue
            if tb is None:
                raise LoweringError(f"manual threadblock policy: rank {ins.rank} {side}s "
                                    f"{'from' if side == 'recv' else 'to'} rank {peer} without a "
                                    f"{side}tb= hint", ins.where)
            spec = found.setdefault((ins.rank, tb), {"send": None, "recv": None, "channel": None, "where": {}})
            for key, value in ((side, peer), ("channel", ins.channel)):
                if spec[key] is not None and spec[key] != value:
                    raise LoweringError(
                        f"manual threadblock policy: rank {ins.rank} threadblock {tb} would have two "
                        f"{'channels' if key == 'channel' else side + ' peers'} ({spec[key]} from "
                        f"{spec['where'].get(key)}, {value} here); a threadblock has one send peer, one "
                        f"receive peer and one channel", ins.where)
                spec[key] = value
                spec["where"].setdefault(key, ins.where)
    tbs = [[] for _ in range(num_ranks)]
    recv_tb, send_tb, hinted = {}, {}, {}
    for (rank, hint) in sorted(found):
        spec = found[(rank, hint)]
        tb = Tb(rank, len(tbs[rank]), spec["send"], spec["recv"], spec["channel"])
        tbs[rank].append(tb)
        hinted[(rank, hint)] = tb.id
        for side, table in (("recv", recv_tb), ("send", send_tb)):
            if spec[side] is not None:
                key = (rank, spec[side], spec["channel"])
                if key in table:
                    raise LoweringError(f"manual threadblock policy: rank {rank} {side}s "
                                        f"{'from' if side == 'recv' else 'to'} rank {spec[side]} on channel "
                                        f"{spec['channel']} in two threadblocks; a connection belongs to one",
                                        spec["where"].get(side))
                table[key] = tb.id
    return Placement(tuple(tuple(t) for t in tbs), recv_tb, send_tb, hinted)


def assign(dag: Dag, placement: Placement, num_ranks: int) -> tuple[list, Placement]:
    """Threadblock of every instruction, by id (None where fusion removed
    one). Local steps join the threadblock that produces their input, else
    the least loaded one (a new one on a rank that has none)."""
    tb_of: list = [None] * len(dag.instrs)     # by id: a dict keyed by millions of ints is far larger
    tbs = [list(t) for t in placement.tbs]
    load = [Counter() for _ in range(num_ranks)]
    local = []
    for ins in dag.live():
        if ins.msg_in is not None:
            tb_of[ins.id] = placement.recv_tb[(ins.rank, ins.recv_peer, ins.channel)]
        elif ins.msg_out is not None:
            tb_of[ins.id] = placement.send_tb[(ins.rank, ins.send_peer, ins.channel)]
        else:
            local.append(ins)
            continue
        load[ins.rank][tb_of[ins.id]] += 1
    for ins in local:
        hint = ins.sendtb if ins.sendtb is not None else ins.recvtb
        producers = sorted(p for p in dag.preds[ins.id] if tb_of[p] is not None)
        if producers:
            tb = tb_of[producers[-1]]
        elif tbs[ins.rank]:
            tb = min(range(len(tbs[ins.rank])), key=lambda t: (load[ins.rank][t], t))
        else:
            tbs[ins.rank].append(Tb(ins.rank, 0, None, None, ins.channel))
            tb = 0
        if placement.hinted and (ins.rank, hint) in placement.hinted:
            tb = placement.hinted[(ins.rank, hint)]
        tb_of[ins.id] = tb
        load[ins.rank][tb] += 1
    return tb_of, Placement(tuple(tuple(t) for t in tbs), placement.recv_tb, placement.send_tb, placement.hinted)
