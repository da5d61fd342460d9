"""Upper bounds on sizes, counts and rank numbers (msc.ir.limits): an absurd
value is a one-line error naming the value and the limit, raised where it
enters msc, never a hang, a MemoryError traceback or an overflow later."""
from __future__ import annotations

import time

import pytest

import clirun
import msc
from msc.errors import PlanError, UsageError
from msc.ir.limits import MAX_BYTES, MAX_INSTANCES, MAX_RANKS, MAX_SLOTS, MAX_TILE_BYTES
from msc.lower.pipeline import LowerOptions, lower
from msc.formats.plan_text import parse_plan, save_plan
from library import algorithms

RING = algorithms()["allreduce/ring:ring"]


def test_a_billion_ranks_is_refused_at_once():
    start = time.process_time()            # CPU time: load does not inflate it
    with pytest.raises(UsageError, match=f"the number of ranks is 1000000000, over msc's limit of {MAX_RANKS}"):
        msc.trace(RING, 10 ** 9)
    assert time.process_time() - start < 1


def test_a_chunk_factor_of_a_trillion_is_refused(tmp_path):
    path = tmp_path / "huge.py"
    path.write_text("import msc\n\n@msc.algorithm('allgather', chunk_factor=10**12)\ndef huge(p):\n    pass\n")
    [alg] = msc.load_algorithms(path)
    with pytest.raises(UsageError, match="chunk_factor is 1000000000000, over msc's limit"):
        msc.trace(alg, 2)


@pytest.mark.parametrize("option, value, limit", [("instances", 100_000, MAX_INSTANCES),
                                                  ("tile", 10 ** 20, MAX_TILE_BYTES)])
def test_lowering_options_are_bounded(option, value, limit):
    with pytest.raises(UsageError, match=f"is {value}, over msc's limit of {limit}"):
        LowerOptions(**{option: value})


@pytest.mark.parametrize("field, value, limit", [("slots", 10 ** 22, MAX_SLOTS), ("instances", 10 ** 8, MAX_INSTANCES),
                                                 ("tile", 10 ** 20, MAX_TILE_BYTES)])
def test_plan_files_with_absurd_values_are_refused(field, value, limit, tmp_path):
    text = save_plan(lower(msc.trace(RING, 4), LowerOptions()), tmp_path / "ring.plan").read_text()
    line = next(x for x in text.splitlines() if x.startswith("protocol "))
    words = line.split()
    words[words.index(field) + 1] = str(value)
    with pytest.raises(PlanError, match=f"{field} is {value}, over msc's limit of {limit}"):
        parse_plan(text.replace(line, " ".join(words)))


def test_sizes_are_bounded_where_they_are_parsed():
    from msc.units import parse_size

    assert parse_size("1T") == MAX_BYTES
    with pytest.raises(UsageError, match=f"size 8192G is 8796093022208, over msc's limit of {MAX_BYTES}"):
        parse_size("8192G")
    with pytest.raises(UsageError, match=r"bad size '9{40}\.\.\.'"):
        parse_size("9" * 10 ** 6)                       # a huge token is not echoed whole


# in this process (tests/clirun.py); tests/test_cli_processes.py runs each command as a process
def _msc(*args, cwd):
    return clirun.msc(*args, cwd=cwd)


def test_msc_run_estimates_memory_before_allocating(tmp_path):
    save_plan(lower(msc.trace(RING, 4), LowerOptions()), tmp_path / "ring.plan")
    done = _msc("run", "ring.plan", "-b", "512G", "-e", "512G", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "needs about" in done.stderr and "GiB of host memory here" in done.stderr and "lower -e" in done.stderr


def test_msc_simulate_refuses_a_size_past_the_limit(tmp_path):
    save_plan(lower(msc.trace(RING, 4), LowerOptions()), tmp_path / "ring.plan")
    done = _msc("simulate", "ring.plan", "-t", "ring:4", "-b", "0", "-e", str(10 ** 23), cwd=tmp_path)
    assert done.returncode == 2 and "over msc's limit" in done.stderr and "Traceback" not in done.stderr


def test_a_scratch_index_of_a_trillion_is_refused_at_the_users_line(tmp_path):
    path = tmp_path / "big.py"
    path.write_text("import msc\n\n@msc.algorithm('allgather')\ndef big(p):\n"
                    "    p.chunk(0, 'input', 0).copy(1, 'scratch', 10**12)\n")
    done = _msc("verify", str(path), "--ranks", "2", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "big.py:5: copy: rank 1 scratch[1000000000000:1000000000001] would grow" in done.stderr
    assert "past msc's limit of 67108864 chunks" in done.stderr


def test_export_ranges_take_sizes_and_are_bounded(tmp_path):
    save_plan(lower(msc.trace(RING, 4), LowerOptions()), tmp_path / "ring.plan")
    done = _msc("export", "ring.plan", "--max-bytes", str(10 ** 23), "-o", "x.xml", cwd=tmp_path)
    assert done.returncode == 2 and "over msc's limit" in done.stderr and not (tmp_path / "x.xml").exists()
    done = _msc("export", "ring.plan", "--min-bytes", "1M", "--max-bytes", "1K", "-o", "x.xml", cwd=tmp_path)
    assert done.returncode == 2 and "max_bytes must be" in done.stderr and not (tmp_path / "x.xml").exists()
    done = _msc("export", "ring.plan", "--min-bytes", "1K", "--max-bytes", "1M", "-o", "x.xml", cwd=tmp_path)
    assert done.returncode == 0 and 'minBytes="1024"' in (tmp_path / "x.xml").read_text()


def test_simulate_refuses_a_tile_that_makes_a_billion_iterations(tmp_path):
    save_plan(lower(msc.trace(RING, 4), LowerOptions()), tmp_path / "ring.plan")
    start = time.process_time()
    done = _msc("simulate", "ring.plan", "-t", "ring:4", "--tile", "1", "-b", "1G", "-e", "1G", cwd=tmp_path)
    assert done.returncode == 2 and "268435456 tiles of 1 bytes per chunk, over msc's limit" in done.stderr
    assert time.process_time() - start < 30


def test_a_program_within_the_move_limit_lowers_to_a_plan_within_the_step_limit():
    """MAX_STEP_MOVES is twice MAX_CHUNK_MOVES because every transfer is a
    send step and a receive step (a fused forward one): over the library,
    and with instances, a plan's steps move at most twice the chunks its
    program's operations do (fewer where local copies fuse away)."""
    from msc.errors import MscError
    from msc.ir.limits import MAX_CHUNK_MOVES, MAX_STEP_MOVES

    assert MAX_STEP_MOVES == 2 * MAX_CHUNK_MOVES
    checked = 0
    for key, alg in algorithms(switch=False).items():
        for n in (4, 8):
            try:
                program = msc.trace(alg, n)
            except MscError:
                continue
            for instances in (1, 2):
                plan = lower(program, LowerOptions(instances=instances))
                moved = sum(step.count for _, _, _, step in plan.steps())
                assert 0 < moved <= 2 * program.chunk_ops() * instances, key
                checked += 1
    assert checked > 40
