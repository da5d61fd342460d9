"""Which engine runs a plan: the hook point for the msc CUDA runtime.

Today one engine exists: the torch.distributed executor (msc.torch.execute),
which runs any plan on any device its process group's backend serves (gloo
on CPU, NCCL on GPUs), on one node or many.

The CUDA runtime (msc.cuda, being written) will run a plan's generated
kernel directly between the GPUs of one node. When it can, ``choose`` is
where "auto" picks it: CUDA tensors in a group whose ranks all sit on this
node (``single_node``). Until then:

- ``backend="auto"`` runs the torch.distributed executor, always;
- ``backend="cuda"`` raises ``BackendUnavailableError``: asking for the
  runtime by name never falls back silently.
"""
from __future__ import annotations

import os

from msc.errors import UsageError

BACKENDS = ("auto", "torch", "cuda")


class BackendUnavailableError(UsageError):
    """The backend asked for cannot run here (today: the CUDA runtime)."""


def cuda_runtime_available() -> bool:
    """Whether msc.cuda can launch a plan across the GPUs of a group.
    HOOK: return True (e.g. when msc.cuda.runtime imports and finds a
    driver) once the runtime exists, and fill in ``run_cuda``."""
    return False


def single_node(group) -> bool:
    """Whether every rank of ``group`` runs on this node, as torchrun says
    (LOCAL_WORLD_SIZE == WORLD_SIZE and the group is the world). Unknown
    counts as no: the CUDA runtime must never be picked for a group that
    spans nodes."""
    import torch.distributed as dist

    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or world is None or local != world:
        return False
    return dist.get_world_size(group) == int(world)


def choose(backend: str, device, group) -> str:
    """"torch" or "cuda" for a call on ``device`` over ``group``."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    if backend == "cuda":
        if not cuda_runtime_available():
            raise BackendUnavailableError(
                "backend='cuda': the msc CUDA runtime (msc.cuda) cannot run plans yet; use backend='torch' (or "
                "'auto'), the torch.distributed executor, which runs the same plan over NCCL or gloo")
        if getattr(device, "type", None) != "cuda":
            raise UsageError(f"backend='cuda' needs CUDA tensors, these are on {device}")
        if not single_node(group):
            raise UsageError("backend='cuda' runs within one node; this group spans nodes (or torchrun did not "
                             "say it does not): use backend='torch'")
        return "cuda"
    if backend == "auto" and getattr(device, "type", None) == "cuda" and cuda_runtime_available() \
            and single_node(group):
        return "cuda"
    return "torch"


def run_cuda(prepared, call, op: str, group) -> None:
    """HOOK: run ``prepared.plan`` on ``call``'s tensors with the msc CUDA
    runtime. Unreachable while ``cuda_runtime_available()`` is False."""
    raise BackendUnavailableError("the msc CUDA runtime is not available in this build")
