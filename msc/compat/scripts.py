"""Running an MSCCLang-style script (a file that imports msc.compat) as
``__main__``, its programs collected as it defines them: what msc verify,
msc compile and msc show do with such a file (msc.dsl.loader.is_msccl_script
tells them apart from algorithm files)."""
from __future__ import annotations

import sys
from pathlib import Path

from msc.compat.msccl import collecting
from msc.dsl.loader import file_line, import_file, resolve
from msc.errors import AlgorithmError


def run_script(path: str | Path, argv: list[str]):
    """Run an MSCCLang-style script as ``__main__`` with ``argv`` as its
    arguments; return the programs it defined."""
    p = resolve(str(path))
    saved = sys.argv
    sys.argv = [str(p), *argv]
    try:
        with collecting() as programs:
            try:
                import_file(p, "__msc_script__", as_main=True)
            except SystemExit as exc:
                if exc.code not in (0, None):
                    raise AlgorithmError(f"{p} exited with status {exc.code!r} (its arguments: {argv})",
                                         where=file_line(exc, p)) from None
    finally:
        sys.argv = saved
    return programs
