"""msc: a compiler for GPU collective-communication schedules.

Write a collective algorithm as chunk-level copies and reductions, verify
it symbolically, lower it to a plan, and run it.
"""
# First: msc.verified records the verdict-deciding modules as they are imported, so that a
# verifier replaced later (by an algorithm file) cannot record verdicts for other processes.
from msc import verified  # noqa: F401  (isort: skip)
from msc.collectives import Collective, CustomCollective, Expected
from msc.dsl import Algorithm, Program, Ref, algorithm, group, trace
from msc.errors import (AlgorithmError, MscError, OperationError, SourceLine, UsageError,
                        VerificationError)
from msc.loader import load_algorithms
from msc.verify import Report, verify

__all__ = [
    "Algorithm", "AlgorithmError", "Collective", "CustomCollective", "Expected", "MscError",
    "OperationError", "Program", "Ref", "Report", "SourceLine", "UsageError", "VerificationError",
    "algorithm", "group", "load_algorithms", "trace", "verify",
]
__version__ = "0.1.0"
