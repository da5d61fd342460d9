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
