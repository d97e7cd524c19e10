#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server; xgrammar 0.2.8, apache-tvm-ffi and
# transformers 5.23.0 with what it imports for structured output) and, for an old-vs-new comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`).
# Parts owed (add one as `if [ "$PART" = name ]; then ... fi` below, with what it must show):
#   bash scripts/gpu_verify_next.sh moe_threshold      # issue 21: the alignment kernel up to 1024 slots (fifteenth session)
#   bash scripts/gpu_verify_next.sh checkpoint_stages  # issue 26: where in-launch checkpoints cost flash 5-9% on one long prompt
#   bash scripts/gpu_verify_next.sh serving_host       # issue 21 goal 2: ITL through the server against the engine's step
#   bash scripts/gpu_verify_next.sh vllm_layouts       # issue 30: the plugin's step on vLLM's layouts, bf16, flash + fused
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
if [ "$PART" = moe_threshold ]; then
# Must show: rc=0 and no FAILED line for the fused MoE at Kimi's sizes (T = 64 now aligns with the
# one-launch kernel: KERNEL_MAX_SLOTS went from 128 to 1024 slots after the fifteenth session's
# "MoE align" rows) and the Kimi-Linear engine at its real shape with graphs; then bench_moe_mla's
# MoE decode rows at batch 32, 64, 128: each at most its fifteenth-session value (0.6557, 0.8865 ms
# graphed, torch-path alignment then) and the "MoE align" kernel column under the torch column up
# to batch 128. Record in docs/perf-notes.md (the reference table "MoE and MLA kernels").
group moe_fused 150 tests/ops/test_moe.py -k "gpu and fused"
group kimi_gpu 150 tests/models/test_kimi_linear_gpu.py
timeout 200 python3 benchmarks/bench_moe_mla.py --prefill 1024 --batches 32 64 128 2>&1 | grep -E "^\| (kernel|MoE)"
fi
if [ "$PART" = checkpoint_stages ]; then
# Must show: the second table of bench_checkpoint_cost.py --stages: each launch's ms with and
# without checkpoints every 512 tokens at 1x8K and 1x32K, both gates (the whole step: +8.8% /
# +8.5% bounded, +4.8% / +6.4% unbounded in the fifteenth session; the issue's goal 3%). It says
# which launch to fix: the map pass (the checkpoint variant's spills and shared memory: compile
# check), the scan (serial compositions, one [BV, K] x [K, K] tf32x3 dot per checkpoint inside a
# segment), or prepare (unchanged code: should show nothing). Record in docs/perf-notes.md.
timeout 300 python3 benchmarks/bench_checkpoint_cost.py --shapes 1x8K 1x32K --stages 2>&1 | tail -24
# and what the engine writes in one step (each request's last 4 boundaries, its default cap):
timeout 200 python3 benchmarks/bench_checkpoint_cost.py --shapes 1x8K 1x32K 16x1K --cap 4 2>&1 | tail -10
fi
if [ "$PART" = serving_host ]; then
# Must show: bench_serving_host.py's two tables on this machine's host (needs the server wheels in
# .whl): (1) a fixed 2.5 ms device time (the host's Python alone; on the CPU machine ITL median was
# 1.14-1.17x the engine alone at 64 streams) and (2) the real `bench` model on the H200 with CUDA
# graphs at 64 streams: ITL median / engine alone (issue 21 goal 2: at most 1.15x; 8.0 ms vs a
# 2.5 ms step through `vllm bench serve` on 2026-12-01). If (2) is far above (1), rerun it with
# --profile and record where the event loop's time goes. Record in docs/perf-notes.md.
timeout 200 python3 benchmarks/bench_serving_host.py --rounds 2 2>&1 | tail -6
timeout 350 python3 benchmarks/bench_serving_host.py --rounds 2 --model bench 2>&1 | tail -6
fi
if [ "$PART" = vllm_layouts ]; then
# Must show: rc=0 and no FAILED line: the vLLM plugin's step (kdaserve_vllm/gdn_step.py) on vLLM's
# exact layouts (strided views of the fused projection, CUDA-graph padding rows, padding slots -1,
# a ragged verify) through flash prefill and fused decode / verify, bf16, 32 heads x 128, both conv
# layouts: bit for bit the same step on contiguous copies, no padding row or outside slot written.
group vllm_layouts 200 tests/integrations/test_vllm_layouts.py -k gpu
fi
