#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server) and, for an old-vs-new comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`).
# Parts owed (add one as `if [ "$PART" = name ]; then ... fi` below, with what it must show):
#   bash scripts/gpu_verify_next.sh spec       # speculative decoding on its final code
#   bash scripts/gpu_verify_next.sh spec_kimi  # speculative decoding at Kimi-Linear's shape (random weights)
#   bash scripts/gpu_verify_next.sh slow       # flash's slow (128K) tests, not run since the gate-logit rename
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
P="python3 -m pytest -v -p no:cacheprovider"
BUDGET=${BUDGET:-570}; START=$(date +%s)
group() {  # name, seconds, pytest args...: one pytest process per file (one GPU, one at a time)
  local name=$1 secs=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 20 ]; then echo "== $name NOT RUN (budget)"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  local t0=$(date +%s)
  timeout "$secs" $P "$@" > "$OUT/t_$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(grep -c PASSED "$OUT/t_$name.log") passed $(grep -c SKIPPED "$OUT/t_$name.log") skipped $(( $(date +%s) - t0 )) s"
  grep -E "FAILED|^E  " "$OUT/t_$name.log" | head -6
  [ $rc -ne 0 ] && ! grep -q FAILED "$OUT/t_$name.log" && tail -4 "$OUT/t_$name.log"
  return 0
}
PART=${1:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -z "$PART" ] && echo "name a part"
if [ "$PART" = spec ]; then
# The ninth session ran the speculative GPU tests and benchmarks (runs 7-12), then vectorized the
# verify rows (step_inputs._verify_rows, a 2-D block-table array into write_block_tables) and moved
# the capacity message into capacity_error, and the GPU tests now take their scripted drafts from
# kdaserve/testing/speculative.py: CPU tests pass, these GPU runs have not seen that code.
# Must show: every group rc=0; the capacity test passes (its message now says "per state slot");
# the profile's verify "engine step" at batch 32 below run 10's 3687 µs (rows built in ~half the
# host time), and bench_speculative's table again.
group engine_spec 120 -k speculative tests/engine/test_engine_gpu.py
group kimi_spec 150 -k "speculative or too_many" tests/models/test_kimi_linear_gpu.py
timeout 80 python3 benchmarks/profile_speculative.py --batches 8 32 2>&1 | tail -6
timeout 200 python3 benchmarks/bench_speculative.py --batches 1 8 32 2>&1 | tail -12
fi
if [ "$PART" = spec_kimi ]; then
# The issue's numbers at Kimi-Linear's shape: one plain and one speculative engine per row, each
# building the 48B model with random weights (~92 GiB). Must show the table (acceptance is the
# random model's; the verify step's cost against the plain step's is the point).
timeout 560 python3 benchmarks/bench_speculative.py --batches 1 8 --model moonshotai/Kimi-Linear-48B-A3B-Instruct \
    --load-format dummy --workloads random oracle --input-len 256 --output-len 64 2>&1 | tail -7
fi
if [ "$PART" = slow ]; then
# Must show: rc=0 and no FAILED line (128K-token prefills against the reference; kernels unchanged
# since they last passed in the sixth session, names changed since).
group flash_slow 560 -m "gpu and slow" tests/ops/test_flash_prefill.py
fi
