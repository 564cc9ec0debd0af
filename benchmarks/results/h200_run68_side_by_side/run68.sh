#!/usr/bin/env bash
# run 68 (after the vLLM env is sourced): side by side at 128K with vLLM's FA3 / TurboQuant, then the vLLM GPU smoke
set -u
export PYTHONUNBUFFERED=1
R=/tmp/r68; mkdir -p $R/sbs $R/smoke
date -u > $R/date.txt; sha256sum kvrepro/ops/cuda/decode_k4v4.fatbin >> $R/date.txt
timeout 300 env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/side_by_side_vllm.py --ctxs 131072 --out $R/sbs > $R/sbs/log.txt 2>&1; echo "sbs rc $?"
grep -vE "^(INFO|WARNING|DEBUG)" $R/sbs/log.txt | tail -45
tar czf $OUT/run68.tgz -C /tmp r68
OUT=$R/smoke CALL_T0=${T0:-$(date +%s)} CALL_LIMIT_S=200 timeout 200 bash scripts/h200_sweep.sh smoke > $R/smoke/log.txt 2>&1; echo "smoke rc $?"
grep -E "SMOKE|passed|failed|Error" $R/smoke/log.txt $R/smoke/*.txt 2>/dev/null | tail -15
tar czf $OUT/run68.tgz -C /tmp r68
