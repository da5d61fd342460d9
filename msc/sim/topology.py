"""Topologies for the cost model: which links a transfer between two ranks
crosses, with their latency (alpha), bandwidth and whether concurrent
transfers share them, plus per-byte costs of reductions (gamma) and local
copies.

A transfer from rank a to rank b follows a ``Route``: its latency is the sum
of its links' alphas (cut-through: a message pays each hop's latency once,
not its size once per hop), its data rate is at most the slowest *unshared*
link on the way, and it competes max-min fairly with the other transfers on
every *shared* link it crosses (a switch port, a NIC, a PCIe uplink). Shared
links are the simulator's "resources"; their ids are handed out lazily so a
1024-rank fully connected model does not build a million of them up front.

Every link has a kind (msc.sim.protocols.KINDS), and its alpha and bandwidth
are Simple's latency and the line rate. What a protocol makes of them (its
latency, the share of the line rate that carries data, its launch latency
and threadblock rate) is ``view(protocol)``: the same topology with those
applied, which is what the simulator and ``msc bound`` read.

Units inside: seconds, bytes, bytes per second. Outside (CLI, TOML): alpha in
microseconds, bandwidth in GB/s = 1e9 bytes/s, the unit nccl-tests reports.
"""
from __future__ import annotations

import copy
import heapq
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from msc.errors import UsageError
from msc.files import read_input
from msc.ir.limits import MAX_RANKS, MAX_TEXT_FILE_BYTES
from msc.sim.machines import HOP_US, MACHINES
from msc.sim.protocols import (ALPHA_US_MAX, DEFAULT_PROTOCOLS, GB, GBPS_MAX, GBPS_MIN, KINDS, LINK, US,
                                Protocol, number_in, protocols_from_tables)


@dataclass(frozen=True)
class Route:
    """The path of a transfer: total latency (s), the rate its unshared links
    allow (bytes/s, inf if none limits it), the shared links it crosses, and
    the least time a message holds them (s; 0: none): a per-message cost,
    such as the host proxy posting each network message (Nodes)."""

    alpha: float
    bandwidth: float
    resources: tuple[int, ...]
    message: float = 0.0


class Topology:
    """Base class: subclasses implement ``_route(src, dst)``, register
    shared links with ``_resource(name, bandwidth)`` and scale their links
    for a protocol in ``_scale(model)`` (see ``view``)."""

    def __init__(self, name: str, num_ranks: int, *, reduce_gbps: float = math.inf, copy_gbps: float = math.inf,
                 threadblock_gbps: float = math.inf, protocols: dict[str, Protocol] | None = None,
                 gpus_per_node: int | None = None, description: str = "", machine: str | None = None,
                 nvls_gbps: float = 0.0, nvls_alpha_us: float = 0.0, nvls_barrier_us: float = 0.0,
                 note: str = ""):
        if type(num_ranks) is not int or num_ranks < 1:
            raise UsageError(f"topology {name!r}: ranks must be an int >= 1, got {num_ranks!r}")
        if num_ranks > MAX_RANKS:
            raise UsageError(f"topology {name!r} has {num_ranks} ranks, over msc's limit of {MAX_RANKS}")
        for what, v in (("reduce_gbps", reduce_gbps), ("copy_gbps", copy_gbps),
                        ("threadblock_gbps", threadblock_gbps)):
            number_in(what, v, GBPS_MIN, GBPS_MAX, free=True)
        self.name = name
        self.num_ranks = num_ranks
        self.gamma = 1.0 / (reduce_gbps * GB)          # s per byte reduced (one operand added)
        self.delta = 1.0 / (copy_gbps * GB)            # s per byte copied locally
        self.threadblock_bandwidth = threadblock_gbps * GB
        self.protocols = dict(DEFAULT_PROTOCOLS)
        self.protocols.update(protocols or {})
        self.gpus_per_node = gpus_per_node
        self.description = description
        self.machine = machine                         # msc.sim.machines' name of its GPUs, if one
        self.note = note                               # what every command says of it (uncalibrated GPUs)
        # NVLS (in-switch reduction and multicast, msc.sim.machines): per GPU port and direction; 0: none
        self.nvls_bandwidth = nvls_gbps * GB
        self.nvls_alpha, self.nvls_barrier = nvls_alpha_us * US, nvls_barrier_us * US
        self.protocol_name: str | None = None          # set in a view: the protocol applied
        self.launch = 0.0                              # s per collective (a view's protocol's)
        self.step_overhead = 0.0                       # s per message and iteration (a view's protocol's)
        self._reset()

    def _reset(self):
        self.capacity: list[float] = []                # bytes/s of each shared link
        self.resource_names: list[str] = []
        self._resource_ids: dict[str, int] = {}
        self._routes: dict[tuple[int, int], Route] = {}
        self._views: dict[str, Topology] = {}

    def route(self, src: int, dst: int) -> Route:
        key = (src, dst)
        r = self._routes.get(key)
        if r is None:
            n = self.num_ranks
            if not (0 <= src < n and 0 <= dst < n) or src == dst:
                raise UsageError(f"topology {self.name!r} has ranks 0..{n - 1}: no route from {src} to {dst}")
            r = self._routes[key] = self._route(src, dst)
        return r

    def _route(self, src: int, dst: int) -> Route:
        raise NotImplementedError

    def _resource(self, name: str, bandwidth: float) -> int:
        rid = self._resource_ids.get(name)
        if rid is None:
            rid = self._resource_ids[name] = len(self.capacity)
            self.capacity.append(bandwidth)
            self.resource_names.append(name)
        return rid

    def protocol(self, name: str) -> Protocol:
        try:
            return self.protocols[name]
        except KeyError:
            raise UsageError(f"topology {self.name!r} has no model for protocol {name!r} "
                             f"(it has {', '.join(self.protocols)})") from None

    def view(self, protocol: str) -> "Topology":
        """This topology as ``protocol`` sees it: every link's latency and
        rate scaled by the protocol's model of its kind, the threadblock rate
        and launch latency the protocol's (the view of a view is itself)."""
        if self.protocol_name is not None:
            if protocol != self.protocol_name:
                raise UsageError(f"topology {self.name!r} is already the {self.protocol_name} view, "
                                 f"not {protocol}'s")
            return self
        v = self._views.get(protocol)
        if v is None:
            model = self.protocol(protocol)
            v = copy.copy(self)
            v._reset()
            v.protocol_name, v.launch, v.step_overhead = protocol, model.launch_us * US, model.step_us * US
            tb = model.threadblock_gbps
            v.threadblock_bandwidth = tb * GB if tb is not None else \
                self.threadblock_bandwidth * model.link(LINK).bandwidth_factor
            v.tile = model.tile
            v._scale(model, protocol)
            self._views[protocol] = v
        return v

    def _scale(self, model: Protocol, protocol: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        return f"{self.name} ({self.num_ranks} ranks){': ' + self.description if self.description else ''}"

    def same_switch(self, ranks) -> bool:
        """Whether ``ranks`` share one switch that can reduce (an NVSwitch domain)."""
        g = self.gpus_per_node or self.num_ranks
        return len({r // g for r in ranks}) == 1

    def switch_ports(self, rank: int) -> tuple[int, int]:
        """The shared links (out, in) of ``rank``'s port on the switch that
        reduces (NVLS): the links its transfers inside the node cross too,
        so switch operations and NVLink transfers share them."""
        raise UsageError(f"topology {self.name!r} has no switch that reduces (NVLS)")


def _scaled(model: Protocol, kind: str, alpha: float, bandwidth: float) -> tuple[float, float]:
    """(alpha, bandwidth) of a link of ``kind`` under a protocol's ``model``."""
    m = model.link(kind)
    return alpha * m.alpha_factor, bandwidth * m.bandwidth_factor


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise UsageError(f"unknown link kind {kind!r} (kinds: {', '.join(KINDS)})")
    return kind


class Uniform(Topology):
    """Fully connected, every ordered pair its own link (alpha, bandwidth),
    shared only by transfers between that pair: the classic alpha-beta
    model, in which a rank may send to several peers at once."""

    def __init__(self, num_ranks: int, alpha_us: float, bandwidth_gbps: float, *, kind: str = LINK, **kw):
        _positive("alpha_us", alpha_us, zero=True)
        _positive("bandwidth_gbps", bandwidth_gbps)
        kw.setdefault("description", f"fully connected, alpha {alpha_us:g} us, {bandwidth_gbps:g} GB/s per pair")
        super().__init__(kw.pop("name", "uniform"), num_ranks, **kw)
        self.alpha, self.bandwidth, self.kind = alpha_us * US, bandwidth_gbps * GB, _kind(kind)

    def _route(self, src, dst):
        return Route(self.alpha, math.inf, (self._resource(f"{src}->{dst}", self.bandwidth),))

    def _scale(self, model, protocol):
        self.alpha, self.bandwidth = _scaled(model, self.kind, self.alpha, self.bandwidth)


class Nodes(Topology):
    """Nodes of GPUs behind a switch (NVSwitch, or PCIe switches), joined by
    one NIC per GPU into a non-blocking fabric (rail-optimized fat tree).

    Inside a node a transfer uses the sender's egress port and the
    receiver's ingress port (shared; links of ``port_kind``); with
    ``pcie_switches`` > 1 the GPUs are split among PCIe switches and a
    transfer between switches also crosses both switches' uplinks to the
    CPU (shared, PCIe). Across nodes it uses the sender's NIC out and the
    receiver's NIC in (shared, "net": the GPU's PCIe path to its NIC is
    taken as faster than the NIC); the fabric core is taken as non-blocking.
    A node has a NIC per GPU, or ``nics_per_node`` that its GPUs share in
    equal groups of neighbours (GPUs 0-1 on NIC 0 where 4 NICs serve 8).

    A message across nodes holds both NICs for at least ``message_us``,
    whatever its size: the host's network proxy posts each message, and
    its receive, one after another (msc.sim.machines Machine.message_us,
    from NCCL's network post overhead). So a rank's messages across nodes
    pass one per that time at most, many small messages to many peers
    queue, and a multi-node ring's every step waits for its network hop
    (as NCCL's model has it, tuning.cc)."""

    def __init__(self, name, nodes, gpus_per_node, *, port_gbps, port_alpha_us, nic_gbps=None, nic_alpha_us=None,
                 pcie_switches=1, uplink_gbps=None, uplink_alpha_us=0.0, port_kind="nvlink", message_us=0.0,
                 nics_per_node=None, **kw):
        super().__init__(name, nodes * gpus_per_node, gpus_per_node=gpus_per_node, **kw)
        self.nics = nics_per_node or gpus_per_node
        if gpus_per_node % self.nics:
            raise UsageError(f"topology {name!r}: {self.nics} NICs per node do not split {gpus_per_node} GPUs evenly")
        self.nodes, self.proxy = nodes, message_us * US
        self.g, self.port, self.port_alpha = gpus_per_node, port_gbps * GB, port_alpha_us * US
        self.port_kind = _kind(port_kind)
        self.nic = (nic_gbps or 0) * GB
        self.nic_alpha = (nic_alpha_us or 0) * US
        self.nic_message = self.proxy
        self.switches, self.uplink, self.uplink_alpha = pcie_switches, (uplink_gbps or 0) * GB, uplink_alpha_us * US

    def _route(self, src, dst):
        g = self.g
        if src // g != dst // g:
            return Route(self.nic_alpha, math.inf, (self._resource(f"{self._nic(src)}.out", self.nic),
                                                    self._resource(f"{self._nic(dst)}.in", self.nic)), self.nic_message)
        res = [self._resource(f"gpu{src}.out", self.port)]
        alpha = self.port_alpha
        per = g // self.switches
        s_src, s_dst = src % g // per, dst % g // per
        if s_src != s_dst:
            node = src // g
            res += [self._resource(f"node{node}.switch{s_src}.up", self.uplink),
                    self._resource(f"node{node}.switch{s_dst}.down", self.uplink)]
            alpha += self.uplink_alpha
        res.append(self._resource(f"gpu{dst}.in", self.port))
        return Route(alpha, math.inf, tuple(res))

    def _nic(self, rank: int) -> str:
        """The name of ``rank``'s NIC (a NIC per GPU: the rank's own)."""
        if self.nics == self.g:
            return f"nic{rank}"
        return f"node{rank // self.g}.nic{rank % self.g // (self.g // self.nics)}"

    def switch_ports(self, rank):
        if not self.nvls_bandwidth or self.switches != 1:
            return super().switch_ports(rank)
        return self._resource(f"gpu{rank}.out", self.port), self._resource(f"gpu{rank}.in", self.port)

    def _scale(self, model, protocol):
        self.port_alpha, self.port = _scaled(model, self.port_kind, self.port_alpha, self.port)
        self.nic_alpha, self.nic = _scaled(model, "net", self.nic_alpha, self.nic)
        self.uplink_alpha, self.uplink = _scaled(model, "pcie", self.uplink_alpha, self.uplink)


class Torus(Topology):
    """A rows x cols torus of point-to-point links (a ring when rows == 1),
    each direction its own shared link. Transfers take the shortest way
    around each ring, columns first then rows (dimension order), crossing
    every link on the way (cut-through: one latency per hop, no store and
    forward at intermediate ranks)."""

    def __init__(self, rows: int, cols: int, *, alpha_us: float, bandwidth_gbps: float, kind: str = LINK, **kw):
        name = kw.pop("name", f"ring:{cols}" if rows == 1 else f"torus:{rows}x{cols}")
        super().__init__(name, rows * cols, **kw)
        self.rows, self.cols = rows, cols
        self.alpha, self.bandwidth, self.kind = alpha_us * US, bandwidth_gbps * GB, _kind(kind)

    def _route(self, src, dst):
        res = []
        (r0, c0), (r1, c1) = divmod(src, self.cols), divmod(dst, self.cols)
        for size, a, b, at in ((self.cols, c0, c1, lambda c: r0 * self.cols + c),
                               (self.rows, r0, r1, lambda r: r * self.cols + c1)):
            fwd = (b - a) % size
            step = 1 if fwd <= size - fwd else -1
            x = a
            while x != b:
                y = (x + step) % size
                res.append(self._resource(f"{at(x)}->{at(y)}", self.bandwidth))
                x = y
        return Route(self.alpha * len(res), math.inf, tuple(res))

    def _scale(self, model, protocol):
        self.alpha, self.bandwidth = _scaled(model, self.kind, self.alpha, self.bandwidth)


class Graph(Topology):
    """Ranks and named switches joined by links, from a TOML file. A
    transfer takes the path of least total latency (Simple's), then fewest
    links, then the lowest vertex numbers (ranks, then switches in order of
    mention); every protocol takes the same path. Paths pass through
    switches, and through other ranks only if ``forward`` (ranks that route,
    as on a torus of router chips; a GPU does not forward others' traffic
    unless an algorithm tells it to)."""

    def __init__(self, name, num_ranks, links, forward=False, **kw):
        super().__init__(name, num_ranks, **kw)
        self.forward = forward
        self.vertex: dict = {r: r for r in range(num_ranks)}
        self.adj: list[list[tuple]] = [[] for _ in range(num_ranks)]
        self._trees: dict[int, dict] = {}
        self._model: Protocol | None = None           # a view's protocol: links scaled as they are crossed
        for a, b, alpha, bw, shared, kind in links:
            ia, ib = self._vertex(a), self._vertex(b)
            lid = f"{a}->{b}#{len(self.adj[ia])}"
            self.adj[ia].append((ib, alpha, bw, shared, lid, _kind(kind)))

    def _vertex(self, v):
        if v not in self.vertex:
            self.vertex[v] = len(self.adj)
            self.adj.append([])
        return self.vertex[v]

    def _route(self, src, dst):
        tree = self._trees.get(src)
        if tree is None:
            tree = self._trees[src] = self._dijkstra(src)
        if dst not in tree:
            raise UsageError(f"topology {self.name!r}: no path from rank {src} to rank {dst}")
        alpha, bw, res = 0.0, math.inf, []
        v = dst
        while v != src:
            u, (lalpha, lbw, shared, lid, kind) = tree[v]
            if self._model is not None:
                lalpha, lbw = _scaled(self._model, kind, lalpha, lbw)
            alpha += lalpha
            if shared:
                res.append(self._resource(lid, lbw))
            else:
                bw = min(bw, lbw)
            v = u
        return Route(alpha, bw, tuple(reversed(res)))

    def _scale(self, model, protocol):
        self._model = model             # the paths (self._trees, Simple's) are shared with the base

    def _dijkstra(self, src):
        dist = {src: (0.0, 0, src)}
        tree = {}
        heap = [(0.0, 0, src)]
        while heap:
            d, hops, u = heapq.heappop(heap)
            if dist.get(u, (math.inf,))[:2] < (d, hops):
                continue
            if u != src and u < self.num_ranks and not self.forward:
                continue                          # a rank is an end, not a router
            for v, alpha, bw, shared, lid, kind in self.adj[u]:
                key = (d + alpha, hops + 1, u)
                if v not in dist or key < dist[v]:
                    dist[v] = key
                    tree[v] = (u, (alpha, bw, shared, lid, kind))
                    heapq.heappush(heap, (key[0], key[1], v))
        return tree


def _positive(what, v, zero=False):
    """A link's latency (``zero``: alpha_us) or line rate (bandwidth_gbps), in msc.sim.protocols' ranges."""
    if zero:
        number_in(what, v, 0.0, ALPHA_US_MAX)
    else:
        number_in(what, v, GBPS_MIN, GBPS_MAX)


# -- TOML -------------------------------------------------------------------
NIC_ALPHA_US = HOP_US["net"]["Simple"]          # NCCL's network hop latency with Simple (tuning.cc)
# The nodes form (``nodes = N``, no [[link]]): N nodes of gpus_per_node GPUs on one switch of NVLink
# ports, joined by NICs (Nodes). Each key and its range; left out, the machine's value (NICs: one per GPU).
NODES_KEYS = {"nodes": None, "nics_per_node": None, "nic_gbps": (GBPS_MIN, GBPS_MAX), "nic_alpha_us": (0.0, ALPHA_US_MAX),
              "message_us": (0.0, ALPHA_US_MAX),
              "nvlink_gbps": (GBPS_MIN, GBPS_MAX), "nvlink_alpha_us": (0.0, ALPHA_US_MAX),
              "nvls_gbps": (0.0, GBPS_MAX), "nvls_alpha_us": (0.0, ALPHA_US_MAX),
              "nvls_barrier_us": (0.0, ALPHA_US_MAX)}
TOP_KEYS = {"name", "ranks", "description", "machine", "reduce_gbps", "copy_gbps", "threadblock_gbps",
            "gpus_per_node", "forward", "link", "protocol", "calibrated"} | set(NODES_KEYS)
LINK_KEYS = {"from", "to", "alpha_us", "bandwidth_gbps", "shared", "duplex", "kind"}


def load_topology(path: str | Path) -> Topology:
    """A topology from a TOML file (format: docs/performance.md, "Topologies"): a ``Graph``
    of [[link]] tables, or ``Nodes`` where it says ``nodes``."""
    path = Path(path)
    try:
        data = tomllib.loads(read_input(path, MAX_TEXT_FILE_BYTES, what="topology").decode())
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not TOML (byte {exc.start} is not UTF-8)") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: {exc}") from None
    except RecursionError:          # tomllib reads nested arrays and tables recursively
        raise UsageError(f"{path}: arrays or tables nested too deep to read") from None
    return topology_from_dict(data, source=str(path))


def topology_from_dict(data: dict, source: str = "<topology>") -> Topology:
    def bad(msg):
        return UsageError(f"{source}: {msg}")

    unknown = set(data) - TOP_KEYS
    if unknown:
        raise bad(f"unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(TOP_KEYS))})")
    if "nodes" in data:
        return _nodes_from_dict(data, source, bad)
    given = sorted(set(data) & set(NODES_KEYS))
    if given:
        raise bad(f"{', '.join(given)} describe nodes: give 'nodes' (and 'gpus_per_node') for that form")
    n = data.get("ranks")
    if type(n) is not int or n < 1:
        raise bad(f"'ranks' must be an int >= 1, got {n!r}")
    if n > MAX_RANKS:
        raise bad(f"'ranks' is {n}, over msc's limit of {MAX_RANKS}")
    for key in ("name", "description", "machine", "calibrated"):
        if key in data and not isinstance(data[key], str):
            raise bad(f"'{key}' must be a string, got {data[key]!r}")
    machine = _machine(data, bad)
    if not isinstance(data.get("link", []), list):
        raise bad(f"'link' must be [[link]] tables, got {data['link']!r}")
    links = _links(data.get("link", []), n, bad)
    protocols = protocols_from_tables(data.get("protocol", {}), machine.protocols, bad)
    kw = dict(reduce_gbps=machine.reduce_gbps, copy_gbps=machine.copy_gbps, threadblock_gbps=machine.threadblock_gbps)
    kw.update({k: data[k] for k in ("reduce_gbps", "copy_gbps", "threadblock_gbps") if k in data})
    gpn = data.get("gpus_per_node")
    if gpn is not None and (type(gpn) is not int or gpn < 1 or n % gpn):
        raise bad(f"'gpus_per_node' must divide ranks ({n}), got {gpn!r}")
    forward = data.get("forward", False)
    if type(forward) is not bool:
        raise bad(f"'forward' must be true or false, got {forward!r}")
    try:
        return Graph(str(data.get("name", Path(source).stem)), n, links, forward, protocols=protocols,
                     gpus_per_node=gpn, description=str(data.get("description", "")),
                     machine=machine.name if "machine" in data else None, note=_note(data, machine), **kw)
    except UsageError as exc:
        raise bad(str(exc)) from None


def _machine(data: dict, bad):
    machine = MACHINES.get(data.get("machine", "textbook"))
    if machine is None:
        raise bad(f"'machine' must be one of {', '.join(MACHINES)}, got {data['machine']!r}")
    return machine


def _note(data: dict, machine) -> str:
    """What the file takes from an uncalibrated machine, said once by every command that uses it (not
    where it says what it was calibrated to: ``calibrated``, as msc calibrate writes)."""
    if "machine" not in data or not machine.note or "calibrated" in data:
        return ""
    return f"{machine.note} (the values this file does not set)"


def _count(data: dict, key: str, bad, most: int = MAX_RANKS) -> int:
    v = data.get(key)
    if type(v) is not int or not 1 <= v <= most:
        raise bad(f"'{key}' must be an int from 1 to {most}, got {v!r}")
    return v


def _nodes_from_dict(data: dict, source: str, bad) -> Nodes:
    """The nodes form: ``nodes`` nodes of ``gpus_per_node`` GPUs behind one
    NVLink switch each, joined by NICs (docs/performance.md, "Your own cluster's model")."""
    for key in ("link", "forward"):
        if key in data:
            raise bad(f"'{key}' belongs to a topology of [[link]] tables, not to one of 'nodes'")
    nodes, g = _count(data, "nodes", bad), _count(data, "gpus_per_node", bad)
    if nodes * g > MAX_RANKS:
        raise bad(f"{nodes} nodes of {g} GPUs are {nodes * g} ranks, over msc's limit of {MAX_RANKS}")
    if "ranks" in data and data["ranks"] != nodes * g:
        raise bad(f"'ranks' is {data['ranks']!r}, but {nodes} nodes of {g} GPUs are {nodes * g}")
    nics = _count(data, "nics_per_node", bad, g) if "nics_per_node" in data else g
    if g % nics:
        raise bad(f"'nics_per_node' ({nics}) must divide gpus_per_node ({g}): each NIC serves as many GPUs")
    for key in ("name", "description", "machine", "calibrated"):
        if key in data and not isinstance(data[key], str):
            raise bad(f"'{key}' must be a string, got {data[key]!r}")
    machine = _machine(data, bad)
    values = {}
    for key, span in NODES_KEYS.items():
        if span is not None and key in data:
            try:
                values[key] = number_in(key, data[key], *span)
            except UsageError as exc:
                raise bad(str(exc)) from None
    if nodes > 1 and "nic_gbps" not in values:
        raise bad(f"{nodes} nodes need 'nic_gbps', the line rate of a NIC (GB/s; 400 Gb/s = 50)")
    port = values.get("nvlink_gbps", machine.nvlink_gbps)
    if not port:
        raise bad(f"machine {machine.name!r} has no NVLink rate: give 'nvlink_gbps' (GB/s per GPU and direction)")
    # the machine's protocols on this many nodes (LL's share of a NIC from 3 on), under the file's tables
    protocols = protocols_from_tables(data.get("protocol", {}), machine.protocols_for(nodes), bad)
    kw = dict(reduce_gbps=machine.reduce_gbps, copy_gbps=machine.copy_gbps, threadblock_gbps=machine.threadblock_gbps)
    kw.update({k: data[k] for k in ("reduce_gbps", "copy_gbps", "threadblock_gbps") if k in data})
    nvls = {k: values.get(k, getattr(machine, k)) for k in ("nvls_gbps", "nvls_alpha_us", "nvls_barrier_us")}
    name = str(data.get("name", Path(source).stem))
    text = f"{nodes} node(s) of {g} {machine.description} GPUs on NVLink ({port:g} GB/s per GPU and direction)"
    if nodes > 1:
        text += f", {nics} NIC(s) of {values['nic_gbps']:g} GB/s per node"
    try:
        return Nodes(name, nodes, g, port_gbps=port, port_alpha_us=values.get("nvlink_alpha_us", machine.nvlink_alpha_us),
                     nic_gbps=values.get("nic_gbps"), nic_alpha_us=values.get("nic_alpha_us", NIC_ALPHA_US),
                     message_us=values.get("message_us", machine.message_us), nics_per_node=nics, protocols=protocols,
                     description=str(data.get("description", text)), machine=machine.name if "machine" in data else None,
                     note=_note(data, machine), **nvls, **kw)
    except UsageError as exc:
        raise bad(str(exc)) from None


def _links(entries, n: int, bad) -> list[tuple]:
    """(from, to, alpha s, bandwidth B/s, shared, kind) of each direction of
    each pair of ends of the [[link]] ``entries``."""
    links = []
    for i, entry in enumerate(entries):
        for src, dst in _link_ends(f"link {i + 1}", entry, n, bad):
            shared, duplex = entry.get("shared", True), entry.get("duplex", True)
            kind = entry.get("kind", LINK)
            if not isinstance(kind, str) or kind not in KINDS:
                raise bad(f"link {i + 1}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
            alpha, bw = entry["alpha_us"] * US, entry["bandwidth_gbps"] * GB
            links.append((src, dst, alpha, bw, shared, kind))
            if duplex:
                links.append((dst, src, alpha, bw, shared, kind))
    return links


def _link_ends(where: str, entry, n: int, bad) -> list[tuple]:
    """One [[link]] entry checked, and its (from, to) pairs: lists in 'from'
    and 'to' pair up element by element, a single end goes with each."""
    if not isinstance(entry, dict):
        raise bad(f"{where}: expected a [[link]] table")
    unknown = set(entry) - LINK_KEYS
    if unknown:
        raise bad(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(LINK_KEYS))})")
    for key in ("from", "to", "alpha_us", "bandwidth_gbps"):
        if key not in entry:
            raise bad(f"{where}: missing '{key}'")
    for key in ("shared", "duplex"):
        if key in entry and type(entry[key]) is not bool:      # "false" is a string, and true
            raise bad(f"{where}: '{key}' must be true or false, got {entry[key]!r}")
    try:
        _positive("alpha_us", entry["alpha_us"], zero=True)
        _positive("bandwidth_gbps", entry["bandwidth_gbps"])
    except UsageError as exc:
        raise bad(f"{where}: {exc}") from None
    ends = [entry["from"], entry["to"]]
    length = max((len(end) for end in ends if isinstance(end, list)), default=1)
    for end in ends:
        if isinstance(end, list) and len(end) != length:
            raise bad(f"{where}: 'from' and 'to' lists must have the same length")
    pairs = list(zip(*(end if isinstance(end, list) else [end] * length for end in ends)))
    for src, dst in pairs:
        for v in (src, dst):
            if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, int) and not 0 <= v < n):
                raise bad(f"{where}: {v!r} is neither a rank (0..{n - 1}) nor a switch name")
        if src == dst:
            raise bad(f"{where}: a link from {src!r} to itself")
    return pairs

