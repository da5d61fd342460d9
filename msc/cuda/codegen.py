"""Rendering a plan into CUDA C++ through the Jinja templates in templates/.

Python only gathers data here (which threadblock has which steps, chunk
classes, connections, the encoded tables); every line of CUDA lives in the
templates. Two forms of one kernel:

- straight-line (small plans): each threadblock's steps as code, with every
  constant folded; one translation unit per (plan, data type, op);
- table (large plans): one interpreter reading the plan's threadblock and
  step tables from device memory (``plan_tables``); its text holds no plan,
  so one translation unit per (protocol, data type, op, source width) runs
  every plan of that kind, and a new plan needs tables, not a compile.
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from msc.dsl.collectives import REDUCING
from msc.errors import UsageError
from msc.ir import Plan, StepOp
from msc.ir.ops import PROTOCOLS, REDUCE_OP_NAMES, REDUCE_OPS, kernel_op_problem, reduce_op, switch_op_problem
from msc.resources import data_dir

if TYPE_CHECKING:
    from msc.ir.arrays import PlanArrays


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
    block count, the connections (those with a sender, in sorted (sender,
    receiver, channel) order, numbered from 0), and the launch shape."""

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
    groups: tuple[tuple[int, ...], ...] = ()     # the switch groups (NVLS), in order of first use
    switch_tbs: tuple[tuple[int, int], ...] = ()  # per global threadblock: (group index, channel), (-1, -1): none

    @property
    def switch(self) -> bool:
        """Whether the plan has switch ops (its kernel includes templates/multimem.cuh.j2)."""
        return bool(self.groups)

    def group_channels(self, g: int) -> tuple[int, ...]:
        """The channels of group ``g``'s threadblocks: a barrier counter each, in this order."""
        return tuple(sorted({c for gi, c in self.switch_tbs if gi == g}))

    def groups_of(self, rank: int) -> tuple[int, ...]:
        """The indices of the switch groups ``rank`` belongs to (it may be in several), in order."""
        return tuple(g for g, members in enumerate(self.groups) if rank in members)

    def group_counters(self) -> tuple[tuple[int, int], ...]:
        """Every (group, channel) with a barrier counter, in order: where each lies in group memory."""
        return tuple((g, c) for g in range(len(self.groups)) for c in self.group_channels(g))


def _check_kind(dtype: str, op: str) -> DType:
    if dtype not in DTYPES:
        raise UsageError(f"the CUDA backend has no data type {dtype!r} (it has {', '.join(DTYPES)})")
    reduce_op(op)
    return DTYPES[dtype]


def check_kernel(dtype: str, op: str, plan: Plan) -> DType:
    """UsageError unless the CUDA backend can run ``plan`` with ``dtype`` and ``op``."""
    dt = _check_kind(dtype, op)
    problem = kernel_op_problem(op, dtype, dt.floating)
    if problem:
        raise UsageError(problem)
    if REDUCE_OPS[op].average and plan.collective not in REDUCING:
        raise UsageError(f"{op} on the CUDA backend is for {', '.join(REDUCING)}, not {plan.collective}")
    if plan.first_switch_step() is not None:
        problem = switch_op_problem(op, dtype)
        if problem:
            raise UsageError(f"plan {plan.name!r} reduces in the NVLink switch, and {problem}")
    proto = PROTOCOLS.get(plan.protocol)
    if proto is not None and proto.transport is None:
        rendered = " and ".join(p.name for p in PROTOCOLS.values() if p.transport)
        raise UsageError(f"the CUDA backend renders the {rendered} protocols; {proto.name} is not implemented")
    return dt


def kernel_layout(plan: Plan, form: str) -> KernelLayout:
    """How the runtime launches ``plan`` rendered in ``form``: its
    threadblocks and connections as the plan's columns (msc.ir.arrays) have them."""
    import numpy as np          # here: the msc command imports this module, and no numpy

    from msc.ir.arrays import plan_arrays

    arrays = plan_arrays(plan)
    tbs_per_rank = np.diff(arrays.rank_tb_start)
    blocks = tuple(zip(arrays.tb_rank.tolist(), arrays.tb_id.tolist()))
    groups, switch_tbs = _switch_groups(plan, blocks)
    return KernelLayout(plan.num_ranks, blocks,
                        tuple(zip(arrays.rank_tb_start[:-1].tolist(), tbs_per_rank.tolist())),
                        _connections(arrays), tuple(rp.scratch for rp in plan.ranks), tuple(tbs_per_rank.tolist()),
                        NTHREADS[plan.protocol], plan.slots, plan.chunk_factor, form,
                        int(np.diff(arrays.tb_start).max(initial=0)), groups, switch_tbs)


def _switch_groups(plan: Plan, blocks) -> tuple[tuple, tuple]:
    """The plan's switch groups and, per global threadblock, (its group's index, its channel)
    ((-1, -1): none); ((), ()) for a plan without switch ops. A rank may be in several groups:
    its buffers lie in one group memory that each of its groups reaches (msc.cuda.groups)."""
    if plan.first_switch_step() is None:
        return (), ()
    groups: list[tuple[int, ...]] = []
    rows = []
    for rank, t in blocks:
        tb = plan.ranks[rank].threadblocks[t]
        if not tb.group or not any(s.op.switch for s in tb.steps):
            rows.append((-1, -1))
            continue
        if tb.group not in groups:
            groups.append(tb.group)
        rows.append((groups.index(tb.group), tb.channel))
    return tuple(groups), tuple(rows)


def _connections(arrays: PlanArrays) -> tuple[Connection, ...]:
    """The connections that have a sender, in the plan's (sorted) order,
    each with its largest message (0: it sends none)."""
    import numpy as np

    sending = np.flatnonzero(arrays.conn_senders > 0)
    largest = np.zeros(arrays.num_conns, dtype=np.int64)
    busy = np.flatnonzero(arrays.sends_per_conn > 0)
    if busy.size:
        largest[busy] = np.maximum.reduceat(arrays.count[arrays.send_steps], arrays.send_ptr[busy])
    return tuple(Connection(i, int(arrays.conn_sender[c]), int(arrays.conn_receiver[c]), int(arrays.conn_channel[c]),
                            int(largest[c])) for i, c in enumerate(sending.tolist()))


TB_COLUMNS = 8     # a row of the threadblock table (templates/kernel.cu.j2: TB_RANK .. TB_START)


@dataclass(frozen=True)
class PlanTables:
    """A plan as the table-form kernel reads it from device memory: the
    threadblock table (TB_COLUMNS ints per global threadblock: rank,
    threadblock, steps, connection in, connection out, largest message in,
    out, start of its steps) and the step table (templates/kernel.cu.j2 gives
    a step's encoding). int32, as the kernel reads them."""

    threadblocks: tuple[int, ...]
    steps: tuple[int, ...]

    def device_image(self) -> bytes:
        """Both tables as the device holds them: the threadblock table, then the
        step table at byte ``steps_offset``."""
        return _int32_bytes(self.threadblocks + self.steps)

    @property
    def steps_offset(self) -> int:
        return 4 * len(self.threadblocks)

    def to_bytes(self) -> bytes:
        """A self-describing encoding: the threadblock table's length, then the image."""
        return _int32_bytes((len(self.threadblocks),)) + self.device_image()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "PlanTables":
        ints = _ints(raw) if len(raw) % 4 == 0 else ()
        if not ints or not 0 <= ints[0] <= len(ints) - 1:
            raise ValueError("not an encoding of plan tables")
        return cls(tuple(ints[1:1 + ints[0]]), tuple(ints[1 + ints[0]:]))


def describe_tables(tables: PlanTables) -> str:
    """The tables as text, a row per threadblock and per step, for a reader of the
    table-form kernel (msc compile --emit cuda writes it beside the source)."""
    lines = ["# the plan as the table-form kernel reads it (templates/kernel.cu.j2 decodes each row)",
             "# threadblocks: rank threadblock steps conn_in conn_out max_in max_out start"]
    rows = [tables.threadblocks[i:i + TB_COLUMNS] for i in range(0, len(tables.threadblocks), TB_COLUMNS)]
    lines += [" ".join(map(str, row)) for row in rows]
    lines.append("# steps, per threadblock: op(name) count nsrc ndeps publish | dst buf index | srcs (buf index)... "
                 "| classes | fresh | deps (threadblock step steps)...")
    for row in rows:
        lines.append(f"# rank {row[0]} threadblock {row[1]}")
        at = row[7]
        for _ in range(row[2]):
            op, count, nsrc, ndeps, publish, dbuf, dindex = tables.steps[at:at + 7]
            at += 7
            parts = []
            for width in (2 * nsrc, count, nsrc * count, 3 * ndeps):
                parts.append(" ".join(map(str, tables.steps[at:at + width])) or "-")
                at += width
            lines.append(f"{op}({STEP_OPS[op].name}) {count} {nsrc} {ndeps} {publish} | {dbuf} {dindex} | "
                         + " | ".join(parts))
    return "\n".join(lines) + "\n"


def _int32_bytes(values) -> bytes:
    out = array("i", values)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def _ints(raw: bytes) -> array:
    out = array("i")
    out.frombytes(raw)
    if sys.byteorder != "little":
        out.byteswap()
    return out


def table_width(plan: Plan) -> int:
    """MAX_SRCS of the table-form kernel that runs ``plan``: the smallest power of two
    that holds its widest step's local sources (every library plan: 1). The width sizes
    registers, so it is compiled in: one kernel per width that plans need."""
    return 1 << (_widest_step(plan) - 1).bit_length()


def _widest_step(plan: Plan) -> int:
    """The most local sources a step of ``plan`` reads (at least 1)."""
    return max([len(s.srcs) for rp in plan.ranks for tb in rp.threadblocks for s in tb.steps] + [1])


def _encode(plan: Plan, layout: KernelLayout, facts, average: bool) -> tuple[list[dict], PlanTables]:
    """The plan's threadblocks and steps: as records for the straight-line form's code,
    and as the tables the table form reads (the same values). ``average``: mark the
    inputs the kernel pre-scales by 1/n where first read ("fresh")."""
    import numpy as np

    from msc.ir.arrays import plan_arrays

    arrays = plan_arrays(plan)
    conn = dict(zip(np.flatnonzero(arrays.conn_senders > 0).tolist(), layout.connections))   # -1, no sender: None
    published = np.zeros(arrays.num_steps, dtype=bool)             # steps another step depends on
    published[arrays.dep_step[arrays.dep_step >= 0]] = True
    published, first_step = published.tolist(), arrays.tb_start.tolist()
    recv_conn, send_conn = arrays.tb_recv_conn.tolist(), arrays.tb_send_conn.tolist()
    tbs, rows, table = [], [], []
    for gid, (rank, t) in enumerate(layout.blocks):
        rp = plan.ranks[rank]
        tb = rp.threadblocks[t]
        cin, cout = conn.get(recv_conn[gid]), conn.get(send_conn[gid])
        row = [rank, t, len(tb.steps), cin.id if cin else -1, cout.id if cout else -1,
               cin.max_count if cin else 0, cout.max_count if cout else 0, len(table)]
        rows.extend(row)
        steps = []
        barriers = _barrier_kinds(tb)
        for i, step in enumerate(tb.steps):
            fact = facts.get((rank, t, i)) or _guessed_facts(step, plan.chunk_factor)
            cls = list(fact.classes) if fact.classes else [0] * step.count
            fresh = [int(f) for row_ in fact.fresh for f in row_] if average else [0] * (len(step.srcs) * step.count)
            deps = [x for (dt, ds) in step.deps for x in (dt, ds, len(rp.threadblocks[dt].steps))]
            srcs = [(BUF_IDS[sl.buffer], sl.index) for sl in step.srcs]
            dst = (BUF_IDS[step.dst.buffer], step.dst.index) if step.dst is not None else (0, 0)
            if step.op is StepOp.BARRIER:
                dst = (barriers.get(i, BARRIER_EACH_TILE), 0)
            publish = published[first_step[gid] + i]
            steps.append(dict(index=i, op=step.op.name, count=step.count, srcs=srcs, dst=dst, cls=cls, fresh=fresh,
                              deps=deps, publish=publish, text=_describe(step)))
            table.extend([STEP_OPS.index(step.op), step.count, len(srcs), len(deps) // 3, int(publish),
                          dst[0], dst[1], *[x for o in srcs for x in o], *cls, *fresh, *deps])
        tbs.append(dict(gid=gid, rank=rank, tb=t, send=_peer(tb.send), recv=_peer(tb.recv), channel=tb.channel,
                        row=row, steps=steps))
    return tbs, PlanTables(tuple(rows), tuple(table))


# How often a barrier step passes (the dst operand of its encoding, templates/steps.cuh.j2): a
# threadblock's first and last barriers bound the call, so they pass once (at the first and the last
# tile iteration); the others separate switch accesses of every tile (msc.ir.StepOp).
BARRIER_EACH_TILE, BARRIER_FIRST, BARRIER_LAST = 0, 1, 2


def _barrier_kinds(tb) -> dict[int, int]:
    """Step index -> BARRIER_FIRST / BARRIER_LAST for the threadblock's first and last barrier."""
    at = [i for i, s in enumerate(tb.steps) if s.op is StepOp.BARRIER]
    if not at:
        return {}
    return {at[-1]: BARRIER_LAST, at[0]: BARRIER_FIRST}    # one barrier: it passes once, at the start


def plan_tables(plan: Plan, *, op: str = "sum", collective=None, allow_deadlock: bool = False) -> PlanTables:
    """The tables the table-form kernel runs ``plan`` from, for reductions with ``op``
    (only whether it pre-scales matters: ``prescales``)."""
    facts = plan_facts(plan, collective=collective, allow_deadlock=allow_deadlock)
    return _encode(plan, kernel_layout(plan, "table"), facts, prescales(plan, op))[1]


def prescales(plan: Plan, op: str) -> bool:
    """Whether the kernel averages by scaling inputs by 1/n where first read (NCCL's PreMulSum):
    for an averaging ``op``, unless the plan has switch ops. The switch reads the members' memory
    as it is and only sums, so a switch plan's average is its sum, then a second launch divides
    every output chunk by its contributions (``average_table``; the executor's definition)."""
    return REDUCE_OPS[op].average and plan.first_switch_step() is None


def average_table(plan: Plan, collective=None) -> tuple[int, ...]:
    """What a switch plan's division pass (templates/switch_average.cuh.j2) reads, as int32:
    per rank (first entry, end of its entries, its threadblocks), then an entry (buffer id,
    chunk, m) per output chunk of m >= 2 contributions: msc.executor's divisors, so the pass
    divides exactly what the reference divides."""
    from msc.executor import Executor

    averaged = Executor(plan, collective=collective).averaged
    head, entries = [], []
    for rank, rp in enumerate(plan.ranks):
        mine = [(BUF_IDS[buf], index, m) for r, buf, index, m in averaged if r == rank]
        head += [len(entries) // 3, len(entries) // 3 + len(mine), len(rp.threadblocks)]
        entries += [x for entry in mine for x in entry]
    return tuple(head + entries)


def _kernel_context(protocol: str, dtype: DType, op: str, form: str, max_srcs: int, switch: bool = False) -> dict:
    """What every kernel's text needs, whatever the form. ``switch``: the kernel runs switch
    ops (NVLS): it includes templates/multimem.cuh.j2 for (dtype, op), and for an average the
    division pass (``divides``: templates/switch_average.cuh.j2); kernels without them render
    as they did before switch ops existed."""
    from msc.cuda.switch import switch_form

    step_ops, op_masks = step_op_table()
    return dict(dtype=dtype, op=op, redop=REDUCE_OPS[op], protocol=protocol, transport=PROTOCOLS[protocol].transport,
                form=form, nthreads=NTHREADS[protocol], min_blocks=MIN_BLOCKS[protocol],
                counter_words=COUNTER_STRIDE // 8, step_ops=step_ops, op_masks=op_masks, max_srcs=max_srcs,
                switch=switch_form(dtype.name, op) if switch else None,
                divides=switch and REDUCE_OPS[op].average,
                barrier_first=BARRIER_FIRST, barrier_last=BARRIER_LAST)


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
    The table form's source is the plan's kind's (render_table_kernel), its
    tables are data (plan_tables). ``allow_deadlock``: render a plan that
    deadlocks (for timeout tests)."""
    dt = check_kernel(dtype, op, plan)
    form = choose_form(plan, form)
    layout = kernel_layout(plan, form)
    if form == "table":
        return render_table_kernel(plan.protocol, dtype=dtype, op=op, max_srcs=table_width(plan),
                                   switch=layout.switch), layout
    facts = plan_facts(plan, collective=collective, allow_deadlock=allow_deadlock)
    tbs, _ = _encode(plan, layout, facts, prescales(plan, op))
    context = _kernel_context(plan.protocol, dt, op, form, _widest_step(plan), layout.switch)
    context.update(plan=plan, tbs=tbs)
    return environment().get_template("kernel.cu.j2").render(**context), layout


def render_table_kernel(protocol: str, *, dtype: str = "float32", op: str = "sum", max_srcs: int = 1,
                        switch: bool = False) -> str:
    """The table-form kernel for every plan of ``protocol`` whose steps read at most
    ``max_srcs`` local sources (``switch``: and that has switch ops): no plan in its text
    (the plan comes as PlanTables)."""
    context = _kernel_context(protocol, _check_kind(dtype, op), op, "table", max_srcs, switch)
    return environment().get_template("kernel.cu.j2").render(**context)
