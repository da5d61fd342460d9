"""The streaming plan writer (msc.formats.plan_text.plan_text_parts, save_plan):
its text equals the one-string printer it replaced, step by step, on the
library's plans and on a custom collective's (with its contract), and
save_plan writes those bytes and records the same verified-cache entry as
the text whole."""
from __future__ import annotations

import hashlib
import json

import pytest

import msc
from msc.formats.plan_text import FORMAT_VERSION, _peer, _step, dump_plan, plan_text_parts, save_plan
from msc.ir.contract_text import contract_lines
from msc.lower.pipeline import LowerOptions, lower
from msc.verification import cache as verified
from library import algorithms, neighbours, rank_counts

ALGORITHMS = algorithms()


def one_string(plan) -> str:
    """The printer before the writer streamed: every step formatted where it stands."""
    out = [
        f"msc-plan {FORMAT_VERSION}",
        f"name {json.dumps(plan.name)} collective {plan.collective} ranks {plan.num_ranks} "
        f"chunk_factor {plan.chunk_factor}",
        f"input_chunks {plan.input_chunks} output_chunks {plan.output_chunks} "
        f"inplace {'true' if plan.inplace else 'false'} root {plan.root}",
        f"protocol {plan.protocol} instances {plan.instances} slots {plan.slots} tile {plan.tile}",
    ]
    if plan.contract is not None:
        out.append("")
        out += contract_lines(plan.contract)
    for rp in plan.ranks:
        out.append("")
        out.append(f"rank {rp.rank} scratch {rp.scratch}")
        for tb in rp.threadblocks:
            group = f" group {','.join(map(str, tb.group))}" if tb.group else ""
            out.append(f"  tb {tb.id} send {_peer(tb.send)} recv {_peer(tb.recv)} channel {tb.channel}{group}")
            out += [f"    {i}: {_step(step)}" for i, step in enumerate(tb.steps)]
    return "\n".join(out) + "\n"


def library_plans():
    for key in sorted(ALGORITHMS):
        alg = ALGORITHMS[key]
        n = max(rank_counts(alg))
        for inplace in (True, False):
            yield key, lower(msc.trace(alg, n, inplace=inplace))
    ring = ALGORITHMS["allreduce/ring:ring"]
    yield "ring x2 LL", lower(msc.trace(ring, 5), LowerOptions(instances=2, protocol="LL"))


def custom_plan():
    program = msc.trace(neighbours, 4)
    msc.verify(program)
    return lower(program)


def test_the_streamed_text_is_the_one_string_text_on_the_library():
    done = 0
    for key, plan in library_plans():
        parts = list(plan_text_parts(plan))
        assert len(parts) == 1 + plan.num_ranks, key          # the header, then a piece per rank
        assert "".join(parts) == dump_plan(plan) == one_string(plan), key
        done += 1
    assert done > 2 * 20


def test_the_streamed_text_of_a_custom_collective_carries_its_contract():
    plan = custom_plan()
    assert plan.contract is not None
    text = dump_plan(plan)
    assert text == one_string(plan)
    assert "contract" in text.split("\nrank 0 ")[0]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MSC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MSC_VERIFY_CACHE", raising=False)
    monkeypatch.setattr(verified._STATE, "warned", set())
    return tmp_path


def test_save_plan_writes_the_text_and_remembers_its_digest(cache_dir):
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 8))
    text = dump_plan(plan)
    path = save_plan(plan, cache_dir / "ring.plan", verified=True)
    assert path.read_bytes() == text.encode()
    assert verified.known(text, "plan", plan.collective)            # the entry remember(text) would make
    assert not verified.known(text + "\n", "plan", plan.collective)
    entries = sorted(p.name for p in (cache_dir / "cache" / "verified").iterdir() if len(p.name) == 64)
    body = verified._body(text, "plan", plan.collective, None)
    assert entries == [hashlib.sha256(body).hexdigest()]


def test_save_plan_unverified_records_nothing(cache_dir):
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 4))
    save_plan(plan, cache_dir / "ring.plan")
    assert (cache_dir / "ring.plan").read_text() == dump_plan(plan)
    assert not verified.known(dump_plan(plan), "plan", plan.collective)
