"""The runtimes that run msc's plans, and their limits: one table.

- ``msc``: msc's own CUDA runtime (msc.cuda.runtime), the default target of
  ``msc compile``. No fixed limits: it sizes every connection for
  max(plan.slots, 8) messages, takes any number of steps, and checks the
  grid against the GPU at launch.
- ``msccl``: microsoft/msccl, the NCCL 2.12 fork MSCCLang targets; reads
  MSCCL-IR XML (xml_export, xml_import).
- ``azure``: Azure/msccl-executor-nccl, NCCL 2.18+ with an MSCCL scheduler;
  reads MSCCL-IR XML with other spellings and tighter limits.

Every MSCCL value is the runtime's own constant, read from its source
(microsoft/msccl master b23e9cd, Azure/msccl-executor-nccl main c6f6b36;
the file and constant are named beside each value). Where the runtimes
compare with ``>=`` the table holds the largest value that passes.

Connection capacity. A message (one <step>'s transfer of one tile) takes
MSCCL_CHUNKSTEPS = NCCL_STEPS/2 = 4 of a connection's NCCL_STEPS = 8 buffer
steps with the Simple protocol, and one step with LL and LL128 (chunkSize in
the interpreter kernel: ``... * (Proto::Id == NCCL_PROTO_SIMPLE ?
MSCCL_CHUNKSTEPS : 1)``). So a connection holds 2 Simple messages, 8 LL or
LL128 ones, before its sender blocks: a plan verified deadlock-free with
more slots than that may hang there.
"""
from __future__ import annotations

from dataclasses import dataclass

from msc.errors import UsageError
from msc.ir.ops import PROTOCOL_NAMES

PROTOCOL_SLOTS = PROTOCOL_NAMES     # the order of Runtime.slots (the protocols: msc.ir.ops)


class CapacityWarning(UserWarning):
    """MSCCL XML that records no slots, of a protocol the MSCCL runtimes give
    different capacities: which runtime's was assumed (--runtime picks)."""


@dataclass(frozen=True)
class Runtime:
    """One runtime's limits; None: no fixed limit. Counts are per rank
    unless named otherwise, and steps are the runtime's own (<step>s in
    XML, nops included)."""

    name: str
    title: str                          # the project, for messages
    xml: bool                           # reads MSCCL-IR XML
    slots: tuple[int, int, int] | None  # messages a connection holds, per PROTOCOL_SLOTS
    slots_source: tuple[str, str, str] | str  # where each capacity comes from, for messages
    max_threadblocks: int | None = None   # MSCCL_MAX_NUM_THREAD_BLOCKS
    max_tb_per_channel: int | None = None  # MSCCL_MAX_NUM_THREAD_BLOCKS_PER_CHANNEL (senders, receivers each)
    max_channels: int | None = None     # MAXCHANNELS
    max_steps: int | None = None        # MSCCL_MAX_NUM_STEPS: per threadblock
    max_nodes: int | None = None        # MAX_NODES of the XML reader, less one (algo, gpus, own tbs and steps)
    max_count: int | None = None        # MSCCL_MAX_COUNT - 1: the largest cnt
    max_offset: int | None = None       # srcoff/dstoff are int16_t
    max_dep_tb: int | None = None       # depid is int8_t
    max_ranks: int | None = None        # MAX_SUBS: <gpu> children of <algo>
    max_str: int | None = None          # MAX_STR_LEN: an attribute value
    max_attrs: int | None = None        # MAX_ATTR_COUNT: attributes read per element
    # XML spellings
    reducescatter: str = "reducescatter"  # coll of reduce-scatter
    custom: bool = False                # accepts coll="custom"
    unlimited_bytes: int = 0            # the maxBytes that means "no upper bound"
    lowercase_bytes: bool = False       # also write minbytes/maxbytes (msccl's config file spelling)

    def coll(self, collective: str) -> str:
        """The coll= this runtime spells msc's ``collective`` as (reduce-scatter: each its own way)."""
        return self.reducescatter if collective == "reducescatter" else collective

    def connection_slots(self, protocol: str) -> int | None:
        """Messages a ``protocol`` connection holds before its sender blocks
        (None: as many as the plan needs)."""
        if protocol not in PROTOCOL_SLOTS:
            raise UsageError(f"unknown protocol {protocol!r} (expected one of {', '.join(PROTOCOL_SLOTS)})")
        return None if self.slots is None else self.slots[PROTOCOL_SLOTS.index(protocol)]

    def slots_reason(self, protocol: str) -> str:
        source = self.slots_source
        return source if isinstance(source, str) else source[PROTOCOL_SLOTS.index(protocol)]


# microsoft/msccl and Azure/msccl-executor-nccl agree on these. Files: msccl's src/include/msccl.h,
# devcomm.h, src/graph/xml.h and topo.cc (its reader); azure's src/include/msccl/msccl_struct.h,
# msccl_parser.h, src/include/device.h and src/misc/msccl/msccl_parser.cc (its reader).
_SHARED = dict(
    # NCCL_STEPS 8 (devcomm.h / device.h) / MSCCL_CHUNKSTEPS NCCL_STEPS/2 (msccl.h / msccl_struct.h) for
    # Simple; LL and LL128 messages take one step each
    slots=(2, 8, 8),
    max_tb_per_channel=32,              # MSCCL_MAX_NUM_THREAD_BLOCKS_PER_CHANNEL (msccl.h / msccl_struct.h)
    max_channels=32,                    # MAXCHANNELS (devcomm.h / device.h)
    max_nodes=(1 << 12) - 1,            # MAX_NODES 1<<12 (xml.h) / 4096 (msccl_parser.h): reading fails at it
    max_count=71,                       # MSCCL_MAX_COUNT 72: the readers refuse cnt >= it
    max_offset=(1 << 15) - 1,           # srcoff/dstoff stored as int16_t (mscclTransfer / mscclTransmission)
    max_dep_tb=(1 << 7) - 1,            # depid stored as int8_t (dependentBid)
    max_ranks=1024,                     # MAX_SUBS (xml.h / msccl_parser.h): children of an element
    max_str=255,                        # MAX_STR_LEN (same files)
    max_attrs=16,                       # MAX_ATTR_COUNT (same files; further attributes are dropped)
)
_NCCL_STEPS = ("NCCL_STEPS 8 / MSCCL_CHUNKSTEPS 4", "NCCL_STEPS 8, a message a step", "NCCL_STEPS 8, a message a step")

RUNTIMES: dict[str, Runtime] = {
    "msc": Runtime("msc", "msc's own CUDA runtime", False, None,
                   "connections sized for the plan: max(plan.slots, MSC_MIN_SLOTS)"),
    "msccl": Runtime(
        "msccl", "microsoft/msccl", True, slots_source=_NCCL_STEPS,
        max_threadblocks=216,           # MSCCL_MAX_NUM_THREAD_BLOCKS (108*2): src/include/msccl.h
        max_steps=256,                  # MSCCL_MAX_NUM_STEPS: src/include/msccl.h
        reducescatter="reduce_scatter", custom=True, unlimited_bytes=(1 << 63) - 1, lowercase_bytes=True,
        **_SHARED),
    "azure": Runtime(
        "azure", "Azure/msccl-executor-nccl", True, slots_source=_NCCL_STEPS,
        max_threadblocks=32 * 32,       # MSCCL_MAX_NUM_THREAD_BLOCKS (_PER_CHANNEL * MAXCHANNELS): msccl_struct.h
        max_steps=64,                   # MSCCL_MAX_NUM_STEPS ?= 64: makefiles/common.mk (a build flag since
                                        # #48; msccl_struct.h's define on the v2.17-v2.19 branches)
        **_SHARED),
}
DEFAULT_TARGET = "msc"                   # what `msc compile` lowers for
MSC_MIN_SLOTS = 8                        # msc's runtime sizes every connection for at least this many
XML_RUNTIMES = tuple(name for name, rt in RUNTIMES.items() if rt.xml)
DEFAULT_XML_RUNTIME = "msccl"            # assumed for XML that names no runtime, where the runtimes differ


def runtime_slots(plan, runtime: str = DEFAULT_TARGET) -> int:
    """Messages a connection of ``plan`` holds when ``runtime`` runs it: msc's
    own runtime gives max(plan.slots, MSC_MIN_SLOTS) (plan.slots is the
    fewest the plan was verified deadlock-free with), an MSCCL runtime what
    its connections of the plan's protocol hold."""
    given = get_runtime(runtime).connection_slots(plan.protocol)
    return max(plan.slots, MSC_MIN_SLOTS) if given is None else given


def get_runtime(name: str) -> Runtime:
    rt = RUNTIMES.get(name) if isinstance(name, str) else None
    if rt is None:
        raise UsageError(f"unknown runtime {name!r} (expected one of {', '.join(RUNTIMES)})")
    return rt


def xml_runtime(name: str) -> Runtime:
    """An MSCCL runtime (one that reads XML), by name."""
    rt = RUNTIMES.get(name) if isinstance(name, str) else None
    if rt is None or not rt.xml:
        raise UsageError(f"unknown MSCCL runtime {name!r} (expected one of {', '.join(XML_RUNTIMES)})")
    return rt


@dataclass(frozen=True)
class Capacity:
    """The slots per connection a foreign MSCCL XML file is verified with,
    and where the number comes from."""

    slots: int
    runtimes: tuple[str, ...]   # the runtimes that give this many
    assumed: str | None = None  # a note when the runtimes differ and one was picked

    def describe(self, protocol: str) -> str:
        """"a Simple connection holds 2 messages on the msccl and azure runtimes (...)"."""
        many = len(self.runtimes) > 1
        return (f"a {protocol} connection holds {self.slots} message{'s' if self.slots > 1 else ''} on the "
                f"{' and '.join(self.runtimes)} runtime{'s' if many else ''} "
                f"({RUNTIMES[self.runtimes[0]].slots_reason(protocol)})")


def xml_capacity(protocol: str, runtime: str | None = None) -> Capacity:
    """Slots per connection for MSCCL XML that does not record its own
    (no ``msc_slots``): what a ``protocol`` connection holds on ``runtime``,
    or, without one, on the MSCCL runtimes when they agree; where they
    differ, DEFAULT_XML_RUNTIME's, with a note saying so."""
    if runtime is not None:
        return Capacity(xml_runtime(runtime).connection_slots(protocol), (runtime,))
    given = {name: RUNTIMES[name].connection_slots(protocol) for name in XML_RUNTIMES}
    if len(set(given.values())) == 1:
        return Capacity(given[DEFAULT_XML_RUNTIME], XML_RUNTIMES)
    others = ", ".join(f"{name} {slots}" for name, slots in given.items() if name != DEFAULT_XML_RUNTIME)
    return Capacity(given[DEFAULT_XML_RUNTIME], (DEFAULT_XML_RUNTIME,),
                    f"the MSCCL runtimes give {protocol} connections different capacities ({others}); "
                    f"assumed the {DEFAULT_XML_RUNTIME} runtime's {given[DEFAULT_XML_RUNTIME]} "
                    f"(pick one with --runtime)")


def slots_note(plan, needed: int | None) -> str:
    """Why a plan that deadlocks with ``plan.slots`` slots per connection
    does, in the runtimes' terms: ``needed`` is the fewest it runs with
    (None: none up to 8, lowering's most)."""
    cap = xml_capacity(plan.protocol)
    held = cap.describe(plan.protocol)
    if needed is None:
        return f"  it deadlocks with 8 slots per connection too (more capacity does not help); {held}"
    if needed > cap.slots:
        return (f"  it needs {needed} slots per connection, and {held}: it can hang there; msc's own runtime "
                f"gives it {needed} (verify for that with --slots {needed})")
    return f"  it deadlocks with {plan.slots} slot(s) per connection and runs with {needed} ({held})"


def add_capacity_args(parser) -> None:
    """``--slots N`` and ``--runtime R`` for a command that loads a plan:
    the connection capacity it is verified (and run) with, applied at load
    before verifying (msc.formats.load.read_plan_file)."""
    parser.add_argument("--slots", type=int, metavar="N",
                        help="verify (and run) the plan with N slots (messages in flight) per connection, "
                             "whatever the file records")
    parser.add_argument("--runtime", choices=XML_RUNTIMES,
                        help="verify (and run) the plan with the slots per connection this MSCCL runtime gives "
                             "its protocol (Simple 2, LL and LL128 8); default: what the file records, and for "
                             "MSCCL XML that records none (not written by msc), what both runtimes give")


def capacity_args(args) -> dict:
    """The ``slots=``/``runtime=`` keywords for a plan loader, from the flags
    add_capacity_args adds: only those given (a loader that takes a path
    alone still serves a command run without them)."""
    return {key: value for key in ("slots", "runtime") if (value := getattr(args, key, None)) is not None}
