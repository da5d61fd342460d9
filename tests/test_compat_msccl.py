"""The MSCCLang compatibility layer (msc.compat.msccl): examples verify
through `msc verify`, semantics follow MSCCLang, errors carry the user's line."""
import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

import msc
from msc import cli
from msc.compat import msccl
from msc.compat.msccl import (AllGather, AllReduce, AllToAll, Buffer, Check, MSCCLProgram, ReduceScatter,
                              ThreadblockPolicy, XML, chunk, fully_connected, line, ring, star)
from msc.ir import OpKind
from msc.loader import is_msccl_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _lineno() -> int:
    """The caller's line (use on the same line as the operation)."""
    return sys._getframe(1).f_lineno


def _verify_cli(capsys, *argv):
    rc = cli.main(["verify", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


# -- the examples, through `msc verify` ------------------------------------------------
@pytest.mark.parametrize("example, name, extra", [
    ("msccl_allreduce_ring.py", "allreduce_ring", []),
    ("msccl_allreduce_ring.py", "allreduce_ring", ["--channels", "3"]),
    ("msccl_allgather_ring.py", "allgather_ring", []),
    ("msccl_allgather_ring.py", "allgather_ring", ["--chunks", "2", "--out-of-place"]),
    ("msccl_alltoall_allpairs.py", "alltoall_allpairs", []),
    ("msccl_alltoall_allpairs.py", "alltoall_allpairs", ["--via-scratch"]),
])
@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_examples_verify(capsys, example, name, extra, ranks):
    path = EXAMPLES / example
    assert is_msccl_script(path)
    rc, out, err = _verify_cli(capsys, path, "--", ranks, 1, "Simple", *extra)
    assert rc == 0, err
    assert out.startswith(f"verified: {name} (")
    assert f"{ranks} ranks" in out
    assert err == ""  # XML() printed nothing under msc verify


def test_example_through_the_msc_command():
    proc = subprocess.run([sys.executable, "-m", "msc.cli", "verify", str(EXAMPLES / "msccl_allreduce_ring.py"),
                           "--", "8", "1", "Simple"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "verified: allreduce_ring (allreduce, 8 ranks, 112 ops" in proc.stdout


def test_script_arguments_reach_argparse(capsys):
    rc, out, err = _verify_cli(capsys, EXAMPLES / "msccl_allreduce_ring.py", "--", 4, 1, "NotAProtocol")
    assert rc == 2
    assert "exited with status 2" in err


# -- a broken program ----------------------------------------------------------------
BROKEN = """\
from msc.compat.msccl import *

with MSCCLProgram("broken_allgather", fully_connected(3), AllGather(3, 1, False), 1):
    for r in range(3):
        for dst in range(3):
            if (r, dst) != (0, 2):
                chunk(r, Buffer.input, 0).copy(dst, Buffer.output, r)
    chunk(1, Buffer.input, 0).copy(2, Buffer.output, 0)
    {check}
"""
BROKEN_LINE = 8


@pytest.mark.parametrize("check", ["Check()", "pass"])
def test_broken_script_fails_verification_with_its_line(tmp_path, capsys, check):
    script = tmp_path / "broken.py"
    script.write_text(BROKEN.format(check=check))
    rc, out, err = _verify_cli(capsys, script)
    assert rc == 1
    assert "verification failed" in err
    assert "rank 2 output[0]" in err
    assert f"broken.py:{BROKEN_LINE}:" in err
    assert "input[0] of rank 0" in err and "foreign input[0] of rank 1" in err


def test_broken_script_json(tmp_path, capsys):
    script = tmp_path / "broken.py"
    script.write_text(BROKEN.format(check="Check()"))
    rc, out, err = _verify_cli(capsys, script, "--json")
    assert rc == 1
    detail = json.loads(out)
    assert (detail["rank"], detail["buffer"], detail["index"], detail["line"]) == (2, "output", 0, BROKEN_LINE)


def test_check_raises_verification_error_in_process():
    with pytest.raises(msc.VerificationError) as info:
        with MSCCLProgram("missing_step", fully_connected(3), AllReduce(3, 1, True), 1):
            chunk(1, Buffer.input, 0).reduce(chunk(0, Buffer.input, 0))
            chunk(1, Buffer.input, 0).copy(0, Buffer.input, 0); line = _lineno()  # noqa: E702
            chunk(1, Buffer.input, 0).copy(2, Buffer.input, 0)
            Check()
    err = info.value
    assert not isinstance(err, msc.OperationError)
    assert (err.rank, err.index) == (0, 0)
    assert err.where.line == line and os.path.samefile(err.where.file, __file__)
    assert err.expected == "input[0] of ranks 0-2" and "missing input[0] of rank 2" in err.found


def test_check_returns_true():
    with MSCCLProgram("ok", fully_connected(2), AllGather(2, 1, True), 1):
        chunk(0, Buffer.input, 0).copy(1, Buffer.output, 0)
        chunk(1, Buffer.input, 0).copy(0, Buffer.output, 1)
        assert Check() is True


# -- user lines and hints --------------------------------------------------------------
def test_ops_carry_the_users_file_and_line():
    def helper(c, dst):
        return c.copy(dst, Buffer.output, 0), _lineno()

    with MSCCLProgram("lines", fully_connected(3), AllReduce(3, 1, False), 1) as p:
        acc = chunk(0, Buffer.input, 0).copy(0, Buffer.output, 0); first = _lineno()  # noqa: E702
        acc.reduce(chunk(1, Buffer.input, 0)); second = _lineno()  # noqa: E702
        _, third = helper(acc, 2)
    ops = p.program.ops
    assert [op.where.line for op in ops] == [first, second, third]
    assert all(os.path.samefile(op.where.file, __file__) for op in ops)


def test_hints_map_onto_op_fields():
    with MSCCLProgram("hints", fully_connected(2), AllReduce(2, 2, True), 1,
                      threadblock_policy=ThreadblockPolicy.manual) as p:
        chunk(0, Buffer.input, 0).copy(1, Buffer.input, 0, sendtb=1, recvtb=2, ch=3)
        chunk(0, Buffer.input, 1).copy(1, Buffer.input, 1)
        chunk(1, Buffer.input, 1).reduce(chunk(0, Buffer.input, 0), sendtb=4, recvtb=5, ch=6)
        chunk(1, Buffer.input, 0).copy(0, Buffer.scratch, 0, 0, -1, 1)  # positional, as MSCCLang allows
        with pytest.raises(msc.OperationError, match="sendtb=-2"):
            chunk(0, Buffer.input, 0).copy(1, Buffer.input, 0, sendtb=-2)
    hints = [(op.kind, op.sendtb, op.recvtb, op.channel) for op in p.program.ops]
    assert hints == [(OpKind.COPY, 1, 2, 3), (OpKind.COPY, None, None, None),
                     (OpKind.REDUCE, 4, 5, 6), (OpKind.COPY, 0, None, 1)]


# -- MSCCLang's conventions ---------------------------------------------------------------
def test_inplace_allgather_aliases_input_into_output():
    n, k = 3, 2
    with MSCCLProgram("ag", fully_connected(n), AllGather(n, k, True), 1) as p:
        for r in range(n):
            for i in range(k):
                ref = chunk(r, Buffer.input, i)
                assert ref == chunk(r, Buffer.output, r * k + i)
                assert (ref.buffer, ref.index) == (Buffer.output, r * k + i)
                assert (ref.get_origin_rank(), ref.get_origin_index(), ref.get_dst_index()) == (r, i, r * k + i)
        # Copying input to its own output slot is dropped, as in MSCCLang.
        same = chunk(1, Buffer.input, 0).copy(1, Buffer.output, k)
        assert same == chunk(1, Buffer.output, k) and p.program.ops == []
        # No buffer: the same physical place on the destination (output[1*k+1] of rank 2).
        chunk(1, Buffer.input, 1).copy(2)
        assert chunk(2, Buffer.output, k + 1).get_origin_rank() == 1
        # An explicit input buffer is aliased with the destination's layout.
        chunk(1, Buffer.input, 1).copy(0, Buffer.input, 0)
    ops = [(op.dst_rank, op.dst_buffer, op.dst_index) for op in p.program.ops]
    assert ops == [(2, "output", k + 1), (0, "output", 0)]


def test_out_of_place_allgather_output_starts_empty():
    with MSCCLProgram("ag", fully_connected(2), AllGather(2, 1, False), 1):
        assert chunk(0, Buffer.output, 0) is None
        assert chunk(0, Buffer.input, 0) is not None
        out = chunk(0, Buffer.input, 0).copy(0, Buffer.output, 0)
        assert chunk(0, Buffer.output, 0) == out
        assert out.get_origin_rank() == 0


def test_allreduce_inplace_and_out_of_place():
    with MSCCLProgram("in", fully_connected(2), AllReduce(2, 1, True), 1):
        assert chunk(1, Buffer.output, 0) == chunk(1, Buffer.input, 0) is not None
        assert chunk(1, Buffer.output, 0).buffer == Buffer.input
    with MSCCLProgram("out", fully_connected(2), AllReduce(2, 1, False), 1):
        assert chunk(1, Buffer.output, 0) is None
        with pytest.raises(msc.OperationError, match="read-only"):
            chunk(0, Buffer.input, 0).copy(1, Buffer.input, 0)


@pytest.mark.parametrize("inplace", [True, False])
def test_reduce_scatter_ring_in_both_forms(inplace):
    n = 4
    with MSCCLProgram("rs", fully_connected(n), ReduceScatter(n, 1, inplace), 1) as p:
        if inplace:
            assert chunk(2, Buffer.output, 0) == chunk(2, Buffer.input, 2)
        for b in range(n):
            acc = chunk((b + 1) % n, Buffer.input, b)
            for step in range(2, n):
                rank = (b + step) % n
                acc = chunk(rank, Buffer.input, b).copy(rank, "partial", b).reduce(acc)
            # In place output[0] of rank b is input[b]: the local copy is dropped.
            chunk(b, Buffer.input, b).copy(b, Buffer.output, 0).reduce(acc)
        assert Check()
    local_copies = sum(op.kind is OpKind.COPY and op.dst_buffer != "partial" for op in p.program.ops)
    assert local_copies == (0 if inplace else n)


def test_reduce_scatter_output_index_is_checked_before_aliasing():
    with MSCCLProgram("rs", fully_connected(2), ReduceScatter(2, 1, True), 1):
        with pytest.raises(msc.OperationError, match="index out of range"):
            chunk(0, Buffer.output, 1)  # would alias input[1], but output has 1 chunk


def test_alltoall_chunk_metadata():
    n, k = 3, 2
    with MSCCLProgram("a2a", fully_connected(n), AllToAll(n, k, False), 1):
        for r in range(n):
            for i in range(n * k):
                c = chunk(r, Buffer.input, i)
                assert (c.get_origin_rank(), c.get_origin_index()) == (r, i)
                assert (c.get_dst_rank(), c.get_dst_index()) == (i // k, r * k + i % k)
        pair = chunk(0, Buffer.input, 0, 2)
        assert pair.get_dst_index(1) == 1
        summed = chunk(1, Buffer.input, 0).copy(1, Buffer.scratch).reduce(chunk(0, Buffer.input, 0))
        with pytest.raises(msc.OperationError, match="reduction"):
            summed.get_origin_rank()
        with pytest.raises(msc.OperationError, match="holds no chunk"):
            chunk(0, Buffer.input, 0).copy(1, Buffer.scratch, 4)
            chunk(1, Buffer.scratch, 4, 2).get_dst_rank(1)  # the first slot decides; the second is empty


def test_scratch_buffers_append_at_index_minus_one():
    with MSCCLProgram("scratch", fully_connected(3), AllToAll(3, 1, False), 1) as p:
        assert chunk(1, Buffer.scratch, 0) is None
        assert chunk(1, "copy_0", 0) is None
        a = chunk(0, Buffer.input, 1).copy(1, Buffer.scratch)
        b = chunk(2, Buffer.input, 1).copy(1, Buffer.scratch)
        c = chunk(0, Buffer.input, 2).copy(1, "copy_0")
        assert [(r.buffer, r.index) for r in (a, b, c)] == [("scratch", 0), ("scratch", 1), ("copy_0", 0)]
        assert chunk(1, Buffer.scratch, 1).get_origin_rank() == 2
        d = chunk(0, Buffer.input, 1).copy(1, Buffer.scratch, 5)
        assert chunk(1, Buffer.scratch, 3) is None
        e = chunk(0, Buffer.input, 1).copy(1, Buffer.scratch)
        assert (d.index, e.index) == (5, 6)
    assert p.program.scratch_sizes[(1, "scratch")] == 7


def test_split_and_group():
    with MSCCLProgram("sg", fully_connected(2), AllReduce(2, 4, True), 1):
        whole = chunk(0, Buffer.input, 0, 4)
        parts = whole.split(2)
        assert [(r.index, r.size) for r in parts] == [(0, 2), (2, 2)]
        assert parts[1].group(parts[0]) == whole
        assert isinstance(parts[0], msccl.Ref) and parts[0].prog.name == "sg"
        overlap = chunk(0, Buffer.input, 1, 2).group(chunk(0, Buffer.input, 0, 2))
        assert (overlap.index, overlap.size) == (0, 3)
        with pytest.raises(msc.OperationError, match="gap"):
            chunk(0, Buffer.input, 0).group(chunk(0, Buffer.input, 2))
        with pytest.raises(msc.OperationError, match="not on rank"):
            chunk(0, Buffer.input, 0).group(chunk(1, Buffer.input, 1))
        with pytest.raises(msc.OperationError, match="split"):
            whole.split(3)
        out = whole.copy(1)
        assert (out.rank, out.buffer, out.index, out.size) == (1, "input", 0, 4)


# -- topologies ---------------------------------------------------------------------
def test_topology_helpers():
    t = fully_connected(4)
    assert (t.num_ranks, t.ngpus, t.num_nodes()) == (4, 4, 4)
    assert t.link(0, 3) and not t.link(2, 2)
    r = ring(4)
    assert sorted(r.destinations(0)) == [1, 3] and sorted(r.sources(2)) == [1, 3]
    assert sorted(line(4).destinations(0)) == [1] and sorted(line(4).destinations(2)) == [1, 3]
    assert sorted(star(4).destinations(0)) == [1, 2, 3] and sorted(star(4).destinations(2)) == [0]
    with pytest.raises(msc.AlgorithmError):
        fully_connected(0)


def test_copies_need_a_link():
    with MSCCLProgram("ring", ring(4), AllReduce(4, 1, True), 1) as p:
        chunk(0, Buffer.input, 0).copy(1)
        with pytest.raises(msc.OperationError, match="no link from rank 0 to rank 2") as info:
            bad = _lineno(); chunk(0, Buffer.input, 0).copy(2)  # noqa: E702
        assert info.value.where.line == bad
        with pytest.raises(msc.OperationError, match="no link from rank 2 to rank 0"):
            chunk(0, Buffer.input, 0).reduce(chunk(2, Buffer.input, 0))
    assert len(p.program.ops) == 1


# -- programs, options, collecting -----------------------------------------------------
def test_program_keeps_lowering_options():
    prog = MSCCLProgram("opts", fully_connected(2), AllGather(2, 1, True), 3, protocol="LL128",
                        threadblock_policy=ThreadblockPolicy.manual, instr_fusion=False)
    assert prog.program is None
    with prog:
        assert isinstance(prog.program, msc.Program)
    assert (prog.instances, prog.protocol, prog.threadblock_policy, prog.instr_fusion) == \
        (3, "LL128", ThreadblockPolicy.manual, False)
    assert prog.program.params["instances"] == 3 and prog.program.params["threadblock_policy"] == "manual"
    assert isinstance(prog.program.ops, tuple)  # sealed on exit
    assert (prog.program.collective, prog.program.inplace, prog.program.chunk_factor) == ("allgather", True, 1)


def test_collecting_gathers_finished_programs():
    with msccl.collecting() as programs:
        with MSCCLProgram("first", fully_connected(2), AllReduce(2, 1, True), 1):
            XML()  # nothing under collecting()
        with pytest.raises(ZeroDivisionError):
            with MSCCLProgram("failed", fully_connected(2), AllReduce(2, 1, True), 1):
                1 / 0
        with MSCCLProgram("second", fully_connected(2), AllToAll(2, 1, False), 1):
            pass
    assert [p.name for p in programs] == ["first", "second"]
    assert all(isinstance(p, msc.Program) for p in programs)


def test_xml_without_the_lowering_stage(monkeypatch):
    monkeypatch.setitem(sys.modules, "msc.xml_export", None)
    with MSCCLProgram("x", fully_connected(2), AllReduce(2, 1, True), 1):
        with pytest.raises(msc.MscError, match="lowering stage"):
            XML()


def test_xml_calls_the_exporter(monkeypatch, capsys):
    calls = []

    def program_to_xml(program, **options):
        calls.append((program, options))
        return "<algo/>"

    monkeypatch.setitem(sys.modules, "msc.xml_export", types.SimpleNamespace(program_to_xml=program_to_xml))
    with MSCCLProgram("x", fully_connected(2), AllReduce(2, 1, True), 2, protocol="LL",
                      threadblock_policy=ThreadblockPolicy.manual):
        chunk(0, Buffer.input, 0).copy(1)
        XML()
    assert capsys.readouterr().out == "<algo/>\n"
    (program, options), = calls
    assert options == {"instances": 2, "protocol": "LL", "threadblock_policy": "manual", "instr_fusion": True,
                       "name": "x"}
    assert len(program.ops) == 1 and isinstance(program.ops, tuple)


# -- misuse ---------------------------------------------------------------------------------
def test_module_functions_need_a_program():
    for fn, args in ((chunk, (0, Buffer.input, 0)), (Check, ()), (XML, ())):
        with pytest.raises(msc.AlgorithmError, match="MSCCLProgram") as info:
            here = _lineno(); fn(*args)  # noqa: E702
        assert info.value.where.line == here


def test_nested_programs_are_an_error():
    outer = MSCCLProgram("outer", fully_connected(2), AllReduce(2, 1, True), 1)
    inner = MSCCLProgram("inner", fully_connected(2), AllReduce(2, 1, True), 1)
    with pytest.raises(msc.AlgorithmError, match="'inner' is opened inside MSCCLProgram 'outer'"):
        with outer:
            with inner:
                pass
    with pytest.raises(msc.AlgorithmError, match="already traced"):
        with outer:
            pass
    with MSCCLProgram("after", fully_connected(2), AllReduce(2, 1, True), 1):  # the stack is clean again
        assert chunk(0, Buffer.input, 0) is not None


def test_current_program_is_context_local():
    seen = []

    def other_thread():
        try:
            chunk(0, Buffer.input, 0)
        except msc.AlgorithmError as exc:
            seen.append(exc)

    with MSCCLProgram("main", fully_connected(2), AllReduce(2, 1, True), 1):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert len(seen) == 1


def test_refs_cannot_change_a_finished_program():
    with MSCCLProgram("done", fully_connected(2), AllReduce(2, 1, True), 1):
        ref = chunk(0, Buffer.input, 0)
    with pytest.raises(msc.OperationError, match="finished tracing"):
        ref.copy(1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(protocol="LL64"), "protocol must be one of Simple, LL, LL128"),
    (dict(instances=0), "instances must be an int >= 1"),
    (dict(topo=fully_connected(3)), "topology has 3 ranks but the collective has 2"),
    (dict(collective="allreduce"), "collective must be"),
    (dict(threadblock_policy="greedy"), "threadblock_policy"),
])
def test_bad_program_arguments(kwargs, message):
    args = dict(name="bad", topo=fully_connected(2), collective=AllReduce(2, 1, True), instances=1)
    args.update(kwargs)
    with pytest.raises(msc.AlgorithmError, match=message):
        MSCCLProgram(**args)


def test_bad_locations():
    with MSCCLProgram("loc", fully_connected(2), AllReduce(2, 1, True), 1):
        with pytest.raises(msc.OperationError, match="rank 2 does not exist"):
            chunk(2, Buffer.input, 0)
        with pytest.raises(msc.OperationError, match="index out of range"):
            chunk(0, Buffer.input, 1)
        with pytest.raises(msc.OperationError, match="buffer must be"):
            chunk(0, 3, 0)
        with pytest.raises(msc.OperationError, match="rank 5 does not exist"):
            chunk(0, Buffer.input, 0).copy(5)
        with pytest.raises(msc.OperationError, match="chunk reference"):
            chunk(0, Buffer.input, 0).reduce(None)


def test_none_chunk_under_msc_verify_names_the_line(tmp_path, capsys):
    script = tmp_path / "none_chunk.py"
    script.write_text("from msc.compat.msccl import *\n"
                      "with MSCCLProgram('p', fully_connected(2), AllReduce(2, 1, False), 1):\n"
                      "    chunk(0, Buffer.output, 0).copy(1, Buffer.output, 0)\n")
    rc, out, err = _verify_cli(capsys, script)
    assert rc == 2
    assert "none_chunk.py:3:" in err and "NoneType" in err


def test_star_import_exports_the_mscclang_names():
    namespace = {}
    exec("from msc.compat.msccl import *", namespace)
    names = set(namespace) - {"__builtins__"}
    assert {"MSCCLProgram", "chunk", "Check", "XML", "Buffer", "ThreadblockPolicy", "fully_connected",
            "AllReduce", "AllGather", "ReduceScatter", "AllToAll"} <= names
    assert not names & {"msc", "collecting", "verify", "user_line", "contextvars", "importlib"}
    assert str(Buffer.input) == "input" and Buffer.output == "output"


def test_custom_collective_through_native():
    class SendNext(msccl.Collective):
        native = msc.CustomCollective("send_next", input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,
                                      postcondition=lambda r, i, n, k: [((r - 1) % n, i)])

    n = 3
    with MSCCLProgram("send_next", fully_connected(n), SendNext(n, 1, False), 1) as p:
        for r in range(n):
            chunk(r, Buffer.input, 0).copy((r + 1) % n, Buffer.output, 0)
        assert Check()
    assert p.program.collective == "send_next"
    with pytest.raises(msc.VerificationError, match="rank 0 output\\[0\\]"):
        with MSCCLProgram("send_self", fully_connected(n), SendNext(n, 1, False), 1):
            for r in range(n):
                chunk(r, Buffer.input, 0).copy(r, Buffer.output, 0)
            Check()


def test_mscclang_style_custom_collective_is_refused_clearly():
    class CollEx(msccl.Collective):
        def init_buffers(self):
            return []

        def check(self, prog):
            return True

    prog = MSCCLProgram("custom", fully_connected(2), CollEx(2, 1, False), 1)
    with pytest.raises(msc.AlgorithmError, match="msc.CustomCollective"):
        with prog:
            pass


def test_compile_script_with_options_before_the_script_arguments(tmp_path):
    # "-o OUT -- ARGS": everything after -- belongs to the script; two instances of
    # a manual-policy program get their own threadblocks (hints shifted per instance).
    from msc.cli import main
    from msc.plan_text import load_plan

    out = tmp_path / "ring.plan"
    assert main(["compile", str(EXAMPLES / "msccl_allreduce_ring.py"), "-o", str(out), "--", "4", "2", "LL"]) == 0
    plan = load_plan(out)
    assert (plan.num_ranks, plan.instances, plan.protocol) == (4, 2, "LL")
    assert {tb.channel for tb in plan.ranks[0].threadblocks} == {0, 1}



CHECKED_SCRIPT = """from msc.compat.msccl import *

with MSCCLProgram("gather2", fully_connected(2), AllGather(2, 1, True), 1):
    chunk(0, Buffer.input, 0).copy(1, Buffer.output, 0)
    chunk(1, Buffer.input, 0).copy(0, Buffer.output, 1)
    {middle}
    chunk(1, Buffer.input, 0).copy(0, Buffer.output, 1)    # again: still right, but unseen by a Check() above
    {end}
"""


@pytest.mark.parametrize("middle, end, verifications", [
    ("pass", "Check()", 1),         # Check() saw every op: msc verify reuses its report
    ("Check()", "pass", 2),         # it missed the last op: msc verify verifies the whole program
    ("pass", "pass", 1),
])
def test_msc_verify_does_not_verify_a_checked_script_twice(tmp_path, capsys, monkeypatch, middle, end,
                                                           verifications):
    calls = []
    real = msc.verify

    def counting(program):
        calls.append(len(program.ops))
        return real(program)

    monkeypatch.setattr(msc, "verify", counting)
    monkeypatch.setattr("msc.compat.msccl.verify", counting)
    script = tmp_path / "gather2.py"
    script.write_text(CHECKED_SCRIPT.format(middle=middle, end=end))
    rc, out, err = _verify_cli(capsys, script)
    assert rc == 0, err
    assert "verified: gather2" in out
    assert len(calls) == verifications and calls[-1] == 3
