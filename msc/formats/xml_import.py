"""MSCCL-IR XML (from msc, MSCCLang, TACCL or by hand) into a plan.

The reading is the MSCCL runtime's (see xml_export for the format and
the two runtimes). Each ``<step>`` becomes one plan step, so step indices and
``depid``/``deps`` carry over unchanged:

    s r rcs rrs rrc rrcs cpy  ->  send recv rcs rrs rrc rrcs copy
    re  (dst += src)          ->  reduce srcs (dst, src) -> dst
    nop                       ->  nop (waits for its dependency)

Buffers ``i``/``o``/``s`` are the user's input and output and the scratch
buffer; in the in-place forms ``i`` and ``o`` are mapped onto the one
physical buffer through the collective's layout (in-place allgather: ``i``
offset x is output chunk rank*k + x, as NCCL's sendbuff = recvbuff +
rank*count). Operands a type does not use are ignored (MSCCLang writes the
remote end there). The chunk factor k follows from ``nchunksperloop``:
allreduce, broadcast, reduce: k = nchunksperloop (= i_chunks); allgather,
reducescatter, alltoall: k = nchunksperloop / ngpus.

XML whose meaning on the runtime differs from the plan's reading is
refused, naming the step: a nop without a dependency (the runtime's step
numbering slips), a run of nops not followed by a step with a dependency
(the runtime rejects it), a wait for a nop or for a step without
``hasdep="1"`` (the runtime never signals it), and ``re`` steps the runtime
fuses into one pass when that pass differs from doing them in turn (another
``cnt``, or a source overlapping the destination). Runtime size limits are
not checked here (xml_export does that). A custom collective in place
(``coll="custom" inplace="1"``) has one buffer, which ``i`` and ``o`` both
name from chunk 0 (NCCL's sendbuff == recvbuff); a built-in msc exported
as custom (``msc_collective``: gather, scatter, sendrecv) keeps its own
layout (in-place gather: ``i`` is unit rank of ``o``).

Connection capacity. A plan is verified with the slots per connection it
records (msc.verification.plan); an XML file says nothing about it unless msc
wrote it (``msc_slots``). Otherwise the plan gets what a connection of its
protocol holds on the MSCCL runtime (msc.lower.runtimes.xml_capacity: 2 for
Simple, 8 for LL and LL128, on both runtimes), or the ``slots`` asked for.

Every error is a PlanError naming the element, attribute, gpu/tb/step and
the line, quoting at most 80 characters of a value or name; DTDs and
entities are refused. Bytes are decoded as the XML declaration says (UTF-8
without one): an encoding expat cannot read is refused naming it, and bytes
that are not UTF-8 in a UTF-8 file are named by their byte offset.
"""
from __future__ import annotations

import re
import warnings
import xml.etree.ElementTree as ET
from xml.parsers import expat

from msc.dsl.collectives import COLLECTIVES as SPECS, contract_of, get_collective
from msc.lower.runtimes import RUNTIMES
from msc.errors import MscError, PlanError
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.ir.ops import PROTOCOL_NAMES
from msc.verification.plan_values import check_plan
from msc.ir.contract_text import build_contract
from msc.formats.plan_text import clipped, shown
from msc.lower.runtimes import CapacityWarning, xml_capacity

# coll= as the runtimes spell MSCCL's collectives (reduce-scatter: each its own way), and custom
COLLECTIVES = {**{name: name for name, spec in SPECS.items() if spec.msccl},
               **{rt.reducescatter: "reducescatter" for rt in RUNTIMES.values()}, "custom": "custom"}
BUFFERS = {"i": "input", "o": "output", "s": "scratch"}
TYPES = {op.xml: op for op in StepOp if op.xml}
MAX_REDUCE_FUSION = 16    # the runtime fuses at most this many re steps
_INT = re.compile(r"[-+]?[0-9]{1,19}\Z")     # decimal; 19 digits keep int() cheap
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _integer(value: str) -> int | None:
    value = value.strip()
    return int(value) if _INT.match(value) else None


def xml_to_plan(text: str | bytes, *, path: str | None = None, slots: int | None = None,
                runtime: str | None = None) -> Plan:
    """The plan an MSCCL XML text describes, checked with plan_check (not
    verified). ``slots``: the connection capacity to record (default: the
    ``msc_slots`` attribute msc writes, else what a connection of the file's
    protocol holds on ``runtime``, "msccl" or "azure"; None: on both, which
    agree; see msc.lower.runtimes.xml_capacity)."""
    root, lines = _parse(text, path)
    return _Reader(lines, path).plan(root, slots, runtime)


class _FirstElement(Exception):
    """Stops expat at the root element (its attributes are all we want)."""


def xml_byte_range(text: str | bytes, *, path: str | None = None) -> tuple[int, int | None]:
    """The message sizes an MSCCL XML asks to be selected for, as
    ``(min_bytes, max_bytes)`` with msc's ``min_bytes <= size < max_bytes``
    (max_bytes None: no upper bound), read from ``<algo minBytes maxBytes>``
    (or the lower-case spellings of msccl's config file). Absent bounds,
    ``maxBytes="0"`` (the azure runtime's "no limit") and msccl's largest
    int64 mean no bound. azure compares ``size <= maxBytes``; msc reads every
    bound as msccl does, so such a range ends one byte earlier here. Only the
    root element is read."""
    parser = _expat(text, path)
    found: dict = {}

    def start(tag, attrs):
        found.update(tag=tag, attrs=attrs, line=parser.CurrentLineNumber)
        raise _FirstElement

    parser.StartElementHandler = start
    try:
        _feed(parser, text, path)
    except _FirstElement:
        pass
    if found.get("tag") != "algo":
        raise PlanError(f"the root element is <{shown(found.get('tag'))}>, expected <algo>", path=path,
                        line=found.get("line"))
    attrs, line = found["attrs"], found["line"]

    def bound(name):
        value = attrs.get(name, attrs.get(name.lower()))
        if value is None:
            return None
        number = _integer(value)
        if number is None or number < 0:
            raise PlanError(f"<algo> attribute {name}={value!r:.40} is not an integer >= 0", path=path, line=line)
        return number

    low, high = bound("minBytes") or 0, bound("maxBytes")
    if high == 0 or (high is not None and high >= (1 << 63) - 1):
        high = None
    if high is not None and high <= low:
        raise PlanError(f"<algo> selects no size: minBytes={low} and maxBytes={high}", path=path, line=line)
    return low, high


def _parse(text, path):
    """Elements and their line numbers (ElementTree's builder fed by expat,
    which knows the lines)."""
    builder = ET.TreeBuilder()
    lines: dict = {}
    parser = _expat(text, path)

    def start(tag, attrs):
        lines[builder.start(tag, attrs)] = parser.CurrentLineNumber

    parser.StartElementHandler = start
    parser.EndElementHandler = builder.end
    _feed(parser, text, path)
    return builder.close(), lines


def _expat(text, path):
    """An expat parser for MSCCL XML ``text`` that refuses DTDs and entity
    declarations (no expansion tricks in files we are handed)."""
    if not isinstance(text, (str, bytes)):
        raise PlanError(f"MSCCL XML must be str or bytes, got {type(text).__name__}", path=path)
    parser = expat.ParserCreate()

    def refuse(*_):
        raise PlanError("MSCCL XML must not contain a DTD or entity declarations", path=path,
                        line=parser.CurrentLineNumber)

    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    return parser


_DECLARED = re.compile(rb"""\s*<\?xml\s[^>]*?encoding\s*=\s*["']([^"']*)["']""")
_UTF8 = ("utf-8", "utf8")


def _feed(parser, text, path) -> None:
    try:
        parser.Parse(text, True)
    except expat.ExpatError as exc:
        if isinstance(text, bytes):
            _check_utf8(text, path)
        raise PlanError(f"not well-formed XML: {expat.ErrorString(exc.code)}", path=path, line=exc.lineno,
                        column=exc.offset + 1) from None
    except UnicodeEncodeError as exc:            # str input that is not Unicode text (a lone surrogate)
        raise PlanError(f"character {exc.start} of the text is not Unicode text ({exc.reason})", path=path) from None
    except (LookupError, ValueError) as exc:     # pyexpat's codec lookup for an unknown declared encoding
        declared = _declared_encoding(text)
        if declared is None or declared.lower() in _UTF8:
            raise
        raise PlanError(f"the XML declaration names the encoding {shown(declared)!r}, which msc cannot read "
                        f"({shown(exc)})", path=path, line=1) from None


def _declared_encoding(text) -> str | None:
    head = text[:1024] if isinstance(text, bytes) else text[:1024].encode("utf-8", "replace")
    found = _DECLARED.match(head)
    return found.group(1).decode("ascii", "replace") if found else None


def _check_utf8(data: bytes, path) -> None:
    """A PlanError naming the first byte that is not UTF-8, if the text
    should be UTF-8 (no declared encoding, or UTF-8) and is not."""
    declared = _declared_encoding(data)
    if (declared is not None and declared.lower() not in _UTF8) or data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset {exc.start} ({exc.reason})",
                        path=path or "<plan>", line=data.count(b"\n", 0, exc.start) + 1) from None


class _Reader:
    def __init__(self, lines: dict, path: str | None):
        self.lines, self.path = lines, path
        # logical buffer -> (physical buffer, chunk offset) on a rank; the layout's in place
        self.alias = lambda rank, buffer: (buffer, 0)

    def error(self, el, message: str, **where) -> PlanError:
        return PlanError(clipped(message), line=self.lines.get(el), path=self.path, **where)

    def text(self, el, attr: str, **where) -> str:
        value = el.get(attr)
        if value is None:
            raise self.error(el, f"<{el.tag}> has no attribute {attr!r}", **where)
        return value

    def int(self, el, attr: str, low: int | None = None, high: int | None = None, *, default=None,
            bounds=_INT32, **where) -> int:
        if default is not None and el.get(attr) is None:
            return default
        value = self.text(el, attr, **where)
        number = _integer(value)
        if number is None or not bounds[0] <= number <= bounds[1]:
            raise self.error(el, f"<{el.tag}> attribute {attr}={value!r:.40} is not an integer "
                                 f"(of at most {bounds[1].bit_length() + 1} bits)", **where)
        if (low is not None and number < low) or (high is not None and number > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise self.error(el, f"<{el.tag}> attribute {attr}={number} must be {span}", **where)
        return number

    def children(self, el, tag: str, **where) -> list:
        for child in el:
            if child.tag != tag:
                raise self.error(child, f"unexpected element <{shown(child.tag)}> in <{el.tag}> (expected <{tag}>)",
                                 **where)
        return list(el)

    # -- the algorithm --------------------------------------------------------
    def plan(self, algo, slots: int | None, runtime: str | None = None) -> Plan:
        if algo.tag != "algo":
            raise self.error(algo, f"the root element is <{shown(algo.tag)}>, expected <algo>")
        name = self.text(algo, "name")
        protocol = self.text(algo, "proto")
        if protocol not in PROTOCOL_NAMES:
            raise self.error(algo, f"<algo> proto={protocol!r:.40} is not one of {', '.join(PROTOCOL_NAMES)}")
        coll = self.text(algo, "coll")
        if coll not in COLLECTIVES:
            raise self.error(algo, f"<algo> coll={coll!r:.40} is not a collective msc knows "
                                   f"({', '.join(COLLECTIVES)})")
        collective = COLLECTIVES[coll]
        n = self.int(algo, "ngpus", 1)
        nchunks = self.int(algo, "nchunksperloop", 1)
        nchannels = self.int(algo, "nchannels", 1)
        inplace = bool(self.int(algo, "inplace", 0, 1))
        root = self.int(algo, "msc_root", 0, n - 1, default=0)
        if slots is None:
            slots = self.int(algo, "msc_slots", 1, default=0) or self.capacity(protocol, runtime)
        extra = dict(protocol=protocol, slots=slots, root=root,
                     instances=self.int(algo, "msc_instances", 1, default=1),
                     tile=self.int(algo, "msc_tile", 0, default=0))
        gpus = self.children(algo, "gpu")
        if len(gpus) != n:
            raise self.error(algo, f"<algo> has ngpus={n} but {len(gpus)} <gpu> elements")
        by_id = {}
        for gpu in gpus:
            rank = self.int(gpu, "id", 0, n - 1)
            if rank in by_id:
                raise self.error(gpu, f"<gpu id={rank}> appears twice", rank=rank)
            by_id[rank] = gpu
        # a built-in MSCCL lacks, exported as custom by msc: its own layout (in place: its aliasing, not
        # the custom collectives' one buffer)
        with_contract = collective == "custom" and algo.get("msc_contract") is not None    # msc wrote what it requires
        builtin = algo.get("msc_collective") if with_contract else None
        builtin = builtin if builtin in SPECS else None
        k, sizes, layout = self.geometry(algo, builtin or collective, n, nchunks, inplace, root, gpus)
        if layout is not None and inplace:
            self.alias = layout.alias
        ranks = tuple(self.rank(by_id[r], r, n, nchannels, sizes) for r in range(n))
        if with_contract:
            geometry_k = k
            collective, k, extra["contract"] = self.contract(algo, sizes)
            if builtin is not None:
                if k != geometry_k:
                    raise self.error(algo, f"<algo> msc_chunk_factor={k}, but {builtin} with nchunksperloop={nchunks} "
                                           f"and {n} gpus has chunk factor {geometry_k}")
                extra["contract"] = self.builtin_contract(algo, collective, n, k, root, extra["contract"])
        plan = Plan(name, collective, n, k, inplace, sizes["input"], sizes["output"], ranks, **extra)
        try:
            check_plan(plan)
        except PlanError as exc:
            raise self.located(exc, by_id) from None
        return plan

    def builtin_contract(self, algo, collective: str, n: int, k: int, root: int, contract) -> None:
        """None (a built-in's plan carries no contract) where ``contract`` is the built-in's own."""
        if contract != contract_of(get_collective(collective), n, k, root):
            raise self.error(algo, f"<algo> msc_collective={collective!r} is built in, but msc_contract is not what "
                                   f"{collective} requires at {n} ranks and chunk factor {k}")
        return None

    def contract(self, algo, sizes) -> tuple:
        """(collective name, chunk factor, Contract) from msc's attributes of a custom collective."""
        name = self.text(algo, "msc_collective")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name.lower() == "custom":
            raise self.error(algo, f"<algo> msc_collective={name!r:.40} is not a collective name")
        k = self.int(algo, "msc_chunk_factor", 1, max(1, sizes["input"], sizes["output"]))
        rows = []
        for row in algo.get("msc_contract").split(";"):
            if not row.strip():
                continue
            m = re.fullmatch(r"\s*(post|pre)\s+([0-9]{1,9})\s*:(.*)", row, flags=re.S)
            if m is None:
                raise self.error(algo, f"<algo> msc_contract: {row.strip()[:40]!r} is not a row 'post R: ...' or "
                                       f"'pre R: ...'")
            rows.append((m[1], int(m[2]), m[3].split(), self.lines.get(algo)))
        try:
            return name, k, build_contract(rows)
        except PlanError as exc:          # its message without a place: the <algo> element's
            raise self.error(algo, f"<algo> msc_contract: {str(exc).removeprefix('<plan>: ')}") from None

    def capacity(self, protocol: str, runtime: str | None) -> int:
        """Slots for XML that records none: the runtimes' (a warning where
        they differ and one was assumed)."""
        found = xml_capacity(protocol, runtime)
        if found.assumed:
            warnings.warn(f"{self.path or '<xml>'}: {found.assumed}", CapacityWarning, stacklevel=4)
        return found.slots

    def geometry(self, algo, collective, n, nchunks, inplace, root, gpus):
        """Chunk factor and the plan's logical sizes, from nchunksperloop,
        checked against every gpu's i_chunks/o_chunks as the runtime does (a
        count is either 0, unused, or nchunksperloop / its multiplier)."""
        if collective == "custom":
            ins = [self.int(g, "i_chunks", 0) for g in gpus]
            outs = [self.int(g, "o_chunks", 0) for g in gpus]
            if not inplace:
                return 1, {"input": max(ins), "output": max(outs)}, None
            # one buffer (sendbuff == recvbuff): i and o name it from chunk 0
            size = max(ins + outs)
            self.alias = lambda rank, buffer: ("input", 0) if buffer == "output" else (buffer, 0)
            return 1, {"input": size, "output": max(outs) or size}, None
        units = max(SPECS[collective].units(n))             # nchunksperloop = units * k
        if nchunks % units:
            raise self.error(algo, f"{collective}: nchunksperloop={nchunks} is not a multiple of ngpus={n}")
        k = nchunks // units
        try:
            layout = get_collective(collective).layout(n, k, inplace, root)
        except MscError as exc:
            raise self.error(algo, f"{collective} with {n} ranks and chunk factor {k}: {exc}") from None
        sizes = layout.logical_sizes
        for gpu in gpus:
            for attr, buf in (("i_chunks", "input"), ("o_chunks", "output")):
                have = self.int(gpu, attr, 0)
                if have not in (0, sizes[buf]):
                    raise self.error(gpu, f"<gpu> {attr}={have}, but {collective} with nchunksperloop={nchunks} "
                                          f"and {n} gpus has {sizes[buf]} {buf} chunks (or 0: unused)")
        return k, dict(sizes), layout

    def located(self, exc: PlanError, by_id: dict) -> PlanError:
        """A plan_check error with the line of the element it names."""
        el = by_id.get(exc.rank)
        if el is not None and exc.tb is not None and exc.tb < len(el):
            el = sorted(el, key=lambda t: int(t.get("id")))[exc.tb]
            if exc.step is not None and exc.step < len(el):
                el = el[exc.step]
        located = PlanError(clipped(str(exc)), line=self.lines.get(el), path=self.path)
        located.rank, located.tb, located.step = exc.rank, exc.tb, exc.step
        return located

    # -- one gpu ----------------------------------------------------------------
    def rank(self, gpu, r: int, n: int, nchannels: int, sizes: dict) -> RankPlan:
        declared = {"i": self.int(gpu, "i_chunks", 0, rank=r), "o": self.int(gpu, "o_chunks", 0, rank=r),
                    "s": self.int(gpu, "s_chunks", 0, rank=r)}
        tbs = {}
        for el in self.children(gpu, "tb", rank=r):
            t = self.int(el, "id", 0, rank=r)
            if t in tbs:
                raise self.error(el, f"<tb id={t}> appears twice", rank=r)
            tbs[t] = el
        if sorted(tbs) != list(range(len(tbs))):
            missing = min(set(range(len(tbs))) - set(tbs))
            raise self.error(gpu, f"threadblock ids must be 0..{len(tbs) - 1}; <tb id={missing}> is missing",
                             rank=r)
        elements = [tbs[t] for t in range(len(tbs))]
        steps = [self.children(el, "step", rank=r, tb=t) for t, el in enumerate(elements)]
        threadblocks = tuple(self.threadblock(el, r, t, n, nchannels, declared, steps)
                             for t, el in enumerate(elements))
        return RankPlan(r, declared["s"], threadblocks)

    def threadblock(self, el, r, t, n, nchannels, declared, all_steps) -> Threadblock:
        where = dict(rank=r, tb=t)
        peers = []
        for attr in ("send", "recv"):
            peer = self.int(el, attr, -1, n - 1, **where)
            if peer == r:
                raise self.error(el, f"<tb> {attr}={peer} is its own gpu", **where)
            peers.append(None if peer == -1 else peer)
        channel = self.int(el, "chan", 0, nchannels - 1, **where)
        steps, pending = [], None     # pending: the first nop of a run not yet closed by a real step
        chain = _Chain()
        for s, step_el in enumerate(all_steps[t]):
            step, dep = self.step(step_el, r, t, s, declared, all_steps)
            if step.op is StepOp.NOP:
                if dep is None:
                    raise self.error(step_el, "a nop without a dependency (depid=-1) shifts the runtime's "
                                              "step numbering", rank=r, tb=t, step=s)
                pending = s if pending is None else pending
            elif pending is not None:
                if dep is None:
                    raise self.error(step_el, f"the nops from step {pending} must be followed by a step with a "
                                              f"dependency (the runtime refuses this)", rank=r, tb=t, step=s)
                pending = None
            problem = chain.add(step_el, step, dep)
            if problem:
                raise self.error(step_el, problem, rank=r, tb=t, step=s)
            steps.append(step)
        return Threadblock(t, peers[0], peers[1], channel, tuple(steps))

    def step(self, el, r, t, s, declared, all_steps) -> tuple[Step, tuple | None]:
        where = dict(rank=r, tb=t, step=s)
        if self.int(el, "s", **where) != s:
            raise self.error(el, f"<step s={shown(el.get('s').strip())}> is step {s} of its threadblock "
                                 f"(s must count 0, 1, ...)",
                             **where)
        kind = self.text(el, "type", **where)
        op = TYPES.get(kind)
        if op is None:
            raise self.error(el, f"<step> type={kind!r:.40} is not an MSCCL step type ({', '.join(TYPES)})",
                             **where)
        count = self.int(el, "cnt", 0 if op is StepOp.NOP else 1, **where)
        operands = {}
        for side in ("src", "dst"):
            letter = self.text(el, side + "buf", **where)
            if letter not in BUFFERS:
                raise self.error(el, f"<step> {side}buf={letter!r:.40} is not i, o or s", **where)
            operands[side] = (letter, self.int(el, side + "off", -1, **where))
        depid = self.int(el, "depid", -1, len(all_steps) - 1, **where)
        deps = self.int(el, "deps", **where)
        hasdep = self.int(el, "hasdep", 0, 1, **where)
        dep = None
        if depid >= 0:
            dep = (depid, deps)
            self.check_dep(el, dep, all_steps, where)
        if hasdep and op is StepOp.NOP:
            raise self.error(el, "hasdep=1 on a nop: the runtime signals nothing for nops", **where)
        src = self.operand(el, "src", operands["src"], count, declared, where) if op.nsrc != "0" else None
        dst = self.operand(el, "dst", operands["dst"], count, declared, where) if op.has_dst else None
        srcs = (dst, src) if op is StepOp.REDUCE else ((src,) if src else ())
        if op is StepOp.NOP:
            count = 1   # a plan step moves >= 1 chunk; a nop moves none
        return Step(op, srcs, dst, count, (dep,) if dep else ()), dep

    def operand(self, el, side, operand, count, declared, where) -> Slice:
        letter, offset = operand
        if offset < 0 or offset + count > declared[letter]:
            raise self.error(el, f"<step> {side}buf={letter} {side}off={offset} cnt={count} lies outside the "
                                 f"{declared[letter]} chunks the <gpu> declares for {letter}", **where)
        buffer, base = self.alias(where["rank"], BUFFERS[letter])
        return Slice(buffer, base + offset, count)

    def check_dep(self, el, dep, all_steps, where):
        dt, ds = dep
        targets = all_steps[dt]
        if not 0 <= ds < len(targets):
            raise self.error(el, f"depends on step {ds} of threadblock {dt}, which has {len(targets)} steps",
                             **where)
        target = targets[ds]
        if target.get("type") == StepOp.NOP.xml:
            raise self.error(el, f"depends on threadblock {dt} step {ds}, a nop, which the runtime never signals",
                             **where)
        if _integer(target.get("hasdep") or "") != 1:
            raise self.error(el, f"depends on threadblock {dt} step {ds}, which lacks hasdep=\"1\": the runtime "
                                 f"would never signal it", **where)


class _Chain:
    """The runtime's fusion of consecutive re steps (same destination and
    source buffer, no dependency on the later one, no hasdep on the earlier
    one, at most MAX_REDUCE_FUSION reductions per threadblock before a reset)
    into one pass that reads the destination once and uses the last cnt.
    ``add`` says what is wrong when that pass differs from the steps in turn."""

    def __init__(self):
        self.key = None          # (dst buffer, dst index, src buffer) of the open chain
        self.dst = None
        self.count = None
        self.reductions = 0

    def add(self, el, step: Step, dep) -> str | None:
        if step.op is StepOp.NOP:
            return None          # nops leave a chain open
        if step.op is not StepOp.REDUCE:
            self.key = None
            return None
        dst, src = step.dst, step.srcs[1]
        key = (dst.buffer, dst.index, src.buffer)
        fused = key == self.key and dep is None
        if src != dst and _overlap(src, dst) or fused and _overlap(src, dst):
            return (f"re source {src} overlaps its destination {dst}; the runtime's pass would read it " +
                    ("before the earlier re steps of its chain wrote it" if fused else "while writing it"))
        if fused and step.count != self.count:
            return (f"the runtime fuses this re step (cnt={step.count}) with the re steps before it "
                    f"(cnt={self.count}) into one pass of cnt={step.count}")
        self.reductions += 1
        hasdep = el.get("hasdep") == "1"
        self.key = None if hasdep or self.reductions == MAX_REDUCE_FUSION else key
        self.count = step.count
        return None


def _overlap(a: Slice, b: Slice) -> bool:
    return a.buffer == b.buffer and a.index < b.index + b.count and b.index < a.index + a.count
