"""Upper bounds on every size, count and rank number msc takes.

Each is checked where the value enters msc (the command line, the DSL, the
plan and XML readers, the exporter), so that an absurd value is a one-line
error naming the value and the limit (exit 2), never a hang, a MemoryError
or an overflow later. The limits are far above anything msc is used for
(the largest plans tested have 1024 ranks, bench/compile_speed.py) and far
below what would exhaust a machine.
"""
from __future__ import annotations

from msc.errors import UsageError

MAX_RANKS = 1 << 14               # ranks of a program or plan
MAX_CHUNK_FACTOR = 1 << 16        # chunks per data unit
MAX_BUFFER_CHUNKS = 1 << 26       # chunks of one buffer of one rank (scratch grows on demand)
MAX_TOTAL_CHUNKS = 1 << 26        # chunks of every buffer of every rank together (the verifiers and the
                                  # executor hold a value or two per chunk: about 1 GiB at this limit)
MAX_CHUNK_MOVES = 1 << 24         # chunks that the steps of a plan, or a program's operations, move in all
                                  # (the plan verifier holds ~150 bytes per chunk moved; the 1024-rank ring
                                  # allreduce moves 2.1 million)
MAX_INSTANCES = 64                # copies of a schedule a plan runs side by side
MAX_SLOTS = 1 << 12               # messages in flight per connection
MAX_TILE_BYTES = 1 << 30          # pipelining tile per chunk
MAX_BYTES = 1 << 40               # a message size (msc run, simulate, tune, bench, export ranges)
MAX_STEPS = 1 << 26               # steps of a plan
MAX_TILES = 1 << 20               # tile iterations of one chunk the simulator models
MAX_XML_BYTES = (1 << 63) - 1     # MSCCL-IR's minBytes/maxBytes are 64-bit integers
MAX_PLAN_FILE_BYTES = 1 << 30     # a plan or MSCCL XML file (the 1024-rank ring allreduce's plan is ~0.2 GB)
MAX_TEXT_FILE_BYTES = 1 << 26     # a TOML topology or calibration, a plans.json, an algorithm's source


def check(value: int, limit: int, what: str) -> int:
    """``value`` if 0 <= value <= limit, else UsageError naming both."""
    if value > limit:
        raise UsageError(f"{what} is {value}, over msc's limit of {limit}")
    return value
