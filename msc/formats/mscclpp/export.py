"""An msc plan as an MSCCL++ execution plan (JSON for microsoft/mscclpp's executor).

msc's two-sided connections become one-sided memory channels: each
connection (sender, receiver, channel) is a pair of memory channels (one on
each end, paired by their order between the two ranks, as the executor
pairs them) and a region of the receiver's scratch.

Simple: the region holds ``slots`` messages of the connection's largest
count. A send waits for a credit once its slot was used before, ``put``s
into the slot and signals; a receive waits for the signal, copies or reduces
out of the slot and signals a credit back; the sender waits for its last
credits at the end, so the next call cannot overwrite a slot the receiver of
this call still reads, and every semaphore is back where it began. (The
executor's ``pws`` signals on port channels only; on a memory channel it is
a plain put, so the signal is its own operation.) Fused steps use the fused
operations: rcs copies out of the slot and puts the slot onward, rrs and rrcs
are ``res`` (reduce, keep, and write to the peer), rrc is ``re``.

LL: packets (``ppkt`` sends, ``upkt`` receives, ``repkt``/``respkt`` reduce,
``rppkt`` forwards), one scratch slot per message: a packet carries its own
flag, so no signal or wait guards the data; the double scratch buffer keeps
consecutive calls apart. The call after next writes the same half again, and
a sender that hears nothing from its receiver (a broadcast's root) could run
two calls ahead and overwrite packets not yet read: so a receiving
threadblock signals first (its rank's previous call has ended) and the sender
waits for that before its kernel returns; a call's packets are then written
after the receiver ended the call before last. LL128 has no MSCCL++
counterpart and is refused.

Threadblocks keep msc's order and ids. The executor puts no __syncthreads
between operations, so a ``nop`` separates a wait from the data it guards and
data from the signal that publishes it. A dependency on another threadblock
is a device semaphore: released after the step, acquired before the
waiting one. A threadblock over the executor's 64 operations is spread over
several, each starting where the previous one released it (a semaphore).
msc_* fields (ignored by the executor) record what msc's reader needs to
give the plan back: the root, chunk factor, slots, each threadblock's msc
channel and original id.

Switch plans (NVLS; msc.ir.StepOp): every group declares one switch channel
per buffer its ops reach through the switch, the same list on every member
(each is one multicast object, created collectively). ``swrs`` is ``glres``
(multimem load-reduce into a multimem store, both through the switch),
``swst`` is ``gstore``. MSCCL++ has no reduce-load into the issuing rank
alone, so ``swred`` is a ``glres`` into a scratch region of every member that
only this threadblock uses (at one offset on every rank, after every rank's
own scratch), then a copy out of the rank's own copy. A group barrier is what
MSCCL++'s own NVLS plans do: a signal to every other member and a wait on
each, on memory channels kept for it, between nops.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from msc.errors import PlanError
from msc.ir.contract_text import contract_lines
from msc.formats.mscclpp.limits import MAX_DEVICE_SEMAPHORES, MAX_OPERANDS, MAX_OPERATION
from msc.formats.mscclpp.limits import MAX_CHANNEL_PER_OPERATION
from msc.ir import Plan, Slice, Step, StepOp
from msc.verification.plan_values import check_plan

LETTER = {"input": "i", "output": "o", "scratch": "s"}
UNBOUNDED = (1 << 64) - 1


@dataclass
class Connection:
    sender: int
    receiver: int
    channel: int
    counts: list = field(default_factory=list)    # chunks of each message, in order
    start: int = 0                                # its first scratch chunk on the receiver

    @property
    def key(self):
        return (self.sender, self.receiver, self.channel)

    @property
    def width(self) -> int:
        return max(self.counts, default=0)


def plan_to_mscclpp(plan: Plan, *, name: str | None = None) -> dict:
    """The MSCCL++ execution plan of ``plan`` as a JSON-ready dict, within the
    executor's limits (PlanError for what it cannot express: LL128)."""
    if plan.protocol not in ("Simple", "LL"):
        raise PlanError(f"protocol {plan.protocol}: the MSCCL++ executor runs Simple and LL (packets) only; compile "
                        f"the algorithm with --protocol Simple or LL to export it")
    check_plan(plan)
    conns = _connections(plan)
    layout = {rp.rank: _scratch_layout(plan, rp, conns) for rp in plan.ranks}
    switches = _Switches(plan, max(top for _, top in layout.values()))
    ranks = [_RankWriter(plan, rp, conns, layout, switches).build() for rp in plan.ranks]
    doc = {"name": name or plan.name, "collective": plan.collective, "protocol": plan.protocol,
           "inplace": plan.inplace, "reuse_resources": False, "use_double_scratch_buffer": plan.protocol == "LL",
           "buffer_alignment": 16, "num_threads_per_block": 1024, "min_message_size": 0,
           "max_message_size": UNBOUNDED, "gpus": ranks,
           "msc_chunk_factor": plan.chunk_factor, "msc_root": plan.root, "msc_slots": plan.slots}
    if plan.tile:
        doc["msc_tile"] = plan.tile
    if plan.instances != 1:
        doc["msc_instances"] = plan.instances
    if plan.contract is not None:
        doc["msc_contract"] = [line.strip() for line in contract_lines(plan.contract)[1:]]
    return doc


def plan_to_mscclpp_json(plan: Plan, *, name: str | None = None) -> str:
    return json.dumps(plan_to_mscclpp(plan, name=name), indent=1) + "\n"


def _connections(plan: Plan) -> dict:
    """Every connection with its messages' counts and its scratch region on the receiver."""
    conns: dict = {}
    for rp in plan.ranks:
        for tb in rp.threadblocks:
            if tb.send is not None:
                c = conns.setdefault((rp.rank, tb.send, tb.channel), Connection(rp.rank, tb.send, tb.channel))
                c.counts = [s.count for s in tb.steps if s.op.sends]
    return conns


def _scratch_layout(plan: Plan, rp, conns: dict) -> tuple[dict, int]:
    """A rank's scratch after the plan's own: LL's temps (rrs keeps its sum
    somewhere, one temp per threadblock), then each incoming connection's
    slots (LL: one per message). Sets each connection's start; returns the
    temps per threadblock and the scratch chunks in all."""
    ll = plan.protocol == "LL"
    temps, top = {}, rp.scratch
    for tb in rp.threadblocks:
        width = max((s.count for s in tb.steps if s.op is StepOp.RRS), default=0)
        if ll and width:
            temps[tb.id], top = top, top + width
    for c in sorted((c for c in conns.values() if c.receiver == rp.rank), key=lambda c: c.key):
        c.start = top
        top += c.width * (len(c.counts) if ll else min(plan.slots, len(c.counts)))
    return temps, top


@dataclass(frozen=True)
class BarrierLink:
    """The memory channel pair two members of a group use for its barriers
    (a switch threadblock's msc channel and group); no data goes over it."""

    sender: int           # the lower rank
    receiver: int
    channel: int
    group: tuple

    @property
    def key(self):
        return (self.sender, self.receiver, -1 - self.channel, self.group)


class _Switches:
    """The plan's switch channels ((group, buffer), the same list on every
    member) and the scratch region each swred threadblock reduces into, at
    one offset on every rank (``base``: above every rank's own scratch)."""

    def __init__(self, plan: Plan, base: int):
        used, self.temps, top = set(), {}, base
        for rp in plan.ranks:
            for tb in rp.threadblocks:
                for step in tb.steps:
                    if step.op.group_reads:
                        used.add((tb.group, step.srcs[0].buffer))
                    if step.op.group_writes:
                        used.add((tb.group, step.dst.buffer))
                    if step.op is StepOp.SWRED:
                        used.add((tb.group, "scratch"))
                width = max((st.count for st in tb.steps if st.op is StepOp.SWRED), default=0)
                if width:
                    self.temps[(rp.rank, tb.id)], top = top, top + width
        self.channels = sorted(used, key=lambda gb: (gb[0], list(LETTER).index(gb[1])))
        self.scratch = top if self.temps else 0

    def of(self, rank: int) -> list:
        """The switch channels ``rank`` declares, in the common order."""
        return [gb for gb in self.channels if rank in gb[0]]


def _barrier_links(plan: Plan, rank: int) -> list:
    links = set()
    for tb in plan.ranks[rank].threadblocks:
        if any(step.op is StepOp.BARRIER for step in tb.steps):
            links |= {BarrierLink(min(rank, m), max(rank, m), tb.channel, tb.group) for m in tb.group if m != rank}
    return sorted(links, key=lambda link: link.key)


def _peer_order(conns: dict, rank: int, links: list = ()) -> list:
    """The connections (and barrier links) of ``rank`` in the order its memory
    channels are declared: by peer, then key, the same order on both ends."""
    mine = [c for c in conns.values() if rank in (c.sender, c.receiver)] + list(links)
    return sorted(mine, key=lambda c: (c.receiver if c.sender == rank else c.sender, c.key))


class _RankWriter:
    """One gpu entry: channels, scratch layout, remote buffers, semaphores, threadblocks."""

    def __init__(self, plan: Plan, rp, conns: dict, conns_layout: dict, switches: _Switches):
        self.plan, self.rp, self.conns, self.r = plan, rp, conns, rp.rank
        self.ll = plan.protocol == "LL"
        self.switches = switches
        self.switch_channel = {gb: i for i, gb in enumerate(switches.of(self.r))}
        self.links = _barrier_links(plan, self.r)
        order = _peer_order(conns, self.r, self.links)
        self.channel = {c.key: i for i, c in enumerate(order)}
        self.peers = [c.receiver if c.sender == self.r else c.sender for c in order]
        self.remote = sorted({c.receiver for c in conns.values() if c.sender == self.r})
        self.semaphores = 0
        self.edges = self._edges()
        self.temps, self.scratch = conns_layout[rp.rank]

    def new_semaphore(self) -> int:
        self.semaphores += 1
        return self.semaphores - 1

    def _edges(self) -> dict:
        """(tb, step) -> ([semaphores it acquires], [semaphores it releases])."""
        edges: dict = {}
        for tb in self.rp.threadblocks:
            for s, step in enumerate(tb.steps):
                for dt, ds in step.deps:
                    if dt == tb.id:
                        continue                 # program order
                    sem = self.new_semaphore()
                    edges.setdefault((tb.id, s), ([], []))[0].append(sem)
                    edges.setdefault((dt, ds), ([], []))[1].append(sem)
        return edges

    def build(self) -> dict:
        entries = _spread(self, [(tb, _BlockWriter(self, tb).ops()) for tb in self.rp.threadblocks])
        doc = {"id": self.r, "input_chunks": self.plan.input_chunks, "output_chunks": self.plan.output_chunks,
               "scratch_chunks": max(self.scratch, self.switches.scratch), "msc_scratch": self.rp.scratch,
               "channels": [{"channel_type": "memory", "connected_to": [p]} for p in self.peers] + [
                   {"channel_type": "switch", "buffer_type": LETTER[buf],
                    "rank_groups": [{"size": len(group), "ranks": list(group)}]} for group, buf in self.switch_channel],
               "remote_buffers": [{"rank": p, "type": "s", "access_channel_types": ["memory"]} for p in self.remote],
               "semaphores": [{"init_value": 0} for _ in range(self.semaphores)], "threadblocks": entries}
        if self.links:
            doc["msc_barrier_channels"] = sorted(self.channel[link.key] for link in self.links)
        return doc


class _BlockWriter:
    """One msc threadblock's operations, grouped per step (a group is never split)."""

    def __init__(self, rank: _RankWriter, tb):
        self.w, self.tb, self.r = rank, tb, rank.r
        self.send = rank.conns.get((self.r, tb.send, tb.channel)) if tb.send is not None else None
        self.recv = rank.conns.get((tb.recv, self.r, tb.channel)) if tb.recv is not None else None
        self.sent = self.received = 0

    def ops(self) -> list[list[dict]]:
        groups = [self.step(s, step) for s, step in enumerate(self.tb.steps)]
        if self.send is not None and not self.w.ll:      # the last credits: the receiver is done with every slot
            drain = len(self.send.counts) - max(0, len(self.send.counts) - self.w.plan.slots)
            groups.append([self.sync("wait", [self.send]) for _ in range(drain)])
        if self.w.ll:            # the receiver has begun this call, so it is done with the last one ...
            if self.recv is not None:
                groups.insert(0, [self.sync("signal", [self.recv])])
            if self.send is not None:
                groups.append([self.sync("wait", [self.send])])     # ... before the sender's kernel returns
        return [g for g in groups if g]

    def sync(self, name: str, conns: list) -> dict:
        return {"name": name, "channel_ids": [self.w.channel[c.key] for c in conns], "channel_type": "memory"}

    def step(self, s: int, step: Step) -> list[dict]:
        acquire, release = self.w.edges.get((self.tb.id, s), ([], []))
        before, after = [], []
        for i in range(0, len(acquire), MAX_DEVICE_SEMAPHORES):
            before.append({"name": "sem_acquire", "semaphore_ids": acquire[i:i + MAX_DEVICE_SEMAPHORES]})
        waits, signals = [], []
        if step.op.receives and not self.w.ll:
            waits.append(self.recv)
            signals.append(self.recv)                   # the credit back
        if step.op.sends and not self.w.ll:
            if self.sent >= self.w.plan.slots:
                waits.append(self.send)                 # the credit for this slot
            signals.append(self.send)
        if waits:
            before.append(self.sync("wait", waits))
        if before:
            before.append({"name": "nop"})
        body = self.data(step, s)
        if signals:
            after.append(self.sync("signal", signals))
        for i in range(0, len(release), MAX_DEVICE_SEMAPHORES):
            after.append({"name": "sem_release", "semaphore_ids": release[i:i + MAX_DEVICE_SEMAPHORES]})
        if after and (before + body)[-1:] != [{"name": "nop"}]:
            after.insert(0, {"name": "nop"})      # publish the step's data (and, for a nop step, the ones before)
        self.sent += step.op.sends
        self.received += step.op.receives
        return before + body + after

    # -- operands --------------------------------------------------------------------------------
    def local(self, sl: Slice) -> dict:
        return {"type": LETTER[sl.buffer], "index": sl.index, "size": sl.count}

    def slot(self, conn: Connection, m: int) -> int:
        return conn.start + conn.width * (m if self.w.ll else m % self.w.plan.slots)

    def slot_in(self, count: int) -> dict:
        return {"type": "s", "index": self.slot(self.recv, self.received), "size": count}

    def slot_out(self, count: int) -> dict:
        return {"buffer_id": 0, "index": self.slot(self.send, self.sent), "size": count}

    def data(self, step: Step, s: int) -> list[dict]:
        op, n = step.op, step.count
        src = self.local(step.srcs[0]) if step.srcs else None
        dst = self.local(step.dst) if step.dst is not None else None
        if op is StepOp.NOP:
            return []
        if op.switch:
            return self.switch_step(step)
        if op is StepOp.COPY:
            return [_op("copy", [src], [dst])]
        if op is StepOp.REDUCE:
            return _reduce(step, self.local)
        ll = self.w.ll
        if op is StepOp.SEND:
            return [self.put("ppkt" if ll else "put", [src], [self.slot_out(n)])]
        if op is StepOp.RECV:
            return [_op("upkt" if ll else "copy", [self.slot_in(n)], [dst])]
        if op is StepOp.RCS:
            return [_op("upkt" if ll else "copy", [self.slot_in(n)], [dst]),
                    self.put("rppkt" if ll else "put", [self.slot_in(n)], [self.slot_out(n)])]
        if op is StepOp.RRC:
            return [_op("repkt" if ll else "re", [src, self.slot_in(n)], [dst])]
        keep = dst if op is StepOp.RRCS else (
            {"type": "s", "index": self.w.temps[self.tb.id], "size": n} if ll else self.slot_in(n))
        return [self.put("respkt" if ll else "res", [src, self.slot_in(n)], [keep, self.slot_out(n)])]

    def through_switch(self, sl: Slice) -> dict:
        return {"switch_channel_id": self.w.switch_channel[(self.tb.group, sl.buffer)], "index": sl.index,
                "size": sl.count}

    def switch_step(self, step: Step) -> list[dict]:
        """glres, gstore, or for swred a glres into this threadblock's scratch
        region on every member and a copy out of the rank's own; a barrier as
        a signal to every other member and a wait on each."""
        op = step.op
        if op is StepOp.BARRIER:
            links = [self.w.channel[link.key] for link in self.w.links
                     if link.channel == self.tb.channel and link.group == self.tb.group]
            sync = lambda name: [{"name": name, "channel_ids": links[i:i + MAX_CHANNEL_PER_OPERATION],
                                  "channel_type": "memory"} for i in range(0, len(links), MAX_CHANNEL_PER_OPERATION)]
            return [{"name": "nop"}] + sync("signal") + sync("wait") + [{"name": "nop"}]
        # A nop first: the threads of a multimem op split the bytes unlike the data ops before it.
        if op is StepOp.SWST:
            return [{"name": "nop"}, _switch_op("gstore", self.local(step.srcs[0]), self.through_switch(step.dst))]
        if op is StepOp.SWRS:
            return [{"name": "nop"}, _switch_op("glres", self.through_switch(step.srcs[0]),
                                                self.through_switch(step.dst))]
        temp = Slice("scratch", self.w.switches.temps[(self.r, self.tb.id)], step.count)
        return [{"name": "nop"}, _switch_op("glres", self.through_switch(step.srcs[0]), self.through_switch(temp)),
                {"name": "nop"}, _op("copy", [self.local(temp)], [self.local(step.dst)])]

    def put(self, name: str, srcs: list, dsts: list) -> dict:
        out = _op(name, srcs, dsts)
        out.update({"channel_ids": [self.w.channel[self.send.key]], "channel_type": "memory"})
        if name in ("res", "respkt"):
            out["reduce_op"] = "sum"
        return out


def _op(name: str, srcs: list, dsts: list) -> dict:
    out = {"name": name, "src_buff": srcs, "dst_buff": dsts}
    if name in ("re", "repkt"):
        out["reduce_op"] = "sum"
    return out


def _switch_op(name: str, src: dict, dst: dict) -> dict:
    out = {"name": name, "src_buff": [src], "dst_buff": [dst], "channel_type": "switch"}
    if name == "glres":
        out["reduce_op"] = "sum"
    return out


def _reduce(step: Step, local) -> list[dict]:
    """reduce S1..Sm -> D as ``re`` operations of at most MAX_OPERANDS sources,
    D first where it is a source (later ones then add to it)."""
    srcs = sorted(step.srcs, key=lambda sl: sl != step.dst)
    out, dst = [], local(step.dst)
    first, rest = srcs[:MAX_OPERANDS], srcs[MAX_OPERANDS:]
    out.append(_op("re", [local(s) for s in first], [dst]))
    while rest:
        more, rest = rest[:MAX_OPERANDS - 1], rest[MAX_OPERANDS - 1:]
        out.append(_op("re", [dst] + [local(s) for s in more], [dst]))
    return out


def _spread(w: _RankWriter, tbs: list) -> list[dict]:
    """Threadblock entries; one over MAX_OPERATION operations continues in
    new threadblocks (ids after msc's), each acquiring what the previous
    part releases at its end."""
    entries, extra = [], []
    budget = MAX_OPERATION - 3                       # room for the hand-over: nop, sem_release / sem_acquire, nop
    for tb, groups in tbs:
        parts, current = [], []
        for g in groups:
            if len(g) > budget:
                raise PlanError(f"a step needs {len(g)} MSCCL++ operations, over the executor's limit "
                                f"MAX_OPERATION = {MAX_OPERATION}", rank=w.r, tb=tb.id)
            if current and len(current) + len(g) > budget:
                parts.append(current)
                current = []
            current = current + g
        parts.append(current)
        for i in range(len(parts) - 1):
            sem = w.new_semaphore()
            parts[i] = parts[i] + [{"name": "nop"}, {"name": "sem_release", "semaphore_ids": [sem]}]
            parts[i + 1] = [{"name": "sem_acquire", "semaphore_ids": [sem]}, {"name": "nop"}] + parts[i + 1]
        meta = {"msc_tb": tb.id, "msc_channel": tb.channel}
        entries.append((parts[0], tb, meta))
        extra += [(p, tb, {**meta, "msc_part": i + 1}) for i, p in enumerate(parts[1:])]
    out = []
    for t, (ops, tb, meta) in enumerate(entries + extra):
        out.append(_entry(w, t, ops, tb, meta))
    return out


def _entry(w: _RankWriter, t: int, ops: list, tb, meta: dict) -> dict:
    """A threadblock entry: its channels and remote buffers, and its operations
    with channel and buffer ids local to it."""
    used = sorted({c for op in ops for c in op.get("channel_ids", [])})
    local = {c: i for i, c in enumerate(used)}
    switched = sorted({b["switch_channel_id"] for op in ops for b in op.get("src_buff", []) + op.get("dst_buff", [])
                       if "switch_channel_id" in b})
    local_switch = {c: i for i, c in enumerate(switched)}
    buffers = [w.remote.index(tb.send)] if tb.send is not None else []
    for op in ops:
        if "channel_ids" in op:
            op["channel_ids"] = [local[c] for c in op["channel_ids"]]
        for b in op.get("src_buff", []) + op.get("dst_buff", []):
            if "switch_channel_id" in b:
                b["switch_channel_id"] = local_switch[b["switch_channel_id"]]
    channels = [{"channel_type": "memory", "channel_ids": used}] if used else []
    if switched:
        channels.append({"channel_type": "switch", "channel_ids": switched})
    if tb.group:
        meta = {**meta, "msc_group": list(tb.group)}
    entry = {"id": t, "ops": ops, "channels": channels,
             "remote_buffer_refs": ([{"access_channel_type": "memory", "remote_buffer_ids": buffers}]
                                    if buffers else [])}
    entry.update(meta)
    return entry
