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
    plan = plan_of("allreduce/tree", 4, alg="binomial")
    fig = draw_schedule(plan, tmp_path / "bt.png")
    assert len(fig.axes) == 2                         # reduce up, broadcast down: they overlap in steps
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


LATE = """
    import msc

    # rank 1 ends with rank 3's input plus rank 0's; nothing else is required
    late = msc.CustomCollective("late", input_chunks=1, output_chunks=1,
                                postcondition=lambda r, i, n, k: [(0, 0), (3, 0)] if r == 1 else None)

    @msc.algorithm(late, inplace=False)
    def relay(p):
        p.chunk(3, "input", 0).copy(2, "output", 0)          # step 1
        p.chunk(2, "output", 0).copy(1, "output", 0)         # step 2
        p.chunk(1, "output", 0).reduce(p.chunk(0, "input", 0))   # sent in step 1, reduced after step 2
"""


def test_late_messages_wait_dotted_in_the_receivers_lane(tmp_path):
    import msc
    from algfile import write
    from msc.lower.pipeline import LowerOptions, lower

    path, _ = write(tmp_path, LATE)
    [alg] = msc.load_algorithms(path)
    plan = lower(msc.trace(alg, 4), LowerOptions())
    fig = draw_schedule(plan, tmp_path / "late.png")
    [ax] = fig.axes
    dotted = [line for line in ax.get_lines() if line.get_linestyle() not in ("-", "None")]
    assert len(dotted) == 1
    ys, xs = dotted[0].get_ydata(), dotted[0].get_xdata()
    assert round(ys[0]) == round(ys[1]) == 1 and xs[1] > xs[0]      # in rank 1's lane, from step 1's end to 2's


def test_columns_are_the_algorithms_steps_and_chunks_its_units(tmp_path):
    """Issue 42: a 3-step recursive doubling allgather spans 3 steps (it
    showed 8 logical rounds), a ring allgather of 8 ranks 7, a pipelined
    chain broadcast n - 2 + chunks; 2 instances keep the algorithm's chunk
    numbers (0-7, not 0-15) and draw each message once."""
    from msc.cli.pictures import program_steps

    for name, n, alg, params, steps in (("allgather/recursive_doubling", 8, None, {}, 3),
                                        ("allgather/ring", 8, None, {}, 7),
                                        ("broadcast/chain", 5, None, {"chunks": 4}, 7),
                                        ("allreduce/ring", 4, None, {}, 6),
                                        ("allreduce/halving_doubling", 8, None, {}, 6),
                                        ("alltoall/allpairs", 8, None, {}, 1)):
        sp = compile_plan(plan_of(name, n, alg, **params))
        col = program_steps(sp)
        assert int(col[sp.msg_send].max()) + 1 == steps, name
        assert (col[sp.msg_recv] == col[sp.msg_send] + 1).all(), name        # each message spans its step
    from msc.lower.pipeline import LowerOptions, lower
    import msc

    [ring] = msc.load_algorithms("allgather/ring")
    plan = lower(msc.trace(ring, 8, inplace=False), LowerOptions(instances=2))
    fig = draw_schedule(plan, tmp_path / "ring2.png")
    [ax] = fig.axes
    assert arrows(ax) == len(compile_plan(plan).msg_send) // 2 == 56
    labels = {t.get_text() for t in ax.texts if t.get_text()}
    assert labels == {str(i) for i in range(8)}
    assert "ring: allgather, 8 ranks, 7 steps, 112 messages, 2 instances drawn as one" in texts(fig)
    assert [t.get_text() for t in ax.get_xticklabels(minor=True)] == [str(k) for k in range(1, 8)]


def test_many_ranks_are_summarized(tmp_path):
    fig = draw_schedule(plan_of("allreduce/ring", 20), tmp_path / "r20.png")
    assert "summary" in fig._suptitle.get_text() and len(fig.axes) == 4     # two panels and their colour bars


def test_a_crowded_step_is_summarized_in_the_algorithms_steps(tmp_path):
    """A 16-rank alltoall (240 messages in its one step) was a 1945x7128
    picture of crossing arrows: now the summary, of 1 step; an 8-rank one
    (56 messages) is still drawn message by message."""
    fig = draw_schedule(plan_of("alltoall/allpairs", 16), tmp_path / "a16.png")
    title = fig._suptitle.get_text()
    assert title.startswith("allpairs: alltoall, 16 ranks, 1 step, 240 messages (summary: 240 messages in one step")
    assert fig.axes[1].get_xlabel().startswith("step of the algorithm")
    fig = draw_schedule(plan_of("alltoall/allpairs", 8), tmp_path / "a8.png")
    assert arrows(fig.axes[0]) == 56
    assert "every pair coloured: 1 chunk" in draw_schedule(plan_of("alltoall/allpairs", 16),
                                                           tmp_path / "b.png").axes[0].get_title()


def test_messages_into_scratch_carry_the_chunk_they_were_sent_from(tmp_path):
    """An in-place alltoall receives into scratch slots, whose numbers mean
    nothing to the algorithm (they labelled rank 0's messages all 0): each
    message now carries the input chunk it left, which for alltoall is its
    receiver, so every label and colour of an arrow into rank d is d's."""
    fig = draw_schedule(plan_of("alltoall/allpairs", 4, inplace=True), tmp_path / "a4.png")
    [ax] = fig.axes
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) == arrows(ax) == 12
    heads = {tuple(p.get_facecolor()) for p in arrow_patches(ax)}
    assert len(heads) == 4                                 # one colour per receiver, not per scratch slot
    assert sorted(t.get_text() for t in labels) == sorted(str(d) for d in range(4) for _ in range(3))


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
