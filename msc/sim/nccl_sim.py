"""NCCL's choices (msc.sim.nccl) as msc plans, simulated: the records of
``msc simulate --nccl``.

Per size: NCCL's algorithm, protocol and channels; the plan that does the
same (one library ring or tree per channel: algorithms/*/nccl_rings.py'
rail_rings, algorithms/allreduce/nccl_tree.py; the switch plans allreduce/
nvls.py and nvls_tree.py and PAT's algorithms/*/pat.py on as many channels
as NCCL runs; alltoall/allpairs and sendrecv/ring for grouped send/receive); and
msc's simulation of it with NCCL's slices as tiles and its buffers' slots.
Plans are lowered once per (algorithm, protocol, channels).
"""
from __future__ import annotations

from dataclasses import replace

from msc.errors import UsageError
from msc.ir.ops import protocol_name
from msc.sim import nccl
from msc.sim.simulate import Simulator
from msc.sim.topology import Topology

# NCCL's plans are lowered verified up to this many ranks and unverified past it: simulation takes NCCL's
# slots, not the fewest the verifier finds, and at 1024 GPUs verifying them was 60% of lowering NVLSTree
# (4.5 of 7.3 CPU-s); tests/test_nccl_scale.py holds the unverified plans to the verified ones (dgx-h100:2/:4/:8, dgx-a100:2)
VERIFIED_RANKS = 64


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
    """The msc plan that runs like NCCL's ``choice`` on ``topology`` (cached per topology).
    Unverified, a plan of another protocol from the same program is this one with its protocol
    replaced: for msc's runtime, lowering takes the protocol only as the plan's field (the slots
    it needs are what verifying finds), so tree LL and LL128 on 16 channels are lowered once."""
    cache = topology.__dict__.setdefault("_nccl_plans", {})
    key = (collective, choice.algorithm, choice.protocol, choice.channels)
    if key not in cache:
        recipe = _recipe(topology, collective, choice)
        twin = None
        if topology.num_ranks > VERIFIED_RANKS:
            twin = next((plan for k, (r, plan) in cache.items() if r == recipe and k != key), None)
        plan = (replace(twin, protocol=protocol_name(choice.protocol)) if twin is not None
                else _lower(topology, collective, choice))
        cache[key] = (recipe, plan)
    return cache[key][1]


def _recipe(topology: Topology, collective: str, choice: nccl.Choice) -> tuple:
    """What _lower traces and lowers for ``choice`` but its protocol: (algorithm, parameters, instances)."""
    name, params, instances = _program(topology, collective, choice)
    return name, tuple(sorted(params.items())), instances


def _lower(topology: Topology, collective: str, choice: nccl.Choice, verify: bool | None = None):
    """``verify``: verify the plan (None: up to VERIFIED_RANKS ranks)."""
    import msc
    from msc.lower.pipeline import LowerOptions, lower

    name, params, instances = _program(topology, collective, choice)
    program = msc.trace(_library(name), topology.num_ranks, inplace=False, **params)    # NCCL needs no staging copies
    return lower(program, LowerOptions(protocol=choice.protocol, instances=instances),
                 verify=topology.num_ranks <= VERIFIED_RANKS if verify is None else verify)


def _program(topology: Topology, collective: str, choice: nccl.Choice):
    """(library algorithm's name, its parameters, instances) of the plan that runs like ``choice``."""
    g = topology.gpus_per_node
    instances = 1
    if choice.algorithm == "tree":
        # channel c and c + channels are the two trees' [nccl_model.md 4.4]: half the channels each
        name, params = "allreduce/nccl_tree:nccl_tree", dict(gpus_per_node=g, channels=max(1, choice.channels // 2),
                                                              chunks=1)
    elif choice.algorithm == "p2p":
        name, params = "alltoall/allpairs:allpairs" if collective == "alltoall" else "sendrecv/ring:ring", {}
    elif choice.algorithm in ("nvls", "nvlstree", "pat"):
        # a switch threadblock per NVLS channel, and PAT's steps on every channel: instances
        if collective != "allreduce" and choice.algorithm != "pat":
            raise UsageError(f"the library has no NVLS {collective} to run NCCL's choice with (NCCL's model never "
                             f"prefers it to the ring on these machines)")
        name = {"nvls": "allreduce/nvls:nvls", "nvlstree": "allreduce/nvls_tree:nvls_tree",
                "pat": f"{collective}/pat:pat"}[choice.algorithm]
        params, instances = {}, choice.channels
        if choice.algorithm == "nvlstree":       # an instance carries both trees, NCCL a tree per channel
            params, instances = dict(gpus_per_node=g, trees=2, btree=True), max(1, choice.channels // 2)
    else:
        name, params = f"{collective}/nccl_rings:rail_rings", dict(rings=choice.channels, gpus_per_node=g)
        if "slices" in _library(name).params:
            params["slices"] = nccl.slices(choice)
    return name, params, instances


def tree_shares(plan, topology: Topology, choice: nccl.Choice) -> list[float]:
    """Per connection of ``plan`` (NCCL's tree, lowered by _lower): the share
    of a channel's threadblock rate its sender has in NCCL's tree kernel,
    whose threads are split between the reduction up and the broadcast down
    (nccl.TREE_RATE_SHARE each way), except the root's sends (its one op has
    every thread)."""
    from msc.dsl import nccl_orders
    from msc.sim.sim_plan import compile_plan

    sp = compile_plan(plan)
    n, g = topology.num_ranks, topology.gpus_per_node
    per_tree = max(1, choice.channels // 2)
    parents: dict = {}
    for channel in range(2 * per_tree):
        tree, c = divmod(channel, per_tree)
        parents[channel] = dict(nccl_orders.node_tree(n, g, c % g, tree))
    shares = []
    for src, ch in zip(sp.conn_src.tolist(), sp.conn_ch.tolist()):
        rooted = src not in parents[ch % (2 * per_tree)]             # the root has no parent
        shares.append(1.0 if rooted else nccl.TREE_RATE_SHARE)
    return shares


def simulate_nccl(collective: str, topology: Topology, sizes: list[int], *, dtype: str = "float",
                  algorithms=None, protocols=None) -> list[dict]:
    """Records as msc.sim.simulate.Simulator.records gives them, one per
    size, plus NCCL's ``algorithm``, ``protocol``, ``channels`` and its own
    model's time ``nccl_us``."""
    s = nccl.system(topology)
    shares: dict = {}           # (algorithm, protocol, channels) -> per connection, a threadblock's share
    sims: dict = {}             # that + (slots, per-message us) -> Simulator
    out = []
    for size in sizes:
        choice = nccl.choose(s, collective, max(size, 1), algorithms=algorithms, protocols=protocols)
        plan = plan_for(topology, collective, choice)
        key = (choice.algorithm, choice.protocol, choice.channels)
        if key not in shares:
            shares[key] = tree_shares(plan, topology, choice) if choice.algorithm == "tree" else None
            sims[key] = Simulator(plan, topology, slots=nccl.SLOTS[choice.protocol], dtype=dtype, shares=shares[key])
        sim = sims[key]
        how = nccl.pipeline(s, collective, choice, sim.chunk_geometry(size)[2], max(size, 1),
                            sim.view.step_overhead * 1e6)
        if how.slots != sim.slots or how.step_us is not None:
            variant = key + (how.slots, how.step_us, how.tile, how.network_step)
            if variant not in sims:
                sims[variant] = Simulator(sim.sp, topology, tile=how.tile, slots=how.slots, dtype=dtype,
                                          step_us=how.step_us, shares=shares[key], network_step=how.network_step)
            sim = sims[variant]
        [record] = sim.retiled(how.tile).records([size])
        record.update(plan=f"nccl {choice.algorithm}", algorithm=choice.algorithm, protocol=choice.protocol,
                      channels=choice.channels, nccl_us=choice.nccl_us, tile=how.tile)
        out.append(record)
    return out
