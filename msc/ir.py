"""The intermediate representations of msc, as frozen dataclasses.

Stage 1, the trace: what a DSL program did, one ``Op`` per copy or reduce,
with buffers already resolved to the physical buffers of a rank (in-place
aliases applied). Later stages (the plan) add their records here too.
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from msc.errors import SourceLine


class OpKind(Enum):
    COPY = "copy"      # dst <- src
    REDUCE = "reduce"  # dst <- dst (+) src


class Op(NamedTuple):
    """One chunk operation of a traced program (immutable).

    A NamedTuple rather than a frozen dataclass: a 1024-rank ring traces two
    million of these, and a tuple is built five times faster.

    ``size`` chunks starting at ``src_index`` of ``src_buffer`` on
    ``src_rank`` are copied to, or reduced into, ``size`` chunks starting at
    ``dst_index`` of ``dst_buffer`` on ``dst_rank``. When the ranks differ the
    operation is a send and a receive. ``channel``, ``sendtb`` and ``recvtb``
    are the user's optional placement hints.
    """

    kind: OpKind
    src_rank: int
    src_buffer: str
    src_index: int
    dst_rank: int
    dst_buffer: str
    dst_index: int
    size: int
    channel: int | None = None
    sendtb: int | None = None
    recvtb: int | None = None
    where: SourceLine | None = None

    def describe(self) -> str:
        src = f"rank {self.src_rank} {self.src_buffer}[{_span(self.src_index, self.size)}]"
        dst = f"rank {self.dst_rank} {self.dst_buffer}[{_span(self.dst_index, self.size)}]"
        if self.kind is OpKind.COPY:
            return f"copy {src} -> {dst}"
        return f"reduce {src} into {dst}"


def _span(index: int, size: int) -> str:
    return str(index) if size == 1 else f"{index}:{index + size}"
