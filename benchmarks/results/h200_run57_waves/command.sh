#!/usr/bin/env bash
# run 57: the committed build (f032ff8c) at more splits than one wave (hardware-balanced waves) for k4v2 batch 3 / 6
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
R=/tmp/r57; mkdir -p $R
date -u > $R/date.txt; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> $R/date.txt
sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin >> $R/date.txt
for pass in 1 2; do
  mkdir -p $R/p$pass
  python3 benchmarks/cuda_split_waves.py --out $R/p$pass --preset k4v2 --rule-only --batches 3 6 --extra-splits 27 33 44 55 66 88 \
    > $R/p$pass/log.txt 2>&1 || echo "FAIL $pass"
  grep -E "'batch'" $R/p$pass/log.txt | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print('$pass', d['kernel'], d['batch'], d['splits'], round(d['waves'],2), d['ms_graph'], round(d['pct_copy'],1))" | tee -a $R/summary.txt
done
tar czf $OUT/run57.tgz -C /tmp r57
