"""NCCL's PAT as library algorithms (algorithms/allgather/pat.py,
algorithms/reducescatter/pat.py): verified at many rank counts and GPUs per
node, run to the reference result with random data, and the shape NCCL's
PAT has: ceil(log2 n) messages per rank, peers at +- 2^d, n - 1 blocks sent."""
from __future__ import annotations

import math

import numpy as np
import pytest

import msc
from library import algorithms
from msc.dsl import pat as pat_ranks
from msc.executor import run_collective
from msc.lower import LowerOptions, lower
from msc.verification import reference

PAT = {c: algorithms()[f"{c}/pat:pat"] for c in ("allgather", "reducescatter")}
ONE_GPU = list(range(1, 18)) + [24, 31, 32]
NODES = [(2, 1), (2, 3), (4, 2), (4, 5), (8, 2), (8, 3)]          # (gpus per node, nodes)


@pytest.mark.parametrize("collective", sorted(PAT))
def test_pat_verifies_at_every_rank_count_and_both_forms(collective):
    for n in ONE_GPU:
        for inplace in (True, False):
            assert msc.verify(msc.trace(PAT[collective], n, inplace=inplace)).num_ranks == n
    for g, nodes in NODES:
        for inplace in (True, False):
            program = msc.trace(PAT[collective], g * nodes, inplace=inplace, gpus_per_node=g)
            assert msc.verify(program).num_ranks == g * nodes


@pytest.mark.parametrize("collective", sorted(PAT))
@pytest.mark.parametrize("n,g", [(5, 1), (8, 1), (12, 4)])
def test_pat_plans_run_to_the_reference_result(collective, n, g):
    for inplace in (True, False):
        plan = lower(msc.trace(PAT[collective], n, inplace=inplace, gpus_per_node=g), LowerOptions(protocol="Simple"))
        for count, op in ((3, "sum"), (257, "max")):
            length = plan.input_chunks // plan.chunk_factor * count
            inputs = reference.random_inputs(np.random.default_rng(count + n), np.dtype(np.float32), op, n, length)
            assert all(np.all(x != 0) for x in inputs)
            outputs = run_collective(plan, inputs, op)
            assert reference.check(collective, inputs, outputs, op=op) == [0] * n


def _sends(program):
    """Per rank, the (peer, chunks) of every op it sends to another rank."""
    out = {}
    for op in program.ops:
        if op.src_rank != op.dst_rank:
            out.setdefault(op.src_rank, []).append((op.dst_rank, op.size))
    return out


@pytest.mark.parametrize("collective", sorted(PAT))
def test_pat_sends_log2_messages_to_peers_two_to_the_d_away(collective):
    """With one GPU per node and 2^D ranks every rank sends D messages, one per
    dimension, to rank -+ 2^d (allgather: the far one first with one block;
    reduce-scatter: the near one first with half), n - 1 blocks in all."""
    for n in (2, 4, 8, 16, 32):
        D = int(math.log2(n))
        sends = _sends(msc.trace(PAT[collective], n))
        for r in range(n):
            got = sends[r]
            assert len(got) == D and sum(size for _, size in got) == n - 1
            sign = -1 if collective == "allgather" else 1
            dims = list(reversed(range(D))) if collective == "allgather" else list(range(D))
            assert [peer for peer, _ in got] == [(r + sign * (1 << d)) % n for d in dims]
            assert [size for _, size in got] == [1 << (D - 1 - d) for d in dims]


def test_pat_ranks_helpers():
    assert [pat_ranks.dimensions(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    assert [pat_ranks.bit_reversed(s, 3) for s in range(8)] == [0, 4, 2, 6, 1, 5, 3, 7]
    assert pat_ranks.runs([0, 2, 4], 3) == [(0, 3)]            # positions 0, 2, 1
    assert pat_ranks.runs([1, 3, 5, 7, 9], 4) == [(8, 3), (12, 1), (14, 1)]   # 8, 12, 10, 14, 9
    assert pat_ranks.gather_step(6, 1) == ([0], 2) and pat_ranks.gather_step(6, 0) == ([0, 2, 4], 4)
    assert pat_ranks.reduce_step(6, 1) == ([2], 2) and pat_ranks.reduce_step(6, 0) == ([1, 3, 5], 4)
