"""Instruction fusion: rules as data, applied to the DAG.

Each rule joins a ``first`` instruction with a ``second`` one that consumes
the value ``first`` wrote, when the second's only dependency is the first
(so nothing can come between them) and the rule's condition holds:

    copy(x -> y)    rrc(y -> y)       -> rrc(x -> y)      out of place: reduce straight from the input
    copy(x -> y)    reduce(y <- y, a) -> reduce(y <- x, a)
    reduce(y <- .., a) reduce(y <- y, b) -> reduce(y <- .., a, b)   a chain of local reduces, one pass
    recv(x)         send(x)           -> rcs(x)            forward what arrives
    rrc(s -> x)     send(x)           -> rrcs(s -> x)      reduce what arrives, keep it, forward it
    rrcs(s -> x)    (x dead)          -> rrs(s)            ... and do not keep it when nobody reads it

The local rules (first three) drop the intermediate store, so they need the
first's value to have no other reader. The forwarding rules keep the store
and need the receive and send to share a threadblock: ``allowed(first,
second)`` decides that (threadblock assignment), and ``forwarding_pairs``
lists the candidates it decides on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from msc.lower.dag import Dag, Instr, instr_from_fields
from msc.ir import StepOp


@dataclass(frozen=True)
class Rule:
    name: str
    first: StepOp
    second: StepOp
    result: StepOp
    keeps_store: bool          # the first's store stays (others may read it)


LOCAL_RULES = (
    Rule("copy(x -> y) rrc(y -> y) -> rrc(x -> y)", StepOp.COPY, StepOp.RRC, StepOp.RRC, False),
    Rule("copy(x -> y) reduce(y <- y, a) -> reduce(y <- x, a)", StepOp.COPY, StepOp.REDUCE, StepOp.REDUCE, False),
    Rule("reduce(y <- .., a) reduce(y <- y, b) -> reduce(y <- .., a, b)", StepOp.REDUCE, StepOp.REDUCE,
         StepOp.REDUCE, False),
)
FORWARDING_RULES = (
    Rule("recv(x) send(x) -> rcs(x)", StepOp.RECV, StepOp.SEND, StepOp.RCS, True),
    Rule("rrc(s -> x) send(x) -> rrcs(s -> x)", StepOp.RRC, StepOp.SEND, StepOp.RRCS, True),
)


def _consumes(first: Instr, second: Instr, rule: Rule) -> bool:
    """``second`` reads exactly the chunks ``first`` wrote, in the place the rule expects."""
    if first.dst is None or first.rank != second.rank or first.count != second.count:
        return False
    d = first.dst
    if rule.second is StepOp.SEND:
        return _same(second.srcs[0], d)
    # rrc(y -> y) / reduce(y <- y, ..): the value is read and rewritten in place
    return _same(second.dst, d) and _same(second.srcs[0], d)


def _without(ids: tuple, drop: set, add: int | None = None) -> tuple:
    """``ids`` less ``drop``, plus ``add``, without repeats, in order."""
    out = [x for x in ids if x not in drop]
    if add is not None:
        out.append(add)
    return tuple(dict.fromkeys(out))


def _less(ids: tuple, x: int) -> tuple:
    """``ids`` without ``x`` (the same tuple when it has none: the usual case)."""
    return tuple(v for v in ids if v != x) if x in ids else ids


def _renamed(ids: tuple, old: int, new: int) -> tuple:
    """``ids`` (no repeats) less ``old``, plus ``new`` at the end unless
    present: _without(ids, {old}, new) without the set and the dict."""
    kept = _less(ids, old)
    return kept if new in kept else kept + (new,)


def _both(x: tuple, y: tuple, a: int, b: int) -> tuple:
    """``x`` then ``y`` (each without repeats) less ``a`` and ``b``, without
    repeats: _without(x + y, {a, b}), with no dict when ``y`` adds nothing."""
    if not y:
        return _less(_less(x, a), b)
    return tuple(dict.fromkeys(v for v in x + y if v != a and v != b))


def _same(x, y) -> bool:
    return x is y or (x is not None and y is not None and x.buffer == y.buffer and x.index == y.index
                      and x.count == y.count)


def _joined(first: Instr, second: Instr, rule: Rule) -> Instr:
    # every field spelled out: _replace builds a dict and is several times slower
    if rule.second is StepOp.SEND:   # the receive keeps its store and takes the send's message
        return instr_from_fields((first.id, first.rank, rule.result, first.srcs, first.dst, first.count,
                                  first.recv_peer, second.send_peer, first.msg_in, second.msg_out, first.channel,
                                  first.recvtb, second.sendtb, second.where, first.store))
    # local rules: first's sources replace the in-place operand (a copy's where is second's anyway)
    return second._replace(id=first.id, srcs=first.srcs + second.srcs[1:])


def _sources_stable(dag: Dag, first: Instr, second: Instr) -> bool:
    """Moving first's reads to second's time is safe: whatever overwrites a
    chunk first read already waits for second."""
    return all(second.id in dag.preds[w] for w in dag.overwriters[first.id] if w != second.id)


def _candidates(dag: Dag, rules) -> list[tuple[Instr, Instr, Rule]]:
    found = []
    firsts = tuple(rule.first for rule in rules)    # a tuple: hashing an Enum member is slow
    instrs, succs, preds, readers = dag.instrs, dag.succs, dag.preds, dag.readers
    for first in dag.live():
        if first.op not in firsts:   # most instructions start no rule: skip them early
            continue
        for rule in rules:
            if rule.first is not first.op:
                continue
            for sid in sorted(succs[first.id]):
                second = instrs[sid]
                if (second is not None and second.op is rule.second and preds[sid] == (first.id,)
                        and _consumes(first, second, rule)):
                    if not rule.keeps_store and (readers[first.id] != (sid,)
                                                 or not _sources_stable(dag, first, second)):
                        continue
                    found.append((first, second, rule))
                    break
    return found


def _merge(dag: Dag, first: Instr, second: Instr, joined: Instr, keeps_store: bool) -> None:
    """Replace first and second by ``joined``, which takes first's id: every
    table that named second names the joined instruction instead."""
    a, b = first.id, second.id
    preds, succs, readers, overwriters = dag.preds, dag.succs, dag.readers, dag.overwriters
    pb, sb = preds[b], succs[b]
    for p in pb:                    # whoever b depended on lists b as a successor/reader/overwriter
        if p != a:
            for table in (succs, readers, overwriters):
                if b in table[p]:
                    table[p] = _renamed(table[p], b, a)
    for s in sb:
        preds[s] = _renamed(preds[s], b, a)
    # b's only predecessor is a (a candidate's condition), so a's own lists just lose b
    preds[a] = _without(preds[a] + pb, {a, b}) if pb != (a,) else _less(preds[a], b)
    succs[a] = _both(succs[a], sb, a, b)
    overwriters[a] = _both(overwriters[a], overwriters[b], a, b)
    if keeps_store:                 # the joined write is first's (second is a send)
        readers[a] = _less(readers[a], b)
    else:                           # first's store is gone; the joined write is second's
        readers[a] = _less(readers[b], a)
        dag.overwritten[a] = dag.overwritten[b]
    preds[b] = succs[b] = readers[b] = overwriters[b] = ()
    dag.instrs[a], dag.instrs[b] = joined, None
    for msg in (joined.msg_in, joined.msg_out):
        if msg is not None:
            sender, receiver = dag.messages[msg]
            dag.messages[msg] = (a if sender == b else sender, a if receiver == b else receiver)


def fuse_local(dag: Dag) -> Dag:
    """Apply the local rules until none applies."""
    dag = dag.copy()
    while True:
        found = _candidates(dag, LOCAL_RULES)
        done = set()
        for first, second, rule in found:
            if first.id in done or second.id in done:
                continue
            first, second = dag.instrs[first.id], dag.instrs[second.id]
            if first is None or second is None:
                continue
            _merge(dag, first, second, _joined(first, second, rule), rule.keeps_store)
            done.update((first.id, second.id))
        if not done:
            return dag


def forwarding_pairs(dag: Dag) -> list[tuple[Instr, Instr, Rule]]:
    """Receive-then-send pairs that could fuse (rcs, rrcs)."""
    return _candidates(dag, FORWARDING_RULES)


def fuse_forwarding(dag: Dag, allowed: Callable[[Instr, Instr], bool], pairs=None) -> Dag:
    """Fuse the receive-then-send pairs ``allowed`` accepts, chains included
    (a receive fuses with one send; other sends of the same chunk stay).
    ``pairs``: forwarding_pairs(dag), when the caller already has them."""
    pairs = forwarding_pairs(dag) if pairs is None else pairs
    dag = dag.copy()
    for first, second, rule in pairs:
        first, second = dag.instrs[first.id], dag.instrs[second.id]
        if first is None or second is None or not allowed(first, second):
            continue
        _merge(dag, first, second, _joined(first, second, rule), rule.keeps_store)
    return dag


def drop_dead_stores(dag: Dag, final: Callable[[Instr], bool]) -> Dag:
    """rrcs(s -> x) -> rrs(s) where nobody reads x's new value and it does not
    survive to the end (``final(instr)``: its chunks are part of the result)."""
    dag = dag.copy()
    for instr in dag.live():
        if (instr.op is StepOp.RRCS and not dag.readers[instr.id]
                and (dag.overwritten[instr.id] or not final(instr))):
            # every field spelled out: _replace is several times slower
            dag.instrs[instr.id] = instr_from_fields((instr.id, instr.rank, StepOp.RRS, instr.srcs, None, instr.count,
                                                      instr.recv_peer, instr.send_peer, instr.msg_in, instr.msg_out,
                                                      instr.channel, instr.recvtb, instr.sendtb, instr.where,
                                                      instr.dst))
    return dag
