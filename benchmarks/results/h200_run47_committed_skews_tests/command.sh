#!/usr/bin/env bash
# run 47: the new committed build (9295e012): rank skews per preset, against the previous build (824cf8f7); GPU tests
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r47; mkdir -p $R
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
git log --oneline -1 >> $R/date.txt 2>/dev/null; sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin >> $R/date.txt
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2; do
  for p in k4v2 k4v4 k8v4; do
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 3 6 13 \
      --variant prev=$V/head.fatbin --skews 32 64 80 96 128 > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
  done
done
tar czf $OUT/run47.tgz -C /tmp r47; cp $R/summary.txt $OUT/
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_ops_cuda_decode.py -k "(graph or partition) and (k4v2 or k4v4)" > $R/memcheck.txt 2>&1; echo "memcheck rc $?"; tail -3 $R/memcheck.txt
timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -x tests/test_ops_cuda_decode.py -k "graph and (k4v2 or k4v4)" > $R/racecheck.txt 2>&1; echo "racecheck rc $?"; tail -3 $R/racecheck.txt
timeout 280 python3 -m pytest -q tests/test_ops_cuda_decode.py > $R/pytest.txt 2>&1; echo "pytest rc $?"; tail -3 $R/pytest.txt
tar czf $OUT/run47.tgz -C /tmp r47
