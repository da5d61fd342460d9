"""NVLink SHARP in the kernels: which multimem instruction reduces and stores
each element type, rendered from templates/multimem.cuh.j2.

What the switch can do is decided in one place, msc.ir.ops.switch_op_problem
(and its table SWITCH_OPS); this module only knows how each element type is
spelled in PTX. Every multimem access moves whole *units*: an f32, an f64,
an s32, or a PAIR of half-type elements (f16x2/bf16x2: sm_90's ptxas rejects
multimem.ld_reduce and multimem.st on a single .f16/.bf16). A vector access
moves four units, 16 bytes (.v4.f32, .v4.f16x2, .v4.bf16x2; f64 and the
integer types have no vector form). So a slice of a half type must start and
end on an even element: ``switch_slice_problem`` says why one does not.

Accumulation: on a GPU the switch reduces the members' copies in an order
the hardware does not define; half-type sums accumulate in f32
(``.acc::f32``, as NCCL does, src/device/reduce_kernel.h) and round once.
The emulated device (``MSC_HOST``) defines the order: members in increasing
member (rank) order, accumulating in the element type, rounding after every
operation (common.cuh.j2's reduce_op): the reference executor's order. Min,
max and integer sums are exact either way; float sums agree with a GPU only
within rounding.

The lead's wiring point: ``switch_context(dtype, op)`` is what a kernel's
Jinja context needs to include multimem.cuh.j2 (after common.cuh.j2).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from msc.errors import UsageError
from msc.ir.ops import reduce_op, switch_op_problem

VECTOR_BYTES = 16


@dataclass(frozen=True)
class SwitchType:
    """How multimem spells one element type: the unit it moves (``ptx``), the
    inline-asm register class of one unit and its size, and whether four
    units move as one 16-byte vector (``.v4``)."""

    ptx: str
    register: str             # "r": 32 bits, "l": 64 bits
    unit_bytes: int
    elements: int             # elements per unit
    vector: bool
    acc: str = ""             # the accumulation qualifier of a sum


SWITCH_TYPES: dict[str, SwitchType] = {
    "float32": SwitchType("f32", "r", 4, 1, True),
    "float64": SwitchType("f64", "l", 8, 1, False),
    "float16": SwitchType("f16x2", "r", 4, 2, True, acc=".acc::f32"),
    "bfloat16": SwitchType("bf16x2", "r", 4, 2, True, acc=".acc::f32"),
    "int32": SwitchType("s32", "r", 4, 1, False),
}
# The PTX reduction of each msc op the switch can do (an average: the sum, divided after the plan).
SWITCH_PTX_OPS = {"sum": "add", "avg": "add", "min": "min", "max": "max"}


@dataclass(frozen=True)
class SwitchForm:
    """The multimem instructions of one (element type, op): what multimem.cuh.j2 renders."""

    dtype: str
    op: str
    ptx_op: str               # add, min, max
    type: SwitchType

    @property
    def acc(self) -> str:     # .acc::f32 exists for add only (ptxas: "Illegal reduction operation" for min/max)
        return self.type.acc if self.ptx_op == "add" else ""

    @property
    def ld_reduce(self) -> str:
        """The scalar load-reduce's mnemonic (the vector one adds .v4 before the type)."""
        return f"multimem.ld_reduce.relaxed.sys.global.{self.ptx_op}{self.acc}"


def switch_form(dtype: str, op: str) -> SwitchForm:
    """The multimem form of ``dtype`` and ``op``; UsageError (from the one table,
    msc.ir.ops.switch_op_problem) where the switch cannot do it: nothing renders then."""
    reduce_op(op)
    problem = switch_op_problem(op, dtype)
    if problem:
        raise UsageError(problem)
    return SwitchForm(dtype, op, SWITCH_PTX_OPS[op], SWITCH_TYPES[dtype])


def switch_context(dtype: str, op: str) -> dict:
    """What a kernel's Jinja context adds to include templates/multimem.cuh.j2."""
    return {"switch": switch_form(dtype, op)}


def supported_pairs() -> list[tuple[str, str]]:
    """Every (dtype, op) the switch reduces (avg: its sum, divided after the plan)."""
    from msc.ir.ops import REDUCE_OP_NAMES

    return [(d, o) for d in SWITCH_TYPES for o in REDUCE_OP_NAMES if switch_op_problem(o, d) is None]


def switch_slice_problem(dtype: str, offset: int, count: int, *, what: str = "slice") -> str | None:
    """Why multimem cannot move ``count`` elements of ``dtype`` from element
    ``offset`` of a group buffer (a half type in pairs: even offset and count), or None."""
    unit = SWITCH_TYPES[dtype].elements
    if offset % unit or count % unit:
        return (f"the {what} [{offset}, {offset + count}) of {dtype} is not whole multimem units: the NVLink switch "
                f"moves {dtype} in pairs of elements, so a slice must start and end on an even element")
    return None


def nvrtc_ptx(source: str, *, arch: str = "sm_90", name: str = "switch_probe.cu") -> tuple[str, bytes, str]:
    """(PTX, cubin, log) of ``source`` compiled for ``arch`` with NVRTC's
    low-level calls, which need no driver (cuda.core's PTX output asks the
    driver's version). ptxas runs on the way to the cubin, so an instruction
    form sm_90 lacks fails here. CompileError with the log."""
    from cuda.bindings import nvrtc

    from msc.errors import CompileError

    def check(result, what):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC {what} failed: {result[0]}")
        return result[1:]

    (prog,) = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "create")
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
        status = nvrtc.nvrtcCompileProgram(prog, len(options), options)[0]
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        check(nvrtc.nvrtcGetProgramLog(prog, log), "log")
        log_text = log.decode(errors="replace").rstrip("\0")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC could not compile {name} for {arch}", log=log_text)
        (ptx_size,) = check(nvrtc.nvrtcGetPTXSize(prog), "PTX size")
        ptx = b" " * ptx_size
        check(nvrtc.nvrtcGetPTX(prog, ptx), "PTX")
        (cubin_size,) = check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * cubin_size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode().rstrip("\0"), cubin, log_text


class SwitchMemC(ctypes.Structure):
    """multimem.cuh.j2's SwitchMem as the runtime packs it: the multicast
    address (a GPU), or an array of the members' addresses (the emulated device)."""

    _fields_ = [("mc", ctypes.c_void_p), ("members", ctypes.c_void_p), ("n", ctypes.c_int)]
