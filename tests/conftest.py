"""Test-wide settings."""
import os
import tempfile

# Check the values of every plan lowering builds (msc.lower.CHECK_IR), not only in use.
os.environ.setdefault("MSC_CHECK", "1")
# A cache of our own (compiled kernels, verified plan texts): a developer's ~/.cache/msc must not
# decide what a test sees, and tests must not fill it.
os.environ.setdefault("MSC_CACHE_DIR", tempfile.mkdtemp(prefix="msc-test-cache-"))
