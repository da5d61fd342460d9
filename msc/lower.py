"""Lowering a verified program to a plan: the pipeline, one pass a line.

    trace ops --replicate--> instances --allocate_scratch--> one scratch buffer per rank
      --build_dag--> instructions --spread_channels--> --fuse_local--> --place--> threadblocks
      --fuse_forwarding--> --drop_dead_stores--> --compact_scratch-->
      --assign--> --order--> --build_plan--> Plan
      --choose_slots--> the smallest connection capacity the plan is deadlock-free with

Every pass is a pure function of its inputs (see dag.py, fusion.py,
placement.py, schedule.py). Programs of single-chunk transfers between ranks
take bulk.py, the same passes over numpy arrays, which builds the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from msc.bulk import bulk_plans, fits
from msc.dag import allocate_scratch, build_dag, compact_scratch, replicate
from msc.errors import DeadlockError, LoweringError, UsageError
from msc.fusion import drop_dead_stores, forwarding_pairs, fuse_forwarding, fuse_local
from msc.ir import Plan
from msc.limits import MAX_INSTANCES, MAX_TILE_BYTES, check
from msc.perf import SELF_CHECK, pause_gc
from msc.placement import assign, place_auto, place_manual, spread_channels
from msc.plan_bulk import prepare
from msc.plan_check import PROTOCOLS
from msc.plan_check import check_plan
from msc.plan_verify import check_races, verify_plan
from msc.schedule import PRIORITIES, build_plan, order

MAX_SLOTS = 8    # the MSCCL runtime's NCCL_STEPS; our runtime provides as many
# Check every lowered plan's values (plan_check) before verifying it. Lowering
# builds valid plans by construction, so this costs time for nothing in use;
# the tests turn it on (MSC_CHECK=1, see tests/conftest.py).
CHECK_IR = SELF_CHECK


@dataclass(frozen=True)
class LowerOptions:
    """How to lower. ``threadblocks``: "auto" or "manual" (honour the DSL's
    sendtb/recvtb hints). ``tile``: pipelining tile in bytes per chunk and
    iteration, 0 for the runtime's default."""

    protocol: str = "Simple"
    instances: int = 1
    threadblocks: str = "auto"
    fuse: bool = True
    tile: int = 0

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise UsageError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if type(self.instances) is not int or self.instances < 1:
            raise UsageError(f"instances must be an int >= 1, got {self.instances!r}")
        check(self.instances, MAX_INSTANCES, "instances")
        if self.threadblocks not in ("auto", "manual"):
            raise UsageError(f"threadblocks must be 'auto' or 'manual', got {self.threadblocks!r}")
        if type(self.tile) is not int or self.tile < 0:
            raise UsageError(f"tile must be an int >= 0 (bytes), got {self.tile!r}")
        check(self.tile, MAX_TILE_BYTES, "tile (bytes)")


@pause_gc
def lower(program, options: LowerOptions = LowerOptions(), *, collective=None, bulk: bool = True) -> Plan:
    """The plan for a traced program (verify the program first: ``msc.verify``).
    ``bulk=False`` takes the pass-by-pass pipeline where bulk lowering would
    apply (the tests compare the two)."""
    layout = program.layout
    n = layout.num_ranks
    physical = set(layout.physical_sizes)
    ops, scratch_sizes = replicate(program.ops, options.instances, program.scratch_sizes)
    ops, scratch = allocate_scratch(ops, physical, scratch_sizes, n)
    fields = dict(name=program.name, collective=layout.name, chunk_factor=layout.chunk_factor * options.instances,
                  inplace=layout.inplace, input_chunks=layout.logical_sizes["input"] * options.instances,
                  output_chunks=layout.logical_sizes["output"] * options.instances, root=layout.root,
                  protocol=options.protocol, instances=options.instances, slots=1, tile=options.tile)
    collective = collective or layout.collective
    failures = []
    # the program's own columns where replicate and allocate_scratch changed nothing
    columns = program.columns if options.instances == 1 and not program.scratch_sizes else None
    # the first order that works with the fewest slots wins
    for priority, plan in _plans(ops, scratch, n, options, fields, bulk and fits(options), columns):
        if isinstance(plan, LoweringError):
            failures.append(f"{priority} order: {plan}")
            continue
        if CHECK_IR:
            check_plan(plan)
        verified = verified_with_fewest_slots(plan, collective)
        if verified is not None:
            return verified
        failures.append(f"{priority} order: deadlocks even with {MAX_SLOTS} slots per connection")
    raise LoweringError("no step order works:\n  " + "\n  ".join(failures))


def _plans(ops, scratch, n, options: LowerOptions, fields: dict, use_bulk: bool, columns=None):
    """(priority, plan) for each of PRIORITIES in turn, or (priority,
    LoweringError) where no step order of that priority exists. Bulk
    lowering first where it applies; from the first order it leaves to the
    pipeline (None), the pipeline does the rest."""
    remaining = list(PRIORITIES)
    if use_bulk:
        for priority, plan in bulk_plans(ops, scratch, n, PRIORITIES, fields, columns):
            if plan is None:
                break
            remaining.remove(priority)
            yield priority, plan
        else:
            return
    yield from _pipeline_plans(ops, scratch, n, options, fields, remaining)


def _pipeline_plans(ops, scratch, n, options: LowerOptions, fields: dict, priorities):
    """The lowering pipeline, pass by pass (see the module docstring)."""
    dag = build_dag(ops)
    if options.threadblocks == "auto":
        dag = spread_channels(dag, n)
    if options.fuse:
        dag = fuse_local(dag)
    pairs = forwarding_pairs(dag) if options.fuse else []
    if options.threadblocks == "manual":
        placement = place_manual(dag, n)
    else:
        placement = place_auto(dag, pairs, n)
    if options.fuse:
        dag = fuse_forwarding(dag, placement.allows, pairs)
        dag = drop_dead_stores(dag, final=lambda instr: instr.dst.buffer != "scratch")
    dag, scratch = compact_scratch(dag, scratch)
    del pairs                        # they keep the pre-fusion instructions alive
    tb_of, placement = assign(dag, placement, n)
    for priority in priorities:
        try:
            steps = order(dag, priority)
        except LoweringError as exc:
            yield priority, exc
            continue
        yield priority, build_plan(dag, steps, tb_of, placement, num_ranks=n, scratch=scratch, **fields)


def verified_with_fewest_slots(plan: Plan, collective) -> Plan | None:
    """The plan verified with the fewest connection slots (1, 2, 4, 8) it runs
    without deadlock at; None if even MAX_SLOTS deadlocks. The bulk path reads
    the plan once and finds that capacity without running it (exact: deadlock
    freedom depends on neither data nor order); where it cannot tell, each
    capacity is tried in turn from 1, as a deadlock shows early."""
    check_races(plan, collective=collective)      # races do not depend on the capacity: once
    prepared = prepare(plan)
    slots = prepared.fewest_slots(MAX_SLOTS) or 1
    while slots <= MAX_SLOTS:
        candidate = replace(plan, slots=slots)
        try:
            verify_plan(candidate, collective=collective, checked=True, check_races=False, prepared=prepared)
            return candidate
        except DeadlockError:
            slots *= 2
    return None
