"""The CUDA driver, through cuda.bindings: probing for it, and the few calls
the runtime makes (memory, copies, peer access, IPC handles), each checked
by one helper that turns a failing status into a typed msc error.

``driver_available()`` is the one place that decides whether anything may
touch a GPU: it never raises and never hangs without a driver (it probes
``cuInit`` once, in a try). Every launch path, and every GPU test, asks it
first. Everything else here needs a driver and is exercised only on a GPU
machine (tests/test_cuda_gpu.py).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from msc.errors import MscError, UsageError

IPC_HANDLE_BYTES = 64


class DriverError(MscError):
    """A CUDA driver call failed: the call's name and the driver's error."""

    def __init__(self, call: str, status):
        self.call, self.status = call, status
        super().__init__(f"CUDA driver call {call} failed: {_status_name(status)}")


def _status_name(status) -> str:
    try:
        from cuda.bindings import driver

        err, name = driver.cuGetErrorName(status)
        if err == driver.CUresult.CUDA_SUCCESS:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:       # the name is a courtesy: never mask the real error
        pass
    return str(status)


@lru_cache(maxsize=1)
def probe() -> tuple[bool, str]:
    """(whether a CUDA driver and at least one GPU are usable, why not)."""
    try:
        from cuda.bindings import driver
    except Exception as exc:                     # cuda-bindings not installed
        return False, f"cuda.bindings is not importable ({type(exc).__name__}: {exc})"
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False, f"cuInit failed: {err}"
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS:
            return False, f"cuDeviceGetCount failed: {err}"
        if count < 1:
            return False, "the CUDA driver sees no GPU"
        return True, f"{count} GPU(s)"
    except Exception as exc:                     # no libcuda.so: DynamicLibNotFoundError and friends
        return False, f"no CUDA driver ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"


def driver_available() -> bool:
    """Whether a CUDA driver and a GPU are here. Never raises."""
    return probe()[0]


def require_driver() -> None:
    ok, why = probe()
    if not ok:
        raise UsageError(f"the msc CUDA runtime needs an NVIDIA GPU and driver: {why}")


def call(fn, *args):
    """Run a cuda.bindings driver call; raise DriverError unless it succeeded.
    Returns the call's results after the status (None, one value or a tuple)."""
    from cuda.bindings import driver

    out = fn(*args)
    status, rest = out[0], out[1:]
    if status != driver.CUresult.CUDA_SUCCESS:
        raise DriverError(getattr(fn, "__name__", str(fn)), status)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def device_count() -> int:
    from cuda.bindings import driver

    require_driver()
    return call(driver.cuDeviceGetCount)


def arch(index: int) -> str:
    """NVRTC arch of GPU ``index`` ("sm_90")."""
    from cuda.core import Device

    return f"sm_{Device(index).arch}"


def multiprocessors(index: int) -> int:
    from cuda.core import Device

    return int(Device(index).properties.multiprocessor_count)


def max_active_blocks(kernel, nthreads: int) -> int:
    """Blocks of ``kernel`` (a loaded cuda.core Kernel) one SM holds at once
    with ``nthreads`` threads each (the occupancy API: registers, shared memory)."""
    return int(kernel.occupancy.max_active_blocks_per_multiprocessor(nthreads, 0))


def mps_active() -> bool:
    """Whether an MPS control daemon is running for this process's user: its pipe directory
    ($CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps) holds the daemon's ``control`` pipe.
    CUDA connects a process to the MPS server there at context creation."""
    import os
    from pathlib import Path

    pipes = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    try:
        return (pipes / "control").exists()
    except OSError:
        return False


SHARED_GPU = ("their kernels would share the GPU by time-slicing: kernels of different processes take turns on "
              "it unless MPS runs them side by side, and each rank's blocks spin until the other's run, so every "
              "wait would last a time slice (or the timeout)")


MAX_TIMEOUT_S = 365 * 24 * 3600.0     # a spin-wait budget beyond a year is a mistake (inf, 1e400)


def timeout_ns(timeout_s: float) -> int:
    """Spin-wait budget in nanoseconds (the kernel reads the GPU's global
    timer, which counts nanoseconds whatever the SM clock does)."""
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise UsageError(f"timeout_s must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g} (a year), got "
                         f"{timeout_s!r}")
    return max(1, int(timeout_s * 1e9))


# -- memory ---------------------------------------------------------------------------
def mem_alloc(nbytes: int) -> int:
    """Device memory in the current context (torch's primary context)."""
    from cuda.bindings import driver

    return int(call(driver.cuMemAlloc, max(nbytes, 1)))


def mem_free(ptr: int) -> None:
    from cuda.bindings import driver

    call(driver.cuMemFree, driver.CUdeviceptr(ptr))


def memset_async(ptr: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import driver

    call(driver.cuMemsetD8Async, driver.CUdeviceptr(ptr), 0, nbytes, driver.CUstream(stream))


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Device to device (any GPU: unified addressing), in stream order."""
    from cuda.bindings import driver

    call(driver.cuMemcpyAsync, driver.CUdeviceptr(dst), driver.CUdeviceptr(src), nbytes, driver.CUstream(stream))


def copy_to_host_async(host_ptr: int, dev_ptr: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import driver

    call(driver.cuMemcpyDtoHAsync, host_ptr, driver.CUdeviceptr(dev_ptr), nbytes, driver.CUstream(stream))


def write(dev_ptr: int, host_ptr: int, nbytes: int) -> None:
    """Synchronous copy from host memory (tests poke counters with it)."""
    from cuda.bindings import driver

    call(driver.cuMemcpyHtoD, driver.CUdeviceptr(dev_ptr), host_ptr, nbytes)


def read(dev_ptr: int, nbytes: int) -> bytes:
    """Synchronous copy to host (for diagnostics after a launch failed)."""
    from cuda.bindings import driver

    buf = (ctypes.c_char * nbytes)()
    call(driver.cuMemcpyDtoH, ctypes.addressof(buf), driver.CUdeviceptr(dev_ptr), nbytes)
    return bytes(buf)


def enable_peer_access(peer_index: int) -> None:
    """Let the current context reach GPU ``peer_index``'s memory (one direction)."""
    from cuda.bindings import driver

    dev = call(driver.cuDeviceGet, peer_index)
    ctx = call(driver.cuDevicePrimaryCtxRetain, dev)
    status = driver.cuCtxEnablePeerAccess(ctx, 0)[0]
    if status not in (driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        raise DriverError("cuCtxEnablePeerAccess", status)


def pci_bus_id(index: int) -> str:
    """GPU ``index``'s PCI bus id, the name another process can look it up by."""
    from cuda.bindings import driver

    raw = call(driver.cuDeviceGetPCIBusId, 64, call(driver.cuDeviceGet, index))
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).rstrip("\0").strip()


def index_of_bus_id(bus_id: str) -> int | None:
    """The index this process gives the GPU at ``bus_id``; None if it does not see it."""
    from cuda.bindings import driver

    status, dev = driver.cuDeviceGetByPCIBusId(bus_id.encode())
    if status != driver.CUresult.CUDA_SUCCESS:
        return None
    for i in range(device_count()):
        if call(driver.cuDeviceGet, i) == dev:
            return i
    return None


def can_access_peer(index: int, peer_index: int) -> bool:
    from cuda.bindings import driver

    return bool(call(driver.cuDeviceCanAccessPeer, call(driver.cuDeviceGet, index), call(driver.cuDeviceGet, peer_index)))


# -- IPC ------------------------------------------------------------------------------
class DriverIpc:
    """Legacy CUDA IPC on cuMemAlloc'd memory: a 64-byte handle per
    allocation. The torchrun bootstrap (msc.cuda.bootstrap) takes any object
    with these two methods, so tests inject fakes."""

    def export(self, ptr: int) -> bytes:
        from cuda.bindings import driver

        handle = call(driver.cuIpcGetMemHandle, driver.CUdeviceptr(ptr))
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def open(self, handle: bytes) -> int:
        from cuda.bindings import driver

        if len(handle) != IPC_HANDLE_BYTES:
            raise UsageError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        h = driver.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
        return int(call(driver.cuIpcOpenMemHandle, h, driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))

    def close(self, ptr: int) -> None:
        from cuda.bindings import driver

        call(driver.cuIpcCloseMemHandle, driver.CUdeviceptr(ptr))
