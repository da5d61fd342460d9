"""Which plan runs a call: plans by collective, rank count, in-place form,
root and message size, like MSCCL's minBytes/maxBytes.

Torch-free. A registry is built from a directory, files, Plan objects or
``add`` calls; ``select`` picks the plan for a call and raises ``NoPlanError``
(naming what was asked and what exists) when none covers it.

Sizes. ``nbytes`` of a call is the byte size, on one rank, of the larger
logical buffer (msc run's and nccl-tests' size, NCCL's nBytes): the tensor
for allreduce, broadcast and reduce; the gathered output for allgather; the
full input for reducescatter and alltoall. An entry covers
``min_bytes <= nbytes < max_bytes`` (max_bytes None: no upper bound).

The index file. A directory may hold ``plans.json``::

    {"version": 1,
     "plans": [
       {"file": "allreduce-ring-n4.plan",     "min_bytes": 0,    "max_bytes": "1M"},
       {"file": "allreduce-allpairs-n4.plan", "min_bytes": "1M", "max_bytes": null}
     ]}

(a bare list of entries also works). ``file`` is relative to the index;
sizes are byte counts or strings such as "64K", "1M", "2G" (powers of
1024); ``min_bytes`` defaults to 0 and ``max_bytes`` to null. An entry may
also state ``collective``, ``ranks``, ``inplace`` and ``root``: then the
plan file is read only when a call first selects it (and must agree);
otherwise it is read when the index is. Keys starting with ``_`` and
``note`` are ignored (room for a tuner's measurements); any other key is an
error. Without ``plans.json`` every ``*.plan`` and ``*.xml`` file of the
directory is an entry covering all sizes, except that an MSCCL XML file
covers the sizes its ``<algo minBytes maxBytes>`` select (also in an index
entry that gives neither ``min_bytes`` nor ``max_bytes``).

Entries for the same (collective, ranks, form, root) must not overlap:
two plans for one call is an error when the registry is built, not a
silent pick.

Roots. A plan of a rooted collective whose registry row relabels
(broadcast, reduce) serves every root: where no entry has the call's root,
one with another root (the lowest) is turned to it by renaming its ranks
(msc.lower.relabel.for_root) and verified the first time that root is
asked for (``RootedEntry``). A gather or scatter plan serves its own root.
"""
from __future__ import annotations

import json
from pathlib import Path

from msc.dsl.collectives import ROOTED, collective_key
from msc.errors import PlanError, UsageError
from msc.files import read_input
from msc.ir import Plan
from msc.ir.limits import MAX_PLAN_FILE_BYTES, MAX_TEXT_FILE_BYTES
from msc.units import format_size

INDEX = "plans.json"
# the tuner (msc tune -o DIR) also records which algorithm, protocol and instance count won
_ENTRY_KEYS = {"file", "collective", "ranks", "inplace", "root", "min_bytes", "max_bytes", "note",
               "algorithm", "protocol", "instances"}


class NoPlanError(UsageError):
    """No registered plan covers a call. ``available`` lists what exists
    for the collective (all entries when it has none)."""

    def __init__(self, message: str, *, collective: str, num_ranks: int, nbytes: int, inplace: bool,
                 root: int | None, available: list[str]):
        self.collective, self.num_ranks, self.nbytes = collective, num_ranks, nbytes
        self.inplace, self.root, self.available = inplace, root, available
        super().__init__(message)


def parse_bytes(value, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UsageError(f"{what} must be a byte count or a size such as \"1M\", got {value!r}")
    from msc.units import parse_size

    from msc.ir.limits import MAX_BYTES

    n = parse_size(value) if isinstance(value, str) else value
    if not 0 <= n <= MAX_BYTES:                  # no call is larger: a size past it is a mistake
        raise UsageError(f"{what} must be from 0 to {MAX_BYTES} (msc's size limit), got {_short(value)}")
    return n




class PlanEntry:
    """One plan and the calls it serves. ``plan`` is read on first use
    when the entry was made from an index that states its metadata."""

    def __init__(self, *, collective: str, num_ranks: int, inplace: bool, root: int, min_bytes: int,
                 max_bytes: int | None, source: str, plan: Plan | None = None, path: Path | None = None,
                 verify: bool = True):
        if max_bytes is not None and max_bytes <= min_bytes:
            raise UsageError(f"{source}: max_bytes ({max_bytes}) must be > min_bytes ({min_bytes}) or null")
        self.collective, self.num_ranks, self.inplace = collective_key(collective), num_ranks, inplace
        self.root = root if self.collective in ROOTED else 0
        self.min_bytes, self.max_bytes, self.source = min_bytes, max_bytes, source
        self._plan, self._path, self._verify = plan, path, verify

    @classmethod
    def of(cls, plan: Plan, *, min_bytes: int = 0, max_bytes: int | None = None, source: str | None = None):
        return cls(collective=plan.collective, num_ranks=plan.num_ranks, inplace=plan.inplace, root=plan.root,
                   min_bytes=min_bytes, max_bytes=max_bytes, source=source or f"<plan {plan.name}>", plan=plan)

    @property
    def key(self) -> tuple:
        return (self.collective, self.num_ranks, self.inplace, self.root)

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            plan = _load(self._path, self._verify)
            stated = (self.collective, self.num_ranks, self.inplace, self.root)
            found = (collective_key(plan.collective), plan.num_ranks, plan.inplace,
                     plan.root if collective_key(plan.collective) in ROOTED else 0)
            if stated != found:
                raise PlanError(f"{self.source}: the index says {_describe_key(stated)}, the plan is "
                                f"{_describe_key(found)}", path=str(self._path))
            self._plan = plan
        return self._plan

    def covers(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes and (self.max_bytes is None or nbytes < self.max_bytes)

    def digest(self) -> str:
        """16 hex digits naming what the entry serves and with what: its key,
        size range and plan (a plan not read yet: its file's bytes)."""
        import hashlib

        h = hashlib.blake2b(repr((self.key, self.min_bytes, self.max_bytes)).encode(), digest_size=8)
        if self._plan is None and self._path is not None:
            h.update(read_input(self._path, MAX_PLAN_FILE_BYTES, what="plan", error=PlanError))
        else:
            from msc.formats.plan_text import plan_digest

            h.update(plan_digest(self.plan).encode())
        return h.hexdigest()

    def overlaps(self, other: PlanEntry) -> bool:
        lo = max(self.min_bytes, other.min_bytes)
        his = [h for h in (self.max_bytes, other.max_bytes) if h is not None]
        return not his or lo < min(his)

    def __repr__(self) -> str:
        return f"<PlanEntry {self.describe()}>"

    def describe(self) -> str:
        return (f"{_describe_key(self.key)} [{format_size(self.min_bytes)}, {format_size(self.max_bytes)}) "
                f"from {self.source}")


class RootedEntry(PlanEntry):
    """``base``'s plan turned to serve ``root`` (msc.lower.relabel.for_root),
    verified when it is made: the first time a call asks for that root."""

    def __init__(self, base: PlanEntry, root: int):
        from msc.lower.relabel import for_root
        from msc.verification.plan import verify_plan

        turned = for_root(base.plan, root)
        verify_plan(turned)
        super().__init__(collective=base.collective, num_ranks=base.num_ranks, inplace=base.inplace, root=root,
                         min_bytes=base.min_bytes, max_bytes=base.max_bytes,
                         source=f"{base.source} (root {base.root} relabelled to {root})", plan=turned)
        self.base = base


def _describe_key(key) -> str:
    collective, n, inplace, root = key
    text = f"{collective} {n} ranks {'in place' if inplace else 'out of place'}"
    return text + (f" root {root}" if collective in ROOTED else "")


_UNSET = object()      # a size bound the caller did not give


def file_range(path: Path) -> tuple[int, int | None]:
    """The sizes a plan file asks for: an MSCCL XML's minBytes/maxBytes
    (msc.formats.xml_import.xml_byte_range); every size for a .plan file."""
    if path.suffix.lower() != ".xml":
        return 0, None
    from msc.formats.xml_import import xml_byte_range

    text = read_input(path, MAX_PLAN_FILE_BYTES, what="plan")
    return xml_byte_range(text, path=str(path))


class PlanFolderWarning(UserWarning):
    """Plans are read from where users other than this one can change them."""


_warned: set[str] = set()


def _check_trust(path: Path) -> None:
    """Warn (once a place) where a plan file or index, or the folder it is
    in, can be changed by another user. What a plans folder trusts: nothing
    about a plan's results (msc verifies every plan it reads: none gives a
    wrong result or races), but which plans serve which calls, and so how
    fast they run and what passes through, is whoever can write there."""
    import os
    import warnings

    from msc.files import others_can_change

    for place in (path.parent, path):
        why = others_can_change(place)
        real = os.path.realpath(place)
        if why is None or real in _warned:
            continue
        _warned.add(real)
        link = f" (a link to {real})" if os.path.abspath(place) != real else ""
        warnings.warn(f"msc: plans are read from {place}{link}, which is {why}: msc verifies each plan it reads, so "
                      f"none gives a wrong result, but whoever can write there chooses which plans serve your calls; "
                      f"keep plans where only you can write", PlanFolderWarning, stacklevel=4)


def _load(path: Path, verify: bool) -> Plan:
    from msc.formats.load import load_plan

    plan = load_plan(path, verify=verify)
    _check_trust(path)                    # of what was read (a device or a FIFO is refused by the reader)
    return plan


class PlanRegistry:
    """Plans by (collective, ranks, in-place, root) and size range."""

    def __init__(self, entries=()):
        self._entries: list[PlanEntry] = []
        self.index: Path | None = None                # the plans.json it was read from, if any
        self.unlisted: tuple[str, ...] = ()           # plan files beside that index it has no entry for
        self._rooted: dict[tuple[int, int], RootedEntry] = {}    # (id(entry), root) -> that entry turned
        self.folder: Path | None = None               # the directory it was read from, if any
        self.tuned_on: dict[int, str] = {}             # rank count -> the topology msc tune wrote entries for
        for entry in entries:
            self._insert(entry)

    # -- building -----------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path, *, verify: bool = True) -> PlanRegistry:
        """``path/plans.json`` if there is one, else every ``*.plan``/``*.xml``
        file of the directory, each for all sizes (an XML: its own
        minBytes/maxBytes)."""
        path = Path(path)
        if not path.is_dir():
            raise UsageError(f"{path} is not a directory of plans")
        if (path / INDEX).is_file():
            reg = cls.from_index(path / INDEX, verify=verify)
            listed = {Path(e.source.split(":", 1)[1]).name for e in reg._entries if e.source and ":" in e.source}
            reg.unlisted = tuple(sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".plan", ".xml")
                                        and p.is_file() and p.name not in listed))
        else:
            files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".plan", ".xml") and p.is_file())
            if not files:
                raise UsageError(f"{path} holds no plans (no {INDEX}, no *.plan or *.xml files); write them with "
                                 f"`msc compile ALGORITHM --ranks N -o {path}/NAME.plan`")
            reg = cls.from_files(files, verify=verify)
        reg.folder = path
        return reg

    @classmethod
    def from_files(cls, paths, *, verify: bool = True) -> PlanRegistry:
        """Plan files (each for all sizes, an XML for its own
        minBytes/maxBytes) and index files (``*.json``)."""
        reg = cls()
        for p in paths:
            p = Path(p)
            if p.suffix.lower() == ".json":
                for entry in _read_index(p, verify):
                    reg._insert(entry)
            else:
                reg.add(p, verify=verify)
        return reg

    @classmethod
    def from_index(cls, path, *, verify: bool = True) -> PlanRegistry:
        data, entries = read_index(Path(path), verify)
        reg = cls(entries)
        reg.index = Path(path)
        items = data.get("plans") if isinstance(data, dict) else data
        for item in items:
            if isinstance(item.get("_topology"), str) and type(item.get("ranks")) is int:
                reg.tuned_on.setdefault(item["ranks"], item["_topology"])
        return reg

    @classmethod
    def from_plans(cls, plans) -> PlanRegistry:
        """Plan objects or files, each for all sizes."""
        reg = cls()
        for plan in plans:
            reg.add(plan)
        return reg

    def add(self, plan, *, min_bytes=_UNSET, max_bytes=_UNSET, verify: bool = True) -> PlanEntry:
        """Register a Plan (or a plan file) for ``min_bytes <= nbytes <
        max_bytes`` (max_bytes None: no upper bound). Unset, they are 0 and
        None, except for an MSCCL XML file: its own minBytes/maxBytes."""
        if isinstance(plan, (str, Path)) and min_bytes is _UNSET and max_bytes is _UNSET:
            min_bytes, max_bytes = file_range(Path(plan))
        lo = parse_bytes(0 if min_bytes is _UNSET else min_bytes, "min_bytes") or 0
        hi = parse_bytes(None if max_bytes is _UNSET else max_bytes, "max_bytes")
        if isinstance(plan, (str, Path)):
            path = Path(plan)
            entry = PlanEntry.of(_load(path, verify), min_bytes=lo, max_bytes=hi, source=str(path))
        elif isinstance(plan, Plan):
            entry = PlanEntry.of(plan, min_bytes=lo, max_bytes=hi)
        else:
            raise UsageError(f"expected a Plan or a plan file, got {type(plan).__name__}")
        self._insert(entry)
        return entry

    def _insert(self, entry: PlanEntry) -> None:
        for other in self._entries:
            if other.key == entry.key and other.overlaps(entry):
                raise UsageError(f"two plans for the same calls: {other.describe()} and {entry.describe()}; "
                                 f"give them size ranges that do not overlap (min_bytes/max_bytes)")
        self._entries.append(entry)

    # -- looking up ---------------------------------------------------------------------------------
    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, collective: str, num_ranks: int, nbytes: int, inplace: bool = True, root: int = 0, *,
              exact: bool = False) -> PlanEntry:
        """The entry for a call: same form first, then (unless ``exact``)
        the other form, which run_plan adapts with one copy; for a rooted
        collective with no entry of the call's root, (unless ``exact``) an
        entry of another root turned to it (``RootedEntry``)."""
        coll = collective_key(collective)
        root = root if coll in ROOTED else 0
        forms = (inplace,) if exact else (inplace, not inplace)
        for form in forms:
            for e in self._entries:
                if e.key == (coll, num_ranks, form, root) and e.covers(nbytes):
                    return e
        if coll in ROOTED and not exact:
            for form in forms:
                others = [e for e in self._entries if e.key[:3] == (coll, num_ranks, form) and e.covers(nbytes)]
                for e in sorted(others, key=lambda e: e.root):
                    turned = self._turned(e, root)
                    if turned is not None:
                        return turned
        same = [e for e in self._entries if e.collective == coll] or self._entries
        listing = "; ".join(e.describe() for e in same) or "nothing (the registry is empty)"
        asked = _describe_key((coll, num_ranks, inplace, root))
        if self.index is not None:         # a plans.json decides: a plan file it does not list is not used
            beside = (f"; {', '.join(self.unlisted)} in {self.index.parent} {'is' if len(self.unlisted) == 1 else 'are'}"
                      f" not listed in it" if self.unlisted else "")
            todo = (f"Compile one (msc compile ALGORITHM --ranks {num_ranks} -o {self.index.parent}/NAME.plan) and "
                    f"add an entry for it to {self.index} (file, min_bytes, max_bytes){beside}")
        else:
            todo = f"Compile one (msc compile ALGORITHM --ranks {num_ranks}) and register it for that size"
        raise NoPlanError(f"no msc plan for {asked} at {nbytes} bytes ({format_size(nbytes)})"
                          f"{' in that form' if exact else ''}; the registry has: {listing}"
                          f"{f' (from {self.index})' if self.index is not None else ''}. {todo}", collective=coll, num_ranks=num_ranks, nbytes=nbytes, inplace=inplace,
                          root=root if coll in ROOTED else None, available=[e.describe() for e in same])

    def _turned(self, entry: PlanEntry, root: int) -> RootedEntry | None:
        """``entry`` turned to ``root``, made (and verified) once; None for
        a plan that cannot be renamed (switch groups)."""
        key = (id(entry), root)
        if key not in self._rooted:
            from msc.lower.relabel import can_relabel

            self._rooted[key] = RootedEntry(entry, root) if can_relabel(entry.plan) else None
        return self._rooted[key]

    def select(self, collective: str, num_ranks: int, nbytes: int, inplace: bool = True, root: int = 0, *,
               exact: bool = False) -> Plan:
        """The plan for a call (see ``entry``); NoPlanError when none covers it."""
        return self.entry(collective, num_ranks, nbytes, inplace, root, exact=exact).plan

    def gaps(self, collective: str, num_ranks: int, inplace: bool | None = True, root: int = 0) -> list[tuple]:
        """Size ranges [lo, hi) (hi None: unbounded) that no entry covers
        for calls of this form (``inplace=None``: of either form, as
        ``select`` without ``exact`` serves them)."""
        coll = collective_key(collective)
        root = root if coll in ROOTED else 0
        forms = (True, False) if inplace is None else (inplace,)
        spans = sorted((e.min_bytes, e.max_bytes) for e in self._entries
                       if e.key in {(coll, num_ranks, f, root) for f in forms})
        out, at = [], 0
        for lo, hi in spans:
            if lo > at:
                out.append((at, lo))
            if hi is None:
                return out
            at = max(at, hi)
        out.append((at, None))
        return out

    def describe(self) -> str:
        return "\n".join(e.describe() for e in self._entries) or "(no plans)"

    def tune_command(self, collective: str, num_ranks: int, inplace: bool = True) -> str:
        """The ``msc tune`` command that writes plans for every size of such
        calls into this registry's folder: the library's algorithms of the
        collective, on the topology the folder's index was tuned for (else a
        ring), for the call's form (``--inplace out``; rooted plans serve
        every root). A registry of no folder gets ``-o PLANS``."""
        import shlex

        from msc.dsl.loader import library_names

        coll = collective_key(collective)
        folder = self.folder or (self.index.parent if self.index is not None else None)
        words = ["msc", "tune", *[name for name in library_names() if name.split("/")[0] == coll],
                 "--ranks", str(num_ranks), "-t", self.tuned_on.get(num_ranks, f"ring:{num_ranks}"),
                 "-o", "PLANS" if folder is None else str(folder), *([] if inplace else ["--inplace", "out"])]
        return " ".join(shlex.quote(w) if w != "PLANS" else w for w in words)


def _read_json(path: Path):
    try:
        data = json.loads(read_input(path, MAX_TEXT_FILE_BYTES, what="plans.json").decode())
        _check_trust(path)
        return data
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not JSON (byte {exc.start} is not UTF-8)") from None
    except RecursionError:
        raise UsageError(f"{path}: arrays or objects nested too deep to read") from None


def _check_stated(item: dict, where: str) -> None:
    """The values an entry states, each of its type and range (JSON's "false"
    is a string, not false; 8.0 is not a rank count)."""
    from msc.ir.limits import MAX_RANKS

    file = item["file"]
    if not isinstance(file, str) or not file:
        raise UsageError(f"{where}: \"file\" must be a plan file's name, got {_short(file)}")
    if "collective" in item and not isinstance(item["collective"], str):
        raise UsageError(f"{where}: \"collective\" must be a name such as \"allreduce\", "
                         f"got {_short(item['collective'])}")
    ranks = item.get("ranks", 1)
    if type(ranks) is not int or not 1 <= ranks <= MAX_RANKS:
        raise UsageError(f"{where}: \"ranks\" must be an int from 1 to {MAX_RANKS}, got {_short(ranks)}")
    if "inplace" in item and type(item["inplace"]) is not bool:
        raise UsageError(f"{where}: \"inplace\" must be true or false, got {_short(item['inplace'])}")
    root, top = item.get("root", 0), ranks if "ranks" in item else MAX_RANKS
    if type(root) is not int or not 0 <= root < top:
        raise UsageError(f"{where}: \"root\" must be a rank, an int from 0 to {top - 1}, got {_short(root)}")


def _short(value) -> str:
    """``repr(value)`` cut short (a deeply nested value has no full repr)."""
    import reprlib

    return reprlib.repr(value)


def _read_index(path: Path, verify: bool) -> list[PlanEntry]:
    return read_index(path, verify)[1]


def read_index(path: Path, verify: bool = True) -> tuple[object, list[PlanEntry]]:
    """plans.json at ``path`` as read (a list, or an object with "plans") and
    its entries, one per item in the file's order; UsageError naming the
    file, entry and key for anything the registry cannot take."""
    data = _read_json(path)
    items = data.get("plans") if isinstance(data, dict) else data
    if isinstance(data, dict) and (type(data.get("version", 1)) is not int or data.get("version", 1) != 1):
        raise UsageError(f"{path}: index version {_short(data.get('version'))}, this msc reads version 1")
    if not isinstance(items, list):
        raise UsageError(f"{path}: expected {{\"plans\": [...]}} or a list of entries")
    entries = []
    for i, item in enumerate(items):
        where = f"{path} entry {i}"
        if not isinstance(item, dict) or "file" not in item:
            raise UsageError(f"{where}: expected an object with a \"file\" key, got {_short(item)}")
        unknown = sorted(k for k in item if k not in _ENTRY_KEYS and not str(k).startswith("_"))
        if unknown:
            raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_ENTRY_KEYS))})")
        _check_stated(item, where)
        file = path.parent / item["file"]
        if "min_bytes" in item or "max_bytes" in item:
            lo = parse_bytes(item.get("min_bytes", 0), f"{where}: min_bytes") or 0
            hi = parse_bytes(item.get("max_bytes"), f"{where}: max_bytes")
        else:                                          # an XML's own range, else every size
            lo, hi = file_range(file) if file.is_file() else (0, None)
        source = f"{path.name}:{item['file']}"
        if all(k in item for k in ("collective", "ranks", "inplace")):
            if not file.is_file():
                raise UsageError(f"{where}: plan file {file} does not exist")
            entries.append(PlanEntry(collective=item["collective"], num_ranks=item["ranks"],
                                     inplace=item["inplace"], root=item.get("root", 0), min_bytes=lo,
                                     max_bytes=hi, source=source, path=file, verify=verify))
        else:
            entry = PlanEntry.of(_load(file, verify), min_bytes=lo, max_bytes=hi, source=source)
            for k, attr in (("collective", "collective"), ("ranks", "num_ranks"), ("inplace", "inplace"),
                            ("root", "root")):
                if k in item and collective_key(item[k]) != collective_key(getattr(entry, attr)):
                    raise UsageError(f"{where}: says {k} {_short(item[k])}, the plan has {getattr(entry, attr)!r}")
            entries.append(entry)
    return data, entries
