"""msc.torch.agree: ranks that make different calls get a clear error on
every rank before any data moves (no garbage, no SIGABRT from gloo, no hang
until the process group's timeout), a rank that does not come is named
within the timeout, and repeated calls build their signature once.

Two gloo worker processes over a TCP store, as torchrun's (tests/torchdist.py
Pool(tcp=True)), started once for the module; the other msc.torch tests run every
call through the same check over a FileStore.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import torchdist  # noqa: E402
from patience import patience  # noqa: E402
from torchdist import library_plan  # noqa: E402

from msc.torch import agree  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
TIMEOUT = 0.5          # the workers' agreement timeout (seconds), where a case waits for it
PATIENT = 30.0         # where none should be waited for: the cases must end long before


@pytest.fixture(scope="module")
def pool():
    saved = os.environ.pop("MSC_DEVICE", None)
    try:
        p = torchdist.Pool(2, timeout=60, tcp=True)        # a TCP store, as under torchrun
    finally:
        if saved is not None:
            os.environ["MSC_DEVICE"] = saved
    yield p
    p.close()
    # the workers destroyed their groups and exited cleanly (a group msc kept alive would abort them at exit)
    assert [proc.exitcode for proc in p.procs] == [0, 0], p.unclean


def test_different_calls_raise_on_every_rank_naming_both_values(pool):
    results = pool.run(torchdist.agree_mismatch_cases, PATIENT)
    expected = {
        "dtype": "dtype: rank 0 float32, rank 1 int32",
        "width": "dtype: rank 0 float32, rank 1 float64",
        "count": "count: rank 0 1024, rank 1 1000",
        "transport": "transport: rank 0 p2p, rank 1 alltoall",
        "op": "op: rank 0 sum, rank 1 max",
        "plan": "plan: rank 0 'ring' #",        # and rank 1 the ring of 2 instances: another plan
        "backend": "backend: rank 0 torch, rank 1 cuda",
    }
    for rank, cases in enumerate(results):
        for name, kind, message, seconds, unchanged in cases:
            if name == "backend" and kind != "DisagreementError":
                # no C++ compiler for the emulated device: rank 1 refuses backend="cuda" and says so
                assert kind == ("BackendUnavailableError" if rank == 1 else "PeerFailedError"), (name, message)
                continue
            assert kind == "DisagreementError", (rank, name, kind, message)
            assert expected[name] in message, (rank, name, message)
            assert "msc call #" in message and "nothing was sent" in message
            assert unchanged, (rank, name, "the tensor changed")          # no garbage
            assert seconds < patience(5), (rank, name, seconds)          # decided at once, not by the timeout
    # both ranks report the same disagreement
    assert [m for _, _, m, _, _ in results[0]] == [m for _, _, m, _, _ in results[1]]


def test_a_call_that_fails_on_one_rank_fails_on_all_at_once(pool):
    (kind0, msg0, dt0), (kind1, msg1, dt1) = pool.run(torchdist.agree_local_failure_case, PATIENT)
    assert kind0 == "NoPlanError" and "no msc plan for allreduce" in msg0
    assert kind1 == "PeerFailedError" and "rank 0: NoPlanError: no msc plan for allreduce" in msg1
    assert dt0 < patience(5) and dt1 < patience(5)            # not the 30 s timeout


def test_a_rank_that_comes_too_late_is_named_and_the_group_goes_on(pool):
    (kind0, msg0, dt0, missing0), (kind1, msg1, dt1, missing1) = pool.run(torchdist.agree_stall_case, TIMEOUT)
    assert kind0 == "AgreementTimeoutError" and missing0 == [1], msg0
    assert f"rank 0 waited {TIMEOUT:g} s" in msg0 and "for rank 1, which did not make the call" in msg0
    assert TIMEOUT <= dt0 < TIMEOUT + patience(0.5)
    assert kind1 == "AgreementTimeoutError" and missing1 == [1]
    assert "rank 1 came to msc call" in msg1 and f"after rank 0 had waited {TIMEOUT} s" in msg1
    assert dt1 < patience(1)               # its record was claimed: it learns at once


def test_a_rank_that_never_comes_is_named_within_the_timeout(pool):
    (kind, msg, dt), _ = pool.run(torchdist.agree_never_case, TIMEOUT)
    assert kind == "AgreementTimeoutError" and "for rank 1, which did not make the call" in msg
    assert TIMEOUT <= dt < TIMEOUT + patience(0.5)


def test_repeated_calls_build_the_signature_once_and_leave_no_records(pool):
    calls = 100
    for r in pool.run(torchdist.agree_repeat_case, calls):
        before, after = r["before"], r["after"]
        assert after["calls"] - before["calls"] == calls              # one digest exchange per call
        assert after["signatures_built"] == before["signatures_built"]  # the signature: built once, cached
        assert after["disagreements"] == before["disagreements"]        # no full exchange
        assert after["deleted"] - before["deleted"] == calls
        assert r["left"] == [after["seq"] - 1]                        # only the last call's record is in the store
        assert r["built_new"] == after["signatures_built"] + 1          # a new count: a new signature


@pytest.mark.slow          # 7-14 s: CI's slow run; the default run stays short
def test_over_a_file_store_too():
    """A FileStore (the other torch.distributed tests' pools) is polled by
    msc, not by its own 10 ms sleeps and whole-second timeouts: the
    timeout holds to well under a second, and repeated calls work."""
    saved = os.environ.pop("MSC_DEVICE", None)
    try:
        p = torchdist.Pool(2, timeout=60)
    finally:
        if saved is not None:
            os.environ["MSC_DEVICE"] = saved
    try:
        (kind, msg, dt, missing), _ = p.run(torchdist.agree_stall_case, 0.5)
        assert kind == "AgreementTimeoutError" and missing == [1], msg
        assert 0.5 <= dt < 0.5 + patience(0.5), dt
        for r in p.run(torchdist.agree_repeat_case, 20):
            assert r["after"]["calls"] - r["before"]["calls"] == 20 and r["left"] == [r["after"]["seq"] - 1]
    finally:
        p.close()


def test_msc_keeps_no_group_alive(pool):
    assert pool.run(torchdist.agree_releases_group_case) == [True, True]


def test_the_check_can_be_turned_off(pool):
    for r in pool.run(torchdist.agree_off_case):      # a worker that never agreed has no gate, so no "calls"
        assert r["after"].get("calls", 0) == r["before"].get("calls", 0)


def test_without_the_store_the_check_runs_as_a_collective(pool):
    for kind, message in pool.run(torchdist.agree_without_store_case):
        assert kind == "DisagreementError" and "count: rank 0 64, rank 1 32" in message


# -- in one process ------------------------------------------------------------------------------------

def test_plan_digest_ignores_the_name_and_source_lines():
    from msc.ir import SourceLine

    ring = library_plan("allreduce/ring:ring", 2, True)
    ranks = tuple(replace(rp, threadblocks=tuple(replace(tb, steps=tuple(replace(s, where=SourceLine("elsewhere.py", 1))
                                                                           for s in tb.steps))
                                              for tb in rp.threadblocks)) for rp in ring.ranks)
    moved = replace(ring, name="renamed", ranks=ranks)
    assert agree.plan_digest(moved) == agree.plan_digest(ring)
    assert agree.plan_digest(library_plan("allreduce/ring:ring", 2, False)) != agree.plan_digest(ring)
    assert agree.plan_digest(library_plan("allreduce/allpairs:allpairs", 3, True)) != \
        agree.plan_digest(library_plan("allreduce/ring:ring", 3, True))
    assert agree.plan_digest(library_plan("allreduce/ring:ring", 2, True, 2)) != agree.plan_digest(ring)


def test_timeout_settings(monkeypatch):
    from msc.errors import UsageError

    monkeypatch.delenv("MSC_TORCH_TIMEOUT", raising=False)
    assert agree.timeout_s(42.0) == 42.0
    monkeypatch.setenv("MSC_TORCH_TIMEOUT", "2.5")
    assert agree.timeout_s() == 2.5
    agree.set_timeout(7)
    try:
        assert agree.timeout_s() == 7.0
    finally:
        agree.set_timeout(None)
    monkeypatch.setenv("MSC_TORCH_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="MSC_TORCH_TIMEOUT"):
        agree.timeout_s()
    with pytest.raises(UsageError):
        agree.set_timeout(0)


def test_rank_lists_are_compact():
    assert agree._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_a_disagreement_groups_ranks_by_value():
    """Four ranks of a subgroup (global ranks 4-7): ranks sharing a value
    are listed together, each with its global rank when alone."""
    g = agree.Gate.__new__(agree.Gate)
    g.world, g.global_ranks, g.name = False, [4, 5, 6, 7], "group '3' (global ranks 4-7)"
    base = [["ring", "ab" * 8], "allreduce", "sum", "float32", 1024, "mixed", "torch", "cpu"]
    values = [list(base) for _ in range(4)]
    values[3][3] = "int32"
    values[1][0] = ["ring", "cd" * 8]
    exc = g._disagreement(values, 7)
    assert isinstance(exc, agree.DisagreementError) and exc.seq == 7
    text = str(exc)
    assert "disagree on msc call #7" in text
    assert "plan: ranks 0, 2-3 'ring' #abababab, rank 1 (global 5) 'ring' #cdcdcdcd" in text
    assert "dtype: ranks 0-2 float32, rank 3 (global 7) int32" in text
    assert set(exc.values) == {"plan", "dtype"} and exc.values["dtype"][3] == "int32"
