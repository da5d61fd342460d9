"""A plan must be right for every element count: data lands only in a
user-buffer chunk of its own class (position within a unit), and a chunk's
class is where its data physically started."""
import numpy as np
import pytest

import msc
from msc.executor import run_collective
from msc.lower.pipeline import lower

SWAPPED = msc.CustomCollective(
    "swapped", input_chunks=2, output_chunks=2,
    precondition=lambda r, i, n, k: (r, 1 - i), postcondition=lambda r, i, n, k: [(r, i)])


@msc.algorithm(SWAPPED, chunk_factor=2, inplace=False)
def unswap(p):
    for r in range(p.num_ranks):
        p.chunk(r, "input", 1).copy(r, "output", 0)
        p.chunk(r, "input", 0).copy(r, "output", 1)


def test_relabelled_inputs_keep_the_class_of_their_physical_start():
    program = msc.trace(unswap, 2)
    msc.verify(program)               # right for counts divisible by 2 ...
    with pytest.raises(msc.VerificationError, match="class 1 into output\\[0\\] \\(class 0\\)") as err:
        lower(program, collective=SWAPPED)   # ... but not for others, so the plan is refused
    assert err.value.where is not None and err.value.where.line > 0


@msc.algorithm("allgather", chunk_factor=2, inplace=False)
def allgather_direct(p):
    for r in range(p.num_ranks):
        for d in range(p.num_ranks):
            for i in range(2):
                p.chunk(r, "input", i).copy(d, "output", r * 2 + i)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 7])
def test_a_class_preserving_plan_runs_at_any_count(count):
    plan = lower(msc.trace(allgather_direct, 3))
    rng = np.random.default_rng(count)
    inputs = [rng.uniform(1, 2, count).astype(np.float32) for _ in range(3)]
    outputs = run_collective(plan, inputs)
    for out in outputs:
        np.testing.assert_array_equal(out, np.concatenate(inputs))
