#!/usr/bin/env bash
# Run on a GPU machine from the repo root: GPU tests, then the benchmark scripts named as arguments.
# Logs go to $OUT (or ./out). FLA 0.6.0 is installed from .whl/ when present (no network there).
#   bash scripts/gpu_suite.sh [pytest -k expression] [benchmarks/bench_x.py ...]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
expr=${1:-}; shift || true
python3 -m pytest -q -m gpu ${expr:+-k "$expr"} -p no:cacheprovider --durations=20 tests 2>&1 | tee "$OUT/gpu_tests.log"
for b in "$@"; do
  echo "=== $b"; python3 "$b" 2>&1 | tee "$OUT/$(basename "$b" .py).log"
done
