#!/usr/bin/env bash
# Train on several nodes under SLURM: one task per GPU, every task runs the same command.
#   sbatch --nodes=2 scripts/slurm_train.sh experiment=areal14b_pair_full trainer=fsdp
# Lightning reads the ranks from SLURM (SLURM_PROCID, SLURM_LOCALID, SLURM_NODELIST); every rank
# grows its own problems (problems_per_step is per rank) and owns one vLLM engine per agent on its
# own GPU. The estimate is checked on every rank before a model is loaded
# (python -m mars2.training.memory <same overrides> trainer.num_nodes=N prints it).
#SBATCH --job-name=mars2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=48:00:00
#SBATCH --output=logs/slurm/%x-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PYTHON=${PYTHON:-.venv/bin/python}
NODES=${SLURM_JOB_NUM_NODES:-1}
GPUS=${SLURM_NTASKS_PER_NODE:-8}
RUN_DIR=${RUN_DIR:-logs/train/runs/slurm/${SLURM_JOB_ID:-local}}
mkdir -p logs/slurm "$RUN_DIR"

# One run directory for all ranks (Hydra's default is a timestamp, which ranks would not share).
srun --kill-on-bad-exit=1 "$PYTHON" src/mars2/train.py \
  trainer.num_nodes="$NODES" trainer.devices="$GPUS" hydra.run.dir="$RUN_DIR" "$@"
