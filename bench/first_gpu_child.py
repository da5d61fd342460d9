"""Children of bench/first_gpu_run.py, each in a process of its own (so a
sanitizer can wrap it, or two can meet as torchrun's workers do):

    python bench/first_gpu_child.py sanitize --device cuda|emu --cache DIR
        the ring allreduce at 4 ranks, Simple and LL, float32 sum, counts 1
        and 1001 on one communicator each, bit-exact against msc.executor;
        the first GPU run starts it under compute-sanitizer (memcheck,
        synccheck); a line per check, the last "ok" or "FAILED ...".

    RANK=R WORLD_SIZE=2 MASTER_ADDR=A MASTER_PORT=P python bench/first_gpu_child.py torchrun \\
        --device D --cache DIR --out DIR
        two processes with the environment torchrun gives its workers: the
        torchrun placement's bootstrap (arenas
        exported and opened through CUDA IPC, or shared memory on the
        emulated device), then the ring allreduce at 2 ranks, Simple and LL,
        counts 1, 1001 and 4099, each rank's output bit-exact against
        msc.executor; writes DIR/rank<R>.json. On one GPU both processes use
        GPU 0: msc refuses that unless MPS runs (their spinning kernels
        time-slice), so without MPS the child lifts the refusal for itself
        (as tests/cudaboot.py's ipc_case does): every wait may last a time
        slice, which proves the path, not its speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_gpu_checks import RING, Run, check_counts, plan_of     # noqa: E402  (sets sys.path for msc too)

SANITIZE_COUNTS = (1, 1001)
TORCHRUN_COUNTS = (1, 1001, 4099)


def sanitize(args) -> int:
    run = Run(args.device, True, Path(args.cache), Path(args.cache), ranks=4)
    failed = 0
    for protocol in ("Simple", "LL"):
        try:
            detail = check_counts(run, plan_of(RING, 4, protocol), None, "float32", "sum", SANITIZE_COUNTS,
                                  timeout_s=args.timeout)
            print(f"{RING}@4 {protocol} float32 sum {detail}", flush=True)
        except Exception as exc:               # the line says what failed; the exit status that something did
            failed += 1
            print(f"FAILED {RING}@4 {protocol}: {type(exc).__name__}: {exc}"[:2000], flush=True)
    print("ok" if not failed else f"FAILED {failed} of 2", flush=True)
    return 1 if failed else 0


def torchrun(args) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    result = {"rank": rank, "checks": [], "ok": False}
    try:
        result["checks"] = [_torchrun_protocol(args, rank, n, protocol) for protocol in ("Simple", "LL")]
        result["ok"] = True
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()[-2000:]
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


def _torchrun_protocol(args, rank: int, n: int, protocol: str) -> str:
    import numpy as np

    from msc.cuda import Communicator
    from msc.cuda.validate import units
    from msc.executor import run_collective
    from msc.verification import reference

    plan = plan_of(RING, n, protocol)
    shared = ""
    if args.device == "cuda":
        import torch

        torch.cuda.set_device(0)
    comm = Communicator(plan, "torchrun", device=args.device, cache=Path(args.cache), timeout_s=args.timeout)
    try:
        if args.device == "cuda" and comm.backend.shared() is not None:
            comm.backend.shared = lambda: None          # both ranks on GPU 0 on purpose (module doc)
            shared = ", GPU 0 shared without MPS (time-sliced)"
        for i, count in enumerate(TORCHRUN_COUNTS):
            inputs = reference.random_inputs(np.random.default_rng(i), np.dtype("float32"), "sum", n,
                                             units(plan)[0] * count)
            want = run_collective(plan, [x.copy() for x in inputs], "sum", count=count)
            x = inputs[rank].copy()
            if args.device == "cuda":
                import torch

                got = comm.run(torch.from_numpy(x).to("cuda:0"))
                comm.synchronize()
                got = got.cpu().numpy()
            else:
                got = comm.run(x)
                comm.synchronize()
            if got.tobytes() != want[rank].tobytes():
                bad = np.flatnonzero(got != want[rank])
                raise AssertionError(f"{protocol} count {count} rank {rank}: {bad.size} elements differ from "
                                     f"msc.executor, first at {bad[:4].tolist()}")
    finally:
        comm.close()
    return f"{protocol}: counts {', '.join(map(str, TORCHRUN_COUNTS))} bit-exact{shared}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("sanitize", "torchrun"))
    ap.add_argument("--device", choices=("cuda", "emu"), required=True)
    ap.add_argument("--cache", required=True, help="the first GPU run's kernel cache")
    ap.add_argument("--out", default=".", help="torchrun: the folder for rank<R>.json")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a kernel's spin-wait may last")
    args = ap.parse_args(argv)
    os.environ.setdefault("MSC_CACHE_DIR", args.cache)
    return sanitize(args) if args.what == "sanitize" else torchrun(args)


if __name__ == "__main__":
    sys.exit(main())
