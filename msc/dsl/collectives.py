"""Collectives as a precondition (which chunk starts where) and a
postcondition (which contributions must end where).

A chunk's identity is a *label* ``(origin_rank, origin_index)``: the input
chunk it started as. A collective is described per rank in *logical*
buffers ("input" and "output", indices as the user sees them); ``Layout``
maps those onto the physical buffers of a rank, which differ only for the
in-place forms (e.g. in-place allgather: input i of rank r *is* output
chunk r*k+i).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable

from msc.errors import UsageError, did_you_mean

Label = tuple[int, int]


class Expected:
    """The multiset of contributions one output chunk must hold.

    Shared between chunks that must hold the same thing, so the verifier can
    remember verdicts per (value, expectation) pair.
    """

    __slots__ = ("_counts", "single", "every_rank")

    def __init__(self, labels: Iterable[Label]):
        self._counts: dict[Label, int] | None = dict(Counter(labels))
        self.every_rank: tuple[int, int] | None = None
        only = next(iter(self._counts)) if len(self._counts) == 1 else None
        self.single: Label | None = only if only and self._counts[only] == 1 else None

    @classmethod
    def of_every_rank(cls, n: int, index: int) -> Expected:
        """Label (r, index) of every rank r < n once: a reduction's output.
        ``every_rank`` is (n, index), and ``counts`` is made when first
        asked for: the verifiers' fast paths read ``every_rank`` instead (a
        1024-rank allreduce's outputs are a million labels, 117 MB as dicts)."""
        self = cls.__new__(cls)
        self._counts, self.every_rank = None, (n, index)
        self.single = (0, index) if n == 1 else None
        return self

    @property
    def counts(self) -> dict[Label, int]:
        """Each label's multiplicity, in order of first mention."""
        if self._counts is None:
            n, index = self.every_rank
            self._counts = {(r, index): 1 for r in range(n)}
        return self._counts

    def __repr__(self) -> str:
        return f"Expected({describe_multiset(self.counts)})"


def describe_multiset(counts: dict[tuple[int, int], int], limit: int = 6) -> str:
    """Compact text for a multiset of labels: 'input[3] of ranks 0-7',
    'input[1] of rank 2 (x2)'. Labels are grouped by index and count."""
    if not counts:
        return "nothing"
    groups: dict[tuple[int, int], list[int]] = {}
    for (rank, index), count in counts.items():
        groups.setdefault((index, count), []).append(rank)
    parts = []
    for (index, count), ranks in sorted(groups.items()):
        ranks.sort()
        who = compact_ranges(ranks)
        text = f"input[{index}] of rank{'s' if len(ranks) > 1 else ''} {who}"
        parts.append(text + (f" (x{count})" if count > 1 else ""))
    if len(parts) > limit:
        parts = parts[:limit] + [f"... {len(parts) - limit} more groups"]
    return ", ".join(parts)


def compact_ranges(values: list[int], sep: str = ",") -> str:
    """Sorted ints as runs: [0, 1, 2, 5] -> "0-2,5" (``sep`` between runs)."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return sep.join(out)

class Collective:
    """Base of every collective. Subclasses say how big the buffers are,
    what they start with and what they must end with.

    ``k`` is the chunk factor, ``n`` the number of ranks.
    """

    name: str = "custom"
    has_root: bool = False

    def input_chunks(self, n: int, k: int) -> int:
        raise NotImplementedError

    def output_chunks(self, n: int, k: int) -> int:
        raise NotImplementedError

    def inplace_alias(self, rank: int, n: int, k: int) -> tuple[str, str, int]:
        """In-place form: ``(alias, target, offset)`` says logical buffer
        ``alias`` is ``target`` starting at chunk ``offset``. Default: the
        output is the input."""
        return ("output", "input", 0)

    def precondition(self, rank: int, index: int, n: int, k: int, root: int) -> Label | None:
        """The label input chunk ``index`` of ``rank`` starts with."""
        return (rank, index)

    def postcondition(self, rank: int, index: int, n: int, k: int, root: int) -> Expected | None:
        """What output chunk ``index`` of ``rank`` must hold; None: anything."""
        raise NotImplementedError

    def postconditions(self, rank: int, n: int, k: int, root: int) -> tuple[Expected | None, ...]:
        """postcondition() of every output chunk of ``rank``, in bulk. A
        collective whose expectations repeat between ranks may return one
        tuple for all of them (verifiers then read it once)."""
        post = self.postcondition
        return tuple([post(rank, i, n, k, root) for i in range(self.output_chunks(n, k))])

    @property
    def labels_are_positions(self) -> bool:
        """Whether input chunk i of rank r starts as label (r, i) everywhere
        (the default precondition), which verifiers may use without asking."""
        return type(self).precondition is Collective.precondition

    def layout(self, num_ranks: int, chunk_factor: int, inplace: bool, root: int = 0) -> Layout:
        layout = Layout(self, num_ranks, chunk_factor, inplace, root)
        layout.validate()
        return layout


class _Cached(Collective):
    """Built-ins share one Expected per distinct multiset."""

    def __init__(self):
        self._cache: dict[tuple, Expected] = {}
        self._rows: dict[tuple, tuple] = {}

    def _expect(self, key: tuple, make: Callable[[], Iterable[Label] | Expected]) -> Expected:
        found = self._cache.get(key)
        if found is None:
            made = make()
            found = self._cache[key] = made if isinstance(made, Expected) else Expected(made)
        return found

    def _row_key(self, rank: int, n: int, k: int, root: int) -> tuple | None:
        """Ranks with the same key have the same expectations (None: none share)."""
        return None

    def postconditions(self, rank, n, k, root):
        key = self._row_key(rank, n, k, root)
        if key is None or not self._rows_shared():
            return Collective.postconditions(self, rank, n, k, root)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = Collective.postconditions(self, rank, n, k, root)
        return row

    def _rows_shared(self) -> bool:
        """Whether the postcondition is the one the row key was written for
        (a subclass may change one without the other)."""
        cls = type(self)
        owner = next(c for c in cls.__mro__ if "_row_key" in c.__dict__)
        return cls.postcondition is owner.postcondition


class AllReduce(_Cached):
    name = "allreduce"

    def input_chunks(self, n, k):
        return k

    def output_chunks(self, n, k):
        return k

    def postcondition(self, rank, index, n, k, root):
        return self._expect((n, index), lambda: Expected.of_every_rank(n, index))

    def _row_key(self, rank, n, k, root):
        return (n, k)


class _OneToN:
    """Buffers of 1 unit in, n out; in place the input is unit ``rank`` of the
    output (allgather, gather)."""

    def input_chunks(self, n, k):
        return k

    def output_chunks(self, n, k):
        return n * k

    def inplace_alias(self, rank, n, k):
        return ("input", "output", rank * k)


class _NToOne:
    """Buffers of n units in, 1 out; in place the output is unit ``rank`` of
    the input (reducescatter, scatter)."""

    def input_chunks(self, n, k):
        return n * k

    def output_chunks(self, n, k):
        return k

    def inplace_alias(self, rank, n, k):
        return ("output", "input", rank * k)


class AllGather(_OneToN, _Cached):
    name = "allgather"

    def postcondition(self, rank, index, n, k, root):
        src = (index // k, index % k)
        return self._expect(src, lambda: (src,))

    def _row_key(self, rank, n, k, root):
        return (n, k)


class ReduceScatter(_NToOne, _Cached):
    name = "reducescatter"

    def postcondition(self, rank, index, n, k, root):
        at = rank * k + index
        return self._expect((n, at), lambda: Expected.of_every_rank(n, at))


class AllToAll(_Cached):
    name = "alltoall"

    def input_chunks(self, n, k):
        return n * k

    def output_chunks(self, n, k):
        return n * k

    def postcondition(self, rank, index, n, k, root):
        src = (index // k, rank * k + index % k)
        return self._expect(src, lambda: (src,))


class Broadcast(_Cached):
    name = "broadcast"
    has_root = True

    def input_chunks(self, n, k):
        return k

    def output_chunks(self, n, k):
        return k

    def postcondition(self, rank, index, n, k, root):
        src = (root, index)
        return self._expect(src, lambda: (src,))

    def _row_key(self, rank, n, k, root):
        return (n, k, root)


class Reduce(_Cached):
    name = "reduce"
    has_root = True

    def input_chunks(self, n, k):
        return k

    def output_chunks(self, n, k):
        return k

    def postcondition(self, rank, index, n, k, root):
        if rank != root:
            return None
        return self._expect((n, index), lambda: Expected.of_every_rank(n, index))

    def _row_key(self, rank, n, k, root):
        return (n, k, root, rank == root)


class SendRecv(_Cached):
    """Each rank's input to the next rank's output ((r - 1) mod n -> r): the
    point-to-point exchange of pipeline parallelism (nccl-tests' sendrecv).
    In place, each rank's buffer ends holding its predecessor's."""

    name = "sendrecv"

    def input_chunks(self, n, k):
        return k

    def output_chunks(self, n, k):
        return k

    def postcondition(self, rank, index, n, k, root):
        src = ((rank - 1) % n, index)
        return self._expect(src, lambda: (src,))


class Gather(_OneToN, _Cached):
    """Every rank's input to unit ``rank`` of the root's output (nccl-tests'
    gather: NVIDIA/nccl-tests src/gather.cu); other ranks' outputs are
    unspecified. In place, the input is unit ``rank`` of the output."""

    name = "gather"
    has_root = True

    def postcondition(self, rank, index, n, k, root):
        if rank != root:
            return None
        src = (index // k, index % k)
        return self._expect(src, lambda: (src,))

    def _row_key(self, rank, n, k, root):
        return (n, k, root, rank == root)


class Scatter(_NToOne, _Cached):
    """Unit r of the root's input to rank r's output (nccl-tests' scatter:
    src/scatter.cu); other ranks' inputs are not read. In place, the output
    is unit ``rank`` of the input."""

    name = "scatter"
    has_root = True

    def postcondition(self, rank, index, n, k, root):
        src = (root, rank * k + index)
        return self._expect(src, lambda: (src,))


def _extra_params(fn, fixed: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(names, required names) of ``fn``'s parameters after its first
    ``fixed`` positional ones: the algorithm parameters it asks for."""
    import inspect

    if not callable(fn):
        return (), ()
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return (), ()
    if any(p.kind is p.VAR_POSITIONAL for p in params[:fixed + 1]):
        return (), ()
    rest = [p for p in params[fixed:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return tuple(p.name for p in rest), tuple(p.name for p in rest if p.default is p.empty)


class CustomCollective(Collective):
    """A collective stated by the user.

    ``input_chunks``/``output_chunks``: an int or ``f(n, k) -> int``.
    ``postcondition(rank, index, n, k)``: the labels ``(origin_rank,
    origin_index)`` output chunk ``index`` of ``rank`` must hold (a label
    twice means it must be reduced in twice), or None for "anything".
    ``precondition(rank, index, n, k)``: the label input chunk ``index`` of
    ``rank`` starts with, or None for "starts empty"; default ``(rank, index)``.

    Each of these functions may also name parameters of the algorithm it
    is traced with after those (``postcondition(rank, index, n, k,
    gpus_per_node)``): ``msc.trace`` gives them the algorithm's values
    (``with_params``), so a node size need not be written in twice.

    Example, each rank sends its input to the next rank (pipeline parallelism)::

        send_next = msc.CustomCollective(
            "send_next", input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,
            postcondition=lambda r, i, n, k: [((r - 1) % n, i)])
    """

    def __init__(
        self,
        name: str,
        *,
        input_chunks: int | Callable[[int, int], int],
        output_chunks: int | Callable[[int, int], int],
        postcondition: Callable[[int, int, int, int], Iterable[Label] | None],
        precondition: Callable[[int, int, int, int], Label | None] | None = None,
    ):
        self.name = name
        self._given = {"input_chunks": input_chunks, "output_chunks": output_chunks,
                       "postcondition": postcondition, "precondition": precondition}
        self.base: CustomCollective | None = None          # the definition this one binds parameters of
        self._input = self._unbound("input_chunks", 2)
        self._output = self._unbound("output_chunks", 2)
        self._post = self._unbound("postcondition", 4)
        self._pre = self._unbound("precondition", 4)
        self._cache: dict[tuple, Expected] = {}

    _FIXED = {"input_chunks": 2, "output_chunks": 2, "postcondition": 4, "precondition": 4}

    @property
    def param_names(self) -> tuple[str, ...]:
        """The algorithm parameters its functions ask for."""
        return tuple(sorted({name for what, fn in self._given.items()
                             for name in _extra_params(fn, self._FIXED[what])[0]}))

    def _unbound(self, what: str, fixed: int):
        """The function as given, or, where it requires algorithm parameters,
        one that says they were not bound (asked outside ``msc.trace``)."""
        fn = self._given[what]
        required = _extra_params(fn, fixed)[1]
        if not required:
            return fn

        def unbound(*args):
            raise UsageError(f"collective {self.name!r}: {what} takes the algorithm parameter(s) "
                             f"{', '.join(required)}, which only an algorithm gives: trace it (msc.trace, msc "
                             f"compile), or bind them with {self.name}.with_params({required[0]}=...); a plan "
                             f"compiled from it states its requirements itself")
        return unbound

    def with_params(self, params: dict | None = None, **more) -> CustomCollective:
        """This collective with the algorithm parameters its functions ask
        for fixed to ``params`` (those they do not give keep their defaults);
        itself when none asks for any. Missing required ones are refused by
        name."""
        params = {**(params or {}), **more}
        asked = {what: _extra_params(fn, self._FIXED[what]) for what, fn in self._given.items()}
        if not any(names for names, _ in asked.values()):
            return self
        bound = {}
        for what, fn in self._given.items():
            names, required = asked[what]
            missing = [x for x in required if x not in params]
            if missing:
                known = ", ".join(sorted(params)) or "none"
                raise UsageError(f"collective {self.name!r}: {what} takes the parameter(s) {', '.join(missing)}, which "
                                 f"the algorithm does not have (its parameters: {known})")
            given = {x: params[x] for x in names if x in params}
            bound[what] = (lambda fn=fn, given=given: lambda *args: fn(*args, **given))() if names else fn
        copy = CustomCollective(self.name, **bound)
        copy.base = self
        return copy

    @staticmethod
    def _size(spec, n, k) -> int:
        return spec(n, k) if callable(spec) else spec

    def input_chunks(self, n, k):
        return self._size(self._input, n, k)

    def output_chunks(self, n, k):
        return self._size(self._output, n, k)

    @property
    def labels_are_positions(self) -> bool:
        return self._pre is None

    def precondition(self, rank, index, n, k, root):
        if self._pre is None:
            return (rank, index)
        label = self._pre(rank, index, n, k)
        return None if label is None else _as_label(label, f"precondition({rank}, {index})")

    def postcondition(self, rank, index, n, k, root):
        labels = self._post(rank, index, n, k)
        if labels is None:
            return None
        key = tuple(sorted(_as_label(x, f"postcondition({rank}, {index})") for x in labels))
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = Expected(key)
        return found


def replicated(collective: CustomCollective, instances: int) -> CustomCollective:
    """``collective`` as a plan of ``instances`` interleaved copies computes
    it (msc.lower.dag.replicate: chunk i of copy j is chunk i*instances + j):
    at chunk factor k*instances, buffers ``instances`` times as large, and
    output chunk x holds what chunk x // instances held, each label's chunk
    in copy x % instances. Sizes written as ints scale so too."""
    m = instances
    base = collective

    def post(r, x, n, k):
        labels = base._post(r, x // m, n, k // m)
        return None if labels is None else [(o, c * m + x % m) for o, c in labels]

    def pre(r, x, n, k):
        label = base._pre(r, x // m, n, k // m)
        return None if label is None else (label[0], label[1] * m + x % m)

    return CustomCollective(base.name, input_chunks=lambda n, k: base.input_chunks(n, k // m) * m,
                            output_chunks=lambda n, k: base.output_chunks(n, k // m) * m, postcondition=post,
                            precondition=None if base._pre is None else pre)


class StatedCollective(CustomCollective):
    """A custom collective read back from a plan's Contract (msc.ir): the
    tables hold its pre- and postcondition for that plan's rank count and
    chunk factor only, and asking for another is a UsageError."""

    def __init__(self, name: str, n: int, k: int, input_chunks: int, output_chunks: int, contract):
        self.n, self.k, self.contract = n, k, contract
        pre = None if contract.pre is None else (lambda r, i, n_, k_: self._at(n_, k_) or contract.pre[r][i])
        super().__init__(name, input_chunks=self._sized(input_chunks), output_chunks=self._sized(output_chunks),
                         postcondition=lambda r, i, n_, k_: self._at(n_, k_) or contract.post[r][i],
                         precondition=pre)

    def _sized(self, chunks: int):
        return lambda n, k: self._at(n, k) or chunks

    def _at(self, n: int, k: int) -> None:
        if (n, k) != (self.n, self.k):
            raise UsageError(f"collective {self.name!r} is known from a plan for {self.n} ranks and chunk factor "
                             f"{self.k} only, not {n} ranks and chunk factor {k}: pass its CustomCollective "
                             f"definition (--collective FILE.py:NAME)")


def contract_of(collective: Collective, n: int, k: int, root: int = 0):
    """``collective``'s requirements at ``n`` ranks and chunk factor ``k`` as
    an msc.ir.Contract (what a plan of a custom collective carries)."""
    from msc.ir import Contract

    post = tuple(tuple(None if e is None else tuple(sorted(lab for lab, c in e.counts.items() for _ in range(c)))
                       for e in collective.postconditions(r, n, k, root)) for r in range(n))
    pre = None
    if not collective.labels_are_positions:
        pre = tuple(tuple(collective.precondition(r, i, n, k, root) for i in range(collective.input_chunks(n, k)))
                    for r in range(n))
    return Contract(post=post, pre=pre)


def _as_label(value, context: str) -> Label:
    try:
        rank, index = value
        return (int(rank), int(index))
    except (TypeError, ValueError):
        raise UsageError(f"{context} must give (origin_rank, origin_index) pairs, got {value!r}") from None


# -- the registry of built-in collectives ----------------------------------------
@dataclass(frozen=True)
class Arrays:
    """What a collective's reference needs of the per-rank inputs (1-D
    arrays of numpy or torch): the library's stack, cat and the reduction over
    axis 0 (in the reference's or the baseline's precision)."""

    xs: list
    root: int
    stack: Callable
    cat: Callable
    reduce: Callable

    @property
    def n(self) -> int:
        return len(self.xs)

    def units(self):
        """The inputs as [source rank, unit, element]: n equal units each."""
        for rank, x in enumerate(self.xs):
            if len(x) % self.n:
                raise UsageError(f"rank {rank}: input of {len(x)} elements is not {self.n} equal units")
        return self.stack(self.xs).reshape(self.n, self.n, -1)


@dataclass(frozen=True)
class TorchCall:
    """How torch.distributed's call of a collective names msc's buffers:
    msc.torch's call (msc.torch.calls), the msc backend's methods
    (msc.torch.process_group) and the torch test cases are derived from it.

    ``args``: the call's tensor arguments in order, each with the msc buffer
    it is; a call with one tensor ("tensor": "input") is in place.
    ``listed``: its list form's argument and the buffer that list of n equal
    tensors stands for ("gather_list": the output); ``at_root``: that list is
    given on the root only (elsewhere msc gives the plan a buffer of its
    own). ``method``/``list_method``: the c10d ProcessGroup methods of the
    tensor and list forms the msc backend serves, ``options`` their options
    class (torch.distributed's).
    """

    function: str                           # torch.distributed's function: "all_gather_into_tensor"
    call: str                               # msc.torch's, same arguments after ``plans``: "all_gather"
    args: tuple[tuple[str, str], ...]       # (argument, msc buffer) of its tensors, in order
    options: str                            # c10d's options class: "AllgatherOptions"
    root: str | None = None                 # the root argument: "src", "dst"
    listed: tuple[str, str] | None = None   # (argument, msc buffer) of the list form ("both": alltoall's)
    at_root: bool = False                   # the list is given on the root only
    method: str | None = None               # c10d's method of the tensor form: "_allgather_base"
    list_method: str | None = None          # c10d's method of the list form: "allgather"
    splits: bool = False                    # takes split sizes (all_to_all_single: msc.torch.uneven)


@dataclass(frozen=True)
class CollectiveSpec:
    """A built-in collective: every fact of it a module needs. Units per rank
    of its buffers are its Collective's chunks at chunk factor 1."""

    cls: type[Collective]                   # its pre- and postcondition (and name, has_root)
    reduces: bool                           # combines values: takes a reduce op, tolerances, reducing kernels
    busbw: Callable[[int], float]           # nccl-tests' bus-bandwidth factor at n ranks (doc/PERFORMANCE.md)
    demand: Callable[[int, int, bool], float]   # bytes per byte of size that must cross into a side of k of n
    #                                         ranks (root inside it?): msc.sim.cut_bound
    latency: int | None                     # the path latency bounding it (msc.sim.cut_bound's CutModel.latency:
    #                                         0 any pair, 1 from the root, 2 to the root); None: neighbours only
    reference: Callable[[Arrays], list]     # per rank, the output from the inputs (None: unspecified)
    msccl: bool = True                      # MSCCL XML has it (coll=); else exported as coll="custom" + contract
    msccl_multipliers: Callable[[int], tuple[int, int]] = lambda n: (1, 1)   # at n ranks, what the MSCCL
    #                                         runtimes multiply i_chunks and o_chunks by to get nchunksperloop
    torch: TorchCall | None = None          # torch.distributed's call, None: torch has none
    nccl: bool = True                       # msc simulate --nccl models what NCCL runs for it
    synthesizes: bool = True                # msc synthesize makes it
    baseline: str | None = None             # the library algorithm msc tune compares with ("vs ring")
    relabels: bool = True                   # rooted: a plan of one root serves every root, its ranks renamed
    #                                         (msc.lower.relabel.for_root); not where a unit's place names its rank
    partition_demand: Callable[[int], float] | None = None   # bytes per byte crossing a partition into p parts

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def has_root(self) -> bool:
        return self.cls.has_root

    def units(self, n: int) -> tuple[int, int]:
        """Data units per rank of the (input, output) at n ranks."""
        c = self.cls()
        return c.input_chunks(n, 1), c.output_chunks(n, 1)


def _everyone(a: Arrays, out) -> list:
    return [out for _ in range(a.n)]


def _unit_of_each(a: Arrays, combine) -> list:
    """Rank r's output: ``combine`` of unit r of every rank's input ([source rank, element])."""
    units = a.units()
    return [combine(units[:, r]) for r in range(a.n)]


_ONE = (("tensor", "input"),)                           # one tensor, in place
_PAIR = (("output", "output"), ("input", "input"))

COLLECTIVES: dict[str, CollectiveSpec] = {s.name: s for s in (
    CollectiveSpec(AllReduce, reduces=True, busbw=lambda n: 2 * (n - 1) / n, demand=lambda n, k, root_in: 1.0,
                   latency=0, reference=lambda a: _everyone(a, a.reduce(a.stack(a.xs))),
                   torch=TorchCall("all_reduce", "all_reduce", _ONE, "AllreduceOptions", method="allreduce"),
                   baseline="allreduce/ring", partition_demand=lambda parts: 2.0 * (parts - 1)),
    CollectiveSpec(AllGather, reduces=False, busbw=lambda n: (n - 1) / n, demand=lambda n, k, root_in: (n - k) / n,
                   latency=0, reference=lambda a: _everyone(a, a.cat(a.xs)), msccl_multipliers=lambda n: (n, 1),
                   torch=TorchCall("all_gather_into_tensor", "all_gather",
                                   (("output_tensor", "output"), ("input_tensor", "input")), "AllgatherOptions",
                                   listed=("tensor_list", "output"), method="_allgather_base", list_method="allgather"),
                   baseline="allgather/ring"),
    CollectiveSpec(ReduceScatter, reduces=True, busbw=lambda n: (n - 1) / n, demand=lambda n, k, root_in: k / n,
                   latency=0, reference=lambda a: _unit_of_each(a, a.reduce), msccl_multipliers=lambda n: (1, n),
                   torch=TorchCall("reduce_scatter_tensor", "reduce_scatter", _PAIR, "ReduceScatterOptions",
                                   listed=("input_list", "input"), method="_reduce_scatter_base",
                                   list_method="reduce_scatter"),
                   baseline="reducescatter/ring"),
    CollectiveSpec(AllToAll, reduces=False, busbw=lambda n: (n - 1) / n,
                   demand=lambda n, k, root_in: k * (n - k) / n, latency=0,
                   reference=lambda a: _unit_of_each(a, lambda u: u.reshape(-1)),
                   torch=TorchCall("all_to_all_single", "all_to_all", _PAIR, "AllToAllOptions",
                                   listed=("tensors", "both"), method="alltoall_base", list_method="alltoall",
                                   splits=True)),
    CollectiveSpec(Broadcast, reduces=False, busbw=lambda n: 1.0, demand=lambda n, k, root_in: 0.0 if root_in else 1.0,
                   latency=1, reference=lambda a: _everyone(a, a.xs[a.root]),
                   torch=TorchCall("broadcast", "broadcast", _ONE, "BroadcastOptions", root="src", method="broadcast"),
                   baseline="broadcast/chain"),
    CollectiveSpec(Reduce, reduces=True, busbw=lambda n: 1.0, demand=lambda n, k, root_in: 1.0 if root_in else 0.0,
                   latency=2, reference=lambda a: [a.reduce(a.stack(a.xs)) if r == a.root else None
                                                   for r in range(a.n)],
                   torch=TorchCall("reduce", "reduce", _ONE, "ReduceOptions", root="dst", method="reduce"),
                   baseline="reduce/ring"),
    # nccl-tests' gather and scatter (src/gather.cu, scatter.cu: busbw factor (n-1)/n of a size of n units);
    # MSCCL, NCCL's cost model and the synthesizer have neither: exported as coll="custom" with the contract
    CollectiveSpec(Gather, reduces=False, busbw=lambda n: (n - 1) / n,
                   demand=lambda n, k, root_in: (n - k) / n if root_in else 0.0, latency=2,
                   reference=lambda a: [a.cat(a.xs) if r == a.root else None for r in range(a.n)],
                   torch=TorchCall("gather", "gather", _ONE, "GatherOptions", root="dst",
                                   listed=("gather_list", "output"), at_root=True, list_method="gather"),
                   msccl=False, nccl=False, synthesizes=False, baseline="gather/direct", relabels=False),
    CollectiveSpec(Scatter, reduces=False, busbw=lambda n: (n - 1) / n,
                   demand=lambda n, k, root_in: 0.0 if root_in else k / n, latency=1,
                   reference=lambda a: [a.xs[a.root].reshape(a.n, -1)[r] for r in range(a.n)],
                   torch=TorchCall("scatter", "scatter", (("tensor", "output"),), "ScatterOptions", root="src",
                                   listed=("scatter_list", "input"), at_root=True, list_method="scatter"),
                   msccl=False, nccl=False, synthesizes=False, baseline="scatter/direct", relabels=False),
    # nccl-tests' sendrecv (NVIDIA/nccl-tests src/sendrecv.cu: r sends to r+1, busbw factor 1); a side of
    # 1..n-1 ranks has a rank whose predecessor is outside it
    CollectiveSpec(SendRecv, reduces=False, busbw=lambda n: 1.0, demand=lambda n, k, root_in: 1.0 if 0 < k < n else 0.0,
                   latency=None, reference=lambda a: [a.xs[(r - 1) % a.n] for r in range(a.n)], msccl=False,
                   synthesizes=False, baseline="sendrecv/ring"),
)}
COLLECTIVE_NAMES = tuple(COLLECTIVES)
ROOTED = tuple(name for name, s in COLLECTIVES.items() if s.has_root)
REDUCING = tuple(name for name, s in COLLECTIVES.items() if s.reduces)
BUILTIN: dict[str, type[Collective]] = {name: s.cls for name, s in COLLECTIVES.items()}
BUSBW_FACTOR = {name: s.busbw for name, s in COLLECTIVES.items()}   # n -> busbw / algbw (nccl-tests)


def collective_key(spec) -> str:
    """A collective name as msc spells it: "all_reduce", "AllReduce", "all-reduce" -> "allreduce"."""
    return str(spec).lower().replace("_", "").replace("-", "")


def collective_spec(spec, refusal: str = "unknown collective") -> CollectiveSpec:
    """The registry row ``spec`` names (any spelling collective_key takes);
    ``refusal``: the error's first words for another name."""
    key = collective_key(spec)
    if key not in COLLECTIVES:
        raise UsageError(f"{refusal} {spec!r}: expected one of {', '.join(COLLECTIVE_NAMES)}"
                         + did_you_mean(key, COLLECTIVE_NAMES))
    return COLLECTIVES[key]


def get_collective(spec: str | Collective) -> Collective:
    if isinstance(spec, Collective):
        return spec
    key = collective_key(spec)
    if key not in BUILTIN:
        raise UsageError(f"unknown collective {spec!r}; expected one of {', '.join(BUILTIN)} or a Collective object"
                         + did_you_mean(key, BUILTIN))
    return BUILTIN[key]()


@dataclass(frozen=True)
class Layout:
    """A collective bound to a rank count, chunk factor, in-place flag and
    root: the physical buffers of every rank and how logical buffers map to
    them."""

    collective: Collective
    num_ranks: int
    chunk_factor: int
    inplace: bool
    root: int = 0
    _aliases: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.collective.name

    @cached_property
    def logical_sizes(self) -> dict[str, int]:
        n, k = self.num_ranks, self.chunk_factor
        return {"input": self.collective.input_chunks(n, k), "output": self.collective.output_chunks(n, k)}

    @cached_property
    def physical_sizes(self) -> dict[str, int]:
        """Chunks per rank of each physical buffer (same on every rank)."""
        sizes = dict(self.logical_sizes)
        if self.inplace:
            alias, target, _ = self.collective.inplace_alias(0, self.num_ranks, self.chunk_factor)
            del sizes[alias]
        return sizes

    def validate(self) -> None:
        """Ranks and chunks within msc's limits, buffer sizes are counts, and an
        in-place alias fits in its target on every rank."""
        from msc.ir.limits import MAX_BUFFER_CHUNKS, MAX_CHUNK_FACTOR, MAX_RANKS, MAX_TOTAL_CHUNKS, check

        check(self.num_ranks, MAX_RANKS, f"{self.name}: the number of ranks")
        check(self.chunk_factor, MAX_CHUNK_FACTOR, f"{self.name}: chunk_factor")
        for name, size in self.logical_sizes.items():
            if type(size) is not int or size < 0:
                raise UsageError(f"{self.name}: {name} size must be an int >= 0 chunks, got {size!r}")
            check(size, MAX_BUFFER_CHUNKS, f"{self.name}: the {name} buffer's chunks")
        check(self.num_ranks * sum(self.physical_sizes.values()), MAX_TOTAL_CHUNKS,
              f"{self.name}: the chunks of the input and output buffers of all {self.num_ranks} ranks")
        if not self.inplace:
            return
        n, k = self.num_ranks, self.chunk_factor
        for rank in range(n):
            alias, target, offset = self.collective.inplace_alias(rank, n, k)
            need, have = self.logical_sizes[alias], self.logical_sizes[target]
            if offset < 0 or offset + need > have:
                raise UsageError(
                    f"in-place {self.name}: {alias} ({need} chunks) does not fit in {target} ({have} chunks) "
                    f"at chunk {offset} on rank {rank}; use inplace=False")

    @cached_property
    def alias_table(self) -> tuple[str, str, tuple[int, ...]] | None:
        """In-place form: (aliased logical buffer, target buffer, offset per rank)."""
        if not self.inplace:
            return None
        n, k = self.num_ranks, self.chunk_factor
        alias, target, _ = self.collective.inplace_alias(0, n, k)
        return alias, target, tuple(self.collective.inplace_alias(r, n, k)[2] for r in range(n))

    def alias(self, rank: int, buffer: str) -> tuple[str, int]:
        """Physical buffer and chunk offset of logical ``buffer`` on ``rank``."""
        if not self.inplace or buffer not in ("input", "output"):
            return buffer, 0
        key = (rank, buffer)
        hit = self._aliases.get(key)
        if hit is None:
            alias, target, offset = self.collective.inplace_alias(rank, self.num_ranks, self.chunk_factor)
            hit = (target, offset) if buffer == alias else (buffer, 0)
            self._aliases[key] = hit
        return hit

    def initial(self, rank: int) -> Iterable[tuple[str, int, Label]]:
        """(physical buffer, index, label) for every input chunk that starts full."""
        n, k = self.num_ranks, self.chunk_factor
        pre = self.collective.precondition
        buf, off = self.alias(rank, "input")
        for i in range(self.logical_sizes["input"]):
            label = pre(rank, i, n, k, self.root)
            if label is not None:
                yield buf, off + i, label

    def initial_labels(self, rank: int) -> tuple[str, int, list]:
        """initial() in bulk: (physical buffer, offset, label or None per logical input chunk)."""
        n, k, root, pre = self.num_ranks, self.chunk_factor, self.root, self.collective.precondition
        buf, off = self.alias(rank, "input")
        return buf, off, [pre(rank, i, n, k, root) for i in range(self.logical_sizes["input"])]

    def expected_list(self, rank: int) -> tuple[str, int, list]:
        """expected() in bulk: (physical buffer, offset, Expected or None per logical output chunk)."""
        buf, off, row = self.expected_row(rank)
        return buf, off, list(row)

    def expected_row(self, rank: int) -> tuple[str, int, tuple]:
        """expected_list() as a tuple, the same object for ranks whose
        expectations are the same where the collective shares them (built-ins
        do): a bulk reader can then read each distinct row once."""
        buf, off = self.alias(rank, "output")
        row = self.collective.postconditions(rank, self.num_ranks, self.chunk_factor, self.root)
        if len(row) != self.logical_sizes["output"]:
            raise UsageError(f"{self.name}: postconditions({rank}) gave {len(row)} expectations for "
                             f"{self.logical_sizes['output']} output chunks")
        return buf, off, row

    def expected(self, rank: int) -> Iterable[tuple[int, str, int, Expected | None]]:
        """(logical index, physical buffer, physical index, expectation) per output chunk."""
        n, k = self.num_ranks, self.chunk_factor
        post = self.collective.postcondition
        buf, off = self.alias(rank, "output")
        for i in range(self.logical_sizes["output"]):
            yield i, buf, off + i, post(rank, i, n, k, self.root)
