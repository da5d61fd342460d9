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

Units inside: seconds, bytes, bytes per second. Outside (CLI, TOML): alpha in
microseconds, bandwidth in GB/s = 1e9 bytes/s, the unit nccl-tests reports.
"""
from __future__ import annotations

import heapq
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from msc.errors import UsageError
from msc.ir.ops import PROTOCOLS

GB = 1e9
US = 1e-6


@dataclass(frozen=True)
class Route:
    """The path of a transfer: total latency (s), the rate its unshared links
    allow (bytes/s, inf if none limits it), and the shared links it crosses."""

    alpha: float
    bandwidth: float
    resources: tuple[int, ...]


@dataclass(frozen=True)
class Protocol:
    """How a protocol changes the model, after NCCL: latency as a fraction of
    Simple's, the fraction of link bandwidth that carries data, and the
    pipelining tile (bytes per chunk and iteration) when a plan says 0. The
    defaults, and why, are msc.ir.ops.PROTOCOLS'; a topology file may change them.
    """

    alpha_factor: float
    bandwidth_factor: float
    tile: int


DEFAULT_PROTOCOLS = {p.name: Protocol(p.alpha_factor, p.bandwidth_factor, p.tile) for p in PROTOCOLS.values()}


class Topology:
    """Base class: subclasses implement ``_route(src, dst)`` and register
    shared links with ``_resource(name, bandwidth)``."""

    def __init__(self, name: str, num_ranks: int, *, reduce_gbps: float = math.inf, copy_gbps: float = math.inf,
                 threadblock_gbps: float = math.inf, protocols: dict[str, Protocol] | None = None,
                 gpus_per_node: int | None = None, description: str = ""):
        if type(num_ranks) is not int or num_ranks < 1:
            raise UsageError(f"topology {name!r}: ranks must be an int >= 1, got {num_ranks!r}")
        for what, v in (("reduce_gbps", reduce_gbps), ("copy_gbps", copy_gbps),
                        ("threadblock_gbps", threadblock_gbps)):
            if not (isinstance(v, (int, float)) and v > 0):
                raise UsageError(f"topology {name!r}: {what} must be > 0 (inf: free), got {v!r}")
        self.name = name
        self.num_ranks = num_ranks
        self.gamma = 1.0 / (reduce_gbps * GB)          # s per byte reduced (one operand added)
        self.delta = 1.0 / (copy_gbps * GB)            # s per byte copied locally
        self.threadblock_bandwidth = threadblock_gbps * GB
        self.protocols = dict(DEFAULT_PROTOCOLS)
        self.protocols.update(protocols or {})
        self.gpus_per_node = gpus_per_node
        self.description = description
        self.capacity: list[float] = []                # bytes/s of each shared link
        self.resource_names: list[str] = []
        self._resource_ids: dict[str, int] = {}
        self._routes: dict[tuple[int, int], Route] = {}

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

    def summary(self) -> str:
        return f"{self.name} ({self.num_ranks} ranks){': ' + self.description if self.description else ''}"


class Uniform(Topology):
    """Fully connected, every ordered pair its own link (alpha, bandwidth),
    shared only by transfers between that pair: the classic alpha-beta
    model, in which a rank may send to several peers at once."""

    def __init__(self, num_ranks: int, alpha_us: float, bandwidth_gbps: float, **kw):
        _positive("alpha_us", alpha_us, zero=True)
        _positive("bandwidth_gbps", bandwidth_gbps)
        kw.setdefault("description", f"fully connected, alpha {alpha_us:g} us, {bandwidth_gbps:g} GB/s per pair")
        super().__init__(kw.pop("name", "uniform"), num_ranks, **kw)
        self.alpha, self.bandwidth = alpha_us * US, bandwidth_gbps * GB

    def _route(self, src, dst):
        return Route(self.alpha, math.inf, (self._resource(f"{src}->{dst}", self.bandwidth),))


class Nodes(Topology):
    """Nodes of GPUs behind a switch (NVSwitch, or PCIe switches), joined by
    one NIC per GPU into a non-blocking fabric (rail-optimized fat tree).

    Inside a node a transfer uses the sender's egress port and the
    receiver's ingress port (shared); with ``pcie_switches`` > 1 the GPUs are
    split among PCIe switches and a transfer between switches also crosses
    both switches' uplinks to the CPU (shared). Across nodes it uses the
    sender's NIC out and the receiver's NIC in (shared); the fabric core is
    taken as non-blocking."""

    def __init__(self, name, nodes, gpus_per_node, *, port_gbps, port_alpha_us, nic_gbps=None, nic_alpha_us=None,
                 pcie_switches=1, uplink_gbps=None, uplink_alpha_us=0.0, **kw):
        super().__init__(name, nodes * gpus_per_node, gpus_per_node=gpus_per_node, **kw)
        self.g, self.port, self.port_alpha = gpus_per_node, port_gbps * GB, port_alpha_us * US
        self.nic = (nic_gbps or 0) * GB
        self.nic_alpha = (nic_alpha_us or 0) * US
        self.switches, self.uplink, self.uplink_alpha = pcie_switches, (uplink_gbps or 0) * GB, uplink_alpha_us * US

    def _route(self, src, dst):
        g = self.g
        if src // g != dst // g:
            return Route(self.nic_alpha, math.inf, (self._resource(f"nic{src}.out", self.nic),
                                                    self._resource(f"nic{dst}.in", self.nic)))
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


class Torus(Topology):
    """A rows x cols torus of point-to-point links (a ring when rows == 1),
    each direction its own shared link. Transfers take the shortest way
    around each ring, columns first then rows (dimension order), crossing
    every link on the way (cut-through: one latency per hop, no store and
    forward at intermediate ranks)."""

    def __init__(self, rows: int, cols: int, *, alpha_us: float, bandwidth_gbps: float, **kw):
        name = kw.pop("name", f"ring:{cols}" if rows == 1 else f"torus:{rows}x{cols}")
        super().__init__(name, rows * cols, **kw)
        self.rows, self.cols = rows, cols
        self.alpha, self.bandwidth = alpha_us * US, bandwidth_gbps * GB

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


class Graph(Topology):
    """Ranks and named switches joined by links, from a TOML file. A
    transfer takes the path of least total latency, then fewest links, then
    the lowest vertex numbers (ranks, then switches in order of mention).
    Paths pass through switches, and through other ranks only if
    ``forward`` (ranks that route, as on a torus of router chips; a GPU does
    not forward others' traffic unless an algorithm tells it to)."""

    def __init__(self, name, num_ranks, links, forward=False, **kw):
        super().__init__(name, num_ranks, **kw)
        self.forward = forward
        self.vertex: dict = {r: r for r in range(num_ranks)}
        self.adj: list[list[tuple]] = [[] for _ in range(num_ranks)]
        self._trees: dict[int, dict] = {}
        for a, b, alpha, bw, shared in links:
            ia, ib = self._vertex(a), self._vertex(b)
            lid = f"{a}->{b}#{len(self.adj[ia])}"
            self.adj[ia].append((ib, alpha, bw, shared, lid))

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
            u, (lalpha, lbw, shared, lid) = tree[v]
            alpha += lalpha
            if shared:
                res.append(self._resource(lid, lbw))
            else:
                bw = min(bw, lbw)
            v = u
        return Route(alpha, bw, tuple(reversed(res)))

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
            for v, alpha, bw, shared, lid in self.adj[u]:
                key = (d + alpha, hops + 1, u)
                if v not in dist or key < dist[v]:
                    dist[v] = key
                    tree[v] = (u, (alpha, bw, shared, lid))
                    heapq.heappush(heap, (key[0], key[1], v))
        return tree


def _positive(what, v, zero=False):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v >= 0 if zero else v > 0):
        raise UsageError(f"{what} must be a number {'>= 0' if zero else '> 0'}, got {v!r}")


# -- presets ----------------------------------------------------------------
# H100 SXM numbers (documented assumptions, see the README's topology section):
# NVLink4: 18 links x 25 GB/s = 450 GB/s per direction through NVSwitch; a
# message pays ~2 us with Simple (flag + fence + launch of the step; NCCL's
# ring hardware latency on NVLink is 3.4 us for Simple, 0.47 us for LL). One
# threadblock moves ~40 GB/s (NCCL needs ~16 channels to fill NVLink4). HBM3
# at 3.35 TB/s: a reduction reads two operands and writes one (~1.1 TB/s of
# results), a copy reads one and writes one (~1.7 TB/s).
H100 = dict(reduce_gbps=1100.0, copy_gbps=1650.0, threadblock_gbps=40.0)
NVSWITCH = dict(port_gbps=450.0, port_alpha_us=2.0)
# NDR InfiniBand, 400 Gb/s per NIC: ~48 GB/s of data; GPUDirect RDMA plus the
# proxy thread cost ~8 us per message with Simple (NCCL's ring network
# latency is 14 us for Simple and 2.7 us for LL).
IB = dict(nic_gbps=48.0, nic_alpha_us=8.0)


def nvswitch(**kw) -> Nodes:
    """8 H100 GPUs on NVSwitch."""
    return Nodes("nvswitch", 1, 8, **NVSWITCH, **H100,
                 description="8 H100 on NVSwitch (450 GB/s per GPU and direction, 2 us)", **kw)


def pcie(**kw) -> Nodes:
    """8 GPUs, PCIe Gen4 x16 (~25 GB/s per direction in practice), two PCIe
    switches of 4 GPUs whose x16 uplinks meet at the CPU; ~5 us per message
    (NCCL's ring latency over PCI is 5.7 us for Simple). A100-PCIe class
    compute (HBM2e at 1.9 TB/s), 40 GB/s per threadblock."""
    return Nodes("pcie", 1, 8, port_gbps=25.0, port_alpha_us=5.0, pcie_switches=2, uplink_gbps=25.0,
                 uplink_alpha_us=1.0, reduce_gbps=630.0, copy_gbps=950.0, threadblock_gbps=40.0,
                 description="8 GPUs on two PCIe Gen4 switches (25 GB/s, 5 us)", **kw)


def infiniband(nodes: int, **kw) -> Nodes:
    """``nodes`` NVSwitch nodes of 8 H100, one 400 Gb/s NIC per GPU."""
    return Nodes(f"ib:{nodes}", nodes, 8, **NVSWITCH, **IB, **H100,
                 description=f"{nodes} nodes of 8 H100 (NVSwitch), one 400 Gb/s InfiniBand NIC per GPU", **kw)


RING_LINK = dict(alpha_us=2.0, bandwidth_gbps=50.0)   # one NVLink4 bundle of two links


def ring(n: int, **kw) -> Torus:
    return Torus(1, n, **RING_LINK, description=f"bidirectional ring of {n}, 50 GB/s links, 2 us", **kw)


def torus(rows: int, cols: int, **kw) -> Torus:
    return Torus(rows, cols, **RING_LINK, description=f"{rows}x{cols} torus, 50 GB/s links, 2 us", **kw)


PRESETS = ("nvswitch", "pcie", "ib[:NODES]", "ring[:N]", "torus[:RxC]", "uniform[:N]")


def get_topology(spec: str | None, num_ranks: int | None, *, alpha_us: float | None = None,
                 bandwidth_gbps: float | None = None) -> Topology:
    """A topology for ``num_ranks`` ranks from a preset name, a TOML file, or
    (no spec) the uniform model of ``alpha_us`` and ``bandwidth_gbps``.
    ``num_ranks`` None: as many as the spec names (msc bound)."""
    uniform_args = alpha_us is not None or bandwidth_gbps is not None
    if spec is None or spec.split(":")[0] == "uniform":
        if alpha_us is None or bandwidth_gbps is None:
            raise UsageError("give --topology NAME|FILE, or the uniform model's --alpha-us A and --bandwidth-gbps B")
        n = num_ranks
        if spec and ":" in spec:
            n = _int_arg(spec, spec.split(":", 1)[1])
        if n is None:
            raise UsageError("the uniform model needs a rank count: give --ranks N (or --topology uniform:N)")
        topo = Uniform(n, alpha_us, bandwidth_gbps)
    elif uniform_args:
        raise UsageError("--alpha-us/--bandwidth-gbps describe the uniform model; leave them out with --topology "
                         f"{spec} (or write a TOML topology)")
    elif spec.endswith(".toml") or Path(spec).is_file():
        topo = load_topology(spec)
    else:
        topo = _preset(spec, num_ranks)
    if num_ranks is not None and topo.num_ranks != num_ranks:
        raise UsageError(f"topology {topo.name!r} has {topo.num_ranks} ranks, the plan {num_ranks}")
    return topo


def _int_arg(spec, text):
    if not re.fullmatch(r"\d+", text) or int(text) < 1:
        raise UsageError(f"bad topology {spec!r}: {text!r} is not a positive count")
    return int(text)


def _preset(spec: str, n: int | None) -> Topology:
    name, _, arg = spec.partition(":")
    if n is None and not arg and name in ("ib", "ring", "torus"):
        raise UsageError(f"topology {spec!r} takes its size from the rank count: give --ranks N "
                         f"(or {name}:{dict(ib='NODES', ring='N', torus='RxC')[name]})")
    if name in ("nvswitch", "h100") and not arg:
        return nvswitch()
    if name == "pcie" and not arg:
        return pcie()
    if name == "ib":
        if not arg and n % 8:
            raise UsageError(f"ib: nodes of 8 GPUs, but the plan has {n} ranks")
        return infiniband(_int_arg(spec, arg) if arg else n // 8)
    if name == "ring":
        return ring(_int_arg(spec, arg) if arg else n)
    if name == "torus":
        if arg:
            m = re.fullmatch(r"(\d+)x(\d+)", arg)
            if not m or min(int(m[1]), int(m[2])) < 1:
                raise UsageError(f"bad topology {spec!r}: expected torus:ROWSxCOLS")
            return torus(int(m[1]), int(m[2]))
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        return torus(rows, n // rows)
    raise UsageError(f"unknown topology {spec!r}: expected a TOML file or one of {', '.join(PRESETS)}")


# -- TOML -------------------------------------------------------------------
TOP_KEYS = {"name", "ranks", "description", "reduce_gbps", "copy_gbps", "threadblock_gbps", "gpus_per_node",
            "forward", "link", "protocol"}
LINK_KEYS = {"from", "to", "alpha_us", "bandwidth_gbps", "shared", "duplex"}
PROTOCOL_KEYS = {"alpha_factor", "bandwidth_factor", "tile"}


def load_topology(path: str | Path) -> Graph:
    """A ``Graph`` topology from a TOML file (format: README, "Topologies")."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read topology {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return topology_from_dict(data, source=str(path))


def topology_from_dict(data: dict, source: str = "<topology>") -> Graph:
    def bad(msg):
        return UsageError(f"{source}: {msg}")

    unknown = set(data) - TOP_KEYS
    if unknown:
        raise bad(f"unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(TOP_KEYS))})")
    n = data.get("ranks")
    if type(n) is not int or n < 1:
        raise bad(f"'ranks' must be an int >= 1, got {n!r}")
    links = _links(data.get("link", []), n, bad)
    protocols = _protocols(data.get("protocol", {}), bad)
    kw = {k: data[k] for k in ("reduce_gbps", "copy_gbps", "threadblock_gbps") if k in data}
    gpn = data.get("gpus_per_node")
    if gpn is not None and (type(gpn) is not int or gpn < 1 or n % gpn):
        raise bad(f"'gpus_per_node' must divide ranks ({n}), got {gpn!r}")
    try:
        forward = data.get("forward", False)
        if type(forward) is not bool:
            raise bad(f"'forward' must be true or false, got {forward!r}")
        return Graph(str(data.get("name", Path(source).stem)), n, links, forward, protocols=protocols,
                     gpus_per_node=gpn, description=str(data.get("description", "")), **kw)
    except UsageError as exc:
        raise bad(str(exc)) from None


def _links(entries, n: int, bad) -> list[tuple]:
    """(from, to, alpha s, bandwidth B/s, shared) of each direction of each
    pair of ends of the [[link]] ``entries``."""
    links = []
    for i, entry in enumerate(entries):
        for src, dst in _link_ends(f"link {i + 1}", entry, n, bad):
            shared = entry.get("shared", True)
            alpha, bw = entry["alpha_us"] * US, entry["bandwidth_gbps"] * GB
            links.append((src, dst, alpha, bw, bool(shared)))
            if entry.get("duplex", True):
                links.append((dst, src, alpha, bw, bool(shared)))
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


def _protocols(tables: dict, bad) -> dict:
    """The [protocol.NAME] tables: each protocol's factors, its defaults' where not given."""
    protocols = {}
    for pname, table in tables.items():
        if pname not in DEFAULT_PROTOCOLS or not isinstance(table, dict) or set(table) - PROTOCOL_KEYS:
            raise bad(f"[protocol.{pname}]: protocols are {', '.join(DEFAULT_PROTOCOLS)}, "
                      f"keys {', '.join(sorted(PROTOCOL_KEYS))}")
        base = DEFAULT_PROTOCOLS[pname]
        protocols[pname] = Protocol(float(table.get("alpha_factor", base.alpha_factor)),
                                    float(table.get("bandwidth_factor", base.bandwidth_factor)),
                                    int(table.get("tile", base.tile)))
    return protocols
