"""The ``msc`` command line: exit codes, JSON output, algorithm selection,
parameters, error reports without tracebacks, ``msc list``, and a verify
path that loads no numpy, torch or CUDA."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import clirun
import msc

from algfile import write
from patience import patience

REPO = Path(__file__).resolve().parent.parent
RING = REPO / "algorithms" / "allreduce" / "ring.py"


# in this process (tests/clirun.py); tests/test_cli_processes.py runs each command as a process
def cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return clirun.msc(*args, cwd=cwd)


def same_file(shown: str, path: Path) -> bool:
    """Whether ``shown`` (as msc prints it: relative to the command's working
    directory or absolute) is ``path``."""
    return (REPO / shown).resolve() == path.resolve()


def blamed(stderr: str) -> tuple[str, int]:
    """The ``FILE:LINE`` an error message on stderr starts with."""
    message = stderr.split(": ", 2)[2]  # after "msc: error: "
    file, line, _ = message.split(":", 2)
    return file, int(line)


TWO_ALGORITHMS = """
    import msc

    @msc.algorithm("allgather", inplace=False)
    def direct(p, skip=-1):
        \"\"\"Every rank sends its chunk to every rank.\"\"\"
        n = p.num_ranks
        for r in range(n):
            for j in range(n):
                if j != skip:
                    p.chunk(r, "input", 0).copy(j, "output", r)  # @copy

    @msc.algorithm("allgather", chunk_factor=lambda n, hops: hops, hops=1)
    def relay(p, hops=1):
        n = p.num_ranks
        for r in range(n):
            for i in range(hops):
                ref = p.chunk(r, "input", i)
                for j in range(1, n):
                    ref = ref.copy((r + j) % n, "output", r * hops + i)
"""


@pytest.fixture
def two(tmp_path):
    return write(tmp_path, TWO_ALGORITHMS)


def test_verify_ok_exits_0():
    [ring] = msc.load_algorithms(RING)
    done = cli("verify", RING, "--ranks", 4)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"verified: ring (allreduce, 4 ranks, {len(msc.trace(ring, 4).ops)} ops,")
    done = cli("verify", "allreduce/ring", "-n", 5, "--inplace", "out")  # a library name
    assert done.returncode == 0, done.stderr
    assert f"(allreduce, 5 ranks, {len(msc.trace(ring, 5, inplace=False).ops)} ops," in done.stdout


def test_verify_json_fields():
    done = cli("verify", RING, "--ranks", 8, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [ring] = msc.load_algorithms(RING)
    assert report["algorithm"] == "ring"
    assert report["collective"] == "allreduce"
    assert report["ranks"] == 8
    assert report["ops"] == len(msc.trace(ring, 8).ops)
    assert report["verified"] is True
    assert isinstance(report["seconds"], float) and 0 <= report["seconds"] < 10


def test_verification_failure_exits_1_with_chunk_and_line(two):
    path, marks = two
    done = cli("verify", path, "--name", "direct", "-n", 3, "--param", "skip=2")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("msc: verification failed: ")
    assert "rank 2 output[0] was never written" in done.stderr
    done = cli("verify", path, "--name", "direct", "-n", 3, "--param", "skip=2", "--json")
    assert done.returncode == 1
    result = json.loads(done.stdout)
    assert result["verified"] is False and result["error"] == "verification failed"
    assert (result["rank"], result["buffer"], result["index"]) == (2, "output", 0)
    assert result["expected"] == "input[0] of rank 0"


def test_wrong_contribution_reports_the_line(tmp_path):
    path, marks = write(tmp_path, """
        import msc

        @msc.algorithm("allreduce", inplace=False)
        def off_by_one(p):
            n = p.num_ranks
            for r in range(n):
                out = p.chunk(r, "input", 0).copy(r, "output", 0)
                for j in range(n):
                    if j != r:
                        out.reduce(p.chunk(j if (r, j) != (1, 2) else 0, "input", 0))  # @reduce
    """)
    done = cli("verify", path, "-n", 3, "--json")
    assert done.returncode == 1
    result = json.loads(done.stdout)
    assert (result["rank"], result["buffer"], result["index"]) == (1, "output", 0)
    assert same_file(result["file"], path) and result["line"] == marks["reduce"]
    assert f":{marks['reduce']}: rank 1 output[0] holds the wrong contributions" in done.stderr


@pytest.mark.parametrize("args,message", [
    (("verify", "no/such/file.py", "-n", 4), "no such algorithm file"),
    (("verify", RING), "--ranks N is required"),
    (("verify", RING, "-n", 4, "--param", "width=2"), "has no parameter width"),
    (("verify", RING, "-n", 4, "--param", "width"), "--param takes name=value"),
    (("verify", RING, "-n", 0), "num_ranks must be an int >= 1"),
    (("verify", RING, "-n", 4, "--name", "tree"), "has no algorithm 'tree'"),
])
def test_bad_input_exits_2_without_traceback(args, message):
    done = cli(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_empty_file_and_unsupported_ranks_exit_2(tmp_path):
    empty, _ = write(tmp_path, "import msc\n", name="empty.py")
    done = cli("verify", empty, "-n", 2)
    assert done.returncode == 2 and "defines no @msc.algorithm" in done.stderr
    even, _ = write(tmp_path, """
        import msc

        @msc.algorithm("allreduce", ranks=lambda n: n % 2 == 0)
        def pairs(p):
            pass
    """, name="even.py")
    done = cli("verify", even, "-n", 3)
    assert done.returncode == 2 and "does not support 3 ranks" in done.stderr
    assert "Traceback" not in done.stderr


def test_name_selects_among_several_algorithms(two):
    path, _ = two
    done = cli("verify", path, "-n", 3)
    assert done.returncode == 2
    assert "defines several algorithms (direct, relay); pick one with --name" in done.stderr
    for name in ("direct", "relay"):
        done = cli("verify", path, "-n", 3, "--name", name, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["algorithm"] == name


def test_param_reaches_the_algorithm(two):
    path, _ = two
    ops = {}
    for hops in (1, 3):
        done = cli("verify", path, "-n", 4, "--name", "relay", "--param", f"hops={hops}", "--json")
        assert done.returncode == 0, done.stderr
        ops[hops] = json.loads(done.stdout)["ops"]
    assert ops == {1: 4 * 3, 3: 4 * 3 * 3}  # in place: n*hops chunks, n-1 hops each


def test_inplace_option_selects_the_form(tmp_path):
    path, _ = write(tmp_path, """
        import msc

        send_next = msc.CustomCollective(
            "send_next", input_chunks=1, output_chunks=1,
            postcondition=lambda r, i, n, k: None if r == 0 else [(r - 1, 0)])

        @msc.algorithm(send_next)
        def forward(p):
            for r in range(p.num_ranks - 1):
                p.chunk(r, "input", 0).copy(r + 1, "output", 0)
    """)
    assert cli("verify", path, "-n", 3, "--inplace", "out").returncode == 0
    assert cli("verify", path, "-n", 3, "--inplace", "in").returncode == 1  # overwrites before sending
    assert cli("verify", path, "-n", 3).returncode == 1  # in place by default


def test_syntax_error_exits_2_with_file_and_line(tmp_path):
    path, marks = write(tmp_path, """
        import msc

        @msc.algorithm("allreduce")
        def broken(p):
            for r in range(p.num_ranks)  # @syntax
                pass
    """)
    done = cli("verify", path, "-n", 2)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f":{marks['syntax']}: syntax error" in done.stderr
    file, line = blamed(done.stderr)
    assert same_file(file, path) and line == marks["syntax"]


def test_exception_in_algorithm_exits_2_with_file_and_line(tmp_path):
    path, marks = write(tmp_path, """
        import msc

        @msc.algorithm("allreduce")
        def broken(p):
            return [][p.num_ranks]  # @index
    """)
    done = cli("verify", path, "-n", 2)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f":{marks['index']}: IndexError in algorithm 'broken'" in done.stderr
    file, line = blamed(done.stderr)
    assert same_file(file, path) and line == marks["index"]


def test_exception_in_chunk_factor_exits_2_without_traceback(tmp_path):
    """The user's sizing code failing is bad input (2), not a failed
    verification (1), and is reported at its line."""
    path, marks = write(tmp_path, """
        import msc

        @msc.algorithm("allreduce", chunk_factor=lambda n: 12 // (n - 1))  # @factor
        def pairs(p):
            pass
    """)
    done = cli("verify", path, "-n", 1)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f":{marks['factor']}: ZeroDivisionError" in done.stderr
    file, line = blamed(done.stderr)
    assert same_file(file, path) and line == marks["factor"]


def test_list_shows_library_and_files(two):
    done = cli("list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    ring = [line for line in lines if line.split("  ")[0].endswith("allreduce/ring.py")]
    assert len(ring) == 1 and ring[0].split("  ")[1] == "ring"
    assert ring[0].split("  ")[2].startswith("[allreduce")
    path, _ = two
    done = cli("list", path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{path}  direct  [allgather, skip=-1]  Every rank sends its chunk to every rank.",
        f"{path}  relay  [allgather, hops=1]  ",
    ]


HEAVY = "sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'cuda') or m.startswith('cuda'))"


def test_cli_imports_no_numpy_torch_or_cuda():
    for code in ("import sys, msc.cli.main",
                 f"import sys, msc.cli.main; msc.cli.main.main(['verify', {str(RING)!r}, '-n', '4'])"):
        done = subprocess.run([sys.executable, "-c", f"{code}; print({HEAVY})"], cwd=REPO,
                              capture_output=True, text=True, timeout=patience(60))
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "[]", done.stdout


def test_only_bfloat16_work_imports_ml_dtypes(tmp_path):
    """ml_dtypes (numpy's bfloat16; 0.7 CPU-s to import) is imported by a command that works in
    bfloat16, not by every command that runs or simulates a plan."""
    calls = [["compile", "allreduce/ring", "-n", "4", "-o", "r.plan"], ["run", "r.plan", "-b", "1K", "-e", "4K"],
             ["simulate", "r.plan", "-t", "ring:4"], ["bound", "allreduce", "-t", "ring:4"], None,
             ["run", "r.plan", "-b", "1K", "-e", "1K", "-d", "bf16"], None]
    code = "import sys, msc.cli.main\n" + "".join(
        "print('ml_dtypes' in sys.modules)\n" if c is None else f"assert msc.cli.main.main({c!r}) == 0\n" for c in calls)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line in ("True", "False")] == ["False", "True"], done.stdout


def test_import_names_the_size_range_a_plan_file_does_not_keep(tmp_path):
    plan = tmp_path / "ring.plan"
    assert cli("compile", "algorithms/allreduce/ring.py", "--ranks", "4", "-o", plan).returncode == 0
    for extra, note in (((), False), (("--min-bytes", "1024", "--max-bytes", "65536"), True)):
        xml = tmp_path / "ring.xml"
        assert cli("export", plan, "--format", "msccl-xml", "-o", xml, *extra).returncode == 0
        done = cli("import", xml, "-o", tmp_path / "back.plan")
        assert done.returncode == 0, done.stderr
        assert ("1024 <= bytes < 65536" in done.stderr) is note
        assert ("plans.json" in done.stderr) is note


# -- issue 15 (a new user's first hour) and issue 14 (hardening): in-process runs of msc.cli.main.main ----
def run_main(capsys, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``msc ARGS`` run in this process."""
    from msc.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


PIECES = """
    import msc

    @msc.algorithm("allreduce", chunk_factor=lambda n, pieces=4: 2 * pieces, ranks=lambda n: n in (8, 64))  # @decorator
    def pieced(p, pieces=4, exact=False, rate=0.5, label="x"):
        import json, os
        with open(os.environ["MSC_TEST_SEEN"], "w") as f:
            json.dump({"pieces": pieces, "exact": exact, "rate": rate, "label": label}, f)
"""


@pytest.fixture
def pieces(tmp_path, monkeypatch):
    seen = tmp_path / "seen.json"
    monkeypatch.setenv("MSC_TEST_SEEN", str(seen))
    path, marks = write(tmp_path, PIECES)
    return path, marks, seen


@pytest.mark.parametrize("param,message", [
    ("pieces=abc", "--param pieces=abc: pieces takes an int (its default is 4), got 'abc'"),
    ("pieces=2.5", "--param pieces=2.5: pieces takes an int (its default is 4), got '2.5'"),
    ("exact=maybe", "--param exact=maybe: exact takes true or false (its default is False), got 'maybe'"),
    ("rate=fast", "--param rate=fast: rate takes a number (its default is 0.5), got 'fast'"),
    ("width=2", "--param width: algorithm 'pieced' has no parameter width "
                "(parameters: exact, label, pieces, rate)"),
])
def test_param_values_are_checked_against_the_defaults_type(capsys, pieces, param, message):
    """Issue 15, item 4: ``pieces=abc`` was reported as 'chunk_factor must be
    an int >= 1, got 'abcabc''."""
    path, _, _ = pieces
    code, out, err = run_main(capsys, "verify", path, "-n", 8, "--param", param)
    assert (code, out, err) == (2, "", f"msc: error: {message}\n")


def test_param_values_arrive_as_the_defaults_type(capsys, pieces):
    path, _, seen = pieces
    code, _, err = run_main(capsys, "verify", path, "-n", 8, "-p", "pieces=3", "-p", "exact=yes", "-p", "rate=2",
                            "-p", "label=123")
    assert code == 1, err          # the algorithm does nothing: verification fails, after tracing
    assert json.loads(seen.read_text()) == {"pieces": 3, "exact": True, "rate": 2.0, "label": "123"}
    code, _, err = run_main(capsys, "verify", path, "-n", 8, "-p", "pieces=3", "-p", "pieces=4")
    assert (code, err) == (2, "msc: error: --param pieces is given twice\n")


def test_a_rejected_value_names_the_parameters_that_led_there(capsys, pieces):
    """Issue 15, item 4: ``pieces=-1`` reported only 'chunk_factor -2'."""
    path, marks, _ = pieces
    code, out, err = run_main(capsys, "verify", path, "-n", 8, "--param", "pieces=-1")
    assert code == 2
    assert err.endswith(f":{marks['decorator']}: algorithm 'pieced': chunk_factor must be an int >= 1, but "
                        f"chunk_factor(n=8, pieces=-1) gave -2\n")
    file, line = blamed(err)
    assert Path(file).resolve() == path.resolve() and line == marks["decorator"]
    code, out, err = run_main(capsys, "verify", path, "-n", 4)
    assert (code, err) == (2, "msc: error: algorithm 'pieced' does not support 4 ranks "
                              "(supported rank counts from 1 to 64: 8, 64)\n")


def test_debug_adds_the_traceback_and_keeps_the_exit_status(capsys, pieces, tmp_path):
    """Issue 15, item 5: --debug turned exit status 2 into 1."""
    path, _, _ = pieces
    for args in (("--debug", "verify", path, "-n", 4), ("verify", "--debug", path, "-n", 4)):
        code, out, err = run_main(capsys, *args)
        assert code == 2
        assert err.startswith("Traceback (most recent call last):")
        assert err.endswith("msc: error: algorithm 'pieced' does not support 4 ranks "
                            "(supported rank counts from 1 to 64: 8, 64)\n")
    code, out, err = run_main(capsys, "--debug", "verify", path, "-n", 8)       # writes nothing: fails
    assert code == 1 and "Traceback" in err and "msc: verification failed: " in err
    code, out, err = run_main(capsys, "--debug", "verify", tmp_path / "missing.plan")
    assert code == 2 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("msc: error: ")


def test_compile_emit_cuda_times_the_cuda_step_apart_from_verification(capsys, tmp_path, monkeypatch):
    """Issue 15, item 6: NVRTC's time was labelled as verification time."""
    import time

    import msc.cli.main

    real = msc.cli.main.emit_cuda

    def slow_emit(plan, path, args):
        time.sleep(0.5)
        return real(plan, path, args)

    monkeypatch.setattr(msc.cli.main, "emit_cuda", slow_emit)
    plan = tmp_path / "ring.plan"
    code, out, err = run_main(capsys, "compile", "allreduce/ring", "-n", 4, "-o", plan, "--emit", "cuda")
    assert code == 0, err
    lines = out.splitlines()
    verified = float(lines[0].split("program verified, lowered and plan verified in ")[1].split(" s")[0])
    assert lines[1].startswith("  CUDA: source rendered in ")
    assert verified < 0.5 <= float(lines[1].split(" in ")[1].split(" s")[0])
    assert lines[2:] == [f"  wrote {tmp_path / 'ring.float32-sum.cu'}"]
    code, out, err = run_main(capsys, "compile", "allreduce/ring", "-n", 4, "-o", plan, "--emit", "cuda", "--json")
    report = json.loads(out)
    assert code == 0 and report["seconds"] < 0.5 <= report["emit_seconds"]


def test_compile_emit_cuda_with_arch_says_nvrtc_or_the_cache(capsys, tmp_path):
    pytest.importorskip("cuda.bindings")
    plan = tmp_path / "ring.plan"
    args = ("compile", "allreduce/ring", "-n", 2, "-o", plan, "--emit", "cuda", "--arch", "sm_90")
    code, first, err = run_main(capsys, *args)
    if code == 2 and "NVRTC" in err:
        pytest.skip(f"no NVRTC here: {err}")
    assert code == 0, err
    code, again, err = run_main(capsys, *args)
    assert code == 0, err
    assert first.splitlines()[1].split(" in ")[0] in ("  CUDA: rendered and compiled with NVRTC for sm_90",
                                                      "  CUDA: taken from the kernel cache")
    assert again.splitlines()[1].startswith("  CUDA: taken from the kernel cache in ")


def test_every_flag_of_every_subcommand_has_help():
    """Issue 15, item 8: export --format/--min-bytes/--max-bytes/--no-verify,
    import's options and compile --protocol had none."""
    import argparse

    from msc.cli.main import build_parser

    missing, seen = [], set()

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, sub in action.choices.items():
                    seen.add(command)
                    walk(sub, f"{name} {command}")
            if not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "msc")
    assert missing == []
    assert {"verify", "compile", "export", "import", "run", "bench", "simulate", "tune", "show", "list"} <= seen


@pytest.fixture(scope="module")
def ring_plan(tmp_path_factory):          # read only by its tests: compiled once
    plan = tmp_path_factory.mktemp("ring-plan") / "ring4.plan"
    assert cli("compile", "allreduce/ring", "-n", 4, "-o", plan).returncode == 0
    return plan


@pytest.mark.parametrize("flags,named", [
    (("--ranks", "4"), "--ranks applies"),
    (("--inplace", "out"), "--inplace applies"),
    (("--param", "chunks=2"), "--param applies"),
    (("--name", "ring"), "--name applies"),
    (("-n", "4", "-p", "x=1"), "--ranks, --param apply"),
])
def test_verify_plan_refuses_the_flags_of_algorithm_files(capsys, ring_plan, flags, named):
    """Issue 14, item 7: they were silently ignored."""
    code, out, err = run_main(capsys, "verify", ring_plan, *flags)
    assert code == 2 and out == ""
    assert err.startswith(f"msc: error: {named} to algorithm files; {ring_plan} is a plan (its ranks and "
                          f"parameters are fixed): leave ")


def test_arguments_after_double_dash_go_only_to_msccl_scripts(capsys, ring_plan, tmp_path):
    code, _, err = run_main(capsys, "verify", ring_plan, "--", "8")
    assert (code, err) == (2, f"msc: error: arguments after -- are for MSCCLang scripts; {ring_plan} is a plan\n")
    code, _, err = run_main(capsys, "compile", "allreduce/ring", "-n", 4, "-o", tmp_path / "x.plan", "--", "8", "1")
    assert code == 2
    assert err == ("msc: error: arguments after -- (8 1) are for MSCCLang scripts; allreduce/ring is an "
                   "@msc.algorithm file: use --ranks and --param\n")
    assert not (tmp_path / "x.plan").exists()
    code, _, err = run_main(capsys, "list", "--", "x")
    assert code == 2 and "msc list takes no arguments after --" in err


def test_compile_of_a_plan_points_at_verify_and_run(capsys, ring_plan):
    """Issue 14, item 7: it said 'invalid syntax'."""
    code, out, err = run_main(capsys, "compile", ring_plan)
    assert code == 2 and out == ""
    assert err == (f"msc: error: {ring_plan} is a plan, not an algorithm file: msc compile takes an algorithm (.py) "
                   f"and writes a plan; to check this one use `msc verify {ring_plan}`, to run it "
                   f"`msc run {ring_plan}`\n")


def test_tune_refuses_a_parameter_no_algorithm_has(capsys):
    code, out, err = run_main(capsys, "tune", "allreduce/ring", "allreduce/tree", "-n", 4, "-t", "nvswitch",
                              "--param", "bogus=1,2")
    assert code == 2 and out == ""
    assert err == ("msc: error: --param bogus: no algorithm in allreduce/ring, allreduce/tree has a parameter bogus "
                   "(their parameters: chunks)\n")
    code, out, err = run_main(capsys, "tune", "allreduce/tree", "-n", 4, "-t", "nvswitch", "--param", "chunks=2,x")
    assert (code, err) == (2, "msc: error: --param chunks=x: chunks takes an int (its default is 4), got 'x'\n")


@pytest.mark.parametrize("flag,value", [("--alpha-us", "inf"), ("--alpha-us", "nan"), ("--alpha-us", "-1"),
                                        ("--bandwidth-gbps", "inf"), ("--bandwidth-gbps", "0"),
                                        ("--bandwidth-gbps", "-inf"),
                                        # numbers that overflow the model's times (issue 27)
                                        ("--alpha-us", "1e308"), ("--alpha-us", "2e6"),
                                        ("--bandwidth-gbps", "1e-300"), ("--bandwidth-gbps", "1e300")])
def test_simulate_refuses_infinite_nan_and_negative_model_numbers(capsys, ring_plan, flag, value):
    other = {"--alpha-us": ("--bandwidth-gbps", "10"), "--bandwidth-gbps": ("--alpha-us", "1")}[flag]
    with pytest.raises(SystemExit) as done:
        run_main(capsys, "simulate", ring_plan, f"{flag}={value}", *other)
    assert done.value.code == 2
    assert f"argument {flag}: expected a finite number" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_named(capsys, tmp_path):
    path = tmp_path / "latin.py"
    path.write_bytes(b"import msc\n# caf\xe9\n")
    code, out, err = run_main(capsys, "verify", path, "-n", 2)
    assert code == 2
    assert err == f"msc: error: {path}:2: not utf-8 text: byte 0xe9 on this line cannot be decoded (invalid " \
                  f"continuation byte)\n"


def test_msccl_scripts_refuse_the_flags_of_algorithm_files(capsys):
    script = REPO / "examples" / "msccl_allreduce_ring.py"
    for command in ("verify", "compile"):
        code, out, err = run_main(capsys, command, script, "-n", 8, "--", 4, 1, "Simple")
        assert (code, out) == (2, "")
        assert err == (f"msc: error: --ranks applies to @msc.algorithm files; {script} is an MSCCLang script: give "
                       f"its arguments after -- (msc {command} {script} -- ARGS)\n")
