"""Cases for tests/test_torchrun_bootstrap.py, run in torchdist.Pool workers
(module level, so that spawn finds them), and the rank script that test runs
as its own processes to signal them."""
from __future__ import annotations

import os
import sys
import time

SHM = "/dev/shm"


def leftovers(pid: int | None = None) -> list[str]:
    """Files this process (or ``pid``) left in /dev/shm under the emulated device's old names."""
    pid = os.getpid() if pid is None else pid
    try:
        return sorted(n for n in os.listdir(SHM) if n.startswith(f"msc-emu-{pid}-"))
    except FileNotFoundError:
        return []


def _plan(name: str | None = None, instances: int = 1):
    import dataclasses

    from torchdist import library_plan

    plan = library_plan("allreduce/ring:ring", 2, True, instances)
    return plan if name is None else dataclasses.replace(plan, name=name)


def renamed_plan_case(rank: int, n: int) -> dict:
    """Rank 1's plan is rank 0's under another name: msc.torch's agreement
    passes (content), and the CUDA runtime's bootstrap must meet too."""
    import torch

    import msc.torch as mt
    from msc.torch import agree, backends

    os.environ["MSC_DEVICE"] = "emu"
    agree.set_timeout(20)
    try:
        plan = _plan(None if rank == 0 else "the-same-ring-by-another-name")
        t = torch.full((1000,), float(rank + 1))
        t0 = time.perf_counter()
        mt.all_reduce(plan, t, backend="cuda")
        took = time.perf_counter() - t0
        comm = backends.communicators()[-1]
        out = {"values": sorted(set(t.tolist())), "seconds": took, "prefix": comm._prefix(), "name": comm.plan.name}
        backends.close_communicators()
        return out
    finally:
        agree.set_timeout(None)
        os.environ.pop("MSC_DEVICE", None)


def different_plans_case(rank: int, n: int, timeout: float) -> dict:
    """The ranks run different plans on the runtime directly (no agreement):
    each waits at the bootstrap under its own key, fails within ``timeout``,
    and keeps no arena (no mapping, no /dev/shm file)."""
    import numpy as np

    from msc.cuda import Communicator

    comm = Communicator(_plan(instances=1 + rank), "torchrun", device="emu", timeout_s=timeout)
    t0 = time.perf_counter()
    try:
        comm.all_reduce(np.ones(100, np.float32))
        error = "no error"
    except Exception as exc:          # the test reads the type and the message
        error = f"{type(exc).__name__}: {exc}"
    took = time.perf_counter() - t0
    shared = [m for m in comm.backend.memory.maps.values() if m.name is not None or getattr(m, "fd", -1) >= 0]
    out = {"error": error, "seconds": took, "owned": len(comm._owned), "mapped": len(comm.backend.memory.maps),
           "shared": len(shared), "files": leftovers()}
    comm.close()
    import torch.distributed as dist

    again = Communicator(_plan(), "torchrun", device="emu", timeout_s=30)     # the next one meets again
    dist.barrier()
    x = np.ones(100, np.float32)
    again.all_reduce(x)
    again.synchronize()
    again.close()
    out["after"] = float(x[0])
    return out


def lone_close_case(rank: int, n: int, timeout: float) -> dict:
    """After a good call, rank 0 closes while rank 1 does not come to the
    release rendezvous for a while: rank 0's close raises after ``timeout``
    and still frees its arena and unmaps rank 1's."""
    import numpy as np
    import torch.distributed as dist

    from msc.cuda import Communicator

    comm = Communicator(_plan(), "torchrun", device="emu", timeout_s=timeout)
    dist.barrier()                        # built on both ranks: the first call's bootstrap meets at once
    x = np.full(100, rank + 1.0, np.float32)
    comm.all_reduce(x)
    comm.synchronize()
    if rank == 1:
        time.sleep(timeout + 1.5)
    try:
        comm.close()
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    out = {"sum": float(x[0]), "error": error, "mapped": len(comm.backend.memory.maps), "owned": len(comm._owned)}
    dist.barrier()
    return out


def group_timeout_case(rank: int, n: int, group_s: float, env_s: str) -> dict:
    """msc.torch's communicators take the group's timeout, or MSC_TORCH_TIMEOUT;
    a peer that stalls after the agreement is then bounded by it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import msc.torch as mt
    from msc.cuda import runtime
    from msc.torch import backends

    os.environ["MSC_DEVICE"] = "emu"
    os.environ.pop("MSC_TORCH_TIMEOUT", None)
    out = {}
    try:
        group = dist.new_group([0, 1], timeout=timedelta(seconds=group_s))
        plan = _plan()
        from msc.cuda.compiler import compile_host

        for p in (plan, _plan("another")):         # built before the clock runs: ranks must not wait on a build
            compile_host(runtime.runtime_plan(p))
        dist.barrier()
        t = torch.full((64,), float(rank + 1))
        mt.all_reduce(plan, t, backend="cuda", group=group)
        comm = backends.communicators()[-1]
        out["group"] = comm.timeout_s
        out["values"] = sorted(set(t.tolist()))
        # rank 1 stalls after agreeing on the next call: rank 0's kernel waits for it, at most the group's timeout
        real = runtime.Communicator.run
        if rank == 1:
            def stalled(self, *args, **kw):
                time.sleep(group_s + 2)
                return real(self, *args, **kw)
            runtime.Communicator.run = stalled
        t0 = time.perf_counter()
        try:
            mt.all_reduce(plan, torch.ones(64), backend="cuda", group=group)
            out["stall"] = "no error"
        except Exception as exc:
            out["stall"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            runtime.Communicator.run = real
        out["stall_s"] = time.perf_counter() - t0
        dist.barrier()                                 # both broken; close together
        backends.close_communicators()
        os.environ["MSC_TORCH_TIMEOUT"] = env_s            # the environment wins over the group
        mt.all_reduce(_plan("another"), torch.ones(64), backend="cuda", group=group)
        out["env"] = backends.communicators()[-1].timeout_s
        backends.close_communicators()
        dist.destroy_process_group(group)
        return out
    finally:
        os.environ.pop("MSC_DEVICE", None)
        os.environ.pop("MSC_TORCH_TIMEOUT", None)


def rank_main(rank: int, init_file: str) -> None:
    """One rank of a 2-process job: rank 0 makes a call on the emulated
    runtime and waits in its bootstrap for rank 1, which never calls; the
    test signals rank 0 there, as torchrun does when another rank died."""
    import numpy as np
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 1:
        print("ready", flush=True)
        time.sleep(120)
        return
    from msc.cuda import Communicator, bootstrap

    comm = Communicator(_plan(), "torchrun", device="emu", timeout_s=120)
    real = bootstrap.exchange

    def announced(*args, **kw):
        print("exchanging", flush=True)
        return real(*args, **kw)

    bootstrap.exchange = announced
    comm.all_reduce(np.ones(100, np.float32))


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), sys.argv[2])
