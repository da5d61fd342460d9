"""The fields of an MSCCL++ plan beside its operations, checked as read:
the executor's own settings msc reads or models (buffer_alignment and the
like) and the msc_* fields msc's export writes (which the executor ignores)
for msc's reader to give the plan back. Each has a type and a range; a
plan that breaks one is refused naming the field, never carried on to fail
in the model or the lift. msc_* fields msc does not know are kept as they are."""
from __future__ import annotations

from msc.errors import PlanError
from msc.ir.limits import MAX_CHUNK_FACTOR, MAX_INSTANCES, MAX_SLOTS, MAX_TILE_BYTES

INT32 = (1 << 31) - 1
UNBOUNDED = (1 << 64) - 1


def _int(lo, hi):
    """An int in lo..hi (hi a number, or a function of the context)."""
    def check(value, ctx):
        top = hi(ctx) if callable(hi) else hi
        if type(value) is not int or not lo <= value <= top:
            return f"an integer {lo}..{top}"
        return None
    return check


def _list(item):
    """A list whose every entry ``item`` takes."""
    def check(value, ctx):
        if not isinstance(value, list) or any(item(v, ctx) for v in value):
            return f"a list, each {item(None, ctx)}"
        return None
    return check


def _string(value, ctx):
    return None if isinstance(value, str) else "a string"


def _bool(value, ctx):
    return None if type(value) is bool else "true or false"


def _exactly(want):
    return lambda value, ctx: None if type(value) is int and value == want else (
        f"{want} (msc models the executor's {want}-byte units)")


# The plan's fields: ctx is {"ranks": n}.
PLAN = {
    "buffer_alignment": _exactly(16),
    "num_threads_per_block": _int(1, 1024),
    "min_message_size": _int(0, UNBOUNDED),
    "max_message_size": _int(0, UNBOUNDED),
    "reuse_resources": _bool,
    "msc_chunk_factor": _int(1, MAX_CHUNK_FACTOR),
    "msc_root": _int(0, lambda ctx: ctx["ranks"] - 1),
    "msc_slots": _int(1, MAX_SLOTS),
    "msc_tile": _int(0, MAX_TILE_BYTES),
    "msc_instances": _int(1, MAX_INSTANCES),
    "msc_contract": _list(_string),
}
# A gpu's: ctx adds "scratch" (its chunks) and "channels" (its memory channels).
GPU = {
    "msc_scratch": _int(0, lambda ctx: ctx["scratch"]),
    "msc_barrier_channels": _list(_int(0, lambda ctx: ctx["channels"] - 1)),
}
# A threadblock's: ctx adds "threadblocks" (the gpu's).
THREADBLOCK = {
    "msc_tb": _int(0, lambda ctx: ctx["threadblocks"] - 1),
    "msc_part": _int(1, lambda ctx: ctx["threadblocks"] - 1),
    "msc_channel": _int(0, INT32),
    "msc_group": _list(_int(0, lambda ctx: ctx["ranks"] - 1)),
}


def check_fields(obj: dict, fields: dict, ctx: dict, path=None, **where) -> None:
    """PlanError naming the first of ``fields`` in ``obj`` (the plan, or the
    gpu or threadblock ``where`` names) that is not what it must be."""
    for key, check in fields.items():
        if key in obj:
            want = check(obj[key], ctx)
            if want is not None:
                raise PlanError(f"{'' if where else 'plan: '}{key} must be {want}, got {obj[key]!r:.60}", path=path,
                                **where)
