"""Choosing a synthesized program's pieces and spread by simulating them.

The packing's own estimate (the busiest link's load) is a lower bound on
what a schedule achieves: how the runtime's threadblocks loop over their
steps decides how close a plan comes to it, and that depends on the pieces,
the channels they are spread over and the instances in ways a link count
cannot see. So candidates are written out, and msc.sim.tune simulates each
piece count with its spreads (the program's ``spread`` parameter: 1, 2, 4)
and instance counts (1, 2, 4), Simple protocol, at the size asked for; the
fastest wins.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from msc.synth import PIECE_CHOICES, Synthesis, Synthesizer


@dataclass(frozen=True)
class Choice:
    """The chosen synthesis, its instances, and its simulated time (s) at
    ``size`` next to the other candidates' (label -> s); ``synthesizer``
    writes the same packing with another spread."""

    synthesis: Synthesis
    instances: int
    size: int
    seconds: float
    tried: dict
    synthesizer: Synthesizer


def choose_by_simulation(collective: str, topology, size: int, *, root: int = 0, name: str = "synthesized",
                         command: str = "", protocols=("Simple",)) -> Choice:
    from msc.sim.tune import tune

    synth = Synthesizer(collective, topology, root=root)
    made = {k: synth.program(k, name=name, command=command) for k in PIECE_CHOICES}
    with tempfile.TemporaryDirectory(prefix="msc-synthesize-") as tmp:
        files = {}
        for k, s in made.items():
            path = Path(tmp) / f"{name}_pieces{k}.py"
            path.write_text(s.text)
            files[str(path)] = k
        params = {"spread": [1, 2, 4]}
        if collective in ("broadcast", "reduce"):
            params["root"] = [root]
        result = tune(list(files), topology.num_ranks, topology, [size], protocols=protocols,
                      user_params=params, refine=False)
    cands = result.candidates
    tried = {f"pieces={files[c.file]} spread={c.params['spread']} {c.protocol} x{c.instances}": c.times[0]
             for c in cands}
    best = cands[result.winners[0]]
    k, spread = files[best.file], best.params["spread"]
    chosen = synth.program(k, spread=spread, name=name, command=command)      # packed already: kept
    return Choice(chosen, best.instances, size, best.times[0], tried, synth)
