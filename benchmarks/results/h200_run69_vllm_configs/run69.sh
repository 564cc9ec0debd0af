#!/usr/bin/env bash
# run 69: vLLM's decode configurations (batch 16 / 24, 32 splits: several waves) with the committed build, the previous
# one, the committed source without L2::128B (nopf), and the committed fatbin again (cmt: position in the list)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
V=.device/cudavar; R=/tmp/r69; mkdir -p $R
date -u > $R/date.txt; sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin $V/prev.fatbin $V/nopf.fatbin $V/cmt.fatbin >> $R/date.txt
cp $V/run69.sh $V/run69_nopf.cu $R/
python3 benchmarks/cuda_split_waves.py --out $R --preset k4v2 --rule-only --extra-splits 32 --batches 16 24 3 \
  --variant prev=$V/prev.fatbin nopf=$V/nopf.fatbin cmt=$V/cmt.fatbin > $R/log.txt 2>&1 || echo FAIL
grep -E "'batch'" $R/log.txt | python3 -c "
import sys,ast
for l in sys.stdin:
    d=ast.literal_eval(l[l.index('{'):l.rindex('}')+1]); print(d['kernel'], d['batch'], d['splits'], d['ms_graph'], round(d['pct_copy'],1), '%.2e'%d['relerr_vs_f64'])" | tee $R/summary.txt
tar czf $OUT/run69.tgz -C /tmp r69
