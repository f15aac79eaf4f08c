"""Checkpoints: when the training state is saved, writing it whole, finding the newest complete one.

A checkpoint is one folder ``checkpoints/step_N`` of Accelerate's ``save_state``, written under a
temporary name and renamed into place once every file is on the disk, so a process killed while
saving leaves the previous checkpoint intact. Each ends with checkpoint.json, the list of its files
and their sizes, which --resume checks before it trusts one (a copy that lost a file, a disk that
filled). ``Checkpointer`` decides the cadence: the training loop calls its ``save`` after every
step.
"""

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

from common.errors import UserError, first_line
from common.files import fsync_dir, fsync_tree, write_json
from common.run_record import check_resume_config

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "checkpoint.json"  # a checkpoint's files and sizes, written last
STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(output_dir: Path, up_to: int | None = None) -> Path | None:
    """The checkpoint with the highest step (at most ``up_to``), by its name only; unfinished
    temporary folders do not count. ``latest_good_checkpoint`` also checks its files."""
    steps = _checkpoints(output_dir, up_to)
    return steps[0] if steps else None


def _checkpoints(output_dir: Path, up_to: int | None = None) -> list[Path]:
    """The checkpoint folders (step_N) at most at step ``up_to``, the newest first."""
    folder = Path(output_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := STEP_DIR.match(p.name)) and (up_to is None or int(m.group(1)) <= up_to)]
    return [p for _, p in sorted(steps, reverse=True)]


def latest_good_checkpoint(output_dir: Path,
                           up_to: int | None = None) -> tuple[Path | None, dict[Path, str]]:
    """The newest checkpoint that ``checkpoint_problem`` passes (None if there is none), and the
    problem of each newer one, which it does not."""
    damaged = {}
    for checkpoint in _checkpoints(output_dir, up_to):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, damaged
        damaged[checkpoint] = problem
    return None, damaged


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What makes a checkpoint folder unusable, naming the file ("optimizer.bin is missing"); None
    when it is complete.

    Every file its checkpoint.json lists must be there with the size it was written with, and read
    as what it is: a safetensors header that accounts for the whole file, the zip directory at the
    end of a torch.save file. That costs a few small reads whatever the size of the checkpoint;
    checksums would read every byte (gigabytes of optimizer state) at each resume, for bit flips
    that the storage's own checksums catch. Checkpoints of earlier versions, without
    checkpoint.json, are checked against what save_state writes for the scripts: the model,
    optimizer, scheduler, the RNG state of each process and the training progress.
    """
    checkpoint = Path(checkpoint)
    try:
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
        files = {str(name): int(size) for name, size in files.items()}
    except FileNotFoundError:
        try:
            files = _files_save_state_writes(checkpoint)
        except OSError as error:
            return f"the folder cannot be read ({error.strerror})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is unreadable"
    for name, size in files.items():
        problem = _file_problem(checkpoint / name, size)
        if problem:
            return f"{name} {problem}"
    return None


def _files_save_state_writes(checkpoint: Path) -> dict[str, int | None]:
    """For a checkpoint without checkpoint.json: the files Accelerate's save_state writes for the
    scripts (accelerate/checkpointing.py), and any other state file in the folder; sizes unknown."""
    names = {p.name for p in checkpoint.iterdir()}
    model = ("pytorch_model.bin" if "pytorch_model.bin" in names
             else "model.safetensors")  # safe_serialization
    processes = 1 + max((int(m.group(1)) for n in names
                         if (m := re.fullmatch(r"random_states_(\d+)\.pkl", n))), default=0)
    expected = [model, "optimizer.bin", "scheduler.bin",
                *(f"random_states_{i}.pkl" for i in range(processes)),
                "custom_checkpoint_0.pkl"]  # TrainProgress
    others = sorted(n for n in names
                    if n.endswith((".bin", ".pkl", ".pt", ".safetensors")) and n not in expected)
    return dict.fromkeys([*expected, *others])


def _file_problem(path: Path, size: int | None) -> str | None:
    try:
        actual = path.stat().st_size
        if size is not None and actual != size:
            return f"has {actual} bytes where {size} were written"
        with open(path, "rb") as f:
            return _content_problem(f, actual, path.suffix)
    except FileNotFoundError:
        return "is missing"
    except OSError as error:
        return f"cannot be read ({error.strerror})"


def _content_problem(f, size: int, suffix: str) -> str | None:
    """A cut or garbled file, from its structure: the safetensors header (an 8-byte length, then
    JSON giving every tensor's byte range) or the zip directory at the end of a torch.save file."""
    head = f.read(8)
    if suffix == ".safetensors":
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        try:
            if not 0 < length <= size - 8:
                raise ValueError
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "is not a complete safetensors file"
        if 8 + length + end != size:
            return (f"is not a complete safetensors file ({size} bytes where its header gives "
                    f"{8 + length + end})")
    elif head.startswith(b"PK\x03\x04"):  # torch.save's format since torch 1.6
        f.seek(0)
        try:
            zipfile.ZipFile(f).close()
        except (zipfile.BadZipFile, ValueError, EOFError):
            return "is cut short or corrupt (its zip directory does not read)"
    elif size == 0:
        return "is empty"
    return None


def save_checkpoint(accelerator, output_dir: Path, step: int, keep: int) -> Path:
    """Full training state (model, optimizer, scheduler, RNGs, registered objects) at ``step``.

    Every process must call this: save_state writes each process's RNG state and waits for all of
    them (under ``if is_main_process`` it would hang). The main process then lists the files in
    checkpoint.json, renames the finished folder into place and removes the oldest checkpoints
    beyond ``keep``.
    """
    folder = Path(output_dir) / CHECKPOINT_DIR
    final, partial = folder / f"step_{step:08d}", folder / f".tmp-step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # a leftover from a process killed while saving
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(partial))
        # every process's RNG state is written before the list is made
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            files = {p.relative_to(partial).as_posix(): p.stat().st_size
                     for p in sorted(partial.rglob("*")) if p.is_file()}
            # last: it lists all the others
            write_json(partial / MANIFEST, {"step": step, "files": files})
            fsync_tree(partial)
    except OSError as error:  # a full disk, a quota: keep the previous checkpoint and say so
        shutil.rmtree(partial, ignore_errors=True)
        previous = latest_checkpoint(output_dir)
        raise UserError(f"cannot write checkpoint {final} ({error.strerror or error}); the "
                        f"previous one, {previous or 'none yet'}, is intact: free space in "
                        f"{folder.parent} and --resume") from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        fsync_dir(folder)
        # Newer ones than this (left by a run resumed from an older checkpoint, a damaged one among
        # them) are not counted: they are replaced when this run reaches their step.
        for path in _checkpoints(output_dir, up_to=step)[keep:]:
            shutil.rmtree(path)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, checkpoint: Path) -> None:
    """accelerator.load_state, with one line when the checkpoint does not fit this script."""
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as error:  # noqa: BLE001
        # whatever Accelerate or torch met, one line and what to do
        raise UserError(f"--resume: cannot load {checkpoint} ({first_line(error)}); it was written "
                        f"by another script or version of it: resume with that one, or start a "
                        f"new run") from None


def resume_from(accelerator, checkpoint: Path | None, progress: "TrainProgress", config: dict,
                resumable: set[str]) -> None:
    """Continue the run of ``checkpoint`` (None: nothing to continue): check that this run is the
    same experiment (its flags except ``resumable``, its data), load the training state into
    everything prepared and registered, and forget the metrics of an epoch saved only in part."""
    if checkpoint is None:
        return
    check_resume_config(checkpoint, config, resumable)
    load_checkpoint(accelerator, checkpoint)
    progress.history = [m for m in progress.history if m["epoch_complete"]]
    accelerator.print(f"resumed from {checkpoint} at epoch {progress.epoch + 1}, "
                      f"step {progress.step}")


class Checkpointer:
    """When the training state is saved, decided in one place: the loop calls ``save`` after every
    optimizer step, as torchtitan's loop calls its checkpointer.

    It saves every ``every`` steps (--checkpoint-every; None: not within an epoch), at the end of
    each epoch (after its evaluation, so the epoch's metrics are in it), and at the step where the
    processes agreed to stop for a signal; never a step whose loss was not finite. Every process
    calls it (save_state is a collective).
    """

    def __init__(self, accelerator, output_dir: Path, every: int | None, keep: int):
        self.accelerator, self.output_dir = accelerator, output_dir
        self.every, self.keep = every, keep
        self.last = None  # the checkpoint this run wrote last

    def due(self, step: int, epoch_end: bool) -> bool:
        """Whether optimizer step ``step`` is saved unless the run stops for a non-finite loss."""
        return epoch_end or bool(self.every) and step % self.every == 0

    def save(self, step: int, epoch_end: bool, stop=None) -> Path | None:
        """Save ``step`` when it is due or ``stop`` (common.step_guard.Stop) keeps it; the folder,
        or None when nothing was written."""
        if stop is not None and not stop.saves:  # a non-finite loss: nothing of this step is kept
            return None
        if stop is None and not self.due(step, epoch_end):
            return None
        self.last = save_checkpoint(self.accelerator, self.output_dir, step, self.keep)
        return self.last


class TrainProgress:
    """Where training stands, saved in every checkpoint
    (``accelerator.register_for_checkpointing``).

    ``step`` counts optimizer steps over the whole run; ``batch_in_epoch`` lets a resumed run skip
    the batches of the current epoch it has already trained on; ``history`` holds the metrics of
    finished epochs, so metrics.jsonl can be rewritten to match the checkpoint being resumed;
    ``tracker_run_id`` is the wandb run a resumed job keeps logging to.
    """

    def __init__(self):
        self.epoch, self.step, self.batch_in_epoch, self.history = 0, 0, 0, []
        self.tracker_run_id = None

    def end_epoch(self, epoch: int, steps_per_epoch: int) -> bool:
        """After the last step trained in ``epoch``: whether the epoch is complete (not cut short by
        --max-steps); if it is, the next one begins at its first batch."""
        complete = self.batch_in_epoch == steps_per_epoch
        if complete:
            self.epoch, self.batch_in_epoch = epoch + 1, 0
        return complete

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "batch_in_epoch": self.batch_in_epoch,
                "history": self.history, "tracker_run_id": self.tracker_run_id}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.batch_in_epoch, self.history = state["batch_in_epoch"], list(state["history"])
        self.tracker_run_id = state.get("tracker_run_id")
