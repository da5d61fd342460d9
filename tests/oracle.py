"""A numeric oracle for traced programs, independent of msc's verifier.

It runs a program's ops on random integers (mod a large prime) instead of
symbolic labels, then compares every output chunk with the number the
collective requires. Two different multisets of contributions sum to the
same value with probability about 1/P, so agreement by accident is
negligible.

The physical layout of the built-in collectives (which logical chunk lives
where in the in-place forms) and what their outputs must hold are written
out here again on purpose, from the collective's definition, rather than
taken from ``msc.dsl.collectives``: the oracle must not share the code it
checks. Custom collectives are described by the user's own pre- and
postcondition, which the oracle calls.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import msc
from msc.ir import OpKind

P = (1 << 61) - 1  # a Mersenne prime

# Chunks per rank of the logical input and output buffers, given n and k.
_SIZES = {
    "allreduce": (lambda n, k: k, lambda n, k: k),
    "allgather": (lambda n, k: k, lambda n, k: n * k),
    "reducescatter": (lambda n, k: n * k, lambda n, k: k),
    "alltoall": (lambda n, k: n * k, lambda n, k: n * k),
    "broadcast": (lambda n, k: k, lambda n, k: k),
    "reduce": (lambda n, k: k, lambda n, k: k),
    "gather": (lambda n, k: k, lambda n, k: n * k),
    "scatter": (lambda n, k: n * k, lambda n, k: k),
}


@dataclass(frozen=True)
class Spec:
    """A collective instance: name, ranks, chunk factor, form and root."""

    collective: object  # the msc Collective (used only for custom ones)
    n: int
    k: int
    inplace: bool
    root: int = 0

    @property
    def name(self) -> str:
        return self.collective.name

    @property
    def builtin(self) -> bool:
        # by kind, not by name: a custom collective may be called "gather" and mean its own postcondition
        return self.name in _SIZES and not isinstance(self.collective, msc.CustomCollective)

    @property
    def kind(self) -> str:
        """The built-in's name, or "custom" (whatever a custom collective is called)."""
        return self.name if self.builtin else "custom"

    def logical_sizes(self) -> tuple[int, int]:
        if self.builtin:
            size_in, size_out = _SIZES[self.name]
            return size_in(self.n, self.k), size_out(self.n, self.k)
        return self.collective.input_chunks(self.n, self.k), self.collective.output_chunks(self.n, self.k)

    def physical_sizes(self) -> dict[str, int]:
        size_in, size_out = self.logical_sizes()
        if not self.inplace:
            return {"input": size_in, "output": size_out}
        if self.kind in ("allgather", "gather"):
            return {"output": size_out}
        return {"input": size_in}

    def locate(self, rank: int, buffer: str, index: int) -> tuple[str, int]:
        """Physical (buffer, index) of logical chunk ``buffer[index]`` of ``rank``."""
        if not self.inplace or buffer not in ("input", "output"):
            return buffer, index
        if self.kind in ("allgather", "gather"):
            return ("output", rank * self.k + index) if buffer == "input" else (buffer, index)
        if self.kind in ("reducescatter", "scatter"):
            return ("input", rank * self.k + index) if buffer == "output" else (buffer, index)
        if not self.builtin:
            alias, target, offset = self.collective.inplace_alias(rank, self.n, self.k)
            return (target, offset + index) if buffer == alias else (buffer, index)
        return "input", index  # allreduce, alltoall, broadcast, reduce: output is input

    def initial_label(self, rank: int, index: int):
        """The label input chunk ``index`` of ``rank`` starts as (None: empty)."""
        if self.builtin:
            return (rank, index)
        return self.collective.precondition(rank, index, self.n, self.k, self.root)

    def required(self, rank: int, index: int, value) -> int | None:
        """The number output chunk ``index`` of ``rank`` must hold; None: anything.
        ``value(label)`` is the number input chunk ``label`` started with."""
        n, k, name = self.n, self.k, self.kind
        if name == "allreduce":
            return sum(value((r, index)) for r in range(n)) % P
        if name == "allgather":
            return value((index // k, index % k))
        if name == "reducescatter":
            return sum(value((r, rank * k + index)) for r in range(n)) % P
        if name == "alltoall":
            return value((index // k, rank * k + index % k))
        if name == "broadcast":
            return value((self.root, index))
        if name == "reduce":
            return sum(value((r, index)) for r in range(n)) % P if rank == self.root else None
        if name == "gather":
            return value((index // k, index % k)) if rank == self.root else None
        if name == "scatter":
            return value((self.root, rank * k + index))
        expected = self.collective.postcondition(rank, index, n, k, self.root)
        if expected is None:
            return None
        return sum(value(label) * count for label, count in expected.counts.items()) % P


def spec_of(program) -> Spec:
    layout = program.layout
    return Spec(layout.collective, layout.num_ranks, layout.chunk_factor, layout.inplace, layout.root)


@dataclass
class Outcome:
    """What the numeric run found.

    ``unwritten``: for the first op that reads a chunk nothing wrote (a
    reduce also reads its destination), ``(op index, {(rank, buffer,
    index), ...})``. ``wrong``: output chunks ``(rank, logical index)`` that
    do not hold what the collective requires, in rank then index order.
    """

    unwritten: tuple[int, frozenset] | None = None
    wrong: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.unwritten is None and not self.wrong


def run(program, ops=None, seed: int = 0) -> Outcome:
    """Evaluate ``ops`` (default: the program's) numerically and judge the outputs."""
    spec = spec_of(program)
    ops = program.ops if ops is None else ops
    rng = random.Random(seed)
    numbers: dict = {}

    def value(label):
        if label not in numbers:
            numbers[label] = rng.getrandbits(62) % P
        return numbers[label]

    size_in, size_out = spec.logical_sizes()
    memory: dict[tuple[int, str], list] = {}
    for rank in range(spec.n):
        for buf, size in spec.physical_sizes().items():
            memory[rank, buf] = [None] * size
        for i in range(size_in):
            label = spec.initial_label(rank, i)
            if label is not None:
                buf, at = spec.locate(rank, "input", i)
                memory[rank, buf][at] = value(label)

    for opi, op in enumerate(ops):
        if op.group:
            missing = _switch(op, memory)
            if missing:
                return Outcome(unwritten=(opi, frozenset(missing)))
            continue
        src = memory.get((op.src_rank, op.src_buffer), [])
        dst = memory.setdefault((op.dst_rank, op.dst_buffer), [])
        reads = [src[op.src_index + j] if op.src_index + j < len(src) else None for j in range(op.size)]
        missing = {(op.src_rank, op.src_buffer, op.src_index + j) for j in range(op.size) if reads[j] is None}
        if op.kind is OpKind.REDUCE:
            missing |= {(op.dst_rank, op.dst_buffer, op.dst_index + j) for j in range(op.size)
                        if op.dst_index + j >= len(dst) or dst[op.dst_index + j] is None}
        if missing:
            return Outcome(unwritten=(opi, frozenset(missing)))
        if len(dst) < op.dst_index + op.size:
            dst.extend([None] * (op.dst_index + op.size - len(dst)))
        for j, v in enumerate(reads):
            at = op.dst_index + j
            dst[at] = v if op.kind is OpKind.COPY else (dst[at] + v) % P

    wrong = []
    for rank in range(spec.n):
        for i in range(size_out):
            want = spec.required(rank, i, value)
            if want is None:
                continue
            buf, at = spec.locate(rank, "output", i)
            chunks = memory[rank, buf]
            if at >= len(chunks) or chunks[at] != want:
                wrong.append((rank, i))
    return Outcome(wrong=wrong)


def _switch(op, memory) -> set:
    """A switch op (NVLS): the sum over the group's members of their chunks,
    or one rank's chunks, written to the group's members or to one rank.
    Returns the chunks it would read that nothing has written."""
    readers = (op.src_rank,) if op.kind is OpKind.SWITCH_STORE else op.group
    writers = (op.src_rank,) if op.kind is OpKind.SWITCH_REDUCE else op.group
    missing, sums = set(), []
    for j in range(op.size):
        total = 0
        for m in readers:
            chunks = memory.get((m, op.src_buffer), [])
            at = op.src_index + j
            if at >= len(chunks) or chunks[at] is None:
                missing.add((m, op.src_buffer, at))
            else:
                total = (total + chunks[at]) % P
        sums.append(total)
    if missing:
        return missing
    for m in writers:
        dst = memory.setdefault((m, op.dst_buffer), [])
        if len(dst) < op.dst_index + op.size:
            dst.extend([None] * (op.dst_index + op.size - len(dst)))
        dst[op.dst_index:op.dst_index + op.size] = sums
    return missing


def agrees(program, outcome: Outcome, error) -> str | None:
    """Whether the verifier's verdict (``error``: the VerificationError it
    raised, or None) agrees with the oracle's ``outcome``; None if it does,
    else a description of the disagreement."""
    if outcome.ok:
        return None if error is None else f"oracle: correct; verifier rejected it: {error}"
    if error is None:
        return f"oracle: {outcome}; verifier accepted it"
    if outcome.unwritten is not None:
        opi, chunks = outcome.unwritten
        if (error.rank, error.buffer, error.index) not in chunks:
            return f"oracle: op {opi} reads unwritten {sorted(chunks)}; verifier: {error}"
        if error.where != program.ops[opi].where:
            return f"oracle: op {opi} at {program.ops[opi].where}; verifier blames {error.where}"
        return None
    if (error.rank, error.buffer, error.index) != (outcome.wrong[0][0], "output", outcome.wrong[0][1]):
        return f"oracle: first wrong output {outcome.wrong[0]}; verifier: {error}"
    return None
