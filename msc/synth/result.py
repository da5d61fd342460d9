"""What msc.synth writes: a program's text and what its packing predicts
(its own module so that the program writers, msc.synth.switch among them,
use it without importing the package that imports them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Synthesis:
    """The program's text, its pieces and spread, and what it predicts:
    ``bandwidth_s_per_byte``, the busiest link's time per byte of the
    collective's size (nccl-tests size, msc.units) under the packing, and
    which link that is."""

    collective: str
    text: str
    pieces: int
    spread: int
    add_on_arrival: bool | None    # sum_up's choice (None: the collective sums nothing)
    trees: int                     # alltoall: the pieces relayed
    max_depth: int                 # hops from a root to the farthest rank (alltoall: of a piece's path)
    bandwidth_s_per_byte: float
    busiest: str
    switch: bool = False           # reduces in the switch (msc.synth.switch): no packing, no spread
