"""Checking an MSCCL++ execution plan as read: the executor's limits, then
the one-sided check (msc.verification.onesided) against the collective the
plan names, or the custom one msc recorded in it (``msc_contract``), or the
one given."""
from __future__ import annotations

from msc.formats.mscclpp.limits import check_limits
from msc.ir.onesided import OneSidedPlan


def stated_collective(plan: OneSidedPlan, collective=None):
    """``collective`` if given; else, for a plan whose custom collective msc
    recorded, that collective (msc.dsl.collectives.StatedCollective); else None
    (the plan's own name is looked up)."""
    if collective is not None or plan.meta_value("msc_contract") is None:
        return collective
    from msc.dsl.collectives import StatedCollective
    from msc.formats.mscclpp.lift import contract_of_plan

    gpu = plan.gpus[0]
    k = plan.meta_value("msc_chunk_factor", 1)
    return StatedCollective(plan.collective, plan.num_ranks, k, gpu.input_chunks, gpu.output_chunks,
                            contract_of_plan(plan))


def verify_mscclpp(plan: OneSidedPlan, *, collective=None, **options):
    """The executor's limits, then msc.verification.onesided.verify_onesided; its report."""
    from msc.verification.onesided import verify_onesided

    check_limits(plan)
    return verify_onesided(plan, collective=stated_collective(plan, collective), **options)
