"""The MSCCL++ executor's limits (microsoft/mscclpp at 1f5f065,
src/core/include/execution_common.hpp and executor.cc), checked on every plan
msc writes and every plan it reads: one check for both."""
from __future__ import annotations

from msc.errors import RuntimeLimitError
from msc.ir.onesided import OneSidedPlan

RUNTIME = "mscclpp"
TITLE = "microsoft/mscclpp src/core/include/execution_common.hpp"
MAX_OPERATION = 64                  # operations per threadblock, a pipeline's body included (executor.cc)
MAX_CHANNEL = 16                    # memory, port, switch channels (each) and remote buffers a threadblock declares
MAX_CHANNEL_PER_OPERATION = 8
MAX_LOCAL_BUFFER_PER_OPERATION = 2
MAX_OPERANDS = MAX_LOCAL_BUFFER_PER_OPERATION + MAX_CHANNEL_PER_OPERATION    # src_buff / dst_buff entries
MAX_DEVICE_SEMAPHORES = 16          # semaphore ids per operation
MAX_DEVICE_SYNCERS = 16             # barrier ids
BUFFER_ALIGNMENT = 16               # message sizes and offsets are in 16-byte units


def _limit(constant: str, value: int, maximum: int, what: str, **where) -> RuntimeLimitError:
    return RuntimeLimitError(constant, value, maximum, f"{what} {value} exceeds the MSCCL++ executor's limit "
                             f"{constant} = {maximum} ({TITLE})", runtime=RUNTIME, **where)


def check_limits(plan: OneSidedPlan) -> None:
    """RuntimeLimitError naming the constant, rank, threadblock and operation
    for the first limit of the executor ``plan`` exceeds."""
    for gpu in plan.gpus:
        for t, ops in enumerate(gpu.threadblocks):
            where = dict(rank=gpu.rank, tb=t)
            total = sum(op.count for op in ops)
            if total > MAX_OPERATION:
                raise _limit("MAX_OPERATION", total, MAX_OPERATION, "operations (a pipeline's body included)", **where)
            for count, what in ((gpu.tb_channels[t] if gpu.tb_channels else 0, "channels of one kind declared"),
                                (gpu.tb_buffers[t] if gpu.tb_buffers else 0, "remote buffers declared")):
                if count > MAX_CHANNEL:
                    raise _limit("MAX_CHANNEL", count, MAX_CHANNEL, what, **where)
            for i, op in enumerate(ops):
                for inner in (op,) + op.body:
                    _check_op(inner, i, **where)


def _check_op(op, index: int, **where) -> None:
    checks = ((len(op.channels), MAX_CHANNEL_PER_OPERATION, "MAX_CHANNEL_PER_OPERATION", "channels"),
              (len(op.srcs), MAX_OPERANDS, "MAX_LOCAL_BUFFER_PER_OPERATION + MAX_CHANNEL_PER_OPERATION", "sources"),
              (len(op.dsts), MAX_OPERANDS, "MAX_LOCAL_BUFFER_PER_OPERATION + MAX_CHANNEL_PER_OPERATION",
               "destinations"),
              (len(op.semaphores), MAX_DEVICE_SEMAPHORES, "MAX_DEVICE_SEMAPHORES", "semaphore ids"))
    for value, maximum, constant, what in checks:
        if value > maximum:
            raise _limit(constant, value, maximum, f"operation {index} ({op.name}): {what}", **where)
    if op.barrier is not None and op.barrier[0] >= MAX_DEVICE_SYNCERS:
        raise _limit("MAX_DEVICE_SYNCERS", op.barrier[0] + 1, MAX_DEVICE_SYNCERS, f"operation {index} (barrier): barrier ids", **where)
