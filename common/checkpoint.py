"""The run folder and its files: config.json, metrics.jsonl, checkpoints, the final weights.

Every file is written under a temporary name and renamed into place (``atomic_write``), so a
process killed while writing leaves the previous file or checkpoint intact, where writing in place
would leave a half-written checkpoint that the next --resume would pick.
"""

import errno
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import safetensors.torch
import torch
from accelerate.utils import broadcast_object_list
from safetensors.torch import load_file

from common.errors import UserError, first_line

CHECKPOINT_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP and torch.compile wrappers


def new_run_dir(script: str, root: str = "runs") -> Path:
    """A folder name no earlier run has used: runs/<script>-<date>-<time>[-N]."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path(root) / f"{script}-{stamp}", 1
    while path.exists():
        n += 1
        path = Path(root) / f"{script}-{stamp}-{n}"
    return path


def resolve_run(accelerator, output_dir: str | None, resume: str | None, script: str) -> tuple[Path, Path | None]:
    """The run folder, and the checkpoint to continue from (None: a fresh start).

    ``resume`` is None, "latest" (the newest complete checkpoint of ``output_dir``) or a checkpoint
    folder, whose run folder is then the default ``output_dir``. A worker restarted by torchrun
    (``accelerate launch --max_restarts N``) continues from the newest checkpoint by itself.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    given = Path(resume) if resume not in (None, "latest") else None
    if output_dir is None and given is None and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise UserError("a restartable launch (--max_restarts) needs --output-dir, so that a restarted worker "
                        "finds the run's checkpoints: add --output-dir runs/NAME")
    if resume == "latest" and output_dir is None:
        raise UserError("--resume needs --output-dir (the folder of the run to continue) or a checkpoint: "
                        "--resume runs/NAME/checkpoints/step_NNNNNNNN")
    if output_dir:
        path = Path(output_dir)
    elif given is not None:
        path = given.parent.parent  # runs/NAME/checkpoints/step_N
    else:
        path = new_run_dir(Path(script).stem)
    path = Path(broadcast_object_list([str(path)])[0])  # processes started a second apart must agree
    if given is not None:
        if not given.is_dir() or not _STEP_DIR.match(given.name):
            raise UserError(f"--resume {given}: not a checkpoint folder; pass runs/NAME/checkpoints/step_NNNNNNNN "
                            f"or --resume alone for the newest checkpoint of --output-dir")
        checkpoint = given
        if path != given.parent.parent:
            check_output_dir(path, resume=None)  # continuing elsewhere: never into another run
    elif restarted and latest_checkpoint(path) is not None:
        checkpoint = latest_checkpoint(path)
    elif restarted:
        checkpoint = None  # the worker died before the first checkpoint: start again in the same folder
    else:
        check_output_dir(path, resume)
        checkpoint = latest_checkpoint(path) if resume else None
    accelerator.wait_for_everyone()  # every process has checked before the main one writes anything
    return path, checkpoint  # created with the first file written into it, so bad input leaves nothing


def check_output_dir(output_dir: Path, resume: str | None) -> None:
    """Never overwrite a run silently: a used folder needs --resume, --resume needs a checkpoint."""
    if resume:
        if not output_dir.is_dir():
            raise UserError(f"--resume: {output_dir} does not exist; pass the --output-dir of the run "
                            f"to continue")
        if latest_checkpoint(output_dir) is None:
            raise UserError(f"--resume: no complete checkpoint in {output_dir / CHECKPOINT_DIR}; "
                            f"start a new run without --resume")
    elif output_dir.exists() and any(output_dir.iterdir()):
        what = "a run" if (output_dir / "config.json").exists() else "files"
        raise UserError(f"--output-dir {output_dir} already holds {what}: add --resume to continue it, "
                        f"or choose another --output-dir")


def latest_checkpoint(output_dir: Path, up_to: int | None = None) -> Path | None:
    """The complete checkpoint with the highest step (at most ``up_to``); unfinished temporary
    folders do not count."""
    folder = Path(output_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (up_to is None or int(m.group(1)) <= up_to)]
    return max(steps)[1] if steps else None


def save_checkpoint(accelerator, output_dir: Path, step: int, keep: int) -> Path:
    """Full training state (model, optimizer, scheduler, RNGs, registered objects) at ``step``.

    Every process must call this: save_state writes each process's RNG state and waits for all of
    them (under ``if is_main_process`` it would hang). The main process then renames the finished
    folder into place and removes the oldest checkpoints beyond ``keep``.
    """
    folder = Path(output_dir) / CHECKPOINT_DIR
    final, partial = folder / f"step_{step:08d}", folder / f".tmp-step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # a leftover from a process killed while saving
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(partial))
        if accelerator.is_main_process:
            _fsync_tree(partial)
    except OSError as error:  # a full disk, a quota: keep the previous checkpoint and say so
        shutil.rmtree(partial, ignore_errors=True)
        previous = latest_checkpoint(output_dir)
        raise UserError(f"cannot write checkpoint {final} ({error.strerror or error}); the previous one, "
                        f"{previous or 'none yet'}, is intact: free space in {folder.parent} and --resume") from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _fsync_dir(folder)
        older = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)))
        for _, path in older[:-keep]:
            shutil.rmtree(path)
    accelerator.wait_for_everyone()
    return final


def save_weights(model: torch.nn.Module, path: Path, metadata: dict) -> None:
    """The final weights as a plain state dict in safetensors: loads into an unwrapped model.

    ``metadata`` is what evaluation needs besides the weights (the model name, the class names, the
    normalisation, the input size); values that are not strings are stored as JSON (read_metadata).
    """
    state = {k: v.detach().cpu().contiguous() for k, v in strip_wrapper_prefixes(model.state_dict()).items()}
    text = {key: value if isinstance(value, str) else json.dumps(value) for key, value in metadata.items()}
    with atomic_write(path) as f:
        f.write(safetensors.torch.save(state, metadata=text))


def read_metadata(path: Path) -> dict:
    """The metadata save_weights stored in a .safetensors file, JSON values decoded; empty for
    other files and for files without metadata."""
    if Path(path).suffix != ".safetensors":
        return {}
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            stored = f.metadata() or {}
    except Exception:  # noqa: BLE001 - an unreadable file is reported by load_weights
        return {}
    decoded = {}
    for key, value in stored.items():
        try:
            decoded[key] = json.loads(value)
        except ValueError:
            decoded[key] = value  # a plain string, e.g. the model name
    return decoded


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from our safetensors or from a torch.save'd file of another script.

    Accepts a plain state dict, one nested under "state_dict" or "model", and keys prefixed with
    ``module.`` (saved from a DataParallel/DDP-wrapped model) or ``_orig_mod.`` (torch.compile).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--weights {path}: no such file")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise UserError(f"--weights {path}: cannot read it ({type(error).__name__}: {error}); pass a "
                        f".safetensors file or a torch.save'd state dict") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"--weights {path}: not a state dict of tensors")
    return strip_wrapper_prefixes(state)


def strip_wrapper_prefixes(state: dict) -> dict:
    """Remove the key prefixes that DataParallel/DDP (``module.``) and torch.compile add."""
    def clean(key: str) -> str:
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        return key
    return {clean(k): v for k, v in state.items()}


@contextmanager
def atomic_write(path: Path):
    """Open a new file for ``path`` in binary mode; on success it reaches the disk and replaces
    ``path`` in one rename, on failure it is removed. Readers see the old file or the whole new one.

        with atomic_write(output_dir / "config.json") as f:
            f.write(text.encode())
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One temporary name per file: a leftover of a killed writer is overwritten, not piled up. Each
    # file has one writer at a time (the main process; the data cache holds a file lock).
    partial = path.with_name(f".tmp-{path.name}")
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself reaches the disk


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:  # some network and FUSE filesystems cannot sync a folder; their renames stand
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            _fsync_file(Path(root) / name)
        _fsync_dir(Path(root))


class TrainProgress:
    """Where training stands, saved in every checkpoint (``accelerator.register_for_checkpointing``).

    ``step`` counts optimizer steps over the whole run; ``batch_in_epoch`` lets a resumed run skip
    the batches of the current epoch it has already trained on; ``history`` holds the metrics of
    finished epochs, so metrics.jsonl can be rewritten to match the checkpoint being resumed;
    ``tracker_run_id`` is the wandb run a resumed job keeps logging to.
    """

    def __init__(self):
        self.epoch, self.step, self.batch_in_epoch, self.history = 0, 0, 0, []
        self.tracker_run_id = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "batch_in_epoch": self.batch_in_epoch,
                "history": self.history, "tracker_run_id": self.tracker_run_id}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.batch_in_epoch, self.history = state["batch_in_epoch"], list(state["history"])
        self.tracker_run_id = state.get("tracker_run_id")


# ----------------------------------------------------------------------------------------------
# config.json and metrics.jsonl

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
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_config(flags: dict, derived: dict) -> dict:
    """The resolved flags, what was derived from them and the environment: config.json and wandb."""
    return {"args": flags, **derived, "versions": versions(), "git_commit": git_commit(), "command": sys.argv}


def write_json(path: Path, obj) -> None:
    with atomic_write(path) as f:
        f.write((json.dumps(obj, indent=2) + "\n").encode())


# What makes a run the experiment it is beyond its flags (the batch size is one): a moved --data-dir
# must hold the same data. The precision, which the Accelerate config may set, is compared on its own.
SAME_ON_RESUME = ("classes", "image_size", "normalization", "train_size", "loader", "eval_split")


def _precision(config: dict) -> str:
    """The mixed precision a run trains in: train_amp.py records it; earlier versions of train_dp.py
    had it as a flag; every other run is fp32 ("no")."""
    return config.get("mixed_precision") or config.get("args", {}).get("mixed_precision") or "no"


def check_resume_config(checkpoint: Path, config: dict, resumable: set[str]) -> None:
    """A resumed run must be the same experiment as the run the checkpoint belongs to (its
    config.json): the same flags (``config["args"]``, dest: value) except those in ``resumable``, the
    same mixed precision, and the same SAME_ON_RESUME values where both runs record them."""
    output_dir = Path(checkpoint).parent.parent
    try:
        saved = json.loads((output_dir / "config.json").read_text())
        saved_flags = saved["args"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--resume: {output_dir / 'config.json'} is missing or unreadable, so the run's flags "
                        f"are unknown; start a new run") from None
    for key, value in config["args"].items():
        if key not in resumable and key in saved_flags and saved_flags[key] != value:
            flag = "--" + key.replace("_", "-")
            now, then = ("not set" if v is None else repr(v) for v in (value, saved_flags[key]))
            raise UserError(f"--resume: {flag} is {now} but the run in {output_dir} used {then}; "
                            f"resume with the same {flag} or start a new run")
    if _precision(saved) != _precision(config):
        raise UserError(f"--resume: the run in {output_dir} trained in mixed precision {_precision(saved)} but this "
                        f"one would train in {_precision(config)}; resume with the script and precision of that "
                        f"run, or start a new run")
    for key in SAME_ON_RESUME:
        if key in saved and key in config and saved[key] != config[key]:
            raise UserError(f"--resume: this run's {key} would be {config[key]!r} but the run in {output_dir} "
                            f"had {saved[key]!r}; resume with the data and the settings of that run, or start "
                            f"a new run")


def load_checkpoint(accelerator, checkpoint: Path) -> None:
    """accelerator.load_state, with one line when the checkpoint does not fit this script."""
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as error:  # noqa: BLE001 - whatever Accelerate or torch met, one line and what to do
        raise UserError(f"--resume: cannot load {checkpoint} ({first_line(error)}); it was written by another "
                        f"script or version of it: resume with that one, or start a new run") from None


def write_metrics(output_dir: Path, history: list[dict]) -> None:
    """metrics.jsonl: one JSON object per line, rewritten whole so it always matches the checkpoint."""
    with atomic_write(Path(output_dir) / "metrics.jsonl") as f:
        f.write("".join(json.dumps(m) + "\n" for m in history).encode())
