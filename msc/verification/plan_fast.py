"""The plan verifier's fast path: is a plan certainly correct? Answered in
bulk (numpy) from the static happens-before graph, without running the
threadblocks one step at a time.

``accepts(plan, layout, capacity)`` is True only when the executor of
``msc.verification.plan`` (execute, then check_outputs) would succeed on the plan at
that connection capacity; False on anything else or anything doubtful. It
never raises a verification error: on False the caller runs the executor,
which finds the error and words it. ``fewest_slots(plan, most)`` is the
smallest capacity (a power of two) the plan runs at without deadlock.

Both start from ``prepare(plan)``: the plan's arrays (msc.ir.arrays:
threadblocks, steps, operands, connections and messages) and the graph
edges that do not depend on the capacity, so that lowering, which asks for
the fewest slots and then verifies at that capacity, reads a plan of
millions of steps once.

How. Each threadblock is sequential and each connection a FIFO with blocking
ends (a Kahn network), so the executor's blocking rules are edges of a static
graph over steps: program order, dependencies, the k-th send of a connection
before its k-th receive, and (capacity c) the (k-c)-th receive before the
k-th send. The plan runs to completion iff that graph is acyclic and every
receive has its send and every send the receive that frees its slot; that
depends on neither the data nor the order the threadblocks run in, so the
fewest slots found here are exactly the executor's. ``msc.ir.levels`` sorts the
steps into a topological order.

Values are then resolved in SSA form, chunk by chunk ("lanes": a step moving
c chunks has c lanes): a read of a chunk gets the last write before it in
that order, or the chunk's initial label. This is the value every execution
reads only when the accesses of a chunk are ordered by happens-before, so
the plan must be race-free (the callers of verify_plan establish it: the race
check runs first, or every rank has one threadblock). Two accesses of one
chunk in the same level, one a write, are a race that shows here: then
accepts() declines; a race between levels cannot be seen here.

Then, as the executor does: no read of an unwritten chunk, only chunks of one
class reduced together (a sum's class is its left operand's), data written
into a user buffer only at positions of its class, and every output holding
its expected multiset of contributions (counted once per distinct final value).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from msc.ir.accesses import index_type, last_of_each, pieces, writes_around
from msc.ir import Plan, StepOp
from msc.ir.arrays import OPS as _OPS, RECEIVES as _RECEIVES, plan_arrays
from msc.ir.levels import levels
from msc.verification.multisets import Decline, Leaves, expand, expectations, holds, jump, need, pointers
from msc.perf import pause_gc
from msc.verification import crosscheck


_HAS_DST = np.array([op.has_dst for op in _OPS])
_MIN_SRCS = np.array([{"0": 0, "1": 1, "2+": 2}[op.nsrc] for op in _OPS])
_MAX_SRCS = np.array([{"0": 0, "1": 1, "2+": 1 << 30}[op.nsrc] for op in _OPS])
(_SEND, _RECV, _RCS, _RRS, _RRC, _RRCS, _COPY, _REDUCE, _NOP) = (
    _OPS.index(op) for op in (StepOp.SEND, StepOp.RECV, StepOp.RCS, StepOp.RRS, StepOp.RRC, StepOp.RRCS,
                              StepOp.COPY, StepOp.REDUCE, StepOp.NOP))


def _of_ops(*groups) -> np.ndarray:
    """A table by op code: ``value`` for the ops of each (ops, value) group, else 0."""
    table = np.zeros(len(_OPS), dtype=np.int8)
    for ops, value in groups:
        table[list(ops)] = value
    return table


# Per lane, by its step's op, the value it makes: an alias (1) of its first source (send, copy) or of what it
# receives (recv, rcs); a sum (2) of its first source and what it receives (rrs, rrc, rrcs) or of its first two
# sources (reduce); nothing (0: its entry stays a value of its own) for the rest.
_VALUE_KIND = _of_ops(((_SEND, _COPY, _RECV, _RCS), 1), ((_RRS, _RRC, _RRCS, _REDUCE), 2))
_LEFT_IS_FIRST = _of_ops(((_SEND, _COPY, _RRS, _RRC, _RRCS, _REDUCE), 1)).astype(bool)
_LEFT_IS_RECEIVED = _of_ops(((_RECV, _RCS), 1)).astype(bool)
_RIGHT_IS_RECEIVED = _of_ops(((_RRS, _RRC, _RRCS), 1)).astype(bool)


def _judged(fn, *args, fallback):
    """fn(*args), or ``fallback`` where the fast path cannot tell."""
    try:
        return fn(*args)
    except Decline:
        return fallback
    except Exception:
        if crosscheck.ENABLED:     # in tests a crash here is a bug to see, not a plan to decline
            raise
        return fallback    # a malformed plan (verify_plan(checked=True) skips check_plan): the executor words it


def accepts(plan: Plan, layout, capacity: int) -> bool:
    """True only if executing ``plan`` with ``capacity`` slots per connection
    succeeds and its outputs are right (see the module docstring)."""
    return prepare(plan).accepts(plan, layout, capacity)


def fewest_slots(plan: Plan, most: int) -> int | None:
    """The smallest power of two c <= ``most`` at which ``plan`` runs
    without deadlock; ``most * 2`` when it deadlocks at every one of them;
    None when the fast path cannot tell (a malformed plan)."""
    return prepare(plan).fewest_slots(most)


@pause_gc
def prepare(plan: Plan) -> PlanReading:
    """``plan`` read for accepts() and fewest_slots(), to ask both (and at
    several capacities) for the price of one reading."""
    return PlanReading(plan)


def connections(plan: Plan) -> int:
    """Distinct connections (sender, receiver, channel) the plan's threadblocks name."""
    return plan_arrays(plan).num_conns


class PlanReading:
    """A plan read into arrays: what neither the collective nor the capacity
    changes. Holds the plan's ranks (``plan.ranks``): its answers are for
    plans with these ranks (``replace(plan, slots=..)`` keeps them)."""

    def __init__(self, plan: Plan):
        self.ranks = plan.ranks
        self._levels: dict[int, np.ndarray | None] = {}     # capacity -> step levels, None: deadlock
        self._edges = None
        self._race_events = None       # the race check's sorted events, for the dataflow at the same levels
        self.readable = _judged(self._read, plan, fallback=False)

    @pause_gc
    def accepts(self, plan: Plan, layout, capacity: int) -> bool:
        """accepts() of the module, for ``plan`` (whose ranks these are)."""
        if plan.ranks is not self.ranks:
            raise ValueError("PlanReading.accepts: a plan with other ranks than the prepared one")
        return self.readable and _judged(self._accepts, plan, layout, capacity, fallback=False)

    @pause_gc
    def fewest_slots(self, most: int) -> int | None:
        """fewest_slots() of the module."""
        if not self.readable:
            return None
        return _judged(self._fewest, most, fallback=None)

    def _fewest(self, most: int) -> int:
        c = 1
        while c <= most:
            if self._level(c) is not None:
                return c
            c *= 2
        return most * 2

    # -- reading ------------------------------------------------------------------
    def _read(self, plan: Plan) -> bool:
        # Declined: switch groups (NVLS), whose barriers and remote accesses only the executor models.
        need(not any(tb.group for rp in plan.ranks for tb in rp.threadblocks))
        arrays = plan_arrays(plan)
        # Declined: what check_plan refuses and the executor would crash on,
        # and two threadblocks on a connection's end (the FIFO order would depend on timing).
        need(arrays.ranks_in_order(plan.num_ranks) and arrays.ids_in_order and arrays.one_threadblock_per_end
             and not arrays.unconnected.size and arrays.deps_in_range)
        self.arrays, self.operands = arrays, arrays.operands()
        self.n, self.N = plan.num_ranks, arrays.num_steps
        self.op, self.count, self.nsrc, self.step_rank = arrays.op, arrays.count, arrays.nsrc, arrays.step_rank
        self._pair_messages()
        self.well_formed = self._shapes_checked()
        self._edges = self._static_edges()
        return True

    @property
    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """_static_edges, kept until accepts() needs the memory (read again if asked for after)."""
        if self._edges is None:
            self._edges = self._static_edges()
        return self._edges

    def _pair_messages(self) -> None:
        """Each receive (``rcv``, in step order): its connection, its k (it
        takes the connection's k-th message) and, unless some receive has no
        send (``unmatched``: a deadlock at every capacity), its send."""
        arrays = self.arrays
        self.rcv = rcv = np.flatnonzero(_RECEIVES[self.op])
        rcv_tb = arrays.step_tb[rcv]
        self.rcv_conn = arrays.tb_recv_conn[rcv_tb]
        # One threadblock receives on a connection: its receives are the connection's, in order.
        per_tb = np.bincount(rcv_tb, minlength=arrays.num_tbs)
        self.rk = np.arange(len(rcv), dtype=np.int64) - (np.cumsum(per_tb) - per_tb)[rcv_tb]
        self.nsnd, self.nrcv = arrays.sends_per_conn, arrays.receives_per_conn
        self.unmatched = bool((self.nrcv > self.nsnd).any())
        if not self.unmatched:
            self.sender = arrays.send_steps[arrays.send_ptr[self.rcv_conn] + self.rk]     # k-th send -> k-th receive

    def _shapes_checked(self) -> bool:
        """Whether the steps have the shapes check_plan requires (else
        accepts() declines; fewest_slots needs none of them)."""
        op, count, nsrc, has_dst, ops = self.op, self.count, self.nsrc, self.arrays.has_dst, self.operands
        return bool(
            (count >= 1).all() and (has_dst == _HAS_DST[op]).all()
            and ((nsrc >= _MIN_SRCS[op]) & (nsrc <= _MAX_SRCS[op])).all()
            and (ops.src_count == count[ops.src_owner]).all() and (ops.dst_count == count[ops.dst_owner]).all()
            and (self.unmatched or (count[self.sender] == count[self.rcv]).all()))

    def _static_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """The graph's edges that hold at every capacity: program order,
        dependencies, each message's send before its receive; sorted by source
        once (levels() sorts its edges stably, quickly when they come in few
        sorted runs: these, then the capacity's)."""
        arrays = self.arrays
        later = np.ones(self.N, dtype=bool)                           # every step but a threadblock's first
        later[arrays.tb_start[:-1][np.diff(arrays.tb_start) > 0]] = False
        later = np.flatnonzero(later)
        src_e, dst_e = [later - 1, arrays.dep_step], [later, arrays.dep_owner]
        if not self.unmatched:
            src_e.append(self.sender)
            dst_e.append(self.rcv)
        src, dst = np.concatenate(src_e), np.concatenate(dst_e)
        order = np.argsort(src, kind="stable")
        return src[order], dst[order]

    def _level(self, capacity: int):
        """Levels of the steps in the graph with capacity edges; None when
        the plan deadlocks at ``capacity``."""
        if capacity not in self._levels:
            self._levels[capacity] = self._levels_at(capacity)
        return self._levels[capacity]

    def _levels_at(self, capacity: int):
        # The k-th send of a connection waits for its (k - c)-th receive; a
        # send that has none waits forever.
        if self.unmatched or (self.nsnd - capacity > self.nrcv).any():
            return None
        frees = self.rk + capacity < self.nsnd[self.rcv_conn]                  # the receives that free a send
        freed = self.arrays.send_ptr[self.rcv_conn[frees]] + self.rk[frees] + capacity
        src, dst = self.edges
        return levels(self.N, np.concatenate([src, self.rcv[frees]]),          # in step order, as rcv is
                      np.concatenate([dst, self.arrays.send_steps[freed]]))

    # -- races ----------------------------------------------------------------------
    @pause_gc
    def race_free(self) -> bool:
        """True only if no two steps of a rank touch one chunk, one of them
        writing, unordered by happens-before (msc.verification.plan's race
        check would pass); False where this cannot tell."""
        return self.readable and _judged(self._race_free, fallback=False)

    def _race_free(self) -> bool:
        # FastTrack over a topological order of the steps (any capacity's
        # levels: their graph holds happens-before's edges and more): every
        # access must follow its chunk's last write, and a write every read
        # since. Two accesses in one level are unordered; across levels a
        # pair in one threadblock is ordered by program order, one in two by
        # a dependency from a step at or after the first to a step at or
        # before the second (longer chains: declined, the executor decides).
        level = next((v for v in self._levels.values() if v is not None), None)
        if level is None:
            level = levels(self.N, *self.edges)
            need(level is not None)           # a cycle: the executor's static order finds it
        arrays, ops = self.arrays, self.operands
        count, step_rank = self.count, self.step_rank
        nbuf = len(ops.buffer_names)
        stride = 1 + int(max(ops.src_index.max(initial=0) + count[ops.src_owner].max(initial=0),
                             ops.dst_index.max(initial=0) + count[ops.dst_owner].max(initial=0)))
        num_reads, cell, ev_step = self._events(
            (step_rank[ops.src_owner] * nbuf + ops.src_buf) * stride + ops.src_index,
            (step_rank[ops.dst_owner] * nbuf + ops.dst_buf) * stride + ops.dst_index)
        num_levels = int(level.max()) + 1 if self.N else 1
        need(int(cell.max(initial=0)) + 1 < (1 << 62) // (2 * num_levels))
        key, order = _sorted_events(cell, num_reads, level, ev_step, num_levels)
        del cell
        order = order.astype(index_type(len(order)))   # (kept for the dataflow: int32 where it fits)
        tb = arrays.step_tb
        ordered = _DependencyReach(tb, arrays)
        # (earlier step, later step) pairs that must be ordered: each access after its last write, each read
        # before the next write; a step's own read and write are ordered. A write after reads of the last
        # write follows that write through them: only a write right after it is checked against it.
        # A piece of chunks at a time (msc.ir.accesses.pieces): every array here is per access.
        for start, stop in pieces(key, 2 * num_levels):
            s_cell, s_level, s_write = _decoded(key[start:stop], num_levels)
            s_step = ev_step[order[start:stop]]
            _no_race_within_a_level(s_cell, s_level, s_step, s_write)
            del s_level
            before, after = writes_around(s_cell, s_write)
            m = stop - start
            has_before = (before >= 0) & (~s_write | (before == np.arange(m) - 1))
            has_after = ~s_write & (after < m)
            first = np.concatenate([s_step[before[has_before]], s_step[has_after]])
            second = np.concatenate([s_step[has_before], s_step[after[has_after]]])
            apart = tb[first] != tb[second]            # in one threadblock: program order (levels follow it)
            if not ordered(first[apart], second[apart]):
                return False
        # the dataflow at these levels sorts the same events the same way (its cells are these, renumbered)
        self._race_events = _RaceEvents(level, key, order, num_reads, num_levels, stride)
        return True

    # -- the values -----------------------------------------------------------------
    def _accepts(self, plan: Plan, layout, capacity: int) -> bool:
        need(type(capacity) is int and capacity >= 1 and plan.num_ranks == self.n and self.well_formed)
        level = self._level(capacity)
        if level is None:
            return False                                                      # a deadlock
        self._edges = None        # (the levels are found: the values need the room)
        cells = self._cells(layout)
        ops = self.operands
        src_cell = self._slice_cells(cells, ops.src_buf, ops.src_index, ops.src_owner)
        dst_cell = self._slice_cells(cells, ops.dst_buf, ops.dst_index, ops.dst_owner)
        leaves = Leaves(layout, plan.chunk_factor, cells.at)
        initial = _initial_values(cells.count, leaves)
        lanes = self._lanes()
        read_value, final = self._dataflow(level, src_cell, dst_cell, cells, lanes.write_lane, initial,
                                           leaves.count)
        del src_cell, dst_cell, initial   # (arrays are dropped once used: at scale each is tens of MB)
        values = self._value_graph(lanes, read_value, leaves.count)
        del read_value
        rep = self._one_class_per_sum(values, leaves, lanes, cells, plan.chunk_factor)
        del lanes
        out_cells, out_exp, exps = expectations(layout, cells.at)
        if not out_cells.size:
            return True
        value = final[out_cells]
        del final, out_cells
        need((value >= 0).all())                                                  # an output never written
        value = rep[value]
        del rep
        kind, left_class, right_class = values.kind, values.left_class, values.right_class
        del values
        return holds(value, out_exp, exps, leaves, kind, left_class, right_class)

    def _cells(self, layout) -> _Cells:
        """One cell per (rank, buffer, chunk), numbered rank by rank."""
        names = list(dict.fromkeys([*layout.physical_sizes, "scratch"]))
        column = {b: i for i, b in enumerate(names)}
        buffer_names = self.operands.buffer_names
        need(all(b in column for b in buffer_names))
        sizes = np.zeros((self.n, len(names)), dtype=np.int64)
        sizes[:, :] = [layout.physical_sizes.get(b, 0) for b in names]
        sizes[:, column["scratch"]] = self.arrays.rank_scratch
        need((sizes >= 0).all())
        first = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes.ravel(), out=first[1:])
        to_layout = np.array([column[b] for b in buffer_names] or [0], dtype=np.int64)
        return _Cells(column, sizes, first, int(first[-1]), column["scratch"], to_layout)

    def _slice_cells(self, cells: _Cells, buf, index, owner) -> np.ndarray:
        """Cells of each slice's first chunk, checked to lie in its buffer."""
        rank = self.step_rank[owner]
        column = cells.to_layout[buf]
        need((index >= 0).all() and (index + self.count[owner] <= cells.sizes[rank, column]).all())
        return cells.first[rank * cells.sizes.shape[1] + column] + index

    def _lanes(self) -> _Lanes:
        """Every read and write of one chunk, with the lane it belongs to (their
        cells and steps, per access, only _dataflow makes and keeps); as int32
        where they fit (msc.ir.accesses.index_type)."""
        count, ops = self.count, self.operands
        lane_start = np.cumsum(count) - count
        num_lanes = int(count.sum())
        narrow = index_type(num_lanes + len(ops.src_owner) + len(ops.dst_owner))
        read_row, read_j, read_lane = expand(lane_start[ops.src_owner], count[ops.src_owner])
        read_lane = read_lane.astype(narrow)
        read_pos = ops.src_pos.astype(narrow)[read_row]
        del read_row, read_j
        write_row, write_j, write_lane = expand(lane_start[ops.dst_owner], count[ops.dst_owner])
        return _Lanes(lane_start, num_lanes, read_lane, read_pos, write_row.astype(narrow), write_j.astype(narrow),
                      write_lane.astype(narrow))

    def _events(self, src_cell, dst_cell):
        """Every read, then every write, of one chunk: its cell and its step
        (int32 where steps fit). ``src_cell``, ``dst_cell``: each slice's
        first cell, in any numbering of cells (the race check's or the layout's)."""
        count, ops = self.count, self.operands
        step_type = index_type(self.N)
        read_row, _, read_cell = expand(src_cell, count[ops.src_owner])
        read_step = ops.src_owner.astype(step_type)[read_row]
        del read_row
        write_row, _, write_cell = expand(dst_cell, count[ops.dst_owner])
        num_reads = read_cell.size
        cell = np.concatenate([read_cell, write_cell])
        del read_cell, write_cell
        return num_reads, cell, np.concatenate([read_step, ops.dst_owner.astype(step_type)[write_row]])

    def _dataflow(self, level, src_cell, dst_cell, cells: _Cells, write_lane, initial, num_leaves: int):
        """What each read reads (a leaf, or the lane that wrote it, numbered
        after the leaves) and each cell's final value, with accesses ordered
        by level; declines where one level holds a write and another access
        of the same chunk (a race the order cannot settle). ``src_cell``,
        ``dst_cell``: each slice's first cell."""
        sorted_before, self._race_events = self._race_events, None
        if sorted_before is not None and sorted_before.level is level:
            return self._dataflow_sorted(sorted_before, cells, write_lane, initial, num_leaves)
        num_reads, cell, ev_step = self._events(src_cell, dst_cell)
        num_levels = int(level.max()) + 1 if self.N else 1
        read_value = np.empty(num_reads, dtype=np.int64)                      # every read is filled in
        final = initial.copy()                                                 # each cell's last value
        if len(initial) * num_levels * 2 < (1 << 62):
            key, order = _sorted_events(cell, num_reads, level, ev_step, num_levels)
            del cell
            for start, stop in pieces(key, 2 * num_levels):                  # (msc.ir.accesses.pieces)
                _piece_values(*_decoded(key[start:stop], num_levels), order[start:stop], ev_step, num_reads,
                              write_lane, initial, num_leaves, read_value, final)
        else:
            ev_level = level[ev_step]
            ev_write = np.concatenate([np.zeros(num_reads, bool), np.ones(len(cell) - num_reads, bool)])
            order = np.lexsort((ev_write, ev_level, cell))
            _piece_values(cell[order], ev_level[order], ev_write[order], order, ev_step, num_reads, write_lane,
                          initial, num_leaves, read_value, final)
        need((read_value >= 0).all())                                         # a read of an unwritten chunk
        return read_value, final

    def _dataflow_sorted(self, events: _RaceEvents, cells: _Cells, write_lane, initial, num_leaves: int):
        """_dataflow from the race check's sorted events (at the same levels):
        the same events, each cell's together in the same order, so the same
        values; the race check has found no write sharing a level with
        another access of its chunk. Its cells are renumbered as the
        layout's, a piece at a time."""
        key, order, num_reads, num_levels = events.key, events.order, events.num_reads, events.num_levels
        first = cells.first[np.arange(self.n)[:, None] * cells.sizes.shape[1] + cells.to_layout[None, :]].ravel()
        read_value = np.empty(num_reads, dtype=np.int64)
        final = initial.copy()
        for start, stop in pieces(key, 2 * num_levels):
            race_cell, _, s_write = _decoded(key[start:stop], num_levels)
            rank_buf, index = np.divmod(race_cell, events.stride)               # (rank * buffers + buffer, index)
            _piece_values(first[rank_buf] + index, None, s_write, order[start:stop], None, num_reads, write_lane,
                          initial, num_leaves, read_value, final)
        need((read_value >= 0).all())
        return read_value, final

    def _value_graph(self, lanes: _Lanes, read_value, num_leaves: int) -> _Values:
        """Values: the leaves, then one entry per lane (an alias of what it
        copies or receives, or a sum of two), then the partial sums of
        reductions with more than two sources. Each lane's entry is written
        in place (at scale every per-lane array is hundreds of MB)."""
        num_lanes, lane_start, count = lanes.count, lanes.lane_start, self.count
        lane_step = np.repeat(np.arange(self.N, dtype=index_type(self.N)), count)
        lane_op = self.op[lane_step]
        total = num_leaves + num_lanes
        kind = np.zeros(total, dtype=np.int8)                                  # 0 leaf, 1 alias, 2 sum
        # values as int32 where every one fits, the partial sums of wide reductions (after) too
        wide = np.flatnonzero((self.op == _REDUCE) & (self.nsrc > 2))
        narrow = index_type(total + int((self.count[wide] * (self.nsrc[wide] - 2)).sum()))
        left = np.arange(total, dtype=narrow)
        right = np.full(total, -1, dtype=narrow)
        lane_kind, lane_left, lane_right = kind[num_leaves:], left[num_leaves:], right[num_leaves:]
        lane_kind[:] = _VALUE_KIND[lane_op]
        # the left operand: the first source (-1 where a lane has none), or what a receive takes
        takes_first = _LEFT_IS_FIRST[lane_op]
        lane_left[takes_first] = -1
        first, at = lanes.read_lane[lanes.read_pos == 0], read_value[lanes.read_pos == 0]
        keep = takes_first[first]
        lane_left[first[keep]] = at[keep]
        del takes_first, first, at, keep
        second, at = lanes.read_lane[lanes.read_pos == 1], read_value[lanes.read_pos == 1]
        keep = lane_op[second] == _REDUCE
        lane_right[second[keep]] = at[keep]                                    # a reduce's second source
        del second, at, keep
        sender_of = np.full(self.N, -1, dtype=np.int64)
        sender_of[self.rcv] = self.sender
        receiving = np.flatnonzero(_RECEIVES[lane_op])
        step = lane_step[receiving]
        del lane_step
        received = num_leaves + lane_start[sender_of[step]] + (receiving - lane_start[step])   # the sender's lane
        del sender_of, step
        alias = _LEFT_IS_RECEIVED[lane_op[receiving]]
        lane_left[receiving[alias]] = received[alias]
        alias = _RIGHT_IS_RECEIVED[lane_op[receiving]]
        lane_right[receiving[alias]] = received[alias]
        del receiving, received, alias, lane_op, lane_kind, lane_left, lane_right
        if wide.size:
            kind, left, right = self._wide_sums(wide, lanes, read_value, num_leaves, kind, left, right)
        # Aliases point at their value, sums at their left operand's leaf (their class).
        rep = jump(pointers(kind == 1, left, narrow), own=True)
        left_class = rep[left]
        right_class = np.where(right >= 0, rep[np.maximum(right, 0)], -1)
        return _Values(kind, rep, left_class, right_class)

    def _wide_sums(self, wide, lanes: _Lanes, read_value, num_leaves: int, kind, left, right):
        """reduce(s0, s1, s2, ..) as ((s0 + s1) + s2) + ..: new entries for
        the partial sums; the lane's own entry becomes the last sum."""
        more = lanes.read_pos >= 2
        refs = {(int(ln), int(p)): int(v) for ln, p, v in zip(lanes.read_lane[more], lanes.read_pos[more],
                                                               read_value[more])}
        extra_left, extra_right = [], []
        nxt = len(left)
        for g in wide.tolist():
            sources = int(self.nsrc[g])
            for lane in range(int(lanes.lane_start[g]), int(lanes.lane_start[g] + self.count[g])):
                acc = nxt
                extra_left.append(int(left[num_leaves + lane]))
                extra_right.append(int(right[num_leaves + lane]))
                nxt += 1
                for pos in range(2, sources - 1):
                    extra_left.append(acc)
                    extra_right.append(refs[(lane, pos)])
                    acc = nxt
                    nxt += 1
                left[num_leaves + lane], right[num_leaves + lane] = acc, refs[(lane, sources - 1)]
        return (np.concatenate([kind, np.full(len(extra_left), 2, np.int8)]),
                np.concatenate([left, np.array(extra_left, dtype=np.int64)]),
                np.concatenate([right, np.array(extra_right, dtype=np.int64)]))

    def _one_class_per_sum(self, values: _Values, leaves, lanes: _Lanes, cells: _Cells, k: int) -> np.ndarray:
        """Check that only chunks of one class are reduced together and that
        data lands in a user buffer only at positions of its class; the
        representative of every value."""
        kind, rep = values.kind, values.rep
        num_leaves = leaves.count
        leftmost = jump(pointers(kind == 2, values.left_class, index_type(len(kind))), own=True)
        cls = np.full(len(kind), -1, dtype=index_type(k))                       # (classes are below k)
        cls[:num_leaves] = leaves.leaf_class
        cls = cls[leftmost]                                                      # per leaf and sum
        del leftmost
        sums = kind == 2
        need((cls[values.left_class[sums]] == cls[values.right_class[sums]]).all())
        dst_column = cells.to_layout[self.operands.dst_buf[lanes.write_row]]
        user = dst_column != cells.scratch
        positions = self.operands.dst_index[lanes.write_row[user]] + lanes.write_j[user]
        need((cls[rep[np.add(lanes.write_lane[user], num_leaves, dtype=np.int64)]] == positions % k).all())
        return rep


class _Cells(NamedTuple):
    """Every (rank, buffer, chunk) of a layout as one cell number."""
    column: dict            # buffer name -> column of ``sizes``
    sizes: np.ndarray       # (rank, column) -> chunks
    first: np.ndarray       # (rank * columns + column) -> its first cell
    count: int
    scratch: int            # the scratch buffer's column
    to_layout: np.ndarray   # the plan's buffer codes -> columns

    def at(self, rank, buf, off, width, index):
        """Cells ``index`` of ``buf`` on ``rank``, checked: [off, off + width) lies in it."""
        col = self.column.get(buf)
        need(col is not None and 0 <= off and off + width <= self.sizes[rank, col])
        return self.first[rank * self.sizes.shape[1] + col] + index


class _Lanes(NamedTuple):
    """The chunk-level reads and writes of every step (a step moving c chunks has c lanes)."""
    lane_start: np.ndarray  # per step, its first lane
    count: int
    read_lane: np.ndarray
    read_pos: np.ndarray    # which source of its step (0, 1, ..)
    write_row: np.ndarray   # per write, its destination slice
    write_j: np.ndarray     # chunk within the slice
    write_lane: np.ndarray


class _RaceEvents(NamedTuple):
    """The race check's events, sorted (_sorted_events), at ``level``; its
    cells are (rank * buffers + buffer) * stride + index, buffers by the plan's codes."""
    level: np.ndarray
    key: np.ndarray
    order: np.ndarray
    num_reads: int
    num_levels: int
    stride: int


class _Values(NamedTuple):
    kind: np.ndarray        # 0 leaf, 1 alias, 2 sum
    rep: np.ndarray         # per value, the value it stands for (aliases resolved); these three int32 or int64
    left_class: np.ndarray  # per value, its left operand's representative
    right_class: np.ndarray  # per sum, its right operand's representative (-1 elsewhere)


def _sorted_events(cell, num_reads: int, level, ev_step, num_levels: int):
    """The events (``cell``: the reads' chunks, then the writes'; taken over
    and overwritten) ordered by (cell, level of their step, read before
    write), ties in that order: one key per event, ((cell * num_levels +
    level) * 2 + write), sorted, and the order (positions among reads then
    writes). Built in place: at scale every array here is hundreds of MB.
    The caller checks that the key fits int64; _decoded reads it back."""
    key = cell
    key *= num_levels
    key += level[ev_step]
    key *= 2
    key[num_reads:] += 1
    order = np.argsort(key, kind="stable")
    return key[order], order


def _decoded(key, num_levels: int):
    """Sorted event keys (_sorted_events) as their cells, levels and write flags."""
    s_write = (key & 1).astype(bool)
    key = key >> 1
    s_level = key % num_levels
    key //= num_levels
    return key, s_level, s_write


def _piece_values(s_cell, s_level, s_write, order, ev_step, num_reads: int, write_lane, initial, num_leaves: int,
                  read_value, final) -> None:
    """_dataflow for the events of whole cells, sorted (``s_cell``,
    ``s_level``, ``s_write``; ``order``: their positions among all events):
    fills in their reads' values and their cells' final values (``s_level``
    None: the race check has found no race within a level among them)."""
    if s_level is not None:
        _no_race_within_a_level(s_cell, s_level, ev_step[order], s_write)
    # Each read: the last write to its cell before it, else the cell's initial value.
    before, _ = writes_around(s_cell, s_write, following=False)
    written = np.full(len(order), -1, dtype=np.int64)                          # write events: their lane
    written[s_write] = write_lane[order[s_write] - num_reads] + num_leaves
    seen = np.where(before >= 0, written[np.maximum(before, 0)], initial[s_cell])
    read_value[order[~s_write]] = seen[~s_write]
    del seen
    cell_last = last_of_each(s_cell)
    last_write = np.where(s_write[cell_last], cell_last, before[cell_last])
    final[s_cell[cell_last]] = np.where(last_write >= 0, written[np.maximum(last_write, 0)],
                                        initial[s_cell[cell_last]])


def _initial_values(num_cells: int, leaves) -> np.ndarray:
    """Per cell its initial leaf, -1 where nothing starts."""
    initial = np.full(num_cells, -1, dtype=np.int64)
    if leaves.cells.size:   # the last label put in a cell stays there, as in the executor
        uniq, pos = np.unique(leaves.cells[::-1], return_index=True)
        initial[uniq] = leaves.leaf_ids[::-1][pos]
    return initial


class _DependencyReach:
    """``ordered(first, second)``: whether for every pair some dependency runs
    from a step of ``first``'s threadblock at or after it to a step of
    ``second``'s at or before it (so ``first`` happens before ``second``).
    The dependencies are sorted once, on the first pairs asked about."""

    def __init__(self, tb, arrays):
        self.tb, self.arrays = tb, arrays
        self.table = None

    def __call__(self, first, second) -> bool:
        if not first.size:
            return True
        if self.table is None:
            self.table = self._sorted()
        if self.table is False:
            return False
        tb, pos = self.tb, self.arrays.step_pos
        key, group, reach, T, P = self.table
        want = tb[second] * T + tb[first]
        at = np.searchsorted(key, want * P + pos[second], side="right") - 1
        found = at >= 0
        at = np.maximum(at, 0)
        return bool((found & (group[at] == want) & (reach[at] >= pos[first])).all())

    def _sorted(self):
        tb, arrays = self.tb, self.arrays
        pos = arrays.step_pos
        owner, step = arrays.dep_owner, arrays.dep_step
        if not owner.size:
            return False
        T = np.int64(arrays.num_tbs)
        P = np.int64(int(np.diff(arrays.tb_start).max()) + 1)
        need(int(T) * int(T) * int(P) < (1 << 62))
        # per (waiting threadblock, awaited threadblock): dependencies by the waiting step's position, with the
        # latest awaited position so far
        group = tb[owner] * T + tb[step]
        key = group * P + pos[owner]
        o = np.argsort(key, kind="stable")
        key, group, reach = key[o], group[o], pos[step][o]
        reach = np.maximum.accumulate(group * P + reach) - group * P      # a running max within each group
        return key, group, reach, T, P


def _no_race_within_a_level(s_cell, s_level, s_step, s_write) -> None:
    """Accesses sorted by (cell, level, write last): a write must be the only
    access of its chunk in its level, but for its own step's reads. Checked
    on neighbours (no per-access group number: at scale each array is 100s
    of MB): writes sort last, so two writes in a group are two in a row, and
    a group whose last access is a write must have one step throughout."""
    n = len(s_cell)
    if n < 2:
        return
    inside = (s_cell[1:] == s_cell[:-1]) & (s_level[1:] == s_level[:-1])      # access i + 1 in i's group
    need(not (inside & s_write[1:] & s_write[:-1]).any())
    mixed = np.flatnonzero(inside & (s_step[1:] != s_step[:-1]))            # i and i + 1: two steps, one group
    if mixed.size:
        group_end = np.flatnonzero(np.append(~inside, True))                   # the last access of each group
        need(not s_write[group_end[np.searchsorted(group_end, mixed + 1)]].any())
