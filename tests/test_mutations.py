"""Mutation testing of the verifier on every library algorithm.

Each algorithm under algorithms/ (found anew on every run) is traced at a
small rank count it supports, in place and out of place, and its ops are
mutated: one op dropped, one reduce duplicated, one copy sent to the wrong
rank or the wrong index. The numeric oracle (tests/oracle.py) decides
whether a mutant still computes the collective; the verifier must reject
exactly the mutants the oracle finds wrong, and accept the equivalent ones.

``python tests/test_mutations.py`` prints how many mutants of each kind were
caught and how many were equivalent.
"""
from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import pytest

import msc
from msc.ir import OpKind
from msc.dsl.loader import is_msccl_script

import oracle

LIBRARY = Path(__file__).resolve().parent.parent / "algorithms"
RANK_CHOICES = (4, 5, 8, 3, 6)  # the first of these the algorithm supports (else 2..16)
MAX_PER_KIND = 40
KINDS = ("drop", "duplicate_reduce", "wrong_dst_rank", "wrong_dst_index")


def library_files() -> list[Path]:
    return sorted(p for p in LIBRARY.rglob("*.py") if p.name != "__init__.py")


def rank_count(alg) -> int:
    for n in (*RANK_CHOICES, *range(2, 17)):
        if alg.supports(n):
            return n
    raise AssertionError(f"{alg.name} supports none of 2..16 ranks")


def _overlaps(op) -> bool:
    """A local op whose source and destination overlap: the DSL never emits one."""
    return (op.src_rank == op.dst_rank and op.src_buffer == op.dst_buffer
            and op.src_index < op.dst_index + op.size and op.dst_index < op.src_index + op.size
            and not (op.kind is OpKind.COPY and op.src_index == op.dst_index))


def _buffer_size(program, rank: int, buffer: str) -> int:
    fixed = program.layout.physical_sizes.get(buffer)
    return fixed if fixed is not None else program.scratch_sizes[(rank, buffer)]


def mutants(program, kind: str, rng: random.Random):
    """Up to MAX_PER_KIND ``(description, ops)`` of one kind, sampled with ``rng``."""
    ops = program.ops
    n = program.num_ranks
    copies = [i for i, op in enumerate(ops) if op.kind is OpKind.COPY]
    if kind == "drop":
        edits = [(i, None) for i in range(len(ops))]
    elif kind == "duplicate_reduce":
        edits = [(i, None) for i, op in enumerate(ops) if op.kind is OpKind.REDUCE]
    elif kind == "wrong_dst_rank":
        edits = [(i, r) for i in copies for r in range(n) if r != ops[i].dst_rank]
    else:
        edits = [(i, j) for i in copies
                 for j in range(_buffer_size(program, ops[i].dst_rank, ops[i].dst_buffer) - ops[i].size + 1)
                 if j != ops[i].dst_index]
    out = []
    for i, value in rng.sample(edits, min(MAX_PER_KIND, len(edits))):
        op = ops[i]
        if kind == "drop":
            new, what = ops[:i] + ops[i + 1:], f"drop op {i} ({op.describe()})"
        elif kind == "duplicate_reduce":
            new, what = ops[:i + 1] + ops[i:], f"repeat op {i} ({op.describe()})"
        else:
            changed = op._replace(dst_rank=value) if kind == "wrong_dst_rank" else op._replace(dst_index=value)
            if _overlaps(changed):
                continue
            new, what = ops[:i] + (changed,) + ops[i + 1:], f"op {i} {op.describe()} -> {changed.describe()}"
        out.append((what, new))
    return out


def check_mutants(alg, inplace: bool, stats: Counter) -> None:
    n = rank_count(alg)
    program = msc.trace(alg, n, inplace=inplace)
    msc.verify(program)
    assert oracle.run(program).ok, f"{alg.name} at {n} ranks: the oracle disagrees with the original"
    for kind in KINDS:
        rng = random.Random(f"{alg.name}:{n}:{inplace}:{kind}")
        for what, ops in mutants(program, kind, rng):
            mutant = program.with_ops(ops)
            outcome = oracle.run(mutant, seed=len(ops))
            try:
                msc.verify(mutant)
                error = None
            except msc.VerificationError as exc:
                error = exc
            disagreement = oracle.agrees(mutant, outcome, error)
            assert disagreement is None, f"{alg.name} n={n} inplace={inplace}: {what}: {disagreement}"
            verdict = "equivalent" if outcome.ok else "unwritten read" if outcome.unwritten else "wrong output"
            stats[kind, verdict] += 1


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "outofplace"])
@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(LIBRARY)))
def test_verifier_rejects_exactly_the_wrong_mutants(path, inplace):
    if is_msccl_script(path):
        pytest.skip("MSCCLang script, not an @msc.algorithm file")
    algorithms = msc.load_algorithms(path)
    assert algorithms, f"{path} defines no algorithm"
    stats = Counter()
    for alg in algorithms:
        check_mutants(alg, inplace, stats)
    assert sum(c for (_, verdict), c in stats.items() if verdict != "equivalent") > 0


@msc.algorithm("allgather", inplace=False)
def redundant_allgather(p):
    """Right, with ops that do not matter: a copy sent twice and a scratch
    chunk nobody reads."""
    n = p.num_ranks
    for r in range(n):
        for j in range(n):
            p.chunk(r, "input", 0).copy(j, "output", r)
    p.chunk(0, "input", 0).copy(1, "output", 0)
    p.chunk(1, "input", 0).copy(2, "scratch", 0)


def test_equivalent_mutants_are_accepted():
    stats = Counter()
    check_mutants(redundant_allgather, False, stats)
    assert stats["drop", "equivalent"] == 3  # either copy to rank 1's output[0], or the scratch copy
    assert stats["wrong_dst_index", "equivalent"] >= 1  # the scratch copy moved within scratch
    assert stats["drop", "wrong output"] == 4 * 4 - 1


def main() -> int:
    print(f"{'algorithm':50} {'form':6} {'n':>2} {'mutant':17} {'total':>5} {'caught':>6} {'equiv':>5}")
    for path in library_files():
        if is_msccl_script(path):
            continue
        for alg in msc.load_algorithms(path):
            for inplace in (True, False):
                stats = Counter()
                check_mutants(alg, inplace, stats)
                name = f"{path.relative_to(LIBRARY)}:{alg.name}"
                for kind in KINDS:
                    total = sum(c for (k, _), c in stats.items() if k == kind)
                    equivalent = stats[kind, "equivalent"]
                    print(f"{name:50} {'in' if inplace else 'out':6} {rank_count(alg):>2} {kind:17} "
                          f"{total:>5} {total - equivalent:>6} {equivalent:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
