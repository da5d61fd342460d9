"""MSCCL++ execution plans: export of every library plan within the
executor's limits, the one-sided checker and executor on plans written here
from the documented format (a race, a deadlock, a wrong result, limits,
what is refused), and the export/import round trip."""
from __future__ import annotations

import copy
import functools
import json
import subprocess
from pathlib import Path

import pytest

import clirun
import msc
from msc.errors import DeadlockError, ExecutionError, PlanError, RaceError, RuntimeLimitError, VerificationError
from msc.formats.diff import diff_plans
from msc.formats.mscclpp.export import plan_to_mscclpp, plan_to_mscclpp_json
from msc.formats.mscclpp.lift import lift_plan
from msc.formats.mscclpp.limits import MAX_OPERATION, check_limits
from msc.formats.mscclpp.reader import parse_mscclpp
from msc.lower.pipeline import LowerOptions, lower
from msc.formats.mscclpp.check import verify_mscclpp
from msc.verification.onesided import verify_onesided
from msc.verification.plan import verify_plan
from library import algorithms, rank_counts

ALGORITHMS = algorithms(switch=False)          # switch plans (NVLS, Simple only): tests/test_mscclpp_channels.py
CASES = [(key, n) for key in ALGORITHMS for n in rank_counts(ALGORITHMS[key], (4, 8))]


@functools.lru_cache(maxsize=None)
def library_plan(key: str, n: int, inplace: bool, protocol: str):
    return lower(msc.trace(ALGORITHMS[key], n, inplace=inplace), LowerOptions(protocol=protocol))


def test_the_cases_cover_the_library_at_4_and_8_ranks():
    assert {key for key, _ in CASES} == set(ALGORITHMS)
    assert {n for _, n in CASES} >= {4, 8}


# -- export and round trip -------------------------------------------------------------------
@pytest.mark.parametrize("key,n", CASES, ids=[f"{k}-{n}" for k, n in CASES])
@pytest.mark.parametrize("protocol", ["Simple", "LL"])
def test_library_plans_export_within_limits_verify_and_come_back_equivalent(key, n, protocol):
    for inplace in (True, False):
        plan = library_plan(key, n, inplace, protocol)
        doc = parse_mscclpp(plan_to_mscclpp_json(plan))
        check_limits(doc)
        report = verify_mscclpp(doc)
        assert report.results_checked and report.num_ranks == plan.num_ranks
        back = lift_plan(doc)
        assert diff_plans(plan, back, equivalent=True) is None
        verify_plan(back)


def test_a_threadblock_over_the_operation_limit_is_spread_over_more():
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 16), LowerOptions())
    steps = max(len(tb.steps) for rp in plan.ranks for tb in rp.threadblocks)
    doc = plan_to_mscclpp(plan)
    gpu = doc["gpus"][0]
    assert 3 * steps > MAX_OPERATION                      # at least a wait, a data op and a signal per step
    assert len(gpu["threadblocks"]) > len(plan.ranks[0].threadblocks)
    assert max(len(tb["ops"]) for tb in gpu["threadblocks"]) <= MAX_OPERATION
    one_sided = parse_mscclpp(json.dumps(doc))
    verify_onesided(one_sided)
    assert diff_plans(plan, lift_plan(one_sided), equivalent=True) is None


def test_ll128_is_refused_naming_the_protocols_it_has():
    plan = library_plan("allreduce/ring:ring", 4, True, "LL128")
    with pytest.raises(PlanError, match="LL128: the MSCCL\\+\\+ executor runs Simple and LL"):
        plan_to_mscclpp(plan)


def test_simple_sends_wait_for_credits_and_the_sender_drains_them():
    plan = library_plan("allreduce/ring:ring", 4, True, "Simple")
    doc = plan_to_mscclpp(plan)
    names = [op["name"] for tb in doc["gpus"][0]["threadblocks"] for op in tb["ops"]]
    assert names.count("signal") and names.count("wait")
    assert "pws" not in names          # pws signals only on port channels: the signal is its own operation
    waits = sum(len(op["channel_ids"]) for tb in doc["gpus"][0]["threadblocks"] for op in tb["ops"]
                if op["name"] == "wait")
    signals = sum(len(op["channel_ids"]) for tb in doc["gpus"][0]["threadblocks"] for op in tb["ops"]
                  if op["name"] == "signal")
    assert waits == signals            # each data signal has its credit back, each credit is waited for


# -- hand-written plans ------------------------------------------------------------------------
def allgather_2() -> dict:
    """A 2-rank allgather: each rank copies its input to its output chunk
    and puts it into the peer's, then signals and waits (the format as
    src/core/executor/execution_plan.cc reads it)."""
    def gpu(r):
        return {"id": r, "input_chunks": 1, "output_chunks": 2, "scratch_chunks": 1,
                "channels": [{"channel_type": "memory", "connected_to": [1 - r]}],
                "remote_buffers": [{"rank": 1 - r, "type": "o", "access_channel_types": ["memory"]}],
                "semaphores": [],
                "threadblocks": [{"id": 0, "channels": [{"channel_type": "memory", "channel_ids": [0]}],
                                  "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0]}],
                                  "ops": [
                    {"name": "copy", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                     "dst_buff": [{"type": "o", "index": r, "size": 1}]},
                    {"name": "put", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                     "dst_buff": [{"buffer_id": 0, "index": r, "size": 1}], "channel_ids": [0],
                     "channel_type": "memory"},
                    {"name": "nop"},
                    {"name": "signal", "channel_ids": [0], "channel_type": "memory"},
                    {"name": "wait", "channel_ids": [0], "channel_type": "memory"},
                    {"name": "nop"},
                    {"name": "copy", "src_buff": [{"type": "o", "index": 1 - r, "size": 1}],
                     "dst_buff": [{"type": "s", "index": 0, "size": 1}]}]}]}
    return {"name": "ag2", "collective": "allgather", "protocol": "Simple", "inplace": False,
            "gpus": [gpu(0), gpu(1)]}


def check(doc: dict):
    return verify_mscclpp(parse_mscclpp(json.dumps(doc)))


def ops(doc, rank):
    return doc["gpus"][rank]["threadblocks"][0]["ops"]


def test_the_hand_written_allgather_verifies():
    report = check(allgather_2())
    assert report.results_checked and report.operations == 14


def test_a_signal_without_a_nop_before_it_races_with_the_peer_reading():
    doc = allgather_2()
    del ops(doc, 0)[2]                  # the nop between rank 0's put and its signal
    with pytest.raises(RaceError, match=r"race on rank 1's output bytes 0\.\.64 .*rank 0 threadblock 0 operation 1 "
                                        r"\(put\) writes it and rank 1 threadblock 0 operation 6 \(copy\) reads it"):
        check(doc)


def test_a_wait_never_signalled_is_a_deadlock_naming_rank_threadblock_and_operation():
    doc = allgather_2()
    del ops(doc, 1)[3]                  # rank 1 no longer signals
    with pytest.raises(DeadlockError, match=r"rank 0 threadblock 0 operation 4 \(wait\): wait 1 on its memory channel from "
                                            r"rank 1 .*signals only 0 time"):
        check(doc)


def test_a_missing_copy_is_a_wrong_result_naming_rank_and_chunk():
    doc = allgather_2()
    del ops(doc, 1)[0]                  # rank 1 never writes its own output chunk
    with pytest.raises(VerificationError, match="wrong result on rank 1: output chunk 1") as err:
        check(doc)
    assert err.value.found == "nothing written"


def test_unbalanced_signals_are_reported_for_the_next_call():
    doc = allgather_2()
    ops(doc, 0).insert(4, {"name": "signal", "channel_ids": [0], "channel_type": "memory"})
    with pytest.raises(ExecutionError, match="rank 0 signals its memory channel 0 to rank 1 2 time.* waits on it 1 time"):
        check(doc)


def test_a_peer_access_nothing_waits_for_is_reported():
    doc = allgather_2()
    for r in (0, 1):
        del ops(doc, r)[6]              # no read after the wait ...
    del ops(doc, 1)[4]                  # ... and rank 1 does not wait: rank 0's put may land after rank 1 ended
    ops(doc, 0)[3:4] = []               # (and rank 0 does not signal, so the counts still balance)
    with pytest.raises(RaceError, match="rank 0 threadblock 0 operation 1 \\(put\\) writes rank 1's output .* nothing "
                                        "on rank 1 waits for it"):
        check(doc)


def test_the_operation_limit_names_the_constant_rank_and_threadblock():
    doc = allgather_2()
    ops(doc, 1).extend({"name": "nop"} for _ in range(MAX_OPERATION))
    with pytest.raises(RuntimeLimitError, match=f"rank 1, threadblock 0: operations .* {MAX_OPERATION + 7} exceeds "
                                                f"the MSCCL\\+\\+ executor's limit MAX_OPERATION = {MAX_OPERATION}"):
        check(doc)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["gpus"][0]["channels"][0].update(channel_type="nvlink"), "channels\\[0\\] is a 'nvlink' channel"),
    (lambda d: ops(d, 1).insert(0, {"name": "glres"}), "operation 0: glres takes a switch-channel source and a "
                                                       "switch-channel destination"),
    (lambda d: ops(d, 1).insert(0, {"name": "flush"}), "operation 0: flush waits for a port channel's proxy"),
    (lambda d: ops(d, 1).insert(2, {"name": "bogus"}), "operation 2: 'bogus' is not an operation of the MSCCL\\+\\+"),
    (lambda d: d.update(protocol="LL128"), "protocol 'LL128': the executor takes Simple or LL"),
])
def test_what_msc_does_not_model_is_refused_by_name(change, message):
    doc = allgather_2()
    change(doc)
    with pytest.raises(PlanError, match=message):
        check(doc)


def test_a_foreign_shape_verifies_but_is_not_read_as_an_msc_plan():
    doc = parse_mscclpp(json.dumps(allgather_2()))
    verify_onesided(doc)
    with pytest.raises(PlanError, match="operation 1 \\(put\\) writes rank 1's output directly \\(zero-copy\\); not in the shape msc's "
                                        "MSCCL\\+\\+ export writes"):
        lift_plan(doc)


# -- the command line ----------------------------------------------------------------------
# in this process (tests/clirun.py); tests/test_cli_processes.py runs each command as a process
def cli(*args, cwd) -> subprocess.CompletedProcess:
    return clirun.msc(*args, cwd=cwd)


def test_export_verify_diff_and_import_on_the_command_line(tmp_path):
    assert cli("compile", "allgather/ring", "--ranks", "4", "-o", "ag.plan", cwd=tmp_path).returncode == 0
    done = cli("export", "ag.plan", "--format", "mscclpp", "-o", "ag.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = cli("verify", "ag.json", cwd=tmp_path)
    assert done.returncode == 0 and "verified MSCCL++ plan" in done.stdout and "outputs right" in done.stdout
    assert cli("diff", "ag.plan", "ag.json", "--equivalent", cwd=tmp_path).returncode == 0
    assert cli("import", "ag.json", "-o", "back.plan", cwd=tmp_path).returncode == 0
    (tmp_path / "bad.json").write_text(json.dumps({**allgather_2(), "gpus": [
        {**allgather_2()["gpus"][0], "threadblocks": [{"id": 0, "ops": [{"name": "wait", "channel_ids": [0]}],
                                                        "channels": [{"channel_type": "memory", "channel_ids": [0]}]}]},
        allgather_2()["gpus"][1]]}))
    done = cli("verify", "bad.json", cwd=tmp_path)
    assert done.returncode == 1 and "deadlock" in done.stderr and "rank 1 threadblock 0 operation 4 (wait)" in done.stderr
    (tmp_path / "ag2.json").write_text(json.dumps(allgather_2()))     # not msc's shape: run in the executor's model
    done = cli("run", "ag2.json", "-b", "128", "-e", "1K", "-d", "half", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)["records"]
    assert [r["size"] for r in records] == [128, 256, 512, 1024] and not any(r["wrong"] for r in records)
    broken = allgather_2()
    del ops(broken, 1)[0]                                                 # rank 1's own chunk never copied
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    done = cli("run", "broken.json", "-b", "128", "-e", "128", "--json", cwd=tmp_path)
    assert done.returncode == 1 and json.loads(done.stdout)["records"][0]["wrong_per_rank"] == [0, 16]
    done = cli("simulate", "ag2.json", "-t", "ring:2", cwd=tmp_path)          # not msc's shape: the one-sided model
    assert done.returncode == 0 and "in the one-sided model (msc.sim.onesided)" in done.stdout, done.stderr
    done = cli("simulate", "ag2.json", "-t", "ring:2", "--model", "lifted", cwd=tmp_path)
    assert done.returncode == 2 and "operation 1 (put) writes rank 1's output directly (zero-copy)" in done.stderr
    done = cli("run", "ag.json", "-o", "max", cwd=tmp_path)
    assert done.returncode == 2 and "allgather" in done.stderr
    done = cli("export", "ag.plan", "--format", "mscclpp", "--runtime", "azure", cwd=tmp_path)
    assert done.returncode == 2 and "--runtime applies to --format msccl-xml" in done.stderr


# -- bad input ------------------------------------------------------------------------------------
def _paths(obj, pre=()):
    yield pre
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, pre + (k,))


def test_mutated_plans_are_refused_with_msc_errors_only():
    """Values of the wrong type or size anywhere in a plan: an MscError naming
    what is wrong, never a Python exception from inside the reader or the model."""
    import random

    from msc.errors import MscError

    rng = random.Random(7)
    bases = [allgather_2(), plan_to_mscclpp(library_plan("allreduce/ring:ring", 4, True, "LL"))]
    values = [None, -1, 0, 3, 1 << 40, "x", "s", [], {}, [1, 2], {"a": 1}, True, 1.5]
    refused = 0
    for _ in range(300):
        doc = copy.deepcopy(rng.choice(bases))
        *parents, last = rng.choice([p for p in _paths(doc) if p])
        holder = functools.reduce(lambda obj, key: obj[key], parents, doc)
        holder[last] = rng.choice(values)
        try:
            check(doc)
        except MscError:
            refused += 1
    assert refused > 150


# -- a custom collective travels with the plan -------------------------------------------------
PAIR_SUM = msc.CustomCollective("pair_sum", input_chunks=1, output_chunks=1,
                                postcondition=lambda r, i, n, k: [(r, 0), ((r + 1) % n, 0)])


@msc.algorithm(PAIR_SUM, inplace=False)
def neighbours(p):
    n = p.num_ranks
    for r in range(n):
        p.chunk(r, "input", 0).copy(r, "output", 0)
    for r in range(n):
        p.chunk(r, "output", 0).reduce(p.chunk((r + 1) % n, "input", 0))


def test_a_custom_collective_is_checked_from_the_contract_the_export_records():
    plan = lower(msc.trace(neighbours, 4), LowerOptions())
    doc = plan_to_mscclpp(plan)
    report = check(doc)
    assert report.results_checked and report.collective == "pair_sum"
    assert diff_plans(plan, lift_plan(parse_mscclpp(json.dumps(doc))), equivalent=True) is None
    for tb in doc["gpus"][2]["threadblocks"]:          # rank 2 no longer adds what rank 3 sends it
        tb["ops"] = [op for op in tb["ops"] if op["name"] not in ("re", "res")]
    with pytest.raises(VerificationError, match="wrong result on rank 2: .* not what pair_sum requires"):
        check(doc)
