#!/usr/bin/env bash
# run 46: pages per step 2 / 3 / 4 (with ex2.ftz), the per-warp merge rotation, traces of k4v2
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r46; mkdir -p $R
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2; do
  for p in k4v2 k8v4 k4v4; do
    vs="base=$V/base.fatbin s2=$V/s2.fatbin s2m=$V/s2m.fatbin"
    [ $p = k4v2 ] && vs="$vs s3=$V/s3.fatbin s4=$V/s4.fatbin"
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 3 6 13 --variant $vs \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
  done
done
for t in s2t bt; do
  mkdir -p $R/trace_$t
  python3 benchmarks/cuda_split_waves.py --out $R/trace_$t --preset k4v2 --rule-only --batches 3 13 --trace $V/$t.fatbin \
    > $R/trace_$t/log.txt 2>&1 || echo "FAIL trace $t"
  grep "^trace" $R/trace_$t/log.txt | sed "s/^/$t /" | tee -a $R/summary.txt
done
cp kvrepro/ops/cuda/decode_k4v4.fatbin /tmp/committed.fatbin
cp $V/s2m.fatbin kvrepro/ops/cuda/decode_k4v4.fatbin
timeout 200 python3 -m pytest -q -x tests/test_ops_cuda_decode.py -k "(matches and (32-8 or 56-8 or 16-2)) or graph or partition or nan or counters or strided or 2_gib" > $R/pytest_s2m.txt 2>&1; echo "pytest s2m rc $?"; tail -2 $R/pytest_s2m.txt
cp /tmp/committed.fatbin kvrepro/ops/cuda/decode_k4v4.fatbin
tar czf $OUT/run46.tgz -C /tmp r46; cp $R/summary.txt $OUT/
