"""The registries of step ops (msc.ir.StepOp), reduce ops and protocols
(msc.ir.ops) are the only lists of them: what cannot import them (the grammar,
MSCCL's XML names, the rendered CUDA) is checked against them here, and
every table built from them agrees."""
from __future__ import annotations

import re

import numpy as np
import pytest

import msc
from msc.cli.main import build_parser
from msc.cuda.codegen import render
from msc.errors import UsageError
from msc.ir import StepOp
from msc.lower.pipeline import LowerOptions, lower
from msc.ir.ops import PROTOCOL_NAMES, PROTOCOLS, REDUCE_OP_NAMES, REDUCE_OPS
from msc.resources import data_dir
from library import algorithms

# MSCCL-IR's <step> types, as the MSCCL runtimes read them (mscclFuncType names).
MSCCL_STEP_TYPES = {"s", "r", "rcs", "rrs", "rrc", "rrcs", "cpy", "re", "nop"}


def _plan(protocol: str = "Simple"):
    return lower(msc.trace(algorithms()["allreduce/ring:ring"], 2), LowerOptions(protocol=protocol))


def test_the_grammar_spells_the_step_ops_of_the_registry():
    grammar = (data_dir("grammars") / "plan.lark").read_text()
    line = re.search(r"^OP(?:\.\d+)?:(.*)$", grammar, re.M)[1]
    assert sorted(re.findall(r'"(\w+)"', line)) == sorted(op.value for op in StepOp)


def test_pictures_colour_every_step_op_apart():
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    from msc.cli.pictures import OP_COLORS

    assert set(OP_COLORS) == {op.value for op in StepOp}
    assert len({to_rgba(c) for c in OP_COLORS.values()}) == len(StepOp)      # real colours, all different


def test_xml_step_types_are_the_registry_s_and_msccl_s():
    from msc.formats.xml_import import TYPES

    assert {op.xml for op in StepOp if op.xml} == MSCCL_STEP_TYPES
    assert TYPES == {op.xml: op for op in StepOp if op.xml}


def test_xml_export_refuses_an_op_msccl_has_no_type_for(monkeypatch):
    """An op added to the registry without an MSCCL type (xml None) makes
    export fail naming the op and where it is, not write a type MSCCL lacks."""
    from msc.errors import PlanError
    from msc.formats.xml_export import plan_to_xml

    plan = _plan("Simple")
    rank, tb, s = next((rp.rank, t, i) for rp in plan.ranks for t, block in enumerate(rp.threadblocks)
                       for i, step in enumerate(block.steps) if step.op is StepOp.RRCS)
    monkeypatch.setattr(StepOp.RRCS, "xml", None)
    with pytest.raises(PlanError, match="rrcs: MSCCL-IR has no step type") as exc:
        plan_to_xml(plan)
    assert (exc.value.rank, exc.value.tb, exc.value.step) == (rank, tb, s)


@pytest.mark.parametrize("protocol", [p.name for p in PROTOCOLS.values() if p.transport])
def test_rendered_cuda_takes_ops_and_transport_from_the_registries(protocol):
    plan = _plan(protocol)
    for name, op in REDUCE_OPS.items():
        for dtype in ("float32", "bfloat16"):
            source, layout = render(plan, dtype=dtype, op=name, form="table")
            enum = next(x for x in source.splitlines() if x.startswith("enum { OP_"))
            assert re.findall(r"OP_(\w+) = (\d+)", enum) == [(o.name, str(i)) for i, o in enumerate(StepOp)]
            assert ("return a * (float)inv_n;" in source) == (op.average and dtype == "float32")
            # the op's C spelling is its row's: float math for half types, the element type's otherwise
            spelled = f"return from_f({op.c_float});" if dtype == "bfloat16" else f"return {op.c_elem};"
            assert spelled in source, (name, dtype)
        assert layout.nthreads == PROTOCOLS[protocol].threads
        assert f"#define MIN_BLOCKS {PROTOCOLS[protocol].min_blocks}" in source
        transport = PROTOCOLS[protocol].transport
        assert ("// LL: every 4 data bytes" in source, "// Simple: the sender copies" in source) == \
            (transport == "ll", transport == "simple")


def test_templates_spell_no_reduce_op():
    """Each op's C spelling lives in its REDUCE_OPS row only."""
    templates = "\n".join(p.read_text() for p in (data_dir("templates")).glob("*.j2"))
    for op in REDUCE_OPS.values():
        for spelling in {op.c_float, op.c_elem} - {"x + y", "a + b"}:      # sums are ordinary C elsewhere
            assert spelling not in templates, spelling


def test_a_protocol_without_a_transport_is_refused_by_the_cuda_backend():
    for spec in PROTOCOLS.values():
        if spec.transport is None:
            with pytest.raises(UsageError, match=f"{spec.name} is not implemented"):
                render(_plan(spec.name))


def test_reduce_ops_name_real_functions_and_every_table_is_the_registry_s():
    from msc import executor
    from msc.verification import reference
    from msc.cli import run as runner
    from msc.cuda import codegen

    for op in REDUCE_OPS.values():
        assert isinstance(getattr(np, op.numpy), np.ufunc)
    assert executor.OPS == reference.OPS == runner.OPS == codegen.OPS == REDUCE_OP_NAMES
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from msc.torch.execute import COMBINE, op_name

    for op in REDUCE_OPS.values():
        assert COMBINE[op.name] is getattr(torch, op.torch)
        assert op_name(getattr(dist.ReduceOp, op.torch_op)) == op.name
        assert all(op_name(alias) == op.name for alias in op.aliases)


def test_protocol_tables_are_the_registry_s():
    from msc.cuda.launch import DEFAULT_TILE_BYTES
    from msc.lower.runtimes import PROTOCOL_SLOTS
    from msc.sim.machines import MACHINES
    from msc.sim.protocols import DEFAULT_PROTOCOLS, KINDS

    assert PROTOCOL_SLOTS == PROTOCOL_NAMES == tuple(DEFAULT_PROTOCOLS) == tuple(DEFAULT_TILE_BYTES)
    for p in PROTOCOLS.values():
        model = DEFAULT_PROTOCOLS[p.name]
        assert model.tile == p.tile == DEFAULT_TILE_BYTES[p.name]
        for kind in KINDS:
            link = model.link(kind)
            assert (link.alpha_factor, link.bandwidth_factor) == (p.alpha_factor, p.bandwidth_factor)
        for machine in MACHINES.values():
            assert machine.protocols[p.name].tile == p.tile and set(machine.protocols[p.name].links) == set(KINDS)


def test_cli_choices_are_the_registry_s():
    compile_cmd = build_parser()._subparsers._group_actions[0].choices["compile"]
    choices = {a.dest: a.choices for a in compile_cmd._actions}
    assert tuple(choices["protocol"]) == PROTOCOL_NAMES and tuple(choices["op"]) == REDUCE_OP_NAMES


# -- an op's rule of types: one function of the op registry, applied by every path -------------------
def _bitwise_and():
    """An op whose row allows integer types only (as a bitwise op's would)."""
    from msc.ir.ops import ReduceOp

    return ReduceOp("band", "bitwise_and", "bitwise_and", "BAND", "", "a & b", types="integer")


def test_the_op_rule_of_types_is_applied_by_the_executor_and_the_kernels(monkeypatch):
    from msc.executor import run_collective
    from msc.ir.ops import kernel_op_problem, op_dtype_problem

    monkeypatch.setitem(REDUCE_OPS, "band", _bitwise_and())
    assert op_dtype_problem("band", "int32", False) is None
    assert op_dtype_problem("band", "float32", True) == "the reduction op band reduces integer types, not float32"
    assert op_dtype_problem("avg", "int32", False) is None                       # the executor truncates
    assert kernel_op_problem("band", "float16", True) == "the reduction op band reduces integer types, not float16"
    assert "needs a floating type (it scales inputs by 1/n), not int32" in kernel_op_problem("avg", "int32", False)
    plan = _plan()
    rng = np.random.default_rng(3)
    ints = [rng.integers(1, 1 << 30, 5, dtype=np.int32) for _ in range(2)]
    got = run_collective(plan, ints, "band", count=5)
    assert all(np.array_equal(g, ints[0] & ints[1]) for g in got)
    with pytest.raises(UsageError, match="plan 'ring': the reduction op band reduces integer types, not float32"):
        run_collective(plan, [x.astype(np.float32) for x in ints], "band", count=5)


def test_the_op_rule_of_types_is_applied_by_the_torch_executor(monkeypatch):
    torch = pytest.importorskip("torch")
    from msc.torch import execute

    monkeypatch.setitem(REDUCE_OPS, "band", _bitwise_and())
    monkeypatch.setitem(execute.COMBINE, "band", torch.bitwise_and)
    plan = _plan()
    g = torch.Generator().manual_seed(5)
    ints = [torch.randint(1, 1 << 30, (5,), generator=g, dtype=torch.int32) for _ in range(2)]
    phys = [{"input": t.clone()} if plan.inplace else {"input": t.clone(), "output": torch.zeros_like(t)} for t in ints]
    execute.run_local(plan, phys, count=5, op="band")
    out = "input" if plan.inplace else "output"
    assert all(torch.equal(p[out], ints[0] & ints[1]) for p in phys)
    floats = [{k: v.float() for k, v in p.items()} for p in phys]
    with pytest.raises(UsageError, match="the reduction op band reduces integer types, not float32"):
        execute.run_local(plan, floats, count=5, op="band")
