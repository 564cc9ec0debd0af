#!/usr/bin/env bash
# Runs on a GPU machine from the repo root, with vLLM 0.20.2 importable by python3 (installed, or put on PYTHONPATH
# first where the machine has no network: see notes/kit.md). Installs kvrepro's vLLM entry point into /tmp/kvsite_ep.
# Usage: bash scripts/h200_sweep.sh smoke                 GPU smoke of the decode path (~30-60 s)
#        bash scripts/h200_sweep.sh sweep RUN_ID MODES [EDGE_MODES] [PARAMS_JSON] [MODE_PARAMS_JSON]
#        bash scripts/h200_sweep.sh smoke+sweep RUN_ID MODES [EDGE_MODES] ...   (both, one call)
#        bash scripts/h200_sweep.sh prefix                 prefix caching smoke (scripts/vllm_smoke.py --case piecewise)
#        bash scripts/h200_sweep.sh preempt                vLLM's preemption counter on a workload that must preempt
# Wall budget of the whole call: CALL_LIMIT_S (default 585) counted from CALL_T0 (epoch seconds; set
# it first thing on the command line so that staging counts too), else from this script's start.
# Modes that no longer fit are not started (a later call resumes them). SIZING_ONLY=modes,... sizes only;
# MIN_START='{"mode": s}' overrides kvrepro.sweep.MIN_START_S (seconds a mode needs to be started).
# PREFILL_AUTO=1: kvrepro modes prefill with KVREPRO_PREFILL=dequant if the smoke passed it (see smoke) and the
# key offset is not rope-mean (the default; that prefill cannot add it back).
# Results: $OUT/RUN_ID.jsonl (rows of earlier calls resume from results/capacity/RUN_ID.jsonl or from
# the warm machine's /tmp/kvres copy, whichever has more rows; kvrepro.sweep re-measures a mode whose rows
# are incomplete and moves its earlier rows to RUN_ID.jsonl.superseded) + $OUT/sweep_log.txt (full vLLM
# log) + $OUT/smoke_log.txt (the smoke test's SMOKE lines).
set -u
case "${1:-}" in smoke|sweep|smoke+sweep|prefix|preempt|smokeg) ;;
  *) echo "usage: $0 smoke | sweep RUN_ID MODES [EDGE] [PARAMS] [MODE_PARAMS] | smoke+sweep ... | prefix | preempt | smokeg"; exit 2 ;;
esac
T0=${CALL_T0:-$(date +%s)}
left() { echo $(( ${CALL_LIMIT_S:-585} - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
# Compile caches shared by every engine start of this machine while it stays warm (torch.compile
# artifacts of vLLM, Triton kernels incl. kvrepro's, warmed by the smoke).
export VLLM_CACHE_ROOT=/tmp/kvcache/vllm TRITON_CACHE_DIR=/tmp/kvcache/triton
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/kvout}; mkdir -p "$OUT" /tmp/kvcache /tmp/kvres
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
  echo "entry point: metadata shim in $d (same line as pyproject; the editable install did not expose it)"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,temperature.gpu --format=csv,noheader

smoke() {
  # Warm-up compiles every decode variant into TRITON_CACHE_DIR (the k4v4 engine then loads them),
  # captures a padded decode graph (must allocate nothing), replay == eager == reference; then the
  # two prefill paths at 128K with vLLM's FlashAttention (flag file if KVREPRO_PREFILL=dequant is
  # right and faster than fa).
  rm -f /tmp/kvcache/flags/prefill_dequant_ok
  KVREPRO_SMOKE_FLAGS=/tmp/kvcache/flags timeout 120 python3 -m pytest -q -s -x tests/test_vllm_gpu_runtime.py 2>&1 \
    | grep -E "SMOKE|passed|failed|skipped|[Ee]rror" | tail -20 | tee $OUT/smoke_log.txt
  echo "smoke done at $(( $(date +%s) - T0 )) s" | tee -a $OUT/smoke_log.txt
}

sweep() {
  local run=$1 modes=$2 edge=${3:-} params=${4:-'{}'} mparams=${5:-'{}'} src=results/capacity/$1.jsonl
  if [ -f /tmp/kvres/$run.jsonl ] && [ "$(wc -l < /tmp/kvres/$run.jsonl)" -gt "$(cat $src 2>/dev/null | wc -l)" ]; then
    src=/tmp/kvres/$run.jsonl
  fi
  [ -f "$src" ] && cp "$src" $OUT/$run.jsonl && echo "resuming from $src ($(wc -l < $src) rows)"
  [ -f "$src.superseded" ] && cp "$src.superseded" $OUT/$run.jsonl.superseded
  [ -f "$src.engine_errors" ] && cp "$src.engine_errors" $OUT/$run.jsonl.engine_errors
  # PREFILL_AUTO=1: use KVREPRO_PREFILL=dequant for kvrepro modes if this machine's smoke found it
  # right and faster than fa (the rows record the path in env / kvrepro_settings).
  # Not with the key offset rope-mean (the default): that prefill cannot add the offset back (kvrepro.settings).
  if [ "${PREFILL_AUTO:-0}" = 1 ] && [ -z "${KVREPRO_PREFILL:-}" ] && [ -f /tmp/kvcache/flags/prefill_dequant_ok ] \
     && [ "$(python3 -c 'from kvrepro.settings import Settings; print(Settings.from_env().key_offset)')" != rope-mean ]; then
    export KVREPRO_PREFILL=dequant; echo "KVREPRO_PREFILL=dequant ($(cat /tmp/kvcache/flags/prefill_dequant_ok))"
  fi
  local budget; budget=$(left)
  echo "sweep budget ${budget} s: $modes (edge: ${edge:-none}; sizing only: ${SIZING_ONLY:-none})"
  timeout $(( budget > 20 ? budget : 20 )) python3 -m kvrepro.sweep --modes "$modes" --results $OUT/$run.jsonl \
    --run-id $run --confirm-edge "$edge" --sizing-only "${SIZING_ONLY:-}" --params "$params" \
    --mode-params "$mparams" --min-start-s "${MIN_START:-{\}}" --budget-s $(( budget - 10 )) --timeout-s ${SWEEP_TIMEOUT_S:-540} 2>&1 \
    | tee $OUT/sweep_log.txt \
    | grep -E "^\[sweep\]|^\[measure\]|^\{|[Ee]rror|Traceback|kvrepro settings|GPU KV cache size|CUDA graph pool memory|Available KV cache" \
    | cut -c1-700 | tail -60
  cp $OUT/$run.jsonl /tmp/kvres/ 2>/dev/null
  cp $OUT/$run.jsonl.superseded /tmp/kvres/ 2>/dev/null
  cp $OUT/$run.jsonl.engine_errors /tmp/kvres/ 2>/dev/null
  echo "call done at $(( $(date +%s) - T0 )) s"
}

case "${1:-}" in
  smoke) smoke ;;
  sweep) shift; sweep "$@" ;;
  smoke+sweep) shift; smoke; sweep "$@" ;;
  prefix)  # prefix caching through the backend (tiny model, piecewise graphs, every eager call checked; ~1-2 min)
    timeout 240 python3 scripts/vllm_smoke.py --case piecewise --out $OUT/piecewise.json > $OUT/piecewise_log.txt 2>&1
    echo "piecewise rc=$?"; grep -E "Error|Traceback" $OUT/piecewise_log.txt | tail -5; cat $OUT/piecewise.json 2>/dev/null | cut -c1-1500
    ;;
  preempt)  # vLLM's preemption counter on a workload that must preempt (tiny model, 48 KV blocks; ~1 min)
    timeout 240 python3 scripts/vllm_smoke.py --case preempt --out $OUT/preempt.json > $OUT/preempt_log.txt 2>&1
    echo "preempt rc=$?"; grep -E "Error|Traceback" $OUT/preempt_log.txt | tail -5; cat $OUT/preempt.json 2>/dev/null | cut -c1-1500
    ;;
  smokeg)  # the tiny-model engine smoke (CUDA graphs + torch.compile, ~2 min)
    timeout 200 python3 scripts/vllm_smoke.py --case graphs --out $OUT/smoke_graphs.json 2>&1 | tee $OUT/smoke_log.txt | grep -E "SMOKE|Error|Traceback|KV cache size" | tail -20
    ;;
  *) echo "usage: $0 smoke | sweep RUN_ID MODES [EDGE] [PARAMS] [MODE_PARAMS] | smoke+sweep ... | prefix | preempt | smokeg"; exit 2 ;;
esac
