"""msc on PyTorch: run compiled plans over torch.distributed, in training.

    import msc.torch as mt
    registry = mt.PlanRegistry.from_dir("plans/")          # torch-free
    mt.all_reduce(registry, tensor)                         # like dist.all_reduce
    mt.run_plan(plan, input, output, op="sum")              # any plan, any collective
    ddp.register_comm_hook(None, mt.allreduce_hook("plans/"))

- ``run_plan(plan, input, output=None, *, op, group, backend, transport)``:
  this process's part of a plan over a torch.distributed group (plan rank
  r = group rank r), run by one of two engines (``backend``, see
  msc.torch.backends):

  - "torch", the torch.distributed executor: deadlock-free rounds of
    messages (batched isend/irecv, or one all_to_all_single per round: the
    default on gloo) and local torch reductions (msc.torch.rounds,
    rank_program, execute), on any process group, one node or many. Results
    are the reference executor's (msc.executor), bit for bit.
  - "cuda", the msc CUDA runtime (msc.cuda.Communicator, placement
    "torchrun"): the plan's generated kernel across the GPUs of one node,
    one communicator per plan and group, kept. ``MSC_DEVICE=emu`` runs it
    on the emulated device (the same kernel as host threads, CPU tensors),
    so it can be tried without a GPU.
  - "auto" (default): "cuda" for tensors on the runtime's device (of a
    dtype and op its kernels take) when torchrun
    says the job is on one node, else "torch".
- One call per collective torch.distributed has (``all_reduce``,
  ``all_gather``, ...: the registry rows' ``TorchCall``, msc.dsl.collectives):
  torch.distributed's signatures with the plans first (a PlanRegistry, a
  directory, a Plan or a list).
- ``PlanRegistry``: plans by collective, ranks, form and size range
  (msc.formats.registry; ``NoPlanError`` when nothing covers a call).
- ``allreduce_hook(plans, backend=)``: a DDP communication hook (msc.torch.ddp).
- ``BackendUnavailableError``: backend="cuda" where the runtime cannot run
  the call (no GPU and driver while MSC_DEVICE is not "emu"; tensors,
  dtype, op or group it does not take), with the reason;
  ``cuda_runtime_available()``.
- ``run_local(plan, buffers, count=, op=)``: every rank in this process, for
  tests and debugging.
- The torch.distributed backend "msc" (msc.torch.process_group):
  ``dist.init_process_group("msc")`` runs every collective of any torch code
  (FSDP, DDP) on the plans in ``$MSC_PLANS`` (or ``configure(plans=...)``),
  passing the rest through to gloo/NCCL; ``report()`` says which calls msc
  served and why the others passed through (msc.torch.served).

Importing msc.torch does not import torch; the names that need it load it
on first use and say how to install it when it is missing.
"""
from __future__ import annotations

import importlib

from msc.dsl.collectives import COLLECTIVES
from msc.torch import backend_registration
from msc.formats.registry import NoPlanError, PlanEntry, PlanFolderWarning, PlanRegistry
from msc.torch.served import report
from msc.torch.settings import configure

_LAZY = {
    "run_plan": "msc.torch.calls", "registry_of": "msc.torch.calls",
    **{spec.torch.call: "msc.torch.calls" for spec in COLLECTIVES.values() if spec.torch},   # one per registry row
    "allreduce_hook": "msc.torch.ddp",
    "run_local": "msc.torch.execute", "prepare": "msc.torch.execute", "Prepared": "msc.torch.execute",
    "clear_caches": "msc.torch.execute",
    "BackendUnavailableError": "msc.torch.backends", "cuda_runtime_available": "msc.torch.backends",
    "close_communicators": "msc.torch.backends",
    "MscProcessGroup": "msc.torch.process_group", "StrictModeError": "msc.torch.process_group",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'msc.torch' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name == "torch" or (exc.name or "").startswith("torch."):
            raise ImportError(f"msc.torch.{name} needs PyTorch: pip install 'msc[torch]'") from exc
        raise
    globals()[name] = value
    return value


backend_registration.install()          # dist.init_process_group("msc") works once torch.distributed loads

__all__ = ["NoPlanError", "PlanEntry", "PlanFolderWarning", "PlanRegistry", "configure", "report", *_LAZY]
