#!/usr/bin/env bash
# The first GPU window's one device command (bench/README.md, "The first GPU run"): the carried
# wheels the image lacks (bench/carry.py), then bench/first_gpu_run.py under a hard limit that
# SIGINTs it (it writes its summary) and kills it 15 s later. $OUT: where the results go (the
# device tool's output folder); $BUDGET_S: the run's budget (default 480); arguments go to the run.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
budget=${BUDGET_S:-480}
python=${PYTHON:-python3}
mkdir -p "$OUT"
"$python" bench/carry.py --wheels .whl --target /tmp/msc-site 2>&1 | tee "$OUT/carry.log" || exit 3
export PYTHONPATH="/tmp/msc-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout -s INT -k 15 $((budget + 45)) "$python" bench/first_gpu_run.py --budget-s "$budget" \
    --out "$OUT/first-run" "$@" 2>&1 | tee "$OUT/first-run.log"
