#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server; openai, jiter, distro, sniffio, httpx2,
# httpcore2, h11, anyio, truststore for part real_client's OpenAI-SDK client; xgrammar 0.2.8, apache-tvm-ffi and
# transformers 5.23.0 with what it imports for structured output; pillow for image_tower) and, for an old-vs-new
# comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`), [".base"] likewise for kimi_fusions.
# `bash scripts/gpu_verify_next.sh PART [PART ...]`: several parts run in order within one budget.
# `bash scripts/gpu_verify_next.sh --owed`: the parts still owed, one a line, in the order to run
# them (nothing when nothing is owed); parts kept to run again are not owed.
# Add a part as `if [ "$PART" = name ]; then ... fi` below, with what it must show, and name it in
# OWED; take it out of OWED once it ran (its numbers go to docs/perf-notes.md).
OWED=(
  fp4_small       # an H100 or H200 (issue 63): the decode shapes swept at batch 1 / 2 / 4 (never swept there)
  fp4_wide        # an H100 or H200 (issue 63): MXFP4 with scale codes past 128 (the words decoder's WIDE program)
  fp4_native      # a B200 / MI355X only (issue 63): MXFP4 experts through tl.dot_scaled, timed
  fp4_kimi_full   # an H200 (issue 63): the whole Kimi-Linear (27 layers) with MXFP4 experts against bf16
                  # (an H100 ran MXFP4 against FP8 with the byte tables, forty-third session: bf16 does not
                  # fit it; KIMI_FORMATS="mxfp4 fp8" on an H100 times the words program's whole model)
  house_speed     # on an H200 (issue 59 asks it there; the H100 ran it, thirty-third session: within A/A):
                  # .old = `git archive 6eb0c8b kdaserve benchmarks`
  tp_gpus         # two or more GPUs (kind nvidia-h100-x2 or larger; issue 61): tensor parallel over NCCL with
                  # CUDA graphs per rank, and its throughput against one GPU
)
# Done, kept to run again: fp4_placed, fp4_glm_pairs (forty-fourth session, H100), fp4_words (forty-third session, H100), fp4_pairs (forty-second session, H100), fp4_prefill, fp4_sweep_left, fp4_ncu (forty-first session, H100), fp4_sides (fortieth session, H100), fp4_pair (thirty-ninth session, H100; its KDASERVE_FP4_DECODER is gone, fortieth), fp4_bf16, fp4_shapes, fp4_glm, fp4_moe (thirty-eighth session, H100), image_tower (thirty-seventh session, H100), fp4_variants, ling_routing, ling_real, kimi_ttft (thirty-sixth session, H200), ling_tests (thirty-fourth session, H100: all passed), after_removal, house_tests, house_tests2, house_server and house_speed
# (thirty-third session, H100: all passed, throughput within A/A), k1_models and k1_models2 (thirty-second session, H100: all passed),
# k1_ncu (K1 under Nsight Compute), k1_defaults (the K1 GPU tests and
# the new defaults against the old), k1_prefetch_ncu, k1_table, k1_order (issue 21 goal 3), by the thirtieth
# session; moe_ncu (goal 4: the fused MoE prefill kernels under Nsight Compute),
# mla_prefill (the MLA GPU tests and launch-shape sweep), kimi_ttft (TTFT 8K and 32K), mla_glm_test,
# by the twenty-ninth session; align_default (goal 1), real_client
# (goal 2, the OpenAI SDK as the client), by the twenty-eighth session; kimi_decode_kinds,
# kimi_fusions (.base = `git archive c04ce36 kdaserve benchmarks`), host_split (.old = `git archive
# 272aacf kdaserve benchmarks`), by the twenty-seventh (docs/perf-notes.md). Removed after they ran
# (thirty-second session): k1_l2_ahead and k1_caps, with the variants they timed; (forty-third session)
# fp4_split, with split K (MoeTiles.split_k: no batch or shape won, docs/perf-notes.md); (forty-fourth session,
# never run) fp4_e4m3, with the byte tables it was to time (the words program replaced them: part fp4_placed).
if [ "${1:-}" = --owed ]; then
  for part in "${OWED[@]}"; do echo "$part"; done
  exit 0
fi
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
cap() {  # seconds: the smaller of $1 and what is left of the budget (at least 1)
  local left=$(( BUDGET - ($(date +%s) - START) )); [ "$left" -lt 1 ] && left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
fp4_sides_new_old_new() {  # log prefix: --moe-formats --fp4-sides, decode at batch 8 / 64 / 256 at Kimi-Linear's
  # and GLM-5.3-Flash's experts: the new code, the old (.old), the new again, each a process of its own
  for shape in kimi glm; do
    for code in new old new2; do
      [ $(( $(date +%s) - START )) -gt $(( BUDGET - 40 )) ] && { echo "== $shape $code NOT RUN (budget)"; continue; }
      local root=.; [ $code = old ] && root=.old
      local log="$OUT/$1_${shape}_$code.log"
      timeout $(cap 100) env PYTHONPATH="$PWD/$root:$PYTHONPATH" python3 $root/benchmarks/bench_moe_mla.py --moe-formats \
        --fp4-sides --moe-shape $shape --batches 8 64 256 --prefill > "$log" 2>&1
      echo "== $shape $code rc=$?"; grep "^|.*\(mxfp4\|nvfp4\) \(left\|right\)" "$log"
      grep -m3 "Error\|Traceback" "$log"
    done
  done
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ $# -eq 0 ] && echo "name a part (or several: they run in order and share the budget)"
for PART in "$@"; do
echo "#### part $PART ($(( BUDGET - ($(date +%s) - START) )) s of the budget left)"

if [ "$PART" = host_split ]; then
  # Must show, per pair of invocations (old then new, same command): the engine process's host work
  # per step in the server (trace columns core_cpu and host) lower with the new code (on the CPU
  # machine, fake device: core_cpu 0.61-0.67 -> 0.42-0.46 ms at 64 streams), the API processes' CPU
  # per token not higher (CPU machine: 28-33 -> 25-31 us with one, 42-46 -> 37-42 with two), and
  # ITL / alone for each: issue 21 goal 2 wants <= 1.15x. "alone" is the engine with its text,
  # the same bar for both. The trace's "execute" column is the runner's share of step() (staging,
  # replay, logits, sampling, readback): with the fake device (last invocation, same host, no GPU
  # work) it is the host step only, so the two "host" columns apart say how much of the engine's
  # host work is the GPU path's and how much is this host's Python speed (CPU machine: 0.24 ms alone).
  # Invocation 5: the new code at --stream-interval 4 (API CPU per token below invocation 4's).
  [ -d .old/kdaserve ] || { echo "carry .old (git archive 272aacf kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  cp benchmarks/bench_serving_host.py .old/benchmarks/
  i=0
  for n in 1 2; do   # ~80 s an invocation (model load, graphs, warm-up, alone, rounds): four fit
    for code in old new; do
      i=$((i + 1))
      [ $(( $(date +%s) - START )) -gt $(( BUDGET - 100 )) ] && { echo "== invocation $i NOT RUN (budget)"; continue; }
      dir=.; [ $code = old ] && dir=.old
      (cd $dir && timeout 100 python3 benchmarks/bench_serving_host.py --model bench --rounds 2 --trace \
         --api-server-count $n > "$OUT/hs_$i.log" 2>&1)
      echo "== invocation $i, $code code, $n API processes rc=$?"; grep "^| [0-9]\|^| alone" "$OUT/hs_$i.log"
    done
  done
  if [ $(( $(date +%s) - START )) -lt $(( BUDGET - 100 )) ]; then
    timeout 90 python3 benchmarks/bench_serving_host.py --model bench --rounds 2 --trace --api-server-count 2 \
      --stream-interval 4 > "$OUT/hs_5.log" 2>&1
    echo "== invocation 5, new code, 2 API processes, stream interval 4 rc=$?"; grep "^| [0-9]\|^| alone" "$OUT/hs_5.log"
  else echo "== invocation 5 NOT RUN (budget)"; fi
  timeout 60 python3 benchmarks/bench_serving_host.py --device-ms 1.4 --rounds 2 --trace --api-server-count 2 \
    > "$OUT/hs_6.log" 2>&1
  echo "== invocation 6, new code, fake device 1.4 ms on this host rc=$?"; grep "^| [0-9]\|^| alone" "$OUT/hs_6.log"
fi

if [ "$PART" = kimi_decode_kinds ]; then
  # Must show: the decode table at batch 1, 64 and 256 (engine / floor: the twentieth session had
  # 2.67x (one at a time), 0.95x and 1.13x) and, below it, the step by layer kind: each kind's device
  # us against its own floor (MoE experts: the experts the batch touches; MLA: latent rows; KDA:
  # states read and written; GEMMs: dense weights) and its share of the step; the "total" row's
  # method says whether the profiler saw the kernels inside the graph replays, and the device
  # launches per step (benchmarks/decode_launches.py predicts 382 kernels, plus the step's few
  # copies: staged inputs, block tables, tokens back). Issue 21 goal 1 asks
  # what each part is at against its own floor: the kinds furthest above theirs are where the next
  # work goes ("other" at batch 1: launch-bound kernels).
  timeout 560 python3 benchmarks/bench_kimi_linear.py --batches 1 64 256 --ttft 8192 > "$OUT/kimi_kinds.log" 2>&1
  echo "== rc=$?"; sed -n '/^| prefill of one prompt/,$p' "$OUT/kimi_kinds.log"; grep -i "error\|Traceback" "$OUT/kimi_kinds.log" | head -5
fi

if [ "$PART" = kimi_fusions ]; then
  # Must show: the graph step and the engine step at batch 1 and 64 lower with the new code (382
  # launches per step instead of 561, benchmarks/decode_launches.py: fused SwiGLU, the MLA cache
  # write with its norm, the shared expert inside the fused MoE kernels up to 64 tokens, the MLA
  # value heads written row-major, KDA's gate b projections in one batched GEMM, routing one row per
  # program at decode sizes), most at batch 1 (twenty-sixth session, graph replay alone: 3373 ->
  # 2799 us at batch 1, 19791 -> 19841 at 64 before the routing rows change); TTFT at 2K not higher.
  # The new log lists each step's largest kernels. Base first, then new.
  [ -d .base/kdaserve ] || { echo "carry .base (git archive c04ce36 kdaserve benchmarks | tar -x -C .base)"; exit 1; }
  for code in base new; do
    dir=.; [ $code = base ] && dir=.base
    (cd $dir && timeout 280 python3 benchmarks/bench_kimi_linear.py --batches 1 64 --ttft 2048 --ctx 2048 \
       > "$OUT/kf_$code.log" 2>&1)
    echo "== $code rc=$?"; grep "TTFT\|^| [0-9]" "$OUT/kf_$code.log" | head -8
  done
fi

if [ "$PART" = mla_glm_test ]; then
  # Must show: tests/ops/test_mla.py's GPU tests pass compiled, GLM's prefill at [128, 64] 8 warps
  # 2 stages with the base-2 softmax (twenty-ninth session run 6: 4 passed at the shapes before).
  group mla_test 150 tests/ops/test_mla.py -k gpu
fi

if [ "$PART" = mla_prefill ]; then
  # Must show: tests/ops/test_mla.py's GPU tests pass compiled (the prefill at the new Hopper
  # shapes, [128, 64] 8 warps 3 stages for Kimi-Linear's heads, [128, 32] for GLM's, base-2
  # softmax); the sweep's default row at or within ~3% of the fastest at 8K and 32K on an H200
  # (twenty-ninth session, H100: Kimi 8K 1.4717 ms = 47% of peak, 32K 25.74 ms; GLM 8K 5.13 ms).
  group mla_test 150 tests/ops/test_mla.py -k gpu
  timeout $(cap 200) python3 benchmarks/bench_moe_mla.py --sweep-mla-prefill --prefill 8192 32768 > "$OUT/mla_sweep.log" 2>&1
  echo "== mla sweep rc=$?"; sed -n '/^| heads/,$p' "$OUT/mla_sweep.log"; grep -m3 "Error\|Traceback" "$OUT/mla_sweep.log"
fi

if [ "$PART" = ling_tests ]; then
  # Must show (issue 64): tests/models/test_bailing_hybrid_gpu.py passes (Triton paths = reference in
  # fp32 on >= 90% of tokens, graphs = eager, bf16 chunked prefill, MTP lossless under graphs), and the
  # CPU file's tests on the GPU machine (transformers' comparison on the CPU, the engine's on CUDA
  # where a test asks for it).
  group ling_gpu 200 tests/models/test_bailing_hybrid_gpu.py
  group ling_cpu_file 200 tests/models/test_bailing_hybrid.py -k "not interpreter"
fi

if [ "$PART" = ling_real ]; then
  # Must show (issue 64): Ling-3.0-Flash's shape with dummy weights, FP8 experts and linears
  # (--quantization fp8): TTFT of an 8K prompt (second run), the prefill per layer kind, and the
  # decode step at batch 1 and 64 against its memory floor (bytes / copy bandwidth). On an H100
  # (78 GiB) its first 12 layers (10 KDA, 2 MLA, 2 dense) at full width; on an H200 the whole model
  # (121.3B of its 124.4B parameters in FP8: ~119 GiB of weights).
  layers=""; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] \
    && layers="--num-hidden-layers 12"
  # The whole model on an H200 leaves 6.4 GiB at 0.92 (56 sequences of 8K fit): 0.95 fits 64.
  timeout $(cap 420) python3 benchmarks/bench_kimi_linear.py --model inclusionAI/Ling-3.0-Flash --quantization fp8 \
    $layers --gpu-memory-utilization 0.95 --batches 1 64 --ttft 8192 > "$OUT/ling_real.log" 2>&1
  echo "== ling_real ($layers) rc=$?"; grep "TTFT\|^| \|built in" "$OUT/ling_real.log" | head -40
  grep -m3 "Error\|Traceback" "$OUT/ling_real.log"
fi

if [ "$PART" = fp4_variants ]; then
  # Must show (issue 63): every variant checked against the dequantized weight (no "WRONG" line),
  # then per M the best launch shape of each: the 4-bit forms against bf16's GEMM of the same
  # structure and the 4-bit floor. The kernels' form through the thirty-fifth session ("split":
  # even / odd activation columns, strided loads, scales loaded per element) was 2x bf16's time at
  # decode in the fused MoE; the winner here becomes ops/fp4/tiles.py's K step.
  timeout $(cap 400) python3 benchmarks/bench_fp4_tiles.py --formats mxfp4 --m 16 4096 > "$OUT/fp4_variants.log" 2>&1
  echo "== fp4_variants rc=$?"; grep -v "^# M=" "$OUT/fp4_variants.log" | tail -30
fi

if [ "$PART" = image_tower ]; then
  # Must show (issue 62): the tower in bf16 on the GPU within 2e-2 of fp32 on the CPU (1 passed), the
  # image tests through the engine (tiny, fp32 reference paths: 5 passed), then the time of a 512 x 512
  # image through a GLM-5.3-Flash-sized tower (transformers' default vision config: depth 24, width
  # 1024) alone and 8 / 32 at once, beside the CPU's processing time per image; then the TTFT below.
  group tower_gpu 120 tests/models/test_glm5_next_vision.py
  group canvas_gpu 60 tests/models/test_glm5_next_images.py   # the canvas's patches made on the GPU, bit for bit
  group image_prompts 150 tests/models/test_glm5_next_image_prompts.py
  timeout $(cap 200) python3 benchmarks/bench_vision_tower.py --batches 1 8 32 > "$OUT/vision_tower.log" 2>&1
  echo "== vision_tower rc=$?"; sed -n '/^NVIDIA\|^| images/,$p' "$OUT/vision_tower.log"; grep -m3 "Error" "$OUT/vision_tower.log"
  # Then TTFT of random-mm's request (1024 text tokens + one 512 x 512 image, ~256 image tokens) at
  # GLM-5.3-Flash's width: its first 8 layers in FP8 (~53 GiB: fits an H100) with the default tower
  # merged to width 4096, against a text-only request of the same length: the image's share
  # (processing + tower) should be a few ms, next to the tower time above.
  timeout $(cap 240) python3 benchmarks/bench_image_ttft.py --num-hidden-layers 8 --quantization fp8 \
    > "$OUT/image_ttft.log" 2>&1
  echo "== image_ttft rc=$?"; sed -n '/^NVIDIA\|^a request/,$p' "$OUT/image_ttft.log"; grep -m3 "Error" "$OUT/image_ttft.log"
fi

if [ "$PART" = fp4_native ]; then
  # Must show (issue 63), on a card whose tensor cores multiply fp4 (sm_100 / sm_103 / gfx950, where
  # MXFP4 experts take tl.dot_scaled by default; NVFP4 decodes in registers everywhere): test_fp4.py's
  # GPU tests pass (18), and the --moe-formats table: MXFP4 against bf16 and FP8 at decode (goal: within
  # 1.3x of its floor at batch 64, faster than FP8 from batch 8) and prefill (the decoding path's
  # numbers: perf-notes' "4-bit experts against bf16 and FP8", H100), then GLM-5.3-Flash's experts.
  case "$(python3 -c 'import torch; from kdaserve.ops.precision import device_target; print(device_target(torch.device("cuda")))')" in
    sm_100|sm_103|gfx950) ;;
    *) echo "fp4_native needs an sm_100 / sm_103 / gfx950 card"; exit 1 ;;
  esac
  group fp4_gpu 150 tests/ops/test_fp4.py -k gpu
  timeout $(cap 200) python3 benchmarks/bench_moe_mla.py --moe-formats --batches 1 8 64 256 --prefill 1024 8192 \
    > "$OUT/fp4_native.log" 2>&1
  echo "== formats rc=$?"; sed -n '/^| step/,$p' "$OUT/fp4_native.log"; grep -m3 "Error\|Traceback" "$OUT/fp4_native.log"
  timeout $(cap 200) python3 benchmarks/bench_moe_mla.py --moe-formats --moe-shape glm --batches 8 64 256 \
    --prefill 8192 > "$OUT/fp4_native_glm.log" 2>&1
  echo "== formats glm rc=$?"; sed -n '/^| step/,$p' "$OUT/fp4_native_glm.log"
fi

if [ "$PART" = fp4_bf16 ]; then
  # Must show (issue 63): test_fp4.py's GPU tests pass (21: the bf16 decoders bit for bit over every byte
  # times every scale code, the GEMMs within bf16's rounding of the fp32 reference); the tile bench: the
  # bf16 decoding (trans_b16, swap_b16) against the fp32 one (trans_bc) at M 16 and 4096; then the
  # --moe-formats table for the old code (.old) and the new in one command: MXFP4 / NVFP4 decode b64
  # lower (goal: within 1.3x of the 4-bit floor, below FP8 from batch 8).
  [ -d .old/kdaserve ] || { echo "carry .old (git archive 7249190 kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  group fp4_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  timeout $(cap 150) python3 benchmarks/bench_fp4_tiles.py --m 16 4096 --variants trans_bc trans_b16 swap_b16 bf16 \
    > "$OUT/fp4_tiles.log" 2>&1
  echo "== tiles rc=$?"; sed -n '/^| M/,$p' "$OUT/fp4_tiles.log"; grep -m3 "WRONG\|Error" "$OUT/fp4_tiles.log"
  for code in old new; do
    dir=.; [ $code = old ] && dir=.old
    (cd $dir && timeout $(cap 120) python3 benchmarks/bench_moe_mla.py --moe-formats --batches 1 8 64 256 \
       --prefill 1024 8192 > "$OUT/fp4_formats_$code.log" 2>&1)
    echo "== formats $code rc=$?"; sed -n '/^| step/,$p' "$OUT/fp4_formats_$code.log" | grep -v "| fp8 \|| bf16 " 
    grep -m3 "Error\|Traceback" "$OUT/fp4_formats_$code.log"
  done
  sed -n '/^| step/,$p' "$OUT/fp4_formats_new.log" | grep "| fp8 \|| bf16 "
fi

if [ "$PART" = fp4_prefill ]; then
  # Must show (issue 63): part fp4_sides (fortieth session, one H100) ran with the 4-bit kernels' activation
  # rows unmasked, a padded slot reading token 0's row: Kimi-Linear's 8 layers (MXFP4) TTFT 2048 29.2 ms
  # against the thirty-ninth session's 19.1 (bf16 17.7), MoE prefill 8K 3-9% slower. Now the right side
  # (prefill) masks its rows again and the left side (sm_90 decode) reads the block's first slot's row.
  # TTFT 2048 back near 19 ms (prefill by kind: MoE experts well under fp4_sides' 17.09 ms), graph step
  # at 1 / 64 about fp4_sides' 923 / 3750 us; then --moe-formats --fp4-sides at Kimi's experts: prefill 8K
  # MXFP4 about the thirty-ninth session's 3.49 ms (fp4_sides: 3.80), decode "left" rows at or under
  # fp4_sides' (batch 64 MXFP4 0.4236, NVFP4 0.4448 ms): since then ptxas no longer serializes the left
  # kernels' wgmma (tl.assume of one K step at least; SASS: each HGMMA waits for 7 groups, not 0).
  # First test_fp4.py's GPU tests: the kernels changed since fp4_sides (row masks, first-slot rows, the
  # assume) against the reference, both decoders bit for bit, the 4-bit shared expert.
  # With .old (`git archive 86651d5 kdaserve benchmarks | tar -x -C .old`: the thirty-ninth session's code,
  # TTFT 19.1 there) Kimi's 8 layers run new, old, new in the same command (any card: compare within it);
  # with .base (`git archive caccf39 ...`: the row masks back, the assume not yet) the formats table's
  # decode rows once more from .base: the assume's own effect (it also took gate|up from 93 to 130
  # registers, 5 programs an SM to 3).
  group fp4_prefill_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  runs=("kimi8 new"); [ -d .old/kdaserve ] && runs+=("kimi8 old")
  runs+=("formats new"); [ -d .base/kdaserve ] && runs+=("formats base"); [ -d .old/kdaserve ] && runs+=("kimi8 new")
  i=0
  for run in "${runs[@]}"; do
    read -r what tree <<< "$run"; i=$((i + 1))
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 90 )) ] && { echo "== $what $tree NOT RUN (budget)"; continue; }
    root=.; [ "$tree" = old ] && root=.old; [ "$tree" = base ] && root=.base
    log="$OUT/fp4_prefill_${i}_${what}_$tree.log"
    if [ "$what" = kimi8 ]; then
      timeout $(cap 120) env PYTHONPATH="$PWD/$root:$PYTHONPATH" python3 $root/benchmarks/bench_kimi_linear.py \
        --model moonshotai/Kimi-Linear-48B-A3B-Instruct --quantization mxfp4 --num-hidden-layers 8 --batches 1 64 \
        --ttft 2048 > "$log" 2>&1
      echo "== kimi 8 layers ($tree) rc=$?"; grep "TTFT\|^| 1 |\|^| 64 |\|^| MoE experts" "$log" | head -8
    else
      prefill="--prefill 2048 8192"; [ "$tree" = base ] && prefill="--prefill"
      timeout $(cap 120) env PYTHONPATH="$PWD/$root:$PYTHONPATH" python3 $root/benchmarks/bench_moe_mla.py \
        --moe-formats --fp4-sides --moe-shape kimi --batches 8 64 256 $prefill > "$log" 2>&1
      echo "== formats kimi ($tree) rc=$?"; grep "^|.*\(mxfp4\|nvfp4\)" "$log"
    fi
    grep -m3 "Error\|Traceback" "$log"
  done
fi

if [ "$PART" = fp4_sides ]; then
  # Must show (issue 63): sm_90's 4-bit decode with the decoded tiles left of the dots and byte tables
  # (tiles.fp4_weights_left; the fortieth session timed it on an H100 at Kimi-Linear's experts only,
  # 1.03-1.10x as fast as right and bitwise) and a 4-bit shared expert run as one more expert (untimed).
  # test_fp4.py's GPU tests pass (the 4-bit shared expert's among them); Kimi-Linear's first 8 layers
  # with MXFP4 experts at the defaults: graph step at 64 under the last run's 3878 us (bf16 7013), at 1
  # about its 910 (the dummy Quark config quantizes the routed experts only: its bf16 shared expert
  # still runs apart); --moe-formats --fp4-sides
  # at GLM-5.3-Flash's experts: "left" faster than "right" at 8 / 64 / 256 for both formats (Kimi's
  # run: batch 64 MXFP4 0.4232 against 0.4500 ms; prefill runs right only); then Kimi's --fp4-sides
  # once more (the spread between runs).
  group fp4_sides_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  runs=("kimi8 120" "glm 200 --prefill 8192" "kimi 100 --prefill 8192")
  for run in "${runs[@]}"; do
    read -r shape secs extra <<< "$run"
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 60 )) ] && { echo "== $shape NOT RUN (budget)"; continue; }
    if [ "$shape" = kimi8 ]; then
      timeout $(cap "$secs") python3 benchmarks/bench_kimi_linear.py --model moonshotai/Kimi-Linear-48B-A3B-Instruct \
        --quantization mxfp4 --num-hidden-layers 8 --batches 1 64 --ttft 2048 > "$OUT/fp4_sides_$shape.log" 2>&1
      echo "== kimi 8 layers rc=$?"; grep "^| 1 |\|^| 64 |" "$OUT/fp4_sides_$shape.log" | head -4
    else
      timeout $(cap "$secs") python3 benchmarks/bench_moe_mla.py --moe-formats --fp4-sides --moe-shape "$shape" \
        --batches 8 64 256 $extra > "$OUT/fp4_sides_$shape.log" 2>&1
      echo "== formats $shape rc=$?"; grep "^|.*\(mxfp4\|nvfp4\)" "$OUT/fp4_sides_$shape.log"
    fi
    grep -m3 "Error\|Traceback" "$OUT/fp4_sides_$shape.log"
  done
fi

if [ "$PART" = fp4_pair ]; then
  # Must show (issue 63): test_fp4.py's GPU tests pass (the gate|up kernel's gate and up scales in one
  # load at MXFP4 decode); then --moe-formats, the new code (scale rows 16 bytes apart, the paired load)
  # against the old (.old = `git archive ea67572 kdaserve benchmarks`), new, old, new, old at Kimi-Linear's
  # experts (hidden 2304: 72 MXFP4 scales a row, whose stride Triton could not take as aligned) and
  # GLM-5.3-Flash's (new, old): MXFP4 decode at 8 / 64 / 256 faster with the new code by more than old-vs-old's spread
  # (the H100 experiment, unaligned rows: 2-3% at batch 64 and 256); NVFP4 and prefill not slower.
  [ -d .old/kdaserve ] || { echo "carry .old (git archive ea67572 kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  group fp4_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  i=0
  for run in kimi:new kimi:old kimi:new kimi:old glm:new glm:old; do
    shape=${run%:*} code=${run#*:} i=$((i + 1))
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 60 )) ] && { echo "== $run NOT RUN (budget)"; continue; }
    dir=.; [ "$code" = old ] && dir=.old
    timeout $(cap 100) python3 $dir/benchmarks/bench_moe_mla.py --moe-formats --moe-shape $shape --batches 8 64 256 \
      --prefill 8192 > "$OUT/fp4_pair_${i}_${shape}_$code.log" 2>&1
    echo "== formats $run rc=$?"; grep "^|.*\(mxfp4\|nvfp4\|fp8\)" "$OUT/fp4_pair_${i}_${shape}_$code.log"
    grep -m3 "Error\|Traceback" "$OUT/fp4_pair_${i}_${shape}_$code.log"
  done
fi

if [ "$PART" = fp4_kimi_full ]; then
  # Must show (issue 63: "Kimi-Linear with 4-bit experts at the real shape: its decode step vs the bf16
  # step"): the whole released architecture (bf16 needs the H200's memory: 91.5 GiB), random weights,
  # MXFP4 experts quantized at load, then bf16: graph step and engine step at batch 1 / 64 / 256
  # (the 8-layer H100 run: 933 vs 949 us at 1, 3989 vs 6851 at 64), TTFT 8K. KIMI_FORMATS picks the
  # expert formats (default "mxfp4 none"; on an H100, where bf16 does not fit, "mxfp4 fp8").
  for q in ${KIMI_FORMATS:-mxfp4 none}; do
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 240 )) ] && { echo "== kimi $q NOT RUN (budget)"; continue; }
    flag=""; [ "$q" = none ] || flag="--quantization $q"
    timeout $(cap 270) python3 benchmarks/bench_kimi_linear.py --model moonshotai/Kimi-Linear-48B-A3B-Instruct $flag \
      --batches 1 64 256 --ttft 8192 > "$OUT/fp4_kimi_full_$q.log" 2>&1
    echo "== kimi whole model, experts $q rc=$?"; grep "^| 1 |\|^| 64 |\|^| 256 |\|TTFT" "$OUT/fp4_kimi_full_$q.log" | head -10
    grep -m3 "Error\|Traceback" "$OUT/fp4_kimi_full_$q.log"
  done
fi

if [ "$PART" = fp4_glm ]; then
  # Must show (issue 63): --moe-formats at GLM-5.3-Flash's experts (288 of width 2048 on hidden 4096, top 8),
  # then one rank's share at -tp 2 (width 1024): MXFP4 / NVFP4 decode faster than FP8 from batch 8 up,
  # each format's "x floor" (goal at batch 64: 1.3x).
  for shape in glm glm-tp2; do
    timeout $(cap 240) python3 benchmarks/bench_moe_mla.py --moe-formats --moe-shape $shape --batches 1 8 64 256 \
      --prefill 1024 8192 > "$OUT/fp4_formats_$shape.log" 2>&1
    echo "== formats $shape rc=$?"; sed -n '/^experts:/,$p' "$OUT/fp4_formats_$shape.log"
    grep -m3 "Error\|Traceback" "$OUT/fp4_formats_$shape.log"
  done
fi

if [ "$PART" = fp4_sweep_left ]; then
  # Must show (issue 63): the --sweep-moe-fp4 table at decode 8 / 64 / 256 with sm_90's decode as served
  # now (tiles left of the dots, byte tables, wgmma no longer serialized; never swept so: the shapes were
  # chosen on the right side, thirty-eighth session): whether another gate|up or down shape brings batch
  # 64 nearer 1.3x its floor (fp4_sides: 1.54x; gate_up 1.43x, down 1.64x of their own bytes). A shape
  # more than a run's spread (~2%) faster than the default at 64 and 256 and not slower at 8 is a new default.
  timeout $(cap 330) python3 benchmarks/bench_moe_mla.py --sweep-moe-fp4 --batches 8 64 256 --prefill \
    > "$OUT/fp4_sweep_left.log" 2>&1
  echo "== sweep rc=$?"; sed -n '/^| step/,$p' "$OUT/fp4_sweep_left.log"
  grep -m3 "Error\|Traceback" "$OUT/fp4_sweep_left.log"
fi

if [ "$PART" = fp4_words ]; then
  # Must show (issue 63): the tables decoder with the codes loaded as 32-bit words instead of bytes
  # and MXFP4's scale pairs in two operations (forty-second session: sm_90's decode loop 1151 -> 1090
  # instructions a trip for gate|up, 553 -> 510 for down, tools/sass_loop; registers 159 / 135 -> 163 /
  # 138, still 3 programs an SM). First
  # test_fp4.py's GPU tests (the tables bit for bit the bitwise decoding, both sides), then
  # --moe-formats --fp4-sides, decode only, at Kimi-Linear's and GLM-5.3-Flash's experts, new / old /
  # new code (.old = `git archive 2162f0b kdaserve benchmarks`): the "left" rows (the tables) under the
  # old code's at batch 8 / 64 / 256 by more than the two new runs differ; "right" (bitwise, bytes)
  # the A/A check. fp4_pairs (H100): Kimi b64 MXFP4 left 0.3767-0.3779 ms, GLM 1.4801.
  [ -d .old/kdaserve ] || { echo "carry .old (git archive 2162f0b kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  group fp4_words_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  fp4_sides_new_old_new fp4_words
fi

if [ "$PART" = fp4_placed ]; then
  # Must show (issue 63): the words program (ops/fp4/word_decode.py: per byte a prmt, a shift and an and
  # place each value's bits where bf16 has them, its constants all immediates; one product a pair, MXFP4's
  # factor 2^(s - 1) with the placement's 2^126 folded in where every scale code is at most 128, NVFP4's
  # values times 2^-16 that the accumulators take back) in place of the byte tables (forty-fourth session,
  # tools/sass_loop, sm_90's decode loop a trip, gate|up / down: MXFP4 1090 / 510 -> 896 / 432, the WIDE
  # program 1031 / 499; NVFP4 1092 / 541 -> 937 / 459). First test_fp4.py's GPU tests:
  # test_gpu_the_words_program_gives_every_code_times_every_scale_exactly (the programs on the hardware
  # over every scale code each takes, bf16 subnormals included) and
  # test_gpu_words_decoding_equals_the_bitwise_decoding[*] (the GEMMs bit for bit either decoder, the
  # WIDE program at scale codes past 128 too). If either fails, revert the commit that brought
  # ops/fp4/word_decode.py (the byte tables come back). Then --moe-formats --fp4-sides, decode only,
  # new / old / new (.old = `git archive 36ff8eb kdaserve benchmarks`: the byte tables): the "left" rows
  # under the old code's by more than the two new runs differ (fp4_words, H100: Kimi-Linear b64 MXFP4
  # 0.3631 ms, 1.32x its floor, NVFP4 0.4052, 1.39x; GLM-5.3-Flash 1.4420 / 1.5355, 1.40x / 1.41x); the
  # right rows (bitwise, unchanged) the A/A check.
  [ -d .old/kdaserve ] || { echo "carry .old (git archive 36ff8eb kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  group fp4_placed_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  fp4_sides_new_old_new fp4_placed
fi

if [ "$PART" = fp4_glm_pairs ]; then
  # Must show (issue 63): whether GLM-5.3-Flash's experts (288 of width 2048 on hidden 4096: K steps 16 /
  # 8 of 256, twice Kimi-Linear's) want other decode shapes than the ones swept at Kimi-Linear's
  # (fp4_sweep_left, fp4_pairs): --sweep-moe-fp4 --fp4-pairs at batch 8 / 64 / 256, MXFP4, then the
  # single-GEMM sweep (--sweep-moe-fp4, decode only). GLM's b64 stood at 1.40x its floor (fp4_words,
  # H100), Kimi-Linear's at 1.32x. A pair faster than the default by more than ~2% at 64 and 256 and
  # not slower at 8 becomes moe_tiles' choice for such shapes (by hidden and width, not by model).
  for mode in "--fp4-pairs" ""; do
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 60 )) ] && { echo "== glm sweep $mode NOT RUN (budget)"; continue; }
    log="$OUT/fp4_glm_pairs${mode:+_pairs}.log"
    timeout $(cap 240) python3 benchmarks/bench_moe_mla.py --sweep-moe-fp4 $mode --moe-shape glm --batches 8 64 256 --prefill \
      > "$log" 2>&1
    echo "== glm sweep $mode rc=$?"; grep "^| decode" "$log"
    grep -m3 "Error\|Traceback" "$log"
  done
fi

if [ "$PART" = fp4_small ]; then
  # Must show (issue 63): whether batches 1 / 2 / 4 want other decode shapes than those chosen at 8 / 64 /
  # 256 (fp4_sweep_left, fp4_pairs). At batch 1 Kimi-Linear's MoE layer ran 3.0x its floor (fp4_split,
  # H100: gate|up 0.0148, down 0.0103, the rest 0.0048 ms; 8 experts give gate|up 128 and down 144
  # programs of 4 warps on 132 SMs) and the MoE kind 3.24x in the whole model (fp4_kimi_full); split K
  # lost (removed). --sweep-moe-fp4 (each GEMM's shapes with the other at its default, FP4_SWEEP: BN 32
  # gives twice the programs) at Kimi-Linear's and GLM-5.3-Flash's experts. A shape faster than the
  # default by more than ~3% at every small batch becomes moe_tiles' choice there (by slots per expert).
  for shape in kimi glm; do
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 60 )) ] && { echo "== small $shape NOT RUN (budget)"; continue; }
    log="$OUT/fp4_small_$shape.log"
    timeout $(cap 240) python3 benchmarks/bench_moe_mla.py --sweep-moe-fp4 --moe-shape $shape --batches 1 2 4 --prefill \
      > "$log" 2>&1
    echo "== small $shape rc=$?"; grep "^| decode" "$log"
    grep -m3 "Error\|Traceback" "$log"
  done
fi

if [ "$PART" = fp4_wide ]; then
  # Must show (issue 63): the words decoder's WIDE program (MXFP4 weights whose scale codes pass 128: a
  # second product a pair, sm_90's loop 1031 / 499 instructions a trip against the folded program's
  # 896 / 432) timed beside the folded one: --moe-formats --fp4-sides' "mxfp4 left wide" row (the same
  # experts, every scale code moved past 128) within ~10% of "mxfp4 left", and under the byte tables'
  # time (fp4_placed, H100: Kimi-Linear b64 0.3795 ms old against 0.3419-0.3473 new) at both shapes.
  for shape in kimi glm; do
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 45 )) ] && { echo "== wide $shape NOT RUN (budget)"; continue; }
    log="$OUT/fp4_wide_$shape.log"
    timeout $(cap 100) python3 benchmarks/bench_moe_mla.py --moe-formats --fp4-sides --moe-shape $shape \
      --batches 8 64 256 --prefill > "$log" 2>&1
    echo "== wide $shape rc=$?"; grep "^|.*mxfp4 \(left\|right\)" "$log"
    grep -m3 "Error\|Traceback" "$log"
  done
fi

if [ "$PART" = fp4_pairs ]; then
  # Must show (issue 63): part fp4_sweep_left (forty-first session, H100) found down (128, 128, 4, 3) 11-15%
  # faster than the default then, (64, 256, 4, 3), at batch 8 / 64 / 256, and gate|up (64, 256) 2-8%; both
  # are sm_90's left-side decode default now (ops/moe/fused.moe_tiles). fp4_ncu: gate|up 64% of issue slots,
  # alu pipe 60%, 3 programs an SM. First test_fp4.py's GPU tests (the new default shapes against the
  # reference); then --fp4-pairs at Kimi-Linear's experts (the old default's row first, register caps of
  # 128: 4 programs an SM): the default at or under every other row at 64 and 256 (else the faster pair
  # becomes the default); --moe-formats --fp4-sides at Kimi-Linear's and GLM-5.3-Flash's experts, decode
  # only: "left" rows under the fp4_prefill / fp4_sides ones (Kimi b64 MXFP4 0.4193, GLM 1.5939 ms) with
  # "right" as this run's baseline; Kimi-Linear's 8 layers (MXFP4) graph step at 1 / 64 (fp4_prefill: 906 / 3730 us).
  group fp4_pairs_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  runs=("pairs kimi" "formats glm" "formats kimi" "kimi8 -")
  for run in "${runs[@]}"; do
    read -r what shape <<< "$run"
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 45 )) ] && { echo "== $what $shape NOT RUN (budget)"; continue; }
    log="$OUT/fp4_pairs_${what}_$shape.log"
    if [ "$what" = pairs ]; then
      timeout $(cap 150) python3 benchmarks/bench_moe_mla.py --sweep-moe-fp4 --fp4-pairs --moe-shape $shape \
        --batches 8 64 256 > "$log" 2>&1
      echo "== pairs $shape rc=$?"; sed -n '/^| step/,$p' "$log"
    elif [ "$what" = formats ]; then
      timeout $(cap 150) python3 benchmarks/bench_moe_mla.py --moe-formats --fp4-sides --moe-shape $shape \
        --batches 8 64 256 --prefill > "$log" 2>&1
      echo "== formats $shape rc=$?"; grep "^|.*\(mxfp4\|nvfp4\|bf16\|fp8\)" "$log"
    else
      timeout $(cap 120) python3 benchmarks/bench_kimi_linear.py --model moonshotai/Kimi-Linear-48B-A3B-Instruct \
        --quantization mxfp4 --num-hidden-layers 8 --batches 1 64 --ttft 2048 > "$log" 2>&1
      echo "== kimi 8 layers rc=$?"; grep "TTFT\|^| 1 |\|^| 64 |\|^| MoE experts" "$log" | head -8
    fi
    grep -m3 "Error\|Traceback" "$log"
  done
fi

if [ "$PART" = fp4_ncu ]; then
  # Must show (issue 63): what holds sm_90's 4-bit decode at batch 64 to 1.43x (gate|up) and 1.64x (down) of
  # its bytes (fp4_sides), Kimi-Linear's experts in MXFP4, served as now (left, byte tables): per kernel
  # the duration, DRAM throughput, issue slots busy, each pipe's activity (alu: prmt / lop3 / shifts;
  # fma / fmaheavy: imad, hmul2), occupancy, and the stall reasons per issued instruction. If issue or
  # the alu pipe sits near its peak, fewer decode instructions pay; if long-scoreboard / barrier stalls
  # lead with DRAM well under peak, more loads in flight (stages, programs an SM) do.
  timeout $(cap 240) ncu --clock-control none --kernel-name regex:"_moe_(gate_up|down)" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats \
    --metrics "dram__bytes_read.sum,smsp__inst_executed.sum,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/profile_moe_prefill.py --tokens 64 --format mxfp4 > "$OUT/fp4_ncu.txt" 2>&1
  echo "== ncu rc=$?"; grep -E "^  _moe|tokens,|Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|dram__bytes|inst_executed.sum|pipe_(alu|fma|fmaheavy|fmalite|lsu|tensor|uniform|shared)" "$OUT/fp4_ncu.txt" | head -70
  grep -E "issue_stalled" "$OUT/fp4_ncu.txt" | awk '$NF+0 > 0.05' | head -40
fi

if [ "$PART" = fp4_shapes ]; then
  # Must show (issue 63): the --sweep-moe-fp4 table at decode 8 / 64 and prefill 8K (the default's row
  # against each GEMM's other shapes); with fp4_moe before it (`fp4_moe fp4_shapes`): the GPU tests, the
  # formats table and Kimi-Linear's 8 layers as well.
  timeout $(cap 200) python3 benchmarks/bench_moe_mla.py --sweep-moe-fp4 --batches 8 64 --prefill 8192 \
    > "$OUT/fp4_sweep.log" 2>&1
  echo "== sweep rc=$?"; grep "| default" "$OUT/fp4_sweep.log"   # the whole table: $OUT/fp4_sweep.log
fi

if [ "$PART" = fp4_moe ]; then
  # Must show (issue 63): test_fp4.py's GPU tests pass (13: the decoders bit for bit, both formats at
  # T = 1, 64, 2048 within bf16's rounding of the fp32 reference); the --moe-formats table: at decode
  # (graph replay) MXFP4 / NVFP4 faster than bf16 from batch 8 up, each format's "x floor" (its own
  # bytes) reported; at prefill 4-bit within ~1.3x of bf16 (the decode in registers is extra ALU work
  # per weight element, amortized over 128 rows). Then the engine: Kimi-Linear's first 8 layers with
  # MXFP4 experts (random weights quantized at load) decode step vs the same in bf16.
  group fp4_gpu 150 tests/ops/test_fp4.py -k "gpu or decoders"
  timeout 200 python3 benchmarks/bench_moe_mla.py --moe-formats --batches 1 8 64 256 --prefill 1024 8192 \
    > "$OUT/fp4_formats.log" 2>&1
  echo "== formats rc=$?"; sed -n '/^| step/,$p' "$OUT/fp4_formats.log"; grep -m3 "Error\|Traceback" "$OUT/fp4_formats.log"
  for q in mxfp4 none; do
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 100 )) ] && { echo "== kimi $q NOT RUN (budget)"; continue; }
    flag=""; [ "$q" = none ] || flag="--quantization $q"
    timeout 100 python3 benchmarks/bench_kimi_linear.py --model moonshotai/Kimi-Linear-48B-A3B-Instruct $flag \
      --num-hidden-layers 8 --batches 1 64 --ttft 2048 > "$OUT/fp4_kimi_$q.log" 2>&1
    echo "== kimi experts $q rc=$?"; grep "^| 1 |\|^| 64 |\|TTFT" "$OUT/fp4_kimi_$q.log" | head -8
    grep -m3 "Error\|Traceback" "$OUT/fp4_kimi_$q.log"
  done
fi

if [ "$PART" = ling_routing ]; then
  # Must show (issue 64, issue 66 part 2): Ling-3.0-Flash's first 12 layers (FP8), decode at batch 1 and
  # 64: the engine and graph step and the "other" kind's device us with the grouped routing kernel
  # (new) against the torch path's ~14 launches per MoE layer (old), new, old, new, old: new lower at
  # batch 1 by more than the two codes' own spreads, equal tokens/s or better at 64.
  [ -d .old/kdaserve ] || { echo "carry .old (git archive 17ab949 kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  # First the model's GPU tests through the new routing (graphs capture the grouped kernel and the
  # fused experts with the shared expert's column): 3 passed.
  group ling_gpu 150 tests/models/test_bailing_hybrid_gpu.py
  # The grouped routing kernel against the torch path on the GPU (512 experts in 8 groups, ...): 4 passed.
  group grouped_routing 60 tests/ops/test_moe.py -k restricts_to_groups
  for i in 1 2 3 4; do
    dir=.; code=new; [ $((i % 2)) -eq 0 ] && { dir=.old; code=old; }
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 110 )) ] && { echo "== invocation $i NOT RUN (budget)"; continue; }
    (cd $dir && timeout 110 python3 benchmarks/bench_kimi_linear.py --model inclusionAI/Ling-3.0-Flash \
       --quantization fp8 --num-hidden-layers 12 --batches 1 64 --ttft 2048 > "$OUT/ling_routing_$i.log" 2>&1)
    echo "== invocation $i, $code code rc=$?"
    grep "^| 1 |\|^| 64 |" "$OUT/ling_routing_$i.log" | grep "x |\|other\|total" | head -8
  done
fi

if [ "$PART" = kimi_ttft ]; then
  # Must show (issue 21 goal 4; H200: Kimi-Linear needs 91.5 GiB): TTFT of one 8K and one 32K
  # prompt (second run of each) and the prefill per layer kind (twenty-eighth session 8K:
  # 141.9-143.3 ms, MoE 56.01 ms, MLA 16.34 ms; 32K: 813.8 ms in the nineteenth session, before the
  # fused RMSNorm, with "other" 149.26 ms and MLA 256.59 ms of it). MLA should be lower now: the
  # twenty-ninth session's prefill kernel is 1.33-1.52x faster on an H100.
  timeout $(cap 330) python3 benchmarks/bench_kimi_linear.py --batches 1 --ttft 8192 32768 > "$OUT/kimi_ttft.log" 2>&1
  echo "== kimi rc=$?"; grep "TTFT\|^| " "$OUT/kimi_ttft.log" | grep -v "^| 1 |" | head -24; grep -m3 "Error\|Traceback" "$OUT/kimi_ttft.log"
fi

if [ "$PART" = k1_defaults ]; then
  # Must show (issue 21 goal 3): the flash GPU tests pass with both new K1 defaults (fp16 operands for
  # the inverse's products; the chunk's q|k|v and forget-logit lines prefetched into L1 before the
  # sequence's table loads); the agreement lines equal for flash and flash[prepare_prefetch=0] (a
  # prefetch changes no arithmetic); flash faster than both other columns at every row (run 2 on the
  # H200 with the late q|k|v-only prefetch: 64 heads 16x1K 2.974 (old) -> 2.748 (half) -> 2.601 ms),
  # and K1's own device us (profile_prefill rows; run 2: 2120.5 -> 1899.0 -> 1754.9 us).
  group flash_test 200 tests/ops/test_flash_prefill.py -k gpu
  old=prepare_half_dots=0,prepare_prefetch=0
  timeout $(cap 150) python3 benchmarks/bench_prefill.py --no-baselines --config prepare_prefetch=0 --config $old \
    --heads 32 64 96 --shapes 16x1K 1x8K > "$OUT/k1d_bounded.log" 2>&1
  echo "== bounded rc=$?"; grep "vs fp64\|^| " "$OUT/k1d_bounded.log"; grep -m3 "Error\|Traceback" "$OUT/k1d_bounded.log"
  timeout $(cap 100) python3 benchmarks/bench_prefill.py --no-agreement --no-baselines --config prepare_prefetch=0 \
    --config $old --gate unbounded --heads 32 64 --shapes 16x1K 1x8K > "$OUT/k1d_unbounded.log" 2>&1
  echo "== unbounded rc=$?"; grep "^| " "$OUT/k1d_unbounded.log"; grep -m3 "Error\|Traceback" "$OUT/k1d_unbounded.log"
  timeout $(cap 100) python3 benchmarks/profile_prefill.py --columns flash --config prepare_prefetch=0 --config $old \
    --heads 64 --shapes 16x1K 1x8K > "$OUT/k1d_profile.log" 2>&1
  echo "== profile rc=$?"; grep "^H=\|flash_prepare\|flash_recurrence" "$OUT/k1d_profile.log"
fi

if [ "$PART" = k1_table ]; then
  # Must show: the reference tables' flash rows with the thirtieth session's K1 (fp16 operands for the
  # inverse's products, L1 prefetch) beside the code before it (flash[prepare_half_dots=0,
  # prepare_prefetch=0]) in one process: flash faster at every row, bounded and unbounded gate.
  old=prepare_half_dots=0,prepare_prefetch=0
  timeout $(cap 300) python3 benchmarks/bench_prefill.py --no-agreement --no-baselines --config $old \
    --heads 96 64 32 16 --shapes 1x8K 8x1K 16x1K 64x512 1x32K 1x128K > "$OUT/k1t_bounded.log" 2>&1
  echo "== bounded rc=$?"; grep "^| " "$OUT/k1t_bounded.log"; grep -m3 "Error\|Traceback" "$OUT/k1t_bounded.log"
  timeout $(cap 150) python3 benchmarks/bench_prefill.py --no-agreement --no-baselines --config $old --gate unbounded \
    --heads 32 64 --shapes 1x8K 16x1K 1x32K 64x512 > "$OUT/k1t_unbounded.log" 2>&1
  echo "== unbounded rc=$?"; grep "^| " "$OUT/k1t_unbounded.log"; grep -m3 "Error\|Traceback" "$OUT/k1t_unbounded.log"
fi

if [ "$PART" = k1_order ]; then
  # Must show: the flash GPU tests pass with K1's new order (q convolved first, Qg stored, then k;
  # beta k e^g cast to the W product's operand type at once: the sm_90 build of the bounded K1 then
  # needs 20 bytes of spills at a 200-register cap instead of 256, the unbounded C = 16 one 128
  # registers instead of 242), the same agreement lines as before, and its times against .old (=
  # `git archive fa56bbd kdaserve benchmarks`, the same K1 in the old order) in the same command,
  # with the register caps the new order allows (bounded 168: 3 programs per SM; unbounded 128: 4).
  # Thirtieth session run 5 (H200): 168 bounded and uncapped unbounded won, now the defaults, so
  # the config columns below now time 168 against itself and 128 / uncapped against uncapped.
  [ -d .old/kdaserve ] || { echo "carry .old (git archive fa56bbd kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  group flash_test 200 tests/ops/test_flash_prefill.py -k gpu
  timeout $(cap 80) python3 benchmarks/bench_prefill.py --no-baselines --config prepare_maxnreg=168 --heads 32 64 96 \
    --shapes 16x1K 1x8K > "$OUT/ko_new_b.log" 2>&1
  echo "== new bounded rc=$?"; grep "vs fp64\|^| " "$OUT/ko_new_b.log"; grep -m3 "Error\|Traceback" "$OUT/ko_new_b.log"
  (cd .old && timeout $(cap 60) python3 benchmarks/bench_prefill.py --no-agreement --no-baselines --heads 32 64 96 \
    --shapes 16x1K 1x8K > "$OUT/ko_old_b.log" 2>&1)
  echo "== old bounded rc=$?"; grep "^| " "$OUT/ko_old_b.log"
  timeout $(cap 80) python3 benchmarks/bench_prefill.py --no-agreement --no-baselines --gate unbounded \
    --config unbounded_prepare_maxnreg=128 --config unbounded_prepare_maxnreg=0 --heads 32 64 --shapes 16x1K 1x8K \
    > "$OUT/ko_new_u.log" 2>&1
  echo "== new unbounded rc=$?"; grep "^| " "$OUT/ko_new_u.log"; grep -m3 "Error\|Traceback" "$OUT/ko_new_u.log"
  (cd .old && timeout $(cap 60) python3 benchmarks/bench_prefill.py --no-agreement --no-baselines --gate unbounded \
    --heads 32 64 --shapes 16x1K 1x8K > "$OUT/ko_old_u.log" 2>&1)
  echo "== old unbounded rc=$?"; grep "^| " "$OUT/ko_old_u.log"
  timeout $(cap 60) python3 benchmarks/profile_prefill.py --columns flash --config prepare_maxnreg=168 --heads 64 \
    --shapes 16x1K > "$OUT/ko_prof_new.log" 2>&1
  echo "== new profile rc=$?"; grep "^H=\|flash_prepare" "$OUT/ko_prof_new.log"
  (cd .old && timeout $(cap 40) python3 benchmarks/profile_prefill.py --columns flash --heads 64 --shapes 16x1K \
    > "$OUT/ko_prof_old.log" 2>&1)
  echo "== old profile rc=$?"; grep "^H=\|flash_prepare" "$OUT/ko_prof_old.log"
fi

if [ "$PART" = house_tests ]; then
  # Must show (issue 59): every test of these files passes with the rebuilt engine: the step's
  # Context built once by step_context.build_context (eager) and for capture (graphs, KDA
  # build_for_capture), the KDA layers' steps built by the loader's pair, the memory plan sized
  # before the pools, the MTP drafter apart from the runner, the output processor apart from the
  # scheduler. One pytest process per file.
  group engine 200 tests/engine/test_engine_gpu.py
  group kda_layer 120 tests/layers/test_kda_layer_gpu.py
  group host_overhead 100 tests/engine/test_host_overhead_gpu.py
  group flash 150 tests/ops/test_flash_prefill.py -k "gpu and not 128k"
fi

if [ "$PART" = house_tests2 ]; then
  group prefix 150 tests/engine/test_prefix_caching_gpu.py
  group structured 120 tests/engine/test_structured_outputs_gpu.py
  group server 120 tests/server/test_server_gpu.py
  group kimi 100 tests/models/test_kimi_linear_gpu.py
  group glm 120 tests/models/test_glm5_next.py -k gpu
fi

if [ "$PART" = tp_gpus ]; then
  # Must show (issue 60, on issue 61's machines): tests/engine/test_tensor_parallel_gpu.py passes (NCCL,
  # graphs captured per rank, async scheduling: two GPUs give one GPU's greedy tokens for nano,
  # kimi-tiny, glm-tiny, and glm-tiny with --enable-expert-parallel; MTP at two ranks with graphs
  # lossless against one rank, 5 passed), and bench_throughput.py's bench
  # model at -tp 1 and -tp 2 (flash+fused): its table rows for each, one process each. Kimi-Linear at
  # its real shape with dummy weights at -tp 2 on two H100s (46.5 GiB of weights each): TTFT of 8K and
  # the decode step, width-split experts then whole experts per rank (--enable-expert-parallel).
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "tp_gpus needs two GPUs"; exit 1; }
  group tp_gpu 300 tests/engine/test_tensor_parallel_gpu.py
  for tp in 1 2; do
    timeout $(cap 120) python3 benchmarks/bench_throughput.py --pairs flash+fused -tp $tp > "$OUT/tp_bench_$tp.log" 2>&1
    echo "== bench -tp $tp rc=$?"; grep "^flash+fused  " "$OUT/tp_bench_$tp.log" | tail -1
  done
  for ep in "" --enable-expert-parallel; do
    timeout $(cap 150) python3 benchmarks/bench_kimi_linear.py --batches 1 8 --ttft 8192 -tp 2 $ep > "$OUT/tp_kimi$ep.log" 2>&1
    echo "== kimi -tp 2 $ep rc=$?"; grep "TTFT\|^| " "$OUT/tp_kimi$ep.log" | head -20
    grep -m3 "Error\|Traceback" "$OUT/tp_kimi$ep.log"
  done
fi

if [ "$PART" = house_server ]; then
  # Must show: the server's GPU tests pass on the rebuilt engine (the server reads only EngineInfo).
  group server 150 tests/server/test_server_gpu.py
fi

if [ "$PART" = house_speed ]; then
  # Must show (issue 59: the house's rebuild changes no speed): bench_throughput.py's output tok/s
  # and engine decode step for flash+fused, old and new code alternating (new, old, new, old), each
  # invocation a process of its own: |new - old| within the spread of the two new runs (A/A) and of
  # the two old runs, else the difference is real and goes to docs/perf-notes.md.
  [ -d .old/kdaserve ] || { echo "carry .old (git archive <commit before issue 59> kdaserve benchmarks | tar -x -C .old)"; exit 1; }
  # ROUNDS invocations (default 8: four of each); the H100's first run (2026-12-06, 128 x 512/64) took
  # 15 s an invocation.
  for i in $(seq 1 "${ROUNDS:-8}"); do
    dir=.; code=new; [ $((i % 2)) -eq 0 ] && { dir=.old; code=old; }
    [ $(( $(date +%s) - START )) -gt $(( BUDGET - 90 )) ] && { echo "== invocation $i NOT RUN (budget)"; continue; }
    (cd $dir && timeout 90 python3 benchmarks/bench_throughput.py --pairs flash+fused > "$OUT/house_speed_$i.log" 2>&1)
    echo "== invocation $i, $code code rc=$?"; grep "^flash+fused  " "$OUT/house_speed_$i.log" | tail -1
  done
  grep -m1 "^pair " "$OUT/house_speed_1.log"
fi

if [ "$PART" = after_removal ]; then
  # Must show (thirty-second session): tests/ops/test_flash_prefill.py's GPU tests pass with K1's
  # L2 lookahead and the FIRST launch's own register cap removed (the default kernels' sources lost
  # only code compiled out at the defaults: the sm_90 builds' registers and spills are unchanged,
  # tools/compile_check_flash); the plugin's NaN check on CUDA (test_vllm_layouts.py: a NaN stops the
  # process by a device-side assertion, finite inputs pass) and the plugin's layouts in bf16.
  group flash_after 240 tests/ops/test_flash_prefill.py -k "gpu and not 128k"
  group plugin_gpu 150 tests/integrations/test_vllm_layouts.py -k gpu
fi

if [ "$PART" = k1_models ]; then
  # Must show (thirtieth session's K1 defaults: fp16 operands for the inverse's products, the L1
  # prefetch, q before k, the bounded K1 capped at 168 registers, the unbounded one uncapped): the GPU
  # tests of everything that prefills through flash pass (layers, the engine, prefix caching's
  # checkpoints, Kimi-Linear's and GLM-5.3-Flash's tiny models, the compile-ahead warm-up, the
  # 128K flash tests run 5 did not rerun with the new caps), one file at a time.
  # Its groups' caps add up past one command: k1_models2 holds the second half.
  group flash_128k 200 tests/ops/test_flash_prefill.py -k "gpu and 128k"
  group kda_layer 120 tests/layers/test_kda_layer_gpu.py
  group engine 200 tests/engine/test_engine_gpu.py
  group prefix 120 tests/engine/test_prefix_caching_gpu.py
fi

if [ "$PART" = k1_models2 ]; then
  # Must show: the second half of k1_models (the same defaults), one file at a time.
  group kimi 150 tests/models/test_kimi_linear_gpu.py
  group glm 150 tests/models/test_glm5_next.py
  group warmup 120 tests/engine/test_warmup.py
  group compile_ahead 120 tests/ops/test_compile_ahead.py
fi

if [ "$PART" = k1_prefetch_ncu ]; then
  # Must show: K1's stall reasons with and without prepare_prefetch (64 heads 16x1K, bounded):
  # long_scoreboard's share lower with the prefetch (run 1, without: wait 19.8%, selected 19.6%,
  # long scoreboard 19.4%, short scoreboard 13.0%, barrier 10.7% of the samples).
  for cfg in prepare_prefetch=0 prepare_prefetch=1; do
    timeout $(cap 90) ncu --kernel-name regex:flash_prepare --launch-skip 2 --launch-count 1 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy --metrics regex:smsp__pcsamp_warps_issue_stalled_.* \
      python3 benchmarks/profile_flash_ncu.py --heads 64 --shape 16x1K --config $cfg > "$OUT/k1_ncu_$cfg.txt" 2>&1
    echo "== $cfg rc=$?"; grep -E "Duration|Issue Slots Busy|Eligible Warps|No Eligible" "$OUT/k1_ncu_$cfg.txt"
    grep -E "pcsamp_warps_issue_stalled_(wait|selected|long_scoreboard|short_scoreboard|barrier|mio_throttle|no_instructions) " "$OUT/k1_ncu_$cfg.txt"
  done
fi

if [ "$PART" = k1_ncu ]; then
  # Must show (issue 21 goal 3, what bounds K1): Nsight Compute's full set for the main K1 launch at
  # 64 heads 16x1K, bounded gate: duration, DRAM bytes against the floor the script prints (2130 B
  # per token-head), issue-slot and pipe utilization, occupancy (2 programs of 4 warps per SM at 255
  # registers), the warp stall reasons; then the SASS lines with the most stall samples.
  timeout $(cap 240) ncu --kernel-name regex:flash_prepare --launch-skip 2 --launch-count 1 --set full \
    --import-source no -f -o "$OUT/k1" python3 benchmarks/profile_flash_ncu.py --heads 64 --shape 16x1K \
    > "$OUT/k1_ncu_run.log" 2>&1
  echo "== ncu rc=$?"; grep -v "^==PROF==" "$OUT/k1_ncu_run.log" | tail -3
  ncu -i "$OUT/k1.ncu-rep" --page details > "$OUT/k1_details.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Compute \(SM\)|Executed Ipc|Issue Slots Busy|Issued Warp|No Eligible|Active Warps Per Scheduler|Eligible Warps|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|dram__bytes|Stall" "$OUT/k1_details.txt" | head -60
  ncu -i "$OUT/k1.ncu-rep" --page raw --csv > "$OUT/k1_raw.csv" 2>&1
  python3 - "$OUT/k1_raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) >= 3:   # header, units, the profiled launch
    names, units, vals = rows[0], rows[1], rows[2]
    def num(v):
        try: return float(v.replace(",", ""))
        except ValueError: return None
    st = [(n, num(v)) for n, v in zip(names, vals) if n.startswith("smsp__pcsamp_warps_issue_stalled")
          and not n.endswith("not_issued") and num(v) is not None]
    tot = sum(v for _, v in st) or 1
    for n, v in sorted(st, key=lambda nv: -nv[1])[:10]:
        print(f"  {n[len('smsp__pcsamp_warps_issue_stalled_'):]}: {100 * v / tot:.1f}% of stall samples")
    for key in ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
                "smsp__issue_active.avg.pct_of_peak_sustained_active"):
        if key in names:
            print(f"  {key} = {vals[names.index(key)]} {units[names.index(key)]}")
PY
  ncu -i "$OUT/k1.ncu-rep" --page source --csv --print-source sass > "$OUT/k1_sass.csv" 2>&1
  echo "== sass page rc=$? $(wc -l < "$OUT/k1_sass.csv") lines; stall samples per 250-instruction window:"
  python3 - "$OUT/k1_sass.csv" <<'PY'
import csv, re, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
src, samples = hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
tot = sum(float(r[samples] or 0) for r in data) or 1
for i in range(0, len(data), 250):
    part = data[i:i + 250]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0].split(".")[0] for r in part]
    mix = " ".join(f"{k}={ops.count(k)}" for k in ("LDG", "STG", "HMMA", "MUFU", "BAR", "LDS", "STS") if k in ops)
    print(f"  {i:5d}: {100 * sum(float(r[samples] or 0) for r in part) / tot:5.1f}%  {mix}")
PY
fi

if [ "$PART" = moe_ncu ]; then
  # Must show (goal 4, any Hopper card): Nsight Compute's counters for the fused MoE prefill kernels
  # at 8K tokens (gate|up, down, sum) and cuBLAS's dense GEMM at gate|up's shape: DRAM bytes and
  # throughput, L2 throughput and hit rate, SM (tensor pipe) throughput, stalls. Twenty-ninth session
  # (H100, base clocks): gate|up L2 87%, DRAM 62%, SM 68%; cuBLAS L2 53%, SM 92%.
  timeout $(cap 200) ncu --kernel-name regex:_moe_ --launch-skip 3 --launch-count 3 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    python3 benchmarks/profile_moe_prefill.py --tokens 8192 > "$OUT/moe_ncu.txt" 2>&1
  echo "== ncu rc=$?"; grep -E "^  [_a-z]|tokens,|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|dram__bytes|hit_rate" "$OUT/moe_ncu.txt"
  timeout $(cap 120) ncu --launch-skip 2 --launch-count 1 --kernel-name regex:"gemm|sm90|cutlass|nvjet" --section SpeedOfLight \
    --section LaunchStats --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct python3 -c "
import torch
a = torch.randn(65536, 2304, device='cuda', dtype=torch.bfloat16); w = torch.randn(2048, 2304, device='cuda', dtype=torch.bfloat16)
for _ in range(3): a @ w.T
torch.cuda.synchronize()" > "$OUT/dense_ncu.txt" 2>&1
  echo "== dense ncu rc=$?"; grep -E "^  [_a-z]|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|dram__bytes|hit_rate|Cluster Size|Grid Size" "$OUT/dense_ncu.txt"
fi

if [ "$PART" = align_default ]; then
  # Must show: the alignment tests pass compiled (the per-expert kernel, now the default up to
  # 4096 slots, with E and BM as runtime arguments, against the torch path and the blocks path, with
  # and without the shared expert's column; the default path's tables too), and Kimi-Linear's decode
  # step at batch 1 / 64 / 256 with the alignment counted under "MoE experts" (the twenty-eighth
  # session's per-expert run: engine 2989 / 18425 us at batch 1 / 64, the alignment then in "other").
  group align_test 200 tests/ops/test_moe.py -k "align or gpu"
  timeout $(cap 200) python3 benchmarks/bench_kimi_linear.py --batches 1 64 256 --ttft 8192 > "$OUT/kimi_align.log" 2>&1
  echo "== kimi rc=$?"; grep "TTFT\|^| [0-9]* |" "$OUT/kimi_align.log" | head -24; grep -m3 "Error\|Traceback" "$OUT/kimi_align.log"
fi

if [ "$PART" = real_client ]; then
  # Must show (issue 21 goal 2 with a real client): the OpenAI SDK's async streaming completions,
  # 64 streams split over 4 client processes (one SDK process parses too slowly for 64 streams at
  # ~400 chunks/s each), through `kdaserve serve`'s app with two API processes and then one: ITL /
  # the engine alone at or under 1.15x with two (the lean client, twenty-eighth session: 0.99x /
  # 1.12x at 128 tokens). The client processes start their streams together (a barrier), 512
  # tokens each, so that the steady window (all streams running) is long. Read the stream-mean
  # column: the SDK hands a read's events over back to back, so single intervals bunch
  # (twenty-eighth session: 1.37-1.40x with two API processes, 2.0-2.8x with one).
  python3 -c "import openai" || echo "carry .whl with openai and httpx2 (its HTTP client)"
  for how in "openai 2" "openai 1"; do
    read -r cl n <<< "$how"
    timeout $(cap 130) python3 benchmarks/bench_serving_host.py --model bench --rounds 2 --client $cl --client-processes 4 \
      --max-tokens 512 \
      --api-server-count $n > "$OUT/rc_${cl}_$n.log" 2>&1
    echo "== $cl client, $n API processes rc=$?"; grep "engine alone\|^| [0-9]" "$OUT/rc_${cl}_$n.log"; grep -m3 "Error\|Traceback" "$OUT/rc_${cl}_$n.log"
  done
fi


done
