#!/usr/bin/env bash
# First GPU run after the 2026-11-30 host-overhead work (engine staging ring, sampler transfer,
# start-up warm-up, prefill table caches, `adaptive` decode): none of it has run on a GPU yet.
# About 6-8 minutes on an H200; logs under $OUT (or ./out). Run from the repo root:
#   bash scripts/gpu_verify_host_work.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# 1. Correctness of the GPU-only paths (graph decode == eager with the staging ring, one sync per
#    decode step, warm-up changes no outputs and leaves nothing to compile, tables from pinned
#    memory, a captured conv replays right after pinned memory is recycled, adaptive == its kernel).
timeout 300 python3 -m pytest -q -x -p no:cacheprovider -m "not slow" \
  tests/engine/test_host_overhead_gpu.py tests/ops/test_host_overhead.py tests/ops/test_adaptive_decode.py \
  tests/engine/test_engine_gpu.py tests/layers/test_kda_layer_gpu.py 2>&1 | tee "$OUT/verify_tests.log" | tail -15
# 2. Effect: host time per prefill call (was chunk 1401 / flash 780 us on one H200 host) ...
timeout 200 python3 benchmarks/bench_prefill.py --no-agreement --no-stages --device-time --heads 32 --shapes 1x8K 16x1K \
  2>&1 | tee "$OUT/prefill_host.log" | tail -8
# ... the engine step vs the graph replay, and the first timed run on a cold kernel cache (the
#    warm-up should leave nothing to compile: the compile counts are printed per phase) ...
TRITON_CACHE_DIR=$(mktemp -d) timeout 300 python3 benchmarks/bench_throughput.py --pairs chunk+chain,flash+fused \
  --num-requests 64 --timed-runs 2 --no-script-warmup 2>&1 | tee "$OUT/throughput.log" | tail -12
# ... and the adaptive decode column with its verdict line.
timeout 200 python3 benchmarks/bench_decode.py --sections table --heads 32 2>&1 | tee "$OUT/decode.log" | tail -12
