"""The run record: config.json and metrics.jsonl, and the check that a resume is the same run."""

import json
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from accelerate.state import AcceleratorState

from common.errors import UserError
from common.failures import fail_together, from_main, why_not_written
from common.files import atomic_write, write_json
from common.recipe.compiling import compile_line


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "torchvision", "accelerate", "datasets", "wandb"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def git_commit() -> str | None:
    """The commit of the code that runs, when it runs from a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_config(flags: dict, derived: dict) -> dict:
    """The resolved flags, what was derived from them and the environment: config.json and wandb.
    What --compile does on the device (``derived["device"]``), from the plugin prepare() uses."""
    plugin = AcceleratorState().dynamo_plugin.to_dict()  # Accelerator() made it: never None
    compiled = compile_line(flags, derived.get("device", ""), plugin["backend"], plugin["mode"])
    return {"args": flags, **derived, **({"compile": compiled} if compiled else {}),
            "versions": versions(), "git_commit": git_commit(), "command": sys.argv}


# What makes a run the experiment it is beyond its flags (the batch size is one): a moved --data-dir
# must hold the same data. The precision (the Accelerate config may set it) is compared on its own.
SAME_ON_RESUME = ("classes", "image_size", "normalization", "interpolation", "train_size", "loader",
                  "eval_split")


def _precision(config: dict) -> str:
    """The mixed precision a run trains in: train_amp.py records it; earlier versions of train_dp.py
    had it as a flag; every other run is fp32 (Accelerate's "no")."""
    precision = config.get("mixed_precision") or config.get("args", {}).get("mixed_precision")
    return "fp32" if precision in (None, "no") else precision


def check_resume_config(checkpoint: Path, config: dict, resumable: set[str]) -> None:
    """A resumed run must be the same experiment as the run the checkpoint belongs to (its
    config.json): the same flags (``config["args"]``, dest: value) except those in ``resumable``,
    the same mixed precision, and the same SAME_ON_RESUME values where both runs record them."""
    output_dir = Path(checkpoint).parent.parent
    try:
        saved = json.loads((output_dir / "config.json").read_text())
        if not isinstance(saved_flags := saved["args"], dict):  # flag: value
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--resume: {output_dir / 'config.json'} is missing or unreadable, so the "
                        f"run's flags are unknown; start a new run") from None
    for key, value in config["args"].items():
        if key not in resumable and key in saved_flags and saved_flags[key] != value:
            flag = "--" + key.replace("_", "-")
            now, then = (f"{flag} {v!r}" if v is not None else f"no {flag}"
                         for v in (value, saved_flags[key]))
            raise UserError(f"--resume: this run has {now} but the run in {output_dir} had {then}; "
                            f"resume with the flags of that run, or start a new run")
    if _precision(saved) != _precision(config):
        raise UserError(f"--resume: the run in {output_dir} trained in {_precision(saved)} but "
                        f"this one would train in {_precision(config)}; "
                        f"resume with the script and precision of that run, or start a new run")
    for key in SAME_ON_RESUME:
        if key in saved and key in config and saved[key] != config[key]:
            raise UserError(f"--resume: this run's {key} would be {config[key]!r} but the run in "
                            f"{output_dir} had {saved[key]!r}; resume with the data and the "
                            f"settings of that run, or start a new run")


# metrics.jsonl that the main process could not write, said by the next collective step
# (save_checkpoint, which follows every epoch's record): only the main process writes it, and the
# others, already on their way to that step, would wait there for it until --dist-timeout.
_unwritten = None


def write_metrics(output_dir: Path, history: list[dict]) -> None:
    """metrics.jsonl: one JSON object per line, rewritten whole so it always matches the
    checkpoint. A write that fails leaves the previous file and is reported by the next
    checkpoint (``unwritten_metrics``), on every process."""
    global _unwritten
    path = Path(output_dir) / "metrics.jsonl"
    try:
        with atomic_write(path) as f:
            f.write("".join(json.dumps(m) + "\n" for m in history).encode())
    except Exception as error:  # noqa: BLE001 - a full disk, whatever raises it
        epoch = f" after epoch {history[-1].get('epoch')}" if history else ""
        _unwritten = f"cannot write {path} ({why_not_written(error, path)}){epoch}"


def unwritten_metrics() -> str | None:
    """The line for metrics.jsonl not written since the last call (None: it was)."""
    global _unwritten
    failure, _unwritten = _unwritten, None
    return failure


def write_config(accelerator, output_dir: Path, config: dict) -> None:
    """config.json, by the main process, once per run: a resumed run keeps the record of the run
    it continues. A failed write stops every process with one line."""
    path = Path(output_dir) / "config.json"
    failure = None
    if accelerator.is_main_process and not path.exists():
        try:
            write_json(path, config)
        except Exception as error:  # noqa: BLE001
            failure = (f"cannot write {path} ({why_not_written(error, path)}): free space in "
                       f"{output_dir}, then run the same command again")
    if (failure := from_main(accelerator, failure)) is not None:
        fail_together(accelerator, failure)


def done_line(step: int, history: list[dict], weights: Path) -> str:
    """The run's last line: its step, the test accuracy of the weights it names (with --ema-decay
    the average's, which model.safetensors holds and evaluate.py reproduces), where they are."""
    if not history:
        return f"done: step {step} - weights in {weights}"
    last = history[-1]
    accuracy = (f"test_acc_ema {last['test_acc_ema']:.4f} (the weight average, saved; the trained "
                f"weights' test_acc {last['test_acc']:.4f})" if "test_acc_ema" in last else
                f"test_acc {last['test_acc']:.4f}")
    return f"done: step {step}, {accuracy} - weights in {weights}"


# MLflow's longest param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH): Accelerate would
# drop a longer one (1,000 class names) with a warning that prints it whole; config.json has it all.
MAX_PARAM_CHARS = 6000


def flat_config(config: dict, prefix: str = "") -> dict:
    """``config`` as the flat values TensorBoard's hparams and MLflow's params take: nested keys
    joined by "/", lists as text, None left out, text cut to MAX_PARAM_CHARS."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}/"))
        elif value is not None:
            value = value if isinstance(value, (bool, int, float)) else str(value)
            too_long = isinstance(value, str) and len(value) > MAX_PARAM_CHARS
            flat[f"{prefix}{key}"] = value[:MAX_PARAM_CHARS - 3] + "..." if too_long else value
    return flat
