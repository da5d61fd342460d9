"""What the "msc" torch.distributed backend does: its plans, engine, fallback and strictness.

Torch-free. ``configure(...)`` before ``init_process_group("msc")`` sets
them from Python; otherwise, or for what it leaves unset, the environment:

- ``MSC_PLANS``: the directory of plans (as for the DDP hook: a
  ``plans.json`` index, or every ``*.plan``/``*.xml`` file in it). Required:
  a job on the msc backend with no plans is a mistake, refused at init.
- ``MSC_ENGINE``: "auto" (default), "torch" or "cuda" (msc.torch.backends).
- ``MSC_FALLBACK``: the backend that runs what msc does not serve: one
  name for every device ("gloo") or a device map ("cpu:gloo,cuda:nccl",
  the default).
- ``MSC_STRICT=1``: a call of a collective that has plans, which msc
  does not serve, is an error naming why (instead of passing through).
- ``MSC_REPORT=1``: print ``msc.torch.report()`` at exit on rank 0.

A process group takes its settings when it is created; changing them
later affects only groups created later.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from msc.errors import UsageError

ENGINES = ("auto", "torch", "cuda")
DEFAULT_FALLBACK = {"cpu": "gloo", "cuda": "nccl"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    plans: object = None                 # a directory, index file, PlanRegistry, Plan or list
    engine: str = "auto"
    transport: str = "auto"
    fallback: dict = field(default_factory=lambda: dict(DEFAULT_FALLBACK))
    strict: bool = False
    report: bool = False


_CONFIGURED: dict = {}


def configure(*, plans=None, engine: str | None = None, transport: str | None = None, fallback: str | None = None,
              strict: bool | None = None, report: bool | None = None) -> None:
    """Settings for process groups created later on the "msc" backend;
    each given value overrides its environment variable (see the module
    doc). ``plans``: a directory, a plans.json or plan file, a
    PlanRegistry, a Plan or a list of plans."""
    given = {"plans": plans, "engine": engine, "transport": transport, "fallback": fallback, "strict": strict,
             "report": report}
    for key, value in given.items():
        if value is not None:
            _CONFIGURED[key] = value
    current()                       # a bad value fails here, not at init_process_group


def reset() -> None:
    """Forget what ``configure`` set (the environment decides again)."""
    _CONFIGURED.clear()


def _flag(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise UsageError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def parse_fallback(text: str, what: str = "MSC_FALLBACK") -> dict:
    """"gloo" -> every device on gloo; "cpu:gloo,cuda:nccl" -> a device map
    (devices not named keep the default)."""
    text = str(text).strip()
    if not text:
        raise UsageError(f"{what} is empty: name a torch.distributed backend (gloo, nccl) or a device map "
                         f"such as cpu:gloo,cuda:nccl")
    if ":" not in text:
        if "," in text:
            raise UsageError(f"{what}={text!r}: give one backend name or a device map such as cpu:gloo,cuda:nccl")
        return {device: _backend_name(text, what) for device in DEFAULT_FALLBACK}
    chosen = dict(DEFAULT_FALLBACK)
    for part in text.split(","):
        device, sep, name = part.strip().partition(":")
        if not sep or not device or not name:
            raise UsageError(f"{what}={text!r}: {part.strip()!r} is not DEVICE:BACKEND (e.g. cuda:nccl)")
        if device not in DEFAULT_FALLBACK:
            raise UsageError(f"{what}={text!r}: unknown device {device!r} (expected cpu or cuda)")
        chosen[device] = _backend_name(name, what)
    return chosen


def _backend_name(name: str, what: str) -> str:
    name = name.strip().lower()
    if name == "msc":
        raise UsageError(f"{what}: the fallback of the msc backend cannot be msc itself; name gloo, nccl or "
                         f"another torch.distributed backend")
    if not name.replace("_", "").isalnum():
        raise UsageError(f"{what}: {name!r} is not a backend name")
    return name


def current() -> Settings:
    """The settings a process group created now would take."""
    env = os.environ
    got = dict(_CONFIGURED)
    plans = got.get("plans", env.get("MSC_PLANS") or None)
    engine = got.get("engine", env.get("MSC_ENGINE") or "auto")
    if engine not in ENGINES:
        raise UsageError(f"msc engine {engine!r} is not one of {', '.join(ENGINES)} (MSC_ENGINE or "
                         f"msc.torch.configure(engine=...))")
    fallback = got.get("fallback", env.get("MSC_FALLBACK") or None)
    fallback = dict(DEFAULT_FALLBACK) if fallback is None else parse_fallback(fallback)
    strict = _flag("MSC_STRICT", got.get("strict", env.get("MSC_STRICT", "")))
    report = _flag("MSC_REPORT", got.get("report", env.get("MSC_REPORT", "")))
    transport = got.get("transport", "auto")
    return Settings(plans=plans, engine=engine, transport=transport, fallback=fallback, strict=strict,
                    report=report)


def require_plans(settings: Settings) -> Settings:
    """``settings`` with plans, or the UsageError that says how to give them."""
    if settings.plans is None:
        raise UsageError("the msc torch.distributed backend needs plans: set MSC_PLANS to a directory of plans "
                         "(msc tune ... -o DIR writes one) or call msc.torch.configure(plans=DIR) before "
                         "init_process_group('msc')")
    if isinstance(settings.plans, (str, Path)) and not Path(settings.plans).exists():
        raise UsageError(f"MSC_PLANS: {settings.plans} does not exist (a directory of plans, a plans.json or a "
                         f"plan file)")
    return settings
