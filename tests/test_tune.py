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

from patience import join
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
    from msc.formats.registry import PlanRegistry

    write_plans(tuned, tmp_path)
    registry = PlanRegistry.from_dir(tmp_path)
    for j, size in enumerate(tuned.sizes):
        entry = registry.entry("allreduce", 8, size, inplace=False)
        assert entry.plan.protocol == tuned.candidates[tuned.winners[j]].protocol


def test_threadblock_budget_skips_instances_over_it():
    # the ring runs one threadblock per rank and instance: a budget of 4 keeps x1, x2, x4 of 1..32
    result = tune(["allreduce/ring"], 8, nvswitch(), [1 << 20], protocols=("Simple",), max_threadblocks=4)
    assert sorted(c.instances for c in result.candidates) == [1, 2, 4]
    assert any("x8, x16, x32 would run over 4 threadblocks" in note for note in result.skipped)
    from msc.sim.tune import threadblocks
    assert all(threadblocks(c.plan) <= 4 for c in result.candidates)
    with pytest.raises(UsageError, match="no algorithm could be built"):
        tune(["allreduce/allpairs"], 8, nvswitch(), [1 << 20], protocols=("Simple",), max_threadblocks=2)
    with pytest.raises(UsageError, match="budget"):
        tune(["allreduce/ring"], 8, nvswitch(), [1 << 20], max_threadblocks=0)


def test_default_instances_reach_32_within_the_budget():
    from msc.sim.tune import DEFAULT_INSTANCES, MAX_THREADBLOCKS, threadblocks

    assert DEFAULT_INSTANCES[-1] == 32 and MAX_THREADBLOCKS >= 32
    result = tune(["allgather/ring"], 8, nvswitch(), [1 << 20], protocols=("Simple",))
    assert [c.instances for c in result.candidates] == list(DEFAULT_INSTANCES)
    assert max(threadblocks(c.plan) for c in result.candidates) == 32


def test_protocols_share_one_lowering():
    # on msc's runtime the protocol is only the plan's label: relabelling equals lowering again
    import dataclasses

    import msc
    from msc.lower.pipeline import LowerOptions, lower

    [alg] = [a for a in msc.load_algorithms("allgather/nccl_rings") if a.name == "rail_rings"]
    prog = msc.trace(alg, 16)
    msc.verify(prog)
    simple = lower(prog, LowerOptions(protocol="Simple", instances=2))
    for proto in ("LL", "LL128"):
        assert dataclasses.replace(simple, protocol=proto) == lower(prog, LowerOptions(protocol=proto, instances=2))
    result = tune(["allgather/ring"], 8, nvswitch(), [1 << 20], protocols=("LL", "Simple"), instances=(1, 2))
    assert [(c.protocol, c.instances) for c in result.candidates] == [("LL", 1), ("LL", 2), ("Simple", 1),
                                                                        ("Simple", 2)]


def test_link_floor_is_a_lower_bound_on_contended_plans():
    # eight rings through one NIC pair on ib:2 (the library's ring, x8): the links are shared
    from msc.sim.presets import infiniband
    from msc.sim.simulate import Simulator
    from msc.sim.tune import link_floor

    import msc
    from msc.lower.pipeline import LowerOptions, lower

    [ring] = msc.load_algorithms("allgather/ring")
    sim = Simulator(lower(msc.trace(ring, 16), LowerOptions(instances=8)), infiniband(2))
    sizes = [1 << 20, 64 << 20]
    exact = [r.seconds for r in sim.run(sizes, engine="events")]
    fast = [r.seconds for r in sim.run(sizes, engine="fast")]
    floor = link_floor(sim, sizes)
    assert all(f <= e * (1 + 1e-9) for f, e in zip(floor, exact))
    assert floor[1] > fast[1] * 1.5          # where the NIC is the bottleneck it is much the tighter bound


def test_each_form_and_root_tunes_into_one_folder(tmp_path, capsys):
    """Plan file names carry the call they serve (out of place: -out; root R:
    -rootR), so tuning the other form or root into the same -o folder keeps
    what is there; a root is tuned one at a time."""
    from msc.formats.registry import PlanRegistry

    base = ["--ranks", 4, "--alpha-us", 1, "--bandwidth-gbps", 50, "-b", "4K", "-e", "64K", "-f", 16,
            "--instances", "1", "--protocols", "Simple", "-o", tmp_path]
    for extra in (["allgather/ring"], ["allgather/ring", "--inplace", "out"], ["broadcast/chain"],
                  ["broadcast/chain", "--param", "root=2"]):
        rc, _, err = run_cli(["tune", *extra, *base], capsys)
        assert rc == 0, err
    keys = {e.key for e in PlanRegistry.from_dir(tmp_path)}
    assert keys == {("allgather", 4, True, 0), ("allgather", 4, False, 0), ("broadcast", 4, True, 0),
                    ("broadcast", 4, True, 2)}
    names = sorted(p.name for p in tmp_path.glob("*.plan"))
    assert any(n.endswith("-n4-out.plan") for n in names) and any(n.endswith("-n4-root2.plan") for n in names)
    rc, _, err = run_cli(["tune", "broadcast/chain", "--param", "root=1,2", *base], capsys)
    assert rc == 2 and "--param root takes one value, got 2" in err


def test_workers_change_nothing():
    """Simulating on two worker processes (msc.sim.parallel) gives the same
    times, exactness, winners and ranges as in-process, bit for bit, on a
    topology whose shared inter-island link makes the tuner run the event
    engine and bisect crossovers; no worker outlives the tune."""
    import multiprocessing
    from pathlib import Path

    from msc.sim.presets import get_topology

    topo = get_topology(str(Path(__file__).parents[1] / "bench/topologies/islands.toml"), 8)
    sizes = [1 << e for e in range(12, 25, 3)]
    files = ["allreduce/ring", "allreduce/halving_doubling", "allreduce/hierarchical"]
    seen = []
    for workers in (1, 2):
        r = tune(files, 8, topo, sizes, protocols=("Simple", "LL"), instances=(1, 4), workers=workers)
        seen.append(([(c.label, c.times, c.known) for c in r.candidates], r.winners, r.ranges))
        assert multiprocessing.active_children() == []
    assert seen[0] == seen[1]
    cands, winners, ranges = seen[0]
    assert any(not all(known) for _, _, known in cands)          # contended sizes left as bounds
    assert len(ranges) >= 2


def _fails_on_odd(item, size):
    if item % 2:
        raise UsageError(f"item {item} at {size}")
    return item * size


def test_pool_raises_a_workers_error_here_and_stops():
    """A job that raises in a worker raises its own error in the caller (run
    again there), and the pool's workers are gone after it."""
    import multiprocessing

    from msc.sim.parallel import Pool

    with pytest.raises(UsageError, match="item 3 at 5"):
        with Pool([0, 2, 4, 3, 6], 2) as pool:
            assert list(pool.map(_fails_on_odd, pool.items[:3], 5)) == [0, 10, 20]
            list(pool.map(_fails_on_odd, pool.items, 5))
    assert multiprocessing.active_children() == []


def test_drive_waits_without_spinning(monkeypatch):
    """A walk with one job done and one still running waits for the other
    (msc.sim.parallel.drive once returned from wait() at once, again and
    again, on the job already done: a busy loop beside the workers)."""
    import threading
    from concurrent.futures import Future

    from msc.sim import parallel

    class Late:
        """A pool whose job "late" finishes 0.2 s after it is submitted, from another thread."""

        def submit(self, fn, item, *args):
            future = Future()
            if item == "late":
                threading.Timer(0.2, future.set_result, ("late done",)).start()
            else:
                future.set_result(fn(item))
            return future

        result = staticmethod(Future.result)

    def walk():
        results = yield [(str.upper, "soon"), (str.upper, "late")]
        return results

    calls = []
    real_wait = parallel.wait
    monkeypatch.setattr(parallel, "wait", lambda fs, **kw: calls.append(len(fs)) or real_wait(fs, **kw))
    assert list(parallel.drive(Late(), [walk()])) == [(0, ["SOON", "late done"])]
    assert calls == [1]              # once, on the job still running


def test_workers_must_be_positive():
    with pytest.raises(UsageError, match="workers"):
        tune(["allreduce/ring"], 8, Uniform(8, 2.0, 100.0), [1 << 20], workers=0)


def _write_after_a_pause(result, outdir, barrier, pause):
    """A writer process: start with the others, and dwell between reading
    plans.json and writing it (in each plan file's write) so they overlap."""
    import time

    import msc.formats.plan_text as plan_text

    save = plan_text.save_plan

    def slow_save(plan, path):
        time.sleep(pause)
        return save(plan, path)

    plan_text.save_plan = slow_save
    barrier.wait()
    write_plans(result, outdir)


def test_tunes_writing_one_folder_at_once_keep_every_collective(tmp_path):
    """Three tunes of different collectives into one -o folder, at once: each
    read plans.json, wrote its plan files and rewrote plans.json, and the
    last one kept only what it had read (a collective's .plan files were then
    left unlisted, and the backend passed its calls through). The folder is
    locked across the read-merge-write."""
    import multiprocessing

    from msc.formats.registry import PlanRegistry

    results = [tune([name], 4, Uniform(4, 1.0, 50.0), [4096], protocols=("Simple",), instances=(1,))
               for name in ("allgather/ring", "reducescatter/ring", "allreduce/ring")]
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(results))
    writers = [ctx.Process(target=_write_after_a_pause, args=(r, tmp_path, barrier, 0.3)) for r in results]
    for w in writers:
        w.start()
    for w in writers:
        join(w, 60)
    assert [w.exitcode for w in writers] == [0, 0, 0]
    listed = {e["file"] for e in json.loads((tmp_path / "plans.json").read_text())}
    assert listed == {p.name for p in tmp_path.glob("*.plan")} and len(listed) == 3
    assert {e.key[0] for e in PlanRegistry.from_dir(tmp_path)} == {"allgather", "reducescatter", "allreduce"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(listed | {"plans.json"})     # no lock file left


def test_crossover_decisions_equal_both_exact_times(monkeypatch):
    """_a_wins (bisection's comparison) decides as comparing both exact times
    would, on contended candidates across sizes, with fewer event runs."""
    import msc.sim.tune as T
    from msc.sim.parallel import Pool, drive
    from msc.sim.presets import get_topology

    topo = get_topology("dgx-h100:2", 16)
    r = tune(["allreduce/ring", "allreduce/hierarchical"], 16, topo, [1 << 20], protocols=("Simple", "LL"),
             instances=(1, 2, 4), refine=False)
    cands = r.candidates
    events = []
    real = T.contended_time
    monkeypatch.setattr(T, "contended_time", lambda c, size: events.append(1) or real(c, size))
    sizes = [1 << e for e in range(10, 28, 3)]
    exact = {(i, s): T.time_at(c, s) for i, c in enumerate(cands) for s in sizes}
    full = len(events)
    events.clear()
    pairs = [(i, j, s) for i in range(len(cands)) for j in range(len(cands)) if i != j for s in sizes][::7]
    walks = [T._a_wins(cands[i], cands[j], s) for i, j, s in pairs]
    decided = dict(drive(Pool(cands, 1), walks))
    assert [decided[k] for k in range(len(pairs))] == [exact[(i, s)] <= exact[(j, s)] for i, j, s in pairs]
    assert full > 0 and len(events) < 2 * len(pairs) * full / len(exact)
