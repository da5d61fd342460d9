"""msc.verification.cache: a plan text this msc verified before is not verified again
on load; any change to the text, to msc, or to the collective verifies.

An entry vouches only for what it names (this text, this msc, this
collective) under the cache's key: forged, garbage, torn or borrowed entries
are misses, a process whose verifier functions were replaced records
nothing, and no symbolic link in the cache is followed (issue 14, item 1).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import msc
import msc.dsl.collectives
import msc.lower.pipeline
import msc.verification.plan
from msc.verification import cache as verified
from msc.errors import VerificationError
from msc.lower.pipeline import lower
from msc.formats.plan_text import dump_plan, save_plan
from msc.formats.load import load_plan

REPO = Path(__file__).resolve().parent.parent
VERIFY_CODE = getattr(msc.verification.plan.verify_plan, "__wrapped__", msc.verification.plan.verify_plan).__code__


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """(tmp folder, the names of the plans loading verified: verify_plan
    called from msc.formats.load). The calls are counted by a profile hook, not
    by replacing verify_plan: a replaced verifier is exactly what
    msc.verification.cache refuses to record for."""
    monkeypatch.setenv("MSC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MSC_VERIFY_CACHE", raising=False)
    monkeypatch.setattr(verified._STATE, "warned", set())       # each test sees its warnings
    verified.msc_digest.cache_clear()       # msc's sources as the subprocesses of this test see them
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is VERIFY_CODE:
            caller = frame.f_back
            while caller is not None and caller.f_globals.get("__name__") == "msc.perf":     # pause_gc
                caller = caller.f_back
            if caller is not None and caller.f_globals.get("__name__") == "msc.formats.load":
                calls.append(frame.f_locals["plan"].name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    yield tmp_path, calls
    sys.setprofile(previous)


def ring_plan(n=4):
    [alg] = msc.load_algorithms("allreduce/ring")
    return lower(msc.trace(alg, n))


def entries(tmp) -> list[Path]:
    folder = tmp / "cache" / "verified"
    return sorted(p for p in folder.iterdir() if re.fullmatch("[0-9a-f]{64}", p.name)) if folder.is_dir() else []


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
    with pytest.warns(verified.CacheWarning):        # a replaced function of msc.verification.cache: nothing recorded
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
    collective = msc.dsl.collectives.get_collective("allreduce")
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


# -- issue 14, item 1: forged, garbage and borrowed entries ---------------------
def wrong_plan_file(tmp) -> Path:
    path = tmp / "wrong.plan"
    path.write_text(wrong_plan_text())
    return path


def entry_names(text: bytes) -> list[str]:
    """Where an entry for ``text`` (a ring allreduce plan) is looked up now,
    and where the old cache looked (an empty file named by a SHA-256 anyone
    can compute: the forgery of the issue)."""
    old = hashlib.sha256()
    for part in (verified.msc_digest(), "plan", "allreduce"):
        old.update(part.encode())
        old.update(b"\0")
    old.update(text)
    return [hashlib.sha256(verified._body(text, "plan", "allreduce", None)).hexdigest(), old.hexdigest()]


def make_cache(tmp) -> Path:
    """A cache with its key (a verified plan saved once)."""
    save_plan(ring_plan(), tmp / "good.plan", verified=True)
    return tmp / "cache" / "verified"


@pytest.mark.parametrize("content", [b"", b"garbage\n" * 3, os.urandom(300)], ids=["empty", "garbage", "random"])
def test_a_forged_entry_is_a_miss(cache, content):
    """An empty (or garbage) file at the entry's name no longer passes a
    wrong allreduce: load_plan verifies it and fails."""
    tmp, calls = cache
    folder = make_cache(tmp)
    path = wrong_plan_file(tmp)
    for name in entry_names(path.read_bytes()):
        (folder / name).write_bytes(content)
    with pytest.raises(VerificationError):
        load_plan(path)
    assert calls == ["ring"]


def test_forged_entries_pass_no_command_or_registry(cache):
    """The commands of the issue (export, simulate) and the msc.torch
    registry all verify a wrong allreduce despite a forged entry."""
    tmp, _ = cache
    folder = make_cache(tmp)
    path = wrong_plan_file(tmp)
    for name in entry_names(path.read_bytes()):
        (folder / name).write_bytes(b"")
    for command in (["export", path, "-o", tmp / "out.xml"], ["simulate", path, "--topology", "nvswitch"]):
        done = subprocess.run([sys.executable, "-m", "msc.cli", *map(str, command)], cwd=REPO, capture_output=True,
                              text=True, env=os.environ.copy())
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "verification failed" in done.stderr
    assert not (tmp / "out.xml").exists()
    from msc.formats.registry import PlanRegistry

    with pytest.raises(VerificationError):
        PlanRegistry.from_files([path])


def test_an_entry_for_another_text_is_a_miss(cache):
    """A genuine entry copied to the name a wrong text looks up: the entry
    names the digest of the text it vouches for, so it does not vouch for this one."""
    tmp, calls = cache
    folder = make_cache(tmp)
    [genuine] = entries(tmp)
    path = wrong_plan_file(tmp)
    target = folder / entry_names(path.read_bytes())[0]
    target.write_bytes(genuine.read_bytes())
    with pytest.raises(VerificationError):
        load_plan(path)


def test_an_entry_made_with_another_key_is_a_miss(cache):
    """Someone who can write the cache but not read its key computes every
    field of an entry; the MAC under a key of their own does not pass."""
    tmp, calls = cache
    folder = make_cache(tmp)
    path = wrong_plan_file(tmp)
    text = path.read_bytes()
    body = verified._body(text, "plan", "allreduce", None)
    forged = body + b"mac " + hmac.new(b"\0" * 32, body, "sha256").hexdigest().encode() + b"\n"
    (folder / hashlib.sha256(body).hexdigest()).write_bytes(forged)
    with pytest.raises(VerificationError):
        load_plan(path)


def test_an_entry_holds_what_it_vouches_for(cache):
    tmp, _ = cache
    make_cache(tmp)
    [entry] = entries(tmp)
    text = (tmp / "good.plan").read_bytes()
    lines = entry.read_text().splitlines()
    assert lines[0] == verified.FORMAT
    assert f"msc {verified.msc_digest()}" in lines
    assert f"text {hashlib.sha256(text).hexdigest()}" in lines
    assert 'collective "allreduce"' in lines and 'reader "plan"' in lines
    assert re.fullmatch("mac [0-9a-f]{64}", lines[-1])
    for cut in (1, len(entry.read_bytes()) // 2, len(entry.read_bytes()) - 1):    # a torn entry is a miss
        whole = entry.read_bytes()
        entry.write_bytes(whole[:cut])
        assert not verified.known(text, "plan", "allreduce")
        entry.write_bytes(whole)
        assert verified.known(text, "plan", "allreduce")


def test_the_key_is_private_and_a_shared_key_is_refused(cache):
    tmp, calls = cache
    folder = make_cache(tmp)
    key = folder / verified.KEY
    assert key.stat().st_mode & 0o777 == 0o600 and folder.stat().st_mode & 0o777 == 0o700
    assert load_plan(tmp / "good.plan") and calls == []
    key.chmod(0o644)                  # others could read it: entries made with it prove nothing
    with pytest.warns(verified.CacheWarning, match="not a key only this user"):
        load_plan(tmp / "good.plan")
    assert calls == ["ring"]


# -- a replaced verifier records nothing ------------------------------------------
def test_a_replaced_plan_verifier_records_nothing(cache, monkeypatch):
    tmp, calls = cache
    path = wrong_plan_file(tmp)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(msc.verification.plan, "verify_plan", lambda plan, **kw: None)
        with pytest.warns(verified.CacheWarning, match="msc.verification.plan.verify_plan"):
            load_plan(path)               # this process chose to believe it ...
    assert entries(tmp) == []
    with pytest.raises(VerificationError):
        load_plan(path)                   # ... later ones do not


@pytest.mark.parametrize("how", ["module attribute", "code", "class method", "package attribute", "table"])
def test_replacements_that_stop_recording(cache, how):
    tmp, _ = cache
    plan = ring_plan()
    with pytest.MonkeyPatch.context() as patch:
        if how == "module attribute":
            patch.setattr(msc.lower.pipeline, "verified_with_fewest_slots", lambda plan, collective: plan)
        elif how == "code":           # the function object stays, its code does not
            inner = msc.verification.plan.verify_plan.__wrapped__
            patch.setattr(inner, "__code__", (lambda plan, **kw: None).__code__)
        elif how == "class method":
            patch.setattr(msc.dsl.collectives.AllReduce, "postcondition", lambda self, *a: None)
        elif how == "package attribute":
            patch.setattr(msc, "verify", lambda program, **kw: None)
        else:
            patch.setitem(msc.dsl.collectives.BUILTIN, "allreduce", msc.dsl.collectives.BUILTIN["allgather"])
        assert verified.replaced()
        with pytest.warns(verified.CacheWarning, match="not recording"):
            save_plan(plan, tmp / "ring.plan", verified=True)
        assert entries(tmp) == []
    assert verified.replaced() == []
    save_plan(plan, tmp / "ring.plan", verified=True)
    assert len(entries(tmp)) == 1


def test_nothing_is_replaced_in_an_ordinary_process():
    assert verified.replaced() == []
    code = "import msc, msc.formats.plan_text, msc.formats.xml_import, msc.verification.program_verifier_fast; from msc.verification import cache as verified; print(verified.replaced())"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr


EVIL = '''
import msc
import msc.lower.pipeline

class Report:
    name, collective, num_ranks, ops, chunk_ops, output_chunks, seconds = "nothing", "allreduce", 4, 0, 0, 0, 0.0

msc.verify = lambda program, **kw: Report()                            # the program verifier says yes
msc.lower.pipeline.verified_with_fewest_slots = lambda plan, collective: plan   # and so does lowering's plan verifier

@msc.algorithm("allreduce", chunk_factor=1)
def nothing(p: msc.Program):
    for r in range(p.num_ranks):
        p.chunk(r, "input", 0).copy(r, "scratch", 0)
'''


def test_an_algorithm_file_that_replaces_the_verifiers_gets_nothing_recorded(cache):
    """The issue's reproducer: `msc compile` of a file that monkeypatches
    msc.verify and the plan verifier wrote a do-nothing allreduce and
    recorded it as verified, so every later process trusted it."""
    tmp, calls = cache
    evil = tmp / "evil.py"
    evil.write_text(EVIL)
    plan_file = tmp / "nothing.plan"
    done = subprocess.run([sys.executable, "-m", "msc.cli", "compile", str(evil), "--ranks", "4", "-o", str(plan_file)],
                          cwd=REPO, capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr           # the process believes itself ...
    assert "not recording verified plans" in done.stderr
    assert "msc.lower.pipeline.verified_with_fewest_slots" in done.stderr
    assert entries(tmp) == []
    with pytest.raises(VerificationError, match="holds the wrong contributions"):
        load_plan(plan_file)                          # ... no other process does
    done = subprocess.run([sys.executable, "-m", "msc.cli", "export", str(plan_file)], cwd=REPO,
                          capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 1


# -- no symbolic links ----------------------------------------------------------
def test_a_symlinked_cache_dir_is_not_followed(cache, monkeypatch):
    tmp, calls = cache
    target = tmp / "elsewhere"
    target.mkdir()
    link = tmp / "link"
    link.symlink_to(target, target_is_directory=True)
    monkeypatch.setenv("MSC_CACHE_DIR", str(link))
    with pytest.warns(verified.CacheWarning, match="symbolic link"):
        path = save_plan(ring_plan(), tmp / "ring.plan", verified=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # once: no second warning
        load_plan(path)
        load_plan(path)
    assert list(target.iterdir()) == []              # nothing created where the link points
    assert calls == ["ring", "ring"]


@pytest.mark.parametrize("part", ["verified", "key", "entry"])
def test_a_symlink_under_the_cache_root_is_not_followed(cache, part):
    tmp, calls = cache
    folder = make_cache(tmp)
    [entry] = entries(tmp)
    good = tmp / "good.plan"
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    if part == "verified":
        folder.rename(elsewhere / "verified")
        folder.symlink_to(elsewhere / "verified", target_is_directory=True)
    else:
        moved = elsewhere / part
        (folder / verified.KEY if part == "key" else entry).rename(moved)
        (folder / verified.KEY if part == "key" else entry).symlink_to(moved)
    with pytest.warns(verified.CacheWarning, match="symbolic link"):
        load_plan(good)
    assert calls == ["ring"]
    before = sorted(p.name for p in elsewhere.rglob("*"))
    load_plan(good)
    assert sorted(p.name for p in elsewhere.rglob("*")) == before     # nothing written through the link


def test_concurrent_first_uses_share_one_key(cache):
    """Processes that make the cache at once agree on one key (the first
    link wins), so every entry they write stays valid."""
    tmp, _ = cache
    code = ("import sys; from msc.verification import cache as verified; verified.remember(sys.argv[1].encode(), 'plan', 'allreduce');"
            "print(verified.known(sys.argv[1].encode(), 'plan', 'allreduce'))")
    procs = [subprocess.Popen([sys.executable, "-c", code, f"text {i}"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=os.environ.copy()) for i in range(6)]
    assert [p.communicate()[0].strip() for p in procs] == ["True"] * 6
    assert all(verified.known(f"text {i}".encode(), "plan", "allreduce") for i in range(6))
