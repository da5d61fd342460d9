"""The kernel caches trust only what this user's msc wrote (issue 27, items 1, 8 and 10).

An attacker who can write to a shared ``MSC_CACHE_DIR`` but cannot read the
user's key plants entries with every digest they can compute (the old
SHA-256 sidecars): a library with a constructor, a precompiled header that
adds one, a rendered source that computes something else, an entry copied
from another key, a FIFO. None of it is run or compiled: each is a miss and
the entry is built again. A cache that cannot be written (full, or its
folders blocked) costs the next build, with a warning naming the cache, not
the run. A library without msc's entry points is a clear error.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import msc
from cudaboot import check_run
from library import algorithms
from patience import join, patience
from msc.cuda import Communicator, emu, hostbuild, kcache
from msc.cuda.compiler import compile_host, rendered
from msc.cuda.runtime import runtime_plan
from msc.errors import UsageError
from msc.lower.pipeline import LowerOptions, lower

try:
    COMPILER = hostbuild.find_compiler()
except UsageError as exc:
    COMPILER = None
    NO_COMPILER = str(exc)
pytestmark = pytest.mark.skipif(COMPILER is None, reason="the emulated device needs a C++20 compiler")

EVIL = r"""
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
    if (const char* p = getenv("MSC_PLANTED_MARK")) { FILE* f = fopen(p, "w"); if (f) { fputs("ran", f); fclose(f); } }
}
"""


def plan(key: str = "allreduce/ring:ring", n: int = 2, protocol: str = "LL"):
    return runtime_plan(lower(msc.trace(algorithms(switch=False)[key], n), LowerOptions(protocol=protocol, tile=4096)))


def plant(path: Path, data: bytes) -> None:
    """What an attacker without the key writes: the file, the old SHA-256 sidecar, and a MAC under a key of theirs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(data).hexdigest())
    import hmac

    mac = hmac.new(b"attacker" * 4, data, "sha256").hexdigest()
    path.with_name(path.name + kcache.SIDECAR).write_text(mac)


def evil_library(tmp: Path) -> bytes:
    src = tmp / "evil.cpp"
    src.write_text(EVIL + 'extern "C" int msc_launch(void*, int, int) { return 0; }\n')
    subprocess.run([COMPILER.path, "-shared", "-fPIC", "-o", str(tmp / "evil.so"), str(src)], check=True)
    return (tmp / "evil.so").read_bytes()


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "planted-code-ran"
    monkeypatch.setenv("MSC_PLANTED_MARK", str(path))
    return path


def test_a_planted_library_is_never_loaded(tmp_path, marker, cold_cache):
    cache = cold_cache
    p = plan()
    first = compile_host(p, cache=cache)
    assert not first.cache_hit and first.library.is_file()
    plant(first.library, evil_library(tmp_path))
    again = compile_host(p, cache=cache)
    assert not again.cache_hit                                 # a miss: built again
    comm = Communicator(p, device="emu", cache=cache, timeout_s=30)
    check_run(comm, 1001, "float32", "sum", seed=3)            # the real kernel ran
    comm.close()
    assert not marker.exists()
    assert compile_host(p, cache=cache).cache_hit              # and the rebuilt entry is the user's again


def test_a_library_is_loaded_from_the_bytes_that_were_checked(tmp_path, marker, cold_cache):
    """Swapping the cache's file after the check changes nothing: the private copy is loaded."""
    cache = cold_cache
    p = plan()
    compile_host(p, cache=cache)
    hit = compile_host(p, cache=cache)
    assert hit.cache_hit
    hit.library.write_bytes(evil_library(tmp_path))            # after the check, before the load
    kernel = emu.load(hit.library, hit.layout, hit.dtype, hit.op, True, hit_args_size(), hit.image)
    assert kernel.lib.msc_args_size() == hit_args_size() and not marker.exists()


def hit_args_size() -> int:
    import ctypes

    from msc.cuda.launch import MscArgsHeader

    return ctypes.sizeof(MscArgsHeader)


@pytest.mark.parametrize("shared", [False, pytest.param(True, marks=pytest.mark.slow)])   # each builds a header
def test_planted_precompiled_headers_are_never_used(tmp_path, marker, shared):
    """A .gch built from the real headers plus a constructor, at the path msc would use: a miss,
    in a cache only this user can write (the checked .gch is then used in place) and in one that
    others can write to (a checked copy in the build's private folder)."""
    cache = tmp_path / "cache"
    from msc.cuda.codegen import environment

    text = environment().get_template("host_includes.h.j2").render()
    key = hostbuild.build_key(text, COMPILER, hostbuild.FLAGS)
    work = tmp_path / "evil-pch"
    work.mkdir()
    header = work / hostbuild.INCLUDES
    header.write_text(text + EVIL)
    subprocess.run([COMPILER.path, *hostbuild.FLAGS, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                   check=True, capture_output=True)
    planted = (work / f"{hostbuild.INCLUDES}.gch").read_bytes()
    target = cache / "host" / f"pch-{key}" / f"{hostbuild.INCLUDES}.gch"
    plant(target, planted)
    if shared:
        for folder in (cache, cache / "host", target.parent):
            folder.chmod(0o777)
    p = plan("allgather/ring:ring", 2, "Simple" if shared else "LL")
    comm = Communicator(p, device="emu", cache=cache, timeout_s=30)
    check_run(comm, 77, "float32", "sum", seed=4)
    comm.close()
    assert not marker.exists()
    assert target.read_bytes() != planted                      # replaced by the user's own
    assert (str(target.parent) in hostbuild._PCH_CHECKED) is not shared     # used in place only where private


def test_a_planted_source_is_not_compiled_and_a_copied_entry_is_a_miss(tmp_path):
    cache = tmp_path / "cache"
    p, other = plan(), plan("allgather/ring:ring", 2, "LL")
    first = rendered(p, cache=cache)
    assert not first.cache_hit and rendered(p, cache=cache).cache_hit
    plant(first.source_path, first.source.replace("MSC_", "MSC_PLANTED_", 1).encode())
    again = rendered(p, cache=cache)
    assert not again.cache_hit and again.source == first.source
    # the user's own valid entry, copied to another key's place: not that key's source
    second = rendered(other, cache=cache)
    for suffix in ("", kcache.SIDECAR):
        shutil.copyfile(f"{first.source_path}{suffix}", f"{second.source_path}{suffix}")
    moved = rendered(other, cache=cache)
    assert not moved.cache_hit and moved.source == second.source != first.source


def test_planted_tables_are_recomputed(tmp_path):
    from msc.cuda.compiler import tables

    cache = tmp_path / "cache"
    p = plan("allreduce/ring:ring", 4, "Simple")
    want = tables(p, cache=cache)
    (entry,) = (cache / "kernels").glob("tables-*/tables.i32")
    wrong = bytearray(entry.read_bytes())
    wrong[-4:] = b"\x07\x00\x00\x00"
    plant(entry, bytes(wrong))
    assert tables(p, cache=cache).to_bytes() == want.to_bytes()


def test_a_fifo_planted_as_an_entry_is_a_miss_not_a_hang(tmp_path):
    cache = tmp_path / "cache"
    p = plan()
    first = rendered(p, cache=cache)
    for suffix in ("", kcache.SIDECAR):
        path = Path(f"{first.source_path}{suffix}")
        path.unlink()
        os.mkfifo(path)
    got = []
    worker = threading.Thread(target=lambda: got.append(rendered(p, cache=cache)), daemon=True)
    worker.start()
    join(worker, 20)
    assert got and not got[0].cache_hit and got[0].source == first.source


def test_a_library_without_msc_entry_points_is_named_not_a_traceback(tmp_path):
    src = tmp_path / "lib.cpp"
    src.write_text('extern "C" int something(void) { return 0; }\n')
    lib = tmp_path / "kernel.so"
    subprocess.run([COMPILER.path, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    for image in (None, lib.read_bytes()):
        with pytest.raises(UsageError, match=f"{lib} is not a kernel library msc built: it lacks msc_launch"):
            emu.load(lib, None, "float32", "sum", True, hit_args_size(), image)
    with pytest.raises(UsageError, match=f"cannot load the kernel library {lib}"):
        emu.load(lib, None, "float32", "sum", True, hit_args_size(), b"not an ELF file")


def test_a_full_kernel_cache_costs_the_cache_not_the_run(tmp_path, monkeypatch, capsys, cold_cache):
    """Every write into the cache fails with ENOSPC: msc run --backend emu builds in a
    temporary folder, runs, and warns once, naming the cache (which held the headers before it filled)."""
    from msc.cli.main import main
    from msc.formats.plan_text import save_plan

    cache = cold_cache
    monkeypatch.setenv("MSC_CACHE_DIR", str(cache))
    save_plan(plan("allreduce/ring:ring", 2, "Simple"), tmp_path / "ring.plan")
    real = kcache.write_atomic

    def full(path, data, **kw):
        if str(path).startswith(str(cache / "host")) or str(path).startswith(str(cache / "kernels")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data, **kw)

    monkeypatch.setattr(kcache, "write_atomic", full)
    monkeypatch.setattr(kcache, "_warned", set())
    with pytest.warns(kcache.KernelCacheWarning) as seen:
        code = main(["run", str(tmp_path / "ring.plan"), "--backend", "emu", "-b", "64", "-e", "4K", "-f", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert all(r.split()[-1] == "0" for r in out.splitlines() if r and not r.startswith("#"))     # #wrong
    messages = [str(w.message) for w in seen]
    assert len(messages) == 1 and f"the kernel cache {cache} is full (No space left on device" in messages[0]
    assert not list(cache.glob("host/*/kernel.so"))


def test_a_cache_whose_folders_cannot_be_made_still_runs(tmp_path):
    """The same in a real process: the cache's host/ and kernels/ are files, so no entry can be written."""
    from msc.formats.plan_text import save_plan

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "host").write_text("not a folder")
    (cache / "kernels").write_text("not a folder")
    save_plan(plan("allreduce/ring:ring", 2, "Simple"), tmp_path / "ring.plan")
    env = {**os.environ, "MSC_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-m", "msc.cli", "run", str(tmp_path / "ring.plan"), "--backend", "emu",
                           "-b", "64", "-e", "64", "-f", "2"], capture_output=True, text=True, timeout=patience(300), env=env)
    assert done.returncode == 0, done.stderr
    assert f"the kernel cache {cache} cannot be written" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("msc: the kernel cache") == 1
