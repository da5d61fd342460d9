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

Served: all_reduce, all_gather_single (all_gather_into_tensor), all_gather
(list of equal tensors), reduce_scatter_single (reduce_scatter_tensor),
reduce_scatter (list of equal tensors), all_to_all_single (split sizes
given: on padded units, msc.torch.uneven, counted as "alltoallv"),
all_to_all (list of equal tensors), broadcast and reduce from any root (a
plan of another root turned to it: msc.formats.registry), gather and
scatter (the list on the root only) from the roots of their plans; their
coalesced forms one call at a time. Each registry row's methods are
derived from its TorchCall (msc.dsl.collectives). A call passes through when no plan covers it
(collective, ranks, bytes, form), its dtype or op is not one msc runs (e.g.
PREMUL_SUM, bitwise ops, complex or bool tensors), its tensors are empty, a
list form's tensors differ in size, or one call names several tensors. Tensors that are not contiguous (strided views) are served through
contiguous copies, the result copied back (gloo, handed one, computes a
wrong result); a written one whose elements share memory (an expanded view)
is refused (gloo writes past its storage). Barrier and send/recv always
pass through (msc has no plans for them).

Served calls made with ``async_op=True`` on CPU tensors (the torch
executor, the emulated device) run on the group's worker thread, in the
order they were made, and return a Work that completes when the call has
run (``wait()`` raises its error); a synchronous served call first waits
for the ones before it. msc's own messages go on a communicator of their
own (a second fallback backend), so a call running behind the caller never
interleaves with pass-through calls, which get the wrapped backend's own
Work. On a GPU the CUDA runtime queues its kernel on the current stream:
stream-ordered, with a complete Work, as before.

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

from msc.dsl.collectives import COLLECTIVES, get_collective
from msc.errors import UsageError
from msc.torch import calls, served, uneven
from msc.torch import settings as msc_settings
from msc.torch.execute import check_op_dtype, op_name
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


def _async(opts) -> bool:
    """Whether the caller passed async_op=True (torch.distributed sets the options' asyncOp)."""
    return bool(getattr(opts, "asyncOp", False)) if opts is not None else False


class _Worker:
    """One group's served calls made with async_op=True on CPU tensors, run
    on a thread of their own in the order they were made (every rank makes
    them in that order; their messages go on msc's own communicator). A
    call's Work completes when it has run, with its error if it failed."""

    def __init__(self, name: str):
        import queue

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job, result) -> dist.Work:
        fut = torch.futures.Future()
        with self._idle:
            self._pending += 1
        self._jobs.put((job, fut, list(result)))
        return _Pending(fut)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut, result = item
            try:
                job()
            except BaseException as exc:          # the caller's wait() raises it
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
                fut.set_exception(exc)
                continue
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            fut.set_result(result)

    def drain(self) -> None:
        """Return once every call submitted so far has run (at once on the worker itself)."""
        if threading.current_thread() is self._thread:
            return
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def stop(self) -> None:
        self.drain()
        self._jobs.put(None)
        self._thread.join(timeout=60)


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
    return _Pending(torch.futures.collect_all([w.get_future() for w in works]), works)


class _Pending(dist.Work):
    """A Work that completes with ``fut`` (a served call running behind the
    caller, or several Works): ``wait()`` raises the call's error, which a
    Work made by torch's ``_create_work_from_future`` would swallow."""

    def __init__(self, fut, works=()):
        super().__init__()
        self._fut, self._works = fut, list(works)

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self):
        return self._fut


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
        self._thread: _Worker | None = None                    # runs async served calls, made at the first
        _same_plans_everywhere(store, rank, size, timeout, self.registry, settings.plans)
        self._backend_for("cpu")                                # gloo connects all ranks now, as init does
        self._backend_for("cpu", own=True)                      # msc's own messages: a communicator of their own

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

    def _backend_for(self, device, own: bool = False):
        """The fallback backend for ``device``; ``own``: the one that carries
        msc's own messages while it serves a call (the executor's, the
        runtime's bootstrap), apart from the pass-through calls, so that a
        served call running behind the caller never interleaves with them."""
        name = self.fallback_name(device)
        key = f"own/{name}" if own else name
        backend = self._backends.get(key)
        if backend is None:
            store = PrefixStore(f"msc-{'own' if own else 'fallback'}/{name}/", self._store)
            backend = self._backends[key] = _make_backend(name, store, self.rank(), self.size(), self._timeout)
        return backend

    def _fallback(self, tensor):
        return self._backend_for(tensor.device if tensor is not None else None, own=self._inside())

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
        name = "alltoall" if name == "alltoallv" else name           # served by alltoall plans
        return any(e.collective == name for e in self.registry)

    def _pass(self, collective: str, tensors, reason: str, fallback, remedy=None):
        """Pass the call through to the fallback, counted with its reason;
        under MSC_STRICT raise instead, in one line, with ``remedy()`` (what
        makes the missing plan) where given."""
        nbytes, dtype = _nbytes(tensors), _dtype(tensors)
        if self.settings.strict and self._has_plans(collective):
            where = self.fallback_name(next((t.device for t in tensors if t is not None), None))
            raise StrictModeError(
                f"MSC_STRICT: {collective} of {format_size(nbytes)} {served.spelled(dtype)} over {self.size()} ranks "
                f"would pass through to {where}: {reason}{f'; to make it: {remedy()}' if remedy else ''}")
        served.passed(collective, _counted_size(collective, nbytes), dtype, reason)
        return fallback()

    def _tune_hint(self, req: _Request):
        """``remedy`` for a call no plan covers: the msc tune command that writes plans for it."""
        def remedy():
            try:
                inplace = calls._Call(get_collective(req.collective), self.size(), 1, self.rank(), req.input,
                                      req.output).inplace
            except UsageError:
                inplace = True
            return self.registry.tune_command(req.collective, self.size(), inplace)
        return remedy

    def _call(self, collective: str, tensors, fallback, request, opts=None):
        """``request()`` gives the _Request msc serves, or the reason it
        cannot; ``opts``: the call's options (``asyncOp``: async_op)."""
        if self._inside():
            return fallback()
        req = request()
        if isinstance(req, str):
            return self._pass(collective, tensors, req, fallback)
        return self._serve(req, tensors, fallback, _async(opts))

    def _serve(self, req: _Request, tensors, fallback, async_op: bool = False):
        name = req.collective
        given = [t for t in (req.input, req.output) if t is not None]
        if any(t.numel() == 0 for t in given):
            return self._pass(name, tensors, "empty tensor", fallback)
        # no plan for the size in either form: pass at once (the common pass-through, kept cheap)
        entry = self._entry(name, max(t.numel() * t.element_size() for t in given), True, req.root)
        if isinstance(entry, str):
            return self._pass(name, tensors, entry, fallback, remedy=self._tune_hint(req))
        req = _through_copies(req)
        try:
            op = op_name(req.op)
            call = calls._Call(get_collective(name), self.size(), 1, self.rank(), req.input, req.output)
            check_op_dtype(op, call.dtype)                 # the op registry's rule of types: else pass through
        except UsageError as exc:
            return self._pass(name, tensors, str(exc), fallback)
        nbytes = call.nbytes()
        entry = self._entry(name, nbytes, call.inplace, req.root)
        if isinstance(entry, str):
            return self._pass(name, tensors, entry, fallback, remedy=self._tune_hint(req))
        plan = entry.plan

        def job():
            engine: list[str] = []
            with self.serving():
                calls._run(lambda: plan, req.input, req.output, op=op, group=self, backend=self.settings.engine,
                           transport=self._transport(call.device), engine_used=engine, what=name)
                if req.after is not None:
                    req.after()
            served.served(name, nbytes, call.dtype, _label(entry), _engine_label(engine[0]))
        return self._run_served(job, req.result, async_op and call.device.type == "cpu")

    # -- served calls in order: inline, or behind the caller on the group's worker thread --------------
    def _run_served(self, job, result, background: bool):
        """Run ``job`` (a served call) and return its Work: with
        ``background`` (async_op on CPU tensors) on the group's worker thread,
        the Work completing when it has run; else here, after the worker's
        earlier calls (a group's served calls run in the order they are made,
        as every rank makes them). On CUDA tensors the CUDA runtime queues its
        kernel on the caller's stream: stream-ordered, done inline."""
        if background:
            return self._worker().submit(job, result)
        self.drain()
        job()
        return _done(result)

    def _worker(self) -> "_Worker":
        if self._thread is None:
            self._thread = _Worker(f"msc-served-{self.group_name or id(self)}")
        return self._thread

    def drain(self) -> None:
        """Wait until the served calls running behind the caller are done
        (nothing to wait for on the worker thread itself)."""
        if self._thread is not None:
            self._thread.drain()

    def _transport(self, device) -> str:
        """The torch executor's transport for tensors on ``device`` (msc.torch.execute.choose_transport)."""
        transport = self.settings.transport
        if transport == "auto":
            transport = "mixed" if self.fallback_name(device) == "gloo" else "p2p"
        return transport

    def _entry(self, name: str, nbytes: int, inplace: bool, root: int | None):
        """The registry's entry for a call, or why none covers it;
        remembered per call shape (a miss builds a long message)."""
        key = (name, nbytes, inplace, root)
        found = self._entries.get(key)
        if found is None:
            try:
                found = self.registry.entry(name, self.size(), nbytes, inplace, root or 0)
            except NoPlanError:
                found = self._missing(name, nbytes)
            if len(self._entries) >= _REMEMBERED:
                self._entries.clear()
            self._entries[key] = found
        return found

    def _missing(self, collective: str, nbytes: int) -> str:
        """Why no plan serves the call, shortest first: no plan of the
        collective, none for this many ranks, or none covering this size
        (a rooted plan serves every root: msc.formats.registry)."""
        mine = [e for e in self.registry if e.collective == collective]
        if not mine:
            return f"no {collective} plans"
        mine = [e for e in mine if e.num_ranks == self.size()]
        if not mine:
            return f"no {collective} plan for {self.size()} ranks"
        return f"no {collective} plan covers {format_size(nbytes)} bytes"

    # -- the collectives: each registry row's c10d methods (msc.dsl.collectives.TorchCall), made below
    #    by _tensor_form and _list_form; here the forms made of those, and the uneven all_to_all_single
    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        single = dist.AllreduceOptions()
        single.reduceOp, single.timeout, single.asyncOp = opts.reduceOp, opts.timeout, _async(opts)
        return _all([self.allreduce([t], single) for t in tensors])

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _all([self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _all([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()

        def fallback():
            return self._fallback(input).alltoall_base(output, input, output_splits, input_splits, opts)
        if (output_splits or input_splits) and not self._inside():
            return self._serve_uneven(output, input, output_splits, input_splits, fallback, _async(opts))
        return self._call("alltoall", [input, output], fallback,
                          lambda: _Request("alltoall", input, output, result=[output]), opts)

    alltoall_base = all_to_all_single

    def _serve_uneven(self, output, input, output_splits, input_splits, fallback, async_op: bool = False):
        """An all_to_all_single given split sizes (msc.torch.uneven): the
        ranks exchange their splits, then every rank takes the same branch:
        served on padded units by the alltoall plan for the padded size, or
        passed through. Counted as "alltoallv". What is refused before the
        exchange is the same on every rank (the plans, the dtype)."""
        name, tensors, n = "alltoallv", [input, output], self.size()
        if not any(e.collective == "alltoall" and e.num_ranks == n for e in self.registry):
            return self._pass(name, tensors, self._missing("alltoall", 0), fallback,
                              remedy=lambda: self.registry.tune_command("alltoall", n, False))
        if input.dtype not in calls._SUPPORTED:
            return self._pass(name, tensors, f"unsupported dtype {input.dtype}", fallback)
        self.drain()                             # the exchange is a call of the group: after the earlier ones
        with self.serving():
            splits = uneven.exchange(self, self.rank(), n, output, input, output_splits, input_splits)
        if splits.pad == 0:                                     # every split of every rank is empty
            served.served(name, None, input.dtype, "nothing to move", "no engine")
            return _done([output])
        entry = self._entry("alltoall", splits.padded_numel() * input.element_size(), False, None)
        if isinstance(entry, str):
            return self._pass(name, tensors, f"{entry} (the splits padded to {splits.pad} rows per pair)", fallback,
                              remedy=lambda: self.registry.tune_command("alltoall", n, False))
        out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)

        def job():
            engine: list[str] = []
            with self.serving():
                uneven.run_padded(splits, lambda send, recv: calls._run(
                    lambda: entry.plan, send, recv, group=self, backend=self.settings.engine,
                    transport=self._transport(input.device), engine_used=engine, what="alltoall with splits"),
                    out, input)
            if out is not output:
                output.copy_(out)
            served.served(name, None, input.dtype, f"{_label(entry)} padded to the largest split",
                          _engine_label(engine[0]))
        return self._run_served(job, [output], async_op and input.device.type == "cpu")

    def _list_request(self, spec, outs, ins, opts):
        """The _Request of a list form (``spec.torch.listed``): the list of n
        equal tensors as one buffer, copied out after where it is the
        output; on a rank without the list (``at_root``) a buffer of msc's own."""
        name, (_, listed) = spec.name, spec.torch.listed
        extra = _options(spec, opts)
        if listed == "both":                                        # all_to_all(outputs, inputs)
            if not ins or not _equal_list(ins, ins[0]) or not _equal_list(outs, ins[0]):
                return "the lists' tensors differ in size, dtype or device"
            whole_in = torch.cat([t.reshape(-1) for t in ins])
            whole_out = torch.empty_like(whole_in)
            return _Request(name, whole_in, whole_out, after=_copy_out(whole_out, outs), result=outs, **extra)
        lists, singles = (outs, ins) if listed == "output" else (ins, outs)
        if len(singles) != 1 or len(lists) > 1:
            return "several tensors in one call"
        one, given = singles[0], (lists[0] if lists else None)
        if given is None and not (spec.torch.at_root and self.rank() != extra.get("root")):
            return f"no {spec.torch.listed[0]} given"
        if given is not None and (not given or not _equal_list(given, one)):
            return f"the {listed} list's tensors differ from the {'input' if listed == 'output' else 'output'} " \
                   f"in size, dtype or device"
        units = dict(zip(("input", "output"), spec.units(self.size())))
        numel = one.numel() // max(units["output" if listed == "input" else "input"], 1) * units[listed]
        if listed == "output":
            whole = torch.empty(numel, dtype=one.dtype, device=one.device)
            after = _copy_out(whole, given) if given is not None else None
            return _Request(name, one, whole, after=after, result=given or [], **extra)
        whole = torch.cat([t.reshape(-1) for t in given]) if given is not None else \
            torch.zeros(numel, dtype=one.dtype, device=one.device)
        return _Request(name, whole, one, result=[one], **extra)

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
        if self._thread is not None:
            self._thread.stop()
        for backend in self._backends.values():
            stop = getattr(backend, "shutdown", None)
            if stop is not None:
                stop()


def _options(spec, opts) -> dict:
    """The _Request arguments a call's options give: its op, its root."""
    extra = {"op": opts.reduceOp} if spec.reduces else {}
    if spec.has_root:
        extra["root"] = opts.rootRank
    return extra


def _tensor_form(spec):
    """The c10d method of ``spec``'s tensor form (``TorchCall.method``):
    ``method(tensors, opts)`` of one tensor in place, else
    ``method(output, input, opts)`` (its arguments' order)."""
    tc, name = spec.torch, spec.name
    options = getattr(torch._C._distributed_c10d, tc.options)     # (torch.distributed lacks AllgatherOptions)
    if len(tc.args) == 1:
        def one(self, tensors, opts=None):
            opts = opts if opts is not None else options()
            return self._call(name, tensors, lambda: getattr(self._fallback(tensors[0]), tc.method)(tensors, opts),
                              lambda: "several tensors in one call" if len(tensors) != 1 else
                              _Request(name, tensors[0], None, result=tensors, **_options(spec, opts)), opts)
        return one
    order = [buffer for _, buffer in tc.args]

    def pair(self, first, second, opts=None):
        opts = opts if opts is not None else options()
        t = dict(zip(order, (first, second)))
        return self._call(name, [t["input"], t["output"]],
                          lambda: getattr(self._fallback(t["input"]), tc.method)(first, second, opts),
                          lambda: _Request(name, t["input"], t["output"], result=[t["output"]],
                                           **_options(spec, opts)), opts)
    return pair


def _list_form(spec):
    """The c10d method of ``spec``'s list form (``TorchCall.list_method``):
    ``method(outputs, inputs, opts)``, the listed side a list of lists (or,
    for "both", each side a list of n tensors)."""
    tc, name = spec.torch, spec.name
    options = getattr(torch._C._distributed_c10d, tc.options)     # (torch.distributed lacks AllgatherOptions)

    def listed(self, outs, ins, opts=None):
        opts = opts if opts is not None else options()
        flat = lambda side: [t for ts in side for t in ts]          # noqa: E731
        tensors = [*(ins if tc.listed[1] in ("output", "both") else flat(ins)),
                   *(outs if tc.listed[1] in ("input", "both") else flat(outs))]
        return self._call(name, tensors, lambda: getattr(self._fallback(tensors[0]), tc.list_method)(outs, ins, opts),
                          lambda: self._list_request(spec, outs, ins, opts), opts)
    return listed


for _spec in COLLECTIVES.values():
    if _spec.torch is not None and _spec.torch.method is not None and not _spec.torch.splits:
        setattr(MscProcessGroup, _spec.torch.method, _tensor_form(_spec))
    if _spec.torch is not None and _spec.torch.list_method is not None:
        setattr(MscProcessGroup, _spec.torch.list_method, _list_form(_spec))


def _counted_size(collective: str, nbytes):
    """The size a call is counted under in the report: none for alltoallv,
    whose calls' sizes all differ (MoE: one per batch)."""
    return None if collective == "alltoallv" else nbytes


def _label(entry) -> str:
    """The plan as the report names it: its file, else its name (and the
    root it was turned to, for another root's plan)."""
    base = getattr(entry, "base", None)
    if base is not None:
        return f"{_label(base)} (root {base.root} relabelled to {entry.root})"
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
