"""Where the default test run's CPU seconds go, per module, per worker (issue 40).

    python bench/suite_cpu.py [--top N] [--out FILE.json] [-- PYTEST-ARGS...]
    python bench/suite_cpu.py --report FILE.json [--top N]

Runs ``pytest -q`` (the README's command; PYTEST-ARGS are added to it) with
this file loaded as a plugin in the controller and every xdist worker, and
prints the run's CPU seconds (user + system of pytest and everything it
started, from getrusage of this process's children, as /usr/bin/time counts)
split into:
- collection per worker (imports and parametrization: every worker collects
  every module);
- each test's own CPU (the worker's getrusage(SELF) around the test's setup,
  call and teardown) and its waited-for children's (a CLI subprocess, g++, a
  README block), summed per module;
- what no test accounts for: processes reaped after their test, above all
  the torch pool workers (tests/torchdist.py forks them from a forkserver,
  whose children are counted when the forkserver stops at the session's end),
  and a worker's start-up.

``pytest --durations`` shows wall times, which on a shared 2-core machine
measure the load as much as the test, and miss the CPU of the processes a
test hands its work to; this is the CPU picture the issue's budget (360
CPU-seconds for the default run) is counted in.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_ENV = "MSC_SUITE_CPU_DIR"          # where the workers' records go (set by main())
_records = None


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _write(record: dict) -> None:
    global _records
    if _ENV not in os.environ:
        return
    if _records is None:
        name = os.environ.get("PYTEST_XDIST_WORKER", "controller")
        _records = open(Path(os.environ[_ENV]) / f"{name}.jsonl", "a")
    _records.write(json.dumps(record) + "\n")
    _records.flush()


# -- the plugin (pytest -p suite_cpu, in the controller and each worker) ----------------------------

@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    before = _cpu()
    yield
    after = _cpu()
    _write({"collect": after[0] - before[0], "collect_children": after[1] - before[1]})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = _cpu(), time.monotonic()
    yield
    after = _cpu()
    _write({"test": item.nodeid, "self": after[0] - before[0], "children": after[1] - before[1],
            "wall": time.monotonic() - start})


def pytest_unconfigure(config):
    own, kids = _cpu()
    _write({"end_self": own, "end_children": kids})
    if _records is not None:
        _records.close()


# -- the report ------------------------------------------------------------------------------------

def summarize(folder: Path) -> dict:
    """The workers' records, summed: per module, per worker, and what no test accounts for."""
    modules: dict[str, dict] = collections.defaultdict(lambda: {"self": 0.0, "children": 0.0, "wall": 0.0,
                                                                  "tests": 0})
    tests, workers = [], {}
    for path in sorted(folder.glob("gw*.jsonl")) or sorted(folder.glob("controller.jsonl")):
        w = {"collect": 0.0, "tests_self": 0.0, "tests_children": 0.0, "end_self": 0.0, "end_children": 0.0}
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "test" in r:
                m = modules[r["test"].split("::")[0]]
                for k in ("self", "children", "wall"):
                    m[k] += r[k]
                m["tests"] += 1
                w["tests_self"] += r["self"]
                w["tests_children"] += r["children"]
                tests.append(r)
            elif "collect" in r:
                w["collect"] += r["collect"] + r["collect_children"]
            elif "end_self" in r:
                w["end_self"], w["end_children"] = r["end_self"], r["end_children"]
        w["unattributed"] = w["end_self"] + w["end_children"] - w["collect"] - w["tests_self"] - w["tests_children"]
        workers[path.stem] = w
    controller = folder / "controller.jsonl"
    if workers and controller.exists():                # under xdist: the controller's own CPU (its children are the workers)
        ends = [json.loads(line) for line in controller.read_text().splitlines() if "end_self" in line]
        workers["controller"] = {"collect": 0.0, "tests_self": 0.0, "tests_children": 0.0, "end_children": 0.0,
                                 "end_self": ends[-1]["end_self"], "unattributed": ends[-1]["end_self"]}
    return {"modules": dict(modules), "workers": workers,
            "tests": sorted(tests, key=lambda r: -(r["self"] + r["children"]))}


def report(summary: dict, top: int) -> str:
    lines = []
    total = summary.get("cpu")
    if total is not None:
        lines.append(f"pytest and its processes: {total['user'] + total['system']:.1f} CPU-s "
                     f"({total['user']:.1f} user + {total['system']:.1f} system), {total['wall']:.1f} s wall, "
                     f"exit {total['rc']}, load average before/after {total['load'][0]:.2f}/{total['load'][1]:.2f}")
    lines.append("worker      total  collect    tests (own + children)  unattributed")
    for name, w in summary["workers"].items():
        lines.append(f"{name:10s} {w['end_self'] + w['end_children']:6.1f} {w['collect']:8.1f} "
                     f"{w['tests_self'] + w['tests_children']:8.1f} ({w['tests_self']:6.1f} + {w['tests_children']:6.1f})"
                     f" {w['unattributed']:12.1f}")
    lines.append(f"\nmodules by CPU-s (own + children; {len(summary['modules'])} modules):")
    ranked = sorted(summary["modules"].items(), key=lambda kv: -(kv[1]["self"] + kv[1]["children"]))
    for name, m in ranked[:top]:
        lines.append(f"{m['self'] + m['children']:7.1f} = {m['self']:6.1f} + {m['children']:6.1f}  "
                     f"{m['tests']:4d} tests  {m['wall']:6.1f} s wall  {name}")
    lines.append(f"\ntests by CPU-s (own + children):")
    for r in summary["tests"][:top]:
        lines.append(f"{r['self'] + r['children']:6.1f} = {r['self']:5.1f} + {r['children']:5.1f}  "
                     f"{r['wall']:5.1f} s wall  {r['test']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path, help="write the summary as JSON")
    parser.add_argument("--report", type=Path, help="print the report of an earlier --out and run nothing")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    if args.report:
        print(report(json.loads(args.report.read_text()), args.top))
        return 0
    with tempfile.TemporaryDirectory(prefix="msc-suite-cpu-") as folder:
        env = {**os.environ, _ENV: folder,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        load_before, start = os.getloadavg()[0], time.monotonic()
        script = Path(sys.executable).parent / "pytest"        # the README's `pytest -q`, where it is installed
        command = [str(script)] if script.exists() else [sys.executable, "-m", "pytest"]
        rc = subprocess.run([*command, "-q", "-p", "suite_cpu", *args.pytest_args],
                            cwd=REPO, env=env).returncode
        wall, kids = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
        summary = summarize(Path(folder))
    summary["cpu"] = {"user": kids.ru_utime, "system": kids.ru_stime, "wall": wall, "rc": rc,
                      "load": [load_before, os.getloadavg()[0]]}
    print(report(summary, args.top))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
