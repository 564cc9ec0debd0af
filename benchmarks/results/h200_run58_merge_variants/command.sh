#!/usr/bin/env bash
# run 58: the split merge as an online log-sum-exp per warp (MERGE_ONLINE, MERGE_UNROLL 6) and the count-in as one
# atom.acq_rel (ACQREL), against the committed build (f032ff8c); trace of k4v2 batch 3
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r58; mkdir -p $R
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin $V/*.fatbin $V/run58_variants.cu >> $R/date.txt; cp $V/run58_variants.cu $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2; do
  for p in k4v2 k4v4 k8v4; do
    [ $pass = 2 ] && [ $p != k4v2 ] && continue
    vs="mo=$V/mo.fatbin"; [ $p = k4v2 ] && vs="mo=$V/mo.fatbin mo_u6=$V/mo_u6.fatbin ar=$V/ar.fatbin on=$V/on.fatbin"
    extra=""; [ $p = k4v2 ] && [ $pass = 1 ] && extra="--trace $V/tr_mo.fatbin"
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 3 6 13 --variant $vs $extra \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    grep "^trace" $R/p$pass/$p/log.txt | cut -c1-400 | tee -a $R/summary.txt
  done
done
mkdir -p $R/trace_final; python3 benchmarks/cuda_split_waves.py --out $R/trace_final --preset k4v2 --rule-only --batches 3 --trace $V/tr_final.fatbin > $R/trace_final/log.txt 2>&1; grep "^trace" $R/trace_final/log.txt | cut -c1-400 | sed "s/^/final /" | tee -a $R/summary.txt
tar czf $OUT/run58.tgz -C /tmp r58; cp $R/summary.txt $OUT/
