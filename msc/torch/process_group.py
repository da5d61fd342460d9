"""The "msc" torch.distributed backend: any torch code's collectives on msc plans.

After ``import msc.torch``, ``dist.init_process_group("msc")`` (or the
device map "cpu:msc,cuda:msc", or ``new_group(backend="msc")``) makes an
``MscProcessGroup``: every collective call on it (from FSDP, DDP or user
code) is served by the plan the group's registry (``MSC_PLANS``) holds for
it, on the engine msc.torch chooses (``MSC_ENGINE``, default "auto"), or
passed through to a wrapped backend (``MSC_FALLBACK``: gloo for CPU
tensors, NCCL for CUDA tensors by default) with the reason counted in
``msc.torch.report()``. ``MSC_STRICT=1`` makes a pass-through of a
collective that has any plan an error (``StrictModeError``) naming why.

Served: all_reduce, all_gather_into_tensor, all_gather (list of equal
tensors), reduce_scatter_tensor, reduce_scatter (list of equal tensors),
all_to_all_single with equal (or no) splits, all_to_all (list of equal
tensors), broadcast, reduce; their coalesced forms one call at a time. A
call passes through when no plan covers it (collective, ranks, bytes,
form, root), its dtype or op is not one msc runs (e.g. PREMUL_SUM, bitwise
ops, complex or bool tensors), its tensors are empty, all_to_all splits
are uneven, a list form's tensors differ in size, or one call names several
tensors. Tensors that are not contiguous (strided views) are served through
contiguous copies, the result copied back (gloo, handed one, computes a
wrong result); a written one whose elements share memory (an expanded view)
is refused (gloo writes past its storage). Barrier, send/recv, gather, scatter
always pass through (msc has no plans for them).

Served calls run synchronously on the torch executor (and on the emulated
device); on a GPU the CUDA runtime queues its kernel on the current stream.
``async_op=True`` gets a Work that is already complete (wait() returns at
once, get_future() is done): correct, but a served call does not overlap
computation the way an asynchronous NCCL call does. Pass-through calls get
the wrapped backend's own Work.

The agreement check (msc.torch.agree) applies to served calls. Every rank
decides alone whether msc serves a call, so the group's creation checks
that all ranks hold the same plans (``_same_plans_everywhere``).
"""
from __future__ import annotations

import atexit
import threading
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from msc.dsl.collectives import get_collective
from msc.errors import UsageError
from msc.torch import calls, served
from msc.torch import settings as msc_settings
from msc.torch.execute import op_name
from msc.dsl.collectives import collective_key
from msc.formats.registry import NoPlanError
from msc.units import format_size


_REMEMBERED = 4096          # call shapes whose plan (or its absence) a group keeps


class StrictModeError(UsageError):
    """MSC_STRICT: a collective that has plans would have passed through."""


class _Request:
    """One call as msc would serve it: msc's collective name, the input and
    output tensors as msc.torch's calls take them, op, root; ``after`` copies
    results to where the caller wants them; ``result`` is what the Work's
    future holds."""

    def __init__(self, collective, input, output, *, op="sum", root=None, after=None, result=()):
        self.collective, self.input, self.output = collective, input, output
        self.op, self.root, self.after, self.result = op, root, after, list(result)


def _nbytes(tensors) -> int:
    return max((t.numel() * t.element_size() for t in tensors if t is not None), default=None)


def _dtype(tensors):
    """The first tensor's dtype (the report spells it)."""
    for t in tensors:
        if t is not None:
            return t.dtype
    return None


def _done(tensors) -> dist.Work:
    """A completed Work holding ``tensors`` (a future with the tensors'
    CUDA device where they are on one, as DDP expects)."""
    devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
    fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    fut.set_result(list(tensors))
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _all(works) -> dist.Work:
    """One Work for several (the coalesced forms)."""
    works = [w for w in works if w is not None]
    if len(works) == 1:
        return works[0]
    fut = torch.futures.collect_all([w.get_future() for w in works])
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _make_backend(name: str, store, rank: int, size: int, timeout: timedelta):
    """A c10d Backend named ``name`` over ``store`` (the fallback)."""
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if name == "nccl":
        if not dist.is_nccl_available():
            raise UsageError("MSC_FALLBACK: nccl is not available in this torch build; use gloo")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise UsageError(f"MSC_FALLBACK: unknown torch.distributed backend {name!r} (gloo, nccl, or one registered "
                         f"with Backend.register_backend)")
    if plugin.extended_api:
        raise UsageError(f"MSC_FALLBACK: backend {name!r} uses the extended creator API, which msc cannot wrap")
    return plugin.creator_fn(store, rank, size, timeout)


class MscProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run msc plans (see the module doc)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, settings: msc_settings.Settings):
        super().__init__(rank, size)
        self.settings = settings
        self.registry = calls.registry_of(settings.plans)     # read and verified now: bad plans fail at init
        self._store, self._timeout = store, timeout
        self._backends: dict[str, object] = {}
        self._entries: dict[tuple, object] = {}                # call shape -> registry entry or why none
        self._local = threading.local()
        _same_plans_everywhere(store, rank, size, timeout, self.registry, settings.plans)
        self._backend_for("cpu")                                # gloo connects all ranks now, as init does

    # -- identity ----------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "msc"

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names.get(self, "")

    def __repr__(self) -> str:
        return f"MscProcessGroup(rank={self.rank()}, size={self.size()}, fallback={self.settings.fallback})"

    def fallback_name(self, device=None) -> str:
        """The backend that carries this group's messages on ``device`` (cpu when None)."""
        kind = "cuda" if getattr(device, "type", device) == "cuda" else "cpu"
        return self.settings.fallback[kind]

    def _backend_for(self, device):
        name = self.fallback_name(device)
        backend = self._backends.get(name)
        if backend is None:
            store = PrefixStore(f"msc-fallback/{name}/", self._store)
            backend = self._backends[name] = _make_backend(name, store, self.rank(), self.size(), self._timeout)
        return backend

    def _fallback(self, tensor):
        return self._backend_for(tensor.device if tensor is not None else None)

    # -- serve or pass -----------------------------------------------------------------------------
    @contextmanager
    def serving(self):
        """While msc itself calls this group (its executor's messages, the
        runtime's bootstrap): those calls go straight to the fallback, uncounted."""
        self._local.serving = getattr(self._local, "serving", 0) + 1
        try:
            yield
        finally:
            self._local.serving -= 1

    def _inside(self) -> bool:
        return self._local.__dict__.get("serving", 0) > 0

    def _has_plans(self, collective: str) -> bool:
        name = collective_key(collective)
        return any(e.collective == name for e in self.registry)

    def _pass(self, collective: str, tensors, reason: str, fallback, detail: str = ""):
        nbytes, dtype = _nbytes(tensors), _dtype(tensors)
        if self.settings.strict and self._has_plans(collective):
            where = self.fallback_name(next((t.device for t in tensors if t is not None), None))
            raise StrictModeError(
                f"MSC_STRICT: {collective} of {format_size(nbytes)} {served.spelled(dtype)} over {self.size()} ranks "
                f"would pass through to {where}: {reason}{f' ({detail})' if detail else ''}")
        served.passed(collective, nbytes, dtype, reason)
        return fallback()

    def _call(self, collective: str, tensors, fallback, request):
        """``request()`` gives the _Request msc serves, or the reason it cannot."""
        if self._inside():
            return fallback()
        req = request()
        if isinstance(req, str):
            return self._pass(collective, tensors, req, fallback)
        return self._serve(req, tensors, fallback)

    def _serve(self, req: _Request, tensors, fallback):
        name = req.collective
        given = [t for t in (req.input, req.output) if t is not None]
        if any(t.numel() == 0 for t in given):
            return self._pass(name, tensors, "empty tensor", fallback)
        # no plan for the size in either form: pass at once (the common pass-through, kept cheap)
        entry = self._entry(name, max(t.numel() * t.element_size() for t in given), True, req.root)
        if isinstance(entry, tuple):
            return self._pass(name, tensors, entry[0], fallback, detail=entry[1])
        req = _through_copies(req)
        try:
            op = op_name(req.op)
            call = calls._Call(get_collective(name), self.size(), 1, self.rank(), req.input, req.output)
        except UsageError as exc:
            return self._pass(name, tensors, str(exc), fallback)
        nbytes = call.nbytes()
        entry = self._entry(name, nbytes, call.inplace, req.root)
        if isinstance(entry, tuple):
            return self._pass(name, tensors, entry[0], fallback, detail=entry[1])
        plan = entry.plan
        transport = self.settings.transport
        if transport == "auto":
            transport = "mixed" if self.fallback_name(call.device) == "gloo" else "p2p"
        engine: list[str] = []
        with self.serving():
            calls._run(lambda: plan, req.input, req.output, op=op, group=self, backend=self.settings.engine,
                       transport=transport, engine_used=engine, what=name)
            if req.after is not None:
                req.after()
        served.served(name, nbytes, call.dtype, _label(entry), _engine_label(engine[0]))
        return _done(req.result)

    def _entry(self, name: str, nbytes: int, inplace: bool, root: int | None):
        """The registry's entry for a call, or (reason, detail) when none
        covers it; remembered per call shape (a miss builds a long message)."""
        key = (name, nbytes, inplace, root)
        found = self._entries.get(key)
        if found is None:
            try:
                found = self.registry.entry(name, self.size(), nbytes, inplace, root or 0)
            except NoPlanError as exc:
                found = (self._missing(name, nbytes, root), str(exc))
            if len(self._entries) >= _REMEMBERED:
                self._entries.clear()
            self._entries[key] = found
        return found

    def _missing(self, collective: str, nbytes: int, root: int | None) -> str:
        """Why no plan serves the call, shortest first: no plan of the
        collective, none for this many ranks, none with this root, or none
        covering this size."""
        mine = [e for e in self.registry if e.collective == collective]
        if not mine:
            return f"no {collective} plans"
        mine = [e for e in mine if e.num_ranks == self.size()]
        if not mine:
            return f"no {collective} plan for {self.size()} ranks"
        if root is not None and not any(e.root == root for e in mine):
            return f"no {collective} plan with root {root}"
        return f"no {collective} plan covers {format_size(nbytes)} bytes"

    # -- the collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._call("allreduce", tensors, lambda: self._fallback(tensors[0]).allreduce(tensors, opts),
                          lambda: "several tensors in one call" if len(tensors) != 1 else
                          _Request("allreduce", tensors[0], None, op=opts.reduceOp, result=tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        single = dist.AllreduceOptions()
        single.reduceOp, single.timeout = opts.reduceOp, opts.timeout
        return _all([self.allreduce([t], single) for t in tensors])

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._call("allgather", [input, output],
                          lambda: self._fallback(input)._allgather_base(output, input, opts),
                          lambda: _Request("allgather", input, output, result=[output]))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _all([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        flat = [t for ts in output_lists for t in ts]
        return self._call("allgather", [*inputs, *flat],
                          lambda: self._fallback(inputs[0]).allgather(output_lists, inputs, opts),
                          lambda: self._gather_request(output_lists, inputs))

    def _gather_request(self, output_lists, inputs):
        if len(inputs) != 1 or len(output_lists) != 1:
            return "several tensors in one call"
        outs, inp = output_lists[0], inputs[0]
        if not _equal_list(outs, inp):
            return "the output list's tensors differ from the input in size, dtype or device"
        whole = torch.empty(len(outs) * inp.numel(), dtype=inp.dtype, device=inp.device)
        return _Request("allgather", inp, whole, after=_copy_out(whole, outs), result=outs)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._call("reducescatter", [input, output],
                          lambda: self._fallback(input)._reduce_scatter_base(output, input, opts),
                          lambda: _Request("reducescatter", input, output, op=opts.reduceOp, result=[output]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _all([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        flat = [t for ts in input_lists for t in ts]
        return self._call("reducescatter", [*flat, *outputs],
                          lambda: self._fallback(outputs[0]).reduce_scatter(outputs, input_lists, opts),
                          lambda: self._scatter_request(outputs, input_lists, opts))

    def _scatter_request(self, outputs, input_lists, opts):
        if len(outputs) != 1 or len(input_lists) != 1:
            return "several tensors in one call"
        out, ins = outputs[0], input_lists[0]
        if not _equal_list(ins, out):
            return "the input list's tensors differ from the output in size, dtype or device"
        whole = torch.cat([t.reshape(-1) for t in ins])
        return _Request("reducescatter", whole, out, op=opts.reduceOp, result=[out])

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._call("alltoall", [input, output],
                          lambda: self._fallback(input).alltoall_base(output, input, output_splits, input_splits,
                                                                      opts),
                          lambda: self._alltoall_request(output, input, output_splits, input_splits))

    alltoall_base = all_to_all_single

    def _alltoall_request(self, output, input, output_splits, input_splits):
        n = self.size()
        for splits, t in ((input_splits, input), (output_splits, output)):
            if splits and (len(splits) != n or len(set(splits)) != 1 or sum(splits) != t.shape[0]):
                return f"uneven splits {list(splits)}"
        return _Request("alltoall", input, output, result=[output])

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._call("alltoall", [*inputs, *outputs],
                          lambda: self._fallback(inputs[0]).alltoall(outputs, inputs, opts),
                          lambda: self._alltoall_list_request(outputs, inputs))

    def _alltoall_list_request(self, outputs, inputs):
        if not inputs or not _equal_list(inputs, inputs[0]) or not _equal_list(outputs, inputs[0]):
            return "the lists' tensors differ in size, dtype or device"
        whole_in = torch.cat([t.reshape(-1) for t in inputs])
        whole_out = torch.empty_like(whole_in)
        return _Request("alltoall", whole_in, whole_out, after=_copy_out(whole_out, outputs), result=outputs)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._call("broadcast", tensors, lambda: self._fallback(tensors[0]).broadcast(tensors, opts),
                          lambda: "several tensors in one call" if len(tensors) != 1 else
                          _Request("broadcast", tensors[0], None, root=opts.rootRank, result=tensors))

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._call("reduce", tensors, lambda: self._fallback(tensors[0]).reduce(tensors, opts),
                          lambda: "several tensors in one call" if len(tensors) != 1 else
                          _Request("reduce", tensors[0], None, op=opts.reduceOp, root=opts.rootRank, result=tensors))

    # -- what msc has no plans for: always the fallback ----------------------------------------------
    def _through(self, what: str, tensors, fallback):
        if self._inside():
            return fallback()
        return self._pass(what, tensors, f"msc has no plans for {what}", fallback)

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._through("barrier", [], lambda: self._fallback(None).barrier(opts))

    def send(self, tensors, dst: int, tag: int = 0):
        return self._through("send", tensors, lambda: self._fallback(tensors[0]).send(tensors, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        return self._through("recv", tensors, lambda: self._fallback(tensors[0]).recv(tensors, src, tag))

    def recv_anysource(self, tensors, tag: int = 0):
        return self._through("recv", tensors, lambda: self._fallback(tensors[0]).recv_anysource(tensors, tag))

    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        flat = [t for ts in output_lists for t in ts]
        return self._through("gather", [*inputs, *flat],
                             lambda: self._fallback(inputs[0]).gather(output_lists, inputs, opts))

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        flat = [t for ts in input_lists for t in ts]
        return self._through("scatter", [*outputs, *flat],
                             lambda: self._fallback(outputs[0]).scatter(outputs, input_lists, opts))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        flat = [t for ts in output_lists for t in ts]
        return self._through("allgather_coalesced", [*inputs, *flat],
                             lambda: self._fallback(inputs[0]).allgather_coalesced(output_lists, inputs, opts))

    def monitored_barrier(self, opts=None, wait_all_ranks: bool = False):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._through("barrier", [], lambda: self._fallback(None).monitored_barrier(opts, wait_all_ranks))

    # -- coalescing: msc's own batches go to the fallback; a user's calls run one at a time ---------
    def _start_coalescing(self, device):
        if self._inside():
            backend = self._fallback(torch.empty(0, device=device))
            if backend.supports_coalescing:
                backend._start_coalescing(device)
        self._local.coalescing = getattr(self._local, "coalescing", 0) + 1

    def _end_coalescing(self, device):
        self._local.coalescing -= 1
        if self._inside():
            backend = self._fallback(torch.empty(0, device=device))
            if backend.supports_coalescing:
                return backend._end_coalescing(device)
        return _done([])

    def shutdown(self) -> None:
        for backend in self._backends.values():
            stop = getattr(backend, "shutdown", None)
            if stop is not None:
                stop()


def _label(entry) -> str:
    """The plan as the report names it: its file, else its name."""
    source = str(entry.source)
    if source.startswith("<"):
        return entry.plan.name
    return source.replace("\\", "/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]     # "plans.json:FILE" -> FILE


def _engine_label(engine: str) -> str:
    if engine == "cuda":
        from msc.torch.backends import runtime_device

        return "the CUDA runtime (emulated)" if runtime_device() == "emu" else "the CUDA runtime"
    return "the torch executor"


def _same_plans_everywhere(store, rank: int, size: int, timeout: timedelta, registry, source) -> None:
    """Every rank must hold the same plans: each decides alone whether a
    call is served or passed through, so ranks with different plans would
    make different calls (one waiting for msc's agreement, another inside
    gloo) and hang. Checked once, at the group's creation, through its store."""
    import hashlib

    mine = hashlib.blake2b("".join(e.digest() for e in registry).encode(), digest_size=8).hexdigest()
    store.set(f"msc-plans/{rank}", f"{mine} {source}")
    keys = [f"msc-plans/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except Exception as exc:                 # the store's timeout: a rank never came
        raise UsageError(f"the msc backend: not every rank published its plans within {timeout}: {exc}") from None
    records = [store.get(k).decode() for k in keys]
    if len(set(r.split(" ", 1)[0] for r in records)) > 1:
        groups: dict[str, list[int]] = {}
        for r, rec in enumerate(records):
            groups.setdefault(rec, []).append(r)
        listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: plans {rec.split(' ', 1)[1]} "
                            f"(digest {rec.split(' ', 1)[0]})" for rec, rs in groups.items())
        raise UsageError(f"the msc backend needs the same plans on every rank (each rank decides alone which "
                         f"calls msc serves): {listing}")


def _through_copies(req: _Request) -> _Request:
    """A call on tensors that are not contiguous (a strided view, such as
    ``base[:, ::2]``), served on contiguous copies with the result copied
    back after (torch.distributed requires contiguous tensors; gloo, handed
    one, computes a wrong result). A written tensor whose elements may share
    memory (an expanded view) is refused: no result can be written to it,
    and gloo, handed one, writes past its storage (the heap is corrupted)."""
    inp, out = req.input, req.output
    if all(t is None or t.is_contiguous() for t in (inp, out)):
        return req
    written = inp if out is None else out          # the in-place forms write their input
    if not written.is_contiguous() and _may_overlap(written):
        raise UsageError(f"{req.collective}: the tensor it writes has elements that share memory (an expanded view, "
                         f"shape {tuple(written.shape)}, strides {written.stride()}): no result can be written to it "
                         f"(and a backend handed it writes past its storage); pass a tensor of its own (.clone())")
    new_in = None if inp is None else inp.contiguous()
    new_out = None if out is None else out.contiguous()
    result, then = (new_in if out is None else new_out), req.after

    def after():
        if result is not written:
            written.copy_(result)
        if then is not None:
            then()
    return _Request(req.collective, new_in, new_out, op=req.op, root=req.root, after=after, result=req.result)


def _may_overlap(t) -> bool:
    """Whether two elements of ``t`` may be one: not if each dimension's
    stride (in increasing order) steps past everything the smaller ones span."""
    span = 0
    dims = sorted(((sz, st) for sz, st in zip(t.shape, t.stride()) if sz > 1), key=lambda d: d[1])
    for size, stride in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _copy_out(whole, outs):
    """What a list form does after the call: ``whole``'s equal consecutive
    pieces copied into the list's tensors."""
    def after():
        m = outs[0].numel()
        for i, o in enumerate(outs):
            o.copy_(whole[i * m:(i + 1) * m].view_as(o))
    return after


def _equal_list(tensors, like) -> bool:
    """The list's tensors are like ``like`` (strided views too: they are read
    by torch.cat and written by copy_, unless their elements may overlap)."""
    return all(t.numel() == like.numel() and t.dtype == like.dtype and t.device == like.device
               and (t.is_contiguous() or not _may_overlap(t)) for t in tensors)     # (expanded: gloo says why)


# -- the backend's creator ----------------------------------------------------------------------------

_REPORT_AT_EXIT = {"registered": False}


def create(store, rank: int, size: int, timeout: timedelta) -> MscProcessGroup:
    """torch.distributed's creator for the "msc" backend (Backend.register_backend)."""
    settings = msc_settings.require_plans(msc_settings.current())
    group = MscProcessGroup(store, rank, size, timeout, settings)
    if settings.report and not _REPORT_AT_EXIT["registered"]:
        _REPORT_AT_EXIT["registered"] = True
        if rank == 0:                       # the first group is the world: its rank 0 prints
            atexit.register(lambda: print(served.report(), flush=True))
    return group
