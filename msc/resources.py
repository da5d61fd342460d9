"""Where msc's files are: its data folders, inside the installed package (a
wheel puts ``grammars/``, ``templates/`` and ``algorithms/`` under ``msc/``)
or at the top of a source checkout; and its cache."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent    # msc/ itself
_PACKAGE = PACKAGE_DIR


def data_dir(name: str) -> Path:
    """The folder ``name`` (grammars, templates, algorithms). ``$MSC_TEMPLATES_DIR``
    replaces the templates (for trying a changed template, e.g. the injected
    faults of bench/emu_faults.py; the kernel caches key on their contents)."""
    override = os.environ.get(f"MSC_{name.upper()}_DIR") if name == "templates" else None
    if override:
        if not Path(override).is_dir():
            raise FileNotFoundError(f"$MSC_TEMPLATES_DIR={override!r} is not a folder")
        return Path(override)
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"msc data folder {name!r} not found beside {_PACKAGE}")


def cache_dir() -> Path:
    """$MSC_CACHE_DIR, else ~/.cache/msc (XDG_CACHE_HOME respected)."""
    if os.environ.get("MSC_CACHE_DIR"):
        return Path(os.environ["MSC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "msc"
