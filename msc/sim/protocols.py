"""How each protocol fares on each kind of link: the cost model's protocol
parameters, after NCCL's tuning model (src/graph/tuning.cc; numbers and
their sources: msc.sim.presets and bench/calibration/).

A link has a kind ("nvlink", "pcie", "net", or "link": the textbook
alpha-beta link of the uniform model and of TOML links that name none), a
line rate and a latency, its Simple latency. Per protocol and kind a
``LinkModel`` scales both: the latency a message pays (LL packets need no
fence: a fraction of Simple's) and the fraction of the line rate that
carries data (LL sends a 4-byte flag with every 4 bytes of data; even Simple
loses some to its flags and fences: NCCL's maintainers put Simple's
protocol overhead on NVLink at about 20%). Per protocol, a ``Protocol``
adds what no link decides: the latency of a launch (NCCL's base latency), the
rate one threadblock can move (a channel's cap) and the pipelining tile.

``Topology.view(protocol)`` (msc.sim.topology) applies these once, so the
simulator and ``msc bound`` read plain alphas and capacities.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from msc.errors import UsageError
from msc.ir.limits import MAX_TILE_BYTES
from msc.ir.ops import PROTOCOLS

GB = 1e9
US = 1e-6

# The ranges the cost model's inputs must lie in (TOML topologies, the uniform model's flags):
# finite, and far enough from overflow that no sum of latencies or size over a rate becomes inf.
ALPHA_US_MAX = 1e6                  # a latency (us): a second per hop, launch or message
GBPS_MIN, GBPS_MAX = 1e-6, 1e9      # a rate (GB/s): 1 kB/s to 1 EB/s
ALPHA_FACTOR_MAX = 1e3              # a protocol's latency as a multiple of Simple's


def number_in(what: str, v, low: float, high: float, *, above: bool = False, free: bool = False) -> float:
    """``v`` as a float if it is a number (not a bool) with ``low <= v <= high``
    (``low < v`` with ``above``; ``free``: inf too, meaning no limit), else a
    UsageError naming ``what``, the range and the value."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok and not (free and v == math.inf):
        ok = (low < v if above else low <= v) and v <= high
    if not ok:
        span = f"{'>' if above else '>='} {low:g} and <= {high:g}" + (" (or inf: no limit)" if free else "")
        raise UsageError(f"{what} must be a number {span}, got {v!r}")
    return float(v)

KINDS = ("link", "nvlink", "pcie", "net")
LINK = "link"


@dataclass(frozen=True)
class LinkModel:
    """One protocol on one kind of link: latency as a fraction of the
    link's Simple latency, and the fraction of its line rate carrying data."""

    alpha_factor: float
    bandwidth_factor: float

    def __post_init__(self):          # a negative factor predicted 0 us: no model holds one
        number_in("alpha_factor", self.alpha_factor, 0.0, ALPHA_FACTOR_MAX, above=True)
        number_in("bandwidth_factor", self.bandwidth_factor, 0.0, 1.0, above=True)


@dataclass(frozen=True)
class Protocol:
    """One protocol on one machine. ``launch_us``: paid once per collective
    (a kernel launch and its first and last synchronization: NCCL's base
    latency); ``threadblock_gbps``: the most one threadblock moves (None:
    the topology's threadblock rate times this protocol's bandwidth factor
    on a "link"); ``tile``: bytes per chunk and iteration where a plan says 0;
    ``links``: a LinkModel per kind; ``step_us``: what a message costs the
    threadblocks at its two ends per tile iteration whatever its size
    (posting and waiting on the connection's flags)."""

    launch_us: float = 0.0
    threadblock_gbps: float | None = None
    tile: int = 0
    links: dict = field(default_factory=dict)
    step_us: float = 0.0

    def __post_init__(self):
        number_in("launch_us", self.launch_us, 0.0, ALPHA_US_MAX)
        number_in("step_us", self.step_us, 0.0, ALPHA_US_MAX)
        if self.threadblock_gbps is not None:
            number_in("threadblock_gbps", self.threadblock_gbps, GBPS_MIN, GBPS_MAX)
        if type(self.tile) is not int or not 0 <= self.tile <= MAX_TILE_BYTES:
            raise UsageError(f"tile must be an int from 0 to {MAX_TILE_BYTES} (bytes), got {self.tile!r}")
        for kind, model in self.links.items():
            if not isinstance(model, LinkModel):
                raise UsageError(f"links[{kind!r}] must be a LinkModel, got {model!r}")

    def link(self, kind: str) -> LinkModel:
        return self.links[kind]


def textbook(name: str) -> Protocol:
    """The alpha-beta model's protocol: the same factors on every kind of
    link, no launch latency (msc.ir.ops.PROTOCOLS' factors: LL a quarter of
    Simple's latency and half its bandwidth, LL128 half and 120/128)."""
    spec = PROTOCOLS[name]
    model = LinkModel(spec.alpha_factor, spec.bandwidth_factor)
    return Protocol(0.0, None, spec.tile, {kind: model for kind in KINDS})


DEFAULT_PROTOCOLS = {name: textbook(name) for name in PROTOCOLS}

PROTOCOL_KEYS = {"alpha_factor", "bandwidth_factor", "tile", "launch_us", "threadblock_gbps", "step_us"}
KIND_KEYS = {"alpha_factor", "bandwidth_factor"}


def with_links(base: Protocol, **per_kind: tuple[float, float]) -> Protocol:
    """``base`` with the (alpha_factor, bandwidth_factor) of the kinds named."""
    links = dict(base.links)
    for kind, (af, bf) in per_kind.items():
        if kind not in KINDS:
            raise UsageError(f"unknown link kind {kind!r} (kinds: {', '.join(KINDS)})")
        links[kind] = LinkModel(af, bf)
    return replace(base, links=links)


def protocols_from_tables(tables: dict, base: dict[str, Protocol], bad) -> dict[str, Protocol]:
    """The TOML ``[protocol.NAME]`` tables applied over ``base``:
    ``alpha_factor``/``bandwidth_factor`` set every kind's (a "link"'s in
    particular), ``[protocol.NAME.KIND]`` one kind's; ``launch_us``,
    ``threadblock_gbps`` and ``tile`` the protocol's own. ``bad(msg)`` makes
    the error to raise."""
    out = dict(base)
    if not isinstance(tables, dict):
        raise bad("[protocol] must be a table of [protocol.NAME] tables")
    for pname, table in tables.items():
        if pname not in DEFAULT_PROTOCOLS or not isinstance(table, dict):
            raise bad(f"[protocol.{pname}]: protocols are {', '.join(DEFAULT_PROTOCOLS)}")
        unknown = set(table) - PROTOCOL_KEYS - set(KINDS)
        if unknown:
            raise bad(f"[protocol.{pname}]: unknown key(s) {', '.join(sorted(unknown))} (keys: "
                      f"{', '.join(sorted(PROTOCOL_KEYS))}; kinds of link: {', '.join(KINDS)})")
        proto = out[pname]
        everywhere = {k: _number(bad, pname, k, table[k]) for k in KIND_KEYS if k in table}
        links = {kind: replace(m, **everywhere) for kind, m in proto.links.items()}
        for kind in KINDS:
            if kind in table:
                sub = table[kind]
                if not isinstance(sub, dict) or set(sub) - KIND_KEYS:
                    raise bad(f"[protocol.{pname}.{kind}]: keys are {', '.join(sorted(KIND_KEYS))}")
                links[kind] = replace(links[kind], **{k: _number(bad, f"{pname}.{kind}", k, v) for k, v in sub.items()})
        own = {}
        for key in ("launch_us", "step_us", "threadblock_gbps"):
            if key in table:
                own[key] = _number(bad, pname, key, table[key])
        if "tile" in table:
            tile = table["tile"]
            if type(tile) is not int or not 1 <= tile <= MAX_TILE_BYTES:
                raise bad(f"[protocol.{pname}]: tile must be an int >= 1 and <= {MAX_TILE_BYTES} (bytes), "
                          f"got {tile!r}")
            own["tile"] = tile
        out[pname] = replace(proto, links=links, **own)
    return out


RANGES = {"alpha_factor": (0.0, ALPHA_FACTOR_MAX, True), "bandwidth_factor": (0.0, 1.0, True),
          "launch_us": (0.0, ALPHA_US_MAX, False), "step_us": (0.0, ALPHA_US_MAX, False),
          "threadblock_gbps": (GBPS_MIN, GBPS_MAX, False)}     # (low, high, low excluded)


def _number(bad, where: str, key: str, v) -> float:
    low, high, above = RANGES[key]
    try:
        return number_in(key, v, low, high, above=above)
    except UsageError as exc:
        raise bad(f"[protocol.{where}]: {exc}") from None
