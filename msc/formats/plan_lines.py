"""A fast reader for plan text laid out as ``dump_plan`` writes it.

The grammar (grammars/plan.lark, read by lark in msc.formats.plan_text) defines the
format and reports every syntax error; building its parse tree costs about
100 us a step, minutes for the two million steps of a 1024-rank ring. Plans
are nearly always files msc wrote, one rank, threadblock or step per line,
so this module reads that layout with one regular expression per line.

It only ever takes the happy path: any line it does not recognise (a
comment inside the header, a step split over lines, an unusual name, a
negative number) and any value ``_build`` in plan_text would complain
about (version, step numbering, operand counts, empty slices) makes it
return None, and the caller parses the text with lark instead, which gives
the same plan or the grammar's error. Tests check that both readers agree
on every library plan and on fuzzed text.
"""
from __future__ import annotations

import json
import re

from msc.errors import PlanError, SourceLine
from msc.ir.contract_text import build_contract
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock

_WS = r"[ \t\f\r]"                        # what lark's WS skips within a line
_INT = r"[0-9]+"
_SLICE = rf"(?:input|output|scratch){_WS}*\[{_WS}*{_INT}{_WS}*(?::{_WS}*{_INT}{_WS}*)?\]"
_STRING = r'"(?:\\.|[^"\\])*"'
_OPS = "|".join(op.value for op in sorted(StepOp, key=lambda op: -len(op.value)))
_END = rf"{_WS}*(?:#[^\n]*)?\Z"
_W = r"[ \t\f\r\n]"                       # between header fields, newlines too

HEADER = re.compile(
    rf"{_W}*msc-plan{_W}+({_INT}){_W}+name{_W}+({_STRING}){_W}+collective{_W}+([A-Za-z_][A-Za-z0-9_]*)"
    rf"{_W}+ranks{_W}+({_INT}){_W}+chunk_factor{_W}+({_INT}){_W}+input_chunks{_W}+({_INT}){_W}+output_chunks"
    rf"{_W}+({_INT}){_W}+inplace{_W}+(true|false){_W}+root{_W}+({_INT}){_W}+protocol{_W}+([A-Za-z_][A-Za-z0-9_]*)"
    rf"{_W}+instances{_W}+({_INT}){_W}+slots{_W}+({_INT}){_W}+tile{_W}+({_INT})(?=[ \t\f\r]*(?:#[^\n]*)?(?:\n|\Z))")
RANK = re.compile(rf"{_WS}*rank{_WS}+({_INT}){_WS}+scratch{_WS}+({_INT}){_END}")
TB = re.compile(rf"{_WS}*tb{_WS}+({_INT}){_WS}+send{_WS}+({_INT}|-){_WS}+recv{_WS}+({_INT}|-){_WS}+channel"
                rf"{_WS}+({_INT})(?:{_WS}+group{_WS}+({_INT}(?:{_WS}*,{_WS}*{_INT})*))?{_END}")
STEP = re.compile(
    rf"{_WS}*({_INT}){_WS}*:{_WS}*({_OPS})"
    rf"(?:{_WS}+({_SLICE}(?:{_WS}*,{_WS}*{_SLICE})*))?"
    rf"(?:{_WS}*->{_WS}*({_SLICE}))?"
    rf"(?:{_WS}+after{_WS}+({_INT}\.{_INT}(?:{_WS}*,{_WS}*{_INT}\.{_INT})*))?"
    rf"(?:{_WS}+@{_WS}*({_STRING}){_WS}*:{_WS}*({_INT}))?{_END}")
SLICE_PARTS = re.compile(rf"(input|output|scratch){_WS}*\[{_WS}*({_INT}){_WS}*(?::{_WS}*({_INT}){_WS}*)?\]")
BLANK = re.compile(_END)
CONTRACT = re.compile(rf"{_WS}*contract{_END}")
CONTRACT_ROW = re.compile(rf"{_WS}*(post|pre){_WS}+({_INT}){_WS}*:((?:{_WS}+(?:\*|-|[0-9]+\.[0-9]+(?:\+[0-9]+\.[0-9]+)*))*){_END}")
OPS = {op.value: op for op in StepOp}


class _Fallback(Exception):
    """Something the fast path does not take: lark reads the text instead."""


def read_plan_lines(text: str, lines: dict, *, step_lines: bool = True) -> Plan | None:
    """The plan, with ``lines`` filled as plan_text does ((rank,),
    (rank, tb), (rank, tb, step) -> line), or None to let lark read it.
    ``step_lines=False`` leaves out the steps' lines (a dict of millions of
    keys, needed only to place an error: read again to get them)."""
    try:
        return _Reader(lines, step_lines).read(text)
    except _Fallback:
        lines.clear()
        return None


class _Reader:
    def __init__(self, lines: dict, step_lines: bool = True):
        self.lines, self.step_lines = lines, step_lines
        self.slices: dict[str, Slice] = {}
        self.strings: dict[str, str] = {}

    def read(self, text: str) -> Plan:
        head = HEADER.match(text)
        if head is None or int(head[1]) != 1:        # plan_text.FORMAT_VERSION; lark reports others
            raise _Fallback
        h = head.groups()
        if min(int(h[3]), int(h[4]), int(h[10]), int(h[11])) < 1:     # ranks, chunk_factor, instances, slots
            raise _Fallback                                               # plan_text._build names the token
        name = self.string(h[1])
        first_line = text.count("\n", 0, head.end()) + 1
        body = text[head.end():].split("\n")
        if not BLANK.match(body[0]):
            raise _Fallback
        contract, used = self.contract(body, first_line)
        if used:
            body, first_line = body[used:], first_line + used
        ranks = self.ranks(body, first_line)
        return Plan(name, h[2], int(h[3]), int(h[4]), h[7] == "true", int(h[5]), int(h[6]), ranks,
                    int(h[8]), h[9], int(h[10]), int(h[11]), int(h[12]), contract)

    def contract(self, body: list[str], first_line: int):
        """(the Contract, lines of ``body`` it took, up to the last before the
        first rank) where a contract follows the header; (None, 0) otherwise."""
        at = 1
        while at < len(body) and BLANK.match(body[at]):
            at += 1
        if at >= len(body) or CONTRACT.match(body[at]) is None:
            return None, 0
        rows, at = [], at + 1
        while at < len(body) and RANK.match(body[at]) is None:
            m = CONTRACT_ROW.match(body[at])
            if m is None:
                if not BLANK.match(body[at]):
                    raise _Fallback
            else:
                rows.append((m[1], int(m[2]), m[3].split(), first_line + at))
            at += 1
        try:
            return build_contract(rows), at - 1
        except PlanError:                # the grammar's reader says it, with the file's name
            raise _Fallback from None

    def ranks(self, body: list[str], first_line: int) -> tuple[RankPlan, ...]:
        """The ranks from the text after the header, split into lines:
        ``body[0]`` ends the header's line, line ``first_line``."""
        so_far = _SoFar()
        lines, step_lines = self.lines, self.step_lines
        # A step is its number, a colon, then text that alone decides the Step
        # (the number holds no colon): a line whose text after its first colon
        # was read before is that Step again, once its number checks out.
        # Large plans repeat a few step texts across all ranks: this loop
        # takes those lines itself, every other line goes to self.line.
        known: dict[str, Step] = {}
        rank, tb, steps = None, None, so_far.steps
        for number, line in enumerate(body[1:], start=first_line + 1):
            head, colon, rest = line.partition(":")
            step = known.get(rest) if colon else None
            if step is not None and tb is not None:
                position = head.strip(" \t\f\r")
                if position.isascii() and position.isdigit():
                    if int(position) != len(steps):
                        raise _Fallback
                    if step_lines:
                        lines[(rank, tb, len(steps))] = number
                    steps.append(step)
                    continue
            self.line(so_far, line, rest, number, known)
            rank, tb, steps = so_far.rank, None if so_far.tb is None else so_far.tb[0], so_far.steps
        return so_far.close()

    def line(self, so_far: _SoFar, line: str, rest: str, number: int, known: dict) -> None:
        """Line ``number``, not a step read before: a new step (``rest``, the
        text after its colon, becomes known), a threadblock, a rank or nothing."""
        m = STEP.match(line)
        if m is not None:
            if so_far.tb is None:
                raise _Fallback
            steps = so_far.steps
            if self.step_lines:
                self.lines[(so_far.rank, so_far.tb[0], len(steps))] = number
            steps.append(self.step(m, len(steps)))
            known[rest] = steps[-1]
            return
        m = TB.match(line)
        if m is not None:
            if so_far.rank is None:
                raise _Fallback
            group = tuple(int(x) for x in m[5].split(",")) if m[5] else ()
            so_far.threadblock((int(m[1]), _peer(m[2]), _peer(m[3]), int(m[4]), group))
            self.lines[(so_far.rank, so_far.tb[0])] = number
            return
        m = RANK.match(line)
        if m is not None:
            so_far.next_rank(int(m[1]), int(m[2]))
            self.lines[(so_far.rank,)] = number
            return
        if not BLANK.match(line):
            raise _Fallback

    def step(self, m, position: int) -> Step:
        if int(m[1]) != position:
            raise _Fallback
        srcs = tuple(self.slice(s.strip(" \t\f\r")) for s in m[3].split(",")) if m[3] else ()
        dst = self.slice(m[4]) if m[4] else None
        count = None
        for sl in (*srcs, dst) if dst is not None else srcs:
            if count is None:
                count = sl.count
            elif sl.count != count:
                raise _Fallback
        deps = ()
        if m[5]:
            deps = tuple((int(t), int(s)) for t, s in (d.strip(" \t\f\r").split(".") for d in m[5].split(",")))
        where = SourceLine(self.string(m[6]), int(m[7])) if m[6] else None
        return Step(OPS[m[2]], srcs, dst, count or 1, deps, where)

    def slice(self, text: str) -> Slice:
        sl = self.slices.get(text)
        if sl is None:
            buffer, lo, hi = SLICE_PARTS.fullmatch(text).groups()
            lo = int(lo)
            hi = lo + 1 if hi is None else int(hi)
            if hi <= lo:
                raise _Fallback
            sl = self.slices[text] = Slice(buffer, lo, hi - lo)
        return sl

    def string(self, quoted: str) -> str:
        value = self.strings.get(quoted)
        if value is None:
            try:
                value = json.loads(quoted)
            except ValueError:
                raise _Fallback from None
            self.strings[quoted] = value
        return value


class _SoFar:
    """The ranks read so far, and the rank and threadblock being read (its
    steps so far; ``tb``: (id, send, recv, channel, group))."""

    def __init__(self):
        self.ranks: list[RankPlan] = []
        self.rank = self.scratch = self.tb = None
        self.tbs: list[Threadblock] = []
        self.steps: list[Step] = []

    def threadblock(self, tb: tuple) -> None:
        self._close_tb()
        self.tb, self.steps = tb, []

    def next_rank(self, rank: int, scratch: int) -> None:
        self._close_rank()
        self.rank, self.scratch, self.tbs, self.tb, self.steps = rank, scratch, [], None, []

    def close(self) -> tuple[RankPlan, ...]:
        self._close_rank()
        return tuple(self.ranks)

    def _close_tb(self) -> None:
        if self.tb is not None:
            tid, send, recv, channel, group = self.tb
            self.tbs.append(Threadblock(tid, send, recv, channel, tuple(self.steps), group))

    def _close_rank(self) -> None:
        if self.rank is not None:
            self._close_tb()
            self.ranks.append(RankPlan(self.rank, self.scratch, tuple(self.tbs)))


def _peer(token: str) -> int | None:
    return None if token == "-" else int(token)
