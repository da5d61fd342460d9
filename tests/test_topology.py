"""Topologies: preset routes, the TOML format and its errors."""
from __future__ import annotations

import math

import pytest

from msc.errors import UsageError
from msc.sim.machines import H100
from msc.sim.presets import PRESETS, dgx_h100, pcie, torus
from msc.sim.presets import get_topology
from msc.sim.topology import GB, US, load_topology


def names(topo, route):
    return [topo.resource_names[r] for r in route.resources]


def test_nvswitch_uses_ports():
    t = get_topology("nvswitch", 8)
    r = t.route(0, 5)
    assert names(t, r) == ["gpu0.out", "gpu5.in"] and r.alpha == pytest.approx(3.4 * US)
    assert t.capacity[r.resources[0]] == 450 * GB and t.threadblock_bandwidth == H100.threadblock_gbps * GB


def test_a_protocol_s_view_scales_each_kind_of_link():
    """Simple keeps NVLink's latency and carries 0.82 of its line rate; LL pays
    NCCL's 0.6 us per hop on one node and on several (a hop inside a node
    does not touch the network proxy); across nodes the NIC's (network)
    factors apply, and a message holds both NICs at least the host proxy's
    post overhead (1 us on the Intel hosts of DGX H100) whatever protocol."""
    assert dgx_h100(1).view("LL").route(0, 5).alpha == pytest.approx(0.6 * US)
    t = dgx_h100(2)
    simple, ll = t.view("Simple"), t.view("LL")
    assert simple.view("Simple") is simple and t.view("LL") is ll
    with pytest.raises(UsageError, match="already the Simple view"):
        simple.view("LL")
    r = ll.route(0, 5)
    assert r.alpha == pytest.approx(0.6 * US) and r.message == 0.0
    assert ll.route(0, 8).message == simple.route(0, 8).message == pytest.approx(H100.proxy_us * US) == 1.0 * US
    assert ll.capacity[r.resources[0]] == pytest.approx(450 * GB * H100.protocols["LL"].link("nvlink").bandwidth_factor)
    assert simple.capacity[simple.route(0, 5).resources[0]] == pytest.approx(450 * GB * 0.82)
    net = simple.route(0, 8)
    assert net.alpha == pytest.approx(14 * US) and simple.capacity[net.resources[0]] == pytest.approx(50 * GB * 0.94)
    assert (simple.launch, ll.launch) == (pytest.approx(8.4 * US), pytest.approx(6.6 * US))
    assert t.route(0, 5).alpha == pytest.approx(3.4 * US) and t.launch == 0.0     # the base is untouched


def test_pcie_crosses_switch_uplinks():
    t = pcie()
    assert names(t, t.route(0, 3)) == ["gpu0.out", "gpu3.in"]
    assert names(t, t.route(1, 6)) == ["gpu1.out", "node0.switch0.up", "node0.switch1.down", "gpu6.in"]


def test_infiniband_nodes():
    t = get_topology("ib:2", 16)
    assert t.num_ranks == 16 and t.gpus_per_node == 8 and t.name == "ib:2"
    assert names(t, t.route(3, 4)) == ["gpu3.out", "gpu4.in"]
    r = t.route(3, 12)
    assert names(t, r) == ["nic3.out", "nic12.in"] and r.alpha == pytest.approx(14 * US)


def test_torus_routes_the_short_way():
    t = torus(4, 4)
    r = t.route(0, 3)                          # one hop backwards around the row
    assert names(t, r) == ["0->3"] and r.alpha == pytest.approx(3.4 * US)
    assert names(t, t.route(0, 10)) == ["0->1", "1->2", "2->6", "6->10"]
    assert get_topology("ring", 6).route(0, 4).alpha == pytest.approx(2 * 3.4 * US)


def test_get_topology():
    assert get_topology(None, 4, alpha_us=1, bandwidth_gbps=10).route(1, 2).alpha == pytest.approx(US)
    assert get_topology("ib", 24).num_ranks == 24
    assert get_topology("dgx-a100", 16).name == "dgx-a100:2" and get_topology("dgx-h100:4", None).num_ranks == 32
    assert get_topology("dgx-h100", None).name == "dgx-h100"
    assert get_topology("torus", 12).name == "torus:3x4"
    with pytest.raises(UsageError, match="takes no ':2'"):
        get_topology("nvswitch:2", None)
    with pytest.raises(UsageError, match="nodes of 8 GPUs"):
        get_topology("dgx-h100", 12)
    with pytest.raises(UsageError, match="has 8 ranks, the plan 4"):
        get_topology("nvswitch", 4)
    with pytest.raises(UsageError, match="unknown topology"):
        get_topology("nvlink", 8)
    with pytest.raises(UsageError, match="uniform model"):
        get_topology("nvswitch", 8, alpha_us=1.0)
    with pytest.raises(UsageError, match="--alpha-us"):
        get_topology(None, 8)


TOML = """
name = "two islands"
ranks = 4
reduce_gbps = 500
threadblock_gbps = 20

[[link]]                   # ranks 0, 1 on switch a; 2, 3 on switch b
from = [0, 1, 2, 3]
to = ["a", "a", "b", "b"]
alpha_us = 0.5
bandwidth_gbps = 100

[[link]]
from = "a"
to = "b"
alpha_us = 3
bandwidth_gbps = 25

[[link]]                   # a private fast lane, not shared
from = 1
to = 2
alpha_us = 0.25
bandwidth_gbps = 50
shared = false
duplex = false

[protocol.LL]
alpha_factor = 0.1

[protocol.Simple]
launch_us = 5
[protocol.Simple.link]
bandwidth_factor = 0.8
"""


def test_toml_topology(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(TOML)
    t = load_topology(path)
    assert t.name == "two islands" and t.num_ranks == 4 and t.gamma == pytest.approx(1 / 500e9)
    r = t.route(0, 3)
    assert r.alpha == pytest.approx(4 * US) and len(r.resources) == 3 and r.bandwidth == math.inf
    lane = t.route(1, 2)                       # least latency wins: the private lane
    assert lane.alpha == pytest.approx(0.25 * US) and lane.resources == () and lane.bandwidth == 50 * GB
    back = t.route(2, 1)                       # not duplex: the way back goes through the switches
    assert back.alpha == pytest.approx(4 * US)
    path.write_text(TOML.replace("reduce_gbps", "forward = true\nreduce_gbps"))
    assert load_topology(path).route(0, 3).alpha == pytest.approx(2.25 * US)   # 0 a 1 2 b 3: ranks forward
    ll = t.protocol("LL").link("link")
    assert (ll.alpha_factor, ll.bandwidth_factor) == (0.1, 0.5)
    assert t.view("LL").route(0, 3).alpha == pytest.approx(0.4 * US)
    simple = t.view("Simple")
    assert simple.launch == pytest.approx(5 * US) and simple.route(1, 2).bandwidth == pytest.approx(40 * GB)
    assert simple.route(0, 3).alpha == pytest.approx(4 * US)      # the same path as the base's
    assert get_topology(str(path), 4).name == "two islands"


def test_toml_kinds_and_machine(tmp_path):
    """A TOML link of a kind gets the machine's model of that kind."""
    path = tmp_path / "t.toml"
    path.write_text('ranks = 2\nmachine = "h100"\n[[link]]\nfrom = 0\nto = 1\nalpha_us = 3.4\n'
                    'bandwidth_gbps = 450\nkind = "nvlink"\n')
    t = load_topology(path)
    assert t.view("LL").route(0, 1).alpha == pytest.approx(0.6 * US) and t.view("LL").launch == pytest.approx(6.6 * US)
    assert t.threadblock_bandwidth == H100.threadblock_gbps * GB


@pytest.mark.parametrize("text,message", [
    ("ranks = 0", "'ranks'"),
    ("ranks = 2\ncolour = 1", "unknown key"),
    ("ranks = 2\n[[link]]\nfrom = 0\nto = 1\nalpha_us = 1", "missing 'bandwidth_gbps'"),
    ("ranks = 2\n[[link]]\nfrom = 0\nto = 5\nalpha_us = 1\nbandwidth_gbps = 1", "neither a rank"),
    ("ranks = 2\n[[link]]\nfrom = [0, 1]\nto = [1]\nalpha_us = 1\nbandwidth_gbps = 1", "same length"),
    ("ranks = 2\n[[link]]\nfrom = 0\nto = 1\nalpha_us = 1\nbandwidth_gbps = 0", "bandwidth_gbps"),
    ("ranks = 2\n[protocol.XL]\nalpha_factor = 1", "protocols are"),
    ("ranks = 2\n[protocol.LL]\nlatency = 1", "unknown key"),
    ("ranks = 2\n[protocol.LL.nvlink]\nspeed = 1", "keys are"),
    ("ranks = 2\n[protocol.LL]\nlaunch_us = -1", "launch_us must be"),
    ("ranks = 2\nmachine = \"mi300x\"", "'machine' must be one of"),
    ("ranks = 2\n[[link]]\nfrom = 0\nto = 1\nalpha_us = 1\nbandwidth_gbps = 1\nkind = \"wifi\"", "kind must be"),
    ("ranks = 2\n[[link", "t.toml"),
])
def test_toml_errors(tmp_path, text, message):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        load_topology(path)


def test_unreachable_rank(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text("ranks = 3\n[[link]]\nfrom = 0\nto = 1\nalpha_us = 1\nbandwidth_gbps = 1\n")
    with pytest.raises(UsageError, match="no path from rank 0 to rank 2"):
        load_topology(path).route(0, 2)
