"""``msc diff``: do two plans describe the same schedule?

Two questions, two modes; each answers None (the same) or the first
``Difference``, naming rank, threadblock and step on both sides.

exact (default): the same plan, read top to bottom. The header
(collective, ranks, chunk factor, in place, input and output chunks, root,
protocol, instances, slots, tile), then per rank its scratch size and its
threadblocks (send and receive peer, channel), per threadblock its steps
(op, operands, dependencies). Not compared, as they change no step: the
plan's name (a label; an export, an import or another tool names it
otherwise), the algorithm lines steps are annotated with, and the order and
repetition of a step's dependencies (it waits for all of them).

equivalent: the same operations in the same partial order, however the
schedule is cut into threadblocks and however its waits are spelled.
Per rank:

- The operations are the steps other than nops, each taken as what it
  does: op, operands and, when it sends or receives, the peer and channel of
  that connection (so the message order on each connection counts). A
  ``reduce`` of m sources is taken as the steps MSCCL XML spells it with
  (``copy S1 -> D`` unless D is a source, then ``reduce D, Si -> D`` for each
  other source; see msc.formats.xml_export), so a plan and its XML compare.
- Happens-before is the transitive closure of program order (within a
  threadblock) and dependencies; a nop takes part as the step it is (it is
  done when the steps before it and its dependencies are) but is no
  operation. So nops, dependencies on the own threadblock and waits implied
  by other waits do not count, and neither do threadblock numbering, the
  threadblock count and the channel of purely local work.
- Two ranks are equivalent when a bijection between their operations keeps
  what each does and happens-before, both ways. Operations alike in every
  field are matched in happens-before order: in a race-free plan they are
  ordered (alike sends or receives share a connection, hence a
  threadblock; alike local steps write the same chunks). Unordered alike
  operations (a race) are matched in (threadblock, step) order, so two
  racy plans may differ here only by which one of them is which.
- Header: collective, ranks, chunk factor, in place, input and output
  chunks, root, protocol. Not compared: the name, instances, slots and tile
  (msc's records of how it lowered and verified a plan, which MSCCL XML from
  other tools does not hold) and scratch sizes (the operations' slices are
  compared).

Happens-before is kept as one bitset (a Python int) per step and rank:
memory grows as the square of a rank's steps (2 MB for 4,000).
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import NamedTuple

from msc.errors import PlanError, SourceLine
from msc.ir import Plan, RankPlan, Step, StepOp, Threadblock

EXACT_HEADER = ("collective", "num_ranks", "chunk_factor", "inplace", "input_chunks", "output_chunks", "root",
                "protocol", "instances", "slots", "tile")
EQUIVALENT_HEADER = EXACT_HEADER[:8]          # without instances, slots, tile (see above)
KEYWORDS = {"num_ranks": "ranks"}             # a header field as the plan text spells it


@dataclass(frozen=True)
class Side:
    """One plan's side of a difference: where (rank, threadblock, step; None
    above that level or where it has nothing) and what it has there."""

    rank: int | None
    tb: int | None
    step: int | None
    text: str
    source: SourceLine | None = None      # the algorithm line the step came from
    field: str | None = None              # a header difference: the Plan field

    @property
    def position(self) -> str:
        return ", ".join(f"{name} {v}" for name, v in (("rank", self.rank), ("threadblock", self.tb),
                                                       ("step", self.step)) if v is not None)

    @property
    def key(self) -> tuple:
        """What ``file_lines`` maps to a line."""
        if self.field is not None:
            return ("header", self.field)
        return tuple(v for v in (self.rank, self.tb, self.step) if v is not None)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "threadblock": self.tb, "step": self.step, "value": self.text,
                "field": self.field, "source": str(self.source) if self.source else None}


@dataclass(frozen=True)
class Difference:
    """The first way two plans differ. ``kind``: header, rank, threadblock,
    step (exact mode), operation or order (equivalent mode)."""

    kind: str
    summary: str
    a: Side
    b: Side

    def to_dict(self) -> dict:
        return {"kind": self.kind, "summary": self.summary, "a": self.a.to_dict(), "b": self.b.to_dict()}


def diff_plans(a: Plan, b: Plan, *, equivalent: bool = False, names: tuple[str, str] = ("a", "b")
               ) -> Difference | None:
    """None when ``a`` and ``b`` are the same schedule (exactly, or up to
    dependency equivalence), else their first difference; ``names`` name
    the plans in its summary. Plans need not verify; a dependency on a step
    that does not exist, or (equivalent mode) a cycle of dependencies, is a
    PlanError."""
    found = _header(a, b, EQUIVALENT_HEADER if equivalent else EXACT_HEADER, names)
    if found is not None:
        return found
    if len(a.ranks) != len(b.ranks):                  # only a plan that fails check_plan
        return Difference("rank", f"{names[0]} has {len(a.ranks)} rank sections, {names[1]} {len(b.ranks)}",
                          Side(None, None, None, f"{len(a.ranks)} ranks"),
                          Side(None, None, None, f"{len(b.ranks)} ranks"))
    compare = _equivalent_rank if equivalent else _exact_rank
    for ra, rb in zip(a.ranks, b.ranks):
        found = compare(ra, rb, names)
        if found is not None:
            return found
    return None


def _header(a: Plan, b: Plan, names_of_fields, names) -> Difference | None:
    for name in names_of_fields:
        va, vb = getattr(a, name), getattr(b, name)
        if va != vb:
            word = KEYWORDS.get(name, name)
            return Difference("header", f"{word}: {_value(va)} in {names[0]}, {_value(vb)} in {names[1]}",
                              Side(None, None, None, f"{word} {_value(va)}", field=name),
                              Side(None, None, None, f"{word} {_value(vb)}", field=name))
    return None


def _value(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


# -- exact ------------------------------------------------------------------------------------------
def _exact_rank(ra: RankPlan, rb: RankPlan, names) -> Difference | None:
    r = ra.rank
    if ra.scratch != rb.scratch:
        return Difference("rank", f"rank {r}: scratch is {ra.scratch} chunks in {names[0]}, {rb.scratch} in "
                                  f"{names[1]}", Side(r, None, None, f"scratch {ra.scratch}"),
                          Side(r, None, None, f"scratch {rb.scratch}"))
    for ta, tb in zip(ra.threadblocks, rb.threadblocks):
        found = _exact_threadblock(r, ta, tb, names)
        if found is not None:
            return found
    na, nb = len(ra.threadblocks), len(rb.threadblocks)
    if na != nb:
        t = min(na, nb)
        extra = (ra if na > nb else rb).threadblocks[t]
        only, other = (names[0], names[1]) if na > nb else (names[1], names[0])
        have = Side(r, t, None, _tb_text(extra))
        lack = Side(r, None, None, f"{min(na, nb)} threadblocks")
        return Difference("threadblock", f"rank {r}, threadblock {t}: only in {only} ({other} has {min(na, nb)} "
                                         f"threadblocks)", *((have, lack) if na > nb else (lack, have)))
    return None


def _exact_threadblock(r: int, ta: Threadblock, tb: Threadblock, names) -> Difference | None:
    t = ta.id
    differ = [word for word, x, y in (("send peer", ta.send, tb.send), ("receive peer", ta.recv, tb.recv),
                                      ("channel", ta.channel, tb.channel)) if x != y]
    if differ:
        return Difference("threadblock", f"rank {r}, threadblock {t}: {_differ(differ)}",
                          Side(r, t, None, _tb_text(ta)), Side(r, t, None, _tb_text(tb)))
    if ta.steps != tb.steps:                      # equal tuples: nothing to look at step by step
        for s, (sa, sb) in enumerate(zip(ta.steps, tb.steps)):
            differ = [word for word, x, y in (("op", sa.op, sb.op), ("sources", sa.srcs, sb.srcs),
                                              ("destination", sa.dst, sb.dst), ("count", sa.count, sb.count),
                                              ("dependencies", set(sa.deps), set(sb.deps))) if x != y]
            if differ:
                return Difference("step", f"rank {r}, threadblock {t}, step {s}: {_differ(differ)}",
                                  _step_side(r, t, s, sa), _step_side(r, t, s, sb))
    na, nb = len(ta.steps), len(tb.steps)
    if na != nb:
        s = min(na, nb)
        only, other = (names[0], names[1]) if na > nb else (names[1], names[0])
        have = _step_side(r, t, s, (ta if na > nb else tb).steps[s])
        lack = Side(r, t, None, f"{s} steps")
        return Difference("step", f"rank {r}, threadblock {t}, step {s}: only in {only} ({other} has {s} steps "
                                  f"there)", *((have, lack) if na > nb else (lack, have)))
    return None


def _differ(words: list[str]) -> str:
    plural = len(words) > 1 or words[0] in ("sources", "dependencies")
    return f"the {' and '.join(words)} differ{'' if plural else 's'}"


def _tb_text(tb: Threadblock) -> str:
    peer = lambda p: "-" if p is None else str(p)       # noqa: E731
    return f"tb {tb.id} send {peer(tb.send)} recv {peer(tb.recv)} channel {tb.channel}"


def step_text(step: Step) -> str:
    text = step.op.value
    if step.srcs:
        text += " " + ", ".join(map(str, step.srcs))
    if step.dst is not None:
        text += " -> " + str(step.dst)
    if step.deps:
        text += " after " + ", ".join(f"{t}.{s}" for t, s in step.deps)
    return text


def _step_side(r: int, t: int, s: int, step: Step) -> Side:
    return Side(r, t, s, step_text(step), step.where)


# -- equivalent: operations and happens-before ------------------------------------------------------
class _Node(NamedTuple):
    """One node of a rank's graph: an operation (``label``: what it does) or
    a nop (label None); ``part`` of ``parts``: its place in an expanded reduce."""

    label: tuple | None
    tb: int
    step: int
    part: int
    parts: int
    source: Step


def _primitives(step: Step, tb: Threadblock) -> list[tuple]:
    """The operations of a step: (op, sources, destination, (send peer,
    channel) or None, (receive peer, channel) or None); none for a nop."""
    if step.op is StepOp.NOP:
        return []
    if step.op is not StepOp.REDUCE:
        send = (tb.send, tb.channel) if step.op.sends else None
        recv = (tb.recv, tb.channel) if step.op.receives else None
        return [(step.op, step.srcs, step.dst, send, recv)]
    # reduce S1..Sm -> D as MSCCL XML spells it: [copy S1 -> D], then D += Si
    srcs, dst, out = list(step.srcs), step.dst, []
    if dst in srcs:
        srcs.remove(dst)
    else:
        out.append((StepOp.COPY, (srcs.pop(0),), dst, None, None))
    return out + [(StepOp.REDUCE, (dst, s), dst, None, None) for s in srcs]


def _graph(rp: RankPlan, name: str) -> tuple[list[_Node], list[list[int]], list[int]]:
    """The rank's nodes, each one's direct predecessors, and a topological
    order (ties broken by threadblock, step: deterministic)."""
    nodes: list[_Node] = []
    preds: list[list[int]] = []
    first, last = {}, {}
    for tb in rp.threadblocks:
        prev = None
        for s, step in enumerate(tb.steps):
            labels = _primitives(step, tb)
            ids = []
            for k, label in enumerate(labels or [None]):
                ids.append(len(nodes))
                nodes.append(_Node(label, tb.id, s, k, len(labels), step))
                preds.append([] if prev is None else [prev])
                prev = ids[-1]
            first[(tb.id, s)], last[(tb.id, s)] = ids[0], ids[-1]
    for tb in rp.threadblocks:
        for s, step in enumerate(tb.steps):
            for dep in step.deps:
                if dep not in last:
                    raise PlanError(f"{name}: dependency on threadblock {dep[0]} step {dep[1]}, which does not "
                                    f"exist", rank=rp.rank, tb=tb.id, step=s)
                preds[first[(tb.id, s)]].append(last[dep])
    return nodes, preds, _topological(nodes, preds, rp.rank, name)


def _topological(nodes, preds, rank, name) -> list[int]:
    succs: list[list[int]] = [[] for _ in preds]
    waiting = [len(p) for p in preds]
    for x, ps in enumerate(preds):
        for p in ps:
            succs[p].append(x)
    ready = [x for x, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        x = heapq.heappop(ready)
        order.append(x)
        for y in succs[x]:
            waiting[y] -= 1
            if waiting[y] == 0:
                heapq.heappush(ready, y)
    if len(order) < len(nodes):
        stuck = nodes[min(x for x, w in enumerate(waiting) if w)]
        raise PlanError(f"{name}: the step is on, or waits for, a cycle of dependencies (no order of the rank's "
                        f"steps exists)", rank=rank, tb=stuck.tb, step=stuck.step)
    return order


def _closure(preds, order, bit) -> tuple[list[int], list[int]]:
    """Per node, the operations that happen before it (bits), and those it
    waits for directly (through nops only)."""
    before, near = [0] * len(preds), [0] * len(preds)
    for x in order:
        b = n = 0
        for p in preds[x]:
            b |= before[p] | bit[p]
            n |= bit[p] or near[p]
        before[x], near[x] = b, n
    return before, near


def _bits(value: int):
    while value:
        low = value & -value
        yield low.bit_length() - 1
        value ^= low


def _label_text(label: tuple) -> str:
    op, srcs, dst, send, recv = label
    text = op.value + (" " + ", ".join(map(str, srcs)) if srcs else "") + (f" -> {dst}" if dst is not None else "")
    ends = ([f"from rank {recv[0]}"] if recv else []) + ([f"to rank {send[0]}"] if send else [])
    return text + (f" ({', '.join(ends)}, channel {(send or recv)[1]})" if ends else "")


def _node_text(node: _Node) -> str:
    text = _label_text(node.label)
    if node.parts > 1:
        text += f" (part {node.part + 1} of {node.parts} of {step_text(node.source)})"
    return text


def _equivalent_rank(ra: RankPlan, rb: RankPlan, names) -> Difference | None:
    r = ra.rank
    nodes_a, preds_a, order_a = _graph(ra, names[0])
    nodes_b, preds_b, order_b = _graph(rb, names[1])
    occurrences: list[dict] = []
    for nodes, order in ((nodes_a, order_a), (nodes_b, order_b)):
        occ: dict[tuple, list[int]] = {}
        for x in order:
            if nodes[x].label is not None:
                occ.setdefault(nodes[x].label, []).append(x)
        occurrences.append(occ)
    found = _unmatched(r, nodes_a, nodes_b, *occurrences, names)
    if found is not None:
        return found
    occ_a, occ_b = occurrences
    to_a = [-1] * len(nodes_b)                           # b's operation -> a's node
    to_b = [-1] * len(nodes_a)
    for label, xs in occ_a.items():
        for x, y in zip(xs, occ_b[label]):
            to_a[y], to_b[x] = x, y
    before_a, near_a = _closure(preds_a, order_a, [1 << x if n.label is not None else 0
                                                   for x, n in enumerate(nodes_a)])
    before_b, near_b = _closure(preds_b, order_b, [1 << to_a[y] if n.label is not None else 0
                                                   for y, n in enumerate(nodes_b)])
    real = [x for x in order_a if nodes_a[x].label is not None]
    b_before = {x: before_b[to_b[x]] for x in real}      # b's relation on a's numbering
    differ = [x for x in real if before_a[x] != b_before[x]]
    if not differ:
        return None
    # the first step that differs by itself, not only through what it waits for
    x = next((x for x in differ if all(before_a[p] == b_before[p] for p in _bits(near_a[x] | near_b[to_b[x]]))),
             differ[0])
    missing, extra = before_a[x] & ~b_before[x], b_before[x] & ~before_a[x]
    if missing:
        position = {x: i for i, x in enumerate(order_a)}
        y = max(_bits(missing & near_a[x] or missing), key=position.get)
        return _order_difference(r, x, y, y in _bits(near_a[x]), nodes_a, nodes_b, to_b, names, first_has=True)
    position = {to_a[y]: i for i, y in enumerate(order_b) if nodes_b[y].label is not None}
    y = max(_bits(extra & near_b[to_b[x]] or extra), key=position.get)
    return _order_difference(r, x, y, y in _bits(near_b[to_b[x]]), nodes_a, nodes_b, to_b, names, first_has=False)


def _unmatched(r, nodes_a, nodes_b, occ_a, occ_b, names) -> Difference | None:
    """The first operation (in threadblock, step order) of either plan that
    the other has fewer of."""
    for nodes, occ, other_nodes, other_occ, first in ((nodes_a, occ_a, nodes_b, occ_b, True),
                                                      (nodes_b, occ_b, nodes_a, occ_a, False)):
        spare = {x for label, xs in occ.items() for x in xs[len(other_occ.get(label, ())):]}
        if not spare:
            continue
        node = nodes[min(spare)]
        mine, theirs = len(occ[node.label]), len(other_occ.get(node.label, ()))
        text = _node_text(node)
        here, there = names if first else names[::-1]
        summary = (f"rank {r}: {text} is in {here} (threadblock {node.tb}, step {node.step}), not in {there}"
                   if theirs == 0 else f"rank {r}: {here} has {mine} of {text}, {there} {theirs}")
        have = Side(r, node.tb, node.step, text, node.source.where)
        # what the other plan has at the same place, to show what it was changed to
        same = next((n for n in other_nodes if (n.tb, n.step, n.part) == (node.tb, node.step, node.part)), None)
        if same is None:
            lack = Side(r, None, None, f"no {text}")
        else:
            lack = Side(r, same.tb, same.step, (f"no {text}; here: " if theirs == 0 else "here: ") +
                        (_node_text(same) if same.label is not None else step_text(same.source)), same.source.where)
        return Difference("operation", summary, *((have, lack) if first else (lack, have)))
    return None


def _order_difference(r, x, y, direct, nodes_a, nodes_b, to_b, names, first_has) -> Difference:
    """Operation x comes after operation y in one plan (a if ``first_has``), not in the other."""
    has, lacks = names if first_has else names[::-1]
    verb = "comes after" if direct else "comes after (through other steps)"
    summary = (f"rank {r}: {_node_text(nodes_a[x])} {verb} {_node_text(nodes_a[y])} in {has}, not in {lacks}")

    def side(nodes, ox, oy, holds):
        node, other = nodes[ox], nodes[oy]
        where = f"threadblock {other.tb}, step {other.step}"
        text = (f"{_node_text(node)}; {verb} {where}" if holds else
                f"{_node_text(node)}; does not come after {where}")
        return Side(r, node.tb, node.step, text, node.source.where)

    return Difference("order", summary, side(nodes_a, x, y, first_has), side(nodes_b, to_b[x], to_b[y], not first_has))


# -- where a difference is in the files ------------------------------------------------------------
def file_lines(data: bytes, reader: str) -> dict:
    """The line of each rank (rank,), threadblock (rank, tb), step (rank,
    tb, step) and header field ("header", field) of a plan file that
    msc.formats.load.read_plan_file read as ``reader`` ("plan" or "xml")."""
    if reader == "mscclpp":
        return {}                   # JSON: no lines to point at
    return _xml_lines(data) if reader == "xml" else _plan_lines(data.decode("utf-8"))


def line_of(lines: dict, key: tuple) -> int | None:
    """``key``'s line, else that of the nearest element holding it."""
    if key and key[0] == "header":
        return lines.get(key, lines.get(("header",)))
    while key and key not in lines:
        key = key[:-1]
    return lines.get(key) if key else None


_QUOTED = re.compile(r'"(?:\\.|[^"\\])*"')


def _plan_lines(text: str) -> dict:
    from msc.formats.plan_lines import read_plan_lines

    lines: dict = {}
    if read_plan_lines(text, lines) is None:       # not in dump_plan's layout: the grammar's reader places it
        from msc.formats.plan_text import _parse_with_grammar

        _parse_with_grammar(text, lines, None)
    header_end = min(lines.get((0,), 1 << 62), text.count("\n") + 1)
    for number, line in enumerate(text.splitlines()[:header_end], 1):
        bare = _QUOTED.sub('""', line.split("#", 1)[0])
        for name in EXACT_HEADER:
            if ("header", name) not in lines and re.search(rf"\b{KEYWORDS.get(name, name)}\b", bare):
                lines[("header", name)] = number
    return lines


def _xml_lines(data: bytes) -> dict:
    from xml.parsers import expat

    parser = expat.ParserCreate()
    lines: dict = {}
    at = {"rank": None, "tb": None, "step": 0}

    def start(tag, attrs):
        line = parser.CurrentLineNumber
        if tag == "algo":
            lines[("header",)] = line
        elif tag == "gpu":
            at["rank"] = int(attrs["id"])
            lines[(at["rank"],)] = line
        elif tag == "tb":
            at["tb"], at["step"] = int(attrs["id"]), 0
            lines[(at["rank"], at["tb"])] = line
        elif tag == "step":
            lines[(at["rank"], at["tb"], at["step"])] = line
            at["step"] += 1

    parser.StartElementHandler = start
    parser.Parse(data, True)
    return lines
