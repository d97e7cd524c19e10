#!/usr/bin/env bash
# GPU runs still owed by the CPU-side work (issue 27 runs this script and empties it). Each part
# fits one 10-minute device command: every group gets its own timeout, and a part stops starting
# groups past its budget (printing "NOT RUN" for the rest). Logs under $OUT (or ./out).
# Carry [".whl"] (fla-core 0.6.0; fastapi, starlette, pydantic(-core), uvicorn, opentelemetry-api,
# annotated-types, typing-inspection for the server; xgrammar 0.2.8, apache-tvm-ffi and
# transformers 5.23.0 with what it imports for structured output) and, for an old-vs-new comparison, [".old"]
# (e.g. `git archive <commit> kdaserve benchmarks | tar -x -C .old`).
# Parts owed (add one as `if [ "$PART" = name ]; then ... fi` below, with what it must show):
#   api_servers_spread  bench_serving_host.py's new columns for several API processes (the engine's
#                 mean step per round, connections per process): why one invocation of two API
#                 processes ran at 1.42x while two others ran at 1.00-1.24x (issue 21 goal 2); and
#                 with --pin (engine, API processes and client on cores of their own) against without.
#   compile_ahead the warm-up's parallel compile (ops/compile_ahead.py): its GPU tests, and start-up
#                 compile per gate with one compile thread and with the cores (issue 20 goal 5).
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

if [ "$PART" = api_servers_spread ]; then
  # Must show, per invocation: whether the slow rounds come with a slower engine step (the
  # "engine mean step ms" column above the "alone" figure) or with connections spread unevenly
  # (e.g. 40 / 24); numbers into docs/perf-notes.md ("Serving path"). Four invocations of two API
  # processes, one of one, each about 60-80 s with the bench model's start-up.
  # With --pin: if pinned invocations are all near 1.0x while unpinned ones still spread, the
  # spread is the OS's placement of the processes.
  i=0
  for v in "2" "2 --pin" "2" "2 --pin" "1 --pin"; do
    i=$((i + 1))
    timeout 100 python3 benchmarks/bench_serving_host.py --model bench --rounds 3 --api-server-count $v > "$OUT/asc_$i.log" 2>&1
    echo "== invocation $i, api-server-count $v rc=$?"; grep "^| [0-9]\|streams\|pinned" "$OUT/asc_$i.log"
  done
fi

if [ "$PART" = compile_ahead ]; then
  # Must show: test_compile_ahead.py's GPU tests pass (the compile pass writes nothing; results
  # equal the reference / a plain call); start-up compile with the cores below one thread for both
  # gates, and whether the unbounded gate's is at most the bounded gate's (issue 20 goal 5); the
  # engine's start-up (bench model, both gates) with one thread and with the cores.
  group compile_ahead 120 tests/ops/test_compile_ahead.py
  timeout 150 python3 benchmarks/bench_compile_time.py --threads 1 auto 2>&1 | tail -6
  timeout 280 python3 benchmarks/bench_compile_time.py --engine bench --threads 1 auto 2>&1 | grep "^|"
fi
