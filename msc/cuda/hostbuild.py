"""Building a rendered kernel for the emulated device (msc.cuda.emu).

The kernel text is the one NVRTC compiles (msc.cuda.codegen.render), built as
host C++20 with ``MSC_HOST=1``: every device primitive in the templates has a
host alternative (templates/host.cuh.j2: a std::thread per CUDA thread, a
std::barrier per block, std::atomic_ref for acquire/release), so the code that
runs is the code a GPU would run, primitives aside. The system C++ compiler
(``$MSC_CXX``, else ``$CXX``, else g++, else clang++) makes a shared library,
loaded with ctypes.

Cache: ``$MSC_CACHE_DIR/host/<key>/``, the key hashing the source, the
compiler (path and version) and the flags. An entry holds the source and the
library, each signed with the user's key (msc.cuda.kcache): a missing, empty,
altered or planted library is rebuilt, never loaded, and the library loaded
is the bytes that were checked. Builds run in a private temporary folder and
are then copied into the cache (a cache that cannot be written, a full one,
costs only the next build). With g++, the standard headers the shim needs
(templates/host_includes.h.j2) are precompiled once per compiler and flags,
cached like a library and force-included, which halves a build (their
include guards make the copy inside the kernel text a no-op): from the cache
where only this user can write its folder, else from a checked copy in the
build's private folder.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from msc.cuda import kcache
from msc.files import write_atomic
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


def build(source: str, *, sanitize: str | None = None, cache: Path | None = None) -> tuple[Path, bytes, bool]:
    """(where the cache keeps the shared library for ``source``, the library's
    bytes, whether they came from the cache). The bytes are the ones checked
    or built: msc.cuda.emu loads them, never the cache's file."""
    compiler = find_compiler()
    cflags = flags(sanitize)
    root = cache or cache_dir()
    folder = f"host/{build_key(source, compiler, cflags)}"
    name = f"{folder}/kernel.so"
    image = kcache.read(root, name)
    if image is not None:
        return root / name, image, True
    with _locked(root / folder):       # the ranks of a job build the same kernel at once: one builds it
        image = kcache.read(root, name)
        if image is not None:
            return root / name, image, True
        image = _build(source, compiler, cflags, root)
        if kcache.write(root, name, image):
            kcache.write(root, f"{folder}/kernel.cpp", source.encode())     # for readers of the cache
    return root / name, image, False


@contextmanager
def _locked(folder: Path):
    """An exclusive lock on ``folder/build.lock`` for this process (released
    when the block ends, or the process dies); no lock where the cache cannot
    hold one (unwritable, full, a planted FIFO or link): builders then only
    duplicate work."""
    fd = _lock_file(folder)
    if fd is None:
        yield
        return
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                    # releases the lock


def _lock_file(folder: Path) -> int | None:
    try:
        import fcntl  # noqa: F401  (no fcntl, Windows: no lock)

        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / "build.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except (ImportError, OSError):
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _build(source: str, compiler: Compiler, cflags: tuple[str, ...], root: Path) -> bytes:
    """The library's bytes, built in a private temporary folder (nothing in
    it can be swapped by anyone else while the compiler runs); on failure the
    folder is kept, and the error names the source in it."""
    try:
        work = Path(tempfile.mkdtemp(prefix="msc-build-"))
    except OSError as exc:
        raise UsageError(f"the emulated device cannot build its kernel: no temporary folder in "
                         f"{tempfile.gettempdir()} ($TMPDIR): {exc.strerror}") from None
    failed = False
    try:
        src = work / "kernel.cpp"
        src.write_text(source)
        pre = _precompiled(compiler, cflags, root, work) if compiler.gnu else None
        out = work / "kernel.so"
        cmd = [compiler.path, *cflags, *(["-include", str(pre)] if pre else []), "-shared", "-o", str(out),
               "-x", "c++", str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            failed = True
            log = done.stderr or done.stdout
            first = next((line for line in log.splitlines() if "error" in line), log.strip()[:200])
            raise CompileError(f"{Path(compiler.path).name} could not build the kernel for the emulated device: "
                               f"{first}", log=log, source_path=str(src))
        return out.read_bytes()
    except OSError as exc:
        raise UsageError(f"the emulated device cannot build its kernel in {work}: {exc.strerror}") from None
    finally:
        if not failed:
            shutil.rmtree(work, ignore_errors=True)


_PCH_LOCK = threading.Lock()
_PCH_CHECKED: dict[str, tuple] = {}      # private cache folder -> the stamp of the .gch checked there


def _precompiled(compiler: Compiler, cflags: tuple[str, ...], root: Path, work: Path) -> Path | None:
    """The precompiled standard headers (their .h path, the .gch beside it):
    the cache's copy, checked, or built once per compiler and flags and
    cached; None when they cannot be built (the kernel then parses the headers
    itself). Used where they lie when only this user can write that folder
    (checked once per process); else copied, as checked, into the build's
    private folder for each build (a shared cache pays the copy)."""
    from msc.cuda.codegen import environment

    text = environment().get_template("host_includes.h.j2").render()
    entry = f"host/pch-{build_key(text, compiler, cflags)}"
    folder, gch = root / entry, f"{INCLUDES}.gch"
    with _PCH_LOCK:                     # concurrent builders of one process check or make it once
        seen = _PCH_CHECKED.get(str(folder))
        if seen is not None and seen == _stamp(folder / gch) and _private(root, folder):
            return folder / INCLUDES
        image = kcache.read(root, f"{entry}/{gch}")
        in_cache = image is not None
        if image is None:
            image = _build_pch(compiler, cflags, text, work)
            if image is None:
                return None
            in_cache = kcache.write(root, f"{entry}/{gch}", image)
        if in_cache and _private(root, folder):
            try:                        # only this user's processes write here: what lies there is checked
                write_atomic(folder / INCLUDES, text.encode())
                stamp = _stamp(folder / gch)
                if stamp is not None:
                    _PCH_CHECKED[str(folder)] = stamp
                    return folder / INCLUDES
            except OSError:
                pass                    # not written (full): the build's own copy below
        (work / INCLUDES).write_text(text)
        (work / gch).write_bytes(image)
        return work / INCLUDES


def _build_pch(compiler: Compiler, cflags: tuple[str, ...], text: str, work: Path) -> bytes | None:
    pch = Path(tempfile.mkdtemp(dir=work))
    header = pch / INCLUDES
    header.write_text(text)
    done = subprocess.run([compiler.path, *cflags, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                          capture_output=True, text=True)
    image = Path(f"{header}.gch").read_bytes() if done.returncode == 0 and Path(f"{header}.gch").is_file() else None
    shutil.rmtree(pch, ignore_errors=True)
    return image


def _stamp(path: Path) -> tuple | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _private(root: Path, folder: Path) -> bool:
    """Whether only this user can change ``folder`` and what is in it: it,
    the folders from the cache root down to it and its files are this user's
    own, no links, and not writable by group or others."""
    if not hasattr(os, "getuid"):
        return False
    paths = [root, *[p for p in folder.parents if root in p.parents], folder]
    try:
        paths += list(folder.iterdir())
        for p in paths:
            st = os.stat(p, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
                return False
    except OSError:
        return False
    return True
