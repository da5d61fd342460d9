"""The plan text format: ``dump_plan`` prints, ``parse_plan`` reads back an
equal plan (grammar: grammars/plan.lark). ``load_plan`` also reads MSCCL XML
and verifies what it loads unless asked not to.

Parse errors say line:column, what was found and what was expected; values
are checked after parsing (msc.verification.plan_values) and an error there names the
line of the offending rank, threadblock or step. An error quotes at most
80 characters of what it found (``shown``), however long the token; a file
that is not UTF-8 is named with the byte offset of the first bad byte.

Plan files are written whole or not at all (msc.files.write_output): a
reader that loads one while it is being rewritten gets the old text or the
new one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path

from msc.errors import PlanError, SourceLine
from msc.ir.contract_text import build_contract, contract_lines
from msc.files import write_output
from msc.verification import cache as verified_texts
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.perf import pause_gc
from msc.formats.plan_lines import read_plan_lines
from msc.resources import data_dir

FORMAT_VERSION = 1
SHOWN = 80               # characters of the input an error message quotes


def shown(value, limit: int = SHOWN) -> str:
    """``value`` as an error message quotes it: at most ``limit`` characters, then "..."."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def clipped(message: str, limit: int = SHOWN) -> str:
    """``message`` with every run of more than ``limit`` non-blank characters
    cut to ``limit`` and "..." (a message that quotes a value it did not shorten)."""
    return re.sub(rf"\S{{{limit + 1},}}", lambda m: m.group()[:limit] + "...", message)


# -- printing ---------------------------------------------------------------
def dump_plan(plan: Plan) -> str:
    return "".join(plan_text_parts(plan))


def plan_text_parts(plan: Plan):
    """dump_plan's text in pieces: the header, then one piece per rank (a
    writer streams them: a 1024-rank ring's text is 200 MB). Steps are shared
    between ranks and threadblocks (bulk lowering makes one object per
    distinct step), so each is formatted once, found by identity."""
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
    yield "\n".join(out) + "\n"
    notes: dict = {}             # id(SourceLine) -> its note (the plan holds every one while this runs)
    texts: dict = {}             # id(Step) -> its line after the number (likewise)
    numbers: list[str] = []      # "    i: " for i = 0, 1, ...
    for rp in plan.ranks:
        out = ["", f"rank {rp.rank} scratch {rp.scratch}"]
        for tb in rp.threadblocks:
            group = f" group {','.join(map(str, tb.group))}" if tb.group else ""
            out.append(f"  tb {tb.id} send {_peer(tb.send)} recv {_peer(tb.recv)} channel {tb.channel}{group}")
            steps = tb.steps
            if len(numbers) < len(steps):
                numbers += [f"    {i}: " for i in range(len(numbers), len(steps))]
            lines = list(map(texts.get, map(id, steps)))
            if None in lines:
                for i, step in enumerate(steps):
                    if lines[i] is None:
                        lines[i] = texts[id(step)] = _step(step, notes)
            out += map(str.__add__, numbers, lines)
        yield "\n".join(out) + "\n"


def _peer(p: int | None) -> str:
    return "-" if p is None else str(p)


def _slice(sl: Slice, count: int) -> str:
    return f"{sl.buffer}[{sl.index}]" if count == 1 else f"{sl.buffer}[{sl.index}:{sl.index + sl.count}]"


_OP_NAMES = {op: op.value for op in StepOp}     # (an Enum's .value is a property: slow per step)


def _step(step: Step, notes: dict | None = None) -> str:
    """A step's line after its number; ``notes`` caches each source line's note by identity."""
    text = _OP_NAMES[step.op]
    count = step.count
    if step.srcs:
        if count == 1:
            text += " " + ", ".join([f"{s.buffer}[{s.index}]" for s in step.srcs])
        else:
            text += " " + ", ".join([_slice(s, count) for s in step.srcs])
    dst = step.dst
    if dst is not None:
        text += f" -> {dst.buffer}[{dst.index}]" if count == 1 else " -> " + _slice(dst, count)
    if step.deps:
        text += " after " + ", ".join([f"{t}.{s}" for t, s in step.deps])
    where = step.where
    if where is not None:
        note = None if notes is None else notes.get(id(where))
        if note is None:
            note = f" @ {json.dumps(where.file)}:{where.line}"
            if notes is not None:
                notes[id(where)] = note
        text = f"{text:<44}{note}"
    return text


def save_plan(plan: Plan, path: str | Path, *, verified: bool = False) -> Path:
    """Write the plan's text. ``verified``: the caller verified this plan
    against the built-in collective it names, so loading the file needs no
    second verification (msc.verification.cache)."""
    path = Path(path)
    digest = hashlib.sha256() if verified and verified_texts.enabled() else None

    def pieces():                # one rank's text at a time, hashed as it goes
        for text in plan_text_parts(plan):
            data = text.encode()
            if digest is not None:
                digest.update(data)
            yield data

    write_output(path, pieces())
    if digest is not None:
        verified_texts.remember_digest(digest.hexdigest(), "plan", plan.collective)
    return path

# -- parsing ------------------------------------------------------------------
@lru_cache(maxsize=1)
def _parser():
    from lark import Lark

    return Lark((data_dir("grammars") / "plan.lark").read_text(), parser="lalr", propagate_positions=True)


@pause_gc        # a plan is millions of small acyclic objects: the collector would rescan them (30% at 512 ranks)
def parse_plan(text: str, *, path: str | None = None) -> Plan:
    """A plan from its text; PlanError on any syntax or value error."""
    lines: dict[tuple, int] = {}       # (rank,), (rank, tb), (rank, tb, step) -> line, for value errors
    try:
        plan = read_plan_lines(text, lines, step_lines=False) if isinstance(text, str) else None
    except ValueError:                 # a number of thousands of digits: lark reads it and says where
        plan = None
    fast = plan is not None
    if plan is None:                   # not in dump_plan's layout (or wrong): the grammar reads it
        plan = _parse_with_grammar(text, lines, path)
    from msc.verification.plan_values import check_plan

    try:
        check_plan(plan)
    except PlanError as exc:
        if fast and exc.step is not None:          # the fast read skipped the steps' lines: read again
            read_plan_lines(text, lines)
        key = tuple(v for v in (exc.rank, exc.tb, exc.step) if v is not None)
        while key and key not in lines:
            key = key[:-1]
        line = lines.get(key) if key else None
        if line is None:
            raise PlanError(clipped(str(exc)), path=path) from None
        raise PlanError(clipped(_strip_location(str(exc))), rank=exc.rank, tb=exc.tb, step=exc.step,
                        line=line, path=path) from None
    return plan


def _parse_with_grammar(text: str, lines: dict, path: str | None) -> Plan:
    from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

    try:
        tree = _parser().parse(text)
    except UnexpectedToken as exc:
        found = "end of file" if exc.token.type == "$END" else repr(shown(exc.token))
        raise PlanError(f"found {found}, expected {_expected(exc.expected)}",
                        line=exc.line, column=exc.column, path=path) from None
    except UnexpectedCharacters as exc:
        found = text[exc.pos_in_stream:exc.pos_in_stream + 1] if exc.pos_in_stream is not None else "?"
        raise PlanError(f"found {found!r}, expected {_expected(exc.allowed)}",
                        line=exc.line, column=exc.column, path=path) from None
    except UnexpectedEOF as exc:
        raise PlanError(f"found end of file, expected {_expected(exc.expected)}", path=path,
                        line=text.count("\n") + 1) from None
    except UnexpectedInput as exc:  # any other lark input error
        raise PlanError(clipped(f"syntax error: {exc}"), line=getattr(exc, "line", None),
                        column=getattr(exc, "column", None), path=path) from None
    return _build(tree, lines, path)


def _strip_location(message: str) -> str:
    # check_plan's message starts with "rank R, threadblock T, step S: "; PlanError adds it back
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith("rank ") else message


_NAMES = {"INT": "a number", "STRING": "a quoted string", "NAME": "a name", "BOOL": "true or false",
          "OP": "a step op", "DEP": "a dependency TB.STEP", "$END": "end of file"}


def _expected(names) -> str:
    """Terminal names as a reader knows them: literals quoted, patterns described."""
    literals = {t.name: t.pattern.value for t in _parser().terminals if type(t.pattern).__name__ == "PatternStr"}
    shown = sorted({_NAMES.get(n) or (repr(literals[n]) if n in literals else n.lower()) for n in names})
    return ", ".join(shown[:12]) if shown else "something else"


def _string(tok, path) -> str:
    """A quoted string of the plan (JSON escapes)."""
    try:
        return json.loads(str(tok))
    except ValueError as exc:
        raise PlanError(f"bad quoted string {shown(tok, 40)!r}: {exc.msg}", line=tok.line, column=tok.column,
                        path=path) from None


def _number(tok, path=None) -> int:
    """The integer a token spells (PlanError, placed, for one too long to read)."""
    try:
        return int(tok)
    except ValueError:
        raise PlanError(f"number {shown(tok, 20)!r} has {len(str(tok))} digits; too many", line=tok.line,
                        column=tok.column, path=path) from None


def _int(tok, what, low=None, path=None) -> int:
    value = _number(tok, path)
    if low is not None and value < low:
        raise PlanError(f"{what} must be >= {low}, got {value}", line=tok.line, column=tok.column, path=path)
    return value


def _build(tree, lines, path) -> Plan:
    header, *sections = tree.children
    contract = None
    if sections and sections[0].data == "contract":
        contract = build_contract([_contract_row(row, path) for row in sections[0].children], path)
        sections = sections[1:]
    h = header.children
    version = _number(h[0], path)
    if version != FORMAT_VERSION:
        raise PlanError(f"plan format version {version} is not supported (this msc reads {FORMAT_VERSION})",
                        line=h[0].line, column=h[0].column, path=path)
    name = _string(h[1], path)
    collective = str(h[2])
    num_ranks = _int(h[3], "ranks", 1, path)
    chunk_factor = _int(h[4], "chunk_factor", 1, path)
    input_chunks = _int(h[5], "input_chunks", 0, path)
    output_chunks = _int(h[6], "output_chunks", 0, path)
    inplace = str(h[7]) == "true"
    root = _int(h[8], "root", 0, path)
    protocol = str(h[9])
    instances = _int(h[10], "instances", 1, path)
    slots = _int(h[11], "slots", 1, path)
    tile = _int(h[12], "tile", 0, path)
    ranks = []
    for sec in sections:
        rank_tok, scratch_tok, *tbs = sec.children
        rank = _int(rank_tok, "rank", 0, path)
        lines[(rank,)] = rank_tok.line
        built = []
        for tb_tree in tbs:
            tid_tok, send, recv, ch_tok, *steps = tb_tree.children
            tid = _int(tid_tok, "threadblock id", 0, path)
            lines[(rank, tid)] = tid_tok.line
            group = ()
            if steps and steps[0].data == "group":
                group = tuple(_int(tok, "group member", 0, path) for tok in steps.pop(0).children)
            parsed = []
            for i, st in enumerate(steps):
                lines[(rank, tid, i)] = st.meta.line
                parsed.append(_build_step(st, i, path))
            built.append(Threadblock(tid, _peer_value(send, path), _peer_value(recv, path),
                                     _int(ch_tok, "channel", 0, path), tuple(parsed), group))
        ranks.append(RankPlan(rank, _int(scratch_tok, "scratch", 0, path), tuple(built)))
    return Plan(name, collective, num_ranks, chunk_factor, inplace, input_chunks, output_chunks, tuple(ranks),
                root, protocol, instances, slots, tile, contract)


def _contract_row(row, path) -> tuple[str, int, list[str], int]:
    """A contract row of the parse tree as build_contract takes it."""
    rank_tok, *items = row.children
    kind = "post" if row.data == "post_row" else "pre"
    return kind, _int(rank_tok, f"contract {kind} rank", 0, path), ["+".join(map(str, it.children)) for it in items], \
        rank_tok.line


def _peer_value(tree, path=None) -> int | None:
    tok = tree.children[0]
    return None if tok.type == "NONE" else _number(tok, path)


def _build_step(st, position, path) -> Step:
    num, op_tok, sources, *rest = st.children
    if _number(num, path) != position:
        raise PlanError(f"step numbered {int(num)} is step {position} of its threadblock",
                        line=num.line, column=num.column, path=path)
    op = StepOp(str(op_tok))
    srcs = tuple(_build_slice(s, path) for s in sources.children)
    dst, deps, where = None, (), None
    for part in rest:
        if part.data == "dest":
            dst = _build_slice(part.children[0], path)
        elif part.data == "deps":
            deps = tuple(_dep(d.children[0], path) for d in part.children)
        elif part.data == "source_line":
            where = SourceLine(_string(part.children[0], path), _number(part.children[1], path))
    slices = srcs + ((dst,) if dst is not None else ())
    counts = {s.count for s in slices}
    if len(counts) > 1:
        raise PlanError(f"the operands of a step must have one count, got {sorted(counts)}",
                        line=st.meta.line, column=st.meta.column, path=path)
    count = counts.pop() if counts else 1
    return Step(op, srcs, dst, count, deps, where)


def _dep(tok, path) -> tuple[int, int]:
    try:
        return tuple(int(x) for x in str(tok).split("."))
    except ValueError:
        raise PlanError(f"dependency {shown(tok, 20)!r} has too many digits", line=tok.line, column=tok.column,
                        path=path) from None


def _build_slice(tree, path=None) -> Slice:
    name, start, *end = tree.children
    lo = _number(start, path)
    hi = _number(end[0], path) if end else lo + 1
    if hi <= lo:
        raise PlanError(f"slice {shown(name)}[{lo}:{hi}] is empty", line=start.line, column=start.column, path=path)
    return Slice(str(name), lo, hi - lo)


def decode_utf8(data: bytes, path: str | None = None) -> str:
    """``data`` as UTF-8 text; a PlanError naming the file, the line and the
    byte offset of the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset {exc.start} ({exc.reason})",
                        path=path or "<plan>", line=data.count(b"\n", 0, exc.start) + 1) from None


def plan_digest(plan) -> str:
    """16 hex digits naming a plan's content: its text less
    its name and the source lines of its steps."""
    text = re.sub(r'[ ]+@ "[^\n]*', "", dump_plan(dataclasses.replace(plan, name="")))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
