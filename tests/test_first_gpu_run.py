"""bench/first_gpu_run.py's budget, record and signals (bench/budgeted.py), the wheels it carries
(bench/carry.py), and the real script through its one-command wrapper on the emulated device with
a budget too small for its work: whatever stops a run, it ends in time and says what it proved.

The runner's cases use fake stages in a driver process of their own (they install signal handlers,
an alarm and a watchdog that may end the process); times asserted are the run's own clock against
its budget, with margins far above what loading the machine adds to an alarm's delivery."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from patience import patience

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import budgeted                     # noqa: E402
import carry                        # noqa: E402

STATUSES = {"pass", "fail", "capped", "interrupted", "not run"}

DRIVER = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from budgeted import Record, Runner, StageSpec

    mode, out, budget = sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])

    def quick(stage):
        stage.case("quick", lambda: "done")

    def swallows_exceptions(stage):
        def spin():
            while True:
                try:
                    time.sleep(0.02)
                except Exception:            # what a careless case does: the alarm is no Exception
                    pass
        stage.case("spins, swallowing every Exception", spin)

    def wraps_the_alarm(stage):
        def spin():
            try:
                while True:
                    time.sleep(0.02)
            except BaseException as exc:     # as msc's tracer does with what user code raises
                raise RuntimeError("wrapped") from exc
        stage.case("turns the alarm into an Exception", spin)

    def sleeps(stage):
        print("sleeping", flush=True)
        stage.case("sleeps", time.sleep, 120)

    def swallows_everything(stage):
        def spin():
            while True:
                try:
                    time.sleep(0.02)
                except BaseException:        # hostile: nothing reaches the runner
                    pass
        stage.case("swallows even the alarm", spin)

    bodies = {"budget": [("first", quick, 0.5, 1.0), ("greedy", swallows_exceptions, 1.0, 1.5),
                         ("wrapper", wraps_the_alarm, 0.5, 1.0), ("after", quick, 0.5, 1.0)],
              "signal": [("first", quick, 0.5, 1.0), ("sleeper", sleeps, 1.0, 60.0), ("never", quick, 0.5, 1.0)],
              "hang": [("hostile", swallows_everything, 1.0, 60.0), ("never", quick, 0.5, 1.0)]}[mode]
    record = Record(out, {"mode": mode}, lambda data: json.dumps(data["stages"]))
    runner = Runner(record, budget, log=lambda line: print(line, flush=True), hang_s=2.0)
    ended = runner.run([StageSpec(*b) for b in bodies])
    data = runner.finish(ended)
    sys.exit(128 + 15 if ended == "SIGTERM" else 0 if data["passed"] else 1)
''')


def drive(tmp_path, mode: str, budget: float, *, term_after: str | None = None):
    """The driver in a process of its own; with ``term_after``, SIGTERM once that line is printed.
    Returns (exit code, summary.json, cases.jsonl's records)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    child = subprocess.Popen([sys.executable, str(script), str(BENCH), mode, str(tmp_path), str(budget)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in child.stdout:
        lines.append(line)
        if term_after is not None and line.strip() == term_after:
            time.sleep(0.2)
            child.send_signal(signal.SIGTERM)
    code = child.wait(timeout=patience(600))
    summary = json.loads((tmp_path / "summary.json").read_text())
    cases = [json.loads(line) for line in (tmp_path / "cases.jsonl").read_text().splitlines()]
    return code, summary, cases, "".join(lines)


def test_stage_caps_give_each_stage_its_most_while_later_stages_keep_their_least():
    specs = [budgeted.StageSpec(name, None, lo, hi) for name, lo, hi in (("a", 10, 40), ("b", 60, 150),
                                                                          ("c", 20, 60))]
    assert budgeted.stage_cap(specs, 0, 480) == 40                      # ample: its most
    assert budgeted.stage_cap(specs, 0, 100) == 20                      # 100 - 80 for the later ones
    assert budgeted.stage_cap(specs, 0, 45) == pytest.approx(5.0)       # short: in proportion to the least
    assert budgeted.stage_cap(specs, 2, 30) == 30 and budgeted.stage_cap(specs, 2, 90) == 60
    for left in (1, 7, 45, 90, 300, 1000):                              # never more than the run has left
        assert all(0 <= budgeted.stage_cap(specs, i, left) <= left for i in range(3))


def test_a_stage_that_swallows_exceptions_is_cut_off_and_the_run_ends_in_its_budget(tmp_path):
    code, summary, cases, log = drive(tmp_path, "budget", 4.0)
    assert code == 1, log
    stages = summary["stages"]
    assert [stages[s]["status"] for s in ("first", "greedy", "wrapper", "after")] == \
        ["pass", "capped", "capped", "pass"], stages
    assert summary["ended"] == "finished" and summary["complete"] and not summary["passed"]
    assert summary["seconds"] <= 4.0 + patience(2.0), summary     # the run's own clock against its budget
    for name in ("greedy", "wrapper"):                            # cut off, not failed, even when wrapped
        cut = [c for c in cases if c["stage"] == name]
        assert len(cut) == 1 and cut[0]["cut"] == "Capped" and cut[0]["ok"] is None, cut
    assert [c["case"] for c in cases if c["stage"] == "after"] == ["quick"]


def test_sigterm_mid_run_writes_the_summary_and_exits_with_the_signal(tmp_path):
    code, summary, cases, log = drive(tmp_path, "signal", 60.0, term_after="sleeping")
    assert code == 128 + signal.SIGTERM, log
    assert summary["ended"] == "SIGTERM" and not summary["complete"] and not summary["passed"]
    stages = summary["stages"]
    assert (stages["first"]["status"], stages["sleeper"]["status"], stages["never"]["status"]) == \
        ("pass", "interrupted", "not run")
    assert summary["seconds"] < patience(30), summary             # not the 120 s the case sleeps
    assert [(c["case"], c.get("cut")) for c in cases if c["stage"] == "sleeper"] == [("sleeps", "Interrupted")]


def test_a_stage_that_swallows_even_the_alarm_is_ended_by_the_watchdog(tmp_path):
    code, summary, cases, log = drive(tmp_path, "hang", 1.5)
    assert code == budgeted.EXIT_HUNG, log
    assert summary["ended"].startswith("hung") and "hostile" in summary["ended"], summary
    assert summary["running"] == ["hostile", "swallows even the alarm"] and not summary["passed"]
    assert "budget-watchdog" in log or "Thread" in log             # every thread's stack went to the log


def test_carry_installs_only_what_the_image_lacks():
    fresh = {"lark": "1.3.1", "cuda-core": "1.2.2", "cuda-bindings": "13.5.0", "cuda-pathfinder": "1.9.1"}
    assert carry.needed(fresh) == []
    assert [n for n, _ in carry.needed({**fresh, "lark": None})] == ["lark"]
    for stale in ({"cuda-core": "0.3.0"}, {"cuda-core": None}, {"cuda-bindings": "12.9.0"}):
        names = [n for n, _ in carry.needed({**fresh, **stale})]
        assert names == ["cuda-core", "cuda-bindings", "cuda-pathfinder"], stale
    assert carry.needed({**fresh, "cuda-core": "1.10.0"}) == []          # numbers, not strings
    assert carry.release("13.0.1.post1") == (13, 0, 1) and carry.release("1.2rc1") == (1, 2)


def test_carry_names_a_needed_wheel_it_was_not_given(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(carry, "installed", lambda name: None if name == "lark" else "13.5.0")
    assert carry.main(["--wheels", str(tmp_path), "--target", str(tmp_path / "site")]) == 3
    assert "lark needed but not in" in capsys.readouterr().err


def test_the_script_through_its_wrapper_with_a_tiny_budget_ends_in_time_and_leaves_its_record(tmp_path):
    """The one device command (bench/first_gpu_window.sh) on the emulated device with a 4 s budget:
    its work is cut off (compile workers killed), every stage recorded, exit 1 through the pipe."""
    pytest.importorskip("torch")
    env = {**os.environ, "OUT": str(tmp_path), "BUDGET_S": "4", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(BENCH / "first_gpu_window.sh"), "--device", "emu", "--quick"], env=env,
                          capture_output=True, text=True, timeout=patience(600))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "carry: nothing to install" in (tmp_path / "carry.log").read_text()
    out = tmp_path / "first-run"
    summary = json.loads((out / "summary.json").read_text())
    cases = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]
    assert summary["budget_s"] == 4 and summary["seconds"] <= 4 + patience(15), summary
    assert not summary["passed"] and set(summary["stages"]) >= {"environment", "compile", "kernel-cache"}
    assert {st["status"] for st in summary["stages"].values()} <= STATUSES
    assert any(st["status"] in ("capped", "not run") for st in summary["stages"].values())
    assert cases and all(c["stage"] in summary["stages"] for c in cases)
    assert (out / "summary.txt").read_text().startswith("msc first GPU run: device emu (quick)")
    assert not Path(summary["cache"]).exists()                     # the run's kernel cache is removed


def test_the_compile_stage_lists_each_kernel_once_in_the_order_the_stages_use_them(tmp_path):
    """Headline plans without switch ops (the NVLS stage covers those), the core ring first, the
    children's plans included, no job twice."""
    import first_gpu_run as fgr

    run = fgr.Run("cuda", False, tmp_path, tmp_path)
    keys = fgr.headline_keys(run, core=False)
    assert keys and not any("nvls" in k for k in keys) and fgr.RING not in keys
    jobs = fgr.compile_jobs(fgr.Run("emu", True, tmp_path, tmp_path))
    assert len(jobs) == len(set(jobs))
    assert jobs[0][:3] == (fgr.RING, 8, "Simple") and jobs[0][6:] == fgr.CORE_KINDS[0]
    headline_core = jobs.index((fgr.RING, 8, "Simple", 0, 1, None, "bfloat16", "sum"))
    assert headline_core < min(i for i, j in enumerate(jobs) if j[0] != fgr.RING)   # before the rest
    children = {(fgr.RING, n, p, 0, 1, None, "float32", "sum") for n in (2, 4) for p in ("Simple", "LL")}
    assert children <= set(jobs)
    assert [j for j in jobs if j[0] == fgr.NVLS] == [(fgr.NVLS, 4, "Simple", 0, 1, "table", d, o)
                                                     for d, o in fgr.NVLS_EMULATED]
