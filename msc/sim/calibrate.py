"""``msc calibrate``: a topology's parameters fitted to the user's own
nccl-tests measurements (msc.formats.nccl_tests), written as a TOML
topology every command takes.

Each measured size is predicted as ``msc simulate --nccl`` predicts it:
NCCL's choice by its tuning model (msc.sim.nccl, which no parameter here
changes), run as the msc plan that does the same and simulated. The fit
moves the parameters (``KNOBS``) the simulated time depends on, each inside
its physical range:

- per protocol: its launch latency, its fixed cost per message and
  iteration (``step_us``), the share of NVLink's and of a NIC's line rate it
  carries (the NIC's rate as the network sees it);
- per kind of link: Simple's hop latency over NVLink and over the network;
- across nodes: the least time a message holds both NICs (``message_us``,
  the host's network post overhead);
- where the switch reduces (NVLS): its port rate and barrier latency.

Simulating costs the most, so the fit simulates each measured size once
per candidate: at the topology's own parameters, once more per parameter
that acts on it (a small step up), and once at each fitted point. The
simulated time is piecewise linear in the latencies and in the inverses of
the rates (a sum along the critical path of the schedule, which max-plus
and max-min fair sharing keep), so those steps give its slopes, and the
fit is a bounded linear least squares on them, in relative error weighted
by the goal (10% from 1 MB, 20% below) and robust (Huber's weights: rows
far outside pull no harder than the bar), with a small pull towards the
topology's values where the rows leave a direction free. The fitted point
is simulated again and, where the critical path changed there, fitted
again from its simulated times with the first slopes (the chord method,
``rounds`` in all), keeping the best simulated point.

A measurement nccl-tests took with one process driving N GPUs (``-g N``,
without CUDA graphs, ``-G``) is floored at N host launches (msc.sim.calibration.HOST_LAUNCH_US); sizes
within 15% of that floor say nothing about the GPUs and are left out of
the fit (their ratio is still printed).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import numpy as np

from msc.errors import UsageError
from msc.sim import nccl
from msc.sim.calibration import HOST_LAUNCH_US
from msc.sim.machines import HOP_US, LAUNCH_US, MACHINES
from msc.sim.topology import GB, US, Nodes, Topology

MB = 1 << 20
GOAL = {True: 0.10, False: 0.20}        # the bar from 1 MB on, and below (issue 38)
HOST_BOUND = 1.15                       # measured within this factor of the host floor: the host's pace
RIDGE = 1e-3                            # pull towards the topology's values, per knob over its range
HUBER = 2.0                             # errors beyond twice the bar weigh as if linear (a robust fit)
# The most data a protocol's line carries: LL sends 8-byte packets of 4 data bytes and a flag, LL128
# 128-byte lines of 120 data bytes (msc.ir.ops, NCCL's "120/128"), Simple whole buffers.
PAYLOAD = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
STEP_US_MAX = 10.0                      # a message's fixed cost: a flag posted and waited on, a few us


@dataclass(frozen=True)
class Knob:
    """A parameter the fit moves: ``key`` (launch:P, step:P, alpha:KIND,
    bw:P:KIND, message:net, nvls:gbps, nvls:barrier), its range and unit, and whether the
    simulated time is linear in its inverse (a rate) or in itself."""

    key: str
    low: float
    high: float
    unit: str
    rate: bool
    why: str                            # where its range comes from

    @property
    def label(self) -> str:
        kind, *rest = self.key.split(":")
        return {"launch": "{} launch_us", "step": "{} step_us", "alpha": "{} hop alpha_us (Simple's)",
                "bw": "{} {} bandwidth_factor", "message": "net message_us",
                "nvls": "NVLS {}"}[kind].format(*rest)


def knobs(topology: Nodes) -> list[Knob]:
    """The parameters of ``topology`` a fit may move, with their physical ranges."""
    machine = MACHINES[topology.machine]
    shares = machine.protocols_for(topology.nodes)      # the machine's on this many nodes (LL's NIC share)
    out = []
    for p in topology.protocols:
        launch = LAUNCH_US[p]
        out.append(Knob(f"launch:{p}", launch / 2, launch * 2, "us", False,
                        f"within 2x of NCCL's base latency {launch:g} us (tuning.cc)"))
        out.append(Knob(f"step:{p}", 0.0, STEP_US_MAX, "us", False,
                        "0 to 10 us: a flag posted and waited on per message"))
        kinds = ["nvlink"] + (["net"] if topology.nodes > 1 else [])
        for kind in kinds:
            share = shares[p].links[kind].bandwidth_factor
            out.append(Knob(f"bw:{p}:{kind}", share / 4, PAYLOAD[p], "", True,
                            f"a quarter of {machine.name}'s {share:.3g} to {p}'s payload share {PAYLOAD[p]:.3g}"))
    for kind in ["nvlink"] + (["net"] if topology.nodes > 1 else []):
        hop = HOP_US[kind]["Simple"]
        out.append(Knob(f"alpha:{kind}", hop / 2, hop * 2, "us", False,
                        f"within 2x of NCCL's Simple hop latency {hop:g} us (tuning.cc)"))
    if topology.nodes > 1:
        post = machine.message_us
        out.append(Knob("message:net", post / 2, post * 2, "us", False,
                        f"within 2x of NCCL's network post overhead {post:g} us on {machine.name}'s host (tuning.cc)"))
    if topology.nvls_bandwidth:
        port = topology.port / GB
        out.append(Knob("nvls:gbps", machine.nvls_gbps / 4 if machine.nvls_gbps else port / 4, port, "GB/s", True,
                        f"a quarter of {machine.name}'s to the NVLink port's line rate {port:g} GB/s"))
        out.append(Knob("nvls:barrier", 0.0, 4 * max(machine.nvls_barrier_us, 1.0), "us", False,
                        f"0 to 4x {machine.name}'s {machine.nvls_barrier_us:g} us"))
    return out


def value(topology: Nodes, key: str) -> float:
    """The topology's value of a knob (in the knob's unit)."""
    kind, *rest = key.split(":")
    if kind == "launch":
        return topology.protocols[rest[0]].launch_us
    if kind == "step":
        return topology.protocols[rest[0]].step_us
    if kind == "bw":
        return topology.protocols[rest[0]].links[rest[1]].bandwidth_factor
    if kind == "alpha":
        return (topology.port_alpha if rest[0] == "nvlink" else topology.nic_alpha) / US
    if kind == "message":
        return topology.nic_message / US
    return topology.nvls_bandwidth / GB if rest[0] == "gbps" else topology.nvls_barrier / US


def with_values(topology: Nodes, values: dict[str, float]) -> Nodes:
    """``topology`` with the knobs of ``values`` set. A shallow copy: its NCCL plans
    (msc.sim.nccl_sim.plan_for's cache) are the original's, as no knob changes a plan."""
    t = copy.copy(topology)
    t._reset()
    protocols = dict(topology.protocols)
    for key, x in values.items():
        kind, *rest = key.split(":")
        if kind in ("launch", "step"):
            protocols[rest[0]] = replace(protocols[rest[0]], **{f"{kind}_us": x})
        elif kind == "bw":
            proto = protocols[rest[0]]
            links = dict(proto.links)
            links[rest[1]] = replace(links[rest[1]], bandwidth_factor=x)
            protocols[rest[0]] = replace(proto, links=links)
        elif kind == "alpha":
            setattr(t, "port_alpha" if rest[0] == "nvlink" else "nic_alpha", x * US)
        elif kind == "message":
            t.proxy = t.nic_message = x * US
        elif rest[0] == "gbps":
            t.nvls_bandwidth = x * GB
        else:
            t.nvls_barrier = x * US
    t.protocols = protocols
    return t


@dataclass(frozen=True)
class Measured:
    """One measured time of one size: the log's row and column."""

    collective: str
    size: int
    time_us: float
    floor_us: float             # the host's pace for this log (0: a process per GPU)
    where: str
    column: str                 # "out-of-place" or "in-place"

    @property
    def tolerance(self) -> float:
        return GOAL[self.size >= MB]

    @property
    def host_bound(self) -> bool:
        return self.floor_us > 0 and self.time_us < HOST_BOUND * self.floor_us


def measurements(logs, topology: Topology) -> list[Measured]:
    """Every time of every row of ``logs``, checked against ``topology``."""
    out = []
    for log in logs:
        if log.ranks is not None and log.ranks != topology.num_ranks:
            raise UsageError(f"{log.path}: the test ran on {log.ranks} ranks, topology {topology.name!r} has "
                             f"{topology.num_ranks}: give the topology of the machine it ran on")
        # one process launching N GPUs' kernels per call sets a floor, unless a CUDA graph launches them all
        floor = log.gpus_per_process * HOST_LAUNCH_US if log.gpus_per_process > 1 and not log.graph else 0.0
        for row in log.rows:
            if row.size == 0:                   # too few elements to split among the ranks: nothing moved
                continue
            for column, t in zip(("out-of-place", "in-place"), row.times_us):
                out.append(Measured(row.collective, row.size, t, floor, row.where, column))
    return out


@dataclass
class Fit:
    """A fit's outcome: the knobs, their values before and after, per
    measurement the prediction, and what it cost."""

    topology: Nodes                     # fitted
    knobs: list[Knob]
    before: dict[str, float]
    after: dict[str, float]
    free: set[str]                      # knobs the rows constrain (the others kept their value)
    measured: list[Measured]
    choice: dict[tuple, dict]           # (collective, size) -> NCCL's choice as simulated (record)
    predicted: list[float]              # per measurement, us (the host floor applied)
    before_predicted: list[float]
    simulations: int
    rounds: int

    def ratio(self, i: int, predicted=None) -> float:
        return (predicted or self.predicted)[i] / self.measured[i].time_us

    def within(self, i: int, predicted=None) -> bool:
        return abs(self.ratio(i, predicted) - 1) <= self.measured[i].tolerance


class _Sims:
    """Simulated records per (collective, size) on topologies, counted."""

    def __init__(self):
        self.count = 0

    def run(self, topology: Nodes, points) -> dict[tuple, dict]:
        from msc.sim.nccl_sim import simulate_nccl

        out = {}
        by = {}
        for c, s in points:
            by.setdefault(c, []).append(s)
        for collective, sizes in by.items():
            for size, rec in zip(sizes, simulate_nccl(collective, topology, sizes)):
                out[collective, size] = rec
            self.count += len(sizes)
        return out


def fit(logs, topology: Topology, *, rounds: int = 3) -> Fit:
    """``topology``'s knobs fitted to the measurements of ``logs``."""
    nccl.system(topology)                       # UsageError, with the reason, where NCCL's choice is not modelled
    measured = measurements(logs, topology)
    points = sorted({(m.collective, m.size) for m in measured})
    sims = _Sims()
    all_knobs = knobs(topology)
    before = {k.key: value(topology, k.key) for k in all_knobs}
    base = sims.run(topology, points)
    best_x, best_recs, best_score = dict(before), base, _score(measured, base)
    x, recs, free, done = dict(before), base, set(), 0
    slopes = _slopes(topology, x, recs, all_knobs, sims)
    for done in range(1, rounds + 1):
        # the slopes of the first point (the chord method): each round costs one simulation per size
        x_new, free_now = _solve(measured, recs, slopes, all_knobs, x, before, _weights(measured, recs))
        free |= free_now
        new_recs = sims.run(with_values(topology, x_new), points)
        score = _score(measured, new_recs)
        if score < best_score - 1e-12:
            best_x, best_recs, best_score = x_new, new_recs, score
        if all(abs(x_new[k] - x[k]) <= 1e-9 * max(1.0, abs(x[k])) for k in x):
            break
        x, recs = x_new, new_recs
    fitted = with_values(topology, best_x)
    return Fit(fitted, all_knobs, before, best_x, free, measured, best_recs,
               _predicted(measured, best_recs), _predicted(measured, base), sims.count, done)


def _predicted(measured: list[Measured], recs: dict) -> list[float]:
    return [max(recs[m.collective, m.size]["time"], m.floor_us) for m in measured]


def _score(measured: list[Measured], recs: dict) -> float:
    """The fit's objective on simulated times: weighted squared relative error of the rows it fits."""
    total = 0.0
    for m, p in zip(measured, _predicted(measured, recs)):
        if not m.host_bound:
            total += ((p - m.time_us) / (m.time_us * m.tolerance)) ** 2
    return total


def _weights(measured: list[Measured], recs: dict) -> list[float]:
    """Huber's weights on the simulated errors: 1 within HUBER bars, less beyond, so that the rows the
    model cannot reach (its structure, not its numbers, is off there) pull no harder than the bar."""
    out = []
    for m, p in zip(measured, _predicted(measured, recs)):
        r = abs(p - m.time_us) / (m.time_us * m.tolerance)
        out.append(1.0 if r <= HUBER else HUBER / r)
    return out


def _acts_on(knob: Knob, rec: dict) -> bool:
    """Whether ``knob`` can change the simulated time of ``rec`` (its protocol's, its links')."""
    kind, *rest = knob.key.split(":")
    if kind in ("launch", "step", "bw") and rest[0] != rec["protocol"]:
        return False
    if kind == "nvls":
        return rec["algorithm"] == "nvls"
    return True


def _slopes(topology: Nodes, x: dict, recs: dict, all_knobs: list[Knob], sims: _Sims) -> dict[str, dict]:
    """Per knob (not launches: their slope is 1) and measured size, d time / d knob (a rate's knob: d time /
    d (1 / knob)), from one simulation a small step up."""
    slopes = {}
    for knob in all_knobs:
        if knob.key.startswith("launch:"):
            continue
        points = [p for p, rec in recs.items() if _acts_on(knob, rec)]
        if not points:
            continue
        x0 = x[knob.key]
        if knob.rate:
            x1 = x0 / 1.1 if x0 * 1.1 > knob.high else x0 * 1.1     # stay inside: a factor is at most its payload share
            delta = 1 / x1 - 1 / x0
        else:
            step = max(0.1 * abs(x0), 0.2)
            x1 = x0 + step if x0 + step <= knob.high else x0 - step
            delta = x1 - x0
        moved = sims.run(with_values(topology, {**x, knob.key: x1}), points)
        slopes[knob.key] = {p: (moved[p]["time"] - recs[p]["time"]) / delta for p in points}
    return slopes


def _solve(measured, recs, slopes, all_knobs, x, prior, weights) -> tuple[dict, set]:
    """The knobs' least-squares values on the linearized times (bounded; rate knobs in their inverse)."""
    kept = [(m, w) for m, w in zip(measured, weights) if not m.host_bound]
    use = [m for m, _ in kept]
    free, cols = [], []
    for knob in all_knobs:
        if knob.key.startswith("launch:"):
            col = [1.0 if recs[m.collective, m.size]["protocol"] == knob.key.split(":")[1] else 0.0 for m in use]
        else:
            col = [slopes.get(knob.key, {}).get((m.collective, m.size), 0.0) for m in use]
        span = (1 / knob.low - 1 / knob.high) if knob.rate else knob.high - knob.low
        if use and max(abs(c) * span / m.time_us for c, m in zip(col, use)) >= 0.02:
            free.append(knob)
            cols.append(col)
    out = dict(x)
    if not free:
        return out, set()
    a = np.array(cols, dtype=float).T                          # measurements x knobs
    scale = np.array([math.sqrt(w) / (m.time_us * m.tolerance) for m, w in kept])
    x0 = np.array([1 / x[k.key] if k.rate else x[k.key] for k in free])
    pri = np.array([1 / prior[k.key] if k.rate else prior[k.key] for k in free])
    low = np.array([1 / k.high if k.rate else k.low for k in free])
    high = np.array([1 / k.low if k.rate else k.high for k in free])
    span = high - low
    # residual_i = (t_i + a_i . (v - x0) - m_i) * scale_i  ->  A v - b
    t = np.array([recs[m.collective, m.size]["time"] for m in use])
    meas = np.array([m.time_us for m in use])
    big_a = a * scale[:, None]
    b = (meas - t + a @ x0) * scale
    ridge = RIDGE * len(use) / span ** 2
    h = big_a.T @ big_a + np.diag(ridge)
    g = big_a.T @ b + ridge * pri
    v = np.clip(x0, low, high)
    for _ in range(5000):                                      # coordinate descent on a convex quadratic
        before = v.copy()
        for j in range(len(v)):
            v[j] = min(max((g[j] - h[j] @ v + h[j, j] * v[j]) / h[j, j], low[j]), high[j])
        if np.max(np.abs(v - before) / span) < 1e-10:
            break
    for k, val in zip(free, v):
        out[k.key] = float(1 / val if k.rate else val)
    return out, {k.key for k in free}


# -- the fitted topology as a TOML file ---------------------------------------------------------
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "inf" if v == math.inf else repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(result: Fit, *, name: str, sources: list[str]) -> str:
    """The fitted topology as a TOML file of nodes (msc.sim.topology's nodes form) that every command
    reads back as this topology: each value written, the fitted ones marked with the value they had."""
    t = result.topology
    comment = {k.key: (f"fitted (was {result.before[k.key]:.4g}; range {k.low:.4g}-{k.high:.4g})"
                       if k.key in result.free else "not constrained by the measurements: kept") for k in result.knobs}
    n_ok, n_held, n_before = summary(result)
    lines = [f"# msc calibrate: {t.name!s} fitted to {len(result.measured)} nccl-tests measurements of "
             f"{', '.join(sources)}",
             f"# within the bar (10% from 1 MB, 20% below): {n_ok} of {n_held} (before the fit: {n_before})",
             f"name = {_toml_value(name)}",
             f"description = {_toml_value(t.description)}",
             f"calibrated = {_toml_value(f'msc calibrate: {len(result.measured)} measurements of ' + ', '.join(sources))}",
             f"machine = {_toml_value(t.machine)}",
             f"nodes = {t.nodes}",
             f"gpus_per_node = {t.g}"]
    if t.nics != t.g:
        lines.append(f"nics_per_node = {t.nics}")
    if t.nic:
        lines.append(f"nic_gbps = {_toml_value(t.nic / GB)}")
    if t.nodes > 1:
        lines.append(f"message_us = {_toml_value(t.nic_message / US)}" + _mark(comment, "message:net"))
    lines += [f"nic_alpha_us = {_toml_value(t.nic_alpha / US)}" + _mark(comment, "alpha:net"),
              f"nvlink_gbps = {_toml_value(t.port / GB)}",
              f"nvlink_alpha_us = {_toml_value(t.port_alpha / US)}" + _mark(comment, "alpha:nvlink"),
              f"reduce_gbps = {_toml_value(1 / (t.gamma * GB) if t.gamma else math.inf)}",
              f"copy_gbps = {_toml_value(1 / (t.delta * GB) if t.delta else math.inf)}",
              f"threadblock_gbps = {_toml_value(t.threadblock_bandwidth / GB)}"]
    if t.nvls_bandwidth:
        lines += [f"nvls_gbps = {_toml_value(t.nvls_bandwidth / GB)}" + _mark(comment, "nvls:gbps"),
                  f"nvls_alpha_us = {_toml_value(t.nvls_alpha / US)}",
                  f"nvls_barrier_us = {_toml_value(t.nvls_barrier / US)}" + _mark(comment, "nvls:barrier")]
    for p, proto in t.protocols.items():
        lines += ["", f"[protocol.{p}]",
                  f"launch_us = {_toml_value(proto.launch_us)}" + _mark(comment, f"launch:{p}"),
                  f"step_us = {_toml_value(proto.step_us)}" + _mark(comment, f"step:{p}")]
        if proto.threadblock_gbps is not None:
            lines.append(f"threadblock_gbps = {_toml_value(proto.threadblock_gbps)}")
        if proto.tile:
            lines.append(f"tile = {proto.tile}")
        for kind, link in proto.links.items():
            lines += [f"[protocol.{p}.{kind}]", f"alpha_factor = {_toml_value(link.alpha_factor)}",
                      f"bandwidth_factor = {_toml_value(link.bandwidth_factor)}" + _mark(comment, f"bw:{p}:{kind}")]
    return "\n".join(lines) + "\n"


def _mark(comment: dict, key: str) -> str:
    return f"    # {comment[key]}" if key in comment else ""


def summary(result: Fit) -> tuple[int, int, int]:
    """(within the bar after the fit, measurements held to it (the host-bound aside), within it before)."""
    held = [i for i, m in enumerate(result.measured) if not m.host_bound]
    return (sum(result.within(i) for i in held), len(held),
            sum(result.within(i, result.before_predicted) for i in held))
