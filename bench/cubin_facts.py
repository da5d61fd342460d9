"""Static facts about a compiled msc kernel, read from its cubin without a GPU.

Used by ``bench/cuda_static.py`` and ``tests/test_cuda_static.py``. Three
sources, all from pip wheels:

- ``cuobjdump --dump-resource-usage`` (nvidia-cuda-cuobjdump): the kernel's
  registers, stack, shared and local memory. msc compiles whole programs
  (no -rdc), so the cubin has ONE entry function, ``msc_kernel``; the
  non-inlined device functions (``combine``, ``ll_chunk``, ``wait_until<..>``,
  ``msc_fail``, ``tb_N``, ``run_threadblock``) are local functions
  ``$msc_kernel$<mangled>`` inside the kernel's own text section. cuobjdump
  lists resource usage only for ``msc_kernel`` (and the ELF's .nv.info has an
  EIATTR_REGCOUNT only for it): ptxas allocates registers over the whole call
  tree within the kernel's budget, so the entry's REG is the count the
  hardware allocates per thread for every function of the tree, and the one
  occupancy uses.
- ``nvdisasm`` (nvidia-cuda-nvdisasm): SASS, split per function by its
  ``.type <name>,@function`` labels. ptxas marks register spill and refill
  instructions with the comment ``(*"SpillRefill"*)``; their widths give spill
  bytes per function. Loops are the ranges [target, branch] of backward
  ``BRA`` branches inside one function.
- ptxas's own report (``-v``, through NVRTC's ptxas options): stack frame and
  spill stores/loads per function, the authoritative spill numbers. A ``-v``
  compile differs from msc's cubin only in the command line recorded in its
  .note section (same SASS; tests/test_cuda_static.py checks this), so it
  describes the cubin msc builds.

Occupancy (``blocks_per_sm``) follows cuda_occupancy.h (the CUDA occupancy
calculator) for sm_75, sm_80 and sm_90: registers are allocated per warp in units
of 256, in 4 SM sub-partitions of 16384 registers each; at most 2048
threads, 32 blocks and 65536 registers per block; shared memory per block is
its static size plus 1 KB the system reserves, in 128-byte units, out of
164 KB (sm_80) or 228 KB (sm_90) per SM.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = ("cuobjdump", "nvdisasm")


# -- the tools -------------------------------------------------------------------------
def find_tool(name: str) -> Path | None:
    """A CUDA binary from a pip wheel (site-packages/nvidia/*/bin), else on PATH or in CUDA_HOME."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for found in sorted(Path(root).glob(f"*/bin/{name}")):
                if found.is_file():
                    return found
    except ImportError:
        pass
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and (Path(os.environ[var]) / "bin" / name).is_file():
            return Path(os.environ[var]) / "bin" / name
    return None


def missing_tools() -> list[str]:
    return [t for t in TOOLS if find_tool(t) is None]


def tool_version(name: str) -> str:
    path = find_tool(name)
    if path is None:
        return "missing"
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def _run(name: str, *args: str) -> str:
    path = find_tool(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found (pip install nvidia-cuda-{name})")
    proc = subprocess.run([str(path), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


# -- names ------------------------------------------------------------------------------
def short_name(symbol: str) -> str:
    """``$msc_kernel$_Z10wait_untilILb0EEbPKyyxPjiiix`` -> ``wait_until<false>``; plain names stay."""
    name = symbol.rsplit("$", 1)[-1] if symbol.startswith("$") else symbol
    m = re.match(r"_Z(\d+)", name)
    if not m:
        return name
    start = m.end()
    ident = name[start:start + int(m.group(1))]
    rest = name[start + int(m.group(1)):]
    targs = re.match(r"I((?:Lb[01]E|Li\d+E)+)E", rest)
    if targs:
        vals = re.findall(r"L(b|i)(\d+)E", targs.group(1))
        ident += "<" + ", ".join(("true" if v == "1" else "false") if t == "b" else v for t, v in vals) + ">"
    return ident


# -- NVRTC with ptxas's report --------------------------------------------------------------
def nvrtc_verbose(source: str, *, arch: str, name: str = "kernel.cu") -> tuple[bytes, str]:
    """Compile as msc.cuda.compiler.nvrtc_compile does, with ``ptxas -v``: (cubin, ptxas log)."""
    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(arch=arch, std="c++17", name=name, ptxas_options="-v")
    log = io.StringIO()
    obj = Program(source, "c++", options).compile("cubin", logs=log)
    return bytes(obj.code), log.getvalue()


@dataclass
class PtxasReport:
    registers: int                      # the entry's
    cumulative_stack: int
    functions: dict[str, dict] = field(default_factory=dict)   # short name -> stack, spill_stores, spill_loads


def parse_ptxas(log: str) -> PtxasReport:
    regs = re.search(r"Used (\d+) registers", log)
    cum = re.search(r"(\d+) bytes cumulative stack size", log)
    funcs = {}
    for m in re.finditer(r"Function properties for (\S+)\s*\n\s*ptxas\s+\.\s+(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads", log):
        funcs[short_name(m.group(1))] = dict(stack=int(m.group(2)), spill_stores=int(m.group(3)),
                                             spill_loads=int(m.group(4)))
    if regs is None or not funcs:
        raise ValueError(f"no ptxas report in the log: {log[:500]!r}")
    return PtxasReport(int(regs.group(1)), int(cum.group(1)) if cum else 0, funcs)


# -- cuobjdump: resource usage ----------------------------------------------------------------
def resource_usage(cubin: Path) -> dict[str, dict[str, int]]:
    """cuobjdump --dump-resource-usage: per function listed, REG, STACK, SHARED, LOCAL, ..."""
    out = _run("cuobjdump", "--dump-resource-usage", str(cubin))
    usage = {}
    for m in re.finditer(r"Function (\S+):\s*\n\s*(.*)", out):
        usage[short_name(m.group(1))] = {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", m.group(2))}
    if not usage:
        raise ValueError(f"no resource usage in cuobjdump's output: {out[:300]!r}")
    return usage


# -- nvdisasm: SASS per function ----------------------------------------------------------------
@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str
    op: str          # opcode with its modifiers, e.g. LDG.E.128.STRONG.SYS
    args: str
    note: str        # ptxas's comment, e.g. "SpillRefill"

    @property
    def base(self) -> str:
        return self.op.split(".", 1)[0]

    @property
    def mods(self) -> tuple[str, ...]:
        return tuple(self.op.split(".")[1:])

    @property
    def width(self) -> int:
        """Bytes per thread moved by a load or store (4 unless the opcode says otherwise)."""
        m = self.mods
        for bits, nbytes in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
            if bits in m:
                return nbytes
        return 4


@dataclass
class Function:
    symbol: str
    instrs: list[Instr] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return short_name(self.symbol)

    def loops(self) -> list[tuple[int, int]]:
        """[first, last] address ranges closed by a backward branch in this function."""
        out = []
        for ins in self.instrs:
            if ins.base == "BRA":
                m = re.search(r"\(\s*(\.L_x_\d+)\s*\)", ins.args)
                target = self.labels.get(m.group(1)) if m else None
                if target is not None and target <= ins.addr:
                    out.append((target, ins.addr))
        return out

    def in_loop(self, ins: Instr, loops=None) -> bool:
        return any(a <= ins.addr <= b for a, b in (self.loops() if loops is None else loops))


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;\s*$")
_NOTE = re.compile(r'\s*\(\*"([^"]*)"\*\)')


def disassemble(cubin: Path) -> dict[str, Function]:
    """nvdisasm's SASS of every function, by short name (``msc_kernel``, ``combine``, ``tb_3``, ...)."""
    return parse_sass(_run("nvdisasm", "-c", str(cubin)))


def parse_sass(text: str) -> dict[str, Function]:
    """Functions of nvdisasm's text: ``.type name,@function`` headers, ``.L_x_N:`` labels and
    ``/*addr*/ [@pred] OPCODE args ;`` lines."""
    funcs: dict[str, Function] = {}
    cur: Function | None = None
    pending: list[str] = []
    for line in text.splitlines():
        m = re.match(r"^\s*\.type\s+(\S+),@function", line)
        if m:
            cur = Function(m.group(1))
            funcs[cur.name] = cur
            pending = []
            continue
        if cur is None:
            continue
        m = re.match(r"^(\.L_x_\d+):\s*$", line)
        if m:
            pending.append(m.group(1))
            continue
        note = _NOTE.search(line)
        m = _INSTR.match(_NOTE.sub("", line))
        if m:
            addr = int(m.group(1), 16)
            for label in pending:
                cur.labels[label] = addr
            pending = []
            cur.instrs.append(Instr(addr, (m.group(2) or "").strip(), m.group(3), m.group(4),
                                    note.group(1) if note else ""))
    if not funcs:
        raise ValueError("nvdisasm: no function in the cubin")
    return funcs


# -- registers an instruction reads and writes (enough of SASS's operand syntax for the detectors) ----
_REG = re.compile(r"\bR(\d+)(\.64)?\b")
_STORES = ("ST", "STG", "STS", "STL", "ATOM", "ATOMG", "RED", "REDG")


def _regs(text: str, width: int = 4) -> set[int]:
    """The general registers an operand text names (``R4.64`` is R4 and R5); ``width`` bytes for the first."""
    out = set()
    for m in _REG.finditer(text):
        n = 2 if m.group(2) else 1
        out.update(range(int(m.group(1)), int(m.group(1)) + n))
    return out


def _defs_uses(ins: Instr) -> tuple[set[int], set[int]]:
    """(registers written, registers read) by one instruction: the first operand is the destination,
    except for stores and reductions, which only read."""
    if ins.base in _STORES or "," not in ins.args:
        return set(), _regs(ins.args)
    dest, _, rest = ins.args.partition(",")
    m = _REG.search(dest)
    if m is None:                                # a predicate or uniform destination
        return set(), _regs(rest)
    first, count = int(m.group(1)), (max(1, ins.width // 4) if ins.base in ("LD", "LDG", "LDS", "LDL") else
                                     (2 if m.group(2) else 1))
    return set(range(first, first + count)), _regs(rest)


def _branch_target(fn: Function, ins: Instr) -> int | None:
    m = re.search(r"\(\s*(\.L_x_\d+)\s*\)", ins.args)
    return fn.labels.get(m.group(1)) if m else None


def loads_before_first_use(fn: Function) -> list[int]:
    """Per loop holding 128-bit loads: the most 128-bit loads a thread issues on one path from the
    loop's head before the first instruction that reads a register one of them wrote (loads in flight
    per thread before the first arithmetic, conversion or store of loaded data). Paths follow the
    branches inside the loop (a predicated branch both ways); predicated loads count as issued."""
    out = []
    for a, b in fn.loops():
        body = [i for i in fn.instrs if a <= i.addr <= b]
        if any(i.base in ("LD", "LDG") and i.width == 16 for i in body):
            out.append(_most_loads_on_a_path(fn, body, a, b))
    return out


def _most_loads_on_a_path(fn: Function, body: list[Instr], head: int, last: int) -> int:
    """Forward over the loop's body in program order (a topological order of its forward branches;
    inner loops' back edges are not followed), carrying each path's (loads issued, registers they
    wrote) into its successors; paths that reach the same instruction in the same state merge, so
    the work is linear in the body (at most STATES states per instruction, the most loads kept)."""
    at = {ins.addr: k for k, ins in enumerate(body)}
    states: dict[int, set] = {0: {(0, frozenset())}}
    best = 0
    for k, ins in enumerate(body):
        here = states.pop(k, set())
        defs, uses = _defs_uses(ins)
        wide_load = ins.base in ("LD", "LDG") and ins.width == 16
        for issued, loaded in here:
            if uses & loaded or ins.base in ("RET", "EXIT"):
                best = max(best, issued)
                continue
            state = (issued + 1, loaded | defs) if wide_load else (issued, loaded - defs)
            nexts = [k + 1]
            if ins.base == "BRA":
                target = _branch_target(fn, ins)
                inside = target is not None and head < target <= last and target in at and at[target] > k
                nexts = ([k + 1] if ins.pred else []) + ([at[target]] if inside else [])
            if not nexts or nexts == [len(body)]:
                best = max(best, state[0])
            for n in nexts:
                if n < len(body):
                    states.setdefault(n, set()).add(state)
        for n, st in states.items():
            if len(st) > STATES:
                states[n] = set(sorted(st, key=lambda x: -x[0])[:STATES])
    return best


STATES = 64


def release_fences(fn: Function) -> list[tuple[str, int]]:
    """Per 64-bit strong store (a counter's release: ``STG.E.64.STRONG.SYS``/``.GPU``): its opcode and
    the system-scope fences (``MEMBAR.*.SYS``) issued since the previous barrier or release store."""
    out, sys_fences = [], 0
    for ins in fn.instrs:
        if ins.base == "BAR":
            sys_fences = 0
        elif ins.base == "MEMBAR" and "SYS" in ins.mods:
            sys_fences += 1
        elif ins.base in ("ST", "STG") and ins.width == 8 and "STRONG" in ins.mods and {"SYS", "GPU"} & set(ins.mods):
            out.append((ins.op, sys_fences))
            sys_fences = 0
    return out


def memory_facts(fn: Function) -> dict:
    """Local-memory, spill and 128-bit global/generic access counts of one function."""
    loops = fn.loops()
    local = [i for i in fn.instrs if i.base in ("LDL", "STL")]
    spills = [i for i in local if "Spill" in i.note]
    wide_ld = [i for i in fn.instrs if i.base in ("LDG", "LD") and i.width == 16]
    wide_st = [i for i in fn.instrs if i.base in ("STG", "ST") and i.width == 16]
    vec_loops = [(a, b) for a, b in loops if any(a <= i.addr <= b for i in wide_ld)]
    # innermost loop holding a 128-bit load: the vector loop; other loads in it are per-vector overhead
    inner = min(vec_loops, key=lambda r: r[1] - r[0]) if vec_loops else None
    overhead = [i for i in fn.instrs if inner and inner[0] <= i.addr <= inner[1]
                and i.base in ("LD", "LDG", "LDL", "LDC", "LDS") and i.width != 16]
    return dict(
        instructions=len(fn.instrs), loops=len(loops),
        ldl=sum(i.base == "LDL" for i in local), stl=sum(i.base == "STL" for i in local),
        ldl_in_loops=sum(i.base == "LDL" and fn.in_loop(i, loops) for i in local),
        stl_in_loops=sum(i.base == "STL" and fn.in_loop(i, loops) for i in local),
        spill_store_bytes=sum(i.width for i in spills if i.base == "STL"),
        spill_load_bytes=sum(i.width for i in spills if i.base == "LDL"),
        ld128=sorted({i.op for i in wide_ld}), st128=sorted({i.op for i in wide_st}),
        ld128_in_loops=sum(fn.in_loop(i, loops) for i in wide_ld),
        st128_in_loops=sum(fn.in_loop(i, loops) for i in wide_st),
        ld128_global=sum(i.base == "LDG" for i in wide_ld), st128_global=sum(i.base == "STG" for i in wide_st),
        vector_loop_other_loads=len(overhead),
        vector_loop_other_load_ops=sorted({i.op for i in overhead}),
        calls_in_loops=sum(i.base == "CALL" and fn.in_loop(i, loops) for i in fn.instrs),
        ld128_before_first_use=max(loads_before_first_use(fn), default=0),
        releases=[op for op, _ in release_fences(fn)],
        membar_sys_per_release=max((n for _, n in release_fences(fn)), default=0),
        membar_sys=sum(i.base == "MEMBAR" and "SYS" in i.mods for i in fn.instrs),
        l1_invalidations_in_loops=sum(i.base == "CCTL" and fn.in_loop(i, loops) for i in fn.instrs),
    )


# -- occupancy ---------------------------------------------------------------------------------
ARCH_LIMITS = {
    # registers per SM, per block, allocation unit (per warp), sub-partitions, threads, blocks,
    # shared memory per SM, reserved per block, allocation unit
    "sm_75": dict(regs_sm=65536, regs_block=65536, reg_unit=256, partitions=4, threads=1024, blocks=16,
                  max_regs_thread=255, smem_sm=64 * 1024, smem_reserved=0, smem_unit=256),
    "sm_80": dict(regs_sm=65536, regs_block=65536, reg_unit=256, partitions=4, threads=2048, blocks=32,
                  max_regs_thread=255, smem_sm=164 * 1024, smem_reserved=1024, smem_unit=128),
    "sm_90": dict(regs_sm=65536, regs_block=65536, reg_unit=256, partitions=4, threads=2048, blocks=32,
                  max_regs_thread=255, smem_sm=228 * 1024, smem_reserved=1024, smem_unit=128),
}


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def blocks_per_sm(arch: str, regs: int, nthreads: int, smem: int = 0) -> tuple[int, str, dict]:
    """Resident blocks per SM at this launch shape, the limiting resource, and each limit."""
    lim = ARCH_LIMITS[arch]
    warps = -(-nthreads // 32)
    limits = {"threads": lim["threads"] // (warps * 32), "blocks": lim["blocks"]}
    regs_warp = _round_up(max(regs, 1) * 32, lim["reg_unit"])
    if regs > lim["max_regs_thread"] or regs_warp * _round_up(warps, lim["partitions"]) > lim["regs_block"]:
        limits["registers"] = 0
    else:
        per_partition = (lim["regs_sm"] // lim["partitions"]) // regs_warp
        limits["registers"] = per_partition * lim["partitions"] // warps
    used = _round_up(smem + lim["smem_reserved"], lim["smem_unit"])
    limits["shared"] = lim["smem_sm"] // used if used else lim["blocks"]
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter, limits


# -- all facts of one cubin -------------------------------------------------------------------
LOOP_FUNCTION = {"Simple": "combine", "LL": "ll_chunk"}


def source_defines(source: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)\b", source, re.M)}


def cubin_facts(cubin: bytes, *, arch: str, protocol: str, nthreads: int, ptxas_log: str | None = None) -> dict:
    """Everything the bench and the test check about one kernel's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = resource_usage(path)
        funcs = disassemble(path)
    if "msc_kernel" not in usage or "msc_kernel" not in funcs:
        raise ValueError(f"no msc_kernel in the cubin (functions: {sorted(funcs)})")
    kernel = usage["msc_kernel"]
    per_fn = {name: memory_facts(fn) for name, fn in funcs.items()}
    loop_fn = LOOP_FUNCTION[protocol]
    blocks, limiter, limits = blocks_per_sm(arch, kernel["REG"], nthreads, kernel.get("SHARED", 0))
    facts = dict(
        registers=kernel["REG"], stack=kernel.get("STACK", 0), local=kernel.get("LOCAL", 0),
        shared=kernel.get("SHARED", 0), nthreads=nthreads, blocks_per_sm=blocks, occupancy_limiter=limiter,
        occupancy_limits=limits, functions=sorted(funcs), loop_function=loop_fn,
        loop_function_found=loop_fn in funcs, sass=per_fn,
        spill_store_bytes_sass=sum(f["spill_store_bytes"] for f in per_fn.values()),
        spill_load_bytes_sass=sum(f["spill_load_bytes"] for f in per_fn.values()),
        ldl=sum(f["ldl"] for f in per_fn.values()), stl=sum(f["stl"] for f in per_fn.values()),
        # loads in flight in the element loop; fences per counter release; L1 invalidations per spin
        ld128_before_first_use=per_fn.get("combine", {}).get("ld128_before_first_use", 0),
        membar_sys_per_release=max((f["membar_sys_per_release"] for f in per_fn.values()), default=0),
        spin_l1_invalidations=max((f["l1_invalidations_in_loops"] for n, f in per_fn.items()
                                   if n.startswith(("wait_until", "wait_counter", "spin_packet"))), default=0),
    )
    if ptxas_log is not None:
        rep = parse_ptxas(ptxas_log)
        facts.update(ptxas_registers=rep.registers, ptxas_functions=rep.functions,
                     spill_store_bytes=sum(f["spill_stores"] for f in rep.functions.values()),
                     spill_load_bytes=sum(f["spill_loads"] for f in rep.functions.values()))
    else:
        facts.update(spill_store_bytes=facts["spill_store_bytes_sass"], spill_load_bytes=facts["spill_load_bytes_sass"])
    return facts


def goals(facts: dict, protocol: str) -> dict[str, bool | None]:
    """The static goals: True (pass), False (fail) or None (not applicable to the protocol)."""
    loop = facts["sass"].get(facts["loop_function"])
    simple = protocol == "Simple"
    return {
        "no_spills": facts["spill_store_bytes"] == 0 and facts["spill_load_bytes"] == 0,
        "no_local_in_loop": bool(loop) and loop["ldl_in_loops"] == 0 and loop["stl_in_loops"] == 0,
        "blocks_ge_2": facts["blocks_per_sm"] >= 2 if simple else None,
        "vec128": (bool(loop) and loop["ld128_in_loops"] > 0 and loop["st128_in_loops"] > 0) if simple else None,
        "loads_in_flight": facts["ld128_before_first_use"] >= MIN_LOADS_IN_FLIGHT if simple else None,
        "one_sys_fence": facts["membar_sys_per_release"] <= 1,
    }


# The static gates' thresholds: 128-bit loads a thread has in flight before it first uses one in
# Simple's element loop (4 per operand, 2 operands: a slot and a source), and system fences per release.
MIN_LOADS_IN_FLIGHT = 8
