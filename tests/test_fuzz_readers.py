"""Both readers (plan text, MSCCL XML) under a seeded mutation loop, bounded
in time: every mutant is read and, where it parses, verified. Nothing may end
in anything but an msc error (no traceback), nothing may run past its budget
of CPU time (no hang; a loaded machine does not inflate it), and every mutant
the verifier accepts must compute the collective right on the reference executor (random inputs, never zero,
against msc.verification.reference): a reader that accepted a wrong plan would fail here.

The counts (mutants tried, refused by the reader, refused by the verifier,
accepted and checked) are printed for the record (`pytest -s`).
"""
from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest

import msc
from msc.verification import reference

from msc.executor import run_collective
from msc.lower.pipeline import LowerOptions, lower
from msc.formats.plan_text import dump_plan, parse_plan
from msc.verification.plan import verify_plan
from msc.formats.xml_export import plan_to_xml
from msc.formats.xml_import import xml_to_plan
from library import algorithms
from patience import OverBudget, cpu_budget

MUTANTS = 4000              # per reader, under -m slow; the default run tries a tenth (SHARES)
BUDGET_S = 10               # CPU-seconds per mutant: reading, verifying and running it
BASES = [("allreduce/ring:ring", 3, True), ("allgather/ring:ring", 4, False), ("alltoall/allpairs:allpairs", 3, True),
         ("reducescatter/ring:ring", 3, True), ("broadcast/chain:chain", 3, False), ("reduce/tree:tree", 4, True)]
NUMBERS = ("0", "1", "2", "3", "5", "-1", "4096", "99999999999999999999", "1" * 50)


# The share of each loop's mutants a run tries: a tenth by default (the first tenth of the same seeded
# sequence), all of them under -m slow. The counts each loop asserts scale with it.
SHARES = [pytest.param(0.1, id="tenth"), pytest.param(1.0, id="all", marks=pytest.mark.slow)]


def base_plans():
    out = []
    for key, n, inplace in BASES:
        program = msc.trace(algorithms()[key], n, inplace=inplace)
        out.append(lower(program, LowerOptions()))
    return out


def mutate(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        kind = rng.choice(("number", "number", "number", "delete", "duplicate", "swap", "char", "truncate"))
        if kind == "number":
            found = list(re.finditer(r"\d+", lines[i]))
            if found:
                m = rng.choice(found)
                lines[i] = lines[i][:m.start()] + rng.choice(NUMBERS + (str(int(m.group()) + 1),)) + lines[i][m.end():]
        elif kind == "delete" and len(lines) > 1:
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "swap":
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "char":
            at = rng.randint(0, len(lines[i]))
            lines[i] = lines[i][:at] + rng.choice("0123456789-[]:,.@\"<>/=x \t") + lines[i][at + rng.randint(0, 1):]
        else:
            joined = "\n".join(lines)
            lines = joined[:rng.randint(0, len(joined))].split("\n")
    return "\n".join(lines)


def computes_right(plan) -> bool:
    """The plan on the reference executor with random inputs equals msc.verification.reference (2 counts)."""
    from msc.cuda.validate import units

    if plan.collective not in reference.COLLECTIVES:
        return True                       # a custom collective named by a mutant: nothing to compare
    for count in (1, 7):
        in_units = units(plan)[0]
        inputs = reference.random_inputs(np.random.default_rng(count), np.dtype("float32"), "sum", plan.num_ranks,
                                      in_units * count)
        got = run_collective(plan, [x.copy() for x in inputs], "sum", count=count)
        want = reference.expected_outputs(plan.collective, inputs, op="sum", root=plan.root)
        for r in range(plan.num_ranks):
            if want[r] is not None and not np.allclose(got[r], want[r], rtol=1e-5):
                return False
    return True


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("reader", ["plan", "xml"])
def test_mutated_files_are_refused_or_computed_right(reader, share):
    rng = random.Random(20261123 + (reader == "xml"))
    bases = [dump_plan(p) if reader == "plan" else plan_to_xml(p) for p in base_plans()]
    read = parse_plan if reader == "plan" else xml_to_plan
    counts = {"tried": 0, "unread": 0, "refused": 0, "accepted": 0}
    start = time.perf_counter()
    for i in range(round(MUTANTS * share)):
        text = mutate(bases[i % len(bases)], rng)
        counts["tried"] += 1
        try:
            with cpu_budget(BUDGET_S):
                try:
                    plan = read(text)
                except msc.MscError:
                    counts["unread"] += 1
                    continue
                try:
                    verify_plan(plan)
                except msc.MscError:
                    counts["refused"] += 1
                    continue
                counts["accepted"] += 1
                assert computes_right(plan), f"accepted but wrong ({reader} mutant {i}):\n{text[:3000]}"
        except OverBudget:
            pytest.fail(f"{reader} mutant {i} ran over {BUDGET_S} CPU-seconds:\n{text[:3000]}")
        except AssertionError:
            raise
        except Exception as exc:          # noqa: BLE001 - the point: only msc errors
            pytest.fail(f"{reader} mutant {i}: {type(exc).__name__}: {str(exc)[:300]}\n{text[:2000]}")
    print(f"\n{reader}: {counts} in {time.perf_counter() - start:.1f} s")
    # the XML reader verifies what it reads (at the runtime's slots): its refusals count as unread
    assert counts["accepted"] > 0 and counts["unread"] > 0 and (reader == "xml" or counts["refused"] > 0), counts


# -- TOML topologies and plans.json (issue 27) ---------------------------------------------------------
# The same loop over the two other files users write: every mutant is refused with a typed msc error
# or read into something consistent (finite latencies and rates, a finite bound that no simulated plan
# beats, registry entries of the right types that select their own plans). Rank counts are mutated
# only to small values: the rank limit (msc.ir.limits.MAX_RANKS) has tests of its own.
TOML_MUTANTS = 1200
INDEX_MUTANTS = 1500
TOML_BASES = ['''name = "islands"
ranks = 4
machine = "h100"
threadblock_gbps = 40
gpus_per_node = 2

[[link]]
from = [0, 1, 2, 3]
to = ["a", "a", "b", "b"]
alpha_us = 0.5
bandwidth_gbps = 100
kind = "nvlink"

[[link]]
from = "a"
to = "b"
alpha_us = 2
bandwidth_gbps = 25
kind = "net"
shared = true
duplex = true

[protocol.LL]
launch_us = 6.6
alpha_factor = 0.25
[protocol.LL.nvlink]
bandwidth_factor = 0.3
[protocol.Simple]
tile = 524288
step_us = 1.0
''', '''ranks = 3
forward = true
reduce_gbps = 500
copy_gbps = 1000

[[link]]
from = [0, 1, 2]
to = [1, 2, 0]
alpha_us = 1.0
bandwidth_gbps = 10.0
shared = false
duplex = false

[protocol.LL128]
threadblock_gbps = 20
bandwidth_factor = 0.9
''']
TOML_VALUES = ("0", "1", "-1", "2.5", "1e308", "-1e308", "1e-320", "inf", "-inf", "nan", "true", "false",
               '"false"', '"x"', "[1]", "[]", "{a = 1}", "99999999999999999999", "0.0", "-0.0", "1e6", "1e-6",
               '"nvlink"', '"a"', "4611686018427387904")
GOOD_VALUES = ("0.25", "0.9", "10", "40", "100", "2", "1", "0.5", "1e5", "1e-5")     # values read on


def mutate_toml(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        key, sep, value = lines[i].partition(" = ")
        if sep and rng.random() < 0.8:            # a value replaced: the reader's checks, not the parser's
            choices = ("1", "2", "3", "5", "0", "-1", "[1]", '"4"', "4.0") if key == "ranks" else \
                GOOD_VALUES if rng.random() < 0.5 else TOML_VALUES
            lines[i] = f"{key} = {rng.choice(choices)}"
        elif rng.random() < 0.5 and key != "ranks":
            lines.insert(i, rng.choice(("[[link]]", "[protocol.LL]", "[protocol.XL]", "[protocol.Simple.pcie]",
                                        "link = 5", "protocol = 5", 'from = "c"', "x = " + "[" * 3000 + "]" * 3000,
                                        "alpha_factor = 2", "bandwidth_factor = 1.5", "tile = 0")))
        else:
            lines = mutate("\n".join(lines), rng).split("\n")
    text = "\n".join(lines)       # a rank count the generic mutation made large: back to a small one
    return re.sub(r"^ranks = (\d{2,})", lambda m: f"ranks = {int(m[1]) % 8 + 1}", text, flags=re.M)


def topology_consistent(topo, tmp_plans: dict) -> None:
    """A topology msc read: finite positive numbers everywhere it is asked, and, where a ring plan fits
    its rank count, a finite simulated time that the bound does not exceed."""
    import math

    from msc.cli.bound import add_bound
    from msc.sim.cut_bound import lower_bound
    from msc.sim.simulate import Simulator

    n = topo.num_ranks
    for proto in topo.protocols:
        view = topo.view(proto)
        for src, dst in ((0, n - 1), (n - 1, 0)) if n > 1 else ():
            try:
                route = view.route(src, dst)
            except msc.MscError:
                continue                                  # no path: a typed error, as the bound's below
            assert math.isfinite(route.alpha) and route.alpha >= 0, route
            assert route.bandwidth > 0 and all(math.isfinite(view.capacity[r]) and view.capacity[r] > 0
                                               for r in route.resources), route
    try:
        [bound] = lower_bound("allreduce", topo, [1 << 20])
    except msc.MscError:
        return                                            # ranks that cannot reach each other
    assert math.isfinite(bound.seconds) and bound.seconds >= 0, bound          # 0: no cut binds
    plan = tmp_plans.get(n)
    if plan is not None:
        try:
            records = add_bound(Simulator(plan, topo).records([1 << 20]), "allreduce", 0, topo)
        except msc.MscError:
            return                                        # a pair the plan uses has no path: named
        for r in records:
            assert math.isfinite(r["time"]) and r["time"] > 0 and r["bound_pct"] <= 100 + 1e-6, r


def fuzz_reader(label: str, mutants: int, path, make_text, read, check, on_refused=lambda exc: None) -> dict:
    """Write mutant i (``make_text(i)``) to ``path`` and ``read(path)`` it, each within BUDGET_S: a refusal
    must be an msc error (``on_refused`` checks it), an accepted result must pass ``check``; anything else
    fails naming the mutant. Returns the counts of mutants tried, refused and accepted."""
    counts = {"tried": 0, "refused": 0, "accepted": 0}
    start = time.perf_counter()
    for i in range(mutants):
        text = make_text(i)
        path.write_text(text)
        counts["tried"] += 1
        try:
            with cpu_budget(BUDGET_S):
                try:
                    result = read(path)
                except msc.MscError as exc:
                    on_refused(exc)
                    counts["refused"] += 1
                    continue
                counts["accepted"] += 1
                check(result)
        except OverBudget:
            pytest.fail(f"{label} mutant {i} ran over {BUDGET_S} CPU-seconds:\n{text[:3000]}")
        except AssertionError as exc:
            raise AssertionError(f"{label} mutant {i}: {exc}\n{text[:3000]}") from None
        except Exception as exc:          # noqa: BLE001 - the point: only msc errors
            pytest.fail(f"{label} mutant {i}: {type(exc).__name__}: {str(exc)[:300]}\n{text[:2000]}")
    print(f"\n{label}: {counts} in {time.perf_counter() - start:.1f} s")
    return counts


@pytest.mark.parametrize("share", SHARES)
def test_mutated_toml_topologies_are_refused_or_read_consistently(tmp_path, share):
    from msc.sim.topology import load_topology

    rng = random.Random(20261126)
    plans = {n: lower(msc.trace(algorithms()["allreduce/ring:ring"], n), LowerOptions()) for n in (2, 3, 4)}
    path = tmp_path / "t.toml"

    def named_once(exc):
        assert str(exc).count(str(path)) == 1, f"file named {str(exc).count(str(path))} times: {exc}"

    counts = fuzz_reader("TOML", round(TOML_MUTANTS * share), path, lambda i: mutate_toml(TOML_BASES[i % len(TOML_BASES)], rng),
                         load_topology, lambda topo: topology_consistent(topo, plans), named_once)
    assert counts["accepted"] > 50 * share and counts["refused"] > 50 * share, counts


INDEX_VALUES = (0, 1, -1, 4, 3, 2 ** 40, 2 ** 41, 10 ** 400, 1.5, 4.0, True, False, None, "false", "true", "1M",
                "64K", "abc", "", "-1", [], [1], {}, {"a": 1}, "a.plan", "b.plan", "missing.plan", "allreduce",
                "allgather", "broadcast")
INDEX_KEYS = ("file", "collective", "ranks", "inplace", "root", "min_bytes", "max_bytes", "note", "_x", "bogus",
              "algorithm", "protocol", "instances")


def index_bases():
    return [[{"file": "a.plan", "max_bytes": "1M"}, {"file": "b.plan"}],
            {"version": 1, "plans": [{"file": "a.plan", "collective": "allreduce", "ranks": 4, "inplace": True,
                                      "min_bytes": 0, "max_bytes": 65536},
                                     {"file": "a.plan", "collective": "allreduce", "ranks": 4, "inplace": True,
                                      "min_bytes": "64K", "max_bytes": None, "_label": "x"},
                                     {"file": "c.plan", "collective": "broadcast", "ranks": 4, "inplace": False,
                                      "root": 0}]}]


def mutate_index(data, rng: random.Random) -> str:
    """A plans.json mutant: values and keys replaced, entries dropped or doubled, containers nested
    deep, or the text itself mutated (JSON that does not parse)."""
    import copy
    import json

    data = copy.deepcopy(data)
    items = data["plans"] if isinstance(data, dict) else data
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("value", "value", "value", "key", "drop", "double", "deep", "top"))
        entry = rng.choice(items) if items else None
        if kind == "value" and entry is not None:
            entry[rng.choice(INDEX_KEYS)] = rng.choice(INDEX_VALUES)
        elif kind == "key" and entry is not None and entry:
            del entry[rng.choice(list(entry))]
        elif kind == "drop" and items:
            items.pop(rng.randrange(len(items)))
        elif kind == "double" and items:
            items.append(copy.deepcopy(rng.choice(items)))
        elif kind == "deep" and entry is not None:
            entry[rng.choice(INDEX_KEYS)] = json.loads("[" * 50 + "]" * 50)
        elif kind == "top" and isinstance(data, dict):
            data["version"] = rng.choice(INDEX_VALUES)
    text = json.dumps(data)
    return mutate(text, rng) if rng.random() < 0.15 else text


def registry_consistent(reg) -> None:
    """A registry msc built: entries of the right types within the limits, no two serving one call,
    and each selected by a call at its own smallest size, with a plan of the key it states."""
    from msc.ir.limits import MAX_BYTES, MAX_RANKS

    entries = list(reg)
    for e in entries:
        assert type(e.num_ranks) is int and 1 <= e.num_ranks <= MAX_RANKS, e
        assert type(e.inplace) is bool and type(e.root) is int and 0 <= e.root < e.num_ranks, e
        assert type(e.min_bytes) is int and 0 <= e.min_bytes <= MAX_BYTES, e
        assert e.max_bytes is None or (type(e.max_bytes) is int and e.min_bytes < e.max_bytes <= MAX_BYTES), e
        assert reg.entry(e.collective, e.num_ranks, e.min_bytes, e.inplace, e.root, exact=True) is e, e
        try:
            plan = e.plan
        except msc.MscError:
            continue                       # an index that states a key its plan does not have: refused on use
        assert (plan.num_ranks, plan.inplace) == (e.num_ranks, e.inplace), e


@pytest.mark.parametrize("share", SHARES)
def test_mutated_plans_json_is_refused_or_read_consistently(tmp_path, share):
    from msc.formats.plan_text import save_plan
    from msc.formats.registry import PlanRegistry

    rng = random.Random(20261127)
    for name, key, inplace in (("a.plan", "allreduce/ring:ring", True), ("b.plan", "allgather/ring:ring", False),
                               ("c.plan", "broadcast/chain:chain", False)):
        save_plan(lower(msc.trace(algorithms()[key], 4, inplace=inplace), LowerOptions()), tmp_path / name)
    path = tmp_path / "plans.json"
    bases = index_bases()
    counts = fuzz_reader("plans.json", round(INDEX_MUTANTS * share), path, lambda i: mutate_index(bases[i % len(bases)], rng),
                         lambda _: PlanRegistry.from_dir(tmp_path), registry_consistent)
    assert counts["accepted"] > 50 * share and counts["refused"] > 50 * share, counts
