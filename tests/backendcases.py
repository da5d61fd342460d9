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
    for root in range(n):
        red = _twice(lambda g, t: dist.reduce(t, dst=root, group=g), x)
        same[f"reduce to {root}"] = torch.equal(red[0][0], red[1][0]) if rank == root else True
    for root in range(n):                  # the lists on the root only, as torch.distributed takes them
        outs = [torch.zeros(m) for _ in range(n)] if rank == root else []
        check(f"gather to {root}", _twice(lambda g, t, *o: dist.gather(t, list(o) if rank == root else None, dst=root,
                                                                      group=g), x, *outs))
        parts = list(big.chunk(n)) if rank == root else []
        check(f"scatter from {root}", _twice(lambda g, o, *ins: dist.scatter(o, list(ins) if rank == root else None,
                                                                            src=root, group=g), torch.zeros(m), *parts))

    # async: a Work that completes behind the caller, its future holding the tensors
    t = x.clone()
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    async_ok = work.wait() and work.is_completed() and fut.done() and torch.equal(fut.value()[0], t)
    want = x.clone()
    dist.all_reduce(want, group=stock_group())
    same["async all_reduce"] = torch.equal(t, want)

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
    check("uneven all_to_all",
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


def strict_hint_case(rank: int, n: int, folder: str) -> dict:
    """A group made under MSC_STRICT over ``folder`` (an allreduce plan up to
    4K, a broadcast plan of root 0, an alltoall plan up to 1K): an
    all_reduce of 8K raises in one line with the msc tune command that makes
    its plan; a broadcast from the last rank is served by the root-0 plan,
    with gloo's result; all_to_all_single with splits is served where the
    padded size has a plan and raises (on every rank) where it has none."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt

    mt.configure(strict=True, plans=folder)
    try:
        group = dist.new_group(backend="msc")
    finally:
        mt.settings.reset()
    out = {}
    try:
        dist.all_reduce(_data(rank, 11, 2048), group=group)
        out["allreduce"] = "no error"
    except mt.StrictModeError as exc:
        out["allreduce"] = str(exc)
    b, stock = _data(rank, 12, 64), _data(rank, 12, 64)
    dist.broadcast(b, src=n - 1, group=group)
    dist.broadcast(stock, src=n - 1, group=stock_group())
    out["broadcast equal"] = torch.equal(b, stock)
    for rows in (100, 200):                  # rank 0 sends rank 1 that many rows, the rest 1: padded 800, 1600 bytes
        ins = [1, rows] if rank == 0 else [1, 1]
        outs = [1, 1] if rank == 0 else [rows, 1]
        x, y = _data(rank, 13, sum(ins)), torch.zeros(sum(outs))
        try:
            dist.all_to_all_single(y, x, outs, ins, group=group)
            want = torch.zeros(sum(outs))
            dist.all_to_all_single(want, x, outs, ins, group=stock_group())
            out[f"alltoallv {rows}"] = torch.equal(y, want)
        except mt.StrictModeError as exc:
            out[f"alltoallv {rows}"] = str(exc)
    dist.destroy_process_group(group)
    return out


def moe_case(rank: int, n: int) -> dict:
    """MoE's dispatch and combine: tokens (rows of 8) routed unevenly to
    ranks and back, by all_to_all_single with split sizes on the msc group
    (served: counted as alltoallv) and on stock gloo, msc's combine writing
    a strided view; the counts exchanged first with all_to_all_single itself,
    as MoE layers do (equal splits: the plain alltoall)."""
    import torch
    import torch.distributed as dist

    import msc.torch as mt

    mt.served.clear()
    g = torch.Generator().manual_seed(rank)
    tokens = torch.rand(37 + 11 * rank, 8, generator=g) + 0.5
    dest = torch.randint(0, n, (tokens.shape[0],), generator=g)
    dest[: tokens.shape[0] // 2] = 0                                  # skewed: rank 0's experts are popular
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n)
    result = {}
    for name, group in (("msc", dist.group.WORLD), ("stock", stock_group())):
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        ins, outs = send.tolist(), recv.tolist()
        got = torch.empty(sum(outs), 8)
        dist.all_to_all_single(got, tokens[order], outs, ins, group=group)
        back = torch.empty(tokens.shape[0], 2, 8)[:, 1] if name == "msc" else torch.empty_like(tokens)  # (gloo,
        #                                                                      handed a strided view, gets it wrong)
        dist.all_to_all_single(back, got * 2, ins, outs, group=group)
        result[name] = (got, back)
    done = torch.empty_like(tokens)
    done[order] = result["msc"][1]
    return {"dispatch": torch.equal(result["msc"][0], result["stock"][0]),
            "combine": torch.equal(result["msc"][1], result["stock"][1]),
            "round trip": torch.equal(done, tokens * 2), "rows": mt.served.counts()}


def async_case(rank: int, n: int) -> dict:
    """async_op=True on served calls: rank 0's call returns before rank 1
    has made it (rank 1 comes 0.5 s later) and its wait() returns when it
    has run; calls issued back to back (async, a pass-through between them,
    then a synchronous one) keep their order, results equal gloo's; a call
    that fails behind the caller raises from wait()."""
    import time

    import torch
    import torch.distributed as dist

    from msc.torch import agree

    out = {}
    x = _data(rank, 14, 4096)
    want = x.clone()
    dist.all_reduce(want, group=stock_group())
    dist.barrier(group=stock_group())
    if rank == 1:
        time.sleep(0.5)
    t0 = time.perf_counter()
    t = x.clone()
    work = dist.all_reduce(t, async_op=True)
    out["returned after"] = time.perf_counter() - t0
    work.wait()
    out["done after"] = time.perf_counter() - t0
    out["first"] = torch.equal(t, want)
    a, b, c = _data(rank, 15, 1000), _data(rank, 16, n * 1000), _data(rank, 17, 333)
    ints = _data(rank, 18, 64, "int32")
    mine = [a.clone(), torch.empty(n * 1000), torch.empty(1000), ints.clone(), c.clone()]
    works = [dist.all_reduce(mine[0], async_op=True),
             dist.all_gather_into_tensor(mine[1], a, async_op=True),
             dist.reduce_scatter_tensor(mine[2], b, async_op=True),
             dist.all_reduce(mine[3], op=dist.ReduceOp.BAND, async_op=True)]        # passes through, meanwhile
    dist.broadcast(mine[4], src=n - 1)                                               # synchronous: after them
    for w in works:
        w.wait()
    theirs = [a.clone(), torch.empty(n * 1000), torch.empty(1000), ints.clone(), c.clone()]
    g = stock_group()
    dist.all_reduce(theirs[0], group=g)
    dist.all_gather_into_tensor(theirs[1], a, group=g)
    dist.reduce_scatter_tensor(theirs[2], b, group=g)
    dist.all_reduce(theirs[3], op=dist.ReduceOp.BAND, group=g)
    dist.broadcast(theirs[4], src=n - 1, group=g)
    out["in order"] = [torch.equal(m, s) for m, s in zip(mine, theirs)]
    agree.set_timeout(2.0)
    try:
        work = dist.all_reduce(torch.ones(64 if rank == 0 else 32), async_op=True)       # the ranks disagree
        try:
            work.wait()
            out["failure"] = "no error"
        except Exception as exc:
            out["failure"] = str(exc)
    finally:
        agree.set_timeout(None)
    z = _data(rank, 19, 100)
    stock = z.clone()
    dist.all_reduce(z, async_op=True).wait()
    dist.all_reduce(stock, group=g)
    out["after"] = torch.equal(z, stock)
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


def training_probe_case(rank: int, n: int, steps: int = 3) -> dict:
    """A training script of a user's own, not one the backend was built
    against, on a group made under MSC_STRICT=1 (the environment variable)
    and on stock gloo: a mixture-of-experts layer (one expert per rank)
    whose router starts as the last rank's (broadcast from src=n-1), tokens
    dispatched and combined by all_to_all_single with uneven splits (the
    counts exchanged first), the expert's gradient sent back the same way,
    the shared head's gradient all-reduced with async_op=True while the
    expert's is computed. Strict mode: anything msc did not serve would
    raise. Losses and parameters of both runs equal bit for bit."""
    import os

    import torch
    import torch.distributed as dist

    import msc.torch as mt

    before = os.environ.get("MSC_STRICT")
    os.environ["MSC_STRICT"] = "1"
    try:
        strict = dist.new_group(backend="msc")
    finally:
        if before is None:
            del os.environ["MSC_STRICT"]
        else:
            os.environ["MSC_STRICT"] = before
    mt.served.clear()
    d = 8

    def train(group):
        g = torch.Generator().manual_seed(100 + rank)
        router = torch.randn(d, n, generator=g)                  # differs per rank until broadcast
        expert = torch.randn(d, d, generator=g) * 0.3
        head = torch.randn(d, d, generator=torch.Generator().manual_seed(7)) * 0.3
        dist.broadcast(router, src=n - 1, group=group)
        losses = []
        for step in range(steps):
            data = torch.Generator().manual_seed(1000 * step + rank)
            tokens = torch.rand(20 + 7 * rank + 3 * step, d, generator=data) + 0.5
            target = torch.rand(tokens.shape[0], d, generator=data)
            dest = torch.argmax(tokens @ router, dim=1)
            order = torch.argsort(dest, stable=True)
            send = torch.bincount(dest, minlength=n)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            ins, outs = send.tolist(), recv.tolist()
            arrived = torch.empty(sum(outs), d)
            dist.all_to_all_single(arrived, tokens[order].contiguous(), outs, ins, group=group)
            done = torch.empty(tokens.shape[0], d)
            dist.all_to_all_single(done, arrived @ expert, ins, outs, group=group)          # combine
            combined = torch.empty_like(done)
            combined[order] = done
            combined.requires_grad_(True)
            h = head.clone().requires_grad_(True)
            loss = ((combined @ h - target) ** 2).mean()
            loss.backward()
            head_grad = h.grad.clone()
            pending = dist.all_reduce(head_grad, async_op=True, group=group)                    # behind the expert's
            back = torch.empty(sum(outs), d)
            dist.all_to_all_single(back, combined.grad[order].contiguous(), outs, ins, group=group)
            expert = expert - 0.1 * (arrived.T @ back)
            pending.wait()
            head = head - 0.1 * head_grad / n
            losses.append(loss.item())
        return losses, router, expert, head

    mine, theirs = train(strict), train(stock_group())
    rows = mt.served.counts()
    try:                                                         # the group is strict: this would pass through
        dist.all_reduce(_data(rank, 20, 16, "int32"), op=dist.ReduceOp.BAND, group=strict)
        refused = "no error"
    except mt.StrictModeError as exc:
        refused = str(exc)
    dist.destroy_process_group(strict)
    return {"losses": mine[0], "equal": [torch.equal(a, b) for a, b in zip(mine[1:], theirs[1:])],
            "losses equal": mine[0] == theirs[0], "rows": rows, "refused": refused}
