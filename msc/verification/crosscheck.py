"""One switch, off in use: run every fast path's slow twin beside it and
fail where they disagree (the DSL verifier, the plan verifier), check the
values of every plan lowering builds, and let a crash of the plan verifier's
fast path raise rather than decline. Each costs time for nothing in use;
the tests turn it on (tests/conftest.py, the ``cross_checks`` fixture).

Not one of msc.verification.cache's verdict modules: turning it on only adds
checks, so a test session that does still records what it verified."""

ENABLED = False
