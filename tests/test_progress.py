"""Progress on long work (issue 29, part 2): a bar on stderr where stderr is
a terminal (faked here by monkeypatching isatty), nothing at all on a
non-terminal or with --json, and stdout the same either way."""
from __future__ import annotations

import json
import sys

import pytest

from msc import progress
from msc.cli.main import main

TUNE = ["tune", "allreduce/ring", "allreduce/allpairs", "--ranks", "4", "-t", "ring:4", "-b", "1K", "-e", "64K",
        "--instances", "1,2"]
RUN = ["run", "{plan}", "--backend", "sim", "-b", "8", "-e", "1K"]


def msc(capsys, monkeypatch, argv, *, tty: bool) -> tuple[int, str, str]:
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ring_plan(tmp_path, capsys):
    path = tmp_path / "ring.plan"
    assert main(["compile", "allreduce/ring", "--ranks", "4", "-o", str(path)]) == 0
    capsys.readouterr()
    return str(path)


def test_tune_shows_what_it_does_on_a_terminal_only(capsys, monkeypatch):
    code, plain, quiet_err = msc(capsys, monkeypatch, TUNE, tty=False)
    assert code == 0 and quiet_err == ""
    code, shown, err = msc(capsys, monkeypatch, TUNE, tty=True)
    assert code == 0
    assert "msc: tracing, verifying and lowering algorithms" in err
    assert "msc: simulating" in err and "candidates" in err
    assert shown == plain                   # the bars go to stderr and leave stdout as it was


def test_json_output_has_no_progress_even_on_a_terminal(capsys, monkeypatch):
    code, out, err = msc(capsys, monkeypatch, [*TUNE, "--json"], tty=True)
    assert code == 0 and err == ""
    assert json.loads(out)["collective"] == "allreduce"


def test_run_sweep_shows_progress_on_a_terminal_only(capsys, monkeypatch, ring_plan):
    argv = [a.replace("{plan}", ring_plan) for a in RUN]
    code, plain, quiet_err = msc(capsys, monkeypatch, argv, tty=False)
    assert code == 0 and quiet_err == ""
    code, shown, err = msc(capsys, monkeypatch, argv, tty=True)
    assert code == 0 and "msc: running" in err and "checking it against numpy" in err
    assert [line.split()[:2] for line in shown.splitlines()] == [line.split()[:2] for line in plain.splitlines()]


def test_steps_passes_the_items_through_whether_shown_or_not(monkeypatch, capsys):
    items = [3, 1, 2]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert progress.steps(items, "x") is items
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert list(progress.steps(items, "sorting")) == items
    assert "msc: sorting" in capsys.readouterr().err
    with progress.quiet():
        assert not progress.shown() and progress.steps(items, "x") is items
    assert progress.shown()


def test_label_names_the_item_being_worked_on(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert list(progress.steps(["ring", "tree"], "timing", label=lambda x: f"{x} now")) == ["ring", "tree"]
    err = capsys.readouterr().err
    assert "msc: timing" in err and "ring now" in err and "tree now" in err


def test_without_tqdm_a_terminal_gets_a_line_and_the_work(monkeypatch, capsys):
    """The GPU scripts of bench/ run where tqdm is not installed: on a
    terminal msc.progress says what it does and passes the items through."""
    monkeypatch.setitem(sys.modules, "tqdm", None)           # import tqdm raises ImportError
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    items = [1, 2]
    assert progress.steps(items, "compiling", label=str) is items
    assert capsys.readouterr().err == "msc: compiling (no progress bar: tqdm is not installed)\n"


def _numbers_out(text: str) -> list[str]:
    import re

    return [re.sub(r"[0-9.]+", "#", line) for line in text.splitlines()]


def test_bench_script_shows_progress_on_a_terminal_only(monkeypatch, capsys):
    """bench/simulate_speed.py (16 ranks): a bar naming the plan and topology
    on a terminal's stderr, nothing on a non-terminal, stdout alike but for
    the times it measures."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import simulate_speed

    monkeypatch.setattr(sys, "argv", ["simulate_speed.py", "--ranks", "16"])
    seen = {}
    for tty in (False, True):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
        simulate_speed.main()
        seen[tty] = capsys.readouterr()
    assert seen[False].err == ""
    assert "msc: simulating 16-rank plans at 10 sizes" in seen[True].err
    assert "halving_doubling on ib" in seen[True].err
    assert _numbers_out(seen[True].out) == _numbers_out(seen[False].out) and len(seen[True].out.splitlines()) == 4
