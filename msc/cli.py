"""The ``msc`` command line.

Exit codes: 0 ok, 1 verification failed, 2 bad input (no traceback unless
``--debug``). Commands import only what they need, so ``msc verify`` starts
fast (no numpy, CUDA or torch on that path).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from msc.errors import MscError, UsageError, VerificationError


def parse_params(items: list[str]) -> dict[str, Any]:
    """``--param k=v`` values: ints, floats, booleans, else strings."""
    params = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--param takes name=value, got {item!r}")
        params[key.strip()] = _literal(raw.strip())
    return params


def _literal(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def pick_algorithm(path: str, name: str | None):
    from msc.loader import load_algorithms

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
    inplace = None if args.inplace is None else args.inplace == "in"
    return msc.trace(alg, args.ranks, inplace=inplace, **parse_params(args.param))


def is_plan_file(path: str) -> bool:
    """A .plan or .xml file, or any existing file that is not Python; other
    names are algorithm files or library names (allreduce/ring)."""
    from pathlib import Path

    if path.endswith((".plan", ".xml")):
        return True
    return not path.endswith(".py") and Path(path).is_file()


def cmd_verify(args) -> int:
    import msc
    from msc.loader import is_msccl_script, run_script

    if is_plan_file(args.file):
        from msc.plan_text import load_plan
        from msc.plan_verify import verify_plan

        report = verify_plan(load_plan(args.file, verify=False))
        if args.json:
            print(json.dumps(report.to_dict()))
        else:
            print(f"verified plan: {report.name} ({report.collective}, {report.num_ranks} ranks, "
                  f"{report.threadblocks} threadblocks, {report.steps} steps, {report.connections} connections, "
                  f"{report.slots} slot(s)) in {report.seconds:.3f} s: no deadlock, no race, outputs right")
        return 0
    if is_msccl_script(args.file):
        programs = run_script(args.file, args.script_args)
        if not programs:
            raise UsageError(f"{args.file} defined no MSCCLProgram")
        reports = [already_checked(p) or msc.verify(p) for p in programs]
    else:
        if args.script_args:
            raise UsageError("arguments after -- are for MSCCLang scripts; use --ranks and --param here")
        reports = [msc.verify(trace_from_args(args))]
    for report in reports:
        if args.json:
            print(json.dumps(report.to_dict()))
        else:
            print(f"verified: {report.name} ({report.collective}, {report.num_ranks} ranks, "
                  f"{report.ops} ops, {report.chunk_ops} chunk ops, {report.output_chunks} output chunks checked) "
                  f"in {report.seconds:.3f} s")
    return 0


def already_checked(program):
    """The report of the script's own Check() if it saw every operation of
    the finished (sealed, immutable) program: no need to verify it twice."""
    checked = program.check_report
    if checked is not None and isinstance(program.ops, tuple) and checked[0] == len(program.ops):
        return checked[1]
    return None


def lower_options(args, overrides: dict | None = None):
    from msc.lower import LowerOptions

    values = dict(protocol=args.protocol, instances=args.instances, threadblocks=args.threadblocks,
                  fuse=not args.no_fuse, tile=args.tile)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return LowerOptions(**values)


def default_plan_name(program, options) -> str:
    parts = [program.collective, program.name, f"n{program.num_ranks}"]
    if options.instances != 1:
        parts.append(f"i{options.instances}")
    if options.protocol != "Simple":
        parts.append(options.protocol)
    return "-".join(parts) + ".plan"


def cmd_compile(args) -> int:
    import time

    import msc
    from msc.collectives import BUILTIN
    from msc.loader import is_msccl_script, run_script
    from msc.lower import lower
    from msc.plan_text import save_plan

    if is_msccl_script(args.file):
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
    if args.emit is None and (args.arch or args.form):
        raise UsageError("--arch and --form go with --emit cuda")
    if args.output and len(jobs) > 1:
        raise UsageError(f"{args.file} defines {len(jobs)} programs; -o names one file (leave it out)")
    for prog, options in jobs:
        start = time.perf_counter()
        already_checked(prog) or msc.verify(prog)
        plan = lower(prog, options)           # ends with the plan verifier, against the program's collective
        builtin = type(prog.layout.collective) in BUILTIN.values()      # what loading verifies against
        path = save_plan(plan, args.output or default_plan_name(prog, options), verified=builtin)
        emitted = emit_cuda(plan, path, args) if args.emit == "cuda" else []
        seconds = time.perf_counter() - start
        tbs = sum(len(r.threadblocks) for r in plan.ranks)
        if args.json:
            print(json.dumps({"algorithm": prog.name, "plan": str(path), "ranks": plan.num_ranks,
                              "steps": plan.num_steps(), "threadblocks": tbs, "slots": plan.slots,
                              "protocol": plan.protocol, "instances": plan.instances,
                              "emitted": [str(p) for p in emitted],
                              "seconds": round(seconds, 6), "verified": True}))
        else:
            print(f"compiled: {prog.name} ({plan.collective}, {plan.num_ranks} ranks, {plan.protocol}, "
                  f"{plan.instances} instance(s)) -> {path}: {plan.num_steps()} steps in {tbs} threadblocks, "
                  f"{plan.slots} slot(s); program and plan verified in {seconds:.3f} s")
            for p in emitted:
                print(f"  wrote {p}")
    return 0


def emit_cuda(plan, plan_path, args) -> list:
    """Write the plan's CUDA source (and, with --arch, its cubin) next to it."""
    import shutil

    from msc.cuda import compile as compile_cuda
    from msc.cuda import render

    stem = plan_path.with_suffix("")
    tag = f"{args.dtype}-{args.op}"
    cu = stem.with_name(f"{stem.name}.{tag}.cu")
    if args.arch is None:
        source, _ = render(plan, dtype=args.dtype, op=args.op, form=args.form)
        cu.write_text(source)
        return [cu]
    kernel = compile_cuda(plan, dtype=args.dtype, op=args.op, arch=args.arch, form=args.form)
    cubin = stem.with_name(f"{stem.name}.{tag}.{args.arch}.cubin")
    shutil.copyfile(kernel.source_path, cu)
    cubin.write_bytes(kernel.cubin)
    return [cu, cubin]


def load_plan_arg(path: str, verify: bool = True):
    from msc.plan_text import load_plan

    return load_plan(path, verify=verify)


def cmd_export(args) -> int:
    from msc.xml_export import plan_to_xml

    plan = load_plan_arg(args.plan, verify=not args.no_verify)
    text = plan_to_xml(plan, runtime=args.runtime, min_bytes=args.min_bytes, max_bytes=args.max_bytes)
    if args.output:
        from pathlib import Path

        Path(args.output).write_text(text)
        print(f"exported {args.plan} -> {args.output} (MSCCL XML for the {args.runtime} runtime)")
    else:
        sys.stdout.write(text)
    return 0


def cmd_import(args) -> int:
    from pathlib import Path

    from msc.plan_text import save_plan
    from msc.torch.registry import file_range

    plan = load_plan_arg(args.xml, verify=not args.no_verify)
    save_plan(plan, args.output, verified=not args.no_verify)
    print(f"imported {args.xml} -> {args.output}: {plan.collective}, {plan.num_ranks} ranks, "
          f"{plan.num_steps()} steps" + ("" if args.no_verify else ", verified"))
    low, high = file_range(Path(args.xml))
    if (low, high) != (0, None):     # a .plan holds no size range: say where it goes instead
        print(f"note: the XML selects sizes {low} <= bytes < {high if high is not None else 'any'}; a plan file "
              f"does not keep that: give it as min_bytes/max_bytes in the plans.json that registers "
              f"{args.output}", file=sys.stderr)
    return 0


def cmd_list(args) -> int:
    from msc.loader import load_algorithms
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msc", description="compiler for GPU collective-communication schedules")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    def algorithm_args(p):
        p.add_argument("file", help="algorithm file (or library name such as allreduce/ring)")
        p.add_argument("--ranks", "-n", type=int, help="number of ranks")
        p.add_argument("--param", "-p", action="append", default=[], metavar="NAME=VALUE",
                       help="algorithm parameter (repeatable)")
        p.add_argument("--name", help="which algorithm, when the file defines several")
        p.add_argument("--inplace", choices=("in", "out"), help="force the in-place or out-of-place form")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")

    p = sub.add_parser("verify", help="verify an algorithm symbolically, or a plan (.plan / MSCCL .xml)")
    algorithm_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("compile", help="verify an algorithm, lower it to a plan, verify the plan, write it")
    algorithm_args(p)
    p.add_argument("--protocol", choices=("Simple", "LL", "LL128"), default="Simple")
    p.add_argument("--instances", type=int, default=1, help="replicate the schedule on more channels")
    p.add_argument("--threadblocks", choices=("auto", "manual"), default="auto",
                   help="manual: honour the sendtb/recvtb hints")
    p.add_argument("--no-fuse", action="store_true", help="keep every send and receive a step of its own")
    p.add_argument("--tile", type=int, default=0, help="pipelining tile in bytes per chunk (0: runtime default)")
    p.add_argument("-o", "--output", help="plan file (default: COLLECTIVE-NAME-nRANKS.plan)")
    p.add_argument("--emit", choices=("cuda",), help="also write the CUDA source next to the plan")
    p.add_argument("--arch", help="with --emit cuda: compile with NVRTC for this arch (sm_90, sm_80...) and "
                                  "write the .cubin too")
    p.add_argument("--dtype", default="float32", help="with --emit cuda: data type (float32, bfloat16, float16, "
                                                      "float64, int32)")
    p.add_argument("--op", default="sum", choices=("sum", "prod", "max", "min", "avg"),
                   help="with --emit cuda: the reduction")
    p.add_argument("--form", choices=("straight", "table"),
                   help="with --emit cuda: straight-line or table-driven kernel (default: by plan size)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("export", help="write a plan as MSCCL XML")
    p.add_argument("plan")
    p.add_argument("--format", choices=("msccl-xml",), default="msccl-xml")
    p.add_argument("--runtime", choices=("msccl", "azure"), default="msccl",
                   help="which MSCCL runtime reads it (attribute spellings)")
    p.add_argument("--min-bytes", type=int, default=0)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("-o", "--output")
    p.add_argument("--no-verify", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="read MSCCL XML (from MSCCLang, TACCL, by hand) into a plan file")
    p.add_argument("xml")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--no-verify", action="store_true")
    p.set_defaults(func=cmd_import)

    from msc.runner import add_run_command
    from msc.sim_cli import add_commands as add_simulation_commands

    add_run_command(sub, load_plan_arg)
    from msc.cuda.bench import add_bench_command

    add_bench_command(sub, load_plan_arg)           # msc bench PLAN --backend cuda
    add_simulation_commands(sub, load_plan_arg)      # simulate, tune, show

    p = sub.add_parser("list", help="list the algorithms in files (default: the library)")
    p.add_argument("files", nargs="*")
    p.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``msc COMMAND ... [-- SCRIPT ARGS]``: what follows the first ``--``
    goes, untouched, to an MSCCLang script as its ``sys.argv[1:]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    parser.epilog = "Arguments after -- are passed to an MSCCLang script (msc verify/compile prog.py -- 8 1)."
    args = parser.parse_args(argv)
    args.script_args = script_args
    try:
        return args.func(args)
    except VerificationError as exc:
        if args.debug:
            raise
        _report(args, "verification failed", exc, exc.to_dict())
        return 1
    except MscError as exc:
        if args.debug:
            raise
        _report(args, "error", exc, {"message": str(exc)})
        return 2
    except BrokenPipeError:          # output piped into `head`: stop quietly
        sys.stderr.close()
        return 0
    except (OSError, ValueError) as exc:
        if args.debug:
            raise
        _report(args, "error", exc, {"message": str(exc)})
        return 2


def _report(args, title: str, exc: Exception, detail: dict) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"verified": False, "error": title, **detail}))
    print(f"msc: {title}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
