"""A plan's contract (msc.ir.Contract) as text, and back.

    contract
      post 0: *
      post 1: 0.0 0.1          output chunk 0 of rank 1 holds input 0 of rank 0, ...
      post 2: 0.0+1.0 -        a sum of two inputs; "-": must hold nothing
      pre 0: 0.0 -             only when some input does not start as its own position

Both plan readers (the grammar and the fast line reader) hand the rows to
``build_contract``, so they agree on what a row means and on its errors.
"""
from __future__ import annotations

import re

from msc.errors import PlanError
from msc.ir import Contract

LABEL = re.compile(r"([0-9]+)\.([0-9]+)\Z")


def contract_lines(contract: Contract) -> list[str]:
    out = ["contract"]
    for r, row in enumerate(contract.post):
        out.append(f"  post {r}:" + "".join(" " + _post_item(x) for x in row))
    if contract.pre is not None:
        for r, row in enumerate(contract.pre):
            out.append(f"  pre {r}:" + "".join(" " + ("-" if x is None else _label(x)) for x in row))
    return out


def _label(label) -> str:
    return f"{label[0]}.{label[1]}"


def _post_item(labels) -> str:
    if labels is None:
        return "*"
    return "+".join(_label(x) for x in labels) if labels else "-"


def build_contract(rows: list[tuple[str, int, list[str], int]], path: str | None = None) -> Contract:
    """The Contract from (kind "post"/"pre", rank, items, line) rows: one
    "post" row per rank 0..n-1 in order, and "pre" rows likewise or none."""
    post, pre = [], []
    for kind, rank, items, line in rows:
        table = post if kind == "post" else pre
        if rank != len(table):
            want = f"rank {len(table)}" if rank > len(table) else "each rank once"
            raise PlanError(f"contract: {kind} row of rank {rank} where {want} comes next", line=line, path=path)
        table.append(tuple(_item(kind, x, line, path) for x in items))
    if pre and len(pre) != len(post):
        raise PlanError(f"contract: {len(post)} post rows but {len(pre)} pre rows (give pre for every rank or none)",
                        path=path, line=rows[-1][3] if rows else None)
    return Contract(post=tuple(post), pre=tuple(pre) if pre else None)


def _item(kind: str, text: str, line: int, path):
    if text == "-":
        return () if kind == "post" else None
    if text == "*" and kind == "post":
        return None
    labels = []
    for part in (text.split("+") if kind == "post" else [text]):
        m = LABEL.match(part)
        if m is None:
            raise PlanError(f"contract: {kind} item {text[:40]!r} is not "
                            f"{'labels RANK.INDEX joined by +, * or -' if kind == 'post' else 'a label RANK.INDEX or -'}",
                            line=line, path=path)
        labels.append((int(m[1]), int(m[2])))
    return tuple(sorted(labels)) if kind == "post" else labels[0]


def check_contract(contract: Contract, n: int, input_chunks: int, output_chunks: int) -> None:
    """PlanError for a contract that does not fit its plan: a row per rank,
    an item per chunk, labels naming ranks and input chunks that exist."""
    for kind, table, size in (("post", contract.post, output_chunks), ("pre", contract.pre, input_chunks)):
        if table is None:
            continue
        if len(table) != n:
            raise PlanError(f"contract: {len(table)} {kind} rows for {n} ranks")
        for r, row in enumerate(table):
            if len(row) != size:
                raise PlanError(f"contract: {kind} row of rank {r} has {len(row)} items for {size} "
                                f"{'output' if kind == 'post' else 'input'} chunks")
            for i, item in enumerate(row):
                labels = (item or ()) if kind == "post" else ([] if item is None else [item])
                for origin, index in labels:
                    if not (0 <= origin < n and 0 <= index < input_chunks):
                        raise PlanError(f"contract: {kind} of rank {r} chunk {i} names input {index} of rank "
                                        f"{origin}; ranks are 0..{n - 1} and input chunks 0..{input_chunks - 1}")
