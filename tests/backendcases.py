"""Cases for the "msc" torch.distributed backend, run in tests/torchdist.py
pool workers whose default group is on the msc backend (module-level so
that spawn finds them). Each case compares the msc group's results with a
stock gloo group's on the same random (never zero) data."""
from __future__ import annotations

import functools
import warnings


@functools.cache
def stock_group():
    """A gloo group over the same ranks (made once per worker, in the same order on every rank)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def _data(rank: int, seed: int, numel: int, dtype="float32"):
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == "float32":
        return torch.rand(numel, generator=g) + 0.5                  # in [0.5, 1.5): never zero
    return torch.randint(1, 1000, (numel,), generator=g, dtype=getattr(torch, dtype))


def _twice(fn, *tensors):
    """fn(group, *copies) on the msc group and on the stock group: (msc copies, stock copies)."""
    import torch.distributed as dist

    mine = [t.clone() for t in tensors]
    theirs = [t.clone() for t in tensors]
    fn(dist.group.WORLD, *mine)
    fn(stock_group(), *theirs)
    return mine, theirs


def forms_case(rank: int, n: int) -> dict:
    """Every call form msc serves: results equal gloo's bit for bit (2
    ranks: each sum is one addition), Works complete, and the report
    counts what was served and what passed through, with why."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt

    warnings.simplefilter("ignore", FutureWarning)     # all_gather_into_tensor & co are being renamed
    mt.served.clear()
    m = 1000
    x, big = _data(rank, 1, m), _data(rank, 2, n * m)
    ints = _data(rank, 3, m, "int32")
    same = {}

    def check(name, pair):
        mine, theirs = pair
        same[name] = all(torch.equal(a, b) for a, b in zip(mine, theirs))

    check("all_reduce", _twice(lambda g, t: dist.all_reduce(t, group=g), x))
    check("all_reduce max int32", _twice(lambda g, t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g), ints))
    check("all_reduce avg", _twice(lambda g, t: dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g), x))
    check("all_gather_into_tensor", _twice(lambda g, o, i: dist.all_gather_into_tensor(o, i, group=g),
                                           torch.zeros(n * m), x))
    check("all_gather in place", _twice(lambda g, o: dist.all_gather_into_tensor(o, o[rank * m:(rank + 1) * m],
                                                                                 group=g), big))
    check("all_gather list", _twice(lambda g, i, *outs: dist.all_gather(list(outs), i, group=g),
                                    x, *[torch.zeros(m) for _ in range(n)]))
    check("reduce_scatter_tensor", _twice(lambda g, o, i: dist.reduce_scatter_tensor(o, i, group=g),
                                          torch.zeros(m), big))
    check("reduce_scatter list", _twice(lambda g, o, *ins: dist.reduce_scatter(o, list(ins), group=g),
                                        torch.zeros(m), *big.chunk(n)))
    check("all_to_all_single", _twice(lambda g, o, i: dist.all_to_all_single(o, i, group=g),
                                      torch.zeros(n * m), big))
    check("all_to_all list", _twice(lambda g, *ts: dist.all_to_all(list(ts[:n]), list(ts[n:]), group=g),
                                    *[torch.zeros(m) for _ in range(n)], *big.chunk(n)))
    for root in range(n):
        check(f"broadcast from {root}", _twice(lambda g, t: dist.broadcast(t, src=root, group=g), x))
    red = _twice(lambda g, t: dist.reduce(t, dst=0, group=g), x)
    same["reduce"] = torch.equal(red[0][0], red[1][0]) if rank == 0 else True

    # async: a complete Work whose future holds the tensors
    t = x.clone()
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    async_ok = work.is_completed() and work.wait() and fut.done() and torch.equal(fut.value()[0], t)

    # coalesced: each call served
    a, b = x.clone(), (x * 2).clone()
    with dist._coalescing_manager():
        dist.all_reduce(a)
        dist.all_reduce(b)
    ca, cb = x.clone(), (x * 2).clone()
    dist.all_reduce(ca, group=stock_group())
    dist.all_reduce(cb, group=stock_group())
    same["coalesced all_reduce"] = torch.equal(a, ca) and torch.equal(b, cb)

    # what passes through, each with its result
    check("all_reduce band (passes)", _twice(lambda g, t: dist.all_reduce(t, op=dist.ReduceOp.BAND, group=g), ints))
    ins = [100 * (rank + 1) + 10 * j for j in range(n)]          # rank r sends 100(r+1) + 10j to rank j
    outs = [100 * (j + 1) + 10 * rank for j in range(n)]
    check("uneven all_to_all (passes)",
          _twice(lambda g, o, i: dist.all_to_all_single(o, i, outs, ins, group=g),
                 torch.zeros(sum(outs)), _data(rank, 4, sum(ins))))
    check("complex all_reduce (served as its real view)", _twice(lambda g, t: dist.all_reduce(t, group=g),
                                                                 torch.complex(x, x)))
    check("int8 all_reduce (passes)", _twice(lambda g, t: dist.all_reduce(t, group=g), ints.to(torch.int8)))
    dist.barrier()
    if rank == 0:
        dist.send(x, 1)
    elif rank == 1:
        got = torch.zeros(m)
        dist.recv(got, 0)
        same["recv"] = torch.equal(got, _data(0, 1, m))
    return {"same": same, "async": async_ok, "rows": mt.served.counts(), "report": mt.report()}


def strict_case(rank: int, n: int) -> dict:
    """A group made under MSC_STRICT: a collective that has plans but would
    pass through raises on every rank (before anything is sent), naming why;
    one without plans (barrier) still passes through; served calls run."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt

    mt.configure(strict=True)
    try:
        group = dist.new_group(backend="msc")
    finally:
        mt.settings.reset()
    out = {}
    ints = _data(rank, 5, 64, "int32")
    try:
        dist.all_reduce(ints, op=dist.ReduceOp.BAND, group=group)
        out["band"] = "no error"
    except mt.StrictModeError as exc:
        out["band"] = str(exc)
    out["untouched"] = torch.equal(ints, _data(rank, 5, 64, "int32"))
    dist.barrier(group=group)
    x = _data(rank, 6, 64)
    dist.all_reduce(x, group=group)
    y = _data(rank, 6, 64)
    dist.all_reduce(y, group=stock_group())
    out["served equal"] = torch.equal(x, y)
    dist.destroy_process_group(group)
    return out


def explicit_call_case(rank: int, n: int) -> dict:
    """msc.torch's own calls on an msc group (the default one): the plan
    runs, and its messages are not counted as the user's sends."""
    import torch

    import msc.torch as mt

    mt.served.clear()
    x = _data(rank, 7, 1000)
    mt.all_reduce(mt.PlanRegistry.from_dir(__import__("os").environ["MSC_PLANS"]), x)
    y = _data(rank, 7, 1000)
    import torch.distributed as dist

    dist.all_reduce(y, group=stock_group())
    return {"equal": torch.equal(x, y), "rows": mt.served.counts()}
