# run 68 (2026-12-01 06:43 UTC), after three staging calls (bash .device/vllm-pN/kvdev.sh stage, N = 1..3, carry .device/vllm-pN):
bash .device/vllm-p4/kvdev.sh stage >/dev/null && source .device/vllm-p4/kvdev.sh env && T0=$(date +%s) bash .device/cudavar/run68.sh
# run68.sh: benchmarks/side_by_side_vllm.py --ctxs 131072, then `bash scripts/h200_sweep.sh smoke`
# capacity -w12 in the next call of the same lease (06:45-06:50 UTC):
# T0=$(date +%s); source .device/vllm-p4/kvdev.sh env; OUT=$OUT CALL_T0=$T0 CALL_LIMIT_S=540 MIN_START='{"kvrepro:k4v2":300}' PREFILL_AUTO=1 bash scripts/h200_sweep.sh smoke+sweep h200-20261201-w12 kvrepro:k4v2 kvrepro:k4v2
