"""The CUDA runtime's torchrun bootstrap on the emulated device, as an attacker
of issue 27 found it (items 2, 3, 4 and 9): ranks whose plans differ only in
name met under different keys and hung for 300 s; msc.torch's communicators
ignored the group's timeout and MSC_TORCH_TIMEOUT; a rank signalled during
the bootstrap, or one that timed out there, left its arena in /dev/shm; an
infinite MSC_TORCH_TIMEOUT made every call fail at once."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import bootcases  # noqa: E402
from emu_skip import needs_emu  # noqa: E402
import torchdist  # noqa: E402
from patience import patience  # noqa: E402

from msc.errors import UsageError  # noqa: E402

HERE = Path(__file__).resolve().parent


pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"), needs_emu]


@pytest.fixture(scope="module")
def pool2():
    pool = torchdist.Pool(2, timeout=120)
    yield pool
    pool.close()


# -- MSC_TORCH_TIMEOUT and timeout_s: finite, or refused naming the variable (item 9) -------------------

@pytest.mark.parametrize("text", ["inf", "1e400", "-inf", "nan", "0", "-3", "1e9", "soon"])
def test_msc_torch_timeout_must_be_a_finite_number_of_seconds(monkeypatch, text):
    from msc.torch import agree

    monkeypatch.setenv("MSC_TORCH_TIMEOUT", text)
    with pytest.raises(UsageError, match=f"MSC_TORCH_TIMEOUT must be a number of seconds > 0 and at most 3.1536e"
                                         f"\\+07 \\(a year\\), got '{text}'"):
        agree.timeout_s()


@pytest.mark.parametrize("value", [float("inf"), 1e308, float("nan"), 0, -1, "10", None])
def test_set_timeout_and_the_runtime_refuse_what_is_not_a_finite_time(value):
    from msc.cuda import device as cu
    from msc.torch import agree

    if value is not None:
        with pytest.raises(UsageError, match="the msc.torch timeout must be a number of seconds > 0"):
            agree.set_timeout(value)
    shown = re.escape(repr(value))
    with pytest.raises(UsageError, match=f"timeout_s must be a number of seconds > 0 and at most .*got {shown}"):
        cu.timeout_ns(value)
    assert cu.timeout_ns(2.5) == 2_500_000_000 and agree.timeout_s(3.0) == 3.0


# -- equal plans under other names meet (item 2) --------------------------------------------------------

@pytest.mark.slow          # 10 s of worker start-ups and kernel builds: CI's slow run
def test_ranks_whose_plans_differ_only_in_name_meet(pool2):
    got = pool2.run(bootcases.renamed_plan_case)
    assert [g["values"] for g in got] == [[3.0], [3.0]]
    assert got[0]["name"] != got[1]["name"] and got[0]["prefix"] == got[1]["prefix"]
    assert all(g["seconds"] < 60 for g in got)


# -- a failed bootstrap keeps nothing (items 2 and 4: the timeout path) -------------------------------

def test_a_bootstrap_that_times_out_frees_its_arena_and_leaves_no_file(pool2):
    got = pool2.run(bootcases.different_plans_case, 1.5)
    for g in got:
        assert "which never came" in g["error"] and g["seconds"] < 15, g
        assert g["owned"] == 0 and g["mapped"] == 0 and g["shared"] == 0 and g["files"] == [], g
        assert g["after"] == 2.0, g                 # the ranks' next communicators still meet


def test_close_frees_the_arena_even_when_a_peer_never_joins_the_release(pool2):
    got = pool2.run(bootcases.lone_close_case, 3.0)
    assert [g["sum"] for g in got] == [3.0, 3.0]
    assert "at 'release/1'" in got[0]["error"] and "rank(s) 1" in got[0]["error"], got[0]
    assert all(g["mapped"] == 0 and g["owned"] == 0 for g in got), got


# -- msc.torch takes the group's timeout, or MSC_TORCH_TIMEOUT (item 3) --------------------------------

@pytest.mark.slow          # 10 s of worker start-ups and kernel builds: CI's slow run
def test_msc_torch_communicators_take_the_groups_timeout_or_msc_torch_timeout(pool2):
    got = pool2.run(bootcases.group_timeout_case, 3.0, "2.5")
    for rank, g in enumerate(got):
        assert g["group"] == 3.0 and g["env"] == 2.5 and g["values"] == [3.0], g
        assert g["stall"] != "no error" and g["stall_s"] < patience(30), g
    assert got[0]["stall"].startswith("DeviceTimeoutError") and "3 s" in got[0]["stall"], got[0]


# -- a rank signalled in the bootstrap leaves nothing in /dev/shm (item 4) ------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_rank_signalled_during_the_bootstrap_leaves_nothing(sig, tmp_path):
    init = Path(tempfile.mkdtemp(prefix="msc-boot-")) / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, str(HERE / "bootcases.py"), str(r), str(init)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        line = ranks[0].stdout.readline()
        assert line.strip() == "exchanging", line + ranks[0].stderr.read()
        time.sleep(patience(0.5))                # in the store's wait for rank 1, its arena made and published
        ranks[0].send_signal(sig)
        assert ranks[0].wait(timeout=patience(30)) == -sig
        assert bootcases.leftovers(ranks[0].pid) == []
    finally:
        for p in ranks:
            if p.poll() is None:
                p.terminate()
            p.wait(timeout=patience(30))
            p.stdout.close()
            p.stderr.close()
        for p in ranks:
            for name in bootcases.leftovers(p.pid):          # a failed run must not leave them either
                os.unlink(os.path.join(bootcases.SHM, name))
