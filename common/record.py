"""The run record: config.json, metrics.jsonl and the one log line every script prints."""

import json
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from common.errors import UserError

# Flags that may change between a run and its resume; any other change would make the resumed run
# a different experiment.
RESUMABLE_FLAGS = {"resume", "max_steps", "output_dir", "cache_dir", "data_dir", "keep_checkpoints", "report_to",
                   "wandb_project", "run_name", "wandb_tags", "wandb_group", "log_every",
                   "checkpoint_every", "dist_timeout", "compile"}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "torchvision", "accelerate", "datasets", "wandb"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def write_json(path: Path, obj) -> None:
    """Write JSON under a temporary name, then rename: never a half-written file."""
    partial = Path(path).with_name(f".tmp-{Path(path).name}")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(partial, path)


def git_commit() -> str | None:
    """The commit of the code that runs, when it runs from a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_config(args, derived: dict) -> dict:
    """The resolved flags, what was derived from them and the environment: config.json and wandb."""
    return {"args": vars(args), **derived, "versions": versions(), "git_commit": git_commit(),
            "command": sys.argv}


def check_resume_config(checkpoint: Path, args) -> None:
    """A resumed run must be the same experiment: same flags, except the resumable ones.

    The flags are those in config.json of the run the checkpoint belongs to.
    """
    output_dir = Path(checkpoint).parent.parent
    try:
        saved = json.loads((output_dir / "config.json").read_text())["args"]
    except (OSError, ValueError, KeyError):
        raise UserError(f"--resume: {output_dir / 'config.json'} is missing or unreadable, so the run's flags "
                        f"are unknown; start a new run") from None
    for key, value in vars(args).items():
        if key not in RESUMABLE_FLAGS and key in saved and saved[key] != value:
            flag = "--" + key.replace("_", "-")
            now, then = ("not set" if v is None else repr(v) for v in (value, saved[key]))
            raise UserError(f"--resume: {flag} is {now} but the run in {output_dir} used {then}; "
                            f"resume with the same {flag} or start a new run")


def write_metrics(output_dir: Path, history: list[dict]) -> None:
    """metrics.jsonl: one JSON object per line, rewritten whole so it always matches the checkpoint."""
    partial = Path(output_dir) / ".tmp-metrics.jsonl"
    partial.write_text("".join(json.dumps(m) + "\n" for m in history))
    os.replace(partial, Path(output_dir) / "metrics.jsonl")


# Fields only some scripts record (mixed precision, GPU memory), printed after the common ones.
OPTIONAL_FIELDS = ("loss_scale", "skipped_steps", "gpu_mem_alloc_gb", "gpu_mem_reserved_gb", "gpu_mem_peak_gb")


def log_line(m: dict) -> str:
    """The one greppable line per epoch, in the vocabulary of metrics.jsonl."""
    line = (f"epoch={m['epoch']}/{m['epochs']} step={m['step']} batch={m['batch_size']} lr={m['lr']:.4g} "
            f"train_loss={m['train_loss']:.4f} test_acc={m['test_acc']:.4f} "
            f"epoch_time_s={m['epoch_time_s']:.1f} img_per_s={m['img_per_s']:.0f} "
            f"data_wait_frac={m['data_wait_frac']:.3f}")
    for key in OPTIONAL_FIELDS:
        if key in m:  # a list holds one value per GPU: gpu_mem_peak_gb=5.21,3.02
            value = m[key]
            line += f" {key}=" + (",".join(f"{v:.2f}" for v in value) if isinstance(value, list) else f"{value:g}")
    return line
