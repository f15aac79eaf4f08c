"""What a run reports as it trains: the one log line per epoch, and Weights & Biases.

The log line (``log_line``) prints the values of metrics.jsonl, greppable, in the same order in
every script. wandb goes through Accelerate's tracker integration and is never in the way: one
wandb run per job, which Accelerate creates on the main process only, however many processes the
job has. The run id is kept in the training state, so --resume (and an automatic restart)
continues the same run. Without an API key and without WANDB_MODE, the run is written offline
under --output-dir and one line says how to upload it (`wandb sync`): never a login prompt. A
tracking failure, a server that cannot be reached within START_TIMEOUT included, prints one
warning and training goes on without it.
"""

import netrc
import os
import secrets
import string
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

from common.errors import first_line
from common.run_record import write_metrics

GB = 1e9  # memory is reported in GB of 10^9 bytes (nvidia-smi shows MiB of 2^20 bytes)
DEFAULT_PROJECT = "multigpu-cifar"
# Seconds wandb may take to start before the run goes on without it (WANDB_INIT_TIMEOUT to change):
# the other processes of a job wait for the main one meanwhile, so it must stay well under
# --dist-timeout (600 s), and under wandb's own 90 s.
START_TIMEOUT = 60
SCRIPT_INDENT = "  "  # the start line's continuation lines


def has_wandb_credentials() -> bool:
    """An API key wandb would find without asking: WANDB_API_KEY, an identity token, or ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def start_tracking(accelerator, config: dict, output_dir: Path, progress,
                   project: str | None = None, name: str | None = None,
                   tags: list[str] | None = None, group: str | None = None) -> None:
    """Start (or, on resume, continue) the job's wandb run; a no-op when the Accelerator was made
    without ``log_with="wandb"``.

    ``project``, ``name``, ``tags`` and ``group`` win over the standard WANDB_PROJECT / WANDB_NAME /
    WANDB_TAGS / WANDB_RUN_GROUP variables only when given, so those keep working; so does
    WANDB_DIR.
    """
    if not accelerator.log_with:
        return
    offline_by_default = accelerator.is_main_process and not os.environ.get("WANDB_MODE") \
        and not has_wandb_credentials()
    if offline_by_default:
        os.environ["WANDB_MODE"] = "offline"  # wandb would otherwise prompt for a login, or fail
    if accelerator.is_main_process and progress.tracker_run_id is None:
        # Chosen here, not by wandb, so that it is in the first checkpoint (wandb's own id format).
        progress.tracker_run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                          for _ in range(8))
    init = {"id": progress.tracker_run_id, "resume": "allow",
            "dir": os.environ.get("WANDB_DIR", str(output_dir))}
    if not os.environ.get("WANDB_INIT_TIMEOUT"):  # the other processes wait for this one meanwhile
        init["settings"] = {"init_timeout": START_TIMEOUT}
    init.update({key: value for key, value in {"name": name, "tags": tags, "group": group}.items()
                 if value})
    project = project or os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT)
    try:
        accelerator.init_trackers(project, config=config, init_kwargs={"wandb": init})
    except Exception as error:  # noqa: BLE001 - tracking must never stop training
        _give_up(accelerator, f"wandb did not start ({first_line(error)})")
        return
    if offline_by_default:
        run_dir = Path(accelerator.get_tracker("wandb", unwrap=True).dir).parent
        accelerator.print(f"wandb: no API key configured, so this run is logged offline to "
                          f"{run_dir}; upload it with: wandb sync {run_dir}")


def track(accelerator, values: dict, step: int) -> None:
    """Log ``values`` at the global optimizer ``step`` (main process); lists become key/0,
    key/1..."""
    if not accelerator.trackers:
        return
    flat = {}
    for key, value in values.items():
        if isinstance(value, (list, tuple)):
            flat.update({f"{key}/{i}": v for i, v in enumerate(value)})
        elif isinstance(value, (int, float)):
            flat[key] = value
    try:
        accelerator.log(flat, step=step)
    except Exception as error:  # noqa: BLE001 - tracking must never stop training
        _give_up(accelerator, f"wandb failed to log ({first_line(error)})")


def record_epoch(accelerator, output_dir: Path, history: list[dict], metrics: dict) -> None:
    """An epoch's ``metrics``, appended to ``history``: metrics.jsonl, the log line and wandb."""
    history.append(metrics)
    if accelerator.is_main_process:
        write_metrics(output_dir, history)
    accelerator.print(log_line(metrics))
    track(accelerator, metrics, step=metrics["step"])


class StepLogger:
    """Per-step loss, lr and throughput, every ``every`` optimizer steps.

    ``loss.item()`` waits for the device, so it is read only at those steps, not every step.
    """

    def __init__(self, accelerator, every: int, batch_size: int):
        self.accelerator, self.every, self.batch_size = accelerator, every, batch_size
        self.last_step, self.last_time = None, time.perf_counter()

    def log(self, step: int, loss, lr: float) -> None:
        if not (self.accelerator.is_main_process and self.accelerator.trackers) \
                or step % self.every:
            return
        now = time.perf_counter()
        values = {"train/loss": loss.item(), "train/lr": lr}
        if self.last_step is not None:  # the first interval would include start-up time
            values["train/img_per_s"] = ((step - self.last_step) * self.batch_size
                                         / (now - self.last_time))
        track(self.accelerator, values, step)
        self.last_step, self.last_time = step, now


def _give_up(accelerator, why: str) -> None:
    accelerator.print(f"warning: {why}; training goes on without tracking")
    for tracker in accelerator.trackers:
        try:
            tracker.finish()
        except Exception:  # noqa: BLE001, S110 - already failing; nothing more to report
            pass
    accelerator.trackers = []


# Fields only some scripts record (mixed precision, GPU memory), printed after the common ones.
OPTIONAL_FIELDS = ("loss_scale", "skipped_steps", "gpu_mem_alloc_gb", "gpu_mem_reserved_gb",
                   "gpu_mem_peak_gb")


def log_line(m: dict) -> str:
    """The one greppable line per epoch, in the vocabulary of metrics.jsonl."""
    line = (f"epoch={m['epoch']}/{m['epochs']} step={m['step']} batch={m['batch_size']} "
            f"lr={m['lr']:.4g} train_loss={m['train_loss']:.4f} test_acc={m['test_acc']:.4f} "
            + (f"test_acc_ema={m['test_acc_ema']:.4f} " if "test_acc_ema" in m else "")  # averaged
            + f"epoch_time_s={m['epoch_time_s']:.1f} img_per_s={m['img_per_s']:.0f} "
            f"data_wait_frac={m['data_wait_frac']:.3f}")
    for key in OPTIONAL_FIELDS:
        if key in m:  # a list holds one value per GPU: gpu_mem_peak_gb=5.21,3.02
            value = m[key]
            line += f" {key}=" + (",".join(f"{v:.2f}" for v in value) if isinstance(value, list)
                                  else f"{value:g}")
    return line


def start_line(script: str, where: str, config: dict, data_line: str, output_dir: Path) -> str:
    """The line a run starts with, from the named values of its ``config`` (config.json): the
    script, the model on ``where`` (its devices), the batch, the lr, the numerics, and the data,
    of which ``data_line`` (common.inputs.Inputs.line) says the resolution and the loader."""
    args = config["args"]
    precision = f"{config['mixed_precision']} " if "mixed_precision" in config else ""
    accumulated = f" x {config['grad_accum']} micro-batches" if config["grad_accum"] > 1 else ""
    batch = (f"batch {config['global_batch_size']} "
             f"({config['per_device_batch_size']} per device{accumulated})")
    numerics = (f"fp32 math {config['fp32_precision']}"
                + (" (deterministic)" if args["deterministic"] else ""))
    data = f"{config['train_size']} training images ({config['data']}), {data_line}"
    steps = f"{config['steps_per_epoch']} steps/epoch, {config['total_steps']} steps in all"
    tuned = config.get("fine_tune")  # --pretrained, --pretrained-path: a line of its own
    tuning = f"\n{SCRIPT_INDENT}{tuned['loaded']}" if tuned else ""
    if tuned and "frozen" in tuned:
        tuning += f"\n{SCRIPT_INDENT}{tuned['frozen']}"
    return (f"{script}: {precision}{args['model']} on {where}, {batch}, lr {config['lr']:g}, "
            f"{numerics}, {data}, {steps}, record in {output_dir}{tuning}")


class EpochMeter:
    """One epoch's figures for its log line and metrics.jsonl: the training loss, the time, images
    per second, and the share of the time spent waiting for batches (``wait``, a DataWait). The loss
    is summed on the device and read once, at the end of the epoch."""

    def __init__(self, device: torch.device, batch_size: int):
        self.device, self.batch_size, self.wait = device, batch_size, DataWait(device)

    def start(self) -> None:
        """Before the epoch's first batch."""
        self.loss_sum, self.steps, self.began = (torch.zeros((), device=self.device), 0,
                                                 time.perf_counter())
        self.wait.start()

    def add(self, loss: torch.Tensor) -> None:
        """After each optimizer step, with its loss."""
        self.loss_sum += loss
        self.steps += 1

    def figures(self, loss_sum: torch.Tensor | None = None) -> dict:
        """train_loss, epoch_time_s, img_per_s and data_wait_frac of the epoch so far. ``loss_sum``
        replaces this process's sum (DDP: the mean over processes). Waits for the device first, so
        the time is true."""
        train_loss = (self.loss_sum if loss_sum is None else loss_sum).item() / self.steps
        seconds = time.perf_counter() - self.began
        return {"train_loss": train_loss, "epoch_time_s": seconds,
                "img_per_s": self.steps * self.batch_size / seconds,
                "data_wait_frac": self.wait.seconds() / seconds}


class DataWait:
    """How long each epoch waited for its training batches: from the end of one step's work to the
    batch ready for the next forward pass.

    On a CPU the host clock measures it. On a GPU the host runs ahead of the device, so the host
    clock would measure whatever the device was still busy with; CUDA events in the stream measure
    the device's time instead: the batch's own work (indexing, augmentation) plus any time the
    device sat idle waiting for the host to fetch it. Reading them waits for the device, so
    ``seconds`` is called once an epoch.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.spans, self.total, self.tick = [], 0.0, None

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


def peak_memory(accelerator) -> dict[str, list[float]]:
    """Peak memory allocated on each process's GPU since the last call, in GB, one value per
    process (gathered, so every process must call it); empty on a CPU."""
    if accelerator.device.type != "cuda":
        return {}
    peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device) / GB],
                        device=accelerator.device)
    torch.cuda.reset_peak_memory_stats(accelerator.device)
    return {"gpu_mem_peak_gb": [round(value, 3) for value in accelerator.gather(peak).tolist()]}
