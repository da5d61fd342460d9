"""The first GPU run's NVLS stage (bench/first_gpu_nvls.py: nvls_stage) without a GPU: its logic
against fakes of the driver calls it makes (tests/test_multicast.py's FakeDriver for the multicast object, and
a fake device whose memory, module loads and probe launches this file models: the probe's
modes on one member, where a switch reduce is the value itself). Checked: every outcome is a
recorded case (supported, not supported with the attribute read, failed with the error) and
none escapes; the buffer regions the probe writes are read back bit for bit; the second object
binds the first's allocation; everything made is released and every module unloaded. What the
stage checks on a real GPU is in the script's module doc (stage 5)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import first_gpu_nvls as fgr                                      # noqa: E402
from budgeted import Alarm, Record, Stage                         # noqa: E402
from first_gpu_checks import Run, plan_of                         # noqa: E402
from msc.cuda.multicast import DeviceFacts                       # noqa: E402
from test_multicast import GOOD, FakeDriver                      # noqa: E402


class FakeDevice:
    """GpuSwitchTools' methods on host memory: a physical allocation is a bytearray; a mapped
    address resolves to (allocation, offset), a multicast address to its one bound member's."""

    def __init__(self, driver: FakeDriver, *, corrupt: bool = False):
        self.driver, self.corrupt = driver, corrupt
        self.loaded: set = set()
        self.launches: list = []
        self.compiled: list = []

    def _memory(self):
        """va -> (allocation bytes, size) from the driver's log of maps and binds."""
        bound, arrays, maps = {}, getattr(self, "_arrays", {}), {}
        for _, name, args in self.driver.log:
            if name == "mem_create":
                arrays.setdefault(("mem", len(arrays)), None)
            if name == "mc_bind":
                bound[args[0]] = args[1]
            if name == "map":
                maps[args[0]] = (args[2], args[1])
        self._arrays = arrays
        return bound, maps

    def _at(self, addr: int):
        bound, maps = self._memory()
        for va, (handle, size) in maps.items():
            if va <= addr < va + size:
                mem = bound.get(handle, handle)                 # a multicast handle: its one member's memory
                store = self.__dict__.setdefault("store", {})
                return store.setdefault(mem, bytearray(size)), addr - va
        raise AssertionError(f"address {addr:#x} is not mapped")

    def write(self, ptr, data):
        buf, off = self._at(ptr)
        buf[off:off + len(data)] = data

    def read(self, ptr, nbytes):
        buf, off = self._at(ptr)
        return bytes(buf[off:off + nbytes])

    def arch(self):
        return "sm_90"

    def plan_kernel(self, plan, dtype, op, form, arch, cache):
        self.compiled.append((plan.name, dtype, op, form, arch))
        return b"plan-cubin", "msc_kernel"

    def probe_kernel(self, dtype, op, arch):
        self.compiled.append(("probe", dtype, op, arch))
        return f"probe-{dtype}".encode(), "msc_switch_probe"

    def load(self, cubin, name):
        module = (cubin, len(self.loaded) + len(self.launches) + id(cubin))
        self.loaded.add(module)
        return module, (cubin.decode(), name)

    def unload(self, module):
        self.loaded.remove(module)

    def launch_probe(self, function, args):
        """The probe's modes with one member (msc.cuda.switch_probe.PROBE_MODES)."""
        from cudaboot import np_dtype

        size = np.dtype(np_dtype(function[0].removeprefix("probe-"))).itemsize
        nbytes = args.count * size
        self.launches.append((function, args.mode))
        if args.mode in (0, 2):                                   # reduce (and store): read the group's copy
            data = self.read(args.in_.mc + args.in_offset * size, nbytes)
            if args.mode == 0:
                self.write(args.dst, data)
            else:
                self.write(args.out.mc + args.out_offset * size, data)
        elif args.mode == 1:                                      # store: the local source to every member
            data = self.read(args.src, nbytes)
            self.write(args.out.mc + args.out_offset * size, data)
        if self.corrupt:
            target = args.dst if args.mode == 0 else args.out.mc + args.out_offset * size
            self.write(target + 3 * size, bytes(size))


def run_stage(tmp_path, device: FakeDevice):
    threading.current_thread().device = 0                         # FakeDriver's per-thread device
    run = Run("cuda", True, tmp_path, tmp_path)
    stage = Stage(Record(tmp_path, {}, str), Alarm(install=False), "nvls", 30.0)
    extra = fgr.nvls_stage(run, stage, device)
    return stage, extra, {c["case"]: c for c in stage.cases}


def test_a_gpu_with_multicast_gets_every_check_and_everything_is_released(tmp_path):
    driver = FakeDriver(1)
    device = FakeDevice(driver)
    stage, extra, cases = run_stage(tmp_path, device)
    assert stage.status == "pass", stage.cases
    cap = cases["multicast capability"]["detail"]
    assert cap["CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"] == 1 and cap["supported"] and cap["driver_version"] == 12080
    assert [c[1:4] for c in device.compiled[:3]] == [k for k in fgr.NVLS_KERNELS]
    assert {c[0] for c in device.compiled[:3]} == {"nvls"} and all(c[-1] == "sm_90" for c in device.compiled)
    detail = cases["multicast object over one GPU"]["detail"]
    assert "float32 sum reduce, store, reduce_store: 4096 elements exact" in detail
    assert "bfloat16 max reduce, store, reduce_store" in detail and "second object" in detail
    # the runtime's own path: one object per open, numDevices 1; the second binds the first's memory
    creates = [args for _, name, args in driver.log if name == "mc_create"]
    binds = [args for _, name, args in driver.log if name == "mc_bind"]
    assert [members for _, members in creates] == [1, 1] and len({mem for _, mem, _ in binds}) == 1
    assert len(device.launches) == 7                              # 3 modes x 2 pairs, one read through the second
    assert driver.live == set() and device.loaded == set()        # torn down, modules unloaded
    assert extra["nvls"]["problems"] == []


def test_a_gpu_without_multicast_records_the_attribute_and_skips_the_object(tmp_path):
    lacking = DeviceFacts(0, "NVIDIA H100 80GB HBM3", (9, 0), False, True, True)
    device = FakeDevice(FakeDriver(1, facts={0: lacking}))
    stage, extra, cases = run_stage(tmp_path, device)
    assert stage.status == "pass"
    assert cases["multicast capability"]["detail"]["CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"] == 0
    assert cases["switch kernels loaded"]["ok"] is True           # sm_90: the kernels still load
    skipped = cases["multicast object over one GPU"]
    assert skipped["ok"] is None and "not supported" in skipped["detail"]
    assert "MULTICAST_SUPPORTED is 0" in skipped["detail"]
    assert device.launches == [] and device.loaded == set()


def test_an_older_gpu_skips_the_kernels_too(tmp_path):
    a100 = DeviceFacts(0, "NVIDIA A100-SXM4-80GB", (8, 0), True, True, True)
    device = FakeDevice(FakeDriver(1, facts={0: a100}))
    stage, _, cases = run_stage(tmp_path, device)
    assert stage.status == "pass" and device.compiled == []
    assert "sm_80: no multimem" in cases["switch kernels loaded"]["detail"]
    assert "compute capability is 8.0" in cases["multicast object over one GPU"]["detail"]


@pytest.mark.parametrize("how, words", [("bind", "mc_bind failed on device 0"), ("values", "elements wrong, first at [3]")])
def test_a_failure_is_a_failed_case_with_its_error_and_still_tears_down(tmp_path, how, words):
    driver = FakeDriver(1, fail=("mc_bind", 0) if how == "bind" else None)
    device = FakeDevice(driver, corrupt=how == "values")
    stage, _, cases = run_stage(tmp_path, device)
    case = cases["multicast object over one GPU"]
    assert stage.status == "fail" and case["ok"] is False and words in case["detail"]
    assert cases["multicast capability"]["ok"] and cases["switch kernels loaded"]["ok"]
    assert driver.live == set() and device.loaded == set()


def test_the_real_tools_compile_the_switch_kernels_for_sm90(tmp_path, monkeypatch):
    """GpuSwitchTools' compile calls (NVRTC, no driver) give cubins for every kernel the stage loads."""
    pytest.importorskip("cuda.bindings")
    from msc.cuda.runtime import runtime_plan

    tools = object.__new__(fgr.GpuSwitchTools)                   # no driver: only its compile methods
    plan = runtime_plan(plan_of(fgr.NVLS, 8, "Simple"))
    dtype, op, form = fgr.NVLS_KERNELS[1]
    cubin, name = tools.plan_kernel(plan, dtype, op, form, "sm_90", tmp_path)
    assert cubin[:4] == b"\x7fELF" and name == "msc_kernel"
    cubin, name = tools.probe_kernel("bfloat16", "max", "sm_90")
    assert cubin[:4] == b"\x7fELF" and name == "msc_switch_probe"


def test_a_failed_capability_query_is_recorded_and_the_rest_skipped(tmp_path):
    class Broken(FakeDriver):
        def device_facts(self, index):
            raise RuntimeError("cuDeviceGetAttribute failed (fake)")

    device = FakeDevice(Broken(1))
    stage, _, cases = run_stage(tmp_path, device)
    assert stage.status == "fail" and "cuDeviceGetAttribute failed" in cases["multicast capability"]["detail"]
    assert [cases[n]["ok"] for n in ("switch kernels loaded", "multicast object over one GPU")] == [None, None]
    assert device.compiled == []
