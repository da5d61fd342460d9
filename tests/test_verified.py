"""msc.verified: a plan text this msc verified before is not verified again
on load; any change to the text, to msc, or to the collective verifies."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import msc
import msc.plan_verify
from msc import verified
from msc.errors import VerificationError
from msc.lower import lower
from msc.plan_text import dump_plan, load_plan, save_plan

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MSC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MSC_VERIFY_CACHE", raising=False)
    calls = []
    real = msc.plan_verify.verify_plan

    def counting(plan, **kw):
        calls.append(plan.name)
        return real(plan, **kw)

    monkeypatch.setattr(msc.plan_verify, "verify_plan", counting)
    return tmp_path, calls


def ring_plan(n=4):
    [alg] = msc.load_algorithms("allreduce/ring")
    return lower(msc.trace(alg, n))


def test_msc_compile_remembers_so_loading_does_not_verify_again(cache):
    tmp, calls = cache
    plan_file = tmp / "ring.plan"
    done = subprocess.run([sys.executable, "-m", "msc.cli", "compile", "algorithms/allreduce/ring.py", "--ranks", "4",
                           "-o", str(plan_file)], cwd=REPO, capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert load_plan(plan_file).num_ranks == 4
    assert calls == []


def test_load_verifies_once_then_remembers(cache):
    tmp, calls = cache
    path = save_plan(ring_plan(), tmp / "ring.plan")            # not marked verified
    load_plan(path)
    load_plan(path)
    assert calls == ["ring"]


def test_a_changed_text_verifies_again(cache):
    tmp, calls = cache
    path = save_plan(ring_plan(), tmp / "ring.plan", verified=True)
    load_plan(path)
    assert calls == []
    path.write_text(path.read_text() + "# edited\n")        # one comment more: another text
    load_plan(path)
    assert calls == ["ring"]


def test_another_msc_verifies_again(cache, monkeypatch):
    tmp, calls = cache
    path = save_plan(ring_plan(), tmp / "ring.plan", verified=True)
    monkeypatch.setattr(verified, "msc_digest", lambda: "the digest of another msc")
    load_plan(path)
    assert calls == ["ring"]


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    tmp, calls = cache
    path = save_plan(ring_plan(), tmp / "ring.plan", verified=True)
    monkeypatch.setenv("MSC_VERIFY_CACHE", "0")
    load_plan(path)
    load_plan(path)
    assert calls == ["ring", "ring"]


def test_a_collective_object_is_never_cached(cache):
    tmp, calls = cache
    plan = ring_plan()
    path = save_plan(plan, tmp / "ring.plan", verified=True)
    collective = msc.collectives.get_collective("allreduce")
    load_plan(path, collective=collective)
    load_plan(path, collective=collective)
    assert len(calls) == 2


def wrong_plan_text() -> str:
    """The 3-rank ring with its first rrcs turned into rcs: it forwards the
    partial sum without adding its own input (parses, fails verification)."""
    text = dump_plan(ring_plan(3))
    wrong = re.sub(r"rrcs (\w+\[\d+\]) -> ", "rcs -> ", text, count=1)
    assert wrong != text
    return wrong


def test_a_plan_that_fails_is_never_remembered(cache):
    tmp, calls = cache
    path = tmp / "wrong.plan"
    path.write_text(wrong_plan_text())
    for _ in range(2):
        with pytest.raises(VerificationError):
            load_plan(path)
    assert len(calls) == 2
    assert not (tmp / "cache" / "verified").exists() or not any((tmp / "cache" / "verified").iterdir())


def test_an_unwritable_cache_costs_only_the_second_verification(cache, monkeypatch):
    tmp, calls = cache
    blocker = tmp / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("MSC_CACHE_DIR", str(blocker))
    path = save_plan(ring_plan(), tmp / "ring.plan", verified=True)
    load_plan(path)
    load_plan(path)
    assert len(calls) == 2
