"""Which engine runs a plan: the torch.distributed executor or the msc CUDA runtime.

Two engines run the same verified plans:

- ``"torch"``: the torch.distributed executor (msc.torch.execute): rounds
  of messages over the process group (gloo on CPU, NCCL on GPUs), on one
  node or many, every dtype msc.torch takes. Results are msc.executor's,
  bit for bit.
- ``"cuda"``: the msc CUDA runtime (msc.cuda.Communicator, placement
  "torchrun"): the plan's generated kernel, each process launching its
  rank's blocks on its GPU, peers' buffers mapped by CUDA IPC. One node
  only; the kernels take float32, float64, float16, bfloat16 and int32;
  ``avg`` pre-scales the inputs by 1/n in the kernel (NCCL's PreMulSum), so
  it is not bit-identical to the torch executor's sum-then-divide.

The runtime's *device* is ``$MSC_DEVICE`` (msc.cuda.backend): "cuda" (the
default: a CUDA driver and GPU, CUDA tensors) or "emu", the emulated device
(msc.cuda.emu: the same kernel built as host C++ and run by threads, CPU
tensors, memory files where CUDA IPC would be), which tries the runtime on any
machine. With ``MSC_DEVICE=emu`` this machine behaves, for msc.torch, as a
GPU node would: the runtime is available, its tensors are CPU tensors, and
"auto" picks it where it would pick it on GPUs.

``backend=``:

- ``"torch"``: the torch.distributed executor, always.
- ``"cuda"``: the CUDA runtime, or ``BackendUnavailableError`` (a
  UsageError) saying why it cannot run this call: no GPU/driver, no host
  compiler for "emu", a bad MSC_DEVICE, tensors on another device than the
  runtime's, a dtype or op the kernels lack, a job torchrun says spans
  nodes, more processes on this node than GPUs they all see (two ranks'
  kernels on one GPU only take turns: ``crowded_gpus``; MPS lifts it).
  Never a silent fallback.
  Where torchrun's environment does not say whether the job is on one
  node, the runtime's bootstrap checks that the peers it maps share this
  machine.
- ``"auto"`` (default): the CUDA runtime when the call is one it runs
  (tensors on the runtime's device: CUDA tensors, or CPU tensors under
  MSC_DEVICE=emu; a dtype and op its kernels take) and torchrun says
  every rank runs on this node (``single_node``) with a GPU of its own
  where that can be told (``crowded_gpus``); the torch executor
  otherwise. Processes that see different GPUs through
  CUDA_VISIBLE_DEVICES are compared by the runtime's bootstrap at the
  first call, which refuses two ranks on one GPU.

A communicator is built once per (plan, group, device) and kept (it holds
the kernels and the buffers, as an NCCL communicator does): see
``communicator``; ``close_communicators()`` frees them (a collective).
On the emulated device a launch returns before the kernel has run, so
``cuda_runner``'s function synchronizes before returning (the caller reads CPU tensors
next); on a GPU it does not: the kernel is ordered on torch's current
stream like any CUDA work.
"""
from __future__ import annotations

import os

from msc.dsl.collectives import REDUCING
from msc.ir.ops import REDUCE_OPS, kernel_op_problem
from msc.errors import UsageError

BACKENDS = ("auto", "torch", "cuda")


class BackendUnavailableError(UsageError):
    """The backend asked for cannot run this call here: the CUDA runtime
    without a GPU and driver (or a C++ compiler on the emulated device), or
    for tensors, a dtype, an op or a group it does not take. The message
    says which."""


def runtime_device() -> str:
    """The CUDA runtime's device as ``$MSC_DEVICE`` names it ("cuda" when
    unset; any other value is returned as is, and is not available)."""
    return os.environ.get("MSC_DEVICE") or "cuda"


def cuda_runtime_status() -> tuple[bool, str]:
    """(whether msc.cuda can run plans here, what it runs on or why not).
    Never raises: a GPU needs a CUDA driver with a GPU
    (msc.cuda.device.driver_available) and torch.cuda.is_available(); the
    emulated device (MSC_DEVICE=emu) needs a C++20 host compiler."""
    name = runtime_device()
    try:
        if name == "emu":
            from msc.cuda.hostbuild import find_compiler

            compiler = find_compiler()
            return True, f"the emulated device (MSC_DEVICE=emu; kernels built with {compiler.path})"
        if name != "cuda":
            return False, f"MSC_DEVICE={name!r} names no device of the msc CUDA runtime (it runs on 'cuda' or 'emu')"
        from msc.cuda import device as cu

        ok, why = cu.probe()
        if not ok:
            return False, f"no usable CUDA driver and GPU here ({why})"
        import torch

        if not torch.cuda.is_available():
            return False, (f"torch.cuda.is_available() is False although the driver sees {why} (a CPU-only build "
                           f"of torch {torch.__version__}?)")
        return True, f"CUDA ({why})"
    except Exception as exc:                # never raises: the reason is the answer
        return False, f"{type(exc).__name__}: {exc}"


def cuda_runtime_available() -> bool:
    """Whether msc.cuda can run plans here (see ``cuda_runtime_status``). Never raises."""
    return cuda_runtime_status()[0]


def tensor_device_type() -> str:
    """The torch device type of the runtime's tensors: "cuda", or "cpu" on the emulated device."""
    return "cpu" if runtime_device() == "emu" else "cuda"


def single_node(group=None) -> bool | None:
    """Whether every rank of ``group`` runs on this node, as torchrun says:
    True when LOCAL_WORLD_SIZE == WORLD_SIZE (every process of the world is
    here, so is any group's), False when they differ, None when torchrun
    did not say. ``auto`` picks the CUDA runtime only on True."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or world is None:
        return None
    return local == world


def crowded_gpus() -> str | None:
    """Why this node's torchrun processes would share GPUs, where that is certain: the CUDA
    runtime on GPUs, LOCAL_WORLD_SIZE processes that all see the same GPUs (CUDA_VISIBLE_DEVICES
    unset) and fewer of them, and no MPS. None otherwise (where processes see different GPUs, the
    bootstrap compares their PCI bus ids at the first call)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if runtime_device() != "cuda" or not local.isdigit() or os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return None
    import torch

    from msc.cuda import device as cu

    gpus = torch.cuda.device_count()
    if int(local) <= gpus or cu.mps_active():
        return None
    return (f"torchrun runs {local} processes on this node, which has {gpus} GPU(s), so ranks would share one: "
            f"{cu.SHARED_GPU}")


def kernel_dtype(dtype) -> str | None:
    """The CUDA kernels' name for a torch dtype, or None if they lack it."""
    from msc.cuda.codegen import DTYPES as KERNEL_DTYPES

    name = str(dtype).removeprefix("torch.")
    return name if name in KERNEL_DTYPES else None


def _why_not(device, dtype, op: str | None, collective: str | None) -> str | None:
    """Why the CUDA runtime cannot run a call with these tensors (None: it can)."""
    want = tensor_device_type()
    have = getattr(device, "type", None)
    if have != want:
        if want == "cpu":
            return (f"MSC_DEVICE=emu runs the msc CUDA runtime on the emulated device, which takes CPU tensors; "
                    f"these are on {device}")
        return (f"the msc CUDA runtime takes CUDA tensors, these are on {device} (MSC_DEVICE=emu runs it on CPU "
                f"tensors, on the emulated device)")
    if dtype is not None:
        from msc.cuda.codegen import DTYPES as KERNEL_DTYPES

        name = str(dtype).removeprefix("torch.")
        if name not in KERNEL_DTYPES:
            return f"the msc CUDA runtime's kernels take {', '.join(KERNEL_DTYPES)}, not {name}"
        if op in REDUCE_OPS and collective in REDUCING:
            return kernel_op_problem(op, name, KERNEL_DTYPES[name].floating)
    return None


def choose(backend: str, device, group, dtype=None, op: str | None = None, collective: str | None = None) -> str:
    """"torch" or "cuda" for a call on ``device`` (of ``dtype``, reducing
    with ``op``, a ``collective``) over ``group``. Explicit "cuda" raises
    rather than fall back (see the module doc)."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    if backend == "torch":
        return "torch"
    if backend == "cuda":
        ok, why = cuda_runtime_status()
        if not ok:
            raise BackendUnavailableError(
                f"backend='cuda': the msc CUDA runtime cannot run here: {why}. Use backend='torch' (or 'auto'), "
                f"the torch.distributed executor, which runs the same plan over NCCL or gloo; or set "
                f"MSC_DEVICE=emu to run the CUDA runtime's kernels on the emulated device (CPU tensors)")
        problem = _why_not(device, dtype, op, collective)
        if problem is not None:
            raise BackendUnavailableError(f"backend='cuda': {problem}; use backend='torch' (or 'auto')")
        if single_node(group) is False:
            raise BackendUnavailableError(
                "backend='cuda': the msc CUDA runtime runs within one node, and torchrun says this job spans nodes "
                "(LOCAL_WORLD_SIZE != WORLD_SIZE): use backend='torch'")
        crowded = crowded_gpus()
        if crowded is not None:
            raise BackendUnavailableError(f"backend='cuda': {crowded}. Use backend='torch' (or 'auto'), one process "
                                          f"per GPU, or MPS")
        return "cuda"
    # auto
    if single_node(group) and getattr(device, "type", None) == tensor_device_type() \
            and cuda_runtime_available() and _why_not(device, dtype, op, collective) is None and crowded_gpus() is None:
        return "cuda"
    return "torch"


# -- the communicators ------------------------------------------------------------------------------

_COMMUNICATORS: dict[tuple, tuple] = {}


def communicator(prepared, group, device, dtype, op: str):
    """The msc.cuda Communicator (placement "torchrun") for
    ``prepared.plan`` over ``group`` on ``device`` (a torch device): built
    at the first call, with the kernel of that call's (dtype, op) compiled
    in the constructor, and reused after (kernels of other dtypes and ops
    compile at their first call; the runtime then meets the ranks at a
    barrier). Keyed by the identities of the plan and the group (held, so
    they stay unique), the runtime's device and the GPU index. Its waits
    last ``runtime_timeout``: taken when it is built."""
    import torch.distributed as dist

    from msc.cuda.runtime import Communicator

    pg = group if group is not None else dist.group.WORLD
    name = runtime_device()
    index = device.index if name == "cuda" and device.index is not None else None
    custom = _custom_collective(prepared)
    key = (id(prepared.plan), id(custom), id(pg), name, index)
    hit = _COMMUNICATORS.get(key)
    if hit is not None and hit[0] is prepared.plan and hit[1] is custom and hit[2] is pg:
        return hit[3]
    comm = Communicator(prepared.plan, "torchrun", devices=index, device=name, group=group, collective=custom,
                        dtypes=(kernel_dtype(dtype),), ops=(op,), timeout_s=runtime_timeout(pg, device))
    _COMMUNICATORS[key] = (prepared.plan, custom, pg, comm)
    return comm


def runtime_timeout(pg, device) -> float:
    """How long the CUDA runtime's waits last (a kernel's spin-wait for a
    peer, its bootstrap's wait for the peers' handles): ``MSC_TORCH_TIMEOUT``
    or ``msc.torch.agree.set_timeout`` where set, else the process group's
    timeout (``init_process_group(timeout=...)``, ``new_group(timeout=...)``),
    as for the torch executor, whose waits are the group's."""
    from msc.torch import agree

    return agree.timeout_s(group_timeout_s(pg, device))


def group_timeout_s(pg, device) -> float:
    """The timeout of ``pg``'s backend for tensors on ``device``; else the
    default store's (init_process_group's timeout); else torch's default."""
    import torch.distributed as dist

    try:
        seconds = pg._get_backend(device).options._timeout.total_seconds()      # private: guarded
    except Exception:
        try:
            seconds = dist.distributed_c10d._get_default_store().timeout.total_seconds()
        except Exception:
            seconds = dist.default_pg_timeout.total_seconds()
    from msc.torch.agree import MAX_TIMEOUT_S

    return min(float(seconds), MAX_TIMEOUT_S) if seconds > 0 else float(dist.default_pg_timeout.total_seconds())


def _custom_collective(prepared):
    """The collective to hand msc.cuda: None for the plan's own built-in
    one (its kernels are cached by name), else the custom object."""
    from msc.dsl.collectives import BUILTIN, collective_key

    coll = prepared.collective
    builtin = BUILTIN.get(collective_key(prepared.plan.collective))
    return None if builtin is not None and type(coll) is builtin else coll


def cuda_runner(prepared, call, op: str, group):
    """A function that runs ``prepared.plan`` on physical buffers (``{"input":
    tensor, "output": tensor}``) with the msc CUDA runtime, for ``call`` (a
    msc.torch.calls._Call); calls._physical maps the call form onto them
    exactly as for the torch executor (at most one copy where the forms
    differ). On the emulated device it returns after the kernel has run; on
    a GPU after it is queued on the current stream."""
    comm = communicator(prepared, group, call.device, call.dtype, op)
    plan = prepared.plan
    host = comm.backend.host_tensors

    def run(phys):
        if plan.inplace:
            comm.run(phys.get("input"), phys.get("output"), op)
        else:
            comm.run(phys["input"], phys["output"], op)
        if host:                     # the kernel runs behind the call: _physical's copies, and the caller, read next
            comm.synchronize()

    return run


def communicators() -> list:
    """The cached communicators, oldest first (what ``backend="cuda"`` has built)."""
    return [entry[-1] for entry in _COMMUNICATORS.values()]


def close_communicators() -> None:
    """Free every cached communicator's buffers. A collective: every rank
    of every group that ran a plan on the CUDA runtime must call it, in the
    same order, before its process group is destroyed."""
    while _COMMUNICATORS:
        _, (*_, comm) = _COMMUNICATORS.popitem()
        comm.close()
