#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server; xgrammar 0.2.8, apache-tvm-ffi and
# transformers 5.23.0 with what it imports for structured output) and, for an old-vs-new comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`).
# Parts owed (add one as `if [ "$PART" = name ]; then ... fi` below, with what it must show):
#   bash scripts/gpu_verify_next.sh mtp_graphs   # issue 28: the MTP drafter after CUDA-graph verify steps, --quantization fp8 (thirteenth session, after its GPU time)
#   bash scripts/gpu_verify_next.sh moe_mla      # issue 21 goal 5: the MoE and MLA kernels against their floors and the torch path
#   bash scripts/gpu_verify_next.sh graphs       # the CUDA-graph engine tests after DecodeGraphs' metadata moved into one helper
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
if [ "$PART" = mtp_graphs ]; then
# Must show: rc=0 and no FAILED line for the GLM model tests, the new
# test_gpu_mtp_with_cuda_graphs_is_lossless among them (graphs on, greedy tokens equal to eager MTP
# and to no speculation), and for the Kimi-Linear model tests (--quantization fp8 with the FP8
# GEMMs on the GPU: test_quantization_fp8_keeps_experts_mlps_and_mla_projections_in_fp8); then `kdaserve generate` on glm-tiny with MTP, graphs on vs
# --enforce-eager: its throughput line for what the graphs save (record it in docs/perf-notes.md).
group glm_gpu 300 tests/models/test_glm5_next.py
group kimi_gpu 120 tests/models/test_kimi_linear.py
left=$(( BUDGET - ($(date +%s) - START) ))
for eager in "" --enforce-eager; do
  timeout $(( left > 60 ? left / 2 - 10 : 20 )) python3 -m kdaserve.cli generate --model glm-tiny $eager \
    --prompt "KDA is" --prompt "The state of a linear attention layer" --max-tokens 256 \
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' 2>&1 | tail -4
done
fi
if [ "$PART" = moe_mla ]; then
# Must show: the table of benchmarks/bench_moe_mla.py (Kimi-Linear's sizes; decode at batch 1-256
# against the bytes floor, prefill at 1K and 8K tokens against the bf16 tensor rate, the torch path
# beside each). Record it in docs/perf-notes.md under issue 21 with what limits each row.
timeout $(( BUDGET - 20 )) python3 benchmarks/bench_moe_mla.py 2>&1 | tail -16
fi
if [ "$PART" = graphs ]; then
# Must show: rc=0 and no FAILED line: graph decode equals eager (test_engine_gpu.py), the Kimi-Linear
# engine at its real shape with graphs (test_kimi_linear_gpu.py).
group engine_gpu 300 tests/engine/test_engine_gpu.py
group kimi_gpu 240 tests/models/test_kimi_linear_gpu.py
fi
