#!/usr/bin/env bash
# First GPU run of the next session: what landed after the last GPU run of 2026-11-30 (third
# session) or could not be fitted into it. Two parts, each under the device tool's 10-minute limit
# (about 8 and 7 minutes on an H200); logs under $OUT (or ./out). Every group has its own time
# limit and verbose log, so one slow group cannot hide the others.
#   bash scripts/gpu_verify_next.sh tests     # GPU tests
#   bash scripts/gpu_verify_next.sh bench     # benchmarks and the sanitizer
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
# 1. The warm-up now starts its decode batch classes at p = 4 (bf16 [32, K] split shape at 129-255
#    heads): the compile-nothing tests; the spec [N, 1] verify fix and adaptive; the stream shape's
#    last graph-replay variant (cut by the time limit last run); flash (NFIRST >= 2 and the grid
#    check are CPU-tested); chunk's default must be exactly the old kernel.
group engine 110 -m "not slow" tests/engine/test_host_overhead_gpu.py
group decode 170 -m "gpu and not slow" tests/ops/test_fused_stream.py tests/ops/test_adaptive_decode.py tests/ops/test_fused_decode.py
group flash 110 -m "gpu and not slow" tests/ops/test_flash_prefill.py   # incl. the anchored unbounded gate
group chunk 80 -m "gpu and not slow" tests/ops/test_chunk_prefill.py
fi
if [ "$PART" = bench ]; then
# 2. The full 32-head decode table under the final rule (stream from 256 heads), one run.
timeout 90 python3 benchmarks/bench_decode.py --sections table --heads 32 > "$OUT/decode.log" 2>&1; sed -n '/goals/,$p' "$OUT/decode.log"
# 3. Engine throughput after the warm-up fixes: the first timed run should compile nothing.
TRITON_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/bench_throughput.py --pairs chunk+chain,flash+fused \
  --num-requests 64 --timed-runs 2 --no-script-warmup > "$OUT/throughput.log" 2>&1; grep -E "compiles|req/s" "$OUT/throughput.log" | tail -6
# 3b. The unbounded gate (Kimi-Linear): flash's K1 exact column loop made flash 3.6 ms at 32 heads
#     1 x 8K (bounded: 0.96). Is chunk faster there? If so, `auto` should pick by gate kind.
timeout 90 python3 - <<'PY' 2>&1 | grep -v Warn | tail -4
import functools, sys, os; sys.path.insert(0, os.getcwd())
from benchmarks.bench_prefill import gpu_case, parse_shape, bench_ms
from kdaserve.ops.chunk import kda_prefill_chunk
from kdaserve.ops.flash import kda_prefill_flash
from kdaserve.ops.flash.config import CONFIG
for shape in ("1x8K", "16x1K"):
    for gate in ("bounded", "unbounded"):
        case = gpu_case(parse_shape(shape), 32, gate=gate)
        line = f"32 heads {shape} {gate}: chunk {bench_ms(kda_prefill_chunk, case):.3f} ms, flash {bench_ms(kda_prefill_flash, case):.3f} ms"
        if gate == "unbounded":  # the opt-in anchored halves (CONFIG.unbounded_anchored)
            CONFIG.unbounded_anchored = True
            line += f", flash anchored {bench_ms(kda_prefill_flash, case):.3f} ms"
            CONFIG.unbounded_anchored = False
        print(line, flush=True)
PY
# 4. Where intra_full.py's slices-outer loop faults (opt-in chunk intra kernel), if the tool is there.
if command -v compute-sanitizer >/dev/null; then
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 python3 - > "$OUT/sanitizer.log" 2>&1 <<'PY'
import sys, os; sys.path.insert(0, os.getcwd())
import torch
from benchmarks.bench_prefill import gpu_case
from kdaserve.ops.chunk import ChunkConfig, kda_prefill_chunk
case = gpu_case([64], 1)
kda_prefill_chunk(out=case.new_out(), config=ChunkConfig(intra_inverse="full", intra_slice_outer=True), **case.prefill_args())
torch.cuda.synchronize()
PY
  grep -E "Invalid|at 0x|by thread|Address" "$OUT/sanitizer.log" | head -8
fi
fi
