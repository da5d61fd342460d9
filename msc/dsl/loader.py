"""Loading algorithm files: native ``@msc.algorithm`` files and MSCCLang
scripts (which run as scripts and define programs as they go)."""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import sys
from pathlib import Path

from msc.dsl.program import PASS_THROUGH, Algorithm, describe
from msc.errors import AlgorithmError, MscError, SourceLine, UsageError, did_you_mean
from msc.files import read_input
from msc.ir.limits import MAX_TEXT_FILE_BYTES
from msc.resources import data_dir


def resolve(path: str) -> Path:
    """A file path, or a library name such as ``allreduce/ring``."""
    p = Path(path)
    if p.is_file() or p.exists() and not p.is_dir():     # a device or FIFO: read_source says why it is refused
        return p
    name = path[:-3] if path.endswith(".py") else path
    name = name.removeprefix("algorithms/")
    try:
        lib = data_dir("algorithms") / f"{name}.py"
    except FileNotFoundError:
        lib = None
    if lib is not None and lib.is_file():
        return lib
    raise UsageError(f"no such algorithm file: {path}" + did_you_mean(name, library_names()))


def library_names() -> list[str]:
    """The library's algorithm names (``allreduce/ring``...), for suggestions."""
    try:
        root = data_dir("algorithms")
    except FileNotFoundError:
        return []
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.glob("*/*.py")
                  if p.name != "__init__.py")


def read_source(path: Path) -> str:
    """A Python file's text, decoded as Python does (UTF-8 unless a coding
    line says otherwise); a file that does not decode is an error naming the
    file and line."""
    import tokenize

    data = read_input(path, MAX_TEXT_FILE_BYTES, what="algorithm file")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:           # an unknown coding, or a BOM that contradicts it
        raise AlgorithmError(f"cannot read {path}: {exc.msg}",
                             where=SourceLine(str(path), exc.lineno or 1)) from None
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise AlgorithmError(f"not {encoding} text: byte 0x{data[exc.start]:02x} on this line cannot be decoded "
                             f"({exc.reason})", where=SourceLine(str(path), line)) from None


def import_file(path: Path, module_name: str, as_main: bool = False):
    """Run the file as a module. What its code raises becomes an
    AlgorithmError at its line; ``sys.exit`` too, except in a script
    (``as_main``), where the caller decides; ``KeyboardInterrupt`` and
    ``TimeLimitExceeded`` pass."""
    source = read_source(path)
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise AlgorithmError(f"syntax error: {exc.msg}", where=SourceLine(str(path), exc.lineno or 0)) from None
    except ValueError as exc:            # source with a NUL byte
        raise AlgorithmError(f"cannot compile {path}: {exc}", where=SourceLine(str(path), 1)) from None
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    if as_main:
        module.__name__ = "__main__"
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except (MscError, *PASS_THROUGH):
        raise
    except SystemExit as exc:
        if as_main:
            raise
        raise AlgorithmError(describe(exc, f"while loading {path}") + " (an algorithm file must not end the process)",
                             where=file_line(exc, path)) from None
    except BaseException as exc:
        raise AlgorithmError(describe(exc, f"while loading {path}"), where=file_line(exc, path)) from exc
    return module


def file_line(exc: BaseException, path: Path) -> SourceLine | None:
    tb, line = exc.__traceback__, None
    target = str(path)
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == target:
            line = SourceLine(target, tb.tb_lineno)
        tb = tb.tb_next
    return line


def load_algorithms(path: str | Path) -> list[Algorithm]:
    """The algorithms a file defines, in the order it defines them."""
    p = resolve(str(path))
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    module = import_file(p, f"_msc_algorithms_{p.stem}_{digest}")
    found, seen = [], set()
    for value in vars(module).values():
        if isinstance(value, Algorithm) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)
    return found


def load_collective(spec: str):
    """The Collective ``FILE.py:NAME`` names (the variable NAME of the file,
    or of a library algorithm file), or the file's only Collective object
    when ``:NAME`` is left out; a built-in's name is that built-in."""
    from msc.dsl.collectives import BUILTIN, Collective, collective_key, get_collective

    if collective_key(spec) in BUILTIN:
        return get_collective(spec)
    path, sep, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not sep or not path:
        path, name = spec, ""
    p = resolve(path)
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    module = import_file(p, f"_msc_algorithms_{p.stem}_{digest}")
    found = {k: v for k, v in vars(module).items() if isinstance(v, Collective)}
    if name:
        if name not in found:
            raise UsageError(f"{p} has no collective named {name!r} (it defines: "
                             f"{', '.join(sorted(found)) or 'none'})")
        return found[name]
    distinct = {id(v): v for v in found.values()}
    if len(distinct) != 1:
        raise UsageError(f"{p} defines {len(distinct)} collectives ({', '.join(sorted(found)) or 'none'}): "
                         f"name one, --collective {path}:NAME")
    return next(iter(distinct.values()))


def is_msccl_script(path: str | Path) -> bool:
    """Whether a file uses the MSCCLang compatibility layer (it then runs as
    a script and its programs are collected as it defines them)."""
    p = resolve(str(path))
    try:
        tree = ast.parse(read_source(p), str(p))
    except (SyntaxError, ValueError):    # loading it says what is wrong
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("msc.compat"):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("msc.compat") for a in node.names):
            return True
    return False
