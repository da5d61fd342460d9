"""Test-wide settings: a private cache, and every fast path checked against
the slow path it stands for."""
import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# A cache of our own (compiled kernels, verified plan texts): a developer's ~/.cache/msc must not
# decide what a test sees, and tests must not fill it. Removed when the session ends (the test
# processes' children write into it too, and are done by then).
if "MSC_CACHE_DIR" not in os.environ:
    os.environ["MSC_CACHE_DIR"] = tempfile.mkdtemp(prefix="msc-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MSC_CACHE_DIR"], ignore_errors=True)
# The session's cache, shared by every xdist worker (they inherit the variable) and every command a test
# runs: its entries are keyed by their content (source, compiler, flags), so a kernel one test built is
# one no other test builds again, and no test may damage it (copy it first: cold_cache).
SESSION_CACHE = Path(os.environ["MSC_CACHE_DIR"])


def pytest_configure(config):
    """Bytecode kept in pytest's cache folder (.pytest_cache/d/pyc, which git ignores), also where
    PYTHONDONTWRITEBYTECODE is set: every xdist worker and every command a test runs (a README block, a
    CLI process, a torchrun rank) imports msc, torch and numpy, and compiling them again costs about half
    of a short command's CPU time. The prefix holds every module's bytecode, site-packages' and the
    assertion-rewritten test modules' too, so it is kept between sessions: a folder made new each session
    cost each worker 8 CPU-s of its 13 to collect (Python checks each .pyc against its source's size and
    time, as in __pycache__). No __pycache__ lands beside the sources; ``pytest --cache-clear`` empties it.
    Without pytest's cache (-p no:cacheprovider), a folder of the session's own, removed at its end."""
    if "PYTHONPYCACHEPREFIX" in os.environ:          # the user's, or (in a worker) the controller's
        return
    import sys

    folder = None
    if getattr(config, "cache", None) is not None:
        try:
            folder = str(config.cache.mkdir("pyc"))
        except OSError:                             # a read-only checkout
            folder = None
    if folder is None:
        folder = tempfile.mkdtemp(prefix="msc-test-pyc-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = folder
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


@pytest.fixture(autouse=True, scope="session")
def cross_checks():
    """Every fast path checked against its slow twin, every lowered plan's
    values checked (msc.verification.crosscheck), for the whole session in
    this process (commands a test runs as a subprocess run as users run them)."""
    from msc.verification import crosscheck

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(crosscheck, "ENABLED", True)
        yield


@pytest.fixture(scope="module")
def gloo2():
    """Two torch.distributed (gloo) worker processes for a module's tests
    (tests/torchdist.py); skipped without torch."""
    pytest.importorskip("torch")
    import torchdist

    pool = torchdist.Pool(2, timeout=180)
    yield pool
    pool.close()


def pytest_sessionfinish(session):
    """The forkserver torchdist's pools fork from is stopped and waited for (its workers, and the CPU
    time they used, are this test process's, not orphans')."""
    import sys

    if "torchdist" in sys.modules:
        sys.modules["torchdist"].stop_forkserver()


@pytest.fixture(scope="session")
def kernel_cache() -> Path:
    """The session's kernel cache (SESSION_CACHE): for tests that only read and add entries."""
    return SESSION_CACHE


@pytest.fixture(scope="session")
def _headers_built() -> Path | None:
    """The session cache's precompiled headers for the emulated device (built once, by a kernel
    build), or None where no compiler or no headers can be had."""
    from msc.cuda import hostbuild

    try:
        compiler = hostbuild.find_compiler()
    except Exception:                       # noqa: BLE001 - no compiler: the emulated device's tests skip
        return None
    import msc
    from library import algorithms
    from msc.cuda.compiler import compile_host
    from msc.cuda.runtime import runtime_plan
    from msc.lower.pipeline import LowerOptions, lower

    plan = lower(msc.trace(algorithms(switch=False)["allreduce/ring:ring"], 2), LowerOptions(protocol="LL", tile=4096))
    compile_host(runtime_plan(plan), cache=SESSION_CACHE)
    found = sorted(SESSION_CACHE.glob("host/pch-*"))
    return found[0] if compiler.gnu and found else None


@pytest.fixture
def cold_cache(tmp_path, _headers_built) -> Path:
    """A cache of this test's own (tmp_path/cache) holding no kernel: the session cache's key and, where
    g++ precompiles them, its standard headers, copied (a test may damage or plant anything in it; a
    build in it pays for the kernel, not for the headers again)."""
    cache = tmp_path / "cache"
    (cache / "verified").mkdir(parents=True, mode=0o700)
    key = SESSION_CACHE / "verified" / "key"
    if key.is_file():
        shutil.copy2(key, cache / "verified" / "key")
    if _headers_built is not None:
        shutil.copytree(_headers_built, cache / "host" / _headers_built.name,
                        ignore=shutil.ignore_patterns("build.lock"))
    return cache
