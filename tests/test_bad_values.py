"""Bad values are refused by name, good ones are not misread (issue 27,
items 8-10): TOML topologies in every command that reads them, plans.json
through the Python API, msc tune -o merging plans.json, pictures that cannot
be written, msc synthesize's --name and -o, Python warnings in one line.

Every refusal is exit 2 (or a UsageError from the API), one line, naming the
file once and the key; never a traceback, never a wrong value taken."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import msc
from patience import patience
from msc.errors import UsageError
from msc.sim.protocols import LinkModel, Protocol
from msc.sim.topology import Uniform
from msc.formats.registry import PlanRegistry

RING4 = """name = "t"
ranks = 4
[[link]]
from = [0, 1, 2, 3]
to = [1, 2, 3, 0]
alpha_us = 1.0
bandwidth_gbps = 10.0
"""
PROTO = RING4 + "[protocol.Simple]\n"

# (TOML text, what the one-line error must say besides the file's name)
BAD_TOML = [
    ('ranks = 4\nlink = 5\n', "'link' must be [[link]] tables"),
    ('ranks = 4\nlink = [5]\n', "expected a [[link]] table"),
    (RING4.replace("ranks = 4", "ranks = 4\nprotocol = 5"), "[protocol] must be a table"),
    (PROTO + "tile = [1]\n", "tile must be an int"),
    (PROTO + "tile = 0\n", "tile must be an int"),
    (PROTO + "tile = -100\n", "tile must be an int"),
    (PROTO + "tile = 4611686018427387904\n", "tile must be an int"),
    ('ranks = 4\nx = ' + "[" * 5000 + "]" * 5000 + "\n", "nested too deep"),
    ('ranks = 4\nx = ' + "{a = " * 3000 + "1" + "}" * 3000 + "\n", "nested too deep"),
    (PROTO + "alpha_factor = -1.0\n", "alpha_factor must be a number > 0"),
    (PROTO + 'alpha_factor = "x"\n', "alpha_factor must be a number > 0"),
    (PROTO + "alpha_factor = inf\n", "alpha_factor must be a number > 0"),
    (PROTO + "alpha_factor = nan\n", "alpha_factor must be a number > 0"),
    (PROTO + "bandwidth_factor = 2.0\n", "bandwidth_factor must be a number > 0 and <= 1"),
    (PROTO + "launch_us = inf\n", "launch_us must be a number >= 0"),
    (PROTO + "step_us = -1\n", "step_us must be a number >= 0"),
    (PROTO + "threadblock_gbps = inf\n", "threadblock_gbps must be a number"),
    (RING4 + "[protocol.LL.nvlink]\nalpha_factor = -0.5\n", "[protocol.LL.nvlink]: alpha_factor must be"),
    (RING4.replace("alpha_us = 1.0", "alpha_us = 1e308"), "alpha_us must be a number >= 0 and <= 1e+06"),
    (RING4.replace("alpha_us = 1.0", "alpha_us = inf"), "alpha_us must be a number"),
    (RING4.replace("alpha_us = 1.0", "alpha_us = nan"), "alpha_us must be a number"),
    (RING4.replace("alpha_us = 1.0", "alpha_us = -1"), "alpha_us must be a number"),
    (RING4.replace("bandwidth_gbps = 10.0", "bandwidth_gbps = inf"), "bandwidth_gbps must be a number"),
    (RING4.replace("bandwidth_gbps = 10.0", "bandwidth_gbps = 1e-300"), "bandwidth_gbps must be a number"),
    (RING4.replace("bandwidth_gbps = 10.0", "bandwidth_gbps = 0"), "bandwidth_gbps must be a number"),
    (RING4 + 'shared = "false"\n', "'shared' must be true or false, got 'false'"),
    (RING4 + 'duplex = "false"\n', "'duplex' must be true or false, got 'false'"),
    (RING4 + "shared = 0\n", "'shared' must be true or false, got 0"),
    (RING4 + 'kind = ["nvlink"]\n', "kind must be one of"),
    (RING4.replace('ranks = 4', 'ranks = 4\nreduce_gbps = 1e-320'), "reduce_gbps must be a number"),
    (RING4.replace('ranks = 4', 'ranks = 4\nmachine = [1]'), "'machine' must be a string"),
    (RING4.replace('name = "t"', 'name = {a = 1}'), "'name' must be a string"),
    (RING4.replace("ranks = 4", "ranks = 4\nforward = 1"), "'forward' must be true or false, got 1"),
]
BAD_BYTES = b"ranks = 4\n\xff\xfe\n"           # not UTF-8


def run_main(capsys, *args) -> tuple[int, str, str]:
    from msc.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, args, *, named: str, says: str = "") -> str:
    """Run msc with ``args``: exit 2, one line on stderr naming ``named`` once and saying ``says``."""
    code, _, err = run_main(capsys, *args)
    assert code == 2, (args, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("msc: error: "), err
    assert err.count(named) == 1, f"{named!r} should appear once: {err}"
    assert says in err, err
    return err


@pytest.fixture(scope="module")
def ring_plan(tmp_path_factory) -> Path:
    from msc.formats.plan_text import save_plan
    from msc.lower.pipeline import LowerOptions, lower

    from library import algorithms

    path = tmp_path_factory.mktemp("plans") / "ar4.plan"
    save_plan(lower(msc.trace(algorithms()["allreduce/ring:ring"], 4), LowerOptions()), path)
    return path


def commands(plan: Path, topology: Path, out: Path) -> dict[str, list]:
    """Every command that reads a topology, each with ``topology``."""
    return {
        "bound": ["bound", "allreduce", "-t", topology, "-b", "1M", "-e", "1M"],
        "simulate": ["simulate", plan, "-t", topology, "-b", "1M", "-e", "1M"],
        "tune": ["tune", "allreduce/ring", "-n", 4, "-t", topology, "-b", "1M", "-e", "1M", "--protocols",
                 "Simple", "--instances", "1"],
        "synthesize": ["synthesize", "allreduce", "-t", topology, "--pieces", "1", "-o", out / "s.py"],
        "show": ["show", plan, "--png", out / "s.png", "-t", topology],
    }


@pytest.mark.parametrize("text,says", BAD_TOML + [(BAD_BYTES, "not TOML (byte 10 is not UTF-8)")],
                         ids=[f"toml{i}" for i in range(len(BAD_TOML) + 1)])
def test_bad_toml_values_exit_2_naming_file_and_key_in_bound(capsys, tmp_path, text, says):
    path = tmp_path / "bad.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(capsys, ["bound", "allreduce", "-t", path, "-b", "1M", "-e", "1M"], named=str(path), says=says)


@pytest.mark.parametrize("command", ["bound", "simulate", "tune", "synthesize", "show"])
@pytest.mark.parametrize("index", [0, 3, 7, 11, 18, 22, 25], ids=lambda i: f"toml{i}")
def test_every_command_that_reads_a_topology_refuses_alike(capsys, tmp_path, ring_plan, command, index):
    text, says = BAD_TOML[index]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    refused(capsys, commands(ring_plan, path, tmp_path)[command], named=str(path), says=says)
    assert not (tmp_path / "s.py").exists() and not (tmp_path / "s.png").exists()


@pytest.mark.parametrize("key,value", [("shared", "false"), ("duplex", "false")])
def test_booleans_are_read_as_written(tmp_path, key, value):
    """false (the TOML boolean) is false; the string "false" was read as true before."""
    from msc.sim.topology import load_topology

    path = tmp_path / "t.toml"
    path.write_text(RING4 + f"{key} = false\n")
    topo = load_topology(path)
    if key == "shared":
        assert topo.route(0, 1).resources == () and topo.route(0, 1).bandwidth == 10e9
    else:
        with pytest.raises(UsageError, match="no path from rank 1 to rank 0"):
            topo.route(1, 0)
    path.write_text(RING4 + f'{key} = "{value}"\n')
    with pytest.raises(UsageError, match=f"'{key}' must be true or false"):
        load_topology(path)


def test_extreme_but_allowed_numbers_give_finite_times_and_bounds(capsys, tmp_path, ring_plan):
    """The edges of the ranges: the slowest latency and rate, the largest factor, still finite."""
    path = tmp_path / "slow.toml"
    path.write_text(RING4.replace("alpha_us = 1.0", "alpha_us = 1e6").replace("bandwidth_gbps = 10.0",
                                                                             "bandwidth_gbps = 1e-6")
                    + "[protocol.Simple]\nalpha_factor = 1000.0\nlaunch_us = 1e6\nstep_us = 1e6\n")
    code, out, err = run_main(capsys, "simulate", ring_plan, "-t", path, "-b", "1G", "-e", "1G", "--json")
    assert code == 0, err
    [record] = json.loads(out)
    assert 0 < record["time"] < float("inf") and 0 < record["bound_pct"] <= 100 + 1e-9, record


def test_bound_refuses_a_root_outside_the_topology(capsys, tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(RING4)
    refused(capsys, ["bound", "broadcast", "-t", path, "--root", 9], named="root 9",
            says="is not a rank of topology 't' (0..3)")


# -- plans.json through the Python API ---------------------------------------------------------------
DEEP = "[" * 100000 + "]" * 100000
BAD_INDEX = [
    ([{"file": 5}], '"file" must be a plan file\'s name, got 5'),
    ([{"file": None}], '"file" must be a plan file\'s name, got None'),
    ([{"file": ""}], '"file" must be a plan file\'s name'),
    ([{"file": "a.plan", "collective": "allreduce", "ranks": "abc", "inplace": True}],
     '"ranks" must be an int from 1 to 16384, got \'abc\''),
    ([{"file": "a.plan", "ranks": "abc"}], '"ranks" must be an int'),
    ([{"file": "a.plan", "collective": "allreduce", "ranks": -4, "inplace": True}], '"ranks" must be an int'),
    ([{"file": "a.plan", "ranks": 4.0}], '"ranks" must be an int'),
    ([{"file": "a.plan", "ranks": True}], '"ranks" must be an int'),
    ([{"file": "a.plan", "root": "x"}], '"root" must be a rank'),
    ([{"file": "a.plan", "collective": "broadcast", "ranks": 4, "inplace": True, "root": "x"}], '"root" must be'),
    ([{"file": "a.plan", "collective": "broadcast", "ranks": 4, "inplace": True, "root": 4}], "from 0 to 3"),
    ([{"file": "a.plan", "collective": "allreduce", "ranks": 4, "inplace": "false"}],
     '"inplace" must be true or false, got \'false\''),
    ([{"file": "a.plan", "inplace": "false"}], '"inplace" must be true or false'),
    ([{"file": "a.plan", "collective": 5, "ranks": 4, "inplace": True}], '"collective" must be a name'),
    ([{"file": "a.plan", "min_bytes": 10 ** 400}], "min_bytes must be from 0 to 1099511627776"),
    ([{"file": "a.plan", "max_bytes": 2 ** 41}], "max_bytes must be from 0 to"),
    ([{"file": "a.plan", "min_bytes": -1}], "min_bytes must be from 0 to"),
    ({"version": True, "plans": []}, "index version True"),
    ({"version": 1.0, "plans": []}, "index version 1.0"),
    ([{"file": [[[[[[[[[1]]]]]]]]]}], "\"file\" must be a plan file's name, got [[[[[[[...]]]]]]]"),
]


@pytest.fixture
def plan_dir(tmp_path, ring_plan) -> Path:
    shutil.copy(ring_plan, tmp_path / "a.plan")
    return tmp_path


@pytest.mark.parametrize("index,says", BAD_INDEX, ids=[f"index{i}" for i in range(len(BAD_INDEX))])
@pytest.mark.parametrize("read", ["from_dir", "from_index", "from_files"])
def test_bad_plans_json_entries_are_usage_errors_naming_file_and_key(plan_dir, index, says, read):
    path = plan_dir / "plans.json"
    path.write_text(json.dumps(index))
    with pytest.raises(UsageError) as raised:
        {"from_dir": lambda: PlanRegistry.from_dir(plan_dir), "from_index": lambda: PlanRegistry.from_index(path),
         "from_files": lambda: PlanRegistry.from_files([path])}[read]()
    assert str(raised.value).count(str(path)) == 1 and says in str(raised.value), str(raised.value)


NESTED = "arrays or objects nested too deep to read"


@pytest.mark.parametrize("data,says", [(DEEP, NESTED), ('{"plans": [{"file": ' + DEEP + "}]}", NESTED),
                                       (b"\xff\xfe[]", "not JSON (byte 0 is not UTF-8)")])
def test_unreadable_plans_json_is_a_usage_error(plan_dir, data, says):
    path = plan_dir / "plans.json"
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(UsageError) as raised:
        PlanRegistry.from_dir(plan_dir)
    assert str(raised.value) == f"{path}: {says}"


def test_registry_add_refuses_sizes_past_the_limit(ring_plan):
    with pytest.raises(UsageError, match="max_bytes must be from 0 to"):
        PlanRegistry().add(ring_plan, max_bytes=10 ** 400)


def test_good_plans_json_values_still_read(plan_dir):
    (plan_dir / "plans.json").write_text(json.dumps([{"file": "a.plan", "collective": "allreduce", "ranks": 4,
                                                      "inplace": True, "min_bytes": 0, "max_bytes": "1T"}]))
    reg = PlanRegistry.from_dir(plan_dir)
    assert reg.select("allreduce", 4, 1 << 20).num_ranks == 4


# -- msc tune -o DIR keeps plans.json's other entries ---------------------------------------------------
TUNE = ["-t", "nvswitch", "-b", "1M", "-e", "1M", "--protocols", "Simple", "--instances", "1"]


def test_tune_merges_plans_json_instead_of_dropping_other_collectives(capsys, tmp_path):
    out = tmp_path / "plans"
    assert run_main(capsys, "tune", "allgather/ring", "-n", 8, *TUNE, "-o", out)[0] == 0
    assert run_main(capsys, "tune", "allreduce/ring", "-n", 8, *TUNE, "-o", out)[0] == 0
    assert run_main(capsys, "tune", "allreduce/ring", "-n", 8, *TUNE, "-o", out)[0] == 0   # again: replaced
    entries = json.loads((out / "plans.json").read_text())
    assert sorted(e["collective"] for e in entries) == ["allgather", "allreduce"]
    reg = PlanRegistry.from_dir(out)
    assert reg.select("allgather", 8, 1 << 20).collective == "allgather"
    assert reg.select("allreduce", 8, 1 << 20).collective == "allreduce"


def test_tune_keeps_a_handwritten_index_in_its_form(capsys, plan_dir):
    index = {"version": 1, "note": "mine", "plans": [{"file": "a.plan", "max_bytes": "1M", "_why": "small"}]}
    (plan_dir / "plans.json").write_text(json.dumps(index))
    assert run_main(capsys, "tune", "allgather/ring", "-n", 8, *TUNE, "-o", plan_dir)[0] == 0
    merged = json.loads((plan_dir / "plans.json").read_text())
    assert merged["note"] == "mine" and merged["plans"][0] == index["plans"][0] and len(merged["plans"]) == 2


def test_tune_refuses_a_plans_json_it_cannot_merge_and_leaves_it(capsys, tmp_path):
    (tmp_path / "plans.json").write_text('{"plans": [{"file": 5}]}')
    refused(capsys, ["tune", "allreduce/ring", "-n", 8, *TUNE, "-o", tmp_path], named="plans.json",
            says="msc tune merges its plans into the index there")
    assert (tmp_path / "plans.json").read_text() == '{"plans": [{"file": 5}]}'
    assert not list(tmp_path.glob("*.plan"))


def test_tune_refuses_to_overwrite_a_plan_another_entry_uses(capsys, tmp_path):
    """The tuner's file names differ per call (form, root); an index whose entry
    for another call names such a file by hand is refused, not overwritten."""
    assert run_main(capsys, "tune", "allreduce/ring", "-n", 8, *TUNE, "--inplace", "in", "-o", tmp_path)[0] == 0
    index = tmp_path / "plans.json"
    entries = json.loads(index.read_text())
    for e in entries:                  # by hand: the in-place plan's file, listed for the out-of-place call
        e["inplace"] = False
    index.write_text(json.dumps(entries))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    refused(capsys, ["tune", "allreduce/ring", "-n", 8, *TUNE, "--inplace", "in", "-o", tmp_path],
            named="allreduce-ring-Simple-i1-n8.plan,", says="give msc tune another -o folder")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# -- files that cannot be written, files that must not be overwritten ------------------------------------
UNIFORM = ["--alpha-us", "1", "--bandwidth-gbps", "10"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("how", ["show", "timeline", "simulate", "tune"])
def test_a_picture_that_cannot_be_written_is_exit_2(capsys, ring_plan, how):
    pytest.importorskip("matplotlib")        # pictures need it (msc[plot]); without it the error says so
    args = {"show": ["show", ring_plan, "--png", "/dev/full"],
            "timeline": ["show", ring_plan, "--png", "/dev/full", *UNIFORM],
            "simulate": ["simulate", ring_plan, *UNIFORM, "-b", "1M", "-e", "1M", "--plot", "/dev/full"],
            "tune": ["tune", "allreduce/ring", "-n", 8, *TUNE, "--plot", "/dev/full"]}[how]
    code, out, err = run_main(capsys, *args)
    assert code == 2 and err == "msc: error: cannot write /dev/full: No space left on device\n", err
    assert "-> /dev/full" not in out and "# plot: /dev/full" not in out


def test_a_picture_in_a_format_matplotlib_lacks_names_the_file(capsys, tmp_path, ring_plan):
    pytest.importorskip("matplotlib")
    refused(capsys, ["show", ring_plan, "--png", tmp_path / "x.nope"], named="x.nope", says="not supported")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_device_is_named_by_write_output(tmp_path):
    from msc.files import write_output

    with pytest.raises(OSError) as raised:
        write_output("/dev/full", b"x" * 10)
    assert raised.value.filename == "/dev/full" and raised.value.errno == 28


def test_synthesize_refuses_to_overwrite_its_topology(capsys, tmp_path):
    path = tmp_path / "t.py"                  # a TOML topology under a .py name
    path.write_text(RING4)
    refused(capsys, ["synthesize", "allgather", "-t", path, "-o", path], named=f"-o {path} ",
            says="is the file being read")
    refused(capsys, ["synthesize", "allgather", "-t", path, "-o", tmp_path / "x" / ".." / "t.py"],
            named="is the file being read", says="name another file")
    assert path.read_text() == RING4


def test_pictures_refuse_to_overwrite_what_they_read(capsys, tmp_path, ring_plan):
    plan = tmp_path / "p.plan"
    shutil.copy(ring_plan, plan)
    topo = tmp_path / "t.toml"
    topo.write_text(RING4)
    refused(capsys, ["show", plan, "--png", plan], named=f"--png {plan} ", says="is the file being read")
    refused(capsys, ["show", plan, "-t", topo, "--png", topo], named=f"--png {topo} ", says="is the file being read")
    refused(capsys, ["simulate", plan, "-t", topo, "--plot", plan], named=f"--plot {plan} ", says="being read")
    refused(capsys, ["tune", "allreduce/ring", "-n", 4, "-t", topo, "--plot", topo], named=f"--plot {topo} ",
            says="being read")
    assert plan.read_bytes() == ring_plan.read_bytes() and topo.read_text() == RING4


def test_tune_synthesize_refuses_to_overwrite_an_algorithm_file_given(capsys, tmp_path):
    mine = tmp_path / "allgather-synthesized_p1.py"
    mine.write_text(ALLGATHER)
    before = mine.read_text()
    refused(capsys, ["tune", mine, "-n", 4, "-t", "ring:4", "--synthesize", "-o", tmp_path], named=f"{mine},",
            says="is one of the algorithm files given")
    assert mine.read_text() == before


@pytest.mark.parametrize("name,says", [("class", "is a Python keyword"), ("None", "is a Python keyword"),
                                       ("sum_up", "a name the synthesized program uses"),
                                       ("spread_down", "a name the synthesized program uses"),
                                       ("range", "a name the synthesized program uses"),
                                       ("RANKS", "a name the synthesized program uses"),
                                       ("a b", "must be a Python identifier")])
def test_synthesize_refuses_a_name_that_cannot_name_the_algorithm(capsys, tmp_path, name, says):
    out = tmp_path / "s.py"
    refused(capsys, ["synthesize", "allreduce", "-t", "nvswitch", "--name", name, "-o", out],
            named="--name", says=says)
    assert not out.exists()


ALLGATHER = """import msc


@msc.algorithm("allgather")
def direct(p):
    for r in range(p.num_ranks):
        for d in range(p.num_ranks):
            p.chunk(r, "input", 0).copy(d, "output", r)
"""


def test_a_python_warning_is_one_line_without_its_source(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "warns.py"
    path.write_text(ALLGATHER.replace("import msc", "import warnings\nimport msc")
                    .replace("def direct(p):\n", "def direct(p):\n    warnings.warn(\"careful\")  # line 7\n"))
    done = subprocess.run([sys.executable, "-m", "msc.cli", "verify", "warns.py", "-n", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr
    assert done.stderr == "msc: warning: warns.py:7: UserWarning: careful\n"


def test_a_warning_from_msc_itself_carries_no_location():
    import msc.sim.cut_bound as internal
    from msc.cli.main import one_line_warning

    assert one_line_warning(RuntimeWarning("overflow"), RuntimeWarning, internal.__file__, 10) == \
        "msc: warning: RuntimeWarning: overflow\n"


@pytest.mark.parametrize("make,says", [
    (lambda: LinkModel(-1.0, 0.5), "alpha_factor must be"),
    (lambda: LinkModel(0.5, float("inf")), "bandwidth_factor must be"),
    (lambda: Protocol(launch_us=float("nan")), "launch_us must be"),
    (lambda: Protocol(tile=-1), "tile must be an int"),
    (lambda: Uniform(4, 1e308, 10.0), "alpha_us must be"),
    (lambda: Uniform(4, 1.0, float("inf")), "bandwidth_gbps must be")])
def test_cost_model_records_refuse_values_out_of_range_from_python_too(make, says):
    """The Python API builds the same records the TOML reader does: they check themselves."""
    with pytest.raises(UsageError, match=says):
        make()
