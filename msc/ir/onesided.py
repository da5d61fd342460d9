"""The one-sided model of an MSCCL++ execution plan, as frozen dataclasses.

MSCCL++ (microsoft/mscclpp) runs a JSON execution plan with one generic
interpreter kernel: per rank, threadblocks; per threadblock, operations that
read and write the rank's own buffers and, through memory channels, its
peers' (put, get, remote reduce), signal and wait on channel semaphores,
sync with other threadblocks of the rank (barriers, device semaphores) and
exchange LL packets; through port channels the same transfers go through a
host proxy, and through switch (NVLS) channels a group op reads or writes a
chunk on every member of a group at once. msc.formats.mscclpp reads and
writes the JSON; msc.verification.onesided checks and executes this model.

Operands are resolved when a plan is read: an ``Operand`` names the rank
that owns the buffer (a peer's for a remote operand; the issuing rank and
the group for a switch operand), the buffer and the chunks; a channel is the
rank's flattened memory-channel (or, for a port operation, port-channel)
index. Everything a check reports names (rank, threadblock, operation index).
"""
from __future__ import annotations

from dataclasses import dataclass

# Operation names the executor knows (src/core/executor/execution_plan.cc, getOpType), by what msc does with them.
CONTROL_OPS = ("nop", "barrier", "signal", "wait", "rlxsignal", "rlxwait", "sem_acquire", "sem_release")
DATA_OPS = ("put", "pws", "pwsf", "get", "copy", "re", "res", "rre", "rres")
PACKET_OPS = ("ppkt", "rppkt", "cpkt", "upkt", "repkt", "respkt", "recpkt", "recspkt")
# Switch-channel (NVLS) operations: a multimem access to every member of the channel's group at one offset.
SWITCH_OPS = ("glres", "gstore", "gstorepkt")
PORT_ONLY_OPS = ("flush",)                 # waits for a port channel's proxy: nothing on memory channels
UNSUPPORTED_OPS: dict = {}                # known to the executor, not (yet) to msc
PIPELINE = "pipeline"
KNOWN_OPS = CONTROL_OPS + DATA_OPS + PACKET_OPS + SWITCH_OPS + PORT_ONLY_OPS + tuple(UNSUPPORTED_OPS) + (PIPELINE,)


@dataclass(frozen=True)
class Operand:
    """``size`` chunks of ``rank``'s ``buffer`` (input, output, scratch)
    from ``index``; ``remote``: reached through a memory channel;
    ``group``: reached through a switch channel, the same chunks on every
    rank of the group at once (``rank`` is the rank that issues it)."""

    rank: int
    buffer: str
    index: int
    size: int
    remote: bool = False
    group: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f"rank {self.rank} " if self.remote else ""
        if self.group:
            where = f"ranks {','.join(map(str, self.group))} (switch) "
        return f"{where}{self.buffer}[{self.index}:{self.index + self.size}]"

    def on(self, rank: int) -> "Operand":
        """A switch operand's chunks on one member ``rank``."""
        return Operand(rank, self.buffer, self.index, self.size, remote=rank != self.rank)


@dataclass(frozen=True)
class Operation:
    """One operation of a threadblock. ``channels``: the rank's memory
    channel indices it signals, waits on or writes through, or its port
    channel indices where ``channel_type`` is "port" (the work then goes
    through the host proxy: see msc.verification.onesided); ``semaphores``: device semaphore
    ids; ``barrier``: (id, threadblocks); ``group``: (index, size) of a
    threadblock group, which splits the operands' bytes between its members;
    ``body``, ``unit_size`` (bytes), ``num_chunks``: a pipeline's operations,
    run over slices of ``unit_size`` bytes."""

    name: str
    srcs: tuple[Operand, ...] = ()
    dsts: tuple[Operand, ...] = ()
    channels: tuple[int, ...] = ()
    semaphores: tuple[int, ...] = ()
    barrier: tuple[int, int] | None = None
    group: tuple[int, int] | None = None
    body: tuple["Operation", ...] = ()
    unit_size: int = 0
    num_chunks: int = 0
    channel_type: str = "memory"

    @property
    def port(self) -> bool:
        return self.channel_type == "port"

    @property
    def count(self) -> int:
        """Operations the executor stores for it (a pipeline: itself and its body)."""
        return 1 + len(self.body)


@dataclass(frozen=True)
class Gpu:
    """One rank: its buffer sizes in chunks, its memory channels (the peer of
    each, in the flattened order the executor builds them), the initial
    values of its device semaphores, its switch (NVLS) channels (the
    buffer each binds and the ranks of its group), and per threadblock its operations and
    how many channels and remote buffers it declares."""

    rank: int
    input_chunks: int
    output_chunks: int
    scratch_chunks: int
    channels: tuple[int, ...]
    semaphores: tuple[int, ...]
    threadblocks: tuple[tuple[Operation, ...], ...]
    tb_channels: tuple[int, ...] = ()          # most channels of one kind (memory, port, switch) each threadblock declares
    tb_buffers: tuple[int, ...] = ()           # remote buffers each threadblock declares
    tb_meta: tuple[tuple[tuple[str, object], ...], ...] = ()   # msc_* fields of each threadblock
    meta: tuple[tuple[str, object], ...] = ()  # msc_* fields of the gpu
    switches: tuple[tuple[str, tuple[int, ...]], ...] = ()   # switch channels: (buffer, group's ranks)
    port_channels: tuple[int, ...] = ()        # the peer of each port channel, in the executor's order


@dataclass(frozen=True)
class OneSidedPlan:
    name: str
    collective: str
    protocol: str                 # "Simple" or "LL" (packets)
    inplace: bool
    num_ranks: int
    gpus: tuple[Gpu, ...]
    double_scratch: bool = False
    meta: tuple[tuple[str, object], ...] = ()    # msc_* fields msc writes (root, chunk factor, ...)

    def meta_value(self, key: str, default=None):
        return dict(self.meta).get(key, default)

    def channel_ordinal(self, rank: int, channel: int, port: bool = False) -> tuple[int, int]:
        """(peer, q): ``channel`` of ``rank`` is its q-th memory (or port)
        channel to peer; it pairs with the peer's q-th channel of that kind
        to ``rank`` (executor.cc tags a pair's connections memory first,
        then port, after padding both ends to as many memory channels)."""
        peers = self.gpus[rank].port_channels if port else self.gpus[rank].channels
        peer = peers[channel]
        return peer, sum(1 for p in peers[:channel] if p == peer)
