"""msc.torch on the msc CUDA runtime (backend="cuda"), on the emulated device.

Without a GPU, ``MSC_DEVICE=emu`` runs the runtime's own code (the
Communicator, placement "torchrun": arenas in memory files, the bootstrap over
the process group's store) with the plan's kernel built as host C++: these
tests check msc.torch's side of it (engine choice, call forms, ops,
communicator reuse, the DDP hook) on 2 gloo processes and under torchrun.
What only a GPU shows (streams, CUDA IPC) is tests/test_cuda_gpu.py's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import torchdist  # noqa: E402
from torchdist import library_plan  # noqa: E402
from emu_skip import needs_emu  # noqa: E402
from patience import patience  # noqa: E402

import msc.torch as mt  # noqa: E402
from msc.errors import UsageError  # noqa: E402
from msc.formats.plan_text import save_plan  # noqa: E402
from msc.torch import backends  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")



# torch's own crash at interpreter exit (gloo, under heavy load; seen with plain DDP and no msc at all):
# rank exit -6 after every line of the script has run
TORCH_EXIT_CRASH = "terminate called without an active exception"


# -- choosing the engine (no processes) ----------------------------------------------------------

@pytest.fixture
def env(monkeypatch):
    for name in ("MSC_DEVICE", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cuda_without_gpu_or_emu_is_unavailable_and_says_why(env):
    from msc.cuda.device import driver_available

    if driver_available():
        pytest.skip("a CUDA driver is here")
    ok, why = backends.cuda_runtime_status()
    assert not ok and "no usable CUDA driver" in why
    assert not mt.cuda_runtime_available()
    with pytest.raises(mt.BackendUnavailableError) as exc:
        backends.choose("cuda", torch.device("cpu"), None, torch.float32, "sum", "allreduce")
    text = str(exc.value)
    assert "msc CUDA runtime cannot run here" in text and "no usable CUDA driver" in text and "MSC_DEVICE=emu" in text
    assert backends.choose("auto", torch.device("cpu"), None, torch.float32, "sum", "allreduce") == "torch"
    env.setenv("MSC_DEVICE", "tpu")
    ok, why = backends.cuda_runtime_status()
    assert not ok and "MSC_DEVICE='tpu'" in why
    with pytest.raises(mt.BackendUnavailableError, match="MSC_DEVICE='tpu'"):
        backends.choose("cuda", torch.device("cpu"), None, torch.float32, "sum", "allreduce")
    with pytest.raises(UsageError, match="unknown backend"):
        backends.choose("nccl", torch.device("cpu"), None)
    with pytest.raises(UsageError, match="unknown backend"):
        mt.allreduce_hook(library_plan("allreduce/ring:ring", 2, True), backend="gpu")


@needs_emu
def test_emulated_device_makes_cpu_tensors_the_runtimes(env):
    env.setenv("MSC_DEVICE", "emu")
    assert mt.cuda_runtime_available() and "emulated device" in backends.cuda_runtime_status()[1]
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    choose = backends.choose
    assert choose("cuda", cpu, None, torch.float32, "sum", "allreduce") == "cuda"
    assert choose("cuda", cpu, None, torch.bfloat16, "avg", "allreduce") == "cuda"
    assert choose("cuda", cpu, None, torch.int32, "avg", "allgather") == "cuda"       # no reduction: any op
    with pytest.raises(mt.BackendUnavailableError, match="emulated device, which takes CPU tensors"):
        choose("cuda", gpu, None, torch.float32, "sum", "allreduce")
    with pytest.raises(mt.BackendUnavailableError, match="not int64"):
        choose("cuda", cpu, None, torch.int64, "sum", "allreduce")
    with pytest.raises(mt.BackendUnavailableError, match="avg .* needs a floating type"):
        choose("cuda", cpu, None, torch.int32, "avg", "reduce")
    # auto: only where torchrun says every rank is on this node
    assert choose("auto", cpu, None, torch.float32, "sum", "allreduce") == "torch"
    env.setenv("LOCAL_WORLD_SIZE", "2")
    env.setenv("WORLD_SIZE", "2")
    assert choose("auto", cpu, None, torch.float32, "sum", "allreduce") == "cuda"
    assert choose("auto", cpu, None, torch.int64, "sum", "allreduce") == "torch"      # what the kernels lack
    assert choose("auto", cpu, None, torch.int32, "avg", "allreduce") == "torch"
    assert choose("auto", gpu, None, torch.float32, "sum", "allreduce") == "torch"
    assert choose("torch", cpu, None, torch.float32, "sum", "allreduce") == "torch"
    assert choose("cuda", cpu, None, torch.float32, "sum", "allreduce") == "cuda"
    env.setenv("LOCAL_WORLD_SIZE", "1")
    assert choose("auto", cpu, None, torch.float32, "sum", "allreduce") == "torch"
    with pytest.raises(mt.BackendUnavailableError, match="spans nodes"):
        choose("cuda", cpu, None, torch.float32, "sum", "allreduce")


def test_processes_crowding_the_gpus_get_the_torch_executor_or_an_error(env):
    """More torchrun processes on this node than the GPUs they all see: their kernels would share a
    GPU, so auto picks the torch executor and backend='cuda' says why (unless MPS runs); where
    CUDA_VISIBLE_DEVICES gives each process its own view, the bootstrap decides at the first call."""
    from msc.cuda import device as cu

    gpu = torch.device("cuda", 0)
    env.setattr(backends, "cuda_runtime_status", lambda: (True, "CUDA (faked)"))
    env.setattr(torch.cuda, "device_count", lambda: 1)
    env.setattr(cu, "mps_active", lambda: False)
    env.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env.setenv("LOCAL_WORLD_SIZE", "2")
    env.setenv("WORLD_SIZE", "2")
    assert "2 processes on this node, which has 1 GPU(s)" in backends.crowded_gpus()
    assert backends.choose("auto", gpu, None, torch.float32, "sum", "allreduce") == "torch"
    with pytest.raises(mt.BackendUnavailableError, match=r"2 processes .* 1 GPU\(s\), so ranks would share one: .*"
                                                         r"time-slicing.*Use backend='torch'"):
        backends.choose("cuda", gpu, None, torch.float32, "sum", "allreduce")
    env.setattr(cu, "mps_active", lambda: True)
    assert backends.crowded_gpus() is None
    assert backends.choose("auto", gpu, None, torch.float32, "sum", "allreduce") == "cuda"
    env.setattr(cu, "mps_active", lambda: False)
    env.setenv("CUDA_VISIBLE_DEVICES", "1")                 # each process's own GPU, maybe: not known here
    assert backends.crowded_gpus() is None
    env.delenv("CUDA_VISIBLE_DEVICES")
    env.setattr(torch.cuda, "device_count", lambda: 2)
    assert backends.crowded_gpus() is None and backends.choose("cuda", gpu, None, torch.float32, "sum",
                                                               "allreduce") == "cuda"


# -- 2 gloo processes on the emulated device ---------------------------------------------------------

@pytest.fixture(scope="module")
def pool2():
    pool = torchdist.Pool(2, timeout=120)
    yield pool
    pool.close()


# (algorithm, plan in place, root, call in place, count, dtype, op). Every collective; every branch of
# calls._physical (both call forms on both plan forms of allreduce, allgather and reducescatter); every
# dtype the kernels take and every op; a kernel build per plan (seconds: keep the plans few).
CASES = [
    ("allreduce/ring:ring", True, 0, True, 1000, "float32", "sum"),
    ("allreduce/ring:ring", True, 0, False, 7, "float32", "sum"),
    ("allreduce/ring:ring", True, 0, True, 0, "float32", "sum"),
    ("allreduce/ring:ring", False, 0, True, 513, "float32", "avg"),
    ("allreduce/ring:ring", False, 0, False, 3, "float32", "avg"),
    ("allgather/ring:ring", True, 0, True, 129, "float16", "sum"),
    ("allgather/ring:ring", True, 0, False, 5, "float16", "sum"),
    ("allgather/ring:ring", False, 0, True, 129, "float16", "sum"),
    ("allgather/ring:ring", False, 0, False, 64, "float16", "sum"),
    ("reducescatter/ring:ring", True, 0, True, 257, "bfloat16", "max"),
    ("reducescatter/ring:ring", True, 0, False, 9, "bfloat16", "max"),
    ("reducescatter/ring:ring", False, 0, True, 257, "float64", "prod"),
    ("reducescatter/ring:ring", False, 0, False, 9, "float64", "prod"),
    ("alltoall/allpairs:allpairs", True, 0, True, 100, "int32", "sum"),
    ("alltoall/allpairs:allpairs", True, 0, False, 33, "int32", "sum"),
    ("broadcast/chain:chain", False, 1, False, 333, "float32", "sum"),
    ("broadcast/chain:chain", False, 1, True, 333, "float32", "sum"),
    ("reduce/ring:ring", True, 1, True, 222, "int32", "min"),
    ("reduce/ring:ring", True, 1, False, 222, "int32", "min"),
    ("gather/direct:direct", True, 1, True, 129, "float16", "sum"),
    ("gather/direct:direct", False, 0, True, 64, "int32", "sum"),
    ("scatter/direct:direct", True, 0, True, 77, "bfloat16", "sum"),
    ("scatter/direct:direct", False, 1, True, 31, "float32", "sum"),
]


@needs_emu
@pytest.mark.slow        # 10 s: the default run has the runtime under the msc backend and the emulated sweep
def test_collectives_on_the_runtime_match_the_torch_executor(pool2):
    """mt.all_reduce, all_gather, reduce_scatter, all_to_all, broadcast,
    reduce and run_plan with backend="cuda": the torch executor's results
    (bit for bit; avg within a few roundings), twice over with the same
    communicators (one per plan, never rebuilt or reallocated)."""
    results = pool2.run(torchdist.cuda_collective_cases, CASES, 2)
    plans = {(key, inplace, root) for key, inplace, root, *_ in CASES}
    for r in results:
        first, second = r["rounds"]
        assert len(first) == len(plans), first            # a communicator per plan
        assert second == first                            # the same ones, same arenas
        assert set(r["device"]) == {"emu"}


@needs_emu
@pytest.mark.slow        # 15 CPU-s, most of it the kernel's first build (the default run: the torch engine's)
def test_uneven_alltoall_on_the_emulated_runtime_matches_gloo(pool2):
    """all_to_all_single with split sizes on the CUDA runtime's kernel (the
    even alltoall plan on padded units, its count given at launch): gloo's
    results bit for bit."""
    cases = [("skewed", "float32"), ("equal", "float32"), ("empty", "float32")]     # one kernel: one dtype
    for r in pool2.run(torchdist.uneven_cases, "cuda", cases):
        wrong = [k for k, v in r.items() if v is False]
        assert not wrong, wrong
        assert "do not pair up" in r["mismatch"] and r["untouched"]
        assert r["runtime plans"] == [("allpairs", "emu")]


@needs_emu
def test_cuda_refuses_what_it_cannot_run_and_auto_picks(pool2):
    messages = pool2.run(torchdist.cuda_error_cases)
    assert messages[0] == messages[1]
    text = "\n".join(messages[0])
    from msc.cuda.device import driver_available

    if not driver_available():
        assert "BackendUnavailableError: backend='cuda': the msc CUDA runtime cannot run here: no usable CUDA " \
               "driver" in text
    assert "not int64" in text and "avg on the msc CUDA runtime needs a floating type" in text
    assert "spans nodes" in text


# -- the example under torchrun: DDP gradients reduced by the emulated runtime ---------------------

@needs_emu
@pytest.mark.slow        # docs/training.md's walkthrough (-m slow) runs this example too
def test_train_ddp_example_on_the_emulated_runtime_matches_stock_ddp(tmp_path):
    """2 ranks: the hook divides by 2 (exact) and the kernel adds two terms
    (one rounding, and a+b == b+a), as stock DDP's allreduce does: the
    losses are equal, bit for bit."""
    save_plan(library_plan("allreduce/ring:ring", 2, True), tmp_path / "allreduce-ring-n2.plan")
    out = tmp_path / "losses.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MSC_DEVICE": "emu"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "examples" / "train_ddp.py"), "--plans", str(tmp_path), "--backend", "cuda", "--steps", "3",
         "--check-stock", "--tolerance", "0", "--losses", str(out)],
        capture_output=True, text=True, timeout=patience(240), env=env)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0 or TORCH_EXIT_CRASH in done.stderr, log
    result = json.loads(out.read_text())
    assert result["backend"] == "cuda" and result["cuda_communicators"] == 1      # the runtime ran the plan
    assert result["world"] == 2 and len(result["losses"]) == 3
    assert result["losses"] == result["stock_losses"]
    assert result["losses"][-1] < result["losses"][0]
    assert "gradients reduced by the msc CUDA runtime, on the emulated device" in done.stdout
    assert "msc losses match stock DDP: max relative difference 0 " in done.stdout
