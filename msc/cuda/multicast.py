"""Multicast objects: one buffer that a group of GPUs on one NVSwitch domain
each back with their own memory, and whose multicast address lets a kernel
reduce every member's copy in the switch (multimem.ld_reduce) or store to all
of them (multimem.st): templates/multimem.cuh.j2.

What each member process does (``open_group_buffer``), as NCCL does it
(src/transport/nvls.cc, nvlsAllocateMem) and MSCCL++ (src/core/switch_channel.cc):

1. check the device (``check_multicast``): compute capability 9.0+, a
   driver with multicast objects (CUDA 12.1+), CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,
   POSIX file-descriptor handles and virtual memory management; what is
   missing raises CapabilityError naming the device. No fallback;
2. agree on the size: rounded up to the multicast granularity (the
   recommended one for buffers at least that large, else the minimum) and
   to the allocation granularity of cuMemCreate;
3. member 0 creates the object (cuMulticastCreate, POSIX fd handle type)
   and exports it (cuMemExportToShareableHandle); the fd travels to the
   others over a unix socket (msc.cuda.fdpass), which import it
   (cuMemImportFromShareableHandle);
4. every member adds its device (cuMulticastAddDevice), and all agree that
   every member has, before any binds memory;
5. each allocates its physical memory (cuMemCreate), binds it
   (cuMulticastBindMem), maps the multicast handle and its own memory
   (cuMemAddressReserve, cuMemMap, cuMemSetAccess) and all agree that every
   member is mapped before any kernel may use the buffer.

A rank in several switch groups (``memory=``): one multicast object per
group, and the rank's one physical allocation (its first group's) bound to
each of them, so that every group's switch reads and writes the same copy;
only the first group's buffer creates, maps and releases that memory.

Every step's result is agreed through the gather (each member publishes its
problem or None), so a failure on one member is raised on all of them, each
naming the member that failed, instead of leaving the others waiting. What
a member set up is undone in reverse order on error and by
``GroupBuffer.close`` (unmap, free the address ranges, unbind, release).

The driver calls are injected (``driver``: the MulticastDriver methods), as
msc.cuda.bootstrap injects IPC, so the orchestration is tested with a fake
driver that records calls (tests/test_multicast.py); ``CudaMulticast`` makes
the real calls through cuda.bindings and needs a GPU to run.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Protocol

from msc.errors import CapabilityError, UsageError

MIN_DRIVER = 12010           # CUDA 12.1: multicast objects (NCCL checks the same, src/transport/nvls.cc)
MIN_COMPUTE = (9, 0)         # multimem.* is sm_90+ (PTX ISA 9.7.9.14)


@dataclass(frozen=True)
class DeviceFacts:
    index: int
    name: str
    compute: tuple[int, int]
    multicast: bool           # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
    posix_fd: bool            # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    vmm: bool                 # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class MulticastDriver(Protocol):
    """The driver calls a member makes; handles and addresses are opaque to the orchestration."""

    def driver_version(self) -> int: ...
    def device_facts(self, index: int) -> DeviceFacts: ...
    def mc_granularity(self, size: int, members: int, recommended: bool) -> int: ...
    def mem_granularity(self, index: int) -> int: ...
    def mc_create(self, size: int, members: int): ...
    def export_fd(self, handle) -> int: ...
    def import_fd(self, fd: int): ...
    def mc_add_device(self, handle, index: int) -> None: ...
    def mem_create(self, size: int, index: int): ...
    def mc_bind(self, mc, mem, size: int) -> None: ...
    def mc_unbind(self, mc, index: int, size: int) -> None: ...
    def reserve(self, size: int, alignment: int) -> int: ...
    def map(self, va: int, size: int, handle) -> None: ...
    def set_access(self, va: int, size: int, index: int) -> None: ...
    def unmap(self, va: int, size: int) -> None: ...
    def free_va(self, va: int, size: int) -> None: ...
    def release(self, handle) -> None: ...


# -- the capability check ---------------------------------------------------------------------
def capability_problems(facts: DeviceFacts, driver_version: int) -> list[str]:
    """What GPU ``facts`` (under a driver of ``driver_version``, as cuDriverGetVersion gives it) lacks for NVLS."""
    missing = []
    if driver_version < MIN_DRIVER:
        missing.append(f"the CUDA driver is {driver_version // 1000}.{driver_version % 1000 // 10}; multicast objects "
                       f"need {MIN_DRIVER // 1000}.{MIN_DRIVER % 1000 // 10} or later")
    if facts.compute < MIN_COMPUTE:
        missing.append(f"its compute capability is {facts.compute[0]}.{facts.compute[1]}; multimem instructions need "
                       f"{MIN_COMPUTE[0]}.{MIN_COMPUTE[1]} (Hopper) or later")
    if not facts.multicast:
        missing.append("the driver reports no multicast support for it (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0): "
                       "NVLS needs GPUs joined by NVSwitches that offer it")
    if not facts.posix_fd:
        missing.append("it cannot share memory as POSIX file descriptors "
                       "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)")
    if not facts.vmm:
        missing.append("it has no virtual memory management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED "
                       "is 0)")
    return missing


def describe_device(facts: DeviceFacts) -> str:
    return f"GPU {facts.index} ({facts.name})"


def check_multicast(driver: MulticastDriver, index: int) -> DeviceFacts:
    """GPU ``index``'s facts; CapabilityError naming it and all it lacks for NVLS (no fallback)."""
    facts = driver.device_facts(index)
    missing = capability_problems(facts, driver.driver_version())
    if missing:
        raise CapabilityError(f"NVLink SHARP (switch reduction) is not available on {describe_device(facts)}: "
                              + "; ".join(missing) + ". msc has no fallback for switch operations",
                              device=describe_device(facts), missing=tuple(missing))
    return facts


def rounded_size(nbytes: int, minimum: int, recommended: int, allocation: int) -> int:
    """``nbytes`` rounded up to whole multicast granules (the recommended granule for
    buffers at least that large, the minimum below) that are also whole allocation granules."""
    if nbytes < 1:
        raise UsageError(f"a multicast buffer needs at least one byte, got {nbytes}")
    unit = math.lcm(recommended if nbytes >= recommended else minimum, allocation)
    return -(-nbytes // unit) * unit


# -- the group's buffer ------------------------------------------------------------------------
@dataclass
class GroupBuffer:
    """One member's view of a multicast buffer: ``mc`` the multicast address
    (multimem.* only), ``local`` its own copy (unicast), ``size`` bytes, ``mem`` the
    physical allocation bound (owned by the buffer that created it)."""

    member: int
    members: int
    device: int
    size: int = 0
    mc: int = 0
    local: int = 0
    mem: object = None
    undo: list[tuple[str, Callable[[], None]]] = field(default_factory=list, repr=False)

    def close(self) -> None:
        """Undo every step this member made, last first; the first failure is raised after the rest ran."""
        first = None
        while self.undo:
            _, fn = self.undo.pop()
            try:
                fn()
            except Exception as exc:             # keep releasing: one stuck handle must not leak the others
                first = first or exc
        if first is not None:
            raise first


@dataclass(frozen=True)
class Joined:
    member: int
    pid: int
    host: str
    nbytes: int
    device: str
    problem: str | None


def open_group_buffer(member: int, members: int, device: int, nbytes: int, *, gather, driver: MulticastDriver,
                      host: str = "", tag: str = "switch", timeout_s: float = 60.0, fds=None,
                      memory: GroupBuffer | None = None) -> GroupBuffer:
    """This member's GroupBuffer of a multicast buffer of at least ``nbytes``
    bytes shared by ``members`` processes (member 0 creates it). ``gather(tag,
    obj) -> [obj of member 0, ...]`` as msc.cuda.bootstrap's; every member must
    call this with the same ``members``, ``nbytes`` and ``tag``. ``fds``: the
    descriptor transport (msc.cuda.fdpass by default). ``memory``: this member's
    buffer of another group, whose physical memory to bind instead of allocating
    (its ``local`` is this one's too; close this buffer before that one)."""
    if not 0 <= member < members:
        raise UsageError(f"member {member} of a switch group of {members}")
    if fds is None:
        from msc.cuda import fdpass as fds
    buf = GroupBuffer(member, members, device)
    try:
        pids = _join(buf, nbytes, gather=gather, driver=driver, host=host, tag=tag)
        mc = _share_object(buf, nbytes, pids, gather=gather, driver=driver, tag=tag, timeout_s=timeout_s, fds=fds)
        _, exc = _attempt(lambda: driver.mc_add_device(mc, device))
        _agree(gather, f"{tag}/added", exc, "add its device")          # every member added before any binds
        _, exc = _attempt(lambda: _bind_and_map(buf, mc, driver, memory))
        _agree(gather, f"{tag}/mapped", exc, "bind and map its memory")
    except BaseException:
        buf.close()
        raise
    return buf


def _join(buf: GroupBuffer, nbytes: int, *, gather, driver, host: str, tag: str) -> list[int]:
    """Publish this member (and what its device lacks); raise on every member alike if any
    member cannot take part or the calls differ. The members' pids, in member order."""
    try:
        facts = check_multicast(driver, buf.device)
        problem, name = None, describe_device(facts)
    except CapabilityError as exc:
        problem, name = str(exc), exc.device
    everyone = gather(f"{tag}/join", Joined(buf.member, os.getpid(), host, nbytes, name, problem))
    if len(everyone) != buf.members:
        raise UsageError(f"the switch group has {buf.members} members, the gather {len(everyone)}")
    for m, j in enumerate(everyone):
        if j.member != m:
            raise UsageError(f"member {m} of the switch group published itself as member {j.member}")
    lacking = [j for j in everyone if j.problem]
    if lacking:
        names = "; ".join(f"member {j.member}: {j.problem}" for j in lacking)
        raise CapabilityError(f"the switch group cannot be made: {names}", device=lacking[0].device,
                              missing=tuple(j.problem for j in lacking))
    sizes = {j.nbytes for j in everyone}
    if len(sizes) > 1:
        raise UsageError("the switch group's members asked for different sizes: "
                         + ", ".join(f"member {j.member} {j.nbytes} bytes" for j in everyone))
    hosts = {j.host for j in everyone}
    if len(hosts) > 1:
        raise UsageError("a switch group lives in one machine's NVLink domain, and its members run on "
                         + ", ".join(f"member {j.member} on {j.host or 'an unnamed host'}" for j in everyone))
    return [j.pid for j in everyone]


@dataclass
class _Offer:
    """Member 0's multicast object on offer: its handle, exported fd and the socket serving it."""

    handle: object
    size: int
    fd: int = -1
    server: object = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.fd >= 0:
            os.close(self.fd)
        self.server, self.fd = None, -1


def _share_object(buf: GroupBuffer, nbytes: int, pids: list[int], *, gather, driver, tag: str, timeout_s: float,
                  fds):
    """Member 0 creates the multicast object and offers its fd; the others import it. The handle."""
    offer, exc = _attempt(lambda: _create(buf, nbytes, driver, fds)) if buf.member == 0 else (None, None)
    if buf.member == 0:
        published = "!" + str(exc) if exc else (offer.server.address, offer.size)
    root = gather(f"{tag}/offer", published if buf.member == 0 else None)[0]
    if exc is not None:
        raise exc
    if isinstance(root, str):
        raise UsageError(f"member 0 of the switch group could not create the multicast object: {root[1:]}")
    address, buf.size = root
    if buf.member == 0:
        _, exc = _attempt(lambda: offer.server.send(offer.fd, pids[1:], timeout_s))
        offer.close()
        handle = offer.handle
    else:
        handle, exc = _attempt(lambda: _import(buf, address, driver, fds, timeout_s))
    _agree(gather, f"{tag}/shared", exc, "share the multicast object")
    return handle


def _create(buf: GroupBuffer, nbytes: int, driver, fds) -> _Offer:
    """Member 0: size the object, create it, export it, listen."""
    minimum = driver.mc_granularity(nbytes, buf.members, False)
    recommended = driver.mc_granularity(nbytes, buf.members, True)
    offer = _Offer(None, rounded_size(nbytes, minimum, recommended, driver.mem_granularity(buf.device)))
    offer.handle = driver.mc_create(offer.size, buf.members)
    buf.undo.append(("release multicast", lambda: driver.release(offer.handle)))
    try:
        offer.fd = driver.export_fd(offer.handle)
        offer.server = fds.FdServer()
    except BaseException:
        offer.close()
        raise
    return offer


def _import(buf: GroupBuffer, address: str, driver, fds, timeout_s: float):
    fd = fds.receive_fd(address, timeout_s)
    try:
        handle = driver.import_fd(fd)
    finally:
        os.close(fd)
    buf.undo.append(("release multicast", lambda: driver.release(handle)))
    return handle


def _bind_and_map(buf: GroupBuffer, mc, driver, memory: GroupBuffer | None = None) -> None:
    size, dev = buf.size, buf.device
    if memory is not None and (memory.device != dev or memory.size < size or not memory.mem):
        raise UsageError(f"member {buf.member}'s memory of another switch group ({memory.size} bytes on device "
                         f"{memory.device}) cannot back this group's {size} bytes on device {dev}")
    if memory is None:
        mem = driver.mem_create(size, dev)
        buf.undo.append(("release memory", lambda: driver.release(mem)))
    else:
        mem = memory.mem                 # another group's member buffer owns, maps and releases it
    buf.mem = mem
    driver.mc_bind(mc, mem, size)
    buf.undo.append(("unbind", lambda: driver.mc_unbind(mc, dev, size)))
    buf.mc = _map(buf, mc, driver.mc_granularity(size, buf.members, False), driver)
    buf.local = _map(buf, mem, driver.mem_granularity(dev), driver) if memory is None else memory.local


def _map(buf: GroupBuffer, handle, alignment: int, driver) -> int:
    va = driver.reserve(buf.size, alignment)
    buf.undo.append(("free address range", lambda: driver.free_va(va, buf.size)))
    driver.map(va, buf.size, handle)
    buf.undo.append(("unmap", lambda: driver.unmap(va, buf.size)))
    driver.set_access(va, buf.size, buf.device)
    return va


def _attempt(fn) -> tuple[object, Exception | None]:
    """(fn's result, None), or (None, its exception): a step's outcome, to publish before raising."""
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


def _agree(gather, tag: str, exc: Exception | None, what: str) -> None:
    """Publish this member's outcome of a step; raise on every member if any failed
    (this member's own exception where it is one of them)."""
    everyone = gather(tag, None if exc is None else f"{type(exc).__name__}: {exc}")
    failed = [(m, p) for m, p in enumerate(everyone) if p is not None]
    if exc is not None:
        raise exc
    if failed:
        names = "; ".join(f"member {m}: {p}" for m, p in failed)
        raise UsageError(f"member(s) {', '.join(str(m) for m, _ in failed)} of the switch group could not {what}: "
                         f"{names}")


# -- the real driver ----------------------------------------------------------------------------
class CudaMulticast:
    """MulticastDriver through cuda.bindings (msc.cuda.device.call checks every status).
    Needs a GPU: exercised only on one (the names and signatures were checked against
    cuda-bindings 13.5 without a driver)."""

    def __init__(self):
        from cuda.bindings import driver

        self.d = driver
        self.fd_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    def _call(self, fn, *args):
        from msc.cuda.device import call

        return call(fn, *args)

    def _device(self, index: int):
        return self._call(self.d.cuDeviceGet, index)

    def driver_version(self) -> int:
        return int(self._call(self.d.cuDriverGetVersion))

    def device_facts(self, index: int) -> DeviceFacts:
        d, dev = self.d, self._device(index)
        attr = d.CUdevice_attribute

        def get(a) -> int:
            return int(self._call(d.cuDeviceGetAttribute, a, dev))

        raw = self._call(d.cuDeviceGetName, 256, dev)
        name = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("\0")[0].strip()
        return DeviceFacts(index, name, (get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                         get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
                           bool(get(attr.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)),
                           bool(get(attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)),
                           bool(get(attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)))

    def _mc_prop(self, size: int, members: int):
        prop = self.d.CUmulticastObjectProp()
        prop.numDevices, prop.size, prop.handleTypes, prop.flags = members, size, self.fd_type, 0
        return prop

    def mc_granularity(self, size: int, members: int, recommended: bool) -> int:
        flags = self.d.CUmulticastGranularity_flags
        option = flags.CU_MULTICAST_GRANULARITY_RECOMMENDED if recommended else flags.CU_MULTICAST_GRANULARITY_MINIMUM
        return int(self._call(self.d.cuMulticastGetGranularity, self._mc_prop(size, members), option))

    def _mem_prop(self, index: int):
        d = self.d
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        prop.requestedHandleTypes = self.fd_type
        return prop

    def mem_granularity(self, index: int) -> int:
        option = self.d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._call(self.d.cuMemGetAllocationGranularity, self._mem_prop(index), option))

    def mc_create(self, size: int, members: int):
        return self._call(self.d.cuMulticastCreate, self._mc_prop(size, members))

    def export_fd(self, handle) -> int:
        return int(self._call(self.d.cuMemExportToShareableHandle, handle, self.fd_type, 0))

    def import_fd(self, fd: int):
        return self._call(self.d.cuMemImportFromShareableHandle, fd, self.fd_type)

    def mc_add_device(self, handle, index: int) -> None:
        self._call(self.d.cuMulticastAddDevice, handle, self._device(index))

    def mem_create(self, size: int, index: int):
        return self._call(self.d.cuMemCreate, size, self._mem_prop(index), 0)

    def mc_bind(self, mc, mem, size: int) -> None:
        self._call(self.d.cuMulticastBindMem, mc, 0, mem, 0, size, 0)

    def mc_unbind(self, mc, index: int, size: int) -> None:
        self._call(self.d.cuMulticastUnbind, mc, self._device(index), 0, size)

    def reserve(self, size: int, alignment: int) -> int:
        return int(self._call(self.d.cuMemAddressReserve, size, alignment, self.d.CUdeviceptr(0), 0))

    def map(self, va: int, size: int, handle) -> None:
        self._call(self.d.cuMemMap, self.d.CUdeviceptr(va), size, 0, handle, 0)

    def set_access(self, va: int, size: int, index: int) -> None:
        d = self.d
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._call(d.cuMemSetAccess, d.CUdeviceptr(va), size, [desc], 1)

    def unmap(self, va: int, size: int) -> None:
        self._call(self.d.cuMemUnmap, self.d.CUdeviceptr(va), size)

    def free_va(self, va: int, size: int) -> None:
        self._call(self.d.cuMemAddressFree, self.d.CUdeviceptr(va), size)

    def release(self, handle) -> None:
        self._call(self.d.cuMemRelease, handle)
