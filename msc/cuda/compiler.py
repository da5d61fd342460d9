"""Compiling rendered kernels to cubin with NVRTC (through cuda.core), with a
disk cache. Needs no GPU and no driver: the architecture is always explicit.

The cache key hashes everything the cubin depends on: the templates, msc's
codegen module, the plan (its text), the data type, the op, the form, the
target architecture and the NVRTC version. A second compile of the same
thing reads the cache and runs neither the renderer nor NVRTC.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from msc.cuda.codegen import Connection, KernelLayout, choose_form, render
from msc.errors import CompileError, UsageError
from msc.ir import Plan
from msc.resources import cache_dir, data_dir

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_103", "sm_110",
         "sm_120", "sm_121")
KERNEL_NAME = "msc_kernel"


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


@lru_cache(maxsize=1)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"cannot query the NVRTC version: {err}")
    return f"{major}.{minor}"


@lru_cache(maxsize=1)
def _toolchain_digest() -> str:
    """Hash of everything in msc that shapes generated code."""
    h = hashlib.sha256()
    for path in sorted(data_dir("templates").glob("*.j2")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(Path(__file__).with_name("codegen.py").read_bytes())
    return h.hexdigest()


def cache_key(plan: Plan, *, dtype: str, op: str, arch: str, form: str) -> str:
    from msc.plan_text import dump_plan

    h = hashlib.sha256()
    for part in (_toolchain_digest(), nvrtc_version(), dtype, op, arch, form, dump_plan(plan)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise UsageError(f"arch {arch!r} is not one NVRTC 13 compiles for (one of {', '.join(ARCHS)})")
    return arch


def compile(plan: Plan, *, dtype: str = "float32", op: str = "sum", arch: str = "sm_90", form: str | None = None,
            collective=None, cache: Path | None = None, allow_deadlock: bool = False) -> CompiledKernel:
    """The plan's kernel as a cubin for ``arch`` (rendered, compiled, cached).
    ``allow_deadlock`` renders a deadlocking plan (for timeout tests); it
    changes nothing for a plan that does not deadlock, so it is not in the key."""
    _check_arch(arch)
    form = choose_form(plan, form)
    key = cache_key(plan, dtype=dtype, op=op, arch=arch, form=form)
    folder = (cache or cache_dir()) / "kernels" / key
    src_path, cubin_path, layout_path = folder / "kernel.cu", folder / f"kernel.{arch}.cubin", folder / "layout.json"
    if cubin_path.is_file() and layout_path.is_file() and src_path.is_file():
        return CompiledKernel(cubin_path.read_bytes(), src_path, cubin_path, _load_layout(layout_path), arch, dtype,
                              op, plan.protocol, key, True)
    source, layout = render(plan, dtype=dtype, op=op, form=form, collective=collective,
                            allow_deadlock=allow_deadlock)
    folder.mkdir(parents=True, exist_ok=True)
    _write(src_path, source.encode())
    cubin = nvrtc_compile(source, arch=arch, source_path=src_path)
    _write(cubin_path, cubin)
    _write(layout_path, json.dumps(asdict(layout)).encode())
    return CompiledKernel(cubin, src_path, cubin_path, layout, arch, dtype, op, plan.protocol, key, False)


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


def _write(path: Path, data: bytes) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_layout(path: Path) -> KernelLayout:
    raw = json.loads(path.read_text())
    raw["connections"] = tuple(Connection(**c) for c in raw["connections"])
    for name in ("blocks", "rank_blocks"):
        raw[name] = tuple(tuple(x) for x in raw[name])
    for name in ("scratch_chunks", "threadblocks_per_rank"):
        raw[name] = tuple(raw[name])
    return KernelLayout(**raw)
