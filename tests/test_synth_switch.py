"""msc synthesize with the switch (NVLS): the switch allreduce (msc.synth.switch)
is simulated beside the spanning-tree programs where the topology's switch
reduces, and wins on one H100 node at 1 GB; elsewhere nothing changes."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import msc
from msc.errors import AlgorithmError, UsageError
from msc.executor import run_collective
from msc.lower.pipeline import LowerOptions, lower
from msc.sim.presets import get_topology
from msc.synth import check_name
from msc.synth.switch import global_names, switch_domains, switch_program
from msc.verification.plan import verify_plan


def _load(tmp_path, text: str):
    path = tmp_path / "switch_prog.py"
    path.write_text(text)
    [alg] = msc.load_algorithms(path)
    return alg


@pytest.mark.parametrize("spec, n, g", [("dgx-h100", 8, 8), ("nvswitch", 8, 8), ("dgx-h100:2", 16, 8),
                                        ("ib:3", 24, 8)])
def test_switch_domains_are_the_nodes_where_the_switch_reduces(spec, n, g):
    assert switch_domains(get_topology(spec, n)) == g


@pytest.mark.parametrize("spec, n", [("ring:8", 8), ("torus:2x4", 8), ("pcie", 8), ("dgx-a100", 8)])
def test_topologies_without_nvls_get_no_switch_schedule(spec, n):
    assert switch_domains(get_topology(spec, n)) is None


@pytest.mark.parametrize("spec, n", [("dgx-h100", 8), ("dgx-h100:2", 16), ("dgx-h100:3", 24)])
def test_the_switch_program_verifies_and_sums(spec, n, tmp_path):
    topo = get_topology(spec, n)
    synthesis = switch_program(topo, switch_domains(topo), name="nvls_synth", command="msc synthesize ...")
    assert synthesis.switch and ("p.switch(" in synthesis.text or "node_switches(p" in synthesis.text) and "msc synthesize ..." in synthesis.text
    alg = _load(tmp_path, synthesis.text)
    rng = np.random.default_rng(n)
    for inplace in (True, False):
        program = msc.trace(alg, n, inplace=inplace)
        msc.verify(program)
        plan = lower(program, LowerOptions(instances=2))
        verify_plan(plan)
        inputs = [rng.standard_normal(plan.chunk_factor * 3 + 1) for _ in range(n)]
        for out in run_collective(plan, inputs, "sum"):
            np.testing.assert_allclose(out, np.sum(inputs, axis=0), rtol=1e-12, atol=1e-12)
    with pytest.raises(AlgorithmError, match=f"does not support {n + 8} ranks"):
        msc.trace(alg, n + 8)                       # written for its topology's ranks only


def test_the_switch_program_s_names_are_refused_as_the_algorithm_s():
    assert {"trees_across_nodes", "node_switches", "GPUS_PER_DOMAIN", "TREES"} <= global_names()
    for name in ("trees_across_nodes", "GPUS_PER_DOMAIN"):      # imported from msc.dsl.nvls, and its own
        with pytest.raises(UsageError, match="uses itself"):
            check_name(name)


@pytest.mark.slow
def test_synthesize_picks_the_switch_on_one_h100_node_at_1g_and_verifies(tmp_path):
    out = subprocess.run([sys.executable, "-m", "msc.cli", "synthesize", "allreduce", "-t", "dgx-h100", "--size", "1G",
                          "-o", "nvls_synth.py", "--json"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["switch"] and summary["verified"] and summary["chosen_by"] == "simulation"
    text = (tmp_path / "nvls_synth.py").read_text()
    assert "sw.reduce(r, \"input\", r).store(\"output\", r)" in text
    alg = _load(tmp_path, text)
    verify_plan(lower(msc.trace(alg, 8, inplace=True), LowerOptions(instances=summary["instances"])))
    given = subprocess.run([sys.executable, "-m", "msc.cli", "synthesize", "allreduce", "-t", "dgx-h100", "--pieces", "1",
                            "-o", "trees.py", "--json"], cwd=tmp_path, capture_output=True, text=True)
    assert given.returncode == 0 and not json.loads(given.stdout)["switch"], given.stderr
