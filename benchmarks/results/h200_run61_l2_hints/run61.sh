#!/usr/bin/env bash
# run 61: L2 cache hints on the page copies: evict_first policy (ef), + evict_unchanged secondary (efu), prefetch size
# hints L2::256B / L2::128B (pf256, pf128), both (ef256); base = the committed source built for sm_90 alone
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r61; mkdir -p $R
T0=$(date +%s)
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin $V/*.fatbin $V/run61_variants.cu >> $R/date.txt
cp $V/run61_variants.cu $V/run61.sh $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2; do
  for p in k4v2 k8v4 k4v4; do
    if [ $p = k4v2 ]; then vs="base=$V/base.fatbin ef=$V/ef.fatbin efu=$V/efu.fatbin pf256=$V/pf256.fatbin ef256=$V/ef256.fatbin pf128=$V/pf128.fatbin"
    else [ $pass = 2 ] && continue; vs="base=$V/base.fatbin ef=$V/ef.fatbin ef256=$V/ef256.fatbin"; fi
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 3 6 13 --variant $vs \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    echo "t=$(( $(date +%s) - T0 ))s"
    tar czf $OUT/run61.tgz -C /tmp r61
  done
done
for t in tr_ef tr_base; do
  [ $(( $(date +%s) - T0 )) -gt 500 ] && break
  mkdir -p $R/trace_$t
  python3 benchmarks/cuda_split_waves.py --out $R/trace_$t --preset k4v2 --rule-only --batches 3 --trace $V/$t.fatbin \
    > $R/trace_$t/log.txt 2>&1 || echo "FAIL trace $t"
  grep "^trace" $R/trace_$t/log.txt | cut -c1-600 | sed "s/^/$t /" | tee -a $R/summary.txt
done
echo "total $(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run61.tgz -C /tmp r61; cp $R/summary.txt $OUT/
