"""A packing written out as an msc DSL program: the trees as data at the top
of the file, and a short algorithm function that walks them. The text is
the product: readable, editable, and traced, verified and lowered like any
hand-written algorithm."""
from __future__ import annotations

from msc.dsl.collectives import ROOTED
from msc.synth.packing import LinkLoads, Tree

# The algorithm function of each collective, after the tree tables and the
# helpers. ``spread`` is a parameter of the algorithm (msc tune --param
# spread=1,2,4): piece j moves on channel j % spread, so pieces that share a
# link need not share a threadblock; allreduce sends its second phase on
# channels of its own, so that the threadblocks of the sums and of the
# spreading do not wait on each other. ``add_on_arrival`` (the collectives
# that sum) chooses where a rank with several children adds their parts
# (sum_up); msc tune tries both, as it does every bool parameter.
_BODIES = {
    "allgather": '''
@msc.algorithm("allgather", chunk_factor=PIECES, ranks=[RANKS])
def {name}(p: msc.Program, spread=SPREAD):
    """Piece j of rank r's input travels down OUT_TREES[r, j] to output[r * PIECES + j] everywhere."""
    for (root, piece), edges in OUT_TREES.items():
        index = root * PIECES + piece
        start = p.chunk(root, "input", piece).copy(root, "output", index)
        spread_down(start, edges, "output", index, channel=piece % spread)
''',
    "broadcast": '''
@msc.algorithm("broadcast", chunk_factor=PIECES, ranks=[RANKS])
def {name}(p: msc.Program, spread=SPREAD, root=ROOT):
    """Piece j of the root's input travels down OUT_TREES[root, j] to output[j] everywhere."""
    if root != ROOT:
        raise ValueError(f"these trees are rooted at rank {{ROOT}}, not {{root}}: synthesize again with --root")
    for (_, piece), edges in OUT_TREES.items():
        start = p.chunk(root, "input", piece).copy(root, "output", piece)
        spread_down(start, edges, "output", piece, channel=piece % spread)
''',
    "reducescatter": '''
@msc.algorithm("reducescatter", chunk_factor=PIECES, ranks=[RANKS])
def {name}(p: msc.Program, spread=SPREAD, add_on_arrival=ADD_ON_ARRIVAL):
    """Chunk r * PIECES + j of every input is summed up IN_TREES[r, j] into output[j] of rank r."""
    scratch = Scratch()
    for (root, piece), edges in IN_TREES.items():
        index = root * PIECES + piece
        total = p.chunk(root, "input", index).copy(root, "output", piece)
        sum_up(p, total, edges, index, scratch, channel=piece % spread, on_arrival=add_on_arrival)
''',
    "reduce": '''
@msc.algorithm("reduce", chunk_factor=PIECES, ranks=[RANKS])
def {name}(p: msc.Program, spread=SPREAD, add_on_arrival=ADD_ON_ARRIVAL, root=ROOT):
    """Piece j of every input is summed up IN_TREES[root, j] into the root's output[j]."""
    if root != ROOT:
        raise ValueError(f"these trees are rooted at rank {{ROOT}}, not {{root}}: synthesize again with --root")
    scratch = Scratch()
    for (_, piece), edges in IN_TREES.items():
        total = p.chunk(root, "input", piece).copy(root, "output", piece)
        sum_up(p, total, edges, piece, scratch, channel=piece % spread, on_arrival=add_on_arrival)
''',
    "allreduce": '''
@msc.algorithm("allreduce", chunk_factor=lambda n: n * PIECES, ranks=[RANKS])
def {name}(p: msc.Program, spread=SPREAD, add_on_arrival=ADD_ON_ARRIVAL):
    """Chunk r * PIECES + j is summed up IN_TREES[r, j] into rank r's output (a
    reduce-scatter), then travels down OUT_TREES[r, j] to every output (an allgather)."""
    scratch = Scratch()
    totals = {{}}
    for (root, piece), edges in IN_TREES.items():
        index = root * PIECES + piece
        total = p.chunk(root, "input", index).copy(root, "output", index)
        totals[root, piece] = sum_up(p, total, edges, index, scratch, channel=piece % spread,
                                     on_arrival=add_on_arrival)
    for (root, piece), edges in OUT_TREES.items():
        spread_down(totals[root, piece], edges, "output", root * PIECES + piece, channel=spread + piece % spread)
''',
}

_BODIES["alltoall"] = '''
@msc.algorithm("alltoall", chunk_factor=PIECES, ranks=[RANKS])
def {name}(p: msc.Program, spread=SPREAD):
    """Piece j of rank s's chunk for rank d (input[d * PIECES + j]) goes to output[s * PIECES + j]
    of rank d, straight or through the rank RELAYED[s, d][j] names. In place, the pieces land in
    scratch (one landing in the output would overwrite a piece not yet sent) and are copied into
    the output at the end."""
    scratch = Scratch()
    landed = []
    for s in range(RANKS):
        for d in range(RANKS):
            for j in range(PIECES):
                index = s * PIECES + j
                piece = p.chunk(s, "input", d * PIECES + j)
                if s == d:
                    piece.copy(d, "output", index)
                    continue
                relay = RELAYED.get((s, d), STRAIGHT)[j]
                if relay is not None:
                    piece = piece.copy(relay, "scratch", scratch.take(relay), channel=j % spread)
                if p.inplace:
                    landed.append((piece.copy(d, "scratch", scratch.take(d), channel=j % spread), index))
                else:
                    piece.copy(d, "output", index, channel=j % spread)
    for part, index in landed:
        part.copy(part.rank, "output", index)
'''

_SPREAD_DOWN = '''

def spread_down(start, edges, buffer, index, channel):
    """Copy ``start`` (on the tree's root) down the tree ``edges`` to ``buffer[index]`` of every rank."""
    holder = {start.rank: start}
    for parent, child in edges:
        holder[child] = holder[parent].copy(child, buffer, index, channel=channel)
'''

_SCRATCH = '''

class Scratch:
    """Scratch chunks handed out in order, per rank: every partial sum and landed piece gets its own."""

    def __init__(self):
        self.used = {}

    def take(self, rank):
        self.used[rank] = self.used.get(rank, -1) + 1
        return self.used[rank]
'''

_SUM_UP = '''

def sum_up(p, total, edges, index, scratch, channel, on_arrival):
    """Sum chunk ``index`` of every rank's input up the tree ``edges`` into
    ``total`` (a chunk on the tree's root), leaves first. A rank with one
    child adds the child's sum to its own input as it arrives. A rank with
    several receives each into a scratch chunk of its own, so no receive
    waits on another child's, and adds them up: ``on_arrival``, each right
    after its receive (the addition runs on the threadblock that received
    it), else all after the last receive (on one threadblock). Which is
    faster depends on what else those threadblocks carry."""
    root = total.rank
    children = {}
    for parent, child in edges:
        children.setdefault(parent, []).append(child)
    sums = {}
    for rank in [child for _, child in reversed(edges)] + [root]:     # children before their parents
        kids = children.get(rank, [])
        if not kids:
            sums[rank] = p.chunk(rank, "input", index)                    # a leaf sends its input as it is
            continue
        acc = total if rank == root else p.chunk(rank, "input", index).copy(rank, "scratch", scratch.take(rank))
        if len(kids) == 1:
            sums[rank] = acc.reduce(sums[kids[0]], channel=channel)
            continue
        if on_arrival:
            for kid in kids:
                acc = acc.reduce(sums[kid].copy(rank, "scratch", scratch.take(rank), channel=channel))
        else:
            landed = [sums[kid].copy(rank, "scratch", scratch.take(rank), channel=channel) for kid in kids]
            for part in landed:
                acc = acc.reduce(part)
        sums[rank] = acc
    return sums[root]
'''

WIDTH = 100
# the module-level names program_text writes besides the helpers' (def NAME, class NAME)
CONSTANTS = ("msc", "RANKS", "PIECES", "SPREAD", "ADD_ON_ARRIVAL", "ROOT", "IN_TREES", "OUT_TREES", "STRAIGHT",
             "RELAYED")


def global_names() -> frozenset[str]:
    """The module-level names and builtins a synthesized program looks up
    when it runs: an algorithm named one of them would replace it."""
    import builtins
    import keyword
    import io
    import re
    import tokenize

    texts = [body.format(name="") for body in _BODIES.values()] + [_SPREAD_DOWN, _SCRATCH, _SUM_UP]
    helpers = {m[1] for text in texts for m in re.finditer(r"^(?:def|class) (\w+)", text, re.M)}
    tokens = {t.string for text in texts for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type == tokenize.NAME}
    return frozenset(helpers | set(CONSTANTS) | (tokens & set(dir(builtins)))) - set(keyword.kwlist)


def program_text(collective: str, packing: LinkLoads, *, num_ranks: int, pieces: int, spread: int, name: str,
                 header: str, root: int = 0, sums: bool = False, add_on_arrival: bool = True) -> str:
    """The DSL program: ``header`` as its docstring, then the constants, the
    tree tables (``packing`` a msc.synth.packing.Packing) or, for alltoall,
    the relays (a msc.synth.flows.Flows), the helpers and the function.
    ``sums``: the collective adds up trees (sum_up, whose ``on_arrival``
    defaults to ``add_on_arrival``)."""
    out = [f'"""{header.strip()}\n"""', "import msc", "",
           f"RANKS = {num_ranks}",
           f"PIECES = {pieces}          # pieces per "
           + ("chunk of a rank pair: each has a path" if collective == "alltoall" else "shard: each has a tree")
           + " of its own",
           f"SPREAD = {spread}          # channels the pieces are spread over (the algorithm's parameter)"]
    if sums:
        out.append(f"ADD_ON_ARRIVAL = {add_on_arrival}  # where several children's parts are added (sum_up)")
    if collective in ROOTED:
        out.append(f"ROOT = {root}")
    for kind, table, what in (("in", "IN_TREES", "every rank's share is summed up toward the root"),
                              ("out", "OUT_TREES", "the piece travels from the root down to every rank")):
        trees = [] if collective == "alltoall" else [t for t in packing.trees if t.kind == kind]
        if trees:
            out += ["", f"# {table}[root, piece]: the spanning tree of that piece, as (parent, child) edges,",
                    f"# parents first; {what}.", f"{table} = {{"]
            out += [line for t in sorted(trees, key=lambda t: (t.root, t.piece)) for line in _tree_lines(t)]
            out.append("}")
    if collective == "alltoall":
        out += _relay_lines(packing.relays)
    if collective in ("allgather", "broadcast", "allreduce"):
        out.append(_SPREAD_DOWN.rstrip("\n"))
    if sums or collective == "alltoall":
        out.append(_SCRATCH.rstrip("\n"))
    if sums:
        out.append(_SUM_UP.rstrip("\n"))
    out += ["", _BODIES[collective].format(name=name).rstrip("\n")]
    return "\n".join(out) + "\n"


def _relay_lines(relays: dict) -> list[str]:
    """RELAYED: the pairs with a relayed piece, the rank each piece goes through (None: straight)."""
    out = ["", "# RELAYED[src, dst]: per piece of src's chunk for dst, the rank it is relayed through",
           "# (None: straight over the route between them); pairs not listed send every piece straight.",
           "STRAIGHT = [None] * PIECES", "RELAYED = {"]
    items = [f"({s}, {d}): [{', '.join('None' if r is None else str(r) for r in rs)}],"
             for (s, d), rs in relays.items() if any(r is not None for r in rs)]
    line = "   "
    for item in items:
        if len(line) + 1 + len(item) > WIDTH:
            out.append(line)
            line = "   "
        line += " " + item
    if line.strip():
        out.append(line)
    out.append("}")
    return out


def _tree_lines(tree: Tree) -> list[str]:
    head = f"    ({tree.root}, {tree.piece}): ["
    comment = f"  # depth {tree.depth()}"
    items = [f"({a}, {b})" for a, b in tree.edges]
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "],")
        if len(line) + 1 + len(piece) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = " " * 8 + piece
        else:
            line = line + ("" if line.endswith("[") else " ") + piece
    if not items:
        line += "],"
    lines.append(line)
    lines[0] += comment
    return lines
