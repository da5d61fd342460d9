"""Where the user's code is: the first frame outside msc (``user_line``),
for errors that name the line an operation came from; and the integer
coercion the DSL's checks share."""
from __future__ import annotations

import operator
import os
import sys

from msc.errors import SourceLine
from msc.resources import PACKAGE_DIR

_PACKAGE_DIR = str(PACKAGE_DIR) + os.sep
_LIBRARY_DIR = _PACKAGE_DIR + "algorithms" + os.sep   # where a wheel puts the algorithm library


def _internal(filename: str) -> bool:
    """Frames of msc itself (not the algorithm library a wheel ships inside it)."""
    return filename.startswith(_PACKAGE_DIR) and not filename.startswith(_LIBRARY_DIR)
_lines: dict[tuple[str, int], SourceLine] = {}
# id(code) -> (code, whether it is msc's own): tracing asks millions of times about a few code
# objects; the entry holds the code object, so its id is not reused while the entry stands
_codes: dict[int, tuple] = {}


def _is_internal_code(code) -> bool:
    hit = _codes.get(id(code))
    if hit is None or hit[0] is not code:
        hit = _codes[id(code)] = (code, _internal(code.co_filename))
    return hit[1]


def user_line(depth: int = 2) -> SourceLine | None:
    """The first frame outside the msc package: the user's line."""
    return _first_user_line(sys._getframe(depth))[1]


def _first_user_line(frame) -> tuple:
    """(the first frame from ``frame`` outward outside the msc package, its
    SourceLine), or (None, None) where every frame is msc's."""
    while frame is not None and _is_internal_code(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return None, None
    key = (frame.f_code.co_filename, frame.f_lineno)
    hit = _lines.get(key)
    if hit is None:
        hit = _lines[key] = SourceLine(_display_path(key[0]), key[1])
    return frame, hit


# id(code) -> (code, {instruction offset: SourceLine}) for user code that made an operation itself:
# tracing's record finds the line there with two lookups (msc.dsl.program.Program._record)
user_codes: dict[int, tuple] = {}


def line_at(frame) -> SourceLine | None:
    """user_line's answer where ``frame`` is the frame it starts from, and,
    where that frame is the user's own, its line remembered in ``user_codes``."""
    found, hit = _first_user_line(frame)
    if found is frame:
        code = frame.f_code
        entry = user_codes.get(id(code))
        if entry is None or entry[0] is not code:
            entry = user_codes[id(code)] = (code, {})
        entry[1][frame.f_lasti] = hit
    return hit


def _display_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith(".." + os.sep + "..") else rel


def _integer(value):
    """``value`` as an int where it is an integer of another type (a numpy
    integer: ``operator.index``); anything else (bools included) unchanged,
    for the caller's check to reject with its own words."""
    if type(value) is int or isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _not_int(value) -> str:
    """How a value that should be an int is not one: for error messages."""
    return f" (a {type(value).__name__}, not an int)" if type(value) is not int else ""
