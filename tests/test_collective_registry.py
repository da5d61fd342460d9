"""The registry of built-in collectives (msc.dsl.collectives.COLLECTIVES) is
the only list of them: every list, factor and table a module keeps is derived
from it and checked here, each row's reference agrees with its collective's
postcondition, and sendrecv (added through the registry) goes through every
command: verify, compile, run (reference executor and emulated device),
simulate, bound, tune, export/import and msc.torch."""
from __future__ import annotations

import numpy as np
import pytest

import msc
from emu_skip import needs_emu
from msc.dsl.collectives import (BUILTIN, COLLECTIVE_NAMES, COLLECTIVES, REDUCING, ROOTED, collective_key,
                                 collective_spec, get_collective)
from msc.errors import UsageError
from msc.executor import run_collective
from msc.lower.pipeline import LowerOptions, lower
from msc.verification import reference
from library import algorithms

SENDRECV = "algorithms/sendrecv/ring.py"


def by_postcondition(name: str, xs: list[np.ndarray], root: int) -> list[np.ndarray | None]:
    """Each rank's output from the collective's postcondition at chunk factor 1:
    an output unit is the sum of the input units its labels name."""
    coll, n = get_collective(name), len(xs)
    units_in, _ = COLLECTIVES[name].units(n)
    unit = xs[0].size // units_in
    outs = []
    for r in range(n):
        row = coll.postconditions(r, n, 1, root)
        if all(e is None for e in row):
            outs.append(None)
            continue
        outs.append(np.concatenate([sum(xs[src][i * unit:(i + 1) * unit].astype(np.int64)
                                        for (src, i), c in e.counts.items() for _ in range(c)) for e in row]))
    return outs


@pytest.mark.parametrize("name", COLLECTIVE_NAMES)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_each_reference_is_its_postcondition(name, n):
    """The numpy reference (the row's, written once for numpy and torch) and the
    symbolic postcondition say the same, with integer sums (exact)."""
    rng = np.random.default_rng(n)
    root = n - 1
    units_in, _ = COLLECTIVES[name].units(n)
    xs = reference.random_inputs(rng, np.dtype(np.int64), "sum", n, units_in * 3)
    got = reference.expected_outputs(name, xs, op="sum", root=root)
    want = by_postcondition(name, xs, root)
    for r in range(n):
        if want[r] is None:
            assert got[r] is None, (name, r)
        else:
            np.testing.assert_array_equal(got[r], want[r], err_msg=f"{name} rank {r}")


def test_derived_lists_are_the_registry_s():
    from msc.cli.main import build_parser
    from msc.formats.xml_import import COLLECTIVES as XML
    from msc.sim import nccl
    from msc.sim.tune import BASELINE
    from msc.synth import COLLECTIVES as SYNTH, SUMS
    from msc.dsl.collectives import BUSBW_FACTOR

    assert tuple(BUILTIN) == COLLECTIVE_NAMES and all(BUILTIN[k] is COLLECTIVES[k].cls for k in BUILTIN)
    assert set(ROOTED) == {"broadcast", "reduce", "gather", "scatter"} and set(REDUCING) == {"allreduce", "reducescatter", "reduce"}
    assert set(BUSBW_FACTOR) == set(COLLECTIVE_NAMES)
    assert set(XML.values()) == {k for k, s in COLLECTIVES.items() if s.msccl} | {"custom"}
    assert not {"sendrecv", "gather", "scatter"} & (set(XML.values()) | set(SYNTH))
    assert set(nccl.COLLECTIVES) == {k for k, s in COLLECTIVES.items() if s.nccl} >= set(nccl.P2P)
    assert set(SUMS) == set(SYNTH) & set(REDUCING)
    assert all(BASELINE[k].startswith(k + "/") and BASELINE[k].split(":")[0] in {a.split(":")[0] for a in algorithms()}
               for k in BASELINE)
    bound = build_parser()._subparsers._group_actions[0].choices["bound"]
    [arg] = [a for a in bound._actions if a.dest == "collective"]
    assert arg.help == f"one of {', '.join(COLLECTIVE_NAMES)}"             # msc.cli.bound keeps no copy


def test_nccl_tests_bus_bandwidth_factors():
    """nccl-tests' factors (doc/PERFORMANCE.md; src/sendrecv.cu: 1; src/gather.cu, scatter.cu: (n-1)/n) at 8 ranks."""
    assert {k: s.busbw(8) for k, s in COLLECTIVES.items()} == {
        "allreduce": 1.75, "allgather": 0.875, "reducescatter": 0.875, "alltoall": 0.875, "broadcast": 1.0,
        "reduce": 1.0, "gather": 0.875, "scatter": 0.875, "sendrecv": 1.0}


@pytest.mark.parametrize("spelling", ["AllReduce", "all_reduce", "all-reduce", "ALLREDUCE"])
def test_one_name_normalisation(spelling):
    assert collective_key(spelling) == "allreduce"
    assert collective_spec(spelling).name == get_collective(spelling).name == "allreduce"


def test_unknown_names_are_refused_with_a_suggestion():
    with pytest.raises(UsageError, match=r"no bound for collective 'sendrcv'.*sendrecv.*did you mean 'sendrecv'"):
        collective_spec("sendrcv", refusal="no bound for collective")


# -- sendrecv --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("inplace", [True, False])
def test_sendrecv_runs_as_the_reference_says(n, inplace):
    alg = algorithms()["sendrecv/ring:ring"]
    plan = lower(msc.trace(alg, n, inplace=inplace, chunks=2), LowerOptions())
    rng = np.random.default_rng(n)
    xs = reference.random_inputs(rng, np.dtype(np.float32), "sum", n, 2 * 5)
    outs = run_collective(plan, xs)
    for r in range(n):
        np.testing.assert_array_equal(outs[r], xs[(r - 1) % n])


def test_a_wrong_sendrecv_is_refused(tmp_path):
    """To the previous rank instead of the next: the verifier names the output."""
    path = tmp_path / "back.py"
    path.write_text("import msc\n\n@msc.algorithm('sendrecv', inplace=False)\ndef back(p):\n"
                    "    for r in range(p.num_ranks):\n"
                    "        p.chunk(r, 'input', 0).copy((r - 1) % p.num_ranks, 'output', 0)\n")
    [alg] = msc.load_algorithms(path)
    with pytest.raises(msc.VerificationError, match="rank 0 output.0. holds the wrong contributions"):
        msc.verify(msc.trace(alg, 3))


def run_main(capsys, *args) -> tuple[int, str]:
    from msc.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out + err


def test_sendrecv_through_the_commands(capsys, tmp_path):
    plan, xml, back = tmp_path / "sr.plan", tmp_path / "sr.xml", tmp_path / "back.plan"
    steps = [("verify", SENDRECV, "-n", 4, "--inplace", "in"),
             ("compile", SENDRECV, "-n", 4, "--inplace", "out", "--param", "chunks=2", "-o", plan),
             ("run", plan, "-b", "1K", "-e", "64K", "-f", "8"),
             ("simulate", plan, "--topology", "ring:4", "-b", "1K", "-e", "1M", "-f", "32"),
             ("bound", "sendrecv", "--topology", "ring:4", "-b", "1K", "-e", "1M", "-f", "32"),
             ("tune", SENDRECV, "-n", 4, "--topology", "ring:4", "-b", "1K", "-e", "64K", "-f", "64",
              "--instances", "1,2"),
             ("export", plan, "-o", xml), ("import", xml, "-o", back), ("diff", plan, back)]
    for args in steps:
        code, text = run_main(capsys, *args)
        assert code == 0, (args, text)
        if args[0] == "run":
            assert text.count(" 0\n") >= 3 and "float    none      -1" in text        # 0 wrong at each size
    text = xml.read_text()
    assert 'coll="custom"' in text and 'msc_collective="sendrecv"' in text      # MSCCL has no sendrecv
    assert "collective sendrecv" in back.read_text() and "contract" not in back.read_text()
    code, text = run_main(capsys, "simulate", "--nccl", "sendrecv", "--topology", "nvswitch", "-b", "1K", "-e", "1M",
                          "-f", "1024")        # NCCL's grouped send/receive: LL below 16 KiB a peer
    assert code == 0 and " p2p      LL " in text and " p2p  Simple " in text
    code, text = run_main(capsys, "run", plan, "-o", "max")
    assert code != 0 and "sendrecv does not reduce" in text


def test_sendrecv_xml_with_another_contract_is_refused(capsys, tmp_path):
    """msc_collective names a built-in: its contract must be the built-in's."""
    plan, xml = tmp_path / "sr.plan", tmp_path / "sr.xml"
    assert run_main(capsys, "compile", SENDRECV, "-n", 3, "--inplace", "out", "-o", plan)[0] == 0
    assert run_main(capsys, "export", plan, "-o", xml)[0] == 0
    text = xml.read_text()
    xml.write_text(text.replace('msc_contract="post 0: 2.0; post 1: 0.0', 'msc_contract="post 0: 1.0; post 1: 0.0'))
    code, text = run_main(capsys, "import", xml, "-o", tmp_path / "x.plan")
    assert code != 0 and "is built in, but msc_contract is not what sendrecv requires" in text


@needs_emu
def test_sendrecv_on_the_emulated_device(capsys, tmp_path):
    plan = tmp_path / "sr.plan"
    assert run_main(capsys, "compile", SENDRECV, "-n", 3, "--inplace", "in", "--protocol", "LL", "-o", plan)[0] == 0
    code, text = run_main(capsys, "run", plan, "--backend", "emu", "-b", "1K", "-e", "4K", "-f", "4", "-d", "half")
    assert code == 0 and "Out of bounds values : 0 OK" in text, text


# -- gather and scatter (nccl-tests' src/gather.cu, scatter.cu) -----------------------------------
GATHER, SCATTER = "algorithms/gather/direct.py", "algorithms/scatter/direct.py"


@pytest.mark.parametrize("name", ["gather", "scatter"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("inplace", [True, False])
def test_gather_and_scatter_run_as_the_reference_says(name, n, inplace):
    """Every root, both forms, 2 pieces a unit: the executor's outputs are
    the row's reference (gather: the root's output only)."""
    alg = algorithms()[f"{name}/direct:direct"]
    rng = np.random.default_rng(n)
    for root in range(n):
        plan = lower(msc.trace(alg, n, inplace=inplace, chunks=2, root=root), LowerOptions())
        units_in, _ = COLLECTIVES[name].units(n)
        xs = reference.random_inputs(rng, np.dtype(np.float32), "sum", n, units_in * 2 * 3)
        outs = run_collective(plan, xs)
        want = reference.expected_outputs(name, xs, op="sum", root=root)
        for r in range(n):
            if want[r] is not None:
                np.testing.assert_array_equal(outs[r], want[r], err_msg=f"{name} root {root} rank {r}")
        assert (want[root] == np.concatenate(xs)).all() if name == "gather" else \
            all((want[r] == xs[root][r * 6:(r + 1) * 6]).all() for r in range(n))


def test_a_gather_to_the_wrong_unit_is_refused(tmp_path):
    path = tmp_path / "swap.py"
    path.write_text("import msc\n\n@msc.algorithm('gather', inplace=False)\ndef swap(p):\n"
                    "    n = p.num_ranks\n"
                    "    for r in range(n):\n"
                    "        p.chunk(r, 'input', 0).copy(p.root, 'output', (r + 1) % n)\n")
    [alg] = msc.load_algorithms(path)
    with pytest.raises(msc.VerificationError, match=r"rank 1 output.0. holds the wrong contributions"):
        msc.verify(msc.trace(alg, 3, root=1))


@pytest.mark.parametrize("name, path, root", [("gather", GATHER, 2), ("scatter", SCATTER, 1)])
def test_gather_and_scatter_through_the_commands(capsys, tmp_path, name, path, root):
    """verify, compile, run, simulate, bound, tune, the in-place XML round
    trip (coll="custom", the root kept); what has no model or no format is
    refused saying so."""
    plan, out_plan, xml, back = tmp_path / "g.plan", tmp_path / "o.plan", tmp_path / "g.xml", tmp_path / "b.plan"
    steps = [("verify", path, "-n", 4, "--inplace", "in", "--param", f"root={root}"),
             ("compile", path, "-n", 4, "--inplace", "in", "--param", f"root={root}", "--param", "chunks=2", "-o", plan),
             ("compile", path, "-n", 4, "--inplace", "out", "--param", f"root={root}", "-o", out_plan),
             ("run", plan, "-b", "1K", "-e", "64K", "-f", "8", "--root", root),
             ("run", out_plan, "-b", "1K", "-e", "64K", "-f", "8", "--root", root),
             ("simulate", plan, "--topology", "ring:4", "-b", "1K", "-e", "1M", "-f", "32"),
             ("bound", name, "--topology", "ring:4", "-b", "1K", "-e", "1M", "-f", "32"),
             ("tune", path, "-n", 4, "--topology", "ring:4", "-b", "1K", "-e", "64K", "-f", "64"),
             ("export", plan, "-o", xml), ("import", xml, "-o", back), ("diff", plan, back)]
    for args in steps:
        code, text = run_main(capsys, *args)
        assert code == 0, (args, text)
        if args[0] == "run":
            assert text.count(" 0\n") >= 3, text                # 0 wrong at each size
    text = xml.read_text()
    assert 'coll="custom"' in text and f'msc_collective="{name}"' in text and f'msc_root="{root}"' in text
    assert f"collective {name}" in back.read_text() and "contract" not in back.read_text()
    code, text = run_main(capsys, "simulate", "--nccl", name, "--topology", "nvswitch", "-b", "1K", "-e", "1M")
    assert code != 0 and f"not {name!r} (msc has no model of what NCCL runs for {name}" in text
    code, text = run_main(capsys, "synthesize", name, "--topology", "ring:4", "-o", tmp_path / "s.py")
    assert code != 0 and f"not {name!r}: write its algorithm (the library has {name}/direct)" in text
    code, text = run_main(capsys, "export", out_plan, "-o", tmp_path / "o.xml")    # MSCCL XML: one chunk count
    assert code != 0 and "MSCCL XML cannot describe this plan's buffers" in text and "--format mscclpp" in text


def test_a_gather_plan_serves_its_own_root_only():
    """Renaming ranks moves each rank's unit at the root: for_root refuses,
    and a registry does not turn a gather plan to another root."""
    from msc.formats.registry import NoPlanError, PlanRegistry
    from msc.lower.relabel import for_root

    plan = lower(msc.trace(algorithms()["gather/direct:direct"], 3, root=0), LowerOptions())
    with pytest.raises(UsageError, match=r"serves its own root only.*--param root=2"):
        for_root(plan, 2)
    registry = PlanRegistry.from_plans([plan])
    assert registry.select("gather", 3, 4096, root=0) is plan
    with pytest.raises(NoPlanError, match="gather 3 ranks in place root 2"):
        registry.select("gather", 3, 4096, root=2)


@needs_emu
@pytest.mark.parametrize("path, root", [(GATHER, 2), (SCATTER, 1)])
def test_gather_and_scatter_on_the_emulated_device(capsys, tmp_path, path, root):
    plan = tmp_path / "g.plan"
    assert run_main(capsys, "compile", path, "-n", 3, "--inplace", "in", "--param", f"root={root}", "-o", plan)[0] == 0
    code, text = run_main(capsys, "run", plan, "--backend", "emu", "-b", "1K", "-e", "4K", "-f", "4", "--root", root)
    assert code == 0 and "Out of bounds values : 0 OK" in text, text
