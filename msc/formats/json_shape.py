"""A JSON text's shape, measured before it is parsed: how long its longest
array or object is, how many it has and how deep they nest.

json.loads makes every value a Python object, about 20 times the text's
bytes, before a reader can count anything; a plan over a limit (six million
operations in one threadblock) would cost gigabytes and minutes to refuse.
This pass reads the bytes in blocks with numpy: quotes not escaped (an even
run of backslashes before them) start and end strings; outside strings,
brackets and braces open and close containers and commas separate items,
each comma counted to its innermost open container. Memory is a few times
a block; a text that is not JSON is left to json.loads to describe.
"""
from __future__ import annotations

import re

import numpy as np

BLOCK = 1 << 20                 # bytes measured at a time (the pass holds some tens of bytes per byte of one)
QUOTE, BACKSLASH, COMMA = 34, 92, 44
OPENS, CLOSES = (91, 123), (93, 125)        # [ {   ] }


class ShapeError(ValueError):
    """A container over a limit: ``what`` says which limit, ``offset`` where it opens."""

    def __init__(self, what: str, offset: int):
        super().__init__(what)
        self.what, self.offset = what, offset


def check_shape(data: bytes, *, max_items: int, max_containers: int, max_depth: int) -> None:
    """ShapeError for the first array or object with over ``max_items``
    items, past ``max_containers`` of them in all, or nested deeper than
    ``max_depth``."""
    state = _State()
    for start in range(0, len(data), BLOCK):
        block = np.frombuffer(data, np.uint8, count=min(BLOCK, len(data) - start), offset=start)
        if not state.measure(block, start, max_items, max_containers, max_depth):
            return                            # not JSON: json.loads says where


class _State:
    """What one block hands the next: inside a string or not, the backslashes
    it ended with, and the open containers (where each opened, its commas)."""

    def __init__(self):
        self.in_string = 0
        self.backslashes = 0
        self.opened: list[int] = []           # byte offset of each open container, outermost first
        self.commas: list[int] = []
        self.containers = 0

    def measure(self, a: np.ndarray, start: int, max_items: int, max_containers: int, max_depth: int) -> bool:
        tokens, kinds = self._structure(a)
        delta = np.where(kinds == 1, 1, np.where(kinds == -1, -1, 0))
        depth_after = len(self.opened) + np.cumsum(delta)
        if len(depth_after) and depth_after.min() < 0:
            return False
        if len(depth_after) and depth_after.max() > max_depth:
            at = int(tokens[np.argmax(depth_after > max_depth)])
            raise ShapeError(f"nested over {max_depth} deep", start + at)
        opens = np.flatnonzero(kinds == 1)
        self.containers += len(opens)
        if self.containers > max_containers:
            at = int(tokens[opens[len(opens) - (self.containers - max_containers)]])
            raise ShapeError(f"over {max_containers} arrays and objects in all", start + at)
        # each comma's container: the last one opened at its depth in this block, else one still open from before
        commas = np.flatnonzero(kinds == 0)
        level, open_level = depth_after[commas], depth_after[opens]
        width = len(kinds) + 1
        order = np.argsort(open_level * width + opens, kind="stable")
        keys = (open_level * width + opens)[order]
        j = np.searchsorted(keys, level * width + commas) - 1
        mine = (j >= 0) & (open_level[order][np.maximum(j, 0)] == level) if len(opens) else np.zeros(len(j), bool)
        counts = np.bincount(order[j[mine]], minlength=len(opens)) if len(opens) else np.zeros(0, np.int64)
        before = np.bincount(level[~mine], minlength=len(self.opened) + 1)
        for d in np.flatnonzero(before[1:]) + 1:         # (level 0: a comma outside everything, not JSON)
            self.commas[d - 1] += int(before[d])
        over = [d for d in range(len(self.commas)) if self.commas[d] + 1 > max_items]
        if over:
            raise ShapeError(f"over {max_items} items", self.opened[over[0]])
        if len(counts) and counts.max() + 1 > max_items:
            raise ShapeError(f"over {max_items} items", start + int(tokens[opens[int(np.argmax(counts + 1 > max_items))]]))
        # the containers open at the block's end: those from before down to the lowest depth it reached, then
        # the last opened at each depth above
        low = min(len(self.opened), int(depth_after.min())) if len(depth_after) else len(self.opened)
        end = int(depth_after[-1]) if len(depth_after) else len(self.opened)
        self.opened, self.commas = self.opened[:low], self.commas[:low]
        for d in range(low + 1, end + 1):
            i = np.flatnonzero(open_level == d)[-1]
            self.opened.append(start + int(tokens[opens[i]]))
            self.commas.append(int(counts[i]))
        return True

    def _structure(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of the block's brackets, braces and commas outside
        strings, and their kinds (1 open, -1 close, 0 comma)."""
        quotes = np.flatnonzero(a == QUOTE)
        slash = a == BACKSLASH
        if len(quotes) and (slash.any() or self.backslashes):
            index = np.arange(len(a), dtype=np.int64)
            last_other = np.where(slash, -1, index)
            np.maximum.accumulate(last_other, out=last_other)
            before = np.where(quotes > 0, last_other[np.maximum(quotes - 1, 0)], -1)
            run = quotes - 1 - before + np.where(before < 0, self.backslashes, 0)
            quotes = quotes[run % 2 == 0]
        tail = len(a) - 1 - int(np.flatnonzero(~slash)[-1]) if (~slash).any() else len(a) + self.backslashes
        self.backslashes = tail
        marks = np.flatnonzero((a == COMMA) | (a == OPENS[0]) | (a == OPENS[1]) | (a == CLOSES[0]) | (a == CLOSES[1]))
        outside = (np.searchsorted(quotes, marks) + self.in_string) % 2 == 0
        self.in_string = (self.in_string + len(quotes)) % 2
        marks = marks[outside]
        c = a[marks]
        kinds = np.where((c == OPENS[0]) | (c == OPENS[1]), 1, np.where(c == COMMA, 0, -1))
        return marks, kinds


def where(data: bytes, offset: int) -> str:
    """'line L' of a byte offset, and the key whose value opens there, if any."""
    line = data.count(b"\n", 0, offset) + 1
    key = re.search(rb'"([A-Za-z0-9_]{1,40})"\s*:\s*$', data[max(0, offset - 80):offset])
    return f"{key[1].decode()!r} at line {line}" if key else f"the value at line {line}"
