"""Algorithm files written into a test's tmp folder, with named lines.

A line of the source that ends in ``# @name`` is marked; ``marks[name]`` is
its 1-based line number, so a test can assert the exact line an error names.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import msc


def write(folder: Path, source: str, name: str = "alg.py") -> tuple[Path, dict[str, int]]:
    source = textwrap.dedent(source).lstrip("\n")
    path = folder / name
    path.write_text(source)
    marks = {}
    for number, text in enumerate(source.splitlines(), 1):
        if "# @" in text:
            marks[text.rsplit("# @", 1)[1].strip()] = number
    return path, marks


def load_one(folder: Path, source: str, name: str = "alg.py"):
    """(the file's only algorithm, its marked lines, its path)."""
    path, marks = write(folder, source, name)
    algorithms = msc.load_algorithms(path)
    assert len(algorithms) == 1, [a.name for a in algorithms]
    return algorithms[0], marks, path


def assert_at(error, path: Path, line: int) -> None:
    """``error.where`` is ``line`` of ``path``."""
    assert error.where is not None, f"no line in: {error}"
    assert Path(error.where.file).resolve() == Path(path).resolve(), error.where
    assert error.where.line == line, f"{error.where} != line {line}: {error}"
