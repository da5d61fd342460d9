"""``msc tune``: simulate algorithms x parameters x protocols x instance
counts on a topology, pick the fastest per size range, write the chosen
plans with their ranges.

Parameter variations (unless ``--param name=v1,v2`` lists them): an int
parameter with default d tries d, d/2, 2d and 4d (``chunks``: more or fewer
pipeline pieces); ``gpus_per_node`` also tries the topology's node size;
a bool tries both; anything else keeps its default. ``root`` is never
varied: ``--param root=R`` tunes the plans for root R (one value). At most MAX_VARIANTS combinations per algorithm, defaults first.

Ranges follow MSCCL: a plan serves min_bytes <= size < max_bytes. The first
range starts at 0 and the last is open (max_bytes null), so every size has a
plan; between two swept sizes with different winners the crossover is found
by bisection (both plans simulated at the midpoint, in log scale).

Instances: 1, 2, 4, 8, 16 and 32 (NCCL runs 16-32 channels on H100 and
A100 machines), each kept only while the plan has at most
MAX_THREADBLOCKS threadblocks on every rank (``max_threadblocks``): twice
NCCL's 32 channels of one block each, since an msc threadblock serves one
send and one receive peer where an NCCL block serves a ring's two or a
tree's four, and fewer than an A100's 108 or an H100's 132 SMs, so each
threadblock has an SM, as the cost model's per-threadblock rate assumes.
Instances multiply a plan's threadblocks, so counts over the budget are
skipped without lowering them.

Cost: every candidate is simulated by the fast engine at every size (exact
where no link is over-subscribed, else a lower bound: sharing only slows a
transfer), on one threadblock per class of those that run alike where the
plan has such symmetry (msc.sim.fast_fold: a ring's nodes and instances;
the same floats); the event engine then runs only where a bound could still
beat the best two exact times, so winners and runners-up are exact, and in
a crossover's bisection only where the two bounds leave the comparison
open. The simulations run on every core (msc.sim.parallel): each size's
walk through its candidates and each crossover's bisection decide in order
on their own results, so the result does not depend on the number of
workers.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from msc.dsl.collectives import COLLECTIVES, ROOTED
from msc.errors import AlgorithmError, LoweringError, MscError, UsageError
from msc.ir.ops import DEFAULT_PROTOCOL, PROTOCOL_NAMES
from msc.progress import steps
from msc.sim.parallel import Pool, cores, drive
from msc.dsl.collectives import BUSBW_FACTOR
from msc.units import format_size

MAX_VARIANTS = 12
# Candidates x sizes from which a tune simulates on every core (fewer: forking workers costs more than it saves).
PARALLEL_MIN_WORK = 400
DEFAULT_INSTANCES = (1, 2, 4, 8, 16, 32)
MAX_THREADBLOCKS = 64        # per rank (the module's docstring says why)
BISECT_ROUNDS = 6
# The baseline "vs ring" column compares with: the library's ring (chain for broadcast), Simple, 1 instance.
BASELINE = {name: spec.baseline for name, spec in COLLECTIVES.items() if spec.baseline}


@dataclass
class Candidate:
    algorithm: str
    file: str
    params: dict
    varied: dict
    protocol: str
    instances: int
    plan: object
    sim: object                  # msc.sim.simulate.Simulator (imported where used: msc.cli reads this module)
    folded: object = None        # its fast engine on one threadblock per class (msc.sim.fast_fold), if exact
    times: list = field(default_factory=list)      # seconds per swept size (exact, or a lower bound)
    known: list = field(default_factory=list)      # whether times[j] is exact

    @property
    def label(self) -> str:
        extra = f"[{','.join(f'{k}={v}' for k, v in self.varied.items())}]" if self.varied else ""
        return f"{self.algorithm}{extra} {self.protocol} x{self.instances}"

    def filename(self, ranks: int) -> str:
        """Names differ for every call a plan serves (form, root), so that
        tuning the other form or root into the same folder keeps both."""
        extra = "".join(f"-{k}{v}" for k, v in self.varied.items() if k != "root")
        call = ("" if self.plan.inplace else "-out") + (f"-root{self.plan.root}" if self.plan.root else "")
        name = (f"{self.plan.collective}-{self.algorithm}{extra}-{self.protocol}-i{self.instances}-n{ranks}"
                f"{call}.plan")
        return re.sub(r"[^A-Za-z0-9_.=-]", "_", name)

    def time_at(self, size: int) -> float:
        return time_at(self, size)

    def exact(self, j: int, size: int) -> float:
        """The time at swept size j, simulating contention if the fast
        engine's was only a bound."""
        if not self.known[j]:
            self.times[j] = contended_time(self, size)
            self.known[j] = True
        return self.times[j]


# The simulations of a tune, as functions of a candidate (msc.sim.parallel runs them in workers).
def time_at(c: Candidate, size: int) -> float:
    """``c``'s time at ``size``, exact (the event engine where transfers share links)."""
    t, exact = bound_at(c, size)
    return t if exact else contended_time(c, size)


def bound_at(c: Candidate, size: int) -> tuple[float, bool]:
    """(``c``'s time at ``size`` by the fast engine, whether it is exact; else a lower bound)."""
    [t], [exact] = fast_times(c, [size])
    return t, exact


def contended_time(c: Candidate, size: int) -> float:
    """``c``'s time at a size where the fast engine found transfers sharing
    a link: the event engine's ("auto" would rerun the fast one to find that again)."""
    return c.sim.run([size], engine="events")[0].seconds


def fast_times(c: Candidate, requested: list[int]) -> tuple[list, list]:
    """(times, whether each is exact) of ``c`` at the ``requested`` sizes by
    the fast engine: exact where no link is over-subscribed, else a lower
    bound raised to link_floor's."""
    res = (c.folded or c.sim).run(requested, engine="fast")
    floor = link_floor(c.sim, requested)
    return ([r.seconds if not r.contended else max(r.seconds, f) for r, f in zip(res, floor)],
            [not r.contended for r in res])


@dataclass
class TuneResult:
    collective: str
    ranks: int
    topology: str
    sizes: list
    candidates: list
    winners: list            # per size: candidate index
    ranges: list             # (min_bytes, max_bytes or None, candidate index)
    baseline: Candidate | None
    skipped: list            # human-readable notes
    bounds: list = field(default_factory=list)   # per size: msc bound's time (s); empty: no bound


def variants(alg, topology, user: dict) -> list[dict]:
    options = {}
    for key, default in alg.params.items():
        if key == "root":            # one root per tune: plans for other roots serve other calls
            if key in user:
                if len(user[key]) != 1:
                    raise UsageError(f"--param root takes one value, got {len(user[key])}: a plan for another "
                                     f"root serves another call; tune each root on its own (-o keeps them all)")
                options[key] = list(user[key])
            continue
        if key in user:
            options[key] = list(user[key])
        elif key == "gpus_per_node" and topology.gpus_per_node:
            options[key] = [default, topology.gpus_per_node]
        elif type(default) is bool:
            options[key] = [default, not default]
        elif type(default) is int and default >= 1:
            options[key] = [default, max(1, default // 2), 2 * default, 4 * default]
        else:
            options[key] = [default]
        options[key] = list(dict.fromkeys(options[key]))
    keys = list(options)
    combos = [dict(zip(keys, values)) for values in itertools.product(*(options[k] for k in keys))]
    return combos[:MAX_VARIANTS]


def _candidates(path, alg, ranks, topology, protocols, instances, user, inplace, skipped, varied_keys=True,
                max_threadblocks=None):
    import msc
    from msc.sim import fast_fold
    from msc.sim.simulate import Simulator

    out = []
    for params in variants(alg, topology, user):
        shown = {k: v for k, v in params.items() if v != alg.params.get(k)} if varied_keys else {}
        label = f"{alg.name} {params}"
        try:
            if not alg.supports(ranks, **params):
                skipped.append(f"{label}: does not support {ranks} ranks")
                continue
            prog = msc.trace(alg, ranks, inplace=inplace, **params)
            msc.verify(prog)
        except (AlgorithmError, MscError) as exc:
            skipped.append(f"{label}: {str(exc).splitlines()[0]}")
            continue
        over = set()
        shape = None            # (lowered plan, its partition): its protocols share the partition
        for plan in _lowered(prog, protocols, instances, max_threadblocks, over,
                             lambda why: skipped.append(f"{label} {why}")):
            try:
                sim = Simulator(plan, topology)
            except UsageError as exc:          # a plan the topology cannot run (switch ops without NVLS)
                skipped.append(f"{label} x{plan.instances}: {str(exc).splitlines()[0]}")
                continue
            if shape is None or shape[0].ranks is not plan.ranks:      # replace(plan, protocol=) keeps ranks
                shape = (plan, fast_fold.partition(sim))
            folded = fast_fold.quotient(sim, shape[1]) if shape[1] is not None else None
            out.append(Candidate(alg.name, str(path), params, shown, plan.protocol, plan.instances, plan, sim,
                                 folded))
        if over:
            skipped.append(f"{label}: x{', x'.join(map(str, sorted(over)))} would run over "
                           f"{max_threadblocks} threadblocks per rank (--max-threadblocks)")
    out.sort(key=lambda c: (protocols.index(c.protocol), c.instances))     # protocols first, as given
    return out


def threadblocks(plan) -> int:
    """The most threadblocks any rank of ``plan`` runs."""
    return max((len(rp.threadblocks) for rp in plan.ranks), default=0)


def _lowered(prog, protocols, instances, budget, over: set, skip):
    """The plans of ``prog`` for each protocol and instance count within
    ``budget`` threadblocks per rank (None: no budget); counts over it go
    into ``over``. Instances multiply the threadblocks, so once one count
    is lowered, larger ones over the budget are not. On msc's runtime (the
    tuner's target) the protocol changes nothing but the plan's field
    (its connections hold what the plan needs), so each count is lowered
    once and relabelled for the other protocols."""
    from dataclasses import replace

    from msc.lower.pipeline import LowerOptions, lower
    from msc.lower.switch import SWITCH_PROTOCOLS

    per_instance = None                 # threadblocks per rank and instance, once known
    for inst in sorted(instances):
        if budget is not None and per_instance is not None and per_instance * inst > budget:
            over.add(inst)
            continue
        try:
            plan = lower(prog, LowerOptions(protocol=protocols[0], instances=inst))
        except (LoweringError, MscError) as exc:
            skip(f"x{inst}: {str(exc).splitlines()[0]}")
            continue
        per_instance = threadblocks(plan) / inst
        if budget is not None and threadblocks(plan) > budget:
            over.add(inst)
            continue
        switch = plan.first_switch_step() is not None
        for proto in protocols:
            if switch and proto not in SWITCH_PROTOCOLS:      # as lower() refuses them (msc.lower.pipeline)
                skip(f"x{inst} {proto}: switch ops (NVLS) run with the Simple protocol only")
                continue
            yield plan if proto == plan.protocol else replace(plan, protocol=proto)


def tune(files: list[str], ranks: int, topology, requested: list[int], *, protocols=("Simple", "LL"),
         instances=DEFAULT_INSTANCES, max_threadblocks: int | None = MAX_THREADBLOCKS,
         user_params: dict | None = None, inplace: bool | None = None, refine: bool = True,
         runner_up: bool = True, workers: int | None = None) -> TuneResult:
    """Every algorithm of ``files`` x parameter variations x ``protocols``
    x ``instances`` (those within ``max_threadblocks`` per rank; None: no
    budget) simulated at the ``requested`` sizes; the winners and ranges.
    ``runner_up`` False: only the winners' times are made exact, and the
    ring baseline is not simulated (for scripts that want the winners).
    ``workers``: processes that simulate (None: one per core where the
    work is large enough; 1: this process only); the result is the same."""
    from msc.dsl.loader import load_algorithms

    if not files:
        raise UsageError("tune needs at least one algorithm file")
    if not requested:
        raise UsageError("no sizes to tune for (check -b, -e)")
    for p in protocols:
        if p not in PROTOCOL_NAMES:
            raise UsageError(f"unknown protocol {p!r} (expected {', '.join(PROTOCOL_NAMES)})")
    for i in instances:
        if type(i) is not int or i < 1:
            raise UsageError(f"instance counts must be ints >= 1, got {i!r}")
    if max_threadblocks is not None and (type(max_threadblocks) is not int or max_threadblocks < 1):
        raise UsageError(f"the threadblock budget must be an int >= 1, got {max_threadblocks!r}")
    user = user_params or {}
    skipped, cands, collective = [], [], None
    for path in steps(files, "tracing, verifying and lowering algorithms", unit="file"):
        algs = load_algorithms(path)
        if not algs:
            raise UsageError(f"{path} defines no @msc.algorithm")
        for alg in algs:
            if collective is None:
                collective = alg.collective.name
            elif alg.collective.name != collective:
                raise UsageError(f"tune compares algorithms of one collective: {alg.name} in {path} is "
                                 f"{alg.collective.name}, not {collective}")
            cands += _candidates(path, alg, ranks, topology, protocols, instances, user, inplace, skipped,
                                 max_threadblocks=max_threadblocks)
    if not cands:
        raise UsageError("no algorithm could be built at these settings:\n  " + "\n  ".join(skipped))
    baseline = _baseline(collective, ranks, topology, inplace, cands) if runner_up else None
    everyone = cands + ([baseline] if baseline is not None and baseline not in cands else [])
    if workers is None:
        workers = cores() if len(everyone) * len(requested) >= PARALLEL_MIN_WORK else 1
    if type(workers) is not int or workers < 1:
        raise UsageError(f"workers must be an int >= 1, got {workers!r}")
    exact = 2 if runner_up else 1
    with Pool(everyone, workers) as pool:
        _fast(pool, requested)
    if workers > 1:
        _fold_the_sure(cands, baseline, len(requested), exact)
    with Pool(everyone, workers) as pool:          # forked again: the workers start with the folds made
        _walk(pool, cands, baseline, requested, exact)
        winners = [min(range(len(cands)), key=lambda i: (cands[i].times[j], i)) for j in range(len(requested))]
        ranges = _ranges(pool, requested, winners, cands, refine)
    return TuneResult(collective, ranks, topology.name, list(requested), cands, winners, ranges, baseline, skipped,
                      _bounds(collective, topology, cands, winners, requested))


def _bounds(collective, topology, cands, winners, requested) -> list:
    """msc bound's time per size (s), at the size the winner simulates (rounded down to its chunks)."""
    from msc.sim.cut_bound import COLLECTIVES, lower_bound

    if collective not in COLLECTIVES:
        return []
    at = [cands[w].sim.chunk_geometry(s)[0] for w, s in zip(winners, requested)]
    return [b.seconds for b in lower_bound(collective, topology, at, root=cands[0].plan.root)]


def _fast(pool, requested):
    """Every candidate's time per size by the fast engine: exact without
    contention, else a lower bound (sharing a link only slows transfers),
    raised to link_floor's where transfers did share."""
    everyone = pool.items
    fast = pool.map(fast_times, everyone, requested)
    for c in steps(everyone, f"simulating {len(everyone)} candidates at {len(requested)} sizes (fast engine)",
                   unit="plan"):
        c.times, c.known = next(fast)


def _fold_the_sure(cands, baseline, sizes: int, exact: int) -> None:
    """The event engine's fold (msc.sim.symmetry) of every candidate the
    walks will surely run with contention, made here once before the
    workers fork, rather than in each worker that runs one of its sizes:
    at each size the ``exact`` least bounds that are not exact, and the
    baseline where it is not."""
    sure = {id(baseline): baseline} if baseline is not None and not all(baseline.known) else {}
    for j in range(sizes):
        for i in sorted(range(len(cands)), key=lambda i: (cands[i].times[j], i))[:exact]:
            if not cands[i].known[j]:
                sure[id(cands[i])] = cands[i]
    for c in sure.values():
        c.sim.folding


def _walk(pool, cands, baseline, requested, exact: int = 2):
    """Times per size, exact where it matters: only candidates whose bound
    (``_fast``'s) could still beat the ``exact`` least exact times get the
    event-driven simulation, so at each size the ``exact`` fastest (by
    default the winner and the runner-up) are exact and the rest are
    bounds. The sizes are walked side by side on the ``pool``'s workers;
    each size's walk is exact_best's."""
    walks = [_exact_walk(cands, j, size, exact, baseline) for j, size in enumerate(requested)]
    for _ in steps(drive(pool, walks), "simulating the fastest with contention (event engine)",
                   total=len(walks), unit="size"):
        pass


def _exact_walk(cands, j: int, size: int, count: int, baseline=None):
    """exact_best's walk at swept size j, as a generator for msc.sim.parallel.drive:
    it yields the event simulations it needs next, one at a time, and
    returns the ``count`` least times; then the ``baseline``'s time, exact."""
    best: list[float] = []
    for i in sorted(range(len(cands)), key=lambda i: (cands[i].times[j], i)):
        c = cands[i]
        if len(best) >= count and c.times[j] >= best[count - 1]:
            break
        if not c.known[j]:
            [c.times[j]] = yield [(contended_time, c, size)]
            c.known[j] = True
        best = sorted(best + [c.times[j]])
    if baseline is not None and not baseline.known[j]:
        [baseline.times[j]] = yield [(contended_time, baseline, size)]
        baseline.known[j] = True
    return best[:count]


def link_floor(sim, requested: list[int]) -> list[float]:
    """Per size, a lower bound on ``sim``'s time where transfers share
    links: the launch, then every byte the plan sends (or moves through the
    switch, weighted) over its busiest shared link at that link's full rate (max-min sharing never gives a
    link more). The fast engine's time is a lower bound too; their maximum
    is tighter where many flows share a NIC."""
    import numpy as np

    flows = sim.flow_conn >= 0
    per_flow = np.bincount(sim.flow_conn[flows], weights=sim.sp.count[flows], minlength=len(sim.res))
    load = np.zeros(len(sim.capacity))
    for c, (links, wts) in enumerate(zip(sim.res, sim.wts)):
        if wts is None:
            for r in links:
                load[r] += per_flow[c]
        else:                                   # a switch op's: its bytes on each port (Simulator._switch_flows)
            for r, w in zip(links, wts):
                load[r] += per_flow[c] * w
    busiest = float(np.max(load / np.asarray(sim.capacity))) if len(load) else 0.0
    return [sim.launch + busiest * sim.chunk_geometry(s)[2] for s in requested]


def exact_best(cands, j: int, size: int, count: int = 1) -> list[float]:
    """The ``count`` least times at swept size j (bytes ``size``), exact:
    candidates in order of their times (fast-engine lower bounds until made
    exact) are simulated until the next bound cannot beat them."""
    [(_, best)] = drive(Pool(cands, 1), [_exact_walk(cands, j, size, count)])
    return best


def _baseline(collective, ranks, topology, inplace, cands):
    from msc.dsl.loader import load_algorithms, resolve

    name = BASELINE.get(collective)
    if name is None:
        return None
    target = resolve(name).resolve()
    for c in cands:
        if resolve(c.file).resolve() == target and not c.varied and c.protocol == DEFAULT_PROTOCOL and c.instances == 1:
            return c
    try:
        [alg] = load_algorithms(name)
        found = _candidates(name, alg, ranks, topology, (DEFAULT_PROTOCOL,), (1,),
                            {k: [v] for k, v in alg.params.items()}, inplace, [], varied_keys=False)
    except MscError:
        return None
    return found[0] if found else None


def _ranges(pool, requested, winners, cands, refine):
    """(min_bytes, max_bytes or None, candidate index) per run of sizes with
    one winner; with ``refine``, each boundary by bisection (the
    crossovers' walks side by side on the ``pool``'s workers)."""
    bounds = [j for j in range(len(requested) - 1) if winners[j + 1] != winners[j]]
    walks = [_crossover(cands[winners[j]], cands[winners[j + 1]], requested[j], requested[j + 1]) for j in bounds]
    his = dict(zip(bounds, (requested[j + 1] for j in bounds)))
    if refine:
        for k, hi in drive(pool, walks):
            his[bounds[k]] = hi
    out = []
    lo = 0
    for j in bounds:
        out.append((lo, his[j], winners[j]))
        lo = his[j]
    out.append((lo, None, winners[-1]))
    return out


def _crossover(a: Candidate, b: Candidate, x: int, y: int):
    """Where between sizes x (``a`` wins) and y (``b`` wins) the winner
    changes: bisection in log scale, both simulated at the midpoint (a
    generator for msc.sim.parallel.drive); returns the first size ``b`` serves."""
    for _ in range(BISECT_ROUNDS):
        mid = int(round(math.sqrt(max(x, 1) * y)))
        if mid <= x or mid >= y:
            break
        if (yield from _a_wins(a, b, mid)):
            x = mid
        else:
            y = mid
    return y


def _a_wins(a: Candidate, b: Candidate, size: int):
    """Whether ``a``'s exact time at ``size`` is at most ``b``'s, with the
    event engine only where the fast engine's bounds leave it open: an exact
    time below the other's lower bound decides (the lower bound's
    candidate simulated first)."""
    (ta, ea), (tb, eb) = yield [(bound_at, a, size), (bound_at, b, size)]
    for _ in range(2):
        if ea and (eb or ta <= tb):          # ta <= tb <= b's exact time, or both exact
            return ta <= tb
        if eb and tb < ta:                   # b's exact time is below a's bound
            return False
        if not ea and (eb or ta <= tb):
            [ta], ea = (yield [(contended_time, a, size)]), True
        else:
            [tb], eb = (yield [(contended_time, b, size)]), True
    return ta <= tb


# -- output -----------------------------------------------------------------
def index_entries(result: TuneResult) -> list[dict]:
    out = []
    for lo, hi, i in result.ranges:
        c = result.candidates[i]
        entry = {"file": c.filename(result.ranks), "collective": result.collective, "ranks": result.ranks,
                 "min_bytes": lo, "max_bytes": hi, "algorithm": c.algorithm, "protocol": c.protocol,
                 "instances": c.instances, "inplace": c.plan.inplace}
        if result.collective in ROOTED:
            entry["root"] = c.plan.root
        # "_" keys: the tuner's notes (a registry ignores them)
        entry.update({"_params": c.params, "_topology": result.topology, "_label": c.label})
        out.append(entry)
    return out


def write_plans(result: TuneResult, outdir: str | Path) -> list[dict]:
    """The chosen plans as .plan files and their ranges in plans.json (each
    file written whole or not at all, plans.json last). An existing
    plans.json keeps its entries for other calls (collective, ranks, form,
    root); those for the calls tuned are replaced. The folder is locked from
    reading plans.json to writing it, so tunes into one folder at once each
    merge into what the one before wrote. Returns the new entries."""
    from msc.files import folder_lock, write_output
    from msc.formats.plan_text import save_plan

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    entries = index_entries(result)
    with folder_lock(outdir):
        index = merged_index(outdir / "plans.json", entries)       # checked before anything is written
        for entry, (_, _, i) in zip(entries, result.ranges):
            save_plan(result.candidates[i].plan, outdir / entry["file"])
        write_output(outdir / "plans.json", json.dumps(index, indent=2) + "\n")
    return entries


def merged_index(path: Path, entries: list[dict]):
    """What plans.json at ``path`` becomes with the tuner's ``entries``: its
    entries for other calls kept (in its own form: a list, or an object
    with "plans"), those for the calls of ``entries`` replaced. A file the
    plan registry cannot read, or a kept entry whose plan file a new entry
    would overwrite, is refused (the user's index is never lost)."""
    from msc.dsl.collectives import collective_key
    from msc.formats.registry import read_index

    if not path.exists():
        return entries
    try:
        data, old = read_index(path, verify=False)     # one read: old[i] is the entry of item i
    except MscError as exc:
        raise UsageError(f"{exc} (msc tune merges its plans into the index there: fix it or move it away)") from None
    items = data["plans"] if isinstance(data, dict) else data
    tuned = {(collective_key(e["collective"]), e["ranks"], e["inplace"], e.get("root", 0)) for e in entries}
    new_files = {e["file"] for e in entries}
    kept = []
    for item, entry in zip(items, old):
        if entry.key in tuned:
            continue
        if (path.parent / item["file"]).resolve() in {(path.parent / f).resolve() for f in new_files}:
            raise UsageError(f"{path}: its entry for {entry.describe()} uses {item['file']}, which the tuned "
                             f"plan for another call would overwrite: give msc tune another -o folder")
        kept.append(item)
    if isinstance(data, dict):
        return {**data, "plans": kept + entries}
    return kept + entries




def per_size(result: TuneResult) -> list[dict]:
    factor = BUSBW_FACTOR.get(result.collective, lambda n: 1.0)(result.ranks)
    rows = []
    for j, size in enumerate(result.sizes):
        order = sorted(range(len(result.candidates)), key=lambda i: (result.candidates[i].times[j], i))
        win = result.candidates[order[0]]
        t = win.times[j]
        nxt = result.candidates[order[1]] if len(order) > 1 else None
        base = result.baseline
        rows.append({"size": size, "winner": win.label, "time_us": t * 1e6,
                     "busbw": size / t / 1e9 * factor if t > 0 else 0.0,
                     "runner_up": nxt.label if nxt else None,
                     "vs_runner_up": nxt.times[j] / t if nxt and t > 0 else None,
                     "vs_ring": base.times[j] / t if base and t > 0 else None,
                     "bound_us": result.bounds[j] * 1e6 if result.bounds and result.bounds[j] is not None else None,
                     "bound_pct": 100 * result.bounds[j] / t if result.bounds and result.bounds[j] is not None
                     and t > 0 else None})
    return rows


def format_tune(result: TuneResult, outdir: str | None = None) -> str:
    rows = per_size(result)
    w = max([len(c.label) for c in result.candidates] + [9])
    lines = [f"# msc tune: {result.collective}, {result.ranks} ranks, topology {result.topology}, "
             f"{len(result.candidates)} candidates (predicted times)",
             f"#{'size':>10}  {'winner':<{w}} {'time(us)':>9} {'busbw':>7} {'%bound':>6}  {'runner-up':<{w}} "
             f"{'x':>6}  {'vs ring':>7}"]
    for row in rows:
        x = f"{row['vs_runner_up']:.2f}x" if row["vs_runner_up"] else "-"
        ring = f"{row['vs_ring']:.2f}x" if row["vs_ring"] else "-"
        pct = f"{row['bound_pct']:.1f}" if row["bound_pct"] is not None else "-"
        lines.append(f"{format_size(row['size']):>11}  {row['winner']:<{w}} {row['time_us']:9.2f} {row['busbw']:7.2f} "
                     f"{pct:>6}  {row['runner_up'] or '-':<{w}} {x:>6}  {ring:>7}")
    lines.append("# chosen (min_bytes <= size < max_bytes)" + (f", written to {outdir}/plans.json:" if outdir else ":"))
    for entry, (lo, hi, i) in zip(index_entries(result), result.ranges):
        span = f"[{format_size(lo)}, {format_size(hi)})"
        lines.append(f"#   {span:<22} {result.candidates[i].label:<{w}} {entry['file']}")
    if result.baseline is None:
        lines.append("# vs ring: no ring baseline for this collective")
    else:
        lines.append(f"# vs ring: {result.baseline.label} (time of the ring / time of the winner)")
    lines.append("# %bound: msc bound's least time as a percent of the winner's (100: no plan can be faster)")
    for note in result.skipped:
        lines.append(f"# skipped: {note}")
    return "\n".join(lines)


def records(result, cand) -> list[dict]:
    """busbw records of a candidate at the swept sizes (for plots)."""
    return busbw_records(result, cand.times)


def busbw_records(result, seconds: list[float]) -> list[dict]:
    """busbw records of times (s) at the swept sizes (for plots)."""
    factor = BUSBW_FACTOR.get(result.collective, lambda n: 1.0)(result.ranks)
    return [{"size": s, "busbw": s / t / 1e9 * factor if t > 0 else 0.0, "time": t * 1e6}
            for s, t in zip(result.sizes, seconds) if t is not None]
