"""Does the test suite catch a wrong msc? Curated single-point mutations, each
applied to a temporary copy of the repository, with the tests that cover the
mutated code run against the copy (issue 40, item 3).

Every mutation is one change to one line (or two adjacent ones) that leaves
msc importable but wrong in a way a user would see: a verifier that misses a
race or a double contribution, a lowering that drops an operand, an executor
that rounds or splits wrong, a parser, an exporter, the cost model, NCCL's
model, the torch accounting, a CUDA template. A mutation is *caught* when its
covering tests fail (pytest -x: the first failure ends the run; the time to
catch is the wall and CPU time to that point), *survived* when they all pass:
a survivor is a test the suite lacks.

First the covering tests run on the unmutated copy (all must pass, else the
check means nothing and the script stops). The copy's tests use the copy's
msc (PYTHONPATH), their own kernel cache (tests/conftest.py makes one per
session), and one process (-n 0), so times add up.

    python bench/mutation_check.py                      # all; writes results/mutation-check-DATE.{txt,json}
    python bench/mutation_check.py --only fusion-operand,nccl-ring-latency
    python bench/mutation_check.py --list

No GPU: the template mutations are caught (or not) on the emulated device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Mutation:
    id: str
    area: str
    path: str           # in the repository
    old: str            # occurs exactly once in the file
    new: str
    what: str           # what a user would see
    tests: tuple        # pytest arguments: the covering tests
    owner: str = ""     # another issue's helper writes the test that catches it


MUTATIONS = (
    Mutation("switch-race", "plan verifier", "msc/verification/plan.py",
             "if gb != ga and (wa or wb):", "if gb != ga and (wa and wb):",
             "a switch read racing a write is not reported (only write-write)",
             ("tests/test_plan_verify.py", "tests/test_switch.py", "tests/test_switch_static.py",
              "tests/test_multicast.py"), owner="issue 39 item 2 (hardening)"),
    Mutation("happens-before", "plan verifier", "msc/verification/plan.py",
             "                    if ds + 1 > vc[dt]:\n                        vc[dt] = ds + 1",
             "                    if ds + 1 > vc[dt]:\n                        vc[dt] = ds + 2",
             "a dependency orders one step more than it does: races behind it are missed",
             ("tests/test_plan_verify.py", "tests/test_verify_bulk.py", "tests/test_plan_bulk.py")),
    Mutation("contribution-multiset", "DSL verifier", "msc/verification/program_verifier.py",
             "            if found != expected.counts:", "            if set(found) != set(expected.counts):",
             "a chunk reduced in twice (or a contribution missing its multiplicity) verifies",
             ("tests/test_dsl.py", "tests/test_mutations.py", "tests/test_properties.py")),
    Mutation("fusion-operand", "lowering", "msc/lower/fusion.py",
             "srcs=first.srcs + second.srcs[1:])", "srcs=first.srcs + second.srcs[2:])",
             "a fused reduce drops its second operand",
             ("tests/test_lowering.py", "tests/test_library.py", "tests/test_plan_bulk.py")),
    Mutation("fusion-sources-stable", "lowering", "msc/lower/fusion.py",
             "or not _sources_stable(dag, first, second)):", "or False):",
             "a local fusion moves a read past a write of what it reads",
             ("tests/test_lowering.py", "tests/test_library.py", "tests/test_plan_bulk.py")),
    Mutation("avg-rounding", "executor", "msc/executor.py",
             "q += (wide < 0) & (wide % d != 0)", "q += (wide > 0) & (wide % d != 0)",
             "an integer avg rounds away from zero on positive sums",
             ("tests/test_executor.py", "tests/test_plan_bulk.py", "tests/test_baselines.py")),
    Mutation("chunk-split", "executor", "msc/units.py",
             "    q = -(-count // k)\n", "    q = count // k\n",
             "a count the chunk factor does not divide loses its last elements",
             ("tests/test_executor.py", "tests/test_plan_bulk.py", "tests/test_baselines.py")),
    Mutation("read-snapshot", "executor", "msc/executor.py",
             "out.append(arr[lo:hi].copy())", "out.append(arr[lo:hi])",
             "a read sees what the buffer holds when its value is used, not when it was read",
             ("tests/test_executor.py", "tests/test_plan_bulk.py", "tests/test_baselines.py")),
    Mutation("plan-slice", "plan parser", "msc/formats/plan_lines.py",
             "hi = lo + 1 if hi is None else int(hi)", "hi = lo if hi is None else int(hi)",
             "the fast plan reader reads a one-chunk slice as empty",
             ("tests/test_plan_lines.py", "tests/test_plan_text.py")),
    Mutation("xml-deps", "MSCCL XML exporter", "msc/formats/xml_export.py",
             '"deps": str(x.dep[1]) if x.dep else "-1"', '"deps": str(x.dep[1] + 1) if x.dep else "-1"',
             "an exported step waits for the step after the one it depends on",
             ("tests/test_xml.py", "tests/test_compat_msccl.py")),
    Mutation("mscclpp-size", "MSCCL++ exporter", "msc/formats/mscclpp/export.py",
             'return {"type": LETTER[sl.buffer], "index": sl.index, "size": sl.count}',
             'return {"type": LETTER[sl.buffer], "index": sl.index, "size": 1}',
             "an exported operation on several chunks moves one",
             ("tests/test_mscclpp.py", "tests/test_mscclpp_channels.py")),
    Mutation("protocol-alpha", "cost model", "msc/sim/topology.py",
             "return alpha * m.alpha_factor, bandwidth * m.bandwidth_factor",
             "return alpha, bandwidth * m.bandwidth_factor",
             "a protocol's latency factor (LL's lower alpha) is ignored",
             ("tests/test_simulate.py", "tests/test_tune.py", "tests/test_bound.py", "tests/test_calibration.py")),
    Mutation("protocol-bandwidth", "cost model", "msc/sim/topology.py",
             "return alpha * m.alpha_factor, bandwidth * m.bandwidth_factor",
             "return alpha * m.alpha_factor, bandwidth",
             "a protocol's bandwidth factor (LL's half rate) is ignored",
             ("tests/test_simulate.py", "tests/test_tune.py", "tests/test_bound.py", "tests/test_calibration.py")),
    Mutation("nccl-ring-latency", "NCCL model", "msc/sim/nccl.py",
             "lat *= 1.4 ", "lat *= 1.68 ",
             "NCCL's multi-node ring plateau latency 20% high",
             ("tests/test_nccl.py", "tests/test_calibration.py"), owner="the NCCL model's helper (nccl-model)"),
    Mutation("nccl-tree-latency", "NCCL model", "msc/sim/nccl.py",
             "return lat + 2 * ((s.ppn - 1) * intra + int(math.log2(nodes)) * inter) if",
             "return lat + ((s.ppn - 1) * intra + int(math.log2(nodes)) * inter) if",
             "NCCL's tree latency counts one way up or down, not both",
             ("tests/test_nccl.py", "tests/test_calibration.py")),
    Mutation("torch-bytes", "torch accounting", "msc/torch/calls.py",
             "return max(self.units.values()) * self.count * self.itemsize",
             "return min(self.units.values()) * self.count * self.itemsize",
             "a call's size is its smaller buffer (allgather's input): plans are picked for the wrong size",
             ("tests/test_torch_executor.py", "tests/test_torch_backend.py", "tests/test_torch_registry.py")),
    Mutation("combine-operand", "CUDA template", "templates/combine.cuh.j2",
             "  for (int o = 1; o < MAX_OPS; ++o)\n    if (o < s.n) acc = reduce_op(",
             "  for (int o = 2; o < MAX_OPS; ++o)\n    if (o < s.n) acc = reduce_op(",
             "the kernel's scalar path (a chunk's unaligned head and tail) drops an operand",
             ("tests/test_cuda_emu.py", "-k", "reference_executor or straight or rank_counts")),
    Mutation("slot-wrap", "CUDA template", "templates/steps.cuh.j2",
             "wrap = (0xffffffffu % s + 1u) % s", "wrap = (0xffffffffu % s) % s",
             "a connection's slot index is wrong once its message count passes 2^32",
             ("tests/test_cuda_emu.py", "-k", "2_to_the_32 or reference_executor")),
)


def copy_repo(dst: Path) -> None:
    """The repository's files as git sees them (tracked, and untracked that are not ignored)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_tests(copy: Path, tests: tuple, *, stop_first: bool, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    env.pop("MSC_CACHE_DIR", None)                  # the copy's conftest makes its session's own
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *(["-x"] if stop_first else []),
           *tests]
    cpu, start = children_cpu(), time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, flags=re.M)
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|error)", line)), "")
    return {"code": code, "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(children_cpu() - cpu, 1),
            "first_failure": failed[0] if failed else None, "summary": summary.strip("= "), "tail": out[-3000:]}


def apply(copy: Path, m: Mutation) -> str:
    path = copy / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation {m.id}: {m.old!r} occurs {text.count(m.old)} times in {m.path}, not once "
                         f"(the code moved: update the mutation)")
    path.write_text(text.replace(m.old, m.new))
    return text


def table(rows: list[dict]) -> str:
    lines = [f"{'mutation':24} {'area':20} {'result':9} {'to catch':>16}  caught by / note"]
    for r in rows:
        took = f"{r['wall_s']:.0f} s ({r['cpu_s']:.0f} CPU)" if r["result"] == "caught" else "-"
        note = r["first_failure"] or (f"survivor: {r['owner']} writes its test" if r["owner"] else "SURVIVOR: "
                                      + r["what"])
        lines.append(f"{r['id']:24} {r['area']:20} {r['result']:9} {took:>16}  {note}")
    caught = sum(r["result"] == "caught" for r in rows)
    lines.append(f"caught {caught} of {len(rows)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutation ids")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for mutation-check-DATE.{txt,json}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per test run")
    args = parser.parse_args(argv)
    chosen = list(MUTATIONS)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {m.id for m in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutation(s) {', '.join(sorted(unknown))}")
        chosen = [m for m in MUTATIONS if m.id in wanted]
    if args.list:
        for m in chosen:
            print(f"{m.id:24} {m.area:20} {m.path}: {m.what}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="msc-mutation-") as tmp:
        copy = Path(tmp)
        copy_repo(copy)
        files = sorted({t for m in chosen for t in m.tests if t.endswith(".py")})
        print(f"baseline: the covering tests on the unmutated copy ({len(files)} files)", flush=True)
        base = run_tests(copy, tuple(files), stop_first=False, timeout=args.timeout * 2)
        if base["code"] != 0:
            print(base["tail"], file=sys.stderr)
            print("the covering tests fail without a mutation: nothing to check", file=sys.stderr)
            return 1
        print(f"  {base['summary']} in {base['wall_s']} s ({base['cpu_s']} CPU-s)", flush=True)
        for m in chosen:
            original = apply(copy, m)
            try:
                got = run_tests(copy, m.tests, stop_first=True, timeout=args.timeout)
            finally:
                (copy / m.path).write_text(original)
            result = "survived" if got["code"] == 0 else "caught"
            rows.append({**asdict(m), "tests": list(m.tests), "result": result, **{k: got[k] for k in (
                "wall_s", "cpu_s", "first_failure", "summary")}})
            print(f"{m.id:24} {result:9} {got['wall_s']:7.1f} s {got['cpu_s']:7.1f} CPU-s  "
                  f"{got['first_failure'] or got['summary']}", flush=True)
    report = table(rows)
    print(report)
    if not args.only:
        args.out.mkdir(parents=True, exist_ok=True)
        head = (f"# bench/mutation_check.py, {time.strftime('%Y-%m-%d')}, {platform.node()} "
                f"({os.cpu_count()} cores, Python {platform.python_version()}); no GPU: templates on the emulated "
                f"device; times: wall and CPU seconds of pytest -n 0 -x to the first failure, on a shared machine\n"
                f"# baseline (unmutated copy, all covering tests): {base['summary']} in {base['wall_s']} s "
                f"({base['cpu_s']} CPU-s)\n")
        stem = args.out / f"mutation-check-{time.strftime('%Y-%m-%d')}"
        stem.with_suffix(".txt").write_text(head + report + "\n")
        stem.with_suffix(".json").write_text(json.dumps({"baseline": {k: base[k] for k in (
            "summary", "wall_s", "cpu_s")}, "mutations": rows}, indent=1) + "\n")
        print(f"wrote {stem}.txt and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
