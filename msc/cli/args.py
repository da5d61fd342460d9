"""Arguments several commands share: algorithm parameters (``--param``),
the topology and the size sweep. Imports nothing heavy."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from msc.errors import UsageError
from msc.units import size_arg


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


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def param_value(name: str, raw: str, default: Any, flag: str = "--param") -> Any:
    """A ``--param`` value read as the type of the parameter's default (bool,
    int, float, str; a default of None takes ints, floats, booleans, none
    or text); the error names the parameter and what it expected."""
    raw = raw.strip()
    kind = type(default)

    def wrong(expected: str) -> UsageError:
        return UsageError(f"{flag} {name}={raw}: {name} takes {expected} (its default is {default!r}), "
                          f"got {raw!r}")

    if default is None:
        return _literal(raw)
    if kind is bool:
        if raw.lower() not in _TRUE + _FALSE:
            raise wrong("true or false")
        return raw.lower() in _TRUE
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise wrong("an int") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise wrong("a number") from None
    if kind is str:
        return raw
    import ast

    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise wrong(f"a {kind.__name__} (a Python literal)") from None
    if type(value) is not kind:
        raise wrong(f"a {kind.__name__}")
    return value


def split_param(item: str, flag: str = "--param", form: str = "name=value") -> tuple[str, str]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"{flag} takes {form}, got {item!r}")
    return key.strip(), raw


def _number(text: str, *, zero: bool) -> float:
    """argparse's type for the uniform model's flags: a latency (``zero``:
    0 to msc.sim.protocols.ALPHA_US_MAX us) or a rate (GBPS_MIN to GBPS_MAX
    GB/s); inf, nan and negatives are refused."""
    from msc.sim.protocols import ALPHA_US_MAX, GBPS_MAX, GBPS_MIN

    low, high = (0.0, ALPHA_US_MAX) if zero else (GBPS_MIN, GBPS_MAX)
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected a finite number >= {low:g} and <= {high:g}, got {text!r}")
    return value


def protocol_arg(text: str) -> str:
    """argparse's type for a protocol flag: any case (``ll``, ``simple``), the
    canonical name back (msc.ir.ops.protocol_name)."""
    from msc.ir.ops import protocol_name

    try:
        return protocol_name(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def refuse_inapplicable(collective: str, *, op: str | None = None, op_flag: str = "-o/--op",
                        root: int | None = None, root_flag: str = "-r/--root") -> None:
    """A reduction op given for a built-in collective that does not reduce, or
    a root for one that has none, is an error naming the collective: a flag
    that does not apply is not ignored (None: not given)."""
    if op is None and root is None:
        return
    from msc.dsl.collectives import BUILTIN, REDUCING, ROOTED

    if collective not in BUILTIN:              # a custom collective: its own definition decides
        return
    if op is not None and collective not in REDUCING:
        raise UsageError(f"{op_flag} {op}: {collective} does not reduce (a reduction op applies to "
                         f"{', '.join(REDUCING)}); leave it out")
    if root is not None and collective not in ROOTED:
        raise UsageError(f"{root_flag} {root}: {collective} has no root (a root applies to {', '.join(ROOTED)}); "
                         f"leave it out")


def add_collective_on_topology_args(p: argparse.ArgumentParser, collectives: tuple[str, ...]) -> None:
    """COLLECTIVE, the topology, ``--ranks`` and ``--root``: what msc bound and
    msc synthesize are asked about."""
    p.add_argument("collective", metavar="COLLECTIVE", help=f"one of {', '.join(collectives)}")
    add_topology_args(p)
    p.add_argument("--ranks", "-n", type=int,
                   help="number of ranks (default: the topology's; needed for ib, ring, torus without a size "
                        "and for the uniform model)")
    p.add_argument("--root", "-r", type=int,
                   help="root rank of broadcast and reduce (default 0; an error for the others)")


def add_topology_args(p: argparse.ArgumentParser) -> None:
    from msc.sim.presets import PRESET_NAMES          # the table of presets (no numpy: the CLI starts fast)

    p.add_argument("--topology", "-t", metavar="NAME|FILE",
                   help=f"{', '.join(n for n in PRESET_NAMES if not n.startswith('uniform'))}, or a TOML file")
    p.add_argument("--alpha-us", type=lambda t: _number(t, zero=True), metavar="US",
                   help="uniform model: latency per message (us, 0 to 1e6)")
    p.add_argument("--bandwidth-gbps", type=lambda t: _number(t, zero=False), metavar="GBPS",
                   help="uniform model: bandwidth per rank pair (GB/s = 1e9 B/s, 1e-6 to 1e9)")


def topology_from_args(args, num_ranks: int):
    from msc.sim.presets import get_topology

    return noted(args, get_topology(args.topology, num_ranks, alpha_us=args.alpha_us,
                                    bandwidth_gbps=args.bandwidth_gbps))


def noted(args, topology):
    """``topology``, its note (an uncalibrated machine's: msc.sim.machines) said on stderr, where
    --json leaves stdout to the records, once per command (``args``)."""
    note = getattr(topology, "note", "")
    said = args.__dict__.setdefault("_notes_said", set())
    if note and (topology.name, note) not in said:
        said.add((topology.name, note))
        print(f"msc: note: {topology.name}: {note}", file=sys.stderr)
    return topology


def add_sweep_args(p, default_min: int, default_max: int) -> None:
    p.add_argument("-b", "--minbytes", type=size_arg, default=default_min, help="smallest size (bytes; K, M, G)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=default_max, help="largest size (bytes; K, M, G)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between sizes")


def check_not_input(output, inputs, flag: str) -> None:
    """``flag OUTPUT`` must not name a file the command reads (writing it would
    replace its input): the same path, or a link to it."""
    from pathlib import Path

    from msc.files import same_file

    if output is None:
        return
    for given in inputs:
        if given is not None and Path(given).is_file() and same_file(given, output):
            raise UsageError(f"{flag} {output} is the file being read ({given}); name another file")


def add_collective_arg(parser) -> None:
    """``--collective FILE.py:NAME`` for a command that reads plans: the
    definition of a custom collective whose plan does not state it."""
    parser.add_argument("--collective", metavar="FILE.py:NAME",
                        help="a custom collective's definition (the CustomCollective NAME in FILE.py; NAME may be "
                             "left out when the file defines one), for a plan that does not state its collective "
                             "(MSCCL XML; plans msc writes state it)")


def collective_kw(args) -> dict:
    """``collective=`` for a plan loader, where --collective was given."""
    spec = getattr(args, "collective", None)
    if not spec:
        return {}
    from msc.dsl.loader import load_collective

    return {"collective": load_collective(spec)}
