"""Launch checks: the processes the launcher started, one per GPU, the batch cut in equal slices.

Each check stops a launch that would run, but wrongly (N lone trainings instead of DDP, a process
on a GPU that does not exist, unequal slices of the batch), with one line saying what to change.
"""

import os

import torch

from common.errors import UserError
from common.failures import refused_together


def launched_processes() -> int:
    """Processes started by torchrun / accelerate launch (WORLD_SIZE), 1 for a plain python run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def require_single_process(script: str) -> None:
    """A one-process script (``script``: its ``__file__``) launched as several would train the same
    model N times over."""
    world_size = launched_processes()
    if world_size > 1:
        raise UserError(f"{os.path.basename(script)} trains in one process but was launched as "
                        f"{world_size} processes (WORLD_SIZE={world_size}): use "
                        f"scripts/train_ddp.py for several processes, or launch with "
                        f"--num_processes 1")


def check_gpus_per_node() -> None:
    """One process per GPU: a launch with more processes on a node than it has GPUs (8gpu.yaml on a
    4-GPU machine) would otherwise fail deep inside CUDA with "invalid device ordinal"."""
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if gpus and local_rank >= gpus:
        local_size = os.environ.get("LOCAL_WORLD_SIZE", "more")
        raise UserError(f"the launch starts {local_size} processes on this node but it has {gpus} "
                        f"GPUs: pass --num_processes {gpus} (per node) to accelerate launch, or "
                        f"use a config for {gpus} GPUs")


def check_world_size(accelerator) -> None:
    """Accelerate must see every process the launcher started.

    Without CUDA, ``Accelerator()`` under torchrun gives each process DistributedType.NO: N
    independent trainings on the full data, and no error. The scripts pass ``cpu=True``
    on a CPU-only machine to get gloo; this check catches any other way into that trap.
    """
    world_size = launched_processes()
    if accelerator.num_processes != world_size:
        raise UserError(f"the launcher started {world_size} processes (WORLD_SIZE) but Accelerate "
                        f"runs {accelerator.num_processes} ({accelerator.distributed_type}): each "
                        f"would train alone on all the data; launch with accelerate launch "
                        f"--multi_gpu (or a MULTI_GPU config) or torchrun, on a machine whose "
                        f"devices torch can see")


def check_batch_split(batch_size: int, parts: int, what: str, grad_accum: int = 1) -> None:
    """The global batch is cut into ``parts`` equal slices, one per ``what`` (processes or GPUs),
    and each slice into ``grad_accum`` micro-batches; equal slices make the mean of the slices'
    losses the loss of the whole batch and give every BatchNorm as many images."""
    if grad_accum > 1:
        parts, what = (parts * grad_accum,
                       f"({parts} {what} x {grad_accum} micro-batches of --grad-accum)")
    if batch_size % parts:
        below = batch_size - batch_size % parts
        nearest = f"{below} or {below + parts}" if below else f"{parts} or more"
        raise UserError(f"--batch-size {batch_size} does not divide by {parts} {what}: "
                        f"use {nearest}")


def check_launch(accelerator, batch_size: int, grad_accum: int) -> None:
    """A DDP launch: Accelerate sees every process the launcher started (check_world_size), and
    the global batch cuts into equal slices, one per process and micro-batch (check_batch_split)."""
    check_world_size(accelerator)
    refused_together(accelerator, check_batch_split, batch_size, accelerator.num_processes,
                     "processes", grad_accum)  # one line, not one per process
