"""Validity of a plan's values: run after parsing, after lowering (in tests)
and before verifying. Everything an executor relies on without checking:
ranks and peers exist, slices lie inside their buffers, operands fit the op,
dependencies name existing steps, and every connection has one sending and
one receiving threadblock whose message counts agree, message by message;
a threadblock's switch group holds its rank, every member has at most one
threadblock of a (group, channel), and all of them pass the same number of
barriers.
"""
from __future__ import annotations

from msc.dsl.collectives import get_collective
from msc.errors import MscError, PlanError
from msc.ir import Plan, StepOp
from msc.ir.limits import (MAX_BUFFER_CHUNKS, MAX_CHUNK_FACTOR, MAX_STEP_MOVES, MAX_INSTANCES, MAX_RANKS, MAX_SLOTS,
                          MAX_TILE_BYTES, MAX_TOTAL_CHUNKS)
from msc.ir.ops import PROTOCOL_NAMES
# Chunks a buffer may have: far beyond any real schedule, small enough that
# executing a plan symbolically cannot exhaust memory on a hostile file.
MAX_CHUNKS = MAX_BUFFER_CHUNKS


def buffer_sizes(plan: Plan, rank: int) -> dict[str, int]:
    """Chunks of every physical buffer of ``rank``."""
    sizes = user_buffer_sizes(plan)
    sizes["scratch"] = plan.ranks[rank].scratch
    return sizes


def user_buffer_sizes(plan: Plan) -> dict[str, int]:
    """Chunks of every physical buffer but scratch (the same on every rank)."""
    try:
        layout = get_collective(plan.collective).layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root)
        return dict(layout.physical_sizes)
    except MscError:          # a custom collective: trust the plan's own sizes
        return {"input": plan.input_chunks} | ({} if plan.inplace else {"output": plan.output_chunks})


def check_plan(plan: Plan) -> None:
    """Raise PlanError naming rank, threadblock and step for the first bad value."""
    n = plan.num_ranks
    if type(n) is not int or not 1 <= n <= MAX_RANKS:
        raise PlanError(f"ranks must be 1..{MAX_RANKS} (msc's limit), got {n!r}")
    if len(plan.ranks) != n:
        raise PlanError(f"plan has {len(plan.ranks)} rank sections for {n} ranks")
    if plan.protocol not in PROTOCOL_NAMES:
        raise PlanError(f"unknown protocol {plan.protocol!r} (expected one of {', '.join(PROTOCOL_NAMES)})")
    for name, value, low, high in (("chunk_factor", plan.chunk_factor, 1, MAX_CHUNK_FACTOR),
                                   ("instances", plan.instances, 1, MAX_INSTANCES),
                                   ("slots", plan.slots, 1, MAX_SLOTS), ("tile", plan.tile, 0, MAX_TILE_BYTES)):
        if type(value) is not int or value < low:
            raise PlanError(f"{name} must be an int >= {low}, got {value!r}")
        if value > high:
            raise PlanError(f"{name} is {value}, over msc's limit of {high}")
    if plan.contract is not None:
        from msc.dsl.collectives import BUILTIN, collective_key
        from msc.ir.contract_text import check_contract

        if collective_key(plan.collective) in BUILTIN:
            raise PlanError(f"a plan of the built-in collective {plan.collective} carries a contract: only a custom "
                            f"collective's plan states its requirements")
        check_contract(plan.contract, n, plan.input_chunks, plan.output_chunks)
    try:
        layout = get_collective(plan.collective).layout(n, plan.chunk_factor, plan.inplace, plan.root)
        if (layout.logical_sizes["input"], layout.logical_sizes["output"]) != (plan.input_chunks, plan.output_chunks):
            raise PlanError(f"{plan.collective} with {n} ranks and chunk factor {plan.chunk_factor} has "
                            f"{layout.logical_sizes['input']} input and {layout.logical_sizes['output']} output "
                            f"chunks, the plan says {plan.input_chunks} and {plan.output_chunks}")
    except PlanError:
        raise
    except MscError:
        pass   # custom collective
    if plan.chunk_factor * n > MAX_CHUNKS:
        raise PlanError(f"chunk_factor {plan.chunk_factor} x {n} ranks exceeds {MAX_CHUNKS} chunks per buffer")
    if plan.root is not None and not 0 <= plan.root < n:
        raise PlanError(f"root {plan.root} is not a rank (0..{n - 1})")
    _check_totals(plan)
    sends: dict[tuple, list] = {}
    recvs: dict[tuple, list] = {}
    barriers: dict[tuple, dict[int, int]] = {}      # (group, channel) -> rank -> barriers it passes
    moved = 0
    for r, rp in enumerate(plan.ranks):
        if rp.rank != r:
            raise PlanError(f"rank sections out of order: section {r} is rank {rp.rank}")
        if type(rp.scratch) is not int or not 0 <= rp.scratch <= MAX_CHUNKS:
            raise PlanError(f"scratch must be 0..{MAX_CHUNKS} chunks, got {rp.scratch!r}", rank=r)
        sizes = buffer_sizes(plan, r)
        for t, tb in enumerate(rp.threadblocks):
            if tb.id != t:
                raise PlanError(f"threadblock ids must be 0.. in order, found {tb.id} at position {t}", rank=r)
            for side, peer in (("send", tb.send), ("recv", tb.recv)):
                if peer is not None and not (0 <= peer < n and peer != r):
                    raise PlanError(f"{side} peer {peer} is not another rank (0..{n - 1})", rank=r, tb=t)
            if tb.channel < 0:
                raise PlanError(f"channel {tb.channel} must be >= 0", rank=r, tb=t)
            if tb.group:
                _check_group(plan, r, t, tb, barriers)
            for s, step in enumerate(tb.steps):
                _check_step(plan, r, t, s, step, tb, sizes, rp)
                moved += step.count
                if step.op.sends:
                    sends.setdefault((r, tb.send, tb.channel), []).append((t, s, step.count))
                if step.op.receives:
                    recvs.setdefault((tb.recv, r, tb.channel), []).append((t, s, step.count))
    _check_moves(moved)
    for conn in sorted(set(sends) | set(recvs), key=str):
        _check_connection(conn, sends.get(conn, []), recvs.get(conn, []))
    for (group, ch), passed in sorted(barriers.items()):
        counts = {m: passed.get(m, 0) for m in group}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"rank {m}: {c}" for m, c in counts.items())
            raise PlanError(f"switch group {_members(group)} channel {ch}: the members pass different numbers of "
                            f"barriers ({listed}), so some barrier never completes")


def _members(group) -> str:
    return ",".join(map(str, group))


def _check_group(plan, r, t, tb, barriers) -> None:
    """A switch group: increasing ranks that exist, this rank among them,
    at most one threadblock per member for each (group, channel)."""
    group, n = tb.group, plan.num_ranks
    if (len(group) < 2 or any(type(m) is not int or not 0 <= m < n for m in group)
            or any(a >= b for a, b in zip(group, group[1:]))):
        raise PlanError(f"switch group {_members(group)} must list at least two ranks of 0..{n - 1}, increasing",
                        rank=r, tb=t)
    if r not in group:
        raise PlanError(f"switch group {_members(group)} does not hold the threadblock's own rank {r}", rank=r, tb=t)
    passed = barriers.setdefault((group, tb.channel), {})
    if r in passed:
        raise PlanError(f"rank {r} has more than one threadblock of switch group {_members(group)} on channel "
                        f"{tb.channel}", rank=r, tb=t)
    passed[r] = sum(step.op is StepOp.BARRIER for step in tb.steps)


def _check_totals(plan: Plan) -> None:
    """The chunks of all buffers of all ranks within msc's limit (and, in
    _check_moves, the chunks all steps move): each costs the verifiers and
    the executor memory, and a few bytes of plan can ask for billions
    (``scratch 67108864`` on every rank, a step of ``count`` 2^24 repeated)."""
    user = sum(v for v in user_buffer_sizes(plan).values() if type(v) is int and v > 0)
    # a rank's own bad scratch is named by the rank loop, with its rank
    scratch = sum(rp.scratch for rp in plan.ranks if type(rp.scratch) is int and 0 < rp.scratch <= MAX_CHUNKS)
    total = plan.num_ranks * user + scratch
    if total > MAX_TOTAL_CHUNKS:
        raise PlanError(f"the buffers of all {plan.num_ranks} ranks hold {total} chunks ({plan.num_ranks} x {user} "
                        f"input/output, {scratch} scratch), over msc's limit of {MAX_TOTAL_CHUNKS}")


def _check_moves(moved: int) -> None:
    if moved > MAX_STEP_MOVES:
        raise PlanError(f"the steps move {moved} chunks in all, over msc's limit of {MAX_STEP_MOVES}")


def _check_step(plan, r, t, s, step, tb, sizes, rp):
    where = dict(rank=r, tb=t, step=s)
    if type(step.count) is not int or step.count < 1:
        raise PlanError(f"count {step.count!r} must be >= 1", **where)
    nsrc, has_dst = step.op.nsrc, step.op.has_dst
    if nsrc == "2+" and len(step.srcs) < 2 or nsrc in ("0", "1") and len(step.srcs) != int(nsrc):
        raise PlanError(f"{step.op.value} takes {'at least 2' if nsrc == '2+' else nsrc} source(s), "
                        f"got {len(step.srcs)}", **where)
    if has_dst != (step.dst is not None):
        raise PlanError(f"{step.op.value} {'needs' if has_dst else 'takes no'} destination", **where)
    if step.op.switch and not tb.group:
        raise PlanError(f"{step.op.value} is a switch op, but threadblock {t} has no switch group", **where)
    for sl in step.srcs + ((step.dst,) if step.dst is not None else ()):
        if sl.buffer not in sizes:
            raise PlanError(f"buffer {sl.buffer!r} does not exist (buffers: {', '.join(sizes)})", **where)
        if sl.count != step.count:
            raise PlanError(f"slice {sl} has {sl.count} chunks, the step moves {step.count}", **where)
        if sl.index < 0 or sl.index + sl.count > sizes[sl.buffer]:
            raise PlanError(f"slice {sl} lies outside {sl.buffer}, which has {sizes[sl.buffer]} chunks", **where)
    remote = (step.srcs[:1] if step.op.group_reads else ()) + ((step.dst,) if step.op.group_writes else ())
    for sl in remote:      # on every member: scratch sizes differ by rank
        for m in tb.group:
            size = buffer_sizes(plan, m)[sl.buffer] if sl.buffer == "scratch" else sizes[sl.buffer]
            if sl.index + sl.count > size:
                raise PlanError(f"{step.op.value} reaches {sl} on every member of its switch group, but rank {m}'s "
                                f"{sl.buffer} has {size} chunks", **where)
    if step.op.sends and tb.send is None:
        raise PlanError(f"{step.op.value} sends, but threadblock {t} has no send peer", **where)
    if step.op.receives and tb.recv is None:
        raise PlanError(f"{step.op.value} receives, but threadblock {t} has no receive peer", **where)
    for dep in step.deps:
        if len(dep) != 2:
            raise PlanError(f"dependency {dep!r} must be (threadblock, step)", **where)
        dt, ds = dep
        if not 0 <= dt < len(rp.threadblocks) or not 0 <= ds < len(rp.threadblocks[dt].steps):
            raise PlanError(f"dependency on threadblock {dt} step {ds}, which does not exist", **where)
        if dt == t and ds >= s:
            raise PlanError(f"depends on step {ds} of its own threadblock, which comes at or after it", **where)


def _check_connection(conn, sends, recvs):
    src, dst, ch = conn
    if len({t for t, _, _ in sends}) > 1 or len({t for t, _, _ in recvs}) > 1:
        side = "sending" if len({t for t, _, _ in sends}) > 1 else "receiving"
        raise PlanError(f"connection rank {src} -> rank {dst} channel {ch} has more than one {side} threadblock")
    if len(sends) != len(recvs):
        raise PlanError(f"connection rank {src} -> rank {dst} channel {ch}: {len(sends)} sends but "
                        f"{len(recvs)} receives", rank=src if len(sends) > len(recvs) else dst)
    for k, ((st, ss, sc), (rt, rs, rc)) in enumerate(zip(sends, recvs)):
        if sc != rc:
            raise PlanError(f"connection rank {src} -> rank {dst} channel {ch}, message {k}: rank {src} "
                            f"threadblock {st} step {ss} sends {sc} chunks, rank {dst} threadblock {rt} "
                            f"step {rs} receives {rc}")
