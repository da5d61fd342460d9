"""Where msc's data folders are: inside the installed package (a wheel puts
``grammars/``, ``templates/`` and ``algorithms/`` under ``msc/``) or at the
top of a source checkout."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """The folder ``name`` (grammars, templates, algorithms)."""
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"msc data folder {name!r} not found beside {_PACKAGE}")
