"""Files msc writes for its user (issue 14, item 3): `msc import` and `msc
export` never write over the file they read, check everything before they
write, and every plan, XML and plans.json file is written whole or not at
all, so a concurrent reader never sees part of one. Also (item 7): an XML
declaration naming an encoding msc cannot read is refused alike by `msc
verify` and `msc import`."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

import clirun
import msc
from msc.files import same_file, write_output
from msc.lower.pipeline import lower
from msc.formats.plan_text import dump_plan, parse_plan, save_plan
from msc.formats.load import load_plan
from msc.formats.xml_export import plan_to_xml

REPO = Path(__file__).resolve().parent.parent


# in this process (tests/clirun.py); tests/test_cli_processes.py runs each command as a process
def cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return clirun.msc(*args, cwd=cwd)


def ring_plan(n=3):
    [alg] = msc.load_algorithms("allreduce/ring")
    return lower(msc.trace(alg, n))


def ring_xml(tmp: Path, **bounds) -> Path:
    path = tmp / "ring.xml"
    path.write_text(plan_to_xml(ring_plan(), **bounds))
    return path


# -- msc import / export: never over the input, nothing before everything is checked --
@pytest.mark.parametrize("how", ["same path", "another spelling", "symlink", "hard link"])
def test_import_refuses_to_write_over_its_input(tmp_path, how):
    xml = ring_xml(tmp_path)
    before = xml.read_bytes()
    output = {"same path": xml, "another spelling": tmp_path / "." / "ring.xml", "symlink": tmp_path / "link.plan",
              "hard link": tmp_path / "hard.plan"}[how]
    if how == "symlink":
        output.symlink_to(xml)
    elif how == "hard link":
        os.link(xml, output)
    done = cli("import", xml, "-o", output)
    assert done.returncode == 2, done.stderr
    assert "is the file being imported" in done.stderr and done.stdout == ""
    assert xml.read_bytes() == before                # the issue: the plan text overwrote the XML


def test_export_refuses_to_write_over_its_input(tmp_path):
    plan_file = save_plan(ring_plan(), tmp_path / "ring.plan")
    before = plan_file.read_bytes()
    done = cli("export", plan_file, "-o", plan_file)
    assert done.returncode == 2 and "is the plan being exported" in done.stderr
    assert plan_file.read_bytes() == before


def test_import_checks_the_size_range_before_writing(tmp_path):
    """The issue: `msc import` printed "imported ... verified" and wrote the
    plan, then failed on the XML's size range."""
    xml = ring_xml(tmp_path)
    xml.write_text(re.sub(r'maxBytes="\d+"', 'maxBytes="8"', xml.read_text()).replace('minBytes="0"',
                                                                                      'minBytes="64"'))
    output = tmp_path / "ring.plan"
    done = cli("import", xml, "-o", output)
    assert done.returncode == 2 and "selects no size" in done.stderr
    assert done.stdout == "" and not output.exists()


def test_a_failed_import_leaves_the_old_output_alone(tmp_path):
    wrong = re.sub(r"rrcs (\w+\[\d+\]) -> ", "rcs -> ", dump_plan(ring_plan()), count=1)
    xml = tmp_path / "wrong.xml"
    xml.write_text(plan_to_xml(parse_plan(wrong)))
    output = tmp_path / "out.plan"
    output.write_text("the old plan\n")
    done = cli("import", xml, "-o", output)
    assert done.returncode == 1 and "verification failed" in done.stderr
    assert output.read_text() == "the old plan\n" and done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.plan", "wrong.xml"]     # no temporary left


def test_import_then_export_round_trip(tmp_path):
    xml = ring_xml(tmp_path, min_bytes=1024, max_bytes=1 << 20)
    done = cli("import", xml, "-o", tmp_path / "ring.plan")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"imported {xml} -> ") and "1024 <= bytes < 1048576" in done.stderr
    assert load_plan(tmp_path / "ring.plan") == ring_plan()
    done = cli("export", tmp_path / "ring.plan", "-o", tmp_path / "again.xml")
    assert done.returncode == 0, done.stderr
    assert load_plan(tmp_path / "again.xml") == ring_plan()


@pytest.mark.parametrize("encoding", ["bogus", "shift_jis"])
def test_an_unreadable_declared_encoding_is_refused_by_verify_and_import_alike(tmp_path, encoding):
    """The issue: `msc verify` said the XML was fine (exit 0) while `msc
    import` wrote a plan and then raised."""
    xml = tmp_path / "enc.xml"
    xml.write_text(f'<?xml version="1.0" encoding="{encoding}"?>\n' + plan_to_xml(ring_plan()))
    output = tmp_path / "enc.plan"
    for command in (["verify", xml], ["import", xml, "-o", output]):
        done = cli(*command)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert done.stderr.startswith(f"msc: error: {xml}:1: ") and repr(encoding) in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not output.exists()


def test_same_file():
    assert same_file(__file__, Path(__file__).parent / ".." / "tests" / Path(__file__).name)
    assert not same_file(__file__, REPO / "README.md")
    assert not same_file(__file__, REPO / "no such file")


# -- whole or not at all ------------------------------------------------------------
def run_concurrently(write_a, write_b, read, seconds=1.5, writers=2, readers=4) -> tuple[int, list]:
    """Writers alternate two versions of a file while readers read it:
    (reads done, what each reader saw that was neither version)."""
    stop = threading.Event()
    seen, torn, errors = [0], [], []

    def writer():
        try:
            while not stop.is_set():
                write_a()
                write_b()
        except BaseException as exc:            # noqa: BLE001 - reported below
            errors.append(exc)

    def reader():
        try:
            while not stop.is_set():
                bad = read()
                seen[0] += 1
                if bad is not None:
                    torn.append(bad)
        except BaseException as exc:            # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(writers)] + \
              [threading.Thread(target=reader) for _ in range(readers)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    return seen[0], torn


def test_concurrent_readers_never_see_a_torn_plan(tmp_path):
    """The issue: readers loading a plan while it was rewritten saw torn
    files (5,708 of 7,944 loads). save_plan now writes a temporary file and
    renames it: each load gets one whole version."""
    small, large = ring_plan(3), ring_plan(12)
    texts = {dump_plan(small).encode(), dump_plan(large).encode()}
    path = save_plan(small, tmp_path / "ring.plan")

    def read():
        data = path.read_bytes()
        if data not in texts:
            return len(data)
        plan = load_plan(path, verify=False)
        return None if plan in (small, large) else "another plan"

    reads, torn = run_concurrently(lambda: save_plan(small, path), lambda: save_plan(large, path), read)
    assert reads > 50 and torn == []
    assert [p.name for p in tmp_path.iterdir()] == ["ring.plan"]          # no temporary left behind


@pytest.mark.parametrize("what", ["xml", "plans.json"])
def test_concurrent_readers_never_see_a_torn_output(tmp_path, what):
    """The other files msc writes for its user go the same way (msc export's
    XML, msc tune's plans.json)."""
    a = plan_to_xml(ring_plan(3)) if what == "xml" else "[]\n"
    b = plan_to_xml(ring_plan(12)) if what == "xml" else "[" + ", ".join(['{"file": "x.plan"}'] * 3000) + "]\n"
    path = tmp_path / f"out.{what}"
    write_output(path, a)
    versions = {a.encode(), b.encode()}

    def read():
        data = path.read_bytes()
        return None if data in versions else len(data)

    reads, torn = run_concurrently(lambda: write_output(path, a), lambda: write_output(path, b), read)
    assert reads > 50 and torn == []


def test_tune_writes_plans_json_through_write_output(tmp_path, monkeypatch):
    import inspect

    from msc.sim import tune

    source = inspect.getsource(tune.write_plans)
    assert "write_output(" in source and ".write_text(" not in source


def test_write_output_keeps_links_and_permissions(tmp_path):
    target = tmp_path / "real.plan"
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "link.plan"
    link.symlink_to(target)
    write_output(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    write_output(os.devnull, "into a device: written in place\n")        # not renamed over
    assert Path(os.devnull).exists() and not Path(os.devnull).is_file()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "ring.plan"
    path.write_text("old\n")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        save_plan(ring_plan(), path)
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ring.plan"]


def test_a_write_error_names_the_file_asked_for(tmp_path):
    target = tmp_path / "no such folder" / "ring.plan"
    with pytest.raises(FileNotFoundError) as info:
        save_plan(ring_plan(), target)
    assert info.value.filename == str(target)
