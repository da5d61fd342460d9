"""Both readers (plan text, MSCCL XML) under a seeded mutation loop, bounded
in time: every mutant is read and, where it parses, verified. Nothing may end
in anything but an msc error (no traceback), nothing may run past its time
budget (no hang), and every mutant the verifier accepts must compute the
collective right on the reference executor (random inputs, never zero,
against msc.verification.reference): a reader that accepted a wrong plan would fail here.

The counts (mutants tried, refused by the reader, refused by the verifier,
accepted and checked) are printed for the record (`pytest -s`).
"""
from __future__ import annotations

import random
import re
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest

import msc
from msc.verification import reference

from msc.executor import run_collective
from msc.lower.pipeline import LowerOptions, lower
from msc.formats.plan_text import dump_plan, parse_plan
from msc.verification.plan import verify_plan
from msc.formats.xml_export import plan_to_xml
from msc.formats.xml_import import xml_to_plan
from library import algorithms

MUTANTS = 4000              # per reader
BUDGET_S = 10               # per mutant: reading, verifying and running it
BASES = [("allreduce/ring:ring", 3, True), ("allgather/ring:ring", 4, False), ("alltoall/allpairs:allpairs", 3, True),
         ("reducescatter/ring:ring", 3, True), ("broadcast/chain:chain", 3, False), ("reduce/tree:tree", 4, True)]
NUMBERS = ("0", "1", "2", "3", "5", "-1", "4096", "99999999999999999999", "1" * 50)


class Hang(Exception):
    pass


@contextmanager
def budget(seconds: float):
    def expired(signum, frame):
        raise Hang(f"over {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def base_plans():
    out = []
    for key, n, inplace in BASES:
        program = msc.trace(algorithms()[key], n, inplace=inplace)
        out.append(lower(program, LowerOptions()))
    return out


def mutate(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        kind = rng.choice(("number", "number", "number", "delete", "duplicate", "swap", "char", "truncate"))
        if kind == "number":
            found = list(re.finditer(r"\d+", lines[i]))
            if found:
                m = rng.choice(found)
                lines[i] = lines[i][:m.start()] + rng.choice(NUMBERS + (str(int(m.group()) + 1),)) + lines[i][m.end():]
        elif kind == "delete" and len(lines) > 1:
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "swap":
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "char":
            at = rng.randint(0, len(lines[i]))
            lines[i] = lines[i][:at] + rng.choice("0123456789-[]:,.@\"<>/=x \t") + lines[i][at + rng.randint(0, 1):]
        else:
            joined = "\n".join(lines)
            lines = joined[:rng.randint(0, len(joined))].split("\n")
    return "\n".join(lines)


def computes_right(plan) -> bool:
    """The plan on the reference executor with random inputs equals msc.verification.reference (2 counts)."""
    from msc.cuda.validate import units

    if plan.collective not in reference.COLLECTIVES:
        return True                       # a custom collective named by a mutant: nothing to compare
    for count in (1, 7):
        in_units = units(plan)[0]
        inputs = reference.random_inputs(np.random.default_rng(count), np.dtype("float32"), "sum", plan.num_ranks,
                                      in_units * count)
        got = run_collective(plan, [x.copy() for x in inputs], "sum", count=count)
        want = reference.expected_outputs(plan.collective, inputs, op="sum", root=plan.root)
        for r in range(plan.num_ranks):
            if want[r] is not None and not np.allclose(got[r], want[r], rtol=1e-5):
                return False
    return True


@pytest.mark.parametrize("reader", ["plan", "xml"])
def test_mutated_files_are_refused_or_computed_right(reader):
    rng = random.Random(20261123 + (reader == "xml"))
    bases = [dump_plan(p) if reader == "plan" else plan_to_xml(p) for p in base_plans()]
    read = parse_plan if reader == "plan" else xml_to_plan
    counts = {"tried": 0, "unread": 0, "refused": 0, "accepted": 0}
    start = time.perf_counter()
    for i in range(MUTANTS):
        text = mutate(bases[i % len(bases)], rng)
        counts["tried"] += 1
        try:
            with budget(BUDGET_S):
                try:
                    plan = read(text)
                except msc.MscError:
                    counts["unread"] += 1
                    continue
                try:
                    verify_plan(plan)
                except msc.MscError:
                    counts["refused"] += 1
                    continue
                counts["accepted"] += 1
                assert computes_right(plan), f"accepted but wrong ({reader} mutant {i}):\n{text[:3000]}"
        except Hang:
            pytest.fail(f"{reader} mutant {i} ran over {BUDGET_S} s:\n{text[:3000]}")
        except AssertionError:
            raise
        except Exception as exc:          # noqa: BLE001 - the point: only msc errors
            pytest.fail(f"{reader} mutant {i}: {type(exc).__name__}: {str(exc)[:300]}\n{text[:2000]}")
    print(f"\n{reader}: {counts} in {time.perf_counter() - start:.1f} s")
    # the XML reader verifies what it reads (at the runtime's slots): its refusals count as unread
    assert counts["accepted"] > 0 and counts["unread"] > 0 and (reader == "xml" or counts["refused"] > 0), counts
