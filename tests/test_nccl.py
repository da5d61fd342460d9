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
    """enqueue.cc@2.30: a channel is dropped while the message is below channels x threads x threshold
    (ring LL: 4096 bytes x ranks per channel; Simple: 32 KiB); the work is then spread by traffic in
    cells of 32 KiB (8 KiB for LL), a channel taking at least its share."""
    s = nccl.system(get_topology("dgx-h100", None))
    assert nccl.choose(s, "allgather", 1024).channels == 1
    assert nccl.choose(s, "allgather", 64 << 10).channels == 2                     # 64K / (4096 x 8)
    assert nccl.choose(s, "allgather", 64 << 20).channels == 24
    # 1M >= 24 x 32K keeps 24; 2 MB of traffic in cells of 32 KiB, 3 cells a channel: 22 channels
    assert nccl.choose(s, "allreduce", 1 << 20, algorithms=["ring", "tree"], protocols=["Simple"]).channels == 22
    assert nccl._channels(s, "allreduce", "ring", "Simple", 1 << 20)[0] == 22
    assert nccl.traffic_channels(s, "allreduce", "Simple", 1 << 20, 24) == 22
    assert nccl.traffic_channels(s, "allreduce", "Simple", 64 << 20, 24) == 24


def test_multi_node_picks_and_latency():
    s = nccl.system(get_topology("dgx-a100:2", None))
    assert (s.graph.channels, s.graph.bw, s.graph.runtime, s.cpu) == (8, 24.0, 16, "amd")
    # NCCL 2.30's ring LL allreduce on 2 nodes of 8: 6.6 + 28 intra hops at the AMD proxy's 2.0 + 2 NET
    # hops of 2.7 (2.21 counted 2 x nodes = 4 NET hops: 69.4; nccl_model.md 2.3)
    assert nccl.latency(s, "allreduce", "ring", "LL") == pytest.approx(68.0)
    assert nccl.bus_bandwidth(s, "allreduce", "ring", "Simple") == pytest.approx(192.0)   # "192GB/s", nccl issue 812
    assert nccl.choose(s, "allreduce", 1024).algorithm == "tree"


def test_unsupported_topologies_and_choices_say_why():
    with pytest.raises(UsageError, match="cannot model NCCL's choice on 'ring:8': NCCL decides from the graphs"):
        nccl.system(get_topology("ring:8", None))
    with pytest.raises(UsageError, match="the library has no NVLS allgather"):
        simulate_nccl("allgather", get_topology("dgx-h100", None), [64], algorithms=["nvls"])
    with pytest.raises(UsageError, match="not allreduce on 1 node\\(s\\) of 8 a100"):
        nccl.choose(nccl.system(get_topology("dgx-a100", None)), "allreduce", 64, algorithms=["nvls"])
    with pytest.raises(UsageError, match="needs CollNet\\), not allreduce on 2 node"):
        nccl.choose(nccl.system(get_topology("dgx-h100:2", None)), "allreduce", 64, algorithms=["nvls"])
    with pytest.raises(UsageError, match="NVLSTree for allreduce on several nodes of Hopper GPUs on NVSwitch, not allreduce "
                                         "on 1 node"):
        nccl.choose(nccl.system(get_topology("dgx-h100", None)), "allreduce", 64, algorithms=["nvlstree"])
    with pytest.raises(UsageError, match="PAT for allgather and reducescatter with one GPU per node, not allgather "
                                         "on 2 node\\(s\\) of 8"):
        nccl.choose(nccl.system(get_topology("dgx-h100:2", None)), "allgather", 64, algorithms=["pat"])


def test_forced_nvls_is_nccls_2_30_model_on_its_16_channels():
    """[2.2, 3.1, 3.5, 4.4]: 25 us; 8 channels x min(40 x 0.85 x 7/8 x 2, 60) = 476 GB/s busBw, x 8/14 =
    272 GB/s algBw on 8 H100 (2.21 had 8 x min(40, 60) x 5/6 = 266.7), Simple only, on 16 channels."""
    s = nccl.system(get_topology("dgx-h100", None))
    choice = nccl.choose(s, "allreduce", 1 << 30, algorithms=["nvls"])
    assert (choice.algorithm, choice.protocol, choice.channels) == ("nvls", "Simple", 16)
    assert nccl.bus_bandwidth(s, "allreduce", "nvls", "Simple") == pytest.approx(476.0)
    assert nccl.algorithm_bandwidth(s, "allreduce", "nvls", "Simple") == pytest.approx(272.0)
    assert choice.nccl_us == pytest.approx(25.0 + (1 << 30) / (1000 * 272.0), rel=1e-6)


def test_nccl_s_own_choice_takes_nvls_on_one_h100_node_from_2_mb():
    """NCCL 2.30 weighs NVLS by default (tuning.cc): on 8 H100 its model picks ring LL up to 1 MB and
    NVLS from 2 MB, as NCCL printed on such a machine (nccl-tests issue 309: '8B~1MB: uses Algo RING
    proto LL ... 2MB~16GB uses Algo NVLS proto SIMPLE'). Across nodes NVLS is off (no CollNet): there
    NVLSTree (test_nccl_s_choice_across_nodes), and on A100 no NVLS at all."""
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
    (["simulate", "--nccl", "allscatter", "--topology", "dgx-h100"], "no bound for collective"),
    (["simulate", "--topology", "dgx-h100"], "give one or more plans"),
])
def test_cli_simulate_nccl_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# -- NCCL 2.30.7's model across nodes (nccl_model.md 2.3, 3.1; bench/calibration/nccl_model.md gives each term) --

def _system(name):
    return nccl.system(get_topology(name, None))


def _one_gpu_per_node(nodes):
    from msc.sim.machines import H100
    from msc.sim.presets import dgx

    return dgx(H100, nodes, 50.0, f"h100x1:{nodes}", gpus_per_node=1)


@pytest.mark.parametrize("name,collective,expected", [
    # 2 nodes of 8, Intel: 6.6 / 14 / 8.4 + 28 intra steps at max(hop, 1.0 post overhead; Simple 3.0) + 2 NET
    ("dgx-h100:2", "allreduce", {"LL": 40.0, "LL128": 75.2, "Simple": 131.6}),
    # AMD hosts: the post overhead is 2.0 (x3 for Simple)
    ("dgx-a100:2", "allreduce", {"LL": 68.0, "LL128": 78.0, "Simple": 204.4}),
    # 4 nodes: 62 steps, 6 across nodes (2.21 counted 2 x nodes = 8)
    ("dgx-h100:4", "allreduce", {"LL": 78.8, "LL128": 144.4, "Simple": 282.8}),
    ("dgx-h100:2", "allgather", {"LL": 23.3, "LL128": 44.6, "Simple": 70.0}),
])
def test_multi_node_ring_latencies(name, collective, expected):
    s = _system(name)
    for proto, lat in expected.items():
        assert nccl.latency(s, collective, "ring", proto) == pytest.approx(lat, abs=1e-9), proto


def test_multi_node_ring_plateau_and_time():
    """The ring's plateau: Simple allreduce across nodes, from 64 bytes per runtime channel and rank
    (16 x 16 ranks: 16 KiB), costs 1.4 x its latency (tuning.cc:647@2.30)."""
    s = _system("dgx-h100:2")
    bw = nccl.algorithm_bandwidth(s, "allreduce", "ring", "Simple")
    assert bw == pytest.approx(360 * 16 / 30)
    for nbytes, lat in ((16383, 131.6), (16384, 131.6 * 1.4), (1 << 30, 131.6 * 1.4)):
        got = nccl.nccl_time(s, "allreduce", "ring", "Simple", nbytes) - nbytes / (1000 * bw)
        assert got == pytest.approx(lat, abs=1e-6), nbytes


def test_multi_node_tree_nvlstree_broadcast_and_pat_latencies():
    h2, h4, a2 = _system("dgx-h100:2"), _system("dgx-h100:4"), _system("dgx-a100:2")
    # Tree: base + 2 x (7 chain hops + log2 nodes NET hops), no post overhead on the chain
    assert nccl.latency(h2, "allreduce", "tree", "LL") == pytest.approx(6.8 + 2 * (7 * 0.6 + 5.0))
    assert nccl.latency(h2, "allreduce", "tree", "LL128") == pytest.approx(14.0 + 2 * (7 * 1.25 + 8.5))
    assert nccl.latency(h4, "allreduce", "tree", "Simple") == pytest.approx(8.4 + 2 * (7 * 4.0 + 2 * 14.0))
    assert nccl.latency(a2, "allreduce", "tree", "LL") == nccl.latency(h2, "allreduce", "tree", "LL")
    # NVLSTree: its NVLink hop (25) + 2 log2(nodes) NET hops of 20.9 (v2.28.9)
    assert nccl.latency(h2, "allreduce", "nvlstree", "Simple") == pytest.approx(25.0 + 2 * 20.9)
    assert nccl.latency(h4, "allreduce", "nvlstree", "Simple") == pytest.approx(25.0 + 4 * 20.9)
    # broadcast across nodes: nRanks NET hops (Simple at the tree's); one node: one hop (the same rings)
    assert nccl.latency(h2, "broadcast", "ring", "LL") == pytest.approx(6.6 + 16 * 2.7)
    assert nccl.latency(h2, "broadcast", "ring", "Simple") == pytest.approx(8.4 + 16 * 14.0)
    assert nccl.latency(_system("dgx-h100"), "broadcast", "ring", "LL") == pytest.approx(6.6 + 0.6)
    # one GPU per node: PAT's 8 + log2(nodes) x 14 / 3.5 + 2.8 per rank; the ring at the tree's NET hop
    s = nccl.system(_one_gpu_per_node(64))
    assert (s.ppn, s.graph) == (1, nccl.Graph(2, 24.0, 4))
    assert nccl.latency(s, "allgather", "pat", "Simple") == pytest.approx(8.0 + 6 * 14 / 3.5 + 64 * 2.8)
    assert nccl.latency(s, "allgather", "ring", "LL") == pytest.approx(6.6 + 63 * 5.0)


def test_nvlstree_bandwidth_across_h100_nodes():
    """2.30's NVLSTree busBw: 8 heads x min(40 x 0.85 x 7/8 x 2, 48 (x2 on 2 nodes), 57.7 / 45.5): 461.6
    GB/s on 2 nodes (a user's '470 GB/s' on 2 nodes of 8 H100, nccl-tests issue 309) and 364 from 3
    (their 365.84 on 4); the algorithm bandwidth is that x n / 2(n-1)."""
    h2, h4 = _system("dgx-h100:2"), _system("dgx-h100:4")
    assert h2.nvls == nccl.NvlsGraph(8, 40.0, 48.0) and _system("dgx-h100").nvls == nccl.NvlsGraph(8, 40.0, 60.0)
    assert nccl.bus_bandwidth(h2, "allreduce", "nvlstree", "Simple") == pytest.approx(461.6)
    assert nccl.bus_bandwidth(h4, "allreduce", "nvlstree", "Simple") == pytest.approx(364.0)
    assert nccl.algorithm_bandwidth(h4, "allreduce", "nvlstree", "Simple") == pytest.approx(364.0 * 32 / 62)
    assert _system("dgx-a100:2").nvls is None and "nvlstree" not in nccl.available(_system("dgx-a100:2"), "allreduce")


def test_nccl_s_choice_across_nodes():
    """NCCL 2.30 on 2 nodes of H100: tree LL, tree LL128, then NVLSTree from 4 MB; A100 (no NVLS):
    tree, then the ring; one GPU per node: PAT for a small allgather, the ring for a large one (PAT's
    busBw is 0.75 of the graph's and it is not converted)."""
    h2, a2 = _system("dgx-h100:2"), _system("dgx-a100:2")
    picks = {size: (c.algorithm, c.protocol) for size in (1 << 10, 1 << 20, 4 << 20, 1 << 30)
             for c in [nccl.choose(h2, "allreduce", size)]}
    assert picks == {1 << 10: ("tree", "LL"), 1 << 20: ("tree", "LL128"), 4 << 20: ("nvlstree", "Simple"),
                     1 << 30: ("nvlstree", "Simple")}
    assert nccl.choose(a2, "allreduce", 1 << 30).algorithm == "ring"
    s = nccl.system(_one_gpu_per_node(64))
    assert nccl.choose(s, "allgather", 64 << 10).algorithm == "pat"
    assert nccl.choose(s, "reducescatter", 64 << 10).algorithm == "pat"
    assert nccl.choose(s, "allgather", 1 << 30).algorithm == "ring"
    assert nccl.algorithm_bandwidth(s, "allgather", "pat", "Simple") == pytest.approx(2 * 24.0 * 0.75)


def test_nvls_allgather_is_weighed_and_never_wins_on_one_h100_node():
    """NCCL 2.30 weighs NVLS for allgather and reducescatter on one node; its bandwidth is a GPU's share
    of the switch (8 x 40 x 0.85 x 7/8 x 7/8, not converted: 208 GB/s) against the ring's 411 and its
    latency 25 us against ring LL's 10.8, so at no size does it win (the library has no NVLS allgather)."""
    s = _system("dgx-h100")
    assert nccl.algorithm_bandwidth(s, "allgather", "nvls", "Simple") == pytest.approx(8 * 40 * 0.85 * 7 / 8 * 7 / 8)
    for k in range(3, 34):
        assert nccl.choose(s, "allgather", 1 << k).algorithm == "ring", k


def test_pat_on_one_gpu_per_node_simulates_as_the_library_s_pat():
    topo = _one_gpu_per_node(16)
    [r] = simulate_nccl("allgather", topo, [64 << 10])
    assert (r["algorithm"], r["protocol"]) == ("pat", "Simple") and r["time"] > 0


# -- msc's plans of NCCL's choice against NCCL's own model ----------------------------------------------------

AGREE = 1.5             # issue 38: within 1.5x of NCCL's own model at every size
# Where msc's plans of NCCL's choice are not within AGREE of NCCL's model (sizes, and why): the slow test
# holds them outside, so that one coming within fails it and leaves the list.
MISSES = {
    ("dgx-a100:2", "allreduce"): ((128 << 10,), "NCCL's tree correction halves its LL tree's bandwidth at 128 KB "
                                               "(treeCorrectionFactor, an empirical factor): msc is 0.63x"),
    ("dgx-a100:2", "allgather"): ((512 << 10, 1 << 20, 2 << 20), "two channels' LL128 messages through each NIC "
                                  "per step, each holding it NCCL's 2 us post overhead (AMD hosts)"),
    ("dgx-a100:2", "reducescatter"): ((512 << 10, 1 << 20, 2 << 20), "as allgather"),
    ("dgx-a100:4", "allgather"): ((512 << 10, 1 << 20, 2 << 20, 4 << 20), "as on two nodes"),
    ("dgx-a100:4", "reducescatter"): ((512 << 10, 1 << 20, 2 << 20, 4 << 20), "as on two nodes"),
}
# Where the simulated time falls as the size grows (the size it falls at, and why).
FALLS = {
    ("dgx-h100:8", "allreduce"): ((4 << 10,), "the tree's LL step splits into two passes, whose halves of a network "
                                            "message interleave on a parent's NIC with its other children's: 1 us"),
}


def _agreement(name, collective, sizes, misses=(), falls=()):
    records = simulate_nccl(collective, get_topology(name, None), sizes)
    for r in records:
        ratio = r["time"] / r["nccl_us"]
        within = 1 / AGREE <= ratio <= AGREE
        assert within != (r["size"] in misses), (name, collective, r["size"], r["algorithm"], r["protocol"], ratio)
    fell = [b["size"] for a, b in zip(records, records[1:]) if b["time"] < a["time"]]
    assert fell == list(falls), (name, collective, fell)      # time never falls as the size grows, but there


def test_nccl_plans_agree_with_nccl_s_model_across_two_h100_nodes():
    """A sweep every 4x from 4 KB to 1 GB: tree LL and LL128 pipelined in NCCL's chunks, then NVLSTree."""
    _agreement("dgx-h100:2", "allreduce", [4096 << (2 * k) for k in range(10)])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dgx-h100:2", "dgx-h100:4", "dgx-h100:8", "dgx-a100:2", "dgx-a100:4"])
@pytest.mark.parametrize("collective", ["allreduce", "allgather", "reducescatter"])
def test_nccl_plans_agree_with_nccl_s_model_at_every_size(name, collective):
    _agreement(name, collective, [1 << k for k in range(10, 33 if name != "dgx-h100:8" else 31)],
               MISSES.get((name, collective), ((),))[0], FALLS.get((name, collective), ((),))[0])


def test_per_message_network_cost_makes_a_log_step_allgather_beat_allpairs_at_64_nodes():
    """64 nodes of one H100 and its NIC, 64 KB allgather: all-pairs posts 63 messages a rank at once,
    PAT and recursive doubling log2(64) = 6 in turn. With NCCL's post overhead per message on the NICs
    the log-step plans win (why NCCL uses PAT there); without it, all-pairs was predicted 4x faster."""
    import msc
    from msc.lower.pipeline import LowerOptions, lower
    from msc.sim import presets
    from msc.sim.simulate import simulate

    topo = presets.dgx(presets.H100, 64, presets.NDR_GBPS, "h100-64x1", gpus_per_node=1)
    times = {}
    for name in ("allpairs", "pat", "recursive_doubling"):
        alg = next(a for a in msc.load_algorithms(f"algorithms/allgather/{name}.py") if a.name == name)
        times[name] = simulate(lower(msc.trace(alg, 64), LowerOptions(protocol="LL")), topo, [64 << 10])[0]["time"]
    assert times["pat"] < 0.8 * times["allpairs"] and times["recursive_doubling"] < 0.8 * times["allpairs"], times
