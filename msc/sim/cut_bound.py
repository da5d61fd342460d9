"""Lower bounds on a collective's time from the topology alone (``msc
bound``): no plan, in msc's own cost model (msc.sim.simulate), is faster.

Sizes S are nccl-tests sizes (msc.units): the per-rank buffer for
allreduce, broadcast and reduce; the whole gathered array for allgather,
reducescatter and alltoall, whose shards are S/n. For a protocol p, on
its view of the topology (msc.sim.topology.Topology.view: every link's
latency and data rate as p sees them), with launch latency l_p:

    bound_p(S) = l_p + max( max over cuts A|T:   D(A) / C_p(A) + alpha_p(T->A),
                            [allreduce] max over partitions P:  2(|P|-1) s(P) S / C_p(P) + alpha_p(P),
                            L_p )

(s(P) = 1 but where switch ops may help: "Switch" below), and the
topology's bound is the smallest bound_p over its protocols (a plan uses
one of them; every plan of p pays l_p).

Cuts. A cut splits the ranks into a receiving side A of k ranks and the
rest T. D(A) is what must cross from T to A whatever the algorithm does:
    allgather      (n-k) S/n   the shards A lacks (once each: inside A they may be forwarded)
    reducescatter      k S/n   A's shards of the result depend on T's inputs (T may pre-reduce)
    alltoall     k (n-k) S/n   every pair's own data
    allreduce              S   every element of A's result depends on T's inputs
    broadcast              S   if the root is in T (else 0)
    reduce                 S   if the root is in A (else 0)
C(A) is the capacity of a set of shared links that every route from T to A
crosses. Max-min sharing never gives a link more than its capacity (as the
protocol sees it), and every byte into A passes one of them, so the
transmissions into A take D/C_p at least; the last one then arrives a route latency later,
at least alpha(T->A), the smallest latency of a route into A. A link that is
not shared (TOML ``shared = false``) caps each transfer, not their sum: a
route over such links alone makes C(A) infinite (the term is one latency).

Partitions (allreduce only; for the other collectives the demand of a
partition is the sum of its parts' own cuts, never more than their max).
Take the parts as persons and the messages between parts as calls: every
part must learn every element's sum, and one-way gossip among m persons
takes 2(m-1) calls (a timed schedule serializes into calls in order of
sending without anyone learning less). So 2(m-1) S bytes cross between
parts, through links of capacity C(P) in all (a set every route between
parts crosses: their first, or last, shared links, or the union of each
part's own min cut). On n ranks with a port of bandwidth B each this is
the classic 2(n-1)/n S/B.

Latency. L is the longest shortest path in route latencies (a rank may
relay): between any two ranks for allgather, reducescatter, allreduce and
alltoall, from the root for broadcast, to the root for reduce. A rank may
send to all its peers at once, so log2(n) rounds is no bound in this model:
every rank sending its data to every other is one hop.

Which cuts, per topology (msc.sim.topology):
- uniform: C = k(n-k) B for any k ranks; all k. Exact.
- nvswitch, pcie, ib:N (Nodes): a node's switch(es) and the NIC fabric are
  hubs; C depends only on how many ranks of each switch A holds, a concave
  function of those counts, so for each k its least value is at an extreme
  point: whole switches and one part of a switch, the first k ranks. Exact
  for one node or one switch per node (every preset); with several of
  both, whole switches may also spread over nodes, so it is certified.
- ring, torus: C = the links from T to A. A torus is as edge-connected as
  its degree, so one rank in (or out) is a smallest cut, which settles
  every collective but alltoall; alltoall's are bisection bands (the first
  k ranks by rows, or by columns). Exact; alltoall checked against every
  cut up to 16 ranks (tests/test_bound.py).
- a TOML graph, or any other topology: C(A) is the min cut between T's and
  A's ends of the routes from T to A in a graph of their shared links
  (max-flow; exact where routes cross at most two shared links), over every
  cut up to ALL_CUTS ranks, beyond that over single ranks, their complements,
  nodes (gpus_per_node) and aligned blocks of 2^j ranks: any cut gives a
  valid bound, so this is a certified bound, not always the best. Over
  ROUTE_CUT_RANKS ranks a TOML graph's cuts (the same sides) take the links
  at each side's edge instead of the routes' min cut, and the latency the
  farthest rank from and to the root (_link_model): links x log ranks of
  work where the routes' all pairs and per-cut max-flows grow as n^3.
The exactness is of the data/capacity part: a cut with a slightly larger
capacity but a longer latency into it may add a little (at most alpha).

Switch (NVLS). Where the view's plans may have switch ops (switch_plans:
a topology with nvls_bandwidth R, one switch per node, the Simple
protocol; the simulator refuses them elsewhere), the terms above become
(_with_switch):
- In the simulator a switch op is a flow over its group's NVLink ports,
  the very links NVLink transfers use (capacity P each way), a switch byte
  weighing P/R on its port (msc.sim.simulate.Simulator._switch_flows): per
  byte of its chunk, a reduce-load by rank a on a group G of m ranks moves
  one byte out of every member's port and one into a's; a store by a, one
  out of a's and one into every member's. So a port carries at most
  max(P, R) bytes/s each way, transfers and switch bytes together, and
  every byte of information into a side A of a cut still crosses the
  cut's ports (a reduce-load's sum enters the reader's port; what leaves T
  leaves through T's ports, the switch reading T's copies or T storing):
  the cut terms hold with each capacity taken max(1, R/P) times (on the
  presets R < P: unchanged).
- The partitions whose parts are nodes (or groups of them) hold as they
  are: a switch group lies inside one node, so between parts only
  messages move. The partition of every rank into its own part does not:
  one switch op informs many ranks. Per element, take the switch ops as
  calls: a reduce-load on m ranks is m - 1 one-way calls into the reader
  (it learns what each member knew), a store m - 1 calls out of the writer
  (the fused op both), a message one call. Serialized, they form a one-way
  gossip among the n ranks in which nobody learns less, so they number at
  least 2(n-1). A message costs its two ports' crossings (2 P-bytes: out
  and in); a switch op on m ranks, m + 1 crossings of P/R P-bytes each, for
  m - 1 calls: per call at least min(2, (M+1) P / ((M-1) R)) P-bytes, M
  the largest group (the GPUs of a node). Every P-byte (or NIC byte) takes
  its port (or NIC) for 1/P (1/NIC) s, and the ranks' ports and NICs carry
  n (P + NIC) bytes/s each way: so the partition's 2(n-1) S bytes over its
  capacity n (P + NIC) hold scaled by min(1, (M+1) P / (2 (M-1) R))
  (_switch_scale). On one node of 8 H100 (P = 369, R = 308 GB/s with
  Simple) that is 0.770: (n+1) S / (n R), what NVLS allreduce moves, so
  the bound meets the library's nvls plan at large sizes.
- Every switch plan pays two barriers' latency per call (the simulator
  puts them in its launch), so no term's latency need exceed 2 barriers:
  each cut's, partition's and path's latency is capped there (on the
  presets the barriers' 14 us is no less than any of them: unchanged).

Not counted, so the bound stays valid and only gets looser: reductions and
copies (gamma, delta), the threadblock's rate, slots, tiles, the switch's
per-op latency.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from msc.dsl.collectives import COLLECTIVE_NAMES as COLLECTIVES, COLLECTIVES as SPECS, ROOTED, collective_spec
from msc.errors import UsageError
from msc.sim.topology import GB, Graph, Nodes, Topology, Torus, Uniform, _scaled

ALL_CUTS = 12          # TOML topologies up to this many ranks: every cut (2^n - 2 max-flows)
ROUTE_CUT_RANKS = 64   # TOML topologies over this many ranks: cuts at the sides' own links (_link_model)


@dataclass(frozen=True)
class Cut:
    """A receiving side A of ``k`` ranks; ``root_in``: where the root may be
    (both, on a symmetric topology: some cut of equal capacity has it on
    either side); ``capacity``: bytes/s of the links every route into A
    crosses (inf: none shared); ``alpha``: the least route latency into A (s)."""

    k: int
    root_in: tuple[bool, ...]
    capacity: float
    alpha: float
    label: str


@dataclass(frozen=True)
class Partition:
    """Ranks in ``parts`` parts; ``capacity``: links every route between
    parts crosses; ``alpha``: the least latency of such a route."""

    parts: int
    capacity: float
    alpha: float
    label: str
    demand_scale: float = 1.0   # of the gossip's 2(parts-1) S: less where the switch reduces (_switch_scale)


@dataclass(frozen=True)
class CutModel:
    """What the bound needs of a topology. ``latency``: the longest shortest
    path (s) between any two ranks, from the root, to the root; with labels."""

    num_ranks: int
    cuts: tuple[Cut, ...]
    partitions: tuple[Partition, ...]
    latency: tuple[float, float, float]
    latency_labels: tuple[str, str, str]
    exact: bool


@dataclass(frozen=True)
class Bound:
    size: int                # bytes (nccl-tests)
    seconds: float
    bandwidth: float         # the cut (or partition) term, s
    latency: float           # the latency term, s
    term: str                # "bandwidth", "latency" or "none" (nothing to move)
    limit: str               # the cut, or the path, that sets it
    protocol: str            # the protocol whose bound is the smallest
    launch: float = 0.0      # its launch latency (s), in seconds


def collective_name(spec: str) -> str:
    """The collective's name as msc.dsl.collectives spells it ("reduce-scatter": reducescatter)."""
    return collective_spec(spec, refusal="no bound for collective").name


def demand(collective: str, n: int, k: int, root_in: bool) -> float:
    """Bytes that must cross into a side of k ranks, per byte of size (the registry's)."""
    return SPECS[collective].demand(n, k, root_in)


def nccl_size(collective: str, n: int, size: int, itemsize: int) -> tuple[int, int]:
    """(size rounded down to whole elements per rank, count) as nccl-tests."""
    per = max(SPECS[collective].units(n)) * itemsize
    count = size // per
    return count * per, count


def lower_bound(collective: str, topology: Topology, sizes: list[int], *, root: int = 0,
                protocols: tuple[str, ...] | None = None, cuts=None, switch: bool = True) -> list[Bound]:
    """The bound at each size (bytes, nccl-tests; not rounded here): the
    least over ``protocols`` (default: the topology's) of each protocol's
    bound on its view of the topology, launch latency included. ``cuts``:
    the function giving a view's CutModel (default cut_model). ``switch``
    False: the bound of plans without switch ops (links only)."""
    collective = collective_name(collective)
    n = topology.num_ranks
    if collective in ROOTED and not (type(root) is int and 0 <= root < n):
        raise UsageError(f"root {root!r} is not a rank of topology {topology.name!r} (0..{n - 1})")
    names = tuple(topology.protocols) if protocols is None else tuple(protocols)
    for s in sizes:
        if type(s) is not int or s < 0:
            raise UsageError(f"sizes must be ints >= 0, got {s!r}")
    terms = [_protocol_terms(collective, topology.view(p), root, cuts or cut_model, switch) for p in names]
    out = []
    for size in sizes:
        if size == 0 or n == 1:
            out.append(Bound(size, 0.0, 0.0, 0.0, "none", "-", names[0]))
            continue
        best = None
        for name, (per_byte, alpha, labels, L, L_label, launch) in zip(names, terms):
            data = per_byte * size
            cut = data + alpha
            i = int(np.argmax(cut)) if len(cut) else -1
            bw = float(cut[i]) if i >= 0 else 0.0
            if bw > L:          # the cut's term; "latency" where its one hop outweighs its data
                term, limit = ("bandwidth" if data[i] >= alpha[i] else "latency"), labels[i]
            else:
                term, limit = "latency", L_label
            b = Bound(size, launch + max(bw, L), bw, L, term, limit, name, launch)
            if best is None or b.seconds < best.seconds:
                best = b
        out.append(best)
    return out


def _protocol_terms(collective: str, view: Topology, root: int, cuts, switch: bool = True):
    """(s per byte of size, latency, label per cut; the latency term and its
    label; the launch latency) of one protocol's view of a topology."""
    model = cuts(view, root if collective in ROOTED else 0)
    if switch and switch_plans(view):
        model = _with_switch(view, model)
    coef, cap, alpha, labels = _constraints(collective, model)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_byte = np.where(np.isinf(cap), 0.0, coef / cap)
    if np.any(cap <= 0):
        bad = labels[int(np.argmax(cap <= 0))]
        raise UsageError(f"topology {view.name!r}: no route into one side of the cut {bad}: "
                         f"no {collective} can complete")
    which = SPECS[collective].latency
    if which is None:                    # only neighbours exchange: the cuts' least route latencies bound it
        return per_byte, alpha, labels, 0.0, "-", view.launch
    L, L_label = model.latency[which], model.latency_labels[which]
    if math.isinf(L):
        raise UsageError(f"topology {view.name!r}: some rank cannot reach another ({L_label}): "
                         f"no {collective} can complete")
    return per_byte, alpha, labels, L, L_label, view.launch


def _constraints(collective: str, model: CutModel):
    """Per cut (and root side) and partition: bytes per byte of size, capacity, latency, label."""
    n = model.num_ranks
    rows = []
    for c in model.cuts:
        d = max(demand(collective, n, c.k, r) for r in c.root_in)
        if d > 0:
            rows.append((d, c.capacity, c.alpha, c.label))
    across = SPECS[collective].partition_demand
    if across is not None:
        rows += [(across(p.parts) * p.demand_scale, p.capacity, p.alpha, p.label)
                 for p in model.partitions if p.parts > 1]
    coef = np.array([r[0] for r in rows], dtype=float)
    cap = np.array([r[1] for r in rows], dtype=float)
    alpha = np.array([r[2] for r in rows], dtype=float)
    return coef, cap, alpha, [r[3] for r in rows]


# -- cut models ----------------------------------------------------------------
def cut_model(topology: Topology, root: int = 0) -> CutModel:
    """The cuts to try and the latencies of ``topology`` (root: for a
    topology that is not symmetric, where the root's side matters)."""
    kind = type(topology)
    if kind is Uniform:
        return _uniform(topology)
    if kind is Nodes and topology.g % topology.switches == 0:
        return _nodes(topology)
    if kind is Torus:
        return _torus(topology)
    if kind is Graph and topology.num_ranks > ROUTE_CUT_RANKS:
        return _link_model(topology, root)
    return _routes_model(topology, root)


def _links_text(counts: dict[str, int], capacity: float) -> str:
    parts = [f"{c} {kind}{'s' if c > 1 else ''}" for kind, c in counts.items() if c]
    return f"{' + '.join(parts) or 'no shared link'}: {capacity / GB:g} GB/s"


def _side_text(k: int, n: int, unit: str = "rank", per: int = 1) -> str:
    """A symmetric topology's cut by its sizes (any k ranks will do)."""
    if k == 1:
        return "1 rank in"
    if k == n - 1:
        return "1 rank out"
    if per > 1 and k % per == 0:
        a, b = k // per, (n - k) // per
        return f"{a} {unit}{'s' if a > 1 else ''} | {b}"
    return f"{k} ranks | {n - k}"


def _uniform(t: Uniform) -> CutModel:
    n, bw, a = t.num_ranks, t.bandwidth, t.alpha
    cuts = tuple(Cut(k, (False, True), k * (n - k) * bw, a,
                     f"{_side_text(k, n)} ({_links_text({'link': k * (n - k)}, k * (n - k) * bw)})")
                 for k in range(1, n))
    every = n * (n - 1)
    parts = (Partition(n, every * bw, a, f"every rank out ({_links_text({'link': every}, every * bw)})"),)
    lat = a if n > 1 else 0.0
    label = f"one hop of {a * 1e6:g} us"
    return CutModel(n, cuts, parts if n > 1 else (), (lat, lat, lat), (label,) * 3, True)


def _nodes(t: Nodes) -> CutModel:
    """Nodes of g GPUs: per node a switch (or G PCIe switches under a CPU),
    and a fabric of NICs across nodes. The min cut of each hub is taken on
    the side that costs less (per node, the CPU's side is tried both ways)."""
    n, g, N, per, G = _node_sizes(t)
    cuts = tuple(_nodes_cut(t, k) for k in range(1, n))
    # latencies: a representative of up to 3 nodes has every kind of path a longer one has
    m = min(N, 3) * g
    exact = N == 1 or G == 1        # else whole switches may also spread over nodes: not all such cuts are tried
    rank = np.arange(m)
    node, grp = rank // g, rank % g // per
    pa, ua, na = t.port_alpha, t.uplink_alpha, t.nic_alpha
    lat = np.where(node[:, None] != node[None, :], na, np.where(grp[:, None] != grp[None, :], pa + ua, pa))
    np.fill_diagonal(lat, 0.0)
    far = float(_shortest(lat).max()) if m > 1 else 0.0
    label = f"farthest ranks: {far * 1e6:g} us"
    return CutModel(n, cuts, _nodes_partitions(t), (far, far, far), (label,) * 3, exact)


def switch_plans(t: Topology) -> bool:
    """Whether plans with switch ops (NVLS) run on this view of a topology
    (as msc.sim.simulate.Simulator._switch_flows accepts them): a switch
    that reduces, one per node, and a protocol switch ops run with (a
    topology that is no protocol's view: any)."""
    from msc.lower.switch import SWITCH_PROTOCOLS

    return (isinstance(t, Nodes) and t.nvls_bandwidth > 0 and t.switches == 1 and t.g > 1
            and (t.protocol_name is None or t.protocol_name in SWITCH_PROTOCOLS))


def _switch_scale(t: Nodes) -> float:
    """The share of one-way gossip's 2(n-1) S that the ranks' ports must
    carry where switch ops may replace messages (module doc, "Switch"):
    min(1, (M + 1) P / (2 (M - 1) R)) for groups of up to M ranks, port
    rate P, switch rate R per port and direction."""
    m = min(t.g, t.num_ranks)
    return min(1.0, (m + 1) * t.port / (2 * (m - 1) * t.nvls_bandwidth))


def _with_switch(t: Nodes, model: CutModel) -> CutModel:
    """``model`` (any cut model of ``t``) made a bound for switch plans too
    (module doc, "Switch"): a port carries at most max(P, R) bytes/s each
    way (where R > P, every cut's capacity is taken R / P times larger);
    "every rank out" carries _switch_scale of the gossip's bytes; and no
    term's latency is above the two barriers every switch plan pays."""
    floor = 2 * t.nvls_barrier
    ratio = max(1.0, t.nvls_bandwidth / t.port)
    cuts = tuple(replace(c, capacity=c.capacity * ratio, alpha=min(c.alpha, floor)) for c in model.cuts)
    scale = _switch_scale(t)
    parts = tuple(replace(p, alpha=min(p.alpha, floor), demand_scale=scale,
                          label=f"{p.label}, the switch reducing: {scale:.3g} of its bytes")
                  if p.parts == t.num_ranks else replace(p, alpha=min(p.alpha, floor)) for p in model.partitions)
    lat = tuple(min(x, floor) for x in model.latency)
    labels = tuple(lbl if x <= floor else f"a switch plan's two barriers: {floor * 1e6:g} us"
                   for lbl, x in zip(model.latency_labels, model.latency))
    return CutModel(model.num_ranks, cuts, parts, lat, labels, model.exact)


def _node_sizes(t: Nodes) -> tuple[int, int, int, int, int]:
    """Ranks, GPUs per node, nodes, GPUs per switch, switches per node."""
    n, g = t.num_ranks, t.g
    per = g // t.switches
    return n, g, n // g, per, g // per


def _nodes_cut(t: Nodes, k: int) -> Cut:
    """The cut of ``k`` ranks, filled node by node and switch by switch,
    from the rest."""
    n, g, N, per, G = _node_sizes(t)
    port, up, nic = t.port, t.uplink, t.nic
    pa, ua, na = t.port_alpha, t.uplink_alpha, t.nic_alpha
    split = k % g                     # ranks of the node the cut splits on its first side
    counts = {"port": 0, "uplink": 0, "NIC": min(k, n - k) if N > 1 else 0}
    alphas = [na] if N > 1 else []
    if split:
        inside = [min(max(split - switch * per, 0), per) for switch in range(G)]   # per switch: GPUs in
        outside = [per - x for x in inside]
        if G == 1:
            counts["port"] = min(split, g - split)
        else:
            counts["port"], counts["uplink"] = _cheapest_switch_cut(inside, outside, port, up)
        if any(x and y for x, y in zip(inside, outside)):
            alphas.append(pa)                                   # a switch with GPUs on both sides
        if any(x and y for sw_in, x in enumerate(inside) for sw_out, y in enumerate(outside) if sw_in != sw_out):
            alphas.append(pa + ua)                              # GPUs on both sides under different switches
    cap = counts["port"] * port + counts["uplink"] * up + counts["NIC"] * nic
    label = f"{_side_text(k, n, 'node', g)} ({_links_text(counts, cap)})"
    return Cut(k, (False, True), cap, min(alphas), label)


def _cheapest_switch_cut(inside: list[int], outside: list[int], port: float, up: float) -> tuple[int, int]:
    """(ports, uplinks) a node's cut crosses, with ``inside``/``outside``
    GPUs of each switch on either side, the CPU on the side that costs less."""
    best = None
    for cpu_in_a in (False, True):
        ports = ups = 0
        for x, y in zip(inside, outside):
            # switch on T's side: its ports into A (and its uplink, if the CPU is in A);
            # on A's side: the ports from T into it (and its downlink, if the CPU is in T)
            to_a, to_t = x * port + cpu_in_a * up, y * port + (not cpu_in_a) * up
            ports += x if to_a <= to_t else y
            ups += (cpu_in_a if to_a <= to_t else not cpu_in_a)
        if best is None or ports * port + ups * up < best[0] * port + best[1] * up:
            best = (ports, ups)
    return best


def _nodes_partitions(t: Nodes) -> tuple[Partition, ...]:
    """Every rank, every node and every switch cut out from all others."""
    n, g, N, per, G = _node_sizes(t)
    port, up, nic = t.port, t.uplink, t.nic
    pa, ua, na = t.port_alpha, t.uplink_alpha, t.nic_alpha
    parts = []
    if n > 1:
        counts = {"port": n if g > 1 else 0, "NIC": n if N > 1 else 0}
        cap = counts["port"] * port + counts["NIC"] * nic
        alpha = min(([pa] if per > 1 else []) + ([pa + ua] if G > 1 else []) + ([na] if N > 1 else []))
        parts.append(Partition(n, cap, alpha, f"every rank out ({_links_text(counts, cap)})"))
    if N > 1 and g > 1:
        parts.append(Partition(N, n * nic, na, f"every node out ({_links_text({'NIC': n}, n * nic)})"))
    if G > 1 and per > 1:
        counts = {"port": N * g if g * port <= G * up else 0, "uplink": 0 if g * port <= G * up else N * G,
                  "NIC": n if N > 1 else 0}
        cap = counts["port"] * port + counts["uplink"] * up + counts["NIC"] * nic
        parts.append(Partition(N * G, cap, min([pa + ua] + ([na] if N > 1 else [])),
                               f"every switch out ({_links_text(counts, cap)})"))
    return tuple(parts)


def _torus(t: Torus) -> CutModel:
    R, C, n, bw = t.rows, t.cols, t.num_ranks, t.bandwidth
    links = set()
    for u in range(n):
        r, c = divmod(u, C)
        if C > 1:
            links |= {(u, r * C + (c + 1) % C), (u, r * C + (c - 1) % C)}
        if R > 1:
            links |= {(u, (r + 1) % R * C + c), (u, (r - 1) % R * C + c)}
    U = np.array([u for u, _ in sorted(links)], dtype=np.int64)
    V = np.array([v for _, v in sorted(links)], dtype=np.int64)
    orders = [("row", np.arange(n))]
    if R > 1 and C > 1:
        orders.append(("column", np.array([r * C + c for c in range(C) for r in range(R)])))
    cuts = []
    for name, order in orders:
        pos = np.empty(n, dtype=np.int64)
        pos[order] = np.arange(n)
        ks = np.arange(1, n)
        # link u -> v enters the first k ranks in this order where pos[v] < k <= pos[u]: count per k
        # by differences (O(n), where a k x links table took 931 GiB at a million ranks)
        pu, pv = pos[U], pos[V]
        into = pv < pu
        starts = np.bincount(pv[into] + 1, minlength=n + 1) - np.bincount(pu[into] + 1, minlength=n + 1)
        count = np.cumsum(starts)[1:n]
        line = C if name == "row" else R
        for k, c in zip(ks.tolist(), count.tolist()):
            cap = c * bw if c else math.inf
            side = _side_text(k, n, name, line) if R > 1 and C > 1 else _side_text(k, n)
            cuts.append(Cut(k, (False, True), cap, t.alpha, f"{side} ({_links_text({'link': c}, c * bw)})"))
    every = len(links)
    parts = (Partition(n, every * bw, t.alpha, f"every rank out ({_links_text({'link': every}, every * bw)})"),) \
        if links else ()
    hops = R // 2 + C // 2
    far = hops * t.alpha
    label = f"farthest ranks: {hops} hop{'s' if hops != 1 else ''}, {far * 1e6:g} us"
    return CutModel(n, tuple(cuts), parts, (far, far, far), (label,) * 3, True)


# -- any topology, by its routes -------------------------------------------------------
def _routes_model(t: Topology, root: int) -> CutModel:
    n = t.num_ranks
    routes = {}
    for s in range(n):
        for d in range(n):
            if s != d:
                try:
                    routes[s, d] = t.route(s, d)
                except UsageError:                   # no path: no message can go that way
                    pass
    lat = np.full((n, n), math.inf)
    np.fill_diagonal(lat, 0.0)
    for (s, d), r in routes.items():
        lat[s, d] = r.alpha
    dist = _shortest(lat)
    i, j = np.unravel_index(int(np.argmax(dist)), dist.shape)
    pairs = ((int(i), int(j)), (root, int(np.argmax(dist[root]))), (int(np.argmax(dist[:, root])), root))
    far = tuple(float(dist[p]) for p in pairs)
    labels = tuple(f"rank {a} -> rank {b}: {v * 1e6:g} us" if math.isfinite(v) else f"no path from rank {a} to rank {b}"
                   for (a, b), v in zip(pairs, far))
    cuts = tuple(_route_cut(t, routes, side, root) for side in _sides(n, t.gpus_per_node))
    parts = []
    if n > 1:
        parts.append(_route_partition(t, routes, list(range(n)), n, "every rank out"))
    g = t.gpus_per_node
    if g and 1 < g < n:
        parts.append(_route_partition(t, routes, [r // g for r in range(n)], n // g, "every node out"))
    return CutModel(n, cuts, tuple(p for p in parts if p is not None), far, labels, n <= ALL_CUTS)


def _link_model(t: Graph, root: int) -> CutModel:
    """A large TOML graph's cut model from its links, in O(links x log ranks)
    where _routes_model's all-pairs routes and cuts grow as n^3 (a 512-rank
    star took 94 s). A route from T to A leaves T's ranks by a link out of
    one of them and enters A's ranks by a link into one, so the shared links
    out of T, and those into A, are each a set every route crosses (none if
    one of them is not shared); the least latency of a link into A is no more
    than any route's into it. Sides as _sides. Latency: the farthest rank
    from the root and to it on paths through any vertex, which no chain of
    routes beats. A certified bound: a cut's capacity may exceed the routes'
    min cut (a bottleneck inside the network is not seen)."""
    n = t.num_ranks
    e = _edges(t)
    src_rank, dst_rank = e["src"] < n, e["dst"] < n
    cuts = []
    sizes = sorted({1 << j for j in range(n.bit_length()) if 1 << j < n}
                   | ({t.gpus_per_node} if t.gpus_per_node and t.gpus_per_node < n else set()))
    into_rank_alpha = float(e["alpha"][dst_rank].min()) if dst_rank.any() else math.inf
    for size in sizes:
        m = n // size                                        # whole aligned blocks of this size
        bs = np.where(src_rank, e["src"] // size, -1)
        bd = np.where(dst_rank, e["dst"] // size, -1)
        cross = bs != bd
        per = {}
        for name, sel, block in (("in", cross & (bd >= 0) & (bd < m), bd), ("out", cross & (bs >= 0) & (bs < m), bs),
                                 ("rank_out", src_rank & ~dst_rank & (bs < m), bs),
                                 ("switch_in", ~src_rank & dst_rank & (bd < m), bd),
                                 ("in_from_rank", cross & src_rank & dst_rank & (bd < m), bd),
                                 ("out_to_rank", cross & src_rank & dst_rank & (bs < m), bs)):
            per[name] = _per_block(e, sel, block, m)
        whole = {name: _per_block(e, sel, np.zeros(len(sel), dtype=np.int64), 1)
                 for name, sel in (("rank_out", src_rank & ~dst_rank), ("switch_in", ~src_rank & dst_rank))}
        alpha_in = np.full(m, math.inf)
        sel = cross & (bd >= 0) & (bd < m)
        np.minimum.at(alpha_in, bd[sel], e["alpha"][sel])
        for b in range(m):
            block = frozenset(range(b * size, (b + 1) * size))
            # A = the block: links into it; or links out of the other ranks (to a switch, or into the block)
            options = [_pick(per["in"], b), _add(_sub(_pick(whole["rank_out"], 0), _pick(per["rank_out"], b)),
                                                 _pick(per["in_from_rank"], b))]
            cuts.append(_link_cut(n, block, options, alpha_in[b], root))
            if size < n - 1 or size == 1:
                rest = frozenset(range(n)) - block
                # A = the rest: links into it (from a switch, or from the block); or links out of the block
                options = [_add(_sub(_pick(whole["switch_in"], 0), _pick(per["switch_in"], b)),
                                _pick(per["out_to_rank"], b)), _pick(per["out"], b)]
                cuts.append(_link_cut(n, rest, options, into_rank_alpha, root))
    parts = []
    if n > 1:
        everyone = np.zeros(len(e["src"]), dtype=np.int64)
        options = [_pick(_per_block(e, src_rank, everyone, 1), 0), _pick(_per_block(e, dst_rank, everyone, 1), 0)]
        cap, links = _cheaper(options)
        parts.append(Partition(n, cap, into_rank_alpha, f"every rank out ({_links_text({'link': links}, cap)})"))
    far_from, far_to = _farthest(t, e, root, reverse=False), _farthest(t, e, root, reverse=True)
    far = (max(far_from[0], far_to[0]), far_from[0], far_to[0])
    labels = (f"rank {root} -> rank {far_from[1]}, or back: at least {far[0] * 1e6:g} us",
              f"rank {root} -> rank {far_from[1]}: at least {far[1] * 1e6:g} us",
              f"rank {far_to[1]} -> rank {root}: at least {far[2] * 1e6:g} us")
    return CutModel(n, tuple(cuts), tuple(parts), far, labels, False)


def _edges(t: Graph) -> dict[str, np.ndarray]:
    """The graph's links as arrays (src, dst, alpha, capacity, shared), scaled for the view's protocol."""
    rows = []
    for u, out in enumerate(t.adj):
        for v, alpha, bw, shared, _, kind in out:
            if t._model is not None:
                alpha, bw = _scaled(t._model, kind, alpha, bw)
            rows.append((u, v, alpha, bw, shared))
    src, dst, alpha, cap, shared = zip(*rows) if rows else ((), (), (), (), ())
    return {"src": np.array(src, dtype=np.int64), "dst": np.array(dst, dtype=np.int64),
            "alpha": np.array(alpha, dtype=float), "cap": np.array(cap, dtype=float),
            "shared": np.array(shared, dtype=bool), "nv": len(t.adj)}


def _per_block(e: dict, sel: np.ndarray, block: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block, over the links ``sel`` picks: (shared capacity, links, links not shared)."""
    b = block[sel]
    return (np.bincount(b, weights=e["cap"][sel] * e["shared"][sel], minlength=m)[:m],
            np.bincount(b, minlength=m)[:m], np.bincount(b, weights=~e["shared"][sel], minlength=m)[:m])


def _pick(sums, b):
    return tuple(float(x[b]) for x in sums)


def _add(a, b):
    return tuple(x + y for x, y in zip(a, b))


def _sub(a, b):
    return tuple(x - y for x, y in zip(a, b))


def _cheaper(options: list[tuple]) -> tuple[float, int]:
    """(capacity, links) of the cheaper link set; one with a link not shared caps no sum: infinite."""
    return min((math.inf if round(unshared) else cap, int(round(count))) for cap, count, unshared in options)


def _link_cut(n: int, side: frozenset, options: list[tuple], alpha: float, root: int) -> Cut:
    """The cut of ``side`` by the cheaper of ``options`` (capacity, links, unshared links: infinite if any)."""
    cap, links = _cheaper(options)
    rest = n - len(side)
    where = (f"rank {min(side)} in" if len(side) == 1 else
             f"rank {min(set(range(n)) - side)} out" if rest == 1 else
             f"ranks {_ranks_text(side)} | {_ranks_text(set(range(n)) - side)}")
    text = _links_text({'link': links}, cap) if math.isfinite(cap) else "a link not shared"
    return Cut(len(side), (root in side,), cap, alpha, f"{where} ({text})")


def _farthest(t: Graph, e: dict, root: int, reverse: bool) -> tuple[float, int]:
    """(the largest least latency from ``root`` to a rank, or to ``root``
    from one with ``reverse``, on paths through any vertex; that rank)."""
    nv = e["nv"]
    adj = [[] for _ in range(nv)]
    ends = (e["dst"], e["src"]) if reverse else (e["src"], e["dst"])
    for u, v, a in zip(ends[0].tolist(), ends[1].tolist(), e["alpha"].tolist()):
        adj[u].append((v, a))
    dist = [math.inf] * nv
    dist[root] = 0.0
    heap = [(0.0, root)]
    while heap:
        d, u = heapq.heappop(heap)
        if d > dist[u]:
            continue
        for v, a in adj[u]:
            if d + a < dist[v]:
                dist[v] = d + a
                heapq.heappush(heap, (d + a, v))
    ranks = dist[:t.num_ranks]
    far = max(range(t.num_ranks), key=lambda r: (ranks[r], -r))
    return ranks[far], far


def _sides(n: int, g: int | None) -> list[frozenset]:
    """Receiving sides: all of them up to ALL_CUTS ranks, else single ranks,
    their complements, nodes, and aligned blocks of 2^j ranks (with their
    complements): a certified subset."""
    if n <= ALL_CUTS:
        return [frozenset(r for r in range(n) if m >> r & 1) for m in range(1, (1 << n) - 1)]
    found = set()
    sizes = {1 << j for j in range(n.bit_length()) if 1 << j < n} | ({g} if g and g < n else set())
    for size in sizes:
        for start in range(0, n - size + 1, size):
            block = frozenset(range(start, start + size))
            found |= {block, frozenset(range(n)) - block}
    return sorted(found, key=lambda s: (len(s), sorted(s)))


def _ranks_text(ranks) -> str:
    """"0-3,6" for ranks 0, 1, 2, 3 and 6."""
    out, run = [], []
    for r in sorted(ranks):
        if run and r != run[-1] + 1:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        run.append(r)
    out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def _route_cut(t: Topology, routes: dict, side: frozenset, root: int) -> Cut:
    n = t.num_ranks
    crossing = [(s, d) for (s, d) in routes if s not in side and d in side]
    rest = n - len(side)
    where = (f"rank {next(iter(side))} in" if len(side) == 1 else
             f"rank {next(iter(set(range(n)) - side))} out" if rest == 1 else
             f"ranks {_ranks_text(side)} | {_ranks_text(set(range(n)) - side)}")
    if not crossing:
        return Cut(len(side), (root in side,), 0.0, math.inf, f"{where} (no route)")
    alpha = min(routes[p].alpha for p in crossing)
    paths = [routes[p].resources for p in crossing]
    if any(not p for p in paths):
        return Cut(len(side), (root in side,), math.inf, alpha, f"{where} (a route with no shared link)")
    cap, links = _min_cut(paths, t.capacity)
    return Cut(len(side), (root in side,), cap, alpha, f"{where} ({_links_text({'link': len(links)}, cap)})")


def _route_partition(t: Topology, routes: dict, part: list[int], m: int, what: str) -> Partition | None:
    """Links every route between parts crosses, the cheapest of: the routes'
    first shared links, their last ones, and the union over parts of each
    part's min cut in (or out)."""
    between = {(s, d): r for (s, d), r in routes.items() if part[s] != part[d]}
    if not between or any(not r.resources for r in between.values()):
        return None
    sets = [{r.resources[0] for r in between.values()}, {r.resources[-1] for r in between.values()}]
    for into in (True, False):
        links = set()
        for p in set(part):
            paths = [r.resources for (s, d), r in between.items() if (part[d] if into else part[s]) == p]
            links |= set(_min_cut(paths, t.capacity)[1])
        sets.append(links)
    cap, links = min(((sum(t.capacity[x] for x in links), links) for links in sets), key=lambda c: c[0])
    alpha = min(r.alpha for r in between.values())
    return Partition(m, cap, alpha, f"{what} ({_links_text({'link': len(links)}, cap)})")


def _shortest(lat: np.ndarray) -> np.ndarray:
    """All-pairs shortest paths (Floyd-Warshall, a row of numpy per rank)."""
    d = lat.copy()
    for k in range(len(d)):
        np.minimum(d, d[:, k:k + 1] + d[k:k + 1, :], out=d)
    return d


def _min_cut(paths: list[tuple[int, ...]], capacity: list[float]) -> tuple[float, list[int]]:
    """The cheapest set of links meeting every path (each a sequence of link
    ids), as a min cut: each link an edge in -> out of its capacity, a path
    source -> first in, out -> next in, ..., last out -> sink (unbounded).
    Every path is then a source-sink path, so a cut meets each; paths made of
    pieces of several only add constraints (exact for paths of <= 2 links)."""
    node = {}

    def vertex(key):
        if key not in node:
            node[key] = len(node)
        return node[key]

    src, snk = vertex("s"), vertex("t")
    edges = {}
    for p in paths:
        prev = src
        for x in p:
            i, o = vertex(("in", x)), vertex(("out", x))
            edges.setdefault((i, o), capacity[x])
            edges.setdefault((prev, i), math.inf)
            prev = o
        edges.setdefault((prev, snk), math.inf)
    flow, reach = _max_flow(len(node), edges, src, snk)
    links = sorted(x for key, v in node.items() if key[0] == "in"
                   for x in [key[1]] if reach[v] and not reach[node[("out", x)]])
    return flow, links


def _max_flow(nv: int, edges: dict, s: int, t: int) -> tuple[float, list[bool]]:
    """Edmonds-Karp: (max flow value, the source side of a min cut)."""
    to, cap, adj = [], [], [[] for _ in range(nv)]
    for (u, v), c in edges.items():          # edge e and its reverse e ^ 1
        adj[u].append(len(to))
        to.append(v)
        cap.append(c)
        adj[v].append(len(to))
        to.append(u)
        cap.append(0.0)
    # what rounding leaves of a saturated edge is no capacity
    eps = 1e-12 * max([c for c in cap if math.isfinite(c)] + [1.0])
    total = 0.0
    while True:
        back = [-1] * nv
        seen = [False] * nv
        seen[s] = True
        queue = deque([s])
        while queue and not seen[t]:
            u = queue.popleft()
            for e in adj[u]:
                v = to[e]
                if not seen[v] and cap[e] > eps:
                    seen[v] = True
                    back[v] = e
                    queue.append(v)
        if not seen[t]:
            return total, seen
        push, v = math.inf, t
        while v != s:
            e = back[v]
            push = min(push, cap[e])
            v = to[e ^ 1]
        v = t
        while v != s:
            e = back[v]
            cap[e] -= push
            cap[e ^ 1] += push
            v = to[e ^ 1]
        total += push
