"""The DSL contract: references, operations, hints, scratch buffers, in-place
aliasing, parameters, loading, and the errors (with the user's exact line)."""
from __future__ import annotations

from pathlib import Path

import pytest

import msc
from msc.dsl.collectives import ROOTED
from msc.ir import OpKind

from algfile import assert_at, load_one, write


def run_dsl(collective, n, body, k=1, inplace=False, **decorator):
    """Trace ``body(p, seen)`` as an algorithm; returns (program, seen): what
    the body stored in ``seen`` (references it made, errors it caught)."""
    seen = {}

    @msc.algorithm(collective, chunk_factor=k, inplace=inplace, **decorator)
    def probe(p):
        body(p, seen)

    return msc.trace(probe, n), seen


def fields(ref):
    return (ref.rank, ref.buffer, ref.index, ref.size)


def op_fields(op):
    return (op.kind, op.src_rank, op.src_buffer, op.src_index, op.dst_rank, op.dst_buffer, op.dst_index, op.size)


# -- references, copy and reduce ---------------------------------------------
def test_chunk_reference_fields_and_copy_result():
    def body(p, seen):
        seen["ref"] = p.chunk(1, "input", 0, size=2)
        seen["out"] = seen["ref"].copy(3, "output", 2)
        seen["default"] = p.chunk(0, "input", 1).copy(2, "scratch", 7).copy(1)  # same buffer and index

    program, seen = run_dsl("allgather", 4, body, k=2)
    assert fields(seen["ref"]) == (1, "input", 0, 2)
    assert fields(seen["out"]) == (3, "output", 2, 2)
    assert fields(seen["default"]) == (1, "scratch", 7, 1)
    assert [op_fields(op) for op in program.ops] == [
        (OpKind.COPY, 1, "input", 0, 3, "output", 2, 2),
        (OpKind.COPY, 0, "input", 1, 2, "scratch", 7, 1),
        (OpKind.COPY, 2, "scratch", 7, 1, "scratch", 7, 1),
    ]
    assert isinstance(program.ops, tuple)


def test_reduce_returns_its_destination_and_records_src_into_dst():
    def body(p, seen):
        out = p.chunk(0, "input", 1).copy(0, "output", 1)
        seen["out"] = out
        seen["result"] = out.reduce(p.chunk(2, "input", 1))
        seen["chained"] = out.reduce(p.chunk(1, "input", 1)).reduce(p.chunk(3, "input", 1))

    program, seen = run_dsl("allreduce", 4, body, k=2)
    assert seen["result"] is seen["out"]
    assert seen["chained"] is seen["out"]
    assert [op_fields(op) for op in program.ops[1:]] == [
        (OpKind.REDUCE, 2, "input", 1, 0, "output", 1, 1),
        (OpKind.REDUCE, 1, "input", 1, 0, "output", 1, 1),
        (OpKind.REDUCE, 3, "input", 1, 0, "output", 1, 1),
    ]


def test_reduce_errors_on_size_mismatch_and_non_reference(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        @msc.algorithm("allreduce", chunk_factor=4, inplace=False)
        def sizes(p, which="size"):
            out = p.chunk(1, "input", 0, size=2).copy(1, "output", 0)
            if which == "size":
                out.reduce(p.chunk(2, "input", 0))  # @size
            else:
                out.reduce((2, "input", 0))  # @type
    """)
    with pytest.raises(msc.OperationError, match="sizes differ") as err:
        msc.trace(alg, 3)
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "output", 0)
    assert_at(err.value, path, marks["size"])
    with pytest.raises(msc.OperationError, match="chunk reference") as err:
        msc.trace(alg, 3, which="type")
    assert_at(err.value, path, marks["type"])


def test_split_and_group_round_trip():
    def body(p, seen):
        whole = p.chunk(2, "input", 4, size=4)
        seen["whole"] = whole
        seen["halves"] = whole.split(2)
        seen["quarters"] = whole.split(4)
        seen["one"] = whole.split(1)
        q = seen["quarters"]
        seen["grouped"] = msc.group([q[3], q[1], q[0], q[2]])  # order does not matter
        seen["method"] = seen["halves"][0].group(seen["halves"][1])
        seen["copied"] = seen["halves"][1].copy(0, "output", 0)

    program, seen = run_dsl("allreduce", 3, body, k=8)
    assert [fields(r) for r in seen["halves"]] == [(2, "input", 4, 2), (2, "input", 6, 2)]
    assert [fields(r) for r in seen["quarters"]] == [(2, "input", i, 1) for i in range(4, 8)]
    assert [fields(r) for r in seen["one"]] == [(2, "input", 4, 4)]
    assert seen["grouped"] == seen["whole"]
    assert seen["method"] == seen["whole"]
    assert fields(seen["copied"]) == (0, "output", 0, 2)
    assert op_fields(program.ops[0]) == (OpKind.COPY, 2, "input", 6, 0, "output", 0, 2)


SPLIT_GROUP_ERRORS = {
    "split3": ("p.chunk(1, 'input', 2, size=4).split(3)", "split", (1, "input", 2)),
    "split0": ("p.chunk(1, 'input', 2, size=4).split(0)", "split", (1, "input", 2)),
    "gap": ("msc.group([p.chunk(1, 'input', 0), p.chunk(1, 'input', 2)])", "does not continue", (1, "input", 2)),
    "overlap": ("msc.group([p.chunk(1, 'input', 0, 2), p.chunk(1, 'input', 1)])", "does not continue",
                (1, "input", 1)),
    "ranks": ("msc.group([p.chunk(1, 'input', 0), p.chunk(2, 'input', 1)])", "does not continue",
              (2, "input", 1)),
    "buffers": ("msc.group([p.chunk(1, 'input', 0), p.chunk(1, 'scratch', 1)])", "does not continue",
                (1, "scratch", 1)),
    "empty": ("msc.group([])", "at least one", (None, None, None)),
}


@pytest.mark.parametrize("case", sorted(SPLIT_GROUP_ERRORS))
def test_split_and_group_errors_name_the_chunk_and_line(tmp_path, case):
    statement, message, chunk = SPLIT_GROUP_ERRORS[case]
    alg, marks, path = load_one(tmp_path, f"""
        import msc

        @msc.algorithm("allreduce", chunk_factor=8)
        def bad(p):
            p.chunk(0, "input", 0).copy(1, "scratch", 0)
            {statement}  # @bad
    """)
    with pytest.raises(msc.OperationError, match=message) as err:
        msc.trace(alg, 3)
    assert (err.value.rank, err.value.buffer, err.value.index) == chunk
    assert_at(err.value, path, marks["bad"])


# -- hints -------------------------------------------------------------------
def test_hints_are_recorded_on_ops():
    def body(p, seen):
        out = p.chunk(0, "input", 0).copy(1, "output", 0, channel=1, sendtb=2, recvtb=3)
        out.reduce(p.chunk(1, "input", 0), channel=0, recvtb=5)
        p.chunk(1, "input", 0).copy(0, "output", 0)

    program, _ = run_dsl("allreduce", 2, body)
    assert [(op.channel, op.sendtb, op.recvtb) for op in program.ops] == [(1, 2, 3), (0, None, 5), (None, None, None)]


@pytest.mark.parametrize("hint", ["channel=-1", "sendtb='0'", "recvtb=1.5", "channel=True"])
@pytest.mark.parametrize("op", ["copy", "reduce"])
def test_invalid_hints_are_rejected_at_the_line(tmp_path, hint, op):
    call = (f"p.chunk(0, 'input', 0).copy(1, 'output', 0, {hint})" if op == "copy"
            else f"out.reduce(p.chunk(0, 'input', 0), {hint})")
    alg, marks, path = load_one(tmp_path, f"""
        import msc

        @msc.algorithm("allreduce", inplace=False)
        def hinted(p):
            out = p.chunk(1, "input", 0).copy(1, "output", 0)
            {call}  # @hint
    """)
    with pytest.raises(msc.OperationError, match="hint " + hint.split("=")[0]) as err:
        msc.trace(alg, 2)
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "output", 0)
    assert_at(err.value, path, marks["hint"])


# -- scratch buffers ---------------------------------------------------------
def test_scratch_buffers_grow_on_demand_per_rank_and_name():
    def body(p, seen):
        p.chunk(0, "input", 0).copy(1, "scratch", 5)
        p.chunk(0, "input", 0).copy(1, "scratch", 2)
        p.chunk(0, "input", 0, size=2).copy(1, "scratch", 7)
        p.chunk(1, "input", 1).copy(0, "other", 0)
        seen["size"] = p.buffer_size("scratch")

    program, seen = run_dsl("allreduce", 2, body, k=2)
    assert seen["size"] is None  # scratch buffers have no fixed size
    assert program.scratch_sizes == {(1, "scratch"): 9, (0, "other"): 1}


def test_scratch_chunks_flow_through_verification():
    def body(p, seen):
        n = p.num_ranks
        for r in range(n):
            staged = p.chunk(r, "input", 0).copy((r + 1) % n, "scratch", 3 * r + 2)
            staged.copy((r + 1) % n, "output", r)

    program, _ = run_dsl("allgather", 3, body, inplace=False)
    with pytest.raises(msc.VerificationError, match="never written") as err:
        msc.verify(program)  # rank r's own chunk never reached its output
    assert (err.value.rank, err.value.buffer, err.value.index) == (0, "output", 0)

    def complete(p, seen):
        body(p, seen)
        for r in range(p.num_ranks):
            p.chunk(r, "input", 0).copy(r, "output", r)
            p.chunk(r, "input", 0).copy((r + 2) % p.num_ranks, "output", r)

    program, _ = run_dsl("allgather", 3, complete, inplace=False)
    assert msc.verify(program).output_chunks == 9


# -- in-place aliasing -------------------------------------------------------
# (collective, logical chunk) -> physical chunk in the in-place form; n=3, k=2.
ALIASES = [
    ("allgather", (2, "input", 1), ("output", 5)),
    ("allgather", (2, "output", 1), ("output", 1)),
    ("reducescatter", (2, "output", 1), ("input", 5)),
    ("reducescatter", (2, "input", 1), ("input", 1)),
    ("allreduce", (2, "output", 1), ("input", 1)),
    ("alltoall", (1, "output", 4), ("input", 4)),
    ("broadcast", (1, "output", 1), ("input", 1)),
    ("reduce", (1, "output", 0), ("input", 0)),
]


@pytest.mark.parametrize("collective,logical,physical", ALIASES)
def test_in_place_ops_use_physical_buffers(collective, logical, physical):
    rank, buffer, index = logical

    def body(p, seen):
        p.chunk(rank, buffer, index).copy(0 if rank else 1, "scratch", 0)   # read it
        p.chunk(0 if rank else 1, "scratch", 0).copy(rank, buffer, index)   # write it

    program, _ = run_dsl(collective, 3, body, k=2, inplace=True)
    read, write = program.ops
    assert (read.src_rank, read.src_buffer, read.src_index) == (rank, *physical)
    assert (write.dst_rank, write.dst_buffer, write.dst_index) == (rank, *physical)
    if buffer == "output":  # out of place nothing is aliased (and input is read-only)
        program, _ = run_dsl(collective, 3, body, k=2, inplace=False)
        assert [(op.src_buffer, op.src_index, op.dst_buffer, op.dst_index) for op in program.ops] == [
            (buffer, index, "scratch", 0), ("scratch", 0, buffer, index)]


@pytest.mark.parametrize("collective,logical,physical", ALIASES)
def test_in_place_ops_are_described_as_written(collective, logical, physical):
    """Errors name the buffer the algorithm wrote (output[1]), not the
    physical chunk it aliases in place (input[1])."""
    rank, buffer, index = logical
    other = 0 if rank else 1

    def body(p, seen):
        p.chunk(rank, buffer, index).copy(other, "scratch", 0)
        p.chunk(other, "scratch", 0).copy(rank, buffer, index)

    program, _ = run_dsl(collective, 3, body, k=2, inplace=True)
    assert program.describe_op(0) == f"copy rank {rank} {buffer}[{index}] -> rank {other} scratch[0]"
    assert program.describe_op(1) == f"copy rank {other} scratch[0] -> rank {rank} {buffer}[{index}]"


# A copy of input to output that is the same chunk in place (n=3, k=2, rank 1).
SELF_COPIES = [
    ("allgather", (1, "input", 1), (1, "output", 3)),
    ("reducescatter", (1, "input", 3), (1, "output", 1)),
    ("allreduce", (1, "input", 1), (1, "output", 1)),
    ("alltoall", (1, "input", 5), (1, "output", 5)),
    ("broadcast", (1, "input", 0), (1, "output", 0)),
]


@pytest.mark.parametrize("collective,src,dst", SELF_COPIES)
def test_copy_onto_its_alias_is_dropped_in_place_only(collective, src, dst):
    def body(p, seen):
        seen["dst"] = p.chunk(*src).copy(*dst)

    program, seen = run_dsl(collective, 3, body, k=2, inplace=True)
    assert program.ops == ()
    assert fields(seen["dst"]) == (*dst, 1)
    program, seen = run_dsl(collective, 3, body, k=2, inplace=False)
    assert [op_fields(op) for op in program.ops] == [(OpKind.COPY, *src, *dst, 1)]


def test_in_place_allgather_needs_no_local_copy_but_out_of_place_does():
    def cross_rank_only(p, seen):
        n, k = p.num_ranks, p.chunk_factor
        for r in range(n):
            for i in range(k):
                for j in range(n):
                    if j != r:
                        p.chunk(r, "input", i).copy(j, "output", r * k + i)

    program, _ = run_dsl("allgather", 3, cross_rank_only, k=2, inplace=True)
    assert msc.verify(program).output_chunks == 3 * 6
    program, _ = run_dsl("allgather", 3, cross_rank_only, k=2, inplace=False)
    with pytest.raises(msc.VerificationError, match="never written") as err:
        msc.verify(program)
    assert (err.value.rank, err.value.buffer, err.value.index) == (0, "output", 0)


def test_in_place_reduce_into_its_own_alias_is_an_overlap(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        @msc.algorithm("allreduce", chunk_factor=2)
        def self_reduce(p):
            p.chunk(1, "output", 1).reduce(p.chunk(1, "input", 1))  # @overlap
    """)
    with pytest.raises(msc.OperationError, match="overlap") as err:
        msc.trace(alg, 3)
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "output", 1)
    assert_at(err.value, path, marks["overlap"])
    program = msc.trace(alg, 3, inplace=False)  # distinct buffers out of place
    assert len(program.ops) == 1


def test_overlapping_local_copy_is_rejected(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        @msc.algorithm("allreduce")
        def shifted(p):
            p.chunk(0, "input", 0).copy(0, "scratch", 1)
            p.chunk(0, "scratch", 0, size=2).copy(0, "scratch", 1)  # @overlap
    """)
    with pytest.raises(msc.OperationError, match="overlap") as err:
        msc.trace(alg, 2)
    assert (err.value.rank, err.value.buffer, err.value.index) == (0, "scratch", 1)
    assert_at(err.value, path, marks["overlap"])


@pytest.mark.parametrize("statement", [
    "p.chunk(0, 'output', 1).copy(2, 'input', 1)",
    "p.chunk(2, 'input', 1).reduce(p.chunk(0, 'input', 1))",
    "p.chunk(0, 'input', 1).copy(2)",  # default destination: the same (input) buffer
])
def test_out_of_place_input_is_read_only(tmp_path, statement):
    alg, marks, path = load_one(tmp_path, f"""
        import msc

        @msc.algorithm("allreduce", chunk_factor=2, inplace=False)
        def writes_input(p):
            p.chunk(0, "input", 1).copy(0, "output", 1)
            {statement}  # @write
    """)
    with pytest.raises(msc.OperationError, match="read-only") as err:
        msc.trace(alg, 3)
    assert (err.value.rank, err.value.buffer, err.value.index) == (2, "input", 1)
    assert_at(err.value, path, marks["write"])
    assert len(msc.trace(alg, 3, inplace=True).ops) == 1  # in place the input is the output


# -- parameters ---------------------------------------------------------------
PARAMETRISED = """
    import msc

    @msc.algorithm("allreduce", chunk_factor=lambda n, width: n * width,
                   ranks=lambda n, width: n % 2 == 0 and width <= n, width=2)
    def striped(p, width=1, label="x"):
        seen = striped_seen
        seen.update(n=p.num_ranks, k=p.chunk_factor, params=dict(p.params), width=width, label=label,
                    inplace=p.inplace)

    striped_seen = {}
"""


def test_parameters_defaults_overrides_and_chunk_factor(tmp_path):
    path, _ = write(tmp_path, PARAMETRISED)
    [alg] = msc.load_algorithms(path)
    assert alg.params == {"width": 2, "label": "x"}  # the decorator's default wins over the function's
    assert alg.chunks(4) == 8 and alg.chunks(4, width=3) == 12
    seen = alg.fn.__globals__["striped_seen"]
    program = msc.trace(alg, 4)
    assert seen == {"n": 4, "k": 8, "params": {"width": 2, "label": "x"}, "width": 2, "label": "x",
                    "inplace": True}
    assert program.params == {"width": 2, "label": "x"}
    msc.trace(alg, 6, inplace=False, width=3, label="y")
    assert seen == {"n": 6, "k": 18, "params": {"width": 3, "label": "y"}, "width": 3, "label": "y",
                    "inplace": False}


def test_unknown_parameter_is_a_usage_error(tmp_path):
    path, _ = write(tmp_path, PARAMETRISED)
    [alg] = msc.load_algorithms(path)
    with pytest.raises(msc.UsageError, match="no parameter depth") as err:
        msc.trace(alg, 4, depth=3)
    assert "width" in str(err.value)  # names the parameters it does have
    with pytest.raises(msc.UsageError, match="unknown parameters"):
        msc.algorithm("allreduce", depth=3)(lambda p, width=1: None)


def test_ranks_predicate_decides_support(tmp_path):
    path, _ = write(tmp_path, PARAMETRISED)
    [alg] = msc.load_algorithms(path)
    assert [n for n in range(0, 9) if alg.supports(n)] == [2, 4, 6, 8]
    assert alg.supports(4, width=4) and not alg.supports(4, width=5)
    with pytest.raises(msc.AlgorithmError, match="does not support 3 ranks"):
        msc.trace(alg, 3)
    with pytest.raises(msc.AlgorithmError, match="does not support 4 ranks"):
        msc.trace(alg, 4, width=5)
    with pytest.raises(msc.UsageError):
        msc.trace(alg, 0)


def test_root_is_an_implicit_parameter_of_rooted_collectives():
    def body(p, seen):
        seen["root"] = p.root

    for collective in ROOTED:
        program, seen = run_dsl(collective, 4, body)
        assert seen["root"] == 0 and program.params == {"root": 0}

        @msc.algorithm(collective)
        def rooted(p):
            body(p, seen)

        msc.trace(rooted, 4, root=3)
        assert seen["root"] == 3
        with pytest.raises(msc.AlgorithmError, match="root 4 is not a rank"):
            msc.trace(rooted, 4, root=4)

    @msc.algorithm("allreduce")
    def rootless(p):
        pass

    with pytest.raises(msc.UsageError, match="no parameter root"):
        msc.trace(rootless, 4, root=1)


# -- exceptions inside the algorithm ----------------------------------------
def test_exception_in_the_algorithm_names_the_innermost_user_line(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        def helper(x):
            return 10 // x  # @helper

        @msc.algorithm("allreduce")
        def broken(p, divisor=0, fail="helper"):
            if fail == "helper":
                helper(divisor)  # @call
            table = {}
            return table[p.num_ranks]  # @lookup
    """)
    with pytest.raises(msc.AlgorithmError, match="ZeroDivisionError in algorithm 'broken'") as err:
        msc.trace(alg, 2)
    assert_at(err.value, path, marks["helper"])
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    with pytest.raises(msc.AlgorithmError, match="KeyError") as err:
        msc.trace(alg, 2, fail="lookup")
    assert_at(err.value, path, marks["lookup"])
    assert str(err.value).startswith(f"{err.value.where}: ")


def test_exception_in_sizing_callables_is_an_algorithm_error_at_its_line(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        @msc.algorithm("allreduce",
                       chunk_factor=lambda n, step: n // step,  # @factor
                       ranks=lambda n, step: {2: True, 4: True}[n],  # @ranks
                       step=1)
        def sized(p, step=1):
            pass
    """)
    assert msc.trace(alg, 4).chunk_factor == 4
    with pytest.raises(msc.AlgorithmError, match="ZeroDivisionError") as err:
        msc.trace(alg, 4, step=0)
    assert_at(err.value, path, marks["factor"])
    with pytest.raises(msc.AlgorithmError, match="KeyError") as err:
        msc.trace(alg, 3)
    assert_at(err.value, path, marks["ranks"])


def test_exception_raised_by_the_standard_library_names_the_user_line(tmp_path):
    """An exception raised inside a library the algorithm calls is blamed on
    the user's line that called it, not on the library's file (it once named
    random.py:373)."""
    alg, marks, path = load_one(tmp_path, """
        import random
        import msc

        @msc.algorithm("allreduce")
        def picky(p):
            random.choice([])  # @call
    """)
    with pytest.raises(msc.AlgorithmError, match="IndexError") as err:
        msc.trace(alg, 2)
    assert_at(err.value, path, marks["call"])


# -- loading -------------------------------------------------------------------
def test_load_algorithms_returns_every_algorithm_in_definition_order(tmp_path):
    path, _ = write(tmp_path, """
        \"\"\"Three algorithms, a helper and an alias.\"\"\"
        import msc

        def helper(p):
            return p.num_ranks

        @msc.algorithm("reducescatter", chunk_factor=2)
        def zeta(p):
            \"\"\"First one.\"\"\"

        @msc.algorithm("allgather", inplace=False, ranks=lambda n: n > 2)
        def alpha(p, hops=1):
            pass

        also_zeta = zeta

        @msc.algorithm("broadcast", chunk_factor=lambda n: n)
        def mid(p):
            pass
    """)
    algs = msc.load_algorithms(path)
    assert [a.name for a in algs] == ["zeta", "alpha", "mid"]
    assert [a.collective.name for a in algs] == ["reducescatter", "allgather", "broadcast"]
    assert [a.params for a in algs] == [{}, {"hops": 1}, {"root": 0}]
    assert [a.inplace for a in algs] == [True, False, True]
    assert [a.chunks(5) for a in algs] == [2, 1, 5]
    assert [a.supports(2) for a in algs] == [True, False, True]
    assert algs[0].doc == "First one."


def test_load_algorithms_by_library_name():
    algs = msc.load_algorithms("allreduce/ring")
    assert "ring" in [a.name for a in algs]
    assert all(a.collective.name == "allreduce" for a in algs)


def test_load_errors_name_the_file_and_line(tmp_path):
    path, marks = write(tmp_path, """
        import msc

        def fine(p):
            pass

        x = (1 +  # @syntax
    """)
    with pytest.raises(msc.AlgorithmError, match="syntax error") as err:
        msc.load_algorithms(path)
    assert Path(err.value.where.file).resolve() == path.resolve()
    assert err.value.where.line in (marks["syntax"], marks["syntax"] + 1)  # Python reports '(' or EOF
    path, marks = write(tmp_path, """
        import msc

        VALUE = {}["missing"]  # @boom
    """, name="boom.py")
    with pytest.raises(msc.AlgorithmError, match="KeyError") as err:
        msc.load_algorithms(path)
    assert_at(err.value, path, marks["boom"])
    with pytest.raises(msc.UsageError, match="no such algorithm file"):
        msc.load_algorithms(tmp_path / "absent.py")


# -- error quality: rank, buffer, index and the exact line --------------------
TRACE_ERRORS = {
    # name: (statement, message, (rank, buffer, index))
    "chunk bad rank": ("p.chunk(p.num_ranks, 'input', 0)", "rank 4 does not exist", (4, "input", 0)),
    "chunk negative rank": ("p.chunk(-1, 'input', 1)", "rank -1 does not exist", (-1, "input", 1)),
    "copy to missing rank": ("p.chunk(1, 'input', 0).copy(9, 'output', 1)", "rank 9 does not exist",
                             (9, "output", 1)),
    "chunk index out of range": ("p.chunk(3, 'input', 2)", "index out of range", (3, "input", 2)),
    "copy index out of range": ("p.chunk(3, 'input', 0).copy(2, 'output', 5)", "index out of range",
                                (2, "output", 5)),
    "copy span out of range": ("p.chunk(3, 'input', 0, size=2).copy(2, 'output', 1)", "output\\[1:3\\]",
                               (2, "output", 1)),
    "negative index": ("p.chunk(3, 'input', -1)", "must be an int >= 0", (3, "input", None)),
    "bad size": ("p.chunk(3, 'input', 0, size=0)", "size 0", (3, "input", 0)),
}


@pytest.mark.parametrize("case", sorted(TRACE_ERRORS))
def test_trace_errors_name_chunk_and_line(tmp_path, case):
    statement, message, chunk = TRACE_ERRORS[case]
    alg, marks, path = load_one(tmp_path, f"""
        import msc

        @msc.algorithm("allreduce", chunk_factor=2, inplace=False)
        def wrong(p):
            for r in range(p.num_ranks):
                p.chunk(r, "input", 0).copy(r, "output", 0)
            {statement}  # @bad
            p.chunk(0, "input", 1).copy(0, "output", 1)
    """)
    with pytest.raises(msc.OperationError, match=message) as err:
        msc.trace(alg, 4)
    assert (err.value.rank, err.value.buffer, err.value.index) == chunk
    assert_at(err.value, path, marks["bad"])
    assert str(err.value).startswith(f"{err.value.where}: ")


def test_reading_an_unwritten_chunk_names_the_reading_line(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        @msc.algorithm("allreduce", chunk_factor=2)
        def early(p, where="output"):
            p.chunk(0, "input", 0).copy(1, "scratch", 0)
            if where == "output":
                p.chunk(2, "output", 1).copy(3, "scratch", 0)  # @output
            else:
                p.chunk(1, "scratch", 1).copy(3, "scratch", 0)  # @scratch
    """)
    with pytest.raises(msc.VerificationError, match="which nothing has written") as err:
        msc.verify(msc.trace(alg, 4, inplace=False))
    assert (err.value.rank, err.value.buffer, err.value.index) == (2, "output", 1)
    assert_at(err.value, path, marks["output"])
    with pytest.raises(msc.VerificationError, match="which nothing has written") as err:
        msc.verify(msc.trace(alg, 4, where="scratch"))
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "scratch", 1)
    assert_at(err.value, path, marks["scratch"])


def test_reducing_into_an_unwritten_chunk_is_reported(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        @msc.algorithm("allreduce", inplace=False)
        def no_base(p):
            p.chunk(1, "output", 0).reduce(p.chunk(0, "input", 0))  # @reduce
    """)
    with pytest.raises(msc.VerificationError, match="nothing has written") as err:
        msc.verify(msc.trace(alg, 2))
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "output", 0)
    assert_at(err.value, path, marks["reduce"])


CONTRIBUTION_BUGS = """
    import msc

    @msc.algorithm("allreduce", chunk_factor=2, inplace=False)
    def sloppy(p, bug="missing"):
        n = p.num_ranks
        for i in range(2):
            for r in range(n):
                out = p.chunk(r, "input", i).copy(r, "output", i)
                for j in range(n):
                    if j == r:
                        continue
                    if bug == "missing" and (r, i, j) == (2, 1, 3):
                        continue
                    if bug == "foreign" and (r, i, j) == (1, 0, 3):
                        out.reduce(p.chunk(j, "input", 1))  # @foreign
                        continue
                    out.reduce(p.chunk(j, "input", i))  # @reduce
                if bug == "duplicated" and (r, i) == (3, 0):
                    out.reduce(p.chunk(0, "input", 0))  # @duplicated
"""


@pytest.mark.parametrize("bug,chunk,found,line", [
    ("missing", (2, "output", 1), "missing input[1] of rank 3", "reduce"),
    ("duplicated", (3, "output", 0), "duplicated input[0] of rank 0", "duplicated"),
    ("foreign", (1, "output", 0), "missing input[0] of rank 3; foreign input[1] of rank 3", "foreign"),
])
def test_wrong_contributions_name_chunk_kind_and_last_writing_line(tmp_path, bug, chunk, found, line):
    alg, marks, path = load_one(tmp_path, CONTRIBUTION_BUGS)
    assert msc.verify(msc.trace(alg, 4, bug="none")).output_chunks == 8
    with pytest.raises(msc.VerificationError, match="wrong contributions") as err:
        msc.verify(msc.trace(alg, 4, bug=bug))
    error = err.value
    assert (error.rank, error.buffer, error.index) == chunk
    assert error.expected == f"input[{chunk[2]}] of ranks 0-3"
    assert found in error.found
    assert_at(error, path, marks[line])  # the last line that wrote the chunk
    assert error.to_dict() == {
        "message": error.detail, "rank": chunk[0], "buffer": "output", "index": chunk[2],
        "expected": error.expected, "found": error.found, "file": error.where.file, "line": marks[line]}


def test_blamed_line_is_the_last_writer_not_the_bad_one(tmp_path):
    alg, marks, path = load_one(tmp_path, CONTRIBUTION_BUGS.replace(
        "if bug == \"foreign\" and (r, i, j) == (1, 0, 3)", "if bug == \"foreign\" and (r, i, j) == (1, 0, 0)"))
    with pytest.raises(msc.VerificationError) as err:
        msc.verify(msc.trace(alg, 4, bug="foreign"))
    assert (err.value.rank, err.value.index) == (1, 0)
    assert "foreign input[1] of rank 0" in err.value.found
    assert_at(err.value, path, marks["reduce"])  # the reduces of ranks 2 and 3 came after it


def test_never_written_output_names_the_chunk(tmp_path):
    alg, marks, path = load_one(tmp_path, """
        import msc

        @msc.algorithm("allgather", chunk_factor=2, inplace=False)
        def forgetful(p):
            n = p.num_ranks
            for r in range(n):
                for i in range(2):
                    for j in range(n):
                        if (j, r, i) != (2, 1, 1):
                            p.chunk(r, "input", i).copy(j, "output", 2 * r + i)
    """)
    with pytest.raises(msc.VerificationError, match=r"rank 2 output\[3\] was never written") as err:
        msc.verify(msc.trace(alg, 3))
    assert (err.value.rank, err.value.buffer, err.value.index) == (2, "output", 3)
    assert err.value.expected == "input[1] of rank 1"
    assert err.value.found == "nothing (never written)"


def test_in_place_output_left_at_its_initial_value_is_reported():
    def body(p, seen):
        for i in range(p.chunk_factor):
            for r in range(1, p.num_ranks):  # the root's output is its input
                if (r, i) != (1, 1):
                    p.chunk(0, "input", i).copy(r, "output", i)

    program, _ = run_dsl("broadcast", 3, body, k=2, inplace=True)
    with pytest.raises(msc.VerificationError, match="initial value") as err:
        msc.verify(program)
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "output", 1)
    assert "foreign input[1] of rank 1" in err.value.found


# -- the decorator's contracts: ranks= and chunk_factor (issue 15, item 3) ---------------------------
@pytest.mark.parametrize("ranks,supported", [
    ([8, 64], [8, 64]),
    ((2, 4), [2, 4]),
    ({6}, [6]),
    (frozenset({3, 5}), [3, 5]),
    (range(2, 65, 2), list(range(2, 65, 2))),
    (4, [4]),
    (lambda n: n % 3 == 0, list(range(3, 70, 3))),
])
def test_ranks_takes_a_predicate_the_counts_or_one_count(ranks, supported):
    """``ranks=[2, 4]`` once failed with 'inspect.py:2449: TypeError ...'."""
    @msc.algorithm("allreduce", ranks=ranks)
    def any_form(p):
        pass

    assert [n for n in range(0, 70) if any_form.supports(n)] == [n for n in supported if n < 70]
    msc.trace(any_form, supported[0])


def test_unsupported_rank_count_lists_the_supported_counts_not_a_range():
    """'it supports 8, 64 up to 64' read as the range 8..64; now the counts
    themselves, all of them where ranks= lists them."""
    @msc.algorithm("allreduce", ranks=[64, 8, 512])
    def listed(p):
        pass

    @msc.algorithm("allreduce", ranks=lambda n: n in (8, 64))
    def predicate(p):
        pass

    @msc.algorithm("allreduce", ranks=lambda n, step: n % step == 0, step=2)
    def even(p, step=2):
        pass

    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(listed, 4)
    assert str(err.value) == "algorithm 'listed' does not support 4 ranks (supported rank counts: 8, 64, 512)"
    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(predicate, 4)
    assert str(err.value) == ("algorithm 'predicate' does not support 4 ranks "
                              "(supported rank counts from 1 to 64: 8, 64)")
    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(even, 3)
    assert str(err.value).endswith("(supported rank counts from 1 to 64: 2, 4, ..., 64)")
    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(even, 4, step=3)
    assert str(err.value) == ("algorithm 'even' does not support 4 ranks with step=3 "
                              "(supported rank counts from 1 to 64: 3, 6, ..., 63)")


def test_chunk_factor_reads_the_algorithms_parameters():
    @msc.algorithm("allreduce", chunk_factor=lambda n, pieces=4: 2 * pieces)
    def pieced(p, pieces=4):
        pass

    @msc.algorithm("allreduce", chunk_factor=lambda n, unused=5: unused)    # not a parameter: its own default
    def other(p, pieces=4):
        pass

    assert [pieced.chunks(8), pieced.chunks(8, pieces=3)] == [8, 6]
    assert msc.trace(pieced, 2, pieces=1).chunk_factor == 2
    assert other.chunks(8, pieces=1) == 5


DECLARATION_ERRORS = {
    # name: (decorator arguments, message)
    "ranks text": ('ranks="8"', "ranks= must be a predicate of the rank count"),
    "ranks dict": ("ranks={8: True}", "ranks= must be a predicate of the rank count"),
    "ranks zero": ("ranks=[0, 8]", "ranks= lists rank counts, each an int >= 1; 0 is not one"),
    "ranks float": ("ranks=[8, 2.5]", "2.5 (a float, not an int) is not one"),
    "ranks bool": ("ranks=True", "ranks= must be a predicate"),
    "ranks empty": ("ranks=[]", "ranks= lists no rank count"),
    "ranks empty range": ("ranks=range(0)", "must hold rank counts >= 1"),
    "factor zero": ("chunk_factor=0", "chunk_factor must be an int >= 1 or a function of the rank count, got 0"),
    "factor text": ("chunk_factor='4'", "got '4' (a str, not an int)"),
    "factor bool": ("chunk_factor=True", "got True (a bool, not an int)"),
    "factor param": ("chunk_factor=lambda n, hops: hops",
                     "chunk_factor takes a parameter 'hops' that algorithm 'declared' does not have "
                     "(its parameters: width)"),
    "factor no n": ("chunk_factor=lambda: 4", "chunk_factor must take the rank count as its first parameter"),
    "ranks param": ("ranks=lambda n, rows: n % rows == 0", "ranks= takes a parameter 'rows'"),
    "collective": ('collective="allsum"', "unknown collective 'allsum'"),
}


@pytest.mark.parametrize("case", sorted(DECLARATION_ERRORS))
def test_bad_decorator_arguments_are_reported_at_the_decorator_line(tmp_path, case):
    arguments, message = DECLARATION_ERRORS[case]
    collective = "" if arguments.startswith("collective") else '"allreduce", '
    path, marks = write(tmp_path, f"""
        import msc

        @msc.algorithm({collective}{arguments})  # @decorator
        def declared(p, width=1):
            pass
    """)
    with pytest.raises(msc.UsageError) as err:
        msc.load_algorithms(path)
    assert message in str(err.value)
    file, line = str(err.value).split(": ", 1)[0].rsplit(":", 1)   # the message starts with FILE:LINE
    assert Path(file).resolve() == path.resolve() and int(line) == marks["decorator"]


def test_errors_in_sizing_functions_and_bad_results_name_the_decorator_line(tmp_path):
    """An exception raised in a sizing function outside the algorithm's file
    (here: in a helper module), a wrong return value, and a chunk_factor < 1
    that a parameter led to are reported at the decorator's line, with the
    parameter values."""
    write(tmp_path, """
        def factor(n, pieces):
            return {2: 2}[n] * pieces
    """, name="sizing_helpers.py")
    alg, marks, path = load_one(tmp_path, """
        import sys
        import msc
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from sizing_helpers import factor

        @msc.algorithm("allreduce", chunk_factor=factor, ranks=lambda n, verdict: verdict, verdict=True)  # @decorator
        def sized(p, pieces=1, verdict=True):
            pass
    """)
    assert msc.trace(alg, 2, pieces=3).chunk_factor == 6
    with pytest.raises(msc.AlgorithmError, match="KeyError in the chunk_factor of algorithm 'sized': 4") as err:
        msc.trace(alg, 4)
    assert_at(err.value, path, marks["decorator"])
    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(alg, 2, pieces=-1)
    assert_at(err.value, path, marks["decorator"])
    assert err.value.args[0].endswith(
        "algorithm 'sized': chunk_factor must be an int >= 1, but chunk_factor(n=2, pieces=-1) gave -2")
    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(alg, 2, pieces="abc")
    assert "chunk_factor(n=2, pieces='abc') gave 'abcabc'" in str(err.value)
    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(alg, 2, verdict=[2, 4])
    assert_at(err.value, path, marks["decorator"])
    assert err.value.args[0].endswith("its ranks= predicate must return True or False, but "
                                      "ranks(n=2, verdict=[2, 4]) returned [2, 4] (a list)")
    assert not alg.supports(2, verdict=0) and alg.supports(2, verdict=1)     # an int's truth is fine


def test_numpy_integers_are_ints_and_bools_and_floats_are_not(tmp_path):
    """Issue 14, item 7: ``p.chunk(np.int64(1), "input", 0)`` was rejected."""
    np = pytest.importorskip("numpy")

    def body(p, seen):
        i = np.int64
        ref = p.chunk(i(1), "input", np.int32(0), size=np.uint8(2))
        seen["halves"] = ref.split(np.int16(2))
        ref.copy(i(0), "output", i(0), channel=i(1), sendtb=np.int32(0), recvtb=np.uint8(2))

    program, seen = run_dsl("allgather", np.int64(2), body, k=2)
    assert [fields(r) for r in seen["halves"]] == [(1, "input", 0, 1), (1, "input", 1, 1)]
    [op] = program.ops
    values = (op.src_rank, op.src_index, op.dst_rank, op.dst_index, op.size, op.channel, op.sendtb, op.recvtb)
    assert values == (1, 0, 0, 0, 2, 1, 0, 2) and all(type(v) is int for v in values)
    assert program.num_ranks == 2 and type(program.num_ranks) is int

    @msc.algorithm("allreduce", ranks=[np.int64(4)], chunk_factor=np.int64(2))
    def numpy_sized(p):
        pass

    assert numpy_sized.supports(4) and numpy_sized.chunks(4) == 2


@pytest.mark.parametrize("statement,message", [
    ("p.chunk(True, 'input', 0)", "chunk: rank True is a bool, not an int (ranks are 0..1)"),
    ("p.chunk(np.bool_(True), 'input', 0)", "chunk: rank np.True_ is a bool, not an int"),
    ("p.chunk(1.0, 'input', 0)", "chunk: rank 1.0 is a float, not an int"),
    ("p.chunk(np.float64(1), 'input', 0)", "is a float64, not an int"),
    ("p.chunk(0, 'input', 0.0)", "index 0.0 (a float, not an int) on rank 0 input must be an int >= 0"),
    ("p.chunk(0, 'input', False)", "index False (a bool, not an int)"),
    ("p.chunk(0, 'input', 0, size=True)", "size True (a bool, not an int) must be an int >= 1"),
    ("p.chunk(0, 'input', 0).copy(1.0, 'output', 0)", "copy: rank 1.0 is a float, not an int"),
    ("p.chunk(0, 'input', 0, 2).split(2.0)", "into 2.0 (a float, not an int) equal parts"),
    ("p.chunk(0, 'input', 0).copy(1, 'output', 0, channel=np.True_)", "hint channel=np.True_ (a bool, not an int)"),
])
def test_bools_and_floats_are_rejected_with_their_type(tmp_path, statement, message):
    pytest.importorskip("numpy")
    alg, marks, path = load_one(tmp_path, f"""
        import numpy as np
        import msc

        @msc.algorithm("allgather", chunk_factor=2, inplace=False)
        def typed(p):
            {statement}  # @bad
    """)
    with pytest.raises(msc.OperationError) as err:
        msc.trace(alg, 2)
    assert message in str(err.value)
    assert_at(err.value, path, marks["bad"])


@pytest.mark.parametrize("raise_it,shown", [
    ("sys.exit(0)", "SystemExit in algorithm 'odd': it called sys.exit(0)"),
    ("sys.exit('bye')", "SystemExit in algorithm 'odd': it called sys.exit('bye')"),
    ("raise Custom('custom')", "Custom in algorithm 'odd': custom"),
    ("raise GeneratorExit", "GeneratorExit in algorithm 'odd'"),
    ("raise Mute()", "Mute in algorithm 'odd': (the Mute could not be shown: its __str__ raised)"),
])
def test_exits_and_odd_exceptions_in_the_algorithm_are_algorithm_errors(tmp_path, raise_it, shown):
    """Issue 14, item 5: sys.exit, BaseException subclasses and exceptions
    that cannot be printed become AlgorithmError at the line; Ctrl-C does not."""
    alg, marks, path = load_one(tmp_path, f"""
        import sys
        import msc

        class Custom(BaseException):
            pass

        class Mute(Exception):
            def __str__(self):
                raise RuntimeError("cannot show it")

        @msc.algorithm("allreduce")
        def odd(p, interrupt=False):
            if interrupt:
                raise KeyboardInterrupt
            {raise_it}  # @raise
    """)
    with pytest.raises(msc.AlgorithmError) as err:
        msc.trace(alg, 2)
    assert str(err.value) == f"{err.value.where}: {shown}"
    assert_at(err.value, path, marks["raise"])
    with pytest.raises(KeyboardInterrupt):
        msc.trace(alg, 2, interrupt=True)


def test_exits_while_loading_are_algorithm_errors(tmp_path):
    path, marks = write(tmp_path, """
        import sys
        import msc

        sys.exit(0)  # @exit
    """)
    with pytest.raises(msc.AlgorithmError, match=r"SystemExit while loading .*: it called sys.exit\(0\) "
                                                 r"\(an algorithm file must not end the process\)") as err:
        msc.load_algorithms(path)
    assert_at(err.value, path, marks["exit"])


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """Issue 14, item 7: 'utf-8' codec can't decode byte 0xff ... named no file."""
    path = tmp_path / "latin.py"
    path.write_bytes(b"import msc\n\n# caf\xe9\n")
    with pytest.raises(msc.AlgorithmError) as err:
        msc.load_algorithms(path)
    assert_at(err.value, path, 3)
    assert "not utf-8 text: byte 0xe9 on this line cannot be decoded" in str(err.value)
    path.write_bytes(b"# -*- coding: latin-1 -*-\nimport msc\n\n# caf\xe9\n")     # a coding line is honoured
    assert msc.load_algorithms(path) == []
