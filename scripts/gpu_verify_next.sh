#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server; xgrammar 0.2.8, apache-tvm-ffi and
# transformers 5.23.0 with what it imports for structured output) and, for an old-vs-new comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`).
# Parts owed (add one as `if [ "$PART" = name ]; then ... fi` below, with what it must show):
#   bash scripts/gpu_verify_next.sh ab     # kdaserve ab at Kimi-Linear's shape (issue 22), one real A/B
#   bash scripts/gpu_verify_next.sh nano_accuracy   # fp32 vs bf16 recurrent state on the nano model (issue 22)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
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
if [ "$PART" = ab ]; then
# Issue 22's real A/B: flash+fused against fla+fla at Kimi-Linear's shape (dummy weights), two
# rounds of A B B A (8 server starts of the 48B model, ~50 s each) plus the two provenance runs.
# Must show: every run's line, the provenance lines (A: flash_* and fused kernels; B: FLA's
# chunk_kda / fused_recurrent kernels), and the table; $OUT/ab/ab.json and both plots come back.
# The provenance runs each take a process of their own (the first attempt, 2026-12-02, built them in
# the ab process, whose memory then starved the first server). Graphs captured up to 16 rows only
# (the concurrency) to keep the 10 starts short.
timeout 580 python3 -m kdaserve.cli ab --model moonshotai/Kimi-Linear-48B-A3B-Instruct \
  --a="--load-format dummy --kda-prefill-backend flash --kda-decode-backend fused --max-num-seqs 16 --max-cudagraph-capture-size 16 --max-model-len 4096" \
  --b="--load-format dummy --kda-prefill-backend fla --kda-decode-backend fla --max-num-seqs 16 --max-cudagraph-capture-size 16 --max-model-len 4096" \
  --rounds 2 --num-prompts 32 --input-len 512 --output-len 64 --max-concurrency 16 --out "$OUT/ab"
fi
if [ "$PART" = nano_accuracy ]; then
# Issue 22's accuracy check: fp32 against bf16 recurrent state on the trained nano model, with
# chunked prefill (prompts up to 512 tokens cut into 64-token chunks) so the state round-trips
# through its storage dtype. Must show the table: mean/max |log-prob difference|, exact match per
# arm, McNemar p, greedy agreement; $OUT/nano_accuracy.json comes back.
timeout 400 python3 -m kdaserve.cli accuracy --stdlib-held-out --num-tasks 200 \
  --a="--max-num-batched-tokens 64" --b="--max-num-batched-tokens 64 --mamba-ssm-cache-dtype bfloat16" \
  --json "$OUT/nano_accuracy.json" 2>&1 | tail -12
fi
