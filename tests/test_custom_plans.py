"""Plans of custom collectives as first-class as built-in ones: a plan (and
msc's MSCCL XML) states what its collective requires (msc.ir.Contract), so
every command and the Python API verify, run, simulate, export and import
it with no definition at hand; MSCCL XML of a custom collective that states
nothing is verified structurally (and says its results were not checked),
or fully with ``--collective FILE.py:NAME``."""
from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import clirun
import msc
from algfile import write
from emu_skip import needs_emu
from msc.errors import PlanError, UsageError
from msc.executor import run_collective
from msc.formats.load import load_plan
from msc.formats.plan_text import dump_plan, parse_plan
from msc.formats.plan_lines import read_plan_lines
from msc.ir import Contract
from msc.lower.pipeline import lower
from msc.verification import reference

REPO = Path(__file__).resolve().parent.parent

# Two custom collectives: pipeline parallelism's hand-off (data movement;
# stage 0 may end with anything) and each rank summing its own input and
# its right neighbour's (a reduction), out of place.
DEFINITIONS = """
    import msc

    send_next = msc.CustomCollective(
        "send_next", input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,
        postcondition=lambda r, i, n, k: None if r == 0 else [(r - 1, i)])

    pair_sum = msc.CustomCollective(
        "pair_sum", input_chunks=1, output_chunks=1,
        postcondition=lambda r, i, n, k: [(r, 0), ((r + 1) % n, 0)])

    @msc.algorithm(send_next, chunk_factor=2, inplace=False)
    def hand_off(p):
        for r in reversed(range(p.num_ranks - 1)):
            for i in range(p.chunk_factor):
                p.chunk(r, "input", i).copy(r + 1, "output", i)

    @msc.algorithm(pair_sum, inplace=False)
    def neighbours(p):
        n = p.num_ranks
        for r in range(n):
            p.chunk(r, "input", 0).copy(r, "output", 0)
        for r in range(n):
            p.chunk(r, "output", 0).reduce(p.chunk((r + 1) % n, "input", 0))
"""


# in this process (tests/clirun.py); tests/test_cli_processes.py runs each command as a process
def cli(*args, cwd) -> subprocess.CompletedProcess:
    return clirun.msc(*args, cwd=cwd)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The two algorithms compiled at 4 ranks by the CLI, and the definitions' file."""
    folder = tmp_path_factory.mktemp("custom")
    path, _ = write(folder, DEFINITIONS, "defs.py")
    for name in ("hand_off", "neighbours"):
        ok(cli("compile", path, "--name", name, "--ranks", 4, "-o", f"{name}.plan", cwd=folder))
    return folder


def test_a_compiled_plan_states_its_collective(plans):
    text = (plans / "hand_off.plan").read_text()
    assert "collective send_next" in text
    assert "\ncontract\n  post 0: * *\n  post 1: 0.0 0.1\n  post 2: 1.0 1.1\n  post 3: 2.0 2.1\n" in text
    plan = load_plan(plans / "neighbours.plan")
    assert plan.contract.post == ((((0, 0), (1, 0)),), (((1, 0), (2, 0)),), (((2, 0), (3, 0)),),
                                  (((0, 0), (3, 0)),))
    assert plan.contract.pre is None


@pytest.mark.parametrize("name", [pytest.param("hand_off", marks=pytest.mark.slow), "neighbours"])
def test_every_command_takes_the_plan_with_no_definition(plans, name):
    out = ok(cli("verify", f"{name}.plan", cwd=plans))
    assert "outputs right" in out
    assert "Out of bounds values : 0 OK" in ok(cli("run", f"{name}.plan", "-e", "64K", cwd=plans))
    if name == "neighbours":
        assert "Out of bounds values : 0 OK" in ok(cli("run", f"{name}.plan", "-o", "max", "-d", "int32",
                                                        cwd=plans))
    assert "Avg bus bandwidth" in ok(cli("simulate", f"{name}.plan", "-t", "ring:4", cwd=plans))
    ok(cli("export", f"{name}.plan", "-o", f"{name}.xml", cwd=plans))
    assert 'msc_contract="post 0:' in (plans / f"{name}.xml").read_text()
    assert "outputs right" in ok(cli("verify", f"{name}.xml", cwd=plans))
    ok(cli("import", f"{name}.xml", "-o", f"{name}-back.plan", cwd=plans))
    assert "equal" in ok(cli("diff", "--equivalent", f"{name}.plan", f"{name}.xml", cwd=plans))
    assert load_plan(plans / f"{name}-back.plan").contract == load_plan(plans / f"{name}.plan").contract


@needs_emu
def test_the_emulated_device_runs_a_custom_plan(plans):
    # a custom plan that reduces gets the kernel of the op asked for (max), not sum's
    out = ok(cli("run", "neighbours.plan", "--backend", "emu", "-e", "4K", "-o", "max", "-d", "int32", cwd=plans))
    assert "Out of bounds values : 0 OK" in out


def _plain(folder: Path, name: str) -> Path:
    """msc's XML of the plan without msc's attributes: MSCCL XML as other tools write it."""
    text = (folder / f"{name}.xml").read_text()
    plain = folder / f"{name}-plain.xml"
    plain.write_text(re.sub(r' msc_(collective|chunk_factor|contract)="[^"]*"', "", text))
    return plain


def test_plain_msccl_custom_xml_is_checked_structurally_or_with_its_definition(plans):
    ok(cli("export", "hand_off.plan", "-o", "hand_off.xml", cwd=plans))
    plain = _plain(plans, "hand_off")
    out = ok(cli("verify", plain, cwd=plans))
    assert out.startswith("verified plan structurally: hand_off (custom, 4 ranks") and "results NOT checked" in out
    assert "--collective FILE.py:NAME" in out
    done = cli("run", plain, cwd=plans)
    assert done.returncode == 2 and "does not state what it requires" in done.stderr
    assert "UncheckedWarning" in done.stderr                      # loading it said so first
    full = ok(cli("verify", plain, "--collective", "defs.py:send_next", cwd=plans))
    assert full.startswith("verified plan: hand_off (send_next, 4 ranks") and "outputs right" in full
    assert "Out of bounds values : 0 OK" in ok(cli("run", plain, "--collective", "defs.py:send_next", cwd=plans))
    # the wrong definition: its results are checked, and they are wrong
    wrong = cli("verify", plain, "--collective", "defs.py:pair_sum", cwd=plans)
    assert wrong.returncode != 0 and "pair_sum" in wrong.stderr
    done = cli("verify", plain, "--collective", "defs.py", cwd=plans)     # two collectives: name one
    assert done.returncode == 2 and "defines 2 collectives (pair_sum, send_next): name one" in done.stderr
    done = cli("verify", plain, "--collective", "defs.py:nope", cwd=plans)
    assert done.returncode == 2 and "has no collective named 'nope'" in done.stderr


def test_python_api_takes_custom_plans_with_no_definition(plans):
    plan = load_plan(plans / "neighbours.plan")
    ins = reference.random_inputs(np.random.default_rng(3), np.dtype(np.float32), "sum", 4, 16)
    outs = run_collective(plan, ins, "sum", count=16)
    for r in range(4):
        assert np.array_equal(outs[r], ins[r] + ins[(r + 1) % 4])
    assert reference.check_stated(plan_collective(plan), ins, outs, k=1, count=16) == [0] * 4
    outs[2][5] += 1                                  # one wrong element is caught where it is
    assert reference.check_stated(plan_collective(plan), ins, outs, k=1, count=16) == [0, 0, 1, 0]


def plan_collective(plan):
    from msc.verification.plan import plan_collective as resolve

    return resolve(plan)


@needs_emu
def test_communicator_runs_a_custom_plan_and_an_xml_with_its_definition(plans):
    import torch

    from msc.cuda.runtime import Communicator
    from msc.dsl.loader import load_collective

    xs = [torch.arange(8, dtype=torch.float32) + 10 * r + 1 for r in range(4)]
    comm = Communicator(plans / "hand_off.plan", device="emu")
    got = comm.run([x.clone() for x in xs])
    comm.synchronize()
    assert all(torch.equal(got[r], xs[r - 1]) for r in range(1, 4))
    ok(cli("export", "hand_off.plan", "-o", "hand_off.xml", cwd=plans))
    comm = Communicator(_plain(plans, "hand_off"), device="emu",
                        collective=load_collective(str(plans / "defs.py:send_next")))
    got = comm.run([x.clone() for x in xs])
    comm.synchronize()
    assert comm.plan.collective == "send_next" and all(torch.equal(got[r], xs[r - 1]) for r in range(1, 4))


def test_msc_torch_runs_a_custom_plan_with_no_definition(plans):
    torch = pytest.importorskip("torch")
    import msc.torch as mt

    plan = load_plan(plans / "hand_off.plan")
    xs = [torch.arange(8, dtype=torch.float32) + 10 * r + 1 for r in range(4)]
    bufs = [{"input": x.clone(), "output": torch.zeros(8)} for x in xs]
    mt.run_local(plan, bufs, count=8)
    assert all(torch.equal(bufs[r]["output"], xs[r - 1]) for r in range(1, 4))


# -- the contract's text ------------------------------------------------------------------------------

def _spread_plan():
    spread = msc.CustomCollective(
        "spread", input_chunks=1, output_chunks=1,
        precondition=lambda r, i, n, k: (0, i) if r == 0 else None,
        postcondition=lambda r, i, n, k: [(0, i)])

    @msc.algorithm(spread, inplace=False)
    def fan_out(p):
        for r in range(p.num_ranks):
            p.chunk(0, "input", 0).copy(r, "output", 0)

    program = msc.trace(fan_out, 3)
    msc.verify(program)
    return lower(program, collective=spread)


def test_both_readers_read_a_contract_with_preconditions_alike():
    plan = _spread_plan()
    assert plan.contract == Contract(post=((((0, 0),),),) * 3, pre=(((0, 0),), (None,), (None,)))
    text = dump_plan(plan)
    assert "  pre 0: 0.0\n  pre 1: -\n  pre 2: -\n" in text
    fast = read_plan_lines(text, {})
    assert fast is not None and fast == plan
    # the grammar's reader (a comment in the header sends the text to it)
    slow = parse_plan(text.replace("tile 0\n", "tile 0  # by hand\n", 1))
    assert slow == plan
    assert load_plan_text(text).collective == "spread"


def load_plan_text(text: str):
    return parse_plan(text)


@pytest.mark.parametrize("edit, message", [
    (("  post 1: 0.0\n", "  post 1: 0.0 0.0\n"), "post row of rank 1 has 2 items for 1 output chunks"),
    (("  post 1: 0.0\n", "  post 1: 7.0\n"), "names input 0 of rank 7; ranks are 0..2"),
    (("  post 1: 0.0\n", "  post 2: 0.0\n"), "post row of rank 2 where rank 1 comes next"),
    (("  post 1: 0.0\n", "  post 1: x\n"), "found"),
    (("  pre 2: -\n", ""), "3 post rows but 2 pre rows"),
])
def test_bad_contracts_are_refused_by_line(edit, message):
    text = dump_plan(_spread_plan()).replace(*edit)
    with pytest.raises(PlanError, match=re.escape(message)):
        parse_plan(text, path="spread.plan")


def test_a_built_in_plan_with_a_contract_is_refused():
    plan = _spread_plan()
    from msc.verification.plan_values import check_plan

    with pytest.raises(PlanError, match="built-in collective allgather carries a contract"):
        check_plan(replace(plan, collective="allgather"))


def test_a_stated_collective_is_for_its_plans_shape_only():
    from msc.verification.plan import plan_collective as resolve

    coll = resolve(_spread_plan())
    assert coll.input_chunks(3, 1) == 1
    with pytest.raises(UsageError, match="known from a plan for 3 ranks and chunk factor 1 only"):
        coll.postcondition(0, 0, 4, 1, 0)
