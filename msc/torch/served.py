"""What the "msc" backend served and what it passed through, and why: ``msc.torch.report()``.

Torch-free. Every call a user (or FSDP, DDP...) makes on an msc process
group is counted once, by (collective, bytes, dtype): served by a plan on an
engine, or passed through to the fallback backend with the reason. Calls
msc makes itself while serving (the executor's messages, the runtime's
bootstrap) are not counted. Counts are this process's; every rank makes the
same calls, so rank 0's report stands for the job.
"""
from __future__ import annotations

import threading
from collections import Counter

from msc.units import format_size

_LOCK = threading.Lock()
_COUNTS: Counter = Counter()          # (collective, nbytes, dtype, outcome) -> calls


def served(collective: str, nbytes: int, dtype, plan: str, engine: str) -> None:
    _add(collective, nbytes, dtype, ("served", f"{plan} on {engine}"))


def passed(collective: str, nbytes: int | None, dtype, reason: str) -> None:
    _add(collective, nbytes, dtype, ("passed", reason))


def _add(collective, nbytes, dtype, outcome) -> None:
    with _LOCK:
        _COUNTS[(collective, nbytes, dtype, outcome)] += 1


def clear() -> None:
    with _LOCK:
        _COUNTS.clear()


def counts() -> list[dict]:
    """One row per (collective, bytes, dtype, outcome), in collective and size order:
    {"collective", "bytes", "dtype", "outcome": "served"|"passed", "how": plan/engine or reason, "calls"}."""
    with _LOCK:
        items = list(_COUNTS.items())
    rows = [{"collective": c, "bytes": b, "dtype": spelled(d), "outcome": o[0], "how": o[1], "calls": k}
            for (c, b, d, o), k in items]
    rows.sort(key=lambda r: (r["collective"], -1 if r["bytes"] is None else r["bytes"], str(r["dtype"]),
                             r["outcome"] != "served", r["how"]))
    return rows


def spelled(dtype) -> str | None:
    """"float32" for torch.float32 (kept as the object while counting: every call counts)."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def totals() -> dict[str, int]:
    """{"served": calls, "passed": calls}."""
    out = {"served": 0, "passed": 0}
    for row in counts():
        out[row["outcome"]] += row["calls"]
    return out


def report() -> str:
    """The table: per collective, size and dtype, the calls msc served (plan
    and engine) and those passed through to the fallback (why)."""
    rows = counts()
    if not rows:
        return "msc backend: no calls yet"
    t = totals()
    head = ("collective", "size", "dtype", "calls", "served by msc / passed through (why)")
    body = [(r["collective"], "-" if r["bytes"] is None else format_size(r["bytes"]), r["dtype"] or "-",
             str(r["calls"]), ("served: " if r["outcome"] == "served" else "passed: ") + r["how"]) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
    lines = [f"msc backend: {t['served']} calls served by msc plans, {t['passed']} passed through"]
    for row in [head, *body]:
        lines.append("  ".join(x.ljust(w) for x, w in zip(row[:4], widths)) + "  " + row[4])
    return "\n".join(lines)
