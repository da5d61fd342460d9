"""MSCCL++ switch channels (NVLS) both ways: msc's switch plans exported as
glres/gstore over switch channels with signal/wait barriers, checked
one-sidedly and read back equivalent; plans written here from the executor's
format (microsoft/mscclpp at 1f5f065, execution_plan.cc and
execution_kernel.hpp) with glres, gstore and gstorepkt, verified, and
mutated into the races and missing synchronisation the checker must name."""
from __future__ import annotations

import copy
import functools
import json

import pytest

import clirun
import msc
from msc.errors import PlanError, RaceError, RuntimeLimitError
from msc.formats.diff import diff_plans
from msc.formats.mscclpp.check import verify_mscclpp
from msc.formats.mscclpp.export import plan_to_mscclpp, plan_to_mscclpp_json
from msc.formats.mscclpp.lift import lift_plan
from msc.formats.mscclpp.limits import check_limits
from msc.formats.mscclpp.reader import parse_mscclpp
from msc.ir import StepOp
from msc.lower.pipeline import LowerOptions, lower
from msc.verification.plan import verify_plan
from library import algorithms

SWITCH = {key: alg for key, alg in algorithms().items() if key.startswith(("allreduce/nvls:", "allreduce/nvls_tree:",
                                                                                  "allreduce/nvls_ring:"))}
# (algorithm, ranks, parameters, instances): NVLS at 4 and 8 ranks; NVLS-tree as one node of 8 and as nodes
# of 4 and 2 GPUs (a tree across nodes: memory channels and switch channels in one plan); NVLS-ring as 2 and
# 3 nodes of 2 GPUs (rings of nodes across).
CASES = [("allreduce/nvls:nvls", 4, {}, 1), ("allreduce/nvls:nvls", 8, {}, 1), ("allreduce/nvls:nvls", 8, {}, 4),
         ("allreduce/nvls_tree:nvls_tree", 8, {}, 1), ("allreduce/nvls_tree:nvls_tree", 8, {"gpus_per_node": 4}, 1),
         ("allreduce/nvls_tree:nvls_tree", 4, {"gpus_per_node": 2}, 1),
         ("allreduce/nvls_ring:nvls_ring", 4, {"gpus_per_node": 2}, 1),
         ("allreduce/nvls_ring:nvls_ring", 6, {"gpus_per_node": 2}, 2)]


@functools.lru_cache(maxsize=None)
def switch_plan(key: str, n: int, params: tuple, instances: int, inplace: bool):
    alg = SWITCH[key]
    alg = alg.__class__(**{**alg.__dict__, "params": {**alg.params, **dict(params)}}) if params else alg
    return lower(msc.trace(alg, n, inplace=inplace), LowerOptions(instances=instances))


def plan_of(case, inplace=True):
    key, n, params, instances = case
    return switch_plan(key, n, tuple(sorted(params.items())), instances, inplace)


def test_the_cases_cover_every_switch_algorithm():
    assert {key for key, *_ in CASES} == set(SWITCH) == {"allreduce/nvls:nvls", "allreduce/nvls_tree:nvls_tree",
                                                         "allreduce/nvls_ring:nvls_ring"}
    tree = plan_of(CASES[4])
    assert any(tb.send is not None for rp in tree.ranks for tb in rp.threadblocks)     # the tree across nodes
    assert len({tb.group for rp in tree.ranks for tb in rp.threadblocks if tb.group}) == 2


# -- export, verify, round trip ---------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[f"{k.split(':')[1]}-{n}-{p}-i{i}" for k, n, p, i in CASES])
@pytest.mark.parametrize("inplace", [True, False])
def test_switch_plans_export_within_limits_verify_and_come_back_equivalent(case, inplace):
    plan = plan_of(case, inplace)
    assert plan.first_switch_step() is not None
    doc = parse_mscclpp(plan_to_mscclpp_json(plan))
    check_limits(doc)
    report = verify_mscclpp(doc)
    assert report.results_checked and report.num_ranks == plan.num_ranks
    back = lift_plan(doc)
    assert diff_plans(plan, back, equivalent=True) is None
    assert [tb.group for rp in back.ranks for tb in rp.threadblocks] == \
        [tb.group for rp in plan.ranks for tb in rp.threadblocks]
    verify_plan(back)


def _ops(doc, rank, tb=0):
    return doc["gpus"][rank]["threadblocks"][tb]["ops"]


def test_swrs_is_glres_through_the_switch_and_barriers_signal_and_wait_every_member():
    doc = plan_to_mscclpp(plan_of(CASES[0]))
    gpu = doc["gpus"][2]
    switches = [c for c in gpu["channels"] if c["channel_type"] == "switch"]
    assert switches == [{"channel_type": "switch", "buffer_type": "i", "rank_groups": [{"size": 4, "ranks": [0, 1, 2, 3]}]}]
    names = [op["name"] for op in _ops(doc, 2)]
    assert names == ["nop", "signal", "wait", "nop", "nop", "glres", "nop", "signal", "wait", "nop"]
    glres = _ops(doc, 2)[5]
    assert glres["src_buff"] == glres["dst_buff"] == [{"switch_channel_id": 0, "index": 2, "size": 1}]
    memory = [c["connected_to"] for c in gpu["channels"] if c["channel_type"] == "memory"]
    assert sorted(memory) == [[0], [1], [3]]                           # one barrier channel per other member
    assert _ops(doc, 2)[1]["channel_ids"] == _ops(doc, 2)[2]["channel_ids"] == [0, 1, 2]
    assert gpu["msc_barrier_channels"] == [0, 1, 2]


def test_swred_reduces_into_a_scratch_region_at_one_offset_on_every_rank_then_copies_out():
    plan = plan_of(CASES[3])
    assert {step.op for _, _, _, step in plan.steps()} >= {StepOp.SWRED, StepOp.SWST}
    doc = plan_to_mscclpp(plan)
    regions = set()
    for gpu in doc["gpus"]:
        ops = _ops(doc, gpu["id"])
        i = next(k for k, op in enumerate(ops) if op["name"] == "glres")
        glres, copy_out = ops[i], ops[i + 2]
        assert ops[i + 1] == {"name": "nop"} and copy_out["name"] == "copy"
        region, size = glres["dst_buff"][0]["index"], glres["dst_buff"][0]["size"]
        assert size == plan.chunk_factor // 8                          # the rank's share (two trees: 2 chunks)
        assert copy_out["src_buff"] == [{"type": "s", "index": region, "size": size}]
        assert copy_out["dst_buff"] == [{"type": "i", "index": gpu["id"] * size, "size": size}]
        regions.add(region)
        assert gpu["scratch_chunks"] == 8 * size                       # every issuer's region on every member
    assert regions == set(range(0, plan.chunk_factor, plan.chunk_factor // 8))   # each issuer its own


def test_the_exported_nvls_plan_verifies_from_the_command_line(tmp_path):
    plan_path, json_path = tmp_path / "nvls.plan", tmp_path / "nvls.json"
    run = clirun.msc                  # in this process; tests/test_cli_processes.py runs each command as a process
    assert run("compile", "allreduce/nvls", "--ranks", "8", "-o", str(plan_path)).returncode == 0
    out = run("export", str(plan_path), "--format", "mscclpp", "-o", str(json_path))
    assert out.returncode == 0, out.stderr
    out = run("verify", str(json_path))
    assert out.returncode == 0 and "verified" in out.stdout.lower(), out.stdout + out.stderr
    out = run("diff", str(plan_path), str(json_path), "--equivalent")
    assert out.returncode == 0 and "equal" in out.stdout, out.stdout + out.stderr


# -- plans written from the executor's format ---------------------------------------------------
def _switch_channel(buffer: str, ranks: list) -> dict:
    return {"channel_type": "switch", "buffer_type": buffer, "rank_groups": [{"size": len(ranks), "ranks": ranks}]}


def _sync(name: str, n: int) -> dict:
    return {"name": name, "channel_ids": list(range(n - 1)), "channel_type": "memory"}


def nvls_allreduce(n: int = 2) -> dict:
    """NVLS allreduce in place as MSCCL++'s reduce_nvls.json does it: members
    signal and wait each other (relaxed), rank r glres its chunk r through the
    input's switch channel, and they signal and wait again."""
    gpus = []
    for r in range(n):
        ops = [{"name": "nop"}, _sync("rlxsignal", n), {"name": "nop"}, _sync("rlxwait", n), {"name": "nop"},
               {"name": "glres", "src_buff": [{"switch_channel_id": 0, "index": r, "size": 1}],
                "dst_buff": [{"switch_channel_id": 0, "index": r, "size": 1}], "channel_type": "switch",
                "reduce_op": "sum"},
               {"name": "nop"}, _sync("rlxsignal", n), {"name": "nop"}, _sync("rlxwait", n), {"name": "nop"}]
        gpus.append({"id": r, "input_chunks": n, "output_chunks": n, "scratch_chunks": 0,
                     "channels": [{"channel_type": "memory", "connected_to": [p for p in range(n) if p != r]},
                                  _switch_channel("i", list(range(n)))],
                     "remote_buffers": [], "semaphores": [],
                     "threadblocks": [{"id": 0, "ops": ops, "remote_buffer_refs": [],
                                       "channels": [{"channel_type": "memory", "channel_ids": list(range(n - 1))},
                                                    {"channel_type": "switch", "channel_ids": [0]}]}]})
    return {"name": "nvls", "collective": "allreduce", "protocol": "Simple", "inplace": True, "gpus": gpus}


def nvls_allgather(n: int = 4) -> dict:
    """Allgather in place with gstore: rank r multicasts its output chunk r."""
    doc = nvls_allreduce(n)
    doc.update(collective="allgather", name="nvls_allgather")
    for gpu in doc["gpus"]:
        r = gpu["id"]
        gpu.update(input_chunks=1, output_chunks=n)
        gpu["channels"][1] = _switch_channel("o", list(range(n)))
        _ops(doc, r)[5] = {"name": "gstore", "src_buff": [{"type": "o", "index": r, "size": 1}],
                           "dst_buff": [{"switch_channel_id": 0, "index": r, "size": 1}], "channel_type": "switch"}
    return doc


def nvls_allgather_packets(n: int = 4) -> dict:
    """Allgather with LL packets through the switch (gstorepkt), as MSCCL++'s
    allgather_nvls_zero_copy_pkt does: no signals, the packets carry the flag."""
    gpus = []
    for r in range(n):
        ops = [{"name": "cpkt", "src_buff": [{"type": "o", "index": r, "size": 1}],
                "dst_buff": [{"type": "s", "index": r, "size": 1}]},
               {"name": "gstorepkt", "src_buff": [{"type": "s", "index": r, "size": 1}],
                "dst_buff": [{"switch_channel_id": 0, "index": r, "size": 1}], "channel_type": "switch"}]
        ops += [{"name": "upkt", "src_buff": [{"type": "s", "index": p, "size": 1}],
                 "dst_buff": [{"type": "o", "index": p, "size": 1}]} for p in range(n) if p != r]
        gpus.append({"id": r, "input_chunks": 1, "output_chunks": n, "scratch_chunks": n,
                     "channels": [_switch_channel("s", list(range(n)))], "remote_buffers": [], "semaphores": [],
                     "threadblocks": [{"id": 0, "ops": ops, "remote_buffer_refs": [],
                                       "channels": [{"channel_type": "switch", "channel_ids": [0]}]}]})
    return {"name": "nvls_pkt", "collective": "allgather", "protocol": "LL", "inplace": True,
            "use_double_scratch_buffer": True, "gpus": gpus}


def check(doc):
    return verify_mscclpp(parse_mscclpp(json.dumps(doc)))


@pytest.mark.parametrize("build,n", [(nvls_allreduce, 2), (nvls_allreduce, 8), (nvls_allgather, 4),
                                     (nvls_allgather_packets, 4)])
def test_switch_plans_in_the_executors_format_verify_with_the_right_results(build, n):
    report = check(build(n))
    assert report.results_checked and report.num_ranks == n


def test_a_wrong_group_op_gives_a_wrong_result():
    doc = nvls_allreduce(4)
    glres = _ops(doc, 3)[5]
    glres["name"], glres["src_buff"] = "gstore", [{"type": "i", "index": 3, "size": 1}]      # stores, no reduce
    with pytest.raises(msc.errors.VerificationError, match="wrong result on rank 0: output chunk 3"):
        check(doc)


def test_a_group_op_before_the_members_sync_is_named():
    doc = nvls_allreduce(2)
    _ops(doc, 1).insert(0, _ops(doc, 1).pop(5))     # rank 1 does its glres before it syncs
    with pytest.raises(RaceError, match="rank 1 threadblock 0 operation 0 \\(glres\\) reads rank 0's input .* through "
                                        "the switch before anything shows rank 0's call has begun"):
        check(doc)


def test_a_group_op_no_member_waits_for_is_named():
    doc = nvls_allreduce(2)
    for r in (0, 1):
        del _ops(doc, r)[6:]                        # no sync after the glres
    with pytest.raises(RaceError, match="operation 5 \\(glres\\) .* rank [01]'s input .* nothing on rank [01] waits "
                                        "for it"):
        check(doc)


def test_group_ops_on_one_chunk_from_two_ranks_race():
    doc = nvls_allreduce(2)
    for b in ("src_buff", "dst_buff"):
        _ops(doc, 1)[5][b][0]["index"] = 0          # rank 1 reduces chunk 0 too
    with pytest.raises(RaceError, match="race on rank [01]'s input bytes 0..64 .* operation 5 \\(glres\\) writes it "
                                        "and rank [01] threadblock 0 operation 5 \\(glres\\) (reads|writes) it"):
        check(doc)


def test_a_members_own_access_to_a_chunk_the_switch_writes_races():
    doc = nvls_allreduce(2)
    _ops(doc, 0).insert(5, {"name": "copy", "src_buff": [{"type": "i", "index": 1, "size": 1}],
                            "dst_buff": [{"type": "i", "index": 1, "size": 1}]})   # rank 0 touches rank 1's chunk
    with pytest.raises(RaceError, match="race on rank 0's input bytes 64..128 \\(chunk 1"):
        check(doc)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["gpus"][0]["channels"][1].update(buff=d["gpus"][0]["channels"][1].pop("buffer_type")),
     "channels\\[1\\] \\(switch\\): missing field 'buffer_type'"),
    (lambda d: d["gpus"][1]["channels"].pop(), "a switch channel on the input of ranks \\[0, 1\\] that rank 1, a "
                                               "member, does not declare"),
    (lambda d: d["gpus"][0]["channels"][1]["rank_groups"][0].update(ranks=[1, 2]), "are not distinct ranks .* with "
                                                                                   "rank 0 among them"),
    (lambda d: _ops(d, 0)[5]["src_buff"][0].update(switch_channel_id=3), "switch_channel_id 3 is not below"),
    (lambda d: _ops(d, 0)[5].update(name="gstore"), "gstore takes a local source and a switch-channel destination"),
    (lambda d: _ops(d, 0)[5].update(name="copy"), "copy takes no switch-channel operand"),
])
def test_malformed_switch_plans_are_refused_naming_where(change, message):
    doc = nvls_allreduce(2)
    change(doc)
    with pytest.raises(PlanError, match=message):
        check(doc)


def test_a_threadblock_declaring_more_switch_channels_than_the_executor_holds_is_refused():
    doc = nvls_allreduce(2)
    for gpu in doc["gpus"]:
        gpu["channels"] += [_switch_channel("o", [0, 1]) for _ in range(16)]
        gpu["threadblocks"][0]["channels"][1]["channel_ids"] = list(range(17))
    with pytest.raises(RuntimeLimitError, match="rank 0, threadblock 0: channels of one kind declared 17 exceeds the "
                                                "MSCCL\\+\\+ executor's limit MAX_CHANNEL = 16"):
        check(doc)


def test_a_glres_plan_msc_did_not_write_verifies_but_is_not_lifted():
    doc = parse_mscclpp(json.dumps(nvls_allreduce(2)))
    verify_mscclpp(doc)
    with pytest.raises(PlanError, match="operation 5 \\(glres\\): a switch op in a threadblock msc did not write"):
        lift_plan(doc)


def test_mutating_an_exported_switch_plan_gives_msc_errors_only():
    """Every small change to an exported NVLS-tree plan either verifies or
    is refused with an msc error (never a traceback)."""
    base = plan_to_mscclpp(plan_of(CASES[5]))
    refused = 0
    for r, gpu in enumerate(base["gpus"]):
        for t, tb in enumerate(gpu["threadblocks"]):
            for i in range(len(tb["ops"])):
                doc = copy.deepcopy(base)
                del doc["gpus"][r]["threadblocks"][t]["ops"][i]
                try:
                    check(doc)
                except msc.errors.MscError:
                    refused += 1
    assert refused > 40


# -- port channels (through the host proxy) -------------------------------------------------------
def _port(name: str, **more) -> dict:
    return {"name": name, "channel_ids": [0], "channel_type": "port", **more}


def port_allgather() -> dict:
    """Allgather of 2 ranks over port channels: each copies its input into
    its output, signals that it is ready, waits for the peer's ready, puts its
    input into the peer's output with signal and flush (pwsf), and waits for
    the peer's data."""
    gpus = []
    for r in (0, 1):
        put = _port("pwsf", src_buff=[{"type": "i", "index": 0, "size": 1}],
                    dst_buff=[{"buffer_id": 0, "index": r, "size": 1}])
        ops = [{"name": "copy", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                "dst_buff": [{"type": "o", "index": r, "size": 1}]},
               {"name": "nop"}, _port("signal"), _port("wait"), {"name": "nop"}, put, _port("wait"), {"name": "nop"}]
        gpus.append({"id": r, "input_chunks": 1, "output_chunks": 2, "scratch_chunks": 0,
                     "channels": [{"channel_type": "port", "connected_to": [1 - r]}],
                     "remote_buffers": [{"rank": 1 - r, "type": "o", "access_channel_types": ["port"]}],
                     "semaphores": [],
                     "threadblocks": [{"id": 0, "ops": ops, "channels": [{"channel_type": "port", "channel_ids": [0]}],
                                       "remote_buffer_refs": [{"access_channel_type": "port",
                                                               "remote_buffer_ids": [0]}]}]})
    return {"name": "port_allgather", "collective": "allgather", "protocol": "Simple", "inplace": False, "gpus": gpus}


def test_a_port_channel_plan_verifies_with_the_right_results():
    report = check(port_allgather())
    assert report.results_checked and report.num_ranks == 2


def test_a_put_the_sender_never_flushes_is_named():
    doc = port_allgather()
    for r in (0, 1):
        _ops(doc, r)[5]["name"] = "pws"               # signalled but never flushed
    with pytest.raises(RaceError, match="rank [01] threadblock 0's proxy \\(port channel 0\\) operation 5 \\(pws\\) "
                                        "reads rank [01]'s input .* nothing tells rank [01] the transfer is done"):
        check(doc)


def test_a_flush_without_destinations_flushes_nothing_as_in_the_executor():
    """handleFlush flushes op.nOutputs channels: a flush with no dst_buff
    (what MSCCL++'s DSL writes) leaves the transfer unflushed."""
    doc = port_allgather()
    for r in (0, 1):
        _ops(doc, r)[5]["name"] = "pws"
        _ops(doc, r).insert(6, _port("flush"))
    with pytest.raises(RaceError, match="nothing tells rank [01] the transfer is done"):
        check(doc)
    for r in (0, 1):
        _ops(doc, r)[6]["dst_buff"] = [{"buffer_id": 0, "index": r, "size": 1}]
    assert check(doc).results_checked


def test_a_put_signalled_separately_after_it_still_orders_the_data():
    doc = port_allgather()
    for r in (0, 1):
        _ops(doc, r)[5]["name"] = "put"
        _ops(doc, r)[6:6] = [_port("signal"), {**_port("flush"), "dst_buff": [{"buffer_id": 0, "index": r, "size": 1}]}]
    assert check(doc).results_checked


def test_a_put_its_signal_does_not_follow_is_named():
    doc = port_allgather()
    flush = {**_port("flush"), "dst_buff": [{"buffer_id": 0, "index": 0, "size": 1}]}
    _ops(doc, 0)[5:6] = [_port("signal"), {**_ops(doc, 0)[5], "name": "put"}, flush]   # signal pushed before the put
    with pytest.raises(RaceError, match="rank 0 threadblock 0's proxy \\(port channel 0\\) operation 6 \\(put\\) writes "
                                        "rank 1's output .* nothing on rank 1 waits for it"):
        check(doc)


def test_port_channels_pair_by_their_order_between_two_ranks():
    doc = port_allgather()
    osp = parse_mscclpp(json.dumps(doc))
    assert osp.gpus[0].port_channels == (1,) and osp.gpus[0].channels == ()
    assert osp.channel_ordinal(0, 0, port=True) == (1, 0)
    op = osp.gpus[0].threadblocks[0][5]
    assert op.port and op.dsts[0].rank == 1 and op.dsts[0].buffer == "output" and op.dsts[0].remote


@pytest.mark.parametrize("change,message", [
    (lambda d: d["gpus"][0]["remote_buffers"][0].update(access_channel_types=["memory"]),
     "remote buffer 0 \\(rank 1's output\\) is picked for port channels but declares access through memory"),
    (lambda d: _ops(d, 0)[5].update(channel_ids=[1]), "operation 5: port channel id 1 is not below"),
    (lambda d: _ops(d, 0)[5].update(name="re"), "operation 5 \\(re\\): re has no port-channel form"),
])
def test_malformed_port_plans_are_refused_naming_where(change, message):
    doc = port_allgather()
    change(doc)
    with pytest.raises(PlanError, match=message):
        check(doc)


def test_a_port_plan_verifies_but_is_not_lifted():
    with pytest.raises(PlanError, match="operation 2 \\(signal\\) goes through a port channel"):
        lift_plan(parse_mscclpp(json.dumps(port_allgather())))
