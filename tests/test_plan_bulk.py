"""The plan verifier's fast path (msc.plan_bulk.accepts) against its executor.

accepts() may only say True where the executor (execute, then check_outputs)
succeeds, at the capacity asked. On library plans (every algorithm, several
rank counts, both forms, protocols and instances) it must agree exactly, at
the plan's own capacity and at one slot; on mutants of library plans (from
test_plan_verify's mutants: deleted steps, moved slices, dropped
dependencies, swapped receives and steps, changed peers; plus one slot) a
True must mean the executor succeeds, and most correct mutants must be
accepted, so the test cannot pass by declining everything.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from library import algorithms
from test_plan_verify import KINDS, mutants

import msc
from msc.errors import MscError, PlanError, RaceError
from msc.lower import LowerOptions, lower
from msc.plan_bulk import accepts
from msc.plan_check import check_plan
from msc.plan_verify import _Execution, check_races, plan_collective

ALGORITHMS = algorithms()
RANKS = (3, 4, 8)
OPTIONS = (LowerOptions(), LowerOptions(protocol="LL", instances=2))


def layout_of(plan):
    return plan_collective(plan).layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root)


def executor_accepts(plan, slots: int) -> bool:
    run = _Execution(plan, layout_of(plan), slots)
    try:
        run.execute()
        run.check_outputs()
    except MscError:
        return False
    return True


def library_plans():
    """(description, plan) for every algorithm at the rank counts it supports."""
    for key, alg in sorted(ALGORITHMS.items()):
        for n in RANKS:
            if not alg.supports(n):
                continue
            for inplace in (False, True):
                for options in OPTIONS:
                    program = msc.trace(alg, n, inplace=inplace)
                    yield f"{key} n={n} inplace={inplace} {options.protocol}x{options.instances}", \
                        lower(program, options)


def test_agrees_with_the_executor_on_every_library_plan():
    seen = Counter()
    for what, plan in library_plans():
        for slots in sorted({plan.slots, 1}):
            expected = executor_accepts(plan, slots)
            assert accepts(plan, layout_of(plan), slots) == expected, f"{what} slots={slots}"
            seen[expected] += 1
    assert seen[True] > 100 and seen[False] > 0, seen     # the lowered plans, and some at one slot deadlock


MUTATED = ("allreduce/ring:ring", "allreduce/allpairs:allpairs", "allreduce/tree:binomial",
           "alltoall/hierarchical:hierarchical", "broadcast/chain:chain", "reducescatter/ring:ring",
           "allgather/recursive_doubling:recursive_doubling")


def test_never_accepts_a_mutant_the_executor_rejects():
    stats = Counter()
    for key in MUTATED:
        params = {"gpus_per_node": 2} if "hierarchical" in key else {}
        for inplace in (False, True):
            plan = lower(msc.trace(ALGORITHMS[key], 4, inplace=inplace, **params))
            for kind in (*KINDS, "one_slot"):
                if kind == "one_slot":
                    found = [("slots=1", replace(plan, slots=1))]
                else:
                    found = mutants(plan, kind, random.Random(f"{key}:{inplace}:{kind}"))
                for what, mutant in found:
                    try:
                        check_plan(mutant)
                        check_races(mutant)      # verify_plan asks accepts() only about race-free plans
                    except (PlanError, RaceError):
                        stats["malformed or racy"] += 1
                        continue
                    fast = accepts(mutant, layout_of(mutant), mutant.slots)
                    slow = executor_accepts(mutant, mutant.slots)
                    assert slow or not fast, f"{key} inplace={inplace}: accepted a bad mutant ({kind}: {what})"
                    stats[("good" if slow else "bad", "accepted" if fast else "declined")] += 1
    # Every correct, race-free mutant is accepted today; fewer would make the fast path useless.
    assert stats[("good", "declined")] == 0, stats
    assert stats[("good", "accepted")] >= 20 and stats[("bad", "declined")] >= 200, stats


def test_declines_what_it_cannot_judge():
    alg = ALGORITHMS["allreduce/ring:ring"]
    plan = lower(msc.trace(alg, 4))
    layout = layout_of(plan)
    assert accepts(plan, layout, plan.slots)
    # a capacity it cannot use, a slice outside its buffer (check_plan skipped), a second sending threadblock
    assert not accepts(plan, layout, 0)
    rp = plan.ranks[0]
    tb = rp.threadblocks[0]
    far = replace(tb.steps[0], srcs=(replace(tb.steps[0].srcs[0], index=10 ** 6),)) if tb.steps[0].srcs else None
    if far is not None:
        bad = replace(plan, ranks=(replace(rp, threadblocks=(replace(tb, steps=(far,) + tb.steps[1:]),)
                                         + rp.threadblocks[1:]),) + plan.ranks[1:])
        assert not accepts(bad, layout, plan.slots)
    twice = replace(plan, ranks=(replace(rp, threadblocks=rp.threadblocks + (replace(tb, id=len(rp.threadblocks)),)),)
                    + plan.ranks[1:])
    assert not accepts(twice, layout, plan.slots)
