"""The registries of reduce ops and protocols: one record each, holding every
fact of it that a module or template needs. The executors, the reference,
the CLI's choices, the CUDA renderer, the launch defaults and the
simulator's cost model read them here. (Step ops are IR: their registry is
msc.ir.StepOp, each op with its properties.)

No numpy or torch here: the CLI builds its parser from these names, and
starts without them. The executors look their functions up by name.
"""
from __future__ import annotations

from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class ReduceOp:
    """A reduction a collective call may ask for."""

    name: str                      # as users, the CLI and the kernels spell it
    numpy: str                     # the numpy ufunc that combines two values (executor, reference)
    torch: str                     # the torch function that does (msc.torch.execute)
    torch_op: str                  # its torch.distributed.ReduceOp member
    c_float: str                   # a (+) b in C on floats x, y (common.cuh.j2: half types compute in float)
    c_elem: str                    # a (+) b in C on the element type's a, b (the other types)
    average: bool = False          # then divide by the ranks (the CUDA kernels pre-scale inputs by 1/n instead,
                                   # but for switch plans: their sum, then the executor's division)
    exact: bool = False            # the result is one of the inputs: exact in any order, no rounding tolerance
    aliases: tuple[str, ...] = ()  # further names msc.torch takes
    types: str = "any"             # the element types it reduces: "any", or "integer" (a bitwise op), "floating"
    kernel_types: tuple[str, str] | None = None   # msc's CUDA kernels' own rule of types: (types, why)


REDUCE_OPS: dict[str, ReduceOp] = {op.name: op for op in (
    ReduceOp("sum", "add", "add", "SUM", "x + y", "a + b"),
    ReduceOp("prod", "multiply", "mul", "PRODUCT", "x * y", "a * b", aliases=("product",)),
    ReduceOp("max", "maximum", "maximum", "MAX", "fmaxf(x, y)", "(a > b ? a : b)", exact=True),
    ReduceOp("min", "minimum", "minimum", "MIN", "fminf(x, y)", "(a < b ? a : b)", exact=True),
    ReduceOp("avg", "add", "add", "AVG", "x + y", "a + b", average=True, aliases=("mean",),
             kernel_types=("floating", "it scales inputs by 1/n")),
)}
REDUCE_OP_NAMES = tuple(REDUCE_OPS)


def reduce_op(name) -> ReduceOp:
    """The registry row of reduction ``name``; a UsageError naming the ops for another."""
    from msc.errors import UsageError, did_you_mean

    found = REDUCE_OPS.get(name) if isinstance(name, str) else None
    if found is None:
        raise UsageError(f"unknown reduction op {name!r} (expected one of {', '.join(REDUCE_OP_NAMES)})"
                         + did_you_mean(str(name), REDUCE_OP_NAMES))
    return found


def op_dtype_problem(op: str, dtype: str, floating: bool) -> str | None:
    """Why ``op`` cannot reduce elements of ``dtype`` (``floating``: whether
    it is a floating type), or None: the op registry's rule of types (its
    row's ``types``), which the executor, msc.torch and the CUDA kernels
    (``kernel_op_problem``) all apply."""
    need = reduce_op(op).types
    if _fits(need, floating):
        return None
    return f"the reduction op {op} reduces {need} types, not {dtype}"


def kernel_op_problem(op: str, dtype: str, floating: bool) -> str | None:
    """Why msc's CUDA kernels cannot reduce ``dtype`` with ``op``, or None:
    the op's rule of types, then its kernels' own (``kernel_types``)."""
    problem = op_dtype_problem(op, dtype, floating)
    rule = reduce_op(op).kernel_types
    if problem is None and rule is not None and not _fits(rule[0], floating):
        problem = f"{op} on the msc CUDA runtime needs a {rule[0]} type ({rule[1]}), not {dtype}"
    return problem


def _fits(types: str, floating: bool) -> bool:
    return types == "any" or (types == "floating") == floating


# What NVLink SHARP reduces in the switch, by element type (multimem.ld_reduce on sm_90: PTX
# ISA 9.7.9.14; every form below, and the refusal of the others, checked with NVRTC 13's ptxas in
# tests/test_switch_static.py): .add on f32, f64, f16x2, bf16x2 and s32 (also u32 and u64, but not
# s64), .min/.max only on the half types and the integers. No prod at all, no min/max of f32/f64,
# and no average: avg (float types only) is the switch's sum, then every output chunk divided by
# its number of contributions once the rank's plan has finished (msc.executor's definition: the
# CUDA runtime's second launch, templates/switch_average.cuh.j2), bit-exact with the executor.
SWITCH_OPS: dict[str, tuple[str, ...]] = {
    "float32": ("sum",), "float64": ("sum",),
    "float16": ("sum", "min", "max"), "bfloat16": ("sum", "min", "max"),
    "int32": ("sum", "min", "max"),
}


def switch_op_problem(op: str, dtype: str) -> str | None:
    """Why the NVLink switch cannot reduce ``dtype`` with ``op`` (multimem.ld_reduce), or None.
    An average is the switch's sum, divided afterwards (see SWITCH_OPS)."""
    row = reduce_op(op)
    if dtype not in SWITCH_OPS:
        return (f"the NVLink switch (multimem) has no reduction for data type {dtype!r} (it reduces "
                f"{', '.join(SWITCH_OPS)})")
    if row.average and dtype not in ("float32", "float64", "float16", "bfloat16"):
        return (f"{op} through the NVLink switch needs a floating type (the switch sums, then each output is "
                f"divided by its contributions), not {dtype}")
    name = "sum" if row.average else op
    if name not in SWITCH_OPS[dtype]:
        can = ", ".join(SWITCH_OPS[dtype])
        return f"the NVLink switch cannot reduce {dtype} with {op} (multimem.ld_reduce does {can} on {dtype})"
    return None


@dataclass(frozen=True)
class ProtocolSpec:
    """A transport protocol, after NCCL's. How many messages a connection of
    it holds depends on the runtime: msc.lower.runtimes (Runtime.connection_slots).

    Simple: bulk copies, then a flag behind a memory fence: full bandwidth,
    the highest latency. LL: 8-byte lines of 4 data bytes and a 4-byte flag,
    no fence: half the bandwidth, a fraction of the latency (NCCL's ring
    hardware latencies on NVLink are 0.47 us for LL and 3.4 us for Simple,
    src/graph/tuning.cc). LL128: 128-byte lines with 8 flag bytes (120/128 of
    the bandwidth) and about half Simple's latency.
    """

    name: str
    tile: int                  # default pipelining tile: bytes per chunk and iteration where a plan says 0
    alpha_factor: float        # simulated latency, as a fraction of Simple's
    bandwidth_factor: float    # the fraction of link bandwidth that carries data
    transport: str | None      # the CUDA templates' transport_<name>.cuh.j2; None: the CUDA backend lacks it
    # CUDA threads per block, and blocks per SM the register budget must leave room for
    # (__launch_bounds__): a virtual launch of every rank's blocks must fit the GPU at once. 256
    # threads leave 128 registers: Simple's element loop keeps 8 16-byte loads in flight per thread
    # (32 KiB per block) and no kernel spills. At 384 or 512 threads (NCCL's 512-640) the cap is 80
    # or 64 and the step interpreter spills (bfloat16 table form: 180 or 272 bytes stored by
    # run_threadblock), so bytes in flight come from the unrolled loads instead (bench/cuda_static.py).
    threads: int = 256
    min_blocks: int = 2


PROTOCOLS: dict[str, ProtocolSpec] = {p.name: p for p in (
    ProtocolSpec("Simple", 512 * KIB, 1.0, 1.0, "simple"),     # NCCL: a 4 MiB buffer in 8 steps
    ProtocolSpec("LL", 32 * KIB, 0.25, 0.5, "ll"),             # NCCL: 64 KiB of lines per step, half of it data
    ProtocolSpec("LL128", 256 * KIB, 0.5, 120 / 128, None),
)}
PROTOCOL_NAMES = tuple(PROTOCOLS)
DEFAULT_PROTOCOL = "Simple"


def protocol_name(text: str) -> str:
    """The protocol ``text`` names, in its canonical spelling (``ll``, ``Ll``:
    ``LL``); users type them in any case, plans hold the canonical one."""
    from msc.errors import UsageError, did_you_mean

    found = {name.lower(): name for name in PROTOCOL_NAMES}.get(str(text).strip().lower())
    if found is None:
        raise UsageError(f"unknown protocol {text!r}: expected one of {', '.join(PROTOCOL_NAMES)} (any case)"
                         + did_you_mean(str(text).strip(), PROTOCOL_NAMES, fold_case=True))
    return found
