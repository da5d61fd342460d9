"""``msc simulate --nccl``: what NCCL would do for a collective on a machine,
and how long msc's model says it takes.

NCCL decides per call: its tuning model (src/graph/tuning.cc) predicts a
time for every algorithm and protocol from a base latency, per-hop
latencies and a bus bandwidth that its topology search found, and takes the
least; enqueue.cc then drops channels for small messages and spreads the
work over channels by its traffic. This module repeats that decision with
NCCL 2.30.7's constants (tag v2.30.7-1; bench/calibration/nccl_model.md
gives each with its file and lines, and what changed since 2.21), builds
the msc plan that does what NCCL's choice does (the library's rail rings,
NCCL's tree, PAT, the switch plans; msc.sim.nccl_sim) and simulates it with
NCCL's pipelining: tiles of NCCL's steps and as many in flight as its
buffers hold. So a prediction here is msc's cost model of NCCL's schedule,
not NCCL's own formula (which is reported beside it, ``nccl_us``).

The algorithms NCCL weighs by default on these machines: Ring and Tree
(allreduce), Ring (the others); NVLS (in-switch reduction) for allreduce on
one node of H100 on NVSwitch, NVLSTree (NVLS inside nodes, NCCL's tree
across) on several, NVLS across nodes needing CollNet (SHARP), which these
presets lack; PAT for allgather and reducescatter with one GPU per node.
NVLS allgather and reducescatter are weighed too, and never win here (their
bandwidth is a GPU's share of the switch, below the ring's).

NCCL's choice is modelled on nodes of H100, A100, H200, H20 or B200 GPUs on
NVSwitch with one NIC per GPU, and on one GB200 NVL72 rack: the presets
(dgx-*, hgx-*, gb200-nvl72) and TOML topologies of that form (``nodes``,
``gpus_per_node``, ``nic_gbps``); ``unmodelled`` says why any other is not.
Blackwell takes NCCL 2.30.7's Blackwell rows; its NVLS (and so NVLSTree) is
not modelled: NCCL's NVLS graph search on SM100's speed arrays and 721.8
GB/s of links is not derived here, so NCCL's choice there is weighed
without it (``_not_here`` says so where it is asked for).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from msc.dsl.collectives import COLLECTIVES as SPECS, ROOTED
from msc.errors import UsageError
from msc.ir.ops import PROTOCOL_NAMES
from msc.sim.topology import Nodes, Topology

# NCCL's algorithms in its own order (NCCL_ALGO_TREE, RING, .., NVLS, NVLS_TREE, PAT): a tie goes to the first
ALGORITHMS = ("tree", "ring", "nvls", "nvlstree", "pat")
SWITCH = ("nvls", "nvlstree")                       # run Simple only, on NCCL's NVLS channels
COLLECTIVES = tuple(name for name, spec in SPECS.items() if spec.nccl)
P2P = ("alltoall", "sendrecv")                      # NCCL's grouped send/receive, not its collectives
KIB, MIB = 1024, 1024 * 1024


def _protos(ll, ll128, simple) -> dict:
    return {"LL": ll, "LL128": ll128, "Simple": simple}


# -- NCCL 2.30.7's constants: tuning.cc@v2.30.7-1 ncclTunerConstantsDefaults (lines 149-211) ---------------
BASE_LAT = {"tree": _protos(6.8, 14.0, 8.4), "ring": _protos(6.6, 14.0, 8.4),          # [2.1] us
            "nvls": _protos(0, 0, 0), "nvlstree": _protos(0, 0, 0), "pat": _protos(8.0, 8.0, 8.0)}
HW_LAT = {  # [2.2] us per hop: link kind -> algorithm -> protocol
    "nvlink": {"tree": _protos(0.6, 1.25, 4.0), "ring": _protos(0.6, 1.9, 3.4), "nvls": _protos(0, 0, 25.0),
               "nvlstree": _protos(0, 0, 25.0), "pat": _protos(0, 0, 4.0)},
    "pcie": {"tree": _protos(1.0, 1.9, 4.0), "ring": _protos(1.0, 2.5, 5.7), "nvls": _protos(0, 0, 0),
             "nvlstree": _protos(0, 0, 0), "pat": _protos(0, 0, 4.0)},
    "net": {"tree": _protos(5.0, 8.5, 14.0), "ring": _protos(2.7, 4.0, 14.0), "nvls": _protos(0, 0, 18.0),
            "nvlstree": _protos(0, 0, 20.9), "pat": _protos(0, 0, 14.0)},
}
NET_OVERHEAD = {"intel": 1.0, "amd": 2.0}                           # [2.2] us per network step, x3 for Simple
LL_MAX_BW = {"hopper": 141.0, "ampere": 87.7}                       # [3.3] GB/s on one node (row: the GPU)
LL_MAX_BW_NODES = {"intel": (39.0, 20.4), "amd": (22.5, 19.0)}      # [3.3] 2 nodes, >= 3 nodes (row: the CPU)
RING_LL128_PER_CHANNEL = {"hopper": 36.7, "ampere": 20.0}           # [3.3] per search channel, any node count
TREE_PER_CHANNEL = {"hopper": (38.7, 41.4, 36.0), "ampere": (24.0, 23.6, 17.8)}        # 1, 2, >= 3 nodes
TREE_LL128_PER_CHANNEL = {"hopper": (36.7, 36.7, 29.0), "ampere": (20.0, 20.0, 20.0)}
NVLSTREE_PER_CHANNEL = {"hopper": (0.0, 57.7, 45.5)}                # [3.3] perChMaxNVLSTreeBws, since v2.28
NVLS_EFFICIENCY = {"hopper": 0.85}                                  # [3.1] tuning.cc:138-144, since v2.28
# Blackwell (tuning.cc@v2.30.7 ncclTunerConstantsDefaults' Blackwell rows: llMaxBws 2 x 141 on one node,
# perChMaxRingLL128Bws, perChMaxTreeBws, perChMaxTreeLL128Bws). Hosts other than x86 (Grace): NCCL takes
# Intel's llMaxBw row (index 0 unless AMD) and a network overhead of 1 us (getNetOverhead's default).
LL_MAX_BW["blackwell"] = 282.0
RING_LL128_PER_CHANNEL["blackwell"] = 40.0
TREE_PER_CHANNEL["blackwell"] = (70.0, 42.8, 24.0)
TREE_LL128_PER_CHANNEL["blackwell"] = (55.6, 31.67, 20.0)
LL_MAX_BW_NODES["arm"] = LL_MAX_BW_NODES["intel"]
NET_OVERHEAD["arm"] = 1.0
PAT_FACTOR = 0.75                                                   # [3.2] PAT's busBw factor, since v2.24
TREE_CORRECTION = {  # [1] index log2(bytes / 64), 64 B .. 256 MB; applied to allreduce below index 23
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
TREE_CORRECTED = 23                                 # tuning.cc:638@2.30: the tree's factor for logSize < 23
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}              # [4.5] ring and tree
ALL_THREADS = 640                                   # NCCL_MAX_NTHREADS: NVLS, NVLSTree, and tree and PAT since 2.30
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}              # [4.5] bytes per thread; ring LL: x ranks
MIN_TRAFFIC_PER_CHANNEL = 32 * KIB                  # [4.5] enqueue.cc:585@2.30 (MinTrafficPerChannel)
# [5] per connection: slots in flight (NCCL_STEPS = 8; a Simple ring slice is 2 steps) and a slice's bytes
SLOTS = {"LL": 8, "LL128": 8, "Simple": 4}
SLICE = {"LL": 32 * KIB, "LL128": 576_000, "Simple": MIB}
STEP = {"LL": 32 * KIB, "LL128": 576_000, "Simple": 512 * KIB}     # one buffer step's data (a tree's chunk)
LL128_GRAIN = 1920                                                 # device.h ncclProtoGrainSize@2.30
# [5] LL and LL128 hand data on a line at a time: each thread (LL: 16-byte lines of 8 data bytes) or
# warp (LL128: 2 KiB of lines, 1,920 data bytes) waits for its own lines' flags and stores them on at
# once (src/device/prims_ll.h, prims_ll128.h GenericOp), so a hop holds data back by one pass of the
# threadblock over its lines, not by a step: 512 threads x 8 B, 20 warps x 1,920 B.
PASS = {"LL": MAX_THREADS["LL"] * 8, "LL128": MAX_THREADS["LL128"] // 32 * LL128_GRAIN}
# NCCL's tree splits a channel's threads (src/device/all_reduce.h runTreeSplit@2.30, 640 threads): Simple
# gives the reduction up half plus 64 (384 of 640), LL and LL128 70% ("receiving from up to 3 sources is
# more compute intensive than sending to 3 dests"): 448; the broadcast down the rest. The root's one op
# (receive, reduce, send back down) has them all. NCCL sizes the split by the work a byte takes each way,
# so that the two keep pace: each direction moves half of what the channel's threadblock moves alone
# (TREE_RATE_SHARE); the broadcast's warps make its pass of lines (TREE_DOWN_THREADS).
TREE_UP_THREADS = {"Simple": 384 / 640, "LL": 448 / 640, "LL128": 448 / 640}
TREE_DOWN_THREADS = {p: 1 - x for p, x in TREE_UP_THREADS.items()}
TREE_RATE_SHARE = 0.5
# NVLS at run time [4.4, 5]: NCCL_NVLS_NCHANNELS 16 on SM90 (nvls.cc:155@2.30), moving NCCL_NVLS_CHUNKSIZE
# bytes per step (128 KiB, nvls.cc:160), NVLSTree at most 64 KiB from 4 nodes on (treeMaxChunkSize, nvls.cc:228).
NVLS_CHANNELS = 16
NVLS_CHUNK = 128 * KIB
PAT_CHUNK = 512 * KIB                               # [5] one Simple step, halved for small calls (enqueue.cc:2299)


@dataclass(frozen=True)
class Graph:
    """What NCCL's topology search finds [4.3]: ``channels`` of ``bw`` GB/s
    each (the model's), and the channels it runs (``runtime``, doubled)."""

    channels: int
    bw: float
    runtime: int


@dataclass(frozen=True)
class NvlsGraph:
    """NCCL's NVLS graph [4.3]: one channel per head GPU, the bandwidth each
    takes off a GPU's NVLink (``intra``) and off its NIC or, on one node,
    the pass-2 speed (``inter``)."""

    channels: int
    intra: float
    inter: float


# [4.3] (derived from search.cc by hand; the single-node graphs match NCCL 2.29.2's printed tuning
# table on H100 and a '24 channels' log on A100; the multi-node ones have no log). Tree graphs take the
# ring's channel count (init.cc: the tree must find as many) and bandwidth. One GPU per node (derived):
# the GPU's PCIe path to its NIC, Gen5 x16 = 48 GB/s (H100) or Gen4 x16 = 24 (A100), is the one channel's
# speed; H100's is split by the channel duplication (bwIntra >= 25), A100's is not.
GRAPHS = {("h100", "node"): Graph(12, 30.0, 24), ("a100", "node"): Graph(12, 20.0, 24),
          ("h100", "nodes"): Graph(8, 45.0, 16), ("a100", "nodes"): Graph(8, 24.0, 16),
          ("h100", "gpu per node"): Graph(2, 24.0, 4), ("a100", "gpu per node"): Graph(1, 24.0, 2)}
# H200 and H20: H100's links as NCCL reads them (18 NVLinks of SM90, PCIe Gen5, 400 Gb/s NICs:
# msc.sim.machines), so H100's graphs. B200 (derived as 4.3 does, NCCL 2.30.7's SM100 arrays and
# 18 x 40.1 = 721.8 GB/s of NVLink): one node 8 x 90 (720), doubled to 16 x 45, 32 at run time; across
# nodes one channel per NIC at the PCIe Gen5 path's 48 (8 x 48 = 384 fits the NVLinks), not doubled
# (48 < 50 with 8 channels), 16 at run time; one GPU per node not derived. A GB200 NVL72 rack: one node
# of 72 such GPUs, the same ring graph as B200's (the NVLinks, not the GPU count, bound it); across racks
# not derived.
GRAPHS.update({(m, kind): GRAPHS["h100", kind] for m in ("h200", "h20") for kind in ("node", "nodes", "gpu per node")})
GRAPHS.update({("b200", "node"): Graph(16, 45.0, 32), ("b200", "nodes"): Graph(8, 48.0, 16),
               ("gb200", "node"): Graph(16, 45.0, 32)})
# The NIC line rate (GB/s) the multi-node graphs are derived for (4.3): another rate is another graph.
GRAPH_NIC_GBPS = {"h100": 50.0, "a100": 25.0, "h200": 50.0, "h20": 50.0, "b200": 50.0}
# [4.2] search.cc's SM90 speed arrays (GB/s per channel): intra-node for one node, inter-node across nodes
SM90_INTRA = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
SM90_INTER = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12)
# [4.1] a GPU's NVLinks to the switch as NCCL counts them, and a 400 Gb/s NIC: H200 and H20 as H100 (18
# SM90 links, NVL[370.8] in nccl issue 1189's H20 dump, NET[50.0])
NVLINK_GBPS = {"h100": 18 * 20.6, "h200": 18 * 20.6, "h20": 18 * 20.6}
NIC_GBPS = {"h100": 50.0, "h200": 50.0, "h20": 50.0}
# GPU generation and host CPU (llMaxBw, network overhead): DGX H100 and DGX H200 have Intel Xeon 8480C,
# DGX A100 AMD EPYC 7742, DGX B200 Intel Xeon 8570 (NVIDIA's datasheets and user guides); HGX H20: Intel
# assumed; GB200: Grace (Arm).
ARCH = {"h100": "hopper", "a100": "ampere", "h200": "hopper", "h20": "hopper", "b200": "blackwell",
        "gb200": "blackwell"}
CPU = {"h100": "intel", "a100": "amd", "h200": "intel", "h20": "intel", "b200": "intel", "gb200": "arm"}


def nvls_graph(machine: str, ppn: int, nodes: int) -> NvlsGraph | None:
    """[4.3] NCCL's NVLS graph on nodes of ``ppn`` GPUs of ``machine`` (None: no NVLS).

    Each of the ``ppn`` heads takes its speed twice off its own GPU's
    NVLinks and once off every other GPU's, so ppn + 1 times the speed must
    fit a GPU's links: the search's first such speed (the intra-node array
    on one node, the inter-node one across nodes) is bwIntra; pass 2 then
    raises bwInter a speed at a time while it is below twice bwIntra, up to
    the array's top (across nodes: while a NIC carries it). H100 on one
    node: 8 x 40 / 60 (matching NCCL's 476 GB/s busbw); across nodes 8 x 40
    / 48."""
    if ARCH.get(machine) not in NVLS_EFFICIENCY or ppn < 2:
        return None
    speeds = SM90_INTRA if nodes == 1 else SM90_INTER
    most = speeds[0] if nodes == 1 else NIC_GBPS[machine]
    intra = next((v for v in speeds if (ppn + 1) * v <= NVLINK_GBPS[machine]), speeds[-1])
    inter = intra
    for v in reversed(speeds):                          # ascending
        if v > inter and inter < 2 * intra and v <= most:
            inter = v
    return NvlsGraph(ppn, intra, inter)


@dataclass(frozen=True)
class System:
    """A machine as NCCL's tuning sees it."""

    machine: str
    ranks: int
    nodes: int
    graph: Graph
    nvls: NvlsGraph | None

    @property
    def arch(self) -> str:
        return ARCH[self.machine]

    @property
    def cpu(self) -> str:
        return CPU[self.machine]

    @property
    def ppn(self) -> int:
        return self.ranks // self.nodes


def system(topology: Topology) -> System:
    """NCCL's view of ``topology``; UsageError where msc has no NCCL model of it."""
    why = unmodelled(topology)
    if why is not None:
        raise UsageError(f"msc cannot model NCCL's choice on {topology.name!r}: {why}")
    machine, nodes = topology.machine, topology.num_ranks // topology.g
    nvls = nvls_graph(machine, topology.g, nodes) if topology.nvls_bandwidth else None
    return System(machine, topology.num_ranks, nodes, GRAPHS[machine, _graph_kind(topology)], nvls)


def _graph_kind(topology: Nodes) -> str:
    """Which of NCCL's graphs [4.3] a machine of nodes takes: one node's, several nodes', or one GPU per node's."""
    nodes = topology.num_ranks // topology.g
    return "node" if nodes == 1 else "gpu per node" if topology.g == 1 else "nodes"


def unmodelled(topology: Topology) -> str | None:
    """Why msc cannot repeat NCCL's choice on ``topology`` (None: it can).
    NCCL decides from the graphs its topology search finds, which msc
    derives [4.3] for nodes of GPUs on one NVSwitch with a NIC each: one
    node of any GPU count, 8 GPUs a node across nodes, or one."""
    machine = getattr(topology, "machine", None)
    if not isinstance(topology, Nodes):
        return ("NCCL decides from the graphs its topology search finds on the machine, which msc derives for "
                "nodes of GPUs on NVSwitch with NICs only (dgx-*, hgx-*, gb200-nvl72, or a TOML file of nodes, "
                "gpus_per_node and nic_gbps), not for a graph of links")
    if machine not in ARCH:
        return (f"it names no GPU ({', '.join(sorted(ARCH))}): NCCL's tuning constants are per GPU generation"
                + (" (a TOML file's 'machine')" if machine is None else ""))
    if topology.switches != 1 or topology.port_kind != "nvlink":
        return "its GPUs sit on PCIe switches, whose NCCL graphs msc does not derive"
    kind = _graph_kind(topology)
    if kind == "node":
        return None if (machine, kind) in GRAPHS else f"NCCL's graph on one node of {machine} is not derived"
    if (machine, kind) not in GRAPHS:
        return (f"NCCL's graph across nodes of {topology.g} {machine} "
                f"({'one GPU and its NIC' if kind == 'gpu per node' else 'one NVLink domain'} each) is not derived")
    if topology.g not in (1, 8) or topology.nics != topology.g:
        return (f"NCCL's graphs across nodes are derived for 8 GPUs (or one) with a NIC each; these nodes have "
                f"{topology.g} GPUs and {topology.nics} NIC(s), whose rings share NICs in a graph msc does not derive")
    nic = topology.nic / 1e9
    if abs(nic - GRAPH_NIC_GBPS[machine]) > 1e-9 * nic:
        return (f"NCCL's graph across nodes of {machine} is derived for NICs of {GRAPH_NIC_GBPS[machine]:g} GB/s; "
                f"these are {nic:g} GB/s, for which its search finds other channel speeds")
    return None


@dataclass(frozen=True)
class Choice:
    """NCCL's pick for one call: algorithm, protocol, channels and threads
    it runs, and the time its own model predicts (us)."""

    algorithm: str
    protocol: str
    channels: int
    threads: int
    nccl_us: float


def available(s: System, collective: str) -> list[str]:
    """The algorithms NCCL 2.30 weighs for ``collective`` on ``s`` by default
    [3.6] (tuning.cc:293-304, 495-512@2.30), in NCCL's order."""
    if collective in ROOTED:
        return ["ring"]
    nvls = s.nvls is not None and s.nvls.channels >= 2
    if collective == "allreduce":
        return ["tree", "ring"] + (["nvls"] if nvls and s.nodes == 1 else []) + (["nvlstree"] if nvls and s.nodes > 1
                                                                                else [])
    return ["ring"] + (["nvls"] if nvls and s.nodes == 1 else []) + (["pat"] if pat_enabled(s) else [])


def pat_enabled(s: System) -> bool:
    """PAT runs with one GPU per node only (tuning.cc ncclPatEnable@2.30: nNodes == nRanks; compute
    capability >= 6.0; the host's network, not a device-offloaded one)."""
    return s.nodes == s.ranks and s.ranks > 1


def enabled(s: System, collective: str, algorithms=None, protocols=None) -> list[tuple[str, str]]:
    """The (algorithm, protocol) pairs NCCL may use, narrowed to
    ``algorithms``/``protocols`` (NCCL_ALGO, NCCL_PROTO)."""
    algos = available(s, collective)
    if algorithms is not None:
        bad = set(algorithms) - set(ALGORITHMS)
        if bad:
            raise UsageError(f"NCCL algorithms msc models are {', '.join(ALGORITHMS)}, not {', '.join(sorted(bad))}")
        for a in set(algorithms) - set(algos):
            if a in SWITCH + ("pat",):
                raise UsageError(_not_here(s, collective, a))
        algos = [a for a in algos if a in algorithms]
    if protocols is not None and set(protocols) - set(PROTOCOL_NAMES):
        raise UsageError(f"protocols are {', '.join(PROTOCOL_NAMES)}, not {', '.join(sorted(set(protocols) - set(PROTOCOL_NAMES)))}")
    protos = list(PROTOCOL_NAMES) if protocols is None else [p for p in PROTOCOL_NAMES if p in protocols]
    pairs = [(a, p) for a in algos for p in protos if (a not in SWITCH + ("pat",)) or p == "Simple"]
    if not pairs:
        raise UsageError(f"NCCL has no algorithm among {', '.join(algorithms or ALGORITHMS)} for {collective}"
                         + (f" with {', '.join(protocols)}" if protocols else ""))
    return pairs


def _not_here(s: System, collective: str, algorithm: str) -> str:
    where = f"{collective} on {s.nodes} node(s) of {s.ppn} {s.machine}"
    if algorithm == "pat":
        return f"NCCL runs PAT for allgather and reducescatter with one GPU per node, not {where}"
    if s.arch == "blackwell":
        return (f"msc does not model NCCL's {algorithm.upper() if algorithm == 'nvls' else 'NVLSTree'} on "
                f"{s.machine} ({s.arch}): NCCL's NVLS graph there (its search on that generation's speeds and "
                f"links) is not derived; it models NVLS on Hopper nodes on NVSwitch only")
    if algorithm == "nvls":
        return (f"msc models NCCL's NVLS on one node of Hopper GPUs on NVSwitch (across nodes it needs CollNet), "
                f"not {where}")
    return f"msc models NCCL's NVLSTree for allreduce on several nodes of Hopper GPUs on NVSwitch, not {where}"


def bus_bandwidth(s: System, collective: str, algorithm: str, protocol: str) -> float:
    """NCCL's bus bandwidth (GB/s) [3.1-3.3] (tuning.cc:305-358@2.30)."""
    n_idx = min(s.nodes, 3) - 1
    ll_max = LL_MAX_BW[s.arch] if s.nodes == 1 else LL_MAX_BW_NODES[s.cpu][n_idx - 1]
    if algorithm in SWITCH:
        g = s.nvls
        intra = g.intra * NVLS_EFFICIENCY[s.arch] * (g.channels - 1) / g.channels
        intra *= 2 if collective == "allreduce" else (s.ppn - 1) / s.ppn      # allreduce pipelines two operations
        inter = g.inter * (2 if algorithm == "nvlstree" and s.nodes <= 2 else 1)
        cap = NVLSTREE_PER_CHANNEL[s.arch][n_idx] if algorithm == "nvlstree" else math.inf
        return g.channels * min(intra, inter, cap)
    g = s.graph
    bw = g.channels * g.bw
    if algorithm == "ring":
        if protocol == "LL":
            return min(ll_max, bw * 0.5)
        if protocol == "LL128":
            return min(bw * 0.92, g.channels * RING_LL128_PER_CHANNEL[s.arch])
        return bw
    if algorithm == "pat":
        return bw * PAT_FACTOR
    if collective == "allreduce":                       # the tree's cap: allreduce only since 2.23
        bw = min(bw * 0.92, g.channels * TREE_PER_CHANNEL[s.arch][n_idx])
    if protocol == "LL":
        return min(bw / 3.8, ll_max)
    if protocol == "LL128":
        return min(bw * (7 / 9 if s.nodes == 1 else 120 / 128), g.channels * TREE_LL128_PER_CHANNEL[s.arch][n_idx])
    return bw


def algorithm_bandwidth(s: System, collective: str, algorithm: str, protocol: str) -> float:
    """[3.5] GB/s of user buffer (tuning.cc:366-372@2.30): the bus bandwidth
    times the ring's ratio (one over nccl-tests' bus-bandwidth factor, also
    NVLS's and NVLSTree's since 2.28) or the tree's 0.5; allgather and
    reducescatter of other algorithms than the ring take it as it is."""
    bus = bus_bandwidth(s, collective, algorithm, protocol)
    if algorithm != "ring" and collective in ("allgather", "reducescatter"):
        return bus
    return bus * (0.5 if algorithm == "tree" else 1 / SPECS[collective].busbw(s.ranks))


def latency(s: System, collective: str, algorithm: str, protocol: str) -> float:
    """NCCL's fixed latency (us) of one call [2.3] (tuning.cc:383-435@2.30)."""
    n, nodes = s.ranks, s.nodes
    intra = HW_LAT["nvlink"][algorithm][protocol]
    # with one GPU per node every latency is exposed: the tree's network hop for every algorithm
    inter = HW_LAT["net"]["tree" if s.ppn == 1 else algorithm][protocol]
    lat = BASE_LAT[algorithm][protocol]
    if algorithm == "nvls":
        return intra + (inter if nodes > 1 else 0.0)
    if algorithm == "nvlstree":
        return lat + intra + 2 * int(math.log2(nodes)) * inter
    if algorithm == "tree":
        return lat + 2 * ((s.ppn - 1) * intra + int(math.log2(nodes)) * inter) if collective == "allreduce" else lat
    if algorithm == "pat":
        return lat + int(math.log2(nodes)) * inter / 3.5 + n * 2.8
    if collective in ROOTED:
        # one hop where every channel is the same ring (one node: the search's first try, kept on NVSwitch);
        # else every one of nRanks steps, at the network's hop, Simple at the tree's ("waiting for proper
        # chunk modeling", tuning.cc:398)
        kind = "net" if nodes > 1 else "nvlink"
        if nodes == 1:
            return lat + HW_LAT[kind]["ring"][protocol]
        return lat + n * HW_LAT[kind]["tree" if protocol == "Simple" else "ring"][protocol]
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD[s.cpu] * (3 if protocol == "Simple" else 1))
    steps = 2 * (n - 1) if collective == "allreduce" else n - 1
    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if collective == "allreduce" else nodes - 1)
    return lat + (steps - inter_steps) * intra + inter_steps * inter


def nccl_time(s: System, collective: str, algorithm: str, protocol: str, nbytes: int) -> float:
    """NCCL's predicted time (us) of one call of ``nbytes`` [1] (ncclTopoGetAlgoTime@2.30)."""
    bw = algorithm_bandwidth(s, collective, algorithm, protocol)
    lat = latency(s, collective, algorithm, protocol)
    index = int(math.log2(nbytes >> 6)) if nbytes >= 64 else -1
    if algorithm == "tree" and collective == "allreduce" and 0 <= index < TREE_CORRECTED:
        bw *= TREE_CORRECTION[protocol][index]
    if (algorithm == "ring" and protocol == "Simple" and s.nodes > 1 and collective == "allreduce"
            and nbytes / (s.graph.runtime * s.ranks) >= 64):
        lat *= 1.4                                      # the ring's plateau (compute capability >= 8.0)
    return lat + nbytes / (1000 * bw)


def choose(s: System, collective: str, nbytes: int, *, algorithms=None, protocols=None) -> Choice:
    """What NCCL runs for one call of ``nbytes`` (nccl-tests size)."""
    if collective not in COLLECTIVES:
        why = (f" (msc has no model of what NCCL runs for {collective}: simulate a plan of it, msc simulate PLAN)"
               if collective in SPECS else "")
        raise UsageError(f"msc simulate --nccl models {', '.join(COLLECTIVES)}, not {collective!r}{why}")
    if collective in P2P:
        return _p2p_choice(s, nbytes // s.ranks if collective == "alltoall" else nbytes)
    best = None
    for a, p in enabled(s, collective, algorithms, protocols):      # NCCL's order: the first of equal times wins
        t = nccl_time(s, collective, a, p, nbytes)
        if best is None or t < best[0]:
            best = (t, a, p)
    t, a, p = best
    channels, threads = _channels(s, collective, a, p, nbytes)
    return Choice(a, p, channels, threads, t)


def _channels(s: System, collective: str, algorithm: str, protocol: str, nbytes: int) -> tuple[int, int]:
    """[4.5] Channels and threads for a call (enqueue.cc:2069-2112@2.30):
    a ring or tree drops channels while the message is below channels x
    threads x threshold, then halves its threads; NVLS takes its own
    channels. Then the work is spread over channels by its traffic, at
    least MIN_TRAFFIC_PER_CHANNEL each (traffic_channels)."""
    if algorithm in SWITCH:
        return NVLS_CHANNELS, ALL_THREADS
    nc = s.graph.runtime
    if algorithm == "pat":
        return traffic_channels(s, collective, protocol, nbytes, nc), ALL_THREADS
    nt = MAX_THREADS[protocol]
    threshold = THREAD_THRESHOLD[protocol] * (s.ranks if algorithm == "ring" and protocol == "LL" else 1)
    while nbytes < nc * nt * threshold and nc >= 2:
        nc -= 1
    while nbytes < nc * nt * threshold and nt % 128 == 0:
        nt //= 2
    if algorithm == "tree":
        nt = ALL_THREADS                    # "Tree now uses all threads always"
    return traffic_channels(s, collective, protocol, nbytes, nc), nt


def traffic_channels(s: System, collective: str, protocol: str, nbytes: int, most: int) -> int:
    """[4.5] The channels one call's work takes when NCCL spreads it by
    traffic (enqueue.cc scheduleCollTasksToPlan@2.30): the traffic (2 bytes
    per byte for allreduce, the rank count per rank's byte for allgather and
    reducescatter, 1 otherwise) is cut into cells of MIN_TRAFFIC_PER_CHANNEL
    (a quarter of that for LL), each channel taking whole cells and at least
    its share of the traffic, at most ``most`` channels."""
    per_byte = 2 if collective == "allreduce" else s.ranks if collective in ("allgather", "reducescatter") else 1
    count_bytes = nbytes // s.ranks if collective in ("allgather", "reducescatter") else nbytes
    cell = -(-MIN_TRAFFIC_PER_CHANNEL // (per_byte * (4 if protocol == "LL" else 1)))
    cell = -(-cell // 16) * 16
    cells = max(1, -(-count_bytes // cell))
    per_channel = -(-(max(MIN_TRAFFIC_PER_CHANNEL, count_bytes * per_byte) // most) // 16) * 16
    cells_per_channel = min(cells, -(-per_channel // (cell * per_byte * (4 if protocol == "LL" else 1))))
    return min(most, -(-cells // cells_per_channel))


def _p2p_choice(s: System, per_peer: int) -> Choice:
    """Alltoall and sendrecv are NCCL's grouped send/receive, outside the tuning
    model: LL for messages below NCCL_P2P_LL_THRESHOLD (16 KiB per peer), else
    Simple [5]; one channel per peer pair here (msc's all-pairs plan, or the
    ring of sends to the next rank that nccl-tests' sendrecv_perf makes)."""
    return Choice("p2p", "LL" if per_peer < 16 * KIB else "Simple", 1, MAX_THREADS["Simple"], float("nan"))


def tile(s: System, choice: Choice, chunk_bytes: float, nbytes: int | None = None,
         collective: str = "allreduce") -> int:
    """Bytes per chunk and iteration of the msc plan that runs like NCCL's
    ``choice``, whose chunks are NCCL's slices (``chunk_bytes`` each) [5]:
    NCCL moves a Simple ring's 2 MiB chunk in two slices of up to 1 MiB
    (msc's plan holds the two as chunks of their own, sent one after the
    other at every step), LL 32 KiB of data per step, LL128 576,000 bytes;
    a tree one step per chunk (Simple 512 KiB), LL128's cut for the call's
    ``nbytes`` (tree_chunk); NVLS 128 KiB (NVLSTree's cut: nvls_chunk);
    PAT a Simple step, halved for small calls (pat_chunk); send/receive
    NCCL_P2P_NVL_CHUNKSIZE (512 KiB) or, across nodes,
    NCCL_P2P_NET_CHUNKSIZE (128 KiB)."""
    nbytes = nbytes if nbytes is not None else int(chunk_bytes)
    if choice.algorithm == "p2p" and choice.protocol == "Simple":
        most = 512 * KIB if s.nodes == 1 else 128 * KIB
    elif choice.algorithm in SWITCH:
        most = nvls_chunk(s, choice.algorithm, nbytes, choice.channels)
    elif choice.algorithm == "tree":
        most = tree_chunk(s, choice.protocol, nbytes, choice.channels)
    elif choice.algorithm == "pat":
        most = pat_chunk(collective, nbytes, choice.channels)
    else:
        most = SLICE[choice.protocol]
    return max(1, int(min(most, math.ceil(chunk_bytes))))


def tree_chunk(s: System, protocol: str, nbytes: int, channels: int) -> int:
    """NCCL's tree chunk [5] (enqueue.cc calcCollChunking@2.30): one step of
    the protocol's buffer (Simple 512 KiB, LL 32 KiB of data, LL128
    576,000 bytes); LL128's halved while a channel's share of ``nbytes``
    is under (1 + log2 nodes + ppn / 10) x 64 / ppn chunks (down to 128
    KiB), then under a quarter of that (down to 32 KiB), in LL128's
    1,920-byte grains: so a tree pipelines a few dozen chunks up and
    down at medium sizes."""
    if protocol != "LL128":
        return STEP[protocol]
    chunk, ppn = SLICE["LL128"], s.ppn
    steps = 1 + int(math.log2(s.nodes)) + 0.1 * ppn
    per_channel = nbytes // max(channels, 1)
    while per_channel // chunk < steps * 64 / ppn and chunk > 128 * KIB:
        chunk //= 2
    while per_channel // chunk < steps * 16 / ppn and chunk > 32 * KIB:
        chunk //= 2
    return max(LL128_GRAIN, chunk // LL128_GRAIN * LL128_GRAIN)


def nvls_chunk(s: System, algorithm: str, nbytes: int, channels: int) -> int:
    """NCCL's NVLS and NVLSTree chunks [5] (enqueue.cc:2259-2285@2.30) for a
    call of ``nbytes`` over ``channels`` x heads concurrent operations."""
    ops = channels * (s.nvls.channels if s.nvls else 1)
    if algorithm == "nvls":
        chunk = NVLS_CHUNK
        for below, cap in ((64, 64 * KIB), (8, 32 * KIB), (2, 16 * KIB)):
            if nbytes < below * ops * chunk and chunk > cap:
                chunk = cap
        return chunk
    chunk = min(NVLS_CHUNK, 64 * KIB if s.nodes >= 4 else NVLS_CHUNK)
    for below, cap in ((32, 256 * KIB), (16, 128 * KIB), (4, 64 * KIB), (1, 32 * KIB)):
        if nbytes < below * ops * chunk and chunk > cap:
            chunk = cap
    return chunk


def pat_chunk(collective: str, nbytes: int, channels: int) -> int:
    """NCCL's PAT chunk [5] (enqueue.cc:2296-2300@2.30): a Simple step,
    halved while channels x 32 (allgather) or 16 (reducescatter) chunks
    exceed the call, down to 64 KiB."""
    chunk, times = PAT_CHUNK, 32 if collective == "allgather" else 16
    while chunk * channels * times > nbytes and chunk > 64 * KIB:
        chunk //= 2
    return chunk


@dataclass(frozen=True)
class Pipeline:
    """How msc's plan of NCCL's choice is simulated: bytes per chunk and
    tile iteration, messages in flight per connection, and what a message
    costs its threadblocks (us)."""

    tile: int
    slots: int
    step_us: float | None           # None: the protocol's (msc.sim.machines STEP_US)
    network_step: int | None = None  # the bytes of the network message a tile is a piece of (None: the tile)


def pipeline(s: System, collective: str, choice: Choice, chunk_bytes: float, nbytes: int,
             step_us: float) -> Pipeline:
    """The tile, slots and per-message cost for ``choice`` (``step_us``: the
    protocol's per-message cost). NCCL's steps are the tiles (``tile``),
    as many in flight as its buffers hold; except where LL or LL128 data
    goes down a chain (a tree, a broadcast or a reduce), which a rank hands
    on a line at a time [5, PASS]: there the tile is at most one pass of
    the threadblock over its lines, as many in flight as the steps hold,
    and a step's synchronization (a barrier and a flag once its lines are
    out) is off the data's way down the chain: each tile pays its share of
    a full step's cost by its bytes. Across nodes the proxy posts a step
    once it is whole (``network_step``). (In a ring each rank's chunk of a
    step is its own, so only the chain's depth makes the difference.)"""
    step = tile(s, choice, chunk_bytes, nbytes, collective)
    chain = choice.algorithm == "tree" or collective in ROOTED
    wave = PASS.get(choice.protocol)
    if choice.algorithm == "tree" and wave is not None:       # the broadcast down's warps make its pass
        wave = max(LL128_GRAIN if choice.protocol == "LL128" else 8 * 32,
                   int(wave * TREE_DOWN_THREADS[choice.protocol]))
    if not chain or wave is None:
        return Pipeline(step, SLOTS[choice.protocol], None)
    piece = -(-step // -(-step // wave))            # the step in equal passes of at most a wave
    return Pipeline(piece, SLOTS[choice.protocol] * math.ceil(step / piece), step_us * piece / SLICE[choice.protocol],
                    step if step > piece else None)


def slices(choice: Choice) -> int:
    """Slices per chunk of NCCL's ring [5]: Simple's chunk is 4 steps sent 2 at a time."""
    return 2 if choice.algorithm == "ring" and choice.protocol == "Simple" else 1
