"""What a wheel install must carry: CI runs the suite against the installed
wheel (not the source tree), so these check the real packaging."""
from pathlib import Path

import msc
from msc.resources import data_dir


def test_data_folders_are_found():
    assert (data_dir("grammars") / "plan.lark").is_file()
    assert data_dir("templates").is_dir()
    assert (data_dir("algorithms") / "allreduce" / "ring.py").is_file()


def test_library_algorithm_by_name_keeps_its_source_lines():
    # In a wheel the library sits inside the msc package; its lines must still
    # be reported as the user's, not skipped as msc internals.
    [ring] = msc.load_algorithms("allreduce/ring")
    program = msc.trace(ring, 4)
    where = program.ops[0].where
    assert where is not None
    assert Path(where.file).name == "ring.py"
    source = (data_dir("algorithms") / "allreduce" / "ring.py").read_text().splitlines()
    assert ".copy(" in source[where.line - 1] or ".reduce(" in source[where.line - 1]


def test_verified_plan_digest_is_the_same_installed_and_in_the_checkout():
    """msc.verification.cache keys its cache by a digest of msc's sources: a wheel (the
    library inside the package) and a checkout (beside it) must agree, or a
    plan `msc compile` recorded from one is verified again by the other."""
    import subprocess
    import sys

    from msc.verification.cache import msc_digest

    checkout = Path(__file__).resolve().parent.parent
    show = "import msc.verification.cache as v; print(v.__file__); print(v.msc_digest())"
    other = subprocess.run([sys.executable, "-c", show],
                           cwd=checkout, capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    assert other.stdout.split()[1] == msc_digest()
