"""User-defined collectives (msc.CustomCollective): a pipeline-parallel send
to the next rank, repeated labels, don't-care outputs, empty inputs."""
from __future__ import annotations

import pytest

import msc

import oracle
from algfile import assert_at, write

PIPELINE = """
    import msc

    # Pipeline parallelism: stage r hands its k chunks to stage r+1; what
    # stage 0 ends with does not matter.
    send_next = msc.CustomCollective(
        "send_next", input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,
        postcondition=lambda r, i, n, k: None if r == 0 else [(r - 1, i)])

    @msc.algorithm(send_next, chunk_factor=2)
    def backward(p):
        \"\"\"Last stage first: each input is sent before anything overwrites it.\"\"\"
        for r in reversed(range(p.num_ranks - 1)):
            for i in range(p.chunk_factor):
                p.chunk(r, "input", i).copy(r + 1, "output", i)

    @msc.algorithm(send_next, chunk_factor=2)
    def forward(p):
        \"\"\"First stage first: in place, stage r+1's input is overwritten before it is sent.\"\"\"
        for r in range(p.num_ranks - 1):
            for i in range(p.chunk_factor):
                p.chunk(r, "input", i).copy(r + 1, "output", i)  # @forward

    @msc.algorithm(send_next, chunk_factor=2)
    def skips(p):
        \"\"\"Wrong: sends two stages ahead.\"\"\"
        for r in range(p.num_ranks - 1):
            for i in range(p.chunk_factor):
                p.chunk(r, "input", i).copy(min(r + 2, p.num_ranks - 1), "output", i)  # @skip

    @msc.algorithm(send_next, chunk_factor=2)
    def scribbles(p):
        \"\"\"Right, and also writes garbage where nothing is required (stage 0).\"\"\"
        n = p.num_ranks
        for r in reversed(range(n - 1)):
            for i in range(p.chunk_factor):
                p.chunk(r, "input", i).copy(r + 1, "output", i)
        p.chunk(n - 1, "input", 1).copy(0, "output", 0)
        p.chunk(0, "output", 0).copy(0, "output", 1)

    @msc.algorithm(send_next, chunk_factor=2, inplace=False)
    def forgets(p):
        \"\"\"Wrong: the last stage receives nothing.\"\"\"
        for r in range(p.num_ranks - 2):
            for i in range(p.chunk_factor):
                p.chunk(r, "input", i).copy(r + 1, "output", i)
"""


@pytest.fixture
def pipeline(tmp_path):
    path, marks = write(tmp_path, PIPELINE)
    return {a.name: a for a in msc.load_algorithms(path)}, marks, path


def checked(program):
    """Verify, and insist the numeric oracle agrees on the verdict."""
    outcome = oracle.run(program, seed=7)
    try:
        report = msc.verify(program)
    except msc.VerificationError as exc:
        assert oracle.agrees(program, outcome, exc) is None, oracle.agrees(program, outcome, exc)
        raise
    assert outcome.ok, outcome
    return report


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_send_next_verifies_in_both_forms(pipeline, n, inplace):
    algs, _, _ = pipeline
    report = checked(msc.trace(algs["backward"], n, inplace=inplace))
    assert report.collective == "send_next"
    assert report.output_chunks == (n - 1) * 2  # stage 0's outputs are not checked
    assert report.ops == (n - 1) * 2


def test_send_order_matters_in_place_only(pipeline):
    algs, marks, path = pipeline
    checked(msc.trace(algs["forward"], 4, inplace=False))
    with pytest.raises(msc.VerificationError, match="wrong contributions") as err:
        checked(msc.trace(algs["forward"], 4, inplace=True))
    error = err.value
    assert (error.rank, error.buffer, error.index) == (2, "output", 0)
    assert error.expected == "input[0] of rank 1"
    assert error.found == "input[0] of rank 0: missing input[0] of rank 1; foreign input[0] of rank 0"
    assert_at(error, path, marks["forward"])


@pytest.mark.parametrize("inplace", [True, False])
def test_wrong_program_is_rejected(pipeline, inplace):
    algs, marks, path = pipeline
    with pytest.raises(msc.VerificationError) as err:
        checked(msc.trace(algs["skips"], 4, inplace=inplace))
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "output", 0)
    assert err.value.expected == "input[0] of rank 0"
    # rank 1 never received: out of place nothing is there, in place its own input still is
    if inplace:
        assert err.value.found.startswith("input[0] of rank 1: missing input[0] of rank 0")
    else:
        assert err.value.found == "nothing (never written)"


def test_dont_care_outputs_may_hold_anything(pipeline):
    algs, _, _ = pipeline
    for inplace in (True, False):
        report = checked(msc.trace(algs["scribbles"], 3, inplace=inplace))
        assert report.output_chunks == 4


def test_last_stage_never_receiving_is_reported(pipeline):
    algs, _, _ = pipeline
    with pytest.raises(msc.VerificationError, match="never written") as err:
        checked(msc.trace(algs["forgets"], 4))
    assert (err.value.rank, err.value.buffer, err.value.index) == (3, "output", 0)
    assert err.value.expected == "input[0] of rank 2"


WEIGHTED = """
    import msc

    # Every rank ends with the sum of all inputs, rank 0's counted twice.
    weighted = msc.CustomCollective(
        "weighted_allreduce", input_chunks=1, output_chunks=1,
        postcondition=lambda r, i, n, k: [(j, i) for j in range(n)] + [(0, i)])

    @msc.algorithm(weighted, inplace=False)
    def direct(p, extra=1):
        n = p.num_ranks
        for r in range(n):
            out = p.chunk(r, "input", 0).copy(r, "output", 0)
            for j in range(n):
                if j != r:
                    out.reduce(p.chunk(j, "input", 0))
            for _ in range(extra):
                out.reduce(p.chunk(0, "input", 0))  # @extra
"""


def test_repeated_label_must_be_reduced_in_twice(tmp_path):
    path, marks = write(tmp_path, WEIGHTED)
    [alg] = msc.load_algorithms(path)
    assert checked(msc.trace(alg, 3)).output_chunks == 3
    with pytest.raises(msc.VerificationError) as err:
        checked(msc.trace(alg, 3, extra=0))
    assert (err.value.rank, err.value.buffer, err.value.index) == (0, "output", 0)
    assert err.value.expected == "input[0] of ranks 1-2, input[0] of rank 0 (x2)"
    assert err.value.found.endswith("missing input[0] of rank 0")
    with pytest.raises(msc.VerificationError) as err:
        checked(msc.trace(alg, 3, extra=2))
    assert err.value.found.endswith("duplicated input[0] of rank 0")
    assert_at(err.value, path, marks["extra"])


def test_gather_to_one_rank_checks_only_that_rank():
    gather = msc.CustomCollective(
        "gather", input_chunks=lambda n, k: k, output_chunks=lambda n, k: n * k,
        postcondition=lambda r, i, n, k: [(i // k, i % k)] if r == 2 else None)

    @msc.algorithm(gather, chunk_factor=2, inplace=False)
    def to_rank_two(p):
        for r in range(p.num_ranks):
            for i in range(2):
                p.chunk(r, "input", i).copy(2, "output", 2 * r + i)

    report = checked(msc.trace(to_rank_two, 4))
    assert report.output_chunks == 8


def test_precondition_none_means_the_chunk_starts_empty():
    only_root_has_data = msc.CustomCollective(
        "spread", input_chunks=1, output_chunks=1,
        precondition=lambda r, i, n, k: (0, i) if r == 0 else None,
        postcondition=lambda r, i, n, k: [(0, i)])

    @msc.algorithm(only_root_has_data, inplace=False)
    def spread(p, relay=False):
        n = p.num_ranks
        for r in range(n):
            p.chunk(0, "input", 0).copy(r, "output", 0)
        if relay:
            p.chunk(1, "input", 0).copy(2, "output", 0)

    checked(msc.trace(spread, 3))
    with pytest.raises(msc.VerificationError, match="nothing has written") as err:
        checked(msc.trace(spread, 3, relay=True))
    assert (err.value.rank, err.value.buffer, err.value.index) == (1, "input", 0)


def test_postcondition_must_give_label_pairs():
    broken = msc.CustomCollective("broken", input_chunks=1, output_chunks=1,
                                  postcondition=lambda r, i, n, k: ["not a label"])

    @msc.algorithm(broken, inplace=False)
    def anything(p):
        p.chunk(0, "input", 0).copy(0, "output", 0)

    with pytest.raises(msc.UsageError, match="origin_rank, origin_index"):
        msc.verify(msc.trace(anything, 1))


def test_in_place_custom_collective_with_a_larger_output_fails_cleanly():
    """In place, a custom collective's output is its input: an output larger
    than the input cannot be, and must be refused with an msc error (it
    once crashed verify() with an IndexError past the input's end, and
    silently accepted writes past it)."""
    gather = msc.CustomCollective(
        "gather", input_chunks=1, output_chunks=lambda n, k: n,
        postcondition=lambda r, i, n, k: [(i, 0)] if r == 0 else None)

    @msc.algorithm(gather)  # in place by default
    def incomplete(p):
        p.chunk(1, "input", 0).copy(0, "output", 1)  # rank 2's chunk never arrives

    with pytest.raises(msc.MscError):
        msc.verify(msc.trace(incomplete, 3))
    assert msc.trace(incomplete, 3, inplace=False).layout.physical_sizes == {"input": 1, "output": 3}


HALO = msc.CustomCollective("halo", input_chunks=1, output_chunks=2,
                            postcondition=lambda r, i, n, k: [((r - 1) % n, 0)] if i == 0 else [((r + 1) % n, 0)])


def _halo(swap: bool):
    @msc.algorithm(HALO, inplace=False)
    def halo(p):
        """Each rank's input to its neighbours' outputs: output[0] from the
        left, output[1] from the right (``swap``: the wrong way round)."""
        n = p.num_ranks
        for r in range(n):
            p.chunk(r, "input", 0).copy((r + 1) % n, "output", 1 if swap else 0)
            p.chunk(r, "input", 0).copy((r - 1) % n, "output", 0 if swap else 1)
    return halo


@pytest.mark.parametrize("protocol", ["Simple", "LL"])
def test_a_collective_of_int_sizes_compiles_with_instances(protocol):
    """A halo exchange stated with input_chunks=1, output_chunks=2 (ints)
    compiled with --instances 1 only: at 2 or 4 lowering checked the plan
    against the sizes as written ("output[1] is never written"). Instances
    scale the layout as they replicate it, whichever way the sizes are written."""
    from msc.lower.pipeline import LowerOptions, lower
    from msc.verification.plan import verify_plan

    program = msc.trace(_halo(swap=False), 4)
    msc.verify(program)
    for instances in (2, 4):
        plan = lower(program, LowerOptions(protocol=protocol, instances=instances))
        assert (plan.input_chunks, plan.output_chunks, plan.chunk_factor) == (instances, 2 * instances, instances)
        # output chunk x of rank 0 holds input chunk x % instances of its left (x < instances) or right neighbour
        assert plan.contract.post[0] == tuple(((3 if x < instances else 1, x % instances),)
                                              for x in range(2 * instances))
        verify_plan(plan)


def test_a_wrong_halo_with_instances_is_still_wrong():
    from msc.lower.pipeline import LowerOptions, lower

    with pytest.raises(msc.VerificationError, match="rank 0 output\\[0\\]"):
        msc.verify(msc.trace(_halo(swap=True), 4))
    program = msc.trace(_halo(swap=True), 4)
    with pytest.raises(msc.VerificationError, match="rank 0 output\\[0\\]"):
        lower(program, LowerOptions(instances=2))
