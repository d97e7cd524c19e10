#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server; xgrammar 0.2.8, apache-tvm-ffi and
# transformers 5.23.0 with what it imports for structured output) and, for an old-vs-new comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`).
# Parts owed (add one as `if [ "$PART" = name ]; then ... fi` below, with what it must show):
#   engine_warmup  the engine GPU tests over the warm-up's parallel compile and prefix caching's
#                 per-step fast path (nothing compiles after the warm-up; greedy outputs unchanged).
#   serving_trace  bench_serving_host.py --trace: where the engine process's time goes per step in
#                 the server against alone (issue 21 goal 2).
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

if [ "$PART" = serving_trace ]; then
  # Must show, per round: the engine process's period against alone, split into step() (its
  # device wait and host work) and what the core adds (encoding, pipe writes) and between steps,
  # so a slow round names the part that grew; with .old (the code before the host-time changes,
  # `git archive 33133db kdaserve benchmarks | tar -x -C .old`, this bench script copied in)
  # alternating, the engine's host work per step alone, old against new, in one command.
  i=0
  for v in "new 2" "old 2" "new 2" "old 2" "new 1"; do
    set -- $v; i=$((i + 1))
    root=.; [ "$1" = old ] && root=.old
    timeout 110 python3 $root/benchmarks/bench_serving_host.py --model bench --rounds 2 --trace --api-server-count $2 > "$OUT/st_$i.log" 2>&1
    echo "== invocation $i, $1 code, api-server-count $2 rc=$?"; grep "^| [0-9]\|^| alone" "$OUT/st_$i.log"
  done
fi

if [ "$PART" = engine_warmup ]; then
  # Must show: every test passes (test_host_overhead_gpu: the warm-up runs and changes nothing, a
  # bench run and a served workload after it compile nothing; prefix caching on the GPU).
  group host_overhead 330 tests/engine/test_host_overhead_gpu.py
  group prefix_gpu 150 tests/engine/test_prefix_caching_gpu.py
  group kimi_gpu 150 tests/models/test_kimi_linear_gpu.py
fi
