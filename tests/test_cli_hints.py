"""What the command line says when a user's second day goes wrong (issue 29's
smaller items): close names for a mistyped one, the topologies that fit, a
protocol in any case, inapplicable flags refused, sizes too small for a
plan, an out-of-place-only algorithm forced in place, errors in the buffer
the user wrote, the library's best beside synthesized winners, and
``python -m msc``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import msc
from msc.errors import UsageError

from algfile import load_one, write
from patience import patience

REPO = Path(__file__).resolve().parent.parent


def run_main(capsys, *args) -> tuple[int, str, str]:
    from msc.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *args, says: str) -> str:
    """exit 2, one line on stderr that says ``says``; the line is returned."""
    code, _, err = run_main(capsys, *args)
    assert code == 2, err
    assert err.startswith("msc: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert says in err, err
    return err


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """Library plans: a 6-rank allgather and a 4-rank allreduce."""
    from msc.formats.plan_text import save_plan
    from msc.lower.pipeline import LowerOptions, lower

    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for key, name, n in (("ag6", "allgather/ring", 6), ("ar4", "allreduce/ring", 4)):
        [alg] = msc.load_algorithms(name)
        out[key] = folder / f"{key}.plan"
        save_plan(lower(msc.trace(alg, n), LowerOptions()), out[key])
    return out


# -- 1. close names ----------------------------------------------------------------------------
@pytest.mark.parametrize("args,close", [
    (["compile", "allreduce/rign", "--ranks", 4], "'allreduce/ring'"),
    (["verify", "alreduce/ring", "--ranks", 4], "'allreduce/ring'"),
    (["list", "allgather/rin"], "'allgather/ring'"),
    (["bound", "alreduce", "-t", "ring:4"], "'allreduce'"),
    (["synthesize", "allgathr", "-t", "ring:4", "-o", "x.py"], "'allgather'"),
    (["bound", "allreduce", "-t", "rign:4"], "'ring'"),
    (["bound", "allreduce", "-t", "nvswich"], "'nvswitch'"),
])
def test_a_mistyped_name_gets_the_close_ones(capsys, args, close):
    err = refused(capsys, *args, says="did you mean")
    assert close in err.split("did you mean", 1)[1], err


def test_a_name_close_to_nothing_gets_no_guess(capsys):
    err = refused(capsys, "verify", "no/such/file.py", "-n", 4, says="no such algorithm file: no/such/file.py")
    assert "did you mean" not in err


def test_the_python_api_suggests_collectives_too():
    from msc.dsl.collectives import get_collective

    with pytest.raises(UsageError, match=r"did you mean 'reducescatter' or 'reduce' or 'scatter'\?"):
        get_collective("reducescatte")


# -- 2. the topologies that fit --------------------------------------------------------------------
@pytest.mark.parametrize("topology", [["-t", "ring:4"], ["-t", "dgx-h100"], ["-t", "torus:2x2"],
                                      ["-t", "uniform:4", "--alpha-us", "1", "--bandwidth-gbps", "10"]])
def test_a_topology_of_the_wrong_size_names_those_that_fit(capsys, plans, topology):
    err = refused(capsys, "simulate", plans["ag6"], *topology, "-b", "1K", "-e", "1K", says="for 6 ranks use ")
    for spec in ("ring:6", "torus:2x3", "uniform:6"):
        assert spec in err, err


@pytest.mark.parametrize("n", [1, 6, 7, 8, 16])
def test_every_topology_suggested_has_the_ranks(n):
    from msc.sim.presets import fitting_presets, get_topology

    specs = fitting_presets(n)
    assert f"ring:{n}" in specs and any(s.startswith(f"uniform:{n} ") for s in specs)
    assert (f"dgx-h100:{n // 8}" in specs or "dgx-h100" in specs) == (n % 8 == 0)
    for spec in specs:
        model = dict(alpha_us=1.0, bandwidth_gbps=10.0) if spec.startswith("uniform") else {}
        assert get_topology(spec.split(" ")[0], n, **model).num_ranks == n, spec


def test_bound_with_ranks_that_do_not_match_names_those_that_fit(capsys):
    refused(capsys, "bound", "allreduce", "-t", "ring:4", "-n", 8, says="for 8 ranks use dgx-h100")


# -- 3. protocols in any case --------------------------------------------------------------------
@pytest.mark.parametrize("typed,canonical", [("ll", "LL"), ("Ll128", "LL128"), ("simple", "Simple"),
                                             ("SIMPLE", "Simple"), ("LL", "LL")])
def test_compile_takes_a_protocol_in_any_case_and_writes_it_canonical(capsys, tmp_path, typed, canonical):
    out = tmp_path / "p.plan"
    code, stdout, err = run_main(capsys, "compile", "allgather/ring", "--ranks", 4, "--protocol", typed, "-o", out)
    assert code == 0, err
    assert f"4 ranks, {canonical}," in stdout
    assert msc.load_plan(out).protocol == canonical
    assert f"\nprotocol {canonical} instances 1 " in out.read_text()         # the plan text: canonical


def test_an_unknown_protocol_names_the_close_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(capsys, "compile", "allgather/ring", "--ranks", 4, "--protocol", "ll12")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown protocol 'll12'" in err and "did you mean 'LL128'" in err, err


def test_every_protocol_flag_takes_any_case(capsys):
    from msc.lower.pipeline import LowerOptions

    assert LowerOptions(protocol="ll128").protocol == "LL128"
    code, out, err = run_main(capsys, "bound", "allreduce", "-t", "ring:4", "-b", "1K", "-e", "1K", "--protocol", "ll")
    assert code == 0 and "      LL  " in out, err
    code, out, err = run_main(capsys, "tune", "allreduce/ring", "-n", 4, "-t", "ring:4", "-b", "1K", "-e", "1K",
                              "--protocols", "ll,SIMPLE", "--instances", "1", "--json")
    assert code == 0, err
    assert sorted({c["protocol"] for c in json.loads(out)["candidates"]}) == ["LL", "Simple"]
    code, out, err = run_main(capsys, "simulate", "--nccl", "allreduce", "-t", "nvswitch", "-b", "1M", "-e", "1M",
                              "--nccl-proto", "ll", "--json")
    assert code == 0 and {r["protocol"] for r in json.loads(out)} == {"LL"}, err


# -- 4. flags that do not apply -----------------------------------------------------------------
def test_a_reduction_op_on_a_collective_that_does_not_reduce_is_refused(capsys, plans):
    refused(capsys, "run", plans["ag6"], "-o", "max", "-b", "24", "-e", "24",
            says="-o/--op max: allgather does not reduce")
    code, out, err = run_main(capsys, "run", plans["ar4"], "-o", "max", "-b", "1K", "-e", "1K", "--json")
    assert code == 0 and json.loads(out)["records"][0]["redop"] == "max", err


def test_a_root_on_a_collective_without_one_is_refused(capsys, plans, tmp_path):
    refused(capsys, "run", plans["ag6"], "-r", "1", says="-r/--root 1: allgather has no root")
    refused(capsys, "bound", "allgather", "-t", "ring:4", "-r", "1", says="-r/--root 1: allgather has no root")
    refused(capsys, "synthesize", "allreduce", "-t", "ring:4", "--root", "2", "-o", tmp_path / "s.py",
            says="-r/--root 2: allreduce has no root")
    assert not (tmp_path / "s.py").exists()
    code, out, err = run_main(capsys, "bound", "broadcast", "-t", "ring:4", "-r", "3", "-b", "1K", "-e", "1K", "--json")
    assert code == 0 and json.loads(out)[0]["root"] == 3, err


def test_compile_refuses_cuda_flags_without_emit_and_an_op_that_does_not_apply(capsys, tmp_path):
    out = tmp_path / "ag.plan"
    refused(capsys, "compile", "allgather/ring", "--ranks", 4, "--op", "max", "-o", out,
            says="--op goes with --emit cuda")
    refused(capsys, "compile", "allgather/ring", "--ranks", 4, "--dtype", "float16", "--op", "max", "-o", out,
            says="--dtype, --op go with --emit cuda")
    refused(capsys, "compile", "allgather/ring", "--ranks", 4, "--emit", "cuda", "--op", "max", "-o", out,
            says="--op max: allgather does not reduce")
    assert not out.exists()                     # refused before anything is written
    code, _, err = run_main(capsys, "compile", "allreduce/ring", "--ranks", 4, "--emit", "cuda", "--op", "max",
                            "-o", tmp_path / "ar.plan")
    assert code == 0, err
    assert (tmp_path / "ar.float32-max.cu").stat().st_size > 0


# -- 5. sizes too small for the plan --------------------------------------------------------------
def test_run_refuses_a_size_that_would_run_zero_bytes_naming_the_smallest(capsys, plans):
    refused(capsys, "run", plans["ag6"], "-b", "8", "-e", "64",
            says="size 8 B is too small for plan 'ring' (6-rank allgather, 6 chunks of float per rank in its "
                 "largest buffer): it would hold no element, and run 0 bytes; the smallest size that runs is "
                 "24 B (-b 24)")
    code, out, err = run_main(capsys, "run", plans["ag6"], "-b", "24", "-e", "24", "--json")
    assert code == 0 and json.loads(out)["records"][0]["size"] == 24, err


def test_run_starts_at_the_smallest_size_that_runs_by_default(capsys, plans):
    code, out, err = run_main(capsys, "run", plans["ag6"], "-e", "100", "--json")
    records = json.loads(out)["records"]
    assert code == 0, err
    assert [(r["requested_size"], r["size"], r["count"]) for r in records] == [(24, 24, 1), (48, 48, 2),
                                                                                 (96, 96, 4)]
    assert all(r["count"] >= 1 for r in records)
    code, out, _ = run_main(capsys, "run", plans["ar4"], "-e", "16", "--json")    # 4 B per unit: 8 as before
    assert [r["requested_size"] for r in json.loads(out)["records"]] == [8, 16]


def test_a_size_between_whole_elements_is_rounded_down_with_a_line_saying_so(capsys, plans):
    code, out, err = run_main(capsys, "run", plans["ag6"], "-b", "30", "-e", "30")
    assert code == 0, err
    assert "# sizes rounded down to whole elements per unit (B): 30 -> 24" in out


def test_the_python_sweep_refuses_a_size_too_small_too(plans):
    from msc.cli.run import smallest_size, sweep

    plan = msc.load_plan(plans["ag6"])
    assert smallest_size(plan, 4) == 24 and smallest_size(plan, 2) == 12
    with pytest.raises(UsageError, match=r"the smallest size that runs is 12 B"):
        sweep(plan, min_bytes=8, max_bytes=64, dtype="half")


# -- 6 and 7. out-of-place algorithms forced in place; the buffer the user wrote -----------------------
OUT_OF_PLACE = """
    import msc

    @msc.algorithm("allreduce", inplace=False)
    def gather_all(p):
        n = p.num_ranks
        for r in range(n):
            p.chunk(r, "input", 0).copy(r, "output", 0)
            for j in range(1, n):
                p.chunk(r, "output", 0).reduce(p.chunk((r + j) % n, "input", 0))  # @reduce
"""


def test_an_out_of_place_algorithm_forced_in_place_says_so_naming_it(capsys, tmp_path):
    path, marks = write(tmp_path, OUT_OF_PLACE)
    code, out, err = run_main(capsys, "verify", path, "-n", 3, "--inplace", "out")
    assert code == 0 and out.startswith("verified: gather_all"), err
    code, _, err = run_main(capsys, "verify", path, "-n", 3, "--inplace", "in")
    assert code == 1
    # msc shows a path relative to the working folder where that is at most one level up (a checkout
    # under /tmp, beside pytest's tmp_path), else as given
    shown = {str(path), os.path.relpath(path)}
    assert any(err.startswith(f"msc: verification failed: {where}:{marks['reduce']}: algorithm 'gather_all' is "
                              f"out-of-place only (@msc.algorithm(..., inplace=False)); its in-place form "
                              f"(--inplace in) does not work: rank ") for where in shown), err
    code, _, err = run_main(capsys, "compile", path, "-n", 3, "--inplace", "in", "-o", tmp_path / "x.plan")
    assert code == 1 and "'gather_all' is out-of-place only" in err
    assert not (tmp_path / "x.plan").exists()


def test_an_in_place_error_names_the_buffer_the_algorithm_wrote(tmp_path):
    alg, marks, path = load_one(tmp_path, OUT_OF_PLACE)
    with pytest.raises(msc.VerificationError) as err:
        msc.verify(msc.trace(alg, 3, inplace=True))
    error = err.value
    assert (error.rank, error.buffer, error.index) == (1, "output", 0)
    # the reduce wrote output[0] (in place, the same memory as input[0]): said as the algorithm wrote it
    assert "(last written by reduce rank 0 input[0] into rank 1 output[0])" in str(error), str(error)
    assert error.where.line == marks["reduce"]


# -- 8. the library's best beside a synthesized winner ----------------------------------------------
def test_tune_synthesize_shows_the_librarys_best_beside_the_winner(capsys, tmp_path):
    args = ["tune", "allgather/ring", "-n", 8, "-t", "pcie", "-b", "64K", "-e", "1M", "-f", "16",
            "--protocols", "Simple", "--instances", "1", "--synthesize"]
    code, out, err = run_main(capsys, *args, "--json")
    assert code == 0, err
    result = json.loads(out)
    rows, mine = result["per_size"], result["library_best"]
    assert all(r["winner"].startswith("synthesized") for r in rows)     # synthesized wins everywhere here
    assert [m["size"] for m in mine] == [r["size"] for r in rows]
    for row, m in zip(rows, mine):
        assert m["library_best"] == "ring Simple x1" and m["winner"] == row["winner"]
        assert m["vs_library"] == pytest.approx(m["library_us"] / row["time_us"]) and m["vs_library"] > 1
        assert m["vs_library"] == pytest.approx(row["vs_ring"])              # the ring is the only library file
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    assert "# the library's best (the files given, no synthesized plan) per size, beside the winner:" in out
    table = out.split("beside the winner:\n", 1)[1].splitlines()
    assert [line.split()[:3] for line in table[1:3]] == [["64K", "ring", "Simple"], ["1M", "ring", "Simple"]]
    assert table[1].endswith(f"{mine[0]['vs_library']:.2f}x")


# -- 10. what docs/performance.md says the timeline of a large plan is -----------------------------
def test_the_manual_describes_the_timeline_above_show_lanes():
    from msc.cli.pictures import SHOW_LANES

    text = " ".join((REPO / "docs" / "performance.md").read_text().split())
    assert (f"up to {SHOW_LANES} threadblocks in all, a lane per threadblock" in text
            and f"above {SHOW_LANES} (an 8-rank allpairs allreduce has 104) a heat map instead, a row per rank"
            in text)


# -- 11. python -m msc --------------------------------------------------------------------------
def test_python_dash_m_msc_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "msc", "verify", "allreduce/ring", "-n", "4"], cwd=REPO,
                          capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("verified: ring (allreduce, 4 ranks")
    done = subprocess.run([sys.executable, "-m", "msc", "compile", "allreduce/rign", "-n", "4"], cwd=REPO,
                          capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 2 and "did you mean 'allreduce/ring'" in done.stderr


# -- 12. tests of optional dependencies skip without them ----------------------------------------------
BLOCKER = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("matplotlib", "torch"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
"""


def test_tests_of_optional_dependencies_skip_without_them(tmp_path):
    """The tests that need matplotlib, torch or the emulated device's C++
    compiler, run where none is found: they skip, none fails."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, MSC_CXX=str(tmp_path / "no-such-compiler"))
    tests = ["tests/test_bad_values.py::test_a_picture_in_a_format_matplotlib_lacks_names_the_file",
             "tests/test_bad_values.py::test_a_picture_that_cannot_be_written_is_exit_2",
             "tests/test_registries.py::test_pictures_colour_every_step_op_apart",
             "tests/test_readme.py::test_the_pages_run_as_written"
             "[docs/cuda.md#testing-kernels-without-a-gpu-the-emulated-device]",
             "tests/test_torch_executor.py", "tests/test_pictures.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs", *tests],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=patience(300))
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and "passed" not in summary and "failed" not in summary, done.stdout[-3000:]
    for why in ("matplotlib", "torch", "C++20 compiler"):
        assert why in done.stdout, done.stdout[-3000:]


# -- issue 42: an export the format cannot say names the route that works ----------------------
PAIR_CAT = """
    import msc

    pair_cat = msc.CustomCollective("pair_cat", input_chunks=1, output_chunks=2,
                                    postcondition=lambda r, i, n, k: [(r, 0)] if i == 0 else [((r + 1) % n, 0)])

    @msc.algorithm(pair_cat, inplace=False)
    def neighbours(p):
        for r in range(p.num_ranks):
            p.chunk(r, "input", 0).copy(r, "output", 0)
            p.chunk((r + 1) % p.num_ranks, "input", 0).copy(r, "output", 1)
"""


def test_an_export_msccl_xml_cannot_say_names_the_mscclpp_export(tmp_path, capsys):
    """A custom collective whose input and output differ in chunks, and an
    NVLS plan: the reason in a user's words, and the MSCCL++ export, which
    was tried, as the command to run; that command then works."""
    path, _ = write(tmp_path, PAIR_CAT)
    cases = {"custom": (path, "--ranks", 4), "nvls": ("allreduce/nvls", "--ranks", 8)}
    says = {"custom": "MSCCL XML cannot describe this plan's buffers: it sizes the input and the output from one "
                      "chunk count (nchunksperloop 2: input 2 and output 2 chunks per rank), and this plan's input "
                      "has 1 and its output 2; export it as an MSCCL++ execution plan instead (MSCCL++ gives each "
                      "buffer its own size; tried here",
            "nvls": "barrier: the plan reduces or stores in the switch (NVLS: multimem loads and stores, with "
                    "barriers between them), which the MSCCL runtimes cannot do: MSCCL-IR has no step type for it; "
                    "export it as an MSCCL++ execution plan instead (MSCCL++ has switch channels"}
    for name, compile_args in cases.items():
        plan = tmp_path / f"{name}.plan"
        assert run_main(capsys, "compile", *compile_args, "-o", plan)[0] == 0
        err = refused(capsys, "export", plan, "-o", tmp_path / f"{name}.xml", says=says[name])
        route = f"msc export {plan} --format mscclpp -o {tmp_path / name}.json"
        assert err.rstrip().endswith(route), err
        assert run_main(capsys, *route.split()[1:])[0] == 0
        assert run_main(capsys, "verify", tmp_path / f"{name}.json")[0] == 0
