"""bench/mutation_check.py's mutations still apply: each one's text occurs once in its file (code that
moved makes the check fail here, not an hour into a run), changes it, and names covering tests that exist."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "bench" / "mutation_check.py")
mutation_check = sys.modules.setdefault("mutation_check", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(mutation_check)          # registered first: its dataclass looks itself up there


def test_every_mutation_applies_once_and_names_existing_tests():
    ids = [m.id for m in mutation_check.MUTATIONS]
    assert len(ids) == len(set(ids))
    for m in mutation_check.MUTATIONS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1 and m.old != m.new, m.id
        files = [t for t in m.tests if t.endswith(".py")]
        assert files and all((ROOT / t).is_file() for t in files), m.id
