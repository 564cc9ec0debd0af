#!/usr/bin/env bash
# Runs ON the lent H200 (see /work/shared/device/README.md), from the repo root, after
#   source .device/vllm-c/kvdev.sh env          (vLLM 0.20.2 bundle on PYTHONPATH)
# Usage: bash scripts/h200_sweep.sh smoke
#        bash scripts/h200_sweep.sh sweep RUN_ID MODES [CONFIRM_EDGE_MODES] [PARAMS_JSON]
# Results of a sweep go to results/capacity/RUN_ID.jsonl (resumed if it travelled with the tree)
# and are copied to $OUT.
set -u
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/kvout}; mkdir -p "$OUT"
# The vllm.general_plugins entry point: from kvrepro's installed metadata if pyproject declares it,
# else a metadata-only shim with the same line (no code copied) so vLLM's own plugin loader runs it.
if grep -q 'vllm.general_plugins' pyproject.toml; then
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/kvsite_ep -e . >/dev/null 2>&1 \
    && export PYTHONPATH="/tmp/kvsite_ep:$PYTHONPATH"
fi
if ! python3 -c "from importlib.metadata import entry_points as e; import sys; sys.exit(0 if [x for x in e(group='vllm.general_plugins') if x.value.startswith('kvrepro')] else 1)"; then
  d=/tmp/kvsite/kvrepro_vllm_plugin-0.1.0.dist-info; mkdir -p $d
  printf 'Metadata-Version: 2.1\nName: kvrepro-vllm-plugin\nVersion: 0.1.0\n' > $d/METADATA
  printf '[vllm.general_plugins]\nkvrepro = kvrepro.vllm_backend:register\n' > $d/entry_points.txt
  echo "entry point: metadata shim in $d (pyproject has no vllm.general_plugins line yet)"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,temperature.gpu --format=csv,noheader
case "${1:-}" in
  smoke)
    timeout 120 python3 -m pytest -q -x tests/test_vllm_backend.py 2>&1 | tail -5
    timeout 200 python3 scripts/vllm_smoke.py --case graphs --out $OUT/smoke_graphs.json 2>&1 | grep -E "SMOKE|Error|error|Traceback|KV cache size|CUDA graph" | tail -20
    timeout 150 python3 scripts/vllm_smoke.py --case piecewise --compare $OUT/smoke_graphs.json --out $OUT/smoke_piecewise.json 2>&1 | grep -E "SMOKE|Error|Traceback" | tail -10
    timeout 90 python3 scripts/vllm_smoke.py --case refuse --out $OUT/smoke_refuse.json 2>&1 | grep -E "SMOKE" | tail -3
    ;;
  smokeg)
    timeout 200 python3 scripts/vllm_smoke.py --case graphs --out $OUT/smoke_graphs.json 2>&1 | tee $OUT/smoke_log.txt | grep -E "SMOKE|Error|Traceback|KV cache size" | tail -20
    ;;
  sweep)
    run=$2; modes=$3; edge=${4:-}; params=${5:-'{}'}
    cp results/capacity/$run.jsonl $OUT/ 2>/dev/null   # resume: rows of earlier calls travel with the tree
    timeout ${SWEEP_CALL_S:-580} python3 -m kvrepro.sweep --modes "$modes" --results $OUT/$run.jsonl --run-id $run \
      --confirm-edge "$edge" --params "$params" --timeout-s ${SWEEP_TIMEOUT_S:-540} 2>&1 \
      | tee $OUT/sweep_log.txt | grep -E "^\[sweep\]|^\{|Error|Traceback|KV cache size|Maximum concurrency" | tail -40
    ;;
  *) echo "usage: $0 smoke | sweep RUN_ID MODES [EDGE_MODES] [PARAMS]"; exit 2 ;;
esac
