"""``msc simulate`` of an MSCCL++ execution plan as it is: a cost model of
the one-sided model (msc.ir.onesided), for plans of any shape ``msc verify``
takes (memory, port and switch channels).

Each threadblock runs its operations in order (a pipeline's body once per
slice, as msc.verification.onesided_run expands it). Times come from the
topology's protocol views (msc.sim.topology), the same numbers msc's own
simulator (msc.sim.simulate) reads:

- a remote operand (put's destinations, get's and remote reduces' sources,
  res's peer copies, packet writes to a peer) moves its bytes over the route
  between the two ranks at the threadblock's rate or the route's, shared
  links divided max-min fairly between the transfers on them (msc.sim.events'
  rule); one threadblock's transfers go one after another;
- a reduction costs gamma per byte per source past the first, a copy with no
  remote operand delta per byte (the machine's reduce and copy rates, per
  threadblock, as in msc's simulator);
- a signal costs the protocol's per-message overhead (its fence before the
  flag: msc's ``step_us``); the k-th wait on a channel completes when the
  paired channel's k-th signal has happened plus the route's latency (the
  pairing of msc.verification.onesided_run: OneSidedPlan.channel_ordinal);
- a device-semaphore acquire completes when a release has happened, a
  barrier when its last threadblock arrives, a nop at once;
- packet operations (LL) take the LL view's latency and rates; a packet read
  completes when every packet it reads was written, plus the writer's route
  latency (packets carry their flags: no signal).

Link capacities are the plan's protocol's view's; the launch latency of that
protocol is added once per size. Sizes: whole 16-byte units per chunk of the
largest buffer, as ``msc run X.json`` reads them.

Switch channels (NVLS): a ``glres``, ``gstore`` or ``gstorepkt`` takes its
time in the issuing threadblock, as msc's simulator prices a switch step
(msc.sim.simulate.Simulator._switch_costs): its bytes times the load it puts
on a member's NVLink port per byte (``switch_port_load``: today's rule of
msc.sim.sim_plan._switch_steps, kept in one function so a direction-aware rule
can replace it) at the view's ``nvls_bandwidth``, or the threadblock's rate if
slower, plus ``nvls_alpha``. Packets a ``gstorepkt`` writes are readable on
every member when it ends. Topologies without NVLS and groups across switch
domains are refused as msc's simulator refuses them.

Port channels: a port ``put``/``pws``/``pwsf``/``ppkt``/``rppkt`` (one
trigger per destination) or ``signal`` (one per channel) costs the
threadblock the protocol's per-message overhead once, as a memory signal's
fence, to push its triggers; the host proxy of that threadblock
and channel (msc.verification.onesided_run's agents) takes its triggers in
issue order, each ``proxy_us`` after it was pushed and not before the one
before it is done, and moves the bytes over the route at the route's rate
(a copy engine or NIC, not a threadblock; shared links max-min fair with
everything else). A port signal (or ``pws``'s) is posted when the transfers
before it are done; ``flush`` (on as many channels as it has destinations,
as the executor's handleFlush) and ``pwsf`` block the threadblock until the
proxies are idle. ``PROXY_US`` is a guess (see there).

Every operation name the reader knows is priced (``PRICING`` says how) or,
in a form the model has no price for, refused naming rank, threadblock and
operation: none is free by omission.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from msc.errors import DeadlockError, PlanError, UsageError
from msc.ir.onesided import (CONTROL_OPS, DATA_OPS, PACKET_OPS, PIPELINE, PORT_ONLY_OPS, SWITCH_OPS, OneSidedPlan,
                             Operand)
from msc.sim.events import _Flow, linked_flows, maxmin, settle     # _Flow.t: its owner (a block or a proxy)
from msc.sim.topology import Topology
from msc.verification.onesided_run import UNIT, Layout, _program, _slice, packet_sources, scratch_of

MODEL = "onesided"
REDUCES = ("re", "res", "rre", "rres", "repkt", "respkt", "recpkt", "recspkt")
PACKET_WRITES = {"ppkt": None, "rppkt": None, "cpkt": None, "respkt": 1, "recpkt": 1, "recspkt": 1}
_READY, _COMPUTED, _FLOW, _PROXY = 0, 1, 2, 3

# The host proxy's time from a pushed trigger to the transfer (or signal) it posts. A GUESS, not measured and
# not from MSCCL++: no figure for it was found in MSCCL++'s docs or paper (arXiv 2504.09014). It is the
# order of NCCL's own host proxy post overhead msc's H100 model uses (msc.sim.machines proxy_us, 1 us, after
# NCCL's tuning.cc netOverhead): a host thread polling the FIFO in pinned memory, then posting a copy or an
# RDMA write. OneSidedSimulator(proxy_us=...) replaces it.
PROXY_US = 1.0
PORT_PUTS = ("put", "pws", "pwsf", "ppkt", "rppkt")          # the executor's port-channel data forms
PORT_SYNC = ("signal", "rlxsignal", "wait", "rlxwait", "flush")

# How the model prices each operation name the reader knows (msc.ir.onesided.KNOWN_OPS); a port-channel form
# not in PORT_PUTS + PORT_SYNC is refused by name (check_priced). tests/test_mscclpp_sim.py walks KNOWN_OPS.
PRICING = {
    **{name: "the protocol's per-message overhead; its wait passes at the signal plus the route's latency"
       for name in ("signal", "rlxsignal")},
    **{name: "blocks until the paired channel's k-th signal plus the route's latency" for name in ("wait", "rlxwait")},
    "nop": "free (a __syncthreads)",
    "barrier": "blocks until its threadblocks arrive",
    "sem_acquire": "blocks until a release", "sem_release": "free, wakes an acquire",
    **{name: "its remote bytes over the route, one transfer after another (port: through the proxy)"
       for name in ("put", "pws", "pwsf", "get")},
    "copy": "the copy rate per byte",
    **{name: "gamma per byte per extra source, remote sources over the route" for name in ("re", "res", "rre", "rres")},
    **{name: "LL's rates and latencies; packet reads wait for their writes" for name in PACKET_OPS},
    **{name: "the port load per byte at the switch's rate plus its latency (switch_port_load)" for name in SWITCH_OPS},
    "flush": "blocks until the proxies of its channels are idle",
    PIPELINE: "its body once per slice",
}


def switch_port_load(name: str, members: int, sharing: int) -> float:
    """Bytes a switch op puts on a member's NVLink port per byte it moves,
    by today's rule (msc.sim.sim_plan._switch_steps): a reduce-load reads
    the chunk from all n members and a store writes it to all n, n + 1 for
    both (glres), times the rank's threadblocks of the group that share the
    port; packets (gstorepkt) carry a flag per data word, twice the bytes.
    One function so a direction-aware port model can replace the rule."""
    load = members + (1 if name == "glres" else 0)
    return load * sharing * (2 if name == "gstorepkt" else 1)


@dataclass(frozen=True)
class OneSidedResult:
    size: int          # bytes, nccl-tests' size (whole 16-byte units per chunk)
    count: int         # elements per data unit
    chunk: int         # bytes per chunk
    seconds: float


def byte_range(operand: Operand, inst, chunk: int) -> tuple[int, int]:
    """The bytes of ``operand``'s buffer one operation instance touches: its
    threadblock group's share, then its pipeline slice (Machine.where's
    arithmetic, without the in-place alias, which moves no byte count)."""
    lo, hi = _slice(operand.index * chunk, operand.size * chunk, inst.op.group)
    lo = min(lo + inst.offset, hi)
    return lo, min(hi, lo + inst.unit)


def has_switch_ops(plan: OneSidedPlan) -> bool:
    return any(op.name in SWITCH_OPS for _, _, _, op in _operations(plan))


def _operations(plan: OneSidedPlan):
    """(rank, threadblock, operation index, operation) of every operation, a pipeline's body included."""
    for gpu in plan.gpus:
        for t, ops in enumerate(gpu.threadblocks):
            for i, op in enumerate(ops):
                yield gpu.rank, t, i, op
                for inner in op.body:
                    yield gpu.rank, t, i, inner


def check_priced(plan: OneSidedPlan) -> None:
    """PlanError naming rank, threadblock and operation for the first one the model has no price for."""
    for rank, t, i, op in _operations(plan):
        if op.name not in PRICING:
            what = f"{op.name!r:.40}, an operation it has no price for"
        elif op.port and op.channels and op.name not in PORT_PUTS + PORT_SYNC:
            what = f"{op.name} on a port channel (the executor's port forms: {', '.join(PORT_PUTS + PORT_SYNC)})"
        else:
            continue
        raise PlanError(f"operation {i}: the one-sided cost model refuses {what}", rank=rank, tb=t)


class _Block:
    __slots__ = ("rank", "tb", "program", "pc", "transfers", "packet_writes", "issued", "issue_end")

    def __init__(self, rank, tb, program):
        self.rank, self.tb, self.program, self.pc = rank, tb, program, 0
        self.transfers, self.packet_writes = [], []
        self.issued, self.issue_end = -1, 0.0       # the pc whose port triggers are pushed, and when they were


class _Proxy:
    """A threadblock's port channel's host proxy: its jobs in issue order.
    A job: (when it may start, [(bytes, route)], signal keys, packet writes)."""
    __slots__ = ("key", "jobs", "busy", "transfers", "job")

    def __init__(self, key):
        self.key, self.jobs, self.busy, self.transfers, self.job = key, [], False, [], None


class OneSidedSimulator:
    """A one-sided plan bound to a topology: ``run(sizes)`` gives a
    OneSidedResult per size, ``records(sizes)`` nccl-tests records.
    ``proxy_us``: the port channels' host proxy latency (PROXY_US)."""

    def __init__(self, plan: OneSidedPlan, topology: Topology, *, collective=None, dtype: str = "float",
                 proxy_us: float = PROXY_US):
        from msc.units import parse_dtype

        if topology.num_ranks != plan.num_ranks:
            raise UsageError(f"topology {topology.name!r} has {topology.num_ranks} ranks, plan {plan.name!r} "
                             f"{plan.num_ranks}")
        check_priced(plan)
        self.plan, self.topology = plan, topology
        self.view = topology.view(plan.protocol)           # link capacities, launch, signal overhead
        self.views = {"Simple": topology.view("Simple"), "LL": topology.view("LL")}
        self.proxy = proxy_us * 1e-6
        self.layout = Layout(plan, collective)
        self.type_name, dt = parse_dtype(dtype)
        self.itemsize = dt.itemsize
        gpu = plan.gpus[0]
        self.big = max(gpu.input_chunks, gpu.output_chunks, 1)
        self._routes: dict = {}
        self._capacity: dict = {}        # shared link name -> bytes/s in the plan's protocol's view
        self.sharing = self._switch_sharing()

    def _switch_sharing(self) -> dict:
        """(rank, group) -> the rank's threadblocks with switch ops on that group (they share its port);
        UsageError where the topology has no NVLS or a group spans switch domains (msc's simulator's refusals)."""
        users: dict = {}
        for rank, t, i, op in _operations(self.plan):
            if op.name not in SWITCH_OPS:
                continue
            group = (op.srcs[:1] + op.dsts[:1])[-1].group
            if not self.view.nvls_bandwidth:
                raise UsageError(f"plan {self.plan.name!r} reduces and stores through the switch (NVLS), and "
                                 f"topology {self.view.name!r} has no switch that does (presets with NVLS: "
                                 f"dgx-h100, dgx-h200, hgx-h20, hgx-b200[:NODES], gb200-nvl72, nvswitch, ib)")
            if not self.view.same_switch(group):
                raise UsageError(f"plan {self.plan.name!r}: rank {rank} threadblock {t} operation {i} ({op.name})'s "
                                 f"switch group {','.join(map(str, group))} spans more than one NVSwitch domain of "
                                 f"{self.view.name!r}")
            users.setdefault((rank, group), set()).add(t)
        return {k: len(v) for k, v in users.items()}

    def switch_seconds(self, rank: int, op, nbytes: int) -> float:
        """A switch op's time in its threadblock (msc.sim.simulate.Simulator._switch_costs' price)."""
        view = self.view
        group = op.dsts[0].group
        load = switch_port_load(op.name, len(group), self.sharing[(rank, group)])
        return nbytes * max(load / view.nvls_bandwidth, 1.0 / view.threadblock_bandwidth) + view.nvls_alpha

    def route(self, protocol: str, src: int, dst: int, by_proxy: bool = False):
        """(latency s, private rate cap B/s, shared link names) from ``src`` to ``dst`` under ``protocol``;
        ``by_proxy``: moved by a port channel's proxy (the route's rate, no threadblock's cap)."""
        key = (protocol, src, dst, by_proxy)
        if key not in self._routes:
            view = self.views[protocol]
            r = view.route(src, dst)
            names = tuple(view.resource_names[i] for i in r.resources)
            for i in self.view.route(src, dst).resources:  # the same links, as the plan's protocol rates them
                self._capacity[self.view.resource_names[i]] = self.view.capacity[i]
            cap = r.bandwidth if by_proxy else min(r.bandwidth, view.threadblock_bandwidth)
            self._routes[key] = (r.alpha, cap, names)
        return self._routes[key]

    def capacity(self, name: str) -> float:
        return self._capacity[name]

    def chunk_geometry(self, size: int) -> tuple[int, int, int]:
        """(rounded size, count, chunk bytes) for a requested size, as msc run X.json reads it."""
        chunk = size // self.big // UNIT * UNIT
        k = self.layout.k or 1
        return chunk * self.big, k * chunk // self.itemsize, chunk

    def seconds(self, chunk: int) -> float:
        """The simulated time of one call at ``chunk`` bytes a chunk (launch included), 0 if nothing moves."""
        if chunk <= 0:
            return 0.0
        return _Replay(self, chunk).run() + self.view.launch

    def run(self, requested: list[int]) -> list[OneSidedResult]:
        out = []
        for size in requested:
            rounded, count, chunk = self.chunk_geometry(size)
            out.append(OneSidedResult(rounded, count, chunk, self.seconds(chunk)))
        return out

    def records(self, requested: list[int]) -> list[dict]:
        """msc.sim.simulate.Simulator.records' fields, with ``model``: "onesided"."""
        from msc.dsl.collectives import REDUCING
        from msc.dsl.collectives import BUSBW_FACTOR

        plan, coll = self.plan, self.layout.collective
        name = coll.name if coll is not None else plan.collective
        factor = BUSBW_FACTOR.get(name, lambda n: 1.0)(plan.num_ranks) if coll is not None and self.layout.builtin else 1.0
        root = self.layout.root if coll is not None and coll.has_root else -1
        out = []
        for req, r in zip(requested, self.run(requested)):
            us = r.seconds * 1e6
            algbw = r.size / us / 1e3 if us > 0 else 0.0
            out.append({"plan": plan.name, "size": r.size, "count": r.count, "type": self.type_name,
                        "redop": "sum" if name in REDUCING else "none", "root": root, "time": us,
                        "algbw": algbw, "busbw": algbw * factor, "inplace": plan.inplace, "requested_size": req,
                        "rounded": r.size != req, "iterations": 1 if r.chunk else 0, "engine": MODEL,
                        "contended": False, "topology": self.topology.name, "model": MODEL})
        return out


class _Replay:
    """One call at one chunk size: an event loop over threadblocks, their
    blocking operations, the port channels' proxies and the transfers on
    shared links."""

    def __init__(self, sim: OneSidedSimulator, chunk: int):
        self.sim, self.plan, self.chunk = sim, sim.plan, chunk
        self.blocks = [_Block(gpu.rank, t, _program(ops, chunk, gpu))
                       for gpu in self.plan.gpus for t, ops in enumerate(gpu.threadblocks)]
        self.heap, self.seq, self.now, self.end = [], 0, 0.0, 0.0
        self.signals: dict = {}      # (from, to, q, kind) -> times the flags were posted
        self.waits: dict = {}        # (from, to, q, kind) -> waits passed
        self.sems = {(g.rank, s): v for g in self.plan.gpus for s, v in enumerate(g.semaphores)}
        self.arrived: dict = {}      # (rank, barrier id) -> blocks arrived this round
        self.released: set = set()   # blocks a completed barrier lets through
        self.packets: dict = {}      # rank -> [(lo, hi, time the packets are readable)] in its scratch
        self.parked: dict = {}       # what a block waits for -> blocks
        self.members: dict = {}      # shared link -> its flows
        self.dirty: set = set()
        self.proxies: dict = {}      # (rank, threadblock, port channel) -> _Proxy

    def push(self, at, kind, data):
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, data))

    def run(self) -> float:
        for b in self.blocks:
            self.push(0.0, _READY, b)
        while self.heap or self.dirty:
            if self.dirty and (not self.heap or self.heap[0][0] > self.now):
                self.rebalance()
                continue
            self.now, _, kind, data = heapq.heappop(self.heap)
            if kind == _READY:
                self.advance(data)
            elif kind == _COMPUTED:
                self.next_transfer(data)
            elif kind == _PROXY:
                self.proxy_start(data)
            else:
                f, ver = data
                if ver == f.ver:
                    self.flow_done(f)
        self.raise_if_stuck()
        return self.end

    # -- a threadblock's operations ------------------------------------------------------
    def advance(self, b: _Block) -> None:
        """Run ``b``'s operations from now until one takes time, blocks or transfers."""
        while b.pc < len(b.program):
            inst = b.program[b.pc]
            op = inst.op
            name = op.name
            if name in ("wait", "rlxwait"):
                ready = self.wait_ready(b, op)
            elif name == "sem_acquire":
                ready = self.acquire(b, op)
            elif name == "barrier":
                ready = self.barrier(b, op)
            elif name in ("signal", "rlxsignal"):
                ready = self.signal(b, op)
            elif name == "sem_release":
                ready = self.release(b, op)
            elif name == "nop":
                ready = self.now
            elif name == "flush":
                ready = self.drained(b, op.channels[:len(op.dsts)])     # handleFlush: op.nOutputs channels
            elif op.port and op.name in PORT_PUTS:
                ready = self.port_put(b, inst)
            else:
                self.start_data(b, inst)
                return
            if ready is None:                   # parked: tried again when what it waits for happens
                return
            b.pc += 1                           # done; the threadblock goes on at ``ready``
            self.end = max(self.end, ready)
            if ready > self.now:
                self.push(ready, _READY, b)
                return

    def park(self, key, b: _Block) -> None:
        self.parked.setdefault(key, []).append(b)

    def wake(self, key) -> None:
        for b in self.parked.pop(key, ()):
            self.push(self.now, _READY, b)

    def channel_key(self, rank: int, channel: int, port: bool, outgoing: bool) -> tuple:
        """The signal pairing key (from, to, q, kind) of ``rank``'s channel: a signal's, or a wait's."""
        peer, q = self.plan.channel_ordinal(rank, channel, port)
        kind = "port" if port else "memory"
        return (rank, peer, q, kind) if outgoing else (peer, rank, q, kind)

    def wait_ready(self, b: _Block, op):
        """When the wait passes: its k-th signal on each channel (the k-th wait takes the paired channel's
        k-th signal) plus the route's latency; None (parked) while one is not posted."""
        keys = [self.channel_key(b.rank, c, op.port, False) for c in op.channels]
        ready = self.now
        for k in keys:
            posted = self.signals.get(k, ())
            if len(posted) <= self.waits.get(k, 0):
                self.park(("signal", k), b)
                return None
            ready = max(ready, posted[self.waits.get(k, 0)] + self.sim.route(self.plan.protocol, k[0], k[1])[0])
        for k in keys:
            self.waits[k] = self.waits.get(k, 0) + 1
        return ready

    def post(self, key, at: float) -> None:
        self.signals.setdefault(key, []).append(at)
        self.wake(("signal", key))

    def signal(self, b: _Block, op):
        """Memory channels: the flags are posted after the protocol's per-message overhead (the fence before
        them). Port channels: a trigger a channel, pushed at that overhead; each proxy posts its flag in turn."""
        overhead = self.sim.view.step_overhead
        if not op.port:
            for c in op.channels:
                self.post(self.channel_key(b.rank, c, False, True), self.now + overhead)
            return self.now + overhead
        for c in op.channels:
            self.enqueue(b, c, self.now + overhead, [], [self.channel_key(b.rank, c, True, True)], [])
        return self.now + overhead

    def acquire(self, b: _Block, op):
        keys = [(b.rank, s) for s in op.semaphores]
        for k in keys:
            if self.sems.get(k, 0) <= 0:
                self.park(("sem", k), b)
                return None
        for k in keys:
            self.sems[k] -= 1
        return self.now

    def release(self, b: _Block, op):
        for s in op.semaphores:
            k = (b.rank, s)
            self.sems[k] = self.sems.get(k, 0) + 1
            self.wake(("sem", k))
        return self.now

    def barrier(self, b: _Block, op):
        if b in self.released:
            self.released.discard(b)
            return self.now
        key = (b.rank, op.barrier[0])
        arrived = self.arrived.setdefault(key, [])
        arrived.append(b)
        if len(arrived) < op.barrier[1]:
            return None
        self.arrived[key] = []
        for x in arrived:
            if x is not b:
                self.released.add(x)
                self.push(self.now, _READY, x)
        return self.now

    # -- port channels: the proxies ----------------------------------------------------------
    def port_put(self, b: _Block, inst):
        """Push a trigger per destination once the packets it reads are readable (the protocol's per-message
        overhead for them all, as a signal's fence); the proxy moves the bytes later. pwsf then waits for the
        proxies (a flush)."""
        op, sim = inst.op, self.sim
        channels = op.channels[:len(op.dsts)]
        if b.issued != b.pc:
            # packets in the rank's scratch: a port ppkt copies its sources' raw packets, rppkt reads its first
            sources = {"ppkt": op.srcs, "rppkt": op.srcs[:1]}.get(op.name, ())
            ready = self.packets_ready(b, inst, sources)
            if ready is None:
                self.park(("packets", b.rank), b)
                return None
            if ready > self.now:
                self.push(ready, _READY, b)
                return None
            packets = op.name in ("ppkt", "rppkt")
            protocol = "LL" if packets else "Simple"
            overhead = sim.view.step_overhead
            for d, c in zip(op.dsts, channels):
                lo, hi = byte_range(d, inst, self.chunk)
                moves = [(hi - lo, sim.route(protocol, b.rank, d.rank, by_proxy=True))] if hi > lo else []
                signals = [self.channel_key(b.rank, c, True, True)] if op.name in ("pws", "pwsf") else []
                writes = [(d.rank, lo, hi)] if packets else []
                self.enqueue(b, c, self.now + overhead, moves, signals, writes)
            b.issued, b.issue_end = b.pc, self.now + overhead
            if op.name != "pwsf":
                return b.issue_end
        return self.drained(b, channels)

    def drained(self, b: _Block, channels):
        """When the proxies of ``channels`` have done every job ``b`` pushed (None, parked, while one works)."""
        for c in channels:
            proxy = self.proxies.get((b.rank, b.tb, c))
            if proxy is not None and (proxy.busy or proxy.jobs):
                self.park(("proxy", proxy.key), b)
                return None
        return max(self.now, b.issue_end if b.issued == b.pc else self.now)

    def enqueue(self, b: _Block, channel: int, pushed: float, moves, signals, writes) -> None:
        key = (b.rank, b.tb, channel)
        proxy = self.proxies.setdefault(key, _Proxy(key))
        proxy.jobs.append((pushed + self.sim.proxy, moves, signals, writes))
        if not proxy.busy:
            proxy.busy = True
            self.push(max(self.now, proxy.jobs[0][0]), _PROXY, proxy)

    def proxy_start(self, proxy: _Proxy) -> None:
        proxy.job = proxy.jobs.pop(0)
        proxy.transfers = list(proxy.job[1])
        self.next_transfer(proxy)

    def proxy_done(self, proxy: _Proxy) -> None:
        """The job's bytes are there: post its signals and packets, start the next job or go idle."""
        _, _, signals, writes = proxy.job
        for key in signals:
            self.post(key, self.now)
        for rank, lo, hi in writes:
            latency = self.sim.route("LL", proxy.key[0], rank)[0]
            self.packets.setdefault(rank, []).append((lo, hi, self.now + latency))
            self.wake(("packets", rank))
        self.end = max(self.end, self.now)
        if proxy.jobs:
            self.push(max(self.now, proxy.jobs[0][0]), _PROXY, proxy)
            return
        proxy.busy = False
        self.wake(("proxy", proxy.key))

    # -- data and packet operations ------------------------------------------------------
    def start_data(self, b: _Block, inst) -> None:
        """Once the packets it reads are readable: compute, then its transfers one after another."""
        ready = self.packets_ready(b, inst, packet_sources(inst.op))
        if ready is None:
            self.park(("packets", b.rank), b)
            return
        if ready > self.now:
            self.push(ready, _READY, b)
            return
        op, chunk, sim = inst.op, self.chunk, self.sim
        protocol = "LL" if op.name in PACKET_OPS else "Simple"
        nbytes = [hi - lo for lo, hi in (byte_range(d, inst, chunk) for d in op.dsts[:1] or op.srcs[:1])]
        size = nbytes[0] if nbytes else 0
        b.transfers = []
        if op.name in SWITCH_OPS:                         # the switch moves it: no transfer of the threadblock's
            b.packet_writes = [(m, *byte_range(op.dsts[0], inst, chunk), 0.0) for m in op.dsts[0].group
                               ] if op.name == "gstorepkt" else []
            self.push(self.now + sim.switch_seconds(b.rank, op, size), _COMPUTED, b)
            return
        reads_packets = packet_sources(op)                 # from the rank's own scratch, whatever they say
        remote = [(s, False) for s in op.srcs if s.remote and s.rank != b.rank and s not in reads_packets]
        remote += [(d, True) for d in op.dsts if d.remote and d.rank != b.rank]
        if op.name in REDUCES:
            compute = sim.topology.gamma * size * max(len(op.srcs) - 1, 0)
        else:
            compute = 0.0 if remote else sim.topology.delta * size
        for operand, outgoing in remote:
            lo, hi = byte_range(operand, inst, chunk)
            if hi > lo:
                src, dst = (b.rank, operand.rank) if outgoing else (operand.rank, b.rank)
                b.transfers.append((hi - lo, sim.route(protocol, src, dst)))
        b.packet_writes = self.packet_writes(b, inst, protocol)
        self.push(self.now + compute, _COMPUTED, b)

    def next_transfer(self, owner) -> None:
        """Start the next transfer of a threadblock or a proxy job, or finish it."""
        if not owner.transfers:
            if isinstance(owner, _Proxy):
                self.proxy_done(owner)
            else:
                self.data_done(owner)
            return
        nbytes, (_, cap, res) = owner.transfers.pop(0)
        f = _Flow(owner, float(nbytes), res, cap, self.now)
        if not res:
            f.rate = cap
            self.push(self.now + f.rem / cap, _FLOW, (f, 0))
            return
        for r in res:
            self.members.setdefault(r, set()).add(f)
        self.dirty.update(res)

    def flow_done(self, f: _Flow) -> None:
        f.ver += 1
        for r in f.res:
            self.members[r].discard(f)
        self.dirty.update(f.res)
        self.next_transfer(f.t)

    def data_done(self, b: _Block) -> None:
        rank = None
        for rank, lo, hi, latency in b.packet_writes:
            self.packets.setdefault(rank, []).append((lo, hi, self.now + latency))
            self.wake(("packets", rank))
        b.pc += 1
        self.end = max(self.end, self.now)
        self.advance(b)

    def rebalance(self) -> None:
        """Max-min fair rates for the flows on the changed links and, transitively, those they share links with."""
        flows, seen = linked_flows(self.members, self.dirty)
        self.dirty.clear()
        if not flows:
            return
        now = self.now
        settle(flows, now)
        capacity = {r: self.sim.capacity(r) for r in seen}
        for f, rate in maxmin(flows, capacity, self.members).items():
            if rate != f.rate:
                f.rate = rate
                f.ver += 1
                self.push(now + f.rem / rate, _FLOW, (f, f.ver))

    # -- packets ---------------------------------------------------------------------------
    def packet_writes(self, b: _Block, inst, protocol: str) -> list:
        """(rank, lo, hi, latency) of the packets ``inst`` writes into a scratch (its own or a peer's)."""
        op = inst.op
        if op.name not in PACKET_WRITES:
            return []
        out = []
        for d in op.dsts[PACKET_WRITES[op.name] or 0:]:
            if op.name in ("recpkt", "recspkt") and d is op.dsts[0]:
                continue
            lo, hi = byte_range(d, inst, self.chunk)
            latency = self.sim.route(protocol, b.rank, d.rank)[0] if d.rank != b.rank else 0.0
            out.append((d.rank, lo, hi, latency))
        return out

    def packets_ready(self, b: _Block, inst, sources):
        """When every packet of ``sources`` ``inst`` reads from its rank's scratch is readable (now if none),
        None while some are not written yet."""
        ready = self.now
        for operand in sources:
            lo, hi = byte_range(scratch_of(operand, b.rank), inst, self.chunk)
            if hi <= lo:
                continue
            writes = sorted(w for w in self.packets.get(b.rank, ()) if w[0] < hi and w[1] > lo)
            covered = lo
            for wlo, whi, at in writes:
                if wlo > covered:
                    break
                covered = max(covered, whi)
                ready = max(ready, at)
            if covered < hi:
                return None
        return ready

    def raise_if_stuck(self) -> None:
        stuck = [b for b in self.blocks if b.pc < len(b.program)]
        if stuck:
            b = stuck[0]
            inst = b.program[b.pc]
            raise DeadlockError(f"the one-sided cost model cannot finish the plan at {self.chunk}-byte chunks: "
                                f"{len(stuck)} threadblock(s) never finish, the first rank {b.rank} threadblock "
                                f"{b.tb} at {inst.label}", [(b.rank, b.tb, inst.index, "never finishes")])
