"""The presets of the machines users have (issue 38, part 3): H200, H20, B200
and GB200 NVL72 from msc.sim.machines' one table, the uncalibrated ones
noted by every command, the TOML topology of nodes (``nodes =``), and
``--nccl`` on it where NCCL's choice can be modelled (refused, saying why,
where not)."""
from __future__ import annotations

import json

import pytest

from msc.cli.main import main
from msc.errors import UsageError
from msc.sim import nccl
from msc.sim.machines import MACHINES
from msc.sim.nccl_sim import simulate_nccl
from msc.sim.presets import fitting_presets, get_topology
from msc.sim.topology import GB, Graph, Nodes, load_topology

NEW = {"dgx-h200": ("h200", 8, 450.0), "hgx-h20": ("h20", 8, 450.0), "hgx-b200": ("b200", 8, 900.0),
       "gb200-nvl72": ("gb200", 72, 900.0)}


@pytest.mark.parametrize("name", NEW)
def test_the_new_presets_take_their_machine_from_the_one_table(name):
    machine, gpus, port = NEW[name]
    one, two = get_topology(name, None), get_topology(f"{name}:2", None)
    assert isinstance(two, Nodes) and (one.num_ranks, two.num_ranks) == (gpus, 2 * gpus)
    assert two.machine == machine and two.g == gpus and two.port == port * GB and two.nic == 50 * GB
    m = MACHINES[machine]
    assert two.threadblock_bandwidth == m.threadblock_gbps * GB and two.protocols["LL"] == m.protocols["LL"]
    assert one.note == m.note != "" and "uncalibrated" in one.note
    assert get_topology(name, 2 * gpus).num_ranks == 2 * gpus          # the node count from the ranks
    assert name in fitting_presets(gpus) and f"{name}:3" in fitting_presets(3 * gpus)


def test_the_calibrated_machines_carry_no_note_and_the_sizes_are_checked():
    assert get_topology("dgx-h100:2", None).note == get_topology("dgx-a100", None).note == ""
    with pytest.raises(UsageError, match="nodes of 72 GPUs, but the plan has 100 ranks"):
        get_topology("gb200-nvl72", 100)


def test_blackwell_takes_nccl_s_blackwell_constants():
    """tuning.cc@v2.30.7: LL capped at 2 x 141 on one node, ring LL128 at 40 per search channel; the
    B200 ring graph 16 x 45 (nccl.GRAPHS, derived). Blackwell's NVLS is not modelled: weighed on Hopper
    only, and refused, saying so, where it is asked for."""
    s = nccl.system(get_topology("hgx-b200", None))
    assert (s.arch, s.graph.channels, s.graph.bw, s.graph.runtime, s.nvls) == ("blackwell", 16, 45.0, 32, None)
    assert nccl.bus_bandwidth(s, "allgather", "ring", "LL") == 282.0
    assert nccl.bus_bandwidth(s, "allgather", "ring", "LL128") == pytest.approx(min(720 * 0.92, 16 * 40.0))
    assert nccl.available(s, "allreduce") == ["tree", "ring"]
    with pytest.raises(UsageError, match="does not model NCCL's NVLS on b200 \\(blackwell\\): NCCL's NVLS graph"):
        nccl.choose(s, "allreduce", 1 << 30, algorithms=["nvls"])
    with pytest.raises(UsageError, match="NVLSTree on b200"):
        nccl.choose(nccl.system(get_topology("hgx-b200:2", None)), "allreduce", 1 << 30, algorithms=["nvlstree"])
    assert nccl.system(get_topology("gb200-nvl72", None)).cpu == "arm"


def test_h200_and_h20_take_h100_s_graphs_and_nvls():
    """The same NVLink 4, switch and NICs as H100 (msc.sim.machines): NCCL's graphs and NVLS graphs are
    H100's, so NVLS on one node and NVLSTree across nodes are weighed as on dgx-h100, and PAT with one
    GPU per node."""
    for name in ("dgx-h200", "hgx-h20"):
        for nodes in ("", ":2"):
            s, h100 = nccl.system(get_topology(name + nodes, None)), nccl.system(get_topology("dgx-h100" + nodes, None))
            assert (s.graph, s.nvls, s.arch, s.cpu) == (h100.graph, h100.nvls, "hopper", "intel")
            assert nccl.available(s, "allreduce") == nccl.available(h100, "allreduce")
    assert "nvlstree" in nccl.available(nccl.system(get_topology("hgx-h20:2", None)), "allreduce")


def _write(tmp_path, text, name="t.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


H100_NODES = 'machine = "h100"\nnodes = 2\ngpus_per_node = 8\nnic_gbps = 50\n'


def test_a_toml_file_of_nodes_is_the_preset_it_describes(tmp_path):
    """A TOML file of 2 nodes of 8 H100 with 400 Gb/s NICs: the same routes and rates as dgx-h100:2,
    and --nccl on it the same choices and times."""
    mine, preset = load_topology(_write(tmp_path, H100_NODES)), get_topology("dgx-h100:2", None)
    assert isinstance(mine, Nodes) and mine.num_ranks == 16 and mine.machine == "h100" and mine.note == ""
    for a, b in ((0, 1), (0, 8), (7, 15)):
        r, q = mine.view("Simple").route(a, b), preset.view("Simple").route(a, b)
        assert r.alpha == q.alpha and [mine.view("Simple").capacity[i] for i in r.resources] == \
            [preset.view("Simple").capacity[i] for i in q.resources]
    sizes = [1 << 10, 1 << 20]
    keys = ("algorithm", "protocol", "channels", "time", "nccl_us")
    assert [[r[k] for k in keys] for r in simulate_nccl("allgather", mine, sizes)] == \
        [[r[k] for k in keys] for r in simulate_nccl("allgather", preset, sizes)]
    # from 3 nodes on the machine's protocols for that many nodes (LL's NIC share), its per-message cost
    three, preset = load_topology(_write(tmp_path, H100_NODES.replace("nodes = 2", "nodes = 3"))), get_topology("dgx-h100:3", None)
    assert three.protocols == preset.protocols != mine.protocols and three.nic_message == preset.nic_message == 1e-6


def test_a_toml_file_of_nodes_sets_what_it_names(tmp_path):
    t = load_topology(_write(tmp_path, H100_NODES + 'nic_alpha_us = 9.5\nnvlink_gbps = 400\nnvls_gbps = 300\n'
                                                   'message_us = 2.5\n'
                                                   '[protocol.Simple]\nlaunch_us = 11.0\n[protocol.Simple.net]\n'
                                                   'bandwidth_factor = 0.9\n'))
    v = t.view("Simple")
    assert v.launch == pytest.approx(11e-6) and v.nic_alpha == pytest.approx(9.5e-6) and v.nic == pytest.approx(45 * GB)
    assert t.port == 400 * GB and t.nvls_bandwidth == 300 * GB and t.nic_message == pytest.approx(2.5e-6)


@pytest.mark.parametrize("text,message", [
    ('machine = "h100"\nnodes = 2\ngpus_per_node = 8\n', "2 nodes need 'nic_gbps'"),
    (H100_NODES + "nics_per_node = 3\n", "must divide gpus_per_node"),
    (H100_NODES + "ranks = 8\n", "'ranks' is 8, but 2 nodes of 8 GPUs are 16"),
    (H100_NODES + "[[link]]\nfrom = 0\nto = 1\nalpha_us = 1\nbandwidth_gbps = 1\n", "'link' belongs to"),
    ('ranks = 2\nnic_gbps = 50\n[[link]]\nfrom = 0\nto = 1\nalpha_us = 1\nbandwidth_gbps = 1\n',
     "nic_gbps describe nodes"),
    (H100_NODES.replace("nic_gbps = 50", "nic_gbps = -1"), "nic_gbps must be a number"),
    ('nodes = 1\ngpus_per_node = 4\n', "no NVLink rate: give 'nvlink_gbps'"),
    ('nodes = 0\ngpus_per_node = 4\n', "'nodes' must be an int from 1"),
])
def test_a_toml_file_of_nodes_refuses_what_does_not_fit(tmp_path, text, message):
    with pytest.raises(UsageError, match=message):
        load_topology(_write(tmp_path, text))


def test_nodes_that_share_nics_share_them_in_the_model(tmp_path):
    t = load_topology(_write(tmp_path, H100_NODES + "nics_per_node = 4\n"))
    assert t.route(0, 8).resources == t.route(1, 9).resources != t.route(2, 10).resources


@pytest.mark.parametrize("spec,message", [
    ("nics_per_node = 4\n", "these nodes have 8 GPUs and 4 NIC\\(s\\), whose rings share NICs"),
    ("nic_gbps_200", "derived for NICs of 50 GB/s; these are 25 GB/s"),
    ("textbook", "it names no GPU"),
])
def test_nccl_s_choice_on_a_toml_file_is_refused_where_msc_cannot_model_it(tmp_path, spec, message):
    text = H100_NODES + spec if spec.endswith("\n") else \
        H100_NODES.replace("nic_gbps = 50", "nic_gbps = 25") if spec == "nic_gbps_200" else \
        H100_NODES.replace('machine = "h100"', 'nvlink_gbps = 450')
    with pytest.raises(UsageError, match=message):
        nccl.system(load_topology(_write(tmp_path, text)))


def test_nccl_s_choice_elsewhere_is_refused_with_the_reason(tmp_path):
    with pytest.raises(UsageError, match="across nodes of 72 gb200 .one NVLink domain each. is not derived"):
        nccl.system(get_topology("gb200-nvl72:2", None))
    links = _write(tmp_path, 'ranks = 2\nmachine = "b200"\ngpus_per_node = 2\n[[link]]\nfrom = 0\nto = 1\n'
                             'alpha_us = 1\nbandwidth_gbps = 100\n')
    graph = load_topology(links)
    assert isinstance(graph, Graph) and graph.machine == "b200" and "B200 is uncalibrated" in graph.note
    with pytest.raises(UsageError, match="not for a graph of links"):
        nccl.system(graph)


def test_every_command_notes_an_uncalibrated_machine_once(capsys, tmp_path):
    argv = ["simulate", "--nccl", "allgather", "--topology", "hgx-b200", "-b", "1K", "-e", "1K"]
    assert main(argv + ["--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)[0]["algorithm"] == "ring"        # --json's stdout stays the records
    assert err.count("msc: note: hgx-b200: B200 is uncalibrated") == 1
    assert main(["bound", "allgather", "--topology", "gb200-nvl72", "-b", "1M", "-e", "1M"]) == 0
    assert "msc: note: gb200-nvl72: GB200" in capsys.readouterr().err
    assert main(["bound", "allgather", "--topology", "dgx-h100", "-b", "1M", "-e", "1M"]) == 0
    assert "note" not in capsys.readouterr().err
    nodes = _write(tmp_path, H100_NODES.replace('"h100"', '"h20"'), "h20.toml")
    assert main(["simulate", "--nccl", "allreduce", "--topology", str(nodes), "-b", "1K", "-e", "1K"]) == 0
    out, err = capsys.readouterr()
    assert "tree" in out and "H20 is uncalibrated" in err and "(the values this file does not set)" in err
