"""nn.DataParallel's GPUs: which ones, whether copies between them arrive intact, their memory.

Only train_dp.py needs this module. DataParallel drives every GPU from one process: it copies
batches and outputs directly between GPUs, broadcasts the weights and sums the gradients through
NCCL (torch.cuda.comm), and keeps the model, the gathered outputs and the loss on the first one.
With one process per GPU (DDP) none of this applies: each process sees its own GPU and the data
moves through NCCL's collectives.
"""

import multiprocessing
import os

import torch

from common.errors import UserError, first_line
from common.parallel.launch import check_batch_split
from common.units import GB


def check_compile_flag(backend: str) -> None:
    """--compile BACKEND refused: DataParallel copies its replicas anew at every step, which no
    compiled graph survives (--compile auto and none train them eagerly)."""
    if backend not in ("auto", "none"):
        raise UserError(f"--compile {backend}: not offered with DataParallel (DataParallel's "
                        f"replicas are copied anew at every step): use train_ddp.py --compile")


def data_parallel_devices(device: torch.device) -> list[torch.device]:
    """The GPUs DataParallel splits every batch over: all that this process sees, cuda:0 first.

    CUDA_VISIBLE_DEVICES=0,1 picks the physical GPUs; cuda:0 is the first one listed there. Empty
    when ``device``, where the model trains, is not a GPU.
    """
    if device.type != "cuda":
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def checked_gpus(device: torch.device, batch_size: int, grad_accum: int) -> list[torch.device]:
    """data_parallel_devices, with what DataParallel needs of them checked: the global batch cuts
    into equal slices, one per GPU and micro-batch, and copies between every two GPUs arrive
    intact (check_peer_copies). Empty on a CPU."""
    devices = data_parallel_devices(device)
    if len(devices) > 1:
        check_batch_split(batch_size, len(devices), "visible GPUs", grad_accum)
        check_peer_copies(devices)
    return devices


# seconds one step of the check may take, CUDA's start on a GPU it is first to use included
PEER_CHECK_TIMEOUT = 60
# Seconds for the checking process to start: importing torch from a cold network disk can take
# minutes, and that is no hang between GPUs.
PEER_CHECK_START_LIMIT = 600
PEER_ADVICE = ("DataParallel's scatter and gather copy directly between GPUs even with "
               "NCCL_P2P_DISABLE=1, so train with NCCL_P2P_DISABLE=1 accelerate launch ... "
               "scripts/train_ddp.py instead, or turn off the IOMMU or PCIe ACS that breaks "
               "peer-to-peer (see `nvidia-smi topo -m`)")


def peer_copy(values: torch.Tensor, source: torch.device, target: torch.device) -> torch.Tensor:
    """``values`` (on the host) put on ``source``, copied straight to ``target`` the way
    DataParallel's scatter and gather copy, and read back to the host."""
    return values.to(source).to(target).cpu()


def known_words() -> torch.Tensor:
    """4 MiB of random words, the same in every process: zeros, stale or shifted data all show."""
    return torch.randint(-2**31, 2**31 - 1, (1 << 20,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(0))


def broken_peer_copies(devices: list[torch.device],
                       started=lambda step: None) -> list[tuple[torch.device, torch.device]]:
    """Copy a known pattern between every ordered pair of GPUs, as DataParallel's scatter (the
    batch) and gather (the outputs) copy: the (source, target) pairs whose copy arrived different.
    ``started`` is told each copy before it runs, so that one that hangs can be named."""
    expected, broken = known_words(), []
    for source in devices:
        for target in devices:
            if source != target:
                started(f"the copy {source} -> {target}")
                if not torch.equal(peer_copy(expected, source, target), expected):
                    broken.append((source, target))
    return broken


def broken_nccl_transfers(devices: list[torch.device], started=lambda step: None) -> list[str]:
    """DataParallel's other two transfers, made with the calls it makes: the weights broadcast from
    the first GPU (replicate: comm.broadcast_coalesced) and the gradients summed onto it (backward:
    comm.reduce_add_coalesced). Both go through NCCL where torch has it (torch/nn/parallel/comm.py),
    so NCCL_P2P_DISABLE=1 changes their path. The ones that arrived wrong, named as ``started`` is
    told."""
    comm, first, n = torch.nn.parallel.comm, devices[0], len(devices)
    others = ", ".join(map(str, devices[1:]))
    expected, broken = known_words(), []
    broadcast = f"NCCL's broadcast {first} -> {others}"
    started(broadcast)
    arrived = comm.broadcast_coalesced([expected.to(first)], devices)  # one list of tensors per GPU
    broken += [f"{broadcast} (wrong on {device})" for device, (copy,) in zip(devices, arrived)
               if not torch.equal(copy.cpu(), expected)]
    # GPU i adds (i + 1) x a pattern of words below 1024: a share that arrives zero, stale or twice
    # shows, and the sum stays exact in int32 up to 64 GPUs.
    pattern = expected % 1024
    shares = [[(pattern * (i + 1)).to(device)] for i, device in enumerate(devices)]
    reduce = f"NCCL's reduce_add {others} -> {first}"
    started(reduce)
    (total,) = comm.reduce_add_coalesced(shares, first)
    if not torch.equal(total.cpu(), pattern * (n * (n + 1) // 2)):
        broken.append(reduce)
    return broken


def data_parallel_transfers(devices: list[torch.device], started) -> tuple[list, list[str]]:
    """All that DataParallel moves between GPUs, checked: (broken_peer_copies,
    broken_nccl_transfers)."""
    return broken_peer_copies(devices, started), broken_nccl_transfers(devices, started)


class PeerCheckFailed(Exception):
    """The process that checks transfers between GPUs hung or died; the text says how, in one line,
    and ``step`` is the step it was in (None before the first)."""

    def __init__(self, message: str, step: str | None = None):
        super().__init__(message)
        self.step = step


def report_transfers(check, devices: list[torch.device], channel) -> None:
    """In the child process: that it started, each step of ``check`` as it starts, then the result
    or the error, sent to the parent."""
    channel.send(("ready", None))
    try:
        result = check(devices, lambda step: channel.send(("step", step)))
    except Exception as error:  # the parent reports it, in one line
        channel.send(("failed", first_line(error)))
    else:
        channel.send(("done", result))


def run_transfer_check(devices: list[torch.device], timeout: float = PEER_CHECK_TIMEOUT,
                       check=data_parallel_transfers):
    """``check(devices, started)`` run in a child process: its result, or PeerCheckFailed when one
    step takes longer than ``timeout`` seconds or the child dies.

    Broken peer-to-peer can hang a transfer instead of corrupting it, and a CUDA call that hangs
    cannot be interrupted; a process can be killed. The child is spawned: a forked one cannot use
    CUDA once the parent has asked about the GPUs.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=report_transfers, args=(check, devices, sender), daemon=True)
    child.start()
    sender.close()  # the child holds the only sending end now: when it dies, the pipe ends
    ready, step, finished = False, None, False
    try:
        while receiver.poll(timeout if ready else PEER_CHECK_START_LIMIT):
            try:
                kind, value = receiver.recv()
            except EOFError:
                child.join(5)
                where = f"during {step}" if step else "before its first step"
                raise PeerCheckFailed(f"the process checking transfers between GPUs died "
                                      f"(exit code {child.exitcode}) {where}", step) from None
            finished = kind in ("done", "failed")
            if kind == "done":
                return value
            if kind == "failed":
                raise PeerCheckFailed(f"{step or 'the check'} failed: {value}", step)
            ready, step = True, value or step
        if not ready:
            raise PeerCheckFailed(f"the process checking transfers between GPUs did not start in "
                                  f"{PEER_CHECK_START_LIMIT} s")
        raise PeerCheckFailed(f"{step or 'the check, before its first step,'} got no answer in "
                              f"{timeout:g} s: it hangs, as broken peer-to-peer can", step)
    finally:
        receiver.close()
        child.join(5 if finished else 0)  # a finished child exits by itself; a hung one is killed
        if child.is_alive():
            child.kill()
            child.join(5)


def check_peer_copies(devices: list[torch.device], *, timeout: float = PEER_CHECK_TIMEOUT,
                      check=data_parallel_transfers) -> None:
    """Stop, with what to do, when a transfer between two GPUs arrives wrong, hangs or fails
    (run_transfer_check of ``check``, by default all that DataParallel moves between GPUs).

    On some PCIe machines peer-to-peer copies are enabled but broken (an IOMMU or PCIe ACS
    redirects them); the copies then deliver wrong data without an error, or hang, and
    DataParallel's loss turns NaN in the first epoch (the source articles, on two PCIe GPUs, even at
    lr 0.001). NCCL_P2P_DISABLE=1 moves what goes through NCCL off peer-to-peer: DDP's all-reduce,
    and DataParallel's weight broadcast and gradient sum. DataParallel's scatter of the batch and
    gather of the outputs are plain copies between GPUs that it does not change, so only DDP with
    NCCL_P2P_DISABLE=1 avoids the broken path.
    """
    try:
        copies, nccl = run_transfer_check(devices, timeout, check)
    except PeerCheckFailed as failure:
        raise UserError(f"{failure}; {PEER_ADVICE}") from None
    if copies:
        source, target = copies[0]
        raise UserError(f"the GPU-to-GPU copy {source} -> {target} returned wrong data: "
                        f"peer-to-peer copies are broken on this machine; {PEER_ADVICE}")
    if nccl and os.environ.get("NCCL_P2P_DISABLE") == "1":
        raise UserError(f"{nccl[0]} returned wrong data even with NCCL_P2P_DISABLE=1: NCCL is "
                        f"broken on this machine beyond peer-to-peer; run python "
                        f"scripts/check_gpus.py with NCCL_DEBUG=INFO")
    if nccl:
        raise UserError(f"{nccl[0]} returned wrong data, though direct copies arrived intact: "
                        f"NCCL's peer-to-peer path is broken; run with NCCL_P2P_DISABLE=1, which "
                        f"moves DataParallel's broadcast and reduce_add off it, or use "
                        f"NCCL_P2P_DISABLE=1 accelerate launch ... scripts/train_ddp.py")


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
              "gpu_mem_reserved_gb": [round(torch.cuda.memory_reserved(d) / GB, 3)
                                      for d in devices],
              "gpu_mem_peak_gb": [round(torch.cuda.max_memory_allocated(d) / GB, 3)
                                  for d in devices]}
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    return report
