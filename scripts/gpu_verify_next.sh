#!/usr/bin/env bash
# First GPU run of the next session: what the fourth session (2026-11-30) could not fit into its
# device time. Two parts, each under the device tool's 10-minute limit; logs under $OUT (or ./out).
# Every group has its own time limit and verbose log, so one slow group cannot hide the others.
#   bash scripts/gpu_verify_next.sh tests     # the slow 128K-token tests of the new defaults (~5 min)
#   bash scripts/gpu_verify_next.sh bench     # issue 3's table at 32 and 64 heads (~7 min)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
P="python3 -m pytest -v -p no:cacheprovider"
group() {  # name, seconds, pytest args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" $P "$@" > "$OUT/t_$name.log" 2>&1
  echo "== $name rc=$? $(grep -c PASSED "$OUT/t_$name.log") passed"; grep -E "FAILED|^E  " "$OUT/t_$name.log" | head -6
}
PART=${1:-tests}
if [ "$PART" = tests ]; then
# 1. chunk's wide intra default and flash's anchored unbounded gate at 128K tokens (slow-decay heads
#    held to 5e-3 on their own); both ran every non-slow GPU test in the fourth session.
group chunk128k 200 -m "gpu and slow" tests/ops/test_chunk_prefill.py
group flash128k 150 -m "gpu and slow" tests/ops/test_flash_prefill.py
fi
if [ "$PART" = bench ]; then
# 2. Issue 3's table with the wide chunk intra (only 16 heads fitted in the fourth session: 1.02x
#    the FLA arm at 1 x 64K, the closest cell). FLA autotunes per head count (~3-4 min each), so
#    every row is printed as it finishes ("done H=...").
timeout 560 python3 benchmarks/bench_prefill.py --no-agreement --no-stages --heads 64 32 \
  --shapes 1x64K 1x8K 16x1K 64x512 > "$OUT/prefill.log" 2>&1
echo "table rc=$?"; grep -E "done H=|host time" "$OUT/prefill.log"; sed -n '/wall time/,$p' "$OUT/prefill.log"
fi
