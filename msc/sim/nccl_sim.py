"""NCCL's choices (msc.sim.nccl) as msc plans, simulated: the records of
``msc simulate --nccl``.

Per size: NCCL's algorithm, protocol and channels; the plan that does the
same (one library ring or tree per channel: algorithms/*/nccl_rings.py'
rail_rings, algorithms/allreduce/nccl_tree.py, alltoall/allpairs); and
msc's simulation of it with NCCL's slices as tiles and its buffers' slots.
Plans are lowered once per (algorithm, protocol, channels).
"""
from __future__ import annotations

from msc.errors import UsageError
from msc.sim import nccl
from msc.sim.simulate import Simulator
from msc.sim.topology import Topology


def _library(name: str):
    """The library algorithm ``collective/file:function``."""
    import msc
    from msc.dsl.loader import resolve

    path, _, func = name.partition(":")
    for alg in msc.load_algorithms(resolve(path)):
        if alg.name == func:
            return alg
    raise UsageError(f"the library has no algorithm {name!r}")


def plan_for(topology: Topology, collective: str, choice: nccl.Choice):
    """The msc plan that runs like NCCL's ``choice`` on ``topology`` (cached per topology)."""
    cache = topology.__dict__.setdefault("_nccl_plans", {})
    key = (collective, choice.algorithm, choice.protocol, choice.channels)
    if key not in cache:
        cache[key] = _lower(topology, collective, choice)
    return cache[key]


def _lower(topology: Topology, collective: str, choice: nccl.Choice):
    import msc
    from msc.lower.pipeline import LowerOptions, lower

    g = topology.gpus_per_node
    if choice.algorithm == "tree":
        # channel c and c + channels are the two trees' [nccl_model.md 4.4]: half the channels each
        alg, params = _library("allreduce/nccl_tree:nccl_tree"), dict(gpus_per_node=g, channels=max(1, choice.channels // 2),
                                                                       chunks=1)
    elif choice.algorithm == "p2p":
        alg, params = _library("alltoall/allpairs:allpairs" if collective == "alltoall" else "sendrecv/ring:ring"), {}
    elif choice.algorithm == "nvls":           # one switch threadblock per NVLS channel: instances
        program = msc.trace(_library("allreduce/nvls:nvls"), topology.num_ranks, inplace=False)
        return lower(program, LowerOptions(protocol=choice.protocol, instances=choice.channels))
    else:
        alg, params = _library(f"{collective}/nccl_rings:rail_rings"), dict(rings=choice.channels, gpus_per_node=g)
        if "slices" in alg.params:
            params["slices"] = nccl.slices(choice)
    program = msc.trace(alg, topology.num_ranks, inplace=False, **params)    # NCCL needs no staging copies
    return lower(program, LowerOptions(protocol=choice.protocol, instances=1))


def simulate_nccl(collective: str, topology: Topology, sizes: list[int], *, dtype: str = "float",
                  algorithms=None, protocols=None) -> list[dict]:
    """Records as msc.sim.simulate.Simulator.records gives them, one per
    size, plus NCCL's ``algorithm``, ``protocol``, ``channels`` and its own
    model's time ``nccl_us``."""
    s = nccl.system(topology)
    sims: dict = {}
    out = []
    for size in sizes:
        choice = nccl.choose(s, collective, max(size, 1), algorithms=algorithms, protocols=protocols)
        plan = plan_for(topology, collective, choice)
        key = (choice.algorithm, choice.protocol, choice.channels)
        if key not in sims:
            sims[key] = Simulator(plan, topology, slots=nccl.SLOTS[choice.protocol], dtype=dtype)
        tile = nccl.tile(s, choice, sims[key].chunk_geometry(size)[2])
        [record] = sims[key].retiled(tile).records([size])
        record.update(plan=f"nccl {choice.algorithm}", algorithm=choice.algorithm, protocol=choice.protocol,
                      channels=choice.channels, nccl_us=choice.nccl_us, tile=tile)
        out.append(record)
    return out
