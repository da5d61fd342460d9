"""An MSCCL++ execution plan of the shape msc.formats.mscclpp.export writes,
read back as an msc plan (for ``msc run``, ``simulate``, ``diff``, ``import``).

Each run of operations between synchronisations is one msc step:

    Simple                                   LL                        msc step
    put X -> peer slot                       ppkt X -> peer slot       send X
    copy slot -> D                           upkt slot -> D            recv D
    copy slot -> D; put slot -> peer slot    upkt; rppkt               rcs D
    re [X, slot] -> D                        repkt [X, slot] -> D      rrc X -> D
    res [X, slot] -> [slot, peer slot]       respkt [X, slot] -> [temp, peer slot]   rrs X
    res [X, slot] -> [D, peer slot]          respkt [X, slot] -> [D, peer slot]      rrcs X -> D
    copy X -> D, re [S...] -> D (no slot)                              copy, reduce
    glres switch S -> switch D                                         swrs S -> D
    glres switch S -> switch scratch region; copy region -> D          swred S -> D
    gstore X -> switch D                                               swst X -> D
    wait on the group's barrier channels (msc_barrier_channels)        barrier

A slot is scratch some peer writes. Waits, signals and nops are the
connection's flow control and say nothing more; a device semaphore released
after one step and acquired before another is a dependency. Threadblocks the
exporter spread (``msc_part``) are joined again. Plans of other shapes (the
DSL's, zero-copy puts into outputs, gets, barriers) are refused naming the
first operation that does not fit: ``msc verify`` checks those as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from msc.errors import PlanError
from msc.ir import Contract, Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.ir.onesided import SWITCH_OPS, OneSidedPlan, Operand, Operation
from msc.verification.plan_values import check_plan

FLOW = ("nop", "wait", "signal", "rlxwait", "rlxsignal")
SHAPE = "not in the shape msc's MSCCL++ export writes (msc verify checks it as it is)"


@dataclass
class _Block:
    ops: list
    meta: dict
    index: int = 0                                   # its (first) threadblock in the file
    send: int | None = None
    recv: int | None = None
    steps: list = field(default_factory=list)
    releases: dict = field(default_factory=dict)     # semaphore -> step index
    acquires: list = field(default_factory=list)     # per step: semaphores


def lift_plan(osp: OneSidedPlan) -> Plan:
    """The msc plan ``osp`` is the export of (PlanError naming the rank,
    threadblock and operation where it is not of that shape)."""
    from msc.verification.onesided_run import Layout

    layout = Layout(osp)
    if layout.collective is None and osp.meta_value("msc_contract") is None:
        raise PlanError(f"collective {osp.collective!r}: msc has no such collective, so the plan cannot be read as an "
                        f"msc plan (msc verify checks it structurally)")
    slots = _slots(osp)
    ranks = []
    for gpu in osp.gpus:
        own = dict(gpu.meta).get("msc_scratch", min((i for (r, i) in slots if r == gpu.rank), default=gpu.scratch_chunks))
        blocks = _join_parts(osp, gpu)
        barrier_channels = set(dict(gpu.meta).get("msc_barrier_channels", ()))
        for b in blocks:
            _steps(osp, gpu.rank, b, slots, own, barrier_channels)
        ranks.append(RankPlan(gpu.rank, own, _threadblocks(gpu.rank, blocks)))
    k = osp.meta_value("msc_chunk_factor", layout.k)
    contract = contract_of_plan(osp)
    plan = Plan(osp.name, _collective_name(osp, layout), osp.num_ranks, k, osp.inplace, osp.gpus[0].input_chunks,
                osp.gpus[0].output_chunks, tuple(ranks), root=layout.root, protocol=osp.protocol,
                instances=osp.meta_value("msc_instances", 1), slots=osp.meta_value("msc_slots", 1),
                tile=osp.meta_value("msc_tile", 0), contract=contract)
    check_plan(plan)                 # the connections pair up, the slices fit: else it is not msc's shape
    return plan


def _collective_name(osp, layout) -> str:
    return layout.collective.name if layout.collective is not None else osp.collective


def contract_of_plan(osp: OneSidedPlan) -> Contract | None:
    """The custom collective's requirements msc recorded in the plan (msc_contract), or None."""
    import re

    from msc.ir.contract_text import build_contract, check_contract

    rows = osp.meta_value("msc_contract")
    if rows is None:
        return None
    parsed = []
    for row in rows:
        m = re.fullmatch(r"\s*(post|pre)\s+([0-9]{1,9})\s*:(.*)", str(row), flags=re.S)
        if m is None:
            raise PlanError(f"msc_contract: {str(row)[:40]!r} is not a row 'post R: ...' or 'pre R: ...'")
        parsed.append((m[1], int(m[2]), m[3].split(), None))
    contract = build_contract(parsed)
    gpu = osp.gpus[0]
    check_contract(contract, osp.num_ranks, gpu.input_chunks, gpu.output_chunks)    # rows for these ranks and sizes
    return contract


def _slots(osp: OneSidedPlan) -> dict:
    """(rank, scratch chunk) -> the peer that writes it (through put or packets)."""
    out = {}
    for gpu in osp.gpus:
        for ops in gpu.threadblocks:
            for op in ops:
                for d in op.dsts:
                    if d.remote and d.buffer == "scratch":
                        for i in range(d.index, d.index + d.size):
                            out[(d.rank, i)] = gpu.rank
    return out


def _join_parts(osp: OneSidedPlan, gpu) -> list[_Block]:
    """msc's threadblocks: the exporter's continuation parts appended to their
    first part, without the hand-over (nop, sem_release / sem_acquire, nop)."""
    blocks: dict = {}
    for t, ops in enumerate(gpu.threadblocks):
        meta = dict(gpu.tb_meta[t]) if gpu.tb_meta else {}
        key = meta.get("msc_tb", t)
        if meta.get("msc_part"):
            if key not in blocks:
                raise PlanError(f"msc_part {meta['msc_part']} of threadblock {key}, which comes later",
                                rank=gpu.rank, tb=t)
            blocks[key].ops = blocks[key].ops[:-2] + list(ops[2:])
        else:
            blocks[key] = _Block(list(ops), meta, t)
    return [blocks[k] for k in sorted(blocks)]


def _steps(osp, rank: int, b: _Block, slots: dict, own: int, barrier_channels: set) -> None:
    pending: list = []
    previous: Operation | None = None
    for i, op in enumerate(b.ops):
        where = dict(rank=rank, tb=b.index)
        if op.port:
            raise PlanError(f"operation {i} ({op.name}) goes through a port channel (the host proxy); {SHAPE}", **where)
        if op.name == "wait" and op.channels and set(op.channels) <= barrier_channels:
            if not (b.steps and b.steps[-1][0] is StepOp.BARRIER and previous is not None and previous.name == "wait"):
                _add(b, StepOp.BARRIER, (), None, 1, pending)     # a group of 9+ waits more than once
                pending = []
            previous = op
            continue
        if op.name in FLOW:
            previous = None
            continue
        if op.name == "sem_acquire":
            pending += op.semaphores
            continue
        if op.name == "sem_release":
            if pending or not b.steps:
                _add(b, StepOp.NOP, (), None, 0, pending)
                pending = []
            for s in op.semaphores:
                b.releases[s] = len(b.steps) - 1
            continue
        if _continues(b, previous, op, where, i):
            previous = op
            continue
        opcode, srcs, dst, count = _step_of(op, rank, b, slots, own, i, where)
        _add(b, opcode, srcs, dst, count, pending)
        pending, previous = [], op
    if pending:
        _add(b, StepOp.NOP, (), None, 0, pending)


def _add(b: _Block, op, srcs, dst, count, acquires) -> None:
    b.steps.append((op, srcs, dst, count))
    b.acquires.append(list(acquires))


def _slice(o: Operand) -> Slice:
    return Slice(o.buffer, o.index, o.size)


def _is_slot(o: Operand, rank: int, slots: dict) -> bool:
    return not o.remote and o.buffer == "scratch" and (rank, o.index) in slots


def _peer(b: _Block, side: str, peer: int, where, i: int) -> None:
    have = getattr(b, side)
    if have is not None and have != peer:
        raise PlanError(f"operation {i}: {'sends to' if side == 'send' else 'receives from'} rank {peer} and rank "
                        f"{have}: an msc threadblock has one peer each way; {SHAPE}", **where)
    setattr(b, side, peer)


def _continues(b: _Block, previous, op: Operation, where, i: int) -> bool:
    """The second half of rcs (a put or rppkt of the slot just copied out), or
    the next ``re`` of a reduce with more sources than one operation takes."""
    from msc.formats.mscclpp.limits import MAX_OPERANDS

    if not b.steps:
        return False
    kind, srcs, dst, count = b.steps[-1]
    if kind is StepOp.SWRED and dst is None:       # the copy out of the switch's scratch region
        if op.name != "copy" or len(op.srcs) != 1 or len(op.dsts) != 1 or op.srcs[0].group or op.dsts[0].group \
                or op.srcs[0].remote or op.dsts[0].remote:
            raise PlanError(f"operation {i} ({op.name}): a glres into a scratch region is not followed by a copy out "
                            f"of it; {SHAPE}", **where)
        b.steps[-1] = (kind, srcs, _slice(op.dsts[0]), count)
        return True
    if previous is None:
        return False
    if op.name in ("put", "rppkt") and previous.name in ("copy", "upkt") and kind is StepOp.RECV \
            and op.srcs and op.srcs[0] == previous.srcs[0] and op.dsts and op.dsts[0].remote:
        _peer(b, "send", op.dsts[0].rank, where, i)
        b.steps[-1] = (StepOp.RCS, srcs, dst, count)
        return True
    if op.name == "re" and previous.name == "re" and kind is StepOp.REDUCE and len(previous.srcs) == MAX_OPERANDS \
            and op.srcs[0] == previous.dsts[0] == op.dsts[0]:
        b.steps[-1] = (kind, srcs + tuple(_slice(s) for s in op.srcs[1:]), dst, count)
        return True
    return False


def _switch_step(op: Operation, own: int):
    """swrs, swst, or the first half of swred (glres into a scratch region above the plan's own scratch)."""
    src, dst = op.srcs[0], op.dsts[0]
    if op.name == "gstore":
        return StepOp.SWST, (_slice(src),), _slice(dst), src.size
    if dst.buffer == "scratch" and dst.index >= own:
        return StepOp.SWRED, (_slice(src),), None, src.size
    return StepOp.SWRS, (_slice(src),), _slice(dst), src.size


def _step_of(op: Operation, rank: int, b: _Block, slots: dict, own: int, i: int, where):
    name, srcs, dsts = op.name, op.srcs, op.dsts
    bad = PlanError(f"operation {i} ({name}): {SHAPE}", **where)
    if name in ("glres", "gstore"):
        if not b.meta.get("msc_group"):
            raise PlanError(f"operation {i} ({name}): a switch op in a threadblock msc did not write (no msc_group); "
                            f"{SHAPE}", **where)
        return _switch_step(op, own)
    if not srcs or not dsts or any(s.remote for s in srcs):
        raise bad
    remote = [d for d in dsts if d.remote]
    direct = [d for d in remote if d.buffer != "scratch"]
    if direct:
        raise PlanError(f"operation {i} ({name}) writes rank {direct[0].rank}'s {direct[0].buffer} directly (zero-copy); "
                        f"{SHAPE}", **where)
    for d in remote:
        _peer(b, "send", d.rank, where, i)
    for s in srcs:
        if _is_slot(s, rank, slots):
            _peer(b, "recv", slots[(rank, s.index)], where, i)
    local = [d for d in dsts if not d.remote]
    first = _slice(srcs[0])
    n = srcs[0].size
    if name in ("put", "ppkt") and len(srcs) == 1 and len(remote) == 1 and not local:
        return StepOp.SEND, (first,), None, n
    if name in ("copy", "upkt") and len(srcs) == 1 and len(local) == 1:
        recv = _is_slot(srcs[0], rank, slots) or name == "upkt"
        return (StepOp.RECV, (), _slice(local[0]), n) if recv else (StepOp.COPY, (first,), _slice(local[0]), n)
    if name in ("re", "repkt") and len(local) == 1 and not remote:
        if len(srcs) == 2 and _is_slot(srcs[1], rank, slots):
            return StepOp.RRC, (first,), _slice(local[0]), n
        if name == "re":
            return StepOp.REDUCE, tuple(_slice(s) for s in srcs), _slice(local[0]), n
    if name in ("res", "respkt") and len(srcs) == 2 and _is_slot(srcs[1], rank, slots) and len(dsts) == 2 \
            and not dsts[0].remote and dsts[1].remote:
        keep = dsts[0]
        if keep == srcs[1] or (keep.buffer == "scratch" and keep.index >= own and name == "respkt"):
            return StepOp.RRS, (first,), None, n
        return StepOp.RRCS, (first,), _slice(keep), n
    raise bad


def _threadblocks(rank: int, blocks: list[_Block]) -> tuple[Threadblock, ...]:
    released = {}
    for t, b in enumerate(blocks):
        for sem, s in b.releases.items():
            released[sem] = (t, s)
    out = []
    for t, b in enumerate(blocks):
        steps = []
        for (op, srcs, dst, count), acquires in zip(b.steps, b.acquires):
            missing = [s for s in acquires if s not in released]
            if missing:
                raise PlanError(f"acquires device semaphore {missing[0]}, which no step releases; {SHAPE}",
                                rank=rank, tb=t)
            steps.append(Step(op, tuple(srcs), dst, count, tuple(sorted({released[s] for s in acquires}))))
        out.append(Threadblock(t, b.send, b.recv, int(b.meta.get("msc_channel", 0)), tuple(steps),
                               tuple(b.meta.get("msc_group", ()))))
    return tuple(out)
