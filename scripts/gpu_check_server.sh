#!/usr/bin/env bash
# The server + NCCL step of the GPU check (issue #44), for a device machine that has vLLM (the
# image of scripts/gpu_check.sh has none: carry a vLLM wheel set, or skip). One result line:
#   PASS/FAIL/SKIP server: tests/test_vllm_server.py with the servers' weights pushed over NCCL
#   (vLLM's NCCLTrainerWeightTransferEngine through mars2's WeightSyncClient: the trainer code the
#   CPU tests run with the gloo backend), greedy answers equal to the trainer's after each sync.
# Never run here (no GPU): on CPU the same tests run with gloo in `make test-vllm`.
#   run(command="bash scripts/gpu_check_server.sh", timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d /tmp/mars2-gpu-check-server-XXXX)}
LOG=$OUT/server.log
if ! "$PY" -c "import vllm, torch; assert torch.cuda.is_available()" >"$LOG" 2>&1; then
  echo "SKIP server: no vLLM or no CUDA on this machine (see $LOG)" | tee -a "$OUT/gpu_check.log"
  exit 0
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD/src
export MARS2_VLLM_PYTHON=$PY MARS2_REQUIRE_VLLM=1 MARS2_WEIGHT_TRANSFER=nccl
export MARS2_TINY_MODELS=${MARS2_TINY_MODELS:-$PWD/.cache/tiny_models_vllm}
"$PY" scripts/make_tiny_models.py --out "$MARS2_TINY_MODELS" >>"$LOG" 2>&1
start=$(date +%s)
if timeout -k 10 "${LIMIT_SERVER:-400}" "$PY" -m pytest -p no:cacheprovider -q -x \
    tests/test_vllm_server.py >>"$LOG" 2>&1; then
  echo "PASS server: NCCL weight transfer to vLLM servers, $(( $(date +%s) - start )) s" \
    | tee -a "$OUT/gpu_check.log"
else
  echo "FAIL server: see $LOG ($(tail -n 3 "$LOG" | tr '\n' ' '))" | tee -a "$OUT/gpu_check.log"
  exit 1
fi
