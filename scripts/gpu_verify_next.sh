#!/usr/bin/env bash
# First GPU runs of the next session: what the seventh session (2026-12-01) changed after its GPU
# time ran out, and what the sixth left unrun. Already run on the final code (seventh session, runs
# 5 and 6): the engine GPU tests (14), the KDA layer GPU tests and the host-table GPU tests (11). Each part fits one 10-minute device command (group
# limits sum to <= 560 s); logs under $OUT (or ./out). Carry [".whl"] (fla-core 0.6.0) for the
# parts with FLA, and [".old"] for `ab` (.old = `git archive 8f677f4 kdaserve benchmarks`, the code
# before the seventh session, unpacked at the repository root).
#   bash scripts/gpu_verify_next.sh tests     # prefill ops with their step plans, host tables, layers
#   bash scripts/gpu_verify_next.sh engine    # the engine and the server on the per-step plan
#   bash scripts/gpu_verify_next.sh ab        # old vs new code, back-to-back processes (~6 min)
#   bash scripts/gpu_verify_next.sh bench     # issue 5's goal cells with FLA (~6 min)
#   bash scripts/gpu_verify_next.sh calib     # flash's segment cost model: measure, then time (~4 min)
# What each must show: every group "rc=0" with no FAILED line; `ab`: no new column slower than
# its old one beyond the old/old spread of the same part (it runs old, new, old).
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
# 1. The prefill ops now take a step plan built once (no module caches, frozen FlashConfig): the
#    host-table GPU tests (pinned copies, a conv captured in a graph), flash and chunk (not slow),
#    the KDA layer on the GPU (plans from the context), the adapters (FLA: conv tables in the plan).
group flash 150 -m "gpu and not slow" tests/ops/test_flash_prefill.py
group chunk 150 -m "gpu and not slow" tests/ops/test_chunk_prefill.py
group adapters 100 -m gpu tests/backends/test_adapters_gpu.py   # needs .whl (fla)
group layers_fla 60 -m gpu tests/layers/test_kda_layer_gpu.py      # its fla rows skipped without .whl
group stream 130 -m "gpu and not slow" tests/ops/test_fused_stream.py
fi
if [ "$PART" = engine ]; then
# 2. The engine builds each step's KDA plan once (runner and CUDA-graph capture) and resolves
#    the backend pair once per model; the ops check inputs against ops/limits.py.
group server 120 -m gpu tests/server/test_server_gpu.py
group adaptive 70 tests/ops/test_adaptive_decode.py
group gate_accuracy 60 tests/ops/test_decode_gate_accuracy.py
group fused 120 -m "gpu and not slow" tests/ops/test_fused_decode.py
group chain 60 -m "gpu and not slow" tests/ops/test_chain.py
fi
if [ "$PART" = ab ]; then
# 3. Old (.old) vs new, back-to-back processes, same card: prefill columns (each timed with its
#    step plan built outside the timing, as the engine does; the old code cached it per step),
#    decode, and the engine (64 requests; host planning once per step against the old per-layer
#    cache lookups).
for v in old new old; do
  root=$PWD; [ $v = old ] && root=$PWD/.old
  (cd "$root" && PYTHONPATH=$root timeout 90 python3 benchmarks/bench_prefill.py --no-agreement --no-stages --heads 32 64 \
     --shapes 1x8K 16x1K 2>&1 | sed -n '/^| /p' | sed "s/^/$v prefill /")
  (cd "$root" && PYTHONPATH=$root timeout 90 python3 benchmarks/bench_throughput.py --pairs flash+fused,chunk+chain \
     --num-requests 64 2>&1 | sed -n '/^| /p' | sed "s/^/$v engine /")
done
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
        plan = flash_step_plan(inp["seqs"].cu_seqlens, inp["seqs"].cu_seqlens_cpu, sum(lens), H, 128, True,
                               config=dataclasses.replace(DEFAULT_CONFIG, **cfg))
        fn = lambda: kda_prefill_flash(**inp, step_plan=plan)
        fn(); torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        print(f"| {H} | {len(lens)}x{lens[0]} | {name} | {ms:.3f} |", flush=True)
    del inp; torch.cuda.empty_cache()
PY
echo "calib rc=$?"; cat "$OUT/calib.log"
fi
