"""Every ``msc`` command once as a real process (``python -m msc.cli``): the exit
status a shell sees (0 ok, 1 verification failed or plans differ, 2 bad input)
and what it prints, with no traceback. What the commands do is tested in this
process (tests/clirun.py), where a command costs its work, not a Python start
and numpy's, ml_dtypes' and torch's imports."""
from __future__ import annotations

import pytest

import msc
from clirun import msc_process
from library import algorithms
from msc.formats.plan_text import save_plan
from msc.formats.xml_export import plan_to_xml
from msc.lower.pipeline import LowerOptions, lower

FORGETS = '''
import msc


@msc.algorithm("allgather", inplace=False)
def forgets(p):
    """Every rank's chunk to every rank but the last."""
    n = p.num_ranks
    for r in range(n):
        for j in range(n - 1):
            p.chunk(r, "input", 0).copy(j, "output", r)
'''

# (command words, exit status, text it prints); the files are made below
CASES = [
    (["list"], 0, "allreduce/ring"),
    (["verify", "forgets.py", "-n", "3"], 1, "verification failed"),
    (["compile", "allreduce/rign", "-n", "4"], 2, "did you mean 'allreduce/ring'"),
    (["export", "ring.plan", "--format", "mscclpp", "-o", "ring.json"], 0, "ring.json"),
    (["import", "ring.xml", "-o", "back.plan"], 0, "imported ring.xml -> back.plan"),
    (["diff", "ring.plan", "ll.plan"], 1, "differ: protocol: Simple in ring.plan, LL in ll.plan"),
    (["run", "ring.plan", "-b", "64", "-e", "1K"], 0, "Out of bounds values : 0 OK"),
    (["bench", "ring.plan", "--backend", "emu", "-d", "int64"], 2, "no data type 'int64'"),
    (["simulate", "ring.plan", "-t", "ring:4"], 0, "busbw"),
    (["tune", "allreduce/ring", "-n", "4", "-t", "nowhere"], 2, "unknown topology 'nowhere'"),
    (["show", "ring.plan", "--png", "out.txt"], 2, "cannot write out.txt"),
    (["bound", "allreduce", "-t", "ib:2", "-b", "1K", "-e", "1K"], 0, "msc bound allreduce"),
    (["synthesize", "allreduce", "-t", "ring:3", "-o", "ring3.txt"], 2, "name it FILE.py"),
    (["calibrate", "bad_perf.txt", "-t", "dgx-h100", "-o", "mine.toml"], 2, "bad_perf.txt:3"),
]


def test_every_command_is_a_case():
    from msc.cli.main import build_parser

    [commands] = [a for a in build_parser()._actions if a.dest == "command"]
    assert sorted(case[0][0] for case in CASES) == sorted(commands.choices)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-processes")
    ring = algorithms()["allreduce/ring:ring"]
    simple = lower(msc.trace(ring, 4), LowerOptions())
    save_plan(simple, folder / "ring.plan")
    save_plan(lower(msc.trace(ring, 4), LowerOptions(protocol="LL")), folder / "ll.plan")
    (folder / "ring.xml").write_text(plan_to_xml(simple))
    (folder / "forgets.py").write_text(FORGETS)
    (folder / "bad_perf.txt").write_text("# Collective test starting: all_reduce_perf\n#\n"
                                         "        1024           256     float     sum      -1    eleven\n")
    return folder


@pytest.mark.parametrize("words, status, text", CASES, ids=[case[0][0] for case in CASES])
def test_the_command_as_a_process(words, status, text, files):
    if words[0] == "show":
        pytest.importorskip("matplotlib")
    done = msc_process(*words, cwd=files)
    assert done.returncode == status, (done.stdout[-2000:], done.stderr[-2000:])
    assert text in done.stdout + done.stderr, (done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    if status == 2:
        assert done.stderr.startswith("msc: error: ") and done.stderr.count("\n") == 1, done.stderr
