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
from library import algorithms, neighbours, rank_counts

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


def _last_credit_nop(ops: list) -> int:
    """The nop between a threadblock's last copy out of a scratch slot and the signal after it (the slot's credit)."""
    return max(i for i in range(1, len(ops) - 1) if ops[i]["name"] == "nop" and ops[i + 1]["name"] == "signal"
               and any(b.get("type") == "s" for b in ops[i - 1].get("src_buff", [])))


@pytest.mark.parametrize("plan", ["ring", "pair_sum"])
def test_a_last_credit_returned_before_the_slot_is_read_races_with_the_next_call(plan):
    """The credit that guards the next call's first writes into a slot: the
    next call runs in the model too, so thread 0 signalling it before the
    other threads finished reading the slot is a race with that call."""
    base = plan_to_mscclpp(library_plan("allreduce/ring:ring", 4, False, "Simple") if plan == "ring"
                           else lower(msc.trace(neighbours, 4), LowerOptions()))
    check(base)
    for r in range(4):
        doc = copy.deepcopy(base)
        tb = next(t for t in doc["gpus"][r]["threadblocks"] if any(b.get("type") == "s" for op in t["ops"]
                                                                      for b in op.get("src_buff", [])))
        i = _last_credit_nop(tb["ops"])
        del tb["ops"][i]
        with pytest.raises(RaceError, match=rf"race on rank {r}'s scratch .* of call 2 writes it and rank {r} "
                                            rf"threadblock \d+ operation {i - 1} \((copy|re|res)\) reads it"):
            check(doc)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["allreduce/ring:ring", "pair_sum", "broadcast/chain:chain", "sendrecv/ring:ring",
                                 "reduce/tree:tree"])
def test_every_single_nop_dropped_from_these_exports_is_refused(key):
    """Simple exports where every nop guards something (elsewhere a nop can
    be redundant: a semaphore released with one acquired before it)."""
    from msc.errors import MscError

    traced = msc.trace(neighbours, 4) if key == "pair_sum" else msc.trace(ALGORITHMS[key], 4, inplace=False)
    base = plan_to_mscclpp(lower(traced, LowerOptions()))
    drops = [(r, t, i) for r, gpu in enumerate(base["gpus"]) for t, tb in enumerate(gpu["threadblocks"])
             for i, op in enumerate(tb["ops"]) if op["name"] == "nop"]
    assert drops
    for r, t, i in drops:
        doc = copy.deepcopy(base)
        del doc["gpus"][r]["threadblocks"][t]["ops"][i]
        with pytest.raises(MscError):
            check(doc)


def test_an_ll_sender_that_hears_nothing_back_would_overwrite_packets_two_calls_on():
    """LL: calls alternate the halves of the double scratch buffer, so the
    call after next writes where this one's packets are; a broadcast's root
    hears nothing from its receivers unless they signal it (the export's
    credit: each receiving threadblock signals first, each sender waits last)."""
    doc = plan_to_mscclpp(library_plan("broadcast/chain:chain", 4, False, "LL"))
    check(doc)
    for gpu in doc["gpus"]:
        for tb in gpu["threadblocks"]:
            assert tb["ops"][-1]["name"] == "wait" or tb["ops"][0]["name"] == "signal"
            tb["ops"] = [op for op in tb["ops"] if op["name"] not in ("signal", "wait")]
    with pytest.raises(RaceError, match=r"race on rank 1's scratch .* rank 0 threadblock 0 operation \d \(ppkt\) of "
                                        r"call 3 writes it"):
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


def _tb0(d, **fields):
    d["gpus"][0]["threadblocks"][0].update(fields)


@pytest.mark.parametrize("change,field", [
    (lambda d: d.update(msc_root=None), "msc_root"),
    (lambda d: d.update(msc_root=[0]), "msc_root"),
    (lambda d: d.update(msc_contract=0), "msc_contract"),
    (lambda d: _tb0(d, msc_channel=[1]), "msc_channel"),
    (lambda d: _tb0(d, msc_tb={"a": 1}), "msc_tb"),
    (lambda d: _tb0(d, msc_group=["x"]), "msc_group"),
    (lambda d: d["gpus"][1].update(msc_scratch="s"), "msc_scratch"),
    (lambda d: d["gpus"][1].update(msc_barrier_channels=[99]), "msc_barrier_channels"),
    (lambda d: d.update(msc_slots="junk"), "msc_slots"),
    (lambda d: d.update(buffer_alignment=float("nan")), "NaN"),
    (lambda d: d.update(buffer_alignment=32), "buffer_alignment"),
])
def test_mistyped_fields_are_one_line_errors_naming_them(change, field, tmp_path, capsys):
    """Each was a Python traceback (msc_root, msc_contract, msc_channel,
    msc_tb, msc_scratch: 7 sites in the model and the lift) or was taken
    as it stood (junk msc_slots, buffer_alignment NaN)."""
    from msc.cli.main import main

    doc = plan_to_mscclpp(library_plan("allreduce/ring:ring", 4, True, "Simple"))
    change(doc)
    (tmp_path / "x.json").write_text(json.dumps(doc))
    for argv in (["verify", "x.json"], ["import", "x.json", "-o", "x.plan"], ["simulate", "x.json", "-t", "ring:4"]):
        assert main([a if not a.startswith("x.") else str(tmp_path / a) for a in argv]) == 2, argv
        err = capsys.readouterr().err
        assert field in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("field,make", [
    ("ops", lambda text, n: text.replace('"ops": [', '"ops": [' + ",".join(['{"name": "nop"}'] * n) + ",", 1)),
    ("channel_ids", lambda text, n: text.replace('"channel_ids": [0]', '"channel_ids": [' + ",".join("0" * n) + "]",
                                                 1)),
    ("msc_slots", lambda text, n: text[:-1] + ', "msc_slots": [' + ",".join("1" * n) + "]}"),
])
def test_a_plan_over_a_limit_is_refused_before_its_values_become_objects(field, make):
    """Six million nops in one threadblock (96 MB, under the 1 GiB file
    limit) took 67 s and 2.7 GB in json.loads before the 64-operation limit
    was checked; the shape is measured first, at a few bytes a byte."""
    import time
    import tracemalloc

    from msc.formats.json_shape import BLOCK

    text = make(json.dumps(allgather_2()), 1_000_000)
    tracemalloc.start()
    start = time.process_time()
    try:
        with pytest.raises(PlanError, match=f"'{field}' at line 1: over 65536 items, more than any execution plan"):
            parse_mscclpp(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.process_time() - start < 5
    assert peak < 3 * len(text) + 64 * BLOCK          # the text as bytes, a block's measures (json.loads: 17x the nops)


def test_the_shape_pass_measures_what_json_reads():
    """Longest container, how many, how deep, against json's own reading, on
    random documents full of quotes, backslashes and brackets in strings,
    measured in blocks of 5 and 64 bytes (a block boundary anywhere)."""
    import random

    import msc.formats.json_shape as shape

    def truth(doc, depth=1):
        if not isinstance(doc, (list, dict)):
            return 0, 0, 0
        inner = [truth(v, depth + 1) for v in (doc if isinstance(doc, list) else doc.values())]
        return (max([len(doc)] + [i[0] for i in inner]), 1 + sum(i[1] for i in inner),
                max([depth] + [i[2] for i in inner]))

    def passes(data, key, limit):
        try:
            shape.check_shape(data, **{"max_items": 1 << 30, "max_containers": 1 << 30, "max_depth": 1 << 30,
                                       key: limit})
            return True
        except shape.ShapeError:
            return False

    rng = random.Random(5)
    leaves = [1, 'a\\"b[', "x\\", "]},", True, None, 2.5, "", '\\\\\\"{', "\\"]

    def doc(depth=0):
        r = rng.random()
        if depth > 4 or r < 0.3:
            return rng.choice(leaves)
        if r < 0.65:
            return [doc(depth + 1) for _ in range(rng.randrange(6))]
        return {f'k{i}"[': doc(depth + 1) for i in range(rng.randrange(6))}

    block = shape.BLOCK
    try:
        for _ in range(8):
            d = [doc(1) for _ in range(3)]
            data = json.dumps(d, indent=rng.choice([None, 1])).encode()
            for shape.BLOCK in (5, 64):
                for key, value in zip(("max_items", "max_containers", "max_depth"), truth(d)):
                    assert passes(data, key, value) and not passes(data, key, value - 1), (key, value, data)
    finally:
        shape.BLOCK = block


@pytest.mark.slow
def test_every_msc_field_of_every_wrong_type_is_an_msc_error():
    """The executor's settings and every msc_* field of four exports (ring
    Simple and LL, pair-sum, NVLS), each set to 14 wrong values: an MscError
    or a plan that reads, verifies, lifts (or is refused by name) and
    simulates, never another exception."""
    from msc.errors import MscError
    from msc.sim.onesided import OneSidedSimulator
    from msc.sim.presets import get_topology

    bases = [plan_to_mscclpp(library_plan("allreduce/ring:ring", 4, False, p)) for p in ("Simple", "LL")]
    bases += [plan_to_mscclpp(lower(msc.trace(neighbours, 4), LowerOptions())),
              plan_to_mscclpp(lower(msc.trace(algorithms()["allreduce/nvls:nvls"], 4), LowerOptions()))]
    values = [None, -1, 0, 1.5, "x", "", [], [1], [[0]], {}, {"a": 1}, True, 2**70, float("nan")]
    top = ["buffer_alignment", "num_threads_per_block", "min_message_size", "max_message_size", "reuse_resources",
           "msc_slots", "msc_root", "msc_chunk_factor", "msc_tile", "msc_instances", "msc_contract"]

    def holders(doc):
        yield from ((doc, k) for k in top)
        yield from ((doc["gpus"][1], k) for k in ("msc_scratch", "msc_barrier_channels"))
        for tb in doc["gpus"][1]["threadblocks"][:2]:
            yield from ((tb, k) for k in ("msc_tb", "msc_channel", "msc_part", "msc_group"))

    tried = 0
    for base in bases:
        for i in range(sum(1 for _ in holders(base))):
            for value in values:
                doc = copy.deepcopy(base)
                holder, key = list(holders(doc))[i]
                holder[key] = value
                tried += 1
                try:
                    osp = parse_mscclpp(json.dumps(doc))
                    verify_mscclpp(osp)
                    try:
                        lift_plan(osp)
                    except PlanError:
                        pass
                    OneSidedSimulator(osp, get_topology("ring:4", 4)).run([1 << 16])
                except MscError:
                    pass
    assert tried > 1000


# -- a custom collective travels with the plan -------------------------------------------------
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
