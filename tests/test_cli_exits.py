"""Exit statuses that tell the truth (issue 14, items 5 and 8): the user's
``sys.exit``, odd exceptions and Ctrl-C, and ``--timeout`` for the user's
code that does not end."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from algfile import write
from patience import patience

REPO = Path(__file__).resolve().parent.parent


def run_main(capsys, *args) -> tuple[int, str, str]:
    from msc.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def blamed(err: str, path: Path, line: int) -> bool:
    """Whether the one-line error starts with ``msc: error: PATH:LINE: ``."""
    where = err.removeprefix("msc: error: ").split(": ", 1)[0]
    file, _, number = where.rpartition(":")
    return Path(file).resolve() == path.resolve() and number == str(line)


ODD = """
    import sys
    import msc

    class Custom(BaseException):
        pass

    class Mute(Exception):
        def __str__(self):
            raise RuntimeError("cannot show it")

    def post(rank, index, n, k):
        if rank == 1:
            sys.exit(0)  # @post
        return [(rank, 0)]

    mine = msc.CustomCollective("mine", input_chunks=1, output_chunks=1, postcondition=post)

    @msc.algorithm("allreduce", chunk_factor=lambda n, how: sys.exit(0) if how == "factor" else 1)  # @decorator
    def odd(p, how="exit"):
        if how == "exit":
            sys.exit(0)  # @exit
        if how == "custom":
            raise Custom("custom")  # @custom
        if how == "generator":
            raise GeneratorExit  # @generator
        if how == "mute":
            raise Mute()  # @mute

    @msc.algorithm(mine, inplace=False)
    def checked_by_user_code(p):
        for r in range(p.num_ranks):
            p.chunk(r, "input", 0).copy(r, "output", 0)
"""


@pytest.mark.parametrize("how,mark,message", [
    ("exit", "exit", "SystemExit in algorithm 'odd': it called sys.exit(0)"),
    ("custom", "custom", "Custom in algorithm 'odd': custom"),
    ("generator", "generator", "GeneratorExit in algorithm 'odd'"),
    ("mute", "mute", "Mute in algorithm 'odd': (the Mute could not be shown: its __str__ raised)"),
    ("factor", "decorator", "SystemExit in the chunk_factor of algorithm 'odd': it called sys.exit(0)"),
])
def test_exits_and_odd_exceptions_of_the_algorithm_exit_2_in_one_line(capsys, tmp_path, how, mark, message):
    """``sys.exit(0)`` inside the algorithm made ``msc verify`` exit 0 having
    verified nothing; the others gave tracebacks."""
    path, marks = write(tmp_path, ODD)
    for extra in (("verify",), ("compile", "-o", tmp_path / "odd.plan")):
        code, out, err = run_main(capsys, *extra[:1], path, "--name", "odd", "-n", 2, "-p", f"how={how}", *extra[1:])
        assert (code, out) == (2, ""), (extra, err)
        assert err.count("\n") == 1 and err.endswith(f": {message}\n"), err
        assert blamed(err, path, marks[mark]), err
    assert not (tmp_path / "odd.plan").exists()


def test_user_code_that_msc_calls_is_blamed_at_its_line(capsys, tmp_path):
    """A CustomCollective's postcondition runs inside msc's verifier: its
    sys.exit is still exit 2 at its line."""
    path, marks = write(tmp_path, ODD)
    code, out, err = run_main(capsys, "verify", path, "--name", "checked_by_user_code", "-n", 2)
    assert code == 2
    assert blamed(err, path, marks["post"]) and err.endswith(": SystemExit in user code: it called sys.exit(0)\n")


def test_a_file_that_exits_while_loading_is_exit_2_for_verify_and_list(capsys, tmp_path):
    path, marks = write(tmp_path, """
        import sys
        import msc

        sys.exit(0)  # @exit
    """)
    for args in (("verify", path, "-n", 2), ("list", path), ("compile", path, "-n", 2)):
        code, out, err = run_main(capsys, *args)
        assert (code, out) == (2, ""), args
        assert blamed(err, path, marks["exit"])
        assert err.endswith(f": SystemExit while loading {path}: it called sys.exit(0) (an algorithm file must not "
                            f"end the process)\n")


SLEEPER = """
    import os
    import time
    import msc

    @msc.algorithm("allreduce")
    def sleeper(p, how="sleep"):
        marker = os.environ.get("MSC_TEST_MARKER")
        if marker:
            open(marker, "w").close()
        if how == "sleep":
            time.sleep(60)  # @sleep
        elif how == "spin":
            while True:  # @spin
                pass
        elif how == "swallow":
            while True:
                try:
                    time.sleep(60)
                except BaseException:
                    pass
"""


def _interruptible() -> None:
    """In the child: Ctrl-C raises KeyboardInterrupt even where this test
    runs with SIGINT ignored (a background job), as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    path, _ = write(tmp_path, SLEEPER)
    marker = tmp_path / "started"
    env = {**os.environ, "MSC_TEST_MARKER": str(marker)}
    child = subprocess.Popen([sys.executable, "-m", "msc.cli", "verify", str(path), "-n", "2"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    try:
        deadline = time.monotonic() + patience(60)
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), child.communicate()
        time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=patience(60))
    finally:
        if child.poll() is None:
            child.kill()
    assert (child.returncode, out, err) == (130, "", "msc: interrupted\n")


def test_ctrl_c_in_process_returns_130(capsys, tmp_path, monkeypatch):
    import msc.cli.main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(msc.cli.main, "cmd_list", interrupted)
    assert run_main(capsys, "list") == (130, "", "msc: interrupted\n")


@pytest.mark.parametrize("command,how", [("verify", "sleep"), ("compile", "spin")])
def test_timeout_stops_the_users_code_with_exit_2(capsys, tmp_path, command, how):
    path, marks = write(tmp_path, SLEEPER)
    outer = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    code, out, err = run_main(capsys, command, path, "-n", 2, "-p", f"how={how}", "--timeout", "0.5",
                              *(("-o", tmp_path / "x.plan") if command == "compile" else ()))
    assert time.monotonic() - started < patience(10)
    where = err.split("; it was at ")[1].strip()
    assert (code, out) == (2, "")
    assert err == f"msc: error: msc {command} {path} did not finish in 0.5 s (--timeout); it was at {where}\n"
    file, line = where.rsplit(":", 1)
    assert Path(file).resolve() == path.resolve() and int(line) == marks[how]
    # nothing is left behind: no timer, the previous handler, the collector on, and msc works on
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is outer
    assert gc.isenabled()
    assert run_main(capsys, "verify", "allreduce/ring", "-n", 4, "--timeout", "30")[0] == 0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_timeout_keeps_a_timer_that_was_running(capsys, tmp_path):
    fired = []

    def handler(*args):
        fired.append(args)

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100)
        assert run_main(capsys, "verify", "allreduce/ring", "-n", 4, "--timeout", "5")[0] == 0
        delay, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 100 - patience(10) < delay <= 100 and not fired
        assert signal.getsignal(signal.SIGALRM) is handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_timeout_ends_code_that_swallows_the_interruption(tmp_path):
    path, _ = write(tmp_path, SLEEPER)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "msc.cli", "verify", str(path), "-n", "2", "-p", "how=swallow",
                           "--timeout", "0.5"], cwd=REPO, capture_output=True, text=True, timeout=patience(60))
    assert time.monotonic() - started < patience(20)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"msc: msc verify {path} did not finish in 0.5 s (--timeout) and kept catching the "
                           f"interruption: exiting\n")


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_timeout_must_be_a_positive_number_of_seconds(capsys, value):
    with pytest.raises(SystemExit) as done:
        run_main(capsys, "verify", "allreduce/ring", "-n", 4, f"--timeout={value}")
    assert done.value.code == 2
    assert "argument --timeout: expected seconds" in capsys.readouterr().err
