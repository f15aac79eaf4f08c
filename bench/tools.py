"""Measuring tools for scripts/benchmark.py: launched runs and their peak memory, the plain PyTorch
loop and the input pipelines the scripts are compared with, the machine's matmul peak, and the
report files (benchmark.md, benchmark.png).

Every timing waits for the device before it reads the clock. Rates come from median step times,
which the odd step stalled by other work on the machine does not move; the matmul peak alone is the
best of its repeats, as a peak is.
"""

import contextlib
import os
import pickle
import platform
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import psutil
import torch
import torchvision
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from common.data.device import tensor_loader
from common.data.splits import ImageData
from common.data.stats import channel_stats
from common.data.synthetic import make_synthetic
from common.data.transform import BatchTransform
from common.recipe.ema import WeightAverage
from common.recipe.models import build_model
from common.recipe.numerics import keep_freed_memory
from common.recipe.optim import build_optimizer
from common.run.record import versions
from common.units import GB

# ----------------------------------------------------------------------------------- the machine

def machine_info() -> dict:
    """What the figures were measured on: CPU, cores, threads, GPUs, versions, load."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:  # platform.processor() is often empty on Linux; /proc/cpuinfo has the marketing name
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
        info = {key.strip(): value.strip() for key, value in info.items()}
        cpu = info.get("model name", cpu)
        # The vector units that decide fp32 and bf16 speed on a CPU.
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in info.get("flags", "").split()]
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": cpu, "cpu_flags": flags, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpus": gpus, "cuda": torch.version.cuda, "platform": platform.platform(),
            "versions": {**versions(), "torch": torch.__version__}, "load_average": list(os.getloadavg())}


class OtherWork:
    """The share of the machine's CPU time that processes other than this one and its children used
    between ``__init__`` and ``share()``: a direct measure of how disturbed a benchmark was."""

    def __init__(self):
        self.start = self._times()

    @staticmethod
    def _times() -> tuple[float, float, float]:
        total = psutil.cpu_times()
        busy = sum(total) - total.idle - getattr(total, "iowait", 0)
        mine = os.times()  # children: every waited-for descendant, launchers' workers included
        return time.monotonic(), busy, mine.user + mine.system + mine.children_user + mine.children_system

    def share(self) -> float:
        (t0, busy0, mine0), (t1, busy1, mine1) = self.start, self._times()
        capacity = (t1 - t0) * (os.cpu_count() or 1)
        return max(0.0, ((busy1 - busy0) - (mine1 - mine0)) / capacity) if capacity > 0 else 0.0


def describe_machine(machine: dict) -> str:
    devices = f"{len(machine['gpus'])} x {machine['gpus'][0]}" if machine["gpus"] else "no GPU"
    v = machine["versions"]
    return (f"{machine['cpu']} ({' '.join(machine['cpu_flags'])}), {machine['cpu_cores']} cores, {devices}; "
            f"torch {v['torch']}, "
            f"accelerate {v['accelerate']}, Python {v['python']}")


# ------------------------------------------------------------------------- launched runs, watched

def native_bf16() -> bool:
    """bf16 in hardware on this process's GPU: compute capability 8.0 and newer. Older GPUs only
    emulate it, slowly, though torch.cuda.is_bf16_supported() says True on them."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a clock read next measures it; a no-op on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


try:  # NVML through nvidia-ml-py (requirements-optional.txt); nvidia-smi where it is missing
    import pynvml
except ImportError:
    pynvml = None

# nvidia-smi failing in any of its ways: not installed, no driver, or hung.
NVIDIA_SMI_ERRORS = (OSError, subprocess.SubprocessError, ValueError)
# Reading the GPUs' memory failing, through NVML or nvidia-smi
GPU_QUERY_ERRORS = NVIDIA_SMI_ERRORS + ((pynvml.NVMLError,) if pynvml else ())


def visible_gpus(listed: list[tuple[str, str, int]], visible: str | None) -> list[tuple[str, str, int]]:
    """The rows of ``listed`` (nvidia-smi's index, UUID, bytes used) that processes with
    CUDA_VISIBLE_DEVICES=``visible`` see, in their cuda:0, cuda:1, ... order.

    The variable lists nvidia-smi indices or GPU UUIDs (``GPU-...``, or a unique start of one), and
    CUDA stops at the first entry that names no GPU. Indices are nvidia-smi's where
    CUDA_DEVICE_ORDER=PCI_BUS_ID or the GPUs are all alike, as on a training node; CUDA otherwise
    numbers them fastest first.
    """
    if visible is None:
        return listed
    chosen = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith("MIG-"):  # nvidia-smi's memory.used is the whole GPU's, every MIG slice's
            raise ValueError(f"CUDA_VISIBLE_DEVICES={visible}: nvidia-smi cannot measure MIG slices")
        named = [gpu for gpu in listed if entry == gpu[0] or entry.startswith("GPU-") and gpu[1].startswith(entry)]
        if len(named) != 1:
            break
        chosen += named
    return chosen


def nvidia_smi_gpus(env: dict | None = None) -> list[tuple[str, str, int]]:
    """(nvidia-smi index, UUID, bytes in use: every process's, CUDA contexts included) of each
    GPU that processes started with ``env`` (default: this one's) see, in their cuda:N order.
    Raises one of NVIDIA_SMI_ERRORS where nvidia-smi is missing, fails or hangs."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    listed = [(index, uuid, int(mib) * 2**20) for index, uuid, mib in
              (line.split(", ") for line in out.strip().splitlines())]
    return visible_gpus(listed, (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES"))


def nvml_gpus(env: dict | None = None) -> list[tuple[str, str, int]]:
    """nvidia_smi_gpus's rows read through NVML, the library nvidia-smi itself reads (the same
    indices and UUIDs; bytes where nvidia-smi rounds to MiB), without a process started for every
    sample. Raises pynvml.NVMLError where NVML cannot be read (no driver, no GPU)."""
    pynvml.nvmlInit()  # counted: matched by the shutdown below
    try:
        listed = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)  # bytes in nvidia-ml-py before 11.5
            listed.append((str(index), uuid.decode() if isinstance(uuid, bytes) else uuid,
                           int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)))
    finally:
        pynvml.nvmlShutdown()
    return visible_gpus(listed, (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES"))


def describe_gpus(gpus: list[tuple[str, str, int]], env: dict | None = None) -> str:
    """Which physical GPUs the processes' cuda:0, cuda:1, ... are, in nvidia-smi's numbers."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    pairs = ", ".join(f"cuda:{i} = nvidia-smi's GPU {index}" for i, (index, _, _) in enumerate(gpus))
    return f"GPUs as the processes number them: {pairs}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")


class PeakMemory:
    """For each GPU the processes see, the largest rise of nvidia-smi's memory.used over its value
    before a launch (the CUDA context, about 0.5 GB, included), sampled from outside every
    ``interval`` seconds through NVML (nvml_gpus; nvidia-smi where nvidia-ml-py is not
    installed); the GPUs are the processes' cuda:0, cuda:1, ..., found through
    CUDA_VISIBLE_DEVICES in ``env``. Where neither can be used, ``error`` says why and
    ``stop()`` returns nothing: the scripts' own gpu_mem_peak_gb stands in (scripts/benchmark.py).

    Without GPUs nothing is sampled: each training process reports its own peak resident memory
    when it exits (bench.steptimer), exact and without a watcher taking CPU time from the run.
    """

    def __init__(self, gpus: int, interval: float = 0.5, env: dict | None = None):
        self.peak: dict[str, int] = {}
        self.before: dict[str, int] = {}  # by UUID: the order of nvidia-smi's rows is not the processes'
        self.error, self.env = None, env
        self.read, source = (nvml_gpus, "NVML") if pynvml else (nvidia_smi_gpus, "nvidia-smi")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(interval,), daemon=True)
        if gpus:
            try:
                self.before = {uuid: used for _, uuid, used in self.read(env)[:gpus]}
            except GPU_QUERY_ERRORS as error:
                self.error = f"{source} failed ({type(error).__name__}: {error})"
            else:
                self._thread.start()

    def _sample(self) -> None:
        for _, uuid, used in self.read(self.env):
            if uuid in self.before:
                self.peak[uuid] = max(self.peak.get(uuid, 0), used - self.before[uuid])

    def _watch(self, interval: float) -> None:
        while not self._done.is_set():
            try:
                self._sample()
            except GPU_QUERY_ERRORS:
                pass  # NVML or nvidia-smi busy: the next sample counts
            self._done.wait(interval)

    def stop(self) -> list[float]:
        """Peak per GPU in GB, in the processes' cuda:N order; empty without GPUs, or where no
        sample of every GPU came back."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        if set(self.peak) != set(self.before):
            return []
        return [round(self.peak[uuid] / GB, 3) for uuid in self.before]


@dataclass
class WatchedRun:
    returncode: int
    stdout: str
    stderr: str
    peak_memory_gb: list[float]  # per GPU, from nvidia-smi; empty without GPUs or where it failed
    wall_s: float
    memory_error: str | None = None  # why nvidia-smi could not measure


def last_line(stdout: str, stderr: str) -> str:
    """What a failed launch said last, for a one-line error: its stderr's last line, else stdout's."""
    return (stderr.strip() or stdout.strip() or "no output").splitlines()[-1]


def run_watched(command: list[str], cwd: Path, gpus: int, timeout: float,
                env: dict | None = None) -> WatchedRun:
    """Run ``command`` to its end, with the peak memory of each of its ``gpus`` GPUs; the whole
    process group dies on timeout."""
    start = time.perf_counter()
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        memory = PeakMemory(gpus, env=env)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            stderr += f"\nkilled after {timeout:g} s (--timeout)"
        peak = memory.stop()
    return WatchedRun(process.returncode, stdout, stderr, peak, time.perf_counter() - start, memory.error)


# ------------------------------------------------------------------------ the plain PyTorch loop

class PlainLoop:
    """The minimal training loop: forward, loss, backward, optimizer step, and nothing else.

    The scripts' model, optimizer (common.recipe.optim) and batch size, on batches that are already
    normalised and on the device: no augmentation, schedule, checks or logging. ``bf16`` autocasts
    as Accelerate does, ``channels_last`` converts the model and the batches as train_amp.py does,
    ``tf32_math`` sets TF32 as the scripts' --tf32 does (see tf32); cuDNN searches its convolution
    algorithms (cudnn.benchmark) as in the scripts, and a CPU's allocations stay in the process as
    in the scripts (common.recipe.numerics.keep_freed_memory). ``ema_decay`` adds the scripts' weight average
    (common.recipe.ema.WeightAverage, one process) after every optimizer step, as --ema-decay does.
    """

    def __init__(self, model_name: str, batch_size: int, device: torch.device, bf16: bool = False,
                 channels_last: bool = False, compiled: bool = False, num_batches: int = 4,
                 tf32_math: bool | None = None, ema_decay: float = 0.0):
        keep_freed_memory(device)  # on a CPU, the scripts' allocator setting (set_numerics)
        data = make_synthetic(batch_size * num_batches, 10)
        transform = BatchTransform(*channel_stats(data.train_images), augment=False, channels_last=channels_last)
        self.batches = [(transform.eval(images.to(device)), labels.to(device)) for images, labels in
                        zip(data.train_images.split(batch_size), data.train_labels.split(batch_size))]
        torch.backends.cudnn.benchmark = True  # cuDNN's algorithm search, as the scripts' set_numerics
        torch.manual_seed(0)
        model = build_model(model_name, num_classes=len(data.classes)).to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        # A small lr: the loop runs for speed, and a diverging model would end in NaNs.
        self.optimizer = build_optimizer(model, lr=0.01, momentum=0.9, weight_decay=5e-4)
        self.model = torch.compile(model) if compiled else model
        self.ema = WeightAverage(OneProcess(), model, ema_decay)  # does nothing when 0
        self.criterion = torch.nn.CrossEntropyLoss()
        self.device, self.bf16, self.batch_size, self.steps_done = device, bf16, batch_size, 0
        self.tf32_math = tf32_math
        self.step_seconds: list[float] = []  # every step's time, warm-up included

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` training steps."""
        with tf32(self.tf32_math):
            start = tick = time.perf_counter()
            for _ in range(steps):
                images, labels = self.batches[self.steps_done % len(self.batches)]
                with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
                    loss = self.criterion(self.model(images), labels)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.ema.update()
                # Waits for the device at every step, so each step's time is the device's; the scripts
                # wait a step behind (their NaN check, common/parallel/step_guard.py): the same pace once running.
                loss.item()
                self.steps_done += 1
                self.step_seconds.append(time.perf_counter() - tick)
                tick = time.perf_counter()
            return time.perf_counter() - start


class OneProcess:
    """What common.recipe.ema.WeightAverage asks of an Accelerator, for one process and a plain model."""

    num_processes = 1

    def unwrap_model(self, model):
        return model

    def register_save_state_pre_hook(self, hook):
        pass

    def register_load_state_pre_hook(self, hook):
        pass


def ema_update_seconds(loop: PlainLoop, updates: int = 20) -> float:
    """The median time of one weight-average update of ``loop``'s model, each timed alone with the
    device waited for before and after it (torch.utils.benchmark's timer does both; its Timer
    runs 2 untimed updates before each timed one), on every thread the loop uses (Timer's
    default is one)."""
    # imported here: torch.utils.benchmark warns of a missing CUDA runtime as it is imported
    from torch.utils.benchmark import Timer

    timer = Timer("ema.update()", globals={"ema": loop.ema}, num_threads=torch.get_num_threads())
    return statistics.median(timer.timeit(1).median for _ in range(updates))


@contextlib.contextmanager
def cold_compile_cache():
    """An empty TorchInductor cache while torch.compile compiles: the compile time of a first run.

    Inductor caches compiled graphs and kernels on disk, so a second compile of the same model
    takes seconds instead of the ~50 s of the first (ResNet-18, 2 CPU cores) and would flatter
    torch.compile.
    """
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir  # private: guarded
    except ImportError:
        temporary_cache_dir = None
    torch._dynamo.reset()  # and nothing compiled earlier in this process is reused
    with tempfile.TemporaryDirectory() as folder:
        if temporary_cache_dir is None:
            yield
            return
        with temporary_cache_dir(folder):
            yield


def flops_per_image(model_name: str, num_classes: int = 10) -> float:
    """Training FLOPs per 32x32 image (forward and backward), counted by torch's FlopCounterMode.

    Matmuls and convolutions only, 2 per multiply-add: ResNet-18 with the CIFAR stem gives 3.33
    GFLOP, 3 x its 0.56 G multiply-adds forward.
    """
    model = build_model(model_name, num_classes)
    images, labels = torch.randn(2, 3, 32, 32), torch.arange(2) % num_classes
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    return counter.get_total_flops() / len(images)


def uses_tf32(device: torch.device) -> bool:
    """Whether fp32 matmuls and convolutions run in TF32 on ``device`` with the training scripts'
    --tf32 (their default): on GPUs of compute capability 8.0 (Ampere) and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@contextlib.contextmanager
def tf32(enabled: bool | None):
    """fp32 matmuls and cuDNN convolutions in TF32 (``True``) or strictly in fp32 (``False``) inside
    the block, as the training scripts' --tf32 / --no-tf32 set them, and as before after it;
    ``None`` changes nothing. Effective on GPUs of compute capability 8.0 and later only.

    Set through allow_tf32, which keeps torch's two views of the setting in step: one set through
    the newer fp32_precision alone makes a later read of allow_tf32 raise (torch 2.15), and
    TorchInductor reads it.
    """
    if enabled is None:
        yield
        return
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [flag.allow_tf32 for flag in flags]
    for flag in flags:
        flag.allow_tf32 = enabled
    try:
        yield
    finally:
        for flag, value in zip(flags, before):
            flag.allow_tf32 = value


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 4096, repeats: int = 3,
                tf32_math: bool | None = None, min_seconds: float = 0.025) -> float:
    """FLOP/s of square matmuls of ``size`` in ``dtype`` (fp32 in TF32 or strictly with ``tf32_math``,
    see tf32): what dense math reaches here. The best of ``repeats`` timings, each of as many matmuls
    back to back between two synchronisations as take ``min_seconds``: a GPU's launch and
    synchronisation (~10 us) are then under 0.1 % of a timing, where they would be 10 % of one bf16
    4096-square matmul (~0.15 ms on an H100). On a CPU one 4096-square matmul takes about a second.

    Not torch.utils.benchmark.Timer: its ``timeit`` runs max(n / 100, 2) untimed matmuls before
    each timing (2 s more per timing of a CPU's 1-s matmul), and ``blocked_autorange`` gives a
    median, of one block of one matmul once a matmul outlasts its min_run_time (checked: 2048
    squared on this CPU), not the best of ``repeats``.
    """
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))

    def seconds(matmuls: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(matmuls):
            torch.mm(a, b)
        synchronize(device)
        return time.perf_counter() - start

    with tf32(tf32_math):
        seconds(1)  # the first call picks kernels and warms the caches
        matmuls, timed = 1, seconds(1)
        while timed < min_seconds:
            matmuls *= 2
            timed = seconds(matmuls)
        best = min([timed] + [seconds(matmuls) for _ in range(repeats - 1)])
    return 2 * size**3 * matmuls / best


# ---------------------------------------------------------------------------- input pipelines

def write_cifar_pickles(folder: Path, source: ImageData, cifar100: bool = False) -> None:
    """``source`` in torchvision's cifar-10-batches-py layout (5 training pickles, a test pickle,
    batches.meta) or, with ``cifar100``, its cifar-100-python layout: the format common.data reads,
    written for the torchvision pipeline below and for the tests."""
    folder.mkdir(parents=True)

    def batch(images, labels, name):
        key = "fine_labels" if cifar100 else "labels"
        entry = {"batch_label": name, key: labels.tolist(), "data": images.reshape(len(images), -1).numpy(),
                 "filenames": [f"{name}_{i}.png" for i in range(len(images))]}
        if cifar100:
            entry["coarse_labels"] = [0] * len(labels)
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)

    if cifar100:
        batch(source.train_images, source.train_labels, "train")
        batch(source.test_images, source.test_labels, "test")
        meta = ("meta", {"fine_label_names": source.classes, "coarse_label_names": ["animal"]})
    else:
        chunks = zip(source.train_images.tensor_split(5), source.train_labels.tensor_split(5))
        for i, (images, labels) in enumerate(chunks, start=1):
            batch(images, labels, f"data_batch_{i}")
        batch(source.test_images, source.test_labels, "test_batch")
        meta = ("batches.meta", {"num_cases_per_batch": 5, "label_names": source.classes, "num_vis": 3072})
    with open(folder / meta[0], "wb") as f:
        pickle.dump(meta[1], f, protocol=2)


class UncheckedCIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10 on a cifar-10-batches-py folder written by write_cifar_pickles.

    The class checks the files against the MD5 sums of the real archive; None makes
    torchvision.datasets.utils.check_integrity check only that each file exists.
    """

    train_list: ClassVar = [[name, None] for name, _ in torchvision.datasets.CIFAR10.train_list]
    test_list: ClassVar = [[name, None] for name, _ in torchvision.datasets.CIFAR10.test_list]
    meta: ClassVar = {**torchvision.datasets.CIFAR10.meta, "md5": None}


class OurPipeline:
    """common/data/device.py's tensor_loader and common/data/transform.py's BatchTransform, as the scripts use
    them: the uint8 images on the device, crop, flip and normalisation a whole batch at a time."""

    def __init__(self, images, labels, batch_size: int, device: torch.device):
        self.images, self.labels = images.to(device), labels.to(device)
        self.transform = BatchTransform(*channel_stats(images))
        self.batch_size, self.device, self.epochs = batch_size, device, 0

    def epoch(self) -> float:
        """img/s over one epoch of augmented, normalised batches."""
        loader = tensor_loader(self.images, self.labels, self.batch_size, shuffle=True, seed=self.epochs)
        start, seen = time.perf_counter(), 0
        for step, (images, _) in enumerate(loader):
            images = self.transform.train(images, seed=(self.epochs, step))
            seen += len(images)
        synchronize(self.device)
        self.epochs += 1
        return seen / (time.perf_counter() - start)


class TorchvisionPipeline:
    """The usual CIFAR-10 input pipeline: torchvision's CIFAR10 with PIL transforms per image
    (RandomCrop with 4-pixel padding, RandomHorizontalFlip, ToTensor, Normalize) in DataLoader
    worker processes, each batch then copied to the device."""

    def __init__(self, root: Path, mean, std, batch_size: int, device: torch.device, workers: int = 2):
        T = torchvision.transforms
        transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                               T.Normalize([m / 255 for m in mean], [s / 255 for s in std])])
        dataset = UncheckedCIFAR10(str(root), train=True, transform=transform)
        # Persistent workers: the worker start-up is paid in the warm-up epoch, not in every epoch.
        self.loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                 drop_last=True, persistent_workers=True, pin_memory=device.type == "cuda")
        self.device = device

    def epoch(self) -> float:
        start, seen = time.perf_counter(), 0
        for images, _ in self.loader:
            images = images.to(self.device, non_blocking=True)
            seen += len(images)
        synchronize(self.device)
        return seen / (time.perf_counter() - start)


def compare_pipelines(data, batch_size: int, device: torch.device, rounds: int = 3) -> dict[str, list[float]]:
    """img/s of OurPipeline and TorchvisionPipeline on the same images, epochs alternated so that
    both see the same machine, after one warm-up epoch each."""
    rates = {"ours": [], "torchvision": []}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_cifar_pickles(root / "cifar-10-batches-py", data)
        ours = OurPipeline(data.train_images, data.train_labels, batch_size, device)
        theirs = TorchvisionPipeline(root, *channel_stats(data.train_images), batch_size, device, workers=2)
        ours.epoch(), theirs.epoch()  # warm-up: the workers start, the caches fill
        for _ in range(rounds):
            rates["ours"].append(ours.epoch())
            rates["torchvision"].append(theirs.epoch())
        del theirs  # its persistent workers end with it
    return rates


# ------------------------------------------------------------------------------------ reports

def _fmt_rate(value) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _fmt_duration(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def _fmt_memory(values: list[float], kind: str) -> str:
    return (", ".join(f"{v:.2f}" for v in values) + f" GB ({kind})") if values else "-"


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _fmt_share(value) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def row_cells(row: dict) -> list[str]:
    if row.get("error"):
        return [f"failed: {row['error']}"] + [""] * 5 + [_fmt_share(row.get("other_work"))]
    return [_fmt_rate(row["img_per_s"]), _fmt_duration(row["epoch_50k_s"]), f"{row['speedup']:.2f}x"
            if row.get("speedup") else "-", f"{100 * row['efficiency']:.0f} %" if row.get("efficiency") else "-",
            _fmt_memory(row["peak_memory_gb"], row["memory_kind"]), _fmt_share(row["data_wait_frac"]),
            _fmt_share(row.get("other_work"))]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


STRATEGY_HEADER = ["strategy", "processes", "global batch", "img/s", "50,000-image epoch", "speed-up",
                   "scaling efficiency", "peak memory per device", "data wait", "other work"]
SWEEP_HEADER = ["batch per device", "global batch", "img/s", "50,000-image epoch", "peak memory per device",
                "data wait", "other work"]
CHECK_HEADER = ["check", "measured", "target", "result"]
LOADER_HEADER = ["pipeline", "img/s, each round", "img/s, median"]
INPUT_ROW_HEADER = ["row", "input path", "global batch", "img/s", "data wait (logged, warm-up included)",
                    "data wait after the warm-up", "other work"]


def strategy_table(rows: list[dict]) -> str:
    return markdown_table(STRATEGY_HEADER, [[f"`{r['name']}`: {r['label']}", str(r["processes"]),
                                             str(r["global_batch"]), *row_cells(r)] for r in rows])


def sweep_table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        rest = row_cells(r)
        cells.append([str(r["per_device_batch"]), str(r["global_batch"]), *rest[:2], *rest[4:]])
    return markdown_table(SWEEP_HEADER, cells)


BUSY = 0.10  # a measurement during which other processes used more of the CPU is not conclusive


def check_table(checks: list[dict]) -> str:
    def verdict(c):
        text = {True: "PASS", False: "**BELOW**", None: "reported"}[c["passed"]]
        busy = c.get("other_work") or 0
        return text + (f" (busy: {busy:.0%} other work)" if busy > BUSY else "")
    return markdown_table(CHECK_HEADER, [[c["check"], c["measured"], c["target"], verdict(c)] for c in checks])


def input_tables(report: dict) -> list[str]:
    """The input paths section: the loader comparison and the data wait of the workers rows beside
    the `single` row's (the device path)."""
    inputs, parts = report.get("inputs") or {}, []
    if "rates" in inputs:
        folder, workers = inputs["folder"], count(inputs["workers"], "DataLoader worker")
        names = {"ours": "workers path: worker_loader (decode_image, transforms.v2) + normalise on the device",
                 "torchvision": "torchvision ImageFolder + PIL RandomResizedCrop, flip, ToTensor, Normalize"}
        parts += [f"Loaders, {workers} each, batch {inputs['batch']}, 224 px crops of {folder['train_files']} JPEGs "
                  f"({folder['sides'][0]}-{folder['sides'][1]} px a side, quality {folder['quality']}, "
                  f"{folder['mean_kb']:.0f} KB on average); one epoch of each per round, the order swapped every "
                  f"round, after a warm-up epoch each:", "",
                  markdown_table(LOADER_HEADER, [[names[key], ", ".join(_fmt_rate(r) for r in rates),
                                                  _fmt_rate(statistics.median(rates))]
                                                 for key, rates in inputs["rates"].items()]), "",
                  f"Ratio, workers path / torchvision: {inputs['ratio']:.2f}x (the median of the rounds' ratios).", ""]
    if inputs.get("rows"):
        cells = []
        for r in [r for r in report["rows"] if r["name"] == "single"] + inputs["rows"]:
            name = f"`{r['name']}`: {r['label']}"
            if r.get("error"):
                cells.append([name, f"failed: {r['error']}"] + [""] * 5)
                continue
            path = r["loader"] + (f", {count(r['loader_workers'], 'worker')}" if r["loader"] == "workers" else "")
            cells.append([name, path, str(r["global_batch"]), _fmt_rate(r["img_per_s"]),
                          _fmt_share(r["data_wait_frac"]), _fmt_share(r["data_wait_steady_frac"]),
                          _fmt_share(r.get("other_work"))])
        parts += [markdown_table(INPUT_ROW_HEADER, cells), ""]
    return ["## Input paths", "", *parts] if parts else []


def write_markdown(path: Path, report: dict) -> None:
    parts = [f"# Benchmark: {report['title']}", "",
             (f"Measured {report['started']} on {describe_machine(report['machine'])}, in "
              f"{report['duration_s'] / 60:.0f} min. Command: `{report['command']}`"), "",
             f"Noise: {report['noise']}.", ""]
    if report["rows"]:
        parts += ["## Strategies", "", strategy_table(report["rows"]), ""]
    parts += ["Protocol: " + report["protocol"], ""]
    if report["sweep"]:
        parts += [f"## Batch size sweep (`{report['sweep'][0]['name']}`)", "", sweep_table(report["sweep"]), ""]
    parts += input_tables(report)
    if report["checks"]:
        parts += ["## Checks", "", check_table(report["checks"]), "",
                  (f"Other work: the share of the CPU that other processes used while a row or check was measured; "
                   f"a result marked busy (over {BUSY:.0%}) is not conclusive: run again on a quiet machine."), ""]
        parts += [f"- {c['check']}: {c['note']}" for c in report["checks"] if c.get("note")]
        parts.append("")
    Path(path).write_text("\n".join(parts))


def write_chart(path: Path, report: dict) -> None:
    """benchmark.png: img/s per strategy as bars; the batch-size sweep beside it if there is one."""
    import matplotlib  # imported here: only the report needs it, and Agg needs no display

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if not r.get("error")]
    sweep = [r for r in report["sweep"] if not r.get("error")]
    panels = [p for p in (rows, sweep) if p]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(6.5 * max(len(panels), 1), 0.5 * len(rows) + 2.6),
                             squeeze=False)
    axes = list(axes[0])
    if rows:
        ax = axes.pop(0)
        names = [f"{r['label']}\n(global batch {r['global_batch']})" for r in rows][::-1]
        rates = [r["img_per_s"] for r in rows][::-1]
        colors = {"fp32": "#4c72b0", "bf16": "#dd8452", "fp16": "#55a868"}
        bars = ax.barh(names, rates, color=[colors[r["precision"]] for r in rows][::-1])
        ax.legend(handles=[matplotlib.patches.Patch(color=colors[p], label=p) for p in colors
                           if any(r["precision"] == p for r in rows)], loc="lower right", fontsize=9)
        for bar, r in zip(bars, rows[::-1]):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {_fmt_rate(r['img_per_s'])} img/s" + (f", {r['speedup']:.2f}x" if r.get("speedup") else ""),
                    va="center", fontsize=9)
        ax.set_xlim(0, max(rates) * 1.45)
        ax.set_xlabel("training images per second (higher is better)")
        ax.set_title(f"{report['model']}, {report['dataset']}: throughput per strategy", fontsize=11)
        ax.tick_params(axis="y", labelsize=9)
    if sweep:
        ax = axes.pop(0)
        batches = [r["per_device_batch"] for r in sweep]
        ax.plot(batches, [r["img_per_s"] for r in sweep], "o-", color="#4c72b0", label="img/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch per device")
        ax.set_ylabel("training images per second", color="#4c72b0")
        ax.set_ylim(0, max(r["img_per_s"] for r in sweep) * 1.15)
        memory = [max(r["peak_memory_gb"], default=0.0) for r in sweep]
        twin = ax.twinx()
        twin.plot(batches, memory, "s--", color="#c44e52", label="peak memory")
        twin.set_ylabel(f"peak memory, GB ({sweep[0]['memory_kind']})", color="#c44e52")
        twin.set_ylim(0, max(memory) * 1.15 or 1)
        ax.set_title(f"batch size: throughput and memory ({sweep[0]['label']})", fontsize=11)
    fig.text(0.01, 0.01, describe_machine(report["machine"]), fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
