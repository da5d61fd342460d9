"""The fast line reader (msc.formats.plan_lines) against the grammar: wherever the
fast path takes a text, lark must read the same plan with the same line
numbers; everything else falls back to lark."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings

from msc.errors import PlanError
from msc.formats.plan_lines import read_plan_lines
from msc.formats.plan_text import _parse_with_grammar, dump_plan, parse_plan
from library import uses_switch
from test_plan_text import ALGORITHMS, RING, assert_same, library_plan, mutated_text


def both(text: str):
    fast_lines, slow_lines = {}, {}
    fast = read_plan_lines(text, fast_lines)
    try:
        slow = _parse_with_grammar(text, slow_lines, None)
    except PlanError:
        slow = None
    return fast, fast_lines, slow, slow_lines


@pytest.mark.parametrize("key", sorted(ALGORITHMS))
def test_every_library_plan_takes_the_fast_path_and_agrees(key):
    alg = ALGORITHMS[key]
    protocols = ("Simple",) if uses_switch(alg) else ("Simple", "LL")        # switch ops run with Simple only
    for n, inplace, protocol in itertools.product((2, 3, 4, 8), (True, False), protocols):
        if not alg.supports(n):
            continue
        text = dump_plan(library_plan(key, n, inplace, protocol=protocol))
        fast, fast_lines, slow, slow_lines = both(text)
        assert fast is not None, f"{key} n={n}: the fast path refused dump_plan's own output"
        assert_same(fast, slow)
        assert fast_lines == slow_lines


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("ranks 3", "# a comment\nranks 3"),            # comment inside the header
    lambda t: t.replace("-> output[0]", "\n      -> output[0]", 1),     # a step over two lines
    lambda t: t.replace("send input[2]", "sendinput[2]", 1),           # lark needs no space there
    lambda t: t.replace("msc-plan 1", "msc-plan 2"),                   # a version lark's reader refuses
    lambda t: t.replace("1: rrs", "7: rrs", 1),                        # misnumbered step
    lambda t: t.replace("input[1]", "input[1:1]", 1),                  # empty slice
    lambda t: t.replace("slots 2", "slots 0"),
])
def test_unusual_text_falls_back_to_the_grammar(edit):
    text = edit(RING)
    fast, _, _, _ = both(text)
    assert fast is None
    try:
        parse_plan(text)
    except PlanError:
        pass


@pytest.mark.parametrize("word", ["rank", "reduce", "true", "after", "tb", "scratch"])
def test_keywords_as_collective_and_protocol_names_agree(word):
    """lark's contextual lexer reads a keyword as a NAME where only a name fits; so does the fast path."""
    text = RING.replace("collective allreduce", f"collective {word}").replace("protocol Simple", f"protocol {word}")
    fast, fast_lines, slow, slow_lines = both(text)
    assert fast is not None and slow is not None
    assert_same(fast, slow)
    assert (fast.collective, fast.protocol) == (word, word)


def test_crlf_comments_and_spacing_still_agree():
    text = RING.replace("\n", "  # note\r\n").replace("rank 0 scratch", "rank  0\tscratch")
    fast, fast_lines, slow, slow_lines = both(text)
    assert slow is not None
    if fast is not None:
        assert_same(fast, slow)
        assert fast_lines == slow_lines
    assert_same(parse_plan(text), slow)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_text())
def test_fuzzed_text_fast_path_agrees_with_the_grammar(text):
    fast, fast_lines, slow, slow_lines = both(text)
    if fast is not None:
        assert slow is not None, "the fast path took a text the grammar refuses"
        assert_same(fast, slow)
        assert fast_lines == slow_lines


def test_a_step_text_read_before_is_checked_for_its_number_and_place():
    """The fast path reuses the Step of a text it read before (the part
    after the step number): a misnumbered or misplaced repeat still falls back."""
    ring8 = dump_plan(library_plan("allreduce/ring:ring", 8, True))
    lines = ring8.split("\n")
    seen, repeat = {}, None
    for i, line in enumerate(lines):
        head, colon, rest = line.partition(":")
        if colon and head.strip().isdigit():
            if rest in seen:
                repeat = i
                break
            seen[rest] = i
    assert repeat is not None, "the fixture repeats no step text"
    head, _, rest = lines[repeat].partition(":")
    for bad in (f"{head}9:{rest}", f"x:{rest}", f"rank 0:{rest}"):
        text = "\n".join(lines[:repeat] + [bad] + lines[repeat + 1:])
        fast, _, slow, _ = both(text)
        assert fast is None and slow is None, bad
    fast, fast_lines, slow, slow_lines = both(ring8)
    assert_same(fast, slow)
    assert fast_lines == slow_lines
