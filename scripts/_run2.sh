set -u
export PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/bench_moe_mla.py --sweep-mla-prefill --prefill 2048 8192 > $OUT/mla_sweep.log 2>&1; echo rc=$?
sed -n '/^| heads/,$p' $OUT/mla_sweep.log
cd .old && timeout 80 python3 benchmarks/bench_moe_mla.py --batches 1 64 --prefill 2048 8192 > $OUT/old.log 2>&1; cd ..
timeout 80 python3 benchmarks/bench_moe_mla.py --batches 1 64 --prefill 2048 8192 > $OUT/new.log 2>&1
echo old; grep "^| M" $OUT/old.log; echo new; grep "^| M" $OUT/new.log
for f in test_mla test_moe; do timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/$f.py > $OUT/t_$f.log 2>&1; tail -n1 $OUT/t_$f.log; done
