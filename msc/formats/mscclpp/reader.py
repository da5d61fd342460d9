"""An MSCCL++ execution plan (JSON) into the one-sided model (msc.ir.onesided).

Read as the executor's loader reads it (microsoft/mscclpp at 1f5f065,
src/core/executor/execution_plan.cc): a rank's ``channels`` are flattened,
one memory channel per ``connected_to`` peer, and a threadblock's
``channels[].channel_ids`` name them; an operation's ``channel_ids`` index
the threadblock's list. A rank's ``remote_buffers`` name peers' buffers, a
threadblock's ``remote_buffer_refs`` pick some, and an operand's
``buffer_id`` indexes the threadblock's pick. Operand ``index``/``size`` are
chunks. A ``switch`` channel entry binds one buffer (``buffer_type``) to a
multicast object per ``rank_groups`` entry, flattened in order apart from
the memory channels; a threadblock's switch ``channel_ids`` name those, and
an operand's ``switch_channel_id`` indexes the threadblock's list. Port
channels are flattened apart too (the rank's ``port_channels``); an
operation's ``channel_type`` says which list its ``channel_ids`` and its
operands' ``buffer_id`` index (the threadblock's memory or port picks).

Every error is a PlanError naming the rank, threadblock and operation.
"""
from __future__ import annotations

import json

from msc.errors import PlanError
from msc.formats.mscclpp.meta import GPU, PLAN, THREADBLOCK, check_fields
from msc.ir.limits import MAX_BUFFER_CHUNKS
from msc.ir.onesided import KNOWN_OPS, PIPELINE, SWITCH_OPS, UNSUPPORTED_OPS, Gpu, OneSidedPlan, Operand, Operation

BUFFERS = {"i": "input", "o": "output", "s": "scratch"}
PROTOCOLS = ("Simple", "LL")


# No array or object of a plan within msc's limits is longer (gpus, peers and contract rows are per rank, a
# threadblock has 64 operations), nor has a plan more of them (a 256-rank ring allreduce exported: 2.2 million).
MAX_ITEMS = 1 << 16
MAX_CONTAINERS = 1 << 24
MAX_DEPTH = 32                             # a plan nests 8 deep (gpus, threadblocks, ops, a pipeline's ops, operands)


def parse_mscclpp(data: bytes | str, *, path: str | None = None) -> OneSidedPlan:
    """The one-sided plan of an MSCCL++ JSON text (not checked: see msc.verification.onesided).
    Its shape is measured first, so a plan over a limit is refused before
    json.loads makes an object of every value."""
    from msc.formats.json_shape import ShapeError, check_shape, where

    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    try:
        check_shape(raw, max_items=MAX_ITEMS, max_containers=MAX_CONTAINERS, max_depth=MAX_DEPTH)
    except ShapeError as exc:
        raise PlanError(f"{where(raw, exc.offset)}: {exc.what}, more than any execution plan within msc's limits "
                        f"has", path=path) from None
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise PlanError(f"not JSON: {exc}"[:200], path=path) from None
    return _Reader(path).plan(doc)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def looks_like_mscclpp(head: bytes) -> bool:
    """Whether a file's first bytes start a JSON object (an execution plan)."""
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


def _meta(obj: dict) -> tuple:
    """The msc_* fields msc writes beside the executor's (which it ignores), hashable."""
    freeze = lambda v: tuple(map(freeze, v)) if isinstance(v, list) else v
    return tuple(sorted((k, freeze(v)) for k, v in obj.items() if k.startswith("msc_")))


class _Reader:
    def __init__(self, path):
        self.path = path

    def error(self, message: str, **where) -> PlanError:
        return PlanError(message, path=self.path, **where)

    def field(self, obj, key, kind, what, **where):
        if not isinstance(obj, dict):
            raise self.error(f"{what} must be a JSON object, got {obj!r:.60}", **where)
        if key not in obj:
            raise self.error(f"{what}: missing field {key!r}", **where)
        value = obj[key]
        if kind is int and (type(value) is not int or value < 0):
            raise self.error(f"{what}: {key} must be an integer >= 0, got {value!r:.80}", **where)
        if kind is not int and not isinstance(value, kind):
            raise self.error(f"{what}: {key} must be a {kind.__name__}, got {value!r:.80}", **where)
        return value

    def optional(self, obj, key, kind, default, what, **where):
        """``obj[key]`` of ``kind`` where present, else ``default``."""
        if isinstance(obj, dict) and key not in obj:
            return default
        return self.field(obj, key, kind, what, **where)

    def plan(self, doc) -> OneSidedPlan:
        if not isinstance(doc, dict):
            raise self.error("an execution plan is a JSON object")
        protocol = self.field(doc, "protocol", str, "plan")
        if protocol not in PROTOCOLS:
            raise self.error(f"protocol {protocol!r:.40}: the executor takes {' or '.join(PROTOCOLS)}")
        gpus = self.field(doc, "gpus", list, "plan")
        n = len(gpus)
        if n == 0:
            raise self.error("plan: no gpus")
        for r, gpu in enumerate(gpus):
            if self.field(gpu, "id", int, f"gpus[{r}]") != r:
                raise self.error(f"gpus[{r}] has id {gpu['id']}: the executor reads gpus[rank] and needs id == rank")
        remote = [self.remote_buffers(g, r, n) for r, g in enumerate(gpus)]
        channels = [self.channels(g, r, n) for r, g in enumerate(gpus)]
        _check_groups(self, channels)
        built = tuple(self.gpu(g, r, n, channels[r], remote[r]) for r, g in enumerate(gpus))
        for g in built[1:]:
            if (g.input_chunks, g.output_chunks) != (built[0].input_chunks, built[0].output_chunks):
                raise self.error(f"{g.input_chunks} input and {g.output_chunks} output chunks where rank 0 has "
                                 f"{built[0].input_chunks} and {built[0].output_chunks}: a collective's ranks have "
                                 f"buffers of one size", rank=g.rank)
        check_fields(doc, PLAN, {"ranks": n}, self.path)
        meta = _meta(doc)
        return OneSidedPlan(str(self.field(doc, "name", str, "plan")), self.field(doc, "collective", str, "plan"),
                            protocol, bool(self.field(doc, "inplace", bool, "plan")), n, built,
                            self.optional(doc, "use_double_scratch_buffer", bool, False, "plan"), meta)

    def channels(self, gpu, r, n) -> tuple[tuple[int, ...], tuple, tuple[int, ...]]:
        """(the peer of each memory channel, the (buffer, ranks) of each
        switch channel, the peer of each port channel)."""
        peers, switches, ports = [], [], []
        for c, ch in enumerate(self.field(gpu, "channels", list, "gpu", rank=r)):
            kind = self.field(ch, "channel_type", str, f"channels[{c}]", rank=r)
            if kind == "switch":
                switches += self.switch_channel(ch, c, r, n)
                continue
            if kind not in ("memory", "port"):
                raise self.error(f"channels[{c}] is a {kind!r:.20} channel: the executor has memory, port and "
                                 f"switch channels", rank=r)
            for peer in self.field(ch, "connected_to", list, f"channels[{c}]", rank=r):
                if type(peer) is not int or not 0 <= peer < n or peer == r:
                    raise self.error(f"channels[{c}] connects to {peer!r:.20}, not another rank (0..{n - 1})", rank=r)
                (peers if kind == "memory" else ports).append(peer)
        return tuple(peers), tuple(switches), tuple(ports)

    def switch_channel(self, ch, c, r, n) -> list:
        what = f"channels[{c}] (switch)"
        if "buffer_type" not in ch:
            raise self.error(f"{what}: missing field 'buffer_type' (the executor's loader reads channel"
                             f"[\"buffer_type\"]; {sorted(k for k in ch if k != 'rank_groups')} given)", rank=r)
        buffer = BUFFERS.get(self.field(ch, "buffer_type", str, what, rank=r))
        if buffer is None:
            raise self.error(f"{what}: buffer_type {ch['buffer_type']!r:.10} is not i, o or s", rank=r)
        out = []
        for k, group in enumerate(self.field(ch, "rank_groups", list, what, rank=r)):
            ranks = self.field(group, "ranks", list, f"{what} rank_groups[{k}]", rank=r)
            if (any(type(m) is not int or not 0 <= m < n for m in ranks) or len(set(ranks)) != len(ranks)
                    or r not in ranks):
                raise self.error(f"{what} rank_groups[{k}]: ranks {ranks!r:.60} are not distinct ranks (0..{n - 1}) "
                                 f"with rank {r} among them", rank=r)
            out.append((buffer, tuple(ranks)))
        return out

    def remote_buffers(self, gpu, r, n) -> list[tuple[int, str, tuple]]:
        out = []
        for b, buf in enumerate(self.optional(gpu, "remote_buffers", list, [], "gpu", rank=r)):
            peer = self.field(buf, "rank", int, f"remote_buffers[{b}]", rank=r)
            kind = BUFFERS.get(self.field(buf, "type", str, f"remote_buffers[{b}]", rank=r))
            if kind is None or peer >= n:
                raise self.error(f"remote_buffers[{b}]: {buf['type']!r:.10} of rank {peer} is not a buffer "
                                 f"(i, o, s) of a rank", rank=r)
            access = self.optional(buf, "access_channel_types", list, [], f"remote_buffers[{b}]", rank=r)
            if any(a not in ("memory", "port") for a in access):
                raise self.error(f"remote_buffers[{b}] is reached through {', '.join(map(str, access))} channels: "
                                 f"remote buffers are reached through memory or port channels", rank=r)
            out.append((peer, kind, tuple(access)))
        return out

    def gpu(self, gpu, r, n, channels, remote) -> Gpu:
        peers, switches, ports = channels
        sems = tuple(self.field(s, "init_value", int, "semaphore", rank=r) for s in self.optional(gpu, "semaphores", list, [], "gpu", rank=r))
        tbs, tb_channels, tb_buffers, tb_meta = [], [], [], []
        for t, tb in enumerate(self.field(gpu, "threadblocks", list, "gpu", rank=r)):
            if self.field(tb, "id", int, f"threadblocks[{t}]", rank=r) != t:
                raise self.error(f"threadblocks[{t}] has id {tb['id']}: ids must be 0, 1, ... in order", rank=r, tb=t)
            chans, tb_switches = self.tb_channels(tb, r, t, {"memory": peers, "port": ports}, switches)
            bufs = self.tb_buffers(tb, r, t, remote)
            ctx = (r, t, peers, chans, bufs, tb_switches)
            tbs.append(tuple(self.op(op, i, ctx) for i, op in enumerate(self.field(tb, "ops", list, "tb",
                                                                                      rank=r, tb=t))))
            tb_channels.append(max(len(chans["memory"]), len(chans["port"]), len(tb_switches)))   # MAX_CHANNEL each
            tb_buffers.append(max(len(bufs["memory"]), len(bufs["port"])))
        ctx = {"ranks": n, "scratch": self.chunks(gpu, "scratch_chunks", r), "channels": len(peers),
               "threadblocks": len(tbs)}
        check_fields(gpu, GPU, ctx, self.path, rank=r)
        for t, tb in enumerate(gpu["threadblocks"]):
            check_fields(tb, THREADBLOCK, ctx, self.path, rank=r, tb=t)
            tb_meta.append(_meta(tb))
        return Gpu(r, self.chunks(gpu, "input_chunks", r), self.chunks(gpu, "output_chunks", r),
                   self.chunks(gpu, "scratch_chunks", r), peers, sems, tuple(tbs),
                   tuple(tb_channels), tuple(tb_buffers), tuple(tb_meta), _meta(gpu), switches, ports)

    def chunks(self, gpu, key: str, r: int) -> int:
        """A buffer's size in chunks, within msc's limit (every loop over chunks is bounded by it)."""
        value = self.field(gpu, key, int, "gpu", rank=r)
        if value > MAX_BUFFER_CHUNKS:
            raise self.error(f"{key} is {value}, over msc's limit of {MAX_BUFFER_CHUNKS} chunks a buffer", rank=r)
        return value

    def tb_channels(self, tb, r, t, peers: dict, switches) -> tuple[dict, list]:
        """The threadblock's memory and port channels ({kind: the rank's indices})
        and switch channels ((buffer, ranks) each)."""
        out, out_switches = {"memory": [], "port": []}, []
        for entry in self.optional(tb, "channels", list, [], "threadblock", rank=r, tb=t):
            kind = self.field(entry, "channel_type", str, "channels", rank=r, tb=t)
            if kind not in ("memory", "port", "switch"):
                raise self.error(f"uses a {kind!r:.20} channel: the executor has memory, port and switch channels",
                                 rank=r, tb=t)
            have = switches if kind == "switch" else peers[kind]
            for c in self.field(entry, "channel_ids", list, "channels", rank=r, tb=t):
                if type(c) is not int or not 0 <= c < len(have):
                    raise self.error(f"channel id {c!r:.20} is not one of the rank's {len(have)} {kind} channels",
                                     rank=r, tb=t)
                if kind == "switch":
                    out_switches.append(switches[c])
                else:
                    out[kind].append(c)
        return out, out_switches

    def tb_buffers(self, tb, r, t, remote) -> dict:
        """{kind: [(peer, buffer)]}: the remote buffers the threadblock picks per channel kind."""
        out = {"memory": [], "port": []}
        for entry in self.optional(tb, "remote_buffer_refs", list, [], "threadblock", rank=r, tb=t):
            through = self.field(entry, "access_channel_type", str, "remote_buffer_refs", rank=r, tb=t)
            if through not in out:
                raise self.error(f"remote buffers through {through!r:.20} channels: remote buffers are reached "
                                 f"through memory or port channels", rank=r, tb=t)
            for b in self.field(entry, "remote_buffer_ids", list, "remote_buffer_refs", rank=r, tb=t):
                if type(b) is not int or not 0 <= b < len(remote):
                    raise self.error(f"remote buffer id {b!r:.20} is not one of the rank's {len(remote)}", rank=r, tb=t)
                peer, kind, access = remote[b]
                if access and through not in access:
                    raise self.error(f"remote buffer {b} (rank {peer}'s {kind}) is picked for {through} channels but "
                                     f"declares access through {', '.join(access) or 'none'}", rank=r, tb=t)
                out[through].append((peer, kind))
        return out

    def op(self, op, i, ctx, nested: bool = False) -> Operation:
        r, t, peers, chans, bufs, tb_switches = ctx
        where = dict(rank=r, tb=t)
        name = self.field(op, "name", str, f"operation {i}", **where)
        if name not in KNOWN_OPS:
            raise self.error(f"operation {i}: {name!r:.40} is not an operation of the MSCCL++ executor", **where)
        if name in UNSUPPORTED_OPS:
            raise self.error(f"operation {i}: {name} is {UNSUPPORTED_OPS[name]}, not supported by msc yet", **where)
        kind, channels = self.op_channels(op, name, i, chans, where)
        srcs = tuple(self.operand(b, r, bufs[kind], tb_switches, i, **where) for b in self.optional(op, "src_buff", list, [], f"operation {i}", **where))
        dsts = tuple(self.operand(b, r, bufs[kind], tb_switches, i, **where) for b in self.optional(op, "dst_buff", list, [], f"operation {i}", **where))
        _check_switch_operands(self, name, srcs, dsts, i, where)
        tbg = self.optional(op, "tbg_info", dict, None, f"operation {i}", **where)
        group = None if tbg is None else (self.field(tbg, "tb_id", int, f"operation {i} tbg_info", **where),
                                          self.field(tbg, "tbg_size", int, f"operation {i} tbg_info", **where))
        if group is not None and not group[0] < group[1]:
            raise self.error(f"operation {i}: tbg_info tb_id {group[0]} is not below tbg_size {group[1]}", **where)
        barrier = None
        if name == "barrier":
            barrier = (self.field(op, "barrier_id", int, f"operation {i}", **where),
                       self.field(op, "num_threadblocks", int, f"operation {i}", **where))
        sems = tuple(self.field({"id": s}, "id", int, f"operation {i} semaphore", **where)
                     for s in self.optional(op, "semaphore_ids", list, [], f"operation {i}", **where))
        body, unit, nchunks = (), 0, 0
        if name == PIPELINE:
            if nested:
                raise self.error(f"operation {i}: a pipeline inside a pipeline (the executor runs one level)", **where)
            ctxt = self.field(op, "iter_context", dict, f"operation {i}", **where)
            unit = self.field(ctxt, "unit_size", int, f"operation {i} iter_context", **where)
            nchunks = self.field(ctxt, "num_chunks", int, f"operation {i} iter_context", **where)
            if unit == 0:
                raise self.error(f"operation {i}: pipeline unit_size 0", **where)
            body = tuple(self.op(inner, i, ctx, nested=True) for inner in self.field(op, "ops", list,
                                                                                      f"operation {i}", **where))
        return Operation(name, srcs, dsts, channels, sems, barrier, group, body, unit, nchunks, kind)

    def op_channels(self, op, name, i, chans, where) -> tuple[str, tuple[int, ...]]:
        """(the kind of channel whose threadblock lists the operation's ids
        index, the rank's channels it names). Switch ops name their switch
        channels in their operands; the executor's handlers ignore the
        channel_ids some older plans give them."""
        declared = self.optional(op, "channel_type", str, "memory", f"operation {i}", **where)
        if declared not in ("memory", "port", "switch", "none"):
            raise self.error(f"operation {i}: {name} on a {declared!r:.20} channel: the executor has memory, port and "
                             f"switch channels", **where)
        kind = "port" if declared == "port" else "memory"
        if name == "flush" and kind != "port":
            raise self.error(f"operation {i}: flush waits for a port channel's proxy; it has channel_type {declared}",
                             **where)
        ids = [] if declared == "switch" else self.optional(op, "channel_ids", list, [], f"operation {i}", **where)
        have = chans[kind]
        return kind, tuple(have[self.index(c, have, f"operation {i}: {kind} channel id", **where)] for c in ids)

    def index(self, value, items, what, **where) -> int:
        if type(value) is not int or not 0 <= value < len(items):
            raise self.error(f"{what} {value!r:.20} is not below the threadblock's {len(items)}", **where)
        return value

    def operand(self, buf, r, bufs, switches, i, **where) -> Operand:
        what = f"operation {i} operand"
        index = self.field(buf, "index", int, what, **where)
        size = self.field(buf, "size", int, what, **where)
        if "switch_channel_id" in buf:
            kind, group = switches[self.index(buf["switch_channel_id"], switches,
                                              f"operation {i}: switch_channel_id", **where)]
            return Operand(r, kind, index, size, group=group)
        if "buffer_id" in buf:
            peer, kind = bufs[self.index(buf["buffer_id"], bufs, f"operation {i}: buffer_id", **where)]
            return Operand(peer, kind, index, size, remote=True)
        kind = BUFFERS.get(self.field(buf, "type", str, what, **where))
        if kind is None:
            raise self.error(f"operation {i}: buffer type {buf['type']!r:.10} is not i, o or s", **where)
        return Operand(r, kind, index, size)


# What each switch operation takes (execution_kernel.hpp): glres a switch source and destination (multimem
# load-reduce, then multimem store), gstore and gstorepkt a local source and a switch destination.
SWITCH_SHAPES = {"glres": (True, True), "gstore": (False, True), "gstorepkt": (False, True)}


def _check_switch_operands(reader, name, srcs, dsts, i, where) -> None:
    shape = SWITCH_SHAPES.get(name)
    switched = [bool(o.group) for o in srcs[:1] + dsts[:1]]
    if shape is None:
        if any(o.group for o in srcs + dsts):
            raise reader.error(f"operation {i}: {name} takes no switch-channel operand (only "
                               f"{', '.join(SWITCH_OPS)} do)", **where)
        return
    if len(srcs) != 1 or len(dsts) != 1 or tuple(switched) != shape:
        want = " and ".join(f"a {'switch-channel' if s else 'local'} {w}" for s, w in zip(shape, ("source",
                                                                                                 "destination")))
        raise reader.error(f"operation {i}: {name} takes {want}, one each", **where)
    if name == "glres" and srcs[0].group != dsts[0].group:
        raise reader.error(f"operation {i}: glres reads through ranks {srcs[0].group} and writes through "
                           f"{dsts[0].group}: one group's switch", **where)


def _check_groups(reader, channels) -> None:
    """Every member of a switch channel's group declares it too (the executor
    creates each multicast object collectively over the group)."""
    for r, (_, switches, _) in enumerate(channels):
        for buffer, group in switches:
            for m in group:
                if (buffer, group) not in channels[m][1]:
                    raise reader.error(f"a switch channel on the {buffer} of ranks {list(group)} that rank {m}, "
                                       f"a member, does not declare", rank=r)
