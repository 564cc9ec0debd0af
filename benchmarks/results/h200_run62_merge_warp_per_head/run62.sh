#!/usr/bin/env bash
# run 62: split merge one warp per head with early partial loads (m2p8 / m2p24: MERGE2, PRE 8 / 24), L2::128B (pf128), both (m2p8pf); diagnostic traces (trd_*)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r62; mkdir -p $R
T0=$(date +%s)
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin $V/*.fatbin $V/run62_variants.cu >> $R/date.txt
cp $V/run62_variants.cu $V/run62.sh $R/
summ() { grep -E "'batch'" $1 | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$2', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"; }
for pass in 1 2 3; do
  for p in k4v2 k8v4 k4v4; do
    if [ $p = k4v2 ]; then vs="base=$V/base.fatbin pf128=$V/pf128.fatbin m2p8=$V/m2p8.fatbin m2p24=$V/m2p24.fatbin m2p8pf=$V/m2p8pf.fatbin"
    else [ $pass != 1 ] && continue; vs="base=$V/base.fatbin m2p8=$V/m2p8.fatbin m2p8pf=$V/m2p8pf.fatbin"; fi
    mkdir -p $R/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $R/p$pass/$p --preset $p --rule-only --batches 1 3 6 13 --variant $vs \
      > $R/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    summ $R/p$pass/$p/log.txt "$pass $p" | tee -a $R/summary.txt
    echo "t=$(( $(date +%s) - T0 ))s"
    tar czf $OUT/run62.tgz -C /tmp r62
  done
done
for t in trd_base trd_m2; do
  [ $(( $(date +%s) - T0 )) -gt 500 ] && break
  mkdir -p $R/trace_$t
  python3 benchmarks/cuda_split_waves.py --out $R/trace_$t --preset k4v2 --rule-only --batches 3 --trace $V/$t.fatbin \
    > $R/trace_$t/log.txt 2>&1 || echo "FAIL trace $t"
  grep "^trace" $R/trace_$t/log.txt | sed "s/^/$t /" | tee -a $R/summary.txt
done
echo "total $(( $(date +%s) - T0 ))s" | tee -a $R/summary.txt
tar czf $OUT/run62.tgz -C /tmp r62; cp $R/summary.txt $OUT/
