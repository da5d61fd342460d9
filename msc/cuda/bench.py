"""``msc bench PLAN --backend cuda``: time a plan on a GPU, nccl-tests style,
with two baselines measured in the same run on the same per-rank tensors.

- the plan, through msc.cuda.Communicator (virtual placement by default:
  every rank on one GPU), plain launches, or with ``-G N`` the ``-n``
  launches captured in one CUDA graph and replayed N times;
- ``torch``: a one-GPU PyTorch implementation of the same collective
  (``torch_collective``: stack + reduce + copy back for allreduce, ...);
- ``copy``: device-to-device copy bandwidth of the size (the ceiling).

Flags and columns follow nccl-tests and ``msc run`` (msc.units: sizes,
dtype names, the table): -b -e -f sizes, -n timed iterations, -w warm-up
iterations, -G graph replays, -d dtype, -o op, -c check; columns size
count type redop root time algbw busbw #wrong, then the baselines. #wrong
comes from one run on fresh random inputs (never zero) with poisoned
outputs, compared to msc.verification.reference. Without a GPU and driver the command
exits 2 and says so; it exits 1 when any element is wrong.

The communicator compiles only the kernel the run uses (its dtype and op)
and spin-waits at most ``timeout_s`` (default 30 s, not the runtime's 300 s:
a hang in a benchmark ends quickly with its diagnosis).

``--backend emu`` runs the same code on the emulated device (msc.cuda.emu:
CPU torch tensors, times from the host clock around a synchronize, no CUDA
graphs): it checks the benchmark itself, not speed (bench/first_gpu_run.py
--device emu uses it).

Everything here but the emulated device and ``torch_collective`` (tested on
CPU tensors) needs a GPU and has not run on one yet.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

from msc.dsl.collectives import Arrays, collective_spec
from msc.errors import UsageError

DEFAULT_TIMEOUT_S = 30.0        # seconds a benchmark's spin-wait may last (the runtime's default is 300)


def torch_collective(collective: str, inputs: list, outputs: list, op: str = "sum", root: int = 0) -> None:
    """The collective over per-rank logical tensors, with plain torch ops on
    whatever device they are (the baseline; also right on CPU)."""
    import torch

    n = len(inputs)

    def reduce(stack):
        if op in ("sum", "avg"):
            out = stack.sum(0)
            return out / n if op == "avg" else out
        if op == "prod":
            return stack.prod(0)
        if op == "max":
            return stack.amax(0)
        if op == "min":
            return stack.amin(0)
        raise UsageError(f"unknown reduction {op!r}")

    spec = collective_spec(collective, refusal="no PyTorch baseline for collective")
    arrays = Arrays(inputs, root, torch.stack, torch.cat, lambda stack: reduce(stack).to(inputs[0].dtype))
    for out, value in zip(outputs, spec.reference(arrays)):
        if value is not None:
            out.copy_(value.reshape(-1))


def environment(device: int) -> dict:
    """What a result file records about the machine and software."""
    import torch

    from msc.cuda import device as cu
    from msc.cuda.compiler import nvrtc_version

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(device), "arch": cu.arch(device), "nvrtc": nvrtc_version()}
    try:
        from cuda.bindings import driver

        env["driver"] = cu.call(driver.cuDriverGetVersion)
        import cuda.bindings
        import cuda.core

        env["cuda_core"], env["cuda_bindings"] = cuda.core.__version__, cuda.bindings.__version__
    except Exception as exc:       # versions are a courtesy
        env["versions_error"] = str(exc)
    return env


def _timed(fn, iters: int, warmup: int, graphs: int = 0, host: bool = False, finish=None) -> float:
    """Microseconds per call of ``fn``: on the current CUDA stream (events), or ``host`` (the
    emulated device, CPU tensors) by the host clock, ``finish`` (a synchronize) before it stops."""
    if host:
        import time

        if graphs > 0:
            raise UsageError("CUDA graphs need a GPU: the emulated device times plain calls (-G 0)")
        for _ in range(warmup):
            fn()
        if finish is not None:
            finish()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if finish is not None:
            finish()
        return (time.perf_counter() - t0) * 1e6 / iters
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graphs > 0:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()                                   # warm up on the capture stream too
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
        start.record()
        for _ in range(graphs):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000 / (graphs * iters)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def _to_numpy(t):
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a, device):
    import numpy as np
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def bench(plan, *, min_bytes, max_bytes, factor: int = 2, iters: int = 20, warmup: int = 5, graphs: int = 0,
          dtype: str = "float", op: str = "sum", placement: str = "virtual", device: int | None = None,
          check: bool = True, seed: int = 0, baselines: bool = True, backend: str | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Records per size (msc run's fields plus the baselines). ``backend``: "cuda" or "emu"
    (None: $MSC_DEVICE, else "cuda"); ``device``: the GPU index. ``check``: count wrong elements of
    one call against msc.verification.reference (True), or on the device (``"device"``:
    check_on_device, for sizes too large for the host), or not at all (False)."""
    import numpy as np

    from msc.cuda.backend import choose
    from msc.cuda.runtime import Communicator
    from msc.cuda.validate import check_op
    from msc.progress import steps
    from msc.verification.plan import plan_collective
    from msc.units import TYPES, parse_dtype, parse_size, sizes

    runtime = choose(backend)
    runtime.require()
    host = runtime.host_tensors
    if placement != "virtual":
        raise UsageError("msc bench runs the virtual placement (every rank on one GPU)")
    if iters < 1 or warmup < 0 or graphs < 0:
        raise UsageError(f"need -n >= 1, -w >= 0, -G >= 0; got {iters}, {warmup}, {graphs}")
    if host and graphs:
        raise UsageError("CUDA graphs need a GPU: the emulated device times plain calls (-G 0)")
    tname, dt = parse_dtype(dtype)
    dev = _bind(device, host)
    kernel_dtype = TYPES[tname]
    comm = Communicator(plan, "virtual", None if host else dev, device=runtime.name, timeout_s=timeout_s,
                        dtypes=(kernel_dtype,), ops=(check_op(plan, op, kernel_dtype),))
    run = _Run(comm, plan, plan_collective(plan), tname, dt, _torch_dtype(tname), op, check, seed, iters,
               warmup, graphs, host, "cpu" if host else dev, baselines, np.random.default_rng(seed))
    try:
        swept = sizes(parse_size(min_bytes), parse_size(max_bytes), factor)
        records = [_record(run, requested)
                   for requested in steps(swept, f"timing {plan.name} on the GPU against torch", unit="size")]
        comm.synchronize()
    finally:
        comm.close()
    return {"plan": plan.name, "collective": plan.collective, "ranks": plan.num_ranks, "protocol": plan.protocol,
            "backend": runtime.name, "placement": placement, "inplace": plan.inplace,
            "environment": environment(dev) if not host else host_environment(),
            "wrong": sum(r["wrong"] for r in records), "records": records}


@dataclass(frozen=True)
class _Run:
    """One benchmark's communicator and options (bench's arguments, resolved)."""

    comm: object
    plan: object
    coll: object
    tname: str
    dt: object                # the numpy dtype
    tdtype: object            # the torch dtype
    op: str
    check: bool | str
    seed: int
    iters: int
    warmup: int
    graphs: int
    host: bool
    where: object             # a GPU index, or "cpu" (the emulated device)
    baselines: bool
    rng: object


def _record(run: _Run, requested: int) -> dict:
    """One size: checked once (``run.check``), timed, and the baselines beside it."""
    from msc.cuda.validate import units
    from msc.dsl.collectives import REDUCING
    from msc.dsl.collectives import BUSBW_FACTOR

    plan, coll, comm, n = run.plan, run.coll, run.comm, run.plan.num_ranks
    in_units, out_units = units(plan)
    count = requested // (run.dt.itemsize * max(in_units, out_units))
    size = count * max(in_units, out_units) * run.dt.itemsize
    ins, outs = _tensors(n, in_units * count, out_units * count, run.tdtype, run.where)
    call = _call(comm, plan, coll, ins, outs, count)
    wrong = [0] * n
    if run.check == "device":
        wrong = check_on_device(comm, count, run.op, run.tdtype, run.where, run.seed)
    elif run.check:
        wrong = _check(comm, plan, coll, run.rng, run.dt, run.op, n, count, in_units, out_units,
                       None if run.host else run.where)
    t = _timed(lambda: call(run.op), run.iters, run.warmup, run.graphs, run.host, comm.synchronize) if count else 0.0
    reducing = coll.name in REDUCING
    rec = {"size": size, "count": count, "type": run.tname, "redop": run.op if reducing else "none",
           "root": plan.root if coll.has_root else -1, "time": t, "algbw": size / t / 1e3 if t > 0 else 0.0,
           "wrong": sum(wrong), "wrong_per_rank": wrong, "inplace": plan.inplace, "requested_size": requested,
           "rounded": size != requested, "graph_replays": run.graphs}
    rec["busbw"] = rec["algbw"] * BUSBW_FACTOR[coll.name](n)
    if run.baselines and count:
        rec.update(_baseline_times(coll.name, plan.root, ins, outs, run.op if reducing else "sum", size, t, run.iters,
                                   run.warmup, run.where, run.host))
    return rec


def _bind(device: int | None, host: bool) -> int | None:
    """The GPU the run uses, made current (None on the emulated device)."""
    if host:
        return None
    import torch

    dev = torch.cuda.current_device() if device is None else device
    torch.cuda.set_device(dev)
    return dev


def _tensors(n: int, in_numel: int, out_numel: int, tdtype, where):
    """Per-rank logical inputs (uniform in [1, 2)) and outputs on ``where`` (a GPU index or "cpu")."""
    import torch

    ins = [torch.empty(in_numel, dtype=tdtype, device=where).uniform_(1, 2) for _ in range(n)]
    outs = [torch.empty(out_numel, dtype=tdtype, device=where) for _ in range(n)]
    return ins, outs


def host_environment() -> dict:
    """What a result file records about an emulated-device run."""
    import os

    import torch

    from msc.cuda.emu import DEFAULT_THREADS

    return {"python": platform.python_version(), "torch": torch.__version__, "gpu": "emulated device (msc.cuda.emu)",
            "arch": "host", "cpus": os.cpu_count(), "threads_per_block": os.environ.get("MSC_EMU_THREADS",
                                                                                      str(DEFAULT_THREADS))}


def _torch_dtype(tname: str):
    """The torch dtype of element type ``tname`` (a parse_dtype name); an
    error where the CUDA kernels have none."""
    import torch

    from msc.units import TYPES

    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float64": torch.float64, "int32": torch.int32}.get(TYPES[tname])
    if tdtype is None:
        raise UsageError(f"the CUDA kernels have no {tname}")
    return tdtype


def _baseline_times(collective: str, root: int, ins, outs, op: str, size: int, t: float, iters: int, warmup: int,
                    where, host: bool = False) -> dict:
    """The baselines' record fields: PyTorch's collective on the same
    tensors, and a device copy of ``size`` bytes, against our time ``t``."""
    import torch

    bt = _timed(lambda: torch_collective(collective, ins, outs, op, root), iters, warmup, host=host)
    src = torch.empty(size, dtype=torch.uint8, device=where)
    dst = torch.empty_like(src)
    ct = _timed(lambda: dst.copy_(src), iters, warmup, host=host)
    return {"torch_time": bt, "torch_algbw": size / bt / 1e3 if bt > 0 else 0.0, "copy_time": ct,
            "copy_bw": size / ct / 1e3 if ct > 0 else 0.0, "speedup": bt / t if t > 0 else 0.0}


def _call(comm, plan, coll, ins, outs, count):
    """A function op -> one launch on the physical buffers of ``ins``/``outs``."""
    if not plan.inplace:
        return lambda op: comm.run(ins, outs, op)
    alias, target, _ = coll.inplace_alias(0, plan.num_ranks, plan.chunk_factor)
    if target == "input":
        return lambda op: comm.run(ins, None, op)
    return lambda op: comm.run(None, outs, op)


def _check(comm, plan, coll, rng, dt, op, n, count, in_units, out_units, dev) -> list[int]:
    """Wrong elements per rank of one run on fresh inputs, outputs poisoned."""
    from msc.verification import reference

    inputs = reference.random_inputs(rng, dt, op, n, in_units * count)
    got = run_numpy(comm, inputs, count, op, dev)
    return reference.check(coll.name, inputs, got, op=op, root=plan.root)


def run_numpy(comm, inputs: list, count: int, op: str, dev: int | None = None, *, synchronize: bool = True) -> list:
    """Run ``comm`` (virtual placement) once on per-rank logical numpy
    inputs, every output poisoned first (bytes 0xA5); the logical outputs as
    numpy arrays, after synchronizing (which raises a launch's error). On
    the emulated device the tensors are numpy arrays (no torch needed), on a
    GPU torch tensors on GPU ``dev``. ``synchronize=False`` (emulated device
    only: its outputs are the arrays the kernel writes) returns them at once,
    to be read after ``comm.synchronize()``."""
    if not synchronize and not comm.backend.host_tensors:
        raise UsageError("run_numpy(synchronize=False) returns the kernel's own arrays: emulated device only")
    import numpy as np

    from msc.cuda.validate import units

    n = comm.plan.num_ranks
    _, out_units = units(comm.plan)
    if comm.backend.host_tensors:
        ins = [np.array(a, copy=True) for a in inputs]
        outs = [np.full(out_units * count * a.itemsize, 0xA5, np.uint8).view(a.dtype) for a in ins[:1] * n]
        to_numpy = np.asarray
    else:
        import torch

        ins = [_from_numpy(a, dev) for a in inputs]
        outs = [torch.empty(out_units * count, dtype=ins[0].dtype, device=dev) for _ in range(n)]
        for o in outs:
            o.view(torch.uint8).fill_(0xA5)
        to_numpy = _to_numpy
    got = run_once(comm, ins, outs, count, op)
    if synchronize:
        comm.synchronize()
    return [to_numpy(g) for g in got]


def run_once(comm, ins: list, outs: list, count: int, op: str) -> list:
    """One call of ``comm`` on per-rank logical inputs ``ins`` and output buffers ``outs`` (numpy
    arrays or tensors, as the device takes them; ``ins`` may be overwritten), in the form the plan
    runs: in place, the input in its unit of the output (allgather) or the output over the input.
    Returns the logical outputs (not synchronized)."""
    from msc.verification.plan import plan_collective

    plan = comm.plan
    n, k = plan.num_ranks, plan.chunk_factor
    coll = plan_collective(plan)
    if not plan.inplace:
        return comm.run(ins, outs, op)
    alias, target, _ = coll.inplace_alias(0, n, k)
    if target == "output":                         # allgather: the input sits in unit `rank` of the output
        for r, o in enumerate(outs):
            off = coll.inplace_alias(r, n, k)[2] // k
            o[off * count:off * count + len(ins[r])] = ins[r]
        return comm.run(None, outs, op)
    return comm.run(ins, None, op)


EXACT_OPS = ("sum", "max", "min")


def check_on_device(comm, count: int, op: str, tdtype, where, seed: int = 0) -> list[int]:
    """Wrong elements per rank of one call on fresh inputs that stay on the device: random small
    integers (1..8, never zero), so that every order of additions is exact (n x 8 < 2^8: bfloat16's
    integers, up to 32 ranks), checked bit for bit against ``torch_collective`` on the same device.
    For sizes whose host round trip (msc.verification.reference) would take minutes; outputs
    poisoned first. Ops whose results depend on the order (prod overflows, avg pre-scales) are
    refused."""
    import torch

    from msc.cuda.validate import units
    from msc.verification.plan import plan_collective

    plan = comm.plan
    n = plan.num_ranks
    coll = plan_collective(plan)
    if op not in EXACT_OPS:
        raise UsageError(f"an on-device check needs an op exact in any order ({', '.join(EXACT_OPS)}), not {op!r}")
    if n * 8 >= 256:
        raise UsageError(f"an on-device check sums up to {n} x 8: not exact in bfloat16 beyond 31 ranks")
    in_units, out_units = units(plan)
    gen = torch.Generator(device=where).manual_seed(seed)
    ints = torch.int16 if tdtype.itemsize <= 2 else torch.int32          # no int64 temporary (1 GB ranks)
    ins = [torch.randint(1, 9, (in_units * count,), generator=gen, device=where, dtype=ints).to(tdtype)
           for _ in range(n)]
    want = [torch.empty(out_units * count, dtype=tdtype, device=where) for _ in range(n)]
    torch_collective(coll.name, ins, want, op, plan.root)
    outs = [torch.empty(out_units * count, dtype=tdtype, device=where) for _ in range(n)]
    for o in outs:
        o.view(torch.uint8).fill_(0xA5)
    got = run_once(comm, [x.clone() for x in ins], outs, count, op)
    comm.synchronize()
    specified = [coll.name != "reduce" or r == plan.root for r in range(n)]       # reduce: only the root's
    return [int((_bits(got[r]) != _bits(want[r])).sum()) if specified[r] else 0 for r in range(n)]


def _bits(t):
    """A tensor's elements as integers of their width (a bitwise comparison; NaN == NaN)."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def format_baselines(records: list[dict]) -> str:
    """The baselines beside msc: PyTorch on one GPU, and the copy ceiling."""
    from msc.units import time_text

    lines = ["# baselines on the same GPU and tensors: torch = one-GPU PyTorch collective, copy = device copy",
             f"#{'size':>11}  {'msc':>7}  {'torch':>7}  {'speedup':>7}  {'copy':>7}  {'copy bw':>7}  {'msc/copy':>8}",
             f"#{'(B)':>11}  {'(us)':>7}  {'(us)':>7}  {'':>7}  {'(us)':>7}  {'(GB/s)':>7}  {'(busbw)':>8}"]
    for r in records:
        if "torch_time" not in r:
            continue
        frac = r["busbw"] / r["copy_bw"] if r["copy_bw"] else 0.0
        lines.append(f"{r['size']:12d}  {time_text(r['time'])}  {time_text(r['torch_time'])}  {r['speedup']:7.2f}  "
                     f"{time_text(r['copy_time'])}  {r['copy_bw']:7.1f}  {frac:8.2f}")
    return "\n".join(lines)
