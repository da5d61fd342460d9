"""``msc tune`` and the pictures: choices, size ranges, the plans.json
index, the printed table, and PNG files."""
from __future__ import annotations

import json

import pytest

from msc.errors import UsageError
from msc.formats.load import load_plan
from msc.sim.presets import nvswitch
from msc.sim.topology import Uniform
from msc.sim.tune import format_tune, index_entries, tune, variants, write_plans

from test_simulate import plan_of, run_cli


@pytest.fixture(scope="module")
def tuned():
    # uniform model: LL (a quarter of the latency, half the bandwidth) should win small sizes,
    # Simple large ones; halving-doubling beats the ring (fewer latencies, same bytes)
    sizes = [1 << e for e in range(10, 24, 2)]
    return tune(["allreduce/ring", "allreduce/halving_doubling"], 8, Uniform(8, 2.0, 100.0), sizes,
                protocols=("Simple", "LL"), instances=(1, 2))


def test_winners_are_fastest(tuned):
    for j in range(len(tuned.sizes)):
        win = tuned.candidates[tuned.winners[j]]
        exact = [c.times[j] for c in tuned.candidates if c.known[j]]
        assert win.known[j] and win.times[j] == min(exact)
        assert all(c.times[j] >= win.times[j] for c in tuned.candidates)   # bounds included


def test_ranges_cover_every_size(tuned):
    ranges = tuned.ranges
    assert ranges[0][0] == 0 and ranges[-1][1] is None
    for (lo, hi, _), (lo2, _, _) in zip(ranges, ranges[1:]):
        assert hi == lo2 and lo < hi
    for j, size in enumerate(tuned.sizes):
        [i] = [i for lo, hi, i in ranges if lo <= size and (hi is None or size < hi)]
        assert i == tuned.winners[j]
    # LL (a quarter of the latency) wins small sizes, Simple (twice LL's bandwidth) large ones
    labels = [tuned.candidates[i].label for _, _, i in ranges]
    assert "LL" in labels[0] and "Simple" in labels[-1]


def test_plans_index(tuned, tmp_path):
    entries = write_plans(tuned, tmp_path)
    index = json.loads((tmp_path / "plans.json").read_text())
    assert index == entries == index_entries(tuned)
    for entry in index:
        assert set(entry) >= {"file", "collective", "ranks", "min_bytes", "max_bytes", "algorithm", "protocol",
                              "instances"}
        plan = load_plan(tmp_path / entry["file"])
        assert (plan.collective, plan.num_ranks, plan.protocol, plan.instances) == \
            ("allreduce", 8, entry["protocol"], entry["instances"])


def test_table(tuned):
    text = format_tune(tuned, "out")
    assert "vs ring" in text and "out/plans.json" in text
    rows = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(rows) == len(tuned.sizes)
    assert all(line.rstrip().endswith("x") for line in rows)


def test_variants():
    import msc

    [tree, _] = msc.load_algorithms("allreduce/tree")
    assert [v["chunks"] for v in variants(tree, nvswitch(), {})] == [4, 2, 8, 16]
    assert [v["chunks"] for v in variants(tree, nvswitch(), {"chunks": [3]})] == [3]
    [hier] = msc.load_algorithms("allreduce/hierarchical")
    assert [v["gpus_per_node"] for v in variants(hier, nvswitch(), {})] == [4, 8]


def test_tune_errors():
    with pytest.raises(UsageError, match="one collective"):
        tune(["allreduce/ring", "allgather/ring"], 4, Uniform(4, 1, 10), [1024])
    with pytest.raises(UsageError, match="protocol"):
        tune(["allreduce/ring"], 4, Uniform(4, 1, 10), [1024], protocols=("XL",))


def test_tune_command(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, out, err = run_cli(["tune", "allreduce/ring", "allreduce/tree", "--ranks", 4, "--alpha-us", 1,
                            "--bandwidth-gbps", 50, "-b", "4K", "-e", "1M", "-f", 16, "--instances", "1",
                            "--param", "chunks=1,4", "-o", tmp_path / "out", "--plot", tmp_path / "tune.png"], capsys)
    assert rc == 0, err
    assert (tmp_path / "out" / "plans.json").is_file() and (tmp_path / "tune.png").stat().st_size > 10000
    assert "binomial[chunks=1]" in out or "ring" in out
    rc, out, err = run_cli(["tune", "allreduce/ring", "--ranks", 4, "--alpha-us", 1, "--bandwidth-gbps", 50,
                            "-b", "4K", "-e", "4K", "--json"], capsys)
    result = json.loads(out)
    assert rc == 0 and result["chosen"][0]["algorithm"] == "ring"


def test_pictures(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from msc.formats.plan_text import save_plan

    small = save_plan(plan_of("allreduce/halving_doubling", 8), tmp_path / "hd.plan")
    big = save_plan(plan_of("allreduce/ring", 24), tmp_path / "ring24.plan")
    for argv in (["show", small, "--png", tmp_path / "a.png"],
                 ["show", big, "--png", tmp_path / "b.png"],
                 ["show", small, "--png", tmp_path / "c.png", "-t", "nvswitch", "--size", "4M"],
                 ["show", big, "--png", tmp_path / "d.png", "--alpha-us", "1", "--bandwidth-gbps", "10"],
                 ["simulate", small, big, "--alpha-us", 1, "--bandwidth-gbps", 10, "-e", "1M",
                  "--plot", tmp_path / "e.png"]):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 0, err
    for name in "abcde":
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    rc, out, err = run_cli(["show", small, "--png", tmp_path / "f.png", "--size", "1M"], capsys)
    assert rc == 2 and "--topology" in err


def test_index_loads_in_the_registry(tuned, tmp_path):
    from msc.torch.registry import PlanRegistry

    write_plans(tuned, tmp_path)
    registry = PlanRegistry.from_dir(tmp_path)
    for j, size in enumerate(tuned.sizes):
        entry = registry.entry("allreduce", 8, size, inplace=False)
        assert entry.plan.protocol == tuned.candidates[tuned.winners[j]].protocol
