"""Memory and time bounded by the input's size (issue 27, items 5, 6 and 7):
a few bytes of plan, DSL, XML or TOML that ask for billions of chunks, ranks
or bytes are refused at once with the total and msc's limit (exit 2), and a
file that is not a regular file, or is over its kind's size, is refused
before it is read. The reproducers of the issue, each as a test."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

import clirun
import msc
from msc.errors import AlgorithmError, PlanError, UsageError
from msc.files import read_input
from msc.formats.load import load_plan
from msc.formats.plan_text import parse_plan, save_plan
from msc.formats.xml_export import plan_to_xml
from msc.formats.xml_import import xml_to_plan
from msc.ir.limits import (MAX_CHUNK_MOVES, MAX_PLAN_FILE_BYTES, MAX_RANKS, MAX_STEP_MOVES, MAX_TEXT_FILE_BYTES,
                           MAX_TOTAL_CHUNKS)
from msc.lower.pipeline import LowerOptions, lower
from msc.sim.cut_bound import COLLECTIVES, _link_model, _routes_model, cut_model, lower_bound
from msc.sim.presets import get_topology, ring
from msc.sim.topology import load_topology, topology_from_dict
from msc.formats.registry import PlanRegistry
from library import algorithms
from patience import patience

RING = algorithms()["allreduce/ring:ring"]
HEADER = ("msc-plan 1\nname \"x\" collective allgather ranks {n} chunk_factor {k}\n"
          "input_chunks {k} output_chunks {out} inplace false root 0\nprotocol Simple instances 1 slots 2 tile 0\n\n")


# in this process (tests/clirun.py); tests/test_cli_processes.py runs each command as a process
def _msc(*args, cwd):
    return clirun.msc(*args, cwd=cwd)


def _header(n: int, k: int = 1) -> str:
    return HEADER.format(n=n, k=k, out=n * k)


# -- item 5: memory from tiny inputs ------------------------------------------------------
def test_a_700_byte_plan_with_24_ranks_of_huge_scratch_is_refused(tmp_path):
    text = _header(24) + "".join(f"rank {r} scratch 67108864\n" for r in range(24))
    assert len(text) < 800
    with pytest.raises(PlanError, match=f"the buffers of all 24 ranks hold 1610613336 chunks .* over msc's limit "
                                        f"of {MAX_TOTAL_CHUNKS}"):
        parse_plan(text)
    (tmp_path / "big.plan").write_text(text)
    start = time.process_time()            # CPU time: load does not inflate it
    done = _msc("verify", "big.plan", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    assert "big.plan" in done.stderr and f"over msc's limit of {MAX_TOTAL_CHUNKS}" in done.stderr
    assert time.process_time() - start < 30


def test_scratch_summed_over_ranks_is_bounded_but_a_plan_at_the_limit_is_read():
    per = MAX_TOTAL_CHUNKS // 2 - 3                    # 2 ranks x (1 input + 2 output + scratch): the limit exactly
    plan = parse_plan(_header(2) + f"rank 0 scratch {per}\nrank 1 scratch {per}\n")
    assert [rp.scratch for rp in plan.ranks] == [per, per]
    with pytest.raises(PlanError, match="hold 67108865 chunks"):
        parse_plan(_header(2) + f"rank 0 scratch {per + 1}\nrank 1 scratch {per}\n")


def test_steps_moving_billions_of_chunks_are_refused():
    # 2 KB of plan whose 30 steps each copy 2^23 chunks: 4.5 GB and 13 s in the verifier before
    steps = "".join(f"    {s}: copy scratch[0:8388608] -> scratch[8388608:16777216]\n" for s in range(30))
    text = _header(2) + "rank 0 scratch 16777216\n  tb 0 send - recv - channel 0\n" + steps + "rank 1 scratch 0\n"
    with pytest.raises(PlanError, match=f"the steps move 251658240 chunks in all, over msc's limit of "
                                        f"{MAX_STEP_MOVES}"):
        parse_plan(text)
    # 8 such steps are the limit exactly, and a plan at it is read
    at_limit = MAX_STEP_MOVES // 8388608
    assert at_limit == 8
    plan = parse_plan(text.replace(steps, "".join(steps.splitlines(True)[:at_limit])))
    assert sum(step.count for _, _, _, step in plan.steps()) == MAX_STEP_MOVES
    with pytest.raises(PlanError, match=f"the steps move {MAX_STEP_MOVES + 8388608} chunks in all"):
        parse_plan(text.replace(steps, "".join(steps.splitlines(True)[:at_limit + 1])))


def test_xml_with_s_chunks_of_2_to_the_26_is_refused_at_once():
    xml = plan_to_xml(lower(msc.trace(RING, 4), LowerOptions()))
    big = xml.replace('s_chunks="0"', 's_chunks="67108864"')
    assert big != xml
    start = time.process_time()
    with pytest.raises(PlanError, match="hold 268435472 chunks"):
        xml_to_plan(big)
    assert time.process_time() - start < 5              # 14 s and 4.2 GB in the verifier before


def _algorithm(tmp_path, body: str, collective: str = "allgather", factor: int = 1):
    path = tmp_path / "alg.py"
    path.write_text(f"import msc\n\n@msc.algorithm('{collective}', chunk_factor={factor})\ndef alg(p):\n{body}")
    [alg] = msc.load_algorithms(path)
    return alg


def test_a_24_operation_program_cannot_grow_scratch_past_the_total(tmp_path):
    # each op names scratch[2^26 - 1] on another rank: 7.9 GB and a MemoryError before
    alg = _algorithm(tmp_path, "    for r in range(p.num_ranks):\n"
                               "        p.chunk(r, 'input', 0).copy((r + 1) % p.num_ranks, 'scratch', 67108863)\n")
    with pytest.raises(AlgorithmError, match=r"alg.py:6: copy: rank 1 scratch\[67108863:67108864\] grows the "
                                             f"buffers of all ranks to 67109440 chunks, over msc's limit of "
                                             f"{MAX_TOTAL_CHUNKS}"):
        msc.trace(alg, 24)


def test_a_program_cannot_move_more_chunks_than_the_limit(tmp_path):
    alg = _algorithm(tmp_path, "    for _ in range(600):\n"
                               "        p.chunk(0, 'input', 0, 65536).copy(1, 'output', 0)\n", factor=65536)
    with pytest.raises(AlgorithmError, match=f"alg.py:6: copy: the operations so far move {MAX_CHUNK_MOVES + 65536} "
                                             f"chunks, over msc's limit of {MAX_CHUNK_MOVES}"):
        msc.trace(alg, 2)


def test_buffers_of_all_ranks_are_bounded_before_tracing():
    alg = algorithms()["allgather/ring:ring"]
    start = time.process_time()
    with pytest.raises(UsageError, match="the chunks of the input and output buffers of all 9000 ranks is 81000000, "
                                         f"over msc's limit of {MAX_TOTAL_CHUNKS}"):
        msc.trace(alg, 9000)
    assert time.process_time() - start < 5


def test_instances_cannot_multiply_a_program_past_the_totals(tmp_path):
    # 10 operations of 65536 chunks: 655360 chunk operations, 42 million with 64 instances
    alg = _algorithm(tmp_path, "    for r in range(2):\n"
                               "        for _ in range(5):\n"
                               "            p.chunk(r, 'input', 0, 65536).copy(1 - r, 'output', r * 65536)\n",
                     factor=65536)
    program = msc.trace(alg, 2)
    start = time.process_time()
    with pytest.raises(UsageError, match=f"with 64 instance.s. the plan's steps would move at least 41943040 chunks, "
                                         f"over msc's limit of {MAX_CHUNK_MOVES}: use fewer instances"):
        lower(program, LowerOptions(instances=64))
    assert time.process_time() - start < 2


# -- item 6: topology sizes held to the rank limit -----------------------------------------
@pytest.mark.parametrize("ranks", [10 ** 17, 10 ** 6, MAX_RANKS + 1])
def test_toml_ranks_are_held_to_the_rank_limit(ranks, tmp_path):
    start = time.process_time()
    with pytest.raises(UsageError, match=f"'ranks' is {ranks}, over msc's limit of {MAX_RANKS}"):
        topology_from_dict({"ranks": ranks, "link": [{"from": 0, "to": 1, "alpha_us": 1, "bandwidth_gbps": 1}]})
    (tmp_path / "t.toml").write_text(f"ranks = {ranks}\n")
    with pytest.raises(UsageError, match=f"t.toml: 'ranks' is {ranks}, over msc's limit"):
        load_topology(tmp_path / "t.toml")
    assert time.process_time() - start < 2


@pytest.mark.parametrize("spec, ranks", [("ring:1000000", 10 ** 6), ("torus:100000x100000", 10 ** 10),
                                         ("uniform:20000", 20000), ("ib:4096", 32768), ("dgx-a100:2049", 16392)])
def test_presets_are_held_to_the_rank_limit(spec, ranks):
    start = time.process_time()
    with pytest.raises(UsageError, match=f"has {ranks} ranks, over msc's limit of {MAX_RANKS}"):
        get_topology(spec, None, **({"alpha_us": 1.0, "bandwidth_gbps": 1.0} if spec.startswith("uniform") else {}))
    assert time.process_time() - start < 1


def test_msc_bound_on_a_toml_of_10_to_the_17_ranks_exits_2(tmp_path):
    (tmp_path / "t.toml").write_text("ranks = 100000000000000000\n")
    done = _msc("bound", "allreduce", "-t", "t.toml", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "over msc's limit of 16384" in done.stderr


def test_a_ring_at_the_rank_limit_has_its_cuts_without_a_ranks_by_links_table():
    model = cut_model(ring(MAX_RANKS).view("Simple"))
    assert len(model.cuts) == MAX_RANKS - 1 and model.exact
    # any k consecutive ranks of a ring: two links in, so every cut has the same capacity
    assert {c.capacity for c in model.cuts} == {2 * ring(2).view("Simple").bandwidth}


def _star(n: int, **link) -> dict:
    return {"name": f"star{n}", "ranks": n,
            "link": [{"from": list(range(n)), "to": ["sw"] * n, "alpha_us": 0.5, "bandwidth_gbps": 100, **link}]}


def test_a_large_toml_graph_takes_its_cuts_from_its_links():
    big = topology_from_dict(_star(65))
    assert not cut_model(big).exact and cut_model(topology_from_dict(_star(64))).exact is False
    model = cut_model(big)
    assert len(model.cuts) < 8 * 65                     # singles, complements, aligned blocks: O(n), not 2^n
    small = topology_from_dict(_star(8))
    for c in COLLECTIVES:          # a star: the links' cuts are the routes' min cuts; a cut's hop is its last link's
        [mine], [routes] = (lower_bound(c, small, [1 << 26], cuts=model) for model in (_link_model, _routes_model))
        assert mine.seconds <= routes.seconds and mine.seconds == pytest.approx(routes.seconds, abs=0.51e-6), c


@pytest.mark.parametrize("seed", range(10))
def test_the_link_model_never_bounds_above_the_route_model(seed):
    """Seeded random TOML graphs (switches, direct and one-way links, some not
    shared, forwarding ranks): the links' cuts give a valid bound, at most
    the all-cuts bound of the routes, at every size and collective."""
    from test_bound import connected, random_topology

    topo = random_topology(seed + 1000, max_ranks=7)
    if not connected(topo):
        pytest.skip("not every rank reaches every other")
    for c in COLLECTIVES:
        sizes = [1, 4096, 1 << 26]
        for a, b in zip(lower_bound(c, topo, sizes, cuts=_link_model), lower_bound(c, topo, sizes,
                                                                                   cuts=_routes_model)):
            assert a.seconds <= b.seconds * (1 + 1e-12), (c, a, b)


# -- item 7: unbounded reads ----------------------------------------------------------------
@pytest.fixture
def files(tmp_path):
    save_plan(lower(msc.trace(RING, 4), LowerOptions()), tmp_path / "ring.plan")
    for name in ("zero.plan", "zero.xml", "zero.toml", "zero.json", "zero.py"):
        os.symlink("/dev/zero", tmp_path / name)
    os.mkfifo(tmp_path / "fifo.plan")
    (tmp_path / "folder.plan").mkdir()
    with open(tmp_path / "huge.plan", "wb") as f:      # sparse: no disk used
        f.truncate(MAX_PLAN_FILE_BYTES + 1)
    with open(tmp_path / "huge.toml", "wb") as f:
        f.truncate(MAX_TEXT_FILE_BYTES + 1)
    return tmp_path


@pytest.mark.parametrize("name, kind", [("zero.plan", "a character device"), ("zero.xml", "a character device"),
                                        ("fifo.plan", "a FIFO"), ("folder.plan", "a folder")])
def test_a_plan_that_is_not_a_regular_file_is_refused(files, name, kind):
    start = time.perf_counter()
    with pytest.raises(PlanError, match=f"cannot read plan .*{name}: it is {kind}, not a regular file"):
        load_plan(files / name)
    assert time.perf_counter() - start < patience(2)     # a FIFO with no writer: no wait (a wait costs no CPU)


def test_files_over_their_size_are_refused_before_reading(files):
    with pytest.raises(PlanError, match=f"huge.plan: it has {MAX_PLAN_FILE_BYTES + 1} bytes, over msc's limit of "
                                        f"{MAX_PLAN_FILE_BYTES}"):
        load_plan(files / "huge.plan")
    with pytest.raises(UsageError, match=f"huge.toml: it has {MAX_TEXT_FILE_BYTES + 1} bytes, over msc's limit"):
        load_topology(files / "huge.toml")
    assert read_input(files / "ring.plan", 10 ** 6) == (files / "ring.plan").read_bytes()
    with pytest.raises(UsageError, match=f"ring.plan: it has {(files / 'ring.plan').stat().st_size} bytes, over "
                                         f"msc's limit of 1000"):
        read_input(files / "ring.plan", 1000)


def test_topology_plans_json_and_algorithm_files_linked_to_dev_zero_are_refused(files):
    with pytest.raises(UsageError, match="cannot read topology .*zero.toml: it is a character device"):
        load_topology(files / "zero.toml")
    with pytest.raises(UsageError, match="cannot read plans.json .*zero.json: it is a character device"):
        PlanRegistry.from_index(files / "zero.json")
    with pytest.raises(UsageError, match="cannot read algorithm file .*zero.py: it is a character device"):
        msc.load_algorithms(files / "zero.py")
    (files / "plans.json").write_text(json.dumps({"plans": [{"collective": "allgather", "file": "zero.xml"}]}))
    with pytest.raises(PlanError, match="zero.xml: it is a character device"):
        PlanRegistry.from_index(files / "plans.json")


@pytest.mark.parametrize("args", [("diff", "ring.plan", "/dev/zero"), ("verify", "zero.plan"),
                                  ("simulate", "ring.plan", "-t", "zero.toml"), ("verify", "fifo.plan"),
                                  ("bound", "allreduce", "-t", "huge.toml")])
def test_the_command_line_refuses_them_with_exit_2(files, args):
    done = _msc(*args, cwd=files)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    assert "cannot read" in done.stderr and ("not a regular file" in done.stderr or "over msc's limit" in done.stderr)


# -- msc synthesize --pieces: the limit before the work -----------------------------------------
@pytest.mark.parametrize("collective, factor", [("allgather", 100000), ("allreduce", 400000)])
def test_synthesize_checks_pieces_before_packing(collective, factor):
    from msc.synth import synthesize

    start = time.process_time()
    with pytest.raises(UsageError, match=f"100000 pieces on 4 ranks: {collective}: chunk_factor is {factor}, over "
                                         f"msc's limit of 65536"):
        synthesize(collective, get_topology("ring:4", None), pieces=100000)
    assert time.process_time() - start < 5               # ~50 s of packing before


def test_random_tiny_plans_never_raise_memory_errors():
    """Seeded headers and rank sections with huge scratch, ranks, chunk
    factors and counts: each is parsed or refused with a PlanError."""
    rng = random.Random(27)
    refused = 0
    for _ in range(40):
        n = rng.choice([1, 2, 3, 24, 300])
        k = rng.choice([1, 2, 64, 65536])
        scratch = [rng.choice([0, 1, 1 << 20, 1 << 25, 1 << 26]) for _ in range(min(n, 4))]
        text = _header(n, k) + "".join(f"rank {r} scratch {scratch[r] if r < len(scratch) else 0}\n"
                                       for r in range(n))
        try:
            parse_plan(text)
        except PlanError as exc:
            assert "over msc's limit" in str(exc) or "exceeds" in str(exc), exc
            refused += 1
    assert refused > 0


# -- hangs: ranges, iterables and sizes are taken arithmetically or bounded first --------------------
HUGE_RANKS = '''import itertools

import msc


@msc.algorithm("allgather", ranks=range(2, 2**62, 2))
def evens(p):
    """Each rank copies its input to every rank's output (all pairs)."""
    for r in range(p.num_ranks):
        for j in range(p.num_ranks):
            p.chunk(r, "input", 0).copy(j, "output", r)


MEMBERS = {"range": range(10**18), "count": itertools.count()}


@msc.algorithm("allreduce", ranks=range(1, 2**64), members="range")
def switching(p, members):
    p.switch(MEMBERS[members])
'''


def test_a_ranks_range_of_2_to_the_62_is_taken_arithmetically(tmp_path):
    """min() of range(2, 2**62, 2) walked it in C: msc list, verify and
    compile hung, and neither Ctrl-C nor --timeout stopped them. Run in a
    child so a regression fails by its timeout instead of hanging the suite."""
    (tmp_path / "evens.py").write_text(HUGE_RANKS)
    path = str(tmp_path / "evens.py")
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import evens, msc, json, itertools\n"
              "from msc.cli.main import main\n"
              "alg = evens.evens\n"
              "out = {'supports': [n for n in (1, 2, 3, 4, 2**61, 2**62) if alg.supports(n)]}\n"
              "try:\n    msc.trace(alg, 3)\nexcept msc.MscError as e:\n    out['three'] = str(e)\n"
              "for bad in (range(0, 2**64), range(2**63, -1, -1), itertools.count(1)):\n"
              "    try:\n        msc.algorithm('allreduce', ranks=bad)(alg.fn)\n"
              "    except msc.MscError as e:\n        out.setdefault('refused', []).append(str(e))\n"
              "for members in ('range', 'count'):\n"
              "    try:\n        msc.trace(evens.switching, 4, members=members)\n"
              "    except msc.MscError as e:\n        out[members] = str(e)\n"
              f"out['list'] = main(['list', {path!r}])\n"
              f"out['verify'] = main(['verify', {path!r}, '--ranks', '4', '--name', 'evens', '--timeout', '5'])\n"
              f"out['compile'] = main(['compile', {path!r}, '--ranks', '4', '--name', 'evens', '-o', {str(tmp_path / 'e.plan')!r}])\n"
              "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=patience(60),
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["supports"] == [2, 4, 2**61]
    assert "supported rank counts: 2 to 4611686018427387902 in steps of 2" in out["three"]
    assert "ranks=range(0, 18446744073709551616) must hold rank counts >= 1" in out["refused"][0]
    assert "ranks=range(9223372036854775808, -1, -1) must hold rank counts >= 1" in out["refused"][1]
    assert f"ranks= lists over {MAX_RANKS} rank counts" in out["refused"][2]
    assert "switch: more than the program's 4 ranks in the group" in out["range"]
    assert "switch: more than the program's 4 ranks in the group" in out["count"]
    assert (out["list"], out["verify"], out["compile"]) == (0, 0, 0)


def _mscclpp_with_chunks(chunks: int) -> str:
    from msc.formats.mscclpp.export import plan_to_mscclpp

    doc = plan_to_mscclpp(lower(msc.trace(algorithms()["allgather/ring:ring"], 4), LowerOptions()))
    for gpu in doc["gpus"]:
        gpu["input_chunks"] = gpu["output_chunks"] = chunks
    return json.dumps(doc)


def test_an_mscclpp_plan_of_2_to_the_40_chunks_is_refused_as_it_is_read(tmp_path):
    """The chunk factor search walked k = 1 .. 2**40 before the size check
    (msc verify, run, import, diff and simulate spun): the reader holds
    buffer sizes to msc's limit, and at the limit the model's size check
    comes before any input is made (it made 4 GiB of them)."""
    from msc.cli.main import main
    from msc.formats.mscclpp.reader import parse_mscclpp
    from msc.formats.mscclpp.check import verify_mscclpp
    from msc.ir.limits import MAX_BUFFER_CHUNKS

    text = _mscclpp_with_chunks(2**40)
    with pytest.raises(PlanError, match=f"rank 0: input_chunks is {2**40}, over msc's limit of {MAX_BUFFER_CHUNKS} "
                                        f"chunks a buffer"):
        parse_mscclpp(text)
    (tmp_path / "big.json").write_text(text)
    for command in (["verify"], ["run"], ["import", "-o", "x.plan"], ["diff", "big.json"],
                    ["simulate", "-t", "ring:4"]):
        argv = [command[0], str(tmp_path / "big.json")] + [str(tmp_path / a) if a.endswith(("json", "plan")) else a
                                                          for a in command[1:]]
        assert main(argv) == 2, command
    start = time.process_time()
    with pytest.raises(PlanError, match="over the 268435456 msc's model of the executor runs it with"):
        verify_mscclpp(parse_mscclpp(_mscclpp_with_chunks(MAX_BUFFER_CHUNKS)))
    assert time.process_time() - start < 5
