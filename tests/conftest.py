"""Test-wide settings."""
import os

# Check the values of every plan lowering builds (msc.lower.CHECK_IR), not only in use.
os.environ.setdefault("MSC_CHECK", "1")
