#!/usr/bin/env bash
# run 59: the online merge with each batch of MERGE_UNROLL splits loaded before use (branch-free), with and without the acq_rel count-in

set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r59; mkdir -p $R
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin $V/*.fatbin $V/run59_variants.cu >> $R/date.txt; cp $V/run59_variants.cu $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2; do
  for p in k4v2 k4v4 k8v4; do
    [ $pass = 2 ] && [ $p != k4v2 ] && continue
    vs="bb4=$V/bb4.fatbin"; [ $p = k4v2 ] && vs="bb4=$V/bb4.fatbin bb4_ar0=$V/bb4_ar0.fatbin"
    extra=""
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 3 6 13 --variant $vs $extra \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    grep "^trace" $R/p$pass/$p/log.txt | cut -c1-400 | tee -a $R/summary.txt
  done
done
tar czf $OUT/run59.tgz -C /tmp r59; cp $R/summary.txt $OUT/
