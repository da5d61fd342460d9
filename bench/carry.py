"""What a GPU machine without internet needs of the wheels carried to it
(bench/README.md, "The first GPU run"), installed into a folder of its own:

- lark, wherever it is missing (the GPU image has none);
- cuda-core, cuda-bindings and cuda-pathfinder together, only where the
  image's cuda-core is older than msc needs (1.2: top-level ``cuda.core``
  imports, ``LaunchConfig(is_cooperative=)``, ``Kernel.occupancy``) or its
  cuda-bindings older than 13; the three were tried together with the NVRTC
  13.0 that torch 2.11+cu130 brings, and a newer image's own stay in use.

    python3 bench/carry.py --wheels .whl --target /tmp/msc-site

prints what it installs and why; exit 0 when nothing was needed or all was
installed, 3 when a needed wheel is not in the folder (naming it).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

NEEDS = {"cuda-core": (1, 2), "cuda-bindings": (13, 0)}
CUDA_SET = ("cuda-core", "cuda-bindings", "cuda-pathfinder")


def installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def release(text: str) -> tuple[int, ...]:
    """The leading numbers of a version ("1.2.2" -> (1, 2, 2), "13.0.1.post1" -> (13, 0, 1))."""
    out = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        out.append(int(digits.group()))
        if digits.end() < len(part):            # "2rc1": a pre-release of 2, nothing after counts
            break
    return tuple(out)


def needed(versions: dict[str, str | None]) -> list[tuple[str, str]]:
    """(distribution, why) for each carried wheel to install, given the image's versions."""
    out = []
    if versions.get("lark") is None:
        out.append(("lark", "the image has no lark"))
    stale = [f"{name} {versions.get(name) or 'missing'} (msc needs >= {'.'.join(map(str, least))})"
             for name, least in NEEDS.items() if versions.get(name) is None or release(versions[name]) < least]
    if stale:
        out += [(name, "; ".join(stale)) for name in CUDA_SET]
    return out


def wheel_for(folder: Path, name: str) -> Path | None:
    stem = name.replace("-", "_").lower() + "-"
    return next((p for p in sorted(folder.glob("*.whl")) if p.name.lower().startswith(stem)), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=".whl", help="the folder of carried wheels")
    ap.add_argument("--target", default="/tmp/msc-site", help="where to install them (put it on PYTHONPATH)")
    args = ap.parse_args(argv)
    versions = {name: installed(name) for name in ("lark", *CUDA_SET)}
    print("image: " + ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items()))
    todo = needed(versions)
    if not todo:
        print("carry: nothing to install")
        return 0
    wheels, missing = [], []
    for name, why in todo:
        wheel = wheel_for(Path(args.wheels), name)
        print(f"carry: {name}: {why}: {wheel.name if wheel else 'NO WHEEL'}")
        (wheels.append(str(wheel)) if wheel else missing.append(name))
    if missing:
        print(f"carry: {', '.join(missing)} needed but not in {args.wheels}/ (bench/README.md says how to download "
              f"them)", file=sys.stderr)
        return 3
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--target", args.target, *wheels])
    return 0 if done.returncode == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
