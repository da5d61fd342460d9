"""Lowering a verified program to a plan: the pipeline, one pass a line.

    trace ops --replicate--> instances --allocate_scratch--> one scratch buffer per rank
      --build_dag--> instructions --spread_channels--> --fuse_local--> --place--> threadblocks
      --fuse_forwarding--> --drop_dead_stores--> --compact_scratch-->
      --assign--> --order--> --build_plan--> Plan
      --choose_slots--> the smallest connection capacity the plan is deadlock-free with

Every pass is a pure function of its inputs (see dag.py, fusion.py,
placement.py, schedule.py). Programs of single-chunk transfers between ranks
take bulk.py, the same passes over numpy arrays, which builds the same plan.

The plan fits the runtime it is lowered for (``LowerOptions.runtime``,
msc.lower.runtimes). msc's own runtime gives a connection as many slots as the
plan needs. An MSCCL runtime gives a Simple connection 2 and has limits on
steps and threadblocks; where the plan as asked exceeds them, lowering tries
what it can change, in this order, and takes the first plan that fits:

    as asked            every step order
    spread_flows(w)     each channel's flows over w = 2, 4, ... channels (as
                        MSCCLang assigns channels): fewer messages share a
                        connection, fewer steps share a threadblock
    no fusion           a receive no longer waits for room to send on

and otherwise fails with RuntimeLimitError naming the limit, the runtime and
both values (those of the plan as asked), and what each attempt ran into.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from msc.lower.bulk import bulk_plans, fits
from msc.lower.bulk_trace import allocate_scratch_columns, replicate_columns
from msc.lower.dag import allocate_scratch, build_dag, compact_scratch, replicate
from msc.errors import DeadlockError, LoweringError, RuntimeLimitError, UsageError
from msc.lower.fusion import drop_dead_stores, forwarding_pairs, fuse_forwarding, fuse_local
from msc.dsl.collectives import BUILTIN, CustomCollective, contract_of, replicated
from msc.ir import Plan
from msc.ir.limits import MAX_CHUNK_MOVES, MAX_INSTANCES, MAX_STEP_MOVES, MAX_TILE_BYTES, MAX_TOTAL_CHUNKS, check
from msc.ir.ops import DEFAULT_PROTOCOL, PROTOCOL_NAMES, protocol_name
from msc.perf import pause_gc
from msc.verification import crosscheck
from msc.lower.placement import assign, place_auto, place_manual, spread_channels, spread_flows
from msc.verification.plan_fast import prepare
from msc.verification.plan_values import check_plan, user_buffer_sizes
from msc.verification.plan import check_races, verify_plan
from msc.lower.runtimes import DEFAULT_TARGET, Runtime, get_runtime
from msc.lower.schedule import PRIORITIES, build_plan, order
from msc.lower.switch import SWITCH_PROTOCOLS, lower_switch

MAX_SLOTS = 8    # the most slots per connection lowering tries: the MSCCL runtimes' NCCL_STEPS


@dataclass(frozen=True)
class LowerOptions:
    """How to lower. ``threadblocks``: "auto" or "manual" (honour the DSL's
    sendtb/recvtb hints). ``tile``: pipelining tile in bytes per chunk and
    iteration, 0 for the runtime's default. ``runtime``: the runtime the
    plan must fit (msc.lower.runtimes: "msc", "msccl", "azure")."""

    protocol: str = DEFAULT_PROTOCOL
    instances: int = 1
    threadblocks: str = "auto"
    fuse: bool = True
    tile: int = 0
    runtime: str = DEFAULT_TARGET

    def __post_init__(self):
        if not isinstance(self.protocol, str):
            raise UsageError(f"protocol must be one of {', '.join(PROTOCOL_NAMES)}, got {self.protocol!r}")
        object.__setattr__(self, "protocol", protocol_name(self.protocol))     # "ll": the plan says "LL"
        if type(self.instances) is not int or self.instances < 1:
            raise UsageError(f"instances must be an int >= 1, got {self.instances!r}")
        check(self.instances, MAX_INSTANCES, "instances")
        if self.threadblocks not in ("auto", "manual"):
            raise UsageError(f"threadblocks must be 'auto' or 'manual', got {self.threadblocks!r}")
        if type(self.tile) is not int or self.tile < 0:
            raise UsageError(f"tile must be an int >= 0 (bytes), got {self.tile!r}")
        check(self.tile, MAX_TILE_BYTES, "tile (bytes)")
        get_runtime(self.runtime)


@pause_gc
def lower(program, options: LowerOptions = LowerOptions(), *, collective=None, bulk: bool = True,
          verify: bool = True) -> Plan:
    """The plan for a traced program (verify the program first: ``msc.verify``),
    fitting ``options.runtime`` (see the module docstring; RuntimeLimitError
    where nothing fits). ``bulk=False`` takes the pass-by-pass pipeline
    where bulk lowering would apply (the tests compare the two).
    ``verify=False``: the first order that lowers and fits, not verified
    (its ``slots`` stay 1, claimed by no check), for a library plan that is
    only simulated at a scale where verifying it costs more than the rest
    (msc.sim.nccl_sim; its tests hold such plans to the verified ones)."""
    layout = program.layout
    n = layout.num_ranks
    chunk_ops = program.chunk_ops()
    if chunk_ops * options.instances > MAX_CHUNK_MOVES:    # replicate makes an op per chunk and instance
        raise UsageError(f"with {options.instances} instance(s) the plan's steps would move at least "
                         f"{chunk_ops * options.instances} chunks, over msc's limit of {MAX_CHUNK_MOVES}: "
                         f"use fewer instances")
    trace = _Trace(program, options.instances, bulk and fits(options))
    scratch = trace.scratch
    fields = dict(name=program.name, collective=layout.name, chunk_factor=layout.chunk_factor * options.instances,
                  inplace=layout.inplace, input_chunks=layout.logical_sizes["input"] * options.instances,
                  output_chunks=layout.logical_sizes["output"] * options.instances, root=layout.root,
                  protocol=options.protocol, instances=options.instances, slots=1, tile=options.tile)
    if collective is None or collective is getattr(layout.collective, "base", None):
        collective = layout.collective             # (a definition given as is: the traced one has its parameters)
    if options.instances > 1 and isinstance(collective, CustomCollective):     # built-ins are stated for any k
        collective = replicated(collective, options.instances)
    target = get_runtime(options.runtime)
    room = min(target.connection_slots(options.protocol) or MAX_SLOTS, MAX_SLOTS)
    if trace.has_switch:
        return _lower_switch(trace.ops(), scratch, n, options, fields, collective, target, room, verify)
    outcomes = []   # per attempt: (what, [(order, LoweringError | RuntimeLimitError | slots it needs | None)])
    for what, opts, ways in _attempts(options, target, trace):
        tried = []
        outcomes.append((what, tried))
        use_bulk = bulk and ways == 1 and fits(opts)
        # the first order that fits wins, with the fewest slots it runs with
        for priority, plan in _plans(trace, scratch, n, opts, fields, use_bulk, ways):
            if isinstance(plan, LoweringError):
                tried.append((priority, plan))
                continue
            if crosscheck.ENABLED:     # lowering builds valid plans by construction: tests check
                check_plan(plan)
            _check_totals(plan, 2 * chunk_ops * options.instances > MAX_STEP_MOVES)
            problem = _exceeds(plan, target)
            if problem is not None:
                tried.append((priority, problem))
                continue
            if not verify:
                return _stating(plan, collective)
            verified = verified_with_fewest_slots(plan, collective)
            if verified is not None and verified.slots <= room:
                return _stating(verified, collective)
            tried.append((priority, None if verified is None else verified.slots))
    raise _no_fit(outcomes, target, room, options.protocol)


def _lower_switch(ops, scratch, n, options: LowerOptions, fields, collective, target: Runtime, room: int,
                  verify: bool = True) -> Plan:
    """A program with switch ops (msc.lower.switch), for msc's own runtime only."""
    if target.xml:
        raise UsageError(f"the program uses switch ops (NVLS), which the {target.name} runtime ({target.title}) does "
                         f"not have: lower it for the msc runtime")
    if options.protocol not in SWITCH_PROTOCOLS:
        raise UsageError(f"the program uses switch ops (NVLS), which run with the Simple protocol only, not "
                         f"{options.protocol}")
    tried = []
    for priority in PRIORITIES:
        try:
            plan = lower_switch(ops, scratch, n, options, fields, priority)
        except LoweringError as exc:
            tried.append((priority, exc))
            continue
        if crosscheck.ENABLED:
            check_plan(plan)
        if not verify:
            return _stating(plan, collective)
        verified = verified_with_fewest_slots(plan, collective)
        if verified is not None and verified.slots <= room:
            return _stating(verified, collective)
        tried.append((priority, None if verified is None else verified.slots))
    raise _no_fit([("as asked", tried)], target, room, options.protocol)


def _stating(plan: Plan, collective) -> Plan:
    """A plan of a custom collective carries its requirements (msc.ir.Contract),
    so that any reader can verify and run it without the definition."""
    if collective.name in BUILTIN and type(collective) is BUILTIN[collective.name]:
        return plan
    return replace(plan, contract=contract_of(collective, plan.num_ranks, plan.chunk_factor, plan.root))


def _check_totals(plan: Plan, count_moves: bool) -> None:
    """The plan within msc.ir.limits' totals before it is verified (the
    program is, but instances multiply it, and a send and its receive are
    two steps): its chunks, and, with ``count_moves``, the chunks its steps move."""
    fewer = ": use fewer instances" if plan.instances > 1 else ""
    chunks = plan.num_ranks * sum(user_buffer_sizes(plan).values()) + sum(rp.scratch for rp in plan.ranks)
    if chunks > MAX_TOTAL_CHUNKS:
        raise UsageError(f"the plan's buffers of all ranks would hold {chunks} chunks, over msc's limit of "
                         f"{MAX_TOTAL_CHUNKS}{fewer}")
    moved = sum(step.count for rp in plan.ranks for tb in rp.threadblocks for step in tb.steps) if count_moves else 0
    if moved > MAX_STEP_MOVES:
        raise UsageError(f"the plan's steps would move {moved} chunks, over msc's limit of {MAX_STEP_MOVES}{fewer}")


class _Trace:
    """The program's operations as lowering takes them (replicated over
    ``instances``, named scratch buffers on one): as columns for bulk
    lowering (msc.lower.bulk_trace) and as Op tuples for the pipeline, each
    made only where it is used. ``bulk``: bulk lowering will be tried (the
    scratch sizes are then read from the columns)."""

    def __init__(self, program, instances: int, bulk: bool):
        self.program, self.instances = program, instances
        self.physical = set(program.layout.physical_sizes)
        self.has_switch = program.has_switch
        self._ops = self._columns = None
        self.scratch = self.columns()[1] if bulk and not self.has_switch else self._op_list()[1]

    def _op_list(self):
        if self._ops is None:
            p = self.program
            ops, sizes = replicate(p.ops, self.instances, p.scratch_sizes)
            self._ops = allocate_scratch(ops, self.physical, sizes, p.num_ranks)
        return self._ops

    def ops(self) -> list:
        return self._op_list()[0]

    def columns(self):
        """(OpColumns, scratch chunks per rank)."""
        if self._columns is None:
            p = self.program
            c, sizes = replicate_columns(p.columns(), self.instances, p.scratch_sizes)
            self._columns = allocate_scratch_columns(c, self.physical, sizes, p.num_ranks)
        return self._columns

    def channels(self) -> int:
        """Channels the operations name (1 + the highest)."""
        if self._ops is None:
            return 1 + int(self.columns()[0].channel.max(initial=0))
        return 1 + max((op.channel or 0 for op in self.ops()), default=0)


def _plans(trace: _Trace, scratch, n, options: LowerOptions, fields: dict, use_bulk: bool, ways: int = 1):
    """(priority, plan) for each of PRIORITIES in turn, or (priority,
    LoweringError) where no step order of that priority exists. Bulk
    lowering first where it applies; from the first order it leaves to the
    pipeline (None), the pipeline does the rest. ``ways``: spread_flows."""
    remaining = list(PRIORITIES)
    if use_bulk:
        for priority, plan in bulk_plans(None, scratch, n, PRIORITIES, fields, lambda: trace.columns()[0]):
            if plan is None:
                break
            remaining.remove(priority)
            yield priority, plan
        else:
            return
    yield from _pipeline_plans(trace.ops(), scratch, n, options, fields, remaining, ways)


def _pipeline_plans(ops, scratch, n, options: LowerOptions, fields: dict, priorities, ways: int = 1):
    """The lowering pipeline, pass by pass (see the module docstring)."""
    dag = build_dag(ops)
    if options.threadblocks == "auto":
        dag = spread_channels(dag, n)
    if options.fuse:
        dag = fuse_local(dag)
    if ways > 1:
        dag = spread_flows(dag, forwarding_pairs(dag), ways)
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


def _attempts(options: LowerOptions, target: Runtime, trace: _Trace):
    """(what, options, ways) to lower with, in turn: as asked; for an MSCCL
    runtime, then flows spread over more channels (auto placement only) and
    no fusion."""
    yield "as asked", options, 1
    if not target.xml:
        return
    if options.threadblocks == "auto":
        channels = trace.channels()
        ways = 2
        while channels * ways <= target.max_channels:
            yield f"flows over {ways} channels", options, ways
            ways *= 2
    if options.fuse:
        yield "no fusion", replace(options, fuse=False), 1


def _exceeds(plan: Plan, target: Runtime) -> RuntimeLimitError | None:
    """The first limit of ``target`` other than connection slots the plan exceeds."""
    if not target.xml:
        return None
    from msc.lower.msccl_steps import check_limits

    try:
        check_limits(plan, target)
    except RuntimeLimitError as exc:
        return exc
    return None


def _no_fit(outcomes, target: Runtime, room: int, protocol: str) -> Exception:
    """The error when no attempt gave a plan. msc's runtime (one attempt):
    no step order works. An MSCCL runtime: RuntimeLimitError for the first
    limit the plan as asked exceeds, then what each attempt ran into (one
    line for attempts that ran into the same)."""
    if not target.xml:
        return LoweringError("no step order works:\n  " + "\n  ".join(
            f"{priority} order: {outcome or f'deadlocks even with {MAX_SLOTS} slots per connection'}"
            for priority, outcome in outcomes[0][1]))
    limit, lines = None, []
    for what, tried in outcomes:
        texts = []
        for priority, outcome in tried:
            if outcome is None:
                text = f"deadlocks even with {MAX_SLOTS} slots per connection"
            elif isinstance(outcome, int):          # more slots than the runtime gives
                limit = limit or RuntimeLimitError(
                    "NCCL_STEPS / MSCCL_CHUNKSTEPS (messages per connection)", outcome, room,
                    f"the plan needs {outcome} slots per connection, and a {protocol} connection of the "
                    f"{target.name} runtime holds {room} ({target.slots_reason(protocol)})", runtime=target.name)
                text = f"needs {outcome} slots per connection"
            elif isinstance(outcome, RuntimeLimitError):
                limit = limit or outcome
                at = ", ".join(f"{name} {value}" for name, value in
                               (("rank", outcome.rank), ("threadblock", outcome.tb)) if value is not None)
                text = f"{outcome.limit} {outcome.value} > {outcome.maximum}" + (f" ({at})" if at else "")
            else:                                   # LoweringError: no such step order
                text = str(outcome)
            texts.append(text)
        text = texts[0] if len(set(texts)) == 1 else "; ".join(f"{p} order: {t}" for (p, _), t in zip(tried, texts))
        if lines and lines[-1][1] == text:
            lines[-1] = (f"{lines[-1][0]}, {what}", text)
        else:
            lines.append((what, text))
    body = "\n  ".join(f"{what}: {text}" for what, text in lines)
    if limit is None:
        return LoweringError(f"no step order works for the {target.name} runtime:\n  {body}")
    return RuntimeLimitError(limit.limit, limit.value, limit.maximum,
                             f"no plan fits the {target.name} runtime ({target.title}): {limit.args[0]}; "
                             f"tried (each in the depth and trace step orders):\n  {body}", runtime=target.name)


def verified_with_fewest_slots(plan: Plan, collective) -> Plan | None:
    """The plan verified with the fewest connection slots (1, 2, 4, 8) it runs
    without deadlock at; None if even MAX_SLOTS deadlocks. The bulk path reads
    the plan once and finds that capacity without running it (exact: deadlock
    freedom depends on neither data nor order); where it cannot tell, each
    capacity is tried in turn from 1, as a deadlock shows early."""
    prepared = prepare(plan)
    slots = prepared.fewest_slots(MAX_SLOTS) or 1
    check_races(plan, collective=collective, prepared=prepared)      # races do not depend on the capacity: once
    while slots <= MAX_SLOTS:
        candidate = replace(plan, slots=slots)
        try:
            verify_plan(candidate, collective=collective, checked=True, check_races=False, prepared=prepared)
            return candidate
        except DeadlockError:
            slots *= 2
    return None
