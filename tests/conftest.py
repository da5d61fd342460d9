"""Test-wide settings: a private cache, and every fast path checked against
the slow path it stands for."""
import atexit
import os
import shutil
import tempfile

import pytest

# A cache of our own (compiled kernels, verified plan texts): a developer's ~/.cache/msc must not
# decide what a test sees, and tests must not fill it. Removed when the session ends (the test
# processes' children write into it too, and are done by then).
if "MSC_CACHE_DIR" not in os.environ:
    os.environ["MSC_CACHE_DIR"] = tempfile.mkdtemp(prefix="msc-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MSC_CACHE_DIR"], ignore_errors=True)


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
