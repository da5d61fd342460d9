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


def cmd_verify(args) -> int:
    import msc
    from msc.loader import is_msccl_script, run_script

    if is_msccl_script(args.file):
        programs = run_script(args.file, args.script_args)
        if not programs:
            raise UsageError(f"{args.file} defined no MSCCLProgram")
        reports = [msc.verify(p) for p in programs]
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

    p = sub.add_parser("verify", help="verify an algorithm symbolically")
    algorithm_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("script_args", nargs="*", metavar="-- ARGS",
                   help="arguments for an MSCCLang script (after --)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("list", help="list the algorithms in files (default: the library)")
    p.add_argument("files", nargs="*")
    p.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
