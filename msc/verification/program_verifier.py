"""Symbolic verification of a traced program.

The program is executed on symbolic chunks. An input chunk is its label
``(origin_rank, origin_index)``; reducing builds a ``Sum`` node that shares
its operands, so a step costs O(chunks it touches), never O(contributions).
Only when an output chunk is checked is the node's multiset of
contributions counted, once per distinct (node, expectation) pair; the ring
allreduce at n ranks therefore checks in O(n^2), the size of its trace.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from msc.dsl.collectives import describe_multiset
from msc.errors import VerificationError
from msc.ir import OpKind
from msc.perf import pause_gc
from msc.verification import crosscheck


class Sum:
    """Symbolic ``a (+) b``; operands are labels or other ``Sum`` nodes."""

    __slots__ = ("a", "b", "c")

    def __init__(self, a, b):
        self.a = a
        self.b = b
        self.c = -1      # chunk class, kept by the plan verifier


def contributions(value) -> dict[tuple[int, int], int]:
    """The multiset of labels in a symbolic value, counted with multiplicity.

    Linear in the size of the DAG below ``value``, also where nodes are
    shared (a node reduced in twice counts twice).
    """
    if type(value) is not Sum:
        return {value: 1}
    # Most values are trees (a ring's partial sums are chains): count their
    # leaves in one walk, and take the DAG way below once a node repeats.
    leaves: dict = {}
    seen = set()
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) is Sum:
            if id(node) in seen:
                return _shared_contributions(value)
            seen.add(id(node))
            stack.append(node.b)
            stack.append(node.a)
        else:
            leaves[node] = leaves.get(node, 0) + 1
    return leaves


def _shared_contributions(value) -> dict[tuple[int, int], int]:
    """contributions() of a value whose nodes are shared: linear in the DAG."""
    # Order the DAG parents-before-children, then push multiplicities down.
    order, seen, stack = [], set(), [(value, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for child in (node.a, node.b):
            if type(child) is Sum and id(child) not in seen:
                stack.append((child, False))
    mult = defaultdict(int)
    mult[id(value)] = 1
    leaves: dict = defaultdict(int)
    for node in reversed(order):
        m = mult[id(node)]
        for child in (node.a, node.b):
            if type(child) is Sum:
                mult[id(child)] += m
            else:
                leaves[child] += m
    return dict(leaves)


@dataclass(frozen=True)
class Report:
    """What a successful verification checked."""

    name: str
    collective: str
    num_ranks: int
    ops: int
    chunk_ops: int
    output_chunks: int
    seconds: float

    def to_dict(self) -> dict:
        return {"algorithm": self.name, "collective": self.collective, "ranks": self.num_ranks,
                "ops": self.ops, "chunk_ops": self.chunk_ops, "output_chunks": self.output_chunks,
                "seconds": round(self.seconds, 6), "verified": True}


# From this many operations verify() first tries the bulk fast path
# (msc.verification.program_verifier_fast); below, reading the trace into arrays costs more than it saves.
BULK_FROM_OPS = 20_000


@pause_gc
def verify(program) -> Report:
    """Check that every output chunk of every rank holds exactly what the
    program's collective requires. Raises ``VerificationError`` naming the
    rank, buffer, index, expected and found contributions and the user's
    line that last wrote the chunk (or that read a chunk nothing wrote)."""
    start = time.perf_counter()
    fast = None
    count = _op_count(program)
    if count >= BULK_FROM_OPS and not getattr(program, "has_switch", False):
        # numpy: not for small programs (the command line stays light)
        from msc.verification import program_verifier_fast

        fast = program_verifier_fast.checked_outputs(program)
    if fast is None or crosscheck.ENABLED:
        try:
            outputs = _run(program)
        except VerificationError as err:
            if fast is not None:
                raise AssertionError(f"msc.verification.program_verifier_fast accepted a program verify rejects: "
                                     f"{err}") from err
            raise
        if fast is not None and fast != outputs:
            raise AssertionError(f"msc.verification.program_verifier_fast checked {fast} outputs, verify {outputs}")
    else:
        outputs = fast
    return Report(program.name, program.layout.name, program.layout.num_ranks, count,
                  program.chunk_ops(), outputs, time.perf_counter() - start)


def _op_count(program) -> int:
    """len(program.ops), without building a traced program's Op tuples (msc.dsl.program.Program.num_ops)."""
    count = getattr(program, "num_ops", None)
    return count if type(count) is int else len(program.ops)


def _run(program) -> int:
    """verify() one operation at a time, in Python: the definition, and the
    words of every error. Returns the number of output chunks checked."""
    state, writer = _initial_state(program.layout)
    _execute(program.ops, state, writer)
    return _check_outputs(program, state, writer)


def _initial_state(layout) -> tuple[list[dict[str, list]], list[dict[str, list]]]:
    """Per rank and physical buffer: each chunk's symbolic value (its
    initial label, None where it starts empty) and its last writer (-1:
    none yet)."""
    state: list[dict[str, list]] = []
    writer: list[dict[str, list]] = []
    for rank in range(layout.num_ranks):
        bufs = {b: [None] * size for b, size in layout.physical_sizes.items()}
        buf, off, labels = layout.initial_labels(rank)       # None where a chunk starts empty: as is
        bufs[buf][off:off + len(labels)] = labels
        state.append(bufs)
        writer.append({b: [-1] * size for b, size in layout.physical_sizes.items()})
    return state, writer


def _execute(ops, state: list[dict[str, list]], writer: list[dict[str, list]]) -> None:
    """Run ``ops`` on the symbolic ``state``, recording in ``writer`` the op
    that last wrote each chunk; a read of an empty chunk is an error."""
    COPY = OpKind.COPY
    for opi, op in enumerate(ops):
        if op.group:
            _switch(opi, op, state, writer)
            continue
        kind, sr, sb, si, dr, db, di, size = op[:8]
        src = state[sr].get(sb)
        if src is None or len(src) < si + size:
            _unwritten(op, sr, sb, si if src is None else max(si, len(src)))
        dst, wr = _destination(state, writer, dr, db, di + size)
        for lane in range(size):
            value = src[si + lane]
            if value is None:
                _unwritten(op, sr, sb, si + lane)
            if kind is COPY:
                dst[di + lane] = value
            else:
                old = dst[di + lane]
                if old is None:
                    _unwritten(op, dr, db, di + lane)
                dst[di + lane] = Sum(old, value)
            wr[di + lane] = opi


def _switch(opi: int, op, state, writer) -> None:
    """A switch op (msc.dsl.switch): the members' copies reduced in member
    order; every value is read before any is written."""
    kind, sr, sb, si, dr, db, di, size = op[:8]
    if kind is OpKind.SWITCH_STORE:
        values = [_value(op, state, sr, sb, si + lane) for lane in range(size)]
    else:
        values = []
        for lane in range(size):
            acc = None
            for m in op.group:
                v = _value(op, state, m, sb, si + lane)
                acc = v if acc is None else Sum(acc, v)
            values.append(acc)
    for m in (dr,) if kind is OpKind.SWITCH_REDUCE else op.group:
        dst, wr = _destination(state, writer, m, db, di + size)
        dst[di:di + size] = values
        wr[di:di + size] = [opi] * size


def _destination(state, writer, rank: int, buffer: str, end: int) -> tuple[list, list]:
    """The chunks of ``buffer`` on ``rank`` and their writers, grown to ``end``
    chunks (a scratch buffer grows as it is written)."""
    dst = state[rank].get(buffer)
    if dst is None:
        dst = state[rank][buffer] = []
        writer[rank][buffer] = []
    wr = writer[rank][buffer]
    if len(dst) < end:
        grow = end - len(dst)
        dst.extend([None] * grow)
        wr.extend([-1] * grow)
    return dst, wr


def _value(op, state, rank: int, buffer: str, index: int):
    """Chunk ``index`` of ``buffer`` on ``rank``; an error where nothing wrote it."""
    chunks = state[rank].get(buffer)
    if chunks is None or index >= len(chunks) or chunks[index] is None:
        _unwritten(op, rank, buffer, index)
    return chunks[index]


def _check_outputs(program, state: list[dict[str, list]], writer: list[dict[str, list]]) -> int:
    """Check every expected output chunk of the final ``state``; returns how
    many there are. Contributions are counted once per distinct (value,
    expectation)."""
    layout = program.layout
    checked: dict[tuple[int, int], bool] = {}
    outputs = 0
    for rank in range(layout.num_ranks):
        buf, off, wanted = layout.expected_list(rank)
        for index, expected in enumerate(wanted):
            if expected is None:
                continue
            pidx = off + index
            outputs += 1
            value = state[rank][buf][pidx]
            if value is None:
                raise VerificationError(
                    f"rank {rank} output[{index}] was never written",
                    rank=rank, buffer="output", index=index,
                    expected=describe_multiset(expected.counts), found="nothing (never written)")
            if value is expected.single:
                continue
            if type(value) is not Sum:
                if expected.single is not None and value == expected.single:
                    continue
                _mismatch(program, rank, index, buf, pidx, expected, {value: 1}, writer)
            key = (id(value), id(expected))
            if key in checked:
                continue
            found = contributions(value)
            if found != expected.counts:
                _mismatch(program, rank, index, buf, pidx, expected, found, writer)
            checked[key] = True
    return outputs


def _unwritten(op, rank: int, buffer: str, index: int):
    raise VerificationError(
        f"{op.describe()} reads rank {rank} {buffer}[{index}], which nothing has written",
        rank=rank, buffer=buffer, index=index, where=op.where)


def _mismatch(program, rank, index, buf, pidx, expected, found, writer):
    opi = writer[rank][buf][pidx]
    where, how = None, "it still holds its initial value"
    if opi >= 0:
        op = program.ops[opi]
        where, how = op.where, f"last written by {program.describe_op(opi)}"
    raise contribution_error(rank, index, expected.counts, found, how, where)


def contribution_error(rank: int, index: int, want: dict, found: dict, how: str, where) -> VerificationError:
    """The error for an output chunk holding the wrong multiset: what is
    missing, duplicated and foreign, and what last wrote it (``how``)."""
    missing = {k: c - found.get(k, 0) for k, c in want.items() if found.get(k, 0) < c}
    extra = {k: c - want[k] for k, c in found.items() if k in want and c > want[k]}
    foreign = {k: c for k, c in found.items() if k not in want}
    parts = []
    if missing:
        parts.append(f"missing {describe_multiset(missing)}")
    if extra:
        parts.append(f"duplicated {describe_multiset(extra)}")
    if foreign:
        parts.append(f"foreign {describe_multiset(foreign)}")
    return VerificationError(
        f"rank {rank} output[{index}] holds the wrong contributions ({how})",
        rank=rank, buffer="output", index=index, expected=describe_multiset(want),
        found=f"{describe_multiset(found)}: " + "; ".join(parts), where=where)
