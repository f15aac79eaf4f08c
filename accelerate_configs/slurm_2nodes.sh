#!/bin/bash
# Two nodes of 4 GPUs under SLURM: one `accelerate launch` per node, each starting 4 DDP processes.
#   sbatch accelerate_configs/slurm_2nodes.sh --model resnet50 --batch-size 1024
# Another GPU count: sbatch --gpus-per-node=8 ... (each node starts a process per GPU it is given);
# --gpus-per-node=0 starts one process a node, on its CPUs. Rehearse the job on one machine, on a
# two-node SLURM made there (accelerate_configs/slurm_cluster.py, docs/usage.md), with
#   sbatch --gpus-per-node=0 --cpus-per-task=1 accelerate_configs/slurm_2nodes.sh ARGS...
# Arguments go to scripts/train_ddp.py. Run from the project root (the job starts there), with the
# project's virtual environment active or on PATH. SLURM gives each node its rank (SLURM_NODEID) and
# the first node of the allocation is the rendezvous host, so nothing in the config needs editing.
#
# The job saves and comes back by itself. 300 s before its time limit SLURM sends SIGUSR1 to this
# shell, which passes it on to every training process; they finish the step, save a checkpoint and
# exit (code 75), and the shell puts the job back in the queue. The job starts again from the top
# with the same id, so in the same run folder, and continues from the newest checkpoint without
# --resume (SLURM_RESTART_COUNT > 0). scancel and preemption send SIGTERM to the training processes
# themselves, which save the same way if the cluster's KillWait or GraceTime leaves them the time;
# scancel ends the job, a partition with PreemptMode=REQUEUE requeues it. Set the run folder with
# OUTPUT_DIR=runs/NAME (sbatch --export=ALL,OUTPUT_DIR=...), not with --output-dir.
#SBATCH --job-name=train-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
# A requeued job keeps its id, so its output file: append to it instead of emptying it.
#SBATCH --open-mode=append
# The job may go back to the queue (scontrol requeue below, preemption, a node failure).
#SBATCH --requeue
# SIGUSR1 300 s before the time limit (SLURM may send it up to 60 s earlier), to this shell only
# (B:): the shell must know, to requeue the job. It must cover a step, the rest of an evaluation and
# a checkpoint: raise it and TORCH_ELASTIC_SHUTDOWN_TIMEOUT below together if those take longer.
#SBATCH --signal=B:USR1@300
set -euo pipefail

# The GPUs SLURM gave each node (--gpus-per-node above; a typed request, a100:4, is read after its
# colon), or GPUS_PER_NODE=N from the submitting shell (sbatch passes it on). 0: one process on
# the node's CPUs.
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-4}}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}
PROCESSES_PER_NODE=$((GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1))
# sed, not head: sed reads the whole list, head stops early and may leave scontrol a SIGPIPE,
# which pipefail turns into the job's failure.
MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MAIN_PORT=${MAIN_PORT:-29500}
# The same folder after a requeue (same job id): the requeued job finds its checkpoints there.
OUTPUT_DIR=${OUTPUT_DIR:-runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}
# torch's launcher passes on SIGTERM, SIGINT, SIGHUP and SIGQUIT only; SIGUSR1 would kill it, and
# the step would end under its workers' feet. PET_SIGNALS_TO_HANDLE is its --signals-to-handle
# (TORCHELASTIC_SIGNALS_TO_HANDLE does nothing: the launcher overwrites it with this list,
# torch/distributed/launcher/api.py).
PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
# After passing a signal on, the launcher waits this long for its workers, then SIGKILLs them
# (default 30 s). Less than the 300 s above: the workers end before the time limit.
TORCH_ELASTIC_SHUTDOWN_TIMEOUT=240
export PROCESSES_PER_NODE MAIN_ADDR MAIN_PORT OUTPUT_DIR
export PET_SIGNALS_TO_HANDLE TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# The interface the nodes reach each other on, if their names resolve to 127.0.1.1 or the first
# interface is not theirs (docs/usage.md, Accelerate configs): export NCCL_SOCKET_IFNAME=ib0 (or
# GLOO_SOCKET_IFNAME on CPUs) here, before srun, which passes the environment on.

# Single quotes: SLURM_NODEID must be read on each node, not here on the first one. exec: the
# launcher itself is srun's task. In the background (&): bash runs a trap only between commands,
# and `wait` is one that a signal cuts short.
srun bash -c 'exec accelerate launch --config_file accelerate_configs/2nodes_4gpu.yaml \
    --num_machines "$SLURM_NNODES" --num_processes $((SLURM_NNODES * PROCESSES_PER_NODE)) \
    --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" \
    scripts/train_ddp.py --output-dir "$OUTPUT_DIR" "$@"' bash "$@" &
srun_pid=$!

# srun passes SIGUSR1 on to every process of its step on each node, the launchers and their workers
# (a SIGTERM it would turn into SIGKILL: src/srun/signals.c in SLURM's sources).
time_is_up=""
stop_and_save() { time_is_up=yes; kill -USR1 "$srun_pid" 2>/dev/null || true; }
trap stop_and_save USR1

status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # the wait was cut short by the signal: wait for the end
    status=0
    wait "$srun_pid" || status=$?
done

# After passing a signal on, torch's launcher exits 1 (accelerate < 1.16) or 138 (128 + SIGUSR1,
# accelerate >= 1.16) whatever its workers' 75, and 138 is also a launcher killed by SIGUSR1
# (docs/usage.md). So the shell goes by the signal it passed on: stopped for the time limit and not
# finished (no final weights) means requeue. A failure without that signal, or scancel, ends the job
# with the step's exit code.
if [[ -n $time_is_up && $status -ne 0 && ! -e $OUTPUT_DIR/model.safetensors ]]; then
    echo "stopped before the time limit: requeued, to continue from the checkpoint in $OUTPUT_DIR"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
