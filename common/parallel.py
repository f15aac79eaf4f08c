"""Processes and GPUs: what the launcher started, how the batch is split, decisions all processes
take together, and the GPUs that nn.DataParallel drives from one process.

With one process per GPU (DDP) each process sees its own GPU and the data moves through NCCL;
DataParallel instead copies batches and outputs directly between GPUs, broadcasts the weights and
sums the gradients through NCCL (torch.cuda.comm), and keeps the model, the gathered outputs and the
loss on the first one.
"""

import ctypes
import math
import multiprocessing
import os
import signal
import sys

import torch

from common.checkpoint import latest_checkpoint, latest_good_checkpoint
from common.errors import UserError, first_line

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
        precision = "fp16" if torch.cuda.is_available() and _own_gpu_capability() < (8, 0) else "bf16"
        if configured != "no" and os.environ.get("RANK", "0") == "0":
            print(f"warning: the Accelerate config's mixed_precision {configured} is not one train_amp.py trains "
                  f"in; training in {precision} (--mixed-precision fp16 or bf16 to choose)", file=sys.stderr)
    if precision == "fp16" and not torch.cuda.is_available():
        given = "--mixed-precision fp16" if requested else "mixed_precision fp16 (from the Accelerate config)"
        raise UserError(f"{given} needs a GPU (on a CPU Accelerate would train in fp32 without a word): "
                        f"use --mixed-precision bf16")
    return precision


def _own_gpu_capability() -> tuple[int, int]:
    """Compute capability of this process's GPU (LOCAL_RANK), made its current device first, as
    Accelerate will: asking before would create a CUDA context on GPU 0 in every process."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.cuda.get_device_capability()


def set_numerics(device: torch.device, tf32: bool, deterministic: bool) -> str:
    """Set how fp32 math runs in this process, for every script; returns what fp32 matmuls and
    convolutions run in on ``device``, "tf32" or "ieee", for the start line and config.json.

    - TF32 (--tf32, on by default) keeps fp32's range with a 10-bit mantissa, on the tensor cores of
      GPUs of compute capability 8.0 and newer: several times the speed of strict fp32 matmuls, and
      ImageNet-style training reaches the same accuracy (NVIDIA's Ampere results). torch's defaults
      mix the two (TF32 for cuDNN convolutions, strict fp32 for matmuls); here both follow the flag.
      CPUs and older GPUs have no TF32: "ieee" there, whatever the flag.
    - cudnn.benchmark times cuDNN's convolution algorithms once per input shape and keeps the
      fastest; the shapes here are fixed, so it pays from the first epoch.
    - --deterministic: deterministic algorithms only (an op that has none raises), no algorithm
      search, and cuBLAS with a fixed workspace, so a run and its resume repeat bit for bit on a GPU
      too, at some cost in speed. Call this before the first matmul: cuBLAS reads
      CUBLAS_WORKSPACE_CONFIG when it starts.
    """
    if deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # the two values deterministic cuBLAS accepts
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    has_tf32 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
    return "tf32" if tf32 and has_tf32 else "ieee"


def check_batch_split(batch_size: int, parts: int, what: str, grad_accum: int = 1) -> None:
    """The global batch is cut into ``parts`` equal slices, one per ``what`` (processes or GPUs), and
    each slice into ``grad_accum`` micro-batches; equal slices make the mean of the slices' losses the
    loss of the whole batch and give every BatchNorm as many images."""
    if grad_accum > 1:
        parts, what = parts * grad_accum, f"({parts} {what} x {grad_accum} micro-batches of --grad-accum)"
    if batch_size % parts:
        below = batch_size - batch_size % parts
        nearest = f"{below} or {below + parts}" if below else f"{parts} or more"
        raise UserError(f"--batch-size {batch_size} does not divide by {parts} {what}: use {nearest}")


# The signals that ask a run to stop and save: SLURM (scancel, preemption, --signal), Kubernetes and
# torchrun/accelerate launch, which pass on the SIGTERM they get, send SIGTERM; SLURM jobs often ask
# for SIGUSR1 ahead of their time limit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: stopped to be continued, not failed
_PR_SET_PDEATHSIG = 1


class StepGuard:
    """What every process must decide together after each optimizer step, without making the host wait
    for the device every step: a NaN or infinite loss stops the run, a stop signal saves it and stops.

    ``check`` sums, over processes, the step's loss (non-finite if any part is) and the number of
    processes that got a stop signal (SIGTERM or SIGUSR1, which set a flag and nothing else), so every
    process gets the same answer at the same step and none is left waiting in the next all-reduce. On
    a GPU it reads the two numbers one step later, when the device has long computed them, so the host
    keeps queueing work ahead of the device; on a CPU they are there at once. A bad step has then
    changed the weights in memory, but nothing of it is kept: ``flush`` reads the pending numbers
    before every checkpoint and at the end of each epoch, so no checkpoint, model.safetensors or
    metrics line ever holds it. After a stop signal the caller saves a checkpoint and calls ``stop``:
    one line, and the exit code STOPPED_EXIT_CODE from every process. The process also asks the kernel
    for a SIGTERM when its launcher dies: `accelerate launch` of one process passes no signal on.
    """

    def __init__(self, accelerator, output_dir, listen: bool = True):
        self.accelerator, self.output_dir = accelerator, output_dir
        self.pending = None  # (step, sums on their way to the host, event that marks their arrival)
        self.received = None  # the first stop signal this process got, by name
        self.stopping = False  # the processes agreed to stop
        if listen:  # in the main thread of a training process (tests of the rest pass listen=False)
            for stop_signal in STOP_SIGNALS:
                signal.signal(stop_signal, self._on_signal)
            _signal_when_parent_dies(signal.SIGTERM)

    def _on_signal(self, signum, frame) -> None:  # only a flag: the step in progress finishes
        self.received = self.received or signal.Signals(signum).name

    def check(self, loss: torch.Tensor, step: int) -> bool:
        """After optimizer step ``step`` with its ``loss``: True when the processes agree to stop now
        (a stop signal reached one of them); exits, in every process, on a non-finite loss."""
        loss = loss.detach().float()
        signalled = torch.full_like(loss, float(self.received is not None))  # a fill on the device, no copy
        total = self.accelerator.reduce(torch.stack([loss, signalled]), "sum")
        if total.is_cuda:  # a copy into pinned host memory, queued behind the step's work
            stream, arrived = torch.cuda.current_stream(total.device), torch.cuda.Event()
            total = total.to("cpu", non_blocking=True)
            arrived.record(stream)
            previous, self.pending = self.pending, (step, total, arrived)
        else:  # the CPU has computed it already
            previous = (step, total, None)
        if previous and self._read(*previous):
            self.flush()  # on a GPU, the step after the signal too, before anything is saved
            self.stopping = True
        return self.stopping

    def agree(self) -> bool:
        """True when a stop signal reached any process, asked of all of them at once (it waits for the
        device): at the end of an epoch, for a signal that came during evaluation or the checkpoint."""
        self.flush()
        signalled = torch.tensor(float(self.received is not None), device=self.accelerator.device)
        self.stopping = self.stopping or bool(self.accelerator.reduce(signalled, "sum") > 0)
        return self.stopping

    def flush(self) -> None:
        """Wait for the newest step's loss and stop if it is not finite: before anything is saved."""
        if self.pending:
            pending, self.pending = self.pending, None
            self.stopping = self._read(*pending) or self.stopping

    def stop(self, checkpoint, step: int) -> None:
        """After the checkpoint of the agreed stop ``step``: say so once, close the tracker, exit."""
        self.accelerator.print(f"stopped by {self.received or 'a stop signal to another process'} after step {step}: "
                               f"the training state is in {checkpoint}; the same command with --resume "
                               f"continues from there (exit code {STOPPED_EXIT_CODE})", flush=True)
        self.accelerator.end_training()
        for stop_signal in STOP_SIGNALS:  # the launcher's SIGTERM, once another process has exited, must
            signal.signal(stop_signal, signal.SIG_IGN)  # not kill this one while it shuts down
        raise SystemExit(STOPPED_EXIT_CODE)

    def _read(self, step: int, total: torch.Tensor, arrived) -> bool:
        if arrived is not None:
            arrived.synchronize()
        loss, signalled = total.tolist()
        if math.isfinite(loss):
            return signalled > 0
        checkpoint = latest_good_checkpoint(self.output_dir)[0]  # checked: one to resume from
        then = (f"the last good checkpoint is {checkpoint}: resume from it with a lower --lr" if checkpoint
                else "there is no checkpoint yet: start again with a lower --lr")
        # Every process says it before any exits, so the launcher cannot stop one before it speaks.
        print(f"error: the loss is {loss} at step {step}: training stopped and nothing of that step was "
              f"saved; {then}", file=sys.stderr, flush=True)
        self.accelerator.wait_for_everyone()
        raise SystemExit(1)


def _signal_when_parent_dies(signum: int) -> None:
    """Linux's PR_SET_PDEATHSIG: ``signum`` to this process when the process that started it exits,
    as a launcher that is killed without passing its signal on does. Elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


class SkippedSteps:
    """fp16 steps that the GradScaler skipped because their gradients overflowed.

    A skip halves the loss scale, and one now and then is normal: the scale probes upwards after
    every 2,000 good steps. A run whose every step overflows has diverged, and nothing says so: the
    scale halves forever and no step is applied. ``limit`` skipped steps in a row (a scale 2^-limit
    of the one that last worked) stop the run, in every process (DDP averages the gradients before
    the scaler looks, so all skip alike), without a checkpoint of those steps, naming the newest
    checkpoint from before the skipping began.
    """

    def __init__(self, accelerator, output_dir, limit: int = 100):
        self.accelerator, self.output_dir, self.limit = accelerator, output_dir, limit
        self.in_epoch = self.in_a_row = 0  # the log line reports in_epoch, the count of this epoch

    def count(self, step: int) -> None:
        """After ``optimizer.step()`` of optimizer step ``step``."""
        if not self.accelerator.optimizer_step_was_skipped:
            self.in_a_row = 0
            return
        self.in_epoch += 1
        self.in_a_row += 1
        if self.in_a_row < self.limit:
            return
        first = step - self.in_a_row + 1
        checkpoint = latest_checkpoint(self.output_dir, up_to=first - 1)
        then = (f"the newest checkpoint before them is {checkpoint}: resume from it with a lower --lr or "
                f"--clip-grad" if checkpoint else "there is no checkpoint from before them: start again with a "
                "lower --lr, --clip-grad or --mixed-precision bf16")
        print(f"error: fp16 skipped {self.in_a_row} steps in a row ({first} to {step}) because the gradients "
              f"overflowed at every loss scale (now {self.accelerator.scaler.get_scale():g}): training diverged "
              f"and stopped; {then}", file=sys.stderr, flush=True)
        self.accelerator.wait_for_everyone()
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


PEER_CHECK_TIMEOUT = 60  # seconds one step of the check may take, CUDA's start on a GPU it is first to use included
# Seconds for the checking process to start: importing torch from a cold network disk can take minutes,
# and that is no hang between GPUs.
PEER_CHECK_START_LIMIT = 600
PEER_ADVICE = ("DataParallel's scatter and gather copy directly between GPUs even with NCCL_P2P_DISABLE=1, so "
               "train with NCCL_P2P_DISABLE=1 accelerate launch ... scripts/train_ddp.py instead, or turn off the "
               "IOMMU or PCIe ACS that breaks peer-to-peer (see `nvidia-smi topo -m`)")


def peer_copy(values: torch.Tensor, source: torch.device, target: torch.device) -> torch.Tensor:
    """``values`` (on the host) put on ``source``, copied straight to ``target`` the way
    DataParallel's scatter and gather copy, and read back to the host."""
    return values.to(source).to(target).cpu()


def known_words() -> torch.Tensor:
    """4 MiB of random words, the same in every process: zeros, stale or shifted data all show."""
    return torch.randint(-2**31, 2**31 - 1, (1 << 20,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))


def broken_peer_copies(devices: list[torch.device],
                       started=lambda step: None) -> list[tuple[torch.device, torch.device]]:
    """Copy a known pattern between every ordered pair of GPUs, as DataParallel's scatter (the batch)
    and gather (the outputs) copy: the (source, target) pairs whose copy arrived different.
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
    """DataParallel's other two transfers, made with the calls it makes: the weights broadcast from the
    first GPU (replicate: comm.broadcast_coalesced) and the gradients summed onto it (backward:
    comm.reduce_add_coalesced). Both go through NCCL where torch has it (torch/nn/parallel/comm.py),
    so NCCL_P2P_DISABLE=1 changes their path. The ones that arrived wrong, named as ``started`` is told."""
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
    """All that DataParallel moves between GPUs, checked: (broken_peer_copies, broken_nccl_transfers)."""
    return broken_peer_copies(devices, started), broken_nccl_transfers(devices, started)


class PeerCheckFailed(Exception):
    """The process that checks transfers between GPUs hung or died; the text says how, in one line,
    and ``step`` is the step it was in (None before the first)."""

    def __init__(self, message: str, step: str | None = None):
        super().__init__(message)
        self.step = step


def report_transfers(check, devices: list[torch.device], channel) -> None:
    """In the child process: that it started, each step of ``check`` as it starts, then the result or
    the error, sent to the parent."""
    channel.send(("ready", None))
    try:
        result = check(devices, lambda step: channel.send(("step", step)))
    except Exception as error:  # the parent reports it, in one line
        channel.send(("failed", first_line(error)))
    else:
        channel.send(("done", result))


def run_transfer_check(devices: list[torch.device], timeout: float = PEER_CHECK_TIMEOUT,
                       check=data_parallel_transfers):
    """``check(devices, started)`` run in a child process: its result, or PeerCheckFailed when one step
    takes longer than ``timeout`` seconds or the child dies.

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
                raise PeerCheckFailed(f"the process checking transfers between GPUs died (exit code "
                                      f"{child.exitcode}) {where}", step) from None
            finished = kind in ("done", "failed")
            if kind == "done":
                return value
            if kind == "failed":
                raise PeerCheckFailed(f"{step or 'the check'} failed: {value}", step)
            ready, step = True, value or step
        if not ready:
            raise PeerCheckFailed(f"the process checking transfers between GPUs did not start in "
                                  f"{PEER_CHECK_START_LIMIT} s")
        raise PeerCheckFailed(f"{step or 'the check, before its first step,'} got no answer in {timeout:g} s: "
                              f"it hangs, as broken peer-to-peer can", step)
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
        raise UserError(f"the GPU-to-GPU copy {source} -> {target} returned wrong data: peer-to-peer copies are "
                        f"broken on this machine; {PEER_ADVICE}")
    if nccl and os.environ.get("NCCL_P2P_DISABLE") == "1":
        raise UserError(f"{nccl[0]} returned wrong data even with NCCL_P2P_DISABLE=1: NCCL is broken on this "
                        f"machine beyond peer-to-peer; run python scripts/check_gpus.py with NCCL_DEBUG=INFO")
    if nccl:
        raise UserError(f"{nccl[0]} returned wrong data, though direct copies arrived intact: NCCL's peer-to-peer "
                        f"path is broken; run with NCCL_P2P_DISABLE=1, which moves DataParallel's broadcast and "
                        f"reduce_add off it, or use NCCL_P2P_DISABLE=1 accelerate launch ... scripts/train_ddp.py")


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
