"""Uneven all-to-all (MoE dispatch) priced the way msc.torch runs it: padded units.

msc.torch serves ``all_to_all_single`` with split sizes by running an even
alltoall plan on units padded to the largest piece any rank sends any
other (msc.torch.uneven). Its time is the plan's time at ``n * pad`` bytes
per rank, against the even call's time at the same bytes: the padding's
price. The splits come from *statistics* (``SplitStats``), MoE's routing
of ``tokens`` tokens per rank to the ranks' experts, drawn with a fixed
seed:

- ``uniform``: each token to a rank drawn uniformly (the pieces vary by
  sampling noise alone: a few percent at thousands of tokens);
- ``skewed[:Z]``: to rank d with probability proportional to 1/(d+1)^Z
  (Zipf, exponent Z, default 1), the same popular experts on every rank,
  as a router that favours some experts does.

Besides the padded time the records say ``pad`` (the largest piece over the
mean: the factor padding multiplies the bytes by) and ``busiest`` (the most
bytes a rank sends or receives, over the even call's: what the same call
with exact lengths would still move through its busiest rank, which no msc
engine does yet). Nothing is run: the simulator's model (msc.sim.simulate)
prices both calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msc.errors import UsageError

DEFAULT_TOKENS = 4096          # tokens per rank and call: a 4K-token micro-batch's MoE layer
SEED = 0


@dataclass(frozen=True)
class SplitStats:
    """How tokens are routed: ``kind`` "uniform" or "skewed" (Zipf ``exponent``)."""

    kind: str
    exponent: float = 1.0

    @classmethod
    def parse(cls, text: str) -> SplitStats:
        """"uniform", "skewed" or "skewed:Z" (Z > 0)."""
        kind, _, arg = str(text).strip().lower().partition(":")
        if kind == "uniform" and not arg:
            return cls("uniform")
        if kind == "skewed":
            try:
                z = float(arg) if arg else 1.0
            except ValueError:
                z = -1.0
            if not 0 < z <= 100:
                raise UsageError(f"--splits {text}: the Zipf exponent must be a number above 0 and at most 100")
            return cls("skewed", z)
        raise UsageError(f"--splits {text!r}: expected uniform, skewed or skewed:Z (a Zipf exponent Z, e.g. 1.2)")

    def label(self) -> str:
        return "uniform" if self.kind == "uniform" else f"skewed:{self.exponent:g}"

    def probabilities(self, n: int) -> np.ndarray:
        if self.kind == "uniform":
            return np.full(n, 1.0 / n)
        w = 1.0 / np.arange(1, n + 1) ** self.exponent
        return w / w.sum()


def token_matrix(stats: SplitStats, n: int, tokens: int, seed: int = SEED) -> np.ndarray:
    """[s, d]: tokens rank s sends rank d, each rank routing ``tokens``."""
    if type(tokens) is not int or not 1 <= tokens <= 1 << 30:
        raise UsageError(f"--tokens must be an int from 1 to {1 << 30}, got {tokens!r}")
    rng = np.random.default_rng(seed)
    return rng.multinomial(tokens, stats.probabilities(n), size=n)


def uneven_records(simulator, requested: list[int], stats: SplitStats, tokens: int = DEFAULT_TOKENS, *,
                   engine: str = "auto") -> list[dict]:
    """Per requested size (bytes per rank, as the even call's), the padded
    call's record (time, algbw and busbw of the call's bytes) with
    ``even_time``, ``pad``, ``vs_even`` (padded time over even time),
    ``busiest`` and ``splits``: the plan simulated at the padded sizes and
    at the even ones (msc.sim.simulate.Simulator ``simulator``)."""
    plan = simulator.plan
    if plan.collective != "alltoall":
        raise UsageError(f"--splits prices an alltoall with uneven splits; {plan.name!r} is a plan of {plan.collective}")
    n = plan.num_ranks
    m = token_matrix(stats, n, tokens)
    pad = m.max() * n / tokens                    # the padded unit over the even one
    busiest = max(m.sum(axis=1).max(), m.sum(axis=0).max()) / tokens
    padded_sizes = [max(1, int(round(size * pad))) for size in requested]
    even = simulator.records(requested, engine=engine)
    padded = simulator.records(padded_sizes, engine=engine)
    out = []
    for size, e, p in zip(requested, even, padded):
        rec = dict(p)
        algbw = size / p["time"] / 1e3 if p["time"] > 0 else 0.0
        rec.update(size=size, requested_size=size, count=e["count"], algbw=algbw,
                   busbw=algbw * (e["busbw"] / e["algbw"] if e["algbw"] else 1.0), padded_size=p["size"],
                   even_time=e["time"], pad=pad, vs_even=p["time"] / e["time"] if e["time"] > 0 else float("nan"),
                   busiest=busiest, splits=stats.label(), tokens=tokens)
        out.append(rec)
    return out


COLUMNS = (("even", "(us)", lambda r: f"{r['even_time']:6.1f}"), ("vs", "even", lambda r: f"{r['vs_even']:6.2f}"),
           ("pad", "x", lambda r: f"{r['pad']:6.2f}"), ("busy", "x", lambda r: f"{r['busiest']:6.2f}"))
NOTE = ("# uneven splits as msc.torch runs them: the plan on units padded to the largest piece (time, algbw, busbw: of "
        "the call's bytes); even: the same bytes in equal splits; vs even: time over even's; pad: the padded bytes over "
        "the call's; busy: the most a rank sends or receives over even's (what exact lengths would still move)")
