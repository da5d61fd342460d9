"""Every error msc raises, in one hierarchy.

Each error carries the values that explain it (rank, buffer, index, what was
expected and what was found) and, where there is one, the line of the user's
algorithm file that caused it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SourceLine:
    """A place in a user's file: where an operation was written."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def did_you_mean(word: str, names, *, fold_case: bool = False) -> str:
    """``" (did you mean 'x'?)"``: the names close to a mistyped ``word``
    (difflib's ratio; ``fold_case``: compared in lower case), for the end of
    an error message; "" if none is close."""
    import difflib

    keys = {(n.lower() if fold_case else n): n for n in map(str, names)}
    close = difflib.get_close_matches(str(word).lower() if fold_case else str(word), list(keys), n=3, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(keys[c]) for c in close)}?)"


class MscError(Exception):
    """Base of every error msc raises on purpose."""


class UsageError(MscError):
    """Bad input from the command line or the Python API (exit code 2)."""


class AlgorithmError(MscError):
    """An algorithm could not be traced: bad parameters, an unsupported rank
    count, or an exception inside the user's function (exit code 2)."""

    def __init__(self, message: str, where: SourceLine | None = None):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class VerificationError(MscError):
    """A program or plan does not do what its collective requires (exit code 1).

    ``rank``, ``buffer`` and ``index`` name the chunk, ``expected`` and
    ``found`` describe its contents, ``where`` is the user's line that last
    wrote it (or that made the bad operation).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        buffer: str | None = None,
        index: int | None = None,
        expected: str | None = None,
        found: str | None = None,
        where: SourceLine | None = None,
    ):
        self.rank = rank
        self.buffer = buffer
        self.index = index
        self.expected = expected
        self.found = found
        self.where = where
        self.detail = message
        super().__init__(self._render())

    def _render(self) -> str:
        head = f"{self.where}: " if self.where else ""
        lines = [head + self.detail]
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.found is not None:
            lines.append(f"  found:    {self.found}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "message": self.detail,
            "rank": self.rank,
            "buffer": self.buffer,
            "index": self.index,
            "expected": self.expected,
            "found": self.found,
            "file": self.where.file if self.where else None,
            "line": self.where.line if self.where else None,
        }


class OperationError(VerificationError):
    """An operation is invalid where it is written: a rank that does not exist,
    an index out of range, sizes that do not match. Raised while tracing, at
    the user's line."""


class LoweringError(MscError):
    """A program cannot be lowered as asked: conflicting placement hints, or a
    schedule no connection order can serve (exit code 2)."""

    def __init__(self, message: str, where: SourceLine | None = None):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class PlanError(MscError):
    """A plan that is malformed: a bad value, a peer that does not exist, a
    slice outside its buffer, a dependency on a step that does not exist
    (exit code 2). ``line``/``column`` locate it in a plan file."""

    def __init__(self, message: str, *, rank: int | None = None, tb: int | None = None,
                 step: int | None = None, line: int | None = None, column: int | None = None,
                 path: str | None = None):
        self.rank, self.tb, self.step = rank, tb, step
        self.line, self.column, self.path = line, column, path
        where = ""
        if line is not None:
            where = f"{path or '<plan>'}:{line}" + (f":{column}" if column is not None else "") + ": "
        elif path is not None:         # a plan-wide value (a total, a header field the reader did not place)
            where = f"{path}: "
        at = [f"{name} {value}" for name, value in (("rank", rank), ("threadblock", tb), ("step", step))
              if value is not None]
        super().__init__(where + (", ".join(at) + ": " if at else "") + message)


class RuntimeLimitError(PlanError):
    """A plan exceeds a limit of the runtime it is exported or lowered for
    (msc.lower.runtimes). ``limit`` names it (the runtime's constant), ``value``
    is the plan's value, ``maximum`` the most the runtime takes and
    ``runtime`` its name."""

    def __init__(self, limit: str, value: int, maximum: int, message: str, *, runtime: str | None = None, **where):
        self.limit, self.value, self.maximum, self.runtime = limit, value, maximum, runtime
        self.detail = message          # without the rank, threadblock and step in front
        super().__init__(message, **where)


class FormatError(PlanError):
    """A plan the format it is written to cannot express (MSCCL XML: switch
    operations, a custom collective whose input and output differ in
    chunks). ``detail`` is the message without the rank in front; ``kind``
    names what cannot be said ("switch", "buffers"), so that a caller can
    name the format that can (msc export --format mscclpp)."""

    def __init__(self, message: str, *, kind: str, **where):
        self.kind, self.detail = kind, message
        super().__init__(message, **where)


class DeadlockError(VerificationError):
    """The plan can stop with every unfinished threadblock waiting; ``cycle``
    lists the waits, each (rank, threadblock, step, what it waits on)."""

    def __init__(self, message: str, cycle: list):
        self.cycle = cycle
        super().__init__(message)


class RaceError(VerificationError):
    """Two steps of one rank touch the same chunk, one of them writing, with
    nothing ordering them; ``steps`` names both (rank, threadblock, step)."""

    def __init__(self, message: str, steps: tuple, **kw):
        self.steps = steps
        super().__init__(message, **kw)


class ExecutionError(VerificationError):
    """A plan did something an executor cannot do with real data (lengths
    that do not match, a read of scratch nothing wrote, a stuck plan);
    ``rank``, ``tb`` and ``step`` name the step."""

    def __init__(self, message: str, *, rank=None, tb=None, step=None, where=None, **kw):
        self.tb, self.step = tb, step
        super().__init__(message, rank=rank, where=where, **kw)


class CompileError(MscError):
    """NVRTC rejected generated CUDA: carries the compiler's log and the path
    of the rendered source it was given."""

    def __init__(self, message: str, *, log: str = "", source_path: str | None = None):
        self.log = log
        self.source_path = source_path
        text = message + (f" (source: {source_path})" if source_path else "")
        super().__init__(text + ("\n" + log.strip() if log.strip() else ""))


class CapabilityError(MscError):
    """This machine lacks a hardware or driver capability that was asked for
    (NVLink SHARP multicast: msc.cuda.multicast). ``device`` names the GPU,
    ``missing`` lists what it lacks; there is no fallback (exit code 2)."""

    def __init__(self, message: str, *, device: str | None = None, missing: tuple[str, ...] = ()):
        self.device, self.missing = device, missing
        super().__init__(message)
