"""What a run reports as it trains: the one log line per epoch, and the trackers (--report-to).

The log line (``log_line``) prints metrics.jsonl's values, greppable, in the same order in every
script. The trackers are Accelerate's own (wandb, TensorBoard, MLflow; together if asked) and never
in the way: started on the main process only, and each gets the run's configuration, the per-step
loss, lr and img/s and every epoch's metrics.jsonl row, at the global optimizer step.

- wandb: one run per job. Its id is kept in the training state, so --resume (and an automatic
  restart) continues the same run. Without an API key or WANDB_MODE, the run is written offline
  under --output-dir and one line says how to upload it (`wandb sync`): never a login prompt.
- TensorBoard: event files in --output-dir/tensorboard/<project>/ (TENSORBOARD_DIR), written
  offline; a resumed run adds its own file to the same folder.
- MLflow: one run per job, in the SQLite store --output-dir/mlflow.db (MLFLOW_DB) unless
  MLFLOW_TRACKING_URI says where (not MLflow's default: the working directory); its id kept too.

A tracker not installed is one warning naming its pip command (Accelerate would drop it quietly); so
is a tracking failure (a server silent past START_TIMEOUT, MLFLOW_REQUEST_TIMEOUT): training goes on
"""

import logging
import netrc
import os
import secrets
import string
import time
from contextlib import suppress
from pathlib import Path
from urllib.parse import urlsplit

import torch
from accelerate.tracking import GeneralTracker, TensorBoardTracker, get_available_trackers

from common.errors import first_line
from common.failures import MLFLOW_RUN, from_main, main_alone
from common.observe.utilisation import DataWait, GpuBusy, utilisation_figures
from common.run.record import flat_config, write_config, write_metrics

DEFAULT_PROJECT = "multigpu-cifar"
# Seconds wandb may take to start before the run goes on without it (WANDB_INIT_TIMEOUT overrides):
# the other processes wait meanwhile, so well under --dist-timeout (600 s) and wandb's own 90 s.
START_TIMEOUT = 60
MLFLOW_REQUEST_TIMEOUT = 10  # seconds an MLflow server may take to answer one request
TENSORBOARD_DIR = "tensorboard"  # under --output-dir: tensorboard --logdir RUN/tensorboard
MLFLOW_DB = "mlflow.db"  # under --output-dir: mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db
MLFLOW_ARTIFACTS = "mlflow-artifacts"  # under --output-dir: the experiment's (the scripts log none)


def has_wandb_credentials() -> bool:
    """An API key wandb would find without asking: WANDB_API_KEY, an identity token, or ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def installed_trackers(report_to: list[str]) -> list | None:
    """``Accelerator(log_with=...)`` for --report-to: the installed trackers (start_tracking warns
    of the others); None for none. TensorBoard's without its folder (start_tracking sets it): the
    run folder is known once locked (common.run.folder), after Accelerator(), which wants it."""
    available = {str(tracker) for tracker in get_available_trackers()}  # "none" is no tracker
    return [TensorBoardTracker(DEFAULT_PROJECT, logging_dir=None) if name == "tensorboard"
            else name for name in dict.fromkeys(report_to) if name in available] or None


def start_tracking(accelerator, config: dict, output_dir: Path, progress,
                   project: str | None = None, name: str | None = None,
                   tags: list[str] | None = None, group: str | None = None) -> None:
    """Start (or, on resume, continue) the job's tracker runs, those of ``accelerator.log_with``
    (installed_trackers); one that --report-to names but is not installed gets a warning line.
    ``project`` (wandb's project, MLflow's experiment, TensorBoard's folder), ``name``, ``tags`` and
    ``group`` win over WANDB_PROJECT / WANDB_NAME / WANDB_TAGS / WANDB_RUN_GROUP only when given, so
    those keep working; so do WANDB_DIR, MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME."""
    if not accelerator.is_main_process:  # Accelerate starts no tracker on the others
        return
    # log_with holds Accelerate's LoggerType for a name (str() gives it), or a tracker (its own)
    names = [t.name if isinstance(t, GeneralTracker) else str(t) for t in accelerator.log_with]
    for missing in dict.fromkeys(config.get("args", {}).get("report_to", [])):
        if missing not in (*names, "none"):  # left out by installed_trackers
            accelerator.print(f"warning: --report-to {missing} needs the {missing} package, "
                              f"which is not installed (pip install {missing}); training goes on "
                              f"without it")
    project = project or os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT)
    init, new_run, offline = {}, {}, False
    if "wandb" in names:
        init["wandb"], offline = _wandb_init(accelerator, output_dir, progress, name, tags, group)
    if "mlflow" in names:
        init["mlflow"], new_run["mlflow"] = _mlflow_init(accelerator, output_dir, progress, name)
    requested, started, failed = accelerator.log_with, [], []
    # One at a time: a failing server takes only its own tracker. Alone in accelerator.trackers,
    # as init_trackers starts all there (else a second wandb run, MLflow's "already active" refusal)
    for tracker, tracker_name in zip(requested, names):
        if isinstance(tracker, TensorBoardTracker):  # TensorBoardTracker.start joins the two
            tracker.run_name, tracker.logging_dir_param = project, str(output_dir / TENSORBOARD_DIR)
            new_run["tensorboard"] = not (output_dir / TENSORBOARD_DIR / project).exists()
        accelerator.log_with, accelerator.trackers = [tracker], []
        try:
            accelerator.init_trackers(project, config=None, init_kwargs=init)
            for new in accelerator.trackers:  # a resumed run keeps the parameters it started
                if new.name == "wandb":  # with (MLflow refuses to change one)
                    new.store_init_configuration(config)  # wandb keeps the nesting
                elif new_run[new.name]:  # TensorBoard's hparams and MLflow's params are flat
                    new.store_init_configuration(flat_config(config))
            started += accelerator.trackers
        except Exception as error:  # noqa: BLE001 - tracking must never stop training
            failed.append(f"{tracker_name} did not start ({first_line(error)})")
            _drop(accelerator, accelerator.trackers)
    accelerator.log_with, accelerator.trackers = requested, started
    for why in failed:
        accelerator.print(f"warning: {why}; training goes on without "
                          f"{'it' if accelerator.trackers else 'tracking'}")
    running = [tracker.name for tracker in accelerator.trackers]  # the main process's
    if "mlflow" in running:  # MLflow chose it: kept for --resume
        progress.mlflow_run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    _say_where(accelerator, running, output_dir, project, offline and "wandb" in running)


def start_run(accelerator, script: str, args, config: dict, output_dir: Path, progress,
              where: str, data_line: str) -> None:
    """A run's start: config.json (once per run, common.run.record.write_config), its trackers
    started or continued (start_tracking, with --wandb-project, --run-name, --wandb-tags and
    --wandb-group) and its first line (start_line). A collective: every process must call it."""
    write_config(accelerator, output_dir, config)
    with main_alone(accelerator, "trackers-started", 2 * START_TIMEOUT):  # beyond --dist-timeout
        start_tracking(accelerator, config, output_dir, progress, project=args.wandb_project,
                       name=args.run_name, tags=args.wandb_tags, group=args.wandb_group)
    mlflow = [(t.active_run.info.run_id, os.environ["MLFLOW_TRACKING_URI"])  # all end it
              for t in accelerator.trackers if t.name == "mlflow"]  # (common.failures.end_tracking)
    MLFLOW_RUN[:] = from_main(accelerator, mlflow[0] if mlflow else ())
    accelerator.print(start_line(script, where, config, data_line, output_dir))


def _wandb_init(accelerator, output_dir: Path, progress, name, tags, group) -> tuple[dict, bool]:
    """wandb.init's arguments: the run id (chosen here the first time); and whether the run is
    offline because no API key is configured (WANDB_MODE is then set)."""
    offline = not os.environ.get("WANDB_MODE") and not has_wandb_credentials()
    if offline:
        os.environ["WANDB_MODE"] = "offline"  # wandb would otherwise prompt for a login, or fail
    if progress.tracker_run_id is None:
        # Chosen here, not by wandb, so that it is in the first checkpoint; wandb's format. Its
        # generate_id is internal from wandb 0.31 (wandb.sdk.lib.runid): not tied to that path.
        progress.tracker_run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                          for _ in range(8))
    init = {"id": progress.tracker_run_id, "resume": "allow",
            "dir": os.environ.get("WANDB_DIR", str(output_dir))}
    if not os.environ.get("WANDB_INIT_TIMEOUT"):  # the other processes wait for this one meanwhile
        init["settings"] = {"init_timeout": START_TIMEOUT}
    if os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        accelerator.print(f"wandb: starting its run online (a server that does not answer costs "
                          f"{os.environ.get('WANDB_INIT_TIMEOUT', START_TIMEOUT)} s, then training "
                          f"goes on without it)")
    init |= {k: v for k, v in {"name": name, "tags": tags, "group": group}.items() if v}
    return init, offline


def _mlflow_init(accelerator, output_dir: Path, progress, name) -> tuple[dict, bool]:
    """MLflowTracker's arguments, and whether its run is new: the run to continue, if any, and
    the store in the run folder unless MLFLOW_TRACKING_URI says where."""
    init = {"run_id": progress.mlflow_run_id, "run_name": name}
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")):
        # A server that did not answer held a job 252 s (MLflow: 120 s a request, 7 retries) while
        # the others waited in a collective: bounded like wandb's start, unless the user set them
        wait = float(os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT",
                                           str(MLFLOW_REQUEST_TIMEOUT)))
        tries = 1 + int(os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"))
        accelerator.print(f"mlflow: starting its run at {uri} (one that does not answer costs "
                          f"about {tries * wait + 3:g} s, then training goes on)")
    # a new store's INFO ("Creating initial MLflow database tables...") would precede the start line
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    if not uri:
        # MLflow 3's default is sqlite:///mlflow.db in the working directory (full mlflow only).
        os.environ["MLFLOW_TRACKING_URI"] = run_folder_mlflow_uri(output_dir)
        # Where a new experiment keeps its artifacts; an existing one keeps its own place.
        init["logging_dir"] = str(output_dir.resolve() / MLFLOW_ARTIFACTS)
    return init, progress.mlflow_run_id is None and not os.environ.get("MLFLOW_RUN_ID")


def run_folder_mlflow_uri(output_dir: Path) -> str:
    """The MLflow store in the run folder: a SQLite file (MLflow 3 refuses its old ./mlruns file
    store unless MLFLOW_ALLOW_FILE_STORE=true)."""
    return f"sqlite:///{Path(output_dir).resolve() / MLFLOW_DB}"


def _say_where(accelerator, names: list[str], output_dir: Path, project: str, offline: bool):
    """One line for each tracker that writes into the run folder unasked: where, how to see it."""
    if offline:
        run_dir = Path(accelerator.get_tracker("wandb", unwrap=True).dir).parent
        accelerator.print(f"wandb: no API key configured, so this run is logged offline to "
                          f"{run_dir}; upload it with: wandb sync {run_dir}")
    if "tensorboard" in names:
        accelerator.print(f"tensorboard: events in {output_dir / TENSORBOARD_DIR / project}; "
                          f"see them with: tensorboard --logdir {output_dir / TENSORBOARD_DIR}")
    uri = run_folder_mlflow_uri(output_dir)
    if "mlflow" in names and os.environ.get("MLFLOW_TRACKING_URI") == uri:
        accelerator.print(f"mlflow: run in {uri}; see it with: mlflow ui --backend-store-uri {uri}")


def track(accelerator, values: dict, step: int) -> None:
    """Log ``values`` at the global optimizer ``step`` (main process); lists as key/0, key/1..."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, (list, tuple)):
            flat.update({f"{key}/{i}": v for i, v in enumerate(value)})
        elif isinstance(value, (int, float)):
            flat[key] = value
    try:
        accelerator.log(flat, step=step)
    except Exception as error:  # noqa: BLE001 - tracking must never stop training
        names = " and ".join(tracker.name for tracker in accelerator.trackers)
        accelerator.print(f"warning: {names} failed to log ({first_line(error)}); training goes "
                          f"on without tracking")
        _drop(accelerator, accelerator.trackers)


def record_epoch(accelerator, output_dir: Path, history: list[dict], metrics: dict) -> None:
    """An epoch's ``metrics``, appended to ``history``: metrics.jsonl, the log line and wandb."""
    history.append(metrics)
    if accelerator.is_main_process:
        write_metrics(output_dir, history)
    accelerator.print(log_line(metrics))
    track(accelerator, metrics, step=metrics["step"])


class StepLogger:
    """Per-step loss, lr and throughput, every ``every`` optimizer steps: only then is
    ``loss.item()``, which waits for the device, read."""

    def __init__(self, accelerator, every: int, batch_size: int):
        self.accelerator, self.every, self.batch_size = accelerator, every, batch_size
        self.last_step, self.last_time = None, time.perf_counter()

    def log(self, step: int, loss, lr: float) -> None:
        if not self.accelerator.trackers or step % self.every:  # none but on the main process
            return
        now = time.perf_counter()
        values = {"train/loss": loss.item(), "train/lr": lr}
        if self.last_step is not None:  # the first interval would include start-up time
            values["train/img_per_s"] = ((step - self.last_step) * self.batch_size
                                         / (now - self.last_time))
        track(self.accelerator, values, step)
        self.last_step, self.last_time = step, now


def _drop(accelerator, trackers: list) -> None:
    """``trackers`` finished as well as they can, and logged to no more."""
    for tracker in trackers:
        with suppress(Exception):  # already failing; nothing more to report
            tracker.finish()
    accelerator.trackers = [t for t in accelerator.trackers if t not in trackers]


# Fields only some scripts record (mixed precision, GPU memory), printed after the common ones.
OPTIONAL_FIELDS = ("loss_scale", "skipped_steps", "gpu_mem_alloc_gb", "gpu_mem_reserved_gb",
                   "gpu_mem_peak_gb", "gpu_util_pct")


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
    of which ``data_line`` (common.data.inputs.Inputs.line) says the resolution and the loader."""
    args = config["args"]
    precision = f"{config['mixed_precision']} " if "mixed_precision" in config else ""
    accumulated = f" x {config['grad_accum']} micro-batches" if config["grad_accum"] > 1 else ""
    batch = (f"batch {config['global_batch_size']} "
             f"({config['per_device_batch_size']} per device{accumulated})")
    numerics = f"fp32 math {config['fp32_precision']}{' (deterministic)' * args['deterministic']}"
    data = f"{config['train_size']} training images ({config['data']}), {data_line}"
    steps = f"{config['steps_per_epoch']} steps/epoch, {config['total_steps']} steps in all"
    tuned = config.get("fine_tune", {})  # --pretrained(-path), --compile, --share-gpus: lines
    notes = (tuned.get("loaded"), tuned.get("frozen"), config.get("compile"),  # of their own
             config.get("gpu_sharing"))  # --share-gpus: what a rehearsal proves and does not
    notes = "".join(f"\n  {note}" for note in notes if note)  # indented: the same line's
    if config.get("backend"):  # several processes: their collectives' backend
        where = f"{where} ({config['backend']})"
    return (f"{script}: {precision}{args['model']} on {where}, {batch}, lr {config['lr']:g}, "
            f"{numerics}, {data}, {steps}, record in {output_dir}{notes}")


class EpochMeter:
    """One epoch's figures for its log line and metrics.jsonl: the training loss, the time, images
    per second, the share of it spent waiting for batches (``wait``, a DataWait) and each GPU's
    utilisation (common.observe.utilisation): of ``gpus`` (DataParallel's), else of the training
    device if it is one. The loss is summed on the device and read once, at the epoch's end."""

    def __init__(self, device: torch.device, batch_size: int, gpus: list | None = None):
        self.device, self.batch_size, self.wait = device, batch_size, DataWait(device)
        own = [device] if device.type == "cuda" else []
        self.busy = GpuBusy(own if gpus is None else gpus)  # each GPU's utilisation, read by NVML

    def start(self) -> None:
        """Before the epoch's first batch."""
        self.loss_sum, self.steps, self.began = (torch.zeros((), device=self.device), 0,
                                                 time.perf_counter())
        self.wait.start()
        self.busy.restart()

    def add(self, loss: torch.Tensor) -> None:
        """After each optimizer step, with its loss."""
        self.loss_sum += loss
        self.steps += 1

    def figures(self, loss_sum: torch.Tensor | None = None) -> dict:
        """train_loss, epoch_time_s, img_per_s and data_wait_frac so far. ``loss_sum`` replaces this
        process's sum (DDP: the processes' mean). Waits for the device first: the time is true."""
        train_loss = (self.loss_sum if loss_sum is None else loss_sum).item() / self.steps
        seconds = time.perf_counter() - self.began
        return {"train_loss": train_loss, "epoch_time_s": seconds,
                "img_per_s": self.steps * self.batch_size / seconds,
                "data_wait_frac": self.wait.seconds() / seconds,
                **utilisation_figures(self.busy)}  # a collective with several processes
