"""All-to-all with uneven splits (MoE's dispatch and combine) on an alltoall plan.

``all_to_all_single(output, input, output_split_sizes, input_split_sizes)``
sends rows ``input_split_sizes[d]`` of dim 0 to rank d and receives
``output_split_sizes[s]`` rows from rank s: the split sizes are per call and
per rank. An msc alltoall plan moves equal units, so the call runs the plan
on *padded* units: every pair's piece is padded to ``pad`` rows, the most
any rank sends any other in this call, packed into a buffer of n units of
``pad`` rows, moved by the plan (verified as any alltoall plan: unit j of
rank r ends as unit r of rank j's output), and unpacked. The pieces past
each split's end are moved but never read. Padding suits both engines: the
plan and its kernel stay the even alltoall's (the CUDA runtime takes the
count at launch), at the price of moving ``n * pad`` rows per rank where
the exact call moves the rows it has (``msc simulate --splits`` prices it
against the even call).

What every rank must know to agree on ``pad``: the whole matrix of splits,
of which each rank holds a row (what it sends) and a column (what it
receives). The ranks exchange them first (``exchange``): through the
agreement's store (msc.torch.agree ``Gate.share``: one store round trip, the
same deadline and failure reports as every call's agreement), or, with the
agreement off, one all_gather of 2n ints on the group. Every rank then holds
the same matrix and makes the same decisions: the splits must match
(rank s's ``input_split_sizes[d]`` is rank d's ``output_split_sizes[s]``,
else ``SplitMismatchError`` on every rank before any data moves, where
gloo reads past its buffers), ``pad`` (0: nothing to move), and the plan
that covers ``n * pad`` rows.

Splits that are all ``pad`` (an even call given its split sizes) skip the
packing: the tensors already are the padded units.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from msc.errors import UsageError
from msc.torch import agree


class SplitMismatchError(UsageError):
    """The ranks' split sizes do not pair up: rank s sends rank d a number
    of rows that rank d does not expect from s (``pairs``: (s, d, sent,
    expected))."""

    def __init__(self, message: str, pairs: list[tuple[int, int, int, int]]):
        self.pairs = pairs
        super().__init__(message)


@dataclass(frozen=True)
class Splits:
    """One call's splits, the same on every rank after ``exchange``:
    ``sends[s][d]`` rows from rank s to rank d; ``pad``: the largest;
    ``row``: elements per row; this rank's ``input_splits`` and
    ``output_splits``."""

    sends: tuple[tuple[int, ...], ...]
    row: int
    rank: int

    @property
    def n(self) -> int:
        return len(self.sends)

    @property
    def pad(self) -> int:
        return max((max(r) for r in self.sends), default=0)

    @property
    def input_splits(self) -> tuple[int, ...]:
        return self.sends[self.rank]

    @property
    def output_splits(self) -> tuple[int, ...]:
        return tuple(row[self.rank] for row in self.sends)

    def padded_numel(self) -> int:
        """Elements of the padded input (and output) of every rank."""
        return self.n * self.pad * self.row


def _local(splits, tensor, n: int, what: str) -> list[int]:
    """Checked split sizes of one side of the call (None or []: even)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if not splits:
        if rows % n:
            raise UsageError(f"all_to_all_single: {what} of {rows} rows is not {n} equal splits; give its split sizes")
        return [rows // n] * n
    splits = [int(x) for x in splits]
    if len(splits) != n or min(splits) < 0 or sum(splits) != rows:
        raise UsageError(f"all_to_all_single: {what} split sizes {splits} are not {n} sizes >= 0 adding up to its "
                         f"{rows} rows (dim 0)")
    return splits


def _row(tensor) -> int:
    """Elements per row (of dim 0)."""
    return math.prod(tensor.shape[1:])


def exchange(group, rank: int, n: int, output, input, output_splits, input_splits) -> Splits:
    """Every rank's splits, checked (see the module doc). A local mistake
    (sizes that do not add up) is published to the other ranks, which raise
    PeerFailedError at once."""
    gate = agree.gate(group, rank, n)
    try:
        if input.dtype != output.dtype or input.device != output.device:
            raise UsageError(f"all_to_all_single: input and output differ in dtype or device ({input.dtype} on "
                             f"{input.device}, {output.dtype} on {output.device})")
        row = _row(input)
        if _row(output) != row:
            raise UsageError(f"all_to_all_single: input rows of {row} elements, output rows of {_row(output)}: the "
                             f"dims after the first must be the same")
        mine_in = _local(input_splits, input, n, "input")
        mine_out = _local(output_splits, output, n, "output")
    except Exception as exc:
        if gate is not None and gate.base is not None:
            gate.fail(exc)
        raise
    record = {"dtype": str(input.dtype).removeprefix("torch."), "row": row, "in": mine_in, "out": mine_out}
    if gate is not None and gate.base is not None:
        records = [json.loads(r) for r in gate.share(json.dumps(record).encode(), "all_to_all_single with splits")]
    else:
        records = _all_gather(group, n, record, input.device)
    return _checked(records, rank)


def _all_gather(group, n: int, record: dict, device) -> list[dict]:
    """The records through one all_gather of (row, in..., out...) int64s on the group (no store)."""
    import torch.distributed as dist

    mine = torch.tensor([record["row"], *record["in"], *record["out"]], dtype=torch.int64, device=device)
    every = torch.empty(n * (2 * n + 1), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    rows = every.view(n, 2 * n + 1).tolist()
    return [{"dtype": record["dtype"], "row": r[0], "in": r[1:n + 1], "out": r[n + 1:]} for r in rows]


def _checked(records: list[dict], rank: int) -> Splits:
    """The matrix, when every rank's sends are what their peers expect (the same verdict on every rank)."""
    n = len(records)
    for what in ("dtype", "row"):
        values = [r[what] for r in records]
        if len(set(values)) > 1:
            listing = ", ".join(f"rank {s} {v}" for s, v in enumerate(values))
            raise UsageError(f"all_to_all_single with splits: the ranks' tensors differ in "
                             f"{'dtype' if what == 'dtype' else 'elements per row'}: {listing}")
    wrong = [(s, d, records[s]["in"][d], records[d]["out"][s]) for s in range(n) for d in range(n)
             if records[s]["in"][d] != records[d]["out"][s]]
    if wrong:
        shown = "; ".join(f"rank {s} sends {a} rows to rank {d}, which expects {b}" for s, d, a, b in wrong[:4])
        more = f" (and {len(wrong) - 4} more pairs)" if len(wrong) > 4 else ""
        raise SplitMismatchError(f"all_to_all_single: the ranks' split sizes do not pair up: {shown}{more}; rank s's "
                                 f"input_split_sizes[d] must be rank d's output_split_sizes[s] (nothing was sent)",
                                 wrong)
    return Splits(tuple(tuple(r["in"]) for r in records), records[0]["row"], rank)


def padded(splits: Splits, tensor, sizes) -> tuple[torch.Tensor, bool]:
    """``tensor``'s rows as ``splits.n`` units of ``pad`` rows (piece i at
    unit i, the rest of the unit unspecified): the tensor itself, flat, where
    every size is ``pad``; a new buffer otherwise (second: whether it is new)."""
    flat = tensor.reshape(-1)
    if all(x == splits.pad for x in sizes):
        return flat, False
    unit = splits.pad * splits.row
    out = torch.empty(splits.padded_numel(), dtype=tensor.dtype, device=tensor.device)
    at = 0
    for i, rows in enumerate(sizes):
        take = rows * splits.row
        out[i * unit:i * unit + take].copy_(flat[at:at + take])
        at += take
    return out, True


def unpad(splits: Splits, units: torch.Tensor, output) -> None:
    """The received pieces (unit s of ``units``: rank s's, ``output_splits[s]`` rows) into ``output``, in order."""
    unit = splits.pad * splits.row
    flat = output.view(-1)
    at = 0
    for s, rows in enumerate(splits.output_splits):
        take = rows * splits.row
        flat[at:at + take].copy_(units[s * unit:s * unit + take])
        at += take


def run_padded(splits: Splits, run, output, input) -> torch.Tensor:
    """Move the call's pieces on padded units: ``run(send, recv)`` runs the
    alltoall plan from the padded input into the padded output (the
    caller's engine: msc.torch.calls or the process group); ``output``
    (contiguous) gets every rank's piece in rank order."""
    send, _ = padded(splits, input, splits.input_splits)
    recv_direct = all(x == splits.pad for x in splits.output_splits)
    recv = output.view(-1) if recv_direct else torch.empty_like(send)
    run(send, recv)
    if not recv_direct:
        unpad(splits, recv, output)
    return output
