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
measurements; bench/calibration.py prints and draws the comparison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
    description: str


def _protocol(launch_us: float, threadblock_gbps: float, tile: int, **kinds: tuple[float, float]) -> Protocol:
    """A protocol whose kinds not named keep the textbook factors of its name's tile."""
    return Protocol(launch_us, threadblock_gbps, tile, {k: LinkModel(*v) for k, v in kinds.items()})


def _complete(protocols: dict) -> dict:
    """Each protocol with the textbook model for every kind it does not name."""
    out = {}
    for name, p in protocols.items():
        links = dict(DEFAULT_PROTOCOLS[name].links)
        links.update(p.links)
        out[name] = Protocol(p.launch_us, p.threadblock_gbps, p.tile, links)
    return out


KIB = 1024

# -- H100 SXM ----------------------------------------------------------------------------------
# Latencies: NCCL's ring model (tuning.cc): base latency per protocol (LL 6.6, LL128 14, Simple
# 8.4 us) and hardware latency per hop: NVLink 0.6 / 1.9 / 3.4 us, PCI 1.0 / 2.5 / 5.7, network
# 2.7 / 4.0 / 14.0 (LL / LL128 / Simple). Bandwidth: NVLink4 is 18 links x 25 GB/s = 450 GB/s per
# direction; NCCL's Simple ring reaches ~370 GB/s busbw on 8 H100 (nccl-tests issue 212: "protocol
# overhead ~20%"): Simple carries 0.82 of the NVLink line rate. NDR 400 Gb/s NICs (50 GB/s line)
# carry 46-48 GB/s through NCCL (nccl-tests issue 290): 0.94. LL carries 4 data bytes per 8-byte
# packet; NCCL models its ring at a third of Simple's bus bandwidth (a quarter for allreduce);
# LL128 120 of 128 bytes, modelled at 0.92 of Simple's (tuning.cc).
H100 = Machine(
    "h100", reduce_gbps=1100.0, copy_gbps=1650.0, threadblock_gbps=40.0,
    protocols=_complete({
        "LL": _protocol(6.6, 20.0, 32 * KIB, nvlink=(0.6 / 3.4, 0.82 / 3), pcie=(1.0 / 5.7, 0.82 / 3),
                        net=(2.7 / 14.0, 0.94 / 4)),
        "LL128": _protocol(14.0, 36.7, 256 * KIB, nvlink=(1.9 / 3.4, 0.82 * 0.92), pcie=(2.5 / 5.7, 0.82 * 0.92),
                           net=(4.0 / 14.0, 0.94 * 0.92)),
        "Simple": _protocol(8.4, 40.0, 512 * KIB, nvlink=(1.0, 0.82), pcie=(1.0, 0.82), net=(1.0, 0.94)),
    }),
    nvlink_gbps=450.0, nvlink_alpha_us=3.4,
    description="H100 SXM")

# -- A100 SXM ----------------------------------------------------------------------------------
# NVLink3: 12 links x 25 GB/s = 300 GB/s per direction. The same protocol model as H100 (NCCL's
# latencies do not depend on the generation), A100's HBM2e (2.0 TB/s) for reductions and copies.
A100 = Machine(
    "a100", reduce_gbps=670.0, copy_gbps=1000.0, threadblock_gbps=40.0,
    protocols=H100.protocols, nvlink_gbps=300.0, nvlink_alpha_us=3.4, description="A100 SXM")

TEXTBOOK = Machine("textbook", reduce_gbps=math.inf, copy_gbps=math.inf, threadblock_gbps=math.inf,
                   protocols=dict(DEFAULT_PROTOCOLS), nvlink_gbps=0.0, nvlink_alpha_us=0.0,
                   description="the alpha-beta model: no launch latency, LL a quarter of Simple's latency "
                               "and half its bandwidth, LL128 half and 120/128")

MACHINES = {m.name: m for m in (H100, A100, TEXTBOOK)}
