"""``msc simulate --nccl``: what NCCL would do for a collective on a machine,
and how long msc's model says it takes.

NCCL decides per call: its tuning model (src/graph/tuning.cc) predicts a
time for every algorithm and protocol from a base latency, per-hop
latencies and a bus bandwidth that its topology search found, and takes the
least; enqueue.cc then drops channels for small messages. This module
repeats that decision with NCCL 2.21's constants (bench/calibration/
nccl_model.md gives each with its file and lines), builds the msc plan that
does what NCCL's choice does (the library's rail rings or NCCL's tree, one
channel per ring or tree, the chosen protocol) and simulates it with NCCL's
pipelining: tiles of NCCL's slices and as many in flight as its buffers
hold. So a prediction here is msc's cost model of NCCL's schedule, not
NCCL's own formula (which is reported beside it, ``nccl_us``).

NCCL's own choice includes NVLS (in-switch reduction) where NCCL 2.21
enables it by default: allreduce on one node of H100 on NVSwitch
(tuning.cc@v2.21.5-1 disables NVLS across nodes without CollNet and
NVLSTree on one node), Simple only, 25 us and 8 x min(40, 60) x 5/6 GB/s
in its model; it runs as the library's nvls plan on NCCL's 16 NVLS
channels. ``algorithms=["ring", "tree"]`` is NCCL with NCCL_NVLS_ENABLE=0.
Across nodes NCCL 2.21 also weighs NVLSTree (min(bwIntra, bwInter, or
bwInter / 2 beyond 2 nodes) x channels, 25 us + 2 log2(nodes) x 14 us):
not modelled here, since its multi-node graph's speeds come from NCCL's
NIC search, which msc does not repeat; its choice there is ring or tree.
NCCL's choice is modelled on nodes of H100, A100, H200, H20 or B200 GPUs
on NVSwitch with one NIC per GPU, and on one GB200 NVL72 rack: the presets
(dgx-*, hgx-*, gb200-nvl72) and TOML topologies of that form (``nodes``,
``gpus_per_node``, ``nic_gbps``); ``unmodelled`` says why any other is not.
Blackwell takes NCCL 2.30.7's constants (2.21 has none), and NVLS is weighed
on Hopper only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from msc.dsl.collectives import COLLECTIVES as SPECS, ROOTED
from msc.errors import UsageError
from msc.ir.ops import PROTOCOL_NAMES
from msc.sim.topology import Nodes, Topology

ALGORITHMS = ("ring", "tree", "nvls")
COLLECTIVES = tuple(name for name, spec in SPECS.items() if spec.nccl)
P2P = ("alltoall", "sendrecv")                      # NCCL's grouped send/receive, not its collectives
KIB, MIB = 1024, 1024 * 1024

# -- NCCL 2.21's constants (nccl_model.md section in brackets) ---------------------------------
BASE_LAT = {"ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},         # [2.1] us
            "tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4}}         # Tree Simple: 2.23+'s (0 in 2.21)
HW_LAT = {  # [2.2] us per hop: link kind -> algorithm -> protocol (Tree Simple: 2.23+'s, 28 before)
    "nvlink": {"ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}, "tree": {"LL": 0.6, "LL128": 1.25, "Simple": 4.0}},
    "pcie": {"ring": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7}, "tree": {"LL": 1.0, "LL128": 1.9, "Simple": 4.0}},
    "net": {"ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}, "tree": {"LL": 5.0, "LL128": 8.5, "Simple": 14.0}},
}
NET_OVERHEAD = {"intel": 1.0, "amd": 2.0}                           # [2.2] us, x3 for Simple
LL_MAX_BW = {"hopper": 141.0, "ampere": 87.7}                       # [3.3] GB/s on one node
LL_MAX_BW_NODES = {"intel": (39.0, 20.4), "amd": (22.5, 19.0)}      # [3.3] 2 nodes, >= 3 nodes
RING_LL128_PER_CHANNEL = {"hopper": 36.7, "ampere": 20.0}           # [3.3]
TREE_PER_CHANNEL = {"hopper": (38.7, 41.4, 36.0), "ampere": (24.0, 23.6, 17.8)}        # 1, 2, >= 3 nodes
TREE_LL128_PER_CHANNEL = {"hopper": (36.7, 36.7, 29.0), "ampere": (20.0, 20.0, 20.0)}
# Blackwell, which NCCL 2.21 predates: tuning.cc@v2.30.7 ncclTunerConstantsDefaults' Blackwell rows
# (llMaxBws 2 x 141 on one node, perChMaxRingLL128Bws, perChMaxTreeBws, perChMaxTreeLL128Bws)
LL_MAX_BW["blackwell"] = 282.0
RING_LL128_PER_CHANNEL["blackwell"] = 40.0
TREE_PER_CHANNEL["blackwell"] = (70.0, 42.8, 24.0)
TREE_LL128_PER_CHANNEL["blackwell"] = (55.6, 31.67, 20.0)
# Hosts other than x86: NCCL takes Intel's llMaxBw row (index 0 unless AMD, tuning.cc@v2.30.7) and a network
# overhead of 1 us (getNetOverhead's default)
LL_MAX_BW_NODES["arm"] = LL_MAX_BW_NODES["intel"]
NET_OVERHEAD["arm"] = 1.0
TREE_CORRECTION = {  # [1] index log2(bytes / 64), 64 B .. 256 MB
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}              # [4.5]
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}              # [4.5] bytes per thread; ring LL: x ranks
# [5] per connection: slots in flight (NCCL_STEPS = 8; a Simple slice is 2 steps) and a slice's bytes
SLOTS = {"LL": 8, "LL128": 8, "Simple": 4}
SLICE = {"LL": 32 * KIB, "LL128": 576_000, "Simple": MIB}
# NVLS [2.2, 3.1, 3.5, 4.3, 4.4] @2.21: latency 25 us on NVLink (replacing the base latency), one channel
# per GPU in the model at the search's intra speed (SM90 array: the first whose (GPUs + 1) x speed fits
# the 370.8 GB/s of a GPU's links) capped by the inter speed 60, algBw = busBw x 5/6; at run time
# NCCL_NVLS_NCHANNELS = 16 channels (nvls.cc:232@2.21) moving NVLS_CHUNK bytes per step
# (NCCL_NVLS_CHUNKSIZE, 128 KiB: src/device/all_reduce.h's nvls chunk, enqueue.cc@2.21).
NVLS_LAT_US = 25.0
NVLS_SPEEDS = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
NVLS_LINKS_GBPS = 370.8
NVLS_CHANNELS = 16
NVLS_CHUNK = 128 * KIB


@dataclass(frozen=True)
class Graph:
    """What NCCL's topology search finds [4.3]: ``channels`` of ``bw`` GB/s
    each (the model's), and the channels it runs (``runtime``, doubled)."""

    channels: int
    bw: float
    runtime: int


# [4.3] (derived from search.cc by hand; the single-node graphs match NCCL 2.29.2's printed tuning
# table on H100 and a '24 channels' log on A100; the multi-node H100 one has no log). Tree graphs
# take the ring's channel count (init.cc: the tree must find as many), and its bandwidth on one node
# (derived); on several nodes the ring's too (assumed).
GRAPHS = {("h100", False): Graph(12, 30.0, 24), ("a100", False): Graph(12, 20.0, 24),
          ("h100", True): Graph(8, 45.0, 16), ("a100", True): Graph(8, 24.0, 16)}
# H200 and H20: H100's links as NCCL reads them (18 NVLinks of SM90, PCIe Gen5, 400 Gb/s NICs:
# msc.sim.machines), so H100's graphs. B200 (derived as 4.3 does, NCCL 2.30.7's SM100 arrays and
# 18 x 40.1 = 721.8 GB/s of NVLink): one node 8 x 90 (720), doubled to 16 x 45, 32 at run time; across
# nodes one channel per NIC at the PCIe Gen5 path's 48 (8 x 48 = 384 fits the NVLinks), not doubled
# (48 < 50 with 8 channels), 16 at run time. A GB200 NVL72 rack: one node of 72 such GPUs, the same
# ring graph as B200's (the NVLinks, not the GPU count, bound it); across racks not derived.
GRAPHS.update({(m, multi): GRAPHS["h100", multi] for m in ("h200", "h20") for multi in (False, True)})
GRAPHS.update({("b200", False): Graph(16, 45.0, 32), ("b200", True): Graph(8, 48.0, 16),
               ("gb200", False): Graph(16, 45.0, 32)})
# The NIC line rate (GB/s) the multi-node graphs are derived for (4.3): another rate is another graph.
GRAPH_NIC_GBPS = {"h100": 50.0, "a100": 25.0, "h200": 50.0, "h20": 50.0, "b200": 50.0}
# GPU generation and host CPU (llMaxBw, network overhead): DGX H100 and DGX H200 have Intel Xeon 8480C,
# DGX A100 AMD EPYC 7742, DGX B200 Intel Xeon 8570 (NVIDIA's datasheets and user guides); HGX H20: Intel
# assumed; GB200: Grace (Arm).
ARCH = {"h100": "hopper", "a100": "ampere", "h200": "hopper", "h20": "hopper", "b200": "blackwell",
        "gb200": "blackwell"}
CPU = {"h100": "intel", "a100": "amd", "h200": "intel", "h20": "intel", "b200": "intel", "gb200": "arm"}


@dataclass(frozen=True)
class System:
    """A machine as NCCL's tuning sees it."""

    machine: str
    ranks: int
    nodes: int
    graph: Graph

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
    nodes = topology.num_ranks // topology.g
    return System(topology.machine, topology.num_ranks, nodes, GRAPHS[topology.machine, nodes > 1])


def unmodelled(topology: Topology) -> str | None:
    """Why msc cannot repeat NCCL's choice on ``topology`` (None: it can).
    NCCL decides from the graphs its topology search finds, which msc
    derives for nodes of GPUs on one NVSwitch with a NIC each (4.3)."""
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
    nodes = topology.num_ranks // topology.g
    if nodes == 1:
        return None if (machine, False) in GRAPHS else f"NCCL's graph on one node of {machine} is not derived"
    if (machine, True) not in GRAPHS:
        return f"NCCL's graph across nodes of {topology.g} {machine} (one NVLink domain each) is not derived"
    if topology.g != 8 or topology.nics != topology.g:
        return (f"NCCL's graphs across nodes are derived for 8 GPUs with a NIC each; these nodes have "
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


def enabled(s: System, collective: str, algorithms=None, protocols=None) -> list[tuple[str, str]]:
    """The (algorithm, protocol) pairs NCCL may use [3.6] (NVLS where NCCL
    2.21 enables it by default: nvls_by_default), narrowed to
    ``algorithms``/``protocols`` (NCCL_ALGO, NCCL_PROTO)."""
    algos = ["ring", "tree"] if collective == "allreduce" else ["ring"]
    if algorithms is None and nvls_by_default(s, collective):
        algos.append("nvls")
    if algorithms is not None:
        bad = set(algorithms) - set(ALGORITHMS)
        if bad:
            raise UsageError(f"NCCL algorithms msc models are {', '.join(ALGORITHMS)}, not {', '.join(sorted(bad))}")
        if "nvls" in algorithms:
            _check_nvls(s, collective)
            algos.append("nvls")
        algos = [a for a in algos if a in algorithms]
    protos = list(PROTOCOL_NAMES) if protocols is None else [p for p in PROTOCOL_NAMES if p in protocols]
    if protocols is not None and set(protocols) - set(PROTOCOL_NAMES):
        raise UsageError(f"protocols are {', '.join(PROTOCOL_NAMES)}, not {', '.join(sorted(set(protocols) - set(PROTOCOL_NAMES)))}")
    pairs = [(a, p) for a in algos for p in protos if a != "nvls" or p == "Simple"]     # NVLS runs Simple only
    if not pairs:
        raise UsageError(f"NCCL has no algorithm among {', '.join(algorithms or ALGORITHMS)} for {collective}")
    return pairs


def nvls_by_default(s: System, collective: str) -> bool:
    """Whether NCCL 2.21 weighs NVLS for ``collective`` without being asked:
    allreduce on one Hopper node (NVSwitch with SHARP; NCCL_NVLS_ENABLE
    defaults to on where the driver and switch support multicast). Not on
    Blackwell, whose NVLS NCCL 2.21's model (SM90 speeds, 370.8 GB/s of
    links) does not describe."""
    return s.arch == "hopper" and s.nodes == 1 and collective == "allreduce"


def _check_nvls(s: System, collective: str) -> None:
    """NVLS as msc models it: allreduce on one node of Hopper GPUs (NVSwitch with SHARP)."""
    if s.arch != "hopper" or s.nodes != 1 or collective != "allreduce":
        raise UsageError(f"msc models NCCL's NVLS for allreduce on one Hopper node, not {collective} on "
                         f"{s.nodes} node(s) of {s.machine}")


def bus_bandwidth(s: System, algorithm: str, protocol: str) -> float:
    """NCCL's bus bandwidth (GB/s) [3.1-3.3]."""
    if algorithm == "nvls":
        intra = next((v for v in NVLS_SPEEDS if (s.ppn + 1) * v <= NVLS_LINKS_GBPS), NVLS_SPEEDS[-1])
        return s.ppn * min(intra, 60.0)
    g, n_idx = s.graph, min(s.nodes, 3) - 1
    bw = g.channels * g.bw
    ll_max = LL_MAX_BW[s.arch] if s.nodes == 1 else LL_MAX_BW_NODES[s.cpu][min(s.nodes, 3) - 2]
    if algorithm == "ring":
        if protocol == "LL":
            return min(ll_max, bw * 0.5)
        if protocol == "LL128":
            return min(bw * 0.92, g.channels * RING_LL128_PER_CHANNEL[s.arch])
        return bw
    bw = min(bw * 0.92, g.channels * TREE_PER_CHANNEL[s.arch][n_idx])
    if protocol == "LL":
        return min(bw / 3.8, ll_max)
    if protocol == "LL128":
        return min(bw * (7 / 9 if s.nodes == 1 else 120 / 128), g.channels * TREE_LL128_PER_CHANNEL[s.arch][n_idx])
    return bw


def algorithm_bandwidth(s: System, collective: str, algorithm: str, protocol: str) -> float:
    """[3.5] GB/s of user buffer: the bus bandwidth times NCCL's ratio (a
    ring's: one over nccl-tests' bus-bandwidth factor)."""
    ratio = 0.5 if algorithm == "tree" else 5 / 6 if algorithm == "nvls" else 1 / SPECS[collective].busbw(s.ranks)
    return bus_bandwidth(s, algorithm, protocol) * ratio


def latency(s: System, collective: str, algorithm: str, protocol: str) -> float:
    """NCCL's fixed latency (us) of one call [2.3]."""
    n, nodes = s.ranks, s.nodes
    if algorithm == "nvls":
        return NVLS_LAT_US
    intra = HW_LAT["nvlink"][algorithm][protocol]
    inter = HW_LAT["net"][algorithm][protocol]
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD[s.cpu] * (3 if protocol == "Simple" else 1))
    lat = BASE_LAT[algorithm][protocol]
    if algorithm == "tree":
        return lat + 2 * ((s.ppn - 1) * intra + math.log2(nodes) * inter)
    if collective in ROOTED:
        return lat + (n - 1) * (inter if nodes > 1 else intra)
    steps = 2 * (n - 1) if collective == "allreduce" else n - 1
    inter_steps = 0 if nodes == 1 else (2 * nodes if collective == "allreduce" else nodes - 1)
    return lat + (steps - inter_steps) * intra + inter_steps * inter


def nccl_time(s: System, collective: str, algorithm: str, protocol: str, nbytes: int) -> float:
    """NCCL's predicted time (us) of one call of ``nbytes`` [1]."""
    bw = algorithm_bandwidth(s, collective, algorithm, protocol)
    lat = latency(s, collective, algorithm, protocol)
    index = int(math.log2(nbytes >> 6)) if nbytes >= 64 else -1
    if algorithm == "tree" and 0 <= index < len(TREE_CORRECTION[protocol]):
        bw *= TREE_CORRECTION[protocol][index]
    if (algorithm == "ring" and protocol == "Simple" and s.nodes > 1 and collective == "allreduce"
            and nbytes / (s.graph.runtime * s.ranks) >= 64):
        lat *= 1.4                                      # the ring's plateau (compute capability >= 8.0)
    return lat + nbytes / (1000 * bw)


def choose(s: System, collective: str, nbytes: int, *, algorithms=None, protocols=None) -> Choice:
    """What NCCL runs for one call of ``nbytes`` (nccl-tests size)."""
    if collective not in COLLECTIVES:
        raise UsageError(f"msc simulate --nccl models {', '.join(COLLECTIVES)}, not {collective!r}")
    if collective in P2P:
        return _p2p_choice(s, nbytes // s.ranks if collective == "alltoall" else nbytes)
    pairs = enabled(s, collective, algorithms, protocols)
    times = [(nccl_time(s, collective, a, p, nbytes), a, p) for a, p in pairs]
    t, a, p = min(times)
    channels, threads = _channels(s, a, p, nbytes)
    return Choice(a, p, channels, threads, t)


def _channels(s: System, algorithm: str, protocol: str, nbytes: int) -> tuple[int, int]:
    """[4.5] Channels and threads for a call: channels dropped while the
    message is below channels x threads x threshold, then threads halved."""
    if algorithm == "nvls":
        return NVLS_CHANNELS, MAX_THREADS[protocol]
    nc, nt = s.graph.runtime, MAX_THREADS[protocol]
    threshold = THREAD_THRESHOLD[protocol] * (s.ranks if algorithm == "ring" and protocol == "LL" else 1)
    while nbytes < nc * nt * threshold:
        if nc >= 2:
            nc -= 1
        elif nt % 128 == 0:
            nt //= 2
        else:
            break
    return nc, nt


def _p2p_choice(s: System, per_peer: int) -> Choice:
    """Alltoall and sendrecv are NCCL's grouped send/receive, outside the tuning
    model: LL for messages below NCCL_P2P_LL_THRESHOLD (16 KiB per peer), else
    Simple [5]; one channel per peer pair here (msc's all-pairs plan, or the
    ring of sends to the next rank that nccl-tests' sendrecv_perf makes)."""
    return Choice("p2p", "LL" if per_peer < 16 * KIB else "Simple", 1, MAX_THREADS["Simple"], float("nan"))


def tile(s: System, choice: Choice, chunk_bytes: float) -> int:
    """Bytes per chunk and iteration of the msc plan that runs like NCCL's
    ``choice``, whose chunks are NCCL's slices (``chunk_bytes`` each) [5]:
    NCCL moves a Simple ring's 2 MiB chunk in two slices of up to 1 MiB
    (msc's plan holds the two as chunks of their own, sent one after the
    other at every step), LL 32 KiB of data per step, LL128 576,000 bytes;
    send/receive uses NCCL_P2P_NVL_CHUNKSIZE (512 KiB) or, across nodes,
    NCCL_P2P_NET_CHUNKSIZE (128 KiB)."""
    if choice.algorithm == "p2p" and choice.protocol == "Simple":
        most = 512 * KIB if s.nodes == 1 else 128 * KIB
    elif choice.algorithm == "nvls":
        most = NVLS_CHUNK
    else:
        most = SLICE[choice.protocol]
    return max(1, int(min(most, math.ceil(chunk_bytes))))


def slices(choice: Choice) -> int:
    """Slices per chunk of NCCL's ring [5]: Simple's chunk is 4 steps sent 2 at a time."""
    return 2 if choice.algorithm == "ring" and choice.protocol == "Simple" else 1
