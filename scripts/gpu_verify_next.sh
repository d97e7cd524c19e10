#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server; xgrammar 0.2.8, apache-tvm-ffi and
# transformers 5.23.0 with what it imports for structured output) and, for an old-vs-new comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`).
# Parts owed (add one as `if [ "$PART" = name ]; then ... fi` below, with what it must show):
#   bash scripts/gpu_verify_next.sh moe_align    # issue 21: MoE slot alignment in one launch (fourteenth session, after its GPU time)
#   bash scripts/gpu_verify_next.sh checkpoints  # issue 26: state checkpoints inside flash's launch (fourteenth session, after its GPU time)
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
if [ "$PART" = moe_align ]; then
# Must show: rc=0 and no FAILED line for the MoE GPU tests (the fused experts at Kimi's sizes now
# align in one launch: decode-sized batches take it, 8K-token prefill the torch path) and the
# Kimi-Linear engine at its real shape with graphs; the main table of bench_moe_mla.py: the "MoE
# align" rows (kernel vs torch path, graphed, at batch 1-256: set ops/moe/align.KERNEL_MAX_SLOTS,
# now 128 slots = batch 16, to the crossover) and MoE decode at batch 1 under the fourteenth
# session's 0.0975 ms (graph). Record both in docs/perf-notes.md.
group moe_gpu 200 tests/ops/test_moe.py -k gpu
group kimi_gpu 150 tests/models/test_kimi_linear_gpu.py
timeout 200 python3 benchmarks/bench_moe_mla.py --prefill 8192 2>&1 | tail -20
fi
if [ "$PART" = checkpoints ]; then
# Must show: rc=0 and no FAILED line for flash's GPU tests (test_gpu_checkpoints_inside_the_launch:
# bf16, 32 heads, segmented automatic plan, both gates) and the prefix-caching GPU tests (flash
# now writes the checkpoints a prompt crosses; CUDA graphs); then bench_checkpoint_cost.py: the
# cost of checkpoints every 512 tokens (issue goal: at most 3% of prefill time; the checkpoint
# variants of K2 spill 200 bytes on sm_90 in the compile check, the plain one 8) and
# bench_prefix_caching.py's TTFT table against docs/prefix-caching.md's. Record in perf-notes.
group flash_gpu 240 tests/ops/test_flash_prefill.py -k "gpu and checkpoints"
group prefix_gpu 150 tests/engine/test_prefix_caching_gpu.py
timeout 150 python3 benchmarks/bench_checkpoint_cost.py 2>&1 | tail -12
fi
