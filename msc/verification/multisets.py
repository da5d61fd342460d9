"""Symbolic values in bulk: the numpy form of ``msc.verification.program_verifier``'s labels and
``Sum`` nodes, shared by the verifiers' fast paths (msc.verification.program_verifier_fast,
msc.verification.plan_fast).

Values are numbered: leaves (the collective's input labels) first, then
nodes of ``kind`` 1, an alias of value ``a`` (a copy), or 2, the sum
``a (+) b``.
"""
from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter, is_not

import numpy as np

from msc.dsl.collectives import BUILTIN, CustomCollective
from msc.ir.accesses import index_type

# Multiplicities are counted in float64 (np.bincount): exact below this.
_EXACT = float(1 << 52)


class Decline(Exception):
    """A fast path cannot vouch for its input (the caller runs the slow one)."""


def need(ok) -> None:
    if not ok:
        raise Decline


def expand(first, counts):
    """Per row, ``first + j`` for j < count: (row of each, j of each, value)."""
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    j = np.arange(int(counts.sum()), dtype=np.int64) - starts[rows]
    return rows, j, first[rows] + j


def pointers(select, to, dtype=np.int64):
    """Per entry ``to`` where ``select``, else the entry itself (the end of
    a chain), built in one array (at scale each is hundreds of MB); int32
    only where the caller has checked that the entries fit."""
    ptr = np.arange(select.size, dtype=dtype)
    np.copyto(ptr, to, where=select)
    return ptr


def jump(ptr, own: bool = False):
    """Pointer jumping to the end of every chain (entries at a fixed point
    end one); only entries not yet at an end are worked on. ``own``: ``ptr``
    is the caller's to overwrite (no copy)."""
    if not own:
        ptr = ptr.copy()
    target = ptr[ptr]                      # where each entry's pointer points
    active = np.flatnonzero(target != ptr)
    target = target[active]
    while active.size:
        ptr[active] = target
        # the next jump's targets are this round's test (nothing is written between), read once; an entry
        # moves on while they differ from this round's (what ptr[active] now holds, not read again)
        after = ptr[target]
        moving = after != target
        active, target = active[moving], after[moving]
    return ptr


def resolve(kind: np.ndarray, a: np.ndarray, b: np.ndarray):
    """Every value's representative (an alias goes to what it copies), and
    per value the representatives of its operands (-1 where it has none)."""
    rep = jump(pointers(kind == 1, a, index_type(kind.size)), own=True)      # (int32 where the values fit)
    return rep, rep[np.maximum(a, 0)], np.where(b >= 0, rep[np.maximum(b, 0)], -1)


def contributions(roots, kind, ca, cb):
    """Every root's leaves and their multiplicities: (root position, leaf,
    multiplicity) arrays, sorted by root then leaf.

    Sums used once (one operand edge into them) hang in trees under "heads"
    (roots, and sums used zero or several times): a pointer jump finds each
    sum's head, so a chain of sums is one step, not one per link. Each head's
    own leaves and sub-heads are counted together, then roots expand through
    sub-heads one depth at a time (shared nodes merged per root)."""
    T = len(kind)
    sums = np.flatnonzero(kind == 2)
    a, b = ca[sums], cb[sums]
    head = np.bincount(np.concatenate([a, b]), minlength=T) != 1
    head[roots] = True
    up = np.arange(T, dtype=index_type(T))            # a sum used once: the sum using it (int32 where T fits)
    for operand in (a, b):
        inner = (kind[operand] == 2) & ~head[operand]
        up[operand[inner]] = sums[inner]
    del operand, inner
    top = jump(up, own=True)
    del up                                            # (temporaries go once used: at scale each is tens of MB)
    # Each head's own entries: operand edges from its tree to leaves and to sub-heads.
    src = top[np.concatenate([sums, sums])]
    del top, sums
    dst = np.concatenate([a, b])
    del a, b
    keep = (kind[dst] == 0) | head[dst]
    src = src[keep].astype(np.int64)                   # (head, node) as one int64: head * T + node
    src *= T
    src += dst[keep]
    del dst, keep
    own, own_mult = np.unique(src, return_counts=True)
    del src
    heads = np.flatnonzero(head)                      # CSR: a head's entries lie together
    count = np.bincount(own // T, minlength=T)[heads]
    own_node = (own % T).astype(index_type(T))
    del own
    at = index_type(len(own_node) + 1)                # per value, where its entries start and how many
    start = np.zeros(T, dtype=at)
    start[heads] = np.cumsum(count) - count
    many = np.zeros(T, dtype=at)
    many[heads] = count
    del count, heads
    own_mult = own_mult.astype(np.float64)
    if (kind[roots] == 2).all():
        rows, _, e = expand(start[roots], many[roots])
        if (kind[own_node[e]] == 0).all():            # the usual case: no sub-heads under the roots
            return rows, own_node[e], own_mult[e].astype(np.int64)

    fr_r = np.arange(len(roots), dtype=np.int64)       # frontier: (root position, node, multiplicity)
    fr_n = np.asarray(roots, dtype=np.int64)
    fr_m = np.ones(len(roots))
    got_r, got_n, got_m = [], [], []
    while fr_n.size:
        leaf = kind[fr_n] == 0
        got_r.append(fr_r[leaf])
        got_n.append(fr_n[leaf])
        got_m.append(fr_m[leaf])
        inner = ~leaf
        r, nd, m = fr_r[inner], fr_n[inner], fr_m[inner]
        rows, _, e = expand(start[nd], many[nd])
        key = r[rows] * T + own_node[e]
        uk, inv = np.unique(key, return_inverse=True)
        fr_m = np.bincount(inv.reshape(-1), weights=m[rows] * own_mult[e], minlength=len(uk))
        fr_r, fr_n = uk // T, uk % T
        need(fr_m.size == 0 or fr_m.max() < _EXACT)
    key = np.concatenate(got_r) * T + np.concatenate(got_n)
    uk, inv = np.unique(key, return_inverse=True)
    mult = np.bincount(inv.reshape(-1), weights=np.concatenate(got_m), minlength=len(uk))
    need(mult.size == 0 or mult.max() < _EXACT)
    return uk // T, uk % T, mult.astype(np.int64)


def expectations(layout, cells_of):
    """Every checked output chunk: (cells, index into ``exps`` of each, exps,
    the distinct Expected objects). A row of expectations shared by ranks
    (Layout.expected_row) is read once. ``cells_of`` as for Leaves."""
    cells, which_of, exps, number, rows = [], [], [], {}, {}
    for rank in range(layout.num_ranks):
        buf, off, row = layout.expected_row(rank)
        seen = rows.get(id(row))
        if seen is None:
            present = np.flatnonzero(np.fromiter(map(is_not, row, repeat(None)), bool, len(row)))
            expected = row if len(present) == len(row) else [row[i] for i in present.tolist()]
            for e in expected:
                if id(e) not in number:         # exps keeps them alive: ids stay unique
                    number[id(e)] = len(exps)
                    exps.append(e)
            which = np.fromiter(map(number.__getitem__, map(id, expected)), np.int64, len(expected))
            seen = rows[id(row)] = (row, present, which)          # (row kept: its id stays unique)
        _, present, which = seen
        if len(present):
            cells.append(cells_of(rank, buf, off, int(present[-1]) + 1, off + present))
            which_of.append(which)
    if not cells:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), exps
    return np.concatenate(cells), np.concatenate(which_of), exps


def holds(values, which, exps, leaves, kind, ca, cb) -> bool:
    """Whether every output value ``values[p]`` (a representative) holds the
    contributions ``exps[which[p]]`` asks for; each distinct (value,
    expectation) pair is counted once."""
    pairs = np.unique(values.astype(np.int64) * len(exps) + which)          # (values may be int32)
    roots, which = pairs // len(exps), pairs % len(exps)
    uroots, pair_root = np.unique(roots, return_inverse=True)
    f_root, f_leaf, f_mult = contributions(uroots, kind, ca, cb)
    f_len = np.bincount(f_root, minlength=len(uroots))
    f_start = np.cumsum(f_len) - f_len
    used, pair_exp = np.unique(which, return_inverse=True)
    e_len, e_leaf, e_mult = leaves.expected(list(map(exps.__getitem__, used.tolist())))
    if e_leaf.size and e_leaf.min() < 0:
        return False                                  # a label no input starts as: no value holds it
    e_start = np.cumsum(e_len) - e_len
    length = f_len[pair_root.reshape(-1)]
    pair_exp = pair_exp.reshape(-1)
    if not (length == e_len[pair_exp]).all():
        return False
    _, _, fi = expand(f_start[pair_root.reshape(-1)], length)
    _, _, ei = expand(e_start[pair_exp], length)
    return bool((f_leaf[fi] == e_leaf[ei]).all() and (f_mult[fi] == e_mult[ei]).all())


class Leaves:
    """The collective's inputs: one leaf per distinct label, the cells where
    labels start (``cells``, with ``leaf_ids``), each leaf's class (its
    position mod ``k``), and each Expected's counts in leaves. Where labels
    are positions (the default precondition), leaf r * I + i is label (r, i)
    and nothing is asked per chunk. ``cells_of(rank, buffer, offset, width,
    index)``: the caller's cell numbers of chunks ``index`` of a physical
    buffer (raising Decline where they do not fit)."""

    def __init__(self, layout, k: int, cells_of):
        n = layout.num_ranks
        self.n, self.width = n, layout.logical_sizes["input"]
        self.positions = layout.collective.labels_are_positions
        # Built-in collectives and CustomCollective (which converts them) state labels as two ints.
        self.int_pairs = type(layout.collective) in (*BUILTIN.values(), CustomCollective)
        cells, classes, all_labels = [], [], []
        for rank in range(n):
            if self.positions:
                buf, off = layout.alias(rank, "input")
                got = None
                index = off + np.arange(self.width, dtype=np.int64)
                width = self.width
            else:
                buf, off, got = layout.initial_labels(rank)
                index = off + np.flatnonzero(np.fromiter(map(is_not, got, repeat(None)), bool, len(got)))
                width = len(got)
                if len(index) < len(got):
                    got = [label for label in got if label is not None]
                all_labels.extend(got)
            if not width:
                continue
            cells.append(cells_of(rank, buf, off, width, index))
            classes.append(index % k)
        self.cells = np.concatenate(cells) if cells else np.zeros(0, dtype=np.int64)
        classes = np.concatenate(classes) if classes else np.zeros(0, dtype=np.int64)
        if self.positions:
            self.count = n * self.width
            self.leaf_ids, self.leaf_class = np.arange(self.count, dtype=np.int64), classes
            return
        distinct = list(dict.fromkeys(all_labels))          # leaf i: the i-th distinct label, first come first
        self.count = L = len(distinct)
        self.leaf_of = dict(zip(distinct, range(L)))
        if L == len(all_labels):                             # the usual case: each label starts in one place
            self.leaf_ids, self.leaf_class = np.arange(L, dtype=np.int64), classes
        else:
            start_class = dict(zip(all_labels, classes.tolist()))   # the last one wins, as in the executor
            self.leaf_class = np.fromiter(map(start_class.__getitem__, distinct), np.int64, L)
            self.leaf_ids = np.fromiter(map(self.leaf_of.__getitem__, all_labels), np.int64, len(all_labels))

    def expected(self, exps: list):
        """Per Expected its number of distinct labels, and all of them as
        leaves (ascending within each; -1: no input starts as that label)
        with their multiplicities."""
        if self.positions and exps and all(e.every_rank is not None and e.every_rank[0] == self.n for e in exps):
            return self._of_every_rank(exps)
        length = np.fromiter(map(len, map(attrgetter("counts"), exps)), np.int64, len(exps))
        total = int(length.sum())
        mult = np.fromiter(chain.from_iterable(e.counts.values() for e in exps), np.int64, total)
        labels = list(chain.from_iterable(e.counts for e in exps))
        if self.positions:
            if not self.int_pairs:     # numpy would read 1.5 as 1: only labels of two ints compare as arrays
                need(all(type(x) is tuple and len(x) == 2 and type(x[0]) is int and type(x[1]) is int
                          for x in labels))
            flat = np.fromiter(chain.from_iterable(labels), np.int64, 2 * total)
            r, i = flat[0::2], flat[1::2]
            leaf = np.where((r >= 0) & (r < self.n) & (i >= 0) & (i < self.width), r * self.width + i, -1)
        else:
            leaf = np.fromiter(map(self.leaf_of.get, labels, repeat(-1)), np.int64, total)
        owner = np.repeat(np.arange(len(exps), dtype=np.int64), length)
        key = owner * (self.count + 1) + leaf
        if (key[1:] > key[:-1]).all():               # listed in order already (built-ins list them so)
            return length, leaf, mult
        order = np.lexsort((leaf, owner))
        return length, leaf[order], mult[order]

    def _of_every_rank(self, exps: list):
        """expected() where each Expected is label (r, i) of every rank r once
        (Expected.of_every_rank) and labels are positions: leaf r * width + i,
        ascending in r, without the labels as Python tuples."""
        n, e = self.n, len(exps)
        index = np.repeat(np.fromiter((x.every_rank[1] for x in exps), np.int64, e), n)
        rank = np.tile(np.arange(n, dtype=np.int64), e)
        leaf = np.where((index >= 0) & (index < self.width), rank * self.width + index, -1)
        return np.full(e, n, dtype=np.int64), leaf, np.ones(n * e, dtype=np.int64)
