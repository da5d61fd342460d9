"""Make "msc" a torch.distributed backend name, without importing torch.

``import msc.torch`` must stay torch-free (the CLI and the registry use
it), yet ``dist.init_process_group("msc")`` must work after it. So: when
torch.distributed is loaded already, register now; otherwise register the
moment it finishes loading (a one-shot import hook on its c10d module). The
creator imports msc.torch.process_group (and so torch) only when a group on
the backend is made.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

NAME = "msc"
_C10D = "torch.distributed.distributed_c10d"


def _create(store, rank, size, timeout):
    from msc.torch.process_group import create

    return create(store, rank, size, timeout)


def register(c10d=None) -> None:
    """Register the backend with torch.distributed (idempotent)."""
    c10d = c10d if c10d is not None else importlib.import_module(_C10D)
    if NAME.upper() in getattr(c10d.Backend, "_plugins", {}):
        return
    c10d.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])


class _AfterC10d(importlib.abc.MetaPathFinder):
    """Registers the backend right after torch.distributed's c10d module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _C10D:
            return None
        uninstall()                                  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register(module)
        spec.loader.exec_module = exec_module
        return spec


_HOOK = _AfterC10d()


def uninstall() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def install() -> None:
    module = sys.modules.get(_C10D)
    if module is not None and hasattr(module, "Backend"):
        register(module)
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
