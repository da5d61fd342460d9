"""The ranks of a group agree on a call before any of its data moves.

A collective whose ranks make different calls fails badly: float32 on one
rank and int32 on another exchange bytes that each side reads as its own
type (silent garbage on both); a different element count or element width
makes gloo receive a message of the wrong size (SIGABRT, no Python error); a
different transport or plan leaves each rank waiting for messages the other
never sends (a hang until the process group's timeout, 30 minutes on gloo).
So every call of msc.torch, on either engine, first checks that every rank of
the group makes the same call, and raises on every rank when they do not.

What is compared: the call's *signature* (``FIELDS``): the plan (its name,
and a digest of its content without source lines, so a plan traced on one
rank and read from a file on another is the same plan), the collective, the
reduction op, the dtype, the count (elements per unit of the collective's
buffers, which with the dtype fixes every message's size), the transport the
torch executor resolved ("-" on the CUDA runtime), the engine that runs it
("torch" or "cuda") and the tensors' device type. Not the call's form (in
place or out of place): it only decides local copies, and ranks may differ.

How: every call, before it communicates, each rank publishes a 9-byte
record (a tag and an 8-byte blake2b digest of its signature) in
torch.distributed's key-value store (the default store, as msc.cuda's
bootstrap uses) under ``msc-torch/<group>/<session>/<seq>/<rank>``, where
``seq`` is the group's msc call number, counted alike by every rank, and
reads every rank's record: one ``compare_set``, one ``multi_get`` (which
waits for the records not there yet, at most the timeout) and one
``delete_key`` of its record of an earlier call, which every rank has read
by then. All records equal: the call goes on. Not equal: every rank read the
same records, so every rank takes the same branch: they publish their full
signatures and each raises ``DisagreementError`` naming each field that
differs with every rank's value ("dtype: rank 0 float32, rank 1 int32").
Nothing has been sent, and the group stays usable.

Why every call, and not only the first call of a signature (a cache of
agreed signatures, so that repeated calls cost nothing): a rank repeating a
call it has agreed on cannot know, without hearing from its peers, that a
peer is making a new one, and the peer cannot make it wait. Any rule for
skipping the exchange must be one every rank evaluates alike (every Nth
call, say), and the calls it skips move data unchecked: the garbage and the
SIGABRT this module exists to prevent. So what is cached is the signature
(built and hashed once per plan and (count, dtype, op, transport, engine,
device); the plan's digest once per plan) and each call exchanges only its
digest; the full values cross the store only when the digests differ.

Why the store and not a small collective on the group: (1) a deadline: a
store wait has a timeout and says which records are missing, while a gloo
collective given up after ``work.wait(timeout)`` stays queued and gloo
closes the connection (the group is lost); (2) cost: between 2 gloo
processes on the 2-vCPU development machine the check alone takes 0.13 to
0.19 ms, as a gloo barrier (which carries no data), against 0.29 to 0.36 ms
for a gloo all_gather of 8 bytes per rank (``python bench/torch_agree.py``);
(3) it runs on the CPU: on NCCL no device synchronization per call. Its
price: each call makes O(group size) requests to the store's host (rank 0
under torchrun). A FileStore (``init_method="file://..."``) is polled here,
20 us to 2 ms between looks, as its own waits sleep 10 ms and count whole
seconds.

What it costs a call: a rendezvous of the ranks before the first message.
On that machine, shared with other jobs, it added 0.2 to 0.9 ms to calls
of 64 bytes and 1 MiB that take 0.4 to 1 ms without it (the exchanges right
after a rendezvous are slower there too: a gloo barrier in its place costs
about as much), and 0 to 14 % to a 32 MiB call (15 to 25 ms). A DDP
gradient bucket hardly feels it; a stream of tiny calls does
(``MSC_TORCH_AGREE=0``, below).

The deadline (``timeout_s``): ``MSC_TORCH_TIMEOUT`` (seconds) or
``set_timeout``, else the smaller of 300 s (the CUDA runtime's spin-wait
timeout: long enough for first-iteration skew between ranks) and the
process group's timeout (``init_process_group(timeout=...)``). A rank that
has waited that long for some records *claims* the missing ones (a
``compare_set`` that writes an abort mark where no record is): atomically,
each record is then either its rank's (it came in time) or the mark, so
every rank reads the same outcome. The ranks that came raise
``AgreementTimeoutError`` naming the ranks that did not; a rank that comes
later finds its own record claimed and raises too, naming the rank that gave
up; every rank's call number stays in step and no data moved.

A rank whose call fails before it communicates (``NoPlanError``: no plan
covers its size; a tensor it cannot take) publishes the error instead of a
digest (``fail``), so that its peers raise ``PeerFailedError`` at once,
quoting it, instead of waiting out the timeout.

A group's state (``Gate``: its call counter, a store connection of its
own, this rank's records still to delete) is made at its first call and
refers to the group weakly: a process group kept alive past
``destroy_process_group`` makes the process abort at exit.

After the agreement every rank runs the same program, and its waits are
torch.distributed's: a peer that dies closes its connections (gloo fails at
once); one that stalls in the middle of a call is bounded by the process
group's timeout (``init_process_group(timeout=...)``); on the CUDA runtime
by its communicator's ``timeout_s``, which is ``timeout_s(the group's
timeout)``: this module's setting where made, else the group's
(msc.torch.backends.runtime_timeout).

``MSC_TORCH_AGREE=0`` (on every rank alike) turns the check off: then a
disagreement is undefined behaviour again, as for torch.distributed's own
collectives. A rank with the check on waiting for one with it off reports
that rank as missing.

One call at a time per process and group: a call from a second thread
while one runs raises ``ConcurrentCallError`` naming both threads (without
it the threads' calls took each other's call numbers, and a peer waiting
for a call reported that rank as not making it), and the rank says so in
the store, so a peer's timeout names it too.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from msc.dsl.collectives import compact_ranges
from msc.formats.plan_text import plan_digest
from msc.errors import UsageError

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 365 * 24 * 3600.0     # the CUDA runtime's limit too (msc.cuda.device.MAX_TIMEOUT_S)
FIELDS = ("plan", "collective", "op", "dtype", "count", "transport", "backend", "device")
_OK, _ERROR, _ABORT = b"=", b"E", b"!"       # a record's tag: a signature's digest, a local error, a claim
_PREFIX = "msc-torch"
_ERROR_CHARS = 2000


class AgreementError(UsageError):
    """The ranks of a group do not make the same msc.torch call (base class).
    ``seq`` is the group's msc call number (from 0)."""

    def __init__(self, message: str, *, seq: int | None = None):
        self.seq = seq
        super().__init__(message)


class DisagreementError(AgreementError):
    """The ranks called with different signatures. ``values``: field ->
    the value of every group rank, for each field that differs."""

    def __init__(self, message: str, *, seq: int, values: dict[str, list]):
        self.values = values
        super().__init__(message, seq=seq)


class AgreementTimeoutError(AgreementError):
    """Some ranks did not make the call within the timeout. ``missing``:
    their group ranks; ``timeout_s``: the timeout waited."""

    def __init__(self, message: str, *, seq: int, missing: list[int], timeout_s: float):
        self.missing, self.timeout_s = missing, timeout_s
        super().__init__(message, seq=seq)


class PeerFailedError(AgreementError):
    """Another rank's call failed before it communicated (its error is
    quoted; that rank raised it). ``failed``: group rank -> its error."""

    def __init__(self, message: str, *, seq: int, failed: dict[int, str]):
        self.failed = failed
        super().__init__(message, seq=seq)


class ConcurrentCallError(UsageError):
    """Two threads of one process called collectives on one group at once:
    a group's calls are one sequence, counted alike on every rank."""


# -- one call at a time per group -------------------------------------------------------------------

_BUSY: dict[int, list] = {}                 # id(group) -> [thread ident, thread name, what, depth]
_BUSY_LOCK = threading.Lock()
_CONCURRENT = "concurrent"                  # the store key (under a gate's prefix) a rank says so under


@contextmanager
def one_call_at_a_time(pg, what: str, gate: "Gate | None"):
    """While a call on ``pg`` runs, another thread's call on it raises
    ConcurrentCallError naming both (the first goes on); the rank also says
    so in the store, so that a peer left waiting for the refused call names
    it in its timeout. A thread's own nested calls pass."""
    me = threading.current_thread()
    with _BUSY_LOCK:
        busy = _BUSY.get(id(pg))
        if busy is not None and busy[0] != me.ident:
            text = (f"threads {busy[1]!r} ({busy[2]}) and {me.name!r} ({what}) of this process call collectives on "
                    f"one group at once")
            if gate is not None:
                gate.say_concurrent(text)
            raise ConcurrentCallError(
                f"msc.torch: {text}{'' if gate is None else f' ({gate.label(gate.rank)}, {gate.name})'}: a group's "
                f"calls are one sequence, which every rank must make in the same order; call from one thread, or "
                f"give each thread its own group (torch.distributed.new_group, made in the same order on every rank)")
        if busy is None:
            busy = _BUSY[id(pg)] = [me.ident, me.name, what, 0]
        busy[3] += 1
    try:
        yield
    finally:
        with _BUSY_LOCK:
            busy[3] -= 1
            if not busy[3]:
                del _BUSY[id(pg)]


# -- settings ---------------------------------------------------------------------------------------

_timeout_override: float | None = None


def set_timeout(seconds: float | None) -> None:
    """How long a call waits for the other ranks to make it (every rank
    alike); None: back to ``MSC_TORCH_TIMEOUT`` or the default."""
    global _timeout_override
    if seconds is not None and not (isinstance(seconds, (int, float)) and 0 < seconds <= MAX_TIMEOUT_S):
        raise UsageError(f"the msc.torch timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g} (a "
                         f"year), got {seconds!r}")
    _timeout_override = None if seconds is None else float(seconds)


def timeout_s(default: float = DEFAULT_TIMEOUT_S) -> float:
    """``set_timeout``'s value, else ``$MSC_TORCH_TIMEOUT``, else ``default``."""
    if _timeout_override is not None:
        return _timeout_override
    env = os.environ.get("MSC_TORCH_TIMEOUT")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = 0.0
        if not 0 < value <= MAX_TIMEOUT_S:          # inf and 1e400 too: every wait would then end at once
            raise UsageError(f"MSC_TORCH_TIMEOUT must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g} (a "
                             f"year), got {env!r}")
        return value
    return default


def enabled() -> bool:
    """Whether calls agree first (``MSC_TORCH_AGREE`` is not 0/off/false/no)."""
    return os.environ.get("MSC_TORCH_AGREE", "1").strip().lower() not in ("0", "off", "false", "no")


# -- signatures -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Signature:
    values: tuple            # per FIELDS
    record: bytes            # _OK + 8-byte digest of the values

    def text(self) -> str:
        return json.dumps(list(self.values))


SIGNATURES_BUILT = 0         # signatures built (cache misses), for tests and benchmarks
_SIGNATURES_PER_PLAN = 256


def signature(prepared, count: int, dtype, op: str, transport: str | None, backend: str, device) -> Signature:
    """The signature of a call, cached on ``prepared`` (a msc.torch.execute.Prepared)."""
    global SIGNATURES_BUILT
    key = (count, dtype, op, transport, backend, device)
    cache = prepared.signatures
    sig = cache.get(key)
    if sig is None:
        if prepared.digest is None:
            prepared.digest = plan_digest(prepared.plan)
        values = ([prepared.plan.name, prepared.digest], prepared.collective.name, op,
                  str(dtype).removeprefix("torch."), count, transport or "-", backend, str(device))
        compared = json.dumps([prepared.digest, *values[1:]])       # a plan by its content, not its name
        sig = Signature(values, _OK + hashlib.blake2b(compared.encode(), digest_size=8).digest())
        if len(cache) >= _SIGNATURES_PER_PLAN:
            cache.clear()
        cache[key] = sig
        SIGNATURES_BUILT += 1
    return sig


# -- the groups -------------------------------------------------------------------------------------

class Gate:
    """One process group's agreements: its call counter, its store and the
    records of this rank still to delete."""

    def __init__(self, pg, rank: int, n: int):
        import torch.distributed as dist

        self.rank, self.n = rank, n
        key = id(pg)
        try:                          # weakly: a group kept past destroy_process_group aborts the process at exit
            self.pg = weakref.ref(pg, lambda ref: _GATES.pop(key, None) if _GATES.get(key) is self else None)
        except TypeError:
            self.pg = lambda: pg
        self.seq = 0
        self.stats = {"calls": 0, "disagreements": 0, "timeouts": 0, "failures": 0, "peer_failures": 0,
                      "deleted": 0}
        self.pending: list[tuple[int, str]] = []      # (seq, key) of this rank's records
        name = getattr(pg, "group_name", "") or str(id(pg))
        try:
            self.global_ranks = dist.get_process_group_ranks(pg)
        except Exception:
            self.global_ranks = list(range(n))
        self.world = self.global_ranks == list(range(dist.get_world_size()))
        self.name = "the default group" if pg is dist.group.WORLD or (self.world and name == "0") else \
            f"group {name!r} (global ranks {_ranges(self.global_ranks)})"
        try:
            base = dist.distributed_c10d._get_default_store()
        except Exception:             # a private helper of torch.distributed: without it, no deadline
            base = None
        self.base = base
        self.store, self.cloned, self._store_timeout, self.polls = base, False, None, False
        self.default_timeout = DEFAULT_TIMEOUT_S
        if base is not None:
            try:
                self.default_timeout = min(DEFAULT_TIMEOUT_S, base.timeout.total_seconds())
            except Exception:
                pass
            try:
                self.store, self.cloned = base.clone(), True    # our own connection, with our own timeout
            except Exception:
                pass
            self.polls = _underlying(base, "FileStore")     # its waits sleep 10 ms and count whole seconds
            # a session number: a process group re-created over the same store starts afresh
            session = (self.store.add(f"{_PREFIX}/{name}/sessions", 1) - 1) // n
            self.prefix = f"{_PREFIX}/{name}/{session}/"
        else:
            self.prefix = ""

    # -- keys and store -------------------------------------------------------------------------
    def key(self, seq: int, rank: int, kind: str = "") -> str:
        return f"{self.prefix}{seq}/{kind}{rank}"

    def _read(self, keys: list[str], timeout: float) -> list[bytes]:
        """Every key's value, waiting at most ``timeout`` seconds for them
        (a TCPStore waits on its server; a FileStore is polled here, from
        20 us between looks up to 2 ms, rather than by its own 10 ms sleeps
        and whole-second timeouts)."""
        if self.polls:
            deadline = time.monotonic() + timeout
            pause = 20e-6
            while not self.store.check(keys):
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"the records did not all come within {timeout:g} s")
                time.sleep(min(pause, deadline - now))
                pause = min(2 * pause, 2e-3)
            return self.store.multi_get(keys)
        if self.cloned:
            if self._store_timeout != timeout:
                self.store.set_timeout(timedelta(seconds=timeout))
                self._store_timeout = timeout
        else:
            self.store.wait(keys, timedelta(seconds=timeout))
        return self.store.multi_get(keys)

    def _collect(self, seq: int) -> None:
        """Delete this rank's records of calls before ``seq``: every rank
        has published at ``seq``, so every rank is done reading them."""
        keep = []
        for s, key in self.pending:
            if s < seq:
                self.store.delete_key(key)
                self.stats["deleted"] += 1
            else:
                keep.append((s, key))
        self.pending = keep

    def say_concurrent(self, text: str) -> None:
        """Tell the peers this rank refused a call made from a second thread. Never raises."""
        if self.base is not None:
            try:
                self.store.set(f"{self.prefix}{_CONCURRENT}/{self.rank}", text.encode())
            except Exception:
                pass

    def concurrent(self) -> str:
        """What the ranks that refused a second thread's call said, for a timeout's message ('' if none)."""
        if self.base is None:
            return ""
        said = []
        for r in range(self.n):
            key = f"{self.prefix}{_CONCURRENT}/{r}"
            try:
                if self.store.check([key]):
                    said.append(f"{self.label(r)}: {self.store.get(key).decode(errors='replace')}")
            except Exception:
                pass
        return f"; and {'; '.join(said)}: a call refused there never comes" if said else ""

    def label(self, r: int) -> str:
        return f"rank {r}" if self.world else f"rank {r} (global {self.global_ranks[r]})"

    # -- the calls ------------------------------------------------------------------------------
    def agree(self, sig: Signature, what: str) -> None:
        """Return when every rank makes the call ``sig``; raise an
        AgreementError on every rank otherwise. ``what`` names the call."""
        seq = self.seq
        self.seq += 1
        self.stats["calls"] += 1
        if self.base is None:
            return self._agree_collectively(sig, seq, what)
        timeout = timeout_s(self.default_timeout)
        mine = self.key(seq, self.rank)
        got = self.store.compare_set(mine, b"", sig.record)
        self.pending.append((seq, mine))
        if got != sig.record:
            self.stats["timeouts"] += 1
            self._late(got, seq, what)
        keys = [self.key(seq, r) for r in range(self.n)]
        try:
            records = self._read(keys, timeout)
        except Exception as exc:      # the store's timeout (DistStoreError, RuntimeError), or a store failure
            records = self._claim(keys, seq, timeout, exc)
        if records.count(sig.record) == self.n:
            self._collect(seq)
            return
        self._judge(records, sig, seq, timeout, what)

    def fail(self, exc: BaseException) -> None:
        """This rank's call failed before communicating: publish the error
        in its place, so that the other ranks raise at once. Never raises."""
        if self.base is None:
            return
        seq = self.seq
        self.seq += 1
        self.stats["failures"] += 1
        try:
            mine = self.key(seq, self.rank)
            text = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
            self.store.compare_set(mine, b"", _ERROR + text.encode())
            self.pending.append((seq, mine))
        except Exception:
            pass

    # -- the outcomes ---------------------------------------------------------------------------
    def _claim(self, keys, seq: int, timeout: float, exc: BaseException) -> list[bytes]:
        """After the timeout: the records there are, the missing ones claimed."""
        mark = _ABORT + json.dumps({"by": self.rank, "after": timeout}).encode()
        try:
            return [self.store.compare_set(k, b"", mark) for k in keys]
        except Exception as failure:
            raise AgreementError(f"msc.torch: {self.label(self.rank)} could not reach torch.distributed's key-value "
                                 f"store while waiting at msc call #{seq} on {self.name}: {failure} (after: {exc})",
                                 seq=seq) from None

    def _late(self, got: bytes, seq: int, what: str) -> None:
        try:
            info = json.loads(got[1:]) if got[:1] == _ABORT else {}
        except ValueError:
            info = {}
        by, after = info.get("by", "?"), info.get("after", "?")
        raise AgreementTimeoutError(
            f"msc.torch: {self.label(self.rank)} came to msc call #{seq} on {self.name} ({what}) after "
            f"{self.label(by) if isinstance(by, int) else 'a rank'} had waited {after} s for it and given up: the "
            f"ranks' calls did not meet. Every rank must make the same msc calls in the same order; a rank that is "
            f"only slow needs a longer timeout (MSC_TORCH_TIMEOUT, msc.torch.agree.set_timeout){self.concurrent()}",
            seq=seq, missing=[self.rank], timeout_s=after if isinstance(after, (int, float)) else float("nan"))

    def _judge(self, records: list[bytes], sig: Signature, seq: int, timeout: float, what: str) -> None:
        missing = [r for r, v in enumerate(records) if v[:1] == _ABORT]
        if missing:
            self.stats["timeouts"] += 1
            who = ", ".join(self.label(r) for r in missing)
            raise AgreementTimeoutError(
                f"msc.torch: {self.label(self.rank)} waited {timeout:g} s at msc call #{seq} on {self.name} ({what}) "
                f"for {who}, which did not make the call. Every rank of the group must make the same msc calls in "
                f"the same order (a rank that failed before its call, or runs with MSC_TORCH_AGREE=0, never comes); "
                f"a rank that is only slow needs a longer timeout (MSC_TORCH_TIMEOUT, msc.torch.agree.set_timeout, "
                f"init_process_group(timeout=...)){self.concurrent()}",
                seq=seq, missing=missing, timeout_s=timeout)
        self._collect(seq)            # every record is its rank's own: every rank is done with earlier calls
        failed = {r: v[1:].decode(errors="replace") for r, v in enumerate(records) if v[:1] == _ERROR}
        if failed:
            self.stats["peer_failures"] += 1
            text = "; ".join(f"{self.label(r)}: {msg}" for r, msg in failed.items())
            raise PeerFailedError(f"msc.torch: msc call #{seq} on {self.name} ({what}) failed on another rank before "
                                  f"anything was sent, so no rank runs it: {text}", seq=seq, failed=failed)
        # different digests: every rank saw the same records, so every rank publishes its full signature
        self.stats["disagreements"] += 1
        mine = self.key(seq, self.rank, "full/")
        self.store.set(mine, sig.text().encode())
        self.pending.append((seq, mine))
        keys = [self.key(seq, r, "full/") for r in range(self.n)]
        try:
            texts = self._read(keys, timeout)
        except Exception as exc:
            raise AgreementError(f"msc.torch: the ranks of {self.name} disagree on msc call #{seq} ({what}), and "
                                 f"not every rank published its call within {timeout:g} s: {exc}", seq=seq) from None
        raise self._disagreement([json.loads(t) for t in texts], seq)

    def _disagreement(self, values: list[list], seq: int) -> DisagreementError:
        """The same message on every rank: the fields that differ, every rank's value."""
        differ = {}
        parts = []
        for i, field in enumerate(FIELDS):
            column = [v[i] for v in values]
            if field == "plan":       # [name, digest]: compared by content, shown by name and digest
                if len({digest for _, digest in column}) > 1:
                    column = [f"{name!r} #{digest[:8]}" for name, digest in column]
                else:
                    continue
            if len(set(map(json.dumps, column))) > 1:
                differ[field] = column
                parts.append(f"{field}: {self._by_value(column)}")
        if not parts:                 # equal values, different digests: msc versions differ
            parts.append("the signatures' digests differ though their values are equal (different msc versions?)")
        return DisagreementError(
            f"msc.torch: the ranks of {self.name} disagree on msc call #{seq}: {'; '.join(parts)}. Every "
            f"rank must make the same call (the same plan, count, dtype, op, transport and backend), as for any "
            f"collective; nothing was sent", seq=seq, values=differ)

    def _by_value(self, column: list) -> str:
        """"rank 0 float32, rank 1 int32"; ranks sharing a value grouped."""
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(column):
            groups.setdefault(json.dumps(v), []).append(r)
        out = []
        for value, ranks in groups.items():
            shown = json.loads(value)
            if len(ranks) == 1:
                out.append(f"{self.label(ranks[0])} {shown}")
            else:
                out.append(f"ranks {_ranges(ranks)} {shown}")
        return ", ".join(out)

    def _agree_collectively(self, sig: Signature, seq: int, what: str) -> None:
        """Without the store: the records through all_gather_object (no deadline)."""
        import torch.distributed as dist

        records: list = [None] * self.n
        dist.all_gather_object(records, sig.record, group=self.pg())
        if records.count(sig.record) == self.n:
            return
        texts: list = [None] * self.n
        dist.all_gather_object(texts, sig.text(), group=self.pg())
        self.stats["disagreements"] += 1
        raise self._disagreement([json.loads(t) for t in texts], seq)


def _underlying(store, kind: str) -> bool:
    """Whether ``store``, under any PrefixStores, is a torch.distributed ``kind``."""
    import torch.distributed as dist

    cls = getattr(dist, kind, None)
    for _ in range(16):
        if cls is not None and isinstance(store, cls):
            return True
        store = getattr(store, "underlying_store", None)
        if store is None:
            return False
    return False


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    return compact_ranges(ranks, ", ")


_GATES: dict[int, Gate] = {}


def gate(group, rank: int, n: int) -> Gate | None:
    """The Gate of ``group`` (None: the world), made at its first call; None
    when the check is off (MSC_TORCH_AGREE=0)."""
    if n < 2 or not enabled():
        return None
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    g = _GATES.get(id(pg))
    if g is None or g.pg() is not pg:
        g = _GATES[id(pg)] = Gate(pg, rank, n)
    return g


def stats(group=None) -> dict:
    """The counters of ``group``'s Gate: ``calls`` (agreements), the
    outcomes (``disagreements``, ``timeouts``, ``failures``: this rank's
    calls that failed before communicating, ``peer_failures``), ``deleted``
    (records removed from the store), ``seq`` (the next call's number) and
    ``signatures_built`` (signature cache misses, all groups)."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    g = _GATES.get(id(pg))
    return {**(g.stats if g is not None else {}), "seq": g.seq if g is not None else 0,
            "signatures_built": SIGNATURES_BUILT}


__all__ = ["AgreementError", "AgreementTimeoutError", "ConcurrentCallError", "DEFAULT_TIMEOUT_S", "DisagreementError", "FIELDS", "Gate",
           "PeerFailedError", "Signature", "enabled", "gate", "one_call_at_a_time", "plan_digest", "set_timeout",
           "signature", "stats", "timeout_s"]
