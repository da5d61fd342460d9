"""Compiling rendered kernels: to cubin with NVRTC (through cuda.core; no GPU
and no driver needed, the architecture is always explicit), or to a host
library for the emulated device (msc.cuda.hostbuild). Both start from one
rendered source, cached on disk.

Cache layout, under ``$MSC_CACHE_DIR/kernels/<key>/``: ``kernel.cu`` (the
rendered source) and ``kernel.<arch>.nvrtc<version>.cubin``; under
``$MSC_CACHE_DIR/kernels/tables-<key>/tables.i32`` a table-form plan's
tables. Every file has a sidecar with an HMAC under the user's key, checked
on every read (msc.cuda.kcache): an empty, altered, planted or unreadable
entry is a miss and is rebuilt, and what is compiled or run is the bytes
that were checked. Keys hash everything the bytes depend on:
the templates and msc's own code (codegen, and the verifier that computes
the step facts: msc.verification.cache.msc_digest) always; for a
straight-line kernel and for tables the collective (a custom one by what it
requires of every chunk, not by its name) and the plan text; the data type,
op and form of a kernel. A table-form kernel's text holds no plan: its key
is (protocol, data type, op, source width), so every table-form plan of
that kind shares one cubin. A second compile of the same thing reads the
cache and runs neither the renderer nor the compiler. The launch layout is
computed from the plan (cheap), never cached.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from msc.cuda import kcache
from msc.cuda.codegen import (KernelLayout, PlanTables, check_kernel, choose_form, kernel_layout, plan_tables,
                              prescales, render, table_width)
from msc.errors import CompileError, UsageError
from msc.ir import Plan
from msc.resources import cache_dir, data_dir

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_103", "sm_110",
         "sm_120", "sm_121")
KERNEL_NAME = "msc_kernel"


@dataclass(frozen=True)
class Rendered:
    """A plan's kernel source (as checked or rendered: never read again from
    the cache), where the cache keeps it, and its launch layout."""

    key: str
    folder: Path
    source_path: Path
    layout: KernelLayout
    cache_hit: bool
    source: str


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
    source: str = ""


@dataclass(frozen=True)
class HostCompiled:
    """A plan built for the emulated device: a shared library, its bytes as
    checked or built (msc.cuda.emu loads those, never the cache's file again)
    and where the cache keeps it."""

    library: Path
    source_path: Path
    layout: KernelLayout
    dtype: str
    op: str
    protocol: str
    key: str
    cache_hit: bool
    image: bytes = b""


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
        if collective is None and plan.contract is not None:      # stated by the plan itself
            return "contract:" + hashlib.sha256(repr(plan.contract).encode()).hexdigest()
        return f"builtin:{collective or plan.collective}"
    n, k, root = plan.num_ranks, plan.chunk_factor, plan.root
    h = hashlib.sha256(f"{type(collective).__qualname__}:{collective.name}".encode())
    for rank in range(n):
        pre = [collective.precondition(rank, i, n, k, root) for i in range(collective.input_chunks(n, k))]
        post = [None if e is None else sorted(e.counts.items()) for e in collective.postconditions(rank, n, k, root)]
        h.update(repr((rank, pre, post)).encode())
    return "custom:" + h.hexdigest()


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def source_key(plan: Plan, *, dtype: str, op: str, form: str, collective=None) -> str:
    """The key of the plan's kernel source: a table-form kernel's is its kind's."""
    if form == "table":
        kind = ("table", plan.protocol, dtype, op, str(table_width(plan)))
        if plan.first_switch_step() is not None:        # another kernel (multimem); others keep their keys
            kind += ("switch",)
        return _digest(_toolchain_digest(), *kind)
    from msc.formats.plan_text import dump_plan

    return _digest(_toolchain_digest(), collective_digest(plan, collective), dtype, op, form, dump_plan(plan))


def tables_key(plan: Plan, *, average: bool, collective=None) -> str:
    from msc.formats.plan_text import dump_plan

    return _digest(_toolchain_digest(), "tables", collective_digest(plan, collective), str(average), dump_plan(plan))


def cache_key(plan: Plan, *, dtype: str, op: str, arch: str, form: str, collective=None) -> str:
    """The key of a cubin: its source's key, the arch and the NVRTC version."""
    return _digest(source_key(plan, dtype=dtype, op=op, form=form, collective=collective), arch, nvrtc_version())


def _check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise UsageError(f"arch {arch!r} is not one NVRTC 13 compiles for (one of {', '.join(ARCHS)})")
    return arch


def rendered(plan: Plan, *, dtype: str = "float32", op: str = "sum", form: str | None = None, collective=None,
             cache: Path | None = None, allow_deadlock: bool = False) -> Rendered:
    """The plan's kernel source (rendered, or read from the cache) and layout.
    ``allow_deadlock`` renders a deadlocking plan (for timeout tests); it
    changes nothing for a plan that does not deadlock, so it is not in the key."""
    check_kernel(dtype, op, plan)            # also on a hit: a table-form kernel is shared by other plans
    form = choose_form(plan, form)
    key = source_key(plan, dtype=dtype, op=op, form=form, collective=collective)
    root = cache or cache_dir()
    name = f"kernels/{key}/kernel.cu"
    folder, layout = root / "kernels" / key, kernel_layout(plan, form)
    cached = kcache.read(root, name)
    if cached is not None:
        try:
            return Rendered(key, folder, root / name, layout, True, cached.decode())
        except UnicodeDecodeError:
            pass                        # not a text msc wrote: rendered again below
    source, _ = render(plan, dtype=dtype, op=op, form=form, collective=collective, allow_deadlock=allow_deadlock)
    kcache.write(root, name, source.encode())
    return Rendered(key, folder, root / name, layout, False, source)


def tables(plan: Plan, *, op: str = "sum", collective=None, cache: Path | None = None,
           allow_deadlock: bool = False) -> PlanTables:
    """The plan's tables for the table-form kernel (computed, or read from the
    cache): what a new plan needs instead of a compile. ``op``: only whether it
    pre-scales inputs matters (msc.cuda.codegen.prescales). ``allow_deadlock`` as in ``rendered``."""
    from msc.ir.ops import reduce_op

    reduce_op(op)
    average = prescales(plan, op)
    root = cache or cache_dir()
    name = f"kernels/tables-{tables_key(plan, average=average, collective=collective)}/tables.i32"
    raw = kcache.read(root, name)
    if raw is not None:
        try:
            return PlanTables.from_bytes(raw)
        except ValueError:
            pass                        # not ours after all: computed again below
    out = plan_tables(plan, op=op, collective=collective, allow_deadlock=allow_deadlock)
    kcache.write(root, name, out.to_bytes())
    return out


def compile(plan: Plan, *, dtype: str = "float32", op: str = "sum", arch: str = "sm_90", form: str | None = None,
            collective=None, cache: Path | None = None, allow_deadlock: bool = False) -> CompiledKernel:
    """The plan's kernel as a cubin for ``arch`` (rendered, compiled, cached)."""
    _check_arch(arch)
    r = rendered(plan, dtype=dtype, op=op, form=form, collective=collective, cache=cache,
                 allow_deadlock=allow_deadlock)
    root = cache or cache_dir()
    name = f"kernels/{r.key}/kernel.{arch}.nvrtc{nvrtc_version()}.cubin"
    cubin = kcache.read(root, name)
    hit = cubin is not None and r.cache_hit
    if cubin is None:
        cubin = nvrtc_compile(r.source, arch=arch, source_path=r.source_path)
        kcache.write(root, name, cubin)
    key = cache_key(plan, dtype=dtype, op=op, arch=arch, form=r.layout.form, collective=collective)
    return CompiledKernel(cubin, r.source_path, root / name, r.layout, arch, dtype, op, plan.protocol, key, hit,
                          source=r.source)


def compile_host(plan: Plan, *, dtype: str = "float32", op: str = "sum", form: str | None = None, collective=None,
                 cache: Path | None = None, allow_deadlock: bool = False, sanitize: str | None = None) -> HostCompiled:
    """The plan's kernel built for the emulated device (rendered, built, cached)."""
    from msc.cuda.hostbuild import build

    r = rendered(plan, dtype=dtype, op=op, form=form, collective=collective, cache=cache,
                 allow_deadlock=allow_deadlock)
    library, image, hit = build(r.source, sanitize=sanitize, cache=cache)
    return HostCompiled(library, r.source_path, r.layout, dtype, op, plan.protocol, r.key, hit and r.cache_hit,
                        image)


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
