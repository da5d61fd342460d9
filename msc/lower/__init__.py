"""Lowering a verified program to a plan: the pass pipeline (``pipeline``)
over the instruction DAG (``dag``), fusion, threadblock and channel
placement, scheduling, the bulk form of the same passes (``bulk``) and the
runtimes' limits (``runtimes``).

``from msc.lower import lower, LowerOptions`` is the public entry point. They
load on first use: importing ``msc.lower.runtimes`` (the command line does)
must not load the passes and numpy."""

__all__ = ["LowerOptions", "lower"]


def __getattr__(name: str):
    if name in __all__:
        from msc.lower import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'msc.lower' has no attribute {name!r}")
