"""The torchrun placement's bootstrap: every process allocates its own arena,
exports a CUDA IPC handle for it, gathers everyone's handles over
torch.distributed (``all_gather_object``) and opens the handles of the
peers its connections reach. The result is a base address per rank, as
this process sees it, for msc.cuda.tables.pointer_tables.

The IPC calls and the gather are injected (``ipc``: export(ptr) -> bytes,
open(bytes) -> ptr; ``gather(obj) -> list``), so tests run the exchange
between gloo processes with fake handles; msc.cuda.device.DriverIpc does
the real thing. What each rank publishes also carries the capacity the
arenas were sized for (a launch.Footprint: the same for every rank, as it
covers all ranks) and a generation number (how many times this
communicator has allocated): every rank must agree on both, else the ranks were not making the same call (a
different count or dtype on some rank) and the exchange says which.
"""
from __future__ import annotations

from dataclasses import dataclass

from msc.errors import UsageError


@dataclass(frozen=True)
class Published:
    rank: int
    generation: int
    capacity: object
    handle: bytes


def torch_gather(group=None):
    """``gather(obj) -> [obj of rank 0, obj of rank 1, ...]`` over torch.distributed."""
    def gather(obj):
        import torch.distributed as dist

        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return gather


def exchange(rank: int, n: int, base: int, capacity, generation: int, needed: tuple[int, ...], *, ipc,
             gather) -> list[int | None]:
    """Bases of every rank's arena in this process: ours, the opened ones of
    ``needed`` peers, None for the rest."""
    mine = Published(rank, generation, capacity, ipc.export(base))
    everyone = gather(mine)
    if len(everyone) != n:
        raise UsageError(f"the process group has {len(everyone)} ranks, the plan {n}")
    for r, p in enumerate(everyone):
        if p.rank != r:
            raise UsageError(f"rank {r} published itself as rank {p.rank}: the group's ranks must be the plan's")
        if (p.generation, p.capacity) != (generation, capacity):
            raise UsageError(f"rank {r} sized its buffers for {p.capacity} (allocation {p.generation}), rank {rank} "
                             f"for {capacity} (allocation {generation}): every rank must make the same call (same "
                             f"element count, dtype and plan)")
    bases: list[int | None] = [None] * n
    bases[rank] = base
    for r in needed:
        bases[r] = ipc.open(everyone[r].handle)
    return bases
