"""A pool of torch.distributed (gloo, CPU) worker processes for tests.

Starting processes and importing torch costs seconds, so a pool starts
``n`` workers once and runs many cases on them: ``pool.run(fn, *args)``
calls the module-level ``fn(rank, n, *args)`` in every worker and returns
the per-rank results, or raises with the workers' tracebacks. A case that
hangs fails after ``timeout`` seconds of a quiet machine (wall time divided
by the load per core as it passes: tests/patience.py), naming the case and
the ranks that did not answer, and the pool is torn down (a deadlock must
not hang the test run, and a loaded machine must not fail it).

Workers are forked from a forkserver that imported torch (and ml_dtypes) once
for the test process (torch.multiprocessing, forkserver with them preloaded): a
new worker costs a fork, not torch's 3 CPU-seconds of imports. The forkserver
itself imports nothing else and starts no thread, and each worker takes the
environment of the process that made its pool (as a spawned one would), not
the forkserver's.
"""
from __future__ import annotations

import os
import queue
import tempfile
import traceback


# What the forkserver imports once: torch, its distributed package and ml_dtypes (every case's
# np_dtype imports it: 0.4-0.8 CPU-s in each of the default run's ~23 workers); no msc, no test
# module: those a worker imports itself, with the environment its pool gives it.
PRELOAD = ["torch", "torch.distributed", "ml_dtypes"]


def _worker(rank: int, n: int, init_method: str, jobs, results, backend: str = "gloo", env=None) -> None:
    os.environ.clear()                  # the pool maker's environment, not the forkserver's
    os.environ.update(env or {})
    import torch
    import torch.distributed as dist

    if backend == "msc":
        import msc.torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)           # n processes share the machine's cores
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=n)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(rank, n, *args)))
        except BaseException:           # report, keep serving: the next case must not hang
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def stop_forkserver() -> None:
    """Stop the forkserver (if one started) and wait for it (multiprocessing has no public call for this)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


class Pool:
    """n gloo worker processes meeting through a FileStore, or (``tcp``) a
    TCPStore that rank 0 hosts, as under torchrun (a FileStore polls, and
    counts its timeouts in whole seconds)."""

    def __init__(self, n: int, timeout: float = 60.0, *, tcp: bool = False, backend: str = "gloo", env=None):
        import torch.multiprocessing as mp

        self.n, self.timeout = n, timeout
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._init_file = None
        if tcp:
            import socket

            with socket.socket() as s:              # a free port (rank 0's store binds it a moment later)
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        else:
            fd, self._init_file = tempfile.mkstemp(prefix="msc-gloo-")
            os.close(fd)
            os.unlink(self._init_file)      # the file store creates it
            init_method = f"file://{self._init_file}"
        self.jobs = [ctx.Queue() for _ in range(n)]
        self.results = ctx.Queue()
        environ = {**os.environ, **(env or {})}
        self.procs = [ctx.Process(target=_worker, args=(r, n, init_method, self.jobs[r], self.results, backend,
                                                        environ), daemon=True) for r in range(n)]
        for p in self.procs:
            p.start()
        self.broken = None

    def run(self, fn, *args) -> list:
        if self.broken:
            raise RuntimeError(f"the pool is broken: {self.broken}")
        for q in self.jobs:
            q.put((fn, args))
        from patience import Waiter

        out, errors, waiting = [None] * self.n, [], set(range(self.n))
        waiter = Waiter(self.timeout)
        while waiting:
            try:
                rank, ok, value = self.results.get(timeout=waiter.slice())
            except queue.Empty:
                if not waiter.expired:
                    continue
                ranks = ", ".join(map(str, sorted(waiting)))
                self.broken = (f"{fn.__name__}{args!r} did not finish in {self.timeout} s of a quiet machine "
                               f"(load-scaled): rank(s) {ranks} of {self.n} never answered (deadlock?)")
                self.close(patience_s=2)        # the workers are stuck in the case: no long goodbye
                raise TimeoutError(self.broken) from None
            waiting.discard(rank)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return out

    def close(self, patience_s: float = 30.0) -> None:
        """Ask every worker to leave (it destroys its group and exits), wait ``patience_s`` seconds of a
        quiet machine for each, then kill what is left; ``self.unclean`` says which ranks were killed."""
        from patience import join

        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        self.unclean = []
        for rank, p in enumerate(self.procs):
            if not join(p, patience_s):
                self.unclean.append(f"rank {rank} (pid {p.pid}) did not exit within {patience_s} s of a quiet "
                                    f"machine after the pool closed: killed")
                p.kill()
                p.join()
        if self._init_file is not None:
            try:
                os.unlink(self._init_file)
            except OSError:
                pass


# -- cases, run in the workers (module-level so spawn can find them) ---------------------------------

import functools
from pathlib import Path

from msc.dsl.collectives import COLLECTIVES, REDUCING

ROOT = Path(__file__).resolve().parent.parent


def _library() -> Path:
    from msc.resources import data_dir

    return data_dir("algorithms")
# (dtype, op) pairs the collective cases cycle through: every dtype and every op appear
COMBOS = (("float32", "sum"), ("bfloat16", "sum"), ("int32", "max"), ("float16", "avg"), ("int64", "prod"),
          ("float64", "min"), ("int64", "avg"), ("float32", "prod"), ("uint8", "sum"), ("float64", "sum"),
          ("int32", "min"), ("float32", "avg"))


@functools.cache
def algorithms(switch: bool = True) -> dict:
    """The library; ``switch=False``: without the algorithms with switch ops
    (NVLS), which the torch executor does not run yet."""
    import msc

    library = _library()
    found = {f"{p.relative_to(library).with_suffix('').as_posix()}:{a.name}": a
             for p in sorted(library.rglob("*.py")) if p.name != "__init__.py" for a in msc.load_algorithms(p)}
    if switch:
        return found
    return {key: a for key, a in found.items()
            if not msc.trace(a, next(n for n in range(2, 65) if a.supports(n))).has_switch}


@functools.cache
def library_plan(key: str, n: int, inplace: bool, instances: int = 1, root: int = 0):
    import msc
    from msc.lower.pipeline import LowerOptions, lower

    alg = algorithms()[key]
    program = msc.trace(alg, n, inplace=inplace, **({"root": root} if alg.collective.has_root else {}))
    msc.verify(program)
    return lower(program, LowerOptions(instances=instances))


def np_dtype(name: str):
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def to_torch(a):
    import numpy as np
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t):
    import ml_dtypes

    if str(t.dtype) == "torch.bfloat16":
        return t.contiguous().view(__import__("torch").int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _silent(owner, name):
    """``owner.name`` called with its FutureWarnings silenced (all_gather_into_tensor & co are being renamed)."""
    import warnings

    fn = getattr(owner, name)

    def call(*args, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return fn(*args, **kw)
    return call


def _by_row(call, collective: str, x, count: int, n: int, rank: int, op: str, root: int, inplace: bool):
    """``call`` (torch.distributed's function, or msc.torch's) of the
    collective as its registry row (TorchCall) names the buffers, on a copy
    of this rank's input; returns this rank's output (None where the
    collective leaves it unspecified). In place: one tensor, or NCCL's
    aliasing (the input unit ``rank`` of the output, or the reverse); a
    list form given on the root only (gather, scatter) has no in-place form."""
    import torch

    from msc.dsl.collectives import get_collective

    spec = COLLECTIVES[collective]
    tc = spec.torch
    units = dict(zip(("input", "output"), spec.units(n)))
    kw = {**({tc.root: root} if tc.root else {}), **({"op": op} if spec.reduces else {})}
    unspecified_here = unspecified(collective, rank, n, root)
    if tc.at_root:
        arg, buffer = tc.listed
        (other, _), = [(b, a) for a, b in tc.args]
        given = None
        if rank == root:
            given = [x[i * count:(i + 1) * count].clone() for i in range(n)] if buffer == "input" else \
                [torch.full((count,), 7, dtype=x.dtype) for _ in range(n)]
        tensor = x.clone() if other == "input" else torch.full((count,), 7, dtype=x.dtype)
        call(tensor, **{arg: given}, **kw)
        if unspecified_here:
            return None
        return torch.cat(given) if buffer == "output" else tensor
    if len(tc.args) == 1:
        t = x.clone()
        call(t, **kw)
        return None if unspecified_here else t
    alias, target, offset = get_collective(collective).inplace_alias(rank, n, 1)
    if inplace:
        whole = torch.full((units[target] * count,), 7, dtype=x.dtype) if target == "output" else x.clone()
        part = whole[offset * count:(offset + units[alias]) * count]
        if target == "output":
            part.copy_(x)
        tensors = {target: whole, alias: part}
    else:
        tensors = {"input": x.clone(), "output": torch.full((units["output"] * count,), 7, dtype=x.dtype)}
    call(*(tensors[buffer] for _, buffer in tc.args), **kw)
    return None if unspecified_here else tensors["output"] if "output" in tensors else tensors["input"]


def unspecified(collective: str, rank: int, n: int, root: int) -> bool:
    """Whether the collective leaves this rank's output unspecified (reduce, gather off the root)."""
    from msc.dsl.collectives import get_collective

    return all(e is None for e in get_collective(collective).postconditions(rank, n, 1, root))


def _dist_result(collective: str, x, n: int, count: int, op: str, root: int):
    """torch.distributed's own collective on a copy of this rank's input;
    None where gloo has no such operation (integer avg) or the output is
    unspecified (reduce off the root)."""
    import torch
    import torch.distributed as dist

    rop = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}[op]
    if op == "avg" and not x.dtype.is_floating_point and collective in REDUCING:
        return None
    tc = COLLECTIVES[collective].torch
    if tc is None:                      # sendrecv: no torch.distributed collective, its point-to-point calls
        t, rank = torch.empty_like(x), dist.get_rank()
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n),
                                           dist.P2POp(dist.irecv, t, (rank - 1) % n)]):
            req.wait()
        return t
    fn = _silent(dist, tc.function)
    call = (lambda *a, op=None, **kw: fn(*a, op=rop, **kw)) if COLLECTIVES[collective].reduces else fn
    return _by_row(call, collective, x, count, n, dist.get_rank(), op, root, False)


def _msc_call(collective: str, plans, x, count: int, n: int, rank: int, op: str, root: int, inplace: bool,
              transport: str):
    """The msc.torch collective with torch.distributed's signature; returns the output."""
    return msc_call(collective, plans, x, count, n, rank, op, root, inplace, transport=transport)


class _With:
    """A module whose collectives get extra keyword arguments."""

    def __init__(self, module, **kw):
        self.module, self.kw = module, kw

    def __getattr__(self, name):
        import functools

        return functools.partial(getattr(self.module, name), **self.kw)


def collective_cases(rank: int, n: int, cases: list) -> int:
    """Each case (algorithm key, plan in place, instances, root, call in
    place, count, dtype, op): the msc result must equal the reference
    executor's bit for bit, and torch.distributed's within tolerance.
    Returns the number of checks made."""
    import numpy as np
    import torch

    from msc.verification import reference
    from msc.executor import run_collective

    checks = 0
    for i, (key, plan_inplace, instances, root, call_inplace, count, dtype, op) in enumerate(cases):
        plan = library_plan(key, n, plan_inplace, instances, root)
        coll = plan.collective
        units = plan.input_chunks // plan.chunk_factor
        dt = np_dtype(dtype)
        inputs = reference.random_inputs(np.random.default_rng(1000 + i), dt, op, n, units * count)
        assert all(np.all(a != 0) for a in inputs)
        x = to_torch(inputs[rank])
        transport = ("alltoall", "p2p", "mixed")[i % 3]
        mine = _msc_call(coll, plan, x.clone(), count, n, rank, op, root, call_inplace, transport)
        where = f"case {i}: {key} n={n} plan {'in' if plan_inplace else 'out'}-place i{instances} root {root}, " \
                f"call {'in' if call_inplace else 'out'}-place, count {count}, {dtype} {op}, {transport}, rank {rank}"
        assert torch.equal(x, to_torch(inputs[rank])), where + ": the input changed"
        if unspecified(coll, rank, n, root):
            _dist_result(coll, x, n, count, op, root)       # take part; nothing to compare
            continue
        # bit for bit the reference executor (msc.executor), whatever the call form
        ref = run_collective(plan, inputs, op, count=count)[rank]
        got = to_numpy(mine)
        assert got.tobytes() == ref.tobytes(), f"{where}: differs from msc.executor: {got[:8]} vs {ref[:8]}"
        # torch.distributed's own collective, within float tolerance
        theirs = _dist_result(coll, x, n, count, op, root)
        if theirs is not None:
            rtol = 2 * reference.tolerance(dt, n, op, coll)
            scale = None
            if rtol and op != "prod":
                mags = [np.abs(a.astype(np.float64)) for a in inputs]
                scale = [reference.expected_outputs(coll, mags, op="avg" if op == "avg" else "sum", root=root)[rank]]
            wrong = reference.count_wrong([got], [to_numpy(theirs)], rtol=rtol, scale=scale)
            assert wrong == [0], f"{where}: {wrong[0]} elements differ from torch.distributed"
        checks += 1
    return checks


def error_cases(rank: int, n: int) -> list[str]:
    """Misuse gives typed msc errors on every rank, and nothing hangs after."""
    import torch

    import msc.torch as mt
    from msc.errors import UsageError

    out = []
    ring = library_plan("allreduce/ring:ring", n, True)
    other = library_plan("allreduce/ring:ring", n + 1, True)

    def expect(exc_type, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except exc_type as exc:
            out.append(str(exc))
        else:
            raise AssertionError(f"{fn.__name__}{args} did not raise {exc_type.__name__}")

    expect(UsageError, mt.run_plan, other, torch.ones(8))                     # plan for n+1 ranks
    expect(UsageError, mt.run_plan, ring, torch.ones(8, 2)[:, 0])             # not contiguous
    expect(UsageError, mt.run_plan, ring, torch.ones(8, dtype=torch.complex64))
    expect(UsageError, mt.run_plan, ring, torch.ones(8), op="xor")
    expect(UsageError, mt.run_plan, ring, torch.ones(8), torch.ones(9))        # sizes disagree
    ag = library_plan("allgather/ring:ring", n, False)
    expect(UsageError, mt.run_plan, ag, torch.ones(5), torch.ones(5))          # output must be n units
    expect(mt.BackendUnavailableError, mt.run_plan, ring, torch.ones(8), backend="cuda")
    registry = mt.PlanRegistry()
    registry.add(ring, max_bytes=1024)
    expect(mt.NoPlanError, mt.all_reduce, registry, torch.ones(1024))          # 4 KiB: not covered
    # and a good call still works after all that
    t = torch.full((10,), float(rank + 1))
    mt.all_reduce(registry, t)
    assert t.tolist() == [float(n * (n + 1) // 2)] * 10, t
    return out


def any_root_cases(rank: int, n: int) -> list[str]:
    """msc.torch's broadcast and reduce with one plan of root 0 (a Plan, and
    a registry) at every root: torch.distributed's results (bit for bit at
    these sizes: a sum of n int32), each root's plan verified once."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt
    from msc.torch import calls

    seen = []
    for key, call in (("broadcast/chain:chain", "broadcast"), ("reduce/ring:ring", "reduce")):
        plan = library_plan(key, n, True)
        registry = mt.PlanRegistry.from_plans([plan])
        for root in range(n):
            for plans in (plan, registry):
                x = torch.randint(1, 1000, (301,), generator=torch.Generator().manual_seed(10 * root + rank),
                                  dtype=torch.int32)
                mine, theirs = x.clone(), x.clone()
                if call == "broadcast":
                    mt.broadcast(plans, mine, src=root)
                    dist.broadcast(theirs, src=root)
                else:
                    mt.reduce(plans, mine, dst=root)
                    dist.reduce(theirs, dst=root)
                assert rank != root and call == "reduce" or torch.equal(mine, theirs), (key, root, rank)
            seen.append(calls.for_root(plan, root).root)
    return seen


# rows rank s sends rank d in an all_to_all_single with splits: MoE-like skew with empty pieces, a rank
# that sends nothing, equal splits given as sizes, and nothing at all
SPLITS = {"skewed": lambda s, d: (s * 7 + d * 13) % 11, "silent rank 0": lambda s, d: 0 if s == 0 else 3 + s + d,
          "equal": lambda s, d: 4, "empty": lambda s, d: 0}


def uneven_cases(rank: int, n: int, backend: str = "torch", cases=None) -> dict:
    """msc.torch.all_to_all with split sizes (msc.torch.uneven) against
    torch.distributed's all_to_all_single on gloo, bit for bit, for each of
    ``cases`` (SPLITS name, dtype name; default: every SPLITS in int32 and
    float32), rows of 3 elements; once more with the agreement off (the
    splits through an all_gather); then splits that do not pair up: a
    SplitMismatchError on every rank, nothing written."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt
    from msc.torch import backends, uneven

    before = {id(c) for c in backends.communicators()}   # a shared pool keeps earlier tests' communicators

    if backend == "cuda":
        os.environ["MSC_DEVICE"] = "emu"
    plans = mt.PlanRegistry.from_plans([library_plan("alltoall/allpairs:allpairs", n, False)])
    out = {}
    for name, dtype in cases or [(name, dtype) for name in SPLITS for dtype in ("int32", "float32")]:
        rows, dtype = SPLITS[name], getattr(torch, dtype)
        ins, outs = [rows(rank, d) for d in range(n)], [rows(s, rank) for s in range(n)]
        x = torch.randint(1, 1 << 20, (sum(ins), 3), generator=torch.Generator().manual_seed(rank)).to(dtype)
        mine, theirs = torch.full((sum(outs), 3), 7, dtype=dtype), torch.zeros(sum(outs), 3, dtype=dtype)
        mt.all_to_all(plans, mine, x, outs, ins, backend=backend)
        dist.all_to_all_single(theirs, x, outs, ins)
        out[f"{name} {dtype}"] = torch.equal(mine, theirs)
    os.environ["MSC_TORCH_AGREE"] = "0"
    try:
        rows = SPLITS["skewed"]
        ins, outs = [rows(rank, d) for d in range(n)], [rows(s, rank) for s in range(n)]
        x = torch.arange(sum(ins), dtype=torch.float32) + 1000 * rank
        mine, theirs = torch.zeros(sum(outs)), torch.zeros(sum(outs))
        mt.all_to_all(plans, mine, x, outs, ins, backend=backend)
        dist.all_to_all_single(theirs, x, outs, ins)
        out["agreement off"] = torch.equal(mine, theirs)
    finally:
        del os.environ["MSC_TORCH_AGREE"]
    ins = [2] * n
    outs = [2] * n if rank else [3] + [2] * (n - 1)               # rank 0 expects 3 rows from rank 0
    x, y = torch.ones(sum(ins)), torch.full((sum(outs),), 5.0)
    try:
        mt.all_to_all(plans, y, x, outs, ins, backend=backend)
        out["mismatch"] = "no error"
    except uneven.SplitMismatchError as exc:
        out["mismatch"] = str(exc)
    out["untouched"] = bool((y == 5).all())
    out["runtime plans"] = sorted({(c.plan.name, c.backend.name) for c in backends.communicators()
                                   if id(c) not in before})
    return out


def registry_cases(rank: int, n: int) -> list[str]:
    """Calls pick plans by size: ring below 4 KiB, allpairs above."""
    import torch

    import msc.torch as mt

    registry = mt.PlanRegistry()
    registry.add(library_plan("allreduce/ring:ring", n, True), max_bytes="4K")
    registry.add(library_plan("allreduce/allpairs:allpairs", n, True), min_bytes="4K")
    names = []
    for numel in (1, 1023, 1024, 5000):
        names.append(registry.entry("allreduce", n, numel * 4, True).plan.name)
        t = torch.arange(numel, dtype=torch.float32) + rank
        mt.all_reduce(registry, t)
        expect = n * torch.arange(numel, dtype=torch.float32) + n * (n - 1) / 2
        assert torch.equal(t, expect), (numel, t[:4], expect[:4])
    return names


def ddp_case(rank: int, n: int, steps: int, plan_dir: str) -> dict:
    """Losses of the example's model trained with the msc hook and with stock DDP."""
    import importlib.util

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import msc.torch as mt

    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "train_ddp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.argparse.Namespace(seed=0, batch=4, seq=16, vocab=64, dim=32, heads=2, layers=2, lr=3e-3)
    hook = mt.allreduce_hook(plan_dir)
    calls = []

    def counting(state, bucket):          # unannotated: DDP checks annotations, and they are strings here
        calls.append(bucket.buffer().numel())
        return hook(state, bucket)

    losses = {}
    for mode in ("msc", "stock"):
        torch.manual_seed(0)
        model = example.TinyLM(args.vocab, args.dim, args.heads, args.layers, args.seq)
        ddp = DDP(model, bucket_cap_mb=0.02)
        if mode == "msc":
            ddp.register_comm_hook(None, counting)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        losses[mode] = []
        for step in range(steps):
            x, y = example.batch(args, rank, step, torch.device("cpu"))
            loss = torch.nn.functional.cross_entropy(ddp(x).reshape(-1, args.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
    return {**losses, "bucket_sizes": sorted(set(calls)), "hook_calls": len(calls)}


# -- msc.torch on the msc CUDA runtime, on the emulated device (MSC_DEVICE=emu) ----------------------

def msc_call(collective: str, plans, x, count: int, n: int, rank: int, op: str, root: int, inplace: bool, **kw):
    """The msc.torch collective with torch.distributed's signature (its
    registry row's), with any keyword arguments (``backend=``); a call of
    one tensor out of place, or of a collective torch has no call for,
    through run_plan. Returns the output (None where unspecified)."""
    import torch

    import msc.torch as mt

    mt = _With(mt, **kw)
    tc = COLLECTIVES[collective].torch
    if tc is None or (len(tc.args) == 1 and not tc.at_root and not inplace):
        out = None if inplace else torch.full((COLLECTIVES[collective].units(n)[1] * count,), 7, dtype=x.dtype)
        return mt.run_plan(plans, x.clone() if inplace else x, out, op=op)
    return _by_row(lambda *a, **k: getattr(mt, tc.call)(plans, *a, **k), collective, x, count, n, rank, op, root,
                   inplace)


def cuda_collective_cases(rank: int, n: int, cases: list, rounds: int = 2) -> dict:
    """Each case (algorithm key, plan in place, root, call in place, count,
    dtype, op) with backend="cuda" on the emulated device against the torch
    executor (backend="torch") on the same random non-zero inputs: bit for
    bit, except avg (the kernel pre-scales by 1/n: within a few roundings)
    and a reduce's non-root ranks (unspecified). ``rounds`` times over: the
    communicators of the first round serve the others (same objects, no
    reallocation). Returns what the checks saw."""
    import os

    import numpy as np
    import torch

    from msc.torch import backends
    from msc.verification import reference

    os.environ["MSC_DEVICE"] = "emu"
    seen = []
    for rnd in range(rounds):
        for i, (key, plan_inplace, root, call_inplace, count, dtype, op) in enumerate(cases):
            plan = library_plan(key, n, plan_inplace, 1, root)
            coll = plan.collective
            units = plan.input_chunks // plan.chunk_factor
            rng = np.random.default_rng(100 * rnd + i)
            inputs = reference.random_inputs(rng, np_dtype(dtype), op, n, units * count)
            assert all(np.all(a != 0) for a in inputs)
            x = to_torch(inputs[rank])
            where = f"round {rnd} case {i}: {key} plan {'in' if plan_inplace else 'out'}-place root {root}, call " \
                    f"{'in' if call_inplace else 'out'}-place, count {count}, {dtype} {op}, rank {rank}"
            mine = msc_call(coll, plan, x.clone(), count, n, rank, op, root, call_inplace, backend="cuda")
            theirs = msc_call(coll, plan, x.clone(), count, n, rank, op, root, call_inplace, backend="torch")
            assert torch.equal(x, to_torch(inputs[rank])), where + ": the input changed"
            if unspecified(coll, rank, n, root):
                continue
            a, b = to_numpy(mine).astype(np.float64), to_numpy(theirs).astype(np.float64)
            if op == "avg":
                eps = float(np.finfo(np_dtype(dtype)).eps) if np_dtype(dtype).kind == "f" else 2 ** -7
                assert np.allclose(a, b, rtol=4 * eps, atol=0), f"{where}: {a[:4]} vs {b[:4]}"
            else:
                assert to_numpy(mine).tobytes() == to_numpy(theirs).tobytes(), f"{where}: {a[:4]} vs {b[:4]}"
        comms = backends.communicators()
        seen.append([(id(c), c.plan.name, c.plan.collective, c._generation) for c in comms])
    return {"rounds": seen, "device": [c.backend.name for c in backends.communicators()]}


def cuda_error_cases(rank: int, n: int) -> list[str]:
    """backend="cuda" refuses what the runtime cannot run, with the reason,
    and never falls back; "auto" falls back for those calls."""
    import dataclasses
    import os

    import torch

    import msc.torch as mt
    from msc.torch import backends

    out = []
    ring = library_plan("allreduce/ring:ring", n, True)

    def expect(exc_type, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except exc_type as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        else:
            raise AssertionError(f"{fn.__name__}{args} {kw} did not raise {exc_type.__name__}")

    from msc.cuda.device import driver_available

    names = ("MSC_DEVICE", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
    saved = {k: os.environ.pop(k, None) for k in names}
    try:
        if not driver_available():
            expect(mt.BackendUnavailableError, mt.run_plan, ring, torch.ones(8), backend="cuda")   # no GPU, no emu
        os.environ["MSC_DEVICE"] = "emu"
        before = len(backends.communicators())
        expect(mt.BackendUnavailableError, mt.run_plan, ring, torch.ones(8, dtype=torch.int64), backend="cuda")
        expect(mt.BackendUnavailableError, mt.run_plan, ring, torch.ones(8, dtype=torch.int32), op="avg",
               backend="cuda")
        assert len(backends.communicators()) == before          # refused before any communicator
        # auto: the runtime when torchrun says one node, for what its kernels take; the executor otherwise
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"] = str(n)
        t = torch.full((8,), rank + 1, dtype=torch.int64)
        mt.run_plan(ring, t, backend="auto")
        assert t.tolist() == [n * (n + 1) // 2] * 8 and len(backends.communicators()) == before
        fresh = dataclasses.replace(ring)                      # a plan no communicator runs yet
        t = torch.full((8,), rank + 1, dtype=torch.float32)
        mt.run_plan(fresh, t, backend="auto")
        assert t.tolist() == [n * (n + 1) // 2] * 8 and len(backends.communicators()) == before + 1
        assert backends.communicators()[-1].plan is fresh
        os.environ["LOCAL_WORLD_SIZE"] = "1"                     # torchrun says: more than one node
        expect(mt.BackendUnavailableError, mt.run_plan, ring, t, backend="cuda")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out



# -- ranks that disagree (msc.torch.agree) ---------------------------------------------------------

def _raised(fn, *args, **kw):
    """(exception or None, seconds) of one call."""
    import time

    t0 = time.perf_counter()
    try:
        fn(*args, **kw)
    except Exception as exc:           # the test looks at the type and the message
        return exc, time.perf_counter() - t0
    return None, time.perf_counter() - t0


def agree_mismatch_cases(rank: int, n: int, timeout: float) -> list:
    """Each case: every rank calls with its own arguments (rank 0 one way,
    the others another); returns per case (error type, message, seconds,
    whether the tensor is unchanged); then a good call must still work."""
    import torch

    import msc.torch as mt
    from msc.torch import agree

    agree.set_timeout(timeout)
    ring = library_plan("allreduce/ring:ring", n, True)
    ring2 = library_plan("allreduce/ring:ring", n, True, 2)          # 2 instances: another plan, the same name
    first = rank == 0
    cases = {
        "dtype": dict(t=torch.full((1024,), 3.0) if first else torch.full((1024,), 3, dtype=torch.int32)),
        "width": dict(t=torch.ones(1024, dtype=torch.float32 if first else torch.float64)),
        "count": dict(t=torch.ones(1024 if first else 1000)),
        "transport": dict(t=torch.ones(64), kw=dict(transport="p2p" if first else "alltoall")),
        "op": dict(t=torch.ones(64), kw=dict(op="sum" if first else "max")),
        "plan": dict(t=torch.ones(64), plan=ring if first else ring2),
        # the CUDA runtime on the emulated device on rank 1 (refused before it builds anything)
        "backend": dict(t=torch.ones(64), kw=dict(backend="torch" if first else "cuda"), emu=not first),
    }
    out = []
    for name, case in cases.items():
        t = case["t"]
        before = t.clone()
        saved = os.environ.get("MSC_DEVICE")
        if case.get("emu"):
            os.environ["MSC_DEVICE"] = "emu"
        try:
            exc, dt = _raised(mt.run_plan, case.get("plan", ring), t, **case.get("kw", {}))
        finally:
            if saved is None:
                os.environ.pop("MSC_DEVICE", None)
            else:
                os.environ["MSC_DEVICE"] = saved
        out.append((name, type(exc).__name__, str(exc), dt, torch.equal(t, before)))
    t = torch.full((100,), float(rank + 1))
    mt.all_reduce(ring, t)
    assert t.tolist() == [n * (n + 1) / 2] * 100
    agree.set_timeout(None)
    return out


def agree_local_failure_case(rank: int, n: int, timeout: float) -> tuple:
    """Rank 0's size has no plan (NoPlanError), the others' has: every rank
    raises at once, the others quoting rank 0's error."""
    import torch

    import msc.torch as mt
    from msc.torch import agree

    agree.set_timeout(timeout)
    registry = mt.PlanRegistry()
    registry.add(library_plan("allreduce/ring:ring", n, True), max_bytes="4K")
    exc, dt = _raised(mt.all_reduce, registry, torch.ones(4096 if rank == 0 else 16))
    t = torch.ones(16)
    mt.all_reduce(registry, t)
    assert t.tolist() == [float(n)] * 16
    agree.set_timeout(None)
    return type(exc).__name__, str(exc), dt


def agree_stall_case(rank: int, n: int, timeout: float) -> tuple:
    """Rank 1 comes to the call only after rank 0's timeout: rank 0 raises
    naming it; rank 1 raises saying rank 0 gave up; the group goes on."""
    import torch

    import msc.torch as mt
    from msc.torch import agree

    agree.set_timeout(timeout)
    import torch.distributed as dist

    ring = library_plan("allreduce/ring:ring", n, True)
    # rank 1 comes to the call once rank 0 has given up (its signal in the store), not after a fixed
    # sleep: on a loaded machine rank 0 can start its wait later than a sleeping rank 1 wakes
    store, signal = agree.gate(None, rank, n).store, "msc-test-rank0-gave-up"
    dist.barrier()
    if rank == 1:
        store.wait([signal])
        store.delete_key(signal)
    t = torch.ones(64)
    exc, dt = _raised(mt.run_plan, ring, t)
    if rank == 0:
        store.set(signal, "1")
    missing = getattr(exc, "missing", None)
    agree.set_timeout(None)                      # the next call waits for rank 1 to wake up
    t = torch.ones(64)
    mt.run_plan(ring, t)
    assert t.tolist() == [float(n)] * 64
    return type(exc).__name__, str(exc), dt, missing


def agree_never_case(rank: int, n: int, timeout: float) -> tuple:
    """On a group of its own, rank 1 never makes the call rank 0 makes."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt
    from msc.torch import agree

    agree.set_timeout(timeout)
    sub = dist.new_group(list(range(n)))
    result = (None, "", 0.0)
    if rank == 0:
        exc, dt = _raised(mt.run_plan, library_plan("allreduce/ring:ring", n, True), torch.ones(8), group=sub)
        result = (type(exc).__name__, str(exc), dt)
    agree.set_timeout(None)
    dist.barrier()                       # the default group is untouched
    return result


def agree_repeat_case(rank: int, n: int, calls: int) -> dict:
    """``calls`` identical calls: one signature built, one digest exchange
    per call, the store's records of earlier calls deleted, no full
    exchange; then a different count: one more signature."""
    import torch

    import msc.torch as mt
    from msc.torch import agree

    ring = library_plan("allreduce/ring:ring", n, True)
    t = torch.ones(256)
    mt.run_plan(ring, t)                         # the first call builds the signature
    before = agree.stats()
    for _ in range(calls):
        t = torch.full((256,), float(rank))
        mt.run_plan(ring, t)
        assert t.tolist() == [n * (n - 1) / 2] * 256
    after = agree.stats()
    g = agree.gate(None, rank, n)
    left = [s for s in range(after["seq"]) if g.store.check([g.key(s, rank)])]
    mt.run_plan(ring, torch.ones(77))            # another count
    return {"before": before, "after": after, "left": left, "built_new": agree.stats()["signatures_built"]}


def agree_off_case(rank: int, n: int) -> dict:
    """MSC_TORCH_AGREE=0 on every rank: no agreement, the call runs."""
    import os

    import torch

    import msc.torch as mt
    from msc.torch import agree

    before = agree.stats()
    os.environ["MSC_TORCH_AGREE"] = "0"
    try:
        t = torch.ones(32)
        mt.run_plan(library_plan("allreduce/ring:ring", n, True), t)
        assert t.tolist() == [float(n)] * 32
    finally:
        del os.environ["MSC_TORCH_AGREE"]
    return {"before": before, "after": agree.stats()}


def agree_without_store_case(rank: int, n: int) -> tuple:
    """Where torch's default store cannot be had: all_gather_object, same checks."""
    import torch

    import msc.torch as mt
    from msc.torch import agree

    g = agree.gate(None, rank, n)
    saved = g.base
    g.base = None
    try:
        ring = library_plan("allreduce/ring:ring", n, True)
        exc, _ = _raised(mt.run_plan, ring, torch.ones(64 if rank == 0 else 32))
        t = torch.ones(64)
        mt.run_plan(ring, t)
        assert t.tolist() == [float(n)] * 64
    finally:
        g.base = saved
    return type(exc).__name__, str(exc)


def agree_releases_group_case(rank: int, n: int) -> bool:
    """msc keeps no group alive: after destroy_process_group(sub) its Gate
    goes (a group held past its destruction aborts the process at exit)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    import msc.torch as mt
    from msc.torch import agree

    sub = dist.new_group(list(range(n)))
    t = torch.ones(8)
    mt.run_plan(library_plan("allreduce/ring:ring", n, True), t, group=sub)
    assert t.tolist() == [float(n)] * 8
    key, ref = id(sub), weakref.ref(sub)
    assert agree._GATES[key].pg() is sub
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    return ref() is None and key not in agree._GATES
