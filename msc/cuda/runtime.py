"""The GPU runtime: ``Communicator`` launches a plan's kernel on torch CUDA
tensors.

    comm = msc.cuda.Communicator(plan, placement="virtual")     # all ranks on one GPU
    outs = comm.run(inputs, op="sum")                           # a tensor per rank
    comm.all_reduce(tensors); comm.synchronize()

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
  arena and exchanges CUDA IPC handles (msc.cuda.bootstrap); it launches its
  own rank's blocks. Every rank must make the same calls.

Memory. A rank's counters, slots and scratch live in its *arena*
(msc.cuda.tables): one driver allocation per rank, zeroed once, sized by
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

Kernels compile at first use for the device's arch, one per (dtype, op)
(msc.cuda.compiler caches cubins on disk); data-movement collectives use one
kernel for every op. Launches run on torch's current stream, so they order
with the caller's work and can be captured in a CUDA graph. The packed
MscArgs block is uploaded with a stream-ordered copy and cached by content,
so a repeated call with the same tensors uploads nothing (a graph captured
after a warm-up call holds only the kernel).

Errors. Bad calls raise UsageError before anything launches
(msc.cuda.validate). A spin-wait that exceeds ``timeout_s`` ends the kernel
with an error word; reading it needs the launch to have finished, and this
runtime adds no synchronization per call: after each launch a stream-ordered
copy of the error word to pinned host memory and an event are queued, and the
next call inspects the words of launches whose events have completed;
``synchronize()`` waits and always checks (also for launches captured in
graphs, by reading the device words). A set error word raises
DeviceTimeoutError (rank, threadblock, step, iteration, and which waits were
unmet, from the device counters) and the communicator becomes *broken*:
every later call raises BrokenCommunicatorError. Under devices and torchrun
placements each launch has its own error word; the other GPUs' blocks
waiting on a failed rank end by their own timeouts.

What runs without a GPU (tests/test_cuda_runtime.py): validation, pointer
tables, arena layout and growth, launch shapes, error decoding, the IPC
handle exchange (gloo, fake handles), compilation for sm_90. Everything that
touches the driver (allocation, upload, launch, error read back, peer
access, IPC) is tested only on a GPU (tests/test_cuda_gpu.py) and was
written without one: it is unproven until those tests run.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from msc.cuda import device as cu
from msc.cuda.codegen import KernelLayout, choose_form, kernel_layout
from msc.cuda.compiler import CompiledKernel
from msc.cuda.compiler import compile as compile_kernel
from msc.cuda.diagnose import BrokenCommunicatorError, counters_from_arena, decode, merge, parse_words
from msc.cuda.launch import ERROR_WORDS, footprint, launch_params, pack_args
from msc.cuda.tables import arena_layout, error_pointer, grow, peers, pointer_tables
from msc.cuda.validate import check_call, check_collective, describe, units
from msc.errors import UsageError
from msc.ir import Plan

PLACEMENTS = ("virtual", "devices", "torchrun")
MIN_SLOTS = 8
ARGS_CACHE = 256          # uploaded MscArgs blocks kept per communicator


def runtime_plan(plan: Plan) -> Plan:
    """The plan as the runtime compiles it: max(plan.slots, MIN_SLOTS) slots."""
    return dataclasses.replace(plan, slots=max(plan.slots, MIN_SLOTS))


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
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
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


class Kernels:
    """A plan's kernels for one arch, by (dtype, op): compiled at first use
    (cached on disk by msc.cuda.compiler), loaded once (needs a driver)."""

    def __init__(self, plan: Plan, arch: str, *, form: str | None = None, cache: Path | None = None,
                 collective=None, allow_deadlock: bool = False):
        self.plan, self.arch, self.form, self.cache, self.collective = plan, arch, form, cache, collective
        self.allow_deadlock = allow_deadlock
        self._compiled: dict[tuple[str, str], CompiledKernel] = {}
        self._loaded: dict[tuple[str, str], object] = {}

    def compiled(self, dtype: str, op: str) -> CompiledKernel:
        key = (dtype, op)
        if key not in self._compiled:
            self._compiled[key] = compile_kernel(self.plan, dtype=dtype, op=op, arch=self.arch, form=self.form,
                                                 collective=self.collective, cache=self.cache,
                                                 allow_deadlock=self.allow_deadlock)
        return self._compiled[key]

    def loaded(self, dtype: str, op: str):
        key = (dtype, op)
        if key not in self._loaded:
            from cuda.core import ObjectCode

            k = self.compiled(dtype, op)
            self._loaded[key] = ObjectCode.from_cubin(k.cubin, name=k.key).get_kernel(k.kernel_name)
        return self._loaded[key]


def _torch():
    try:
        import torch
    except ModuleNotFoundError:
        raise UsageError("the msc CUDA runtime takes torch tensors: pip install 'msc[torch]'") from None
    return torch


class Communicator:
    """A plan bound to GPUs (see the module doc). ``timeout_s``: how long a
    spin-wait may last before the kernel gives up and reports. ``ipc``:
    the torchrun placement's IPC (default msc.cuda.device.DriverIpc).
    ``max_bytes``: refuse calls whose arenas (this process's) would exceed it.
    ``allow_deadlock``: compile a plan that deadlocks (loaded with
    verify=False), to see the timeout path; never for real work."""

    def __init__(self, plan: Plan | str | Path, placement: str = "virtual", devices=None, *, timeout_s: float = 10.0,
                 group=None, form: str | None = None, cache: Path | None = None, collective=None,
                 max_bytes: int | None = None, ipc=None, allow_deadlock: bool = False,
                 _omit_ranks: tuple[int, ...] = ()):
        torch = _torch()
        cu.require_driver()
        if isinstance(plan, (str, Path)):
            from msc.plan_text import load_plan

            plan = load_plan(plan)
        units(plan)
        self.plan, self.placement, self.timeout_s, self.group = plan, placement, float(timeout_s), group
        self.kplan = runtime_plan(plan)
        self.slots = self.kplan.slots
        self.layout = kernel_layout(self.kplan, choose_form(self.kplan, form))
        n = plan.num_ranks
        self.rank = None
        if placement == "torchrun":
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise UsageError("placement 'torchrun' needs torch.distributed initialized (init_process_group)")
            if dist.get_world_size(group) != n:
                raise UsageError(f"plan {plan.name!r} is for {n} ranks, the process group has "
                                 f"{dist.get_world_size(group)}")
            self.rank = dist.get_rank(group)
        torch.cuda.init()
        self.devices = resolve_devices(placement, devices, n, torch.cuda.current_device())
        count = torch.cuda.device_count()
        for d in self.devices:
            if d >= count:
                raise UsageError(f"GPU {d} does not exist ({count} visible)")
        here = torch.cuda.current_device()
        for d in self.devices:
            with torch.cuda.device(d):
                self._bind(d)
        torch.cuda.set_device(here)
        self.ranks_here = tuple(range(n)) if placement != "torchrun" else (self.rank,)
        self.device_of = {r: self.devices[0] if placement != "devices" else self.devices[r] for r in self.ranks_here}
        self._launches = launches(self.layout, placement, self.devices, self.rank)
        if _omit_ranks:          # testing only: a rank that never launches makes its peers time out
            self._launches = tuple(dataclasses.replace(L, grid=self.layout.rank_blocks[min(_omit_ranks)][0])
                                   for L in self._launches)
        archs = {d: cu.arch(d) for d in self.devices}
        self._kernels = {a: Kernels(self.kplan, a, form=form, cache=cache, collective=collective,
                                    allow_deadlock=allow_deadlock)
                         for a in set(archs.values())}
        self._arch = archs
        self._cycles = {d: cu.timeout_cycles(self.timeout_s, cu.clock_rate_hz(d)) for d in self.devices}
        self.max_bytes = max_bytes
        self._ipc = ipc
        self._capacity = None
        self._arenas = None
        self._bases: list[int | None] = [None] * n
        self._owned: dict[int, int] = {}        # rank -> our allocation
        self._opened: dict[int, int] = {}       # rank -> a peer's arena opened by IPC
        self._generation = 0
        self._args: OrderedDict = OrderedDict()
        self._mirrors: dict[int, tuple] = {}    # launch index -> (pinned error copy, event)
        self._last: dict[int, tuple] = {}       # device -> (stream, event) of our last launch there
        self._broken: Exception | None = None
        if placement == "devices":
            for a in self.devices:
                for b in self.devices:
                    if a != b:
                        if not cu.can_access_peer(a, b):
                            raise UsageError(f"GPU {a} cannot access GPU {b} (no peer-to-peer path); placement "
                                             f"'devices' needs every pair")
                        with torch.cuda.device(a):
                            cu.enable_peer_access(b)

    # -- the only places that call cuda.core (tests replace them with fakes) ----------------
    @staticmethod
    def _bind(d: int) -> None:
        """cuda.core on GPU d's primary context, the one torch uses."""
        from cuda.core import Device

        _torch().empty(0, device=f"cuda:{d}")       # torch has made the context
        Device(d).set_current()

    @staticmethod
    def _kernel_launch(stream, grid: int, block: int, kernel, args_ptr: int) -> None:
        """One cooperative launch of ``kernel(args_ptr)`` on ``stream`` (a torch stream)."""
        from cuda.core import LaunchConfig, launch

        launch(stream, LaunchConfig(grid=grid, block=block, is_cooperative=True), kernel, args_ptr)

    # -- the collective calls -------------------------------------------------------------
    def run(self, inputs, outputs=None, op: str = "sum"):
        """Run the plan: ``inputs``/``outputs`` a tensor per rank (virtual,
        devices) or this rank's tensor (torchrun); see msc.cuda.validate for
        the in-place forms. Out-of-place outputs left out are allocated.
        Returns the outputs (per rank, or this rank's)."""
        torch = _torch()
        self._usable()
        single = self.placement == "torchrun"
        ins, outs = self._as_list(inputs, single), self._as_list(outputs, single)
        if outs is None and not self.plan.inplace and ins is not None:
            _, out_units = units(self.plan)
            in_units = units(self.plan)[0]
            outs = [torch.empty(t.numel() // in_units * out_units if t.numel() % in_units == 0 else 0,
                                dtype=t.dtype, device=t.device) for t in ins]
        spec = check_call(self.plan, None if ins is None else [describe(t) for t in ins],
                          None if outs is None else [describe(t) for t in outs], op=op, ranks=self.ranks_here,
                          devices=tuple(f"cuda:{self.device_of[r]}" for r in self.ranks_here))
        if not torch.cuda.is_current_stream_capturing():     # no event queries inside a capture
            self.poll()
        result = self._logical_outputs(ins, outs, spec.count)
        if spec.count > 0:
            self._launch_all(spec)
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
                self._check(self._launches[i], bytes(mirror.numpy().tobytes()))

    def synchronize(self) -> None:
        """Wait for every launch of this communicator and check its error
        word (raises DeviceTimeoutError, then the communicator is broken)."""
        torch = _torch()
        self._usable()
        if self._arenas is None:
            return
        for L in self._launches:
            torch.cuda.synchronize(L.device)
        for L in self._launches:
            with torch.cuda.device(L.device):
                raw = cu.read(error_pointer(self._arenas, self._bases, L.error_rank), 4 * ERROR_WORDS)
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
        torch = _torch()
        try:
            for d in self.devices:
                torch.cuda.synchronize(d)
            parts = []
            for r, base in enumerate(self._bases):
                if base is None:
                    continue
                with torch.cuda.device(self.device_of.get(r, self.devices[0])):
                    raw = cu.read(base, self._arenas[r].counters_end)
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
        from msc.collectives import get_collective

        n, k = self.plan.num_ranks, self.plan.chunk_factor
        alias, target, _ = get_collective(self.plan.collective).inplace_alias(0, n, k)
        if target == "output":
            return outs
        _, out_units = units(self.plan)
        views = []
        for i, r in enumerate(self.ranks_here):
            off = get_collective(self.plan.collective).inplace_alias(r, n, k)[2] // k
            t = ins[i]
            views.append(t if t.numel() == out_units * count and off == 0
                         else t.view(-1)[off * count:(off + out_units) * count])
        return views

    def _launch_all(self, spec) -> None:
        torch = _torch()
        params = launch_params(self.layout, spec.count, dtype=spec.dtype, protocol=self.kplan.protocol,
                               tile_bytes=self.kplan.tile)
        self._reserve(footprint(self.layout, params, dtype=spec.dtype, protocol=self.kplan.protocol,
                                slots=self.slots))
        buffers = [None] * self.plan.num_ranks
        for i, r in enumerate(self.ranks_here):
            buffers[r] = spec.buffers[i]
        ranks, conns = pointer_tables(self.layout, self._arenas, self._bases, buffers, self.ranks_here)
        for i, L in enumerate(self._launches):
            kernel = self._kernels[self._arch[L.device]].loaded(spec.dtype, spec.op)
            args = pack_args(self.layout, params, ranks=ranks, connections=conns,
                             error=error_pointer(self._arenas, self._bases, L.error_rank),
                             first_block=L.first_block, timeout_cycles=self._cycles[L.device])
            with torch.cuda.device(L.device):
                stream = torch.cuda.current_stream(L.device)
                capturing = torch.cuda.is_current_stream_capturing()
                last = self._last.get(L.device)
                if last is not None and last[0] != stream and not capturing:
                    stream.wait_event(last[1])          # launches of one communicator never overlap
                ptr = self._upload(L.device, args, capturing)
                try:
                    self._kernel_launch(stream, L.grid, self.layout.nthreads, kernel, ptr)
                except Exception as exc:            # the grid cannot be resident at once?
                    if not isinstance(exc, ValueError) and "COOPERATIVE_LAUNCH_TOO_LARGE" not in str(exc):
                        raise
                    raise UsageError(f"GPU {L.device} cannot hold the {L.grid} blocks of {self.layout.nthreads} "
                                     f"threads of this launch at once (a cooperative launch needs them all "
                                     f"resident): {exc}") from None
                if not capturing:
                    self._track(i, L, stream)

    def _track(self, i: int, L: Launch, stream) -> None:
        """Queue a copy of the launch's error word to pinned memory and an event."""
        torch = _torch()
        mirror = self._mirrors.get(i, (None,))[0]
        if mirror is None:
            mirror = torch.zeros(4 * ERROR_WORDS, dtype=torch.uint8, pin_memory=True)
        cu.copy_to_host_async(mirror.data_ptr(), error_pointer(self._arenas, self._bases, L.error_rank),
                              4 * ERROR_WORDS, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        self._mirrors[i] = (mirror, event)
        self._last[L.device] = (stream, event)

    def _upload(self, dev: int, args: bytes, capturing: bool) -> int:
        """The MscArgs block in device memory (stream-ordered copy; cached by content)."""
        torch = _torch()
        key = (dev, args)
        hit = self._args.get(key)
        if hit is not None:
            self._args.move_to_end(key)
            if capturing and not hit[2]:           # a graph now reads it: keep it for good
                self._args[key] = (hit[0], hit[1], True)
            return hit[0].data_ptr()
        host = torch.frombuffer(bytearray(args), dtype=torch.uint8).pin_memory()
        on_device = torch.empty(len(args), dtype=torch.uint8, device=f"cuda:{dev}")
        on_device.copy_(host, non_blocking=True)
        # entries made during capture stay: the graph's copy node reads `host` at every replay
        self._args[key] = (on_device, host, capturing)
        while len(self._args) > ARGS_CACHE:
            old = next((k for k, v in self._args.items() if not v[2]), None)
            if old is None:
                break
            del self._args[old]
        return on_device.data_ptr()

    # -- memory -----------------------------------------------------------------------------
    def _reserve(self, need) -> None:
        """Make the arenas hold ``need`` (a launch.Footprint), growing them if not."""
        torch = _torch()
        new = grow(self._capacity, need)
        if new is None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise UsageError("this call needs larger communicator buffers, which cannot be allocated during CUDA "
                             "graph capture: make a call of the largest size before capturing")
        arenas = arena_layout(self.layout, new)
        mine = sum(arenas[r].size for r in self.ranks_here)
        if self.max_bytes is not None and mine > self.max_bytes:
            raise UsageError(f"this call needs {mine} bytes of communicator buffers (scratch, slots, counters), "
                             f"over max_bytes={self.max_bytes}")
        self._release()
        self._generation += 1
        try:
            for r in self.ranks_here:
                with torch.cuda.device(self.device_of[r]):
                    ptr = cu.mem_alloc(arenas[r].size)
                    self._owned[r] = ptr
                    cu.memset_async(ptr, arenas[r].size, torch.cuda.current_stream().cuda_stream)
            for d in self.devices:
                torch.cuda.synchronize(d)
        except cu.DriverError as exc:
            self._release()
            raise UsageError(f"cannot allocate {mine} bytes of communicator buffers: {exc}") from None
        if self.placement == "torchrun":
            from msc.cuda.bootstrap import exchange, torch_gather

            ipc = self._ipc or cu.DriverIpc()
            with torch.cuda.device(self.devices[0]):
                bases = exchange(self.rank, self.plan.num_ranks, self._owned[self.rank], new, self._generation,
                                 peers(self.layout, self.rank), ipc=ipc, gather=torch_gather(self.group))
            self._opened = {r: b for r, b in enumerate(bases) if b is not None and r != self.rank}
        else:
            bases = [self._owned.get(r) for r in range(self.plan.num_ranks)]
        self._bases, self._arenas, self._capacity = bases, arenas, new
        self._args.clear()
        self._mirrors.clear()

    def _release(self) -> None:
        """Free the arenas after every launch that uses them has finished."""
        torch = _torch()
        if not self._owned and not self._opened:
            return
        for d in self.devices:
            torch.cuda.synchronize(d)
        try:
            if self._arenas is not None and self._broken is None:
                self.poll()
        finally:
            ipc = self._ipc or cu.DriverIpc()
            for ptr in self._opened.values():
                with torch.cuda.device(self.devices[0]):
                    ipc.close(ptr)
            self._opened = {}
            if self.placement == "torchrun":
                import torch.distributed as dist

                dist.barrier(group=self.group)     # no peer still maps what we free
            for r, ptr in self._owned.items():
                with torch.cuda.device(self.device_of[r]):
                    cu.mem_free(ptr)
            self._owned = {}
            self._bases = [None] * self.plan.num_ranks
            self._arenas = self._capacity = None

    def close(self) -> None:
        """Free the communicator's device memory (after its launches finish)."""
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
