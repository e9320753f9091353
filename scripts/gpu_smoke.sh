#!/usr/bin/env bash
# A short check of the vLLM path on one GPU (< 5 minutes): the vLLM tests (log-probs, sync,
# LoRA r=4, warm-started and resumed tiny_pair), then through the command line a warm-started
# tiny_pair run with both agents on vLLM (weights synced after the warm start and every step),
# a resume from its step-1 checkpoint and an eval of the result with ckpt_path; each must show
# reward > 0.
#   bash scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d /tmp/mars2-gpu-smoke-XXXX)}
TINY=$PWD/.cache/tiny_models
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv
$PY -m pip install --quiet -e '.[gpu]'
$PY scripts/make_tiny_models.py --out "$TINY"
MARS2_REQUIRE_VLLM=1 MARS2_TINY_MODELS=$TINY $PY -m pytest -q tests/test_vllm.py

VLLM='{gpu_memory_utilization:0.15,enforce_eager:true,max_model_len:2048}'
COMMON=(experiment=tiny_pair trainer=gpu "paths.tiny_models_dir=$TINY"
  agents.tiny_qwen3.generation.backend=vllm agents.tiny_llama.generation.backend=vllm
  "+agents.tiny_qwen3.generation.vllm=$VLLM" "+agents.tiny_llama.generation.vllm=$VLLM")

# max reward over the steps logged in a run's CSV metrics; fails when it is not > 0
reward_above_zero() {
  $PY - "$1" <<'PY'
import csv, glob, sys
rows = [r for f in glob.glob(f"{sys.argv[1]}/csv/*/metrics.csv") for r in csv.DictReader(open(f))]
rewards = [float(r["reward"]) for r in rows if r.get("reward")]
print(f"{sys.argv[1]}: rewards per step {rewards}")
assert rewards and max(rewards) > 0, "no reward > 0"
PY
}

$PY src/mars2/train.py "${COMMON[@]}" logger=csv steps=2 callbacks.checkpoint.every_n_train_steps=1 \
  "hydra.run.dir=$OUT/first"
reward_above_zero "$OUT/first"
$PY src/mars2/train.py "${COMMON[@]}" logger=csv steps=3 "ckpt_path=$OUT/first/checkpoints/step_000001.ckpt" \
  "hydra.run.dir=$OUT/resumed"
reward_above_zero "$OUT/resumed"
$PY src/mars2/eval.py "${COMMON[@]}" data=arith "ckpt_path=$OUT/resumed/checkpoints/last.ckpt" \
  logger=none eval.limit=8 eval.samples=2 eval.tree_budget=4 "hydra.run.dir=$OUT/eval"
$PY - "$OUT/eval/results.json" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))
best = max(s["metrics"].get("pass@1", 0.0) for s in results)
print(f"eval pass@1 (best setting): {best}")
assert best > 0, "the evaluated checkpoint solved nothing"
PY
echo "gpu smoke: ok ($OUT)"
