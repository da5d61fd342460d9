"""``run_plan`` and the torch.distributed-like collectives.

A call names logical tensors as torch.distributed does; the plan names
physical buffers (msc.dsl.collectives layouts). The *call form* is in place
when the tensors alias as NCCL's in-place forms do (allreduce, broadcast,
reduce, alltoall: one tensor; allgather: the input is unit ``rank`` of the
output; reducescatter: the output is unit ``rank`` of the input), out of
place otherwise. A plan of the other form still runs, at the price of one
copy (see ``_physical``). Both engines (msc.torch.backends: the
torch.distributed executor and the msc CUDA runtime) run on the physical
buffers ``_physical`` hands them.

Every call (``_run``) checks its arguments, picks its plan and engine,
then has the group's ranks agree that they all make this call
(msc.torch.agree: one exchange of a digest through torch.distributed's
store, with a timeout) before any data moves; a call that fails on one
rank before that point tells the others, which raise at once.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from msc.errors import UsageError
from msc.ir import Plan
from msc.torch import agree, backends, uneven
from msc.torch.execute import (DTYPES, DistTransport, Prepared, check_op_dtype, choose_transport, execute, op_name,
                               prepare)
from msc.dsl.collectives import COLLECTIVES, collective_key
from msc.formats.registry import PlanRegistry

_SUPPORTED = set(DTYPES)


def _group_info(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("torch.distributed is not initialized: call torch.distributed.init_process_group first "
                         "(or launch with torchrun)")
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise UsageError("this process is not a member of the group it calls a collective on")
    return rank, n


def _flat(t: torch.Tensor | None, what: str) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise UsageError(f"{what} must be contiguous (as torch.distributed requires); call .contiguous() first")
    if t.dtype not in _SUPPORTED:
        raise UsageError(f"{what}: unsupported dtype {t.dtype} (msc runs {', '.join(str(d) for d in DTYPES)})")
    return t.view(-1)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class _Call:
    """A call of ``collective`` over ``n`` ranks with chunk factor ``k``:
    its count (elements per unit), form and tensors."""

    def __init__(self, collective, n: int, k: int, rank: int, input, output):
        name = collective.name
        units = {}
        for which, chunks in (("input", collective.input_chunks(n, k)), ("output", collective.output_chunks(n, k))):
            if chunks % k:
                raise UsageError(f"{name}: {which} of {chunks} chunks is not whole units of {k} chunks; "
                                 f"msc.torch runs collectives whose buffers are whole units")
            units[which] = chunks // k
        alias, target, offset = collective.inplace_alias(rank, n, k)
        if offset % k:
            raise UsageError(f"{name}: the in-place {alias} starts inside a data unit")
        self.alias, self.target, self.unit = alias, target, offset // k
        tensors = {"input": _flat(input, "input"), "output": _flat(output, "output")}
        given = {which: t for which, t in tensors.items() if t is not None}
        if not given:
            raise UsageError("no tensors given")
        dtypes = {t.dtype for t in given.values()}
        devices = {t.device for t in given.values()}
        if len(dtypes) > 1 or len(devices) > 1:
            raise UsageError(f"input and output differ in dtype or device: {sorted(map(str, dtypes | devices))}")
        base = "input" if tensors["input"] is not None else "output"
        numel = given[base].numel()
        if units[base] == 0 or numel % units[base]:
            raise UsageError(f"{name} over {n} ranks: {base} of {numel} elements is not "
                             f"{units[base]} equal units")
        self.count = count = numel // units[base]
        self.units = units
        self.dtype, self.device = given[base].dtype, given[base].device
        self.itemsize = given[base].element_size()
        # the form: NCCL's in-place aliasing, or one tensor standing for both
        whole = tensors[target]
        part = tensors[alias]
        if whole is None and alias == "output" and units[alias] == units[target] and self.unit == 0:
            whole = tensors["input"]                 # all_reduce(tensor): the output is the input
        if whole is None:
            raise UsageError(f"{name}: the {target} tensor is required")
        if whole.numel() != units[target] * count:
            raise UsageError(f"{name}: {target} has {whole.numel()} elements, expected "
                             f"{units[target] * count} ({units[target]} units of {count})")
        view = whole[self.unit * count:(self.unit + units[alias]) * count]
        if part is None or _same_memory(part, view):
            self.inplace, self.whole, self.part = True, whole, view
        else:
            if part.numel() != units[alias] * count:
                raise UsageError(f"{name}: {alias} has {part.numel()} elements, expected "
                                 f"{units[alias] * count} ({units[alias]} units of {count})")
            if _overlap(part, whole):
                raise UsageError(f"{name}: input and output overlap but not as the in-place form "
                                 f"({alias} = unit {self.unit} of {target})")
            self.inplace = False
        self.tensors = tensors if not self.inplace else None

    @property
    def output(self) -> torch.Tensor:
        if self.inplace:
            return self.whole if self.target == "output" else self.part
        return self.tensors["output"]

    def nbytes(self) -> int:
        return max(self.units.values()) * self.count * self.itemsize


def _physical(prepared: Prepared, call: _Call, run) -> None:
    """Run on physical buffers, adapting the call form to the plan's form."""
    plan = prepared.plan
    if plan.inplace and call.inplace:
        run({call.target: call.whole})
    elif not plan.inplace and not call.inplace:
        run(call.tensors)
    elif plan.inplace:                                   # out-of-place call, in-place plan
        src, dst = call.tensors["input"], call.tensors["output"]
        if call.target == "output":                      # allgather: the input goes to its unit of the output
            dst[call.unit * call.count:(call.unit + call.units["input"]) * call.count].copy_(src)
            run({"output": dst})
        elif call.units["output"] == call.units["input"] and call.unit == 0:
            dst.copy_(src)                               # allreduce & co: run on the output
            run({"input": dst})
        else:                                            # reducescatter: the input must stay untouched
            tmp = src.clone()
            run({"input": tmp})
            dst.copy_(tmp[call.unit * call.count:(call.unit + call.units["output"]) * call.count])
    else:                                                # in-place call, out-of-place plan
        if call.target == "input":
            tmp = torch.empty(call.units["output"] * call.count, dtype=call.dtype, device=call.device)
            run({"input": call.whole, "output": tmp})
            call.part.copy_(tmp)
        else:
            run({"input": call.part.clone(), "output": call.whole})


def _load(plan):
    if isinstance(plan, (str, Path)):
        from msc.formats.load import load_plan

        return load_plan(plan)
    return plan


def run_plan(plan, input: torch.Tensor | None, output: torch.Tensor | None = None, *, op="sum", group=None,
             backend: str = "auto", transport: str = "auto", collective=None) -> torch.Tensor:
    """Run ``plan`` (a verified Plan, or a plan file) as this process's
    part of the collective over ``group`` (default: the world), the plan's
    rank r being group rank r. Every rank of the group must make the same
    call (same plan, count, dtype, op, transport, backend), as for any
    collective: before anything is sent the ranks check that they do
    (msc.torch.agree) and otherwise all raise an AgreementError (what
    differs, with every rank's value; a rank that does not come within
    the timeout is named). Returns the output tensor (a view of the input
    for in-place reducescatter).

    ``op``: "sum", "prod", "max", "min", "avg" or a torch.distributed.ReduceOp.
    ``backend`` (msc.torch.backends): "torch", the torch.distributed
    executor, which blocks until this rank is done. "cuda", the msc CUDA
    runtime (a Communicator per plan and group, kept): on a GPU the kernel
    is queued on torch's current stream and the call returns (later work
    on that stream sees the results, as with NCCL); on the emulated device
    (MSC_DEVICE=emu, CPU tensors) it returns once the kernel has run; it
    raises, never falls back, when the runtime cannot run the call. "auto"
    (default): the CUDA runtime for tensors on its device (CUDA; CPU under
    MSC_DEVICE=emu) of a dtype and op its kernels take, when torchrun says
    the job is on one node; the torch executor otherwise. avg on the
    runtime scales the inputs by 1/n before summing: not bit-identical to
    the executor's sum-then-divide.
    ``transport``: how the torch.distributed executor moves a round's
    messages: "p2p" (batched isend/irecv), "alltoall" (one
    all_to_all_single per round), "mixed" (all_to_all_single for the
    rounds where at least half of all pairs of ranks talk, p2p for the
    others) or "auto" (mixed on gloo, p2p otherwise); the CUDA runtime
    ignores it.
    """
    return _run(lambda: _load(plan), input, output, op=op, group=group, backend=backend, transport=transport,
                collective=collective)


def _run(get_plan, input, output, *, op="sum", group=None, backend: str = "auto", transport: str = "auto",
         collective=None, engine_used: list | None = None, what: str | None = None) -> torch.Tensor:
    """A call: ``get_plan()`` (the plan, or what ``prepare`` takes), the
    checks, the ranks' agreement (msc.torch.agree), then the engine. What
    fails on this rank before the agreement is published to the other
    ranks (``Gate.fail``), so that they raise at once instead of waiting
    for this rank until the timeout. The engine chosen ("torch" or
    "cuda") is appended to ``engine_used`` where given."""
    import torch.distributed as dist

    rank, n = _group_info(group)
    gate = agree.gate(group, rank, n)
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    drain = getattr(pg, "drain", None)          # an msc group's served calls running behind the caller go first
    if drain is not None:
        drain()
    with agree.one_call_at_a_time(pg, _what(what or collective, input, output), gate):
        return _run_alone(get_plan, input, output, op, group, backend, transport, collective, engine_used, rank, n,
                          gate, pg)


def _what(collective, input, output) -> str:
    """A call as a ConcurrentCallError names it."""
    name = getattr(collective, "name", collective) or "a collective"
    t = input if input is not None else output
    return f"{name} of {t.numel()} {str(t.dtype).replace('torch.', '')}" if isinstance(t, torch.Tensor) else name


def _run_alone(get_plan, input, output, op, group, backend, transport, collective, engine_used, rank, n, gate, pg):
    try:
        prepared = prepare(get_plan(), collective)
        if prepared.plan.num_ranks != n:
            raise UsageError(f"plan {prepared.plan.name!r} is for {prepared.plan.num_ranks} ranks, the group has {n}")
        op = op_name(op)
        call = _Call(prepared.collective, n, prepared.plan.chunk_factor, rank, input, output)
        check_op_dtype(op, call.dtype)
        chosen = backends.choose(backend, call.device, group, call.dtype, op, prepared.collective.name)
        tr = choose_transport(transport, group, n) if chosen == "torch" else None
        prog = prepared.program(rank, call.count, tr) if tr is not None else None
        sig = agree.signature(prepared, call.count, call.dtype, op, tr, chosen, call.device.type) if gate else None
    except Exception as exc:
        if gate is not None:
            gate.fail(exc)
        raise
    if gate is not None:
        gate.agree(sig, f"{prepared.collective.name} with plan {prepared.plan.name!r}")
    if engine_used is not None:
        engine_used.append(chosen)
    # on the msc backend (msc.torch.process_group) msc's own messages go to its fallback, uncounted
    with getattr(pg, "serving", nullcontext)():
        if chosen == "cuda":
            _physical(prepared, call, backends.cuda_runner(prepared, call, op, group))   # the msc CUDA runtime
            return call.output
        comm = DistTransport(group)
        _physical(prepared, call, lambda phys: execute(prog, phys, op, comm))
    return call.output


# -- torch.distributed-like calls --------------------------------------------------------------------

def registry_of(plans) -> PlanRegistry | Plan | Prepared:
    """What callers pass as ``plans``, ready for ``pick``: a PlanRegistry,
    a Plan (or Prepared) as is; a directory (``PlanRegistry.from_dir``) or a
    plan or index file, read once per process (cached by resolved path);
    a list of Plans and plan files (each for all sizes)."""
    if isinstance(plans, (PlanRegistry, Plan, Prepared)):
        return plans
    if isinstance(plans, (str, Path)):
        key = str(Path(plans).resolve())
        hit = _REGISTRIES.get(key)
        if hit is None:
            p = Path(plans)
            hit = _REGISTRIES[key] = PlanRegistry.from_dir(p) if p.is_dir() else PlanRegistry.from_files([p])
        return hit
    if isinstance(plans, (list, tuple)):
        return PlanRegistry.from_plans(plans)
    raise UsageError(f"plans must be a PlanRegistry, a Plan, a path or a list of them, got {type(plans).__name__}")


_REGISTRIES: dict[str, PlanRegistry] = {}


def pick(plans, collective: str, group, input, output, root: int = 0) -> Plan | Prepared:
    """The plan ``plans`` offers for this call."""
    def size():
        from msc.dsl.collectives import get_collective

        rank, n = _group_info(group)
        call = _Call(get_collective(collective), n, 1, rank, input, output)
        return n, call.nbytes(), call.inplace
    return pick_sized(plans, collective, size, root)


def pick_sized(plans, collective: str, size, root: int = 0) -> Plan | Prepared:
    """The plan ``plans`` offers for a call of ``collective`` whose size
    ``size()`` gives as (ranks, bytes, in place), asked only of a registry."""
    found = registry_of(plans)
    if not isinstance(found, PlanRegistry):
        plan = found.plan if isinstance(found, Prepared) else found
        if collective_key(plan.collective) != collective_key(collective):
            raise UsageError(f"plan {plan.name!r} is a {plan.collective} plan, this call is {collective}")
        return found
    n, nbytes, inplace = size()
    return found.select(collective, n, nbytes, inplace, root)


def _picked(plans, collective: str, group, input, output, root: int | None = None):
    """``get_plan`` for ``_run``: the plan ``plans`` offers for the call
    (picked inside the call, so that a NoPlanError is published to the
    other ranks like any failure before communicating); a rooted plan of
    another root turned to the call's (``for_root``)."""
    def get():
        plan = pick(plans, collective, group, input, output, root or 0)
        return plan if root is None else for_root(plan, root)
    return get


def _derived(spec):
    """msc.torch's call of ``spec``'s collective (``spec.torch``, a
    TorchCall): torch.distributed's arguments after ``plans``, then
    ``group`` and run_plan's keywords. Its tensors are msc's buffers as
    the row names them; a call of one tensor is in place; the in-place
    forms are NCCL's (the input unit ``rank`` of the output, or the
    output unit ``rank`` of the input); a root argument is a group rank (a
    plan of another root is turned to it: ``for_root``)."""
    from inspect import Parameter, Signature

    tc, name = spec.torch, spec.name
    arg = lambda a, default=Parameter.empty: Parameter(a, Parameter.POSITIONAL_OR_KEYWORD, default=default)  # noqa
    params = [arg("plans"), *(arg(a) for a, _ in tc.args)]
    params += [arg(tc.listed[0], None)] if tc.at_root else []
    params += [arg("output_split_sizes", None), arg("input_split_sizes", None)] if tc.splits else []
    params += [arg(tc.root, 0)] if tc.root else []
    params += [arg("op", "sum")] if spec.reduces else []
    sig = Signature([*params, arg("group", None), Parameter("kw", Parameter.VAR_KEYWORD)])

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        plans, group, kw = a["plans"], a["group"], a["kw"]
        tensors = {buffer: a[x] for x, buffer in tc.args}
        if tc.splits and (a["output_split_sizes"] or a["input_split_sizes"]):
            return _all_to_all_uneven(plans, tensors["output"], tensors["input"], a["output_split_sizes"],
                                      a["input_split_sizes"], group, **kw)
        root = a[tc.root] if tc.root else None
        if spec.reduces:
            kw["op"] = a["op"]
        if tc.at_root:
            return _at_root(spec, plans, tensors, a[tc.listed[0]], root, group, kw)
        inp, out = tensors.get("input"), tensors.get("output")
        return _run(_picked(plans, name, group, inp, out, root), inp, out, group=group, **kw)

    call.__name__ = call.__qualname__ = tc.call
    call.__signature__ = sig
    call.__doc__ = f"As torch.distributed.{tc.function}, on the plan ``plans`` offers ({_derived.__name__}: how the " \
                   f"arguments name msc's buffers). Returns the output tensor."
    return call


def _at_root(spec, plans, tensors, listed, root: int, group, kw):
    """A call whose list (``spec.torch.listed``: gather's gather_list,
    scatter's scatter_list) is given on the root only: there the n equal
    tensors as one buffer (copied out after, for an output), elsewhere a
    buffer of msc's own. Returns the list on the root (an output list) or
    the tensor, None on the other ranks of a gather."""
    rank, n = _group_info(group)
    (other, tensor), = tensors.items()
    arg, buffer = spec.torch.listed
    units = dict(zip(("input", "output"), spec.units(n)))
    t = _flat(tensor, other)
    numel = t.numel() // units[other] * units[buffer]
    if rank == root:
        if not isinstance(listed, (list, tuple)) or len(listed) != units[buffer] or any(
                not isinstance(x, torch.Tensor) or x.numel() != numel // units[buffer] for x in listed):
            raise UsageError(f"{spec.name}: on the root (rank {root}) {arg} must be a list of {units[buffer]} tensors "
                             f"of {numel // units[buffer]} elements each")
        whole = torch.cat([x.reshape(-1) for x in listed]) if buffer == "input" else \
            torch.empty(numel, dtype=t.dtype, device=t.device)
    else:
        whole = torch.zeros(numel, dtype=t.dtype, device=t.device)
    inp, out = (whole, t) if buffer == "input" else (t, whole)
    _run(_picked(plans, spec.name, group, inp, out, root), inp, out, group=group, **kw)
    if buffer == "input":
        return tensor
    if rank != root:
        return None
    for i, x in enumerate(listed):
        x.copy_(whole[i * x.numel():(i + 1) * x.numel()].view_as(x))
    return listed


def _all_to_all_uneven(plans, output, input, output_split_sizes, input_split_sizes, group, **kw) -> torch.Tensor:
    """With split sizes: the plan ``plans`` offers for the padded size
    (``pad`` rows per pair) runs on padded units (msc.torch.uneven). Every
    rank must call it."""
    rank, n = _group_info(group)
    if not output.is_contiguous():
        raise UsageError("all_to_all_single: the output must be contiguous (as torch.distributed requires)")
    splits = uneven.exchange(group, rank, n, output, input, output_split_sizes, input_split_sizes)
    if splits.pad == 0:
        return output                            # every split is empty, on every rank
    nbytes = splits.padded_numel() * input.element_size()
    plan = lambda: pick_sized(plans, "alltoall", lambda: (n, nbytes, False))  # noqa: E731
    return uneven.run_padded(splits, lambda send, recv: _run(plan, send, recv, group=group, what="alltoall with splits",
                                                             **kw), output, input)



def _install() -> None:
    """msc.torch's calls, one per registry row torch has a call for."""
    for spec in COLLECTIVES.values():
        if spec.torch is not None:
            globals()[spec.torch.call] = _derived(spec)


_install()


_TURNED: dict[tuple[int, int], tuple[Plan, Plan]] = {}      # (id(plan), root) -> (plan, turned and verified)


def for_root(plan, root: int):
    """``plan`` (a Plan or Prepared) serving ``root``: as it is where its root
    is that, else its ranks renamed (msc.lower.relabel.for_root) and the
    result verified, once per plan and root."""
    p = plan.plan if isinstance(plan, Prepared) else plan
    if p.root == root:
        return plan
    key = (id(p), root)
    hit = _TURNED.get(key)
    if hit is None or hit[0] is not p:
        from msc.lower.relabel import for_root as turn
        from msc.verification.plan import verify_plan

        turned = turn(p, root)
        verify_plan(turned)
        hit = _TURNED[key] = (p, turned)
    return hit[1]
