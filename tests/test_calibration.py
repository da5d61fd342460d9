"""The cost model against published NCCL measurements (issue 25): every row of
tests/data/nccl_published.toml, predicted by ``msc simulate --nccl``, within
15% at 256 MB and above and 25% below (msc.sim.calibration).

Rows the model is not held to yet are strict xfails with their ratio and
reason: NVLS rows and machines msc has no preset of (not simulated), and the
gaps listed in msc.sim.calibration.GAPS (simulated, outside the bar). A gap
that comes within the bar fails the test, so the list cannot go stale.

Simulating every row takes minutes (NCCL's 24 channels share each port, so
the event engine runs): every row runs with ``-m slow`` (CI runs it), a row
of each calibrated machine in the default suite. ``python
bench/calibration.py`` prints and draws all of them.
"""
from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from msc.sim.calibration import GAPS, LARGE, compare, known_gap, load_rows

DATA = Path(__file__).parent / "data" / "nccl_published.toml"
ROWS = load_rows(DATA)
CACHE: dict = {}


def _id(row) -> str:
    return f"{row.index}-{row.label.replace(' ', '-')}"


def _held(row) -> None:
    c = compare(row, CACHE)
    gap = known_gap(row)
    if c.blocked is not None:
        pytest.xfail(f"not modelled: {c.blocked}")
    assert c.ratio is not None and math.isfinite(c.ratio)
    where = f"predicted/measured {c.ratio:.2f} (NCCL's own model {c.nccl_ratio:.2f}), bar +-{c.tolerance:.0%}"
    if gap is not None:
        assert not c.ok, f"{where}: within the bar, but listed as a gap ({gap}): take it off GAPS"
        pytest.xfail(f"{where}: {gap}")
    assert c.ok, f"{where}: outside the bar"


def _first(system, collective, size, algorithm=None):
    return next(r for r in ROWS if (r.system, r.collective, r.compared_size, r.algorithm) ==
                (system, collective, size, algorithm))


SAMPLE = [_first("dgx-h100", "allreduce", 4 << 30, "ring"), _first("dgx-a100", "allreduce", 1 << 10),
          _first("dgx-a100", "allreduce", 256 << 20), _first("dgx-a100:2", "allgather", 1 << 30)]


@pytest.mark.parametrize("row", SAMPLE, ids=_id)
def test_a_row_of_each_calibrated_machine(row):
    _held(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r.use == "calibrate"], ids=_id)
def test_calibrated_rows(row):
    _held(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r.use == "check"], ids=_id)
def test_check_rows(row):
    _held(row)


def test_the_data_cites_every_row():
    raw = tomllib.loads(DATA.read_text())["row"]
    assert len(raw) == len(ROWS) > 250
    for r in raw:
        assert r["source"].strip() and r["use"] in ("calibrate", "check") and r["collective"], r
        numbers = [r.get(k) for k in ("busbw_gbps", "algbw_gbps", "time_us")]
        assert any(v is not None for v in numbers) or "no numeric field" in r.get("note", "") \
            or "no per-system number" in r.get("note", ""), r
    assert {r.use for r in ROWS} == {"calibrate", "check"}


def test_every_gap_covers_a_row_and_says_why():
    for gap in GAPS:
        assert gap.reason.strip() and any(gap.covers(r) for r in ROWS), gap


def test_the_bar_and_what_is_not_simulated():
    small = next(r for r in ROWS if r.system == "nebius-h100:2" and r.size is not None and r.size < LARGE)
    c = compare(small, CACHE)
    assert c.tolerance == 0.25 and c.predicted is None and "no preset of 'nebius-h100:2'" in c.blocked and not c.ok
    other = compare(next(r for r in ROWS if r.system.startswith("gcp-") and (r.size or 0) >= LARGE), CACHE)
    assert other.tolerance == 0.15 and other.predicted is None and not other.ok


NVLS_ROWS = [r for r in ROWS if r.algorithm == "nvls" and r.system.startswith(("dgx-h100", "hgx-h100:"))
             and r.compared_size >= 1 << 30]
# the default run: Azure's rows on 8 H100 (the 5% claim) and the smallest row of each other GPU count;
# -m slow: all of them (a simulation's cost grows with the size: 7 CPU-s for the 25 rows)
NVLS_SAMPLE = [r for r in NVLS_ROWS if r.system == "dgx-h100" and "Azure" in r.source] + [
    min((r for r in NVLS_ROWS if r.system == system), key=lambda r: r.compared_size)
    for system in sorted({r.system for r in NVLS_ROWS} - {"dgx-h100"})]


@pytest.mark.parametrize("rows", [pytest.param(NVLS_SAMPLE, id="sample"),
                                  pytest.param(NVLS_ROWS, id="all", marks=pytest.mark.slow)])
def test_nvls_is_simulated_on_the_switch_and_held_from_1_gib(rows):
    """NCCL's NVLS rows run the library's nvls plan on the switch model:
    from 1 GiB within 5% of Azure's measured busbw on 8 H100, and the
    rows of 2 to 7 GPUs (not fitted) within the bar."""
    assert len(NVLS_ROWS) >= 20 and {r.system for r in rows} >= {"dgx-h100", "hgx-h100:2gpu", "hgx-h100:6gpu"}
    assert sum("Azure" in r.source for r in rows) >= 4
    for row in rows:
        c = compare(row, CACHE)
        assert c.predicted is not None and c.predicted["plan"] == "nccl nvls" and c.ok, row.label
        if row.system == "dgx-h100" and "Azure" in row.source:
            assert abs(c.ratio - 1) <= 0.05, (row.label, c.ratio)


@pytest.mark.slow
def test_nccl_s_choice_with_nvls_on_several_h100_nodes_is_nvlstree():
    """nccl issue 1221's 8 GiB allreduce with NVLS enabled: on 4 nodes NVLSTree simulated within the bar
    (NCCL 2.30's model picks it; its NVLSTree busBw is 364 GB/s from 3 nodes)."""
    row = next(r for r in ROWS if r.system == "dgx-h100:4" and r.note.startswith("NCCL_NVLS_ENABLE=1"))
    c = compare(row, CACHE)
    assert c.predicted["algorithm"] == "nvlstree" and c.ok, c.ratio
