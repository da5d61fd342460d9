"""Compiling rendered kernels: to cubin with NVRTC (through cuda.core; no GPU
and no driver needed, the architecture is always explicit), or to a host
library for the emulated device (msc.cuda.hostbuild). Both start from one
rendered source, cached on disk.

Cache layout, under ``$MSC_CACHE_DIR/kernels/<key>/``: ``kernel.cu`` (the
rendered source), ``layout.json`` (what the runtime launches it with) and
``kernel.<arch>.nvrtc<version>.cubin``, each with a SHA-256 sidecar checked
on every read (msc.formats.files): an empty, altered or unreadable entry is
a miss and is rebuilt. The key hashes everything the source depends on: the
templates, msc's own code (codegen, and the verifier that computes the step
facts: msc.verification.cache.msc_digest), the collective (a custom one by what it
requires of every chunk, not by its name), the plan text, the data type, the
op and the form. A second compile of the same thing reads the cache and runs
neither the renderer nor the compiler.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from msc.formats.files import read_checked, write_checked
from msc.cuda.codegen import Connection, KernelLayout, choose_form, render
from msc.errors import CompileError, UsageError
from msc.ir import Plan
from msc.resources import cache_dir, data_dir

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_103", "sm_110",
         "sm_120", "sm_121")
KERNEL_NAME = "msc_kernel"


@dataclass(frozen=True)
class Rendered:
    """A plan's kernel source in the cache, and its launch layout."""

    key: str
    folder: Path
    source_path: Path
    layout: KernelLayout
    cache_hit: bool

    @property
    def source(self) -> str:
        return self.source_path.read_text()


@dataclass(frozen=True)
class CompiledKernel:
    """A compiled plan: the cubin, where its source and cubin live, and the
    layout the runtime launches it with."""

    cubin: bytes
    source_path: Path
    cubin_path: Path
    layout: KernelLayout
    arch: str
    dtype: str
    op: str
    protocol: str
    key: str
    cache_hit: bool
    kernel_name: str = KERNEL_NAME

    @property
    def source(self) -> str:
        return self.source_path.read_text()


@dataclass(frozen=True)
class HostCompiled:
    """A plan built for the emulated device: a shared library (msc.cuda.emu loads it)."""

    library: Path
    source_path: Path
    layout: KernelLayout
    dtype: str
    op: str
    protocol: str
    key: str
    cache_hit: bool


@lru_cache(maxsize=1)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"cannot query the NVRTC version: {err}")
    return f"{major}.{minor}"


def _toolchain_digest() -> str:
    """Hash of everything in msc that shapes generated code: the templates
    (read at every call: the renderer reloads a template that changed) and
    msc's Python sources (codegen, and the verifier behind the step facts)."""
    from msc.verification.cache import msc_digest

    h = hashlib.sha256(msc_digest().encode())
    for path in sorted(data_dir("templates").glob("*.j2")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def collective_digest(plan: Plan, collective=None) -> str:
    """What the kernel's step facts depend on in the collective: a built-in's
    name, or for a custom collective (a Python object, whose name proves
    nothing) every chunk's pre- and postcondition at the plan's shape."""
    from msc.dsl.collectives import Collective

    if not isinstance(collective, Collective):
        return f"builtin:{collective or plan.collective}"
    n, k, root = plan.num_ranks, plan.chunk_factor, plan.root
    h = hashlib.sha256(f"{type(collective).__qualname__}:{collective.name}".encode())
    for rank in range(n):
        pre = [collective.precondition(rank, i, n, k, root) for i in range(collective.input_chunks(n, k))]
        post = [None if e is None else sorted(e.counts.items()) for e in collective.postconditions(rank, n, k, root)]
        h.update(repr((rank, pre, post)).encode())
    return "custom:" + h.hexdigest()


def source_key(plan: Plan, *, dtype: str, op: str, form: str, collective=None) -> str:
    from msc.formats.plan_text import dump_plan

    h = hashlib.sha256()
    for part in (_toolchain_digest(), collective_digest(plan, collective), dtype, op, form, dump_plan(plan)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def cache_key(plan: Plan, *, dtype: str, op: str, arch: str, form: str, collective=None) -> str:
    """The key of a cubin: its source's key, the arch and the NVRTC version."""
    h = hashlib.sha256()
    for part in (source_key(plan, dtype=dtype, op=op, form=form, collective=collective), arch, nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise UsageError(f"arch {arch!r} is not one NVRTC 13 compiles for (one of {', '.join(ARCHS)})")
    return arch


def rendered(plan: Plan, *, dtype: str = "float32", op: str = "sum", form: str | None = None, collective=None,
             cache: Path | None = None, allow_deadlock: bool = False) -> Rendered:
    """The plan's kernel source (rendered, or read from the cache) and layout.
    ``allow_deadlock`` renders a deadlocking plan (for timeout tests); it
    changes nothing for a plan that does not deadlock, so it is not in the key."""
    form = choose_form(plan, form)
    key = source_key(plan, dtype=dtype, op=op, form=form, collective=collective)
    folder = (cache or cache_dir()) / "kernels" / key
    src_path, layout_path = folder / "kernel.cu", folder / "layout.json"
    if read_checked(src_path) is not None:
        layout = _load_layout(layout_path)
        if layout is not None:
            return Rendered(key, folder, src_path, layout, True)
    source, layout = render(plan, dtype=dtype, op=op, form=form, collective=collective,
                            allow_deadlock=allow_deadlock)
    folder.mkdir(parents=True, exist_ok=True)
    write_checked(layout_path, json.dumps(asdict(layout)).encode())
    write_checked(src_path, source.encode())
    return Rendered(key, folder, src_path, layout, False)


def compile(plan: Plan, *, dtype: str = "float32", op: str = "sum", arch: str = "sm_90", form: str | None = None,
            collective=None, cache: Path | None = None, allow_deadlock: bool = False) -> CompiledKernel:
    """The plan's kernel as a cubin for ``arch`` (rendered, compiled, cached)."""
    _check_arch(arch)
    r = rendered(plan, dtype=dtype, op=op, form=form, collective=collective, cache=cache,
                 allow_deadlock=allow_deadlock)
    cubin_path = r.folder / f"kernel.{arch}.nvrtc{nvrtc_version()}.cubin"
    cubin = read_checked(cubin_path)
    hit = cubin is not None and r.cache_hit
    if cubin is None:
        cubin = nvrtc_compile(r.source, arch=arch, source_path=r.source_path)
        write_checked(cubin_path, cubin)
    key = cache_key(plan, dtype=dtype, op=op, arch=arch, form=r.layout.form, collective=collective)
    return CompiledKernel(cubin, r.source_path, cubin_path, r.layout, arch, dtype, op, plan.protocol, key, hit)


def compile_host(plan: Plan, *, dtype: str = "float32", op: str = "sum", form: str | None = None, collective=None,
                 cache: Path | None = None, allow_deadlock: bool = False, sanitize: str | None = None) -> HostCompiled:
    """The plan's kernel built for the emulated device (rendered, built, cached)."""
    from msc.cuda.hostbuild import build

    r = rendered(plan, dtype=dtype, op=op, form=form, collective=collective, cache=cache,
                 allow_deadlock=allow_deadlock)
    library, hit = build(r.source, sanitize=sanitize, cache=cache)
    return HostCompiled(library, r.source_path, r.layout, dtype, op, plan.protocol, r.key, hit and r.cache_hit)


def nvrtc_compile(source: str, *, arch: str, source_path: Path | None = None) -> bytes:
    """CUDA source -> cubin bytes; CompileError with NVRTC's log on failure."""
    from cuda.core import Program, ProgramOptions

    name = source_path.name if source_path else "msc_kernel.cu"
    options = ProgramOptions(arch=_check_arch(arch), std="c++17", name=name)
    try:
        obj = Program(source, "c++", options).compile("cubin")
    except Exception as exc:  # cuda.core raises NVRTCError (and others) with the log in the message
        text = str(exc)
        log = text.split("compilation log:", 1)[1] if "compilation log:" in text else text
        first = re.search(r"error: (.*)", log)
        raise CompileError(f"NVRTC could not compile the kernel: {first.group(1) if first else type(exc).__name__}",
                           log=log, source_path=str(source_path) if source_path else None) from None
    return bytes(obj.code)


def _load_layout(path: Path) -> KernelLayout | None:
    """The cached layout, or None when the entry is not whole or not a layout."""
    data = read_checked(path)
    if data is None:
        return None
    try:
        raw = json.loads(data)
        raw["connections"] = tuple(Connection(**c) for c in raw["connections"])
        for name in ("blocks", "rank_blocks"):
            raw[name] = tuple(tuple(x) for x in raw[name])
        for name in ("scratch_chunks", "threadblocks_per_rank"):
            raw[name] = tuple(raw[name])
        return KernelLayout(**raw)
    except (ValueError, TypeError, KeyError):
        return None
