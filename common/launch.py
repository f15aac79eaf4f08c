"""What the launcher started: checks that the process count is the one the script expects."""

import os

import torch

from common.errors import UserError


def launched_processes() -> int:
    """Processes started by torchrun / accelerate launch (WORLD_SIZE), 1 for a plain python run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def require_single_process(script: str) -> None:
    """A one-process script launched as several would train the same model N times over."""
    world_size = launched_processes()
    if world_size > 1:
        raise UserError(f"{script} trains in one process but was launched as {world_size} processes "
                        f"(WORLD_SIZE={world_size}): use scripts/train_ddp.py for several processes, or "
                        f"launch with --num_processes 1")


def check_gpus_per_node() -> None:
    """One process per GPU: a launch with more processes on a node than it has GPUs (8gpu.yaml on a
    4-GPU machine) would otherwise fail deep inside CUDA with "invalid device ordinal"."""
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if gpus and local_rank >= gpus:
        local_size = os.environ.get("LOCAL_WORLD_SIZE", "more")
        raise UserError(f"the launch starts {local_size} processes on this node but it has {gpus} GPUs: pass "
                        f"--num_processes {gpus} (per node) to accelerate launch, or use a config for {gpus} GPUs")


def check_world_size(accelerator) -> None:
    """Accelerate must see every process the launcher started.

    Without CUDA, ``Accelerator()`` under torchrun gives each process DistributedType.NO: N
    independent trainings on the full data, and no error. The scripts pass ``cpu=True``
    on a CPU-only machine to get gloo; this check catches any other way into that trap.
    """
    world_size = launched_processes()
    if accelerator.num_processes != world_size:
        raise UserError(f"the launcher started {world_size} processes (WORLD_SIZE) but Accelerate runs "
                        f"{accelerator.num_processes} ({accelerator.distributed_type}): each would train "
                        f"alone on all the data; launch with accelerate launch --multi_gpu (or a MULTI_GPU "
                        f"config) or torchrun, on a machine whose devices torch can see")


def check_batch_split(batch_size: int, parts: int, over: str) -> None:
    """The global batch is cut into ``parts`` equal slices (processes or GPUs); equal slices make
    the mean of the slices' losses the loss of the whole batch and give every BatchNorm as many
    images. ``over`` names the parts in the message, e.g. "2 processes"."""
    if batch_size % parts:
        below = batch_size - batch_size % parts
        nearest = f"{below} or {below + parts}" if below else f"{parts} or more"
        raise UserError(f"--batch-size {batch_size} does not divide by {over}: use {nearest}")
