#!/usr/bin/env bash
# run 64: on top of e2m2pf: count-in by one atom.acq_rel.gpu of thread 0, no fences (ar = ACQREL); float2 stores of the warp partials (s64 = STS64); both (ars64)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r64; mkdir -p $R
T0=$(date +%s)
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin $V/*.fatbin $V/run64_variants.cu >> $R/date.txt
cp $V/run64_variants.cu $V/run64.sh $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2 3; do
  for p in k4v2 k8v4 k4v4; do
    if [ $p = k4v2 ]; then vs="base=$V/base.fatbin e2m2pf=$V/e2m2pf.fatbin ar=$V/ar.fatbin s64=$V/s64.fatbin ars64=$V/ars64.fatbin"
    else [ $pass != 1 ] && continue; vs="base=$V/base.fatbin e2m2pf=$V/e2m2pf.fatbin ars64=$V/ars64.fatbin"; fi
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 1 3 6 13 --variant $vs \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    echo "t=$(( $(date +%s) - T0 ))s"
    tar czf $OUT/run64.tgz -C /tmp r64
  done
done
for t in trd_ars64; do
  [ $(( $(date +%s) - T0 )) -gt 500 ] && break
  mkdir -p $R/trace_$t
  python3 benchmarks/cuda_split_waves.py --out $R/trace_$t --preset k4v2 --rule-only --batches 3 --trace $V/$t.fatbin \
    > $R/trace_$t/log.txt 2>&1 || echo "FAIL trace $t"
  grep "^trace" $R/trace_$t/log.txt | sed "s/^/$t /" | tee -a $R/summary.txt
done
echo "total $(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run64.tgz -C /tmp r64; cp $R/summary.txt $OUT/
