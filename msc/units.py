"""nccl-tests units and tables, shared by the commands that report sizes,
times and bandwidths (msc run, msc bench, msc simulate, msc tune, msc
bound) and by msc.torch's plan registry: sizes as nccl-tests spells them,
data types and their numpy dtypes, the nccl-tests table, and the element
range of a chunk of a user buffer.

numpy is imported where used: the CLI builds its parsers from this module
and starts without numpy.
"""
from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from msc.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

# nccl-tests type names (the table's spelling), their numpy names, and the aliases -d accepts.
TYPES = {"float": "float32", "half": "float16", "double": "float64", "bfloat16": "bfloat16",
         "int32": "int32", "int64": "int64", "uint8": "uint8"}
ALIASES = {"float32": "float", "float16": "half", "float64": "double", "bf16": "bfloat16", "int": "int32"}


def parse_size(text) -> int:
    """Bytes from "8", "1K", "64M", "2G" (powers of 1024, as nccl-tests), at most msc.ir.limits.MAX_BYTES."""
    from msc.ir.limits import MAX_BYTES, check

    shown = str(text) if len(str(text)) <= 40 else str(text)[:40] + "..."
    m = re.fullmatch(r"\s*(\d{1,30})\s*([kKmMgGtT]?)\s*", str(text))
    if not m:
        raise UsageError(f"bad size {shown!r}: expected a byte count such as 8, 1K, 64M or 2G")
    return check(int(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "), MAX_BYTES, f"size {shown}")


def format_size(n: int | None) -> str:
    """The shortest exact spelling parse_size reads back ("64M"); "inf" for None."""
    if n is None:
        return "inf"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_dtype(name: str) -> tuple[str, np.dtype]:
    """(nccl-tests type name, numpy dtype). ml_dtypes (0.7 CPU-s to import) only for bfloat16."""
    import numpy as np

    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in TYPES:
        raise UsageError(f"unsupported dtype {name!r} (supported: {', '.join(TYPES)}; also "
                         f"{', '.join(ALIASES)})")
    if key == "bfloat16":
        import ml_dtypes

        return key, np.dtype(ml_dtypes.bfloat16)
    return key, np.dtype(TYPES[key])


def is_floating(dtype: np.dtype) -> bool:
    """Whether numpy's ``dtype`` is a floating type (ml_dtypes' bfloat16, kind "V", too)."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes < 0 or max_bytes < min_bytes:
        raise UsageError(f"need 0 <= min bytes <= max bytes, got {min_bytes} and {max_bytes}")
    if type(factor) is not int or factor < 2:
        raise UsageError(f"step factor must be an int >= 2, got {factor!r}")
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size = max(size * factor, 1)
    return out


def time_text(us: float) -> str:
    return f"{us:7.0f}" if us >= 1e4 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def format_table(records: list[dict], *, title: str | None = None, columns=()) -> str:
    """The nccl-tests table: one column group, in-place or out-of-place as the
    plan is. Records timed on a device (msc bench) show time, algbw and busbw;
    records of a host backend (msc run) show the host time per call instead,
    and no bandwidth, which would mean nothing. ``columns``: more columns
    after those, each (heading, unit, cell: record -> text of 6 characters)."""
    form = "in-place" if records and records[0]["inplace"] else "out-of-place"
    device = not records or "time" in records[0]
    checked = not records or "wrong" in records[0]           # simulated records check nothing
    lines = [f"# {title}"] if title else []
    if device:
        lines += [
            f"#{'':54}{form:>30}",
            f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>7}  {'algbw':>6}  "
            f"{'busbw':>6}" + (f"  {'#wrong':>6}" if checked else ""),
            f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  "
            f"{'(GB/s)':>6}" + (f"  {'':>6}" if checked else ""),
        ]
    else:
        lines += [
            f"#{'':38}{form:>30}",
            f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'host':>7}  {'#wrong':>6}",
            f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  {'':>6}",
        ]
    for heading, unit, _ in columns:
        lines[-2] += f"  {heading:>6}"
        lines[-1] = (lines[-1] + f"  {unit:>6}").rstrip()
    for r in records:
        row = f"{r['size']:12d}  {r['count']:12d}  {r['type']:>8}  {r['redop']:>6}  {r['root']:6d}  "
        if device:
            row += f"{time_text(r['time'])}  {r['algbw']:6.2f}  {r['busbw']:6.2f}" + (f"  {r['wrong']:6d}" if checked else "")
        else:
            row += f"{time_text(r['host_time'])}  {r['wrong']:6d}"
        lines.append(row + "".join(f"  {cell(r):>6}" for _, _, cell in columns))
    if checked:
        wrong = sum(r["wrong"] for r in records)
        lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if device:
        avg = sum(r["busbw"] for r in records) / len(records) if records else 0.0
        lines.append(f"# Avg bus bandwidth    : {avg:g}")
    else:
        lines.append("# host: wall time per call on this CPU, not a GPU's time; no bandwidth is reported")
    rounded = [f"{r['requested_size']} -> {r['size']}" for r in records if r["rounded"]]
    if rounded:
        lines.append(f"# sizes rounded down to whole elements per unit (B): {', '.join(rounded)}")
    return "\n".join(lines)


def size_arg(text: str) -> int:
    """parse_size for argparse (``type=size_arg``)."""
    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def chunk_bounds(index: int, count: int, k: int) -> tuple[int, int]:
    """Element range [lo, hi) of chunk ``index`` of a user buffer."""
    q = -(-count // k)
    u, c = divmod(index, k)
    base = u * count
    return base + min(c * q, count), base + min((c + 1) * q, count)


def buffer_elements(chunks: int, count: int, k: int) -> int:
    """Elements of a user buffer of ``chunks`` chunks: the end of its last chunk."""
    return chunk_bounds(chunks - 1, count, k)[1] if chunks else 0
