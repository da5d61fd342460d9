"""msc.torch.PlanRegistry: which plan serves a call, and the errors when
none or two do. Torch-free: runs without PyTorch installed."""
from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

import pytest

import msc
from msc.errors import PlanError, UsageError
from msc.lower.pipeline import LowerOptions, lower
from msc.formats.plan_text import save_plan
from msc.resources import data_dir
from msc.torch import NoPlanError, PlanRegistry


@cache
def plan(collective: str, name: str, n: int, inplace: bool = True, root: int = 0):
    [alg] = [a for a in msc.load_algorithms(data_dir("algorithms") / collective / f"{name}.py") if a.name == name]
    program = msc.trace(alg, n, inplace=inplace, **({"root": root} if alg.collective.has_root else {}))
    msc.verify(program)
    return lower(program, LowerOptions())


def test_importing_msc_torch_does_not_import_torch():
    code = "import sys, msc, msc.torch; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_directory_without_index_covers_all_sizes(tmp_path):
    save_plan(plan("allreduce", "ring", 4), tmp_path / "allreduce-ring-n4.plan")
    save_plan(plan("allgather", "ring", 4, False), tmp_path / "allgather-ring-n4.plan")
    (tmp_path / "notes.txt").write_text("not a plan")
    reg = PlanRegistry.from_dir(tmp_path)
    assert len(reg) == 2
    for nbytes in (0, 1, 1 << 40):
        assert reg.select("allreduce", 4, nbytes).name == "ring"
        assert reg.select("all_gather", 4, nbytes, inplace=False).collective == "allgather"


def test_index_size_ranges_min_inclusive_max_exclusive(tmp_path):
    save_plan(plan("allreduce", "ring", 4), tmp_path / "ring.plan")
    save_plan(plan("allreduce", "allpairs", 4), tmp_path / "allpairs.plan")
    (tmp_path / "plans.json").write_text(json.dumps({"version": 1, "plans": [
        {"file": "allpairs.plan", "min_bytes": 0, "max_bytes": "64K", "note": "small messages"},
        {"file": "ring.plan", "min_bytes": 65536, "_measured_busbw": 1.5}]}))
    reg = PlanRegistry.from_dir(tmp_path)
    assert [reg.select("allreduce", 4, b).name for b in (0, 65535, 65536, 1 << 30)] == \
        ["allpairs", "allpairs", "ring", "ring"]
    assert reg.gaps("allreduce", 4) == []


def test_index_with_metadata_reads_plans_lazily(tmp_path):
    save_plan(plan("allreduce", "ring", 2), tmp_path / "ring.plan")
    (tmp_path / "broken.plan").write_text("msc-plan 1\nthis is not a plan\n")
    (tmp_path / "plans.json").write_text(json.dumps([
        {"file": "ring.plan", "collective": "allreduce", "ranks": 2, "inplace": True, "max_bytes": 1024},
        {"file": "broken.plan", "collective": "allreduce", "ranks": 2, "inplace": True, "min_bytes": 1024}]))
    reg = PlanRegistry.from_dir(tmp_path)            # neither file read yet
    assert reg.select("allreduce", 2, 100).name == "ring"
    with pytest.raises(PlanError):
        reg.select("allreduce", 2, 4096)


def test_index_metadata_must_agree_with_the_plan(tmp_path):
    save_plan(plan("allreduce", "ring", 2), tmp_path / "ring.plan")
    (tmp_path / "plans.json").write_text(json.dumps([
        {"file": "ring.plan", "collective": "allreduce", "ranks": 4, "inplace": True}]))
    reg = PlanRegistry.from_dir(tmp_path)
    with pytest.raises(PlanError, match="the index says allreduce 4 ranks in place, the plan is allreduce 2 ranks"):
        reg.select("allreduce", 4, 100)


@pytest.mark.parametrize("index,message", [
    ('[{"file": "ring.plan", "max_byte": 10}]', "unknown key"),
    ('[{"min_bytes": 10}]', 'with a "file" key'),
    ('{"plans": [}', "not JSON"),
    ('{"version": 2, "plans": []}', "version 2"),
    ('[{"file": "ring.plan", "min_bytes": "lots"}]', "bad size"),
    ('[{"file": "ring.plan", "min_bytes": 100, "max_bytes": 100}]', "must be > min_bytes"),
    ('[{"file": "missing.plan"}]', "cannot read"),
])
def test_bad_index_files(tmp_path, index, message):
    save_plan(plan("allreduce", "ring", 2), tmp_path / "ring.plan")
    (tmp_path / "plans.json").write_text(index)
    with pytest.raises((UsageError, PlanError), match=message):
        PlanRegistry.from_dir(tmp_path)


def test_overlapping_plans_for_the_same_calls_are_an_error(tmp_path):
    save_plan(plan("allreduce", "ring", 4), tmp_path / "a.plan")
    save_plan(plan("allreduce", "allpairs", 4), tmp_path / "b.plan")
    with pytest.raises(UsageError, match="two plans for the same calls: .*a.plan.*b.plan"):
        PlanRegistry.from_dir(tmp_path)
    reg = PlanRegistry()
    reg.add(plan("allreduce", "ring", 4), max_bytes="1M")
    reg.add(plan("allreduce", "allpairs", 4), min_bytes="1M")          # adjacent is fine
    reg.add(plan("allreduce", "allpairs", 4, inplace=False))           # another form is another call
    with pytest.raises(UsageError, match="overlap"):
        reg.add(plan("allreduce", "ring", 4), min_bytes="512K", max_bytes="2M")


def test_no_plan_error_names_the_call_and_what_exists():
    reg = PlanRegistry()
    reg.add(plan("allreduce", "ring", 4), max_bytes="1M")
    with pytest.raises(NoPlanError) as info:
        reg.select("allreduce", 4, 3 << 20)
    text = str(info.value)
    assert "no msc plan for allreduce 4 ranks in place at 3145728 bytes (3M)" in text
    assert "allreduce 4 ranks in place [0, 1M) from <plan ring>" in text
    assert "msc compile" in text
    assert (info.value.collective, info.value.num_ranks, info.value.nbytes) == ("allreduce", 4, 3 << 20)
    with pytest.raises(NoPlanError, match="allreduce 8 ranks"):
        reg.select("allreduce", 8, 100)
    with pytest.raises(NoPlanError, match="no msc plan for broadcast.*the registry has: allreduce"):
        reg.select("broadcast", 4, 100)
    assert reg.gaps("allreduce", 4) == [(1 << 20, None)]
    assert reg.gaps("allreduce", 2) == [(0, None)]


def test_the_other_form_serves_unless_exact():
    reg = PlanRegistry.from_plans([plan("allreduce", "ring", 2, inplace=False)])
    assert reg.select("allreduce", 2, 100, inplace=True).inplace is False
    with pytest.raises(NoPlanError, match="in that form"):
        reg.select("allreduce", 2, 100, inplace=True, exact=True)
    assert reg.gaps("allreduce", 2, inplace=True) == [(0, None)]
    assert reg.gaps("allreduce", 2, inplace=None) == []


def test_rooted_collectives_match_the_root_else_turn_another_roots_plan():
    """A plan of the call's root serves it; for another root the lowest
    root's plan is renamed (ranks rotated) and verified, once per root."""
    root0, root2 = plan("broadcast", "chain", 3, root=0), plan("broadcast", "chain", 3, root=2)
    reg = PlanRegistry.from_plans([root0, root2])
    assert reg.select("broadcast", 3, 64, root=2) is root2
    assert reg.select("broadcast", 3, 64, root=0) is root0
    turned = reg.entry("broadcast", 3, 64, root=1)
    assert turned.root == turned.plan.root == 1 and turned.base.plan is root0
    assert turned.source == "<plan chain> (root 0 relabelled to 1)"
    assert reg.entry("broadcast", 3, 64, root=1) is turned                 # made and verified once
    assert [tb.send for tb in turned.plan.ranks[1].threadblocks if tb.send is not None] == \
        [(tb.send + 1) % 3 for tb in root0.ranks[0].threadblocks if tb.send is not None]
    with pytest.raises(NoPlanError, match="broadcast 3 ranks in place root 1"):
        reg.select("broadcast", 3, 64, root=1, exact=True)


@pytest.mark.parametrize("collective,name,n", [("broadcast", "chain", 4), ("broadcast", "binomial_tree", 5),
                                               ("reduce", "ring", 4), ("reduce", "tree", 3)])
def test_a_rooted_plan_renamed_for_every_root_verifies(collective, name, n):
    from msc.executor import run_collective
    from msc.lower.relabel import for_root
    from msc.verification.plan import verify_plan
    import numpy as np

    base = plan(collective, name, n, inplace=False)
    rng = np.random.default_rng(5)
    inputs = [rng.integers(1, 100, 3).astype(np.int64) for _ in range(n)]          # one unit of 3 elements
    for root in range(n):
        turned = for_root(base, root)
        verify_plan(turned)
        out = run_collective(turned, inputs, "sum", count=3)
        want = inputs[root] if collective == "broadcast" else sum(inputs)
        assert np.array_equal(out[root], want), root


def test_a_wrong_renaming_is_caught_by_the_verifier():
    """The verifier is the proof: ranks renamed but the root left where it
    was is a plan that delivers the wrong rank's data."""
    from dataclasses import replace

    from msc.errors import VerificationError
    from msc.lower.relabel import relabel
    from msc.verification.plan import verify_plan

    base = plan("broadcast", "chain", 3)
    with pytest.raises(VerificationError, match="rank 0"):
        verify_plan(replace(relabel(base, [1, 2, 0]), root=0))
    with pytest.raises(UsageError, match="each of 0..2 once"):
        relabel(base, [0, 0, 1])


def test_empty_directory_says_how_to_make_plans(tmp_path):
    with pytest.raises(UsageError, match="holds no plans.*msc compile"):
        PlanRegistry.from_dir(tmp_path)
    with pytest.raises(UsageError, match="not a directory"):
        PlanRegistry.from_dir(tmp_path / "nowhere")


def xml_for(plan_, **byte_range) -> str:
    from msc.formats.xml_export import plan_to_xml

    return plan_to_xml(plan_, **byte_range)


def test_xml_files_keep_their_own_size_ranges(tmp_path):
    (tmp_path / "small.xml").write_text(xml_for(plan("allreduce", "allpairs", 4), max_bytes=65536))
    (tmp_path / "large.xml").write_text(xml_for(plan("allreduce", "ring", 4), min_bytes=65536))
    reg = PlanRegistry.from_dir(tmp_path)
    assert [reg.select("allreduce", 4, b).name for b in (0, 65535, 65536, 1 << 30)] == \
        ["allpairs", "allpairs", "ring", "ring"]
    # an index entry without bounds takes the XML's; stated bounds win
    (tmp_path / "plans.json").write_text(json.dumps([{"file": "small.xml"},
                                                     {"file": "large.xml", "min_bytes": "1M"}]))
    reg = PlanRegistry.from_dir(tmp_path)
    assert reg.select("allreduce", 4, 100).name == "allpairs"
    assert reg.gaps("allreduce", 4) == [(65536, 1 << 20)]
    # an explicit range given to add() wins over the file's
    reg = PlanRegistry()
    assert reg.add(tmp_path / "small.xml", min_bytes=0, max_bytes=None).max_bytes is None


def test_two_xml_files_for_the_same_sizes_is_an_error(tmp_path):
    for name in ("a.xml", "b.xml"):
        (tmp_path / name).write_text(xml_for(plan("allreduce", "ring", 4), max_bytes=1 << 20))
    with pytest.raises(UsageError, match="two plans for the same calls"):
        PlanRegistry.from_dir(tmp_path)


@pytest.mark.parametrize("attrs, expected", [
    ('', (0, None)),
    ('minBytes="1024" maxBytes="4096"', (1024, 4096)),
    ('minbytes="5" maxbytes="9"', (5, 9)),
    ('minBytes="0" maxBytes="0"', (0, None)),                       # azure: 0 is no limit
    ('minBytes="7" maxBytes="9223372036854775807"', (7, None)),     # msccl's int64 max
])
def test_xml_byte_range(attrs, expected):
    from msc.formats.xml_import import xml_byte_range

    assert xml_byte_range(f'<algo name="x" {attrs}><gpu id="0"/></algo>') == expected


@pytest.mark.parametrize("text, message", [
    ('<algo minBytes="-1"/>', "minBytes='-1' is not an integer >= 0"),
    ('<algo maxBytes="lots"/>', "maxBytes='lots' is not an integer >= 0"),
    ('<algo minBytes="10" maxBytes="10"/>', "selects no size"),
    ('<gpu/>', "the root element is <gpu>"),
    ('<algo', "not well-formed"),
])
def test_xml_byte_range_errors(text, message):
    from msc.formats.xml_import import xml_byte_range

    with pytest.raises(PlanError, match=message):
        xml_byte_range(text)


def test_xml_byte_range_refuses_a_dtd_as_the_importer_does():
    from msc.formats.xml_import import xml_byte_range

    with pytest.raises(PlanError, match="must not contain a DTD"):
        xml_byte_range('<!DOCTYPE algo [<!ENTITY x "y">]><algo minBytes="1"/>')


def test_a_plan_the_index_does_not_list_is_named_with_the_index(tmp_path):
    """With a plans.json, a plan file beside it that it does not list is not
    used: the error says which file and which index (a user of docs/training.md
    compiled a plan and saw 'no plan' without a word about plans.json)."""
    save_plan(plan("allreduce", "ring", 4), tmp_path / "allreduce-ring-n4.plan")
    save_plan(plan("allreduce", "ring", 2), tmp_path / "allreduce-ring-n2.plan")
    (tmp_path / "plans.json").write_text(json.dumps({"version": 1, "plans": [{"file": "allreduce-ring-n4.plan"}]}))
    reg = PlanRegistry.from_dir(tmp_path)
    assert reg.index == tmp_path / "plans.json" and reg.unlisted == ("allreduce-ring-n2.plan",)
    with pytest.raises(NoPlanError) as info:
        reg.select("allreduce", 2, 1024)
    text = str(info.value)
    assert f"(from {tmp_path / 'plans.json'})" in text
    assert f"add an entry for it to {tmp_path / 'plans.json'}" in text
    assert f"allreduce-ring-n2.plan in {tmp_path} is not listed in it" in text


def test_a_plans_folder_others_can_write_is_warned_of_even_through_a_link(tmp_path, recwarn):
    """The kernel cache uses only folders no one else can change; a plans
    folder that was a link to a world-writable folder was read without a
    word. msc verifies every plan it reads, so the warning says what such a
    folder still gives away: which plans serve the calls."""
    import os
    import warnings

    import msc.formats.registry as registry
    from msc.torch import PlanFolderWarning

    shared = tmp_path / "shared"
    shared.mkdir()
    save_plan(plan("allreduce", "ring", 4), shared / "allreduce-ring-n4.plan")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    save_plan(plan("allreduce", "ring", 4), mine / "allreduce-ring-n4.plan")
    os.chmod(shared, 0o777)
    (tmp_path / "plans").symlink_to(shared)
    registry._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # a folder only this user can change: no warning
        PlanRegistry.from_dir(mine)
    with pytest.warns(PlanFolderWarning, match=f"plans are read from {tmp_path}/plans \\(a link to {shared}\\), "
                                               f"which is writable by others \\(mode 777\\): msc verifies each plan"):
        assert len(PlanRegistry.from_dir(tmp_path / "plans")) == 1
    os.chmod(shared, 0o755)
    os.chmod(shared / "allreduce-ring-n4.plan", 0o666)
    registry._warned.clear()
    with pytest.warns(PlanFolderWarning, match="allreduce-ring-n4.plan, which is writable by others \\(mode 666\\)"):
        PlanRegistry.from_dir(shared)


def test_the_tune_command_a_miss_names_makes_the_missing_plans(tmp_path, capsys):
    """What strict mode tells a user to run (``tune_command``) is run here as
    told, in this process: afterwards the folder serves the call (any size,
    any root) and keeps the entries it had."""
    import shlex

    from msc.cli.main import main

    save_plan(plan("allreduce", "ring", 2), tmp_path / "allreduce-ring-n2.plan")
    (tmp_path / "plans.json").write_text(json.dumps([{"file": "allreduce-ring-n2.plan", "max_bytes": "4K"}]))
    reg = PlanRegistry.from_dir(tmp_path)
    with pytest.raises(NoPlanError):
        reg.entry("broadcast", 2, 1 << 20, root=1)
    command = reg.tune_command("broadcast", 2)
    assert command == (f"msc tune broadcast/binomial_tree broadcast/chain broadcast/nccl_rings --ranks 2 -t ring:2 "
                       f"-o {tmp_path}")
    words = shlex.split(command)
    assert main(words[1:]) == 0
    capsys.readouterr()
    after = PlanRegistry.from_dir(tmp_path)
    for nbytes in (8, 1 << 20, 1 << 30):
        assert after.entry("broadcast", 2, nbytes, root=1).plan.root == 1
    assert after.entry("allreduce", 2, 100).plan.name == "ring"
    assert after.tuned_on == {2: "ring:2"}
    assert reg.tune_command("reducescatter", 4, inplace=False).endswith(f"--ranks 4 -t ring:4 -o {tmp_path} --inplace out")
