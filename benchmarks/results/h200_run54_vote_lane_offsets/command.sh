#!/usr/bin/env bash
# run 54: vote before the max reduction (VOTE_FIRST), ldmatrix lane offsets once (LANE_OFFS); TAU 0 / 1 / 2; trace
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r54; mkdir -p $R
T0=$(date +%s)
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum $V/*.fatbin $V/run54_variants.cu kvrepro/ops/cuda/decode_k4v4.fatbin >> $R/date.txt
cp $V/run54_variants.cu $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2; do
  for p in k4v2 k4v4 k8v4; do
    if [ $p = k4v2 ]; then vs="base=$V/base.fatbin g_t2=$V/g_t2.fatbin v_t2=$V/v_t2.fatbin o_t0=$V/o_t0.fatbin o_t1=$V/o_t1.fatbin o_t2=$V/o_t2.fatbin"
    else [ $pass = 2 ] && continue; vs="base=$V/base.fatbin g_t2=$V/g_t2.fatbin o_t2=$V/o_t2.fatbin"; fi
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 3 6 13 --variant $vs \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    echo "t=$(( $(date +%s) - T0 ))s"
  done
done
for t in tr_o_t2; do
  [ $(( $(date +%s) - T0 )) -gt 480 ] && break
  mkdir -p $R/trace_$t
  python3 benchmarks/cuda_split_waves.py --out $R/trace_$t --preset k4v2 --rule-only --batches 3 --trace $V/$t.fatbin \
    > $R/trace_$t/log.txt 2>&1 || echo "FAIL trace $t"
  grep "^trace" $R/trace_$t/log.txt | sed "s/^/$t /" | tee -a $R/summary.txt
done
echo "total $(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run54.tgz -C /tmp r54; cp $R/summary.txt $OUT/
