"""Reading a plan file, text or MSCCL XML, verified: the one way msc loads a
plan (``msc run``, ``msc simulate``, the runtimes, msc.torch). It sits above
both readers and the verifier, so neither reader needs the other."""
from __future__ import annotations

import re
import warnings
from dataclasses import replace
from pathlib import Path

from msc.errors import DeadlockError, PlanError, UsageError, VerificationError
from msc.formats.plan_text import decode_utf8, parse_plan
from msc.formats.xml_import import xml_to_plan
from msc.ir import Plan
from msc.files import read_input
from msc.ir.limits import MAX_PLAN_FILE_BYTES, MAX_SLOTS
from msc.lower.runtimes import slots_note, xml_runtime
from msc.verification import cache as verified_texts
from msc.verification import plan as plan_verifier     # looked up at each call, as a replacement would be

_XML_START = re.compile(rb"\s*(?:\xef\xbb\xbf)?\s*<|\xff\xfe|\xfe\xff")    # "<", after blanks or a BOM


def load_plan(path: str | Path, *, verify: bool = True, collective=None, slots: int | None = None,
              runtime: str | None = None) -> Plan:
    """A plan from a .plan file or MSCCL XML; verified unless ``verify=False``
    or this msc verified the same text before (msc.verification.cache). ``slots``,
    ``runtime``: see read_plan_file."""
    return read_plan_file(path, verify=verify, collective=collective, slots=slots, runtime=runtime)[0]


def read_plan_file(path: str | Path, *, verify: bool = True, collective=None, slots: int | None = None,
                   runtime: str | None = None) -> tuple[Plan, bytes, str]:
    """``load_plan``'s plan, with the bytes it was read from (read once) and
    the reader that read them ("plan" or "xml").

    Connection capacity, before verifying: ``slots`` per connection if
    given; else, with ``runtime`` ("msccl" or "azure"), what a connection of
    the plan's protocol holds there (verify the plan as it would run there);
    else the file's own (a plan's ``slots``, XML's ``msc_slots``), and for
    XML that records none what the MSCCL runtimes give (msc.lower.runtimes)."""
    if slots is not None and runtime is not None:
        raise UsageError(f"give the slots per connection (--slots {slots}) or the runtime whose capacity to "
                         f"verify with (--runtime {runtime}), not both")
    if slots is not None and (type(slots) is not int or not 1 <= slots <= MAX_SLOTS):
        raise UsageError(f"slots must be an int in 1..{MAX_SLOTS}, got {slots!r}")
    rt = None if runtime is None else xml_runtime(runtime)
    path = Path(path)
    data = read_input(path, MAX_PLAN_FILE_BYTES, what="plan", error=PlanError)
    reader = _reader(path, data)
    if reader == "mscclpp":
        return _read_mscclpp(path, data, verify=verify, collective=collective, slots=slots, runtime=runtime)
    if reader == "xml":
        plan = xml_to_plan(data, path=str(path), slots=slots, runtime=runtime)   # bytes: expat reads the encoding
    else:
        plan = parse_plan(decode_utf8(data, str(path)), path=str(path))
    plan = stating(plan, collective)
    if rt is not None:
        slots = rt.connection_slots(plan.protocol)
    if slots is not None and slots != plan.slots:
        plan = replace(plan, slots=slots)
    # what the text means depends on the capacity it is read with, where the text does not fix it
    key = reader if reader == "plan" and slots is None else f"{reader} slots {plan.slots}"
    if verify and not verified_texts.known(data, key, plan.collective, collective):
        if states_nothing(plan):
            verify_at_capacity(plan, collective=structural(plan))        # no results to check them against
            warnings.warn(f"{path}: {UNCHECKED}", UncheckedWarning, stacklevel=2)
            return plan, data, reader
        verify_at_capacity(plan, collective=collective)
        verified_texts.remember(data, key, plan.collective, collective)
    return plan, data, reader


class UncheckedWarning(UserWarning):
    """A plan of a custom collective that does not state it: verified for
    deadlock, races and limits only."""


UNCHECKED = ("the plan's collective is custom and not stated in the file (MSCCL XML not written by msc): checked "
             "for deadlock, races and limits only, not its results; give its definition with --collective "
             "FILE.py:NAME to check them")


def states_nothing(plan: Plan) -> bool:
    """Whether nothing says what ``plan`` must compute: a collective that is
    not built in, with no contract (a definition given to the reader attaches one)."""
    from msc.dsl.collectives import BUILTIN, collective_key

    return plan.contract is None and collective_key(plan.collective) not in BUILTIN


def structural(plan: Plan):
    """A collective of the plan's shape that accepts any result: verifying
    against it checks deadlock, races and limits only."""
    from msc.dsl.collectives import StatedCollective
    from msc.ir import Contract

    anything = Contract(post=tuple((None,) * plan.output_chunks for _ in range(plan.num_ranks)))
    return StatedCollective(plan.collective, plan.num_ranks, plan.chunk_factor, plan.input_chunks,
                            plan.output_chunks, anything)


def stating(plan: Plan, collective) -> Plan:
    """``plan`` carrying ``collective``'s requirements (msc.ir.Contract) when
    ``collective`` is a custom one given for a plan that states none; for
    MSCCL XML, which records no chunk factor for custom collectives, the
    chunk factor at which the definition has the plan's buffer sizes."""
    from msc.dsl.collectives import BUILTIN, Collective, contract_of

    if not isinstance(collective, Collective) or type(collective) is BUILTIN.get(collective.name):
        return plan
    if plan.contract is not None:
        return plan
    n = plan.num_ranks
    sizes = (plan.input_chunks, plan.output_chunks)
    if (collective.input_chunks(n, plan.chunk_factor), collective.output_chunks(n, plan.chunk_factor)) != sizes:
        fits = [k for k in range(1, max(sizes) + 1)
                if (collective.input_chunks(n, k), collective.output_chunks(n, k)) == sizes]
        if not fits:
            raise UsageError(f"collective {collective.name!r} has no chunk factor at which its buffers are the "
                             f"plan's ({plan.input_chunks} input and {plan.output_chunks} output chunks at {n} ranks)")
        plan = replace(plan, chunk_factor=fits[0])
    return replace(plan, collective=collective.name,
                   contract=contract_of(collective, n, plan.chunk_factor, plan.root))


def _reader(path: Path, data: bytes) -> str:
    from msc.formats.mscclpp.reader import looks_like_mscclpp

    if path.suffix.lower() == ".json" or looks_like_mscclpp(data[:64]):
        return "mscclpp"
    return "xml" if path.suffix.lower() == ".xml" or _XML_START.match(data) else "plan"


def _read_mscclpp(path: Path, data: bytes, *, verify: bool, collective, slots, runtime) -> tuple[Plan, bytes, str]:
    """An MSCCL++ execution plan: checked as the MSCCL++ executor runs it
    (msc.verification.onesided), then read back as the msc plan it is the
    export of (msc.formats.mscclpp.lift; other shapes are refused there)."""
    from msc.formats.mscclpp.lift import lift_plan
    from msc.formats.mscclpp.reader import parse_mscclpp
    from msc.formats.mscclpp.check import verify_mscclpp

    if runtime is not None:
        raise UsageError(f"--runtime {runtime} names an MSCCL runtime; {path} is an MSCCL++ execution plan")
    osp = parse_mscclpp(data, path=str(path))
    if verify:
        verify_mscclpp(osp, collective=collective)
    plan = stating(lift_plan(osp), collective)
    if slots is not None and slots != plan.slots:
        plan = replace(plan, slots=slots)
    if verify:
        verify_at_capacity(plan, collective=collective if not states_nothing(plan) else structural(plan))
    return plan, data, "mscclpp"


def plan_reader(path: str | Path) -> str:
    """Which reader load_plan uses for ``path``: "plan", "xml" or "mscclpp"."""
    path = Path(path)
    return _reader(path, read_input(path, MAX_PLAN_FILE_BYTES, what="plan", error=PlanError, head=4096))


def is_xml_file(path: str | Path) -> bool:
    """Whether load_plan reads ``path`` as MSCCL XML (a plan for the MSCCL runtimes)."""
    path = Path(path)
    head = read_input(path, MAX_PLAN_FILE_BYTES, what="plan", error=PlanError, head=4096)
    return _reader(path, head) == "xml"


def verify_at_capacity(plan: Plan, *, collective=None):
    """verify_plan's report; where the plan deadlocks with the slots per
    connection it has, the DeadlockError also says how many it needs and
    what the MSCCL runtimes give (a plan can need more than they hold)."""
    from msc.lower.pipeline import verified_with_fewest_slots   # the lowering passes: only when needed

    try:
        return plan_verifier.verify_plan(plan, collective=collective)
    except DeadlockError as exc:
        try:
            found = verified_with_fewest_slots(replace(plan, slots=1), collective)
        except VerificationError:       # it races too: that, not the slots, is its problem
            raise exc from None
        raise DeadlockError(f"{exc.detail}\n{slots_note(plan, found and found.slots)}", exc.cycle) from None
