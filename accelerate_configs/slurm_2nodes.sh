#!/bin/bash
# Two nodes of 4 GPUs under SLURM: one `accelerate launch` per node, each starting 4 DDP processes.
#   sbatch accelerate_configs/slurm_2nodes.sh --model resnet50 --batch-size 1024
# Arguments go to scripts/train_ddp.py. Run from the project root (the job starts there), with the
# project's virtual environment active or on PATH. SLURM gives each node its rank (SLURM_NODEID) and
# the first node of the allocation is the rendezvous host, so nothing in the config needs editing.
#SBATCH --job-name=train-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

GPUS_PER_NODE=4
MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}
export GPUS_PER_NODE MAIN_ADDR MAIN_PORT

# Single quotes: SLURM_NODEID must be read on each node, not here on the first one.
srun bash -c 'accelerate launch --config_file accelerate_configs/2nodes_4gpu.yaml \
    --num_machines "$SLURM_NNODES" --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" \
    scripts/train_ddp.py "$@"' bash "$@"
