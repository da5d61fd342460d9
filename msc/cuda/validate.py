"""Checking a call of the CUDA runtime before anything launches.

Pure functions over tensor *descriptions* (dtype, device, element count,
contiguity, address), so every check runs on CPU tensors or fakes in tests.
A bad call raises UsageError naming the rank and the tensor.

Call forms. Tensors are the ranks' *logical* buffers, one per rank the call
covers (every rank for the virtual and devices placements; the local one
under torchrun). A plan compiled out of place takes ``inputs`` and
``outputs``. A plan compiled in place runs on one physical buffer per rank
(msc.dsl.collectives layouts): the input for allreduce, broadcast, reduce,
alltoall and reducescatter (whose output is unit ``rank`` of it), the
output for allgather (whose input is unit ``rank`` of it); the other
argument may be left out, or given as exactly that alias (same memory).
"""
from __future__ import annotations

from dataclasses import dataclass

from msc.dsl.collectives import REDUCING, get_collective
from msc.cuda.codegen import DTYPES
from msc.cuda.tables import UserBuffers
from msc.errors import UsageError
from msc.ir import Plan
from msc.ir.ops import kernel_op_problem, reduce_op


@dataclass(frozen=True)
class TensorDesc:
    """What validation needs to know about a tensor."""

    dtype: str                 # "float32", "bfloat16", ... (torch's name without "torch.")
    device: str                # "cuda:0", "cpu"
    numel: int
    contiguous: bool = True
    ptr: int = 0
    itemsize: int = 0


def describe(t) -> TensorDesc:
    """A torch tensor's description (duck-typed: no torch import here)."""
    return TensorDesc(str(t.dtype).removeprefix("torch."), str(t.device), int(t.numel()), bool(t.is_contiguous()),
                      int(t.data_ptr()), int(t.element_size()))


@dataclass(frozen=True)
class CallSpec:
    """A checked call: the element count per unit, dtype, op (normalized:
    data-movement collectives always use the "sum" kernel), and per rank of
    the call its physical buffer addresses."""

    count: int
    dtype: str
    op: str
    buffers: tuple[UserBuffers, ...]


def units(plan: Plan) -> tuple[int, int]:
    """Data units of the logical input and output buffers."""
    k = plan.chunk_factor
    for name, chunks in (("input", plan.input_chunks), ("output", plan.output_chunks)):
        if chunks % k:
            raise UsageError(f"plan {plan.name!r}: its {name} of {chunks} chunks is not whole units of {k} chunks; "
                             f"the CUDA runtime runs collectives whose buffers are whole units")
    return plan.input_chunks // k, plan.output_chunks // k


def check_op(plan: Plan, op: str, dtype: str | None = None) -> str:
    """The kernel op for ``op`` on this plan's collective."""
    reduce_op(op)
    if not _reduces(plan):
        return "sum"                                # no reduction happens: one kernel serves every op
    problem = None if dtype is None else kernel_op_problem(op, dtype, dtype in DTYPES and DTYPES[dtype].floating)
    if problem:
        raise UsageError(problem)
    return op


def _reduces(plan: Plan) -> bool:
    """Whether the plan combines values: a reducing built-in, or a custom
    collective's plan with a reducing step."""
    if plan.collective in REDUCING:
        return True
    if plan.contract is None:
        return False
    return any(step.op.reduces for _, _, _, step in plan.steps())


def check_collective(plan: Plan, wanted: str) -> None:
    """A convenience call (all_reduce, ...) must match the plan's collective."""
    if plan.collective != wanted:
        raise UsageError(f"plan {plan.name!r} is a {plan.collective} plan; this call is {wanted} "
                         f"(use run(), or a communicator for a {wanted} plan)")


def _check_tensor(d: TensorDesc, rank: int, what: str, device: str) -> None:
    where = f"rank {rank} {what}"
    if d.dtype not in DTYPES:
        raise UsageError(f"{where}: dtype {d.dtype} is not one the CUDA kernels take ({', '.join(DTYPES)})")
    if d.device != device:
        raise UsageError(f"{where}: tensor is on {d.device}, expected {device} (rank {rank}'s GPU)")
    if not d.contiguous:
        raise UsageError(f"{where}: tensor is not contiguous; call .contiguous() first")


def _list(xs, what: str, ranks: tuple[int, ...]) -> list | None:
    if xs is None:
        return None
    xs = list(xs)
    if len(xs) != len(ranks):
        raise UsageError(f"{what}: {len(xs)} tensor(s) for {len(ranks)} rank(s) (one per rank: "
                         f"{', '.join(map(str, ranks))})")
    return xs


def _overlap(a: TensorDesc, b: TensorDesc) -> bool:
    size = a.itemsize or DTYPES[a.dtype].size
    return a.numel > 0 and b.numel > 0 and a.ptr < b.ptr + b.numel * size and b.ptr < a.ptr + a.numel * size


def check_call(plan: Plan, inputs, outputs, *, op: str, ranks: tuple[int, ...], devices: tuple[str, ...],
               collective=None) -> CallSpec:
    """Check a call (see the module doc); ``inputs``/``outputs``: a
    TensorDesc per rank of ``ranks`` (or None), ``devices``: each rank's
    expected device ("cuda:3")."""
    from msc.verification.plan import plan_collective

    coll = plan_collective(plan, collective)
    n, k = plan.num_ranks, plan.chunk_factor
    in_units, out_units = units(plan)
    ins, outs = _list(inputs, "inputs", ranks), _list(outputs, "outputs", ranks)
    if plan.inplace:
        alias, target, _ = coll.inplace_alias(0, n, k)
        tensors = {"input": ins, "output": outs}
        main = tensors[target]
        if main is None:
            raise UsageError(f"plan {plan.name!r} runs {coll.name} in place on each rank's {target} buffer: "
                             f"pass the {target}s" + (" (each rank's input is unit `rank` of its output)"
                                                      if target == "output" else ""))
        whole = {"input": in_units, "output": out_units}[target]
        part = {"input": in_units, "output": out_units}[alias]
        count = _count(main, ranks, target, whole, coll.name, n, devices)
        dtype = main[0].dtype
        other = tensors[alias]
        if other is not None:
            for i, r in enumerate(ranks):
                offset = coll.inplace_alias(r, n, k)[2] // k
                d, t = other[i], main[i]
                size = t.itemsize or DTYPES[t.dtype].size
                if d is None or d.ptr != t.ptr + offset * count * size or d.numel != part * count \
                        or d.dtype != t.dtype:
                    raise UsageError(f"rank {r} {alias}: plan {plan.name!r} runs in place, so the {alias} must be "
                                     f"unit {offset} of the {target} ({part * count} elements at element "
                                     f"{offset * count}) or left out; compile the plan out of place for separate "
                                     f"buffers")
        buffers = tuple(UserBuffers(t.ptr, t.ptr) for t in main)
    else:
        if ins is None or outs is None:
            raise UsageError(f"plan {plan.name!r} runs out of place: pass inputs and outputs")
        count = _count(ins, ranks, "input", in_units, coll.name, n, devices)
        dtype = ins[0].dtype
        for i, r in enumerate(ranks):
            d = outs[i]
            _check_tensor(d, r, "output", devices[i])
            if d.dtype != dtype:
                raise UsageError(f"rank {r} output: dtype {d.dtype}, the inputs are {dtype}")
            if d.numel != out_units * count:
                raise UsageError(f"rank {r} output: {d.numel} elements, expected {out_units * count} "
                                 f"({out_units} unit(s) of {count}: {coll.name} over {n} ranks)")
            if _overlap(ins[i], d):
                raise UsageError(f"rank {r}: input and output overlap; an out-of-place plan needs separate buffers")
        buffers = tuple(UserBuffers(a.ptr, b.ptr) for a, b in zip(ins, outs))
    return CallSpec(count, dtype, check_op(plan, op, dtype), buffers)


def _count(descs, ranks, what: str, nunits: int, name: str, n: int, devices) -> int:
    """Elements per unit, from every rank's ``what`` tensor (which must agree)."""
    count = None
    first = None
    for i, r in enumerate(ranks):
        d = descs[i]
        if d is None:
            raise UsageError(f"rank {r} {what}: missing (None)")
        _check_tensor(d, r, what, devices[i])
        if first is not None and d.dtype != first.dtype:
            raise UsageError(f"rank {r} {what}: dtype {d.dtype}, rank {ranks[0]}'s is {first.dtype}")
        if d.numel % nunits:
            raise UsageError(f"rank {r} {what}: {d.numel} elements is not {nunits} equal units "
                             f"({name} over {n} ranks: the {what} holds {nunits} unit(s) of `count` elements)")
        c = d.numel // nunits
        if count is not None and c != count:
            raise UsageError(f"rank {r} {what}: {d.numel} elements, rank {ranks[0]} has {first.numel}; every rank "
                             f"must pass the same size")
        count, first = c, first or d
    return count
