"""Static gate of the NVLink SHARP primitives (no GPU): for every (dtype, op)
the switch supports, the probe kernel (templates/switch_probe.cu.j2, which
calls every primitive of multimem.cuh.j2) compiles with NVRTC for sm_90 and
ptxas accepts it; its PTX holds the multimem.ld_reduce and multimem.st forms
with the element type's and op's suffixes and nothing else multimem, the
barrier's release red and proxy fence, and ptxas reports no spills. Pairs
the switch cannot do raise the one table's error before anything renders.
And the table itself is checked against ptxas: the forms it refuses (min of
f32, a single f16, min with .acc::f32) are ones ptxas rejects.
"""
from __future__ import annotations

import re

import pytest

from msc.cuda.switch import SWITCH_TYPES, nvrtc_ptx, supported_pairs, switch_form, switch_slice_problem
from msc.cuda.switch_probe import render_probe
from msc.errors import CompileError, UsageError
from msc.ir.ops import REDUCE_OP_NAMES, switch_op_problem

pytest.importorskip("cuda.bindings")

# (dtype, op) -> the load-reduce and store forms its PTX must hold, exactly.
EXPECTED = {
    "float32": ({"{op}.f32", "{op}.v4.f32"}, {"f32", "v4.f32"}),
    "float64": ({"{op}.f64"}, {"f64"}),
    "float16": ({"{op}{acc}.f16x2", "{op}{acc}.v4.f16x2"}, {"f16x2", "v4.f16x2"}),
    "bfloat16": ({"{op}{acc}.bf16x2", "{op}{acc}.v4.bf16x2"}, {"bf16x2", "v4.bf16x2"}),
    "int32": ({"{op}.s32"}, {"s32"}),
}
PTX_OPS = {"sum": "add", "avg": "add", "min": "min", "max": "max"}


def expected_forms(dtype: str, op: str) -> tuple[set[str], set[str]]:
    ptx_op = PTX_OPS[op]
    acc = ".acc::f32" if ptx_op == "add" else ""
    loads, stores = EXPECTED[dtype]
    return ({"multimem.ld_reduce.relaxed.sys.global." + f.format(op=ptx_op, acc=acc) for f in loads},
            {"multimem.st.relaxed.sys.global." + f for f in stores})


@pytest.mark.parametrize("dtype,op", supported_pairs())
def test_probe_ptx_holds_the_multimem_forms(dtype, op):
    ptx, cubin, log = nvrtc_ptx(render_probe(dtype, op))
    loads = set(re.findall(r"multimem\.ld_reduce\S*", ptx))
    stores = set(re.findall(r"multimem\.st\S*", ptx))
    want_loads, want_stores = expected_forms(dtype, op)
    assert loads == want_loads
    assert stores == want_stores
    assert set(re.findall(r"multimem\.red\S*", ptx)) == {"multimem.red.release.sys.global.add.u64"}
    assert "fence.proxy.alias" in ptx
    assert len(cubin) > 0
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and not any(spills), log


def test_every_pair_is_in_the_table_or_refused():
    """Each of the collective ops on each CUDA data type either renders or raises the table's reason."""
    from msc.cuda.codegen import DTYPES

    supported = set(supported_pairs())
    for dtype in DTYPES:
        for op in REDUCE_OP_NAMES:
            problem = switch_op_problem(op, dtype)
            if (dtype, op) in supported:
                assert problem is None
                switch_form(dtype, op)
            else:
                with pytest.raises(UsageError) as err:
                    render_probe(dtype, op)
                assert str(err.value) == problem


@pytest.mark.parametrize("dtype,op,words", [
    ("float32", "prod", ["cannot reduce float32 with prod"]),
    ("float32", "max", ["cannot reduce float32 with max", "does sum on float32"]),
    ("float64", "min", ["cannot reduce float64 with min"]),
    ("int32", "prod", ["cannot reduce int32 with prod", "sum, min, max"]),
    ("int32", "avg", ["needs a floating type"]),
])
def test_unsupported_pairs_raise_a_clear_error(dtype, op, words):
    with pytest.raises(UsageError) as err:
        render_probe(dtype, op)
    for w in words:
        assert w in str(err.value)


def test_avg_is_the_switch_sum_on_float_types_only():
    """The switch cannot average: avg renders its sum (the runtime divides afterwards), on float types."""
    assert {switch_form(d, "avg").ptx_op for d in ("float32", "float64", "float16", "bfloat16")} == {"add"}
    with pytest.raises(UsageError, match="avg through the NVLink switch needs a floating type.*not int32"):
        switch_form("int32", "avg")


def test_half_slices_must_be_whole_pairs():
    assert switch_slice_problem("float16", 2, 6) is None
    assert "even element" in switch_slice_problem("bfloat16", 3, 4)
    assert "even element" in switch_slice_problem("float16", 2, 5)
    assert switch_slice_problem("float32", 3, 5) is None


# Forms the table refuses, written out: ptxas (sm_90) must reject each, else the table is too strict.
REFUSED_FORMS = [
    ("multimem.ld_reduce.relaxed.sys.global.min.f32", "r"),                 # no min/max of f32
    ("multimem.ld_reduce.relaxed.sys.global.max.f64", "l"),                 # nor of f64
    ("multimem.ld_reduce.relaxed.sys.global.add.f16", "h"),                 # a single half
    ("multimem.ld_reduce.relaxed.sys.global.min.acc::f32.f16x2", "r"),      # .acc::f32 only for add
]


@pytest.mark.parametrize("form,reg", REFUSED_FORMS)
def test_ptxas_rejects_what_the_table_refuses(form, reg):
    from msc.cuda.codegen import environment

    source = environment().get_template("switch_form_check.cu.j2").render(form=form, register=reg)
    with pytest.raises(CompileError) as err:
        nvrtc_ptx(source, name="form_check.cu")
    assert "multimem.ld_reduce" in err.value.log


def test_ptxas_accepts_the_same_check_with_an_allowed_form():
    """The check kernel itself compiles with a form the table uses (so a rejection above is the form's)."""
    from msc.cuda.codegen import environment

    form = switch_form("float16", "max")
    source = environment().get_template("switch_form_check.cu.j2").render(
        form=f"{form.ld_reduce}.{SWITCH_TYPES['float16'].ptx}", register="r")
    ptx, _, _ = nvrtc_ptx(source, name="form_check.cu")
    assert "multimem.ld_reduce.relaxed.sys.global.max.f16x2" in ptx
