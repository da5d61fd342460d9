"""MSCCL-IR XML from a plan: the schedule format the MSCCL runtimes inside
NCCL interpret (one CUDA block per ``<tb>``, steps run in order).

Two runtimes read it, with different spellings and limits (``runtime=``;
their values, with the source file and constant of each, are in
msc.lower.runtimes): ``"msccl"`` (microsoft/msccl, MSCCLang's target) and
``"azure"`` (Azure/msccl-executor-nccl). msccl spells ``coll="reduce_scatter"``
and takes ``custom``; ``minBytes``/``maxBytes`` are optional (selection:
``minBytes <= bytes < maxBytes``) and its config file spells them in lower
case, so we write both spellings (unknown attributes are ignored). azure
spells ``coll="reducescatter"``, has no ``custom``, and requires
``minBytes``, ``maxBytes``, ``inplace`` and ``outofplace`` (selection:
``minBytes <= bytes <= maxBytes``, ``maxBytes="0"`` is no limit).
``check_limits`` checks a plan against a runtime's limits (lowering for a
target uses it too).

Step mapping (buffers ``i``/``o``/``s`` are the rank's *physical* buffers, so
an in-place plan uses one of ``i``/``o`` and writes 0 chunks for the other;
offsets and ``cnt`` are in chunks of size count / nchunksperloop)::

    send   SRC            -> s     src
    recv   -> DST         -> r     dst
    rcs    -> DST         -> rcs   dst
    rrs    SRC            -> rrs   src            (sends SRC + received)
    rrc    SRC -> DST     -> rrc   src, dst       (DST = SRC + received)
    rrcs   SRC -> DST     -> rrcs  src, dst       (... and sends DST)
    copy   SRC -> DST     -> cpy   src, dst
    reduce S1..Sm -> DST  -> cpy S1 -> DST unless DST is one of the Si,
                             then re Si -> DST for the others (re: DST += Si)
    nop                   -> its dependencies move to the next step

An unused operand is written ``srcbuf="i" srcoff="-1"`` / ``dstbuf="o"
dstoff="-1"`` (MSCCLang's spelling; the runtimes only bounds-check operands
the type uses, and -1 passes).

Dependencies. A ``<step>`` names at most one (threadblock, step) to wait for
(``depid``/``deps``). A step with more becomes ``nop`` steps, one per extra
dependency, followed by the step with the first one: the runtime hands the
waits of a run of nops to the next real step, and counts ``deps`` indices
assuming exactly that shape (each nop one dependency, the real step one too),
so a nop is never emitted any other way. The runtime sets a threadblock's
progress flag only after steps with ``hasdep="1"``; we set it exactly on the
steps some other threadblock waits for (and, rarely, to stop the runtime
from fusing two ``re`` steps of different ``cnt``, see ``_chain_breaks``).
Dependencies on the own threadblock are dropped (program order), and so is a
wait the threadblock already made at an earlier step.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import NamedTuple

from msc.dsl.collectives import COLLECTIVES, ROOTED, contract_of, get_collective
from msc.formats.contract_text import contract_lines
from msc.errors import FormatError, MscError, PlanError, RuntimeLimitError, UsageError
from msc.ir import Plan, RankPlan, Slice, Step, StepOp
from msc.ir.limits import MAX_BYTES, check
from msc.verification.plan_values import buffer_sizes, check_plan
from msc.lower.runtimes import Runtime, xml_runtime

__all__ = ["RuntimeLimitError", "check_limits", "plan_to_xml"]

BUFFER_LETTER = {"input": "i", "output": "o", "scratch": "s"}


class XStep(NamedTuple):
    """One <step> being built; ``dep`` is (threadblock, step), at first an
    msc step index, then the XML index of that step's last <step>."""

    type: str
    src: Slice | None
    dst: Slice | None
    count: int
    dep: tuple[int, int] | None = None
    origin: int = 0          # the msc step it comes from (for error messages)


def plan_to_xml(plan: Plan, *, runtime: str = "msccl", min_bytes: int = 0, max_bytes: int | None = None,
                name: str | None = None) -> str:
    """The MSCCL XML of ``plan`` for ``runtime`` ("msccl" or "azure").

    ``min_bytes``/``max_bytes``: the message sizes the runtime may pick the
    algorithm for, written as given (msccl compares ``bytes < maxBytes``,
    azure ``bytes <= maxBytes``); None: no upper bound. Raises
    RuntimeLimitError when the plan exceeds a runtime limit, PlanError when a
    step cannot be expressed."""
    rt = xml_runtime(runtime)
    if type(min_bytes) is not int or min_bytes < 0:
        raise UsageError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes < max(min_bytes, 1)):
        raise UsageError(f"max_bytes must be None or an int >= max(min_bytes, 1), got {max_bytes!r}")
    for what, value in (("min_bytes", min_bytes), ("max_bytes", max_bytes)):
        if value is not None:
            check(value, MAX_BYTES, what)
    name = plan.name if name is None else name
    if type(name) is not str or len(name) > rt.max_str:
        raise UsageError(f"the algorithm name must be a string of at most {rt.max_str} characters "
                         f"(the {rt.name} runtime's MAX_STR_LEN), got {name!r:.80}")
    check_plan(plan)
    coll, mult_in, mult_out = _collective(plan, rt)
    ranks = [_rank_steps(rp) for rp in plan.ranks]
    flagged = [_flagged(steps) for steps in ranks]
    nchunks = max(plan.input_chunks, plan.output_chunks)
    _check_limits(plan, rt, ranks, nchunks, mult_in, mult_out)

    attrs = {"name": name, "proto": plan.protocol,
             "nchannels": str(1 + max((tb.channel for rp in plan.ranks for tb in rp.threadblocks), default=0)),
             "nchunksperloop": str(nchunks), "ngpus": str(plan.num_ranks), "coll": coll,
             "inplace": str(int(plan.inplace)), "outofplace": str(int(not plan.inplace)),
             "minBytes": str(min_bytes), "maxBytes": str(rt.unlimited_bytes if max_bytes is None else max_bytes)}
    if rt.lowercase_bytes:
        attrs["minbytes"], attrs["maxbytes"] = attrs["minBytes"], attrs["maxBytes"]
    # msc's own values, for a faithful import (the runtimes ignore unknown attributes)
    attrs["msc_slots"] = str(plan.slots)
    if coll in ROOTED:
        attrs["msc_root"] = str(plan.root)
    if plan.tile:
        attrs["msc_tile"] = str(plan.tile)
    if plan.instances != 1:
        attrs["msc_instances"] = str(plan.instances)
    contract = _contract(plan)
    if coll == "custom" and contract is not None:     # what the custom collective requires, for msc's reader
        attrs["msc_collective"] = plan.collective
        attrs["msc_chunk_factor"] = str(plan.chunk_factor)
        attrs["msc_contract"] = "; ".join(line.strip() for line in contract_lines(contract)[1:])
    algo = ET.Element("algo", attrs)
    for rp, tb_steps, flags in zip(plan.ranks, ranks, flagged):
        sizes = buffer_sizes(plan, rp.rank)
        gpu = ET.SubElement(algo, "gpu", {"id": str(rp.rank), "i_chunks": str(sizes.get("input", 0)),
                                          "o_chunks": str(sizes.get("output", 0)), "s_chunks": str(rp.scratch)})
        for tb, steps in zip(rp.threadblocks, tb_steps):
            tb_el = ET.SubElement(gpu, "tb", {"id": str(tb.id), "send": _peer(tb.send), "recv": _peer(tb.recv),
                                              "chan": str(tb.channel)})
            for i, x in enumerate(steps):
                ET.SubElement(tb_el, "step", _step_attrs(i, x, (tb.id, i) in flags))
    ET.indent(algo, space="  ")
    # The runtimes' hand-written readers: no XML declaration, spaces only, and
    # "/>" rather than " />" (a space there reads as one more, empty attribute).
    return ET.tostring(algo, encoding="unicode").replace(" />", "/>") + "\n"


def check_limits(plan: Plan, runtime: str | Runtime) -> None:
    """RuntimeLimitError for the first limit of the MSCCL ``runtime`` the
    plan exceeds, counted as the exported XML counts them (a step with
    several dependencies is several <step>s, a reduce may be several);
    PlanError for a step the XML cannot express."""
    rt = runtime if isinstance(runtime, Runtime) else xml_runtime(runtime)
    check_plan(plan)
    _, mult_in, mult_out = _collective(plan, rt)
    ranks = [_rank_steps(rp) for rp in plan.ranks]
    _check_limits(plan, rt, ranks, max(plan.input_chunks, plan.output_chunks), mult_in, mult_out)


# -- steps of one rank ---------------------------------------------------------
def _rank_steps(rp: RankPlan) -> list[list[XStep]]:
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


def _flagged(tb_steps: list[list[XStep]]) -> set[tuple[int, int]]:
    """(tb, step) pairs that get hasdep="1": every step waited for, plus chain breaks."""
    flags = {x.dep for steps in tb_steps for x in steps if x.dep}
    for t, steps in enumerate(tb_steps):
        flags.update((t, i - 1) for i in _chain_breaks(steps))
    return flags


def _chain_breaks(steps: list[XStep]) -> list[int]:
    """Indices i where re step i would be fused with re step i-1 but has a
    different cnt. The runtime fuses consecutive re steps with the same
    destination and source buffer when the later one has no dependency and
    the earlier one no hasdep, and runs the fused step with the last cnt;
    hasdep="1" on the earlier step ends the chain."""
    breaks, re_type = [], StepOp.REDUCE.xml
    for i in range(1, len(steps)):
        p, x = steps[i - 1], steps[i]
        if (p.type == x.type == re_type and x.dep is None and (p.dst.buffer, p.dst.index) == (x.dst.buffer, x.dst.index)
                and p.src.buffer == x.src.buffer and p.count != x.count):
            breaks.append(i)
    return breaks


def _step_attrs(i: int, x: XStep, hasdep: bool) -> dict[str, str]:
    src, dst = x.src, x.dst
    return {"s": str(i), "type": x.type,
            "srcbuf": BUFFER_LETTER[src.buffer] if src else "i", "srcoff": str(src.index) if src else "-1",
            "dstbuf": BUFFER_LETTER[dst.buffer] if dst else "o", "dstoff": str(dst.index) if dst else "-1",
            "cnt": str(x.count), "depid": str(x.dep[0]) if x.dep else "-1", "deps": str(x.dep[1]) if x.dep else "-1",
            "hasdep": "1" if hasdep else "0"}


def _peer(peer: int | None) -> str:
    return "-1" if peer is None else str(peer)


# -- the collective and the runtime's limits -----------------------------------------
def _collective(plan: Plan, rt: Runtime) -> tuple[str, int, int]:
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
    if name == "reducescatter":
        return rt.reducescatter, 1, n
    return name, (n if name == "allgather" else 1), 1


def _contract(plan: Plan):
    """What the plan's collective requires, for a custom one: its own, or a
    built-in's that MSCCL lacks (the reader maps it back to the built-in)."""
    if plan.contract is not None or plan.collective not in COLLECTIVES:
        return plan.contract
    return contract_of(get_collective(plan.collective), plan.num_ranks, plan.chunk_factor, plan.root)


def _limit(limit: str, value: int, maximum: int, what: str, rt: Runtime, constant: int | None = None,
           **where) -> RuntimeLimitError:
    """``constant``: the runtime constant's value where it is not the most
    it takes (MSCCL_MAX_COUNT = 72: cnt < 72)."""
    spelled = f"{limit} = {maximum}" if constant is None else f"{limit} = {constant}, at most {maximum}"
    return RuntimeLimitError(limit, value, maximum, f"{what} {value} exceeds the {rt.name} runtime's limit "
                             f"{spelled} ({rt.title})", runtime=rt.name, **where)


def _check_limits(plan: Plan, rt: Runtime, ranks: list, nchunks: int, mult_in: int, mult_out: int) -> None:
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
