"""``msc simulate``: how long a plan takes on a topology, per message size,
from the cost model (msc.sim.topology) rather than a run.

The model, per step of a threadblock and tile iteration: wait for the
threadblock's previous step, the step's dependencies, its message and (if
it sends) a free slot on its connection; compute (gamma per reduced byte,
the copy rate per locally copied byte); transmit at the route's rate (a
threadblock's rate, unshared links, shared links split max-min fairly); the
message arrives one route latency (alpha) later, and a consumed slot is
back at the sender one latency after the receiving step ends. The
protocol's view of the topology (msc.sim.topology.Topology.view) gives the
latencies and rates, and its launch latency is added once per size. A
switch op (NVLS) pays the switch's latency and transmits as a flow over its
group's NVLink ports, each direction loaded with what the op moves through
it (Simulator._switch_flows), shared with the transfers on those ports. Chunks are taken as
q = ceil(count / k) elements each; a chunk streams in ceil(q bytes / tile)
iterations, as the runtime loops over tiles.

Two engines compute it: msc.sim.fast (max-plus, numpy, all sizes at once) and,
for the sizes where concurrent transfers (or switch ops) did share a link,
msc.sim.events (event-driven, max-min fair sharing). Both give the same times whenever no
link is shared by overlapping transfers (tests/test_simulate.py).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import numpy as np

from msc.dsl.collectives import REDUCING, get_collective
from msc.errors import MscError, UsageError
from msc.ir import Plan
from msc.verification.plan import plan_collective
from msc.ir.limits import MAX_TILES
from msc.lower.runtimes import runtime_slots
from msc.progress import steps
from msc.dsl.collectives import BUSBW_FACTOR
from msc.units import parse_dtype
from msc.sim.events import EventSim, StepColumns
from msc.sim.fast import JUMP_MIN, evaluate, layers, prepare
from msc.sim.symmetry import Folded, fold
from msc.sim.sim_plan import SWITCH_READS, SWITCH_WRITES, SimPlan, compile_plan
from msc.sim.topology import Topology

ENGINES = ("auto", "fast", "events")
# Floats of kept times (iterations x steps x sizes) per fast evaluation: bounds memory near 200 MB.
FAST_BUDGET = 24_000_000
PROBE = 4                # the first prefix of a size's iterations checked for contention (then x2)


@dataclass(frozen=True)
class SimResult:
    size: int               # bytes, nccl-tests' size (rounded down to whole elements per unit)
    count: int              # elements per data unit (the NCCL count)
    seconds: float
    iterations: int         # tile iterations
    engine: str             # "fast" or "events"
    contended: bool         # whether overlapping transfers shared a link


class Simulator:
    """A plan bound to a topology: ``run(sizes)`` gives a SimResult per size.

    ``tile``: bytes per chunk and iteration (default: the plan's, else the
    protocol's); ``slots``: messages in flight per connection (default: what
    msc's own runtime gives the plan, max(plan.slots, 8): plan.slots is only
    the fewest it was verified with; pass plan.slots for a plan that will run
    where connections hold just that, e.g. MSCCL XML); ``step_us``: what a
    message costs its threadblocks per tile iteration (default: the
    protocol's, Protocol.step_us); ``shares``: per connection (SimPlan's
    order), the share of a threadblock's rate its sender has (default 1: a
    threadblock per connection; less where a plan's threadblocks stand for
    parts of one, as NCCL's tree splits a channel's threads between its
    reduction up and its broadcast down); ``network_step``: where a plan's
    messages are pieces of larger network messages (NCCL's steps, whose
    proxy posts a step once it is whole), the bytes of one: a piece across
    nodes pays its share of the route's per-message time (Route.message)
    and arrives when its whole step would have. The plan's
    arrays and layers are built once and reused."""

    def __init__(self, plan: Plan | SimPlan, topology: Topology, *, tile: int | None = None,
                 slots: int | None = None, dtype: str = "float", step_us: float | None = None, shares=None,
                 network_step: int | None = None):
        sp = plan if isinstance(plan, SimPlan) else compile_plan(plan)
        plan = sp.plan
        if topology.num_ranks != plan.num_ranks:
            raise UsageError(f"topology {topology.name!r} has {topology.num_ranks} ranks, plan {plan.name!r} "
                             f"{plan.num_ranks}")
        for what, v in (("tile", tile), ("slots", slots)):
            if v is not None and (type(v) is not int or v < 1):
                raise UsageError(f"{what} must be an int >= 1, got {v!r}")
        view = topology.view(plan.protocol)          # latencies and rates as the plan's protocol sees them
        self.sp, self.plan, self.topology, self.view = sp, plan, topology, view
        self.tile = tile or plan.tile or view.tile
        if network_step is not None and (type(network_step) is not int or network_step < self.tile):
            raise UsageError(f"network_step must be an int >= the tile ({self.tile}), got {network_step!r}")
        self.slots = slots or runtime_slots(plan)
        self.launch = view.launch
        self.type_name, dt = parse_dtype(dtype)
        self.itemsize = dt.itemsize
        routes = [view.route(int(s), int(d)) for s, d in zip(sp.conn_src, sp.conn_dst)]
        self.alpha = np.array([r.alpha for r in routes])
        # per flow (a connection's transmissions; past them, a switch threadblock's ops of one kind):
        # its private rate cap, shared links and the weight of a byte on each (None: 1 on every one)
        shares = [1.0] * len(routes) if shares is None else list(shares)
        if len(shares) != len(routes) or not all(0 < x <= 1 for x in shares):
            raise UsageError(f"shares: one in (0, 1] per connection ({len(routes)}), got {len(shares)}")
        self.cap = [min(r.bandwidth, view.threadblock_bandwidth * x) for r, x in zip(routes, shares)]
        self.res = [r.resources for r in routes]
        self.wts: list = [None] * len(routes)
        self.message = [r.message for r in routes]        # per flow: the least time a message holds its links
        send_conn = np.full(sp.num_steps, -1, dtype=np.int64)
        send_conn[sp.msg_send] = np.repeat(np.arange(len(routes)), np.diff(sp.conn_ptr))
        self.send_conn = self.flow_conn = send_conn     # flow_conn: per step, the flow it transmits on
        if sp.switch_op is not None:
            self._switch_flows(sp, view)
        self.capacity = list(view.capacity)              # after the switch's ports are registered
        self._capacity_tol = np.asarray(self.capacity) * (1 + 1e-9)     # _overloaded's bar per link
        self.rate = rate = np.array([min([c] + [self.capacity[x] / w for x, w in _weighted(res, wts)])
                                     for c, res, wts in zip(self.cap, self.res, self.wts)])
        if len(rate) and not (rate > 0).all():
            raise UsageError(f"topology {topology.name!r} gives a connection no bandwidth")
        if network_step is not None:             # pieces of a network step: its wait and its share of the post
            piece = self.tile / network_step
            netted = [i for i, m in enumerate(self.message[:len(routes)]) if m > 0]
            for i in netted:                     # the piece arrives when its whole step would have, alone
                whole = max(network_step / rate[i], self.message[i])
                self.message[i] *= piece
                self.alpha[i] += whole - max(self.tile / rate[i], self.message[i])
        self.comp = sp.count * (topology.gamma * sp.nred + topology.delta * sp.ncopy)
        # a threadblock's own time per message and iteration: the protocol's synchronization
        step = view.step_overhead if step_us is None else step_us * 1e-6
        self.fixed = np.where((sp.sends | sp.recvs).astype(bool), step, 0.0)
        flow = self.flow_conn
        self.tx = np.where(flow >= 0, sp.count / (rate[np.maximum(flow, 0)] if len(rate) else 1.0), 0.0)
        # a message shorter than its route's per-message time still holds the links that long (Route.message)
        message = np.asarray(self.message + [0.0])
        self.tx_floor = message[flow] if message.any() else None
        if sp.switch_op is not None:
            self._switch_latencies(sp, view)
        self._watch_setup()
        self._layers = None
        self._engines: dict = {}         # the event engine and its folding, shared with retiled copies

    def _switch_flows(self, sp, view) -> None:
        """Switch ops (NVLS) transmit as flows of their own over the group's
        ports on the switch (Topology.switch_ports: the NVLink ports, which
        transfers inside the node share). Per byte of its chunk a
        reduce-load takes one out of every member's port and brings one into
        the issuing rank's; a store takes one out of the issuing rank's port
        and brings one into every member's; the fused op does both (two on
        the issuing rank's port each way). Through the switch a port moves
        view.nvls_bandwidth per direction, so a switch byte weighs
        capacity / nvls_bandwidth on its link. One flow per threadblock and
        kind of op (a threadblock runs one op at a time), capped at the
        threadblock's rate. Together, n members' fused ops load each port
        with n + 1 bytes each way per byte, and n members' reduce-loads
        beside n members' stores of other chunks do too. Switch plans run
        with the Simple protocol only (as lowering makes them): another
        protocol is refused, which msc.sim.cut_bound relies on."""
        from msc.lower.switch import SWITCH_PROTOCOLS

        if view.protocol_name not in SWITCH_PROTOCOLS:
            raise UsageError(f"plan {self.plan.name!r} has switch ops (NVLS), which run with the "
                             f"{' or '.join(SWITCH_PROTOCOLS)} protocol only, not {view.protocol_name}")
        if not view.nvls_bandwidth:
            raise UsageError(f"plan {self.plan.name!r} reduces and stores through the switch (NVLS), and topology "
                             f"{view.name!r} has no switch that does (presets with NVLS: dgx-h100, dgx-h200, hgx-h20, hgx-b200[:NODES], gb200-nvl72, nvswitch, ib)")
        for rp in self.plan.ranks:
            for tb in rp.threadblocks:
                if tb.group and not view.same_switch(tb.group):
                    raise UsageError(f"plan {self.plan.name!r}: rank {rp.rank} threadblock {tb.id}'s switch group "
                                     f"{','.join(map(str, tb.group))} spans more than one NVSwitch domain of "
                                     f"{view.name!r}")
        flow_conn = self.send_conn.copy()
        flows: dict[tuple[int, int], int] = {}
        for g in np.flatnonzero(sp.switch_op).tolist():
            t, kind = int(sp.step_tb[g]), int(sp.switch_op[g])
            if (t, kind) not in flows:
                flows[(t, kind)] = len(self.res)
                links = _switch_links(view, int(sp.tb_rank[t]), sp.tb_group[t], kind)
                self.res.append(tuple(links))
                self.wts.append(tuple(k * view.capacity[r] / view.nvls_bandwidth for r, k in links.items()))
                self.cap.append(view.threadblock_bandwidth)
                self.message.append(0.0)
            flow_conn[g] = flows[(t, kind)]
        self.flow_conn = flow_conn

    def _switch_latencies(self, sp, view) -> None:
        """A switch op pays the switch's latency before it transmits; a
        barrier costs the topology's barrier latency, the first and last of
        a threadblock once per call (in the launch), not per tile."""
        boundary = np.zeros(sp.num_steps, dtype=bool)
        starts, ends = sp.tb_start[:-1], sp.tb_start[1:]
        nonempty = ends > starts
        boundary[starts[nonempty]] = True
        boundary[ends[nonempty] - 1] = True
        boundary &= sp.barrier
        switch = sp.switch_op > 0
        self.fixed = np.where(switch, view.nvls_alpha, np.where(sp.barrier & ~boundary, view.nvls_barrier, self.fixed))
        self.launch += 2 * view.nvls_barrier

    def _watch_setup(self):
        """Shared links that more than one connection crosses, if together
        they could want more than the link has: only there can sharing slow a
        transfer (a threadblock transmits one message at a time)."""
        users: dict[int, dict] = {}           # link -> {flow: the link's bytes per byte of the flow}
        for c, (res, wts) in enumerate(zip(self.res, self.wts)):
            for r, w in _weighted(res, wts):
                users.setdefault(r, {})[c] = w
        contested = {r for r, cs in users.items()
                     if len(cs) > 1 and sum(self.rate[c] * w for c, w in cs.items()) > self.capacity[r] * (1 + 1e-9)}
        self.conn_watch = [tuple(r for r in res if r in contested) for res in self.res]
        # the watched links of each flow and their weights, flat (for _contended's gathers)
        self._watch_len = np.array([len(w) for w in self.conn_watch], dtype=np.int64)
        self._watch_ptr = np.concatenate([[0], np.cumsum(self._watch_len)]).astype(np.int64)
        self._watch_flat = np.array([r for w in self.conn_watch for r in w], dtype=np.int64)
        self._watch_wt = np.array([w for c, ws in enumerate(self.conn_watch) for w in
                                   (users[r][c] for r in ws)], dtype=np.float64)
        watched = np.array([bool(w) for w in self.conn_watch] + [False])
        self.watch = watched[self.flow_conn] if contested else None

    def retiled(self, tile: int) -> "Simulator":
        """This simulator with another tile (the plan's arrays and layers,
        which do not depend on it, are shared)."""
        if type(tile) is not int or tile < 1:
            raise UsageError(f"tile must be an int >= 1, got {tile!r}")
        if tile == self.tile:
            return self
        other = copy.copy(self)
        other.tile = tile
        return other

    def chunk_geometry(self, size: int) -> tuple[int, int, float]:
        """(rounded size, count, chunk bytes) for a requested nccl-tests size."""
        from msc.units import buffer_elements

        k, big = self.plan.chunk_factor, self.sp.chunks_big
        count = size * k // (self.itemsize * big) if big else 0
        q = -(-count // k)
        return buffer_elements(big, count, k) * self.itemsize, count, float(q * self.itemsize)

    def run(self, requested: list[int], *, engine: str = "auto", progress: str | None = None) -> list[SimResult]:
        """A SimResult per size; ``progress`` names the work for a bar over
        the event engine's sizes on a terminal (msc.progress)."""
        if engine not in ENGINES:
            raise UsageError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        geo = [self.chunk_geometry(s) for s in requested]
        iters = [math.ceil(q / self.tile) for _, _, q in geo]
        for (size, _, _), n in zip(geo, iters):
            if n > MAX_TILES:
                raise UsageError(f"a size of {size} bytes is {n} tiles of {self.tile} bytes per chunk, over msc's "
                                 f"limit of {MAX_TILES} simulated tile iterations: use a larger --tile or a smaller size")
        out: list = [None] * len(geo)
        todo = [i for i, n in enumerate(iters) if n > 0]
        for i, n in enumerate(iters):
            if n == 0:
                out[i] = SimResult(geo[i][0], geo[i][1], 0.0, 0, "none", False)
        if engine == "events":
            for i in steps(todo, progress or "", unit="size") if progress else todo:
                out[i] = SimResult(geo[i][0], geo[i][1], self._events_time(geo[i][2]), iters[i], "events", False)
            return self._launched(out)
        if self._layers is None:
            self._layers = layers(self.sp, self.slots)
            self._levels = prepare(self._layers, self.alpha, self.comp, self.tx, self.watch, self.fixed, self.tx_floor)
        contended = []                # sizes whose transfers shared a link: the event engine's
        for batch in self._batches(todo, iters):
            if engine == "auto" and len(batch) == 1 and self._clashes_early(geo[batch[0]][2], iters[batch[0]]):
                contended.append(batch[0])
                continue
            imax = max(iters[i] for i in batch)
            tlen = np.array([[self._tlen(geo[i][2], it) for i in batch] for it in range(imax)])
            res = evaluate(self._layers, self._levels, tlen, watching=self.watch is not None)
            clash = self._contended(res.sends, [iters[i] for i in batch])
            for j, i in enumerate(batch):
                if clash[j] and engine == "auto":
                    contended.append(i)
                else:
                    out[i] = SimResult(geo[i][0], geo[i][1], float(res.seconds[j]), iters[i], "fast", bool(clash[j]))
        for i in steps(contended, progress, unit="size") if progress and len(contended) > 1 else contended:
            out[i] = SimResult(geo[i][0], geo[i][1], self._events_time(geo[i][2]), iters[i], "events", True)
        return self._launched(out)

    def _launched(self, results: list[SimResult]) -> list[SimResult]:
        """The results with the protocol's launch latency added where something moved."""
        if not self.launch:
            return results
        return [replace(r, seconds=r.seconds + self.launch) if r.iterations else r for r in results]

    def _batches(self, todo, iters):
        G = max(self.sp.num_steps, 1)
        window = self._layers.max_delta + 1
        batch, out = [], []
        for i in sorted(todo, key=lambda i: iters[i]):
            if iters[i] > JUMP_MIN:               # alone: a single size can skip periodic iterations
                out.append([i])
                continue
            if batch and min(max(iters[i], 1), window) * G * (len(batch) + 1) > FAST_BUDGET:
                out.append(batch)
                batch = []
            batch.append(i)
        if batch:
            out.append(batch)
        return out

    def _tlen(self, q: float, it: int) -> float:
        return min(self.tile, max(q - it * self.tile, 0.0))

    def _clashes_early(self, q: float, n: int) -> bool:
        """Whether a size of ``n`` tile iterations (chunks of ``q`` bytes)
        is contended within a prefix of its iterations: 4, 8, 16, .. of
        them, fewer than all (at most twice the work of the prefix that shows it). A prefix's times are the full schedule's (an
        iteration waits only on earlier ones; evaluated without jumps), and
        an overload among some of its transmissions is one among all, so a
        clash here is the full evaluation's verdict, without its cost in
        time and memory (the watched transmissions of every iteration: 1.3
        GB for tree LL128 at 1024 GPUs, 207 iterations). None found: the
        caller evaluates them all."""
        if self.watch is None:
            return False
        # a prefix of full tiles is the same schedule for every size that has them (tree LL128 at 4 and
        # 8 MB: 16 of 31 and 61 iterations): its verdict is kept, per tile (retiled copies share the dict)
        known = self._engines.setdefault("probes", {})
        p = PROBE
        while p < n:
            full = q >= p * self.tile
            clash = known.get((self.tile, p)) if full else None
            if clash is None:
                tlen = np.array([[self._tlen(q, it)] for it in range(p)])
                res = evaluate(self._layers, self._levels, tlen, watching=True, jump=False)
                clash = bool(self._contended(res.sends, [p])[0])
                if full:
                    known[(self.tile, p)] = clash
            if clash:
                return True
            p *= 2
        return False

    def _contended(self, sends, iters: list[int]) -> np.ndarray:
        """Per size (``iters``: its tile iterations): whether, at some moment,
        the transmissions on a shared link wanted more than its capacity. If
        never, every flow ran at its solo rate under max-min sharing too, so
        the fast schedule is exact. The first iteration's transmissions are
        checked first: an overload among some transmissions is one among all
        (more flows only add load), and the first iteration usually shows it
        at a small part of the cost."""
        clash = np.zeros(len(iters), dtype=bool)
        if sends is None or not len(sends[1]):
            return clash
        it, g, t0, t1 = sends
        for s, n in enumerate(iters):
            # the watched transmissions are recorded in iteration order: a size's are a prefix
            for rows in dict.fromkeys((int(np.searchsorted(it, 1)), int(np.searchsorted(it, n)))):
                if self._overloaded(g[:rows], t0[:rows, s], t1[:rows, s]):
                    clash[s] = True
                    break
        return clash

    def _overloaded(self, g, t0, t1) -> bool:
        """Whether transmissions (steps ``g``, from ``t0`` to ``t1``) ever load
        a watched link over its capacity. A sweep over start (+rate) and end
        (-rate) events sorted by (link, time, ends first) gives each link's
        load as a running sum (the sum over a link's events is zero, so one
        cumsum serves all links)."""
        live = t1 > t0
        conns = self.flow_conn[g[live]]
        nres = self._watch_len[conns]
        if int(nres.sum()) < 2:      # one link use cannot overload (counted in uses: a folded flow has several)
            return False
        first = np.repeat(self._watch_ptr[conns] - (np.cumsum(nres) - nres), nres)
        at = first + np.arange(int(nres.sum()))
        r = self._watch_flat[at]                                     # each step's watched links, in order
        rt = np.repeat(self.rate[conns], nres) * self._watch_wt[at]  # and its load on each
        when = np.concatenate([np.repeat(t0[live], nres), np.repeat(t1[live], nres)])
        step = np.concatenate([rt, -rt])
        link = np.concatenate([r, r])
        order = np.lexsort((step, when, link))
        load = np.cumsum(step[order])
        return bool(np.any(load > self._capacity_tol[link[order]]))

    # -- the event engine ----------------------------------------------------
    def event_sim(self) -> EventSim:
        if "events" not in self._engines:
            sp = self.sp
            per_iter = np.diff(sp.conn_ptr)
            mconn = np.repeat(np.arange(len(per_iter)), per_iter)
            ordinal = np.arange(len(mconn)) - sp.conn_ptr[mconn]
            so = np.full(sp.num_steps, -1, dtype=np.int64)
            ro = np.full(sp.num_steps, -1, dtype=np.int64)
            rconn = np.full(sp.num_steps, -1, dtype=np.int64)
            so[sp.msg_send] = ordinal
            ro[sp.msg_recv] = ordinal
            rconn[sp.msg_recv] = mconn
            names = list(zip(sp.tb_rank.tolist(), sp.tb_local.tolist()))
            # a message's least time on its links as bytes at the flow's own rate (Route.message)
            floors = [m * r for m, r in zip(self.message, self.rate.tolist())]
            dep_tb = sp.step_tb[sp.dep_src].astype(np.int64)
            columns = StepColumns(np.diff(sp.tb_start), self.comp, sp.count, self.send_conn, rconn, so, ro,
                                  self.fixed, self.flow_conn, sp.dep_dst, dep_tb, sp.dep_src - sp.tb_start[dep_tb])
            self._engines["events"] = EventSim(None, per_iter.tolist(), self.alpha.tolist(), self.cap, self.res,
                                               self.capacity, self.slots, names, self.wts, floors, columns)
        return self._engines["events"]

    @property
    def folding(self) -> Folded:
        """The event engine's plan folded by its symmetry (msc.sim.symmetry):
        its ``sim``, or None and the ``reason`` the full plan runs instead."""
        if "folding" not in self._engines:
            self._engines["folding"] = fold(self.event_sim(), self.sp)
        return self._engines["folding"]

    def _events_time(self, q: float) -> float:
        n = math.ceil(q / self.tile)
        # a makespan: one threadblock per class of those that run alike gives the full run's
        sim = self.folding.sim or self.event_sim()
        return sim.run([self._tlen(q, it) for it in range(n)])

    def timeline(self, size: int):
        """(SimResult, arrays) for one size: per step instance its
        threadblock ``tb`` (global index), ``it``eration, global ``step`` id,
        ``start``, ``txs`` (transmission start) and ``end`` in seconds
        from the kernel's start (the launch latency, which precedes it, is in
        the SimResult's time but not in these)."""
        [res] = self.run([size])
        rounded, count, q = self.chunk_geometry(size)
        n = res.iterations
        if n == 0:
            empty = np.zeros(0)
            return res, {"tb": empty.astype(int), "it": empty.astype(int), "step": empty.astype(int),
                         "start": empty, "txs": empty, "end": empty}
        tlen = [self._tlen(q, it) for it in range(n)]
        if res.engine == "fast":
            fr = evaluate(self._layers, self._levels, np.array(tlen)[:, None], record=True)
            G = self.sp.num_steps
            step = np.tile(np.arange(G), n)
            out = {"tb": self.sp.step_tb[step].astype(np.int64), "it": np.repeat(np.arange(n), G), "step": step,
                   "start": fr.timeline[0, :, 0, :].ravel(), "txs": fr.timeline[1, :, 0, :].ravel(),
                   "end": fr.timeline[2, :, 0, :].ravel()}
        else:
            _, log = self.event_sim().run(tlen, record=True)
            arr = np.array(log, dtype=np.float64).reshape(-1, 6)
            tb = arr[:, 0].astype(np.int64)
            step = self.sp.tb_start[tb] + arr[:, 2].astype(np.int64)
            out = {"tb": tb, "it": arr[:, 1].astype(np.int64), "step": step, "start": arr[:, 3], "txs": arr[:, 4],
                   "end": arr[:, 5]}
        return res, out

    # -- records ---------------------------------------------------------------
    def records(self, requested: list[int], *, engine: str = "auto") -> list[dict]:
        """nccl-tests records (msc.cli.run's fields; nothing is run or checked,
        so #wrong is 0) plus ``iterations``, ``engine`` and ``contended``."""
        plan = self.plan
        try:
            has_root = plan_collective(plan).has_root
        except MscError:                 # a custom collective: no nccl-tests bus factor, busbw = algbw
            has_root = False
        factor = BUSBW_FACTOR.get(plan.collective, lambda n: 1.0)(plan.num_ranks)
        out = []
        what = f"simulating {plan.name} with link contention (event engine)"
        for req, r in zip(requested, self.run(requested, engine=engine, progress=what)):
            us = r.seconds * 1e6
            algbw = r.size / us / 1e3 if us > 0 else 0.0
            out.append({"plan": plan.name, "size": r.size, "count": r.count, "type": self.type_name,
                        "redop": "sum" if plan.collective in REDUCING else "none",
                        "root": plan.root if has_root else -1, "time": us, "algbw": algbw,
                        "busbw": algbw * factor, "inplace": plan.inplace, "requested_size": req,
                        "rounded": r.size != req, "iterations": r.iterations, "engine": r.engine,
                        "contended": r.contended, "topology": self.topology.name})
        return out


def _weighted(res, wts):
    """(link, bytes on it per byte of the flow) of a flow's shared links."""
    return zip(res, wts) if wts is not None else ((r, 1) for r in res)


def _switch_links(view: Topology, rank: int, group: tuple, kind: int) -> dict[int, int]:
    """Per shared link, the bytes a switch op of ``kind`` (SimPlan.switch_op)
    issued by ``rank`` on ``group`` moves across it per byte of its chunk."""
    links: dict[int, int] = {}
    out, into = view.switch_ports(rank)
    for m in group:
        m_out, m_in = view.switch_ports(m)
        if kind & SWITCH_READS:              # every member's copy leaves its port; the sum enters the reader's
            links[m_out] = links.get(m_out, 0) + 1
        if kind & SWITCH_WRITES:             # the result enters every member's port
            links[m_in] = links.get(m_in, 0) + 1
    if kind & SWITCH_READS:
        links[into] = links.get(into, 0) + 1
    if kind & SWITCH_WRITES:                 # it leaves the writer's port once
        links[out] = links.get(out, 0) + 1
    return links


def simulate(plan: Plan, topology: Topology, requested: list[int], **kw) -> list[dict]:
    """Records for ``requested`` sizes (see Simulator.records)."""
    engine = kw.pop("engine", "auto")
    return Simulator(plan, topology, **kw).records(requested, engine=engine)
