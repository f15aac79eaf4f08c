"""Launch checks: the processes the launcher started, one per GPU, the batch cut in equal slices.

Each check stops a launch that would run, but wrongly (N lone trainings instead of DDP, a process
on a GPU that does not exist, unequal slices of the batch), with one line saying what to change.
The one exception is asked for: --share-gpus puts several processes on each GPU, to rehearse a
launch for more GPUs than this machine has (its code paths, checkpoints and resume, not its speed).
"""

import ipaddress
import math
import os
import socket
import time
from contextlib import suppress

import torch
from accelerate.state import PartialState

from common.errors import UserError
from common.failures import ignore_the_launchers_stop, refused_together, watch_failures

# NCCL shares a GPU among processes from 2.30 on, when asked (NCCL_MULTI_RANK_GPU_ENABLE=1; NCCL's
# src/init.cc: "Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1
# ..."); older NCCL refuses ("Duplicate GPU detected", NVIDIA/nccl#103).
NCCL_SHARES_GPUS = (2, 30, 0)
# Seconds a node's other processes wait before they exit with its refusal, so that its first
# process, which says why, is not stopped by the launcher before it has (nothing syncs them yet)
REFUSAL_LINE_S = 5
SHARE_GPUS = ("auto", "nccl", "gloo")  # --share-gpus: auto is NCCL where it can share, else gloo


def require_single_process(script: str) -> None:
    """A one-process script (``script``: its ``__file__``) launched as several would train the same
    model N times over."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, accelerate launch's
    if world_size > 1:
        raise UserError(f"{os.path.basename(script)} trains in one process but was launched as "
                        f"{world_size} processes (WORLD_SIZE={world_size}): use "
                        f"scripts/train_ddp.py for several processes, or launch with "
                        f"--num_processes 1")


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL this torch loads (it may not be the one it was built with); None without NCCL."""
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):  # a torch built without NCCL (CPU, ROCm, macOS)
        return None


def plan_gpu_sharing(share: str | None, processes: int, gpus: int,
                     nccl: tuple[int, ...] | None, refuse_gloo=None) -> tuple[int, str | None]:
    """How ``processes`` sit on a node of ``gpus`` GPUs: the processes on the busiest GPU (0: no
    GPU, 1: a GPU each) and the process group's backend to ask Accelerate for (None: its default,
    NCCL on GPUs, gloo on CPUs). One per GPU, or with --share-gpus ``share`` (auto, nccl, gloo)
    several per GPU over NCCL (version ``nccl``) where it can share, else gloo. Without --share-gpus
    more processes than GPUs is refused: it is a launch meant for another machine (8gpu.yaml on 4
    GPUs), where NCCL would fail at its first collective ("Duplicate GPU detected") or, from 2.30,
    share the GPUs without a word. ``refuse_gloo(nccl, gpus)``, given by a script whose processes
    share a GPU over NCCL only (FSDP2's, common.parallel.fsdp), refuses gloo."""
    if not gpus:  # the CPU: gloo, as without the flag (named when asked, as on GPUs)
        if share == "nccl":
            raise UserError("--share-gpus nccl: no GPU here, and NCCL reduces GPU tensors only: "
                            "use --share-gpus gloo, or drop the flag")
        return 0, "gloo" if share and processes > 1 else None  # 1 process: no group at all
    if (per_gpu := math.ceil(processes / gpus)) == 1:
        return 1, None
    if share is None:
        raise UserError(f"the launch starts {processes} processes on this node but it has {gpus} "
                        f"GPUs: pass --num_processes {gpus} (per node) to accelerate launch, or "
                        f"use a config for {gpus} GPUs (to rehearse this launch here, several "
                        f"processes a GPU: add --share-gpus)")
    nccl_chosen = share in ("auto", "nccl") and nccl_shares_gpus(nccl)
    if refuse_gloo and not nccl_chosen:
        refuse_gloo(nccl, gpus)
    if share == "nccl" and not nccl_chosen:
        raise UserError(f"--share-gpus nccl: this torch's NCCL ({nccl_name(nccl)}) refuses several "
                        f"processes on one GPU; 2.30 and newer share it: use --share-gpus gloo")
    return per_gpu, "nccl" if nccl_chosen else "gloo"


def nccl_shares_gpus(nccl: tuple[int, ...] | None) -> bool:
    """Whether NCCL ``nccl`` (None: none) can put several processes on one GPU."""
    return nccl is not None and nccl >= NCCL_SHARES_GPUS


def nccl_name(nccl: tuple[int, ...] | None) -> str:
    """NCCL's version as people write it, 2.30.7; "none" without NCCL."""
    return ".".join(map(str, nccl)) if nccl else "none"


def set_gpu_sharing(share: str | None, refuse_gloo=None) -> str | None:
    """One process per GPU, or with --share-gpus ``share`` several, set up in this process: the
    backend for Accelerate (None: its default), gloo refused by ``refuse_gloo``. A launch with
    more processes than GPUs and no --share-gpus is refused, in one line from each node's first
    process (the others exit quietly). Shared GPUs change three things here. Accelerate hands DDP
    device_ids=[local rank] (accelerator.py, prepare_model), a GPU this node lacks once processes
    outnumber GPUs: with ACCELERATE_BYPASS_DEVICE_MAP=true it passes none, and DDP uses the device
    the model is on (its own GPU, local rank % GPUs). Accelerate's barrier is put on this process's
    GPU (_wait_on_own_gpu). NCCL shares a GPU if NCCL_MULTI_RANK_GPU_ENABLE=1 (unless set).
    NCCL's errors reach the main thread (TORCH_NCCL_ASYNC_ERROR_HANDLING, below). A restartable
    launch that can hang at its restart is refused here as well (_check_restarts)."""
    # torchrun gives its workers 1 (TearDown) unless set: NCCL's watchdog then aborts the process
    # on a collective's error or timeout (SIGABRT, a C++ dump, the trackers left open), racing the
    # failure watch's grace (common.failures). 2 (CleanUpOnly) aborts the communicators only: the
    # error is raised in the main thread, whose excepthook (the watch's) says it once and exits 1.
    if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1") == "1":
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # read as NCCL's process group is made
    try:
        _check_restarts()
        per_gpu, backend = plan_gpu_sharing(share, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                            torch.cuda.device_count(), nccl_version(), refuse_gloo)
        if (backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "gloo":
            _check_hostname()
    except UserError:
        ignore_the_launchers_stop()  # every process meets the refusal: each exits 1 by itself
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            raise
        time.sleep(REFUSAL_LINE_S)  # the first process's line first: the launcher stops it then
        raise SystemExit(1) from None  # the same refusal, said once a node
    if per_gpu > 1:
        os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"  # read by prepare(): no device_ids
        PartialState.wait_for_everyone = _wait_on_own_gpu  # every barrier of Accelerate's
        if backend == "nccl":  # read when NCCL makes its communicator
            os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    return backend


def _check_restarts() -> None:
    """A restartable launch whose processes share the launcher's store (a static rendezvous, or a
    c10d one without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) can hang in Accelerator() at a restart:
    refused before the process group is made, so that the refusal's own restart cannot hang."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 \
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UserError("a restartable launch whose processes share the launcher's store can hang "
                        "in its restart: launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and a "
                        "c10d rendezvous (--rdzv_backend c10d), as make ddp does")


def _check_hostname() -> None:
    """Several nodes over gloo: gloo gives the others what this node's name resolves to (unless
    GLOO_SOCKET_IFNAME names an interface), and 127.0.1.1 (Debian's /etc/hosts) they cannot reach.
    Not where node 0 is on loopback too (nodes rehearsed on one machine)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) \
            or os.environ.get("GLOO_SOCKET_IFNAME") or _loopback(os.environ.get("MASTER_ADDR", "")):
        return
    if address := _loopback(socket.gethostname()):
        raise UserError(f"this node's name, {socket.gethostname()}, resolves to {address}, a "
                        f"loopback address (/etc/hosts), which gloo would give the other nodes: "
                        f"set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on, "
                        f"on every node (ip -brief addr lists them)")


def _loopback(name: str) -> str | None:
    """The address ``name`` resolves to, if it is a loopback one."""
    with suppress(OSError):
        return (address := socket.gethostbyname(name)) * ipaddress.ip_address(address).is_loopback
    return None


def _wait_on_own_gpu(self) -> None:
    """PartialState.wait_for_everyone (every barrier of Accelerate's: checkpoints, FSDP's loads,
    ours) with its tensor on this process's GPU: Accelerate names cuda:<local rank> (state.py,
    wait_for_everyone: barrier(device_ids=[local_process_index])), where torch then allocates it
    (ProcessGroup::barrier), a GPU this node lacks once processes outnumber GPUs."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()])


def launch_record(accelerator) -> dict:
    """For config.json and the start line: the processes, their device, the process group's
    backend, how many processes share each GPU and, when several do, the warning that says what
    the run proves and what not."""
    gpus = torch.cuda.device_count() if accelerator.device.type == "cuda" else 0
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if accelerator.num_processes > 1 else 1
    per_gpu = math.ceil(processes / gpus) if gpus else None
    backend = accelerator.state.backend if accelerator.num_processes > 1 else None
    record = {"world_size": accelerator.num_processes, "device": str(accelerator.device),
              "backend": backend, "processes_per_gpu": per_gpu, "gpu_sharing": None}
    if per_gpu and per_gpu > 1:
        nccl = nccl_version()
        # Accelerate may name it "cuda:nccl,cpu:gloo" (FSDP with full state dicts): NCCL on the GPUs
        over = (f"NCCL {nccl_name(nccl)} (NCCL_MULTI_RANK_GPU_ENABLE=1)" if "nccl" in backend else
                f"{backend}, its collectives copied through host memory"
                + ("" if nccl_shares_gpus(nccl) else
                   f" (NCCL {nccl_name(nccl)} cannot share a GPU: 2.30 can)"))
        record["gpu_sharing"] = (
            f"warning: --share-gpus: {processes} processes on {gpus} GPU(s) of this node, up to "
            f"{per_gpu} a GPU, over {over}: a rehearsal that proves the launch, its collectives, "
            f"checkpoints and resume; its speed and memory figures say nothing of {processes} GPUs")
    return record


def check_world_size(accelerator) -> None:
    """Accelerate must see every process the launcher started.

    Without CUDA, ``Accelerator()`` under torchrun gives each process DistributedType.NO: N
    independent trainings on the full data, and no error. The scripts pass ``cpu=True``
    on a CPU-only machine to get gloo; this check catches any other way into that trap.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # 1: a plain python run
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


def check_sync_bn(sync_bn: bool, device: torch.device) -> None:
    """--sync-bn where SyncBatchNorm runs: torch has no CPU implementation of it."""
    if sync_bn and device.type == "cpu":
        raise UserError("--sync-bn needs GPUs (SyncBatchNorm has no CPU implementation): drop it")


def check_launch(accelerator, batch_size: int, grad_accum: int, sync_bn: bool = False) -> None:
    """A DDP launch watched from its first collective on (a fault anywhere in start-up, training or
    teardown is one line on every process: common.failures.watch_failures) and checked
    (check_world_size, check_batch_split, check_sync_bn), each refusal said once. A collective:
    every process must call it, right after Accelerator()."""
    watch_failures(accelerator)
    check_world_size(accelerator)
    refused_together(accelerator, check_batch_split, batch_size, accelerator.num_processes,
                     "processes", grad_accum)  # one line, not one per process
    refused_together(accelerator, check_sync_bn, sync_bn, accelerator.device)
