"""Checking and executing a one-sided (MSCCL++) plan: msc.ir.onesided.

One run does both. The plan's operations execute on random integer data at a
chosen chunk size, in any order the synchronisation allows (the scheduler
runs each threadblock until it blocks): a wait blocks until its peer's
matching signal (the k-th wait on a channel takes the k-th signal of the
paired channel), a device-semaphore acquire until a release, a barrier until
its threadblocks arrive, a packet read until the packets are written. No
threadblock able to move while some are unfinished is a deadlock, reported
per blocked threadblock with its rank, threadblock and operation.

Happens-before is tracked with vector clocks, one component per threadblock.
Threads of a block run an operation in parallel and the executor puts no
__syncthreads between operations, so a signal (run by one thread a channel)
publishes only what the block finished before its last ``nop`` or barrier,
and what a wait acquires reaches the block's data operations only after the
next ``nop``; data operations of one block are taken to be ordered among
themselves (program order), as the DSL's own plans assume. Two accesses to
overlapping bytes of one buffer from different threadblocks, one a write,
neither before the other, are a race; so is a peer's access to a rank's
buffer that nothing on that rank waits for (the rank's kernel can end, and
the next call begin, first). Signals and waits must balance per channel, and
device semaphores end where they began: the executor keeps them across
calls, so the next call would start out of step. The results are compared
with the collective's reference (msc.verification.reference).

Switch channels (NVLS, execution_kernel.hpp): ``glres`` reads the chunk on
every member of the group through the multicast address, sums it (member
order here; the switch's own order, exact for integers) and writes the sum to
every member's destination; ``gstore`` writes a local chunk to every member;
``gstorepkt`` the same with packets. Each of those accesses is recorded on
the member's buffer, so any unordered access to any member's copy races, and
a member's input or output reached before anything shows its call began (a
signal/wait exchange, as MSCCL++'s NVLS plans do first) is reported too.

Port channels go through the host proxy: a ``put``/``pws``/``pwsf``/``ppkt``
/``rppkt`` is done later by a proxy per (threadblock, port channel), in the
order the threadblock pushed them, each after what the threadblock knew when
it pushed it. A port ``signal`` (and pws's) follows the proxy's earlier
transfers on that channel; ``flush`` (on its op.nOutputs channels, as
handleFlush reads them) and pwsf give the threadblock the proxy's progress
after the next ``nop``. A transfer whose source is the caller's input or
output and that the sending rank never learns finished is reported last: its
kernel can return, and its caller overwrite the source, while the proxy
still reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from msc.errors import ExecutionError, RaceError
from msc.ir.onesided import OneSidedPlan, Operand
from msc.verification.onesided_run import (ELEMENT, Access, Layout, Machine, Run, calls_for, check_inputs_fit,
                                           chunk_bytes_for)


@dataclass(frozen=True)
class OneSidedReport:
    name: str
    collective: str
    num_ranks: int
    threadblocks: int
    operations: int
    events: int
    chunk_bytes: int
    seconds: float
    results_checked: bool = True

    def to_dict(self) -> dict:
        return {"plan": self.name, "collective": self.collective, "ranks": self.num_ranks, "format": "mscclpp",
                "threadblocks": self.threadblocks, "operations": self.operations, "events": self.events,
                "chunk_bytes": self.chunk_bytes, "seconds": round(self.seconds, 6), "verified": True,
                "results_checked": self.results_checked}


# -- after the run: races, unfinished remote accesses, balance, results ----------------
def _ordered(a: Access, b: Access) -> bool:
    return a.g == b.g or b.clock[a.g] >= a.seq or a.clock[b.g] >= b.seq


def _name(run: Run, g: int) -> str:
    b = run.blocks[g]
    if b.proxy is not None:
        return f"rank {b.rank} threadblock {b.tb}'s proxy (port channel {b.proxy})"
    return f"rank {b.rank} threadblock {b.tb}"


def check_races(run: Run, chunk: int) -> None:
    """Races within the first call, then with the next calls' too (in the
    executor's scratch, shared by the calls)."""
    if run.calls > 1:
        _races(run, chunk, lambda a: a.call == 0)
    _races(run, chunk, lambda a: True)


def _races(run: Run, chunk: int, taken) -> None:
    for (rank, key), accesses in sorted(run.m.state.accesses.items(), key=lambda kv: (run.m.key_call[kv[0][1]], kv[0])):
        accesses = sorted((a for a in accesses if taken(a)), key=lambda a: a.lo)
        active: list[Access] = []
        for a in accesses:
            active = [x for x in active if x.hi > a.lo]
            for x in active:
                if (a.write or x.write) and not _ordered(x, a):
                    first, second = (x, a) if x.write else (a, x)
                    lo, hi = max(a.lo, x.lo), min(a.hi, x.hi)
                    raise RaceError(
                        f"race on rank {rank}'s {key} bytes {lo}..{hi} (chunk {lo // chunk}, at {chunk}-byte chunks): "
                        f"{_name(run, first.g)} {first.who} writes it and {_name(run, second.g)} {second.who} "
                        f"{'writes' if second.write else 'reads'} it, with nothing ordering them",
                        ((run.blocks[first.g].rank, run.blocks[first.g].tb, first.who),
                         (run.blocks[second.g].rank, run.blocks[second.g].tb, second.who)), rank=rank, buffer=key)
            active.append(a)


def check_finished(run: Run) -> None:
    """A peer's access to a rank's buffer must come before that rank's kernel (of the call) ends."""
    for (rank, key), accesses in sorted(run.m.state.accesses.items(), key=lambda kv: kv[0]):
        for a in accesses:
            if a.remote_from is not None and run.ends(a.call)[rank][a.g] < a.seq:
                raise RaceError(f"{_name(run, a.g)} {a.who} {'writes' if a.write else 'reads'} rank {rank}'s {key} "
                                f"(bytes {a.lo}..{a.hi}) and nothing on rank {rank} waits for it: rank {rank}'s kernel "
                                f"can finish, and its caller reuse the buffer, first",
                                ((run.blocks[a.g].rank, run.blocks[a.g].tb, a.who),), rank=rank, buffer=key)


def check_flushed(run: Run) -> None:
    """A port channel's proxy reads the sender's own buffer after the kernel
    pushed the request; only a flush (or a signal back that follows the
    transfer) tells the rank it is done, else its caller may reuse the
    source while the proxy still reads it. (Scratch is the executor's,
    kept apart across calls as for memory-channel puts.)"""
    for (rank, key), accesses in sorted(run.m.state.accesses.items(), key=lambda kv: kv[0]):
        if key.startswith("scratch"):
            continue
        for a in accesses:
            if run.blocks[a.g].proxy is not None and a.remote_from is None and run.ends(a.call)[rank][a.g] < a.seq:
                raise RaceError(f"{_name(run, a.g)} {a.who} reads rank {rank}'s {key} (bytes {a.lo}..{a.hi}) and "
                                f"nothing tells rank {rank} the transfer is done (no flush of that port channel, no "
                                f"signal back after it): its kernel can return, and its caller overwrite the "
                                f"source, while the proxy still reads it",
                                ((run.blocks[a.g].rank, run.blocks[a.g].tb, a.who),), rank=rank, buffer=key)


def check_started(run: Run) -> None:
    """A switch access to another member's input or output must come after
    something of that member's call: they are the caller's, which the
    member's kernel may not have been handed yet (or still uses from its last
    call). MSCCL++'s plans sync the members first (signal/wait). Scratch is
    the executor's, kept apart across calls as for memory-channel puts."""
    for (rank, key), accesses in sorted(run.m.state.accesses.items(), key=lambda kv: kv[0]):
        if key.startswith("scratch"):
            continue
        for a in accesses:
            if a.switch and a.remote_from is not None and not any(
                    a.clock[b.g] >= run.starts[a.call][b.g] for b in run.blocks if b.rank == rank):
                raise RaceError(f"{_name(run, a.g)} {a.who} {'writes' if a.write else 'reads'} rank {rank}'s {key} "
                                f"(bytes {a.lo}..{a.hi}) through the switch before anything shows rank {rank}'s call "
                                f"has begun: rank {rank} may still be in its previous call or not yet have its input",
                                ((run.blocks[a.g].rank, run.blocks[a.g].tb, a.who),), rank=rank, buffer=key)


def check_balance(run: Run) -> None:
    """The executor keeps channel and device semaphores across calls: every
    call must leave them as it found them. (The run's calls each ran every
    operation of the plan once: the counts of one are the total's share.)"""
    st = run.m.state
    for key in sorted(set(st.signals) | set(st.waits)):
        sent, waited = len(st.signals.get(key, ())) // run.calls, st.waits.get(key, 0) // run.calls
        if sent != waited:
            src, dst, q, kind = key
            raise ExecutionError(f"rank {src} signals its {kind} channel {q} to rank {dst} {sent} time(s) but rank {dst} "
                                 f"waits on it {waited} time(s): the semaphore carries the difference into the next "
                                 f"call, whose waits then pass early (or hang)", rank=src)
    for gpu in run.plan.gpus:
        for s, value in enumerate(gpu.semaphores):
            end = value + (st.sems[(gpu.rank, s)] - value) // run.calls
            if end != value:
                raise ExecutionError(f"device semaphore {s} starts at {value} and ends at {end}: "
                                     f"the next call starts from the wrong value", rank=gpu.rank)


def execute_onesided(plan: OneSidedPlan, layout: Layout, chunk: int, inputs: list[np.ndarray], calls: int = 1):
    """Run ``plan`` on per-rank logical ``inputs`` (one dtype) at ``chunk``
    bytes a chunk, ``calls`` calls back to back on the same inputs: (the
    per-rank logical outputs of the first, the Run, the Machine: its
    outputs(call) has each call's). Raises DeadlockError where it cannot finish."""
    machine = Machine(plan, layout, chunk, inputs[0].dtype, calls)
    for call in range(calls):
        for gpu, x in zip(plan.gpus, inputs):
            key, lo, hi = machine.where(Operand(gpu.rank, "input", 0, gpu.input_chunks), None, 0, 1 << 62, "input",
                                        call)
            machine.view(gpu.rank, key, lo, hi)[:] = x
    run = Run(plan, machine)
    run.run()
    return machine.outputs(0), run, machine


def check_results(machine: Machine, layout: Layout, inputs: list[np.ndarray], outputs: list[np.ndarray],
                  call: int = 0) -> None:
    from msc.errors import VerificationError
    from msc.verification.reference import expected_outputs

    where = f" in call {call + 1}" if call else ""
    if not layout.builtin:                   # a custom collective: its stated pre- and postconditions
        per_unit = layout.k * machine.chunk // machine.dtype.itemsize
        for gpu, bad in zip(machine.plan.gpus, layout.wrong(inputs, outputs, per_unit)):
            if bad:
                raise VerificationError(f"wrong result on rank {gpu.rank}{where}: {bad} output element(s) are not what "
                                        f"{layout.collective.name} requires, with random integer inputs at "
                                        f"{machine.chunk}-byte chunks", rank=gpu.rank, buffer="output")
        return
    expected = expected_outputs(layout.collective.name, inputs, op="sum", root=layout.root)
    per_chunk = machine.chunk // machine.dtype.itemsize
    for gpu, got, want in zip(machine.plan.gpus, outputs, expected):
        if want is None or np.array_equal(got, want):
            continue
        bad = int(np.flatnonzero(got != want)[0]) if got.shape == want.shape else 0
        found = "nothing written" if got[bad] == machine.poison else str(got[bad])
        raise VerificationError(f"wrong result on rank {gpu.rank}{where}: output chunk {bad // per_chunk} (element {bad}) "
                                f"of the {layout.collective.name}, with random integer inputs at {machine.chunk}-byte "
                                f"chunks", rank=gpu.rank, buffer="output", index=bad // per_chunk,
                                expected=str(want[bad]), found=found)


def verify_onesided(plan: OneSidedPlan, *, collective=None, root: int | None = None, seed: int = 0,
                    chunk: int | None = None) -> OneSidedReport:
    """Check ``plan`` (deadlock, races, unfinished remote accesses,
    semaphore balance) and, for a collective msc knows, its results on
    random data. Raises the first problem found. (The executor's limits:
    msc.formats.mscclpp.check.verify_mscclpp checks them first.)"""
    from msc.verification.reference import random_inputs

    start = time.perf_counter()
    layout = Layout(plan, collective, root)
    chunk = chunk or chunk_bytes_for(plan)
    check_inputs_fit(plan, chunk, calls_for(plan))
    length = plan.gpus[0].input_chunks * chunk // ELEMENT.itemsize
    inputs = random_inputs(np.random.default_rng(seed), ELEMENT, "sum", layout.n, length)
    _, run, machine = execute_onesided(plan, layout, chunk, inputs, calls_for(plan))
    check_balance(run)                       # first: an unbalanced call lets the next one's waits pass early
    check_races(run, chunk)
    check_started(run)
    check_finished(run)
    if layout.checkable:
        for call in range(run.calls):
            check_results(machine, layout, inputs, machine.outputs(call), call)
    check_flushed(run)
    ops = sum(op.count for gpu in plan.gpus for ops in gpu.threadblocks for op in ops)
    return OneSidedReport(plan.name, plan.collective, plan.num_ranks, len(run.blocks), ops, run.events, chunk,
                          time.perf_counter() - start, layout.checkable)
