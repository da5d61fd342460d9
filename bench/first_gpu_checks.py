"""What bench/first_gpu_run.py's stages and children share: the run's options,
library plans, and bit-exact checks of a Communicator against msc.executor."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "tests", ROOT / "bench", ROOT):   # library plans and cudaboot; this checkout's msc
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

SMALL_TILE = 4096                # bytes: several tiles per chunk at small counts
TIMEOUT_S = 20.0                 # a spin-wait's budget in the sweep (a hang ends quickly)
RING = "allreduce/ring:ring"


@dataclass(frozen=True)
class Run:
    """What the stages share: the device, the options and the run's one kernel cache."""

    device: str
    quick: bool
    out: Path
    cache: Path
    ranks: int = 8

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def where(self) -> str:
        """Where the tensors live: this GPU, or the host for the emulated device."""
        return "cuda:0" if self.gpu else "cpu"


def plan_of(key: str, n: int, protocol: str, tile: int = 0, instances: int = 1):
    import msc
    from library import algorithms
    from msc.lower.pipeline import LowerOptions, lower

    return lower(msc.trace(algorithms()[key], n), LowerOptions(protocol=protocol, tile=tile, instances=instances))


def tile_count(plan, dtype: str, tiles: float) -> int:
    """A count whose chunks take ``tiles`` tiles of the plan's tile (the runtime's default where 0)."""
    from msc.cuda.codegen import DTYPES
    from msc.cuda.launch import DEFAULT_TILE_BYTES

    per_tile = max(8, ((plan.tile or DEFAULT_TILE_BYTES[plan.protocol]) // DTYPES[dtype].size) // 8 * 8)
    return plan.chunk_factor * int(per_tile * tiles) + 3


def communicator(run: Run, plan, **kw):
    """A virtual-placement Communicator on this run's device and kernel cache."""
    from msc.cuda import Communicator

    kw.setdefault("timeout_s", TIMEOUT_S)
    return Communicator(plan, "virtual", None if not run.gpu else 0, device=run.device, cache=run.cache, **kw)


def check_counts(run: Run, plan, form: str | None, dtype: str, op: str, counts, **kw) -> str:
    """Every count on one communicator, bit-exact against msc.executor (cudaboot.check_run)."""
    from cudaboot import check_run

    comm = communicator(run, plan, form=form, dtypes=(dtype,), ops=(op,), **kw)
    try:
        for i, count in enumerate(counts):
            check_run(comm, count, dtype, op, seed=i)
    finally:
        comm.close()
    return f"counts {', '.join(map(str, counts))}: bit-exact"


def check_large(run: Run, plan, form: str, dtype: str, tiles: float) -> str:
    """``tiles`` tiles per chunk, checked on the device (msc.cuda.bench.check_on_device)."""
    import torch

    from msc.cuda.bench import check_on_device

    count = tile_count(plan, dtype, tiles)
    comm = communicator(run, plan, form=form, dtypes=(dtype,), ops=("sum",))
    try:
        wrong = check_on_device(comm, count, "sum", getattr(torch, dtype), run.where)
    finally:
        comm.close()
    if any(wrong):
        raise AssertionError(f"count {count}: wrong elements per rank {wrong}")
    size = count * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return f"count {count} ({size / 2 ** 20:.1f} MiB per rank): 0 wrong"
