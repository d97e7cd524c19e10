#!/usr/bin/env bash
# First GPU runs of the next session: what the sixth session (2026-11-30) changed but could not run
# on the GPU, or measured only without FLA. Three parts, each under the device tool's 10-minute
# limit (group limits sum to <= 560 s); logs under $OUT (or ./out). Run with carry [".whl"].
#   bash scripts/gpu_verify_next.sh tests     # fastmath error bounds (new), engine with the new sigmoid
#   bash scripts/gpu_verify_next.sh bench     # the issue-5 goal cells with FLA, new code (~6 min)
#   bash scripts/gpu_verify_next.sh calib     # flash's segment cost model: measure, then time (~4 min)
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
naive_softplus_copy() {  # the package with fused's old plain log(1 + exp(x)) softplus, under /tmp/naive
rm -rf /tmp/naive && mkdir -p /tmp/naive && cp -r kdaserve /tmp/naive/ && python3 - <<'PY'
p = "/tmp/naive/kdaserve/ops/triton_math.py"; s = open(p).read()
s = s.replace("return tl.where(x > SOFTPLUS_THRESHOLD, x, tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x))))",
              "return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))")
open(p, "w").write(s)
PY
}
PART=${1:-tests}
if [ "$PART" = kernels ]; then
# 0. Seventh session: every kernel now takes its gate, softplus, l2 norm and norm scale from
#    kdaserve/ops/triton_math.py (fused's softplus was a plain log(1 + exp(x))). Each decode and
#    prefill GPU test file, one at a time; the new tiny-softplus test must also FAIL with the
#    plain softplus put back (shown on a copy under /tmp, the repo is untouched).
group triton_math 60 tests/ops/test_triton_math.py
group gate_accuracy 90 tests/ops/test_decode_gate_accuracy.py
naive_softplus_copy
PYTHONPATH=/tmp/naive:$PYTHONPATH timeout 60 $P -m gpu tests/ops/test_decode_gate_accuracy.py -k fused > "$OUT/t_naive.log" 2>&1
echo "== naive softplus (must FAIL): rc=$? $(grep -oE 'relative RMS error [0-9.e+-]+' "$OUT/t_naive.log" | head -2 | tr '\n' ' ')"
for f in chain recurrent_triton norm_triton; do
  group $f 75 -m "gpu and not slow" tests/ops/test_$f.py
done
group flash 120 -m "gpu and not slow" tests/ops/test_flash_prefill.py
fi
if [ "$PART" = kernels2 ]; then
# 0c. The files whose Triton compiles outlast 75 s (first run: fused 28, stream 10, chunk 9 passed
#     before the limit, none failed); adaptive has no gpu marks, so all of it runs on CUDA.
group fused_decode 160 -m "gpu and not slow" tests/ops/test_fused_decode.py
group fused_stream 130 -m "gpu and not slow" tests/ops/test_fused_stream.py
group chunk 170 -m "gpu and not slow" tests/ops/test_chunk_prefill.py
group adaptive 70 tests/ops/test_adaptive_decode.py
group fastmath 45 -m gpu tests/ops/test_flash_fastmath.py
fi
if [ "$PART" = ab ]; then
# 0b. The shared math against the code before it (.old/ = git archive 8f677f4 kdaserve benchmarks,
#     carried), back-to-back processes old, new, old, new on the same card; no FLA (not installed
#     in this part), decode as CUDA-graph replays. Must show: no column slower beyond the A/A spread.
for v in old new old new; do
  root=$PWD; [ $v = old ] && root=$PWD/.old
  (cd "$root" && PYTHONPATH=$root timeout 70 python3 benchmarks/bench_decode.py --sections table --heads 32 \
     --batches 1 64 256 2>&1 | sed -n '/^| /p' | sed "s/^/$v decode /")
  (cd "$root" && PYTHONPATH=$root timeout 80 python3 benchmarks/bench_prefill.py --no-agreement --no-stages --heads 32 \
     --shapes 1x8K 16x1K --gate unbounded 2>&1 | sed -n '/^| /p' | sed "s/^/$v prefill-unbounded /")
done
fi
if [ "$PART" = final ]; then
# 0d. After the triton_math tolerance fix (the GPU's exp costs |x| * 2^-24), the resolve-once
#     refactor and the engine flags: math tests, one A/B round, engine and layer GPU tests.
group triton_math 40 tests/ops/test_triton_math.py
group gate_accuracy 60 tests/ops/test_decode_gate_accuracy.py
naive_softplus_copy
PYTHONPATH=/tmp/naive:$PYTHONPATH timeout 60 $P -m gpu tests/ops/test_decode_gate_accuracy.py -k fused > "$OUT/t_naive.log" 2>&1
echo "== naive softplus (must FAIL): rc=$? $(grep -oE 'relative RMS error [0-9.e+-]+' "$OUT/t_naive.log" | head -2 | tr '\n' ' ')"
for v in old new; do
  root=$PWD; [ $v = old ] && root=$PWD/.old
  (cd "$root" && PYTHONPATH=$root timeout 70 python3 benchmarks/bench_decode.py --sections table --heads 32 \
     --batches 1 64 256 2>&1 | sed -n '/^| /p' | sed "s/^/$v decode /")
  (cd "$root" && PYTHONPATH=$root timeout 80 python3 benchmarks/bench_prefill.py --no-agreement --no-stages --heads 32 \
     --shapes 1x8K 16x1K --gate unbounded 2>&1 | sed -n '/^| /p' | sed "s/^/$v prefill-unbounded /")
done
group engine 200 -m gpu tests/engine/test_host_overhead_gpu.py tests/engine/test_engine_gpu.py
group layers 60 -m gpu tests/layers/test_kda_layer_gpu.py
fi
if [ "$PART" = tests ]; then
# 1. The new GPU tests of fastmath's error bounds (sigmoid_tanh included) have never run.
group fastmath 60 -m gpu tests/ops/test_flash_fastmath.py
# 2. The engine GPU tests last ran before the one-MUFU sigmoid changed flash's K1/K2/correct.
group engine 230 -m gpu tests/engine/test_host_overhead_gpu.py tests/engine/test_engine_gpu.py
# 3. The flash GPU tests passed with the change (run 7); the non-slow ones again, as a guard.
group flash 200 -m "gpu and not slow" tests/ops/test_flash_prefill.py
fi
if [ "$PART" = bench ]; then
# 4. Issue 5's goal cells with FLA in the same process, on the code with the one-MUFU sigmoid
#    (the sixth session's FLA ratios ran the code before it). Two processes (FLA's own timing
#    varies between processes: note it).
timeout 300 python3 benchmarks/bench_prefill.py --no-agreement --no-stages --heads 96 64 \
  --shapes 1x8K 8x1K > "$OUT/prefill_a.log" 2>&1; echo "a rc=$?"; sed -n '/wall time/,$p' "$OUT/prefill_a.log"
timeout 250 python3 benchmarks/bench_prefill.py --no-agreement --no-stages --heads 32 16 \
  --shapes 1x8K 1x32K 1x128K > "$OUT/prefill_b.log" 2>&1; echo "b rc=$?"; sed -n '/wall time/,$p' "$OUT/prefill_b.log"
fi
if [ "$PART" = calib ]; then
# 5. config.py's cost_* constants against the sixth session's measurements (K2 step ~3.0 us,
#    map-pass step ~2.1 us, scan ~5 us per segment, 0.36 ns per token-head): the model then
#    segments 64 heads at 1x8K (4096; seg4096 measured -1.4% there), 1x32K (1824), 1x64K (3872), 1x128K
#    (7712), everything else unchanged. Time both rules before changing the defaults.
timeout 90 python3 -m tools.tune_flash --calibrate 2>&1 | tail -6   # measured on this card
timeout 400 python3 - > "$OUT/calib.log" 2>&1 <<'PY'
import torch, triton
import dataclasses
from kdaserve.ops.flash import DEFAULT_CONFIG, flash_step_plan, kda_prefill_flash
from tools.tune_flash import gpu_inputs
NEW = dict(cost_step_full_us=3.0, cost_step_seg_us=2.1, cost_scan_step_us=5.0, cost_token_head_seg_ns=0.36)
for H, lens in [(64, [8192]), (64, [32768]), (64, [131072]), (32, [32768]), (16, [131072]), (96, [8192])]:
    inp = gpu_inputs(H, lens)
    for name, cfg in (("current", {}), ("measured constants", NEW)):
        plan = flash_step_plan(inp["cu_seqlens"], inp["cu_seqlens_cpu"], sum(lens), H, 128, True,
                               config=dataclasses.replace(DEFAULT_CONFIG, **cfg))
        fn = lambda: kda_prefill_flash(**inp, step_plan=plan)
        fn(); torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        print(f"| {H} | {len(lens)}x{lens[0]} | {name} | {ms:.3f} |", flush=True)
    del inp; torch.cuda.empty_cache()
PY
echo "calib rc=$?"; cat "$OUT/calib.log"
fi
