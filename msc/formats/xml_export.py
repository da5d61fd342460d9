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
``check_limits`` (msc.lower.msccl_steps, which also turns a plan's steps
into <step>s) checks a plan against a runtime's limits, as lowering for a
target does.

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

from msc.dsl.collectives import COLLECTIVES, ROOTED, collective_key, contract_of, get_collective
from msc.errors import PlanError, RuntimeLimitError, UsageError
from msc.ir import Plan, StepOp
from msc.ir.contract_text import contract_lines
from msc.ir.limits import MAX_BYTES, check
from msc.lower.msccl_steps import XStep, check_counted_limits, check_limits, msccl_collective, rank_steps
from msc.lower.runtimes import xml_runtime
from msc.verification.plan_values import buffer_sizes, check_plan

__all__ = ["RuntimeLimitError", "check_limits", "plan_to_xml"]


BUFFER_LETTER = {"input": "i", "output": "o", "scratch": "s"}


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
    coll, mult_in, mult_out = msccl_collective(plan, rt)
    ranks = [rank_steps(rp) for rp in plan.ranks]
    flagged = [_flagged(steps) for steps in ranks]
    nchunks = max(plan.input_chunks, plan.output_chunks)
    check_counted_limits(plan, rt, ranks, nchunks, mult_in, mult_out)

    attrs = {"name": name, "proto": plan.protocol,
             "nchannels": str(1 + max((tb.channel for rp in plan.ranks for tb in rp.threadblocks), default=0)),
             "nchunksperloop": str(nchunks), "ngpus": str(plan.num_ranks), "coll": coll,
             "inplace": str(int(plan.inplace)), "outofplace": str(int(not plan.inplace)),
             "minBytes": str(min_bytes), "maxBytes": str(rt.unlimited_bytes if max_bytes is None else max_bytes)}
    if rt.lowercase_bytes:
        attrs["minbytes"], attrs["maxbytes"] = attrs["minBytes"], attrs["maxBytes"]
    # msc's own values, for a faithful import (the runtimes ignore unknown attributes)
    attrs["msc_slots"] = str(plan.slots)
    if collective_key(plan.collective) in ROOTED:          # coll may be custom (gather, scatter): the plan's own
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


# -- the <step> attributes ---------------------------------------------------------


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


# -- a custom collective's contract -------------------------------------------------


def _contract(plan: Plan):
    """What the plan's collective requires, for a custom one: its own, or a
    built-in's that MSCCL lacks (the reader maps it back to the built-in)."""
    if plan.contract is not None or plan.collective not in COLLECTIVES:
        return plan.contract
    return contract_of(get_collective(plan.collective), plan.num_ranks, plan.chunk_factor, plan.root)
