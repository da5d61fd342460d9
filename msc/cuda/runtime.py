"""The GPU runtime: ``Communicator`` launches a plan's kernel on the ranks' tensors.

    comm = msc.cuda.Communicator(plan, placement="virtual")     # all ranks on one GPU
    outs = comm.run(inputs, op="sum")                           # a tensor per rank
    comm.all_reduce(tensors); comm.synchronize()

Devices (``device=``, default ``$MSC_DEVICE``, else "cuda"): "cuda" runs on
GPUs with torch CUDA tensors; "emu" runs the same kernel on the emulated
device (msc.cuda.emu: the rendered source built as host C++, host memory,
threads), with numpy arrays or CPU torch tensors, on any machine. Only the
device underneath differs (msc.cuda.backend): everything below is the same
code for both.

Placements (the kernel is the same; only pointer tables and launches differ):

- ``"virtual"``: every rank in this process on ONE GPU (``devices``: that
  GPU, default the current one); all ranks' blocks in ONE cooperative
  launch, so every block is resident and spin-waits between ranks cannot
  deadlock. How the runtime is tested and benchmarked on one GPU.
- ``"devices"``: rank r on GPU ``devices[r]`` (default 0..n-1), one process;
  peer access enabled; one cooperative launch per GPU of that rank's blocks
  (``first_block`` = its first global block), on each GPU's current stream.
- ``"torchrun"``: one process per rank over torch.distributed (``group``,
  rank r = group rank r), on the current device; each process allocates its
  arena and exchanges IPC handles (msc.cuda.bootstrap); it launches its
  own rank's blocks. Every rank must make the same calls.

Kernels are compiled in the constructor, before any rendezvous, for the
``dtypes`` and ``ops`` asked for (default float32, sum; msc.cuda.compiler
caches them on disk), and the grid is checked against what the GPU holds at
once (the occupancy API times the SM count): a launch that cannot be
resident fails here, not at the first call. Another (dtype, op) compiles at
its first call; under torchrun every rank then meets at a barrier before
launching, so that compile skew between ranks is not spent in spin-waits.
Data-movement collectives use one kernel for every op. A table-form plan
(msc.cuda.codegen) shares its kernel with every plan of its protocol; the
constructor copies the plan's tables to each GPU it launches on (once per
kind of op: averaging or not) in stream order, every launch on any stream
waits on the copy's event until the event has completed, and close() frees
them.

Memory. A rank's counters, slots and scratch live in its *arena*
(msc.cuda.tables): one allocation per rank, zeroed once, sized by
launch.footprint for the largest call so far. Calls reuse it with no reset
(the kernel's counters persist across launches and CUDA-graph replays). A
call larger than any before *grows* it: the devices are synchronized, the
old arenas freed and fresh zeroed ones allocated (counters restart from
zero with them; they must never be carried into new slots), and under
torchrun the handles are exchanged again; growing is refused during CUDA
graph capture (warm up with the largest size first) and invalidates graphs
captured before. Slots: max(plan.slots, 8) per connection: more capacity
than the plan was verified with never deadlocks and lets more messages
pipeline; the kernel is compiled for that count.

Launches run on the current stream (torch's, on a GPU), so they order with
the caller's work and can be captured in a CUDA graph. The packed MscArgs
block is uploaded with a stream-ordered copy and cached by content, so a
repeated call with the same tensors uploads nothing (a graph captured after
a warm-up call holds only the kernel). On the emulated device a call also
returns before its kernel has run: read results after ``synchronize()``.

Errors. Bad calls raise UsageError before anything launches
(msc.cuda.validate). A spin-wait that exceeds ``timeout_s`` (default 300 s:
long enough for first-iteration skew between ranks) ends the kernel with an
error word; reading it needs the launch to have finished, and this runtime
adds no synchronization per call: after each launch a stream-ordered copy of
the error word to host memory and an event are queued, and the next call
inspects the words of launches whose events have completed;
``synchronize()`` waits and always checks (also for launches captured in
graphs, by reading the device words). A set error word raises
DeviceTimeoutError (rank, threadblock, step, iteration, and which waits were
unmet, from the device counters) and the communicator becomes *broken*:
every later call raises BrokenCommunicatorError. Its device memory is still
freed by ``close()``; to go on, build a new Communicator (under torchrun, on
every rank: the peers' kernels have timed out too, or will). Under devices
and torchrun placements each launch has its own error word; the other GPUs'
blocks waiting on a failed rank end by their own timeouts. A launch the
driver refuses is classified (msc.cuda.backend.launch_failure): a grid the
GPU cannot hold at once is a UsageError, anything else a LaunchError with
the driver's words; either breaks the communicator once a launch of the
call has started (its blocks would wait for the refused ones). Two torchrun
ranks on one GPU are refused at the first call's bootstrap unless MPS is
running (msc.cuda.device.mps_active): their kernels would only take turns.

Switch plans (NVLS): the switch reaches only a group's memory (msc.cuda.groups), so a call
copies each member's input and output there before its launch and the output back after, in
stream order. The emulated device keeps it in the arenas (every placement); a GPU binds a
buffer per member to a multicast object (msc.cuda.multicast), under the torchrun placement
only, after a capability check in the constructor (CapabilityError, no fallback).

What runs without a GPU: everything, on the emulated device
(tests/test_cuda_emu.py), and the CUDA backend's calls with the driver faked
(tests/test_cuda_runtime.py). What only a GPU shows (tests/test_cuda_gpu.py):
the driver calls themselves, speed, occupancy, and the memory model's scopes.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from msc.cuda import device as cu
from msc.cuda.backend import choose
from msc.cuda.codegen import KernelLayout, average_table, choose_form, kernel_layout
from msc.cuda.compiler import tables as plan_tables
from msc.cuda.diagnose import BrokenCommunicatorError, counters_from_arena, decode, merge, parse_words
from msc.cuda.groups import (MemberMemory, check_units, group_bytes, group_layout, span_of, staged_offsets,
                             switch_table, switch_table_bytes)
from msc.cuda.launch import ERROR_WORDS, args_header_size, footprint, launch_params, pack_args
from msc.cuda.tables import UserBuffers, arena_layout, error_pointer, grow, peers, pointer_tables
from msc.cuda.validate import check_call, check_collective, check_op, units
from msc.errors import UsageError
from msc.ir import Plan
from msc.ir.ops import REDUCE_OPS
from msc.lower.runtimes import runtime_slots

PLACEMENTS = ("virtual", "devices", "torchrun")
ARGS_CACHE = 256          # uploaded MscArgs blocks kept per communicator
DEFAULT_TIMEOUT_S = 300.0
_SERIALS: dict[tuple, itertools.count] = {}    # torchrun communicators made here, per group


def content_key(plan: Plan) -> str:
    """16 hex digits naming a plan's content, not its name: msc.torch.agree's
    digest, so ranks whose calls agree meet under one key."""
    from msc.formats.plan_text import plan_digest

    return plan_digest(plan)


def runtime_plan(plan: Plan) -> Plan:
    """The plan as the runtime compiles it: max(plan.slots, MSC_MIN_SLOTS) slots (msc.lower.runtimes)."""
    return dataclasses.replace(plan, slots=runtime_slots(plan, "msc"))


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: the blocks of ``ranks`` (global blocks
    first_block .. first_block + grid - 1) on GPU ``device``, reporting to
    ``error_rank``'s error word."""

    ranks: tuple[int, ...]
    device: int
    first_block: int
    grid: int
    error_rank: int


def _elem_size(dtype: str) -> int:
    from msc.cuda.codegen import DTYPES

    return DTYPES[dtype].size


def launches(layout: KernelLayout, placement: str, devices: tuple[int, ...], rank: int | None = None) -> tuple[Launch, ...]:
    """The launches of one call. ``devices``: one GPU (virtual), a GPU per
    rank (devices), this process's GPU (torchrun, with ``rank``)."""
    n = layout.num_ranks
    if placement == "virtual":
        return (Launch(tuple(range(n)), devices[0], 0, len(layout.blocks), 0),)
    if placement == "devices":
        return tuple(Launch((r,), devices[r], layout.rank_blocks[r][0], layout.rank_blocks[r][1], r) for r in range(n))
    if placement == "torchrun":
        first, count = layout.rank_blocks[rank]
        return (Launch((rank,), devices[0], first, count, rank),)
    raise UsageError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def _device_index(d) -> int:
    if isinstance(d, int) and d >= 0:
        return d
    text = str(d)
    for prefix in ("cuda:", "emu:"):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return int(text[len(prefix):])
    raise UsageError(f"a device is a GPU index or 'cuda:N', got {d!r}")


def resolve_devices(placement: str, devices, n: int, current: int) -> tuple[int, ...]:
    """GPU indices for a placement (pure; see Communicator)."""
    if placement not in PLACEMENTS:
        raise UsageError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement in ("virtual", "torchrun"):
        if devices is None:
            return (current,)
        if isinstance(devices, (list, tuple)):
            if len(devices) != 1:
                raise UsageError(f"placement {placement!r} runs on one GPU; got devices={devices!r}")
            devices = devices[0]
        return (_device_index(devices),)
    out = tuple(range(n)) if devices is None else tuple(_device_index(d) for d in devices)
    if len(out) != n:
        raise UsageError(f"placement 'devices' needs a GPU per rank: {n} ranks, devices={list(out)}")
    if len(set(out)) != n:
        raise UsageError(f"placement 'devices' needs a distinct GPU per rank (ranks sharing a GPU in separate "
                         f"launches can deadlock); got {list(out)}; use placement='virtual' for one GPU")
    return out


def check_resident(grid: int, threads: int, resident: int | None, where: str) -> None:
    """A cooperative launch of ``grid`` blocks needs them all on the GPU at once."""
    if resident is not None and grid > resident:
        raise UsageError(f"{where} holds at most {resident} blocks of {threads} threads of this kernel at once, and "
                         f"a launch of this plan needs {grid} (a cooperative launch needs every block resident): use "
                         f"fewer instances or threadblocks, the devices or torchrun placement, or a larger GPU")


class Kernels:
    """A plan's kernels on one arch, by (dtype, op): compiled (cached on disk
    by msc.cuda.compiler) and loaded once."""

    def __init__(self, backend, plan: Plan, arch: str, *, form: str | None = None, cache: Path | None = None,
                 collective=None, allow_deadlock: bool = False, switch: bool = False):
        self.backend, self.plan, self.arch, self.form, self.cache = backend, plan, arch, form, cache
        self.collective, self.allow_deadlock = collective, allow_deadlock
        self._compiled: dict[tuple[str, str], object] = {}
        self._loaded: dict[tuple[str, str], object] = {}
        self.args_size = args_header_size(switch)

    def compiled(self, dtype: str, op: str):
        key = (dtype, op)
        if key not in self._compiled:
            kw = dict(dtype=dtype, op=op, form=self.form, collective=self.collective, cache=self.cache,
                      allow_deadlock=self.allow_deadlock)
            if self.arch != "host":
                kw["arch"] = self.arch
            self._compiled[key] = self.backend.compile(self.plan, **kw)
        return self._compiled[key]

    def has(self, dtype: str, op: str) -> bool:
        return (dtype, op) in self._loaded

    def loaded(self, dtype: str, op: str):
        key = (dtype, op)
        if key not in self._loaded:
            self._loaded[key] = self.backend.load(self.compiled(dtype, op), self.args_size)
        return self._loaded[key]


class Communicator:
    """A plan bound to devices (see the module doc). ``device``: "cuda" or
    "emu" (default $MSC_DEVICE, else "cuda"). ``timeout_s``: how long a
    spin-wait may last before the kernel gives up and reports. ``dtypes``,
    ``ops``: kernels to compile now. ``ipc``: the torchrun placement's IPC
    (default the device's). ``max_bytes``: refuse calls whose arenas (this
    process's) would exceed it. ``allow_deadlock``: compile a plan that
    deadlocks (loaded with verify=False), to see the timeout path; never for
    real work."""

    def __init__(self, plan: Plan | str | Path, placement: str = "virtual", devices=None, *,
                 device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, group=None,
                 form: str | None = None, cache: Path | None = None, collective=None, max_bytes: int | None = None,
                 ipc=None, allow_deadlock: bool = False, dtypes=("float32",), ops=("sum",),
                 _omit_ranks: tuple[int, ...] = (), _system_scope: bool = False):
        backend = choose(device)
        backend.require()
        if isinstance(plan, (str, Path)):
            from msc.formats.load import load_plan

            plan = load_plan(plan, collective=collective)
        units(plan)
        self.backend = backend
        self._timeout_ns = cu.timeout_ns(timeout_s)
        self.plan, self.placement, self.timeout_s, self.group = plan, placement, float(timeout_s), group
        self.collective = collective
        self.kplan = runtime_plan(plan)
        self.slots = self.kplan.slots
        self.layout = kernel_layout(self.kplan, choose_form(self.kplan, form))
        n = plan.num_ranks
        self.rank = None
        if placement == "torchrun":
            self._join_group(group)
        self.devices = resolve_devices(placement, devices, n, backend.current())
        self._check_devices()
        if self.layout.switch:          # NVLS: CapabilityError (a GPU) or UsageError (placement), no fallback
            backend.check_switch(placement, self.devices)
        self.ranks_here = tuple(range(n)) if placement != "torchrun" else (self.rank,)
        self.device_of = {r: self.devices[0] if placement != "devices" else self.devices[r] for r in self.ranks_here}
        self._launches = launches(self.layout, placement, self.devices, self.rank)
        # testing only: connection counters and packets at .sys scope even where every peer is on this GPU
        # (the scope separate GPUs need), so one GPU can check the kernels' .sys paths too
        self._local_scope = placement == "virtual" and not _system_scope
        if _omit_ranks:          # testing only: a rank that never launches makes its peers time out
            self._launches = tuple(dataclasses.replace(L, grid=self.layout.rank_blocks[min(_omit_ranks)][0])
                                   for L in self._launches)
        self._threads = backend.block_threads(self.layout.nthreads)
        self._arch = {d: backend.arch(d) for d in self.devices}
        self._kernels = {a: Kernels(backend, self.kplan, a, form=form, cache=cache, collective=collective,
                                    allow_deadlock=allow_deadlock, switch=self.layout.switch)
                         for a in set(self._arch.values())}
        self._table_source = dict(collective=collective, cache=cache, allow_deadlock=allow_deadlock)
        # (device, averages) -> [pointers, what holds them, the copy's event until it is seen complete]
        self._tables: dict[tuple[int, bool], list] = {}
        self.max_bytes = max_bytes
        self._ipc = ipc
        self._capacity = None
        self._arenas = None
        self._bases: list[int | None] = [None] * n
        self._owned: dict[int, int] = {}        # rank -> our allocation
        self._opened: dict[int, int] = {}       # rank -> a peer's arena opened by IPC
        self._groups = None                     # switch plans: the group memory's layout (msc.cuda.groups)
        self._group_held: list = []             # a GPU's: this rank's multicast-bound buffer per group it is in
        self._switch_tables: dict[int, int] = {}    # device -> its MscSwitch table
        self._average_tables: dict[int, int] = {}   # device -> a switch plan's division table (avg)
        self._divisions: bytes | None = None
        self._generation = 0
        self._args: OrderedDict = OrderedDict()
        self._mirrors: dict[int, tuple] = {}    # launch index -> (error word copy, event)
        self._last: dict[int, tuple] = {}       # device -> (stream, event) of our last launch there
        self._broken: Exception | None = None
        if placement == "devices":
            self._enable_peer_access()
        self._compile_now(dtypes, ops)

    def _join_group(self, group) -> None:
        """torchrun placement: this process's rank in ``group``, and the keys
        under which its members meet in the job-wide store."""
        import torch.distributed as dist

        plan, n = self.plan, self.plan.num_ranks
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("placement 'torchrun' needs torch.distributed initialized (init_process_group)")
        if dist.get_world_size(group) != n:
            raise UsageError(f"plan {plan.name!r} is for {n} ranks, the process group has "
                             f"{dist.get_world_size(group)}")
        self.rank = dist.get_rank(group)
        # Bootstrap keys in the job-wide store: the group's global ranks, how many
        # communicators this process has made on that group (every member makes them in the
        # same order), and the plan's content (not its name: ranks may read one plan from
        # files of other names, and msc.torch's agreement compares content). So disjoint
        # groups never read each other's keys, and ranks that built communicators for
        # different plans (a mistake they then report) stay in step for the next ones.
        members = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(n))
        self._group_key = "-".join(map(str, members))
        self._plan_key = content_key(plan)
        self._serial = next(_SERIALS.setdefault(members, itertools.count()))

    def _check_devices(self) -> None:
        """Every GPU of ``self.devices`` exists and can be bound (the current one stays current)."""
        backend = self.backend
        count = backend.count()
        for d in self.devices:
            if d >= count:
                raise UsageError(f"{backend.describe_device(d)} does not exist ({count} visible)")
        here = backend.current()
        for d in self.devices:
            backend.bind(d)
        backend.bind(here)

    def _enable_peer_access(self) -> None:
        """devices placement: every GPU reads and writes every other's memory."""
        for a in self.devices:
            for b in self.devices:
                if a != b:
                    if not self.backend.can_access_peer(a, b):
                        raise UsageError(f"GPU {a} cannot access GPU {b} (no peer-to-peer path); placement "
                                         f"'devices' needs every pair")
                    self.backend.enable_peer_access(a, b)

    def _compile_now(self, dtypes, ops) -> None:
        """Compile (and check) the kernels and tables of ``dtypes`` x ``ops``
        now, before any rendezvous."""
        for dtype in dtypes:
            for op in ops:
                op = check_op(self.plan, op, dtype)
                self._kernel(self.devices[0], dtype, op)
                for L in self._launches:
                    self._plan_tables(L.device, op)

    # -- kernels ----------------------------------------------------------------------------
    def _kernel(self, dev: int, dtype: str, op: str):
        """The loaded kernel for ``dev``; checks, the first time, that the GPU holds its launches at once."""
        kernels = self._kernels[self._arch[dev]]
        if kernels.has(dtype, op):
            return kernels.loaded(dtype, op)
        kernel = kernels.loaded(dtype, op)
        for L in self._launches:
            if self._arch[L.device] == self._arch[dev]:
                check_resident(L.grid, self._threads, self.backend.resident_blocks(kernel, self._threads, L.device),
                               f"{self.backend.describe_device(L.device)} ({dtype}, {op} kernel)")
        return kernel

    def _plan_tables(self, dev: int, op: str) -> tuple[int, int]:
        """Device pointers to the plan's threadblock and step tables on ``dev``
        for calls with ``op`` (the table form; (0, 0) for straight-line code):
        copied there once, in stream order, and kept until close()."""
        if self.layout.form != "table":
            return (0, 0)
        key = (dev, REDUCE_OPS[op].average)
        if key not in self._tables:
            if self.backend.capturing():
                raise UsageError(f"the plan's tables for {op!r} are not on the device yet, and cannot be copied there "
                                 f"during CUDA graph capture: make a call with this op before capturing")
            tables = plan_tables(self.kplan, op=op, **self._table_source)
            with self.backend.context(dev):
                ptr, held = self.backend.upload(dev, tables.device_image(), False)
                done = self.backend.uploaded(dev)
            self._tables[key] = [(ptr, ptr + tables.steps_offset), held, done]
        return self._tables[key][0]

    def _after_tables(self, dev: int, op: str, stream) -> None:
        """Order a launch on ``stream`` after the copy of its tables, made on the stream that
        was current when they were uploaded (the constructor's, or a first call's): the stream
        waits on the copy's event until the event is seen complete. Under CUDA graph capture
        no wait is recorded (torch.cuda.graph synchronizes the device before it captures)."""
        entry = self._tables.get((dev, REDUCE_OPS[op].average)) if self.layout.form == "table" else None
        if entry is None or entry[2] is None or self.backend.capturing():
            return
        if entry[2].query():
            entry[2] = None
        else:
            self.backend.wait(stream, entry[2])

    # -- the collective calls -------------------------------------------------------------
    def run(self, inputs, outputs=None, op: str = "sum"):
        """Run the plan: ``inputs``/``outputs`` a tensor per rank (virtual,
        devices) or this rank's tensor (torchrun); see msc.cuda.validate for
        the in-place forms. Out-of-place outputs left out are allocated.
        Returns the outputs (per rank, or this rank's)."""
        self._usable()
        backend = self.backend
        single = self.placement == "torchrun"
        ins, outs = self._as_list(inputs, single), self._as_list(outputs, single)
        if outs is None and not self.plan.inplace and ins is not None:
            in_units, out_units = units(self.plan)
            outs = [backend.empty(t, backend.describe(t).numel // in_units * out_units
                                  if backend.describe(t).numel % in_units == 0 else 0) for t in ins]
        spec = check_call(self.plan, None if ins is None else [backend.describe(t) for t in ins],
                          None if outs is None else [backend.describe(t) for t in outs], op=op, ranks=self.ranks_here,
                          devices=tuple(backend.tensor_device(self.device_of[r]) for r in self.ranks_here))
        if not backend.capturing():     # no event queries inside a capture
            self.poll()
        result = self._logical_outputs(ins, outs, spec.count)
        if spec.count > 0:
            self._launch_all(spec, keep=(ins, outs))
        return result[0] if single else result

    def all_reduce(self, tensors, op: str = "sum", outputs=None):
        check_collective(self.plan, "allreduce")
        return self.run(tensors, outputs, op)

    def all_gather(self, outputs, inputs=None):
        check_collective(self.plan, "allgather")
        return self.run(inputs, outputs)

    def reduce_scatter(self, outputs, inputs, op: str = "sum"):
        check_collective(self.plan, "reducescatter")
        return self.run(inputs, outputs, op)

    def all_to_all(self, outputs, inputs):
        check_collective(self.plan, "alltoall")
        return self.run(inputs, outputs)

    def broadcast(self, tensors, root: int | None = None, outputs=None):
        check_collective(self.plan, "broadcast")
        self._check_root(root)
        return self.run(tensors, outputs)

    def reduce(self, tensors, root: int | None = None, op: str = "sum", outputs=None):
        check_collective(self.plan, "reduce")
        self._check_root(root)
        return self.run(tensors, outputs, op)

    def _check_root(self, root):
        if root is not None and root != self.plan.root:
            raise UsageError(f"plan {self.plan.name!r} has root {self.plan.root}, the call asks root {root}")

    # -- errors -----------------------------------------------------------------------------
    @property
    def broken(self) -> bool:
        return self._broken is not None

    def _usable(self) -> None:
        if self._broken is not None:
            raise BrokenCommunicatorError(f"this communicator is unusable after a failed launch: {self._broken}") \
                from self._broken

    def poll(self) -> None:
        """Check the error words of launches that have finished (no waiting)."""
        for i, (mirror, event) in list(self._mirrors.items()):
            if event.query():
                self._check(self._launches[i], self.backend.snapshot_bytes(mirror))

    def synchronize(self) -> None:
        """Wait for every launch of this communicator and check its error
        word (raises DeviceTimeoutError, then the communicator is broken)."""
        self._usable()
        if self._arenas is None:
            return
        for L in self._launches:
            self.backend.synchronize(L.device)
        for L in self._launches:
            raw = self.backend.read(L.device, error_pointer(self._arenas, self._bases, L.error_rank), 4 * ERROR_WORDS)
            self._check(L, raw)

    def _check(self, launch: Launch, raw: bytes) -> None:
        words = parse_words(raw)
        if words[0] == 0:
            return
        err = decode(words, self.plan, self.layout, counters=self._counters(), slots=self.slots,
                     timeout_s=self.timeout_s)
        self._broken = err
        raise err

    def _counters(self):
        """Device counters of every arena visible here (None if unreadable)."""
        try:
            for d in self.devices:
                self.backend.synchronize(d)
            parts = []
            for r, base in enumerate(self._bases):
                if base is None:
                    continue
                raw = self.backend.read(self.device_of.get(r, self.devices[0]), base, self._arenas[r].counters_end)
                parts.append(counters_from_arena(raw, self._arenas[r], self.layout))
            return merge(parts)
        except Exception:           # a diagnosis must not hide the error it explains
            return None

    # -- launching ------------------------------------------------------------------------
    def _as_list(self, xs, single: bool):
        if xs is None:
            return None
        if single:
            if isinstance(xs, (list, tuple)):
                if len(xs) != 1:
                    raise UsageError(f"placement 'torchrun' takes this rank's tensor, got {len(xs)}")
                return list(xs)
            return [xs]
        if not isinstance(xs, (list, tuple)):
            raise UsageError(f"placement {self.placement!r} takes a list with a tensor per rank "
                             f"({self.plan.num_ranks}), got {type(xs).__name__}")
        return list(xs)

    def _logical_outputs(self, ins, outs, count: int) -> list:
        if not self.plan.inplace:
            return outs
        from msc.verification.plan import plan_collective

        n, k = self.plan.num_ranks, self.plan.chunk_factor
        coll = plan_collective(self.plan, self.collective)
        alias, target, _ = coll.inplace_alias(0, n, k)
        if target == "output":
            return outs
        _, out_units = units(self.plan)
        views = []
        for i, r in enumerate(self.ranks_here):
            off = coll.inplace_alias(r, n, k)[2] // k
            t = ins[i]
            views.append(t if self.backend.describe(t).numel == out_units * count and off == 0
                         else t.reshape(-1)[off * count:(off + out_units) * count])
        return views

    def _launch_all(self, spec, keep=()) -> None:
        backend = self.backend
        params = launch_params(self.layout, spec.count, dtype=spec.dtype, protocol=self.kplan.protocol,
                               tile_bytes=self.kplan.tile)
        fresh = [L for L in self._launches if not self._kernels[self._arch[L.device]].has(spec.dtype, spec.op)]
        kernels = {L.device: self._kernel(L.device, spec.dtype, spec.op) for L in self._launches}
        if fresh and self.placement == "torchrun" and not backend.capturing():
            self._rendezvous(f"kernel {spec.dtype} {spec.op}")     # compiled at first use: start together
        spans = self._switch_spans(spec, params) if self.layout.switch else None
        self._reserve(footprint(self.layout, params, dtype=spec.dtype, protocol=self.kplan.protocol,
                                slots=self.slots, group=group_bytes(self.layout, max(s.size for s in spans))
                                if spans else 0))
        buffers = [None] * self.plan.num_ranks
        for i, r in enumerate(self.ranks_here):
            buffers[r] = spec.buffers[i] if spans is None else self._staged(r, spans[i])
        ranks, conns = pointer_tables(self.layout, self._arenas, self._bases, buffers, self.ranks_here)
        for i, L in enumerate(self._launches):
            switches = (0, 0, 0)
            if spans is not None:       # every group's buffers at one offset, every rank's span alike
                size, at = _elem_size(spec.dtype), self._groups.buffers
                switches = (self._switch_tables[L.device], (at + spans[0].input) // size,
                            (at + spans[0].output) // size)
            packing = dict(ranks=ranks, connections=conns, slot_room=self._capacity.room,
                           error=error_pointer(self._arenas, self._bases, L.error_rank), first_block=L.first_block,
                           timeout_ns=self._timeout_ns, tables=self._plan_tables(L.device, spec.op),
                           local=self._local_scope, switches=switches)
            args = pack_args(self.layout, params, **packing)
            with backend.context(L.device):
                stream = backend.stream(L.device)
                capturing = backend.capturing()
                last = self._last.get(L.device)
                if last is not None and last[0] != stream and not capturing:
                    backend.wait(stream, last[1])          # launches of one communicator never overlap
                self._after_tables(L.device, spec.op, stream)
                ptr, held = self._upload(L.device, args, capturing)
                if spans is not None:
                    self._stage(L, spec, spans, stream, keep, into_group=True)
                self._launch(i, L, stream, kernels[L.device], ptr, keep=(held, keep))
                if spans is not None and REDUCE_OPS[spec.op].average:      # the switch summed: divide now
                    divide = pack_args(self.layout, params, **packing, divide=self._average_tables[L.device])
                    ptr, held = self._upload(L.device, divide, capturing)
                    self._launch(i + 1, L, stream, kernels[L.device], ptr, keep=(held, keep))   # i + 1: after a start
                if spans is not None:
                    self._stage(L, spec, spans, stream, keep, into_group=False)
                if not capturing:
                    self._track(i, L, stream)

    # -- switch plans (NVLS): group memory, staged buffers ----------------------------------
    def _switch_spans(self, spec, params) -> list:
        """Per rank here, the span of its buffers (msc.cuda.groups.Span); the same layout on every
        rank (the switch finds a chunk at one offset on every member), whole multimem units."""
        check_units(self.layout, spec.dtype, spec.count, params.chunk)
        size = _elem_size(spec.dtype)
        in_units, out_units = units(self.plan)
        spans = [span_of(b.input, in_units * spec.count * size, b.output, out_units * spec.count * size,
                         self.plan.inplace) for b in spec.buffers]
        if any(s != spans[0] for s in spans):
            raise UsageError(f"plan {self.plan.name!r} reduces in the NVLink switch, which finds a chunk at one "
                             f"offset on every member: its ranks' in-place buffers must be laid out alike "
                             f"({', '.join(f'rank {r}: input at byte {s.input} of the output' for r, s in zip(self.ranks_here, spans))})")
        return spans

    def _staged(self, rank: int, span):
        """The addresses the kernel uses for ``rank``'s buffers: its copies in its group memory
        (msc.cuda.groups), or none of that for a rank outside every group."""
        if not self.layout.groups_of(rank):
            return None
        base = self._group_memory(rank).local
        at = staged_offsets(span, self._groups)
        return UserBuffers(base + at[0], base + at[1])

    def _stage(self, L: Launch, spec, spans, stream, keep, *, into_group: bool) -> None:
        """Copy the callers' buffers of ``L``'s ranks into their group memory before the launch
        (input and output: a chunk the plan leaves alone comes back as it was), or the output
        back after it, in stream order."""
        size = _elem_size(spec.dtype)
        in_units, out_units = units(self.plan)
        for r in L.ranks:
            if not self.layout.groups_of(r):
                continue
            i = self.ranks_here.index(r)
            user, span = spec.buffers[i], spans[i]
            mem = self._group_memory(r).local + self._groups.buffers
            lo = min(user.input, user.output) if self.plan.inplace else None
            pieces = [(lo, mem, span.size)] if lo is not None else [
                (user.output, mem + span.output, out_units * spec.count * size)]
            if lo is None and into_group:
                pieces.append((user.input, mem + span.input, in_units * spec.count * size))
            for addr, staged, nbytes in pieces:
                src, dst = (addr, staged) if into_group else (staged, addr)
                self.backend.copy(L.device, dst, src, nbytes, stream, keep=keep)

    def _group_memory(self, rank: int) -> MemberMemory:
        return self._member_memory()[rank]

    def _member_memory(self) -> list:
        """Per rank, its group memory as this process sees it (None: not mapped or no group)."""
        if self._group_held:                     # a GPU: this rank's multicast-bound buffers, one memory
            mcs = dict(zip(self.layout.groups_of(self.rank), (buf.mc for buf in self._group_held)))
            mine = MemberMemory(self._group_held[0].local, tuple(mcs.get(g, 0) for g in range(len(self.layout.groups))))
            return [mine if r == self.rank else None for r in range(self.plan.num_ranks)]
        return [MemberMemory(base + a.group) if base is not None and a.group >= 0 else None
                for base, a in zip(self._bases, self._arenas)]

    def _setup_groups(self, capacity) -> None:
        """After (re)allocating: the group memory (a GPU: a multicast object per group, this
        member's one allocation bound to each of its groups', its counters zeroed by all before
        any uses them) and each launch device's MscSwitch table."""
        backend, layout = self.backend, self.layout
        self._groups = group_layout(layout, capacity.group)
        if not backend.group_in_arena:
            mine = layout.groups_of(self.rank)
            for g in mine:            # every member opens its groups in the plan's group order: no cycle waits
                members = layout.groups[g]
                self._group_held.append(backend.open_group(
                    self.devices[0], members.index(self.rank), len(members), capacity.group,
                    prefix=f"{self._prefix()}/group{g}/{self._generation}", timeout_s=self.timeout_s,
                    memory=self._group_held[0] if self._group_held else None))
            if mine:
                with backend.context(self.devices[0]):
                    backend.zero(self.devices[0], self._group_held[0].local, self._groups.buffers,
                                 backend.stream(self.devices[0]))
                backend.synchronize(self.devices[0])
            self._rendezvous("group memory zeroed")      # no member adds to a counter another still zeroes
        memory = self._member_memory()
        for d in {L.device for L in self._launches}:
            ptr = backend.alloc(d, switch_table_bytes(layout))
            self._switch_tables[d] = ptr
            backend.write(d, ptr, switch_table(layout, memory, self._groups, ptr))
            divisions = self._division_table()
            self._average_tables[d] = backend.alloc(d, len(divisions))
            backend.write(d, self._average_tables[d], divisions)

    def _division_table(self) -> bytes:
        """The switch plan's division table (msc.cuda.codegen.average_table) as the device reads it."""
        if self._divisions is None:
            from array import array

            ints = array("i", average_table(self.kplan, self._table_source["collective"]))
            if sys.byteorder != "little":
                ints.byteswap()
            self._divisions = ints.tobytes()
        return self._divisions

    def _launch(self, i: int, L: Launch, stream, kernel, ptr: int, keep) -> None:
        """Launch ``L``, the i-th launch of a call. A launch that fails breaks the communicator
        (launches before it spin on its blocks until they time out), unless it is the first of
        the call and refused for its size: then nothing ran, and the call may be retried."""
        try:
            self.backend.launch(L.device, stream, L.grid, self._threads, kernel, ptr, keep=keep)
        except UsageError:
            if i > 0:
                self._broken = UsageError(f"launch {i} of a call failed after {i} launch(es) had started")
            raise
        except Exception as exc:
            self._broken = exc
            raise

    def _rendezvous(self, tag: str) -> None:
        from msc.cuda.bootstrap import store_gather

        gather = store_gather(self._prefix(), self.rank, self.plan.num_ranks, self.timeout_s, self.group)
        gather(f"{tag}/{self._generation}", self.rank)

    def _prefix(self) -> str:
        return f"msc-cuda/ranks-{self._group_key}/{self._serial}/{self._plan_key}"

    def _track(self, i: int, L: Launch, stream) -> None:
        """Queue a copy of the launch's error word to host memory and an event."""
        mirror = self._mirrors.get(i, (None,))[0]
        mirror, event = self.backend.snapshot(L.device, stream, error_pointer(self._arenas, self._bases, L.error_rank),
                                              4 * ERROR_WORDS, mirror)
        self._mirrors[i] = (mirror, event)
        self._last[L.device] = (stream, event)

    def _upload(self, dev: int, args: bytes, capturing: bool):
        """The MscArgs block on the device (copied in the order of the stream it
        is launched on; cached by content): (pointer, what holds it)."""
        key = (dev, args)
        hit = self._args.get(key)
        if hit is not None:
            self._args.move_to_end(key)
            if capturing and not hit[2]:           # a graph now reads it: keep it for good
                self._args[key] = (hit[0], hit[1], True)
            return hit[0], hit[1]
        ptr, held = self.backend.upload(dev, args, capturing)
        # entries made during capture stay: the graph's copy node reads them at every replay
        self._args[key] = (ptr, held, capturing)
        while len(self._args) > ARGS_CACHE:
            old = next((k for k, v in self._args.items() if not v[2]), None)
            if old is None:
                break
            del self._args[old]
        return ptr, held

    # -- memory -----------------------------------------------------------------------------
    def _reserve(self, need) -> None:
        """Make the arenas hold ``need`` (a launch.Footprint), growing them if not."""
        backend = self.backend
        new = grow(self._capacity, need)
        if new is None:
            return
        if backend.capturing():
            raise UsageError("this call needs larger communicator buffers, which cannot be allocated during CUDA "
                             "graph capture: make a call of the largest size before capturing")
        arenas = arena_layout(self.layout, new, group_in_arena=backend.group_in_arena)
        mine = sum(arenas[r].size for r in self.ranks_here)
        if self.max_bytes is not None and mine > self.max_bytes:
            raise UsageError(f"this call needs {mine} bytes of communicator buffers (scratch, slots, counters), "
                             f"over max_bytes={self.max_bytes}")
        self._release()
        self._generation += 1
        shared = self.placement == "torchrun"
        try:
            for r in self.ranks_here:
                d = self.device_of[r]
                ptr = backend.alloc(d, arenas[r].size, shared=shared)
                self._owned[r] = ptr
                with backend.context(d):
                    backend.zero(d, ptr, arenas[r].size, backend.stream(d))
            for d in self.devices:
                backend.synchronize(d)
        except Exception as exc:
            with suppress(Exception):    # a zeroing still queued must not write freed memory
                for d in self.devices:
                    backend.synchronize(d)
            self._drop()                 # no peer maps these yet: free them without meeting anyone
            if isinstance(exc, cu.DriverError):
                raise UsageError(f"cannot allocate {mine} bytes of communicator buffers: {exc}") from None
            raise
        if self.placement == "torchrun":
            try:
                bases = self._exchange(new)
            except BaseException:
                self._drop()             # the peers may never come: free ours without meeting them
                raise
            self._opened = {r: b for r, b in enumerate(bases) if b is not None and r != self.rank}
        else:
            bases = [self._owned.get(r) for r in range(self.plan.num_ranks)]
        self._bases, self._arenas, self._capacity = bases, arenas, new
        self._args.clear()
        self._mirrors.clear()
        if self.layout.switch:
            try:
                self._setup_groups(new)
            except BaseException:
                self._release()
                raise

    def _exchange(self, capacity) -> list[int | None]:
        """torchrun placement: every rank's arena base in this process (msc.cuda.bootstrap)."""
        from msc.cuda.bootstrap import exchange, store_gather

        backend = self.backend
        d = self.devices[0]
        with backend.context(d):
            return exchange(self.rank, self.plan.num_ranks, self._owned[self.rank], capacity, self._generation,
                            peers(self.layout, self.rank), ipc=self._ipc or backend.ipc(),
                            gather=store_gather(self._prefix(), self.rank, self.plan.num_ranks, self.timeout_s,
                                                self.group),
                            host=backend.host_id(), device=backend.device_id(d), reach=backend.reach(d),
                            shared=backend.shared())

    def _release(self) -> None:
        """Free the arenas after every launch that uses them has finished
        (under torchrun, after the peers say they no longer map ours; ours
        are freed even when a peer never says so)."""
        backend = self.backend
        if not self._owned and not self._opened:
            return
        for d in self.devices:
            backend.synchronize(d)
        try:
            if self._arenas is not None and self._broken is None:
                self.poll()
        finally:
            try:
                self._close_opened()
                if self.placement == "torchrun":
                    self._rendezvous("release")      # no peer still maps what we free
            finally:
                self._drop()

    def _close_opened(self) -> None:
        ipc = self._ipc or self.backend.ipc()
        opened, self._opened = self._opened, {}
        for ptr in opened.values():
            with self.backend.context(self.devices[0]):
                ipc.close(ptr)

    def _drop(self) -> None:
        """Free what this process allocated and unmap the peers' arenas, meeting no one."""
        try:
            self._close_opened()
        finally:
            tables, self._switch_tables = self._switch_tables, {}
            divisions, self._average_tables = self._average_tables, {}
            for d, ptr in [*tables.items(), *divisions.items()]:
                self.backend.free(d, ptr)
            held, self._group_held = self._group_held, []
            for buf in reversed(held):           # the first owns the memory the others bind
                buf.close()
            owned, self._owned = self._owned, {}
            for r, ptr in owned.items():
                self.backend.free(self.device_of[r], ptr)
            self._bases = [None] * self.plan.num_ranks
            self._arenas = self._capacity = None

    def close(self) -> None:
        """Free the communicator's device memory (after its launches finish)."""
        self._release()
        self._tables.clear()        # after _release's synchronize: no launch reads them any more

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
