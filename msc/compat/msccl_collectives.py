"""MSCCLang's collectives (``msccl.language.collectives``) for
``msc.compat.msccl``, and how each maps onto an msc collective.

MSCCLang's Collective API: ``Collective(num_ranks, chunk_factor, inplace)``
with ``init_buffers()`` (per rank, a dict of buffer -> list of ``Chunk`` or
None: the precondition), ``check(prog)`` (reads ``prog.buffers`` after the
program, prints what is wrong and returns a bool: the postcondition) and
``get_buffer_index(rank, buffer, index)`` (in-place forms: where a logical
buffer's chunk lives). The built-ins implement all three.

``native_collective`` picks the msc collective a program verifies against:
a subclass's ``native`` if it sets one; the msc built-in for AllReduce,
AllGather, ReduceScatter and AllToAll (unless a subclass overrides one of
the three methods); otherwise a ``PortedCollective`` built from
``init_buffers``/``get_buffer_index``, whose postcondition the program
derives from ``check`` (see ``msccl_check``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Callable

from msc.dsl.collectives import BUILTIN, CustomCollective, collective_key, get_collective
from msc.dsl.collectives import Collective as NativeCollective
from msc.compat.msccl_chunks import Buffer, Chunk, ReduceChunk
from msc.dsl.program import user_line
from msc.errors import AlgorithmError

__all__ = ["Collective", "AllReduce", "AllGather", "ReduceScatter", "AllToAll"]

_API = ("init_buffers", "check", "get_buffer_index")


class Collective:
    """A collective at a rank count: ``num_ranks``, ``chunk_factor`` (chunks
    per rank, as in msc), ``inplace``.

    Subclass it as in MSCCLang (``init_buffers``, ``check``, optionally
    ``get_buffer_index``), or set ``native`` to an ``msc.CustomCollective``."""

    name = "custom"
    native: NativeCollective | None = None
    _native_name: str | None = None

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool):
        for label, value in (("num_ranks", num_ranks), ("chunk_factor", chunk_factor)):
            if type(value) is not int or value < 1:
                raise AlgorithmError(f"{type(self).__name__}: {label} must be an int >= 1, got {value!r}",
                                     where=user_line())
        self.num_ranks = num_ranks
        self.chunk_factor = chunk_factor
        self.inplace = bool(inplace)

    def init_buffers(self):
        """Per rank, ``{Buffer.input: [...], Buffer.output: [...]}`` with the
        ``Chunk`` each slot starts with (None: empty). A custom collective
        defines it."""
        return None

    def check(self, prog):
        """Whether ``prog.buffers`` hold what the collective requires (print
        what is wrong). A custom collective defines it."""
        return None

    def get_buffer_index(self, rank: int, buffer, index: int):
        """Where chunk ``index`` of logical ``buffer`` on ``rank`` lives: ``(buffer, index)``."""
        return buffer, index

    def destination(self, rank: int, index: int) -> tuple[int, int]:
        """(rank, index) where input chunk ``index`` of ``rank`` must end up;
        -1 where it goes to every rank (MSCCLang's ``dst_rank``/``dst_index``)."""
        return (-1, -1)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_ranks={self.num_ranks}, chunk_factor={self.chunk_factor}, "
                f"inplace={self.inplace})")


class _Builtin(Collective):
    """A collective msc knows; MSCCLang's three methods come from its layout."""

    def _layout(self):
        cached = self.__dict__.get("_native_layout")
        if cached is None:
            cached = self._native_layout = get_collective(self._native_name).layout(
                self.num_ranks, self.chunk_factor, self.inplace)
        return cached

    def init_buffers(self):
        layout = self._layout()
        ranks = []
        for r in range(self.num_ranks):
            phys = {b: [None] * size for b, size in layout.physical_sizes.items()}
            buf, off, starts = layout.initial_labels(r)
            for i, label in enumerate(starts):
                phys[buf][off + i] = Chunk(*label, *self.destination(*label))
            if layout.alias_table is None:
                ranks.append({Buffer.input: phys["input"], Buffer.output: phys["output"]})
                continue
            alias, target, offsets = layout.alias_table
            if alias == "input":     # in-place allgather: the input is a window of the output
                size = layout.logical_sizes["input"]
                ranks.append({Buffer.input: phys[target][offsets[r]:offsets[r] + size], Buffer.output: phys[target]})
            elif any(offsets):       # in-place reduce-scatter: MSCCLang keeps only the input
                ranks.append({Buffer.input: phys[target]})
            else:                    # in-place allreduce: one list under both names
                ranks.append({Buffer.input: phys[target], Buffer.output: phys[target]})
        return ranks

    def get_buffer_index(self, rank, buffer, index):
        table = self._layout().alias_table
        if table is not None and buffer == table[0]:
            return Buffer(table[1]), index + table[2][rank]
        return buffer, index

    def check(self, prog):
        """Every output chunk holds the contributions msc's collective
        requires; prints each one that does not, as MSCCLang does."""
        from msc.dsl.collectives import describe_multiset

        layout = self._layout()
        correct = True
        for r in range(self.num_ranks):
            output = prog.buffers[r][Buffer.output]
            for i, want in enumerate(layout.expected_row(r)[2]):
                if want is None:
                    continue
                got = output[i]
                if got is None or _counts(got) != want.counts:
                    print(f"Rank {r} chunk {i} is incorrect should be {describe_multiset(want.counts)} given {got}")
                    correct = False
        return correct


def _counts(value) -> Counter:
    if isinstance(value, ReduceChunk):
        return value.labels()
    return Counter([value.label]) if isinstance(value, Chunk) else Counter()


class AllReduce(_Builtin):
    name = "allreduce"
    _native_name = "allreduce"

    def destination(self, rank, index):
        return (-1, index)


class AllGather(_Builtin):
    name = "allgather"
    _native_name = "allgather"

    def destination(self, rank, index):
        return (-1, rank * self.chunk_factor + index)


class ReduceScatter(_Builtin):
    name = "reduce_scatter"
    _native_name = "reducescatter"

    def destination(self, rank, index):
        return divmod(index, self.chunk_factor)


class AllToAll(_Builtin):
    name = "alltoall"
    _native_name = "alltoall"

    def destination(self, rank, index):
        k = self.chunk_factor
        return (index // k, rank * k + index % k)


# -- which msc collective a program verifies against -------------------------------
def native_collective(c: Collective, expected: Callable[[int, int], list | None]) -> NativeCollective:
    """The msc collective for ``c``; ``expected(rank, index)`` gives a ported
    collective's postcondition (the labels output chunk ``index`` of ``rank``
    must hold, or None for anything)."""
    if c.native is not None:
        if not isinstance(c.native, NativeCollective):
            raise AlgorithmError(f"collective {type(c).__name__}: native must be an msc collective "
                                 f"(msc.CustomCollective), got {c.native!r}", where=user_line())
        return c.native
    base = next(cls for cls in type(c).__mro__ if cls is Collective or cls in _BUILTINS)
    if base is not Collective and all(getattr(type(c), m) is getattr(base, m) for m in _API):
        return get_collective(base._native_name)
    if type(c).init_buffers is Collective.init_buffers:
        raise AlgorithmError(
            f"collective {type(c).__name__} says nothing about its buffers: define init_buffers() (what each "
            f"rank starts with) and check(prog) (what it must end with), as MSCCLang's custom collectives do, "
            f"or set `native` to an msc.CustomCollective", where=user_line())
    return port(c, expected)


_BUILTINS = (AllReduce, AllGather, ReduceScatter, AllToAll)


class PortedCollective(CustomCollective):
    """An MSCCLang custom collective as an msc one: sizes and precondition
    from ``init_buffers()``, the in-place alias from ``get_buffer_index``
    (or one list under both names), the postcondition from ``expected``.
    ``chunks[rank][i]`` is the Chunk input ``i`` of ``rank`` starts with."""

    def __init__(self, name: str, input_size: int, output_size: int, alias, chunks: list[list],
                 expected: Callable[[int, int], list | None]):
        super().__init__(name, input_chunks=input_size, output_chunks=output_size,
                         postcondition=lambda r, i, n, k: expected(r, i),
                         precondition=lambda r, i, n, k: self._label(r, i))
        self.alias = alias          # (aliased buffer, target, offset per rank), or None
        self.chunks = chunks

    @property
    def inplace(self) -> bool:
        return self.alias is not None

    def _label(self, rank: int, index: int):
        row = self.chunks[rank]
        start = row[index] if index < len(row) else None
        return None if start is None else start.label

    def start(self, rank: int, index: int) -> Chunk | None:
        row = self.chunks[rank]
        return row[index] if index < len(row) else None

    def inplace_alias(self, rank, n, k):
        alias, target, offsets = self.alias
        return (alias, target, offsets[rank])


def port(c: Collective, expected) -> PortedCollective:
    """A PortedCollective from ``c.init_buffers()`` and ``c.get_buffer_index``."""
    who = type(c).__name__
    buffers = c.init_buffers()

    def bad(message: str) -> AlgorithmError:
        return AlgorithmError(f"collective {who}: {message}", where=user_line())

    n = c.num_ranks
    if not isinstance(buffers, (list, tuple)) or len(buffers) != n or not all(
            isinstance(b, Mapping) for b in buffers):
        raise bad(f"init_buffers() must return one dict of buffers per rank ({n}), got {_short(buffers)}")
    inputs, outputs, aliases = [], [], []
    for r, bufs in enumerate(buffers):
        inp = bufs.get(Buffer.input)
        out = bufs.get(Buffer.output)
        if not isinstance(inp, list):
            raise bad(f"init_buffers(): rank {r} has no Buffer.input list")
        if out is not None and not isinstance(out, list):
            raise bad(f"init_buffers(): rank {r} Buffer.output must be a list, got {_short(out)}")
        for name, lst in bufs.items():
            if name not in (Buffer.input, Buffer.output) and isinstance(lst, list) and any(
                    x is not None for x in lst):
                raise bad(f"init_buffers(): rank {r} buffer {name!r} starts with chunks; only the input may")
        inputs.append([_start(x, r, "input", i, bad) for i, x in enumerate(inp)])
        outputs.append(out)
        aliases.append(_alias(c, r, inp, out, bad))
    kinds = {a[:2] if a else None for a in aliases}
    if len(kinds) > 1:
        raise bad(f"get_buffer_index/init_buffers alias the buffers differently on different ranks: "
                  f"{sorted(map(str, kinds))}")
    kind = kinds.pop()
    in_size = max(map(len, inputs))
    if kind == ("output", "input"):
        # The output lives in the input: its own list's length where it has one.
        out_size = min(len(out) if out is not None and out is not inp else len(inp) - a[2]
                       for out, inp, a in zip(outputs, (b[Buffer.input] for b in buffers), aliases))
    elif any(out is None for out in outputs):
        raise bad("init_buffers(): every rank needs a Buffer.output list (or get_buffer_index mapping the "
                  "output into the input)")
    else:
        out_size = max(map(len, outputs))
    for r, (out, a) in enumerate(zip(outputs, aliases)):
        _check_output_starts(out, buffers[r][Buffer.input], inputs[r], a, r, bad)
    alias = None if kind is None else (*kind, tuple(a[2] for a in aliases))
    return PortedCollective(_native_name(who), in_size, out_size, alias, inputs, expected)


def _alias(c: Collective, rank: int, inp: list, out, bad):
    """(aliased buffer, target, offset) on ``rank``, or None: from
    get_buffer_index where it moves a buffer, else from one list under both names."""
    found = None
    for name, other in (("input", "output"), ("output", "input")):
        buf, off = c.get_buffer_index(rank, Buffer(name), 0)
        if buf == other:
            found = (name, other, off)
            break
        if buf != name or off != 0:
            raise bad(f"get_buffer_index({rank}, Buffer.{name}, 0) gave ({buf!r}, {off!r}); msc supports only "
                      f"mapping input into output (or output into input) at a fixed offset")
    if found is None:
        return ("output", "input", 0) if out is not None and out is inp else None
    name, other, off = found
    # The aliased buffer's chunks must sit at consecutive places of the target.
    size = len(inp) if name == "input" else max(0, len(inp) - off)
    for i in range(size):
        got = c.get_buffer_index(rank, Buffer(name), i)
        if tuple(got) != (other, off + i):
            raise bad(f"get_buffer_index({rank}, Buffer.{name}, {i}) gave {got!r}, not ({other!r}, {off + i}); "
                      f"msc supports only a fixed offset per rank")
    return found


def _start(value, rank: int, buffer: str, index: int, bad) -> Chunk | None:
    if value is None or isinstance(value, Chunk):
        if value is not None and not (type(value.origin_rank) is int and type(value.origin_index) is int):
            raise bad(f"init_buffers(): rank {rank} {buffer}[{index}] is {value!r}; its origin must be ints")
        return value
    raise bad(f"init_buffers(): rank {rank} {buffer}[{index}] must be a Chunk or None, got {_short(value)}")


def _check_output_starts(out, inp_list, starts, alias, rank, bad) -> None:
    """The output starts empty except where it is the input."""
    if out is None or out is inp_list:
        return
    lo = hi = 0
    if alias is not None and alias[0] == "input":
        lo, hi = alias[2], alias[2] + len(starts)
    for j, x in enumerate(out):
        if x is None:
            continue
        if not lo <= j < hi or x != starts[j - lo]:
            raise bad(f"init_buffers(): rank {rank} output[{j}] starts with {x!r}, but msc's outputs start empty "
                      f"where they are not the input")


def _native_name(cls_name: str) -> str:
    """The collective's name in plans: its class name, unless that is a
    built-in's (a plan naming one would be checked against it)."""
    key = collective_key(cls_name)
    return f"custom_{cls_name}" if key in BUILTIN else cls_name


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
