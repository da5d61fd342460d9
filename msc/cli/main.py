"""The ``msc`` command line.

Exit codes: 0 ok, 1 verification failed, 2 bad input (no traceback unless
``--debug``). Commands import only what they need, so ``msc verify`` starts
fast (no numpy, CUDA or torch on that path).
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import sys
from typing import Any

from msc.errors import MscError, UsageError, VerificationError
from msc.perf import reuse_freed_memory
from msc.ir.ops import DEFAULT_PROTOCOL, PROTOCOL_NAMES, REDUCE_OP_NAMES
from msc.cli.args import (add_collective_arg, collective_kw, param_value, protocol_arg, refuse_inapplicable,
                          split_param)
from msc.units import size_arg


def algorithm_params(alg, items: list[str]) -> dict[str, Any]:
    """``--param name=value`` items for ``alg``: each name one of its
    parameters, given once, its value read as its default's type."""
    params: dict[str, Any] = {}
    for item in items or ():
        key, raw = split_param(item)
        if key not in alg.params:
            known = ", ".join(sorted(alg.params))
            raise UsageError(f"--param {key}: algorithm {alg.name!r} has no parameter {key} "
                             + (f"(parameters: {known})" if known else "(it takes no parameters)"))
        if key in params:
            raise UsageError(f"--param {key} is given twice")
        params[key] = param_value(key, raw, alg.params[key])
    return params


def pick_algorithm(path: str, name: str | None):
    from msc.dsl.loader import load_algorithms

    algs = load_algorithms(path)
    if not algs:
        raise UsageError(f"{path} defines no @msc.algorithm")
    if name is None:
        if len(algs) > 1:
            raise UsageError(f"{path} defines several algorithms ({', '.join(a.name for a in algs)}); pick one with --name")
        return algs[0]
    for alg in algs:
        if alg.name == name:
            return alg
    raise UsageError(f"{path} has no algorithm {name!r} (it has {', '.join(a.name for a in algs)})")


def trace_from_args(args):
    import msc

    alg = pick_algorithm(args.file, args.name)
    if args.ranks is None:
        raise UsageError("--ranks N is required for an @msc.algorithm file")
    if args.script_args:
        raise UsageError(f"arguments after -- ({' '.join(args.script_args)}) are for MSCCLang scripts; "
                         f"{args.file} is an @msc.algorithm file: use --ranks and --param")
    inplace = None if args.inplace is None else args.inplace == "in"
    params = algorithm_params(alg, args.param)
    if inplace and not alg.inplace:
        return forced_in_place(alg, args.ranks, params)
    return msc.trace(alg, args.ranks, inplace=inplace, **params)


def forced_in_place(alg, ranks: int, params: dict):
    """The in-place form of an algorithm declared out-of-place only
    (``inplace=False``), traced and verified now, so that a failure says
    that plainly, naming the algorithm, before the verifier's detail."""
    import msc

    try:
        program = msc.trace(alg, ranks, inplace=True, **params)
        msc.verify(program)
    except (VerificationError, UsageError) as exc:
        what = (f"algorithm {alg.name!r} is out-of-place only (@msc.algorithm(..., inplace=False)); its in-place "
                f"form (--inplace in) does not work")
        if isinstance(exc, UsageError):
            raise UsageError(f"{what}: {exc}") from exc
        raise VerificationError(f"{what}: {exc.detail}", rank=exc.rank, buffer=exc.buffer, index=exc.index,
                                expected=exc.expected, found=exc.found, where=exc.where) from exc
    return program


def is_plan_file(path: str) -> bool:
    """A .plan, .xml or .json (MSCCL++) file, or any existing file that is
    not Python; other names are algorithm files or library names (allreduce/ring)."""
    from pathlib import Path

    if path.endswith((".plan", ".xml", ".json")):
        return True
    return not path.endswith(".py") and Path(path).is_file()


ALGORITHM_FLAGS = (("ranks", "--ranks"), ("param", "--param"), ("name", "--name"), ("inplace", "--inplace"))


def reject_algorithm_flags(args, kind: str = "plan") -> None:
    """A plan (or an MSCCLang script) takes none of the flags that say how to
    trace an @msc.algorithm; a plan takes no arguments for a script."""
    given = [flag for attr, flag in ALGORITHM_FLAGS if getattr(args, attr) not in (None, [])]
    if given and kind == "plan":
        raise UsageError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to algorithm files; {args.file} "
                         f"is a plan (its ranks and parameters are fixed): leave {'them' if len(given) > 1 else 'it'} "
                         f"out")
    if given:
        raise UsageError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to @msc.algorithm files; "
                         f"{args.file} is an MSCCLang script: give its arguments after -- "
                         f"(msc {args.command} {args.file} -- ARGS)")
    if args.script_args and kind == "plan":
        raise UsageError(f"arguments after -- are for MSCCLang scripts; {args.file} is a plan")


def cmd_verify(args) -> int:
    with time_limit(args.timeout, f"msc verify {args.file}"):
        reports = verify_reports(args)
    for report in reports:
        if args.json:
            print(json.dumps(report.to_dict()))
        elif hasattr(report, "operations"):         # an MSCCL++ execution plan, checked one-sidedly
            print(f"verified MSCCL++ plan: {report.name} ({report.collective}, {report.num_ranks} ranks, "
                  f"{report.threadblocks} threadblocks, {report.operations} operations, run at {report.chunk_bytes}-byte "
                  f"chunks) in {report.seconds:.3f} s: no deadlock, no race, semaphores balanced, within the "
                  f"executor's limits; " + ("outputs right" if report.results_checked else
                                            "results NOT checked: msc does not know the collective"))
        elif is_plan_file(args.file) and not report.results_checked:
            print(f"verified plan structurally: {report.name} ({report.collective}, {report.num_ranks} ranks, "
                  f"{report.threadblocks} threadblocks, {report.steps} steps, {report.connections} connections, "
                  f"{report.slots} slot(s)) in {report.seconds:.3f} s: no deadlock, no race, within the limits; "
                  f"results NOT checked: the file does not state its custom collective (give its definition: "
                  f"--collective FILE.py:NAME)")
        elif is_plan_file(args.file):
            print(f"verified plan: {report.name} ({report.collective}, {report.num_ranks} ranks, "
                  f"{report.threadblocks} threadblocks, {report.steps} steps, {report.connections} connections, "
                  f"{report.slots} slot(s)) in {report.seconds:.3f} s: no deadlock, no race, outputs right")
        else:
            print(f"verified: {report.name} ({report.collective}, {report.num_ranks} ranks, "
                  f"{report.ops} ops, {report.chunk_ops} chunk ops, {report.output_chunks} output chunks checked) "
                  f"in {report.seconds:.3f} s")
    return 0


def verify_reports(args) -> list:
    """What ``msc verify`` checks: a plan, the programs an MSCCLang script
    defines, or an algorithm traced at ``--ranks``."""
    import msc
    from msc.compat.scripts import run_script
    from msc.dsl.loader import is_msccl_script

    if is_plan_file(args.file):
        from msc.formats.load import load_plan, verify_at_capacity

        reject_algorithm_flags(args)
        from msc.formats.load import plan_reader, states_nothing, structural

        given = collective_kw(args)
        if plan_reader(args.file) == "mscclpp":
            return [verify_mscclpp(args, given)]
        plan = load_plan(args.file, verify=False, slots=args.slots, runtime=args.runtime, **given)
        if states_nothing(plan):            # MSCCL XML of a custom collective, no definition given
            return [replace(verify_at_capacity(plan, collective=structural(plan)), results_checked=False)]
        return [verify_at_capacity(plan, **given)]
    given = [flag for flag, value in (("--slots", args.slots), ("--runtime", args.runtime)) if value is not None]
    if given:       # an algorithm's plan gets its slots from lowering (msc compile --runtime)
        raise UsageError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to plans (.plan, MSCCL "
                         f".xml); {args.file} is an algorithm: `msc compile --runtime` lowers it for a runtime")
    if is_msccl_script(args.file):
        reject_algorithm_flags(args, "script")
        programs = run_script(args.file, args.script_args)
        if not programs:
            raise UsageError(f"{args.file} defined no MSCCLProgram")
        return [already_checked(p) or msc.verify(p) for p in programs]
    return [msc.verify(trace_from_args(args))]


def verify_mscclpp(args, given: dict):
    """An MSCCL++ execution plan, checked as its executor runs it (any shape, not only msc's exports)."""
    from msc.errors import PlanError
    from msc.files import read_input
    from msc.formats.mscclpp.reader import parse_mscclpp
    from msc.ir.limits import MAX_PLAN_FILE_BYTES
    from msc.formats.mscclpp.check import verify_mscclpp

    for value, flag in ((args.slots, "--slots"), (args.runtime, "--runtime")):
        if value is not None:
            raise UsageError(f"{flag} applies to msc plans and MSCCL XML; {args.file} is an MSCCL++ execution plan, "
                             f"whose synchronisation is in the file")
    data = read_input(args.file, MAX_PLAN_FILE_BYTES, what="plan", error=PlanError)
    return verify_mscclpp(parse_mscclpp(data, path=args.file), **given)


def already_checked(program):
    """The report of an MSCCLang script's own Check() where it covers the
    finished program (msc.compat.msccl.checked_report): no need to verify it twice."""
    from msc.compat.msccl import checked_report

    return checked_report(program)


def lower_options(args, overrides: dict | None = None):
    from msc.lower.pipeline import LowerOptions

    values = dict(protocol=args.protocol, instances=args.instances, threadblocks=args.threadblocks,
                  fuse=not args.no_fuse, tile=args.tile, runtime=args.runtime)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return LowerOptions(**values)


DEFAULT_DTYPE = "float32"      # msc compile --emit cuda's


def default_plan_name(program, options) -> str:
    parts = [program.collective, program.name, f"n{program.num_ranks}"]
    if options.instances != 1:
        parts.append(f"i{options.instances}")
    if options.protocol != DEFAULT_PROTOCOL:
        parts.append(options.protocol)
    return "-".join(parts) + ".plan"


def cmd_compile(args) -> int:
    import time

    import msc
    from msc.dsl.collectives import BUILTIN
    from msc.compat.scripts import run_script
    from msc.dsl.loader import is_msccl_script
    from msc.lower.pipeline import lower
    from msc.formats.plan_text import save_plan

    if is_plan_file(args.file):
        kind = "MSCCL XML" if args.file.endswith(".xml") else "a plan"
        raise UsageError(f"{args.file} is {kind}, not an algorithm file: msc compile takes an algorithm (.py) "
                         f"and writes a plan; to check this one use `msc verify {args.file}`, to run it "
                         f"`msc run {args.file}`" + ("; `msc import` reads it into a .plan file" if
                                                      args.file.endswith(".xml") else ""))
    cuda_only = [flag for flag in ("arch", "form", "dtype", "op") if getattr(args, flag) is not None]
    if args.emit is None and cuda_only:
        raise UsageError(f"{', '.join('--' + f for f in cuda_only)} go{'es' if len(cuda_only) == 1 else ''} with "
                         f"--emit cuda")
    with time_limit(args.timeout, f"msc compile {args.file}"):   # CUDA emission too
        start = time.perf_counter()
        if is_msccl_script(args.file):
            reject_algorithm_flags(args, "script")
            programs = run_script(args.file, args.script_args)
            if not programs:
                raise UsageError(f"{args.file} defined no MSCCLProgram")
            jobs = []
            for prog in programs:
                given = prog.params
                jobs.append((prog, lower_options(args, {
                    "instances": given.get("instances"), "protocol": given.get("protocol"),
                    "threadblocks": given.get("threadblock_policy"), "fuse": given.get("instr_fusion")})))
        else:
            prog = trace_from_args(args)
            jobs = [(prog, lower_options(args))]
        if args.output and len(jobs) > 1:
            raise UsageError(f"{args.file} defines {len(jobs)} programs; -o names one file (leave it out)")
        for prog, _ in jobs:                     # before anything is written
            refuse_inapplicable(prog.collective, op=args.op, op_flag="--op")
        for prog, options in jobs:
            already_checked(prog) or msc.verify(prog)
            plan = lower(prog, options)           # ends with the plan verifier, against the program's collective
            builtin = type(prog.layout.collective) in BUILTIN.values()      # what loading verifies against
            path = save_plan(plan, args.output or default_plan_name(prog, options), verified=builtin)
            seconds = time.perf_counter() - start
            emitted, how, emit_seconds = [], "", 0.0
            if args.emit == "cuda":                    # NVRTC's time is not verification's
                emitted, how = emit_cuda(plan, path, args)
                emit_seconds = time.perf_counter() - start - seconds
            report_compiled(args, prog, plan, path, seconds, emitted, how, emit_seconds)
            start = time.perf_counter()
    return 0


def report_compiled(args, prog, plan, path, seconds, emitted, how, emit_seconds) -> None:
    tbs = sum(len(r.threadblocks) for r in plan.ranks)
    if args.json:
        print(json.dumps({"algorithm": prog.name, "plan": str(path), "ranks": plan.num_ranks,
                          "steps": plan.num_steps(), "threadblocks": tbs, "slots": plan.slots,
                          "protocol": plan.protocol, "instances": plan.instances, "runtime": args.runtime,
                          "emitted": [str(p) for p in emitted],
                          "seconds": round(seconds, 6), "emit_seconds": round(emit_seconds, 6), "verified": True}))
        return
    print(f"compiled: {prog.name} ({plan.collective}, {plan.num_ranks} ranks, {plan.protocol}, "
          f"{plan.instances} instance(s)) -> {path}: {plan.num_steps()} steps in {tbs} threadblocks, "
          f"{plan.slots} slot(s){'' if args.runtime == 'msc' else ', fits the ' + args.runtime + ' runtime'}; "
          f"program verified, lowered and plan verified in {seconds:.3f} s")
    if emitted:
        print(f"  CUDA: {how} in {emit_seconds:.3f} s")
    for p in emitted:
        print(f"  wrote {p}")


def emit_cuda(plan, plan_path, args) -> tuple[list, str]:
    """Write the plan's CUDA source (and, with --arch, its cubin) next to it,
    and for the table form the plan's tables as text (the kernel's source
    holds no plan then); returns the files and what was done, for the report."""

    from msc.cuda import compile as compile_cuda
    from msc.cuda import render
    from msc.cuda.codegen import choose_form, describe_tables
    from msc.cuda.compiler import tables

    dtype, op = args.dtype or DEFAULT_DTYPE, args.op or "sum"
    stem = plan_path.with_suffix("")
    tag = f"{dtype}-{op}"
    cu = stem.with_name(f"{stem.name}.{tag}.cu")
    written = [cu]
    if args.arch is None:
        source, _ = render(plan, dtype=dtype, op=op, form=args.form)
        cu.write_text(source)
        how = "source rendered"
    else:
        kernel = compile_cuda(plan, dtype=dtype, op=op, arch=args.arch, form=args.form)
        cubin = stem.with_name(f"{stem.name}.{tag}.{args.arch}.cubin")
        cu.write_text(kernel.source)            # the text the cubin was compiled from, as checked
        cubin.write_bytes(kernel.cubin)
        written.append(cubin)
        how = "taken from the kernel cache" if kernel.cache_hit else f"rendered and compiled with NVRTC for {args.arch}"
    if choose_form(plan, args.form) == "table":
        text = stem.with_name(f"{stem.name}.{tag}.tables.txt")
        text.write_text(describe_tables(tables(plan, op=op)))
        written.append(text)
    return written, how


def load_plan_arg(path: str, verify: bool = True, *, slots: int | None = None, runtime: str | None = None,
                  collective=None):
    from msc.formats.load import load_plan

    return load_plan(path, verify=verify, slots=slots, runtime=runtime, collective=collective)


def cmd_export(args) -> int:
    from msc.errors import FormatError, RuntimeLimitError
    from msc.files import same_file, write_output
    from msc.formats.xml_export import plan_to_xml

    if args.output and same_file(args.plan, args.output):
        raise UsageError(f"-o {args.output} is the plan being exported ({args.plan}); name another file")
    plan = load_plan_arg(args.plan, verify=not args.no_verify, **collective_kw(args))
    if args.format == "mscclpp":
        return export_mscclpp(args, plan)
    try:
        text = plan_to_xml(plan, runtime=args.runtime, min_bytes=args.min_bytes, max_bytes=args.max_bytes)
    except FormatError as exc:             # name the format that can say it, where it does
        raise FormatError(f"{exc.detail}; {mscclpp_route(args, plan, exc.kind)}", kind=exc.kind, rank=exc.rank,
                          tb=exc.tb, step=exc.step) from None
    except RuntimeLimitError as exc:       # say how to get a plan that fits
        raise RuntimeLimitError(exc.limit, exc.value, exc.maximum, f"{exc.detail}; a plan lowered for it fits "
                                f"(msc compile ALGORITHM --runtime {args.runtime}) or is refused naming the limit",
                                runtime=exc.runtime, rank=exc.rank, tb=exc.tb, step=exc.step) from None
    if args.output:
        write_output(args.output, text)          # whole or not at all
        print(f"exported {args.plan} -> {args.output} (MSCCL XML for the {args.runtime} runtime)")
    else:
        sys.stdout.write(text)
    return 0


_MSCCLPP_CAN = {"switch": "MSCCL++ has switch channels, which do what NVLS does",
                "buffers": "MSCCL++ gives each buffer its own size"}


def mscclpp_route(args, plan, kind: str) -> str:
    """What to run instead of an MSCCL XML export the format cannot say:
    the MSCCL++ export, tried here (named only where it works)."""
    from pathlib import Path

    from msc.formats.mscclpp.export import plan_to_mscclpp_json
    from msc.formats.mscclpp.limits import check_limits
    from msc.formats.mscclpp.reader import parse_mscclpp

    try:
        check_limits(parse_mscclpp(plan_to_mscclpp_json(plan)))
    except MscError as exc:
        return f"an MSCCL++ execution plan (--format mscclpp) cannot hold it either: {exc}"
    out = Path(args.output).with_suffix(".json") if args.output else Path(args.plan).with_suffix(".json").name
    why = _MSCCLPP_CAN.get(kind, "MSCCL++ can")
    return (f"export it as an MSCCL++ execution plan instead ({why}; tried here: it exports and fits the MSCCL++ "
            f"executor): msc export {args.plan} --format mscclpp -o {out}")


def export_mscclpp(args, plan) -> int:
    from msc.files import write_output
    from msc.formats.mscclpp.export import plan_to_mscclpp_json
    from msc.formats.mscclpp.limits import check_limits
    from msc.formats.mscclpp.reader import parse_mscclpp

    given = [flag for flag, value, default in (("--runtime", args.runtime, "msccl"), ("--min-bytes", args.min_bytes, 0),
                                               ("--max-bytes", args.max_bytes, None)) if value != default]
    if given:
        raise UsageError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --format msccl-xml")
    text = plan_to_mscclpp_json(plan)
    check_limits(parse_mscclpp(text))           # what the executor takes, counted as its loader counts
    if args.output:
        write_output(args.output, text)
        print(f"exported {args.plan} -> {args.output} (MSCCL++ execution plan)")
    else:
        sys.stdout.write(text)
    return 0


def cmd_import(args) -> int:
    """Read, verify and check everything first; write the plan last (whole
    or not at all), never over the file being read."""
    from msc.files import same_file
    from msc.formats.plan_text import save_plan
    from msc.formats.load import read_plan_file
    from msc.formats.xml_import import xml_byte_range

    if same_file(args.xml, args.output):
        raise UsageError(f"-o {args.output} is the file being imported ({args.xml}); name another file")
    plan, data, reader = read_plan_file(args.xml, verify=not args.no_verify, slots=args.slots, runtime=args.runtime,
                                        **collective_kw(args))
    low, high = xml_byte_range(data, path=args.xml) if reader == "xml" else (0, None)
    save_plan(plan, args.output, verified=not args.no_verify)
    print(f"imported {args.xml} -> {args.output}: {plan.collective}, {plan.num_ranks} ranks, "
          f"{plan.num_steps()} steps" + ("" if args.no_verify else ", verified"))
    if (low, high) != (0, None):     # a .plan holds no size range: say where it goes instead
        print(f"note: the XML selects sizes {low} <= bytes < {high if high is not None else 'any'}; a plan file "
              f"does not keep that: give it as min_bytes/max_bytes in the plans.json that registers "
              f"{args.output}", file=sys.stderr)
    return 0


def cmd_diff(args) -> int:
    """0 the same schedule, 1 a difference (as diff(1)), 2 bad input: a
    plan that does not verify under --verify is bad input, not a difference."""
    from msc.formats.diff import diff_plans, file_lines, line_of
    from msc.errors import PlanError
    from msc.formats.load import read_plan_file

    mode = "equivalent" if args.equivalent else "exact"
    with time_limit(args.timeout, f"msc diff {args.a} {args.b}"):
        loaded = []
        for path in (args.a, args.b):
            try:
                loaded.append(read_plan_file(path, verify=args.verify, **collective_kw(args)))
            except VerificationError as exc:
                raise PlanError(f"{path} does not verify (--verify): {exc}") from None
        found = diff_plans(loaded[0][0], loaded[1][0], equivalent=args.equivalent, names=(args.a, args.b))
    if found is None:
        if args.json:
            print(json.dumps({"equal": True, "mode": mode, "a": args.a, "b": args.b}))
        else:
            print("equal" + (" (up to dependency equivalence)" if args.equivalent else ""))
        return 0
    sides = []
    for path, (_, data, reader), side in zip((args.a, args.b), loaded, (found.a, found.b)):
        line = line_of(file_lines(data, reader), side.key)      # read only now: the same plans cost nothing
        sides.append((path, line, side))
    if args.json:
        detail = found.to_dict()
        for name, (path, line, _) in zip("ab", sides):
            detail[name].update(file=path, line=line)
        print(json.dumps({"equal": False, "mode": mode, "a": args.a, "b": args.b, "difference": detail}))
        return 1
    print(f"differ: {found.summary}")
    for path, line, side in sides:
        where = f"{path}:{line}" if line is not None else path
        note = f" (from {side.source})" if side.source else ""
        print(f"  {where}: {side.position + ': ' if side.position else ''}{side.text}{note}")
    return 1


def cmd_list(args) -> int:
    from msc.dsl.loader import load_algorithms
    from msc.resources import data_dir

    if args.files:
        files = args.files
    else:
        root = data_dir("algorithms")
        files = sorted(str(p) for p in root.rglob("*.py") if p.name != "__init__.py")
    for path in files:
        for alg in load_algorithms(path):
            params = ", ".join(f"{k}={v!r}" for k, v in alg.params.items())
            doc = alg.doc.splitlines()[0] if alg.doc else ""
            print(f"{path}  {alg.name}  [{alg.collective.name}{', ' + params if params else ''}]  {doc}")
    return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (a finite number > 0), got {text!r}")
    return value


class time_limit:
    """``with time_limit(seconds):`` bounds the block: ``TimeLimitExceeded``
    is raised wherever it stands (the user's code, msc's) once ``seconds``
    have passed; None or 0: no limit.

    POSIX only, from the main thread: SIGALRM (``signal.setitimer``), whose
    Python handler runs between bytecodes, so a long call into C (numpy,
    NVRTC) ends before it is stopped. After expiring, the alarm repeats every
    0.25 s, so code that catches and ignores the exception (a bare
    ``except:``) still stops; code that keeps ignoring it for 2 s more ends
    the process (exit status 2), as nothing else can stop it. On the way
    out the timer and the previous handler are put back, and a timer that
    was running before (pytest-timeout's, say) goes on with what it had left.
    """

    REPEAT = 0.25
    GRACE = 2.0

    def __init__(self, seconds: float | None, what: str = "msc"):
        self.seconds, self.what = seconds, what
        self.active, self.expired_at = False, None

    def __enter__(self):
        if not self.seconds:
            return self
        import signal
        import threading
        import time

        if not hasattr(signal, "setitimer"):
            raise UsageError("--timeout needs POSIX signals (SIGALRM), which this platform does not have")
        if threading.current_thread() is not threading.main_thread():
            raise UsageError("--timeout works only in the main thread (it uses SIGALRM)")
        self.started = time.monotonic()
        self.previous = signal.signal(signal.SIGALRM, self._alarm)
        self.active = True
        self.outer = signal.setitimer(signal.ITIMER_REAL, self.seconds, self.REPEAT)
        return self

    def _alarm(self, signum, frame) -> None:
        if not self.active:
            return
        import time

        now = time.monotonic()
        if self.expired_at is None:
            self.expired_at = now
        elif now - self.expired_at > self.GRACE:
            import os

            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os.write(2, f"msc: {self.what} did not finish in {self.seconds:g} s (--timeout) and kept catching "
                        f"the interruption: exiting\n".encode())
            os._exit(2)
        from msc.dsl.program import TimeLimitExceeded

        raise TimeLimitExceeded(self.seconds)

    def __exit__(self, *exc) -> bool:
        if not self.seconds:
            return False
        import signal
        import time

        try:
            self.active = False            # first: an alarm from now on does nothing
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous if self.previous is not None else signal.SIG_DFL)
            delay, interval = self.outer
            if delay > 0:
                signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - self.started), 1e-3), interval)
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msc", description="compiler for GPU collective-communication schedules")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="verify, compile, run, bench, simulate, tune, show, bound, synthesize, calibrate, "
                                     "export, import, diff, list")
    # registration order is the order --help lists the commands in
    _add_verify_parser(sub)
    _add_compile_parser(sub)
    _add_export_parser(sub)
    _add_import_parser(sub)
    _add_diff_parser(sub)
    from msc.cli.run import add_run_command
    from msc.cli.sim import add_commands as add_simulation_commands

    add_run_command(sub, load_plan_arg)
    from msc.cli.bench import add_bench_command

    add_bench_command(sub, load_plan_arg)           # msc bench PLAN --backend cuda
    add_simulation_commands(sub, load_plan_arg)      # simulate, tune, show
    from msc.cli.bound import add_bound_command

    add_bound_command(sub)                           # msc bound COLLECTIVE --topology T
    from msc.cli.synth import add_synthesize_command

    add_synthesize_command(sub)                      # msc synthesize COLLECTIVE --topology T -o FILE.py
    from msc.cli.calibrate import add_calibrate_command

    add_calibrate_command(sub)                       # msc calibrate NCCL_TESTS_OUTPUT... --topology T -o FILE.toml

    _add_list_parser(sub)
    return parser


def _add_algorithm_args(p) -> None:
    """The arguments that name an algorithm and how to trace it (verify, compile)."""
    p.add_argument("file", help="algorithm file (or library name such as allreduce/ring)")
    p.add_argument("--ranks", "-n", type=int, help="number of ranks")
    p.add_argument("--param", "-p", action="append", default=[], metavar="NAME=VALUE",
                   help="algorithm parameter, read as the type of its default (repeatable)")
    p.add_argument("--name", help="which algorithm, when the file defines several")
    p.add_argument("--inplace", choices=("in", "out"), help="force the in-place or out-of-place form")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="give up (exit 2) if the command (loading, tracing, verifying, lowering, --emit) "
                        "takes longer; otherwise the algorithm's Python runs with no limit (POSIX: SIGALRM)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")


def _add_verify_parser(sub) -> None:
    """msc verify FILE: an algorithm, or a plan."""
    from msc.lower.runtimes import add_capacity_args

    p = sub.add_parser("verify", help="verify an algorithm symbolically, or a plan (.plan / MSCCL .xml)")
    _add_algorithm_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_capacity_args(p)
    add_collective_arg(p)
    p.set_defaults(func=cmd_verify)


def _add_compile_parser(sub) -> None:
    """msc compile FILE: verify, lower, verify the plan, write it."""
    from msc.lower.runtimes import DEFAULT_TARGET, RUNTIMES

    p = sub.add_parser("compile", help="verify an algorithm, lower it to a plan, verify the plan, write it")
    _add_algorithm_args(p)
    p.add_argument("--protocol", type=protocol_arg, choices=PROTOCOL_NAMES, default=DEFAULT_PROTOCOL,
                   help="transport: Simple (default), LL (low latency: data and flag in one 8-byte store) or "
                        "LL128 (any case)")
    p.add_argument("--instances", type=int, default=1, help="replicate the schedule on more channels")
    p.add_argument("--threadblocks", choices=("auto", "manual"), default="auto",
                   help="manual: honour the sendtb/recvtb hints")
    p.add_argument("--no-fuse", action="store_true", help="keep every send and receive a step of its own")
    p.add_argument("--runtime", choices=tuple(RUNTIMES), default=DEFAULT_TARGET,
                   help="the runtime the plan must fit: msc (its own CUDA runtime, the default: as many slots "
                        "per connection as the plan needs), msccl (microsoft/msccl) or azure "
                        "(Azure/msccl-executor-nccl): their slots per connection, steps per threadblock and "
                        "threadblocks; lowering tries other channel spreads and no fusion to fit, else fails "
                        "naming the limit")
    p.add_argument("--tile", type=int, default=0, help="pipelining tile in bytes per chunk (0: runtime default)")
    p.add_argument("-o", "--output", help="plan file (default: COLLECTIVE-NAME-nRANKS.plan)")
    p.add_argument("--emit", choices=("cuda",), help="also write the CUDA source next to the plan")
    p.add_argument("--arch", help="with --emit cuda: compile with NVRTC for this arch (sm_90, sm_80...) and "
                                  "write the .cubin too")
    p.add_argument("--dtype", help=f"with --emit cuda: data type ({DEFAULT_DTYPE} (default), bfloat16, float16, "
                                   "float64, int32)")
    p.add_argument("--op", choices=REDUCE_OP_NAMES,
                   help="with --emit cuda: the reduction (default sum; an error for collectives that do not reduce)")
    p.add_argument("--form", choices=("straight", "table"),
                   help="with --emit cuda: straight-line or table-driven kernel (default: by plan size)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_compile)


def _add_export_parser(sub) -> None:
    """msc export PLAN: MSCCL XML."""
    p = sub.add_parser("export", help="write a plan as MSCCL XML or an MSCCL++ execution plan")
    p.add_argument("plan", help="plan file (.plan, or MSCCL XML)")
    p.add_argument("--format", choices=("msccl-xml", "mscclpp"), default="msccl-xml",
                   help="output format: msccl-xml (MSCCL-IR XML, default) or mscclpp (MSCCL++ execution plan, JSON)")
    p.add_argument("--runtime", choices=("msccl", "azure"), default="msccl",
                   help="which MSCCL runtime reads it (attribute spellings)")
    p.add_argument("--min-bytes", type=size_arg, default=0,
                   help="smallest message size (bytes; K, M, G, T) the runtime should pick this plan for (default 0)")
    p.add_argument("--max-bytes", type=size_arg, default=None,
                   help="the runtime picks this plan for sizes below this many bytes (K, M, G, T; default: no "
                        "limit)")
    p.add_argument("-o", "--output", help="XML file to write (default: standard output)")
    p.add_argument("--no-verify", action="store_true", help="skip verifying the plan before exporting it")
    add_collective_arg(p)
    p.set_defaults(func=cmd_export)


def _add_import_parser(sub) -> None:
    """msc import XML -o PLAN."""
    from msc.lower.runtimes import add_capacity_args

    p = sub.add_parser("import", help="read MSCCL XML (from MSCCLang, TACCL, by hand) into a plan file")
    p.add_argument("xml", help="MSCCL XML file, or an MSCCL++ execution plan (.json) of the shape msc exports")
    p.add_argument("-o", "--output", required=True, help="plan file to write")
    p.add_argument("--no-verify", action="store_true", help="skip verifying the plan (it is then not marked verified)")
    add_capacity_args(p)
    add_collective_arg(p)
    p.set_defaults(func=cmd_import)


def _add_diff_parser(sub) -> None:
    """msc diff A B."""
    p = sub.add_parser("diff", help="compare two plans (.plan or MSCCL XML, any mix): equal (exit 0) or the first "
                                    "difference (exit 1)")
    p.add_argument("a", metavar="A", help="plan file (.plan, or MSCCL XML)")
    p.add_argument("b", metavar="B", help="plan file (.plan, or MSCCL XML)")
    p.add_argument("--equivalent", action="store_true",
                   help="compare up to dependency equivalence: each rank's operations (peer and channel of what "
                        "they send or receive) and their happens-before order; nops, waits implied by others, "
                        "threadblock numbering, instances, slots and tile do not count (default: exact, the "
                        "name and source-line notes aside)")
    p.add_argument("--verify", action="store_true",
                   help="verify both plans first; one that fails is an error (exit 2). By default plans are "
                        "compared as written, broken ones too (they must still read: values in range)")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    add_collective_arg(p)
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="give up (exit 2) if reading, verifying and comparing take longer (POSIX: SIGALRM)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")
    p.set_defaults(func=cmd_diff)


def _add_list_parser(sub) -> None:
    """msc list [FILE...]."""
    p = sub.add_parser("list", help="list the algorithms in files (default: the library)")
    p.add_argument("files", nargs="*", metavar="FILE", help="algorithm files or library names (default: the library)")
    p.set_defaults(func=cmd_list)


SCRIPT_COMMANDS = ("verify", "compile")       # the commands that pass `-- ARGS` to an MSCCLang script


def main(argv: list[str] | None = None) -> int:
    """``msc COMMAND ... [-- SCRIPT ARGS]``: what follows the first ``--``
    goes, untouched, to an MSCCLang script as its ``sys.argv[1:]``.

    Exit status: 0 ok, 1 verification failed, 2 bad input (the user's code
    failing or exiting included), 130 interrupted (Ctrl-C). ``--debug``
    adds the traceback and keeps the status."""
    if argv is None:                  # msc as its own process (not main([...]) inside another program)
        reuse_freed_memory()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    debug = "--debug" in argv
    import warnings

    shown = warnings.formatwarning
    if not debug:                     # --debug: Python's own form, with the source line
        warnings.formatwarning = one_line_warning
    try:
        parser = build_parser()
        parser.epilog = "Arguments after -- are passed to an MSCCLang script (msc verify/compile prog.py -- 8 1)."
        args = parser.parse_args(argv)
        args.argv, args.script_args = argv, script_args
        return _run(args)
    except KeyboardInterrupt:
        if debug:
            import traceback

            traceback.print_exc()
        print("msc: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = shown


def _run(args) -> int:
    from msc import progress
    from msc.dsl.program import TimeLimitExceeded, describe

    try:
        if args.script_args and args.command not in SCRIPT_COMMANDS:
            raise UsageError(f"msc {args.command} takes no arguments after -- (only msc verify and msc compile "
                             f"pass them to an MSCCLang script); got {' '.join(args.script_args)}")
        with progress.quiet(getattr(args, "json", False)):      # --json: stdout and stderr stay machine-readable
            return args.func(args)
    except VerificationError as exc:
        return _fail(args, 1, "verification failed", exc, exc.to_dict())
    except MscError as exc:
        return _fail(args, 2, "error", exc)
    except BrokenPipeError:          # output piped into `head`: stop quietly
        sys.stderr.close()
        return 0
    except TimeLimitExceeded as exc:
        where = user_frame(exc)
        target = " ".join(x for x in ("msc", args.command, getattr(args, "file", None)) if x)
        return _fail(args, 2, "error", f"{target} did not finish in {exc.seconds:g} s (--timeout)"
                                       + (f"; it was at {where}" if where else ""))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:     # the user's code: exceptions and exits the loader and tracer did not see
        where = user_frame(exc)
        if where is None and isinstance(exc, (OSError, ValueError)):
            return _fail(args, 2, "error", exc)
        if where is None and isinstance(exc, Exception):
            raise                    # a bug in msc: its traceback says where
        text = describe(exc, "in user code")
        return _fail(args, 2, "error", f"{where}: {text}" if where else text)


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A Python warning as msc prints it: one line, without the source line
    Python adds; where it comes from only if that is the user's code."""
    import sysconfig

    from msc.dsl.program import _display_path, _internal

    installed = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    mine = _internal(filename) or filename.startswith(installed) or filename.startswith("<")
    where = "" if mine else f"{_display_path(filename)}:{lineno}: "
    return f"msc: warning: {where}{category.__name__}: {message}\n"


def user_frame(exc: BaseException):
    """The innermost traceback line of the user's code: outside msc, the
    standard library and installed packages (None if there is none)."""
    import sysconfig

    from msc.dsl.program import _display_path, _internal
    from msc.errors import SourceLine

    installed = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    tb, found = exc.__traceback__, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (_internal(name) or name.startswith(installed) or name.startswith("<")):
            found = SourceLine(_display_path(name), tb.tb_lineno)
        tb = tb.tb_next
    return found


def _fail(args, code: int, title: str, exc, detail: dict | None = None) -> int:
    """Report an error in one line (JSON too with --json); --debug adds the
    traceback first and keeps the exit status."""
    if getattr(args, "debug", False):
        import traceback

        traceback.print_exc()
    _report(args, title, exc, detail if detail is not None else {"message": str(exc)})
    return code


def _report(args, title: str, exc, detail: dict) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"verified": False, "error": title, **detail}))
    print(f"msc: {title}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
