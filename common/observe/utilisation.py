"""Each GPU's utilisation over an epoch, the figure nvidia-smi shows: NVML read by a thread beside
training, never in the training step (no host-device synchronisation).

NVML's utilisation is the share of its last sample period (1/6 s to 1 s, by GPU) with a kernel
running; read every SAMPLE_SECONDS through torch.cuda.utilization (nvidia-ml-py) and averaged over
the epoch. A process reads the GPUs it trains on (common.observe.tracking.EpochMeter): its own, or
DataParallel's replicas'; the job's figures are gathered (one value per GPU, in process order).
Without a GPU or NVML, ``why_absent`` says why in metrics.jsonl's gpu_util_absent. Beside it, each
process's peak allocated GPU memory (peak_memory); and training's wait for its batches (DataWait).
"""

import threading
import time

import torch
from accelerate.utils import gather_object

from common.errors import first_line
from common.units import GB

SAMPLE_SECONDS = 0.5


class GpuBusy:
    """Utilisation of ``devices`` (CUDA) sampled in a daemon thread; ``restart()`` opens a window,
    ``means()`` closes it: the mean percent of each device over the window. ``read(device)`` is
    torch.cuda.utilization (a test passes another)."""

    def __init__(self, devices: list[torch.device], read=None):
        self.devices, self.read = devices, read or torch.cuda.utilization
        self.why_absent = None if devices else "no GPU: training on the CPU"
        if devices:
            try:
                self.read(devices[0])
            except Exception as error:  # noqa: BLE001 - pynvml missing, NVML not loaded, a VM ...
                self.why_absent = (f"NVML cannot be read ({first_line(error)}); install "
                                   f"nvidia-ml-py with a driver that has NVML")
        self.sums, self.count, self.lock = [0.0] * len(devices), 0, threading.Lock()
        if self.why_absent is None:
            threading.Thread(target=self._sample, daemon=True, name="gpu-busy").start()

    def _now(self) -> list[float] | None:
        """Each device's utilisation (%) now, as NVML last sampled it; None if the read fails."""
        try:
            return [float(self.read(device)) for device in self.devices]
        except Exception:  # noqa: BLE001 - a missed sample is no reason to stop; the field says why
            return None

    def _sample(self) -> None:
        while True:
            if (values := self._now()) is not None:
                with self.lock:
                    self.sums = [s + v for s, v in zip(self.sums, values)]
                    self.count += 1
            time.sleep(SAMPLE_SECONDS)

    def restart(self) -> None:
        with self.lock:
            self.sums, self.count = [0.0] * len(self.devices), 0

    def means(self) -> list[float] | None:
        """Each device's mean utilisation (%) since restart(). A window shorter than a sample (a
        short epoch on a fast GPU) has NVML read once now: its last sample period covers most of
        the window. None if that read fails too."""
        with self.lock:
            if self.count:
                return [round(s / self.count, 1) for s in self.sums]
        return self._now()


def utilisation_figures(busy: GpuBusy) -> dict:
    """{"gpu_util_pct": [% per GPU of the job]} over the window, or {"gpu_util_absent": why}. With
    several processes, a collective (gathered): every process must call it."""
    if not busy.devices:  # a CPU: the same on every process of the job
        return {"gpu_util_absent": busy.why_absent}
    mine = [busy.why_absent] if busy.why_absent else busy.means() or ["no NVML sample yet"]
    job = gather_object(mine)  # in process order; every process, NVML or not: no one waits alone
    why = next((value for value in job if isinstance(value, str)), None)
    return {"gpu_util_absent": why} if why else {"gpu_util_pct": job}


def peak_memory(accelerator) -> dict[str, list[float]]:
    """Peak memory allocated on each process's GPU since the last call, in GB, one value per
    process (gathered, so every process must call it); empty on a CPU."""
    if accelerator.device.type != "cuda":
        return {}
    peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device) / GB],
                        device=accelerator.device)
    torch.cuda.reset_peak_memory_stats(accelerator.device)
    return {"gpu_mem_peak_gb": [round(value, 3) for value in accelerator.gather(peak).tolist()]}


class DataWait:
    """How long each epoch waited for its training batches: from the end of one step's work to the
    batch ready for the next forward pass.

    On a CPU the host clock measures it. On a GPU the host runs ahead of the device, so the host
    clock would measure whatever the device was still busy with; CUDA events in the stream measure
    the device's time instead: the batch's own work (indexing, augmentation) plus any time the
    device sat idle waiting for the host to fetch it. Reading them waits for the device, so
    ``seconds`` is called once an epoch."""

    def __init__(self, device):
        self.cuda, self.spans, self.total, self.tick = device.type == "cuda", [], 0.0, None

    def start(self) -> None:
        """At the end of a step (and before the first)."""
        self.tick = self._now()

    def stop(self) -> None:
        """Once the batch is ready for the model."""
        if self.cuda:
            self.spans.append((self.tick, self._now()))
        else:
            self.total += time.perf_counter() - self.tick

    def seconds(self) -> float:
        """The wait since the last call."""
        if self.spans:
            self.spans[-1][1].synchronize()
            self.total += sum(start.elapsed_time(end) for start, end in self.spans) / 1000
        total, self.total, self.spans = self.total, 0.0, []
        return total

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

