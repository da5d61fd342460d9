"""``msc simulate X.json`` of an MSCCL++ execution plan: which model runs it.

A plan msc's export wrote (its msc_slots field) in the shape that export
writes is lifted back to the msc plan it came from and simulated by msc's
simulator (msc.sim.simulate), as before; any other plan ``msc verify`` takes
runs in the one-sided cost model (msc.sim.onesided): a plan of that shape
written elsewhere too, whose slots msc's simulator would have to guess (one
a connection, where LL packets need none). ``--model onesided`` runs every MSCCL++ plan in the
one-sided model (an export too: what the executor runs, without msc's
tiling). The output and each record say which model ran.
"""
from __future__ import annotations

from msc.cli.args import collective_kw, topology_from_args
from msc.errors import PlanError, UsageError

MODELS = ("auto", "lifted", "onesided")
LIFTED, ONESIDED = "lifted", "onesided"
MODEL_TEXT = {LIFTED: "lifted to the msc plan it was exported from, msc's simulator",
              ONESIDED: "one-sided model (msc.sim.onesided)"}


def onesided_plan(path: str, args):
    """The plan read and verified as MSCCL++ runs it if the one-sided model
    simulates it (``--model onesided``, or lift refuses its shape), else None
    (msc's simulator of the lifted plan: ``--model lifted``, or auto for an
    export of msc's that lift reads)."""
    from msc.files import read_input
    from msc.formats.mscclpp.check import verify_mscclpp
    from msc.formats.mscclpp.lift import lift_plan
    from msc.formats.mscclpp.reader import parse_mscclpp
    from msc.ir.limits import MAX_PLAN_FILE_BYTES

    if args.model == LIFTED:
        return None
    osp = parse_mscclpp(read_input(path, MAX_PLAN_FILE_BYTES, what="plan", error=PlanError), path=path)
    verify_mscclpp(osp, **collective_kw(args))       # what msc verify checks: deadlock, races, results
    if args.model == ONESIDED or osp.meta_value("msc_slots") is None:
        return osp                # not written by msc's export: the slots a lifted plan would run with are a guess
    try:
        lift_plan(osp)
    except PlanError:             # not msc's shape: only the one-sided model reads it
        return osp
    return None


def refuse_plan_flags(args, path: str) -> None:
    """--tile, --slots, --runtime and --engine describe msc plans' runs; the one-sided model has none of them."""
    given = [flag for flag, v in (("--tile", args.tile), ("--slots", args.slots), ("--runtime", args.runtime),
                                  ("--engine", args.engine if args.engine != "auto" else None)) if v is not None]
    if given:
        raise UsageError(f"{', '.join(given)} {'describe' if len(given) > 1 else 'describes'} an msc plan's run; {path} runs in the one-sided model of "
                         f"MSCCL++ (its operations move whole chunks, as the executor runs them): leave them out, "
                         f"or give --model lifted for a plan in the shape msc's export writes")


def simulate_onesided(args, path: str, osp, requested):
    """(records, series label, topology, title) of ``osp`` in the one-sided model."""
    from msc.cli.bound import add_bound
    from msc.formats.mscclpp.check import stated_collective
    from msc.sim.onesided import OneSidedSimulator, has_switch_ops

    refuse_plan_flags(args, path)
    topo = topology_from_args(args, osp.num_ranks)
    sim = OneSidedSimulator(osp, topo, collective=stated_collective(osp, collective_kw(args).get("collective")),
                            dtype=args.dtype)
    records = sim.records(requested)
    layout = sim.layout
    # msc bound knows the built-in collectives; its switch terms are proved for msc's own simulator (its barriers,
    # its direction-aware ports), not this model's pricing of switch channels: no bound for switch plans here
    if layout.collective is not None and layout.builtin and not has_switch_ops(osp):
        add_bound(records, layout.collective.name, layout.root, topo)
    name = layout.collective.name if layout.collective is not None else osp.collective
    title = (f"msc simulate {path}: {name}, {osp.num_ranks} ranks, {osp.protocol}, MSCCL++ plan in the "
             f"{MODEL_TEXT[ONESIDED]}, on {topo.summary()} (predicted: nothing run)")
    return records, f"{osp.name} ({osp.protocol}, one-sided model)", topo, title
