"""Running a plan's threadblocks as far as they can go: the blocking
semantics every executor of a plan shares (the plan verifier on symbolic
data, the reference executor on numpy arrays). Each threadblock runs its
steps in order until one is blocked (a dependency not done, no message, no
space on a connection); it then waits on that reason until a step that may
release it runs. Callers supply what blocks a step and how to run it.
"""
from __future__ import annotations

from typing import Callable

from msc.ir import Plan


def drive(plan: Plan, pcs: list[list[int]], blocker: Callable, run: Callable, rng=None) -> None:
    """Advance ``pcs[rank][tb]`` until nothing can move.

    ``blocker(rank, tb, step)``: None when the step can run, else a hashable
    reason. ``run(rank, tb, s, step)``: runs step ``s`` and returns the
    reasons it may have released (("tb", rank, t) is released by every step
    of threadblock t). ``rng``: take runnable threadblocks in random order.
    The caller checks which threadblocks did not finish.
    """
    waiting: dict = {}                # reason -> threadblocks waiting on it
    work = [(rp.rank, tb.id) for rp in plan.ranks for tb in rp.threadblocks]
    work.reverse()
    while work:
        if rng is not None:
            i = rng.randrange(len(work))
            work[i], work[-1] = work[-1], work[i]
        rank, t = work.pop()
        tb = plan.ranks[rank].threadblocks[t]
        pc = pcs[rank]
        while pc[t] < len(tb.steps):
            s = pc[t]
            step = tb.steps[s]
            reason = blocker(rank, tb, step)
            if reason is not None:
                waiting.setdefault(reason, []).append((rank, t))
                break
            released = run(rank, tb, s, step)
            pc[t] = s + 1
            for key in released:
                work.extend(waiting.pop(key, ()))
            work.extend(waiting.pop(("tb", rank, t), ()))
