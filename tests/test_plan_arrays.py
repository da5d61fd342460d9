"""msc.ir.arrays: a plan's columns against a plain-Python reading of the same
plan (library plans: threadblocks, steps, operands, dependencies, sorted
connections, the k-th send paired with the k-th receive), malformed plans
recorded rather than raised (and what the simulator and the plan verifier's
fast path make of them), the consumers' shared numbering, and the cache."""
from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import numpy as np
import pytest
from library import algorithms
from test_plan_verify import S, allgather2

import msc
from msc.cuda.codegen import kernel_layout
from msc.errors import PlanError
from msc.ir.arrays import OPS, plan_arrays
from msc.lower.pipeline import LowerOptions, lower
from msc.sim.sim_plan import compile_plan
from msc.verification import plan_fast

ALGORITHMS = algorithms(switch=False)
OPTIONS = (LowerOptions(), LowerOptions(protocol="LL", instances=2))


def library_plans():
    for key, alg in sorted(ALGORITHMS.items()):
        for n in (4, 6):
            if alg.supports(n):
                for options in OPTIONS:
                    yield f"{key} n={n} {options.protocol}x{options.instances}", lower(msc.trace(alg, n), options)


PLANS = dict(library_plans())


class PlainReading:
    """The same plan read step by step in Python, by the rules of
    msc.ir.arrays' docstring, written out independently."""

    def __init__(self, plan):
        self.tbs, self.steps = [], []           # (rank, tb), (rank position, tb, step index, step)
        self.first = {}                         # (rank position, tb position) -> global id of its first step
        sends, recvs = {}, {}
        for rank_pos, rp in enumerate(plan.ranks):
            for t, tb in enumerate(rp.threadblocks):
                self.first[(rank_pos, t)] = len(self.steps)
                self.tbs.append((rp.rank, tb))
                for i, step in enumerate(tb.steps):
                    g = len(self.steps)
                    self.steps.append((rank_pos, t, i, step))
                    if tb.send is not None:
                        sends.setdefault((rp.rank, tb.send, tb.channel), [])
                        if step.op.sends:
                            sends[(rp.rank, tb.send, tb.channel)].append(g)
                    if tb.recv is not None:
                        recvs.setdefault((tb.recv, rp.rank, tb.channel), [])
                        if step.op.receives:
                            recvs[(tb.recv, rp.rank, tb.channel)].append(g)
        self.connections = sorted(set(sends) | set(recvs))
        self.sends = [sends.get(c, []) for c in self.connections]
        self.recvs = [recvs.get(c, []) for c in self.connections]

    def dependencies(self):
        """(waiting step, step it waits for) as global ids, in step order."""
        return [(g, self.first[(rank_pos, t)] + s) for g, (rank_pos, _, _, step) in enumerate(self.steps)
                for t, s in step.deps]


@pytest.mark.parametrize("key", sorted(PLANS))
def test_the_columns_are_the_plan_read_step_by_step(key):
    plan = PLANS[key]
    arrays, plain = plan_arrays(plan), PlainReading(plan)
    assert arrays.num_steps == len(plain.steps) == plan.num_steps() > 0
    assert arrays.tb_rank.tolist() == [rank for rank, _ in plain.tbs]
    assert arrays.tb_id.tolist() == [tb.id for _, tb in plain.tbs]
    assert np.diff(arrays.tb_start).tolist() == [len(tb.steps) for _, tb in plain.tbs]
    assert arrays.step_tb.tolist() == [arrays.rank_tb_start[rp] + t for rp, t, _, _ in plain.steps]
    assert arrays.step_pos.tolist() == [i for _, _, i, _ in plain.steps]
    assert [OPS[c] for c in arrays.op.tolist()] == [step.op for *_, step in plain.steps]
    assert arrays.count.tolist() == [step.count for *_, step in plain.steps]
    assert arrays.nsrc.tolist() == [len(step.srcs) for *_, step in plain.steps]
    assert arrays.has_dst.tolist() == [step.dst is not None for *_, step in plain.steps]
    assert arrays.rank_scratch.tolist() == [rp.scratch for rp in plan.ranks]
    ops = arrays.operands()
    names = ops.buffer_names
    srcs = [(g, j, sl.buffer, sl.index, sl.count) for g, (*_, step) in enumerate(plain.steps)
            for j, sl in enumerate(step.srcs)]
    assert list(zip(ops.src_owner.tolist(), ops.src_pos.tolist(), [names[b] for b in ops.src_buf.tolist()],
                    ops.src_index.tolist(), ops.src_count.tolist())) == srcs
    dsts = [(g, step.dst.buffer, step.dst.index, step.dst.count) for g, (*_, step) in enumerate(plain.steps)
            if step.dst is not None]
    assert list(zip(ops.dst_owner.tolist(), [names[b] for b in ops.dst_buf.tolist()], ops.dst_index.tolist(),
                    ops.dst_count.tolist())) == dsts
    assert arrays.ranks_in_order(plan.num_ranks) and arrays.ids_in_order and arrays.deps_in_range
    assert arrays.one_threadblock_per_end and arrays.unconnected.size == 0


@pytest.mark.parametrize("key", sorted(PLANS))
def test_connections_are_sorted_and_the_kth_send_pairs_with_the_kth_receive(key):
    plan = PLANS[key]
    arrays, plain = plan_arrays(plan), PlainReading(plan)
    keys = list(zip(arrays.conn_sender.tolist(), arrays.conn_receiver.tolist(), arrays.conn_channel.tolist()))
    assert keys == plain.connections == sorted(keys) and len(keys) == len(set(keys)) > 0
    assert plan_fast.connections(plan) == len(keys)
    for c, (sender, receiver, channel) in enumerate(keys):
        sends = arrays.send_steps[arrays.send_ptr[c]:arrays.send_ptr[c + 1]].tolist()
        recvs = arrays.recv_steps[arrays.recv_ptr[c]:arrays.recv_ptr[c + 1]].tolist()
        assert sends == plain.sends[c] and recvs == plain.recvs[c]
        assert len(sends) == len(recvs) > 0 and arrays.conn_senders[c] == arrays.conn_receivers[c] == 1
        for g_send, g_recv in zip(sends, recvs):                 # the k-th message: its two ends
            assert arrays.tb_send_conn[arrays.step_tb[g_send]] == c == arrays.tb_recv_conn[arrays.step_tb[g_recv]]
            assert arrays.step_rank[g_send] == sender and arrays.step_rank[g_recv] == receiver
            assert arrays.count[g_send] == arrays.count[g_recv]
        send_tb, recv_tb = plain.tbs[arrays.conn_send_tb[c]], plain.tbs[arrays.conn_recv_tb[c]]
        assert (send_tb[0], send_tb[1].send, send_tb[1].channel) == (sender, receiver, channel)
        assert (recv_tb[1].recv, recv_tb[0], recv_tb[1].channel) == (sender, receiver, channel)


@pytest.mark.parametrize("key", [k for k in sorted(PLANS) if any(s.deps for *_, s in PLANS[k].steps())])
def test_dependencies_as_written_and_as_global_ids(key):
    plan = PLANS[key]
    arrays, plain = plan_arrays(plan), PlainReading(plan)
    expected = plain.dependencies()
    assert expected
    assert list(zip(arrays.dep_owner.tolist(), arrays.dep_step.tolist())) == expected
    written = [d for *_, step in plain.steps for d in step.deps]
    assert list(zip(arrays.dep_tb.tolist(), arrays.dep_pos.tolist())) == written


@pytest.mark.parametrize("key", sorted(PLANS)[::3])
def test_the_simulator_and_the_cuda_layout_number_connections_as_the_columns_do(key):
    plan = PLANS[key]
    arrays, sp, layout = plan_arrays(plan), compile_plan(plan), kernel_layout(plan, "table")
    plain = PlainReading(plan)
    assert list(zip(sp.conn_src.tolist(), sp.conn_dst.tolist(), sp.conn_ch.tolist())) == plain.connections
    assert [(c.id, c.sender, c.receiver, c.channel) for c in layout.connections] == \
        [(i, *key) for i, key in enumerate(plain.connections)]
    assert [c.max_count for c in layout.connections] == \
        [max(plain.steps[g][3].count for g in sends) for sends in plain.sends]
    assert sp.msg_send.tolist() == [g for sends in plain.sends for g in sends]
    assert sp.msg_recv.tolist() == [g for recvs in plain.recvs for g in recvs]
    assert list(zip(sp.dep_dst.tolist(), sp.dep_src.tolist())) == plain.dependencies()
    assert sp.tb_send_conn.tolist() == arrays.tb_send_conn.tolist()


# -- malformed plans: recorded, not raised ------------------------------------------
def _exchange(**changes):
    """Two ranks that swap their input (a correct allgather), with ``changes`` to rank 0's threadblock."""
    ranks = {r: [(1 - r, 1 - r, [S("send", [("input", 0)]), S("recv", dst=("output", 1 - r))])] for r in range(2)}
    plan = allgather2(ranks)
    rp = plan.ranks[0]
    tb = replace(rp.threadblocks[0], **changes)
    return replace(plan, ranks=(replace(rp, threadblocks=(tb,)), plan.ranks[1]))


def _declined(plan) -> bool:
    return plan_fast.fewest_slots(plan, 4) is None


def test_a_correct_exchange_is_read_whole():
    plan = _exchange()
    arrays = plan_arrays(plan)
    assert arrays.conn_sender.tolist() == [0, 1] and arrays.conn_receiver.tolist() == [1, 0]
    assert arrays.send_steps.tolist() == [0, 2] and arrays.recv_steps.tolist() == [3, 1]
    assert plan_fast.fewest_slots(plan, 4) == 1 and compile_plan(plan).msg_recv.tolist() == [3, 1]


def test_a_receive_without_a_sender_is_recorded():
    plan = _exchange(send=None, steps=(S("recv", dst=("output", 1)),))
    arrays = plan_arrays(plan)
    assert arrays.conn_senders.tolist() == [0, 1] and arrays.conn_receivers.tolist() == [1, 1]
    assert arrays.sends_per_conn.tolist() == [0, 1] and arrays.receives_per_conn.tolist() == [1, 1]
    assert plan_fast.fewest_slots(plan, 4) == 8                  # read, and deadlocked: it never gets its message
    with pytest.raises(PlanError, match=r"^connection rank 0 -> rank 1 channel 0 has a receiving threadblock "
                                        r"but no sending one$"):
        compile_plan(plan)


def test_unequal_counts_are_recorded():
    steps = (S("send", [("input", 0)]), S("send", [("input", 0)]), S("recv", dst=("output", 1)))
    plan = _exchange(steps=steps)
    arrays = plan_arrays(plan)
    assert arrays.sends_per_conn.tolist() == [2, 1] and arrays.receives_per_conn.tolist() == [1, 1]
    with pytest.raises(PlanError, match=r"^connection rank 0 -> rank 1 channel 0: 2 sends but 1 receives$"):
        compile_plan(plan)


def test_two_threadblocks_on_one_end_are_recorded():
    plan = _exchange()
    rp = plan.ranks[0]
    second = replace(rp.threadblocks[0], id=1, recv=None, steps=(S("send", [("input", 0)]),))
    plan = replace(plan, ranks=(replace(rp, threadblocks=(rp.threadblocks[0], second)), plan.ranks[1]))
    arrays = plan_arrays(plan)
    assert arrays.conn_senders.tolist() == [2, 1] and arrays.conn_send_tb.tolist() == [0, 2]
    assert not arrays.one_threadblock_per_end and arrays.send_steps.tolist() == [0, 2, 3]
    assert _declined(plan)


def test_dependencies_naming_no_step_are_recorded():
    steps = (S("send", [("input", 0)], deps=[(0, 5)]), S("recv", dst=("output", 1), deps=[(0, 0), (3, 0)]))
    plan = _exchange(steps=steps)
    arrays = plan_arrays(plan)
    assert arrays.dep_owner.tolist() == [0, 1, 1] and arrays.dep_step.tolist() == [-1, 0, -1]
    assert arrays.dep_tb.tolist() == [0, 0, 3] and not arrays.deps_in_range
    assert _declined(plan)
    with pytest.raises(PlanError, match=r"^rank 0, threadblock 0, step 0: a dependency names no step of its rank$"):
        compile_plan(plan)
    odd = _exchange(steps=(S("send", [("input", 0)], deps=[("0", 0)]), steps[1]))
    assert plan_arrays(odd).dep_tb.tolist()[0] == -1 and not plan_arrays(odd).deps_in_range


def test_a_step_without_its_peer_is_recorded():
    plan = _exchange(recv=None)                      # its receive step has no peer to receive from
    arrays = plan_arrays(plan)
    assert arrays.unconnected.tolist() == [1] and arrays.recv_steps.tolist() == [3]
    assert arrays.sends_per_conn.tolist() == [1, 1] and arrays.receives_per_conn.tolist() == [1, 0]
    assert _declined(plan)
    with pytest.raises(PlanError, match=r"^rank 0, threadblock 0, step 1: it sends or receives, but its"):
        compile_plan(plan)


def test_ids_and_ranks_out_of_order_are_recorded():
    plan = _exchange(id=3)
    assert not plan_arrays(plan).ids_in_order and _declined(plan)
    swapped = replace(plan, ranks=plan.ranks[::-1])
    arrays = plan_arrays(swapped)
    assert arrays.rank_id.tolist() == [1, 0] and not arrays.ranks_in_order(2) and _declined(swapped)
    assert plan_arrays(_exchange()).ranks_in_order(2) and not plan_arrays(_exchange()).ranks_in_order(3)


# -- the cache --------------------------------------------------------------------------
def test_one_reading_per_plan_shared_by_plans_with_its_ranks():
    plan, other = PLANS[sorted(PLANS)[0]], PLANS[sorted(PLANS)[1]]
    arrays = plan_arrays(plan)
    assert plan_arrays(plan) is arrays and plan_arrays(replace(plan, slots=8)) is arrays
    assert plan_arrays(other) is not arrays and plan_arrays(other).num_steps != 0
    copy = replace(plan, ranks=tuple(list(plan.ranks)))   # another tuple of the same ranks: read again, alike
    assert plan_arrays(copy) is not arrays and plan_arrays(copy).send_steps.tolist() == arrays.send_steps.tolist()
    changed = replace(plan, ranks=(plan.ranks[1], plan.ranks[0], *plan.ranks[2:]))
    assert plan_arrays(changed) is not arrays and plan_arrays(changed).rank_id.tolist()[:2] == [1, 0]
    with pytest.raises(ValueError):
        arrays.op[0] = 1                          # read-only: every consumer shares them


def test_the_cache_keeps_a_few_and_lets_dead_plans_go():
    keys = sorted(PLANS)[:6]
    first = plan_arrays(PLANS[keys[0]])
    for key in keys[1:]:
        plan_arrays(PLANS[key])
    assert plan_arrays(PLANS[keys[0]]) is not first          # pushed out by five others
    plan = _exchange()
    gone = weakref.ref(plan_arrays(plan))
    assert gone() is plan_arrays(plan)
    del plan
    gc.collect()
    assert gone() is None                                    # the cache holds nothing of a plan no one holds


def test_the_cache_is_no_replaced_verdict_module():
    """msc.ir.arrays is one of the verified-plan cache's verdict modules: its
    cache changing must not look like a replaced global (which would stop recording)."""
    from msc.verification import cache as verified

    assert "msc.ir.arrays" in verified.VERDICT_MODULES
    for key in sorted(PLANS)[:3]:
        plan_arrays(PLANS[key])
    plan = _exchange()
    plan_arrays(plan)
    del plan
    assert verified.replaced() == []
