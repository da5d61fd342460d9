"""The ``msc`` command line: exit codes, JSON output, algorithm selection,
parameters, error reports without tracebacks, ``msc list``, and a verify
path that loads no numpy, torch or CUDA."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import msc

from algfile import write

REPO = Path(__file__).resolve().parent.parent
RING = REPO / "algorithms" / "allreduce" / "ring.py"


def cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msc.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


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
    for code in ("import sys, msc.cli",
                 f"import sys, msc.cli; msc.cli.main(['verify', {str(RING)!r}, '-n', '4'])"):
        done = subprocess.run([sys.executable, "-c", f"{code}; print({HEAVY})"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "[]", done.stdout


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
