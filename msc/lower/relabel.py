"""A plan with its ranks renamed: one rooted plan serves every root.

Broadcast and reduce treat ranks alike except the root, so a plan for root
0 run with plan rank p on rank (p + r) mod n is a plan for root r: the same
messages between the same neighbours, shifted around the ring of ranks
(``for_root``). ``relabel`` takes any permutation. The result is a new
Plan, to be verified like any other (msc.torch does, the first time a root
is asked for): the renaming is the argument, the verifier the proof.
"""
from __future__ import annotations

from dataclasses import replace

from msc.dsl.collectives import COLLECTIVES, collective_key
from msc.errors import UsageError
from msc.ir import Plan, RankPlan


def can_relabel(plan: Plan) -> bool:
    """Whether ``for_root`` takes ``plan``: a built-in collective's whose
    registry row relabels, without switch groups."""
    return plan.contract is None and plan.first_switch_step() is None and _relabels(plan)


def _relabels(plan: Plan) -> bool:
    spec = COLLECTIVES.get(collective_key(plan.collective))
    return spec is None or spec.relabels


def relabel(plan: Plan, perm) -> Plan:
    """``plan`` with plan rank p run as rank ``perm[p]``: its threadblocks'
    peers renamed alike, its root ``perm[plan.root]``. Plans with switch
    groups (whose reductions read the members in rank order) and plans of
    custom collectives (whose contract names ranks) are refused."""
    n = plan.num_ranks
    perm = tuple(perm)
    if sorted(perm) != list(range(n)):
        raise UsageError(f"a renaming of {n} ranks must list each of 0..{n - 1} once, got {list(perm)}")
    if plan.contract is not None:
        raise UsageError(f"plan {plan.name!r} is of the custom collective {plan.collective!r}, whose contract names "
                         f"ranks: it cannot be renamed")
    if plan.first_switch_step() is not None:
        raise UsageError(f"plan {plan.name!r} has switch groups (NVLS), whose reductions read the members in rank "
                         f"order: it runs with its own ranks only")

    def peer(p):
        return None if p is None else perm[p]

    ranks = [None] * n
    for rp in plan.ranks:
        tbs = tuple(replace(tb, send=peer(tb.send), recv=peer(tb.recv)) for tb in rp.threadblocks)
        ranks[perm[rp.rank]] = RankPlan(rank=perm[rp.rank], scratch=rp.scratch, threadblocks=tbs)
    return replace(plan, ranks=tuple(ranks), root=perm[plan.root])


def for_root(plan: Plan, root: int) -> Plan:
    """``plan`` (of a rooted collective) turned to serve ``root``: its ranks
    rotated by ``root - plan.root``, so neighbours stay neighbours."""
    n = plan.num_ranks
    if not 0 <= root < n:
        raise UsageError(f"root {root} is not a rank of plan {plan.name!r} ({n} ranks: 0..{n - 1})")
    shift = root - plan.root
    if shift and not _relabels(plan):
        raise UsageError(f"plan {plan.name!r} is a {plan.collective} plan for root {plan.root}, and a {plan.collective} "
                         f"plan serves its own root only (each rank's unit has its place at the root: renaming ranks "
                         f"moves it); compile one for root {root} (msc compile ALGORITHM --param root={root})")
    return plan if shift == 0 else relabel(plan, [(p + shift) % n for p in range(n)])
