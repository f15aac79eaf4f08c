"""What the tests share: running the scripts as a user does, and reading what they leave."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Small enough for 2 CPU cores: 1,024 images at batch 64 is 16 steps an epoch, at the peak lr of 0.1
# (--lr tuned for batch 64: the linear scaling rule leaves it as it is).
DATA = ["--dataset", "synthetic", "--synthetic-train-size", "1024", "--synthetic-test-size", "300"]
TINY = [*DATA, "--model", "resnet20", "--batch-size", "64", "--reference-batch-size", "64", "--epochs", "3"]


def user_env(**extra) -> dict:
    """The environment of a user who never logged in to wandb: no WANDB_* variable, no API key in
    ~/.netrc (HOME is an empty folder), so runs are tracked offline by default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    home = Path(tempfile.gettempdir()) / "multigpu-cifar-test-home"
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), **extra}


def run(script, *args, env_extra=None, cwd=ROOT, launcher=(sys.executable,), check=True, timeout=300):
    """Run scripts/<script> with ``launcher`` (python, torchrun, accelerate launch ...)."""
    env = user_env(CIFAR_CACHE_DIR=str(Path(cwd) / ".cache"), **(env_extra or {}))
    done = subprocess.run([*launcher, str(ROOT / "scripts" / script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise AssertionError(f"{script} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def make(target, *variables, cwd, dry_run=False, env_extra=None, timeout=600):
    """Run a target of the project's Makefile as the README gives it, in this suite's virtual
    environment (-o: counted as installed, which `make test` did), with VARIABLE=value settings."""
    venv = Path(sys.prefix)
    command = ["make", *(["-n"] if dry_run else []), "-C", str(ROOT), "-o", f"{venv}/bin/.installed",
               f"VENV={venv}", target, *variables]
    env = user_env(CIFAR_CACHE_DIR=str(Path(cwd) / ".cache"), OMP_NUM_THREADS="1", **(env_extra or {}))
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def weights(run_dir):
    return load_file(str(Path(run_dir) / "model.safetensors"))


def wandb_runs(run_dir: Path) -> list[Path]:
    """The offline wandb run folders a run left next to its record."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"))
