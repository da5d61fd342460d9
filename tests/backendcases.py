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


def strided_case(rank: int, n: int) -> dict:
    """Calls on tensors that are not contiguous (every other column of a
    matrix): msc serves them through contiguous copies and writes the result
    back, equal to gloo's on contiguous copies, the rest of the matrix as it
    was; stock gloo handed the view itself computes a wrong result (counted).
    A written expanded view (elements sharing memory) is refused."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt
    from msc.errors import UsageError

    mt.served.clear()
    base = _data(rank, 7, 64 * 64).view(64, 64)
    out = {}

    def both(name, call, make):
        """``call(group, *tensors)`` on msc's group with ``make()``'s tensors and on gloo's with contiguous
        copies; equal where msc's were written, and nothing else of their bases changed."""
        mine, theirs = make(), [t.contiguous() for t in make()]
        bases = [t._base.clone() if t._base is not None else None for t in mine]
        call(dist.group.WORLD, *mine)
        call(stock_group(), *theirs)
        equal = all(torch.equal(a, b) for a, b in zip(mine, theirs))
        for t, before in zip(mine, bases):
            if before is not None:                    # the base outside the view: untouched
                outside = torch.ones_like(before, dtype=torch.bool)
                outside.as_strided(t.shape, t.stride(), t.storage_offset())[...] = False
                equal = equal and torch.equal(t._base[outside], before[outside])
        out[name] = equal

    both("all_reduce", lambda g, t: dist.all_reduce(t, group=g), lambda: [base.clone()[:, ::2]])
    both("broadcast", lambda g, t: dist.broadcast(t, src=1, group=g), lambda: [base.clone()[::2, 1:9]])
    both("all_gather_into_tensor", lambda g, o, i: dist.all_gather_into_tensor(o, i, group=g),
         lambda: [torch.zeros(n * 32, 2)[:, 1], base.clone()[:32, 3]])
    both("reduce_scatter_tensor", lambda g, o, i: dist.reduce_scatter_tensor(o, i, group=g),
         lambda: [torch.zeros(32, 3)[:, 0], base.clone()[:, ::2].reshape(-1)[:32 * n]])
    stock = base.clone()
    dist.all_reduce(stock[:, ::2], group=stock_group())        # gloo handed the view itself
    right = base.clone()
    right[:, ::2] = base[:, ::2].contiguous()
    dist.all_reduce(right, group=stock_group())
    out["stock_wrong"] = int((stock[:, ::2] != right[:, ::2]).sum()) + int((stock[:, 1::2] != base[:, 1::2]).sum())
    expanded = torch.ones(4).expand(8, 4)                     # gloo, handed it, writes past its 16 bytes
    try:
        dist.all_reduce(expanded)
        out["expanded"] = "no error"
    except UsageError as exc:
        out["expanded"] = str(exc)
    out["rows"] = mt.served.counts()
    return out


def two_threads_case(rank: int, n: int) -> dict:
    """Rank 0 calls from two threads on one msc group at once (the second
    while the first waits for rank 1): the second raises, naming both
    threads; the first completes. Rank 1, left waiting for the call rank 0
    refused, times out naming it. The group stays usable."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    import msc.torch as mt
    from msc.torch import agree

    agree.set_timeout(2.0)
    out = {}
    x, y = _data(rank, 8, 256), _data(rank, 9, 256)
    want = x.clone()
    dist.all_reduce(want, group=stock_group())
    try:
        if rank == 0:
            def second():
                time.sleep(0.3)
                try:
                    dist.all_reduce(y.clone())
                    out["second"] = "no error"
                except agree.ConcurrentCallError as exc:
                    out["second"] = str(exc)
            t = threading.Thread(target=second, name="worker-2")
            t.start()
            dist.all_reduce(x)
            t.join()
        else:
            time.sleep(1.0)
            dist.all_reduce(x)
            try:
                dist.all_reduce(y.clone())                  # rank 0's refused call: it never comes
                out["second"] = "no error"
            except agree.AgreementTimeoutError as exc:
                out["second"] = str(exc)
        out["first"] = torch.equal(x, want)
        dist.barrier(group=stock_group())
        if rank == 0:                                       # rank 1 gave up on this call number
            try:
                dist.all_reduce(y.clone())
            except agree.AgreementTimeoutError:
                out["caught_up"] = True
        z = _data(rank, 10, 256)
        stock = z.clone()
        dist.all_reduce(z)
        dist.all_reduce(stock, group=stock_group())
        out["after"] = torch.equal(z, stock)
    finally:
        agree.set_timeout(None)
    out["rows"] = mt.served.counts()
    return out
