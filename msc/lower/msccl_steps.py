"""A plan as the MSCCL runtimes run it: its MSCCL-IR <step>s (a step with
several dependencies is several <step>s, a reduce of several sources
several ``re`` steps), the ``coll`` attribute and buffer multipliers, and
the runtime's limits counted on them (msc.lower.runtimes names the
runtimes). Lowering checks a plan for a runtime with ``check_limits``
before it is written; msc.formats.xml_export writes these steps."""
from __future__ import annotations

from typing import NamedTuple

from msc.dsl.collectives import COLLECTIVES, get_collective
from msc.errors import FormatError, MscError, PlanError, RuntimeLimitError
from msc.ir import Plan, RankPlan, Slice, Step, StepOp
from msc.lower.runtimes import Runtime, xml_runtime
from msc.verification.plan_values import buffer_sizes, check_plan


class XStep(NamedTuple):
    """One <step> being built; ``dep`` is (threadblock, step), at first an
    msc step index, then the XML index of that step's last <step>."""

    type: str
    src: Slice | None
    dst: Slice | None
    count: int
    dep: tuple[int, int] | None = None
    origin: int = 0          # the msc step it comes from (for error messages)


def check_limits(plan: Plan, runtime: str | Runtime) -> None:
    """RuntimeLimitError for the first limit of the MSCCL ``runtime`` the
    plan exceeds, counted as the exported XML counts them (a step with
    several dependencies is several <step>s, a reduce may be several);
    PlanError for a step the XML cannot express."""
    rt = runtime if isinstance(runtime, Runtime) else xml_runtime(runtime)
    check_plan(plan)
    _, mult_in, mult_out = msccl_collective(plan, rt)
    ranks = [rank_steps(rp) for rp in plan.ranks]
    check_counted_limits(plan, rt, ranks, max(plan.input_chunks, plan.output_chunks), mult_in, mult_out)


def rank_steps(rp: RankPlan) -> list[list[XStep]]:
    """Per threadblock, its <step>s with dependencies as XML (tb, step)."""
    last = {}                       # msc (tb, step) -> XML index of its last <step>
    out = []
    for tb in rp.threadblocks:
        t = tb.id
        waited: dict[int, int] = {}  # tb -> highest step an earlier step of t waited for
        carried: list = []           # dependencies of the nops since the last real step
        steps: list[XStep] = []
        for s, step in enumerate(tb.steps):
            if step.op is StepOp.NOP:
                carried.extend(step.deps)
                continue
            deps = [d for d in _resolve(rp, t, s, carried + list(step.deps)) if waited.get(d[0], -1) < d[1]]
            carried = []
            waited.update(deps)
            body = [x._replace(origin=s) for x in _expand(step, rp.rank, t, s)]
            steps += [XStep(StepOp.NOP.xml, None, None, 0, d, s) for d in deps[1:]]
            steps.append(body[0]._replace(dep=deps[0] if deps else None))
            steps += body[1:]
            last[(t, s)] = len(steps) - 1
        out.append(steps)
    return [[x._replace(dep=(x.dep[0], last[x.dep])) if x.dep else x for x in steps] for steps in out]


def _resolve(rp: RankPlan, t: int, s: int, deps: list) -> list[tuple[int, int]]:
    """What step s of threadblock t must wait for, as real steps of other
    threadblocks (at most one per threadblock, the latest): a nop is done
    when the steps before it and its own dependencies are, so wait for those."""
    tbs = rp.threadblocks
    latest: dict[int, int] = {}
    stack, seen = list(deps), set()
    while stack:
        dep = stack.pop()
        if dep in seen:
            continue
        seen.add(dep)
        dt, ds = dep
        if dt == t:
            if ds >= s:  # only through nops of other threadblocks: a cycle
                raise PlanError(f"waits (through nops) for step {ds} of its own threadblock, which comes at or "
                                f"after it", rank=rp.rank, tb=t, step=s)
            continue     # program order already waits for it
        if tbs[dt].steps[ds].op is StepOp.NOP:
            j = ds
            while j >= 0 and tbs[dt].steps[j].op is StepOp.NOP:
                stack.extend(tbs[dt].steps[j].deps)
                j -= 1
            if j >= 0:
                stack.append((dt, j))
            continue
        latest[dt] = max(latest.get(dt, -1), ds)
    return sorted(latest.items())


def _expand(step: Step, rank: int, t: int, s: int) -> list[XStep]:
    if step.op.xml is None and step.op.switch:
        raise FormatError(f"{step.op.value}: the plan reduces or stores in the switch (NVLS: multimem loads and "
                          f"stores, with barriers between them), which the MSCCL runtimes cannot do: MSCCL-IR has no "
                          f"step type for it", kind="switch", rank=rank, tb=t, step=s)
    if step.op.xml is None:
        raise FormatError(f"{step.op.value}: MSCCL-IR has no step type for this op, so the plan cannot be exported "
                          f"to MSCCL XML", kind="op", rank=rank, tb=t, step=s)
    if step.op is StepOp.REDUCE:
        return _expand_reduce(step, rank, t, s)
    src = step.srcs[0] if step.srcs else None
    if src is not None and step.dst is not None and src != step.dst and _overlap(src, step.dst):
        raise PlanError(f"{step.op.value} {src} -> {step.dst}: source and destination overlap partly, which "
                        f"the runtime's elementwise kernels cannot do", rank=rank, tb=t, step=s)
    return [XStep(step.op.xml, src, step.dst, step.count)]


def _expand_reduce(step: Step, rank: int, t: int, s: int) -> list[XStep]:
    """reduce S1..Sm -> D as [cpy S1 -> D] re Si -> D ... (re: D += Si).
    No remaining source may overlap D: the runtime may fuse a run of re steps
    into one pass that reads D once, and that must equal doing them in turn."""
    dst, srcs = step.dst, list(step.srcs)
    head = []
    if dst in srcs:
        srcs.remove(dst)
    else:
        first = srcs.pop(0)
        if _overlap(first, dst):
            raise PlanError(f"reduce: source {first} overlaps the destination {dst} partly", rank=rank, tb=t, step=s)
        head = [XStep(StepOp.COPY.xml, first, dst, step.count)]
    for sl in srcs:
        if _overlap(sl, dst):
            raise PlanError(f"reduce: source {sl} overlaps the destination {dst} (a destination may be one source, "
                            f"once); MSCCL's re steps cannot express it", rank=rank, tb=t, step=s)
    return head + [XStep(StepOp.REDUCE.xml, sl, dst, step.count) for sl in srcs]


def _overlap(a: Slice, b: Slice) -> bool:
    return a.buffer == b.buffer and a.index < b.index + b.count and b.index < a.index + a.count


def msccl_collective(plan: Plan, rt: Runtime) -> tuple[str, int, int]:
    """The coll attribute, and the multipliers the msccl runtime applies to
    i_chunks and o_chunks before comparing them with nchunksperloop."""
    try:
        name = get_collective(plan.collective).name
    except MscError:
        name = "custom"
    if name in COLLECTIVES and not COLLECTIVES[name].msccl:      # a built-in MSCCL lacks: custom, with its contract
        name = "custom"
    n = plan.num_ranks
    if name == "custom":
        if not rt.custom:
            raise PlanError(f"the {rt.name} runtime has no custom collectives (plan collective "
                            f"{plan.collective!r}); export it for the msccl runtime")
        return "custom", 1, 1
    return rt.coll(name), *COLLECTIVES[name].msccl_multipliers(n)


def _limit(limit: str, value: int, maximum: int, what: str, rt: Runtime, constant: int | None = None,
           **where) -> RuntimeLimitError:
    """``constant``: the runtime constant's value where it is not the most
    it takes (MSCCL_MAX_COUNT = 72: cnt < 72)."""
    spelled = f"{limit} = {maximum}" if constant is None else f"{limit} = {constant}, at most {maximum}"
    return RuntimeLimitError(limit, value, maximum, f"{what} {value} exceeds the {rt.name} runtime's limit "
                             f"{spelled} ({rt.title})", runtime=rt.name, **where)


def check_counted_limits(plan: Plan, rt: Runtime, ranks: list, nchunks: int, mult_in: int, mult_out: int) -> None:
    n = plan.num_ranks
    if n > rt.max_ranks:
        raise _limit("MAX_SUBS (gpus per algo)", n, rt.max_ranks, "ranks", rt)
    room = rt.connection_slots(plan.protocol)
    if plan.slots > room:
        raise _limit("NCCL_STEPS / MSCCL_CHUNKSTEPS (messages per connection)", plan.slots, room,
                     f"connection slots needed for a deadlock-free {plan.protocol} run:", rt)
    for rp, tb_steps in zip(plan.ranks, ranks):
        r = rp.rank
        sizes = buffer_sizes(plan, r)
        for buf, mult in (("input", mult_in), ("output", mult_out)):
            have = sizes.get(buf, 0)
            if have and have * mult != nchunks:
                raise FormatError(
                    f"MSCCL XML cannot describe this plan's buffers: it sizes the input and the output from one "
                    f"chunk count (nchunksperloop {nchunks}: input {nchunks // mult_in} and output "
                    f"{nchunks // mult_out} chunks per rank), and this plan's input has {sizes.get('input', 0)} and "
                    f"its output {sizes.get('output', 0)}", kind="buffers", rank=r)
        if len(tb_steps) > rt.max_threadblocks:
            raise _limit("MSCCL_MAX_NUM_THREAD_BLOCKS", len(tb_steps), rt.max_threadblocks, "threadblocks", rt,
                         rank=r)
        nodes = 1 + n + len(tb_steps) + sum(map(len, tb_steps))
        if nodes > rt.max_nodes:   # the reader fails when it has read MAX_NODES and reaches another
            raise _limit("MAX_NODES (XML elements read per rank)", nodes, rt.max_nodes,
                         "XML elements (algo, gpus, threadblocks, steps)", rt, rt.max_nodes + 1, rank=r)
        senders: dict[int, int] = {}
        receivers: dict[int, int] = {}
        for tb, steps in zip(rp.threadblocks, tb_steps):
            where = dict(rank=r, tb=tb.id)
            if tb.channel >= rt.max_channels:
                raise _limit("MAXCHANNELS", tb.channel + 1, rt.max_channels, "channels", rt, **where)
            for side, peer in ((senders, tb.send), (receivers, tb.recv)):
                if peer is not None:
                    side[tb.channel] = side.get(tb.channel, 0) + 1
                    if side[tb.channel] > rt.max_tb_per_channel:
                        what = f"{'sending' if side is senders else 'receiving'} threadblocks on channel {tb.channel}:"
                        raise _limit("MSCCL_MAX_NUM_THREAD_BLOCKS_PER_CHANNEL", side[tb.channel],
                                     rt.max_tb_per_channel, what, rt, **where)
            if len(steps) > rt.max_steps:
                raise _limit("MSCCL_MAX_NUM_STEPS", len(steps), rt.max_steps, "steps (nops included)", rt, **where)
            for x in steps:
                if x.count > rt.max_count:
                    raise _limit("MSCCL_MAX_COUNT", x.count, rt.max_count, "cnt", rt, rt.max_count + 1, **where,
                                 step=x.origin)
                for sl in (x.src, x.dst):
                    if sl is not None and sl.index > rt.max_offset:
                        raise _limit("int16 offsets", sl.index, rt.max_offset, f"{sl.buffer} offset", rt, **where,
                                     step=x.origin)
                if x.dep and x.dep[0] > rt.max_dep_tb:
                    raise _limit("int8 depid", x.dep[0], rt.max_dep_tb, "dependency on threadblock", rt, **where,
                                 step=x.origin)
