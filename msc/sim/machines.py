"""The machines the cost model knows: what a GPU generation brings to it
(its reduce and copy rates, the rate one threadblock moves, and per protocol
the launch latency and what each kind of link does to latency and
bandwidth: msc.sim.protocols). Presets (msc.sim.presets) and TOML
topologies (``machine = "h100"``) take their parameters from here.

Every number says where it comes from: NCCL's tuning model
(src/graph/tuning.cc, summarized with line numbers in
bench/calibration/nccl_model.md) or a published measurement
(tests/data/nccl_published.toml). The calibration test
(tests/test_calibration.py) holds the H100 and A100 machines to the
measurements; bench/calibration.py prints and draws the comparison. The
others (H200, H20, B200, GB200) say why they are uncalibrated
(``Machine.uncalibrated``), and every command that uses them says so once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from msc.sim.protocols import DEFAULT_PROTOCOLS, LinkModel, Protocol


@dataclass(frozen=True)
class Machine:
    """A GPU generation's parameters: rates in GB/s, protocols by name."""

    name: str
    reduce_gbps: float
    copy_gbps: float
    threadblock_gbps: float
    protocols: dict
    nvlink_gbps: float          # per GPU and direction, through the NVSwitch
    nvlink_alpha_us: float      # Simple's latency of an NVLink hop
    proxy_us: float             # NCCL's network post overhead on the host (tuning.cc netOverhead)
    description: str
    nvls_gbps: float = 0.0      # NVLS: per GPU port and direction when the switch reduces; 0: no NVLS
    nvls_alpha_us: float = 0.0  # NVLS: latency of a switch reduce or store
    nvls_barrier_us: float = 0.0    # NVLS: latency of a barrier of a switch group
    ll_net_many: float = 0.0        # LL's share of a NIC's line rate from 3 nodes on (0: as on 2)
    uncalibrated: str = ""      # why no measurement of this GPU is fitted ("": the calibration holds it)

    @property
    def note(self) -> str:
        """The one line every command prints about a topology of these GPUs ("" where they are calibrated)."""
        return f"{self.description} is uncalibrated: {self.uncalibrated}" if self.uncalibrated else ""

    def protocols_for(self, nodes: int) -> dict:
        """The protocols on ``nodes`` nodes: from 3 nodes on, LL's share of a NIC is ``ll_net_many``
        (NCCL's llMaxBw has a column for 1, 2 and >= 3 nodes, tuning.cc)."""
        if nodes < 3 or not self.ll_net_many:
            return self.protocols
        ll = self.protocols["LL"]
        net = replace(ll.links["net"], bandwidth_factor=self.ll_net_many)
        return {**self.protocols, "LL": replace(ll, links={**ll.links, "net": net})}

    @property
    def message_us(self) -> float:
        """The least time a message across nodes holds its NICs (msc.sim.topology.Nodes): NCCL's post
        overhead, what its model charges every step of a multi-node ring (tuning.cc: "inter-node rings
        still have to launch nsteps * net overhead"), here per message the host proxy posts. It holds a
        one-channel ring across two A100 nodes at 1 KB within 14% of NCCL 2.17's measured allgather (the
        MSCCL++ NDmv4 page). The NIC itself is not the limit: no citable ConnectX-7 message rate was
        found here, and NCCL's own constant is the host's."""
        return self.proxy_us


def _protocol(launch_us: float, threadblock_gbps: float, tile: int, step_us: float = 0.0,
              **kinds: tuple[float, float]) -> Protocol:
    """A protocol whose kinds not named keep the textbook factors of its name's tile."""
    return Protocol(launch_us, threadblock_gbps, tile, {k: LinkModel(*v) for k, v in kinds.items()}, step_us)


def _complete(protocols: dict) -> dict:
    """Each protocol with the textbook model for every kind it does not name."""
    out = {}
    for name, p in protocols.items():
        links = dict(DEFAULT_PROTOCOLS[name].links)
        links.update(p.links)
        out[name] = replace(p, links=links)
    return out


KIB = 1024

# NCCL's latencies (tuning.cc, nccl_model.md 2.1-2.2): base latency per launch, and per hop Simple's
# latency with LL's and LL128's as fractions of it, per kind of link (Ring's values).
LAUNCH_US = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
HOP_US = {"nvlink": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}, "pcie": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
          "net": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}}
LL128_OF_SIMPLE = 0.92          # NCCL's LL128 bandwidth as a fraction of Simple's (tuning.cc; "120/128")


# What a message costs the threadblocks at its ends whatever its size (per tile iteration): Simple
# fences its data before it posts the flag (a system-scope fence waits for the writes to land, about a
# hop), LL128 posts per warp, LL's flags travel in its data. Fitted: over Simple 1-5 us and LL128 0-2
# us the calibrate rows (the dgx-a100 allreduce table from 4 MB to 128 MB, where NCCL runs below its own
# model, and the H100 plateaus) are best held at 4-5 / 2; 3 / 1 holds as many of them within the bar
# (42 of 49 simulated) and more of the check rows (87 of 95, against 85 at 4 / 1).
STEP_US = {"LL": 0.0, "LL128": 1.0, "Simple": 3.0}


def _machine_protocols(simple: dict, ll: dict, threadblock_gbps: float, ll128_threadblock_gbps: float) -> dict:
    """The three protocols from Simple's and LL's share of each kind's line rate (LL128 is 0.92 of
    Simple's) and the threadblock rates: Simple's, LL half of it (4 data bytes per 8-byte packet),
    LL128 NCCL's per-channel cap."""
    def kinds(name, share):
        return {k: (HOP_US[k][name] / HOP_US[k]["Simple"], share[k]) for k in HOP_US}

    return _complete({
        "LL": _protocol(LAUNCH_US["LL"], threadblock_gbps / 2, 32 * KIB, STEP_US["LL"], **kinds("LL", ll)),
        "LL128": _protocol(LAUNCH_US["LL128"], ll128_threadblock_gbps, 256 * KIB, STEP_US["LL128"],
                           **kinds("LL128", {k: v * LL128_OF_SIMPLE for k, v in simple.items()})),
        "Simple": _protocol(LAUNCH_US["Simple"], threadblock_gbps, 512 * KIB, STEP_US["Simple"],
                            **kinds("Simple", simple)),
    })


# -- H100 SXM (DGX H100: 8 GPUs on NVSwitch, 8 ConnectX-7 NDR 400 Gb/s NICs, Intel Xeon 8480C) --------
# NVLink4: 18 links x 25 GB/s = 450 GB/s per direction. Simple carries 0.82 of it: "450GB/s is the
# line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
# 370GB/s" (nccl-tests issue 212). LL: NCCL caps ring LL on one Hopper node at 141 GB/s (llMaxBw,
# tuning.cc): 141/450. An NDR NIC (50 GB/s line) carries 46-48 GB/s (nccl-tests issue 290): 0.94;
# LL across two nodes is capped at 39 GB/s bus bandwidth on Intel hosts (llMaxBw): 39/400 of 8 NICs,
# from 3 nodes on at 20.4 (llMaxBw's N4 column): 20.4/400.
# PCIe (the pcie kind; no H100 row measures it): Simple as NVLink's, LL a third of it.
# A threadblock: NCCL's search gives a Hopper channel at most 60 GB/s (search.cc's speed array);
# LL128 36.7 (perChMaxRingLL128Bw). Reductions and copies per threadblock: fast enough not to
# limit a channel on H100, where allreduce and allgather both reach ~370 (nccl-tests issue 212).
# NVLS on H100 (NVSwitch 3 with SHARP). A switch op loads each direction of its group's NVLink ports
# with what it moves there (msc.sim.simulate.Simulator._switch_flows: a reduce-load one byte out of
# every member's port and one into the reader's, a store the reverse), at nvls_gbps per port and
# direction: n GPUs' fused reduce-and-multicasts (or their reduce-loads beside stores of other chunks)
# put n + 1 bytes per byte on each port each way, so NVLS allreduce's bus bandwidth is 2(n-1)/(n+1)
# x the port rate, plus a barrier at each end of the call. Fitted on a grid (port 300-370
# GB/s, switch op 0.5-4 us, barrier 1-8 us) to the 8-GPU rows of Azure ND H100 v5 (NCCL 2.18.5, forced
# NVLS; tests/data/nccl_published.toml) through msc.sim.calibration (with its one-process host floor):
# 308 GB/s holds 1-8 GiB at 0.99-1.01 of the measured busbw; the barrier's 7 us narrows the 4-64 MB
# rows' excess (1.3-1.6x at 4-32 MB, a known gap there). Not fitted, and held: the 2-, 4-, 5-, 6- and
# 7-GPU rows (waynehacking8/nccl-collectives-bench, NCCL 2.29.2) at 0.96-1.06 (the n + 1 rule).
NVLS_H100 = dict(nvls_gbps=308.0, nvls_alpha_us=0.5, nvls_barrier_us=7.0)
H100 = Machine(
    "h100", reduce_gbps=1100.0, copy_gbps=1650.0, threadblock_gbps=60.0,
    protocols=_machine_protocols(simple={"nvlink": 0.82, "pcie": 0.82, "net": 0.94},
                                 ll={"nvlink": 141 / 450, "pcie": 0.82 / 3, "net": 39 / 400},
                                 threadblock_gbps=60.0, ll128_threadblock_gbps=36.7),
    nvlink_gbps=450.0, nvlink_alpha_us=HOP_US["nvlink"]["Simple"], proxy_us=1.0,
    description="H100 SXM", ll_net_many=20.4 / 400, **NVLS_H100)

# -- A100 SXM (DGX A100: 8 GPUs on NVSwitch, 8 HDR 200 Gb/s NICs, AMD EPYC 7742) --------------------
# NVLink3: 12 links x 25 GB/s = 300 GB/s per direction. Simple carries 0.845 of it: NCCL's
# allgather reaches 253.59 GB/s busbw at 1 GiB on 8 A100 (microsoft/mscclpp
# docs/performance-ndmv4.md, NCCL 2.17.1). LL: llMaxBw 87.7 on one Ampere node, 22.5 across two
# nodes of AMD hosts, 19.0 from 3. An HDR NIC (25 GB/s line) carries 24 (nccl-tests issue 119; "8x200Gbit/s IB
# cards ... 192GB/s AllReduce BusBW", nccl issue 812): 0.96. Threadblock: 40 GB/s (the Ampere search's
# top speed), LL128 20 (perChMaxRingLL128Bw). A threadblock adds at 107 GB/s: with it the ring
# allreduce is 0.91 of the allgather, as measured on the same machine (231.45 vs 253.59 GB/s at 1 GiB,
# the same page); HBM2e at 2 TB/s for copies.
A100 = Machine(
    "a100", reduce_gbps=107.0, copy_gbps=1000.0, threadblock_gbps=40.0,
    protocols=_machine_protocols(simple={"nvlink": 0.845, "pcie": 0.845, "net": 0.96},
                                 ll={"nvlink": 87.7 / 300, "pcie": 0.845 / 3, "net": 22.5 / 200},
                                 threadblock_gbps=40.0, ll128_threadblock_gbps=20.0),
    nvlink_gbps=300.0, nvlink_alpha_us=HOP_US["nvlink"]["Simple"], proxy_us=2.0,
    description="A100 SXM", ll_net_many=19.0 / 200)

TEXTBOOK = Machine("textbook", reduce_gbps=math.inf, copy_gbps=math.inf, threadblock_gbps=math.inf,
                   protocols=dict(DEFAULT_PROTOCOLS), nvlink_gbps=0.0, nvlink_alpha_us=0.0, proxy_us=0.0,
                   description="the alpha-beta model: no launch latency, LL a quarter of Simple's latency "
                               "and half its bandwidth, LL128 half and 120/128")

# -- H200 SXM (DGX H200: 8 GPUs on NVSwitch, 8 ConnectX-7 400 Gb/s NICs, Intel Xeon 8480C) -----------
# NVIDIA's DGX BasePOD reference architecture describes DGX H200 and DGX H100 as one system ("Four
# NVIDIA NVSwitch chips", "eight single-port NVIDIA ConnectX-7 VPI ... up to 400 Gb/s", "Dual Intel
# Xeon Platinum 8480C"; docs.nvidia.com/dgx-basepod, Core Components): the same NVLink 4 (450 GB/s per
# direction), switch, NICs and host, so NCCL finds the same graphs and H100's parameters apply. Its
# HBM3e (4.8 TB/s against 3.35) is more than a channel's copies and reductions need on H100 already.
# Nothing of H200 is fitted: Azure ND H200 v5's table and nccl-tests issue 272 (475 GB/s allreduce busbw,
# NCCL 2.20.3) are check rows (tests/data/nccl_published.toml; bench/README.md "Calibration").
H200 = replace(H100, name="h200", description="H200 SXM",
               uncalibrated="H100's calibration (the same NVLink 4, NVSwitch and NICs); no H200 measurement "
                            "is fitted")

# -- H20 (HGX H20: 8 GPUs on NVSwitch, one 400 Gb/s NIC per GPU) -------------------------------------
# A Hopper GPU with H100's NVLink 4: NCCL reads 18 links to the switch (NVL[370.8]), a PCIe Gen5 path
# (PCI[48.0]) and a 400 Gb/s NIC (NET[50.0]) in a published topology dump (nccl issue 1189); two nodes of
# 8 H20 with a ConnectX-7 NDR NIC per GPU in nccl issue 1244. The same SM as H100, so a threadblock's
# rates are H100's; its fewer SMs (against 132) still outnumber NCCL's channels. The host CPU is taken
# as Intel (HGX H20 servers vary; NCCL's LL caps and proxy overhead follow it). Nothing of H20 is
# fitted: nccl issue 1244's rows are check rows.
H20 = replace(H100, name="h20", description="H20",
              uncalibrated="H100's calibration (the same NVLink 4 and NICs) and an Intel host assumed; no H20 "
                           "measurement is fitted")

# -- B200 (DGX B200: 8 GPUs on two NVLink 5 switches, 8 ConnectX-7 400 Gb/s NICs, Intel Xeon 8570) -----
# NVLink 5: 18 links x 50 GB/s = 900 GB/s per direction, 1.8 TB/s per GPU (the DGX B200 user guide: "2 x
# 5th generation NVLink switches that provide 14.4 TB/s aggregate bandwidth", 8 x 1.8 TB/s; "8 x NVIDIA
# ConnectX-7 Single Port Cards ... Up to 400Gbps"; "2 x Intel Xeon 8570"). NCCL counts 18 x 40.1 = 721.8
# (SM100_NVLINK_BW, src/graph/topo.h@v2.30.7; "maxBw 721.8" in nccl issue 1807's log). Uncalibrated: no
# measured B200 row is fitted, each number is NCCL's or carried over from H100:
# - Simple carries H100's 0.82 of NVLink (NCCL's protocol overhead, "~20%", nccl-tests issue 212);
#   a NIC the same 0.94 (the same ConnectX-7).
# - LL: NCCL caps it at 2 x 141 = 282 GB/s on one Blackwell node (llMaxBws, src/graph/tuning.cc@v2.30.7):
#   282/900; across nodes by the host's row, Intel's as on H100 (39 on 2 nodes, 20.4 from 3).
# - A threadblock: 90 GB/s, the top of NCCL's SM100 intra-node speed array (search.cc@v2.30.7), as H100's
#   60 is SM90's; LL128 40 (perChMaxRingLL128Bws, Blackwell). Reductions and copies: H100's x 1.5, so
#   that they limit a 90 GB/s channel no more than H100's do a 60 one.
# - NVLS: the port rate at H100's fitted share of its line rate (308/450) times NCCL's NVLS efficiency
#   of Blackwell over Hopper (0.74/0.85, nvlsEfficiency, tuning.cc@v2.30.7): 0.596 x 900 = 536 GB/s;
#   H100's switch latencies. A check, not a fit: by the n + 1 rule 8 GPUs' NVLS allreduce is then
#   2 x 7/9 x 536 = 834 GB/s busbw (the library's nvls plan on 16 channels simulates 823-830 at 1-8 GiB),
#   where nccl issue 1807 measured "830+" on 8 B200 (NCCL 2.27.1, its algorithm not stated).
B200_NVLS_GBPS = NVLS_H100["nvls_gbps"] / H100.nvlink_gbps * 0.74 / 0.85 * 900.0
B200 = Machine(
    "b200", reduce_gbps=H100.reduce_gbps * 1.5, copy_gbps=H100.copy_gbps * 1.5, threadblock_gbps=90.0,
    protocols=_machine_protocols(simple={"nvlink": 0.82, "pcie": 0.82, "net": 0.94},
                                 ll={"nvlink": 282 / 900, "pcie": 0.82 / 3, "net": 39 / 400},
                                 threadblock_gbps=90.0, ll128_threadblock_gbps=40.0),
    nvlink_gbps=900.0, nvlink_alpha_us=HOP_US["nvlink"]["Simple"], proxy_us=1.0, description="B200",
    ll_net_many=20.4 / 400,
    nvls_gbps=round(B200_NVLS_GBPS, 1), nvls_alpha_us=NVLS_H100["nvls_alpha_us"],
    nvls_barrier_us=NVLS_H100["nvls_barrier_us"],
    uncalibrated="NVLink 5's line rate with NCCL's Blackwell constants and H100's protocol shares; no B200 "
                 "measurement is fitted")

# -- GB200 (GB200 NVL72: 72 Blackwell GPUs on one NVLink 5 switch domain, 36 Grace CPUs) --------------
# The rack's 72 GPUs share one NVLink domain through nine switch trays at 1.8 TB/s per GPU (NVIDIA's
# multi-node NVLink tuning guide, "Understanding Your Grace-Blackwell Systems": 18 compute trays of 4
# GPUs, 9 NVLink switch trays); each compute tray holds a ConnectX-7 per GPU (the same guide lists CX7
# in the compute tray; MLCommons inference v6.1, Crusoe's GB200-NVL72 system: 4 ConnectX-7 per 4-GPU
# node). The GPU is B200's as above; the host is Grace (Arm), whose network overhead NCCL takes as 1 us
# (getNetOverhead, tuning.cc@v2.30.7: x86 Intel 1, AMD 2, others 1). Uncalibrated as B200. A check, not
# a fit: CoreWeave's full-rack all_reduce_perf (coreweave/nccl-tests pull request 43) measured 835-847
# GB/s busbw at 4-8 GiB on 72 GPUs.
GB200 = replace(B200, name="gb200", description="GB200 (Blackwell, Grace host)",
                uncalibrated="B200's numbers (NVLink 5's line rate, NCCL's Blackwell constants, H100's protocol "
                             "shares) and a Grace host; no GB200 measurement is fitted")

MACHINES = {m.name: m for m in (H100, A100, H200, H20, B200, GB200, TEXTBOOK)}
