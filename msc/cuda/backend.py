"""The device under msc.cuda.runtime.Communicator: a real GPU (``CudaBackend``:
the CUDA driver through cuda.bindings/cuda.core, and torch.cuda for streams,
events and tensors) or the emulated device (msc.cuda.emu.EmuBackend: host
memory, threads, the kernel built as host C++). Both have the same methods;
the Communicator calls nothing else that touches a device.

Which one: ``Communicator(plan, device="cuda"|"emu")``, else ``$MSC_DEVICE``,
else "cuda".
"""
from __future__ import annotations

import ctypes
import os

from msc.cuda import device as cu
from msc.cuda.validate import describe
from msc.errors import UsageError

DEVICES = ("cuda", "emu")


def _torch():
    try:
        import torch
    except ModuleNotFoundError:
        raise UsageError("the msc CUDA runtime takes torch tensors: pip install 'msc[torch]'") from None
    return torch


def choose(device: str | None):
    """The backend for ``device`` (None: $MSC_DEVICE, else "cuda")."""
    name = device if device is not None else (os.environ.get("MSC_DEVICE") or "cuda")
    if name == "cuda":
        return CudaBackend()
    if name == "emu":
        from msc.cuda import emu

        return emu.backend()
    where = "device=" if device is not None else "MSC_DEVICE="
    raise UsageError(f"{where}{name!r}: the msc CUDA runtime runs on 'cuda' (a GPU) or 'emu' (the emulated device)")


def launch_failure(exc: Exception, where: str, grid: int, block: int) -> Exception:
    """What a failed launch means: the driver's CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE is a grid
    the device cannot hold at once (a UsageError: fewer blocks, or another placement); anything
    else is a LaunchError carrying the driver's (or cuda.core's) own words."""
    from msc.cuda.diagnose import LaunchError

    text = f"{type(exc).__name__}: {exc}"
    if "COOPERATIVE_LAUNCH_TOO_LARGE" in text:
        return UsageError(f"{where} cannot hold the {grid} blocks of {block} threads of this launch at once (a "
                          f"cooperative launch needs them all resident): {exc}")
    return LaunchError(f"the launch of {grid} blocks of {block} threads on {where} failed: {text}", where=where,
                       grid=grid, block=block, cause=text)


class CudaBackend:
    """A real GPU: the driver for memory, IPC and occupancy; torch.cuda for
    streams, events, pinned memory and tensors (torch's primary context).
    Written without a GPU: exercised only by tests/test_cuda_gpu.py on one,
    and on CPU with the driver and torch.cuda faked (tests/cudaboot.py)."""

    name = "cuda"
    host_tensors = False
    group_in_arena = False       # switch group memory: a multicast-bound allocation per member (open_group)

    def require(self) -> None:
        cu.require_driver()
        _torch().cuda.init()

    def current(self) -> int:
        return _torch().cuda.current_device()

    def count(self) -> int:
        return _torch().cuda.device_count()

    def bind(self, index: int) -> None:
        """cuda.core on GPU ``index``'s primary context, the one torch uses."""
        from cuda.core import Device

        torch = _torch()
        with torch.cuda.device(index):
            torch.empty(0, device=f"cuda:{index}")       # torch has made the context
            Device(index).set_current()

    def context(self, index: int):
        return _torch().cuda.device(index)

    def tensor_device(self, index: int) -> str:
        return f"cuda:{index}"

    def arch(self, index: int) -> str:
        return cu.arch(index)

    def can_access_peer(self, a: int, b: int) -> bool:
        return cu.can_access_peer(a, b)

    def enable_peer_access(self, a: int, b: int) -> None:
        with _torch().cuda.device(a):
            cu.enable_peer_access(b)

    def check_switch(self, placement: str, devices) -> None:
        """A plan with switch ops (NVLS) runs one process per GPU (placement 'torchrun': a
        multicast object's members are processes, msc.cuda.multicast) on GPUs with multicast
        support: UsageError for another placement, CapabilityError naming what a GPU lacks."""
        from msc.cuda.multicast import CudaMulticast, check_multicast

        if placement != "torchrun":
            raise UsageError(f"a plan with switch ops (NVLS) runs on GPUs under placement 'torchrun' (one process "
                             f"per GPU, whose buffers a multicast object binds), not {placement!r}; the emulated "
                             f"device (device='emu') runs it in every placement")
        driver = CudaMulticast()
        for d in devices:
            check_multicast(driver, d)

    def open_group(self, index: int, member: int, members: int, nbytes: int, *, prefix: str, timeout_s: float,
                   memory=None):
        """This member's group memory on GPU ``index``: a multicast-bound buffer of at least
        ``nbytes`` (msc.cuda.multicast.open_group_buffer, met through the job's store under
        ``prefix``): a GroupBuffer (.local, .mc, .close()). ``memory``: this member's buffer of
        another group, whose allocation this group binds too (a rank in several groups)."""
        from msc.cuda.bootstrap import store_gather
        from msc.cuda.multicast import CudaMulticast, open_group_buffer

        gather = store_gather(prefix, member, members, timeout_s,
                              subset=f"member {member} of the switch group at {prefix!r}")
        with _torch().cuda.device(index):
            return open_group_buffer(member, members, index, nbytes, gather=gather, driver=CudaMulticast(),
                                     host=self.host_id(), tag="switch", timeout_s=timeout_s, memory=memory)

    def describe_device(self, index: int) -> str:
        return f"GPU {index}"

    # kernels
    def compile(self, plan, *, dtype: str, op: str, form: str, collective, cache, allow_deadlock: bool, arch: str):
        from msc.cuda.compiler import compile as compile_kernel

        return compile_kernel(plan, dtype=dtype, op=op, arch=arch, form=form, collective=collective, cache=cache,
                              allow_deadlock=allow_deadlock)

    def load(self, compiled, args_size: int):
        from cuda.core import ObjectCode

        return ObjectCode.from_cubin(compiled.cubin, name=compiled.key).get_kernel(compiled.kernel_name)

    def resident_blocks(self, kernel, nthreads: int, index: int) -> int | None:
        """Blocks of ``kernel`` the GPU holds at once: the occupancy API per SM times the SMs."""
        return cu.max_active_blocks(kernel, nthreads) * cu.multiprocessors(index)

    def block_threads(self, gpu_threads: int) -> int:
        return gpu_threads

    # tensors
    def describe(self, t):
        return describe(t)

    def empty(self, like, numel: int):
        return _torch().empty(numel, dtype=like.dtype, device=like.device)

    # streams
    def capturing(self) -> bool:
        return _torch().cuda.is_current_stream_capturing()

    def stream(self, index: int):
        return _torch().cuda.current_stream(index)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def record(self, stream):
        event = _torch().cuda.Event()
        event.record(stream)
        return event

    def upload(self, index: int, data: bytes, capturing: bool):
        """A copy of ``data`` to GPU ``index``, ordered in torch's current stream
        there (the stream msc launches on: ``stream(index)``): (device pointer,
        what must stay alive: the device tensor and, under capture, the pinned
        source a graph's copy node reads at every replay). Call it with GPU
        ``index`` current (``context(index)``)."""
        torch = _torch()
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8).pin_memory()
        on_device = torch.empty(len(data), dtype=torch.uint8, device=f"cuda:{index}")
        on_device.copy_(host, non_blocking=True)
        return on_device.data_ptr(), (on_device, host)

    def uploaded(self, index: int):
        """An event after the copies queued so far on GPU ``index``'s current stream (an upload's
        completion, for launches on other streams to wait on)."""
        return self.record(self.stream(index))

    def launch(self, index: int, stream, grid: int, block: int, kernel, args_ptr: int, keep=()) -> None:
        """One cooperative launch of ``kernel(args_ptr)`` on ``stream``. The
        caching allocator orders the reuse of tensors by stream: ``keep`` is
        not needed here. A failure is classified (``launch_failure``)."""
        from cuda.core import LaunchConfig, launch

        try:
            launch(stream, LaunchConfig(grid=grid, block=block, is_cooperative=True), kernel, args_ptr)
        except Exception as exc:
            raise launch_failure(exc, f"GPU {index}", grid, block) from exc

    def snapshot(self, index: int, stream, ptr: int, nbytes: int, previous=None):
        """A stream-ordered copy of device bytes to pinned memory: (buffer, event)."""
        torch = _torch()
        mirror = previous if previous is not None else torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        cu.copy_to_host_async(mirror.data_ptr(), ptr, nbytes, stream.cuda_stream)
        return mirror, self.record(stream)

    @staticmethod
    def snapshot_bytes(buf) -> bytes:
        return bytes(buf.numpy().tobytes())

    def synchronize(self, index: int) -> None:
        _torch().cuda.synchronize(index)

    # memory
    def alloc(self, index: int, nbytes: int, *, shared: bool = False) -> int:
        with _torch().cuda.device(index):
            return cu.mem_alloc(nbytes)

    def zero(self, index: int, ptr: int, nbytes: int, stream) -> None:
        cu.memset_async(ptr, nbytes, stream.cuda_stream)

    def copy(self, index: int, dst: int, src: int, nbytes: int, stream, keep=()) -> None:
        """A stream-ordered device-to-device copy (the caching allocator keeps tensors by stream)."""
        cu.copy_async(dst, src, nbytes, stream.cuda_stream)

    def free(self, index: int, ptr: int) -> None:
        with _torch().cuda.device(index):
            cu.mem_free(ptr)

    def read(self, index: int, ptr: int, nbytes: int) -> bytes:
        with _torch().cuda.device(index):
            return cu.read(ptr, nbytes)

    def write(self, index: int, ptr: int, data: bytes) -> None:
        with _torch().cuda.device(index):
            buf = ctypes.create_string_buffer(data, len(data))
            cu.write(ptr, ctypes.addressof(buf), len(data))

    def ipc(self):
        return cu.DriverIpc()

    def host_id(self) -> str:
        from msc.cuda.emu import _host_id

        return _host_id()

    def device_id(self, index: int) -> str:
        return cu.pci_bus_id(index)

    def shared(self) -> str | None:
        """Why two torchrun ranks must not share a GPU (None where MPS runs their kernels side by side)."""
        return None if cu.mps_active() else cu.SHARED_GPU

    def reach(self, index: int):
        """``reach(peer device id) -> why not, or None`` for GPU ``index``."""
        def why(peer: str) -> str | None:
            other = cu.index_of_bus_id(peer)
            if other is None:
                return f"its GPU {peer} is not visible to this process (CUDA_VISIBLE_DEVICES hides it?)"
            if other != index and not cu.can_access_peer(index, other):
                return f"GPU {index} has no peer-to-peer path to GPU {other} ({peer})"
            return None
        return why
