"""nccl-tests' standard text output, read: what ``msc calibrate`` fits a
topology to.

A log is what all_reduce_perf, all_gather_perf, reduce_scatter_perf,
alltoall_perf, broadcast_perf, reduce_perf or sendrecv_perf print
(src/common.cu and src/util.cu of NVIDIA/nccl-tests): ``#`` lines saying
which test ran (``# Collective test starting: all_reduce_perf``), how many
GPUs each process drove (``# nThread 1 nGpus 8 ...``) and on which devices
(``#  Rank  0 Group  0 Pid 1234 on host device  0 [0000:18:00] NVIDIA
H100 80GB HBM3``), a header naming the columns, then a row per size:
``size count type redop root`` and, out of place then in place, ``time
algbw busbw #wrong`` (older versions print no root, ``error`` for
``#wrong``, or ``N/A`` where nothing was checked). Lines of NCCL's own
logging (``NCCL INFO``, ``NCCL version``) and anything else that is not a
row are passed over; a line that starts as a row and is not one, a row
whose results were wrong, or a log without rows is an error naming the
file and line. Several tests may follow one another in one file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from msc.errors import UsageError
from msc.files import read_input
from msc.ir.limits import MAX_TEXT_FILE_BYTES

# nccl-tests' binaries and msc's names of their collectives
TESTS = {"all_reduce_perf": "allreduce", "all_gather_perf": "allgather", "reduce_scatter_perf": "reducescatter",
         "alltoall_perf": "alltoall", "broadcast_perf": "broadcast", "reduce_perf": "reduce",
         "sendrecv_perf": "sendrecv"}
OTHER_TESTS = ("gather_perf", "scatter_perf", "hypercube_perf", "alltoallv_perf")
_TEST_NAME = re.compile(r"\b(" + "|".join(sorted(TESTS, key=len, reverse=True) + list(OTHER_TESTS)) + r")\b")
_STARTING = re.compile(r"Collective test starting:\s*(\S+)")
_THREADS = re.compile(r"nThread\s+(\d+)\s+nGpus\s+(\d+)")
_GRAPH = re.compile(r"\bgraph:\s*(\d+)")
_RANK = re.compile(r"Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s*(.*?)\s*$")
_VERSION = re.compile(r"nccl-library=(\d+)|NCCL version (\d+\.\d+\.\d+)")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_NCCL_LOG = re.compile(r"\bNCCL (INFO|WARN|ERROR|TRACE|version)\b")
_TAGGED = re.compile(r"^\[\d+,\d+\]<std(out|err)>:")      # mpirun --tag-output's prefix
GROUP = ("time", "algbw", "busbw", "wrong")       # a column group of the standard table


@dataclass(frozen=True)
class Row:
    """One size of one test: the times (us) of the column groups printed
    (out of place, in place), with the line it was read from."""

    collective: str
    size: int                   # bytes: nccl-tests' size column
    count: int
    dtype: str
    times_us: tuple[float, ...]
    busbw: tuple[float, ...]
    where: str                  # "file:line"


@dataclass(frozen=True)
class Log:
    """A file of nccl-tests output: its rows and what its header says."""

    path: str
    rows: tuple[Row, ...]
    ranks: int | None           # from the '#  Rank' lines (None: none printed)
    hosts: tuple[str, ...]      # the distinct hosts of those lines, in order
    devices: tuple[str, ...]    # the distinct device names, e.g. "NVIDIA A100-SXM4-80GB"
    gpus_per_process: int       # nccl-tests -g (x -t): GPUs one process drove
    graph: bool                 # nccl-tests -G: each iteration launched as a CUDA graph
    nccl_version: str | None


def read_logs(paths) -> list[Log]:
    return [read_log(p) for p in paths]


def read_log(path: str | Path) -> Log:
    path = Path(path)
    raw = read_input(path, MAX_TEXT_FILE_BYTES, what="nccl-tests output")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not text (byte {exc.start} is not UTF-8)") from None
    return parse(text, str(path))


def parse(text: str, name: str) -> Log:
    """The rows and header facts of nccl-tests output ``text`` (from file ``name``)."""
    collective = _collective_from_name(name)
    columns: list[str] | None = None
    rows: list[Row] = []
    ranks: dict[int, tuple[str, str]] = {}
    per_process, version, graph = 1, None, False
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{name}:{number}"
        body = _TAGGED.sub("", line).strip()
        if not body:
            continue
        if _NCCL_LOG.search(body):              # NCCL's own logging (NCCL_DEBUG), which may start with a digit
            if (v := _VERSION.search(body)) is not None:
                version = version or _version(v)
            continue
        if body.startswith("#"):
            comment = body.lstrip("#").strip()
            found = _STARTING.search(comment) or (_TEST_NAME.search(comment) if not rows else None)
            if found:
                collective = _collective(found.group(1), where)
            elif (m := _THREADS.search(comment)) is not None:
                per_process = int(m[1]) * int(m[2])
                graph = (g := _GRAPH.search(comment)) is not None and int(g[1]) > 0
            elif (m := _RANK.search(comment)) is not None:
                ranks[int(m[1])] = (m[2], m[3])
            elif comment.split()[:2] == ["size", "count"]:
                columns = comment.split()
            if (v := _VERSION.search(comment)) is not None:
                version = version or _version(v)
            continue
        tokens = body.split()
        if tokens[:2] == ["size", "count"]:         # a header whose '#' was lost (pasted into a page)
            columns = tokens
            continue
        if not tokens[0].isdigit():
            if collective is None and (m := _TEST_NAME.search(body)) is not None:
                collective = _collective(m.group(1), where)     # the command line, echoed
            continue
        if collective is None:
            raise UsageError(f"{where}: a row, but which test printed it? The log has no '# Collective test "
                             f"starting' line (nccl-tests 2.13 and later print one) and names none of "
                             f"{', '.join(TESTS)}: name the file after its test (e.g. all_reduce_perf.txt)")
        rows.append(_row(tokens, columns, collective, where))
    if not rows:
        raise UsageError(f"{name}: no rows of nccl-tests results (a line per size: size count type ... time "
                         f"algbw busbw #wrong ...)")
    hosts = tuple(dict.fromkeys(h for _, (h, _) in sorted(ranks.items())))
    devices = tuple(dict.fromkeys(d for _, (_, d) in sorted(ranks.items()) if d))
    return Log(name, tuple(rows), max(ranks) + 1 if ranks else None, hosts, devices, per_process, graph, version)


def _collective_from_name(name: str) -> str | None:
    """The test a file is named after (all_reduce_perf.txt), if it is."""
    m = _TEST_NAME.search(Path(name).name)
    return TESTS.get(m.group(1)) if m else None


def _collective(test: str, where: str) -> str:
    if test not in TESTS:
        raise UsageError(f"{where}: {test} is not a test msc models NCCL for (it models {', '.join(TESTS)})")
    return TESTS[test]


def _version(m) -> str:
    if m[2]:
        return m[2]
    code = int(m[1])            # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _row(tokens: list[str], columns: list[str] | None, collective: str, where: str) -> Row:
    """A row: ``size count type [redop] [root]`` then groups of ``time algbw busbw #wrong`` (the
    header's columns where one was printed, else told apart by their count)."""
    def bad(why):
        return UsageError(f"{where}: not a row of nccl-tests results ({why}): {' '.join(tokens)}")

    if len(tokens) < 3 or not tokens[1].isdigit():
        raise bad("it starts with a size but no element count follows")
    lead, group = 3, len(GROUP)
    if columns is not None:
        lead = next((i for i, c in enumerate(columns) if c in ("time", "cputime")), None)
        if lead is None:
            raise UsageError(f"{where}: the header names no time column: {' '.join(columns)}")
        if columns[lead] == "cputime":
            raise UsageError(f"{where}: the times are the host's CPU time (nccl-tests -C), not the collective's")
        rest = columns[lead + 1:]
        group = 1 + next((i for i, c in enumerate(rest) if c in ("time", "cputime")), len(rest))
    else:
        if len(tokens) > 3 and not _NUMBER.match(tokens[3]):
            lead = 4                                        # a redop column
        if (len(tokens) - lead) % group == 1:
            lead += 1                                       # a root column
    values = tokens[lead:]
    if len(values) < group or len(values) % group or len(values) // group > 2:
        raise bad(f"expected 1 or 2 groups of {group} columns (time algbw busbw #wrong) after the first {lead}, "
                  f"found {len(values)} values")
    times, busbw = [], []
    for k in range(0, len(values), group):
        time, _, bus, wrong = values[k:k + 4]
        for what, text in (("time", time), ("busbw", bus)):
            if not _NUMBER.match(text):
                raise bad(f"its {what} {text!r} is not a number")
        if wrong != "N/A" and (not _NUMBER.match(wrong) or float(wrong) != 0):
            raise UsageError(f"{where}: nccl-tests found {wrong} wrong result(s) at this size: a failed run is no "
                             f"measurement to fit (run it again, or leave the row out)")
        if float(time) <= 0:
            raise bad(f"its time {time} is not positive")
        times.append(float(time))
        busbw.append(float(bus))
    return Row(collective, int(tokens[0]), int(tokens[1]), tokens[2], tuple(times), tuple(busbw), where)


# GPU names (nccl-tests prints the CUDA device name) -> msc.sim.machines' names
DEVICES = ((re.compile(r"\bGB200\b"), "gb200"), (re.compile(r"\bB200\b"), "b200"), (re.compile(r"\bH200\b"), "h200"),
           (re.compile(r"\bH20\b"), "h20"), (re.compile(r"\bH100\b"), "h100"), (re.compile(r"\bA100\b"), "a100"))


def machine_of(device: str) -> str | None:
    """msc's machine for a CUDA device name (``NVIDIA A100-SXM4-80GB``: a100), None if none."""
    return next((name for pattern, name in DEVICES if pattern.search(device)), None)
