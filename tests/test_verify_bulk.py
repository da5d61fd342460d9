"""The DSL verifier's fast path (msc/verification/program_verifier_fast.py) vouches only for
programs the Python run accepts, and for most right ones."""
from __future__ import annotations

import importlib
import random

import numpy as np
import pytest

import msc
from msc.errors import MscError, VerificationError
from msc.verification.program_verifier import _run
from msc.verification.program_verifier_fast import checked_outputs
from library import algorithms

VERIFY = importlib.import_module("msc.verification.program_verifier")     # the module (msc.verify is the function)
from test_mutations import KINDS, mutants, redundant_allgather


def _slow(program):
    """The Python run's verdict: outputs checked, or the error's type."""
    try:
        return _run(program)
    except VerificationError as exc:
        return type(exc)


def test_library_programs_agree():
    vouched = 0
    for key, alg in algorithms(switch=False).items():
        for n in (2, 3, 4, 5, 8):
            for inplace in (True, False):
                try:
                    program = msc.trace(alg, n, inplace=inplace)
                except MscError:
                    continue
                fast = checked_outputs(program)
                assert fast == _slow(program), (key, n, inplace)
                vouched += 1
    assert vouched > 150


def test_mutants_are_never_vouched_for_when_wrong():
    """Library mutants are nearly all wrong; test_mutations' redundant
    allgather gives right ones (a copy sent twice, scratch nobody reads)."""
    rejected = vouched = 0
    for key, alg in (*algorithms(switch=False).items(), ("redundant", redundant_allgather)):
        for n in (4, 5):
            try:
                program = msc.trace(alg, n, inplace=False)
            except MscError:
                continue
            for kind in KINDS:
                for what, ops in mutants(program, kind, random.Random(f"{key}:{n}:{kind}"))[:8 if key != "redundant" else None]:
                    mutant = program.with_ops(ops)
                    fast, slow = checked_outputs(mutant), _slow(mutant)
                    if fast is not None:
                        assert fast == slow, (key, what)
                        vouched += 1
                    elif not isinstance(slow, int):
                        rejected += 1
    assert rejected > 500 and vouched >= 3, (rejected, vouched)


CUSTOM = msc.CustomCollective(
    "pairs", input_chunks=lambda n, k: 2 * k, output_chunks=lambda n, k: 2 * k,
    # both input chunks of a rank start with the same label: one leaf, in two places
    precondition=lambda r, i, n, k: (r, 0),
    postcondition=lambda r, i, n, k: [((r + 1) % n, 0)] * 2 if i == 0 else None)


@msc.algorithm(CUSTOM, chunk_factor=1, inplace=False)
def twice_the_neighbour(p, drop=False):
    n = p.num_ranks
    for r in range(n):
        left = (r + 1) % n
        p.chunk(left, "input", 0, 2).copy(r, "t", 0)               # two chunks at once, through scratch
        acc = p.chunk(r, "t", 0).copy(r, "output", 0)
        if not drop:
            acc.reduce(p.chunk(r, "t", 1))


@pytest.mark.parametrize("drop", [False, True])
def test_repeated_labels_multi_chunk_ops_and_scratch(drop):
    program = msc.trace(twice_the_neighbour, 3, drop=drop)
    assert checked_outputs(program) == (None if drop else 3)
    assert _slow(program) == (VerificationError if drop else 3)


@msc.algorithm("allgather", inplace=False)
def shifted_in_place(p, read_unwritten=False):
    """Multi-chunk local copies out to scratch and back, one chunk shifted."""
    n = p.num_ranks
    for r in range(n):
        for j in range(n):
            p.chunk(j, "input", 0).copy(r, "output", j)
        p.chunk(r, "output", 0, n - 1).copy(r, "t", 1)
        p.chunk(r, "t", 2 if read_unwritten else 1, n - 1).copy(r, "output", 0)


@pytest.mark.parametrize("read_unwritten", [False, True])
def test_multi_chunk_copies_and_unwritten_reads(read_unwritten):
    program = msc.trace(shifted_in_place, 3, read_unwritten=read_unwritten)
    assert checked_outputs(program) == (None if read_unwritten else 3 * 3)
    assert _slow(program) == (VerificationError if read_unwritten else 9)


def test_lanes_of_an_overlapping_copy_run_in_order():
    """The DSL never emits a copy onto itself shifted, but a trace may hold
    one, and verify runs its lanes in order: copying output[0:2] onto
    output[1:3] then leaves output[0]'s value in all three (lane j reads
    what lane j-1 wrote), so output[2] can put it back into output[0]."""
    program = msc.trace(shifted_in_place, 3)
    local = program.ops[-1]                        # a local copy on the last rank, as a template
    def copy(src, i, dst, j, size):
        return local._replace(src_buffer=src, src_index=i, dst_buffer=dst, dst_index=j, size=size)
    save, shift, fix, restore = (copy("output", 1, "t", 0, 2), copy("output", 0, "output", 1, 2),
                                 copy("output", 2, "output", 0, 1), copy("t", 0, "output", 1, 2))
    right = program.with_ops(program.ops + (save, shift, fix, restore))
    assert checked_outputs(right) == _slow(right) == 9
    wrong = program.with_ops(program.ops + (save, shift._replace(size=1), fix, restore))   # output[2] is not output[0]'s
    assert checked_outputs(wrong) is None and _slow(wrong) is VerificationError


def test_verify_takes_the_fast_path_from_a_size_on(monkeypatch):
    import msc.verification.program_verifier_fast as bulk
    answers = []
    real = bulk.checked_outputs
    monkeypatch.setattr(bulk, "checked_outputs", lambda program: answers.append(real(program)) or answers[-1])
    ring = algorithms(switch=False)["allreduce/ring:ring"]
    small, large = msc.trace(ring, 8), msc.trace(ring, 160)
    assert len(small.ops) < VERIFY.BULK_FROM_OPS <= len(large.ops)
    assert msc.verify(small).output_chunks == 64 and answers == []
    assert msc.verify(large).output_chunks == 160 * 160 and answers == [160 * 160]


def test_errors_are_worded_by_the_python_run(monkeypatch):
    """Where the fast path declines, verify's error is the Python run's, word for word."""
    ring = algorithms(switch=False)["allreduce/ring:ring"]
    program = msc.trace(ring, 5)
    words = {}
    for threshold in (0, 10 ** 9):
        monkeypatch.setattr(VERIFY, "BULK_FROM_OPS", threshold)
        for i in (0, 7, len(program.ops) - 1):
            mutant = program.with_ops(program.ops[:i] + program.ops[i + 1:])
            with pytest.raises(VerificationError) as err:
                msc.verify(mutant)
            words.setdefault(i, set()).add(str(err.value))
    assert all(len(texts) == 1 for texts in words.values()), words


def test_the_ssa_in_small_pieces_equals_it_in_one(monkeypatch):
    """_read_and_final_values works a piece of chunks at a time (msc.ir.accesses.PIECE): with pieces of
    a few accesses (and chunks of many accesses that overrun them) every value equals the one-piece run's,
    on library programs and on mutants (whose reads of unwritten chunks decline in some piece)."""
    import msc.ir.accesses as accesses
    import msc.verification.program_verifier_fast as bulk

    captured = []
    real = bulk._read_and_final_values
    monkeypatch.setattr(bulk, "_read_and_final_values", lambda *a: captured.append(a) or real(*a))
    lib = algorithms(switch=False)
    programs = [msc.trace(lib[key], n) for key, n in (("allreduce/ring:ring", 5), ("allreduce/hierarchical:hierarchical", 8),
                                                      ("allgather/ring:ring", 4))]
    programs += [programs[0].with_ops(ops) for _, ops in mutants(programs[0], "drop", random.Random(3))[:6]]
    for program in programs:
        captured.clear()
        whole = checked_outputs(program)
        (args,) = captured
        try:
            one = real(*args)
        except bulk.Decline:
            one = None
        for size in (1, 3, 17):
            monkeypatch.setattr(accesses, "PIECE", size)
            assert checked_outputs(program) == whole
            try:
                got = real(*args)
            except bulk.Decline:
                got = None
            assert (got is None) == (one is None)
            if one is not None:
                assert all(np.array_equal(g, o) for g, o in zip(got, one))
        monkeypatch.undo()
        monkeypatch.setattr(bulk, "_read_and_final_values", lambda *a: captured.append(a) or real(*a))


def test_int64_values_past_the_narrow_range_answer_as_int32(monkeypatch):
    """resolve's representatives (and contributions' pointers) are int32 below
    msc.ir.accesses.NARROW_BELOW values; with every one int64 the fast path
    answers the same on library programs and their mutants."""
    import msc.ir.accesses as accesses

    lib = algorithms(switch=False)
    programs = [msc.trace(lib[key], n) for key, n in (("allreduce/ring:ring", 5), ("allreduce/hierarchical:hierarchical", 8),
                                                      ("reducescatter/ring:ring", 4))]
    programs += [p.with_ops(ops) for p in programs for _, ops in mutants(p, "wrong_dst_index", random.Random(5))[:4]]
    narrow = [checked_outputs(p) for p in programs]
    monkeypatch.setattr(accesses, "NARROW_BELOW", 0)
    assert [checked_outputs(p) for p in programs] == narrow
    assert sum(x is not None for x in narrow) >= 3 and None in narrow
