#!/usr/bin/env bash
# run 45: per-page instruction cuts (ex2.ftz, two pages per step, 5 CTAs/SM), timed against the committed build
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar
date -u > $OUT/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $OUT/date.txt
for pass in 1 2; do
  for p in k4v2 k8v4 k4v4; do
    mkdir -p $OUT/p$pass/$p
    python3 benchmarks/cuda_split_waves.py --out $OUT/p$pass/$p --preset $p --rule-only --batches 1 3 6 13 \
      --variant base=$V/base.fatbin ftz=$V/ftz.fatbin pair=$V/pair.fatbin pairftz=$V/pairftz.fatbin \
      > $OUT/p$pass/$p/log.txt 2>&1 || echo "FAIL $pass $p"
    grep -E "'batch': (3|6|13)" $OUT/p$pass/$p/log.txt | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$pass $p', d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])"
  done
done
mkdir -p $OUT/mc5
python3 benchmarks/cuda_split_waves.py --out $OUT/mc5 --preset k4v2 --rule-only --batches 3 6 13 \
  --variant mc5=$V/mc5.fatbin ftzmc5=$V/ftzmc5.fatbin --extra-splits 27 13 6 > $OUT/mc5/log.txt 2>&1 || echo FAIL mc5
grep -E "'batch'" $OUT/mc5/log.txt | cut -c1-220
# correctness of the pair + ftz build: copied over the committed fatbin for pytest
cp kvrepro/ops/cuda/decode_k4v4.fatbin /tmp/committed.fatbin
cp $V/pairftz.fatbin kvrepro/ops/cuda/decode_k4v4.fatbin
timeout 200 python3 -m pytest -q -x tests/test_ops_cuda_decode.py -k "(matches and (32-8 or 56-8 or 16-2)) or graph or partition or nan or counters or strided or 2_gib" > $OUT/pytest_pairftz.txt 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest_pairftz.txt
cp /tmp/committed.fatbin kvrepro/ops/cuda/decode_k4v4.fatbin
