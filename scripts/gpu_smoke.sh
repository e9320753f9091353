#!/usr/bin/env bash
# A short check on one GPU (< 5 minutes): vLLM generation for both tiny agents, weight sync after
# a training step, then a 2-step tiny_pair run on the GPU with the vLLM backend.
#   bash scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv
$PY -m pip install --quiet -e '.[gpu]'
$PY scripts/make_tiny_models.py --out .cache/tiny_models
MARS2_TINY_MODELS=$PWD/.cache/tiny_models $PY -m pytest -q -m gpu tests/test_gpu.py
$PY src/mars2/train.py experiment=tiny_pair debug=fast trainer=gpu logger=csv \
  paths.tiny_models_dir=$PWD/.cache/tiny_models \
  agents.tiny_qwen3.generation.backend=vllm agents.tiny_llama.generation.backend=vllm \
  '+agents.tiny_qwen3.generation.vllm={gpu_memory_utilization:0.2}' \
  '+agents.tiny_llama.generation.vllm={gpu_memory_utilization:0.2}'
echo "gpu smoke: ok"
