"""Tracing's record finds an operation's source line directly where the
caller of copy/reduce is user code (msc.dsl.source_lines.user_codes): the
same SourceLine objects as user_line's walk over the frames, for the
library (whose NVLS algorithms call copy and reduce from msc's own helpers)
and for MSCCLang scripts (whose calls come through msc.compat)."""
from __future__ import annotations

from pathlib import Path

import msc
import msc.dsl.program as program_module
from msc.compat.scripts import run_script
from library import algorithms, rank_counts

REPO = Path(__file__).resolve().parent.parent


def lines(trace, monkeypatch, walk: bool):
    with monkeypatch.context() as m:
        if walk:                  # the direct lookup never finds anything: every line from the walk
            m.setattr(program_module, "user_codes", {})
        return [op.where for op in trace().ops]


def test_direct_lines_are_the_walks_on_the_library(monkeypatch):
    compared = internal = 0
    for key, alg in sorted(algorithms().items()):
        n = rank_counts(alg)[-1]
        direct = lines(lambda: msc.trace(alg, n), monkeypatch, walk=False)
        walked = lines(lambda: msc.trace(alg, n), monkeypatch, walk=True)
        assert len(direct) == len(walked) and all(a is b for a, b in zip(direct, walked)), key
        assert all(w is not None and w.file.endswith(".py") for w in direct), key
        compared += 1
        internal += "nvls" in key
    assert compared > 20 and internal


def test_direct_lines_are_the_walks_in_msccl_scripts(monkeypatch):
    script = str(REPO / "examples" / "msccl_allreduce_ring.py")

    def trace():
        [program] = run_script(script, ["4", "1"])
        return program

    direct, walked = lines(trace, monkeypatch, walk=False), lines(trace, monkeypatch, walk=True)
    assert direct and all(a is b for a, b in zip(direct, walked)) and len(direct) == len(walked)
    assert {w.file for w in direct} == {w.file for w in walked} and all("msccl_allreduce_ring" in w.file
                                                                        for w in direct)


def test_a_helper_in_the_users_file_is_the_line_inside_it(tmp_path, monkeypatch):
    path = tmp_path / "helper.py"
    path.write_text("import msc\n\n\ndef hop(p, r):\n    p.chunk(r, 'input', 0).copy((r + 1) % p.num_ranks, 'output', 0)\n\n\n"
                    "@msc.algorithm('sendrecv', inplace=False)\ndef ring(p):\n    for r in range(p.num_ranks):\n"
                    "        hop(p, r)\n")
    [alg] = msc.load_algorithms(str(path))
    direct = lines(lambda: msc.trace(alg, 3), monkeypatch, walk=False)
    assert [w.line for w in direct] == [5, 5, 5]
    assert direct == lines(lambda: msc.trace(alg, 3), monkeypatch, walk=True)
