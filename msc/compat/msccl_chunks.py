"""What MSCCLang's buffers hold, for ``msc.compat.msccl``: its ``Buffer``
names, ``Chunk`` and ``ReduceChunk`` (which custom collectives build in
``init_buffers`` and compare in ``check``), and the lazy sums tracing keeps.
"""
from __future__ import annotations

from collections import Counter
from enum import Enum

__all__ = ["Buffer", "Chunk", "ReduceChunk"]


class Buffer(str, Enum):
    """MSCCLang's buffer names; any other hashable names a scratch buffer.

    A ``str`` enum, so ``ref.buffer == Buffer.input`` holds for a reference
    to the input buffer (references carry plain names), and a dict keyed by
    ``Buffer.output`` answers to ``"output"`` too."""

    input = "input"
    output = "output"
    scratch = "scratch"

    def __str__(self) -> str:
        return self.value


class Chunk:
    """An input chunk: where it starts (``origin_rank``, ``origin_index``)
    and where its collective sends it (``dst_rank``, ``dst_index``; -1: every
    rank, or not said). Equal and hashed by origin only, as in MSCCLang."""

    __slots__ = ("origin_rank", "origin_index", "dst_rank", "dst_index")

    def __init__(self, origin_rank: int, origin_index: int, dst_rank: int = -1, dst_index: int = -1):
        self.origin_rank = origin_rank
        self.origin_index = origin_index
        self.dst_rank = dst_rank
        self.dst_index = dst_index

    @property
    def label(self) -> tuple[int, int]:
        return (self.origin_rank, self.origin_index)

    def reduce(self, dst: int, chunk) -> ReduceChunk:
        """This chunk reduced with ``chunk`` (a Chunk or ReduceChunk) on rank ``dst``."""
        if isinstance(chunk, ReduceChunk):
            return chunk.reduce(dst, self)
        if isinstance(chunk, Chunk):
            return ReduceChunk(dst, [self, chunk])
        raise TypeError(f"Chunk.reduce: cannot reduce {self!r} with {chunk!r} (a Chunk or ReduceChunk is needed)")

    def __eq__(self, other) -> bool:
        return type(other) is Chunk and self.label == other.label

    def __hash__(self) -> int:
        return hash(self.label)

    def __lt__(self, other: Chunk) -> bool:
        return self.label < other.label

    def __repr__(self) -> str:
        return (f"Chunk(origin_rank={self.origin_rank}, origin_index={self.origin_index}, "
                f"dst_rank={self.dst_rank}, dst_index={self.dst_index})")


class ReduceChunk:
    """A reduction of several chunks, made on ``creation_rank``; equal to
    another when both hold the same chunks, counted with multiplicity (so a
    missing or doubled contribution is a difference), in any order."""

    __slots__ = ("creation_rank", "chunks")

    def __init__(self, creation_rank: int, chunks: list):
        self.creation_rank = creation_rank
        self.chunks = list(chunks)

    def reduce(self, dst: int, chunk) -> ReduceChunk:
        if isinstance(chunk, ReduceChunk):
            return ReduceChunk(self.creation_rank, self.chunks + chunk.chunks)
        if isinstance(chunk, Chunk):
            return ReduceChunk(self.creation_rank, self.chunks + [chunk])
        raise TypeError(f"ReduceChunk.reduce: cannot reduce with {chunk!r} (a Chunk or ReduceChunk is needed)")

    def sort(self) -> None:
        self.chunks.sort()

    def labels(self) -> Counter:
        return Counter(c.label for c in self.chunks)

    def __eq__(self, other) -> bool:
        return isinstance(other, ReduceChunk) and self.labels() == other.labels()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.labels().items())))

    def __repr__(self) -> str:
        return f"ReduceChunk(creation_rank={self.creation_rank}, chunks={self.chunks!r})"


class Sum:
    """A traced reduction ``a (+) b`` made on ``rank``: kept as a tree so a
    reduce costs O(1); turned into a ReduceChunk only where it is read."""

    __slots__ = ("rank", "a", "b")

    def __init__(self, rank: int, a, b):
        self.rank, self.a, self.b = rank, a, b


def leaves(value) -> list[Chunk]:
    """The chunks a traced value holds, in reduction order."""
    out, stack = [], [value]
    while stack:
        node = stack.pop()
        if type(node) is Sum:
            stack += (node.b, node.a)
        else:
            out.append(node)
    return out


def labels(value) -> list[tuple[int, int]]:
    """The labels of a traced value (a Chunk or Sum), with multiplicity."""
    return [c.label for c in leaves(value)]


def as_mscclang(value):
    """A traced value as MSCCLang shows it: None, a Chunk or a ReduceChunk."""
    if type(value) is Sum:
        return ReduceChunk(value.rank, leaves(value))
    return value
