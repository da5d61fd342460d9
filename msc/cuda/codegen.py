"""Rendering a plan into CUDA C++ through the Jinja templates in templates/.

Python only gathers data here (which threadblock has which steps, chunk
classes, connections, the encoded step table); every line of CUDA lives in
the templates. One translation unit per (plan, data type, op, protocol).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from msc.errors import UsageError
from msc.ir import Plan, StepOp
from msc.ir.ops import PROTOCOLS, REDUCE_OP_NAMES, REDUCE_OPS
from msc.resources import data_dir


@dataclass(frozen=True)
class DType:
    name: str
    ctype: str        # the C type (half types: a 16-bit struct, see common.cuh.j2)
    size: int
    half: bool = False
    floating: bool = True


DTYPES = {d.name: d for d in (
    DType("float32", "float", 4), DType("float64", "double", 8),
    DType("float16", "u16", 2, half=True), DType("bfloat16", "u16", 2, half=True),
    DType("int32", "int", 4, floating=False),
)}
OPS = REDUCE_OP_NAMES
BUF_IDS = {"input": 0, "output": 1, "scratch": 2}
# Straight-line code up to this many steps in the whole plan, the table form above: NVRTC
# time grows with code size (bench/codegen_speed.py measures the trade-off).
STRAIGHT_LINE_MAX_STEPS = 256
# Threads per block, and blocks per SM for __launch_bounds__, by protocol (why: msc.ir.ops.ProtocolSpec).
NTHREADS = {p.name: p.threads for p in PROTOCOLS.values()}
MIN_BLOCKS = {p.name: p.min_blocks for p in PROTOCOLS.values()}
# Device counters (dependencies, connection heads and tails) sit this many bytes apart, one
# per cache line, so that writers of different counters never share a line.
COUNTER_STRIDE = 128
# The kernel's step-op codes: a step op's index here (the templates' enum is generated from it).
STEP_OPS = tuple(StepOp)


def step_op_table() -> tuple[list[dict], dict[str, int]]:
    """The step ops as the templates declare them (name, code) and bit masks, by code, of
    the ops that receive, send and store to a destination (from msc.ir)."""
    ops = [dict(name=op.name, code=i) for i, op in enumerate(STEP_OPS)]
    masks = dict(receives=sum(1 << i for i, op in enumerate(STEP_OPS) if op.receives),
                 sends=sum(1 << i for i, op in enumerate(STEP_OPS) if op.sends),
                 stores=sum(1 << i for i, op in enumerate(STEP_OPS) if op.has_dst))
    return ops, masks


@dataclass(frozen=True)
class Connection:
    id: int
    sender: int
    receiver: int
    channel: int
    max_count: int            # chunks in its largest message (sizes its slots)


@dataclass(frozen=True)
class KernelLayout:
    """What the host runtime needs to launch a rendered kernel: the global
    threadblocks (rank, threadblock) in order, each rank's first block and
    block count, the connections, and the launch shape."""

    num_ranks: int
    blocks: tuple[tuple[int, int], ...]
    rank_blocks: tuple[tuple[int, int], ...]     # per rank: (first global block, count)
    connections: tuple[Connection, ...]
    scratch_chunks: tuple[int, ...]
    threadblocks_per_rank: tuple[int, ...]
    nthreads: int
    slots: int
    chunk_factor: int
    form: str
    max_steps: int = 0                           # steps of the longest threadblock


def _check(dtype: str, op: str, plan: Plan) -> DType:
    if dtype not in DTYPES:
        raise UsageError(f"the CUDA backend has no data type {dtype!r} (it has {', '.join(DTYPES)})")
    if op not in OPS:
        raise UsageError(f"unknown reduction {op!r} (expected one of {', '.join(OPS)})")
    dt = DTYPES[dtype]
    if REDUCE_OPS[op].average and not dt.floating:
        raise UsageError(f"{op} on the CUDA backend needs a floating type (it scales inputs by 1/n), not {dtype}")
    if REDUCE_OPS[op].average and plan.collective not in ("allreduce", "reducescatter", "reduce"):
        raise UsageError(f"{op} on the CUDA backend is for allreduce, reducescatter and reduce, not {plan.collective}")
    proto = PROTOCOLS.get(plan.protocol)
    if proto is not None and proto.transport is None:
        rendered = " and ".join(p.name for p in PROTOCOLS.values() if p.transport)
        raise UsageError(f"the CUDA backend renders the {rendered} protocols; {proto.name} is not implemented")
    return dt


def kernel_layout(plan: Plan, form: str) -> KernelLayout:
    conns: dict[tuple[int, int, int], int] = {}
    for rp in plan.ranks:
        for tb in rp.threadblocks:
            if tb.send is not None:
                key = (rp.rank, tb.send, tb.channel)
                conns[key] = max([conns.get(key, 0)] + [s.count for s in tb.steps if s.op.sends])
    connections = tuple(Connection(i, s, r, c, m) for i, ((s, r, c), m) in enumerate(sorted(conns.items())))
    blocks, rank_blocks = [], []
    for rp in plan.ranks:
        rank_blocks.append((len(blocks), len(rp.threadblocks)))
        blocks.extend((rp.rank, tb.id) for tb in rp.threadblocks)
    return KernelLayout(plan.num_ranks, tuple(blocks), tuple(rank_blocks), connections,
                        tuple(rp.scratch for rp in plan.ranks), tuple(len(rp.threadblocks) for rp in plan.ranks),
                        NTHREADS[plan.protocol], plan.slots, plan.chunk_factor, form,
                        max((len(tb.steps) for rp in plan.ranks for tb in rp.threadblocks), default=0))


def _context(plan: Plan, dtype: DType, op: str, form: str, facts) -> dict:
    layout = kernel_layout(plan, form)
    conn_id = {(c.sender, c.receiver, c.channel): c for c in layout.connections}
    published = {(r, t, s) for (r, _, _, step) in
                 ((rp.rank, tb, i, st) for rp in plan.ranks for tb in rp.threadblocks for i, st in enumerate(tb.steps))
                 for (t, s) in step.deps}
    average = REDUCE_OPS[op].average      # inputs pre-scaled by 1/n where first read: which are ("fresh")
    tbs, table, starts = [], [], []
    for gid, (rank, t) in enumerate(layout.blocks):
        rp = plan.ranks[rank]
        tb = rp.threadblocks[t]
        cin = conn_id.get((tb.recv, rank, tb.channel)) if tb.recv is not None else None
        cout = conn_id.get((rank, tb.send, tb.channel)) if tb.send is not None else None
        steps = []
        starts.append(len(table))
        for i, step in enumerate(tb.steps):
            fact = facts.get((rank, t, i)) or _guessed_facts(step, plan.chunk_factor)
            cls = list(fact.classes) if fact.classes else [0] * step.count
            fresh = [int(f) for row in fact.fresh for f in row] if average else [0] * (len(step.srcs) * step.count)
            deps = [x for (dt, ds) in step.deps for x in (dt, ds, len(rp.threadblocks[dt].steps))]
            srcs = [(BUF_IDS[sl.buffer], sl.index) for sl in step.srcs]
            dst = (BUF_IDS[step.dst.buffer], step.dst.index) if step.dst is not None else (0, 0)
            publish = (rank, t, i) in published
            steps.append(dict(index=i, op=step.op.name, count=step.count, srcs=srcs, dst=dst, cls=cls, fresh=fresh,
                              deps=deps, publish=publish, text=_describe(step)))
            table.extend([STEP_OPS.index(step.op), step.count, len(srcs), len(deps) // 3, int(publish),
                          dst[0], dst[1], *[x for o in srcs for x in o], *cls, *fresh, *deps])
        tbs.append(dict(gid=gid, rank=rank, tb=t, send=_peer(tb.send), recv=_peer(tb.recv), channel=tb.channel,
                        conn_in=cin.id if cin else -1, conn_out=cout.id if cout else -1,
                        max_in=cin.max_count if cin else 0, max_out=cout.max_count if cout else 0, steps=steps))
    step_ops, op_masks = step_op_table()
    return dict(plan=plan, dtype=dtype, op=op, redop=REDUCE_OPS[op], protocol=plan.protocol,
                transport=PROTOCOLS[plan.protocol].transport, form=form, nthreads=layout.nthreads,
                min_blocks=MIN_BLOCKS[plan.protocol], counter_words=COUNTER_STRIDE // 8, step_ops=step_ops,
                max_srcs=max([len(s.srcs) for rp in plan.ranks for tb in rp.threadblocks for s in tb.steps] + [1]),
                op_masks=op_masks, conns=layout.connections, tbs=tbs, table=table or [0],
                starts=starts or [0]), layout


def _guessed_facts(step, k: int):
    """Facts for a step the symbolic run never reached (a deadlocking plan
    rendered with allow_deadlock): classes from user-buffer indices, nothing
    pre-scaled. Such a step never runs where the plan deadlocks."""
    from msc.verification.plan import StepFacts

    sl = step.dst if step.dst is not None and step.dst.buffer != "scratch" else next(
        (x for x in step.srcs if x.buffer != "scratch"), None)
    classes = tuple((sl.index + j) % k if sl is not None else 0 for j in range(step.count))
    return StepFacts(classes, tuple(tuple(False for _ in range(step.count)) for _ in step.srcs))


def plan_facts(plan: Plan, *, collective=None, allow_deadlock: bool = False) -> dict:
    """msc.verification.plan.step_facts; with ``allow_deadlock``, the facts of the steps
    a deadlocking plan reaches before it sticks (the rest are guessed), so
    that tests can put a deadlock on a GPU and see it time out."""
    from msc.verification.plan import step_facts

    return step_facts(plan, collective=collective, partial=allow_deadlock)


def _peer(p):
    return "-" if p is None else str(p)


def _describe(step) -> str:
    text = step.op.value
    if step.srcs:
        text += " " + ", ".join(str(s) for s in step.srcs)
    if step.dst is not None:
        text += f" -> {step.dst}"
    if step.where is not None:
        text += f"   ({step.where})"
    return text.replace("*/", "* /")


@lru_cache(maxsize=1)
def environment():
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    env = Environment(loader=FileSystemLoader(str(data_dir("templates"))), undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.globals["max"] = max
    return env


def choose_form(plan: Plan, form: str | None) -> str:
    if form is None:
        return "straight" if plan.num_steps() <= STRAIGHT_LINE_MAX_STEPS else "table"
    if form not in ("straight", "table"):
        raise UsageError(f"form must be 'straight' or 'table', got {form!r}")
    return form


def render(plan: Plan, *, dtype: str = "float32", op: str = "sum", form: str | None = None,
           collective=None, allow_deadlock: bool = False) -> tuple[str, KernelLayout]:
    """CUDA source for the plan and the layout the runtime launches it with.
    ``allow_deadlock``: render a plan that deadlocks (for timeout tests)."""
    dt = _check(dtype, op, plan)
    form = choose_form(plan, form)
    facts = plan_facts(plan, collective=collective, allow_deadlock=allow_deadlock)
    context, layout = _context(plan, dt, op, form, facts)
    return environment().get_template("kernel.cu.j2").render(**context), layout
