"""The torchrun placement's bootstrap: every process allocates its own arena,
exports a handle for it (a CUDA IPC handle, or on the emulated device the
name of a shared-memory file), gathers everyone's handles and opens those of
the peers its connections reach. The result is a base address per rank, as
this process sees it, for msc.cuda.tables.pointer_tables.

The IPC calls and the gather are injected (``ipc``: export(ptr) -> bytes,
open(bytes) -> ptr, optionally settle(ptr) once every peer has opened ours;
``gather(tag, obj) -> [obj of rank 0, ...]``), so tests run the exchange
between gloo processes with fake handles; msc.cuda.device.DriverIpc and
msc.cuda.emu.ShmIpc do the real thing.

What each rank publishes also carries the capacity the arenas were sized for
(a launch.Footprint: the same for every rank, as it covers all ranks), a
generation number (how many times this communicator has allocated), the
machine it runs on and its device. Every rank must agree on capacity and
generation, else the ranks were not making the same call (a different count
or dtype on some rank) and the exchange says which; a peer on another
machine, or a device this one cannot reach, is named before any handle is
opened. Two ranks on one GPU are refused where the device says sharing one
would not work (``shared``: why not, or None): on a GPU, each process's
kernel spins on the other's, and kernels of different processes take turns
on the GPU (time-slicing) unless MPS runs them side by side.

``store_gather`` gathers through torch.distributed's key-value store with a
deadline: a rank that grows its buffers while a peer does not (the calls
differ) gets an error naming the ranks that never published, instead of
waiting for ever in a collective they will not join.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

from msc.errors import UsageError


@dataclass(frozen=True)
class Published:
    rank: int
    generation: int
    capacity: object
    handle: bytes
    host: str = ""            # the machine (processes that can share device memory agree on it)
    device: str = ""          # the device, as peers can look it up (a PCI bus id; "emu:N")


def torch_gather(group=None):
    """``gather(tag, obj)`` over torch.distributed's all_gather_object (no deadline)."""
    def gather(tag, obj):
        import torch.distributed as dist

        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return gather


def store_gather(prefix: str, rank: int, n: int, timeout_s: float, group=None, *, subset: str = ""):
    """``gather(tag, obj)`` through the default process group's store: each
    rank sets ``prefix/tag/rank`` and waits at most ``timeout_s`` for the
    others' keys. Falls back to ``torch_gather`` (over ``group``) where the store
    cannot be reached, except for a ``subset``: ``rank`` and ``n`` number the
    members of a subset of the processes that ``subset`` describes (a switch
    group), which only the store can gather (a collective would need every
    process of the job): a UsageError there."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:   # a private helper of torch.distributed: without it, gather without a deadline
        if subset:
            raise UsageError(f"{subset}: its {n} members exchange through torch.distributed's key-value store, "
                             f"which cannot be reached here ({type(exc).__name__}: {exc}); a gather over every "
                             f"process would mix other groups' members in") from None
        return torch_gather(group)
    ranks = list(range(n)) if group is None else dist.get_process_group_ranks(group)

    def gather(tag, obj):
        keys = [f"{prefix}/{tag}/{r}" for r in range(n)]
        store.set(keys[rank], pickle.dumps(obj))
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except Exception:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            who = (f"members of {subset}" if subset else
                   "process group ranks " + ", ".join(str(ranks[r]) for r in missing))
            raise UsageError(f"rank {rank} waited {timeout_s:g} s at '{tag}' of the msc CUDA runtime's bootstrap for "
                             f"rank(s) {', '.join(map(str, missing))} ({who}), which never came: every rank must make "
                             f"the same calls (the same element count and dtype), and a rank that grows its buffers "
                             f"waits for the others to grow theirs") from None
        return [pickle.loads(store.get(k)) for k in keys]
    return gather


def exchange(rank: int, n: int, base: int, capacity, generation: int, needed: tuple[int, ...], *, ipc,
             gather, host: str = "", device: str = "", reach=None, shared: str | None = None) -> list[int | None]:
    """Bases of every rank's arena in this process: ours, the opened ones of
    ``needed`` peers, None for the rest. ``reach(device) -> str | None``:
    why this process cannot map memory of that peer device (None: it can).
    ``shared``: why ranks must not share a device (None: they may)."""
    mine = Published(rank, generation, capacity, ipc.export(base), host, device)
    everyone = gather(f"publish/{generation}", mine)
    if len(everyone) != n:
        raise UsageError(f"the process group has {len(everyone)} ranks, the plan {n}")
    if shared is not None:
        _refuse_shared_devices(everyone, shared)
    for r, p in enumerate(everyone):
        if p.rank != r:
            raise UsageError(f"rank {r} published itself as rank {p.rank}: the group's ranks must be the plan's")
        if (p.generation, p.capacity) != (generation, capacity):
            raise UsageError(f"rank {r} sized its buffers for {p.capacity} (allocation {p.generation}), rank {rank} "
                             f"for {capacity} (allocation {generation}): every rank must make the same call (same "
                             f"element count, dtype and plan)")
    for r in needed:
        p = everyone[r]
        if p.host != host:
            raise UsageError(f"rank {r} runs on {p.host or 'an unnamed host'}, rank {rank} on {host or 'an unnamed host'}: "
                             f"the torchrun placement maps peers' memory, so every rank must run on one machine "
                             f"(use msc.torch's backend='torch' across machines)")
        why = reach(p.device) if reach is not None else None
        if why:
            raise UsageError(f"rank {rank} cannot reach the memory of rank {r} ({p.device}): {why}")
    bases: list[int | None] = [None] * n
    bases[rank] = base
    for r in needed:
        bases[r] = ipc.open(everyone[r].handle)
    settle = getattr(ipc, "settle", None)
    if settle is not None:
        gather(f"opened/{generation}", rank)          # every peer has mapped our arena
        settle(base)
    return bases


def _refuse_shared_devices(everyone: list[Published], why: str) -> None:
    """UsageError, on every rank alike, when two ranks published the same device of one machine."""
    by_device: dict[tuple[str, str], list[int]] = {}
    for p in everyone:
        by_device.setdefault((p.host, p.device), []).append(p.rank)
    crowded = [(device, ranks) for (_, device), ranks in by_device.items() if len(ranks) > 1]
    if crowded:
        named = "; ".join(f"ranks {', '.join(map(str, ranks))} on {device}" for device, ranks in crowded)
        raise UsageError(f"the torchrun placement runs one rank per GPU, and {named}: {why}. Give each process its "
                         f"own GPU (torch.cuda.set_device(local_rank) before the first call)")
