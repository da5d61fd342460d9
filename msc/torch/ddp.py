"""DDP communication hook: gradient buckets reduced by msc plans.

``allreduce_hook(plans)`` returns ``hook(state, bucket)`` for
``ddp_model.register_comm_hook(state, hook)``. Each bucket's flat gradient
tensor is divided by the group size and then summed in place by the plan
the registry picks for (allreduce, group size, bucket bytes): the order of
torch's own ``allreduce_hook`` (divide first), so a 2-rank run gives the
same bits as stock DDP (dividing by 2 is exact; a 2-rank sum is a+b, and
a+b == b+a), whichever engine runs the plan. The hook never uses the
"avg" op: the CUDA runtime's avg (a pre-scale by 1/n in the kernel) and
the executor's (sum, then divide) round differently from stock DDP.

Engine (``backend=``, msc.torch.backends): "torch" the torch.distributed
executor; "cuda" the msc CUDA runtime (one Communicator per plan and group,
built at the first bucket of its size range and kept; under MSC_DEVICE=emu
the emulated device, CPU gradients); "auto" the CUDA runtime for CUDA
gradients (CPU ones under MSC_DEVICE=emu) when torchrun says the job is on
one node, the executor otherwise.

The torch executor runs synchronously inside the hook (it blocks until this
rank is done), and so does the CUDA runtime on the emulated device; on a
GPU the runtime's kernel is queued on the current stream. The hook returns
an already completed ``torch.futures.Future`` (for CUDA gradients one made
with the bucket's device, so that whoever waits on it waits for the
current stream's work). DDP accepts that, but the bucket's communication
does not overlap the rest of the backward pass as stock DDP's asynchronous
allreduce does (except for what a GPU's stream overlaps on its own).
"""
import torch
import torch.distributed as dist

from msc.errors import UsageError
from msc.torch.backends import BACKENDS
from msc.torch.calls import all_reduce, registry_of


def allreduce_hook(plans, *, group=None, backend: str = "auto", transport: str = "auto", average: bool = True):
    """A DDP comm hook running ``plans`` (a PlanRegistry, a directory or
    index of plans, a Plan, or a list of Plans/files). ``state`` passed
    to register_comm_hook may be a ProcessGroup (as for torch's default
    hooks) or None; ``group`` is used otherwise. ``average=False`` sums.
    ``backend`` ("auto", "torch", "cuda"), ``transport``: as for
    msc.torch.run_plan."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    registry = registry_of(plans)      # read the plans now: a bad directory fails at registration

    # the real annotation (no `from __future__ import annotations` here): DDP checks it
    def msc_allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        pg = state if isinstance(state, dist.ProcessGroup) else group
        tensor = bucket.buffer()
        if average:
            tensor.div_(dist.get_world_size(pg))
        all_reduce(registry, tensor, op="sum", group=pg, backend=backend, transport=transport)
        fut = torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda else torch.futures.Future()
        fut.set_result(tensor)
        return fut

    return msc_allreduce_hook
