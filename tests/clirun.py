"""The ``msc`` command in tests: in this process, or (once per command) as users run it.

``msc(*args, cwd=...)`` runs ``msc.cli.main.main(args)`` here, in ``cwd``,
with ``env`` laid over the environment, and returns what a subprocess would:
a ``subprocess.CompletedProcess`` with the exit status and the text written
to stdout and stderr (Python warnings included, as the command prints them).
``cwd`` None: this process's working directory. A fresh ``python -m msc.cli`` costs 0.3-1.5 CPU-seconds of imports (numpy,
ml_dtypes; torch for some commands: 3 more) before it does anything; here
those are paid once per test process. What only a real process shows (the
exit status Python makes of an uncaught exception, a traceback on stderr,
what a command imports, signals, timeouts) is tested with ``msc_process``,
once per command (tests/test_cli_exits.py).

An exception that escapes ``main`` (a bug in msc: a real process would print
a traceback and exit 1) is raised here, so the test fails with it.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _once_sets() -> list[set]:
    """msc's warn-once memories: a fresh process starts with them empty."""
    from msc.cuda import kcache
    from msc.verification import cache

    return [kcache._warned, cache._STATE.warned]


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _environment(env: dict | None):
    """``env`` laid over os.environ (a value of None removes the variable), restored after."""
    saved = dict(os.environ)
    try:
        for name, value in (env or {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def msc(*args, cwd: str | Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``msc ARGS`` in this process, as a fresh one would run it (see the module)."""
    from msc.cli.main import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    remembered = [set(s) for s in _once_sets()]
    for s in _once_sets():
        s.clear()
    try:
        with _environment(env), contextlib.chdir(cwd or os.getcwd()), warnings.catch_warnings(), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.resetwarnings()              # Python's defaults for a script, not pytest's
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = _print_warning
            try:
                code = main(argv)
            except SystemExit as exc:             # argparse: --help, usage errors
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
    finally:
        for s, before in zip(_once_sets(), remembered):
            s.clear()
            s.update(before)
    return subprocess.CompletedProcess(["msc", *argv], code, out.getvalue(), err.getvalue())


def msc_process(*args, cwd: str | Path | None = None, env: dict | None = None, timeout: float = 300,
                **kw) -> subprocess.CompletedProcess:
    """``python -m msc.cli ARGS`` in a process of its own (this Python, this checkout's msc), given up
    after ``timeout`` seconds of a quiet machine (tests/patience.py)."""
    from patience import patience

    environ = {**os.environ, **{k: str(v) for k, v in (env or {}).items() if v is not None}}
    for name in [k for k, v in (env or {}).items() if v is None]:
        environ.pop(name, None)
    return subprocess.run([sys.executable, "-m", "msc.cli", *map(str, args)], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=patience(timeout), **kw)
