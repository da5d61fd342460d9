"""DDP communication hook: gradient buckets reduced by msc plans.

``allreduce_hook(plans)`` returns ``hook(state, bucket)`` for
``ddp_model.register_comm_hook(state, hook)``. Each bucket's flat gradient
tensor is divided by the group size and then summed in place by the plan
the registry picks for (allreduce, group size, bucket bytes): the order of
torch's own ``allreduce_hook`` (divide first), so a 2-rank run gives the
same bits as stock DDP (dividing by 2 is exact; a 2-rank sum is a+b).

The plan runs synchronously inside the hook (the executor blocks until
this rank is done), and the hook returns an already completed
``torch.futures.Future``; DDP accepts that, but the bucket's communication
no longer overlaps the rest of the backward pass as stock DDP's
asynchronous allreduce does.

Engine: ``backend="auto"`` runs the torch.distributed executor today; it
is where the msc CUDA runtime will be chosen for GPU groups of one node
(msc.torch.backends).
"""
import torch
import torch.distributed as dist

from msc.torch.calls import all_reduce, registry_of


def allreduce_hook(plans, *, group=None, backend: str = "auto", transport: str = "auto", average: bool = True):
    """A DDP comm hook running ``plans`` (a PlanRegistry, a directory or
    index of plans, a Plan, or a list of Plans/files). ``state`` passed
    to register_comm_hook may be a ProcessGroup (as for torch's default
    hooks) or None; ``group`` is used otherwise. ``average=False`` sums.
    ``backend``, ``transport``: as for msc.torch.run_plan."""
    registry = registry_of(plans)      # read the plans now: a bad directory fails at registration

    # the real annotation (no `from __future__ import annotations` here): DDP checks it
    def msc_allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        pg = state if isinstance(state, dist.ProcessGroup) else group
        tensor = bucket.buffer()
        if average:
            tensor.div_(dist.get_world_size(pg))
        all_reduce(registry, tensor, op="sum", group=pg, backend=backend, transport=transport)
        fut = torch.futures.Future()
        fut.set_result(tensor)
        return fut

    return msc_allreduce_hook
