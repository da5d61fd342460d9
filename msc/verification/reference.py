"""What each built-in collective must produce, computed directly with numpy
from the per-rank inputs, independent of any plan; and the comparison that
counts wrong elements.

Inputs are per-rank *logical* 1-D arrays of one dtype: E elements
(allreduce, allgather, broadcast, reduce) or n units of E (reducescatter,
alltoall). The reduction is computed more accurately than any plan does:
  - floats: in float64, then rounded once to the dtype (float64 itself is
    reduced in float64, in rank order);
  - integers: modulo 2**64 in uint64, then truncated to the dtype: the same
    wrap-around result a GPU gets in any order, since + and * modulo 2**b
    are associative and commutative;
  - max/min: exact in the dtype;
  - avg: the sum divided by n: floats rounded once from float64, integers
    truncated toward zero.

Tolerances (``tolerance``). Data movement (allgather, alltoall,
broadcast), max/min, and every integer result must be exact. Sums,
products and averages of floats may differ from the reference by the
rounding of a different reduction order: summing n values in any order (any
tree) errs by at most (n-1)*u*sum|x_i| (u: unit roundoff, 2**-24 float32,
2**-11 float16, 2**-8 bfloat16, 2**-53 float64), a product by (n-1)*u*|p|;
the reference adds one rounding, avg one more. So an element is right when
|actual - expected| <= (n + 2) * u * scale, with scale = sum|x_i| (avg: /n)
or |expected| for prod; for float64 the bound is doubled, as the reference
itself rounds n-1 times. With inputs in [1, 2) a contribution missing from a
sum of n (at least 1/(2n) of it) is still caught: (n + 2) * u < 1/(2n) for
n <= 8 even in bfloat16.
"""
from __future__ import annotations

import numpy as np

from msc.dsl.collectives import COLLECTIVE_NAMES as COLLECTIVES, REDUCING, Arrays, collective_spec
from msc.errors import UsageError
from msc.ir.ops import REDUCE_OP_NAMES, REDUCE_OPS, reduce_op
from msc.units import chunk_bounds, is_floating

OPS = REDUCE_OP_NAMES
# by dtype name: importing ml_dtypes (for bfloat16) costs a command 0.7 CPU-s, and a bfloat16 array
# exists only where it was imported
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def random_inputs(rng, dtype: np.dtype, op: str, nranks: int, length: int) -> list[np.ndarray]:
    """Seeded random inputs that are never zero: floats uniform in [1, 2);
    for integers a random sign (unsigned: none) times 1..7, or 1..3 for
    prod, so sums and products stay small (and where they do wrap, the
    reference wraps the same way)."""
    out = []
    for _ in range(nranks):
        if is_floating(dtype):
            out.append(rng.uniform(1.0, 2.0, length).astype(dtype))
            continue
        x = rng.integers(1, 4 if op == "prod" else 8, length)
        if dtype.kind == "i":
            x = x * rng.choice(np.array([-1, 1]), length)
        out.append(x.astype(dtype))
    return out


def _is_int(dtype) -> bool:
    return np.dtype(dtype).kind in "iu"


def reduce_ranks(stack: np.ndarray, op: str) -> np.ndarray:
    """``op`` over axis 0 (the ranks) of an (n, L) array, in its dtype."""
    dtype, n = stack.dtype, stack.shape[0]
    spec = reduce_op(op)
    ufunc = getattr(np, spec.numpy)
    if spec.exact:
        return ufunc.reduce(stack, axis=0)
    if _is_int(dtype):
        total = ufunc.reduce(stack.astype(np.uint64), axis=0, dtype=np.uint64).astype(dtype)
        if not spec.average:
            return total
        # truncation toward zero through the magnitude (|INT64_MIN| is right as a uint64)
        mag = np.abs(total.astype(np.int64)).astype(np.uint64) // np.uint64(n)
        signed = mag.astype(np.int64)
        return np.where(total < 0, -signed, signed).astype(dtype)
    total = ufunc.reduce(stack.astype(np.float64), axis=0)
    if spec.average:
        total = total / n
    return total.astype(dtype)


def expected_outputs(collective: str, inputs: list[np.ndarray], *, op: str = "sum",
                     root: int = 0) -> list[np.ndarray | None]:
    """Per rank, the logical output the collective must produce (None: not
    specified, reduce's non-root ranks): its registry row's reference, in numpy."""
    n = len(inputs)
    if n < 1:
        raise UsageError("no inputs")
    xs = [np.asarray(x) for x in inputs]
    if any(x.ndim != 1 or x.dtype != xs[0].dtype or x.size != xs[0].size for x in xs):
        raise UsageError("inputs must be 1-D arrays of one dtype and length")
    spec = collective_spec(collective, refusal="no reference for collective")
    if spec.has_root and not 0 <= root < n:
        raise UsageError(f"root {root} is not a rank (0..{n - 1})")
    arrays = Arrays(xs, root, np.stack, np.concatenate, lambda stack: reduce_ranks(stack, op))
    return [None if out is None else np.array(out, copy=True) for out in spec.reference(arrays)]


def _tiny(dtype: np.dtype) -> float:
    """The smallest normal number of a float type (numpy's own, or bfloat16's from ml_dtypes)."""
    if dtype.name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).tiny)
    return float(np.finfo(dtype).tiny)


def tolerance(dtype, nranks: int, op: str, collective: str) -> float:
    """Relative tolerance (of ``scale``, see the module doc); 0: exact."""
    dtype = np.dtype(dtype)
    if collective not in REDUCING or op in OPS and REDUCE_OPS[op].exact or _is_int(dtype):
        return 0.0
    u = UNIT_ROUNDOFF[dtype.name]
    return (nranks + 2) * u * (2 if dtype == np.float64 else 1)


def _scales(collective, inputs, op, root):
    """Per rank, the magnitude errors scale with (None where exact)."""
    if op == "prod":
        return None                                    # relative to |expected|
    mags = [np.abs(np.asarray(x).astype(np.float64)) for x in inputs]
    return expected_outputs(collective, mags, op="avg" if op == "avg" else "sum", root=root)


def count_wrong(actual: list[np.ndarray | None], expected: list[np.ndarray | None], *, rtol: float = 0.0,
                scale: list[np.ndarray | None] | None = None) -> list[int]:
    """Wrong elements per rank. Exact when ``rtol`` is 0; otherwise right
    when |a - e| <= rtol * scale (default scale |e|). Ranks whose expected
    output is None are not checked (0). A missing or mis-sized output counts
    every expected element wrong."""
    wrong = []
    for r, (a, e) in enumerate(zip(actual, expected)):
        if e is None:
            wrong.append(0)
            continue
        if a is None or np.asarray(a).shape != e.shape:
            wrong.append(int(e.size))
            continue
        a = np.asarray(a)
        if rtol == 0.0:
            wrong.append(int(np.count_nonzero(a != e)))
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        s = np.abs(e64) if scale is None or scale[r] is None else np.asarray(scale[r], np.float64)
        tiny = _tiny(e.dtype)                           # slack for results near underflow
        ok = (a64 == e64) | (np.abs(a64 - e64) <= rtol * s + tiny)
        wrong.append(int(e.size - np.count_nonzero(ok)))
    return wrong


def check(collective: str, inputs: list[np.ndarray], outputs: list[np.ndarray | None], *, op: str = "sum",
          root: int = 0) -> list[int]:
    """Wrong elements per rank of ``outputs`` for this collective, op and
    inputs, with the tolerance of the module doc."""
    expected = expected_outputs(collective, inputs, op=op, root=root)
    dtype = np.asarray(inputs[0]).dtype
    rtol = tolerance(dtype, len(inputs), op, collective)
    scale = _scales(collective, inputs, op, root) if rtol else None
    return count_wrong(outputs, expected, rtol=rtol, scale=scale)


def check_stated(collective, inputs: list[np.ndarray], outputs: list[np.ndarray | None], *, k: int, count: int,
                 op: str = "sum", root: int = 0) -> list[int]:
    """Wrong elements per rank for any collective, custom ones included,
    straight from its pre- and postcondition: output chunk i of rank r must
    equal ``op`` over the input chunks its labels name (a label twice: taken
    twice; one label: copied, exact); chunks that may hold anything are not
    checked. Floats within the tolerance of a sum of that many terms."""
    n = len(inputs)
    xs = [np.asarray(x) for x in inputs]
    source = _label_sources(collective, xs, n, k, count, root)
    expected, scales, terms = [], [], 1
    for r in range(n):
        out = None if outputs[r] is None else np.asarray(outputs[r])
        want = np.array(out if out is not None else np.zeros(0, xs[0].dtype), copy=True)
        scale = np.zeros(want.shape, np.float64)
        posts = collective.postconditions(r, n, k, root)
        if out is None and any(e is not None for e in posts):
            expected.append(np.zeros(0, xs[0].dtype))          # an output is required: all of it is wrong
            scales.append(None)
            continue
        for i, e in enumerate(posts):
            if e is None:
                continue
            lo, hi = chunk_bounds(i, count, k)
            parts = [source[label] for label, times in e.counts.items() for _ in range(times)]
            if not parts:
                raise UsageError(f"{collective.name}: output {i} of rank {r} must hold nothing; msc run cannot "
                                 f"check a value for it")
            if any(p.size != hi - lo for p in parts):
                raise UsageError(f"{collective.name}: output {i} of rank {r} is {hi - lo} elements at count {count}, "
                                 f"its inputs differ in length: pick a count divisible by the chunk factor {k}")
            want[lo:hi] = parts[0] if len(parts) == 1 else reduce_ranks(np.stack(parts), op)
            scale[lo:hi] = np.abs(np.stack(parts).astype(np.float64)).sum(axis=0) / (len(parts) if op == "avg" else 1)
            terms = max(terms, len(parts))
        expected.append(want if out is not None else None)
        scales.append(scale)
    dtype = xs[0].dtype
    reduces = terms > 1
    rtol = 0.0 if not reduces or (op in OPS and REDUCE_OPS[op].exact) or _is_int(dtype) else \
        (terms + 2) * UNIT_ROUNDOFF[np.dtype(dtype).name] * (2 if dtype == np.float64 else 1)
    return count_wrong(outputs, expected, rtol=rtol, scale=None if op == "prod" or not rtol else scales)


def _label_sources(collective, xs, n: int, k: int, count: int, root: int) -> dict:
    """label -> the elements of the input chunk that starts with it."""
    chunks = collective.input_chunks(n, k)
    source = {}
    for r in range(n):
        for i in range(chunks):
            label = collective.precondition(r, i, n, k, root)
            if label is not None:
                lo, hi = chunk_bounds(i, count, k)
                source[label] = xs[r][lo:hi]
    return source
