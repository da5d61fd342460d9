"""Running a one-sided (MSCCL++) plan in msc's model of its executor: the
buffers of every rank, the channel and device semaphores, barriers and
packets, and a scheduler that runs each threadblock until it blocks, keeping
a vector clock per threadblock and recording every access with the clock it
happened at. A run can be several calls back to back: what the executor
keeps between calls (scratch, semaphores) is shared, each call has its
caller's own input and output, and a rank's kernel ends (all its
threadblocks) before its next call begins. msc.verification.onesided checks
what a run recorded; its docstring gives the model."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from msc.errors import DeadlockError, ExecutionError, PlanError
from msc.ir.onesided import SWITCH_OPS, OneSidedPlan, Operand, Operation
from msc.units import is_floating

ELEMENT = np.dtype(np.int32)                  # what msc verify runs plans on
UNIT = 16                                     # the executor's buffer_alignment
POISON = np.int32(-(1 << 30))                 # what unwritten int32 output and scratch hold
MAX_MODEL_BYTES = 1 << 28                     # all ranks' buffers together, in the model
MAX_INSTANCES = 1 << 22                       # operations run (a pipeline's body once per slice), all threadblocks
PACKET_READS = {"rppkt": 1, "upkt": 1, "repkt": None, "respkt": None, "recpkt": None, "recspkt": None,
                "gstorepkt": 1}


@dataclass
class Instance:
    """One execution of an operation: a pipeline's body runs once per slice; ``call``: which of the run's calls."""

    op: Operation
    index: int
    offset: int = 0
    unit: int = 1 << 62
    label: str = ""
    call: int = 0


END_OF_CALL = Operation("end of call")          # a rank's kernel returns: all its threadblocks, before its next call


def calls_for(plan: OneSidedPlan) -> int:
    """How many calls msc verify runs back to back: two, so what one call
    leaves in the executor's scratch and semaphores meets the next call's
    operations; three with a double scratch buffer (calls alternate halves:
    the third is the first to reuse the first's half)."""
    return 3 if plan.double_scratch else 2


@dataclass
class Block:
    rank: int
    tb: int
    g: int
    program: list
    known: np.ndarray
    pending: np.ndarray
    pc: int = 0
    seq: int = 0
    synced: int = 0
    proxy: int | None = None      # a port channel's host proxy working for threadblock ``tb`` (no program)

    def published(self) -> np.ndarray:
        clock = np.maximum(self.known, self.pending)
        clock[self.g] = self.synced
        return clock

    def finished(self) -> np.ndarray:
        """What the block knows once all its threads are done (its kernel's end)."""
        clock = np.maximum(self.known, self.pending)
        clock[self.g] = self.seq
        return clock


@dataclass
class Access:
    lo: int
    hi: int
    write: bool
    g: int
    seq: int
    clock: np.ndarray
    who: str
    remote_from: int | None = None      # the accessing rank, when it is not the buffer's owner
    switch: bool = False                # through a switch channel (multimem)
    call: int = 0                       # the accessing operation's call


@dataclass
class State:
    signals: dict = field(default_factory=dict)       # (from, to, q, kind) -> [published clocks]
    waits: dict = field(default_factory=dict)         # (from, to, q, kind) -> waits done
    sems: dict = field(default_factory=dict)          # (rank, id) -> value
    sem_clock: dict = field(default_factory=dict)     # (rank, id) -> join of releases
    barriers: dict = field(default_factory=dict)      # (rank, id) -> [blocks arrived this round]
    released: dict = field(default_factory=dict)      # g -> clock a completed barrier hands it
    accesses: dict = field(default_factory=dict)      # (rank, buffer key) -> [Access]


def chunk_bytes_for(plan: OneSidedPlan) -> int:
    """A chunk size that runs every pipeline over several slices, not a whole number of them."""
    size = 64
    for gpu in plan.gpus:
        for ops in gpu.threadblocks:
            for op in ops:
                if op.body and op.num_chunks:
                    size = max(size, math.ceil(op.unit_size * 3 / (2 * op.num_chunks) / UNIT) * UNIT)
    return size


def check_model_bytes(total: int, chunk: int, calls: int) -> None:
    if total > MAX_MODEL_BYTES:
        raise PlanError(f"the plan's buffers take {total} bytes at {chunk}-byte chunks over {calls} call(s), over "
                        f"the {MAX_MODEL_BYTES} msc's model of the executor runs it with")


def check_inputs_fit(plan: OneSidedPlan, chunk: int, calls: int = 1) -> None:
    """Before the inputs are made: every call's inputs fit in the model (its
    buffers hold at least them; the Machine counts the rest)."""
    check_model_bytes(sum(g.input_chunks for g in plan.gpus) * chunk * calls, chunk, calls)


def poison(dtype: np.dtype):
    """What unwritten output and scratch hold: NaN for floats, a value far from any input for integers."""
    if is_floating(dtype):
        return np.array(np.nan).astype(dtype)
    return np.array(POISON).astype(dtype) if dtype.itemsize >= 4 else np.iinfo(dtype).min


def _slice(lo: int, size: int, group) -> tuple[int, int]:
    """The bytes of [lo, lo+size) a threadblock group member takes (calcOffset)."""
    if group is None:
        return lo, lo + size
    index, slices = group
    units = size // UNIT
    start = lambda i: (i * (units // slices) + min(i, units % slices)) * UNIT
    return lo + start(index), lo + start(index + 1)


class Machine:
    """The buffers and synchronisation of every rank during one run of ``calls`` calls."""

    def __init__(self, plan: OneSidedPlan, layout, chunk: int, dtype=ELEMENT, calls: int = 1):
        self.plan, self.layout, self.chunk, self.calls = plan, layout, chunk, calls
        self.dtype = np.dtype(dtype)
        self.poison = poison(self.dtype)
        self.mem: dict = {}
        self.key_call: dict = {}      # buffer key -> the first call that uses it (scratch: shared by calls)
        self.packets: dict = {}       # (rank, buffer key, call) -> (payload, writer event index or -1)
        self.writers: list = []       # packet writer events: (g, seq, clock)
        self.state = State()
        sizes = [{self.key(buffer, c): chunks for c in range(calls) for buffer, chunks in self.physical(gpu).items()}
                 for gpu in plan.gpus]
        check_model_bytes(sum(sum(s.values()) for s in sizes) * chunk, chunk, calls)
        for gpu, physical in zip(plan.gpus, sizes):
            for key, chunks in physical.items():
                self.mem[(gpu.rank, key)] = np.full(chunks * chunk // self.dtype.itemsize, self.poison, self.dtype)

    def key(self, buffer: str, call: int) -> str:
        """The buffer a call's operand reaches: the executor's scratch is the
        same in every call (a double scratch buffer's calls alternate
        halves); input and output are each call's caller's."""
        if buffer == "scratch":
            key = "scratch (its other half)" if self.plan.double_scratch and call % 2 else "scratch"
        else:
            key = buffer if call == 0 else f"{buffer} (call {call + 1})"
        self.key_call.setdefault(key, call)
        return key

    def physical(self, gpu) -> dict[str, int]:
        sizes = {"input": gpu.input_chunks, "output": gpu.output_chunks, "scratch": gpu.scratch_chunks}
        if self.plan.inplace:
            alias, target, offset = self.layout.alias(gpu.rank)
            sizes[target] = max(sizes[target], offset + sizes[alias])
            del sizes[alias]
        return sizes

    def where(self, operand: Operand, group, offset: int, unit: int, who: str, call: int = 0) -> tuple[str, int, int]:
        """(buffer key, first byte, end byte) of an operand in its physical buffer in ``call``."""
        key, base = operand.buffer, 0
        if self.plan.inplace:
            alias, target, at = self.layout.alias(operand.rank)
            if key == alias:
                key, base = target, at * self.chunk
        key = self.key(key, call)
        lo, hi = _slice(base + operand.index * self.chunk, operand.size * self.chunk, group)
        lo = min(lo + offset, hi)
        hi = min(hi, lo + unit)
        arr = self.mem.get((operand.rank, key))
        if arr is None or hi > arr.size * self.dtype.itemsize:
            raise PlanError(f"{who}: {operand} is outside rank {operand.rank}'s {operand.buffer} buffer "
                            f"({(0 if arr is None else arr.size * self.dtype.itemsize) // self.chunk} chunks)")
        return key, lo, hi

    def outputs(self, call: int) -> list[np.ndarray]:
        """Each rank's logical output after ``call``."""
        out = []
        for gpu in self.plan.gpus:
            key, lo, hi = self.where(Operand(gpu.rank, "output", 0, gpu.output_chunks), None, 0, 1 << 62, "output", call)
            out.append(self.view(gpu.rank, key, lo, hi).copy())
        return out

    def view(self, rank: int, key: str, lo: int, hi: int) -> np.ndarray:
        s = self.dtype.itemsize
        return self.mem[(rank, key)][lo // s:hi // s]

    def packet_store(self, rank: int, key: str, call: int = 0):
        """A call's packets in a buffer: their flag is the call's, so a read
        takes only packets its own call wrote (the bytes are shared: the
        accesses recorded say when calls overlap)."""
        if (rank, key, call) not in self.packets:
            n = self.mem[(rank, key)].size
            self.packets[(rank, key, call)] = (np.full(n, self.poison, self.dtype), np.full(n, -1, np.int64))
        return self.packets[(rank, key, call)]

    def record(self, rank, key, lo, hi, write, block, clock, who, packet=False, switch=False, call=0):
        if packet:                   # packets take twice the bytes they carry, in the same buffer
            lo, hi = 2 * lo, 2 * hi
        remote = block.rank if block.rank != rank else None
        self.state.accesses.setdefault((rank, key), []).append(
            Access(lo, hi, write, block.g, block.seq, clock, who, remote, switch, call))


class Layout:
    """Which collective the plan computes, at which chunk factor and root, and
    in place where its input sits in its output (or the reverse)."""

    def __init__(self, plan: OneSidedPlan, collective=None, root: int | None = None):
        from msc.dsl.collectives import get_collective
        from msc.errors import MscError

        self.n = plan.num_ranks
        self.root = int(plan.meta_value("msc_root", 0) if root is None else root)
        try:
            self.collective = get_collective(collective or plan.collective)
        except MscError:
            self.collective = None
        gpu = plan.gpus[0]
        self.k = self._chunk_factor(gpu.input_chunks, gpu.output_chunks)

    def _chunk_factor(self, inputs: int, outputs: int) -> int | None:
        """The chunk factor at which the collective has these buffer sizes
        (the sizes grow with it: no larger one than the sizes, nor msc's limit)."""
        from msc.errors import MscError
        from msc.ir.limits import MAX_CHUNK_FACTOR

        if self.collective is None:
            return None
        for k in range(1, min(max(inputs, outputs, 1), MAX_CHUNK_FACTOR) + 1):
            try:
                sizes = (self.collective.input_chunks(self.n, k), self.collective.output_chunks(self.n, k))
            except MscError:             # a collective known at one chunk factor only (read from a plan)
                continue
            if sizes == (inputs, outputs):
                return k
        return None

    @property
    def checkable(self) -> bool:
        """Whether the results can be checked: a collective whose buffer sizes
        the plan's are, at some chunk factor."""
        return self.k is not None

    @property
    def builtin(self) -> bool:
        from msc.dsl.collectives import BUILTIN

        return type(self.collective) is BUILTIN.get(self.collective.name)

    def wrong(self, inputs: list, outputs: list, count: int) -> list[int]:
        """Wrong elements per rank (msc.verification.reference), sum being the
        executor's only reduction; ``count`` elements per data unit."""
        from msc.verification import reference

        if self.builtin:
            return reference.check(self.collective.name, inputs, outputs, op="sum", root=self.root)
        return reference.check_stated(self.collective, inputs, outputs, k=self.k, count=count, op="sum",
                                      root=self.root)

    def alias(self, rank: int) -> tuple[str, str, int]:
        if self.collective is not None and self.k is not None:
            return self.collective.inplace_alias(rank, self.n, self.k)
        return ("output", "input", 0)


def _program(ops, chunk: int, gpu, call: int = 0) -> list[Instance]:
    """A threadblock's operations as the executor runs them: a pipeline's body
    once per slice of unit_size bytes over num_chunks chunks."""
    out = []
    of = f" of call {call + 1}" if call else ""
    for i, op in enumerate(ops):
        if not op.body:
            out.append(Instance(op, i, label=f"operation {i} ({op.name}){of}", call=call))
            continue
        if op.unit_size % UNIT:
            raise PlanError(f"operation {i}: pipeline unit_size {op.unit_size} is not a multiple of the executor's "
                            f"{UNIT}-byte units", rank=gpu.rank)
        iterations = math.ceil(op.num_chunks * chunk / op.unit_size)
        if iterations * len(op.body) > MAX_INSTANCES:
            raise PlanError(f"operation {i}: a pipeline of {iterations} slices of {len(op.body)} operations, over the "
                            f"{MAX_INSTANCES} msc's model of the executor runs", rank=gpu.rank)
        for it in range(iterations):
            for j, inner in enumerate(op.body):
                out.append(Instance(inner, i, it * op.unit_size, op.unit_size,
                                    f"operation {i} (pipeline, its operation {j} {inner.name}, slice {it}){of}", call))
    return out


class Run:
    """One execution of a plan on the Machine's data, its calls back to back."""

    def __init__(self, plan: OneSidedPlan, machine: Machine):
        self.plan, self.m, st = plan, machine, machine.state
        self.calls = machine.calls
        self.blocks = []
        for gpu in plan.gpus:
            for t, ops in enumerate(gpu.threadblocks):
                self.blocks.append(Block(gpu.rank, t, len(self.blocks), _program(ops, machine.chunk, gpu), None, None))
        if sum(len(b.program) for b in self.blocks) > MAX_INSTANCES:      # one call's, before the next are made
            raise PlanError(f"the plan runs over {MAX_INSTANCES} operations (pipelines' slices counted), more than "
                            f"msc's model of the executor runs")
        for b in self.blocks:
            ops = plan.gpus[b.rank].threadblocks[b.tb]
            for c in range(1, self.calls):
                b.program += [Instance(END_OF_CALL, -1, label=f"the end of call {c}", call=c)]
                b.program += _program(ops, machine.chunk, plan.gpus[b.rank], c)
        self.threadblocks = {gpu.rank: len(gpu.threadblocks) for gpu in plan.gpus}
        self.agents = {}                  # (g, port channel) -> the proxy Block doing that threadblock's transfers
        for b in list(self.blocks):
            for c in sorted({c for inst in b.program if inst.op.port for c in inst.op.channels}):
                self.agents[(b.g, c)] = Block(b.rank, b.tb, len(self.blocks), [], None, None, proxy=c)
                self.blocks.append(self.agents[(b.g, c)])
        for b in self.blocks:
            b.known = np.zeros(len(self.blocks), np.int64)
            b.pending = np.zeros(len(self.blocks), np.int64)
        for gpu in plan.gpus:
            for s, value in enumerate(gpu.semaphores):
                st.sems[(gpu.rank, s)] = value
        self.events = 0
        self.starts = np.ones((self.calls, len(self.blocks)), np.int64)  # a block's first step of each call
        self.call_ends: list[dict] = [{} for _ in range(self.calls)]     # call -> rank -> what its kernel's end knows

    # -- scheduling ----------------------------------------------------------------
    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for b in self.blocks:
                while b.pc < len(b.program) and self.try_step(b):
                    b.pc += 1
                    moved = True
                    self.events += 1
        stuck = [b for b in self.blocks if b.pc < len(b.program)]
        if stuck:
            raise self.deadlock(stuck)
        for b in self.blocks:
            if b.proxy is None:
                self.call_ends[-1][b.rank] = np.maximum(self.call_ends[-1].get(b.rank, 0), b.finished())

    def ends(self, call: int) -> dict:
        """rank -> what its threadblocks know when its kernel of ``call``
        returns (proxies excluded: they outlive it)."""
        return self.call_ends[call]

    def deadlock(self, stuck) -> DeadlockError:
        lines = [f"rank {b.rank} threadblock {b.tb} {b.program[b.pc].label}: {self.blocked_on(b)}" for b in stuck]
        shown = "\n  ".join(lines[:12]) + (f"\n  ... and {len(lines) - 12} more" if len(lines) > 12 else "")
        return DeadlockError(f"deadlock: {len(stuck)} threadblock(s) wait forever:\n  {shown}",
                             [(b.rank, b.tb, b.program[b.pc].index, self.blocked_on(b)) for b in stuck])

    def blocked_on(self, b: Block) -> str:
        op = b.program[b.pc].op
        if op.name in ("wait", "rlxwait"):
            keys = [self.wait_key(b.rank, c, op.port) for c in op.channels]
            late = [k for k in keys if len(self.m.state.signals.get(k, ())) <= self.m.state.waits.get(k, 0)]
            return "; ".join(f"wait {self.m.state.waits.get(k, 0) + 1} on its {k[3]} channel from rank {k[0]} ("
                             f"{k[3]} channel {k[2]} of that pair), which rank {k[0]} signals only "
                             f"{len(self.m.state.signals.get(k, ()))} time(s)" for k in late)
        if op.name == "sem_acquire":
            return f"acquires device semaphore(s) {list(op.semaphores)}, which nothing releases"
        if op.name == "barrier":
            have = len(self.m.state.barriers.get((b.rank, op.barrier[0]), ()))
            return f"barrier {op.barrier[0]} for {op.barrier[1]} threadblocks, which only {have} reach"
        if op is END_OF_CALL:
            return "its kernel's other threadblocks do not finish the call"
        return "reads packets that no operation writes in this call"

    def wait_key(self, rank: int, channel: int, port: bool = False) -> tuple[int, int, int, str]:
        peer, q = self.plan.channel_ordinal(rank, channel, port)
        return (peer, rank, q, "port" if port else "memory")

    def signal_key(self, rank: int, channel: int, port: bool = False) -> tuple[int, int, int, str]:
        peer, q = self.plan.channel_ordinal(rank, channel, port)
        return (rank, peer, q, "port" if port else "memory")

    # -- one operation -----------------------------------------------------------------
    def try_step(self, b: Block) -> bool:
        inst = b.program[b.pc]
        op, st = inst.op, self.m.state
        name = op.name
        if name in ("wait", "rlxwait"):
            keys = [self.wait_key(b.rank, c, op.port) for c in op.channels]
            if any(len(st.signals.get(k, ())) <= st.waits.get(k, 0) for k in keys):
                return False
            for k in keys:
                st.waits[k] = st.waits.get(k, 0) + 1
                for clock in st.signals[k][:st.waits[k]]:
                    np.maximum(b.pending, clock, out=b.pending)
            b.seq += 1
            return True
        if name == "sem_acquire":
            keys = [(b.rank, s) for s in op.semaphores]
            self.check_semaphores(b, inst, keys)
            if any(st.sems[k] <= 0 for k in keys):
                return False
            for k in keys:
                st.sems[k] -= 1
                np.maximum(b.pending, st.sem_clock.get(k, b.pending), out=b.pending)
            b.seq += 1
            return True
        if name == "barrier":
            return self.barrier(b, (b.rank, op.barrier[0]), op.barrier[1], Block.published)
        if op is END_OF_CALL:
            return self.end_of_call(b, inst.call)
        if (name in PACKET_READS or (op.port and name == "ppkt")) and not self.packets_ready(b, inst):
            return False
        b.seq += 1
        self.execute(b, inst)
        return True

    def check_semaphores(self, b, inst, keys) -> None:
        for k in keys:
            if k not in self.m.state.sems:
                raise PlanError(f"{inst.label}: device semaphore {k[1]} is not one of the rank's "
                                f"{len(self.plan.gpus[b.rank].semaphores)}", rank=b.rank, tb=b.tb)

    def barrier(self, b: Block, key, count: int, clock_of) -> bool:
        """``count`` threadblocks meet at ``key``; each leaves knowing
        ``clock_of`` of every one of them."""
        st = self.m.state
        if b.g in st.released:
            clock = st.released.pop(b.g)
            b.seq += 1
            b.known = np.maximum(clock, b.known)
            b.pending[:] = 0
            b.known[b.g] = b.synced = b.seq
            return True
        arrived = st.barriers.setdefault(key, [])
        if b not in arrived:
            arrived.append(b)
        if len(arrived) < count:
            return False
        joined = np.max([clock_of(x) for x in arrived], axis=0)
        for x in arrived:
            joined[x.g] = max(joined[x.g], x.seq)
        for x in arrived:
            st.released[x.g] = joined
        st.barriers[key] = []
        return self.barrier(b, key, count, clock_of)

    def end_of_call(self, b: Block, call: int) -> bool:
        """A rank's kernel returns when all its threadblocks have, everything
        they did complete; its next call starts from there (proxies go on)."""
        if not self.barrier(b, (b.rank, "end of call", call), self.threadblocks[b.rank], Block.finished):
            return False
        self.call_ends[call - 1][b.rank] = b.known.copy()
        self.call_ends[call - 1][b.rank][b.g] = b.seq - 1
        self.starts[call][b.g] = b.seq + 1
        return True

    def execute(self, b: Block, inst: Instance) -> None:
        op, st = inst.op, self.m.state
        if op.name == "nop":
            np.maximum(b.known, b.pending, out=b.known)
            b.pending[:] = 0
            b.synced = b.seq
        elif op.name in ("signal", "rlxsignal"):
            for c in op.channels:               # a port channel's signal follows the proxy's earlier transfers
                clock = np.maximum(b.published(), self.agents[(b.g, c)].known) if op.port else b.published()
                st.signals.setdefault(self.signal_key(b.rank, c, op.port), []).append(clock)
        elif op.name == "flush":
            for c in op.channels[:len(op.dsts)]:    # handleFlush flushes op.nOutputs channels
                np.maximum(b.pending, self.agents[(b.g, c)].known, out=b.pending)
        elif op.name == "sem_release":
            keys = [(b.rank, s) for s in op.semaphores]
            self.check_semaphores(b, inst, keys)
            for k in keys:
                st.sems[k] += 1
                st.sem_clock[k] = np.maximum(st.sem_clock.get(k, b.published()), b.published())
        else:
            DataOp(self, b, inst).run()

    def packets_ready(self, b: Block, inst: Instance) -> bool:
        for operand in packet_sources(inst.op) if not (inst.op.port and inst.op.name == "ppkt") else inst.op.srcs:
            key, lo, hi = self.m.where(scratch_of(operand, b.rank), inst.op.group, 0, 1 << 62, inst.label, inst.call)
            _, writer = self.m.packet_store(b.rank, key, inst.call)
            s = self.m.dtype.itemsize
            if (writer[lo // s:hi // s] < 0).any():
                return False
        return True


def packet_sources(op: Operation) -> tuple[Operand, ...]:
    """The operands an operation reads as packets from the rank's scratch."""
    if op.name not in PACKET_READS:
        return ()
    return op.srcs[:1] if PACKET_READS[op.name] == 1 else op.srcs[1:]


def scratch_of(operand: Operand, rank: int) -> Operand:
    """Packet reads come from the rank's own scratch whatever the operand says (the executor's handlers)."""
    return Operand(rank, "scratch", operand.index, operand.size)


class DataOp:
    """Reads, computes and writes of one data or packet operation."""

    def __init__(self, run: Run, b: Block, inst: Instance):
        self.run_, self.m, self.b, self.inst = run, run.m, b, inst
        self.switch = inst.op.name in SWITCH_OPS
        self.actor = b                    # who does the accesses: the threadblock, or its port channel's proxy
        self.clock = b.known.copy()
        self.clock[b.g] = b.seq

    def locate(self, operand: Operand):
        inst = self.inst
        if operand.remote and operand.rank == self.b.rank:
            raise PlanError(f"{inst.label}: a remote buffer of its own rank", rank=self.b.rank, tb=self.b.tb)
        try:
            return self.m.where(operand, inst.op.group, inst.offset, inst.unit, inst.label, inst.call)
        except PlanError as exc:
            raise PlanError(str(exc), rank=self.b.rank, tb=self.b.tb) from None

    def read(self, operand: Operand) -> np.ndarray:
        key, lo, hi = self.locate(operand)
        self.m.record(operand.rank, key, lo, hi, False, self.actor, self.clock, self.inst.label, switch=self.switch,
                      call=self.inst.call)
        return self.m.view(operand.rank, key, lo, hi).copy()

    def write(self, operand: Operand, values: np.ndarray) -> None:
        key, lo, hi = self.locate(operand)
        self.m.record(operand.rank, key, lo, hi, True, self.actor, self.clock, self.inst.label, switch=self.switch,
                      call=self.inst.call)
        self.m.view(operand.rank, key, lo, hi)[:] = self.fit(values, hi - lo, operand)

    def fit(self, values: np.ndarray, nbytes: int, operand: Operand) -> np.ndarray:
        n = nbytes // self.m.dtype.itemsize
        if values.size < n:
            raise ExecutionError(f"{self.inst.label}: writes {nbytes} bytes to {operand} from only "
                                 f"{values.size * self.m.dtype.itemsize}", rank=self.b.rank, tb=self.b.tb)
        return values[:n]

    def read_packets(self, operand: Operand) -> np.ndarray:
        key, lo, hi = self.locate(scratch_of(operand, self.b.rank))
        payload, writer = self.m.packet_store(self.b.rank, key, self.inst.call)
        s = self.m.dtype.itemsize
        for w in np.unique(writer[lo // s:hi // s]):
            g, seq, clock = self.m.writers[w]
            np.maximum(self.clock, clock, out=self.clock)
            self.clock[g] = max(self.clock[g], seq)
            np.maximum(self.b.pending, self.clock, out=self.b.pending)
        self.m.record(self.b.rank, key, lo, hi, False, self.actor, self.clock, self.inst.label, packet=True,
                      call=self.inst.call)
        return payload[lo // s:hi // s].copy()

    def write_packets(self, operand: Operand, values: np.ndarray) -> None:
        key, lo, hi = self.locate(operand)
        payload, writer = self.m.packet_store(operand.rank, key, self.inst.call)
        s = self.m.dtype.itemsize
        payload[lo // s:hi // s] = self.fit(values, hi - lo, operand)
        writer[lo // s:hi // s] = len(self.m.writers)
        self.m.writers.append((self.actor.g, self.actor.seq, self.clock.copy()))
        self.m.record(operand.rank, key, lo, hi, True, self.actor, self.clock, self.inst.label, packet=True,
                      switch=self.switch, call=self.inst.call)

    def source(self, i: int) -> Operand:
        """Put's i-th source: the first source's buffer at the i-th source's chunks (handlePut)."""
        srcs = self.inst.op.srcs
        s = srcs[min(i, len(srcs) - 1)]
        return Operand(srcs[0].rank, srcs[0].buffer, s.index, s.size, srcs[0].remote)

    def need(self, nsrc: int, ndst: int) -> None:
        op = self.inst.op
        if len(op.srcs) < nsrc or len(op.dsts) < ndst:
            raise PlanError(f"{self.inst.label}: {op.name} needs at least {nsrc} source(s) and {ndst} "
                            f"destination(s), has {len(op.srcs)} and {len(op.dsts)}", rank=self.b.rank, tb=self.b.tb)

    def run(self) -> None:
        op = self.inst.op
        name = op.name
        if op.port:
            return self.port_op(op)
        if name == "copy":
            self.need(1, 1)
            self.write(op.dsts[0], self.read(op.srcs[0]))
        elif name in ("put", "pws", "pwsf"):
            self.need(1, 1)
            for i, d in enumerate(op.dsts):
                self.write(d, self.read(self.source(i)))
        elif name == "get":
            self.need(1, 1)
            for s, d in zip(op.srcs, op.dsts):
                self.write(d, self.read(s))
        elif name in ("re", "res", "rre", "rres"):
            self.need(1, 1)
            value = self.reduce([self.read(s) for s in op.srcs])
            self.write(op.dsts[0], value)
            for d in op.dsts[1:] if name in ("res", "rres") else ():
                self.write(d, value)
        elif name in SWITCH_OPS:
            self.switch_op(op)
        else:
            self.packet_op(op)

    def by_proxy(self, channel: int) -> Block:
        """Hand the work to the port channel's proxy: it runs this
        threadblock's triggers on that channel in order, each after what the
        threadblock knew when it pushed it; the accesses are the proxy's."""
        agent = self.run_.agents[(self.b.g, channel)]
        np.maximum(agent.known, self.clock, out=agent.known)
        agent.seq += 1
        agent.known[agent.g] = agent.seq
        self.actor, self.clock = agent, agent.known.copy()
        return agent

    def port_op(self, op: Operation) -> None:
        """put, pws, pwsf, ppkt, rppkt on port channels (handlePut,
        handlePutPackets, handleReadPutPackets): per destination, a transfer
        the proxy makes later; pws signals after it, pwsf also waits for it."""
        name, st = op.name, self.m.state
        if name not in ("put", "pws", "pwsf", "ppkt", "rppkt"):
            raise PlanError(f"{self.inst.label}: {name} has no port-channel form in the executor", rank=self.b.rank,
                            tb=self.b.tb)
        self.need(1, 1)
        if len(op.channels) < len(op.dsts):
            raise PlanError(f"{self.inst.label}: {len(op.dsts)} destinations over {len(op.channels)} port channels "
                            f"(one each)", rank=self.b.rank, tb=self.b.tb)
        if name == "rppkt":
            self.read_packets(op.srcs[0])          # the threadblock waits for this call's packets first
        start = self.clock.copy()
        for i, d in enumerate(op.dsts):
            self.actor, self.clock = self.b, start
            agent = self.by_proxy(op.channels[i])
            src = op.srcs[min(i, len(op.srcs) - 1)]
            if name in ("ppkt", "rppkt"):          # raw packets, scratch to scratch, flags and all
                self.write_packets(d, self.copy_packets(src))
            else:
                self.write(d, self.read(src))
            if name in ("pws", "pwsf"):
                st.signals.setdefault(self.run_.signal_key(self.b.rank, op.channels[i], True), []).append(
                    agent.known.copy())
            if name == "pwsf":
                np.maximum(self.b.pending, agent.known, out=self.b.pending)

    def copy_packets(self, operand: Operand) -> np.ndarray:
        """The proxy's copy of packets in the rank's scratch: whatever is there (no flag check)."""
        if operand.buffer != "scratch":
            raise PlanError(f"{self.inst.label}: ppkt on a port channel copies packets from {operand}; msc models "
                            f"packets in scratch only", rank=self.b.rank, tb=self.b.tb)
        key, lo, hi = self.locate(operand)
        payload, _ = self.m.packet_store(self.b.rank, key, self.inst.call)
        self.m.record(self.b.rank, key, lo, hi, False, self.actor, self.clock, self.inst.label, packet=True,
                      call=self.inst.call)
        s = self.m.dtype.itemsize
        return payload[lo // s:hi // s].copy()

    def switch_op(self, op: Operation) -> None:
        """glres: every member's destination = the sum of the members' sources
        (multimem.ld_reduce then multimem.st, member order here); gstore: every
        member's destination = the local source; gstorepkt: the same with the
        source's packets (this call's), written as packets."""
        src, dst = op.srcs[0], op.dsts[0]
        if op.name == "glres":
            value = self.reduce([self.read(src.on(m)) for m in src.group])
        elif op.name == "gstore":
            value = self.read(src)
        else:
            if src.buffer != "scratch" or dst.buffer != "scratch":
                raise PlanError(f"{self.inst.label}: gstorepkt from {src} to {dst}: packets live in scratch (the "
                                f"executor reads and writes them at the scratch offset)", rank=self.b.rank, tb=self.b.tb)
            value = self.read_packets(src)
            for m in dst.group:
                self.write_packets(dst.on(m), value)
            return
        for m in dst.group:
            self.write(dst.on(m), value)

    def reduce(self, values: list) -> np.ndarray:
        n = values[0].size
        if any(v.size < n for v in values):
            raise ExecutionError(f"{self.inst.label}: reduces operands of different sizes "
                                 f"({', '.join(str(v.size * self.m.dtype.itemsize) for v in values)} bytes)",
                                 rank=self.b.rank, tb=self.b.tb)
        out = values[0].copy()
        for v in values[1:]:
            out += v[:n]
        return out

    def packet_op(self, op: Operation) -> None:
        name = op.name
        if name == "ppkt":
            self.need(1, 1)
            for i, d in enumerate(op.dsts):
                self.write_packets(d, self.read(self.source(i)))
        elif name == "rppkt":
            self.need(1, 1)
            value = self.read_packets(op.srcs[0])
            for d in op.dsts:
                self.write_packets(d, value)
        elif name == "cpkt":
            self.need(1, 1)
            self.write_packets(op.dsts[0], self.read(op.srcs[0]))
        elif name == "upkt":
            self.need(1, 1)
            self.write(op.dsts[0], self.read_packets(op.srcs[0]))
        else:                                  # repkt respkt recpkt recspkt
            copies = name in ("recpkt", "recspkt")
            self.need(1, 2 if copies else 1)
            value = self.reduce([self.read(op.srcs[0])] + [self.read_packets(s) for s in op.srcs[1:]])
            self.write(op.dsts[0], value)
            if copies:
                self.write_packets(op.dsts[1], value)
            for d in op.dsts[(2 if copies else 1):] if name in ("respkt", "recspkt") else ():
                self.write_packets(d, value)
