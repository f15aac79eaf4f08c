"""Processes and GPUs: what the launcher started, how the batch is split, decisions all processes
take together, and the GPUs that nn.DataParallel drives from one process.

With one process per GPU (DDP) each process sees its own GPU and the data moves through NCCL;
DataParallel instead copies batches, weights and outputs directly between GPUs and keeps the model,
the gathered outputs and the loss on the first one.
"""

import os
import sys

import torch

from common.checkpoint import latest_checkpoint
from common.errors import UserError

GB = 1e9  # memory is reported in GB of 10^9 bytes (nvidia-smi shows MiB of 2^20 bytes)


# ----------------------------------------------------------------------------------------------
# Processes


def launched_processes() -> int:
    """Processes started by torchrun / accelerate launch (WORLD_SIZE), 1 for a plain python run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def require_single_process(script: str) -> None:
    """A one-process script (``script``: its ``__file__``) launched as several would train the same
    model N times over."""
    world_size = launched_processes()
    if world_size > 1:
        raise UserError(f"{os.path.basename(script)} trains in one process but was launched as {world_size} processes "
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


def choose_mixed_precision(requested: str | None) -> str:
    """The 16-bit format to train in: ``requested`` (--mixed-precision), else the Accelerate config's
    (accelerate launch exports it as ACCELERATE_MIXED_PRECISION), else bf16 where the hardware has it
    (CPUs; GPUs of compute capability 8.0 and newer) and fp16 on older GPUs, which only emulate bf16
    (torch.cuda.is_bf16_supported() says True on them). Call it before the Accelerator exists: it asks
    about this process's GPU (LOCAL_RANK) without creating a context on another one."""
    configured = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    precision = requested or configured
    if precision not in ("fp16", "bf16"):
        gpu = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        precision = "fp16" if torch.cuda.is_available() and torch.cuda.get_device_capability(gpu) < (8, 0) else "bf16"
        if configured != "no" and os.environ.get("RANK", "0") == "0":
            print(f"warning: the Accelerate config's mixed_precision {configured} is not one train_amp.py trains "
                  f"in; training in {precision} (--mixed-precision fp16 or bf16 to choose)", file=sys.stderr)
    if precision == "fp16" and not torch.cuda.is_available():
        given = "--mixed-precision fp16" if requested else "mixed_precision fp16 (from the Accelerate config)"
        raise UserError(f"{given} needs a GPU (on a CPU Accelerate would train in fp32 without a word): "
                        f"use --mixed-precision bf16")
    return precision


def check_batch_split(batch_size: int, parts: int, what: str) -> None:
    """The global batch is cut into ``parts`` equal slices, one per ``what`` (processes or GPUs);
    equal slices make the mean of the slices' losses the loss of the whole batch and give every
    BatchNorm as many images."""
    if batch_size % parts:
        below = batch_size - batch_size % parts
        nearest = f"{below} or {below + parts}" if below else f"{parts} or more"
        raise UserError(f"--batch-size {batch_size} does not divide by {parts} {what}: use {nearest}")


def stop_if_not_finite(accelerator, loss: torch.Tensor, step: int, output_dir) -> None:
    """Stop the run, in every process at once, when any process's loss is NaN or infinite.

    The sum over processes is non-finite if any part is, so all processes see the same answer and
    none is left waiting in the next all-reduce. The check runs before the optimizer step, so the
    weights and the last checkpoint stay good. Reading the flag waits for the device: one small
    synchronisation per step, the price of stopping at the exact step.
    """
    total = accelerator.reduce(loss.detach().float(), "sum")
    if not torch.isfinite(total):
        checkpoint = latest_checkpoint(output_dir)
        then = (f"the last good checkpoint is {checkpoint}: resume from it with a lower --lr" if checkpoint
                else "there is no checkpoint yet: start again with a lower --lr")
        # Every process says it before any exits, so the launcher cannot stop one before it speaks.
        print(f"error: the loss is {total.item()} at step {step}: training stopped before that step changed "
              f"the weights; {then}", file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        raise SystemExit(1)


# ----------------------------------------------------------------------------------------------
# GPUs and their memory

def data_parallel_devices(device: torch.device) -> list[torch.device]:
    """The GPUs DataParallel splits every batch over: all that this process sees, cuda:0 first.

    CUDA_VISIBLE_DEVICES=0,1 picks the physical GPUs; cuda:0 is the first one listed there. Empty
    when ``device``, where the model trains, is not a GPU.
    """
    if device.type != "cuda":
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def peer_copy(values: torch.Tensor, source: torch.device, target: torch.device) -> torch.Tensor:
    """``values`` (on the host) put on ``source``, copied straight to ``target`` the way
    DataParallel's scatter and gather copy, and read back to the host."""
    return values.to(source).to(target).cpu()


def broken_peer_copies(devices: list[torch.device]) -> list[tuple[torch.device, torch.device]]:
    """Copy a known pattern between every ordered pair of GPUs: the (source, target) pairs whose
    copy arrived different."""
    # 4 MiB of random words: zeros, stale or shifted data all show.
    expected = torch.randint(-2**31, 2**31 - 1, (1 << 20,), dtype=torch.int32,
                             generator=torch.Generator().manual_seed(0))
    return [(source, target) for source in devices for target in devices
            if source != target and not torch.equal(peer_copy(expected, source, target), expected)]


def check_peer_copies(devices: list[torch.device]) -> None:
    """Stop, with what to do, when a copy between two GPUs arrives wrong (broken_peer_copies).

    On some PCIe machines peer-to-peer copies are enabled but broken (an IOMMU or PCIe ACS
    redirects them); the copies then deliver wrong data without an error and DataParallel's loss
    turns NaN in the first epoch (the source articles, on two PCIe GPUs, even at lr 0.001).
    NCCL_P2P_DISABLE=1 only changes NCCL's transport, and DataParallel's scatter and gather are
    plain tensor copies, so only DDP with NCCL_P2P_DISABLE=1 avoids the broken path.
    """
    broken = broken_peer_copies(devices)
    if broken:
        source, target = broken[0]
        raise UserError(
            f"a GPU-to-GPU copy {source} -> {target} returned wrong data: peer-to-peer copies are broken "
            f"on this machine (IOMMU or PCIe ACS; see `nvidia-smi topo -m`) and DataParallel copies "
            f"directly between GPUs even with NCCL_P2P_DISABLE=1; train with NCCL_P2P_DISABLE=1 "
            f"accelerate launch ... scripts/train_ddp.py instead, or turn the IOMMU / ACS off")


def memory_report(devices: list[torch.device]) -> dict[str, list[float]]:
    """Allocated, reserved and peak allocated memory of each GPU in GB, one value per GPU, under
    the keys the log line prints; empty without GPUs. The peak starts again at each call, so called
    once an epoch it is the peak of that epoch.

    With DataParallel the first GPU holds more than the others: the model the replicas are copied
    from, its gradients and optimizer state, the gathered outputs and the loss, and in these scripts
    the whole dataset.
    """
    if not devices:
        return {}
    report = {"gpu_mem_alloc_gb": [round(torch.cuda.memory_allocated(d) / GB, 3) for d in devices],
              "gpu_mem_reserved_gb": [round(torch.cuda.memory_reserved(d) / GB, 3) for d in devices],
              "gpu_mem_peak_gb": [round(torch.cuda.max_memory_allocated(d) / GB, 3) for d in devices]}
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    return report


def peak_memory(accelerator) -> dict[str, list[float]]:
    """Peak memory allocated on each process's GPU since the last call, in GB, one value per
    process (gathered, so every process must call it); empty on a CPU."""
    if accelerator.device.type != "cuda":
        return {}
    peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device) / GB], device=accelerator.device)
    torch.cuda.reset_peak_memory_stats(accelerator.device)
    return {"gpu_mem_peak_gb": [round(value, 3) for value in accelerator.gather(peak).tolist()]}
