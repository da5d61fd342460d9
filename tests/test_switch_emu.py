"""The multimem primitives on the emulated device (templates/multimem.cuh.j2
built as host C++ through templates/switch_probe.cu.j2): a group buffer is
its members' copies, and the switch's reduction is defined as the reference
executor's: member 0, then (+) each further member in member order,
accumulating in the element type. Checked against numpy computing exactly
that, with random data (never zeros), for switch reduce, switch store, their
fused form (slices that take the unit, vector and tail paths), and the group
barrier (run by one thread per member).

Default set: three (dtype, op) pairs covering a half type in pairs, an
integer and a type with no vector form; ``-m slow``: every pair the switch
supports (msc.cuda.switch.supported_pairs).
"""
from __future__ import annotations

import ctypes
import threading
import time
import zlib

import numpy as np
import pytest

from patience import join, patience
from msc.cuda.switch import SWITCH_TYPES, SwitchMemC, supported_pairs
from msc.cuda.switch_probe import PROBE_MODES, ProbeArgsC, load_probe_host
from msc.ir.ops import REDUCE_OPS

pytest.importorskip("jinja2")
ml_dtypes = pytest.importorskip("ml_dtypes")

NP_DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "int32": np.int32}
QUICK = [("float16", "sum"), ("int32", "max"), ("float64", "sum")]
SLOW = [p for p in supported_pairs() if p not in QUICK]
MEMBERS = 5
LENGTH = 160
THREADS = 4


@pytest.fixture(scope="module")
def libs(kernel_cache):
    cache = kernel_cache
    built = {}

    def get(dtype, op):
        if (dtype, op) not in built:
            built[dtype, op] = load_probe_host(dtype, op, cache=cache)
        return built[dtype, op]
    return get


def random_copies(dtype: str, rng, n: int = MEMBERS) -> list[np.ndarray]:
    """Each member's copy: random values that are never zero (integers small enough that n of them never overflow)."""
    if dtype == "int32":
        out = []
        for _ in range(n):
            x = rng.integers(-1000, 1000, LENGTH).astype(np.int32)
            x[x == 0] = 7
            out.append(x)
        return out
    return [(rng.uniform(0.5, 2.0, LENGTH) * rng.choice([-1.0, 1.0], LENGTH)).astype(NP_DTYPES[dtype]) for _ in range(n)]


def reference(copies: list[np.ndarray], op: str) -> np.ndarray:
    """The defined order: member 0, then (+) member 1, 2, ... in the element type."""
    ufunc = getattr(np, REDUCE_OPS[op].numpy)
    acc = copies[0].copy()
    for x in copies[1:]:
        acc = ufunc(acc, x).astype(copies[0].dtype)
    return acc


def group(arrays: list[np.ndarray]) -> tuple[SwitchMemC, ctypes.Array]:
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    return SwitchMemC(None, ctypes.cast(ptrs, ctypes.c_void_p), len(arrays)), ptrs


def run(lib, args: ProbeArgsC) -> None:
    assert lib.msc_switch_probe_host(ctypes.byref(args), THREADS) == 0


# Slices (in offset, out offset, count): whole units, with a head before the first 16-byte
# boundary, 16-byte vectors and a tail; the second pair at different places within 16 bytes
# (units only).
def slices(dtype: str) -> list[tuple[int, int, int]]:
    u = SWITCH_TYPES[dtype].elements
    return [(2 * u, 2 * u, 60 * u), (0, 0, 64 * u), (4 * u, 1 * u, 30 * u), (6 * u, 6 * u, u)]


def check_pair(lib, dtype: str, op: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for src, dst_off, count in slices(dtype):
        ins = random_copies(dtype, rng)
        outs = random_copies(dtype, rng)
        local = random_copies(dtype, rng, 1)[0]
        before_outs, before_local = [o.copy() for o in outs], local.copy()
        expected = reference([x[src:src + count] for x in ins], op)
        g_in, keep_in = group(ins)
        g_out, keep_out = group(outs)

        # switch reduce into a local buffer (at dst_off of it), nothing stored
        args = ProbeArgsC(g_in, g_out, g_in, local[dst_off:].ctypes.data, None, None, 0, src, dst_off, 0, None,
                          count, PROBE_MODES["reduce"], 0)
        run(lib, args)
        np.testing.assert_array_equal(local[dst_off:dst_off + count].view(np.uint8),
                                      expected.view(np.uint8))
        untouched = np.ones(LENGTH, bool)
        untouched[dst_off:dst_off + count] = False
        np.testing.assert_array_equal(local[untouched], before_local[untouched])
        for o, b in zip(outs, before_outs):
            np.testing.assert_array_equal(o, b)

        # fused: reduce and multicast-store at dst_off of every member's `out`
        args.mode, args.dst, args.out_offset = PROBE_MODES["reduce_store"], None, dst_off
        run(lib, args)
        for o, b in zip(outs, before_outs):
            np.testing.assert_array_equal(o[dst_off:dst_off + count].view(np.uint8), expected.view(np.uint8))
            np.testing.assert_array_equal(o[untouched], b[untouched])

        # switch store: a local source to every member's `in` at src
        source = random_copies(dtype, rng, 1)[0]
        args = ProbeArgsC(g_in, g_in, g_in, None, source[dst_off:].ctypes.data, None, 0, 0, src, 0, None, count,
                          PROBE_MODES["store"], 0)
        before_ins = [x.copy() for x in ins]
        run(lib, args)
        for x, b in zip(ins, before_ins):
            np.testing.assert_array_equal(x[src:src + count], source[dst_off:dst_off + count])
            rest = np.ones(LENGTH, bool)
            rest[src:src + count] = False
            np.testing.assert_array_equal(x[rest], b[rest])
        del keep_in, keep_out


@pytest.mark.parametrize("dtype,op", QUICK)
def test_switch_primitives_match_numpy_in_member_order(libs, dtype, op):
    check_pair(libs(dtype, op), dtype, op, seed=zlib.crc32(f"{dtype}-{op}".encode()))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,op", SLOW)
def test_switch_primitives_every_pair(libs, dtype, op):
    check_pair(libs(dtype, op), dtype, op, seed=zlib.crc32(f"{dtype}-{op}".encode()))


def test_reduction_order_is_member_order(libs):
    """float16 sums whose result depends on the order: the host follows member order, not another one."""
    lib = libs("float16", "sum")
    ins = [np.full(LENGTH, v, np.float16) for v in (2048.0, 1.0, 1.0, -2048.0)]
    g, keep = group(ins)
    dst = np.full(LENGTH, 5, np.float16)
    run(lib, ProbeArgsC(g, g, g, dst.ctypes.data, None, None, 0, 0, 0, 0, None, 32, PROBE_MODES["reduce"], 0))
    # (((2048 + 1) = 2048 in f16) + 1 = 2048) - 2048 = 0; exact arithmetic, or another order, gives 2
    assert (dst[:32] == reference([x[:32] for x in ins], "sum")).all() and dst[0] == 0.0
    del keep


def barrier_args(flags: np.ndarray, member: int, n: int, target: int, error: np.ndarray, timeout_s: float):
    words = [flags[8 * m:].ctypes.data for m in range(n)]         # one 64-byte line per member's copy
    ptrs = (ctypes.c_void_p * n)(*words)
    g = SwitchMemC(None, ctypes.cast(ptrs, ctypes.c_void_p), n)
    return ProbeArgsC(g, g, g, None, None, words[member], target, 0, 0, int(timeout_s * 1e9),
                      error.ctypes.data, 0, PROBE_MODES["barrier"], member), ptrs


def test_group_barrier_waits_for_every_member(libs):
    lib = libs("float16", "sum")
    n = 4
    flags = np.zeros(8 * n, np.uint64)
    error = np.zeros(8, np.uint32)
    for rnd in (1, 2):                                # counters only grow: round r waits for r * n
        made = [barrier_args(flags, m, n, rnd * n, error, patience(30.0)) for m in range(n)]
        threads = [threading.Thread(target=run, args=(lib, a)) for a, _ in made]
        threads[0].start()
        time.sleep(0.3)
        assert threads[0].is_alive(), "a member left the barrier before the others arrived"
        for t in threads[1:]:
            t.start()
        for t in threads:
            join(t, 60)
        assert not any(t.is_alive() for t in threads)
        assert list(flags[::8]) == [rnd * n] * n
        assert error[0] == 0


def test_group_barrier_times_out_when_a_member_is_missing(libs):
    lib = libs("float16", "sum")
    n = 3
    flags = np.zeros(8 * n, np.uint64)
    error = np.zeros(8, np.uint32)
    made = [barrier_args(flags, m, n, n, error, 0.2) for m in range(n - 1)]      # member 2 never arrives
    threads = [threading.Thread(target=run, args=(lib, a)) for a, _ in made]
    for t in threads:
        t.start()
    for t in threads:
        join(t, 60)
    assert error[0] == 1                              # MSC_TIMEOUT, recorded by the first to give up
    assert error[1] in (0, 1)                         # that member's rank
    assert list(flags[::8]) == [n - 1] * n            # both arrivals reached every copy
