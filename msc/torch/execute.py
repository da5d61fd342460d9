"""Running a compiled rank program on torch tensors.

``Prepared`` holds what a plan needs once (its rounds and layout) and, per
(rank, count), the compiled ``RankProgram`` with a reusable workspace tensor per
(dtype, device): repeated calls of one size cost no planning and no
allocation. ``execute`` runs a program round by round; its communication
phases go through a transport object, so the same code runs over
torch.distributed (``DistTransport``) and all ranks in one process
(``run_local``, for tests and debugging).

Waits. ``DistTransport`` waits on torch.distributed's own works, with no
deadline of its own: a call reaches it only after the ranks agreed on the
call (msc.torch.agree, which has a deadline), so every rank runs the same
program; a peer that dies mid-call closes its connections (gloo fails at
once), and one that stalls mid-call is bounded by the process group's
timeout (``init_process_group(timeout=...)``). Bounding it here with
``work.wait(timeout)`` would not leave the group usable either: gloo
closes the connection of a receive that times out.

Not thread-safe: one call at a time per process (as collectives are).
"""
from __future__ import annotations

import functools

from collections import OrderedDict

import torch

from msc.dsl.collectives import get_collective
from msc.errors import UsageError
from msc.ir import Plan
from msc.lower.switch_expand import expand_switch_ops
from msc.ir.ops import REDUCE_OP_NAMES, REDUCE_OPS, op_dtype_problem
from msc.torch.rank_program import ARENA, BUFFER, TRANSPORTS, RankProgram, compile_rank
from msc.torch.rounds import schedule

# The executor's reductions, in the buffers' dtype (integers wrap; floats
# round after every operation). avg sums, then divides (see ``average``).
COMBINE = {op.name: getattr(torch, op.torch) for op in REDUCE_OPS.values()}
OPS = REDUCE_OP_NAMES
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)
TAG = 0x6D73     # "ms": keeps our point-to-point messages apart from a user's tag-0 traffic (gloo)
_PROGRAMS_PER_PLAN = 64


class Prepared:
    """A plan ready to run: its global rounds, its layout, and compiled
    programs per (rank, count), least recently used dropped first; and
    the signatures of its calls (msc.torch.agree), built once."""

    def __init__(self, plan: Plan, collective=None):
        self.plan = plan
        from msc.verification.plan import plan_collective

        self.collective = plan_collective(plan, collective)
        self.layout = self.collective.layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root)
        # switch ops (NVLS) as messages (msc.lower.switch_expand): torch has no switch; the same results
        self.rounds = schedule(expand_switch_ops(plan))     # checks the plan's values, that it cannot get stuck
        self._programs: OrderedDict[tuple[int, int, str], RankProgram] = OrderedDict()
        self.digest: str | None = None        # the plan's content digest and call signatures (msc.torch.agree)
        self.signatures: dict = {}

    def program(self, rank: int, count: int, transport: str = "p2p") -> RankProgram:
        key = (rank, count, transport)
        prog = self._programs.get(key)
        if prog is None:
            prog = compile_rank(self.rounds, rank, count, self.layout, transport)
            self._programs[key] = prog
            if len(self._programs) > _PROGRAMS_PER_PLAN:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        return prog


_PREPARED: OrderedDict[int, tuple[Plan, object, Prepared]] = OrderedDict()
_PREPARED_MAX = 64


def prepare(plan, collective=None) -> Prepared:
    """The cached ``Prepared`` for ``plan`` (a Plan or a Prepared). Keyed by
    identity (hashing a big frozen plan costs more than scheduling a small
    one); the cache holds the plan, so its id stays unique."""
    if isinstance(plan, Prepared):
        return plan
    if not isinstance(plan, Plan):
        raise UsageError(f"expected an msc Plan, got {type(plan).__name__}")
    hit = _PREPARED.get(id(plan))
    if hit is not None and hit[0] is plan and hit[1] is collective:
        _PREPARED.move_to_end(id(plan))
        return hit[2]
    prepared = Prepared(plan, collective)
    _PREPARED[id(plan)] = (plan, collective, prepared)
    if len(_PREPARED) > _PREPARED_MAX:
        _PREPARED.popitem(last=False)
    return prepared


def clear_caches() -> None:
    """Forget prepared plans, compiled programs and their workspaces."""
    _PREPARED.clear()


_ALIASES = {alias: o.name for o in REDUCE_OPS.values() for alias in o.aliases}


@functools.cache
def _torch_op_names() -> dict:
    """torch.distributed's RedOpType -> msc's op name (built once: every collective call asks)."""
    import torch.distributed as dist

    return {getattr(dist.ReduceOp, o.torch_op): o.name for o in REDUCE_OPS.values()}


def op_name(op) -> str:
    """"sum" etc. from a name or a torch.distributed.ReduceOp."""
    if isinstance(op, str):
        key = op.lower()
    else:
        op = getattr(op, "op", op)          # a ReduceOp object (as in AllreduceOptions) holds its RedOpType
        try:
            key = _torch_op_names().get(op)
        except TypeError:
            key = None
        if key is None:
            raise UsageError(f"unsupported reduction op {op!r} (msc runs {', '.join(OPS)})")
    key = _ALIASES.get(key, key)
    if key not in COMBINE:
        raise UsageError(f"unknown reduction op {op!r} (expected one of {', '.join(OPS)})")
    return key


def check_op_dtype(op: str, dtype: torch.dtype) -> None:
    """A UsageError where the op registry's rule of types (msc.ir.ops.op_dtype_problem) refuses ``op`` on ``dtype``."""
    problem = op_dtype_problem(op, str(dtype).replace("torch.", ""), dtype.is_floating_point)
    if problem is not None:
        raise UsageError(problem)


def workspace(prog: RankProgram, like: torch.Tensor) -> torch.Tensor:
    key = (like.dtype, like.device)
    ws = prog.workspace.get(key)
    if ws is None:
        ws = prog.workspace[key] = torch.empty(prog.arena, dtype=like.dtype, device=like.device)
    return ws


def _views(bufs, pieces):
    return [(peer, bufs[b][lo:hi]) for peer, (b, lo, hi) in pieces]


def compute(prog_round, bufs, combine) -> None:
    """The compute phase of one round."""
    for op in prog_round.ops:
        if op[0] == "copy":
            (db, dlo, dhi), (sb, slo, shi) = op[1], op[2]
            bufs[db][dlo:dhi].copy_(bufs[sb][slo:shi])
        else:
            (db, dlo, dhi), (ab, alo, ahi), (bb, blo, bhi) = op[1], op[2], op[3]
            combine(bufs[ab][alo:ahi], bufs[bb][blo:bhi], out=bufs[db][dlo:dhi])


def buffers_for(prog: RankProgram, phys: dict[str, torch.Tensor]) -> list:
    bufs: list = [None, None, None]
    for name, tensor in phys.items():
        bufs[BUFFER[name]] = tensor
    ref = phys.get("input", phys.get("output"))
    bufs[ARENA] = workspace(prog, ref)
    return bufs


def execute(prog: RankProgram, phys: dict[str, torch.Tensor], op: str, transport) -> None:
    """Run ``prog`` on this rank's physical buffers (1-D, contiguous).
    ``transport.p2p(sends, recvs)`` moves one round's messages ((peer,
    tensor) lists); ``transport.alltoall(input, output, input_splits,
    output_splits)`` runs a round's all_to_all_single; both return when the
    round's communication is done."""
    bufs = buffers_for(prog, phys)
    combine = COMBINE[op]
    for r in prog.rounds:
        compute(r, bufs, combine)
        if r.alltoall is not None:
            (ib, ilo, ihi), in_splits, (ob, olo, ohi), out_splits = r.alltoall
            transport.alltoall(bufs[ib][ilo:ihi], bufs[ob][olo:ohi], in_splits, out_splits)
        elif r.sends or r.recvs:
            transport.p2p(_views(bufs, r.sends), _views(bufs, r.recvs))
    if REDUCE_OPS[op].average:
        average(prog, bufs)


def average(prog: RankProgram, bufs) -> None:
    """avg's division, as msc.executor: floats divided in float64 and
    rounded once to the dtype, integers truncated toward zero."""
    for (b, lo, hi), m in prog.averaged:
        view = bufs[b][lo:hi]
        if view.dtype.is_floating_point:
            view.copy_(view.to(torch.float64).div_(m))
        else:
            view.copy_(torch.div(view.to(torch.int64), m, rounding_mode="trunc"))


class DistTransport:
    """Rounds over a torch.distributed group (peers are group ranks).

    p2p: one batch per round; NCCL coalesces it into one group call
    (batch_isend_irecv); gloo gets its receives and then its sends posted
    directly (what batch_isend_irecv does for it, less the per-op Python
    checks). Receives first: gloo then knows a receive waits when the
    peer's data comes; sends first cost a handshake per message.

    alltoall: one all_to_all_single per round (every rank calls it).
    """

    def __init__(self, group, tag: int = TAG):
        import torch.distributed as dist

        self.dist, self.group, self.tag = dist, group, tag
        self.pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self.backend = dist.get_backend(self.pg)
        # the msc backend (msc.torch.process_group): its messages go to the fallback of their device
        self.carrier = getattr(self.pg, "fallback_name", None)

    def _gloo(self, tensors) -> bool:
        if self.carrier is not None:
            return all(self.carrier(t.device) == "gloo" for t in tensors)
        return self.backend == "gloo"

    def p2p(self, sends, recvs) -> None:
        dist, tag = self.dist, self.tag
        if self._gloo([t for _, t in sends] + [t for _, t in recvs]):
            works = [self.pg.recv([t], p, tag) for p, t in recvs]
            works += [self.pg.send([t], p, tag) for p, t in sends]
        else:
            ops = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p, tag=tag) for p, t in recvs]
            ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=p, tag=tag) for p, t in sends]
            works = dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()

    def alltoall(self, inp, out, in_splits, out_splits) -> None:
        self.dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)


def choose_transport(transport: str, group, n: int) -> str:
    """"auto": "mixed" on gloo (one all_to_all_single for each round where
    most pairs of ranks talk, point-to-point messages for the others: gloo's
    collectives cost less than as many sends and receives, but a collective
    makes every rank talk to every other, which a ring's round does not
    need), "p2p" on other backends (NCCL coalesces a round's batch into one
    group call)."""
    if transport == "auto":
        import torch.distributed as dist

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        carrier = getattr(pg, "fallback_name", None)         # the msc backend: what carries its messages
        kind = carrier(None) if carrier is not None else dist.get_backend(pg)
        return "mixed" if kind == "gloo" else "p2p"
    if transport not in TRANSPORTS:
        raise UsageError(f"unknown transport {transport!r} (expected auto or one of {', '.join(TRANSPORTS)})")
    return transport


def run_local(plan, phys: list[dict[str, torch.Tensor]], *, count: int, op: str = "sum", collective=None,
              transport: str = "p2p") -> None:
    """Run every rank of ``plan`` in this process, round by round, on
    per-rank physical buffers (as msc.executor.run_plan, with tensors):
    the same programs and rounds as the distributed run, each round's
    messages copied between ranks once every rank finished its compute
    phase."""
    prepared = prepare(plan, collective)
    n = prepared.plan.num_ranks
    if len(phys) != n:
        raise UsageError(f"{len(phys)} ranks of buffers for a plan of {n} ranks")
    op = op_name(op)
    if transport not in TRANSPORTS:
        raise UsageError(f"unknown transport {transport!r} (expected one of {', '.join(TRANSPORTS)})")
    progs = [prepared.program(r, count, transport) for r in range(n)]
    for r, prog in enumerate(progs):
        for name, size in prog.sizes.items():
            if phys[r].get(name) is None or phys[r][name].numel() != size:
                raise UsageError(f"rank {r}: buffer {name} needs {size} elements at count {count}")
    first = next((t for p in phys for t in p.values() if t is not None), None)
    if first is not None:
        check_op_dtype(op, first.dtype)
    bufs = [buffers_for(prog, p) for prog, p in zip(progs, phys)]
    combine = COMBINE[op]
    at = [{rd.t: rd for rd in prog.rounds} for prog in progs]
    for t in range(prepared.rounds.num_rounds):
        here = [at[r].get(t) for r in range(n)]
        for r in range(n):
            if here[r] is not None:
                compute(here[r], bufs[r], combine)
        if any(h is not None and h.alltoall is not None for h in here):
            _local_alltoall(t, here, bufs)
        else:
            _local_p2p(t, here, bufs)
    if REDUCE_OPS[op].average:
        for prog, b in zip(progs, bufs):
            average(prog, b)


def _local_p2p(t, here, bufs) -> None:
    sent = {}
    for r, rd in enumerate(here):
        for peer, view in _views(bufs[r], rd.sends if rd else ()):
            sent.setdefault((r, peer), []).append(view)
    for r, rd in enumerate(here):
        for peer, view in _views(bufs[r], rd.recvs if rd else ()):
            src = sent[(peer, r)].pop(0)
            if src.numel() != view.numel():
                raise UsageError(f"round {t}: rank {peer} sends {src.numel()} elements, rank {r} expects "
                                 f"{view.numel()}")
            view.copy_(src)
    if any(sent.values()):
        raise UsageError(f"round {t}: messages nobody receives: {[k for k, v in sent.items() if v]}")


def _local_alltoall(t, here, bufs) -> None:
    """all_to_all_single's semantics: rank r's output segment from s is
    s's input segment for r; every rank must take part."""
    calls = []
    for r, rd in enumerate(here):
        if rd is None or rd.alltoall is None:
            raise UsageError(f"round {t}: rank {r} does not take part in the round's alltoall")
        (ib, ilo, ihi), isp, (ob, olo, ohi), osp = rd.alltoall
        calls.append((bufs[r][ib][ilo:ihi], isp, bufs[r][ob][olo:ohi], osp))
    sources = [list(inp.split(isp)) for inp, isp, _, _ in calls]
    for r, (_, _, out, osp) in enumerate(calls):
        for s, piece in enumerate(out.split(osp)):
            if piece.numel() != sources[s][r].numel():
                raise UsageError(f"round {t}: rank {s} sends {sources[s][r].numel()} elements to rank {r}, which "
                                 f"expects {piece.numel()}")
            piece.copy_(sources[s][r])


__all__ = ["COMBINE", "DTYPES", "DistTransport", "OPS", "Prepared", "TAG", "check_op_dtype", "choose_transport",
           "clear_caches", "execute", "op_name", "prepare", "run_local"]
