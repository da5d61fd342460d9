"""msc: a compiler for GPU collective-communication schedules.

Write a collective algorithm as chunk-level copies and reductions, verify
it symbolically, lower it to a plan, and run it:

    import msc
    [ring] = msc.load_algorithms("algorithms/allreduce/ring.py")
    program = msc.trace(ring, num_ranks=8)
    msc.verify(program)
    from msc.lower import lower
    msc.save_plan(lower(program), "ring8.plan")    # msc.load_plan reads it back, verified

The packages are the pipeline's stages: ``dsl`` (writing programs), ``ir``,
``verification``, ``lower``, ``formats`` (plan text, MSCCL XML), then what
runs a plan: ``executor`` (numpy reference), ``sim`` (cost model, bound,
tuner), ``synth`` (schedules synthesized from a topology), ``cuda``
(kernels, on a GPU or the emulated device), ``torch`` (PyTorch collectives
and DDP); ``compat`` (MSCCLang) and ``cli`` sit on top.
"""
# First: msc.verification.cache records the verdict-deciding modules as they are imported, so that a
# verifier replaced later (by an algorithm file) cannot record verdicts for other processes.
import importlib as _importlib  # noqa: I001  (isort: skip)
_importlib.import_module("msc.verification.cache")
from msc.dsl.collectives import Collective, CustomCollective, Expected
from msc.dsl.program import Algorithm, Program, Ref, algorithm, group, trace
from msc.errors import (AlgorithmError, MscError, OperationError, SourceLine, UsageError,
                        VerificationError)
from msc.dsl.loader import load_algorithms
from msc.verification.program_verifier import Report, verify

__all__ = [
    "Algorithm", "AlgorithmError", "Collective", "CustomCollective", "Expected", "MscError",
    "OperationError", "Program", "Ref", "Report", "SourceLine", "UsageError", "VerificationError",
    "algorithm", "group", "load_algorithms", "load_plan", "save_plan", "trace", "verify",
]
__version__ = "0.1.0"

# Reading and writing plans (the plan grammar, the plan verifier) load on first use, so that
# `import msc` stays light for the commands that never touch a plan.
_LAZY = {"load_plan": "msc.formats.load", "save_plan": "msc.formats.plan_text"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'msc' has no attribute {name!r}")
