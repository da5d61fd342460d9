"""The reference executor: runs a plan for all ranks in one process on numpy
arrays. It is the definition of what a plan computes; every backend is
tested against it.

Execution follows the plan verifier (msc.verification.plan._Execution) with real data:
each threadblock runs its steps in order; a step waits for its dependencies
(steps of other threadblocks of its rank), for a message when it receives
and for a free slot when it sends; a connection (sender, receiver, channel)
is a FIFO holding at most ``slots`` messages. Blocked threadblocks wait on a
worklist until what they wait for happens.

Data. ``count`` (E) is the element count per data *unit* (the NCCL count).
With k = plan.chunk_factor and q = ceil(E / k), chunk p of a user buffer
(input, output) holds elements [u*E + min(c*q, E), u*E + min((c+1)*q, E))
with u = p // k, c = p % k: tail chunks are shorter or empty, so any E
works. A step reads all its operands (copies), computes, then writes; a
chunk keeps its length wherever it moves; a scratch chunk holds whatever
array was written into it. A length mismatch (reducing chunks of two
lengths, writing a chunk into a user chunk of another length) raises
ExecutionError naming rank, threadblock and step: the plan verifier's class
check should have excluded it, and nothing is silently truncated.

Reduction ops: sum, prod, max, min in the buffers' dtype, one operation
per pair of chunks as the plan orders them (integers wrap around, as on a
GPU; floats, float16 and bfloat16 included, round after every operation: no
wider accumulator). avg is sum, then, after the plan finished, every output
chunk whose postcondition asks for m >= 2 contributions (m = number of ranks
for the built-in allreduce, reducescatter and reduce at the root) is divided
by m: floats by true division rounded once to the dtype, integers truncated
toward zero. Outputs of data-movement collectives and reduce's non-root
outputs are left alone. A plan's protocol, instances and tile do not change
what it computes.

API: ``run_plan(plan, buffers, count=, op=)`` runs on physical buffers (per
rank {"input": array, "output": array}, as the collective's layout names
them; sizes from ``Executor.buffer_sizes(count)``); ``Executor`` checks a
plan once for many runs; ``run_collective(plan, inputs, op)`` takes and
returns per-rank *logical* arrays (``load_inputs``/``read_outputs``).
"""
from __future__ import annotations

import random

import numpy as np

from msc.dsl.collectives import get_collective
from msc.errors import ExecutionError, UsageError
from msc.ir import Plan, step_values
from msc.ir.ops import REDUCE_OP_NAMES, REDUCE_OPS, op_dtype_problem, reduce_op
from msc.units import buffer_elements, chunk_bounds, is_floating
from msc.verification.plan_values import check_plan
from msc.ir.worklist import Connections, drive

# by name, in native byte order (supported): importing ml_dtypes for bfloat16 costs a command 0.7 CPU-s,
# and a bfloat16 array exists only where it was imported
DTYPES = frozenset(("float64", "float32", "float16", "bfloat16", "int32", "int64", "uint8"))


def supported(dtype: np.dtype) -> bool:
    return dtype.name in DTYPES and dtype.isnative
OPS = REDUCE_OP_NAMES


def divide_truncating(x: np.ndarray, d: int) -> np.ndarray:
    """avg's final division: floats rounded once, integers toward zero."""
    if x.dtype.kind in "iu":
        wide = x.astype(np.int64)        # holds every supported integer; d may exceed uint8's range
        q = wide // d                    # floor, then one up where negative and inexact
        q += (wide < 0) & (wide % d != 0)
        return q.astype(x.dtype)
    return (x.astype(np.float64) / d).astype(x.dtype)


class Executor:
    """A plan prepared for running many times (the plan is checked once).

    ``collective``: a Collective object for plans of custom collectives.
    ``slots``: connection capacity, default plan.slots (the capacity the plan
    was verified deadlock-free with; fewer may get stuck).
    """

    def __init__(self, plan: Plan, *, collective=None, slots: int | None = None):
        check_plan(plan)
        self.plan = plan
        self.k = plan.chunk_factor
        from msc.verification.plan import plan_collective

        self.collective = plan_collective(plan, collective)
        self.layout = self.collective.layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root)
        self.capacity = plan.slots if slots is None else slots
        if type(self.capacity) is not int or self.capacity < 1:
            raise UsageError(f"slots must be an int >= 1, got {slots!r}")
        # avg's divisors: (rank, physical buffer, chunk, m) for output chunks of m >= 2 contributions
        self.averaged = [(rank, buf, index, m) for rank in range(plan.num_ranks)
                         for _, buf, index, exp in self.layout.expected(rank)
                         if exp is not None and (m := sum(exp.counts.values())) >= 2]

    def buffer_sizes(self, count: int) -> dict[str, int]:
        """Elements of every physical buffer of a rank for ``count`` elements per unit."""
        return {b: buffer_elements(c, count, self.k) for b, c in self.layout.physical_sizes.items()}

    def _check_buffers(self, buffers, count):
        n = self.plan.num_ranks
        if type(count) is not int or count < 0:
            raise UsageError(f"count must be an int >= 0 (elements per unit), got {count!r}")
        if len(buffers) != n:
            raise UsageError(f"{len(buffers)} ranks of buffers for a plan of {n} ranks")
        sizes = self.buffer_sizes(count)
        dtype = None
        for rank, bufs in enumerate(buffers):
            if set(bufs) != set(sizes):
                raise UsageError(f"rank {rank}: buffers {sorted(bufs)}, the plan's physical buffers are "
                                 f"{sorted(sizes)} ({'in' if self.plan.inplace else 'out of'} place)")
            for name, arr in bufs.items():
                where = f"rank {rank} {name}"
                if not isinstance(arr, np.ndarray) or arr.ndim != 1:
                    raise UsageError(f"{where}: expected a 1-D numpy array, got {type(arr).__name__} "
                                     f"of shape {getattr(arr, 'shape', None)}")
                if not supported(arr.dtype):
                    raise UsageError(f"{where}: unsupported dtype {arr.dtype} (supported: "
                                     f"{', '.join(sorted(str(d) for d in DTYPES))})")
                if dtype is None:
                    dtype = arr.dtype
                if arr.dtype != dtype:
                    raise UsageError(f"{where}: dtype {arr.dtype}, other buffers are {dtype}")
                if arr.size != sizes[name]:
                    raise UsageError(f"{where}: {arr.size} elements, the plan needs {sizes[name]} "
                                     f"({self.layout.physical_sizes[name]} chunks at {count} elements per "
                                     f"unit of {self.k} chunks)")
                if not arr.flags.writeable:
                    raise UsageError(f"{where}: array is read-only")

    def run(self, buffers: list[dict[str, np.ndarray]], *, count: int, op: str = "sum",
            seed: int | None = None) -> None:
        """Run the plan on ``buffers`` (per rank: physical buffer name -> flat
        array), in place. ``seed``: pick runnable threadblocks in a random
        order (results must not depend on it)."""
        spec = reduce_op(op)
        self._check_buffers(buffers, count)
        dtype = next((arr.dtype for bufs in buffers for arr in bufs.values()), None)
        problem = None if dtype is None else op_dtype_problem(op, dtype.name, is_floating(dtype))
        if problem is not None:
            raise UsageError(f"plan {self.plan.name!r}: {problem}")
        _Run(self, buffers, count, getattr(np, spec.numpy), seed).execute()
        if REDUCE_OPS[op].average:
            for rank, buf, index, m in self.averaged:
                lo, hi = chunk_bounds(index, count, self.k)
                arr = buffers[rank][buf]
                arr[lo:hi] = divide_truncating(arr[lo:hi], m)


class _Run:
    """One execution: program counters, FIFOs, scratch."""

    def __init__(self, ex: Executor, buffers, count, combine, seed):
        self.ex, self.plan, self.bufs, self.count, self.combine = ex, ex.plan, buffers, count, combine
        self.rng = random.Random(seed) if seed is not None else None
        self.scratch = [[None] * rp.scratch for rp in self.plan.ranks]
        self.pcs = [[0] * len(rp.threadblocks) for rp in self.plan.ranks]
        self.connections = Connections(self.plan, ex.capacity, self.pcs)
        self.barriers = self.connections.barriers

    def execute(self) -> None:
        drive(self.plan, self.pcs, self.connections.blocker, self._step, self.rng)
        self._check_finished()

    def _check_finished(self) -> None:
        stuck = [(rp.rank, tb.id, self.pcs[rp.rank][tb.id]) for rp in self.plan.ranks for tb in rp.threadblocks
                 if self.pcs[rp.rank][tb.id] < len(tb.steps)]
        if stuck:
            text = "; ".join(f"rank {r} threadblock {t} step {s}" for r, t, s in stuck[:8])
            r, t, s = stuck[0]
            raise ExecutionError(f"the plan is stuck with {self.ex.capacity} slot(s) per connection: {len(stuck)} "
                                 f"threadblock(s) cannot go on: {text}", rank=r, tb=t, step=s)

    def _fail(self, rank, tb, s, what, **kw):
        step = tb.steps[s]
        raise ExecutionError(f"rank {rank} threadblock {tb.id} step {s} ({step.op.value}): {what}",
                             rank=rank, tb=tb.id, step=s, where=step.where, **kw)

    def _read(self, rank, tb, s, sl, mem=None) -> list[np.ndarray]:
        """Slice ``sl`` in the memory of rank ``mem`` (default: its own)."""
        mem = rank if mem is None else mem
        if sl.buffer == "scratch":
            out = self.scratch[mem][sl.index:sl.index + sl.count]
            for j, a in enumerate(out):
                if a is None:
                    whose = "" if mem == rank else f"rank {mem} "
                    self._fail(rank, tb, s, f"reads {whose}scratch[{sl.index + j}], which nothing has written",
                               buffer="scratch", index=sl.index + j)
            return out
        arr, k, count = self.bufs[mem][sl.buffer], self.ex.k, self.count
        out = []
        for p in range(sl.index, sl.index + sl.count):
            lo, hi = chunk_bounds(p, count, k)
            out.append(arr[lo:hi].copy())     # a snapshot: the buffer may change before it is used
        return out

    def _write(self, rank, tb, s, sl, values, mem=None) -> None:
        mem = rank if mem is None else mem
        if sl.buffer == "scratch":
            # arrays are never mutated once made, so storing shares them safely
            self.scratch[mem][sl.index:sl.index + sl.count] = values
            return
        arr, k, count = self.bufs[mem][sl.buffer], self.ex.k, self.count
        for p, a in zip(range(sl.index, sl.index + sl.count), values):
            lo, hi = chunk_bounds(p, count, k)
            if hi - lo != a.size:
                into = "" if mem == rank else f"rank {mem} "
                self._fail(rank, tb, s, f"writes a chunk of {a.size} elements into {into}{sl.buffer}[{p}], which holds "
                           f"{hi - lo} at {count} elements per unit (class {p % k} of {k})",
                           buffer=sl.buffer, index=p)
            arr[lo:hi] = a

    def _reduce(self, rank, tb, s, xs, ys) -> list[np.ndarray]:
        out = []
        for j, (a, b) in enumerate(zip(xs, ys)):
            if a.size != b.size:
                self._fail(rank, tb, s, f"reduces chunks of {a.size} and {b.size} elements (operand chunk {j}); "
                           f"the plan mixes chunk classes")
            out.append(self.combine(a, b))
        return out

    def _step(self, rank, tb, s, step) -> list:
        op = step.op
        woken = []
        got = None
        if op.receives:
            fifo = self.connections.fifo_in[rank][tb.id]
            got = fifo.take()
            woken.append(fifo.space)
            if len(got) != step.count:
                self._fail(rank, tb, s, f"receives a message of {len(got)} chunks, the step takes {step.count}")
        if op.group_reads:       # the switch reduces the members' copies in member order (the CUDA kernels' too)
            srcs = [self._read(rank, tb, s, step.srcs[0], m) for m in tb.group]
        else:
            srcs = [self._read(rank, tb, s, sl) for sl in step.srcs]
        stored, out = step_values(op, srcs, got, lambda xs, ys: self._reduce(rank, tb, s, xs, ys))
        if op.group_writes:
            for m in tb.group:
                self._write(rank, tb, s, step.dst, stored, m)
        elif step.dst is not None:                    # the ops that have one (check_plan)
            self._write(rank, tb, s, step.dst, stored)
        if op.sends:
            fifo = self.connections.fifo_out[rank][tb.id]
            fifo.items.append(out)
            woken.append(fifo.msg)
        woken.extend(self.barriers.released(rank, tb))
        return woken


def run_plan(plan: Plan, buffers: list[dict[str, np.ndarray]], *, count: int, op: str = "sum",
             collective=None, slots: int | None = None, seed: int | None = None) -> None:
    """Run ``plan`` in place on physical ``buffers`` (per rank: {"input": ...,
    "output": ...}, the names of the collective's layout; flat arrays sized
    Executor.buffer_sizes(count)). Scratch is allocated here."""
    Executor(plan, collective=collective, slots=slots).run(buffers, count=count, op=op, seed=seed)


def poison(arr: np.ndarray) -> None:
    """Fill with bytes 0xA5: non-zero in every dtype and easy to spot."""
    arr.view(np.uint8)[:] = 0xA5


def logical_view(ex: Executor, buffers, rank: int, name: str, count: int) -> np.ndarray:
    """The elements of logical buffer ``name`` ("input"/"output") of ``rank``
    inside its physical buffer (a view)."""
    buf, offset = ex.layout.alias(rank, name)
    if offset % ex.k:
        raise UsageError(f"{name} of rank {rank} starts at chunk {offset} of {buf}, inside a data unit of "
                         f"{ex.k} chunks: no element range holds it")
    lo = (offset // ex.k) * count
    return buffers[rank][buf][lo:lo + buffer_elements(ex.layout.logical_sizes[name], count, ex.k)]


def load_inputs(ex: Executor, inputs: list[np.ndarray], count: int | None = None) -> tuple[list[dict], int]:
    """Physical buffers filled with poison (bytes 0xA5), each rank's logical
    input copied to where the layout puts it (in-place allgather: unit
    ``rank`` of the output buffer); and the count, taken from the input
    length unless given."""
    n = ex.plan.num_ranks
    if len(inputs) != n:
        raise UsageError(f"{len(inputs)} inputs for a plan of {n} ranks")
    arrays = [np.asarray(x) for x in inputs]
    dtype = arrays[0].dtype
    if any(a.ndim != 1 or a.dtype != dtype for a in arrays):
        raise UsageError("inputs must be 1-D arrays of one dtype")
    if not supported(dtype):
        raise UsageError(f"unsupported dtype {dtype} (supported: {', '.join(sorted(map(str, DTYPES)))})")
    if count is None:
        units = ex.layout.logical_sizes["input"] / ex.k
        if not units or arrays[0].size % units:
            raise UsageError(f"cannot tell the count from an input of {arrays[0].size} elements "
                             f"({units:g} units); pass count=")
        count = int(arrays[0].size // units)
    buffers = [{b: np.empty(size, dtype) for b, size in ex.buffer_sizes(count).items()} for _ in range(n)]
    for rank in range(n):
        for arr in buffers[rank].values():
            poison(arr)
        dst = logical_view(ex, buffers, rank, "input", count)
        if arrays[rank].size != dst.size:
            raise UsageError(f"rank {rank}: input of {arrays[rank].size} elements, the plan needs {dst.size} "
                             f"at {count} elements per unit")
        dst[:] = arrays[rank]
    return buffers, count


def read_outputs(ex: Executor, buffers, count: int) -> list[np.ndarray]:
    """Copies of every rank's logical output."""
    return [logical_view(ex, buffers, rank, "output", count).copy() for rank in range(ex.plan.num_ranks)]


def run_collective(plan: Plan, inputs: list[np.ndarray], op: str = "sum", *, count: int | None = None,
                   collective=None, seed: int | None = None) -> list[np.ndarray]:
    """Run ``plan`` on per-rank logical inputs (poisoned outputs, see
    load_inputs); return per-rank logical outputs (reduce's non-root ranks
    included, whatever they hold)."""
    ex = Executor(plan, collective=collective)
    buffers, count = load_inputs(ex, inputs, count)
    ex.run(buffers, count=count, op=op, seed=seed)
    return read_outputs(ex, buffers, count)


__all__ = ["DTYPES", "OPS", "ExecutionError", "Executor", "buffer_elements", "chunk_bounds",
           "divide_truncating", "load_inputs", "logical_view", "poison", "read_outputs", "run_collective", "run_plan"]
