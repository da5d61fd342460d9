"""The algorithm library: every algorithm under algorithms/ verifies in both
forms at every rank count it supports up to 64, also with other parameters."""
import ast
import sys

import pytest

import msc
from msc.ir import OpKind
from library import LIBRARY, algorithms

MAX_RANKS = 64
FORMS = {"inplace": True, "outofplace": False}


ALGORITHMS = algorithms()


def library(*ids: str) -> list[msc.Algorithm]:
    return [ALGORITHMS[i] for i in ids]


def verify_both_forms(alg: msc.Algorithm, n: int, **params) -> None:
    for inplace in FORMS.values():
        msc.verify(msc.trace(alg, n, inplace=inplace, **params))


def test_discovery_finds_the_library():
    expected = {
        "allreduce/ring:ring", "allreduce/allpairs:allpairs", "allreduce/halving_doubling:halving_doubling",
        "allreduce/tree:binomial", "allreduce/tree:double_binary", "allreduce/hierarchical:hierarchical",
        "allreduce/torus2d:torus2d", "allgather/ring:ring", "allgather/recursive_doubling:recursive_doubling",
        "allgather/allpairs:allpairs", "reducescatter/ring:ring", "reducescatter/allpairs:allpairs",
        "alltoall/allpairs:allpairs", "alltoall/hierarchical:hierarchical", "broadcast/chain:chain",
        "broadcast/binomial_tree:binomial_tree", "reduce/ring:ring", "reduce/tree:tree",
    }
    assert expected <= set(ALGORITHMS)
    for key, alg in ALGORITHMS.items():
        assert alg.collective.name == key.split("/")[0], key


def _verify_at(key: str, form: str, upto: int) -> None:
    """Verify at every supported rank count up to ``upto`` (the smallest
    supported one at least: the torus algorithms start at 9)."""
    alg = ALGORITHMS[key]
    supported = [n for n in range(1, MAX_RANKS + 1) if alg.supports(n)]
    assert supported, f"{key} supports no rank count up to {MAX_RANKS}"
    for n in [n for n in supported if n <= upto] or supported[:1]:
        report = msc.verify(msc.trace(alg, n, inplace=FORMS[form]))
        assert report.num_ranks == n and report.output_chunks > 0


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_verifies_at_the_supported_rank_counts_up_to_16(key, form):
    _verify_at(key, form, 16)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_verifies_at_every_supported_rank_count(key, form):
    _verify_at(key, form, MAX_RANKS)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("key", sorted(k for k in ALGORITHMS if "/nccl_" in k))
def test_nccl_grade_baselines_verify_with_their_defaults(key, form):
    """The default suite takes them with 2 rings or tree channel pairs (tests/library.py LIGHT)."""
    alg = algorithms(light=False)[key]
    for n in [n for n in range(1, MAX_RANKS + 1) if alg.supports(n)]:
        assert msc.verify(msc.trace(alg, n, inplace=FORMS[form])).num_ranks == n


@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_every_operation_is_needed(key):
    """Dropping any one op breaks the result: the verifier sees every op, and no op is wasted."""
    alg = ALGORITHMS[key]
    for n in (6, 8):
        if not alg.supports(n):
            continue
        for inplace in FORMS.values():
            program = msc.trace(alg, n, inplace=inplace)
            for i, op in enumerate(program.ops):
                with pytest.raises(msc.VerificationError):
                    msc.verify(program.with_ops(program.ops[:i] + program.ops[i + 1:]))


@pytest.mark.parametrize("alg", library("broadcast/chain:chain", "broadcast/binomial_tree:binomial_tree",
                                        "reduce/ring:ring", "reduce/tree:tree"), ids=lambda a: a.name)
def test_rooted_algorithms_work_from_every_root(alg):
    for n in (1, 2, 3, 5, 8, 13):
        for root in range(n):
            for chunks in (1, 3):
                verify_both_forms(alg, n, root=root, chunks=chunks)


@pytest.mark.parametrize("alg", library("allreduce/tree:binomial", "allreduce/tree:double_binary"),
                         ids=lambda a: a.name)
def test_tree_allreduces_with_other_chunk_counts(alg):
    for n in (2, 3, 7, 8, 33):
        for chunks in (1, 2, 5):
            assert msc.trace(alg, n, chunks=chunks).chunk_factor == chunks
            verify_both_forms(alg, n, chunks=chunks)


def _interior(program: msc.Program, chunk: int) -> set[int]:
    """Ranks that receive a partial sum of ``chunk`` from another rank."""
    return {op.dst_rank for op in program.ops
            if op.kind is OpKind.REDUCE and op.src_rank != op.dst_rank and op.dst_index == chunk}


def test_double_binary_trees_are_complementary():
    alg = ALGORITHMS["allreduce/tree:double_binary"]
    for n in range(2, 33):
        program = msc.trace(alg, n, chunks=2)
        shared = _interior(program, 0) & _interior(program, 1)
        assert shared == (set() if n % 2 == 0 else {0}), n


@pytest.mark.parametrize("alg", library("allreduce/hierarchical:hierarchical", "alltoall/hierarchical:hierarchical"),
                         ids=lambda a: a.collective.name)
def test_hierarchical_with_other_node_sizes(alg):
    for g in (1, 2, 3, 8):
        for n in range(g, 33, g):
            verify_both_forms(alg, n, gpus_per_node=g)


def test_torus2d_with_every_row_count():
    alg = ALGORITHMS["allreduce/torus2d:torus2d"]
    for n in (1, 6, 12, 16, 30):
        for rows in range(1, n + 1):
            if n % rows == 0:
                verify_both_forms(alg, n, rows=rows)


@pytest.mark.parametrize("n,rows", [(12, 3), (16, 4), (7, 1), (30, 5), (2, 1)])
def test_torus2d_default_rows_is_the_squarest_grid(n, rows):
    alg = ALGORITHMS["allreduce/torus2d:torus2d"]
    assert msc.trace(alg, n).ops == msc.trace(alg, n, rows=rows).ops


def test_halving_doubling_chunk_factor_is_the_power_of_two_core():
    alg = ALGORITHMS["allreduce/halving_doubling:halving_doubling"]
    assert [alg.chunks(n) for n in (1, 2, 3, 4, 7, 8, 12, 63, 64)] == [1, 2, 2, 4, 4, 8, 8, 32, 64]


@pytest.mark.parametrize("key,n,params", [
    ("allgather/recursive_doubling:recursive_doubling", 6, {}),
    ("allgather/recursive_doubling:recursive_doubling", 12, {}),
    ("allreduce/hierarchical:hierarchical", 6, {}),
    ("allreduce/hierarchical:hierarchical", 12, {"gpus_per_node": 8}),
    ("alltoall/hierarchical:hierarchical", 2, {}),
    ("alltoall/hierarchical:hierarchical", 9, {"gpus_per_node": 2}),
    ("allreduce/torus2d:torus2d", 8, {"rows": 3}),
    ("allreduce/torus2d:torus2d", 8, {"rows": 0}),
    ("allreduce/nvls_ring:nvls_ring", 12, {}),
    ("allreduce/nvls_ring:nvls_ring", 8, {"gpus_per_node": 1}),
    ("allreduce/nvls_ring:nvls_ring", 8, {"rings": 0}),
])
def test_unsupported_rank_counts_are_rejected(key, n, params):
    alg = ALGORITHMS[key]
    assert not alg.supports(n, **params)
    with pytest.raises(msc.AlgorithmError, match="does not support"):
        msc.trace(alg, n, **params)


@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_algorithm_has_a_docstring(key):
    doc = ALGORITHMS[key].doc
    assert len(doc.split()) >= 8
    assert doc.splitlines()[0].endswith("."), "the first line is the summary `msc list` shows"


@pytest.mark.parametrize("path", sorted(LIBRARY.rglob("*.py")), ids=lambda p: p.relative_to(LIBRARY).as_posix())
def test_file_has_a_docstring_and_imports_only_msc_and_the_standard_library(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            assert top == "msc" or top in sys.stdlib_module_names, f"{path.name} imports {module}"
