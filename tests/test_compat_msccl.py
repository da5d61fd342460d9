"""The MSCCLang compatibility layer (msc.compat.msccl): examples verify
through `msc verify`, semantics follow MSCCLang, errors carry the user's line."""
import json
import os
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import msc
from msc.cli import main as cli
from msc.compat import msccl
from msc.compat.msccl import (AllGather, AllReduce, AllToAll, Buffer, Check, MSCCLProgram, Print, ReduceScatter,
                              ThreadblockPolicy, XML, chunk, create_scratch, fully_connected, line, ring, star)
from msc.ir import OpKind
from msc.dsl.loader import is_msccl_script

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
        traced = [(op.kind, op.sendtb, op.recvtb, op.channel) for op in p.program.ops]
    assert traced == [(OpKind.COPY, 1, 2, 3), (OpKind.COPY, None, None, None),
                      (OpKind.REDUCE, 4, 5, 6), (OpKind.COPY, 0, None, 1)]
    # Manual policy: a send or receive with no hint goes to one more threadblock of its
    # rank (MSCCLang's threadblock -1), one past the highest hint the rank uses (0: 4, 1: 5).
    final = [(op.kind, op.sendtb, op.recvtb, op.channel) for op in p.program.ops]
    assert final == [(OpKind.COPY, 1, 2, 3), (OpKind.COPY, 5, 6, None),
                     (OpKind.REDUCE, 4, 5, 6), (OpKind.COPY, 0, 5, 1)]


def test_manual_policy_without_hints_lowers_like_mscclang():
    # MSCCLang's allpairs-style program that hints only some threadblocks.
    with MSCCLProgram("partly_hinted", fully_connected(3), AllGather(3, 1, True), 1,
                      threadblock_policy=ThreadblockPolicy.manual) as p:
        for r in range(3):
            chunk(r, Buffer.input, 0).copy((r + 1) % 3, Buffer.input, 0, sendtb=0, recvtb=1)
            chunk(r, Buffer.input, 0).copy((r + 2) % 3, Buffer.input, 0)
        Check()
    from msc.lower.pipeline import LowerOptions, lower

    plan = lower(p.program, LowerOptions(threadblocks="manual"))
    assert [len(rank.threadblocks) for rank in plan.ranks] == [3, 3, 3]


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
        # An explicit input buffer is placed with the *source* rank's layout, as in
        # MSCCLang: rank 1's input[0] is output[1*k+0], on rank 0 too.
        chunk(1, Buffer.input, 1).copy(0, Buffer.input, 0)
    ops = [(op.dst_rank, op.dst_buffer, op.dst_index) for op in p.program.ops]
    assert ops == [(2, "output", k + 1), (0, "output", k)]


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
        with MSCCLProgram("first", fully_connected(1), AllReduce(1, 1, True), 1):
            XML()  # nothing under collecting()
        with pytest.raises(ZeroDivisionError):
            with MSCCLProgram("failed", fully_connected(2), AllReduce(2, 1, True), 1):
                1 / 0
        with MSCCLProgram("second", fully_connected(1), AllToAll(1, 1, False), 1):
            chunk(0, Buffer.input, 0).copy(0, Buffer.output, 0)
    assert [p.name for p in programs] == ["first", "second"]
    assert all(isinstance(p, msc.Program) for p in programs)
    # each is verified as its block ends; msc verify reuses the report
    assert [msccl._CHECKED[p][0] for p in programs] == [0, 1]
    assert all(isinstance(msccl.checked_report(p), msc.Report) for p in programs)


def test_collecting_verifies_at_the_end_of_the_block_with_its_line():
    with msccl.collecting():
        with pytest.raises(msc.VerificationError, match="rank 0 output\\[1\\] was never written") as info:
            program = MSCCLProgram("nothing", fully_connected(2), AllToAll(2, 1, False), 1); line = _lineno()  # noqa: E702
            with program:
                chunk(0, Buffer.input, 0).copy(0, Buffer.output, 0)
    assert info.value.where.line == line


def test_xml_prints_the_lowered_program(capsys):
    with MSCCLProgram("x", fully_connected(2), AllReduce(2, 1, True), 2, protocol="LL",
                      threadblock_policy=ThreadblockPolicy.manual):
        chunk(0, Buffer.input, 0).copy(1, Buffer.scratch, 0)
        chunk(1, Buffer.input, 0).reduce(chunk(1, Buffer.scratch, 0))
        chunk(1, Buffer.input, 0).copy(0, Buffer.input, 0)
        XML()
    algo = ET.fromstring(capsys.readouterr().out)
    # what XML() was given reaches the XML: the name, the protocol, and 2 instances of 1 channel each
    assert [algo.get(a) for a in ("name", "proto", "nchannels", "coll")] == ["x", "LL", "2", "allreduce"]
    assert all(tb.get("chan") in ("0", "1") for tb in algo.iter("tb"))


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
        with pytest.raises(msc.OperationError, match="must be hashable"):
            chunk(0, [3], 0)
        with pytest.raises(msc.OperationError, match="buffer must be"):
            chunk(0, None, 0)
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


# -- MSCCLang's custom collectives (Collective subclasses) -----------------------------------
class AllToNext(msccl.Collective):
    """Rank r's k input chunks must end in rank r+1's output (pipeline
    parallelism); the last rank sends nothing, rank 0 receives nothing."""

    def init_buffers(self):
        n, k = self.num_ranks, self.chunk_factor
        return [{Buffer.input: [msccl.Chunk(r, c, r + 1, c) if r + 1 < n else None for c in range(k)],
                 Buffer.output: [None] * k} for r in range(n)]

    def check(self, prog):
        correct = True
        for r in range(1, self.num_ranks):
            for c in range(self.chunk_factor):
                got = prog.buffers[r][Buffer.output][c]
                if got is None or (got.origin_rank, got.origin_index) != (r - 1, c):
                    print(f"Rank {r} chunk {c} is incorrect should be ({r - 1}, {c}) given {got}")
                    correct = False
        return correct


def _all_to_next(n, k, hops):
    """Each chunk goes through a scratch buffer named by a tuple, then to the
    place its Chunk names (get_dst_rank/get_dst_index)."""
    lines = []
    for r in range(n - 1):
        for c in range(k):
            ref = chunk(r, Buffer.input, c)
            if hops:
                ref = ref.copy(r, ("hop", r, r + 1))
            ref.copy(ref.get_dst_rank(), Buffer.output, ref.get_dst_index()); lines.append(_lineno())  # noqa: E702
    return lines


@pytest.mark.parametrize("hops", [False, True])
def test_custom_collective_in_mscclang_style_verifies(hops):
    n, k = 4, 2
    # inplace=True as in MSCCLang's alltonext: the buffers do not alias, so msc lowers it out of place
    with MSCCLProgram("all_to_next", fully_connected(n), AllToNext(n, k, True), 1) as p:
        assert chunk(n - 1, Buffer.input, 0) is None and chunk(1, Buffer.output, 0) is None
        _all_to_next(n, k, hops)
        assert Check() is True
        assert p.buffers[1][Buffer.output][1] == msccl.Chunk(0, 1)
    native = p.program
    assert (native.collective, native.inplace) == ("AllToNext", False)
    report = msc.verify(native)
    assert report.output_chunks == (n - 1) * k      # the chunks check() read: rank 0's output is free
    if hops:
        assert native.scratch_sizes[(0, "('hop', 0, 1)")] == k


def test_custom_collective_check_failure_names_the_chunk_and_its_writer():
    n, k = 4, 1
    with MSCCLProgram("skips", fully_connected(n), AllToNext(n, k, False), 1):
        for r in range(n - 1):
            chunk(r, Buffer.input, 0).copy(min(r + 2, n - 1), Buffer.output, 0)
        with pytest.raises(msc.VerificationError) as info:
            check_line = _lineno(); Check()  # noqa: E702
    err = info.value
    assert "check() of collective AllToNext returned False; it printed:" in str(err)
    assert "Rank 1 chunk 0 is incorrect should be (0, 0) given None" in str(err)
    assert (err.rank, err.buffer, err.index) == (1, "output", 0)
    assert err.where.line == check_line     # rank 1 output[0] was never written: the Check() line
    with MSCCLProgram("wrong_chunk", fully_connected(n), AllToNext(n, k, False), 1):
        for r in range(n - 1):
            chunk(r, Buffer.input, 0).copy(r + 1, Buffer.output, 0)
        chunk(0, Buffer.input, 0).copy(2, Buffer.output, 0); wrong = _lineno()  # noqa: E702
        with pytest.raises(msc.VerificationError) as info:
            Check()
    assert (info.value.rank, info.value.index) == (2, 0) and info.value.where.line == wrong


ALL_TO_NEXT_SCRIPT = """\
from msc.compat.msccl import *

class AllToNext(Collective):
    def init_buffers(self):
        n, k = self.num_ranks, self.chunk_factor
        return [{Buffer.input: [Chunk(r, c, r + 1, c) if r + 1 < n else None for c in range(k)],
                 Buffer.output: [None] * k} for r in range(n)]

    def check(self, prog):
        return all(prog.buffers[r][Buffer.output][0] == Chunk(r - 1, 0) for r in range(1, self.num_ranks))

with MSCCLProgram("all_to_next", fully_connected(3), AllToNext(3, 1, True), 1):
    chunk(0, Buffer.input, 0).copy(1, Buffer.output, 0)
    chunk(1, Buffer.input, 0).copy(DST, Buffer.output, 0)
    XML()
    CHECK
"""


@pytest.mark.parametrize("dst, check, rc", [(2, "Check()", 0), (2, "pass", 0), (1, "Check()", 1), (1, "pass", 1)])
def test_custom_collective_script_under_msc_verify(tmp_path, capsys, dst, check, rc):
    script = tmp_path / "all_to_next.py"
    script.write_text(ALL_TO_NEXT_SCRIPT.replace("DST", str(dst)).replace("CHECK", check))
    code, out, err = _verify_cli(capsys, script)
    assert code == rc, err
    if rc == 0:
        assert out.startswith("verified: all_to_next (AllToNext, 3 ranks, 2 ops")
    else:   # Check()'s line, or without one the MSCCLProgram line
        assert f"all_to_next.py:{16 if check == 'Check()' else 12}: check() of collective AllToNext returned False" in err


def test_custom_collective_xml_is_custom(capsys):
    pytest.importorskip("msc.formats.xml_export")
    with MSCCLProgram("all_to_next", fully_connected(3), AllToNext(3, 1, False), 1):
        _all_to_next(3, 1, hops=False)
        XML()
    xml = capsys.readouterr().out
    assert 'coll="custom"' in xml and 'ngpus="3"' in xml


class GatherInPlace(msccl.Collective):
    """An allgather written as a custom collective: input i of rank r lives
    at output r*k+i (get_buffer_index), as MSCCLang's own AllGather does."""

    def init_buffers(self):
        n, k = self.num_ranks, self.chunk_factor
        ranks = []
        for r in range(n):
            out = [None] * (n * k)
            out[r * k:(r + 1) * k] = [msccl.Chunk(r, i, -1, r * k + i) for i in range(k)]
            ranks.append({Buffer.input: out[r * k:(r + 1) * k], Buffer.output: out})
        return ranks

    def get_buffer_index(self, rank, buffer, index):
        if self.inplace and buffer == Buffer.input:
            return Buffer.output, index + rank * self.chunk_factor
        return buffer, index

    def check(self, prog):
        n, k = self.num_ranks, self.chunk_factor
        return all(prog.buffers[r][Buffer.output][j] == msccl.Chunk(j // k, j % k)
                   for r in range(n) for j in range(n * k))


class SumOneList(msccl.Collective):
    """An allreduce whose input and output are one list (MSCCLang's in-place AllReduce)."""

    def init_buffers(self):
        ranks = []
        for r in range(self.num_ranks):
            data = [msccl.Chunk(r, c, -1, c) for c in range(self.chunk_factor)]
            ranks.append({Buffer.input: data, Buffer.output: data})
        return ranks

    def check(self, prog):
        want = msccl.ReduceChunk(-1, [])
        for r in range(self.num_ranks):
            want = want.reduce(-1, msccl.Chunk(r, 0))
        return all(prog.buffers[r][Buffer.output][0] == want for r in range(self.num_ranks))


def test_custom_collectives_in_place():
    n = 3
    with MSCCLProgram("gather", fully_connected(n), GatherInPlace(n, 1, True), 1) as p:
        assert chunk(2, Buffer.input, 0) == chunk(2, Buffer.output, 2)
        for r in range(n):
            for d in range(n):
                if d != r:   # the source's layout places it: output[r] of d
                    chunk(r, Buffer.input, 0).copy(d, Buffer.input, 0)
        assert Check()
    assert p.program.layout.alias_table == ("input", "output", (0, 1, 2))
    with MSCCLProgram("sum", fully_connected(n), SumOneList(n, 1, True), 1) as p:
        acc = chunk(0, Buffer.input, 0)
        for r in range(1, n):
            acc = chunk(r, Buffer.input, 0).reduce(acc)
        for r in range(n - 1):
            acc.copy(r, Buffer.output, 0)
        assert Check()
        total = p.buffers[0][Buffer.output][0]
        assert isinstance(total, msccl.ReduceChunk) and sorted(c.origin_rank for c in total.chunks) == [0, 1, 2]
        with pytest.raises(TypeError, match="read-only"):
            p.buffers[0][Buffer.output][0] = None
    assert p.program.layout.alias_table == ("output", "input", (0, 0, 0))
    assert msc.verify(p.program).output_chunks == n


def test_builtin_subclass_with_its_own_check():
    class ReduceToZero(AllReduce):
        def check(self, prog):
            return prog.buffers[0][Buffer.output][0] == msccl.ReduceChunk(
                0, [msccl.Chunk(r, 0) for r in range(self.num_ranks)])

    class MyAllGather(AllGather):   # the built-in's own check, through the MSCCLang path
        def init_buffers(self):
            return super().init_buffers()

    n = 3
    with MSCCLProgram("to_zero", fully_connected(n), ReduceToZero(n, 1, True), 1) as p:
        for r in range(1, n):
            chunk(0, Buffer.input, 0).reduce(chunk(r, Buffer.input, 0))
        assert Check()
    assert msc.verify(p.program).output_chunks == 1
    with MSCCLProgram("gather", fully_connected(n), MyAllGather(n, 1, False), 1):
        for r in range(n):
            for d in range(n):
                if (r, d) != (0, 2):
                    chunk(r, Buffer.input, 0).copy(d, Buffer.output, r)
        with pytest.raises(msc.VerificationError, match="Rank 2 chunk 0 is incorrect should be input\\[0\\] of rank 0"):
            Check()


def test_builtins_answer_mscclang_collective_api():
    ag = AllGather(2, 2, True)
    bufs = ag.init_buffers()
    assert [c.label if c else None for c in bufs[1][Buffer.output]] == [None, None, (1, 0), (1, 1)]
    assert bufs[1][Buffer.input] == bufs[1][Buffer.output][2:]
    assert ag.get_buffer_index(1, Buffer.input, 1) == (Buffer.output, 3)
    assert set(ReduceScatter(2, 1, True).init_buffers()[0]) == {Buffer.input}
    ar = AllReduce(2, 1, True).init_buffers()[0]
    assert ar[Buffer.input] is ar[Buffer.output]
    chunk_ = AllToAll(2, 2, False).init_buffers()[1][Buffer.input][1]
    assert (chunk_.origin_rank, chunk_.origin_index, chunk_.dst_rank, chunk_.dst_index) == (1, 1, 0, 3)


def test_chunk_and_reduce_chunk_follow_mscclang():
    a, b = msccl.Chunk(0, 1, 2, 3), msccl.Chunk(1, 1)
    assert a == msccl.Chunk(0, 1) and hash(a) == hash(msccl.Chunk(0, 1)) and b > a
    ab = a.reduce(-1, b)
    assert ab == msccl.ReduceChunk(5, [b, a]) and ab != msccl.ReduceChunk(5, [a, b, b]) and ab != a
    assert ab.reduce(-1, b) == b.reduce(-1, ab)


class _Empty(msccl.Collective):
    pass


class _Bad(msccl.Collective):
    shape = "list"

    def init_buffers(self):
        n = self.num_ranks
        if self.shape == "list":
            return []
        if self.shape == "not a chunk":
            return [{Buffer.input: [(r, 0)], Buffer.output: [None]} for r in range(n)]
        if self.shape == "full output":
            return [{Buffer.input: [msccl.Chunk(r, 0)], Buffer.output: [msccl.Chunk(r, 0)]} for r in range(n)]
        return [{Buffer.input: [msccl.Chunk(r, 0), None], Buffer.output: [None, None]} for r in range(n)]

    def get_buffer_index(self, rank, buffer, index):
        if self.shape == "permuted" and buffer == Buffer.input:
            return Buffer.output, 1 - index
        return buffer, index

    def check(self, prog):
        return True


@pytest.mark.parametrize("shape, message", [
    ("list", "init_buffers\\(\\) must return one dict of buffers per rank \\(2\\), got \\[\\]"),
    ("not a chunk", "rank 0 input\\[0\\] must be a Chunk or None, got \\(0, 0\\)"),
    ("full output", "rank 0 output\\[0\\] starts with Chunk"),
    ("permuted", "get_buffer_index\\(0, Buffer.input, 1\\) gave .*fixed offset"),
])
def test_custom_collective_mistakes_are_named(shape, message):
    collective = _Bad(2, 1, False)
    collective.shape = shape
    with pytest.raises(msc.AlgorithmError, match=message) as info:
        here = _lineno(); MSCCLProgram("bad", fully_connected(2), collective, 1)  # noqa: E702
    assert info.value.where.line == here


def test_custom_collective_without_the_api():
    with pytest.raises(msc.AlgorithmError, match="define init_buffers\\(\\).*or set `native`"):
        MSCCLProgram("empty", fully_connected(2), _Empty(2, 1, False), 1)

    class NoCheck(msccl.Collective):
        def init_buffers(self):
            return [{Buffer.input: [msccl.Chunk(r, 0)], Buffer.output: [None]} for r in range(2)]

    with MSCCLProgram("no_check", fully_connected(2), NoCheck(2, 1, False), 1) as p:
        with pytest.raises(msc.AlgorithmError, match="defines no check"):
            Check()
    assert msc.verify(p.program).output_chunks == 0    # nothing is required of it

    class Raises(AllToNext):
        def check(self, prog):
            return prog.buffers[5]  # noqa: B018

    with MSCCLProgram("raises", fully_connected(2), Raises(2, 1, False), 1):
        with pytest.raises(msc.AlgorithmError, match="IndexError.*in check\\(\\) of collective Raises") as info:
            Check()
    assert info.value.where.line == Raises.check.__code__.co_firstlineno + 1


# -- scratch buffers named by any hashable ---------------------------------------------------
def _three_step_alltoall(nodes, gpus):
    """MSCCLang's three-step alltoall in small: local chunks go straight to
    their rank; chunks for another node gather on one GPU in a scratch buffer
    named (from node, to node), cross once, and scatter from there."""
    n = nodes * gpus
    gather = {}
    for r in range(n):
        for m in range(nodes):
            c = chunk(r, Buffer.input, m * gpus, gpus)
            if m == r // gpus:
                for j, part in enumerate(c.split(gpus)):
                    part.copy(m * gpus + j, Buffer.output, part.get_dst_index())
                continue
            key = (r // gpus, m)
            c = c.copy(r // gpus * gpus + m % gpus, buffer=key)
            gather[key] = gather[key].group(c) if key in gather else c
    for (src, dst), c in gather.items():
        c = c.copy(dst * gpus + src % gpus, buffer=(src, dst))
        for part in c.split(gpus * gpus):
            part.copy(part.get_dst_rank(), Buffer.output, part.get_dst_index())


def test_tuple_scratch_names_three_step_alltoall():
    nodes, gpus = 2, 2
    n = nodes * gpus
    with MSCCLProgram("three_step", fully_connected(n), AllToAll(n, 1, False), 1) as p:
        _three_step_alltoall(nodes, gpus)
        assert Check()
        assert chunk(1, (0, 1), 3) is not None and chunk(1, (0, 1), 4) is None
        assert (0, 1) in p.buffers[1] and len(p.buffers[1][(0, 1)]) == 4
    names = {op.dst_buffer for op in p.program.ops} - {"output"}
    assert names == {"(0, 1)", "(1, 0)"}


def test_scratch_names_in_errors_and_collisions():
    with MSCCLProgram("names", fully_connected(2), AllToAll(2, 1, False), 1) as p:
        chunk(0, Buffer.input, 1).copy(1, (0, "x"), 0)
        assert chunk(1, (0, "x"), 0).get_origin_rank() == 0
        with pytest.raises(msc.OperationError, match="rank 1 \\(0, 'x'\\)\\[1\\]"):
            chunk(1, (0, "x"), 0, 2).get_dst_rank(1)
        assert create_scratch(0, 7) == 7 and 7 in p.buffers[0] and len(p.buffers[0][7]) == 0
        chunk(0, Buffer.input, 0).copy(0, True)          # True == 1: MSCCLang's dict makes them one buffer
        assert chunk(0, 1, 0) is not None
        with pytest.raises(msc.AlgorithmError, match="would both be called '\\(0, 1\\)'"):
            chunk(0, Buffer.input, 0).copy(1, (0, 1))
            chunk(0, Buffer.input, 0).copy(1, "(0, 1)")
        with pytest.raises(msc.OperationError, match="must be hashable"):
            chunk(0, Buffer.input, 0).copy(1, ["scratch"])


# -- in-place copies follow MSCCLang's source-rank layout ---------------------------------
@pytest.mark.parametrize("n", [2, 3, 8])
def test_allpairs_allgather_in_mscclang_style(n, capsys):
    with MSCCLProgram("allgather_allpairs", fully_connected(n), AllGather(n, 1, True), 1,
                      threadblock_policy=ThreadblockPolicy.manual) as p:
        for r1 in range(n):
            for r2 in range(n):
                if r1 != r2:
                    chunk(r1, Buffer.input, 0).copy(r2, Buffer.input, 0, sendtb=r2, recvtb=r1)
        assert Check()
    assert {(op.dst_rank, op.dst_index) for op in p.program.ops} == {
        (r2, r1) for r1 in range(n) for r2 in range(n) if r1 != r2}


def test_in_place_reduce_scatter_output_copy_uses_the_source_offset():
    with MSCCLProgram("rs", fully_connected(2), ReduceScatter(2, 1, True), 1) as p:
        chunk(0, Buffer.output, 0).copy(1, Buffer.output, 0)  # rank 0's output is input[0]: input[0] of rank 1
    assert [(op.dst_rank, op.dst_buffer, op.dst_index) for op in p.program.ops] == [(1, "input", 0)]


def test_verification_failures_point_at_the_users_line(tmp_path, capsys):
    pytest.importorskip("msc.formats.xml_export")
    with MSCCLProgram("gap", fully_connected(2), AllGather(2, 1, False), 1):
        chunk(0, Buffer.input, 0).copy(0, Buffer.output, 0)
        chunk(0, Buffer.input, 0).copy(1, Buffer.output, 0)
        chunk(1, Buffer.input, 0).copy(1, Buffer.output, 1)
        with pytest.raises(msc.VerificationError, match="rank 0 output\\[1\\] was never written") as info:
            line = _lineno(); Check()  # noqa: E702
        assert info.value.where.line == line
        with pytest.raises(msc.VerificationError, match="rank 0 output\\[1\\]") as info:
            line = _lineno(); XML()  # noqa: E702
        assert info.value.where.line == line


# -- topologies, Print ----------------------------------------------------------------------------
def test_dgx1_and_distributed_topologies():
    t = msccl.dgx1()
    assert t.name == "DGX1" and t.num_nodes() == 8
    assert all(t.link(a, b) == t.link(b, a) for a in range(8) for b in range(8))
    assert [sum(t.links[g]) for g in range(8)] == [6] * 8           # six NVLinks per GPU
    assert (t.link(0, 1), t.link(0, 2), t.link(0, 5)) == (2, 1, 0)
    d = msccl.distributed_fully_connected(t, 2, 1)
    assert d.num_nodes() == 16 and d.name == "DistributedFullyConnected(local=DGX1,copies=2,bw=1)"
    assert (d.link(8, 9), d.link(8, 13), d.link(0, 13)) == (2, 0, 1)
    h = msccl.distributed_hub_and_spoke(msccl.hub_and_spoke(2), 2, 3)
    assert h.links == msccl.distributed_fully_connected(msccl.fully_connected(2), 2, 3).links
    assert len(h.switches) == 4 * 2 + 2 * 2
    with pytest.raises(msc.AlgorithmError, match="remote_bw"):
        msccl.distributed_fully_connected(t, 2, 0)
    # A ring over the DGX-1's NVLinks; rank 0 and 5 have none between them.
    order = [0, 1, 3, 2, 6, 7, 5, 4]
    with MSCCLProgram("dgx1_ring", t, AllGather(8, 1, True), 1):
        for i, r in enumerate(order):
            c = chunk(r, Buffer.input, 0)
            for step in range(1, 8):
                c = c.copy(order[(i + step) % 8])
        assert Check()
        with pytest.raises(msc.OperationError, match="no link from rank 0 to rank 5"):
            chunk(0, Buffer.input, 0).copy(5)


def test_print_lists_the_operations(capsys):
    with MSCCLProgram("p", fully_connected(2), AllReduce(2, 1, True), 1):
        chunk(1, Buffer.input, 0).reduce(chunk(0, Buffer.input, 0)); line = _lineno()  # noqa: E702
        Print()
    out = capsys.readouterr().out
    assert out.startswith("0: reduce rank 0 input[0] into rank 1 input[0]  @ ")
    assert out.rstrip().endswith(f"test_compat_msccl.py:{line}")


def test_compile_script_with_options_before_the_script_arguments(tmp_path):
    # "-o OUT -- ARGS": everything after -- belongs to the script; two instances of
    # a manual-policy program get their own threadblocks (hints shifted per instance).
    from msc.cli.main import main
    from msc.formats.load import load_plan

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
