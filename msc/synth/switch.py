"""Allreduce schedules that reduce in the switch (NVLS) for ``msc synthesize``.

Where the topology's GPUs sit in switch domains that reduce and multicast
(msc.sim.topology's view: nvls_bandwidth; dgx-h100[:N], nvswitch, ib:N), an
allreduce need not cross the links as trees do: the switch sums each slice
in one load and writes it to every member in one store. One domain: each
rank reduce-loads and multicast-stores its 1/n (NCCL's NVLS). Several
domains of g GPUs: each local rank reduce-loads its 1/g in its domain, the
ranks of one local index sum it up and send it down binary trees of the
domains (two mirrored trees, each half the slice, one NIC per local rank),
and multicast-store it in their domain; the reduce-loads, the trees and the
stores on threadblocks of their own, so they overlap across tiles (the
library's allreduce/nvls_tree, whose pieces it calls from msc.dsl.nvls:
the switch tree is written once).
"""
from __future__ import annotations

from msc.synth.result import Synthesis

TREES = 2          # trees across domains: tree 1 is tree 0 mirrored


def switch_domains(topology) -> int | None:
    """GPUs per switch domain where ``topology``'s ranks fill equal domains
    of consecutive ranks whose switch reduces (NVLS), else None."""
    view = topology.view("Simple")
    g = getattr(topology, "gpus_per_node", None)
    n = topology.num_ranks
    if not getattr(view, "nvls_bandwidth", 0) or not g or g < 2 or n % g:
        return None
    domains = [tuple(range(j, j + g)) for j in range(0, n, g)]
    if not all(view.same_switch(d) for d in domains) or (len(domains) > 1 and view.same_switch(range(g + 1))):
        return None
    return g


def switch_program(topology, g: int, *, name: str = "synthesized", command: str = "") -> Synthesis:
    """The switch allreduce for ``topology`` (domains of ``g`` ranks)."""
    n = topology.num_ranks
    nodes = n // g
    depth = _depth(nodes)
    header = _header(topology, g, nodes, command)
    body = _ONE_DOMAIN if nodes == 1 else _DOMAINS
    text = f'"""{header}\n"""\n' + body.format(name=name, ranks=n, g=g, trees=TREES)
    return Synthesis("allreduce", text, 1, 1, None, 0 if nodes == 1 else TREES, depth, 0.0, "the switch ports",
                     switch=True)


def _depth(nodes: int) -> int:
    """Hops from the root of a binary tree of ``nodes`` to its deepest leaf."""
    return (nodes - 1).bit_length() if nodes > 1 else 0


def _header(topology, g: int, nodes: int, command: str) -> str:
    regenerate = "Regenerate: " + command if command else ""
    if nodes == 1:
        how = (f"The switch reduces: each of the {g} ranks reads the sum of every rank's copy of its\n"
               f"1/{g} slice in one load through the switch and writes it to every rank in one\n"
               f"multicast store (NCCL's NVLS).")
    else:
        how = (f"The switch reduces inside each of the {nodes} domains of {g} ranks: local rank l\n"
               f"reduce-loads slice l, the ranks of local index l sum it up and send it down {TREES}\n"
               f"binary trees of the domains (mirrored; half the slice each, over rank l's own NIC),\n"
               f"and l multicast-stores it in its domain. Reduce-loads, trees and stores run on\n"
               f"threadblocks of their own, so across tiles they overlap (after NCCL's NVLSTree).")
    return f"""allreduce for {topology.summary()}: synthesized by msc synthesize.

{regenerate}
{how}
Chosen by simulating it beside the spanning-tree programs (msc simulate says more;
msc bound has no switch cuts yet). Edit freely: msc verifies what it traces."""


_ONE_DOMAIN = '''import msc

RANKS = {ranks}


@msc.algorithm("allreduce", chunk_factor=lambda n: n, ranks=lambda n: n == RANKS)
def {name}(p: msc.Program):
    """Rank r reduce-loads slice r through the switch and multicast-stores it."""
    sw = p.switch()
    for r in range(p.num_ranks):
        sw.reduce(r, "input", r).store("output", r)
'''

_DOMAINS = '''import msc
from msc.dsl.nvls import node_switches, reduce_in_nodes, store_in_nodes, trees_across_nodes

RANKS = {ranks}
GPUS_PER_DOMAIN = {g}   # ranks d * GPUS_PER_DOMAIN ... on switch domain d
TREES = {trees}           # binary trees of domains; tree 1 is tree 0 mirrored (msc.dsl.nvls.tree_order)


@msc.algorithm("allreduce", chunk_factor=lambda n: GPUS_PER_DOMAIN * TREES, ranks=lambda n: n == RANKS)
def {name}(p: msc.Program):
    """Reduce in each domain's switch, sum and return across domains up and
    down binary trees, multicast in each domain; local rank l owns chunks
    l * TREES ... l * TREES + TREES - 1, one per tree (msc.dsl.nvls, the
    library's allreduce/nvls_tree.py, writes each step out)."""
    reducing, storing = node_switches(p, GPUS_PER_DOMAIN)
    reduce_in_nodes(reducing, GPUS_PER_DOMAIN, TREES)
    trees_across_nodes(p, GPUS_PER_DOMAIN, TREES)
    store_in_nodes(p, storing, GPUS_PER_DOMAIN, TREES)
'''

CONSTANTS = ("RANKS", "GPUS_PER_DOMAIN", "TREES")


def global_names() -> frozenset[str]:
    """The module-level names and builtins a switch program looks up when
    it runs (msc.synth.emit.global_names for the tree programs)."""
    import builtins
    import io
    import keyword
    import re
    import tokenize

    texts = [body.format(name="", ranks=0, g=0, trees=0) for body in (_ONE_DOMAIN, _DOMAINS)]
    helpers = {m[1] for text in texts for m in re.finditer(r"^def (\w+)", text, re.M)}
    helpers |= {name.strip() for text in texts for m in re.finditer(r"^from \S+ import (.+)$", text, re.M)
                for name in m[1].split(",")}
    tokens = {t.string for text in texts for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type == tokenize.NAME}
    return frozenset(helpers | set(CONSTANTS) | (tokens & set(dir(builtins)))) - set(keyword.kwlist)
