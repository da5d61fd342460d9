"""A plan read into columns (numpy arrays), once: the one reading of a
plan's structure that the plan verifier's fast path
(msc.verification.plan_fast), the simulator (msc.sim.sim_plan) and the CUDA
renderer (msc.cuda.codegen) share, so that they agree on which step is
which, how connections are numbered and which send each receive takes.

Steps get global ids in rank, threadblock, step order, so threadblock t's
steps are ``tb_start[t]:tb_start[t + 1]``; threadblocks get global indices
in rank, threadblock order. Connections (sender, receiver, channel) are
numbered once, in sorted order: every one a threadblock names, at either
end. A connection's messages are its sending steps and its receiving steps,
each in step order: the k-th send is the k-th receive's message (a
connection has one threadblock at each end, the MSCCL rule).

The plan may be malformed (the plan verifier's fast path reads unchecked
plans), so nothing here refuses one: what a consumer must refuse is
recorded instead (ranks or threadblock ids out of order, two threadblocks
on one end of a connection, a connection without a sender, a step that
sends or receives where its threadblock has no peer, a dependency naming no
step, unequal send and receive counts) for it to decline or raise on.

``plan_arrays(plan)`` reads a plan's ranks once and keeps the arrays of the
last few while those ranks live (plans with the same ranks, such as
``replace(plan, slots=..)``, share them); the arrays are read-only. Plans
share objects (bulk lowering repeats a few Step objects over millions of
positions, the plan parser shares Slice objects): attributes are read once
per distinct object where objects repeat.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields
from functools import cached_property
from itertools import chain, count as serials, repeat
from operator import attrgetter, is_not, itemgetter

import numpy as np

from msc.ir import StepOp
from msc.perf import pause_gc

OPS = tuple(StepOp)                                     # a step's op code is its op's index here
_CODE = {id(op): i for i, op in enumerate(OPS)}         # id(): hashing an Enum member is slow
SENDS = np.array([op.sends for op in OPS])
RECEIVES = np.array([op.receives for op in OPS])
# Objects are read once per distinct one when a sample of this many has at
# most half distinct (np.unique over their ids costs less than the reading).
_SAMPLE = 1 << 12
# Plans whose arrays plan_arrays keeps (lowering, verifying, simulating and
# rendering one plan read it once; a few more for callers that alternate).
_KEPT = 4

_op, _srcs, _dst, _deps, _count = (attrgetter(a) for a in ("op", "srcs", "dst", "deps", "count"))
_buffer, _index = attrgetter("buffer"), attrgetter("index")


@dataclass(frozen=True, eq=False)
class PlanArrays:
    """The columns of a plan's ranks (see the module docstring).

    Per rank, in the plan's order: ``rank_id`` (as written), ``rank_scratch``
    and ``rank_tb_start`` (its first threadblock; one entry more). Per
    threadblock: ``tb_rank``, ``tb_id`` (as written), ``tb_start`` (its first
    step; one entry more), ``tb_send_conn`` and ``tb_recv_conn`` (-1: none).
    Per step: ``op`` (a code into OPS), ``count``, ``step_tb``, and read or
    computed on demand ``nsrc``, ``has_dst``, ``step_pos`` (within its
    threadblock) and ``step_rank``. Per dependency, in step order:
    ``dep_owner`` (the step that waits), ``dep_tb`` and ``dep_pos`` as
    written (-1 where not a pair of ints), ``dep_step`` (its global id, -1
    where it names no step of the owner's rank). Per
    connection, sorted: ``conn_sender``, ``conn_receiver``, ``conn_channel``,
    how many threadblocks name it at each end (``conn_senders``,
    ``conn_receivers``) and the first of them (``conn_send_tb``,
    ``conn_recv_tb``, -1: none); its sending steps
    ``send_steps[send_ptr[c]:send_ptr[c + 1]]`` and its receiving steps from
    ``recv_steps`` and ``recv_ptr`` alike. ``unconnected``: the steps that
    send or receive where their threadblock has no peer (in no message).
    The steps' operands are read on demand (``operands()``)."""

    rank_id: np.ndarray
    rank_scratch: np.ndarray
    rank_tb_start: np.ndarray
    tb_rank: np.ndarray
    tb_id: np.ndarray
    tb_start: np.ndarray
    tb_send_conn: np.ndarray
    tb_recv_conn: np.ndarray
    op: np.ndarray
    count: np.ndarray
    step_tb: np.ndarray
    dep_owner: np.ndarray
    dep_tb: np.ndarray
    dep_pos: np.ndarray
    dep_step: np.ndarray
    conn_sender: np.ndarray
    conn_receiver: np.ndarray
    conn_channel: np.ndarray
    conn_senders: np.ndarray
    conn_receivers: np.ndarray
    conn_send_tb: np.ndarray
    conn_recv_tb: np.ndarray
    send_steps: np.ndarray
    send_ptr: np.ndarray
    recv_steps: np.ndarray
    recv_ptr: np.ndarray
    unconnected: np.ndarray
    _table: _StepTable = field(repr=False)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                value.flags.writeable = False      # shared by every consumer of the plan

    @property
    def num_steps(self) -> int:
        return len(self.op)

    @property
    def num_tbs(self) -> int:
        return len(self.tb_rank)

    @property
    def num_conns(self) -> int:
        return len(self.conn_sender)

    @property
    def sends_per_conn(self) -> np.ndarray:
        return np.diff(self.send_ptr)

    @property
    def receives_per_conn(self) -> np.ndarray:
        return np.diff(self.recv_ptr)

    def ranks_in_order(self, num_ranks: int) -> bool:
        """Whether the plan lists ranks 0 .. num_ranks - 1, in order."""
        return len(self.rank_id) == num_ranks and bool((self.rank_id == np.arange(num_ranks)).all())

    @property
    def ids_in_order(self) -> bool:
        """Whether every threadblock's id is its position in its rank."""
        tb_rank_pos = np.repeat(np.arange(len(self.rank_id)), np.diff(self.rank_tb_start))
        return bool((self.tb_id == np.arange(self.num_tbs) - self.rank_tb_start[tb_rank_pos]).all())

    @property
    def one_threadblock_per_end(self) -> bool:
        """Whether no connection has two threadblocks at one end (else the
        order of its messages would depend on timing)."""
        return bool((self.conn_senders <= 1).all() and (self.conn_receivers <= 1).all())

    @property
    def deps_in_range(self) -> bool:
        """Whether every dependency names a step of its rank."""
        return bool((self.dep_step >= 0).all())

    @property
    def nsrc(self) -> np.ndarray:
        return self._table.per_step(self._table.nsrc)

    @property
    def has_dst(self) -> np.ndarray:
        return self._table.per_step(self._table.has_dst)

    @property
    def step_pos(self) -> np.ndarray:
        return np.arange(self.num_steps, dtype=np.int64) - self.tb_start[self.step_tb]

    @property
    def step_rank(self) -> np.ndarray:
        return self.tb_rank[self.step_tb]

    def operands(self) -> Operands:
        """The steps' operands, read anew on each call: only the plan
        verifier's fast path needs them, once per plan it prepares, and
        they would more than double what the cache keeps."""
        return self._table.operands()


@dataclass(frozen=True, eq=False)
class Operands:
    """The slices the steps read and write, a row each, in step order:
    sources (``src_owner`` the step, ``src_pos`` which of its sources) and
    destinations (``dst_owner``), each with a buffer (a code into
    ``buffer_names``), index and count."""

    buffer_names: tuple[str, ...]
    src_owner: np.ndarray
    src_pos: np.ndarray
    src_buf: np.ndarray
    src_index: np.ndarray
    src_count: np.ndarray
    dst_owner: np.ndarray
    dst_buf: np.ndarray
    dst_index: np.ndarray
    dst_count: np.ndarray

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                value.flags.writeable = False


# -- the cache ------------------------------------------------------------------------
class _Entry:
    """A plan's arrays and weak references to the RankPlans they were read
    from (a tuple cannot be referred to weakly): the arrays depend on
    nothing else, and RankPlans are immutable."""

    __slots__ = ("arrays", "refs", "serial")

    def __init__(self, ranks, arrays: PlanArrays, serial: int, forget):
        self.arrays, self.serial = arrays, serial
        self.refs = [weakref.ref(rp, forget) for rp in ranks]

    def holds(self, ranks) -> bool:
        return len(self.refs) == len(ranks) and all(map(_refers_to, self.refs, ranks))


def _refers_to(ref, obj) -> bool:
    return ref() is obj


class _Cache:
    """The arrays of the last few ranks tuples read, by the tuple's id, each
    dropped once one of its RankPlans dies (so the cache keeps no plan
    alive). One object: msc.verification.cache checks that this module's
    globals stay the same objects."""

    def __init__(self):
        self.entries: dict[int, _Entry] = {}          # most recently used last
        self.serials = serials()

    def arrays(self, ranks) -> PlanArrays:
        key = id(ranks)
        entry = self.entries.pop(key, None)
        if entry is not None and entry.holds(ranks):
            self.entries[key] = entry
            return entry.arrays
        arrays = _read(ranks)
        try:
            self.entries[key] = _Entry(ranks, arrays, serial := next(self.serials), self._forgetter(key, serial))
        except TypeError:             # ranks that cannot be referred to weakly (not RankPlans): not kept
            return arrays
        for old in list(self.entries)[:-_KEPT]:
            self.entries.pop(old, None)
        return arrays

    def _forgetter(self, key: int, serial: int):
        """What drops entry ``serial`` when one of its RankPlans dies (an
        entry put under the key since stays)."""
        entries = self.entries

        def forget(_ref):
            entry = entries.get(key)
            if entry is not None and entry.serial == serial:
                entries.pop(key, None)
        return forget


_CACHE = _Cache()


def plan_arrays(plan) -> PlanArrays:
    """The arrays of ``plan``'s ranks, read once while they live."""
    return _CACHE.arrays(plan.ranks)


# -- reading --------------------------------------------------------------------------
@pause_gc
def _read(ranks) -> PlanArrays:
    """The columns of a plan's ``ranks``: a pass of Python over the
    threadblocks and one over the distinct steps, the rest in numpy."""
    tbs = _Threadblocks(ranks)
    conns = _Connections(tbs)
    table = _StepTable(tbs.steps)
    del tbs.steps
    step_tb = np.repeat(np.arange(len(tbs.rank), dtype=np.int64), np.diff(tbs.start))
    op = table.per_step(table.op)
    dep_owner, _, row = _rows(table.ndep, table.inverse)
    dep_tb, dep_pos = table.dep_tb[row], table.dep_pos[row]
    dep_step = _dependency_steps(dep_owner, dep_tb, dep_pos, step_tb, tbs)
    send_steps, send_ptr, unsent = _by_connection(SENDS[op], tbs.start, conns.tb_send, conns.count)
    recv_steps, recv_ptr, unreceived = _by_connection(RECEIVES[op], tbs.start, conns.tb_recv, conns.count)
    return PlanArrays(
        tbs.rank_id, tbs.scratch, tbs.rank_tb_start, tbs.rank, tbs.id, tbs.start, conns.tb_send, conns.tb_recv,
        op, table.per_step(table.count), step_tb, dep_owner, dep_tb, dep_pos, dep_step, conns.sender, conns.receiver, conns.channel,
        conns.senders, conns.receivers, conns.send_tb, conns.recv_tb, send_steps, send_ptr, recv_steps, recv_ptr,
        np.union1d(unsent, unreceived), table)


class _Threadblocks:
    """One pass over the ranks and their threadblocks: per rank its id,
    scratch and first threadblock; per threadblock its rank, id, first step
    and connection keys (None: no peer); every step, in order."""

    def __init__(self, ranks):
        rank_id, scratch, rank_tb_start = [], [], [0]
        tb_rank, tb_id, tb_len, self.send_keys, self.recv_keys = [], [], [], [], []
        self.steps: list = []
        for rp in ranks:
            rank = rp.rank
            for tb in rp.threadblocks:
                tb_rank.append(rank)
                tb_id.append(tb.id)
                tb_len.append(len(tb.steps))
                self.send_keys.append(None if tb.send is None else (rank, tb.send, tb.channel))
                self.recv_keys.append(None if tb.recv is None else (tb.recv, rank, tb.channel))
                self.steps.extend(tb.steps)
            rank_id.append(rank)
            scratch.append(rp.scratch)
            rank_tb_start.append(len(tb_rank))
        self.rank_id, self.scratch = _ints(rank_id), _ints(scratch)
        self.rank_tb_start, self.rank, self.id = _ints(rank_tb_start), _ints(tb_rank), _ints(tb_id)
        self.start = _ints([0, *tb_len]).cumsum()


class _Connections:
    """Every connection a threadblock names, sorted; each threadblock's
    (``tb_send``, ``tb_recv``); how many threadblocks are at each end of a
    connection and the first of them."""

    def __init__(self, tbs: _Threadblocks):
        keys = sorted({key for key in chain(tbs.send_keys, tbs.recv_keys) if key is not None})
        number = {key: i for i, key in enumerate(keys)}
        self.count = len(keys)
        columns = _ints(keys).reshape(-1, 3)
        self.sender, self.receiver, self.channel = (columns[:, i].copy() for i in range(3))
        self.tb_send = _ints([-1 if key is None else number[key] for key in tbs.send_keys])
        self.tb_recv = _ints([-1 if key is None else number[key] for key in tbs.recv_keys])
        self.senders, self.send_tb = self._ends(self.tb_send)
        self.receivers, self.recv_tb = self._ends(self.tb_recv)

    def _ends(self, tb_conn: np.ndarray):
        """Per connection: threadblocks at this end, and the first (-1: none)."""
        named = np.flatnonzero(tb_conn >= 0)
        how_many = np.bincount(tb_conn[named], minlength=self.count)
        first = np.full(self.count, len(tb_conn), dtype=np.int64)
        np.minimum.at(first, tb_conn[named], named)
        first[how_many == 0] = -1
        return how_many, first


class _StepTable:
    """Per distinct Step object (``inverse``: each step's; None where steps
    do not repeat enough to pay): op code, count and dependencies (-1, -1
    where one is not a pair of ints); on first use the sources and the
    destination (the simulator and the CUDA layout need neither)."""

    def __init__(self, steps: list):
        self.objs, self.inverse = _distinct(steps)
        objs = self.objs
        m = len(objs)
        code = _CODE
        self.op = np.fromiter([code[id(step.op)] for step in objs], np.int8, m)
        self.count = np.fromiter(map(_count, objs), np.int64, m)
        pairs: list = []
        self.ndep = np.zeros(m, dtype=np.int64)
        if any(map(_deps, objs)):
            deps = list(map(_deps, objs))
            self.ndep = np.fromiter(map(len, deps), np.int64, m)
            pairs = list(chain.from_iterable(deps))
            if not all(map(_is_pair, pairs)):
                pairs = [d if _is_pair(d) else (-1, -1) for d in pairs]
        self.dep_tb = np.fromiter(map(itemgetter(0), pairs), np.int64, len(pairs))
        self.dep_pos = np.fromiter(map(itemgetter(1), pairs), np.int64, len(pairs))

    def per_step(self, values: np.ndarray) -> np.ndarray:
        return values if self.inverse is None else values[self.inverse]

    @cached_property
    def srcs(self) -> list:
        return list(map(_srcs, self.objs))

    @cached_property
    def dsts(self) -> list:
        return list(map(_dst, self.objs))

    @cached_property
    def nsrc(self) -> np.ndarray:
        return _read_only(np.fromiter(map(len, self.srcs), np.int64, len(self.objs)))

    @cached_property
    def has_dst(self) -> np.ndarray:
        return _read_only(np.fromiter(map(is_not, self.dsts, repeat(None)), bool, len(self.objs)))

    def operands(self) -> Operands:
        names: dict[str, int] = {}                    # buffer names as the slices spell them
        src = _Slices(list(chain.from_iterable(self.srcs)), names)
        src_owner, src_pos, row = _rows(self.nsrc, self.inverse)
        src_columns = src.buf[row], src.index[row], src.count[row]
        dst = _Slices([d for d in self.dsts if d is not None], names)
        dst_owner = np.flatnonzero(self.per_step(self.has_dst))
        dst_columns = (dst.buf, dst.index, dst.count)
        if self.inverse is not None:
            dst_row = np.cumsum(self.has_dst) - 1                      # a distinct step's row among the dsts
            dst_columns = tuple(c[dst_row[self.inverse[dst_owner]]] for c in dst_columns)
        return Operands(tuple(names), src_owner, src_pos, *src_columns, dst_owner, *dst_columns)


class _Slices:
    """Buffer (a code into ``names``, which it extends), index and count of each slice of ``flat``."""

    def __init__(self, flat: list, names: dict):
        objs, inverse = _distinct(flat)
        bufs = list(map(_buffer, objs))
        for b in dict.fromkeys(bufs):
            names.setdefault(b, len(names))
        m = len(objs)
        self.buf = np.fromiter(map(names.__getitem__, bufs), np.int64, m)
        self.index = np.fromiter(map(_index, objs), np.int64, m)
        self.count = np.fromiter(map(_count, objs), np.int64, m)
        if inverse is not None:
            self.buf, self.index, self.count = self.buf[inverse], self.index[inverse], self.count[inverse]


def _is_pair(dep) -> bool:
    return type(dep) is tuple and len(dep) == 2 and type(dep[0]) is int and type(dep[1]) is int


def _distinct(objs: list):
    """(the distinct objects, index of each position's among them), or
    (objs, None) where too few repeat to pay for finding them (judged on a
    sample of positions: repeats may be far apart, between ranks)."""
    n = len(objs)
    if n > _SAMPLE:
        sample = np.random.default_rng(0).integers(0, n, _SAMPLE).tolist()
        if len(set(map(id, map(objs.__getitem__, sample)))) * 2 > _SAMPLE:
            return objs, None
    ids = np.fromiter(map(id, objs), np.int64, n)    # the objects are alive: their ids are distinct
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    if len(first) * 2 > n:
        return objs, None
    return list(map(objs.__getitem__, first.tolist())), inverse.reshape(-1)


def _rows(counts: np.ndarray, inverse):
    """Rows owned per distinct object (``counts`` each, in order) -> rows
    owned per position: (position of each row, its number among its
    position's rows, its row in the distinct table)."""
    if not counts.any():                                    # the common case of dependencies: none
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    first = np.cumsum(counts) - counts
    if inverse is not None:
        first, counts = first[inverse], counts[inverse]
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    table_row = ranges(first, counts)
    return owner, table_row - first[owner], table_row


def _dependency_steps(owner, dep_tb, dep_pos, step_tb, tbs: _Threadblocks) -> np.ndarray:
    """The global id of each dependency's step, -1 where (threadblock, step)
    names no step of the owner's rank."""
    tb_rank_pos = np.repeat(np.arange(len(tbs.rank_id), dtype=np.int64), np.diff(tbs.rank_tb_start))
    rank_pos = tb_rank_pos[step_tb[owner]]
    first_tb = tbs.rank_tb_start[rank_pos]
    named = (dep_tb >= 0) & (dep_tb < tbs.rank_tb_start[rank_pos + 1] - first_tb)
    tb = np.where(named, first_tb + dep_tb, 0)
    named &= (dep_pos >= 0) & (dep_pos < tbs.start[tb + 1] - tbs.start[tb])
    return np.where(named, tbs.start[tb] + dep_pos, -1)


def _by_connection(chosen: np.ndarray, tb_start: np.ndarray, tb_conn: np.ndarray, num_conns: int):
    """The ``chosen`` steps (a mask) grouped by their threadblock's
    connection, in step order within one, and each connection's first entry
    (one more); the chosen steps whose threadblock has no connection, left
    out. A threadblock's steps lie together: the grouping moves threadblocks."""
    steps = np.flatnonzero(chosen)
    chosen_before = np.zeros(len(chosen) + 1, dtype=np.int64)
    np.cumsum(chosen, out=chosen_before[1:])
    first = chosen_before[tb_start[:-1]]                          # a threadblock's first entry in steps
    per_tb = chosen_before[tb_start[1:]] - first
    named = np.flatnonzero(tb_conn >= 0)
    named = named[np.argsort(tb_conn[named], kind="stable")]      # by connection, then threadblock
    grouped = steps[ranges(first[named], per_tb[named])]
    ptr = np.zeros(num_conns + 1, dtype=np.int64)
    np.add.at(ptr, tb_conn[named] + 1, per_tb[named])
    lonely = np.flatnonzero((tb_conn < 0) & (per_tb > 0))
    return grouped, np.cumsum(ptr), steps[ranges(first[lonely], per_tb[lonely])]


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) for each (s, n)."""
    total = int(lens.sum())
    offsets = np.cumsum(lens) - lens
    return np.repeat(starts - offsets, lens) + np.arange(total, dtype=np.int64)


def _ints(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values
