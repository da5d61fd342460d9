"""The built-in topologies: one table (PRESETS) that the CLI's help, the
manual (docs/performance.md) and the tests read, built from the machines of msc.sim.machines; and
``get_topology``, which turns a preset name, a TOML file or the uniform
model's numbers into a topology.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from msc.errors import UsageError, did_you_mean
from msc.sim.machines import A100, B200, GB200, H100, H20, H200, Machine
from msc.sim.topology import NIC_ALPHA_US, Nodes, Topology, Torus, Uniform, load_topology

NDR_GBPS = 50.0                 # 400 Gb/s
HDR_GBPS = 25.0                 # 200 Gb/s


def _gpu(m: Machine) -> dict:
    return dict(reduce_gbps=m.reduce_gbps, copy_gbps=m.copy_gbps, threadblock_gbps=m.threadblock_gbps,
                protocols=m.protocols, machine=m.name, note=m.note)


def _nvls(m: Machine) -> dict:
    """The switch's reduction and multicast where the GPUs sit on an NVSwitch that has them (NVLS)."""
    return dict(nvls_gbps=m.nvls_gbps, nvls_alpha_us=m.nvls_alpha_us, nvls_barrier_us=m.nvls_barrier_us)


def dgx(machine: Machine, nodes: int, nic_gbps: float, name: str, gpus_per_node: int = 8, **kw) -> Nodes:
    """``nodes`` nodes of ``gpus_per_node`` GPUs on NVSwitch, one NIC of ``nic_gbps`` per GPU."""
    gpu = dict(_gpu(machine), protocols=machine.protocols_for(nodes))
    return Nodes(name, nodes, gpus_per_node, port_gbps=machine.nvlink_gbps, port_alpha_us=machine.nvlink_alpha_us,
                 nic_gbps=nic_gbps, nic_alpha_us=NIC_ALPHA_US, message_us=machine.message_us, **gpu,
                 **_nvls(machine), **kw)


def dgx_h100(nodes: int = 1, name: str = "dgx-h100") -> Nodes:
    return dgx(H100, nodes, NDR_GBPS, name,
               description=_dgx_text(H100, nodes, "400 Gb/s"))


def dgx_a100(nodes: int = 1, name: str = "dgx-a100") -> Nodes:
    return dgx(A100, nodes, HDR_GBPS, name,
               description=_dgx_text(A100, nodes, "200 Gb/s"))


def dgx_h200(nodes: int = 1, name: str = "dgx-h200") -> Nodes:
    return dgx(H200, nodes, NDR_GBPS, name, description=_dgx_text(H200, nodes, "400 Gb/s"))


def hgx_h20(nodes: int = 1, name: str = "hgx-h20") -> Nodes:
    return dgx(H20, nodes, NDR_GBPS, name, description=_dgx_text(H20, nodes, "400 Gb/s"))


def hgx_b200(nodes: int = 1, name: str = "hgx-b200") -> Nodes:
    return dgx(B200, nodes, NDR_GBPS, name, description=_dgx_text(B200, nodes, "400 Gb/s"))


NVL72 = 72                      # GPUs in a GB200 NVL72 rack's NVLink domain


def gb200_nvl72(racks: int = 1, name: str = "gb200-nvl72") -> Nodes:
    """``racks`` GB200 NVL72 racks: 72 GPUs on one NVLink domain each (a "node" of the model), one
    400 Gb/s NIC per GPU between racks."""
    return dgx(GB200, racks, NDR_GBPS, name, gpus_per_node=NVL72,
               description=_dgx_text(GB200, racks, "400 Gb/s", gpus=NVL72, where="one NVLink 5 domain",
                                     unit="racks"))


def nvswitch() -> Nodes:
    """8 H100 on NVSwitch (the preset ``nvswitch``: dgx-h100's node)."""
    return dgx_h100(1, "nvswitch")


def infiniband(nodes: int) -> Nodes:
    """``nodes`` nodes of 8 H100, a 400 Gb/s NIC per GPU (the preset ``ib:NODES``)."""
    return dgx_h100(nodes, f"ib:{nodes}")


def _dgx_text(m: Machine, nodes: int, nic: str, gpus: int = 8, where: str = "NVSwitch", unit: str = "nodes") -> str:
    text = f"{gpus} {m.description} on {where} ({m.nvlink_gbps:g} GB/s per GPU and direction)"
    if nodes > 1:
        text = f"{nodes} {unit} of {text}, one {nic} NIC per GPU"
    return text


def pcie() -> Nodes:
    """8 GPUs, PCIe Gen4 x16 (~25 GB/s per direction in practice), two PCIe
    switches of 4 GPUs whose x16 uplinks meet at the CPU; NCCL's PCI hop
    latency (5.7 us with Simple). A100-PCIe class compute."""
    return Nodes("pcie", 1, 8, port_gbps=25.0, port_alpha_us=5.7, pcie_switches=2, uplink_gbps=25.0,
                 uplink_alpha_us=1.0, port_kind="pcie", **_gpu(A100),
                 description="8 A100 on two PCIe Gen4 switches (25 GB/s per GPU and direction)")


RING_GBPS = 50.0                # one NVLink4 bundle of two links


def ring(n: int) -> Torus:
    return Torus(1, n, alpha_us=H100.nvlink_alpha_us, bandwidth_gbps=RING_GBPS, kind="nvlink", **_gpu(H100),
                 description=f"bidirectional ring of {n} H100, {RING_GBPS:g} GB/s NVLink links")


def torus(rows: int, cols: int) -> Torus:
    return Torus(rows, cols, alpha_us=H100.nvlink_alpha_us, bandwidth_gbps=RING_GBPS, kind="nvlink",
                 **_gpu(H100), description=f"{rows}x{cols} torus of H100, {RING_GBPS:g} GB/s NVLink links")


@dataclass(frozen=True)
class Preset:
    """A built-in topology: ``name`` with an optional ``:ARG`` (``arg`` says
    what it is, None: takes none), ``build(arg, ranks)``, and one line of help."""

    name: str
    arg: str | None
    help: str
    build: Callable[[str | None, int | None, str], Topology]


def _nodes_arg(spec: str, arg: str | None, n: int | None, gpus: int = 8) -> int:
    if arg:
        return _int_arg(spec, arg)
    if n % gpus:
        raise UsageError(f"{spec}: nodes of {gpus} GPUs, but the plan has {n} ranks{what_fits(n)}")
    return n // gpus


def _torus_arg(spec: str, arg: str | None, n: int | None) -> Torus:
    if arg:
        m = re.fullmatch(r"(\d+)x(\d+)", arg)
        if not m or min(int(m[1]), int(m[2])) < 1:
            raise UsageError(f"bad topology {spec!r}: expected torus:ROWSxCOLS")
        return torus(int(m[1]), int(m[2]))
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return torus(rows, n // rows)


def _dgx(build: Callable[[int, str], Nodes], base: str, always_numbered: bool = False, gpus: int = 8):
    """A builder of nodes presets: NAME:NODES, or NAME for as many nodes as the ranks fill (one if not given)."""
    def make(arg, n, spec):
        nodes = _nodes_arg(spec, arg, n, gpus) if arg or n else 1
        return build(nodes, f"{base}:{nodes}" if nodes > 1 or always_numbered else base)
    return make


PRESETS: tuple[Preset, ...] = (
    Preset("dgx-h100", "NODES", "nodes of 8 H100 SXM on NVSwitch (450 GB/s per GPU and direction), one 400 Gb/s "
           "NIC per GPU; NCCL's latencies, calibrated against published NCCL measurements",
           _dgx(dgx_h100, "dgx-h100")),
    Preset("dgx-a100", "NODES", "nodes of 8 A100 SXM on NVSwitch (300 GB/s per GPU and direction), one 200 Gb/s "
           "NIC per GPU; calibrated likewise",
           _dgx(dgx_a100, "dgx-a100")),
    Preset("dgx-h200", "NODES", "nodes of 8 H200 SXM on NVSwitch (450 GB/s per GPU and direction), one 400 Gb/s "
           "NIC per GPU; H100's calibration applied (no H200 measurement fitted)",
           _dgx(dgx_h200, "dgx-h200")),
    Preset("hgx-h20", "NODES", "nodes of 8 H20 on NVSwitch (450 GB/s per GPU and direction), one 400 Gb/s NIC "
           "per GPU; H100's calibration applied (no H20 measurement fitted)",
           _dgx(hgx_h20, "hgx-h20")),
    Preset("hgx-b200", "NODES", "nodes of 8 B200 on NVLink 5 switches (900 GB/s per GPU and direction), one "
           "400 Gb/s NIC per GPU; uncalibrated (NCCL's Blackwell constants)",
           _dgx(hgx_b200, "hgx-b200")),
    Preset("gb200-nvl72", "RACKS", "GB200 NVL72 racks: 72 Blackwell GPUs in one NVLink 5 domain (900 GB/s per "
           "GPU and direction), one 400 Gb/s NIC per GPU between racks; uncalibrated, as hgx-b200",
           _dgx(gb200_nvl72, "gb200-nvl72", gpus=NVL72)),
    Preset("nvswitch", None, "8 H100 on NVSwitch: the same machine as dgx-h100",
           lambda arg, n, spec: nvswitch()),
    Preset("ib", "NODES", "nodes of 8 H100, one 400 Gb/s InfiniBand NIC per GPU: the same machine as dgx-h100:NODES",
           _dgx(dgx_h100, "ib", always_numbered=True)),
    Preset("pcie", None, "8 A100 on two PCIe Gen4 switches (25 GB/s per GPU and direction) meeting at the CPU",
           lambda arg, n, spec: pcie()),
    Preset("ring", "N", "a bidirectional ring of H100 joined by 50 GB/s NVLink links",
           lambda arg, n, spec: ring(_int_arg(spec, arg) if arg else n)),
    Preset("torus", "RxC", "a torus of H100 joined by 50 GB/s NVLink links, shortest-way routing",
           lambda arg, n, spec: _torus_arg(spec, arg, n)),
    Preset("uniform", "N", "N ranks fully connected, a link per rank pair of --alpha-us and --bandwidth-gbps "
           "(the textbook alpha-beta model); those two flags without --topology mean the same", None),
)
PRESET_NAMES = tuple(f"{p.name}[:{p.arg}]" if p.arg else p.name for p in PRESETS)


def fitting_presets(n: int) -> list[str]:
    """The built-in topologies of exactly ``n`` ranks, as --topology spells them."""
    specs = []
    if n % 8 == 0:
        nodes = n // 8
        eights = ["dgx-h100", "dgx-a100", "dgx-h200", "hgx-h20", "hgx-b200"]
        specs += eights + ["nvswitch", "pcie"] if nodes == 1 else [f"{s}:{nodes}" for s in eights] + [f"ib:{nodes}"]
    if n % NVL72 == 0:
        specs.append("gb200-nvl72" if n == NVL72 else f"gb200-nvl72:{n // NVL72}")
    specs.append(f"ring:{n}")
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    if rows > 1:
        specs.append(f"torus:{rows}x{n // rows}")
    return specs + [f"uniform:{n} (with --alpha-us US --bandwidth-gbps GBPS)"]


def what_fits(n: int | None) -> str:
    """``"; for N ranks: ring:N, ..."``: the end of a wrong-size message."""
    return f"; for {n} ranks use {', '.join(fitting_presets(n))}, or a TOML file" if n and n >= 1 else ""


def preset(spec: str, n: int | None) -> Topology:
    """The built-in topology ``spec`` names (NAME or NAME:ARG) for ``n`` ranks (None: as it says)."""
    name, _, arg = spec.partition(":")
    for p in PRESETS:
        if p.name == name and p.build is not None:
            if arg and p.arg is None:
                raise UsageError(f"topology {name!r} takes no ':{arg}'")
            if n is None and not arg and (p.arg in ("N", "RxC") or name == "ib"):
                raise UsageError(f"topology {spec!r} takes its size from the rank count: give --ranks N "
                                 f"(or {name}:{p.arg})")
            return p.build(arg or None, n, spec)
    raise UsageError(f"unknown topology {spec!r}: expected a TOML file or one of {', '.join(PRESET_NAMES)}"
                     + did_you_mean(name, [p.name for p in PRESETS]))


def get_topology(spec: str | None, num_ranks: int | None, *, alpha_us: float | None = None,
                 bandwidth_gbps: float | None = None) -> Topology:
    """A topology for ``num_ranks`` ranks from a preset name (PRESETS),
    a TOML file, or (no spec) the uniform model of ``alpha_us`` and
    ``bandwidth_gbps``. ``num_ranks`` None: as many as the spec names (msc bound)."""
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
        topo = preset(spec, num_ranks)
    if num_ranks is not None and topo.num_ranks != num_ranks:
        raise UsageError(f"topology {topo.name!r} has {topo.num_ranks} ranks, the plan {num_ranks}"
                         + what_fits(num_ranks))
    return topo


def _int_arg(spec, text):
    if not re.fullmatch(r"\d+", text) or int(text) < 1:
        raise UsageError(f"bad topology {spec!r}: {text!r} is not a positive count")
    return int(text)
