"""Upper bounds on every size, count and rank number msc takes.

Each is checked where the value enters msc (the command line, the DSL, the
plan and XML readers, the exporter), so that an absurd value is a one-line
error naming the value and the limit (exit 2), never a hang, a MemoryError
or an overflow later. The limits are far above anything msc is used for
(the largest plans compiled have 4096 ranks, bench/scale.py) and far
below what would exhaust a machine.
"""
from __future__ import annotations

from msc.errors import UsageError

MAX_RANKS = 1 << 14               # ranks of a program or plan
MAX_CHUNK_FACTOR = 1 << 16        # chunks per data unit
MAX_BUFFER_CHUNKS = 1 << 26       # chunks of one buffer of one rank (scratch grows on demand)
MAX_TOTAL_CHUNKS = 1 << 26        # chunks of every buffer of every rank together (the verifiers and the
                                  # executor hold a value or two per chunk: about 1 GiB at this limit)
# Chunks a program's operations move in all (with instances, its plan's transfers): what compile costs
# grows with it. Measured on `msc compile allreduce/hierarchical -n 2048` (8.4 million moved, of which 6.3
# in operations of 512 chunks): peak 3.7 GB, ~450 bytes per chunk moved (the verifiers' arrays, 8 bytes
# per chunk access and array with a dozen alive at once, and the plan's steps), 7-8.5 CPU us; the
# 1024-rank ring allreduce ~475 bytes (996 MB for 2.1 million). At this limit: ~16 GB and ~4-5 CPU
# minutes, a compile that fits a 32 GB machine. The 4096-rank ring and hierarchical allreduces (33.5
# million each) fit under it; 2^24 refused them.
MAX_CHUNK_MOVES = 1 << 25
# Chunks the steps of a plan move in all: every transfer is a send step and a receive step (a fused
# forward, one step), so a program within MAX_CHUNK_MOVES lowers to a plan within twice it; the plan
# verifier costs per step move about half what compile does per chunk moved.
MAX_STEP_MOVES = 2 * MAX_CHUNK_MOVES
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
