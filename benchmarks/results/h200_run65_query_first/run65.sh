#!/usr/bin/env bash
# run 65: on top of ars64: the query digits computed while the block-table window is in flight, before the first pages are requested (qf = QFIRST); qf without L2::128B (qfnp)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r65; mkdir -p $R
T0=$(date +%s)
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin $V/*.fatbin $V/run65_variants.cu >> $R/date.txt
cp $V/run65_variants.cu $V/run65.sh $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2 3; do
  for p in k4v2 k8v4 k4v4; do
    if [ $p = k4v2 ]; then vs="base=$V/base.fatbin ars64=$V/ars64.fatbin qf=$V/qf.fatbin qfnp=$V/qfnp.fatbin"
    else [ $pass != 1 ] && continue; vs="base=$V/base.fatbin qf=$V/qf.fatbin qfnp=$V/qfnp.fatbin"; fi
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 1 3 6 13 --variant $vs \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    echo "t=$(( $(date +%s) - T0 ))s"
    tar czf $OUT/run65.tgz -C /tmp r65
  done
done
for t in trd_qf; do
  [ $(( $(date +%s) - T0 )) -gt 500 ] && break
  mkdir -p $R/trace_$t
  python3 benchmarks/cuda_split_waves.py --out $R/trace_$t --preset k4v2 --rule-only --batches 3 --trace $V/$t.fatbin \
    > $R/trace_$t/log.txt 2>&1 || echo "FAIL trace $t"
  grep "^trace" $R/trace_$t/log.txt | sed "s/^/$t /" | tee -a $R/summary.txt
done
echo "total $(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run65.tgz -C /tmp r65; cp $R/summary.txt $OUT/
