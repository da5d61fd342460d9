"""Property tests.

(a) Parametrised algorithms defined here verify at every rank count 2..24
    and chunk factor 1..4, in place and out of place.
(b) The verifier agrees with an independent numeric oracle (tests/oracle.py)
    on random programs: random copies and reduces over random ranks,
    buffers (scratch included) and indices, often grafted onto a correct
    program so that both verdicts occur.
"""
from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

import msc
from msc.dsl.collectives import COLLECTIVE_NAMES, ROOTED
from msc.ir import OpKind

import oracle


# -- (a) parametrised algorithms ---------------------------------------------
@msc.algorithm("allgather", chunk_factor=lambda n, c: c)
def ring_allgather(p, c=1):
    n = p.num_ranks
    for r in range(n):
        for i in range(c):
            at = r * c + i
            ref = p.chunk(r, "input", i).copy(r, "output", at)  # no-op in place
            for step in range(1, n):
                ref = ref.copy((r + step) % n, "output", at)


@msc.algorithm("alltoall", chunk_factor=lambda n, c: c)
def allpairs_alltoall(p, c=1):
    """Every pair exchanges directly, through the receiver's scratch buffer
    so that in place no input is overwritten before it has been sent."""
    n = p.num_ranks
    for src in range(n):
        for dst in range(n):
            p.chunk(src, "input", dst * c, size=c).copy(dst, "scratch", src * c)
    for r in range(n):
        p.chunk(r, "scratch", 0, size=n * c).copy(r, "output", 0)


@msc.algorithm("reducescatter", chunk_factor=lambda n, c: c)
def ring_reducescatter(p, c=1):
    """Chunk r*c+i is summed around the ring in scratch, ending on rank r."""
    n = p.num_ranks
    for r in range(n):
        for i in range(c):
            at = r * c + i
            acc = p.chunk((r + 1) % n, "input", at)
            for step in range(2, n):
                rank = (r + step) % n
                acc = p.chunk(rank, "input", at).copy(rank, "scratch", at).reduce(acc)
            p.chunk(r, "input", at).copy(r, "output", i).reduce(acc)


@msc.algorithm("allreduce", chunk_factor=lambda n, c: n * c)
def ring_allreduce(p, c=1):
    """Reduce-scatter then allgather around the ring; chunk j starts on rank j mod n."""
    n = p.num_ranks
    for j in range(n * c):
        first = j % n
        acc = p.chunk(first, "input", j)
        for step in range(1, n):
            rank = (first + step) % n
            acc = p.chunk(rank, "input", j).copy(rank, "output", j).reduce(acc)
        for step in range(1, n):
            acc = acc.copy((first + n - 1 + step) % n, "output", j)


OUTPUT_CHUNKS = {  # output chunks per rank
    "ring_allgather": lambda n, c: n * c,
    "allpairs_alltoall": lambda n, c: n * c,
    "ring_reducescatter": lambda n, c: c,
    "ring_allreduce": lambda n, c: n * c,
}
PARAMETRISED = [ring_allgather, allpairs_alltoall, ring_reducescatter, ring_allreduce]


@settings(deadline=None, max_examples=120)
@given(alg=st.sampled_from(PARAMETRISED), n=st.integers(2, 24), c=st.integers(1, 4), inplace=st.booleans())
def test_parametrised_algorithms_verify(alg, n, c, inplace):
    program = msc.trace(alg, n, inplace=inplace, c=c)
    report = msc.verify(program)
    assert report.output_chunks == n * OUTPUT_CHUNKS[alg.name](n, c)
    assert report.ops == len(program.ops) > 0
    assert oracle.run(program).ok


# -- (b) random programs against the numeric oracle --------------------------
SEND_NEXT = msc.CustomCollective(  # cyclic: rank r ends with rank r-1's input
    "send_next", input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,
    postcondition=lambda r, i, n, k: [((r - 1) % n, i)])
WEIGHTED = msc.CustomCollective(  # allreduce with rank 0's input counted twice
    "weighted", input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,
    postcondition=lambda r, i, n, k: [(j, i) for j in range(n)] + [(0, i)])
COLLECTIVES = [*COLLECTIVE_NAMES, SEND_NEXT, WEIGHTED]          # every built-in of the registry, two custom


def correct_program(name: str, n: int, k: int, root: int) -> list:
    """A simple program, right in both forms, as logical ops
    ``(kind, (rank, buffer, index), (rank, buffer, index), size, style)``."""
    ops = []

    def copy(src, dst):
        ops.append(("copy", src, dst, 1, "chunk"))

    def reduce(src, dst):
        ops.append(("reduce", src, dst, 1, "chunk"))

    def summed(at, into, extra=()):
        """Sum input chunk ``at`` of every rank in scratch on rank ``into``."""
        copy((into, "input", at), (into, "scratch", at))
        for j in [j for j in range(n) if j != into] + list(extra):
            reduce((j, "input", at), (into, "scratch", at))

    if name in ("allreduce", "weighted", "reduce"):
        home = root if name == "reduce" else 0
        for i in range(k):
            summed(i, home, extra=(0,) if name == "weighted" else ())
            for r in ([home] if name == "reduce" else range(n)):
                copy((home, "scratch", i), (r, "output", i))
    elif name == "allgather":
        for r in range(n):
            for i in range(k):
                for j in range(n):
                    copy((r, "input", i), (j, "output", r * k + i))
    elif name == "reducescatter":
        for r in range(n):
            for i in range(k):
                summed(r * k + i, r)
                copy((r, "scratch", r * k + i), (r, "output", i))
    elif name == "alltoall":
        for r in range(n):
            for at in range(n * k):
                copy((r, "input", at), (r, "scratch", at))
        for r in range(n):
            for j in range(n):
                for i in range(k):
                    copy((j, "scratch", r * k + i), (r, "output", j * k + i))
    elif name == "broadcast":
        for r in range(n):
            for i in range(k):
                copy((root, "input", i), (r, "output", i))
    elif name in ("send_next", "sendrecv"):
        for r in range(n):
            for i in range(k):
                copy((r, "input", i), (r, "scratch", i))
        for r in range(n):
            for i in range(k):
                copy(((r - 1) % n, "scratch", i), (r, "output", i))
    return ops


@st.composite
def random_op(draw, spec: oracle.Spec):
    size_in, size_out = spec.logical_sizes()
    scratch = spec.n * spec.k + 1
    sizes = {"input": size_in, "output": size_out, "scratch": scratch}
    size = draw(st.sampled_from([1, 1, 1, 2]))
    kind = draw(st.sampled_from(["copy", "reduce"]))
    writable = ["output", "scratch"] + (["input"] if spec.inplace else [])
    locs = []
    for buffers in (["input", "output", "scratch"], writable):
        buffers = [b for b in buffers if sizes[b] >= size]
        buffer = draw(st.sampled_from(buffers))
        locs.append((draw(st.integers(0, spec.n - 1)), buffer, draw(st.integers(0, sizes[buffer] - size))))
    style = draw(st.sampled_from(["chunk", "group", "split"])) if size == 2 else "chunk"
    return (kind, locs[0], locs[1], size, style)


def physical(spec: oracle.Spec, loc):
    rank, buffer, index = loc
    return (rank, *spec.locate(rank, buffer, index))


def legal(spec: oracle.Spec, op) -> bool:
    """Whether the DSL accepts ``op`` where it is written (no overlap of
    source and destination except an exact self-copy, which it drops)."""
    kind, src, dst, size, _ = op
    (sr, sb, si), (dr, db, di) = physical(spec, src), physical(spec, dst)
    if (sr, sb) != (dr, db) or si + size <= di or di + size <= si:
        return True
    return kind == "copy" and si == di


@st.composite
def random_programs(draw):
    collective = draw(st.sampled_from(COLLECTIVES))
    name = collective if isinstance(collective, str) else collective.name
    n, k, inplace = draw(st.integers(2, 4)), draw(st.integers(1, 2)), draw(st.booleans())
    root = draw(st.integers(0, n - 1)) if name in ROOTED else 0
    spec = oracle.Spec(msc.dsl.collectives.get_collective(collective), n, k, inplace, root)
    ops = correct_program(name, n, k, root) if draw(st.integers(0, 3)) else []
    for _ in range(draw(st.integers(0 if ops else 1, 3 if ops else 12))):
        edit = draw(st.sampled_from(["insert", "delete", "duplicate", "swap"] if ops else ["insert"]))
        at = draw(st.integers(0, len(ops)))
        if edit == "insert":
            ops.insert(at, draw(random_op(spec)))
        elif edit == "delete":
            del ops[min(at, len(ops) - 1)]
        elif edit == "duplicate":
            ops.insert(at, ops[draw(st.integers(0, len(ops) - 1))])
        else:
            other = draw(st.integers(0, len(ops) - 1))
            at = min(at, len(ops) - 1)
            ops[at], ops[other] = ops[other], ops[at]
    ops = [op for op in ops if legal(spec, op)]
    return collective, spec, ops, draw(st.integers(0, 2**32))


def replay(collective, spec: oracle.Spec, ops):
    """An algorithm that performs ``ops`` through the DSL."""

    def ref(p, loc, size, style):
        rank, buffer, index = loc
        if style == "group":
            return msc.group([p.chunk(rank, buffer, index + 1), p.chunk(rank, buffer, index)])
        if style == "split":
            return msc.group(p.chunk(rank, buffer, index, size=2).split(2))
        return p.chunk(rank, buffer, index, size=size)

    @msc.algorithm(collective, chunk_factor=spec.k, inplace=spec.inplace)
    def random_program(p):
        for kind, src, dst, size, style in ops:
            if kind == "copy":
                ref(p, src, size, style).copy(*dst)
            else:
                ref(p, dst, size, style).reduce(ref(p, src, size, style))

    return random_program


def expected_trace(spec: oracle.Spec, ops) -> list[tuple]:
    """The physical ops the DSL must record for ``ops`` (self-copies dropped)."""
    out = []
    for kind, src, dst, size, _ in ops:
        s, d = physical(spec, src), physical(spec, dst)
        if kind == "copy" and s == d:
            continue
        out.append((OpKind.COPY if kind == "copy" else OpKind.REDUCE, *s, *d, size))
    return out


@settings(deadline=None, max_examples=200)
@given(case=random_programs())
def test_verifier_agrees_with_numeric_oracle(case):
    collective, spec, ops, seed = case
    params = {"root": spec.root} if spec.name in ROOTED else {}
    program = msc.trace(replay(collective, spec, ops), spec.n, **params)
    assert [tuple(op[:8]) for op in program.ops] == expected_trace(spec, ops)
    outcome = oracle.run(program, seed=seed)
    try:
        msc.verify(program)
        error = None
    except msc.VerificationError as exc:
        error = exc
    event("correct" if outcome.ok else "reads unwritten" if outcome.unwritten else "wrong output")
    disagreement = oracle.agrees(program, outcome, error)
    assert disagreement is None, disagreement
