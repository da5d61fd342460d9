"""The emulated CUDA device: msc's kernels run on the CPU, driven by the real
``Communicator``.

Only what a driver does is emulated; everything above it (arena layout,
pointer tables, argument packing, growth and re-zeroing, counters that
persist across launches, deferred error reads, DeviceTimeoutError and the
broken state, the torchrun bootstrap) is the runtime's own code, unchanged:

- the kernel is the rendered CUDA text built as host C++ (msc.cuda.hostbuild)
  and loaded with ctypes; a launch runs grid x block std::threads at once;
- memory is host memory mapped with mmap: private pages for the virtual and
  devices placements, anonymous memory files (memfd) where CUDA IPC would be
  (torchrun: one process per rank, the same bootstrap exchanging where peers
  open them, /proc/<pid>/fd/<n>, instead of IPC handles). They have no name
  in /dev/shm or anywhere, so nothing remains however a process ends (a
  signal, a timeout, kill -9): the memory goes with its last mapping;
- each emulated device has one stream, a worker thread that runs its queue
  in order (launches, zeroing, copies of the error word, events), so calls
  return before their kernels finish, as on a GPU;
- tensors are host tensors: numpy arrays or CPU torch tensors.

Blocks run fewer threads than on a GPU (``MSC_EMU_THREADS``, default 4; the
kernel strides by blockDim, so any count computes the same result): the
emulated device checks what a schedule and its kernel compute and how they
synchronize, not speed, occupancy, or what only GPU hardware does (scopes
.gpu vs .sys, stale L1 lines, warp scheduling).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import queue
import tempfile
import threading
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from msc.cuda.validate import TensorDesc
from msc.errors import UsageError

DEVICES = 64                     # emulated devices a process may address
DEFAULT_THREADS = 4
IPC_HANDLE_BYTES = 64


def threads_per_block(gpu_threads: int) -> int:
    """Threads per emulated block: ``MSC_EMU_THREADS`` (default 4), at most a GPU block's."""
    text = os.environ.get("MSC_EMU_THREADS", str(DEFAULT_THREADS))
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"MSC_EMU_THREADS must be a whole number >= 1, got {text!r}")
    return min(int(text), gpu_threads)


# -- memory -------------------------------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class Mapping:
    ptr: int
    size: int
    name: str | None = None          # where peers open a shareable allocation: "pid/fd/token" (until settled)
    fd: int = -1                     # its memory file, open until every peer has mapped it


def _map(size: int, fd: int = -1) -> int:
    flags = mmap.MAP_SHARED if fd >= 0 else (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ptr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if ptr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise UsageError(f"the emulated device cannot map {size} bytes: {os.strerror(err)}")
    return ptr


class HostMemory:
    """Page-aligned, zeroed host memory at stable addresses (mmap), freed explicitly."""

    def __init__(self):
        self.maps: dict[int, Mapping] = {}
        self.lock = threading.Lock()

    def alloc(self, nbytes: int, shared: bool = False) -> int:
        size = max(nbytes, 1)
        if not shared:
            ptr = _map(size)
            m = Mapping(ptr, size)
        else:
            if not hasattr(os, "memfd_create") or not Path("/proc/self/fd").is_dir():
                raise UsageError("the emulated torchrun placement shares memory through memory files (memfd_create) "
                                 "that peers open in /proc: Linux only")
            token = uuid.uuid4().hex[:16]
            fd = os.memfd_create(f"msc-emu-{token}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                ptr = _map(size, fd)
            except BaseException:
                os.close(fd)
                raise
            m = Mapping(ptr, size, f"{os.getpid()}/{fd}/{token}", fd)
        with self.lock:
            self.maps[ptr] = m
        return ptr

    def attach(self, name: str, size: int) -> int:
        """Map another process's shareable allocation (``name``: "pid/fd/token")."""
        pid, _, rest = name.partition("/")
        fd_text, _, token = rest.partition("/")
        path = f"/proc/{pid}/fd/{fd_text}"
        if not (pid.isdigit() and fd_text.isdigit() and token.isalnum()):
            raise UsageError(f"a peer's emulated device memory is named {name!r}, not pid/fd/token")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise UsageError(f"cannot open a peer's emulated device memory {path}: {exc.strerror} (is the peer on "
                             f"this machine, in this PID namespace, and still running?)") from None
        try:
            if f"msc-emu-{token}" not in os.readlink(f"/proc/self/fd/{fd}"):
                raise UsageError(f"{path} is not the peer's emulated device memory (the process or its file is "
                                 f"gone)")
            ptr = _map(size, fd)
        finally:
            os.close(fd)
        with self.lock:
            self.maps[ptr] = Mapping(ptr, size)
        return ptr

    def unlink(self, ptr: int) -> None:
        """Close a shareable allocation's memory file (its mappings stay): no
        peer can open it any more, and it goes with its last mapping."""
        m = self.maps.get(ptr)
        if m is not None and m.fd >= 0:
            os.close(m.fd)
            m.fd, m.name = -1, None

    def free(self, ptr: int) -> None:
        with self.lock:
            m = self.maps.pop(ptr, None)
        if m is None:
            raise UsageError(f"emulated device: free of {ptr:#x}, which is not allocated")
        if m.fd >= 0:
            os.close(m.fd)
        _libc.munmap(m.ptr, m.size)

    def size(self, ptr: int) -> int:
        return self.maps[ptr].size


# -- streams and events -------------------------------------------------------------------------
class Event:
    def __init__(self):
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class Stream:
    """One emulated device's stream: a worker thread running its queue in order.
    A failed operation (a launch that could not start its threads) is kept and
    raised by the next synchronize()."""

    def __init__(self, index: int):
        self.index = index
        self.pid = os.getpid()            # its worker thread exists in this process only
        self.queue: queue.Queue = queue.Queue()
        self.failure: Exception | None = None
        self.worker = threading.Thread(target=self._work, name=f"msc-emu-stream-{index}", daemon=True)
        self.worker.start()

    def _work(self) -> None:
        while True:
            fn = self.queue.get()
            try:
                fn()
            except Exception as exc:          # kept for the caller: a worker has no one to raise to
                if self.failure is None:
                    self.failure = exc

    def submit(self, fn) -> None:
        if os.getpid() != self.pid:       # a fork copied the stream, not its worker: nothing would run
            raise UsageError(f"emulated device {self.index}: this stream was made in process {self.pid}, before a "
                             f"fork; make communicators (and their streams) in the process that uses them")
        self.queue.put(fn)

    def record(self) -> Event:
        event = Event()
        self.submit(event._done.set)
        return event

    def wait_event(self, event: Event) -> None:
        self.submit(event.synchronize)

    def synchronize(self) -> None:
        self.record().synchronize()
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure


# -- kernels ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostKernel:
    """A kernel built for the emulated device: its library and what it was built from."""

    path: Path
    layout: object
    dtype: str
    op: str
    cache_hit: bool
    lib: ctypes.CDLL

    def launch(self, args_ptr: int, grid: int, block: int) -> None:
        if self.lib.msc_launch(args_ptr, grid, block) != 0:
            raise UsageError(f"the emulated device could not start {grid} x {block} threads for a launch "
                             f"(lower MSC_EMU_THREADS)")

    def path_counts(self) -> tuple[int, int]:
        """Elements the 16-byte path and the scalar path have moved in this library."""
        out = (ctypes.c_uint64 * 2)()
        self.lib.msc_path_counts(out)
        return int(out[0]), int(out[1])


_ENTRY_POINTS = ("msc_launch", "msc_args_size", "msc_path_counts", "msc_round")


def load(path: Path, layout, dtype: str, op: str, cache_hit: bool, args_size: int,
         image: bytes | None = None) -> HostKernel:
    """The kernel library: ``image`` (its bytes, as the cache checked them or
    the build made them), loaded from a private copy that no one else can
    swap; without ``image``, the file at ``path`` (the caller's own)."""
    try:
        lib = ctypes.CDLL(str(path)) if image is None else _load_private(image)
    except OSError as exc:
        raise UsageError(f"the emulated device cannot load the kernel library {path}: {exc}") from None
    missing = [name for name in _ENTRY_POINTS if not hasattr(lib, name)]
    if missing:
        raise UsageError(f"{path} is not a kernel library msc built: it lacks {', '.join(missing)} (delete "
                         f"{path.parent}; msc builds it again)")
    lib.msc_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.msc_launch.restype = ctypes.c_int
    lib.msc_args_size.restype = ctypes.c_int64
    lib.msc_path_counts.argtypes = [ctypes.c_void_p]
    lib.msc_round.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    size = lib.msc_args_size()
    if size != args_size:
        raise UsageError(f"the kernel in {path} takes a {size}-byte MscArgs, msc packs {args_size}: the library "
                         f"and this msc disagree (clear {path.parent})")
    return HostKernel(path, layout, dtype, op, cache_hit, lib)


_PRIVATE_FDS: list[int] = []         # memory files of loaded libraries, open for good (see _load_private)


def _load_private(image: bytes) -> ctypes.CDLL:
    """dlopen ``image`` from an anonymous memory file (memfd), else from a
    temporary file of this user's (0600, in a sticky /tmp) removed once
    loaded. The memory file stays open: the loader knows a library by its
    path, and a later /proc/self/fd/N that reused the number would get this one."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("msc-kernel", os.MFD_CLOEXEC)
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(image)
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
            _PRIVATE_FDS.append(fd)
            return lib
        except OSError:
            os.close(fd)              # no /proc, or memory files are not executable here: a file
    fd, name = tempfile.mkstemp(prefix="msc-kernel-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        return ctypes.CDLL(name)
    finally:
        os.unlink(name)


# -- IPC: shared memory files where CUDA IPC handles would be -----------------------------------
class ShmIpc:
    """The torchrun bootstrap's IPC for the emulated device: a handle says
    where peers open an allocation's memory file (pid, fd, and a token its
    name carries) and its size."""

    def __init__(self, memory: HostMemory):
        self.memory = memory

    def export(self, ptr: int) -> bytes:
        m = self.memory.maps.get(ptr)
        if m is None or m.name is None:
            raise UsageError(f"emulated device memory {ptr:#x} is not shareable")
        raw = m.name.encode() + b"\0" + m.size.to_bytes(8, "little")
        if len(raw) > IPC_HANDLE_BYTES:
            raise UsageError(f"shared memory name {m.name!r} is too long for a handle")
        return raw.ljust(IPC_HANDLE_BYTES, b"\0")

    def open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise UsageError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        name, _, rest = handle.partition(b"\0")
        return self.memory.attach(name.decode(), int.from_bytes(rest[:8], "little"))

    def close(self, ptr: int) -> None:
        self.memory.free(ptr)

    def settle(self, ptr: int) -> None:
        """Every peer has mapped our allocation: its file may close."""
        self.memory.unlink(ptr)


# -- the device -----------------------------------------------------------------------------------
class EmuBackend:
    """The emulated device, as msc.cuda.runtime.Communicator drives it (the
    methods msc.cuda.backend.CudaBackend has for a real GPU)."""

    name = "emu"
    host_tensors = True          # tensors live in host memory: results are read after synchronize()
    group_in_arena = True        # switch group memory: in each member's arena (msc.cuda.groups)

    def __init__(self):
        self.memory = HostMemory()
        self.streams: dict[int, Stream] = {}
        self._current = 0
        self._lock = threading.Lock()

    # devices
    def require(self) -> None:
        from msc.cuda.hostbuild import find_compiler

        find_compiler()

    def current(self) -> int:
        return self._current

    def count(self) -> int:
        return DEVICES

    def bind(self, index: int) -> None:
        self._current = index

    def context(self, index: int):
        return nullcontext()

    def tensor_device(self, index: int) -> str:
        return "cpu"

    def arch(self, index: int) -> str:
        return "host"

    def can_access_peer(self, a: int, b: int) -> bool:
        return True

    def enable_peer_access(self, a: int, b: int) -> None:
        pass

    def describe_device(self, index: int) -> str:
        return f"emulated device {index}"

    def check_switch(self, placement: str, devices) -> None:
        """Switch plans run in every placement here: the group's memory is the members' arenas,
        which every placement maps (no multicast objects, no capability to check)."""

    # kernels
    def compile(self, plan, *, dtype: str, op: str, form: str, collective, cache, allow_deadlock: bool):
        from msc.cuda.compiler import compile_host

        return compile_host(plan, dtype=dtype, op=op, form=form, collective=collective, cache=cache,
                            allow_deadlock=allow_deadlock, sanitize=os.environ.get("MSC_EMU_SANITIZE") or None)

    def load(self, compiled, args_size: int):
        return load(compiled.library, compiled.layout, compiled.dtype, compiled.op, compiled.cache_hit, args_size,
                    compiled.image)

    def resident_blocks(self, kernel, nthreads: int, index: int) -> int | None:
        return None                         # threads, not SMs: any grid is resident at once

    def block_threads(self, gpu_threads: int) -> int:
        return threads_per_block(gpu_threads)

    # tensors
    def describe(self, t) -> TensorDesc:
        return describe_host(t)

    def empty(self, like, numel: int):
        return empty_like(like, numel)

    # streams
    def capturing(self) -> bool:
        return False

    def stream(self, index: int) -> Stream:
        with self._lock:
            s = self.streams.get(index)
            if s is None:
                s = self.streams[index] = Stream(index)
        return s

    def wait(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def record(self, stream: Stream) -> Event:
        return stream.record()

    def upload(self, index: int, data: bytes, capturing: bool):
        """A copy of ``data`` in host memory, made now (it precedes every launch
        queued after it; no stream, so a constructor that uploads starts no thread)."""
        buf = ctypes.create_string_buffer(data, len(data))
        return ctypes.addressof(buf), buf

    def uploaded(self, index: int) -> None:
        return None             # uploads are host copies, done when upload() returns

    def launch(self, index: int, stream: Stream, grid: int, block: int, kernel: HostKernel, args_ptr: int,
               keep=()) -> None:
        """Queue the launch; ``keep`` (the arguments block, the call's tensors)
        stays alive until it has run, as a GPU's allocator would keep them."""
        stream.submit(lambda: (kernel.launch(args_ptr, grid, block), keep))

    def snapshot(self, index: int, stream: Stream, ptr: int, nbytes: int, previous=None):
        """A copy of device bytes taken in stream order: (buffer, event)."""
        buf = previous if previous is not None and len(previous) == nbytes else ctypes.create_string_buffer(nbytes)
        stream.submit(lambda: ctypes.memmove(buf, ptr, nbytes))
        return buf, stream.record()

    @staticmethod
    def snapshot_bytes(buf) -> bytes:
        return bytes(buf.raw)

    def synchronize(self, index: int) -> None:
        self.stream(index).synchronize()

    # memory
    def alloc(self, index: int, nbytes: int, *, shared: bool = False) -> int:
        return self.memory.alloc(nbytes, shared)

    def zero(self, index: int, ptr: int, nbytes: int, stream: Stream) -> None:
        stream.submit(lambda: ctypes.memset(ptr, 0, nbytes))

    def copy(self, index: int, dst: int, src: int, nbytes: int, stream: Stream, keep=()) -> None:
        """A stream-ordered copy between device buffers (``keep`` alive until it has run)."""
        stream.submit(lambda: (ctypes.memmove(dst, src, nbytes), keep))

    def free(self, index: int, ptr: int) -> None:
        self.memory.free(ptr)

    def read(self, index: int, ptr: int, nbytes: int) -> bytes:
        return ctypes.string_at(ptr, nbytes)

    def write(self, index: int, ptr: int, data: bytes) -> None:
        """For tests: poke device memory (counters, slots) between launches."""
        ctypes.memmove(ptr, data, len(data))

    def ipc(self) -> ShmIpc:
        return ShmIpc(self.memory)

    def host_id(self) -> str:
        return _host_id()

    def device_id(self, index: int) -> str:
        return f"emu:{index}"

    def reach(self, index: int):
        return None             # host memory: every emulated device reaches every other

    def shared(self) -> str | None:
        return None             # host threads: ranks' blocks on one emulated device all run at once


def _host_id() -> str:
    """Processes that can open each other's memory files share this: the
    host name, the boot id, and the PID namespace (/proc/<pid> must be the peer)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        pids = os.readlink("/proc/self/ns/pid")
    except OSError:
        pids = ""
    return f"{os.uname().nodename}/{boot}/{pids}"


# -- host tensors -------------------------------------------------------------------------------
def describe_host(t) -> TensorDesc:
    """A numpy array's or a CPU torch tensor's description."""
    if hasattr(t, "__array_interface__") and hasattr(t, "ctypes"):          # numpy
        return TensorDesc(t.dtype.name, "cpu", int(t.size), bool(t.flags.c_contiguous), int(t.ctypes.data),
                          int(t.itemsize))
    if hasattr(t, "data_ptr"):                                                # torch
        return TensorDesc(str(t.dtype).removeprefix("torch."), str(t.device), int(t.numel()),
                          bool(t.is_contiguous()), int(t.data_ptr()), int(t.element_size()))
    raise UsageError(f"the emulated device takes numpy arrays or CPU torch tensors, got {type(t).__name__}")


def empty_like(like, numel: int):
    if hasattr(like, "__array_interface__") and hasattr(like, "ctypes"):
        import numpy as np

        return np.empty(numel, dtype=like.dtype)
    import torch

    return torch.empty(numel, dtype=like.dtype, device=like.device)


_DEFAULT: EmuBackend | None = None


def backend() -> EmuBackend:
    """The process's emulated device (one, like a process's GPUs)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = EmuBackend()
    return _DEFAULT


def _after_fork_in_child() -> None:
    """A forked child gets new streams on first use: the parent's workers
    are not copied by fork (its old Stream objects refuse work, see submit)."""
    if _DEFAULT is not None:
        _DEFAULT.streams = {}
        _DEFAULT._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
