"""The package layout docs/architecture.md describes: stage
packages in layers that import only earlier layers, no import cycles, the
core free of the MSCCLang layer."""
import ast
import pkgutil
import re
from pathlib import Path

import msc

PACKAGE = Path(msc.__file__).parent                       # the msc under test (installed or not)
ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
# An installed wheel carries the data folders inside msc/ (msc.resources): the library's algorithm files
# are programs msc loads by path, not modules of the package, so they are in no layer.
DATA_FOLDERS = ("grammars", "templates", "algorithms")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in DATA_FOLDERS:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()

# docs/architecture.md's table of packages, row by row: a module imports (lazily too) only modules of its own
# package, of its own row, or of an earlier row.
LAYERS = (("msc.errors", "msc.perf", "msc.resources", "msc.progress", "msc.files"), ("msc.ir",), ("msc.units",),
          ("msc.dsl",), ("msc.verification",), ("msc.lower",), ("msc.formats",), ("msc.executor",), ("msc",),
          ("msc.sim",), ("msc.synth",), ("msc.cuda",), ("msc.torch",), ("msc.compat",), ("msc.cli", "msc.__main__"))


def _package(module: str) -> str:
    """The stage package or shared module ``module`` belongs to (msc itself: the public API)."""
    return ".".join(module.split(".")[:2])


def _layer(module: str) -> int:
    package = _package(module)
    return next(i for i, row in enumerate(LAYERS) if package in row)


def _import_lines(path: Path) -> list[tuple[int, str]]:
    """(line, msc module) of every import in ``path``, function-level ones too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("msc"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out += [(node.lineno, m) for m in sorted(subs)] or [(node.lineno, node.module)]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("msc")]
    return out


def _imports(path: Path, *, lazy: bool) -> set[str]:
    """msc modules ``path`` imports (all of them, or only at module level).
    ``from pkg import sub`` where pkg.sub is a module is an edge to the submodule."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if lazy else tree.body
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("msc"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= subs
            if len(subs) < len(node.names):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("msc")}
    return out & MODULES.keys()


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}         # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles_even_through_function_level_imports():
    for lazy in (False, True):
        graph = {name: _imports(path, lazy=lazy) - {name} for name, path in MODULES.items()}
        assert _cycle(graph) is None, f"import cycle ({'any' if lazy else 'module-level'} imports): " \
                                      f"{' -> '.join(_cycle(graph))}"


def test_every_import_points_to_an_earlier_layer():
    """0 package-level cycles, by construction: no module imports a later row of the table."""
    unplaced = sorted({_package(m) for m in MODULES} - {p for row in LAYERS for p in row})
    assert not unplaced, f"packages in no layer of docs/architecture.md's table: {unplaced}"
    upward = [f"{name}:{line} imports {dep} ({_package(dep)} is a later layer than {_package(name)})"
              for name, path in sorted(MODULES.items()) for line, dep in _import_lines(path)
              if _package(dep) != _package(name) and _layer(dep) > _layer(name)]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_a_lazy_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from msc.cli.main import main\n")
    assert (2, "msc.cli.main") in _import_lines(module)
    assert _layer("msc.cli.main") > _layer("msc.ir.ops")


def _layers_section() -> str:
    """The section of docs/architecture.md that holds the table of packages."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("\n## Packages in layers\n"):]
    end = section.find("\n## ", 1)
    return section if end < 0 else section[:end]


def test_the_architecture_table_is_in_layer_order():
    section = _layers_section()
    rows = [tuple(re.findall(r"`(msc(?:\.\w+)?)`", cell)) for cell in re.findall(r"^\| ([^|]+) \|", section, flags=re.M)]
    assert [r for r in rows if r] == [tuple(row) for row in LAYERS]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_top_level_shows_the_stages():
    """What help(msc) lists: the stage packages, a few shared modules, and
    ``__main__`` (``python -m msc``)."""
    top = {m.name for m in pkgutil.iter_modules(msc.__path__)}
    assert top == {"__main__", "cli", "compat", "cuda", "dsl", "errors", "executor", "files", "formats", "ir",
                   "lower", "perf", "progress", "resources", "sim", "synth", "torch", "units", "verification"}


def test_the_core_does_not_import_the_mscclang_layer():
    """Only the CLI reaches msc.compat (its scripts and Check() reports)."""
    allowed = {"msc.cli.main"}
    for name, path in MODULES.items():
        if name.startswith("msc.compat") or name in allowed:
            continue
        assert not any(dep.startswith("msc.compat") for dep in _imports(path, lazy=True)), name


def test_the_public_api_resolves():
    for name in msc.__all__:
        assert getattr(msc, name) is not None, name
    from msc.lower import LowerOptions, lower   # the entry point to lowering docs/dsl.md shows
    assert callable(lower) and LowerOptions().protocol


def test_the_architecture_table_names_every_top_level_module():
    section = _layers_section()
    first_cells = re.findall(r"^\| ([^|]+) \|", section, flags=re.M)
    named = {name.split(".", 1)[1] for cell in first_cells for name in re.findall(r"`(msc\.\w+)`", cell)}
    top = {m.name for m in pkgutil.iter_modules(msc.__path__)}
    assert named == top, f"docs/architecture.md lists {sorted(named - top)} that do not exist, misses {sorted(top - named)}"
