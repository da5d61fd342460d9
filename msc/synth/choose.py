"""Choosing a synthesized program's pieces and spread by simulating them.

The packing's own estimate (the busiest link's load) is a lower bound on
what a schedule achieves: how the runtime's threadblocks loop over their
steps decides how close a plan comes to it, and that depends on the pieces,
the channels they are spread over and the instances in ways a link count
cannot see. So candidates are written out, and msc.sim.tune simulates each
piece count (Synthesizer.piece_choices) with its spreads (the program's
``spread`` parameter: msc.synth.spread_choices), both places to add children's parts
(``add_on_arrival``, where the collective sums) and instance counts (msc
tune's: 1 to 32 within its threadblock budget), Simple protocol, at the
size asked for; the fastest wins. For allreduce on a topology whose switch
reduces (NVLS), the switch schedule (msc.synth.switch) is simulated beside
them with its instance counts, unless ``switch`` is False.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from msc.dsl.collectives import ROOTED
from msc.progress import steps
from msc.synth import SUMS, Synthesis, Synthesizer, spread_choices
from msc.synth.switch import switch_domains, switch_program


@dataclass(frozen=True)
class Choice:
    """The chosen synthesis, its instances, and its simulated time (s) at
    ``size`` next to the other candidates' (label -> s: exact for the
    winner, a lower bound where another could not win); ``synthesizer``
    writes the same packing with another spread."""

    synthesis: Synthesis
    instances: int
    size: int
    seconds: float
    tried: dict
    synthesizer: Synthesizer


def choose_by_simulation(collective: str, topology, size: int, *, root: int = 0, name: str = "synthesized",
                         command: str = "", protocols=("Simple",), switch: bool = True) -> Choice:
    from msc.sim.tune import tune

    synth = Synthesizer(collective, topology, root=root)
    tried, best = {}, None            # best: (seconds, pieces, candidate, the switch program or None)
    with tempfile.TemporaryDirectory(prefix="msc-synthesize-") as tmp:
        if switch and collective == "allreduce" and "Simple" in protocols:
            best = _switch_candidate(topology, size, Path(tmp), name, command, tried)
        for k in steps(synth.piece_choices(), f"synthesizing and simulating {collective} by piece count",
                       unit="count"):
            path = Path(tmp) / f"{name}_pieces{k}.py"
            path.write_text(synth.program(k, name=name, command=command).text)
            params = {"spread": list(spread_choices(k))}
            if collective in SUMS:
                params["add_on_arrival"] = [True, False]
            if collective in ROOTED:
                params["root"] = [root]
            result = tune([str(path)], topology.num_ranks, topology, [size], protocols=protocols,
                          user_params=params, refine=False, runner_up=False)   # the winner alone decides
            for c in result.candidates:
                shown = " ".join(f"{key}={v}" for key, v in c.params.items() if key != "root")
                tried[f"pieces={k} {shown} {c.protocol} x{c.instances}"] = c.times[0]
            winner = result.candidates[result.winners[0]]
            if best is None or winner.times[0] < best[0]:
                best = (winner.times[0], k, winner, None)
    seconds, k, cand, chosen = best
    if chosen is None:
        chosen = synth.program(k, spread=cand.params["spread"],
                               add_on_arrival=cand.params.get("add_on_arrival", True),
                               name=name, command=command)      # packed already: kept
    return Choice(chosen, cand.instances, size, seconds, tried, synth)


def _switch_candidate(topology, size: int, tmp: Path, name: str, command: str, tried: dict):
    """(seconds, None, candidate, program) of the switch schedule's best
    instance count at ``size`` (msc.synth.switch), its candidates' times
    added to ``tried``; None where the topology's switch does not reduce."""
    from msc.sim.tune import tune

    g = switch_domains(topology)
    if g is None:
        return None
    program = switch_program(topology, g, name=name, command=command)
    path = tmp / f"{name}_switch.py"
    path.write_text(program.text)
    result = tune([str(path)], topology.num_ranks, topology, [size], protocols=("Simple",), refine=False,
                  runner_up=False)
    for c in result.candidates:
        tried[f"switch {c.protocol} x{c.instances}"] = c.times[0]
    winner = result.candidates[result.winners[0]]
    return winner.times[0], None, winner, program
