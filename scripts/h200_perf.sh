#!/usr/bin/env bash
# Step profiles and serving load on a GPU machine without network, from the repo root, with vLLM 0.20.2 importable by
# python3 (put on PYTHONPATH first where it is not installed: notes/kit.md). With vLLM and kvrepro installed, run
# scripts/step_profile.py and scripts/serve_bench.py directly instead. Sets up what scripts/h200_sweep.sh does
# (kvrepro's vllm.general_plugins entry
# point in /tmp/kvsite_ep, compile caches in /tmp/kvcache shared by every engine start while the machine stays warm,
# the repo on PYTHONPATH), then:
#   bash scripts/h200_perf.sh profile MODE USERS [extra step_profile args]   -> $OUT/profile_<mode>.json + traces + log
#   bash scripts/h200_perf.sh serve MODES [extra serve_bench args]           -> $OUT/serve.json (+ _logs, _vllm) + log
# The capacity sweep with the fp8 backends goes through scripts/h200_sweep.sh (see its usage).
# OUT defaults to /tmp/kvout. serve resumes from SERVE_FROM (a results/serve/*.json of an earlier call) if given.
# PROFILE_TIMEOUT_S / SERVE_TIMEOUT_S cap the command (default 0: no cap; a machine lent for 10-minute calls needs
# one below that, and serve then resumes with SERVE_FROM in the next call).
set -u
case "${1:-}" in profile|serve) ;; *) echo "usage: $0 profile MODE USERS [...] | serve MODES [...]"; exit 2 ;; esac
export PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/tmp/kvcache/vllm TRITON_CACHE_DIR=/tmp/kvcache/triton
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/kvout}; mkdir -p "$OUT" /tmp/kvcache
if grep -q 'vllm.general_plugins' pyproject.toml; then
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/kvsite_ep -e . >/dev/null 2>&1 \
    && export PYTHONPATH="/tmp/kvsite_ep:$PYTHONPATH"
fi
python3 -c "from importlib.metadata import entry_points as e; import sys; sys.exit(0 if [x for x in e(group='vllm.general_plugins') if x.value.startswith('kvrepro')] else 1)" \
  || { echo "kvrepro's vllm.general_plugins entry point is not installed (see scripts/h200_sweep.sh)"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,temperature.gpu --format=csv,noheader
case "$1" in
  profile)
    mode=$2 users=$3; shift 3; tag=${mode//:/_}
    timeout ${PROFILE_TIMEOUT_S:-0} python3 scripts/step_profile.py --mode "$mode" --users "$users" \
      --out "$OUT/profile_$tag.json" --trace-dir "$OUT/profile_${tag}_traces" "$@" > "$OUT/profile_$tag.log" 2>&1
    echo "step_profile rc=$?"
    grep -E "^\[profile\]|users: timed|wrote|[Ee]rror|Traceback" "$OUT/profile_$tag.log" | cut -c1-900 | tail -20
    ;;
  serve)
    modes=$2; shift 2
    [ -n "${SERVE_FROM:-}" ] && [ -f "$SERVE_FROM" ] && cp "$SERVE_FROM" "$OUT/serve.json" && echo "resuming $SERVE_FROM"
    timeout ${SERVE_TIMEOUT_S:-0} python3 scripts/serve_bench.py --modes "$modes" --out "$OUT/serve.json" "$@" \
      > "$OUT/serve_log.txt" 2>&1
    echo "serve_bench rc=$?"
    grep -E "^\[serve\]|^\||wrote|[Ee]rror|Traceback" "$OUT/serve_log.txt" | cut -c1-900 | tail -30
    ;;
esac
