#!/usr/bin/env bash
# run 67: the committed build (run 66's e3 folded in) against the previous (f032ff8c): timing, GPU tests, sanitizers, trace
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r67; mkdir -p $R
T0=$(date +%s)
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin kvrepro/ops/cuda/decode_k4v4.cu $V/prev.fatbin $V/tr_final.fatbin >> $R/date.txt
cp $V/run67.sh $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2; do
  for p in k4v2 k4v4 k8v4; do
    [ $pass = 2 ] && [ $p != k4v2 ] && continue
    extra=""; [ $p = k4v2 ] && [ $pass = 1 ] && extra="--trace $V/tr_final.fatbin"
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 1 3 6 13 \
      --variant prev=$V/prev.fatbin $extra > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    grep "^trace" $R/p$pass/$p/log.txt | cut -c1-400 | tee -a $R/summary.txt
  done
done
echo "waves t=$(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run67.tgz -C /tmp r67
timeout 300 python3 -m pytest -q tests/test_ops_cuda_decode.py > $R/pytest.txt 2>&1; echo "pytest rc $?" | tee -a $R/summary.txt; tail -2 $R/pytest.txt | tee -a $R/summary.txt
echo "t=$(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run67.tgz -C /tmp r67
timeout 110 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_ops_cuda_decode.py -k "(graph or partition) and (k4v2 or k4v4 or k8v4)" > $R/memcheck.txt 2>&1; echo "memcheck rc $?" | tee -a $R/summary.txt; tail -2 $R/memcheck.txt | tee -a $R/summary.txt
timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -x tests/test_ops_cuda_decode.py -k "graph and (k4v2 or k4v4 or k8v4)" > $R/racecheck.txt 2>&1; echo "racecheck rc $?" | tee -a $R/summary.txt; tail -2 $R/racecheck.txt | tee -a $R/summary.txt
echo "total t=$(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run67.tgz -C /tmp r67; cp $R/summary.txt $OUT/
