"""The GPUs that torch.nn.DataParallel drives from one process: which, whether copies between them
arrive intact, how much memory each holds.

Only scripts/train_dp.py needs this. With one process per GPU (DDP) each process sees its own GPU
and the data moves through NCCL; DataParallel instead copies batches, weights and outputs directly
between GPUs and keeps the model, the gathered outputs and the loss on the first one.
"""

import torch

from common.errors import UserError

GB = 1e9  # memory is reported in GB of 10^9 bytes (nvidia-smi shows MiB of 2^20 bytes)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a clock read next measures it; a no-op on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    the keys the log line prints; empty without GPUs.

    With DataParallel the first GPU holds more than the others: the model the replicas are copied
    from, its gradients and optimizer state, the gathered outputs and the loss, and in these scripts
    the whole dataset.
    """
    if not devices:
        return {}
    return {"gpu_mem_alloc_gb": [round(torch.cuda.memory_allocated(d) / GB, 3) for d in devices],
            "gpu_mem_reserved_gb": [round(torch.cuda.memory_reserved(d) / GB, 3) for d in devices],
            "gpu_mem_peak_gb": [round(torch.cuda.max_memory_allocated(d) / GB, 3) for d in devices]}


def reset_peak_memory(devices: list[torch.device]) -> None:
    """Start a new peak, so that gpu_mem_peak_gb is the peak of one epoch."""
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)


def process_peak_memory(accelerator) -> dict[str, list[float]]:
    """Peak memory allocated on each process's GPU since the last call, in GB, one value per
    process (gathered, so every process must call it); empty on a CPU."""
    if accelerator.device.type != "cuda":
        return {}
    peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device) / GB], device=accelerator.device)
    torch.cuda.reset_peak_memory_stats(accelerator.device)
    return {"gpu_mem_peak_gb": [round(value, 3) for value in accelerator.gather(peak).tolist()]}
