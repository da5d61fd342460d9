"""The switch probe (templates/switch_probe.cu.j2): one small kernel calling every
multimem primitive of templates/multimem.cuh.j2 for a (dtype, op), for the static gate
(NVRTC, tests/test_switch_static.py) and the emulated device (tests/test_switch_emu.py).
Apart from msc.cuda.switch, which the kernel renderer (msc.cuda.codegen) imports: the probe
renders through codegen's environment.
"""
from __future__ import annotations

import ctypes

from msc.cuda.switch import SwitchMemC, switch_form
from msc.ir.ops import reduce_op


def render_probe(dtype: str, op: str) -> str:
    """templates/switch_probe.cu.j2: one small kernel calling every multimem
    primitive for ``dtype`` and ``op`` (the static gate compiles it with
    NVRTC; the emulated device builds it as host C++ and calls its entry points)."""
    from msc.cuda.codegen import DTYPES, environment

    form = switch_form(dtype, op)
    return environment().get_template("switch_probe.cu.j2").render(
        dtype=DTYPES[dtype], op=op, redop=reduce_op(op), switch=form)


class ProbeArgsC(ctypes.Structure):
    """switch_probe.cu.j2's ProbeArgs."""

    _fields_ = [("in_", SwitchMemC), ("out", SwitchMemC), ("flag", SwitchMemC), ("dst", ctypes.c_void_p),
                ("src", ctypes.c_void_p), ("mine", ctypes.c_void_p), ("target", ctypes.c_uint64),
                ("in_offset", ctypes.c_int64), ("out_offset", ctypes.c_int64), ("timeout", ctypes.c_int64),
                ("error", ctypes.c_void_p), ("count", ctypes.c_uint32), ("mode", ctypes.c_int), ("rank", ctypes.c_int)]


PROBE_MODES = {"reduce": 0, "store": 1, "reduce_store": 2, "barrier": 3}


def load_probe_host(dtype: str, op: str, *, cache=None):
    """The probe built for the emulated device (msc.cuda.hostbuild), loaded:
    ``msc_switch_probe_host(ProbeArgsC*, threads) -> int``."""
    from msc.cuda.emu import _load_private      # the emulated device's loader: a private copy of the checked bytes
    from msc.cuda.hostbuild import build

    _, image, _ = build(render_probe(dtype, op), cache=cache)
    lib = _load_private(image)
    lib.msc_switch_probe_host.argtypes = [ctypes.POINTER(ProbeArgsC), ctypes.c_int]
    lib.msc_switch_probe_host.restype = ctypes.c_int
    return lib
