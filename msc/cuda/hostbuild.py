"""Building a rendered kernel for the emulated device (msc.cuda.emu).

The kernel text is the one NVRTC compiles (msc.cuda.codegen.render), built as
host C++20 with ``MSC_HOST=1``: every device primitive in the templates has a
host alternative (templates/host.cuh.j2: a std::thread per CUDA thread, a
std::barrier per block, std::atomic_ref for acquire/release), so the code that
runs is the code a GPU would run, primitives aside. The system C++ compiler
(``$MSC_CXX``, else ``$CXX``, else g++, else clang++) makes a shared library,
loaded with ctypes.

Cache: ``$MSC_CACHE_DIR/host/<key>/``, the key hashing the source, the
compiler (path and version) and the flags. An entry holds the source, the
library and the library's SHA-256, checked when the entry is read: a missing,
empty or altered library is rebuilt, never loaded. Writes go through a
temporary file and a rename, so concurrent builders never see half a file.
With g++, the standard headers the shim needs (templates/host_includes.h.j2)
are precompiled once per compiler and flags and force-included, which halves
a build (their include guards make the copy inside the kernel text a no-op).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from msc.formats.files import read_checked, write_atomic, write_checked
from msc.errors import CompileError, UsageError
from msc.resources import cache_dir

# -O1: a build takes half the time of -O2 and runs the sweep as fast (the threads mostly
# wait on each other). -fno-strict-aliasing: the kernel reads elements through 16-byte
# vectors (a union), as CUDA allows.
FLAGS = ("-std=c++20", "-O1", "-fPIC", "-pthread", "-fno-strict-aliasing", "-DMSC_HOST=1")
SANITIZERS = {"thread": ("-fsanitize=thread", "-g")}
INCLUDES = "msc_host_includes.h"


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str          # the first line of `--version`
    gnu: bool             # g++ (precompiled headers); clang++ also says "clang"


def _candidates() -> list[str]:
    for var in ("MSC_CXX", "CXX"):
        if os.environ.get(var):
            return [os.environ[var]]
    return ["g++", "clang++"]


@lru_cache(maxsize=None)
def _identify(name: str) -> Compiler | None:
    path = shutil.which(name)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    first = out.stdout.strip().splitlines()[0]
    return Compiler(path, first, "clang" not in out.stdout.lower())


def find_compiler() -> Compiler:
    """The C++ compiler the emulated device builds with; UsageError naming
    what was looked for when none works."""
    names = _candidates()
    for name in names:
        found = _identify(name)
        if found is not None:
            return found
    where = "$MSC_CXX/$CXX" if len(names) == 1 else "g++ or clang++ on PATH"
    raise UsageError(f"the emulated CUDA device builds kernels with a C++20 compiler and found none (looked for "
                     f"{' or '.join(names)}: {where}); install g++ (Debian: apt install g++) or set MSC_CXX")


def flags(sanitize: str | None = None) -> tuple[str, ...]:
    if sanitize is None:
        return FLAGS
    if sanitize not in SANITIZERS:
        raise UsageError(f"unknown sanitizer {sanitize!r} (one of {', '.join(SANITIZERS)})")
    return FLAGS + SANITIZERS[sanitize]


def build_key(source: str, compiler: Compiler, cflags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (source, compiler.path, compiler.version, *cflags):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def cached_library(folder: Path) -> Path | None:
    """The entry's library if it is whole (its digest matches), else None."""
    lib = folder / "kernel.so"
    return lib if read_checked(lib) is not None else None


def build(source: str, *, sanitize: str | None = None, cache: Path | None = None) -> tuple[Path, bool]:
    """(the shared library for ``source``, whether it came from the cache)."""
    compiler = find_compiler()
    cflags = flags(sanitize)
    folder = (cache or cache_dir()) / "host" / build_key(source, compiler, cflags)
    hit = cached_library(folder)
    if hit is not None:
        return hit, True
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / "build.lock"):      # the ranks of a job build the same kernel at once: one builds it
        hit = cached_library(folder)
        if hit is not None:
            return hit, True
        return _build(source, folder, compiler, cflags, cache), False


@contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` for this process (released when the block ends, or the process dies)."""
    with open(path, "a+b") as f:
        try:
            import fcntl
        except ImportError:              # no fcntl (Windows): concurrent builders only waste time
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(source: str, folder: Path, compiler: Compiler, cflags: tuple[str, ...], cache: Path | None) -> Path:
    src = folder / "kernel.cpp"
    write_atomic(src, source.encode())
    pre = _precompiled(compiler, cflags, cache) if compiler.gnu else None
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / "kernel.so"
        cmd = [compiler.path, *cflags, *(["-include", str(pre)] if pre else []), "-shared", "-o", str(out),
               "-x", "c++", str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            log = done.stderr or done.stdout
            first = next((line for line in log.splitlines() if "error" in line), log.strip()[:200])
            raise CompileError(f"{Path(compiler.path).name} could not build the kernel for the emulated device: "
                               f"{first}", log=log, source_path=str(src))
        write_checked(folder / "kernel.so", out.read_bytes())
    return folder / "kernel.so"


def _precompiled(compiler: Compiler, cflags: tuple[str, ...], cache: Path | None) -> Path | None:
    """The precompiled standard headers (their .h path, the .gch beside it),
    built once per compiler and flags; None when they cannot be built (the
    kernel then parses the headers itself)."""
    from msc.cuda.codegen import environment

    text = environment().get_template("host_includes.h.j2").render()
    key = build_key(text, compiler, cflags)
    folder = (cache or cache_dir()) / "host" / f"pch-{key}"
    header = folder / INCLUDES
    if (folder / f"{INCLUDES}.gch").is_file():
        return header
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix="pch-tmp-"))
    try:
        (tmp / INCLUDES).write_text(text)
        done = subprocess.run([compiler.path, *cflags, "-x", "c++-header", str(tmp / INCLUDES), "-o",
                               str(tmp / f"{INCLUDES}.gch")], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        try:
            os.rename(tmp, folder)          # atomic: a concurrent builder's finished folder wins
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return header if (folder / f"{INCLUDES}.gch").is_file() else None
