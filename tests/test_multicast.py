"""The multicast object's orchestration (msc.cuda.multicast) with a fake
driver that records every call, members running as threads of this process
with a gather between them, and the real descriptor passing
(msc.cuda.fdpass: the fake exports a real memory file whose contents name
the handle, so an importer that gets the right handle got the fd over the
socket). Checked: the capability check (each missing capability, its
message, naming the device); the order of calls (member 0 creates, every
member adds its device before any member binds, sizes rounded to the
granularities); every member raising when one fails, with exactly its own
completed steps undone, last first; close() undoing everything.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from msc.cuda import fdpass
from patience import join, patience
from msc.cuda.multicast import (DeviceFacts, GroupBuffer, capability_problems, check_multicast, open_group_buffer,
                                rounded_size)
from msc.errors import CapabilityError, UsageError

MIB = 1 << 20
GOOD = DeviceFacts(0, "NVIDIA H100 80GB HBM3", (9, 0), True, True, True)


class FakeDriver:
    """Records (member, call, args) for every call in one shared log; handles are ints."""

    def __init__(self, members: int, *, facts=None, version=12080, fail: tuple[str, int] | None = None,
                 slow: tuple[str, int] | None = None):
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.facts = facts or {}
        self.version = version
        self.fail = fail                    # (call, device): that call raises on that device
        self.slow = slow                    # (call, device): that call takes 0.3 s there (others may overtake it)
        self.next = 100
        self.live: set = set()             # handles and address ranges not yet released
        self.members = members

    def member_of(self, index: int) -> int:
        return index                        # member m runs on device m in these tests

    def _record(self, index: int, name: str, *args):
        if self.slow == (name, index):
            time.sleep(0.3)
        with self.lock:
            self.log.append((self.member_of(index), name, args))
            if self.fail == (name, index):
                raise RuntimeError(f"{name} failed on device {index} (fake)")

    def _new(self) -> int:
        with self.lock:
            self.next += 1
            return self.next

    # each method takes the device of the member calling it through a thread-local
    def _dev(self) -> int:
        return threading.current_thread().device

    def driver_version(self):
        return self.version

    def device_facts(self, index):
        self._record(index, "device_facts", index)
        return self.facts.get(index, DeviceFacts(index, GOOD.name, (9, 0), True, True, True))

    def mc_granularity(self, size, members, recommended):
        self._record(self._dev(), "mc_granularity", size, members, recommended)
        return 512 * MIB if recommended else 2 * MIB

    def mem_granularity(self, index):
        self._record(index, "mem_granularity", index)
        return 2 * MIB

    def mc_create(self, size, members):
        self._record(self._dev(), "mc_create", size, members)
        h = self._new()
        self.live.add(("handle", h))
        return h

    def export_fd(self, handle):
        self._record(self._dev(), "export_fd", handle)
        fd = os.memfd_create("fake-mc")
        os.write(fd, str(handle).encode())
        return fd

    def import_fd(self, fd):
        # pread: the members' descriptors share one file offset (threads of one process, descriptors of one
        # memfd), so a seek and a read of one member could see another's read move it to the end
        handle = int(os.pread(fd, 64, 0))
        self._record(self._dev(), "import_fd", handle)
        self.live.add(("import", self._dev(), handle))
        return handle

    def mc_add_device(self, handle, index):
        self._record(index, "mc_add_device", handle, index)

    def mem_create(self, size, index):
        self._record(index, "mem_create", size, index)
        h = self._new()
        self.live.add(("handle", h))
        return h

    def mc_bind(self, mc, mem, size):
        self._record(self._dev(), "mc_bind", mc, mem, size)

    def mc_unbind(self, mc, index, size):
        self._record(index, "mc_unbind", mc, index, size)

    def reserve(self, size, alignment):
        self._record(self._dev(), "reserve", size, alignment)
        va = self._new() * (1 << 32)
        self.live.add(("va", va))
        return va

    def map(self, va, size, handle):
        self._record(self._dev(), "map", va, size, handle)
        self.live.add(("map", va))

    def set_access(self, va, size, index):
        self._record(index, "set_access", va, size, index)

    def unmap(self, va, size):
        self._record(self._dev(), "unmap", va, size)
        self.live.discard(("map", va))

    def free_va(self, va, size):
        self._record(self._dev(), "free_va", va, size)
        self.live.discard(("va", va))

    def release(self, handle):
        self._record(self._dev(), "release", handle)
        self.live.discard(("handle", handle))
        self.live.discard(("import", self._dev(), handle))

    def calls(self, member: int) -> list[str]:
        return [name for m, name, _ in self.log if m == member]


class ThreadGather:
    """gather(tag, obj) between n threads of this process."""

    def __init__(self, n: int):
        self.n, self.cond, self.boards = n, threading.Condition(), {}

    def for_member(self, member: int):
        def gather(tag, obj):
            with self.cond:
                board = self.boards.setdefault(tag, {})
                board[member] = obj
                self.cond.notify_all()
                if not self.cond.wait_for(lambda: len(board) == self.n, timeout=patience(30)):
                    raise TimeoutError(f"gather {tag}: only {sorted(board)} came")
                return [board[m] for m in range(self.n)]
        return gather


def run_group(n: int, driver: FakeDriver, nbytes: int = 3 * MIB, sizes=None):
    """Every member's GroupBuffer or exception, in member order."""
    gather = ThreadGather(n)
    results: list = [None] * n

    def member(m):
        threading.current_thread().device = m
        try:
            results[m] = open_group_buffer(m, n, m, sizes[m] if sizes else nbytes, gather=gather.for_member(m),
                                           driver=driver, timeout_s=patience(10))
        except Exception as exc:
            results[m] = exc
    threads = [threading.Thread(target=member, args=(m,)) for m in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        join(t, 60)
    assert not any(t.is_alive() for t in threads)
    return results


def close_all(driver: FakeDriver, buffers: list[GroupBuffer]):
    def closer(m, b):
        threading.current_thread().device = m
        b.close()
    threads = [threading.Thread(target=closer, args=(m, b)) for m, b in enumerate(buffers)]
    for t in threads:
        t.start()
    for t in threads:
        join(t, 30)


# -- the capability check ---------------------------------------------------------------------
@pytest.mark.parametrize("facts,version,words", [
    (GOOD, 12000, ["driver is 12.0", "need 12.1 or later"]),
    (DeviceFacts(0, "NVIDIA A100-SXM4-80GB", (8, 0), True, True, True), 12080, ["compute capability is 8.0",
                                                                               "9.0 (Hopper)"]),
    (DeviceFacts(0, "NVIDIA H100 PCIe", (9, 0), False, True, True), 12080, ["CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"]),
    (DeviceFacts(0, GOOD.name, (9, 0), True, False, True), 12080, ["POSIX_FILE_DESCRIPTOR_SUPPORTED is 0"]),
    (DeviceFacts(0, GOOD.name, (9, 0), True, True, False), 12080, ["VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0"]),
])
def test_each_missing_capability_is_named(facts, version, words):
    driver = FakeDriver(1, facts={0: facts}, version=version)
    with pytest.raises(CapabilityError) as err:
        check_multicast(driver, 0)
    text = str(err.value)
    assert f"GPU 0 ({facts.name})" in text and "no fallback" in text
    for w in words:
        assert w in text
    assert err.value.device == f"GPU 0 ({facts.name})" and len(err.value.missing) == 1


def test_everything_missing_lists_everything():
    facts = DeviceFacts(3, "Tesla V100", (7, 0), False, False, False)
    assert len(capability_problems(facts, 11040)) == 5


def test_a_capable_device_passes():
    assert check_multicast(FakeDriver(1, facts={0: GOOD}), 0) == GOOD


def test_sizes_round_to_granularity():
    assert rounded_size(3 * MIB, 2 * MIB, 512 * MIB, 2 * MIB) == 4 * MIB
    assert rounded_size(513 * MIB, 2 * MIB, 512 * MIB, 2 * MIB) == 1024 * MIB
    assert rounded_size(1, 2 * MIB, 512 * MIB, 3 * MIB) == 6 * MIB                 # both granules
    with pytest.raises(UsageError):
        rounded_size(0, 2 * MIB, 512 * MIB, 2 * MIB)


# -- the group --------------------------------------------------------------------------------
def test_group_buffer_call_order():
    n = 4
    driver = FakeDriver(n, slow=("mc_add_device", 0))        # the others must still wait for member 0's add
    fds_before = set(os.listdir("/proc/self/fd"))
    buffers = run_group(n, driver, nbytes=3 * MIB)
    assert all(isinstance(b, GroupBuffer) for b in buffers), buffers
    assert {b.size for b in buffers} == {4 * MIB}
    # member 0 creates and exports; the others import that very handle (it came through the fd)
    created = [args for m, name, args in driver.log if name == "mc_create"]
    assert created == [(4 * MIB, n)]
    handle = next(args[0] for m, name, args in driver.log if name == "export_fd")
    assert sorted(m for m, name, args in driver.log if name == "import_fd" and args == (handle,)) == [1, 2, 3]
    # every member adds its device before any member binds memory
    names = [name for _, name, _ in driver.log]
    assert max(i for i, x in enumerate(names) if x == "mc_add_device") < min(i for i, x in enumerate(names)
                                                                                if x == "mc_bind")
    assert sorted(m for m, name, _ in driver.log if name == "mc_add_device") == list(range(n))
    for m in range(n):
        mine = [x for x in driver.calls(m) if x in ("mc_add_device", "mem_create", "mc_bind", "reserve", "map",
                                                     "set_access")]
        assert mine == ["mc_add_device", "mem_create", "mc_bind", "reserve", "map", "set_access", "reserve", "map",
                        "set_access"]
    for m, name, args in driver.log:
        if name in ("mem_create", "reserve", "map", "set_access", "mc_bind"):
            size = args[2] if name == "mc_bind" else (args[0] if name in ("mem_create", "reserve") else args[1])
            assert size == 4 * MIB
    assert all(b.mc and b.local and b.mc != b.local for b in buffers)
    close_all(driver, buffers)
    assert driver.live == set()
    for m in range(n):
        tail = driver.calls(m)[-7:]
        assert tail == ["unmap", "free_va", "unmap", "free_va", "mc_unbind", "release", "release"]
    assert set(os.listdir("/proc/self/fd")) == fds_before          # no descriptor left open


def test_a_member_of_two_groups_binds_its_one_memory_to_each_groups_object():
    """Devices 0 and 1 form group A, devices 0 and 2 group B (a rank in two switch groups): one
    multicast object per group; device 0 allocates and maps its memory once (group A's buffer)
    and binds that very allocation to B's object too; closing B then A unbinds B's, then releases."""
    driver = FakeDriver(3)
    gathers = {"A": ThreadGather(2), "B": ThreadGather(2)}
    opened: dict = {}

    def member(device, plan):
        threading.current_thread().device = device
        memory = None
        for name, m in plan:
            opened[name, device] = memory = open_group_buffer(
                m, 2, device, 3 * MIB, gather=gathers[name].for_member(m), driver=driver, tag=name, timeout_s=patience(10),
                memory=memory)
    threads = [threading.Thread(target=member, args=args) for args in
               ((0, (("A", 0), ("B", 0))), (1, (("A", 1),)), (2, (("B", 1),)))]
    for t in threads:
        t.start()
    for t in threads:
        join(t, 60)
    assert len(opened) == 4, opened
    a0, b0 = opened["A", 0], opened["B", 0]
    created = [args for _, name, args in driver.log if name == "mc_create"]
    assert len(created) == 2                                            # an object per group
    assert driver.calls(0).count("mem_create") == 1 and b0.mem == a0.mem and b0.local == a0.local
    binds = [args for m, name, args in driver.log if name == "mc_bind" and m == 0]
    assert [mem for _, mem, _ in binds] == [a0.mem, a0.mem] and binds[0][0] != binds[1][0]
    assert b0.mc and a0.mc and b0.mc != a0.mc
    assert driver.calls(0).count("map") == 3                            # A's object, the memory, B's object

    def close(device, *bufs):
        threading.current_thread().device = device
        for b in bufs:
            b.close()
    closers = [threading.Thread(target=close, args=(0, b0, a0)), threading.Thread(target=close, args=(1, opened["A", 1])),
               threading.Thread(target=close, args=(2, opened["B", 2]))]
    for t in closers:
        t.start()
    for t in closers:
        join(t, 30)
    assert driver.live == set()
    # B: its object's mapping, its bind, its object; then A: both mappings, its bind, the memory, its object
    assert driver.calls(0)[-11:] == ["unmap", "free_va", "mc_unbind", "release", "unmap", "free_va", "unmap", "free_va",
                                     "mc_unbind", "release", "release"]


def test_memory_of_another_group_must_cover_the_object():
    small = GroupBuffer(0, 2, 0, size=2 * MIB, local=1 << 32, mem=7)
    with pytest.raises(UsageError, match="member 0's memory of another switch group \\(2097152 bytes on device 0\\) "
                                         "cannot back this group's 4194304 bytes"):
        from msc.cuda.multicast import _bind_and_map
        _bind_and_map(GroupBuffer(0, 2, 0, size=4 * MIB), 5, FakeDriver(2), small)


def test_a_failed_bind_fails_every_member_and_undoes_each_ones_steps():
    n = 3
    driver = FakeDriver(n, fail=("mc_bind", 2))
    results = run_group(n, driver)
    assert isinstance(results[2], RuntimeError) and "mc_bind failed on device 2" in str(results[2])
    for m in (0, 1):
        assert isinstance(results[m], UsageError)
        assert "member(s) 2 of the switch group could not bind and map" in str(results[m])
        assert "mc_bind failed on device 2" in str(results[m])
    assert driver.live == set()                     # everything made was released
    # member 2 undid its memory and multicast import, nothing it had not made
    after = driver.calls(2)[driver.calls(2).index("mc_bind") + 1:]
    assert after == ["release", "release"]
    # member 0 undid its maps, the bind and the creation, in reverse order
    zero = driver.calls(0)
    assert zero[zero.index("set_access", zero.index("set_access") + 1) + 1:] == [
        "unmap", "free_va", "unmap", "free_va", "mc_unbind", "release", "release"]


def test_a_member_without_multicast_stops_the_group_before_any_allocation():
    n = 3
    lacking = DeviceFacts(1, "NVIDIA H100 PCIe", (9, 0), False, True, True)
    driver = FakeDriver(n, facts={1: lacking})
    results = run_group(n, driver)
    for r in results:
        assert isinstance(r, CapabilityError)
        assert "member 1" in str(r) and "GPU 1 (NVIDIA H100 PCIe)" in str(r)
    assert not [x for x in driver.log if x[1] in ("mc_create", "mem_create", "reserve")]


def test_members_asking_for_different_sizes_are_refused():
    driver = FakeDriver(2)
    results = run_group(2, driver, sizes=[MIB, 2 * MIB])
    for r in results:
        assert isinstance(r, UsageError) and "member 0 1048576 bytes, member 1 2097152 bytes" in str(r)
    assert not [x for x in driver.log if x[1] == "mc_create"]


def test_a_failed_create_is_raised_on_every_member():
    driver = FakeDriver(2, fail=("mc_create", 0))
    results = run_group(2, driver)
    assert isinstance(results[0], RuntimeError)
    assert isinstance(results[1], UsageError) and "member 0 of the switch group could not create" in str(results[1])
    assert driver.live == set()


# -- descriptor passing -----------------------------------------------------------------------
def test_fd_travels_over_the_socket():
    server = fdpass.FdServer()
    fd = os.memfd_create("fdpass-test")
    os.write(fd, b"the same file")
    got = []
    t = threading.Thread(target=lambda: got.append(fdpass.receive_fd(server.address, 10)))
    t.start()
    server.send(fd, [os.getpid()], 10)
    join(t, 10)
    server.close()
    assert got and got[0] != fd
    os.lseek(got[0], 0, os.SEEK_SET)
    assert os.read(got[0], 64) == b"the same file"                  # one file, two descriptors
    os.close(got[0])
    os.close(fd)


def test_fd_offer_to_an_unknown_process_times_out_naming_it():
    server = fdpass.FdServer()
    fd = os.memfd_create("fdpass-test")
    got = []
    t = threading.Thread(target=lambda: got.append(_receive_or_error(server.address)))
    t.start()
    with pytest.raises(UsageError, match=r"process\(es\) 999999999 never came"):
        server.send(fd, [999999999], 0.5)          # this process connects, but it is not the one expected
    server.close()
    join(t, 10)
    os.close(fd)
    assert isinstance(got[0], UsageError)           # and it got nothing


def _receive_or_error(address):
    try:
        return fdpass.receive_fd(address, 2)
    except UsageError as exc:
        return exc


def test_receive_from_nowhere_is_a_clear_error():
    with pytest.raises(UsageError, match="could not receive the multicast handle from @msc-fd-nobody"):
        fdpass.receive_fd("@msc-fd-nobody", 1)


# -- the group exchange's gather (msc.cuda.backend.CudaBackend.open_group) ---------------------------
def test_group_exchange_refuses_a_gather_over_every_process_when_the_store_is_missing(monkeypatch):
    """A switch group's members (one node of nvls_tree's per-node groups) number themselves 0..m-1
    among m members: only the job's key-value store can gather them. Without it the exchange must
    refuse by name, not fall back to torch.distributed's all_gather_object over every process of
    the job (the world's list, other groups' members mixed in, or a hang)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch.distributed as dist

    from msc.cuda import backend as backend_mod
    from msc.cuda import multicast

    def unreachable():
        raise RuntimeError("Default process group has not been initialized")

    opened = []
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", unreachable)
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("gathered over every process"))
    monkeypatch.setattr(backend_mod, "_torch", lambda: SimpleNamespace(cuda=SimpleNamespace(device=nullcontext)))
    monkeypatch.setattr(multicast, "CudaMulticast", lambda: None)
    monkeypatch.setattr(multicast, "open_group_buffer",
                        lambda member, members, index, nbytes, *, gather, **kw: opened.append(gather(0, member)))
    with pytest.raises(UsageError, match=r"member 1 of the switch group at 'job/group1/0'.* 2 members exchange "
                                         r"through torch.distributed's key-value store, which cannot be reached"):
        backend_mod.CudaBackend().open_group(3, 1, 2, MIB, prefix="job/group1/0", timeout_s=1.0)
    assert opened == []
