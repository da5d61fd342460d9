"""Every command block of the README and of the manual (docs/*.md), run as
written, in a fresh folder with this Python's msc on PATH: a page that does
not work is a bug.

A page's ``##`` section is the unit: its bash and python blocks run in order,
in one folder (a later block reads what an earlier one wrote), and SECTIONS
says what each section's output must show. A block that is not run is listed
there with the reason (a fragment of a larger program, other machines); a
fragment is still compiled, so its Python at least parses. Sections that take
minutes or need torch are marked slow (``pytest -m slow``, CI's second part).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from emu_skip import needs_emu
from patience import patience

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
RUN = ("bash", "python")
# the repository folders a block may name by path, as it would from the top of a checkout
TOP_FOLDERS = ("algorithms", "examples", "tests")


@dataclass(frozen=True)
class Block:
    page: str
    section: str            # the ## heading the block lies under ("" before the first one)
    line: int               # of the opening fence, 1-based
    lang: str
    code: str


def page_blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, each with the ``##`` section it lies under."""
    found, section, fence, body = [], "", None, []
    for number, line in enumerate((REPO / page).read_text().splitlines(keepends=True), 1):
        opening = re.match(r"^( *)```(\w*)\s*$", line)
        if fence is None and opening:
            fence = (number, opening.group(1), opening.group(2))
            body = []
        elif fence is not None and re.match(r"^ *```\s*$", line):
            start, indent, lang = fence
            # a block inside a list item is indented with it; a reader copies it without the indent
            found.append(Block(page, section, start, lang,
                               "".join(b[len(indent):] if b.startswith(indent) else b for b in body)))
            fence = None
        elif fence is not None:
            body.append(line)
        elif line.startswith("## "):
            section = line[3:].strip()
    assert fence is None, f"{page}:{fence[0]}: a fenced block that never closes"
    return found


def blocks(page: str, heading: str) -> list[tuple[str, str]]:
    """(language, text) of the fenced blocks in ``page``'s section ``heading``."""
    found = [(b.lang, b.code) for b in page_blocks(page) if b.section == heading]
    assert found, f"{page} has no section {heading!r} with blocks"
    return found


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def run_block(lang: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=patience(300))


@dataclass
class Ran:
    """What a section's blocks did: the folder they ran in and each run block's result."""
    folder: Path
    runs: list[tuple[Block, subprocess.CompletedProcess]]

    @property
    def stdout(self) -> str:
        return "".join(done.stdout for _, done in self.runs)

    @property
    def stderr(self) -> str:
        return "".join(done.stderr for _, done in self.runs)

    def text(self, page: str, section: str) -> str:
        """The section's one ``text`` block: output the page shows, which the run must print."""
        [shown] = [code for lang, code in blocks(page, section) if lang == "text"]
        return shown


@dataclass(frozen=True)
class Section:
    """How a section is run: its marks, the modules it needs, blocks not run
    (index among the section's bash and python blocks -> why), the first blocks
    of another section that make the files it starts from, and what its output must show."""
    check: Callable[[Ran], None] = lambda ran: None
    slow: bool = False
    emu: bool = False
    needs: tuple[str, ...] = ()
    skip: dict[int, str] = field(default_factory=dict)
    after: tuple[str, str, int] | None = None


FRAGMENT = "a fragment of a larger program (names it does not define)"


def _ten_minutes(ran: Ran):
    assert "verified: myring (allreduce, 8 ranks" in ran.stdout
    assert ran.text("README.md", "Ten minutes with msc") in ran.stderr, ran.stderr[-2000:]
    assert (ran.folder / "myring8.plan").read_text().startswith("msc-plan 1")
    assert (ran.folder / "myring8-ll.float32-sum.cu").stat().st_size > 1000
    assert ran.stdout.count("Out of bounds values : 0 OK") == 2
    assert "msc simulate --nccl allreduce" in ran.stdout and "%bound" in ran.stdout
    entries = json.loads((ran.folder / "plans8" / "plans.json").read_text())
    assert "myring" in {e["algorithm"] for e in entries}           # it wins the large sizes on dgx-h100
    assert all((ran.folder / "plans8" / e["file"]).is_file() for e in entries)


def _train(ran: Ran):
    assert "served: allreduce-myring" in ran.stdout, ran.stdout[-3000:]
    assert "msc losses match stock DDP: max relative difference 0 over 20 steps" in ran.stdout


def _tour(ran: Ran):
    assert (ran.folder / "ring8.plan").read_text().startswith("msc-plan 1")


def _custom(ran: Ran):
    assert "Out of bounds values : 0 OK" in ran.stdout and "outputs right" in ran.stdout
    assert ran.text("docs/dsl.md", "Your own collectives") in (ran.folder / "pairs.plan").read_text()


def _nvls(ran: Ran):
    """The switch plan runs right on the executor and the emulated device; msc tune picks NVLS for large sizes."""
    assert ran.stdout.count("Out of bounds values : 0 OK") == 2
    last = [line for line in ran.stdout.splitlines() if line.strip().startswith("1G ")]
    assert last and "nvls Simple" in last[-1], ran.stdout[-3000:]


def _emulated(ran: Ran):
    assert "Out of bounds values : 0 OK" in ran.stdout and "backend emu" in ran.stdout


def _mscclang(ran: Ran):
    assert ran.stdout.startswith("verified: all_to_next (AllToNext, 4 ranks, 6 ops")


def _msccl_runtimes(ran: Ran):
    assert "MSCCL_MAX_NUM_STEPS = 64" in ran.stderr and "Out of bounds values : 0 OK" in ran.stdout


def _mscclpp(ran: Ran):
    """Export, check, round trip, a run of the JSON, both models, LL, LL128 refused, an NVLS tree as switch channels."""
    assert ran.stdout.count("verified MSCCL++ plan") == 3
    assert ran.stdout.count("equal (up to dependency equivalence)") == 2
    assert "Out of bounds values : 0 OK" in ran.stdout and "Simple and LL (packets) only" in ran.stderr
    assert "MSCCL++ plan lifted to the msc plan" in ran.stdout and "MSCCL++ plan in the one-sided model" in ran.stdout
    gpu = json.loads((ran.folder / "ring8.json").read_text())["gpus"][0]
    assert len(gpu["threadblocks"]) == 2 and all(len(tb["ops"]) <= 64 for tb in gpu["threadblocks"])


def _backend(ran: Ran):
    """FSDP2 and DDP on the msc backend match stock gloo; FSDP's run prints the report the page shows."""
    assert "msc losses match stock FSDP on gloo: max relative difference 0 " in ran.stdout
    assert "msc losses match stock DDP" in ran.stdout
    report = ran.text("docs/training.md", "The msc backend: FSDP, DDP and any torch code, unchanged")
    assert report in ran.stdout, ran.stdout[-3000:]


def _hook(ran: Ran):
    """Step 3 trains with the hook and compares with stock DDP; so does the CUDA runtime on the emulated device."""
    assert ran.stdout.count("msc losses match stock DDP") == 2, ran.stdout[-3000:]
    assert "the msc CUDA runtime, on the emulated device" in ran.stdout


def _nccl(ran: Ran):
    assert "NCCL's algorithm, protocol and channels" in ran.stdout and " LL " in ran.stdout


def _bound(ran: Ran):
    assert "every rank out (16 ports + 16 NICs" in ran.stdout and "%bound" in ran.stdout


def _pictures(ran: Ran):
    for name in ("hier.png", "timeline.png"):
        assert (ran.folder / name).stat().st_size > 10_000, name


def _calibrate(ran: Ran):
    """The block fits a published four-H100 log (tests/data/nccl_tests) and simulates NCCL on the result."""
    assert "within the bar (10% from 1 MB, 20% below): 22 of 22" in ran.stdout
    assert "msc simulate --nccl allreduce: 4 ranks on mine" in ran.stdout and (ran.folder / "mine.toml").is_file()


def _synthesize(ran: Ran):
    for name in ("allgather_ib2.py", "allgather_ib2.plan", "allgather_ib2.png", "allgather_ib2_busbw.png"):
        assert (ran.folder / name).stat().st_size > 0, name
    assert "synthesized: allgather for ib:2" in ran.stdout and "synthesized_p" in ran.stdout


TRAINING = "docs/training.md"
SECTIONS: dict[tuple[str, str], Section] = {
    ("README.md", "Quick start"): Section(skip={
        0: "CI runs each command, verbatim, in a fresh virtual environment (.ci/run; "
           "test_ci_runs_the_quick_start_verbatim checks they are the README's): the second is the whole suite"}),
    ("README.md", "Ten minutes with msc"): Section(_ten_minutes, emu=True),
    # torch, and two torchrun trainings: about 15 CPU-s
    ("README.md", "Train with it"): Section(_train, slow=True, needs=("torch",), after=(
        "README.md", "Ten minutes with msc", 1), skip={1: FRAGMENT + ": examples/train_ddp.py, which the "
                                                        "torchrun block runs, makes the same calls"}),
    ("docs/dsl.md", "A tour of the DSL"): Section(_tour),
    ("docs/dsl.md", "Your own collectives"): Section(_custom, slow=True),
    ("docs/dsl.md", "Reduce in the switch: NVLS"): Section(_nvls, slow=True, emu=True, skip={
        0: FRAGMENT + " (a program p, a rank r, an index i): the library's allreduce/nvls.py, "
                      "which the bash block compiles and runs, makes these calls"}),
    ("docs/cuda.md", "Testing kernels without a GPU: the emulated device"): Section(_emulated, emu=True),
    ("docs/interop.md", "MSCCLang programs"): Section(_mscclang),
    ("docs/interop.md", "MSCCL XML and the MSCCL runtimes"): Section(_msccl_runtimes),
    ("docs/interop.md", "MSCCL++ execution plans"): Section(_mscclpp),
    (TRAINING, "The msc backend: FSDP, DDP and any torch code, unchanged"): Section(
        _backend, slow=True, needs=("torch",), skip={1: FRAGMENT + ": examples/train_fsdp.py, which the "
                                                       "torchrun block runs, makes these calls"}),
    (TRAINING, "The DDP hook and explicit calls"): Section(_hook, slow=True, needs=("torch",), skip={
        1: FRAGMENT + " (model): examples/train_ddp.py, which step 3 runs, registers this hook",
        3: "it needs other machines (two nodes and a rendezvous endpoint)"}),
    ("docs/performance.md", "NCCL's choice: msc simulate --nccl"): Section(_nccl),
    ("docs/performance.md", "Lower bounds: msc bound"): Section(_bound),
    ("docs/performance.md", "Pictures: msc show"): Section(_pictures, needs=("matplotlib",)),
    ("docs/performance.md", "Your own cluster's model in one command"): Section(_calibrate),
    ("docs/performance.md", "Schedules from the topology: msc synthesize"): Section(
        _synthesize, slow=True, needs=("matplotlib",)),
}


def _runnable() -> dict[tuple[str, str], list[Block]]:
    out: dict[tuple[str, str], list[Block]] = {}
    for page in PAGES:
        for block in page_blocks(page):
            if block.lang in RUN:
                out.setdefault((page, block.section), []).append(block)
    return out


RUNNABLE = _runnable()


def _params():
    for key in RUNNABLE:
        section = SECTIONS.get(key, Section())
        marks = ([pytest.mark.slow] if section.slow else []) + ([needs_emu] if section.emu else [])
        if all(i in section.skip and block.lang == "bash" for i, block in enumerate(RUNNABLE[key])):
            # nothing to run here, nor to compile: say why in the test report rather than pass
            marks.append(pytest.mark.skip(reason="; ".join(sorted(set(section.skip.values())))))
        yield pytest.param(*key, marks=marks, id=f"{key[0]}#{anchor(key[1])}")


def run_section(page: str, heading: str, folder: Path) -> Ran:
    section = SECTIONS.get((page, heading), Section())
    for module in section.needs:
        pytest.importorskip(module)
    for name in TOP_FOLDERS:
        (folder / name).symlink_to(REPO / name)
    if section.after:
        first_page, first_heading, count = section.after
        for block in RUNNABLE[(first_page, first_heading)][:count]:
            done = run_block(block.lang, block.code, folder)
            assert done.returncode == 0, f"{block.page}:{block.line}: failed:\n{done.stderr[-2000:]}"
    ran = Ran(folder, [])
    for i, block in enumerate(RUNNABLE[(page, heading)]):
        if i in section.skip:
            if block.lang == "python":
                compile(block.code, f"{page}:{block.line}", "exec")
            continue
        done = run_block(block.lang, block.code, folder)
        assert done.returncode == 0, (f"{page}:{block.line}: the {block.lang} block failed:\n{block.code}\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        ran.runs.append((block, done))
    return ran


@pytest.mark.parametrize(("page", "heading"), list(_params()))
def test_the_pages_run_as_written(page, heading, tmp_path):
    ran = run_section(page, heading, tmp_path)
    SECTIONS.get((page, heading), Section()).check(ran)


def test_every_listed_section_and_skipped_block_exists():
    """A renamed heading or a moved block must not silently drop its checks."""
    for (page, heading), section in SECTIONS.items():
        assert (page, heading) in RUNNABLE, f"{page} has no section {heading!r} with bash or python blocks"
        count = len(RUNNABLE[(page, heading)])
        assert all(0 <= i < count for i in section.skip), (page, heading, section.skip, count)
        if section.after:
            assert section.after[:2] in RUNNABLE, section.after


def test_every_run_section_checks_its_output():
    """Exit 0 is not enough: every section that runs blocks says what their output must show."""
    for key, found in RUNNABLE.items():
        section = SECTIONS.get(key, Section())
        if len(section.skip) < len(found):
            assert section.check is not Section.check, f"{key}: runs blocks but checks nothing of their output"


def test_the_links_between_pages_resolve():
    """Every relative link of the README and the manual names a file that exists and, in a page, a heading."""
    for page in PAGES:
        text = (REPO / page).read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+:", target):
                continue
            path, _, fragment = target.partition("#")
            file = (REPO / page).parent / path if path else REPO / page
            assert file.exists(), f"{page}: link to {target}: no such file"
            if fragment:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
                assert fragment in {anchor(h) for h in headings}, f"{page}: link to {target}: no such heading"


def test_the_readme_is_short():
    """The README is a front page: what msc is, the quick start, a workflow and links (issue 41)."""
    assert len(README.read_text().splitlines()) <= 300


def test_ci_runs_the_quick_start_verbatim():
    """.ci/run runs each quick-start command as the README spells it."""
    [(lang, code)] = blocks("README.md", "Quick start")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line for line in code.splitlines() if line.strip()]
    assert lang == "bash" and len(commands) == 2
    for command in commands:
        assert command in ci, f".ci/run does not run the README's quick-start command {command!r}"


PERFORMANCE = "docs/performance.md"


def test_the_topology_list_is_the_preset_table():
    """Every preset's line in the manual is the table's name and help, and no other preset is listed."""
    from msc.sim.presets import PRESET_NAMES, PRESETS

    text = (REPO / PERFORMANCE).read_text()
    section = text[text.index("Topologies (`--topology`"):text.index("- A TOML file of your own")]
    listed = [line for line in section.splitlines() if line.startswith("- `")]
    assert listed == [f"- `{name}`: {p.help}." for p, name in zip(PRESETS, PRESET_NAMES)]


def test_the_toml_topology_loads(tmp_path):
    from msc.sim.topology import GB, US, load_topology

    [toml] = [code for lang, code in blocks(PERFORMANCE, "Topologies") if lang == "toml"]
    path = tmp_path / "t.toml"
    path.write_text(toml)
    t = load_topology(path)
    assert t.name == "two islands" and t.machine == "h100"
    ll = t.view("LL")
    assert ll.launch == 6.6 * US and ll.route(0, 1).bandwidth == float("inf")
    assert ll.capacity[ll.route(0, 1).resources[0]] == 100 * GB * 0.3
