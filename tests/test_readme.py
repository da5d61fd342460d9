"""The README's command blocks, run as written (in a fresh folder, with this
Python's msc on PATH): a README that does not work is a bug."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from emu_skip import needs_emu
from patience import patience

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(heading: str) -> list[tuple[str, str]]:
    """(language, text) of the fenced blocks in the README section under ``heading``."""
    text = README.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else None]
    found = []
    for indent, lang, body in re.findall(r"^( *)```(\w+)\n(.*?)^ *```", section, flags=re.S | re.M):
        # a block inside a list item is indented with it; a reader copies it without the indent
        found.append((lang, "".join(line[len(indent):] if line.startswith(indent) else line
                                    for line in body.splitlines(keepends=True))))
    return found


def run_block(lang: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=patience(300))


@needs_emu
def test_the_emulated_device_section_runs_as_written(tmp_path):
    found = blocks("Testing kernels without a GPU: the emulated device")
    assert [lang for lang, _ in found] == ["bash", "python"]
    for lang, code in found:
        done = run_block(lang, code, tmp_path)
        assert done.returncode == 0, f"{lang} block failed:\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if lang == "bash":
            assert "Out of bounds values : 0 OK" in done.stdout and "backend emu" in done.stdout


@pytest.mark.slow
def test_the_training_walkthrough_runs_as_written(tmp_path):
    """The msc backend's block tunes plans and trains FSDP2 and DDP on it
    against stock gloo (printing the report the README shows); the hook's
    step 1 compiles plans, step 3 trains with them under torchrun and
    compares with stock DDP, and the CUDA runtime's command does the same on
    the emulated device. The multi-node command needs other machines: left out."""
    pytest.importorskip("torch")
    (tmp_path / "examples").symlink_to(README.parent / "examples")
    found = blocks("Use it in training")
    commands = [code for lang, code in found if lang == "bash" and "--nnodes" not in code]
    assert len(commands) == 4 and "MSC_DEVICE=emu" in commands[3]
    [report] = [code for lang, code in found if lang == "text"]
    for i, code in enumerate(commands):
        done = run_block("bash", code, tmp_path)
        assert done.returncode == 0, f"failed:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if "torchrun" in code:
            assert "msc losses match stock DDP" in done.stdout, done.stdout[-2000:]
        if i == 0:      # the backend: FSDP matches stock gloo and prints the report the README shows
            assert "msc losses match stock FSDP on gloo: max relative difference 0 " in done.stdout
            assert report in done.stdout, done.stdout[-3000:]
    assert "the msc CUDA runtime, on the emulated device" in done.stdout


def test_ci_runs_the_quick_start_verbatim():
    """.ci/run runs each quick-start command as the README spells it."""
    [(lang, code)] = blocks("Quick start")
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    commands = [line for line in code.splitlines() if line.strip()]
    assert lang == "bash" and len(commands) == 2
    for command in commands:
        assert command in ci, f".ci/run does not run the README's quick-start command {command!r}"


def test_the_dsl_tour_runs_as_written(tmp_path):
    (tmp_path / "algorithms").symlink_to(README.parent / "algorithms")
    found = [code for lang, code in blocks("A tour of the DSL") if lang == "python"]
    assert len(found) == 2
    for code in found:
        done = run_block("python", code, tmp_path)
        assert done.returncode == 0, f"failed:\n{code}\n{done.stderr[-2000:]}"
    assert (tmp_path / "ring8.plan").read_text().startswith("msc-plan 1")


def test_the_pictures_command_runs_as_written(tmp_path):
    pytest.importorskip("matplotlib")
    found = [code for lang, code in blocks("Predicting performance: msc simulate, msc tune, msc show")
             if lang == "bash" and "msc show" in code]
    assert len(found) == 1
    done = run_block("bash", found[0], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "hier.png").stat().st_size > 10_000 and (tmp_path / "timeline.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_synthesize_example_runs_as_written(tmp_path):
    """msc synthesize, compile, show and tune --synthesize --plot, as the README spells them."""
    pytest.importorskip("matplotlib")
    [(lang, code)] = blocks("Schedules from the topology: msc synthesize")
    done = run_block(lang, code, tmp_path)
    assert done.returncode == 0, f"failed:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for name in ("allgather_ib2.py", "allgather_ib2.plan", "allgather_ib2.png", "allgather_ib2_busbw.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "synthesized: allgather for ib:2" in done.stdout and "synthesized_p" in done.stdout


SIMULATE = "Predicting performance: msc simulate, msc tune, msc show"


def test_the_topology_list_is_the_preset_table():
    """Every preset's line in the README is the table's name and help, and no other preset is listed."""
    from msc.sim.presets import PRESET_NAMES, PRESETS

    text = README.read_text()
    section = text[text.index("Topologies (`--topology`"):text.index("- A TOML file of your own")]
    listed = [line for line in section.splitlines() if line.startswith("- `")]
    assert listed == [f"- `{name}`: {p.help}." for p, name in zip(PRESETS, PRESET_NAMES)]


def test_the_readme_toml_topology_loads(tmp_path):
    from msc.sim.topology import GB, US, load_topology

    [(_, toml)] = [(lang, code) for lang, code in blocks(SIMULATE) if lang == "toml"]
    path = tmp_path / "t.toml"
    path.write_text(toml)
    t = load_topology(path)
    assert t.name == "two islands" and t.machine == "h100"
    ll = t.view("LL")
    assert ll.launch == 6.6 * US and ll.route(0, 1).bandwidth == float("inf")
    assert ll.capacity[ll.route(0, 1).resources[0]] == 100 * GB * 0.3


def test_the_calibrate_section_runs_as_written(tmp_path):
    """The block fits a published four-H100 log (tests/data/nccl_tests) and simulates NCCL on the result."""
    (tmp_path / "tests").symlink_to(README.parent / "tests")
    [(lang, code)] = blocks("Your own cluster's model in one command")
    done = run_block(lang, code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "within the bar (10% from 1 MB, 20% below): 22 of 22" in done.stdout
    assert "msc simulate --nccl allreduce: 4 ranks on mine" in done.stdout and (tmp_path / "mine.toml").is_file()


def test_the_readme_nccl_block_runs_as_written(tmp_path):
    found = [code for lang, code in blocks(SIMULATE) if lang == "bash" and "--nccl" in code]
    assert len(found) == 1
    done = run_block("bash", found[0], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NCCL's algorithm, protocol and channels" in done.stdout and " LL " in done.stdout


@pytest.mark.slow
def test_the_custom_collective_section_runs_as_written(tmp_path):
    """The example compiles, runs (max over int32, checked against the contract),
    simulates, exports and verifies its XML; the plan's contract is the one shown."""
    found = blocks("Your own collectives")
    [code] = [body for lang, body in found if lang == "bash"]
    [contract] = [body for lang, body in found if lang == "text"]
    done = run_block("bash", code, tmp_path)
    assert done.returncode == 0, f"failed:\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "Out of bounds values : 0 OK" in done.stdout and "outputs right" in done.stdout
    assert contract in (tmp_path / "pairs.plan").read_text()


@pytest.mark.slow
@needs_emu
def test_the_nvls_section_runs_as_written(tmp_path):
    """The switch example compiles, runs on the reference executor with right
    results, simulates on dgx-h100, and msc tune picks NVLS for large sizes."""
    [code] = [body for lang, body in blocks("Reduce in the switch: NVLS") if lang == "bash"]
    done = run_block("bash", code, tmp_path)
    assert done.returncode == 0, f"failed:\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "Out of bounds values : 0 OK" in done.stdout
    last = [line for line in done.stdout.splitlines() if line.strip().startswith("1G ")]
    assert last and "nvls Simple" in last[-1], done.stdout[-3000:]


def test_the_mscclpp_section_runs_as_written(tmp_path):
    """Export to MSCCL++, its check, the round trip, a run of the JSON, its simulation in both models, LL,
    LL128 refused, and an NVLS-tree plan exported as switch channels, checked and read back."""
    [(lang, code)] = blocks("Interop: MSCCL++ execution plans")
    done = run_block(lang, code, tmp_path)
    assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert done.stdout.count("verified MSCCL++ plan") == 3
    assert done.stdout.count("equal (up to dependency equivalence)") == 2
    assert "Out of bounds values : 0 OK" in done.stdout and "Simple and LL (packets) only" in done.stderr
    assert "MSCCL++ plan lifted to the msc plan" in done.stdout and "MSCCL++ plan in the one-sided model" in done.stdout
    gpu = json.loads((tmp_path / "ring8.json").read_text())["gpus"][0]
    assert len(gpu["threadblocks"]) == 2 and all(len(tb["ops"]) <= 64 for tb in gpu["threadblocks"])
