"""``msc simulate`` of an MSCCL++ execution plan as it is: a cost model of
the one-sided model (msc.ir.onesided), for plans of any shape ``msc verify``
takes (memory channels).

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

Other channels (the reader refuses them today) fit the same loop: a port
channel's put is a transfer that starts after the host proxy's latency (the
topology's ``proxy``) and its flush a wait for the transfers before it; a
switch channel's operations cost what msc's simulator charges switch steps
(the view's ``nvls_*``: the port load at the switch's rate plus its latency).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from msc.errors import DeadlockError, UsageError
from msc.ir.onesided import PACKET_OPS, OneSidedPlan, Operand
from msc.sim.events import maxmin
from msc.sim.topology import Topology
from msc.verification.onesided_run import UNIT, Layout, _program, _slice, packet_sources, scratch_of

MODEL = "onesided"
REDUCES = ("re", "res", "rre", "rres", "repkt", "respkt", "recpkt", "recspkt")
PACKET_WRITES = {"ppkt": None, "rppkt": None, "cpkt": None, "respkt": 1, "recpkt": 1, "recspkt": 1}
_READY, _COMPUTED, _FLOW = 0, 1, 2


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


class _Flow:
    __slots__ = ("tb", "rem", "res", "cap", "rate", "last", "ver")

    def __init__(self, tb, rem, res, cap, now):
        self.tb, self.rem, self.res, self.cap, self.last = tb, rem, res, cap, now
        self.rate, self.ver = 0.0, 0


class _Block:
    __slots__ = ("rank", "tb", "program", "pc", "transfers", "packet_writes")

    def __init__(self, rank, tb, program):
        self.rank, self.tb, self.program, self.pc = rank, tb, program, 0
        self.transfers, self.packet_writes = [], []


class OneSidedSimulator:
    """A one-sided plan bound to a topology: ``run(sizes)`` gives a
    OneSidedResult per size, ``records(sizes)`` nccl-tests records."""

    def __init__(self, plan: OneSidedPlan, topology: Topology, *, collective=None, dtype: str = "float"):
        from msc.units import parse_dtype

        if topology.num_ranks != plan.num_ranks:
            raise UsageError(f"topology {topology.name!r} has {topology.num_ranks} ranks, plan {plan.name!r} "
                             f"{plan.num_ranks}")
        self.plan, self.topology = plan, topology
        self.view = topology.view(plan.protocol)           # link capacities, launch, signal overhead
        self.views = {"Simple": topology.view("Simple"), "LL": topology.view("LL")}
        self.layout = Layout(plan, collective)
        self.type_name, dt = parse_dtype(dtype)
        self.itemsize = dt.itemsize
        gpu = plan.gpus[0]
        self.big = max(gpu.input_chunks, gpu.output_chunks, 1)
        self._routes: dict = {}
        self._capacity: dict = {}        # shared link name -> bytes/s in the plan's protocol's view

    def route(self, protocol: str, src: int, dst: int):
        """(latency s, private rate cap B/s, shared link names) from ``src`` to ``dst`` under ``protocol``."""
        key = (protocol, src, dst)
        if key not in self._routes:
            view = self.views[protocol]
            r = view.route(src, dst)
            names = tuple(view.resource_names[i] for i in r.resources)
            for i in self.view.route(src, dst).resources:  # the same links, as the plan's protocol rates them
                self._capacity[self.view.resource_names[i]] = self.view.capacity[i]
            self._routes[key] = (r.alpha, min(r.bandwidth, view.threadblock_bandwidth), names)
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
        from msc.units import BUSBW_FACTOR

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
    blocking operations and the transfers on shared links."""

    def __init__(self, sim: OneSidedSimulator, chunk: int):
        self.sim, self.plan, self.chunk = sim, sim.plan, chunk
        self.blocks = [_Block(gpu.rank, t, _program(ops, chunk, gpu))
                       for gpu in self.plan.gpus for t, ops in enumerate(gpu.threadblocks)]
        self.heap, self.seq, self.now, self.end = [], 0, 0.0, 0.0
        self.signals: dict = {}      # (from, to, q) -> times the flags were posted
        self.waits: dict = {}        # (from, to, q) -> waits passed
        self.sems = {(g.rank, s): v for g in self.plan.gpus for s, v in enumerate(g.semaphores)}
        self.arrived: dict = {}      # (rank, barrier id) -> blocks arrived this round
        self.released: set = set()   # blocks a completed barrier lets through
        self.packets: dict = {}      # rank -> [(lo, hi, time the packets are readable)] in its scratch
        self.parked: dict = {}       # what a block waits for -> blocks
        self.members: dict = {}      # shared link -> its flows
        self.dirty: set = set()

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
            name = inst.op.name
            if name in ("wait", "rlxwait"):
                ready = self.wait_ready(b, inst.op)
            elif name == "sem_acquire":
                ready = self.acquire(b, inst.op)
            elif name == "barrier":
                ready = self.barrier(b, inst.op)
            elif name in ("signal", "rlxsignal"):
                ready = self.signal(b, inst.op)
            elif name == "sem_release":
                ready = self.release(b, inst.op)
            elif name == "nop":
                ready = self.now
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

    def wait_key(self, rank: int, channel: int) -> tuple[int, int, int]:
        peer, q = self.plan.channel_ordinal(rank, channel)
        return (peer, rank, q)

    def wait_ready(self, b: _Block, op):
        """When the wait passes: its k-th signal on each channel (the k-th wait takes the paired channel's
        k-th signal) plus the route's latency; None (parked) while one is not posted."""
        keys = [self.wait_key(b.rank, c) for c in op.channels]
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

    def signal(self, b: _Block, op):
        """The flags are posted after the protocol's per-message overhead (the fence before them)."""
        posted = self.now + self.sim.view.step_overhead
        for c in op.channels:
            peer, q = self.plan.channel_ordinal(b.rank, c)
            self.signals.setdefault((b.rank, peer, q), []).append(posted)
            self.wake(("signal", (b.rank, peer, q)))
        return posted

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

    # -- data and packet operations ------------------------------------------------------
    def start_data(self, b: _Block, inst) -> None:
        """Once the packets it reads are readable: compute, then its transfers one after another."""
        ready = self.packets_ready(b, inst)
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
        reads_packets = packet_sources(op)                 # from the rank's own scratch, whatever they say
        remote = [(s, False) for s in op.srcs if s.remote and s.rank != b.rank and s not in reads_packets]
        remote += [(d, True) for d in op.dsts if d.remote and d.rank != b.rank]
        if op.name in REDUCES:
            compute = sim.topology.gamma * size * max(len(op.srcs) - 1, 0)
        else:
            compute = 0.0 if remote else sim.topology.delta * size
        b.transfers = []
        for operand, outgoing in remote:
            lo, hi = byte_range(operand, inst, chunk)
            if hi > lo:
                src, dst = (b.rank, operand.rank) if outgoing else (operand.rank, b.rank)
                b.transfers.append((hi - lo, sim.route(protocol, src, dst)))
        b.packet_writes = self.packet_writes(b, inst, protocol)
        self.push(self.now + compute, _COMPUTED, b)

    def next_transfer(self, b: _Block) -> None:
        if not b.transfers:
            self.data_done(b)
            return
        nbytes, (_, cap, res) = b.transfers.pop(0)
        f = _Flow(b, float(nbytes), res, cap, self.now)
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
        self.next_transfer(f.tb)

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
        flows, seen, stack = set(), set(self.dirty), list(self.dirty)
        self.dirty.clear()
        while stack:
            for f in self.members.get(stack.pop(), ()):
                if f not in flows:
                    flows.add(f)
                    for r in f.res:
                        if r not in seen:
                            seen.add(r)
                            stack.append(r)
        if not flows:
            return
        now = self.now
        for f in flows:
            f.rem = max(f.rem - f.rate * (now - f.last), 0.0)
            f.last = now
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

    def packets_ready(self, b: _Block, inst):
        """When every packet ``inst`` reads from its rank's scratch is readable (now if it reads none), None
        while some are not written yet."""
        ready = self.now
        for operand in packet_sources(inst.op):
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
