"""msc.sim.nccl: NCCL's tuning decision, held to NCCL's own printed tuning
tables, and ``msc simulate --nccl``: its plans verify and its records."""
from __future__ import annotations

import json
import math

import pytest

from msc.cli.main import main
from msc.errors import UsageError
from msc.sim import nccl
from msc.sim.calibration import topology_for
from msc.sim.nccl_sim import plan_for, simulate_nccl
from msc.sim.presets import get_topology

# NCCL 2.29.2's TUNING log on 4 and 6 of an 8x H100 NVSwitch node (latency us / algorithm bandwidth
# GB/s), from waynehacking8/nccl-collectives-bench results/scaling_attributed/g{4,6}_*.log @ec97f06
# (bench/calibration/nccl_model.md section 4.3a).
PRINTED = {
    (4, "allgather"): {("ring", "LL"): (8.4, 188.0), ("ring", "LL128"): (19.7, 441.6), ("ring", "Simple"): (18.6, 480.0)},
    (4, "allreduce"): {("ring", "LL"): (10.2, 94.0), ("ring", "LL128"): (25.4, 220.8), ("ring", "Simple"): (28.8, 240.0),
                       ("tree", "LL"): (10.4, 43.6), ("tree", "LL128"): (21.5, 128.8), ("tree", "Simple"): (32.4, 165.6)},
    (6, "allgather"): {("ring", "LL"): (9.6, 169.2), ("ring", "LL128"): (23.5, 397.4), ("ring", "Simple"): (25.4, 432.0)},
    (6, "allreduce"): {("ring", "LL"): (12.6, 84.6), ("ring", "LL128"): (33.0, 198.7), ("ring", "Simple"): (42.4, 216.0),
                       ("tree", "LL"): (12.8, 43.6), ("tree", "LL128"): (26.5, 128.8), ("tree", "Simple"): (48.4, 165.6)},
}


@pytest.mark.parametrize("gpus,collective", sorted(PRINTED))
def test_the_model_reproduces_nccl_s_printed_tuning_table(gpus, collective):
    s = nccl.system(topology_for(f"hgx-h100:{gpus}gpu"))
    for (algo, proto), (lat, bw) in PRINTED[gpus, collective].items():
        assert nccl.latency(s, collective, algo, proto) == pytest.approx(lat, abs=0.05), (algo, proto)
        assert nccl.algorithm_bandwidth(s, collective, algo, proto) == pytest.approx(bw, abs=0.05), (algo, proto)


def test_protocol_switches_on_eight_h100_without_nvls():
    """nccl_model.md section 6 (derived): LL -> LL128 near 3.6 MB, LL128 -> Simple near 36 MB."""
    s = nccl.system(get_topology("dgx-h100", None))
    off = ["ring", "tree"]                                 # NCCL_NVLS_ENABLE=0
    pick = {size: nccl.choose(s, "allreduce", size, algorithms=off).protocol
            for size in (1 << 20, 3 << 20, 4 << 20, 32 << 20, 40 << 20)}
    assert pick == {1 << 20: "LL", 3 << 20: "LL", 4 << 20: "LL128", 32 << 20: "LL128", 40 << 20: "Simple"}
    forced = nccl.choose(s, "allreduce", 1 << 30, protocols=["LL"])
    assert forced.protocol == "LL" and forced.nccl_us == pytest.approx(15.0 + (1 << 30) / (1000 * 141 * 8 / 14))


def test_channels_drop_for_small_messages():
    """enqueue.cc: a channel is dropped while the message is below channels x threads x threshold
    (ring LL: 4096 bytes x ranks per channel; Simple: 32 KiB)."""
    s = nccl.system(get_topology("dgx-h100", None))
    assert nccl.choose(s, "allgather", 1024).channels == 1
    assert nccl.choose(s, "allgather", 64 << 10).channels == 2                     # 64K / (4096 x 8)
    assert nccl.choose(s, "allgather", 64 << 20).channels == 24
    assert nccl.choose(s, "allreduce", 1 << 20, algorithms=["ring", "tree"],
                       protocols=["Simple"]).channels == 24                          # 1M >= 24 x 32K


def test_multi_node_picks_and_latency():
    s = nccl.system(get_topology("dgx-a100:2", None))
    assert (s.graph.channels, s.graph.bw, s.graph.runtime, s.cpu) == (8, 24.0, 16, "amd")
    # NCCL's ring LL allreduce on 2 nodes of 8: 6.6 + 26 intra hops at the AMD proxy's 2.0 + 4 NET hops of 2.7
    assert nccl.latency(s, "allreduce", "ring", "LL") == pytest.approx(69.4)
    assert nccl.bus_bandwidth(s, "ring", "Simple") == pytest.approx(192.0)           # "192GB/s", nccl issue 812
    assert nccl.choose(s, "allreduce", 1024).algorithm == "tree"


def test_unsupported_topologies_and_choices_say_why():
    with pytest.raises(UsageError, match="cannot model NCCL's choice on 'ring:8': NCCL decides from the graphs"):
        nccl.system(get_topology("ring:8", None))
    with pytest.raises(UsageError, match="NVLS for allreduce on one Hopper node, not allgather on 1 node"):
        nccl.choose(nccl.system(get_topology("dgx-h100", None)), "allgather", 64, algorithms=["nvls"])
    with pytest.raises(UsageError, match="not allreduce on 1 node\\(s\\) of a100"):
        nccl.choose(nccl.system(get_topology("dgx-a100", None)), "allreduce", 64, algorithms=["nvls"])
    with pytest.raises(UsageError, match="not allreduce on 2 node"):
        nccl.choose(nccl.system(get_topology("dgx-h100:2", None)), "allreduce", 64, algorithms=["nvls"])


def test_forced_nvls_is_nccls_2_21_model_on_its_16_channels():
    """[2.2, 3.1, 3.5, 4.4]: 25 us, 8 x min(40, 60) x 5/6 = 266.7 GB/s algBw on 8 H100, Simple only."""
    s = nccl.system(get_topology("dgx-h100", None))
    choice = nccl.choose(s, "allreduce", 1 << 30, algorithms=["nvls"])
    assert (choice.algorithm, choice.protocol, choice.channels) == ("nvls", "Simple", 16)
    assert nccl.algorithm_bandwidth(s, "allreduce", "nvls", "Simple") == pytest.approx(266.67, rel=1e-3)
    assert choice.nccl_us == pytest.approx(25.0 + (1 << 30) / (1000 * 266.667), rel=1e-4)


def test_nccl_s_own_choice_takes_nvls_on_one_h100_node_from_2_mb():
    """NCCL 2.21 weighs NVLS by default (tuning.cc): on 8 H100 its model picks ring LL up to 1 MB and
    NVLS from 2 MB, as NCCL printed on such a machine (nccl-tests issue 309: '8B~1MB: uses Algo RING
    proto LL ... 2MB~16GB uses Algo NVLS proto SIMPLE'). Across nodes NVLS is off (no CollNet) and
    NVLSTree is not modelled: ring or tree."""
    s = nccl.system(get_topology("dgx-h100", None))
    picks = {size: (c.algorithm, c.protocol) for size in (1 << 20, 2 << 20, 1 << 30, 16 << 30)
             for c in [nccl.choose(s, "allreduce", size)]}
    assert picks == {1 << 20: ("ring", "LL"), 2 << 20: ("nvls", "Simple"), 1 << 30: ("nvls", "Simple"),
                     16 << 30: ("nvls", "Simple")}
    assert nccl.choose(s, "allreduce", 1 << 30, algorithms=["ring", "tree"]).algorithm == "ring"
    assert nccl.choose(s, "allgather", 1 << 30).algorithm == "ring"
    for topo in ("dgx-h100:2", "dgx-a100"):
        assert nccl.choose(nccl.system(get_topology(topo, None)), "allreduce", 1 << 30).algorithm != "nvls"
    with pytest.raises(UsageError, match="no algorithm among tree"):
        nccl.choose(nccl.system(get_topology("dgx-h100", None)), "allgather", 64, algorithms=["tree"])


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "reducescatter", "alltoall"])
def test_nccl_plans_verify_and_simulate(collective):
    from msc.verification.plan import verify_plan

    topo = get_topology("dgx-h100:2", None)
    records = simulate_nccl(collective, topo, [4096, 8 << 20, 256 << 20])
    assert [r["size"] for r in records] == [4096, 8 << 20, 256 << 20]
    for r in records:
        assert r["time"] > 0 and r["busbw"] > 0 and r["channels"] >= 1 and r["protocol"] in ("LL", "LL128", "Simple")
        choice = nccl.Choice(r["algorithm"], r["protocol"], r["channels"], 0, r["nccl_us"])
        verify_plan(plan_for(topo, collective, choice))
    assert records[-1]["busbw"] > records[0]["busbw"]


def test_rail_rings_on_two_nodes_reach_the_nics():
    """8 NICs of 50 GB/s carrying 0.94 of their line rate: NCCL's ring allgather busbw on 2 nodes is
    bound by them (376 GB/s), where the library's one ring is held to one NIC pair."""
    [r] = simulate_nccl("allgather", get_topology("dgx-h100:2", None), [4 << 30])
    assert 0.9 * 376 < r["busbw"] <= 376.0


def test_cli_simulate_nccl(capsys):
    assert main(["simulate", "--nccl", "allreduce", "--topology", "dgx-a100", "-b", "1K", "-e", "1G", "-f", "1024",
                 "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["size"], r["protocol"]) for r in records] == [(1024, "LL"), (1 << 20, "LL"), (1 << 30, "Simple")]
    assert all(math.isfinite(r["nccl_us"]) and r["time"] > 0 for r in records)
    assert main(["simulate", "--nccl", "allgather", "--topology", "dgx-h100", "-b", "1M", "-e", "1M"]) == 0
    out = capsys.readouterr().out
    assert "algo" in out and "NCCL's algorithm" in out and "%bound" in out


@pytest.mark.parametrize("argv,message", [
    (["simulate", "--nccl", "allreduce"], "needs --topology"),
    (["simulate", "x.plan", "--nccl", "allreduce", "--topology", "dgx-h100"], "not both"),
    (["simulate", "--nccl", "allreduce", "--topology", "dgx-h100", "--tile", "4096"], "--tile"),
    (["simulate", "--nccl", "allreduce", "--topology", "torus:4x4"], "cannot model NCCL's choice on 'torus:4x4'"),
    (["simulate", "--nccl", "gather", "--topology", "dgx-h100"], "no bound for collective"),
    (["simulate", "--topology", "dgx-h100"], "give one or more plans"),
])
def test_cli_simulate_nccl_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
