"""The NCCL-grade baselines (algorithms/*/nccl_*.py, msc/dsl/nccl_orders.py): the
shapes NCCL gives its rings and trees, read back from the traced programs,
and the programs verified, lowered and run with other parameters than the
library test's defaults."""
from __future__ import annotations

from collections import Counter, defaultdict

import ml_dtypes
import numpy as np
import pytest

import msc
from library import algorithms
from msc.dsl.nccl_orders import (bidirectional_rings, node_parent, node_tree, rail_rings, torus_has_rings,
                                 torus_rings)
from msc.errors import UsageError
from msc.executor import run_collective
from msc.lower import LowerOptions, lower
from msc.verification import reference

ALGORITHMS = algorithms(light=False)
COLLECTIVES = ("allgather", "reducescatter", "allreduce")


def alg(collective: str, name: str, file: str = "nccl_rings") -> msc.Algorithm:
    return ALGORITHMS[f"{collective}/{file}:{name}"]


def transfers(program: msc.Program) -> dict[int, Counter]:
    """Per channel, how many operations move data over each (sender, receiver) pair."""
    found: dict[int, Counter] = defaultdict(Counter)
    for op in program.ops:
        if op.src_rank != op.dst_rank:
            found[op.channel or 0][(op.src_rank, op.dst_rank)] += 1
    return found


def verify_both_forms(algorithm: msc.Algorithm, n: int, **params) -> None:
    for inplace in (True, False):
        msc.verify(msc.trace(algorithm, n, inplace=inplace, **params))


# -- rail-aligned rings --------------------------------------------------------------------------

@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("nodes", [2, 3, 4])
def test_rail_rings_leave_and_enter_every_node_through_every_nic(collective, nodes):
    """With 8 rings on nodes of 8, each node is left through the NIC of each
    local GPU by exactly one ring, and entered on the rail it was left by."""
    g = 8
    program = msc.trace(alg(collective, "rail_rings"), nodes * g)
    channels = transfers(program)
    assert sorted(channels) == list(range(8))
    for node in range(nodes):
        leaving, entering = [], []
        for pairs in channels.values():
            crossing = [(s, d) for s, d in pairs if s // g != d // g]
            assert len(crossing) == nodes          # a ring crosses between nodes once per node
            leaving += [s % g for s, d in crossing if s // g == node]
            entering += [d % g for s, d in crossing if d // g == node]
            assert all(s % g == d % g for s, d in crossing), "rail-aligned: same local GPU on both ends"
        assert sorted(leaving) == sorted(entering) == list(range(g)), (node, leaving, entering)


def test_a_single_ring_crosses_through_one_nic_pair_where_rail_rings_use_all():
    ring = transfers(msc.trace(ALGORITHMS["allgather/ring:ring"], 16))
    rails = transfers(msc.trace(alg("allgather", "rail_rings"), 16))
    nics = {(s, d) for pairs in ring.values() for s, d in pairs if s // 8 != d // 8}
    assert nics == {(7, 8), (15, 0)}
    assert len({s for pairs in rails.values() for s, d in pairs if s // 8 != d // 8}) == 16


@pytest.mark.parametrize("g,nodes", [(1, 1), (1, 5), (2, 1), (2, 2), (2, 3), (2, 5), (3, 3), (4, 5), (8, 1), (8, 7)])
def test_rail_ring_orders_visit_every_rank_and_keep_each_node_together(g, nodes):
    n = g * nodes
    for rings in (1, g, 2 * g + 1):
        orders = rail_rings(n, g, rings)
        assert len(orders) == rings
        for c, order in enumerate(orders):
            assert sorted(order) == list(range(n))
            assert [r // g for r in order] == [k for k in range(nodes) for _ in range(g)]
            assert order == orders[c % g], "rings beyond g repeat the rails"
        if nodes > 1 and rings == g:
            exits = Counter((order[(k + 1) * g - 1] % g, k) for order in orders for k in range(nodes))
            assert set(exits.values()) == {1} and len(exits) == g * nodes


def test_rail_rings_cross_rails_only_where_two_gpus_and_an_odd_node_count_force_it():
    for g, nodes in ((2, 2), (2, 3), (3, 3), (8, 3), (8, 4)):
        crossing = [(order[i], order[(i + 1) % len(order)]) for order in rail_rings(g * nodes, g, g)
                    for i in range(len(order)) if order[i] // g != order[(i + 1) % len(order)] // g]
        cross_rail = [(s, d) for s, d in crossing if s % g != d % g]
        assert len(cross_rail) == (g if g == 2 and nodes % 2 else 0), (g, nodes, cross_rail)


def test_rail_rings_with_other_ring_and_node_sizes():
    for collective in COLLECTIVES:
        a = alg(collective, "rail_rings")
        for g, rings in ((1, 1), (2, 3), (4, 4), (3, 6)):
            for n in (g, 2 * g, 3 * g, 5 * g):
                program = msc.trace(a, n, rings=rings, gpus_per_node=g)
                assert sorted(transfers(program)) == list(range(rings)) or n == 1
                verify_both_forms(a, n, rings=rings, gpus_per_node=g)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("n,params", [(12, {}), (6, {"gpus_per_node": 4}), (8, {"rings": 0}),
                                      (8, {"gpus_per_node": 0})])
def test_rail_rings_refuse_what_they_cannot_lay_out(collective, n, params):
    a = alg(collective, "rail_rings")
    assert not a.supports(n, **params)
    with pytest.raises(msc.AlgorithmError, match="does not support"):
        msc.trace(a, n, **params)


def test_rail_ring_orders_reject_bad_arguments():
    with pytest.raises(UsageError, match="gpus_per_node"):
        rail_rings(12, 8, 8)
    with pytest.raises(UsageError, match="rings"):
        rail_rings(16, 8, 0)


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_rail_chains_work_from_every_root_and_leave_each_node_through_every_nic(collective):
    a = alg(collective, "rail_rings")
    for g, nodes, rings, chunks in ((2, 3, 2, 1), (4, 2, 4, 2), (1, 5, 1, 3)):
        n = g * nodes
        for root in range(n):
            verify_both_forms(a, n, root=root, rings=rings, gpus_per_node=g, chunks=chunks)
    for root in (0, 5, 13):
        channels = transfers(msc.trace(a, 16, root=root))
        assert sorted(channels) == list(range(8))
        for pairs in channels.values():
            assert len(pairs) == 15, "a chain of n - 1 hops"
            assert all(s % 8 == d % 8 for s, d in pairs if s // 8 != d // 8), "rail-aligned"
            senders, receivers = {s for s, _ in pairs}, {d for _, d in pairs}
            root_ends = (True, False) if collective == "broadcast" else (False, True)
            assert (root in senders, root in receivers) == root_ends
        # one ring's chain drops its crossing into the root's node (broadcast) or out of it (reduce)
        for node in (0, 1):
            leaving = [s % 8 for pairs in channels.values() for s, d in pairs if s // 8 == node != d // 8]
            dropped = (node != root // 8) if collective == "broadcast" else (node == root // 8)
            assert len(leaving) == len(set(leaving)) == 8 - dropped, (root, node, leaving)


# -- bidirectional rings and torus rings ---------------------------------------------------------

@pytest.mark.parametrize("collective", COLLECTIVES)
def test_bidir_rings_use_each_direction_of_every_link_once(collective):
    for n in (3, 5, 8):
        channels = transfers(msc.trace(alg(collective, "bidir_rings"), n))
        assert {pair for pair in channels[0]} == {(r, (r + 1) % n) for r in range(n)}
        assert {pair for pair in channels[1]} == {(r, (r - 1) % n) for r in range(n)}


def test_bidir_ring_orders():
    assert bidirectional_rings(1) == [[0], [0]]
    assert bidirectional_rings(4) == [[0, 1, 2, 3], [0, 3, 2, 1]]


def torus_links(rows: int, cols: int) -> set[tuple[int, int]]:
    at = lambda i, j: i % rows * cols + j % cols   # noqa: E731
    return {(at(i, j), at(i + di, j + dj)) for i in range(rows) for j in range(cols)
            for di, dj in ((0, 1), (0, -1), (1, 0), (-1, 0))}


@pytest.mark.parametrize("rows,cols", [(3, 3), (3, 4), (4, 4), (3, 7), (5, 6), (4, 8), (6, 6), (7, 5), (16, 16)])
def test_torus_rings_use_every_directed_link_exactly_once(rows, cols):
    orders = torus_rings(rows, cols)
    assert len(orders) == 4
    used = Counter()
    for order in orders:
        assert sorted(order) == list(range(rows * cols))
        used.update((order[i], order[(i + 1) % len(order)]) for i in range(len(order)))
    assert set(used) == torus_links(rows, cols) and set(used.values()) == {1}


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_torus_rings_program_puts_one_ring_on_each_directed_link(collective):
    for rows, n in ((4, 16), (3, 15), (5, 20)):
        channels = transfers(msc.trace(alg(collective, "torus_rings"), n, rows=rows))
        owners = Counter(pair for pairs in channels.values() for pair in pairs)
        assert set(owners) == torus_links(rows, n // rows) and set(owners.values()) == {1}
        verify_both_forms(alg(collective, "torus_rings"), n, rows=rows)


@pytest.mark.parametrize("rows,cols", [(1, 8), (2, 4), (4, 2), (2, 2), (0, 4)])
def test_torus_rings_refuse_tori_with_doubled_links(rows, cols):
    assert not torus_has_rings(rows, cols)
    with pytest.raises(UsageError, match="needs rows >= 3 and cols >= 3"):
        torus_rings(rows, cols)
    a = alg("allgather", "torus_rings")
    if rows >= 1:
        assert not a.supports(rows * cols, rows=rows)
        with pytest.raises(msc.AlgorithmError, match="does not support"):
            msc.trace(a, rows * cols, rows=rows)


# -- NCCL's tree -------------------------------------------------------------------------------

def test_node_double_binary_trees_share_no_interior_node():
    """NCCL's dtree: every node is interior in at most one tree (node 0 in both for odd counts)."""
    for nodes in range(1, 40):
        interior = [{node_parent(x, nodes, t) for x in range(nodes)} - {None} for t in (0, 1)]
        assert interior[0] & interior[1] == (set() if nodes % 2 == 0 or nodes == 1 else {0}), nodes
        for t in (0, 1):
            roots = [x for x in range(nodes) if node_parent(x, nodes, t) is None]
            assert len(roots) == 1
            children = Counter(node_parent(x, nodes, t) for x in range(nodes))
            del children[None]
            assert all(v <= 2 for v in children.values()), "binary trees"


@pytest.mark.parametrize("n,g", [(8, 8), (16, 8), (24, 8), (32, 8), (6, 2), (5, 1)])
def test_node_tree_is_a_chain_per_node_under_a_tree_of_heads(n, g):
    nodes = n // g
    for head in range(g):
        for tree in (0, 1):
            edges = node_tree(n, g, head, tree)
            assert len(edges) == n - 1 and len({c for c, _ in edges}) == n - 1
            sent = set()                      # ranks whose partial sum has gone up
            for child, parent in edges:
                assert parent not in sent and child not in sent, "children before parents"
                sent.add(child)
            for child, parent in edges:
                if child // g == parent // g:
                    assert (child - parent) % g == 1 and child % g != head
                else:
                    assert child % g == parent % g == head
                    assert node_parent(child // g, nodes, tree) == parent // g


def test_nccl_tree_channels_cross_nodes_through_their_own_nic_and_tree():
    a = ALGORITHMS["allreduce/nccl_tree:nccl_tree"]
    g, n, channels = 8, 32, 8
    program = msc.trace(a, n, chunks=1)
    found = transfers(program)
    assert sorted(found) == list(range(2 * channels))
    for channel, pairs in found.items():
        tree, c = divmod(channel, channels)
        crossing = {(s, d) for s, d in pairs if s // g != d // g}
        assert {s % g for s, _ in crossing} == {d % g for _, d in crossing} == {c}
        parents = {x: node_parent(x, n // g, tree) for x in range(n // g)}
        ups = {(s // g, d // g) for s, d in crossing if parents[s // g] == d // g}
        assert ups == {(x, up) for x, up in parents.items() if up is not None}
    interior = [{d // g for ch in range(t * channels, (t + 1) * channels) for (s, d), k in found[ch].items()
                 if s // g != d // g and node_parent(s // g, n // g, t) == d // g} for t in (0, 1)]
    assert not interior[0] & interior[1]


def test_nccl_tree_with_other_parameters():
    a = ALGORITHMS["allreduce/nccl_tree:nccl_tree"]
    for g, channels, chunks in ((1, 1, 1), (2, 3, 2), (4, 2, 3), (8, 1, 1)):
        for n in (g, 2 * g, 3 * g, 5 * g):
            program = msc.trace(a, n, gpus_per_node=g, channels=channels, chunks=chunks)
            assert program.chunk_factor == 2 * channels * chunks
            verify_both_forms(a, n, gpus_per_node=g, channels=channels, chunks=chunks)
    for n, params in ((12, {}), (8, {"channels": 0}), (8, {"chunks": 0})):
        assert not a.supports(n, **params)


# -- lowered and run ---------------------------------------------------------------------------

CASES = [("allgather/nccl_rings:rail_rings", 16, {"rings": 3, "gpus_per_node": 4}),
         ("reducescatter/nccl_rings:rail_rings", 12, {"rings": 4, "gpus_per_node": 4}),
         ("allreduce/nccl_rings:rail_rings", 16, {"rings": 8}),
         ("allgather/nccl_rings:bidir_rings", 5, {}),
         ("reducescatter/nccl_rings:bidir_rings", 6, {}),
         ("allreduce/nccl_rings:bidir_rings", 7, {}),
         ("allgather/nccl_rings:torus_rings", 9, {"rows": 3}),
         ("reducescatter/nccl_rings:torus_rings", 16, {}),
         ("allreduce/nccl_rings:torus_rings", 12, {"rows": 3}),
         ("allreduce/nccl_tree:nccl_tree", 12, {"gpus_per_node": 4, "channels": 2, "chunks": 2}),
         ("allreduce/nccl_tree:nccl_tree", 24, {})]


@pytest.mark.parametrize("key,n,params", CASES, ids=[f"{k}-n{n}" for k, n, _ in CASES])
@pytest.mark.parametrize("protocol,instances", [("Simple", 1), ("LL", 2)])
def test_lowered_plans_run_to_the_reference_result(key, n, params, protocol, instances):
    """Simple and LL plans, run on the reference executor with random data, bit-exact
    against numpy (as `msc run PLAN --backend sim` checks), in both forms."""
    for inplace in (True, False):
        program = msc.trace(ALGORITHMS[key], n, inplace=inplace, **params)
        msc.verify(program)
        plan = lower(program, LowerOptions(protocol=protocol, instances=instances))
        k = plan.chunk_factor
        for count, dtype, op in ((k, np.float32, "sum"), (3 * k + 1, ml_dtypes.bfloat16, "sum"),
                                 (1009, np.int32, "max")):
            length = plan.input_chunks // k * count
            inputs = reference.random_inputs(np.random.default_rng(count), np.dtype(dtype), op, n, length)
            assert all(np.all(x != 0) for x in inputs)
            outputs = run_collective(plan, inputs, op)
            assert reference.check(plan.collective, inputs, outputs, op=op) == [0] * n, (key, count, op)


def test_rail_rings_plan_has_a_threadblock_per_ring_and_rank():
    plan = lower(msc.trace(alg("allgather", "rail_rings"), 16), LowerOptions(instances=2))
    assert all(len(rank.threadblocks) == 16 for rank in plan.ranks)
    assert {tb.channel for rank in plan.ranks for tb in rank.threadblocks} == set(range(16))


@pytest.mark.slow
def test_torus_rings_exist_for_every_torus_up_to_20x20():
    for rows in range(3, 21):
        for cols in range(3, 21):
            used = Counter(pair for order in torus_rings(rows, cols)
                           for pair in zip(order, order[1:] + order[:1]))
            assert set(used) == torus_links(rows, cols) and set(used.values()) == {1}, (rows, cols)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["rail_rings", "torus_rings", "bidir_rings"])
def test_generation_at_256_ranks(spec):
    """Trace and verify at 256 ranks (ib:32, torus:16x16, ring:256) for every ring collective."""
    for collective in COLLECTIVES:
        report = msc.verify(msc.trace(alg(collective, spec), 256))
        assert report.num_ranks == 256
    if spec == "rail_rings":
        report = msc.verify(msc.trace(ALGORITHMS["allreduce/nccl_tree:nccl_tree"], 256))
        assert report.num_ranks == 256
