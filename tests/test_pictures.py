"""The pictures (msc.cli.pictures): a schedule's phases, lanes, arrows and
labels; the busbw plots' log axes; the timeline's lanes. Each picture is
drawn once into tmp_path and its (closed) matplotlib figure inspected."""
from __future__ import annotations

from pathlib import Path

import pytest

from test_simulate import plan_of, run_cli

pytest.importorskip("matplotlib")

from matplotlib.patches import FancyArrowPatch  # noqa: E402

from msc.cli.pictures import draw_schedule, draw_timeline, plot_busbw  # noqa: E402
from msc.sim.sim_plan import compile_plan  # noqa: E402


def arrow_patches(ax) -> list[FancyArrowPatch]:
    """The message arrows (annotations without text)."""
    return [t.arrow_patch for t in ax.texts if isinstance(getattr(t, "arrow_patch", None), FancyArrowPatch)]


def arrows(ax) -> int:
    return len(arrow_patches(ax))


def texts(fig) -> list[str]:
    out = [t.get_text() for t in fig.texts]
    for legend in fig.legends:
        out += [t.get_text() for t in legend.get_texts()] + [legend.get_title().get_text()]
    for ax in fig.axes:
        out += [ax.get_title(loc="left")] + [t.get_text() for t in ax.texts]
    return out


def lines_of(plan) -> set[str]:
    """file:line of every step that sends (the phases), as the pictures name them."""
    return {f"{Path(s.where.file).name}:{s.where.line}" for _, _, _, s in plan.steps() if s.op.sends}


def test_hierarchical_allreduce_colours_its_phases(tmp_path):
    plan = plan_of("allreduce/hierarchical", 8)
    fig = draw_schedule(plan, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    [ax] = fig.axes                                   # phases one after another: one panel
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(8)]
    assert arrows(ax) == len(compile_plan(plan).msg_send)
    phases = lines_of(plan)
    assert len(phases) == 4                           # reduce-scatter, ring reduce, ring copy, allgather
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == len(phases)
    assert {entry.split()[0] for entry in legend} == phases
    assert any("shard.reduce" in entry for entry in legend)          # the code of the line, read back
    assert len({tuple(line.get_color()) for line in fig.legends[0].get_lines()}) == 4
    chunk_labels = [t.get_text() for t in ax.texts if t.get_text()]
    assert len(chunk_labels) > 32 and "0:2" in chunk_labels          # most arrows say what they carry
    assert any("source line" in t for t in texts(fig))


def test_pipelined_phases_get_a_panel_each(tmp_path):
    plan = plan_of("allreduce/tree", 4, alg="double_binary")
    fig = draw_schedule(plan, tmp_path / "db.png")
    assert len(fig.axes) == 2                         # reduce up, broadcast down: they overlap in rounds
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert [t.split()[2] for t in titles] == sorted(lines_of(plan), key=lambda s: int(s.split(":")[1]))
    assert all(len(ax.get_yticklabels()) == 4 for ax in fig.axes)
    assert sum(arrows(ax) for ax in fig.axes) == len(compile_plan(plan).msg_send)
    assert any("a panel per source line" in t for t in texts(fig))


def test_one_line_plans_colour_by_chunk_and_fan_out(tmp_path):
    plan = plan_of("allgather/allpairs", 4)
    fig = draw_schedule(plan, tmp_path / "ag.png")
    [ax] = fig.axes
    assert not any("source line (phase)" in t for t in texts(fig))
    assert any("colour: chunk" in t for t in texts(fig))
    tails = [a.xyann for a in ax.texts if a.get_text() == "" and hasattr(a, "xyann")]
    assert len(tails) == 12 and len(set(tails)) == 12         # every send its own point: fanned out in the lane
    assert {t.get_text() for t in ax.texts if t.get_text()} == {"0", "1", "2", "3"}


def test_a_local_copy_line_does_not_make_phases(tmp_path):
    plan = plan_of("allgather/ring", 4)              # out of place: a local copy line, then one sending line
    fig = draw_schedule(plan, tmp_path / "ring.png")
    [ax] = fig.axes
    assert any("colour: chunk" in t for t in texts(fig))
    colours = {tuple(a.get_edgecolor()) for a in arrow_patches(ax)}
    assert len(colours) == 4                        # a colour per chunk


def test_late_messages_wait_dotted_in_the_receivers_lane(tmp_path):
    plan = plan_of("reducescatter/allpairs", 4)   # every send in round 0, reductions one after another
    fig = draw_schedule(plan, tmp_path / "rs.png")
    [ax] = fig.axes
    dotted = [line for line in ax.get_lines() if line.get_linestyle() not in ("-", "None")]
    assert dotted
    for line in dotted:
        ys = line.get_ydata()
        assert round(ys[0]) == round(ys[1])       # within one lane


def test_many_ranks_are_summarized(tmp_path):
    fig = draw_schedule(plan_of("allreduce/ring", 20), tmp_path / "r20.png")
    assert "summary" in fig._suptitle.get_text() and len(fig.axes) == 4     # two panels and their colour bars


def test_timeline_has_a_lane_per_threadblock(tmp_path):
    from msc.sim.simulate import Simulator
    from msc.sim.topology import Uniform

    plan = plan_of("allreduce/halving_doubling", 4)
    sim = Simulator(plan, Uniform(4, 2.0, 50.0))
    fig = draw_timeline(sim, 1 << 20, tmp_path / "t.png")
    ax = fig.axes[0]
    assert len(ax.get_yticklabels()) == sim.sp.num_tbs
    assert ax.get_xlabel() == "time (us)"


def test_busbw_axes_are_logarithmic_with_plain_labels(tmp_path):
    records = [{"size": 1 << e, "busbw": 0.001 * 2 ** e} for e in range(3, 27)]
    fig = plot_busbw([("a", records), ("b", [{**r, "busbw": r["busbw"] / 3} for r in records])],
                     tmp_path / "bw.png", title="t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
    fmt = ax.yaxis.get_major_formatter()
    assert fmt(0.01, 0) == "0.01" and fmt(100.0, 0) == "100"          # no 10^x mathtext
    lo, hi = ax.get_ylim()
    assert lo < 0.008 / 3 and hi > 0.001 * 2 ** 26
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]


def test_simulate_and_tune_plot_log_busbw(tmp_path, capsys, monkeypatch):
    import msc.cli.pictures

    figures = []
    original = msc.cli.pictures.plot_busbw

    def keep(*args, **kw):
        figures.append(original(*args, **kw))
        return figures[-1]

    monkeypatch.setattr(msc.cli.pictures, "plot_busbw", keep)
    from msc.formats.plan_text import save_plan

    plan = save_plan(plan_of("allreduce/ring", 4), tmp_path / "ring.plan")
    rc, out, err = run_cli(["simulate", plan, "--alpha-us", 1, "--bandwidth-gbps", 10, "-e", "1M",
                            "--plot", tmp_path / "sim.png"], capsys)
    assert rc == 0, err
    rc, out, err = run_cli(["tune", "allreduce/ring", "allreduce/halving_doubling", "--ranks", 4, "--alpha-us", 1,
                            "--bandwidth-gbps", 50, "-b", "4K", "-e", "1M", "-f", 16, "--instances", "1",
                            "--protocols", "Simple", "--plot", tmp_path / "tune.png"], capsys)
    assert rc == 0, err
    assert len(figures) == 2 and all(fig.axes[0].get_yscale() == "log" for fig in figures)
    assert (tmp_path / "sim.png").stat().st_size > 10000 and (tmp_path / "tune.png").stat().st_size > 10000
