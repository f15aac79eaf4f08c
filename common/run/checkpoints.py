"""Checkpoints: when the training state is saved, writing it whole, finding the newest good one.

A checkpoint is one folder ``checkpoints/step_N`` of Accelerate's ``save_state`` that ends with
checkpoint.json, the list of its files with their sizes and crc32 digests: ``save_checkpoint``
writes it whole, ``checkpoint_problem`` checks it, ``resume_from`` loads it (checkpoints hold data
only, common.data_only, so a run folder from elsewhere is safe to resume), ``Checkpointer`` decides
when one is written.
"""

import atexit
import functools
import json
import os
import re
import shutil
import sys
import traceback
import zlib
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from common.data_only import RUNS_CODE, code_in_checkpoint, file_problem, save_as_data
from common.failures import agree, fail_alone, fail_together, from_main, why_not_written
from common.files import fsync_dir, fsync_tree, write_json
from common.run.record import check_resume_config, unwritten_metrics

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "checkpoint.json"  # a checkpoint's files, sizes and digests, written last
# In the run folder, from the first checkpoint on: a run whose checkpoints are gone was not
# "stopped before its first checkpoint", and --resume must not start it again over its record.
WROTE_CHECKPOINTS = ".checkpoints-written"
STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(output_dir: Path, up_to: int | None = None) -> Path | None:
    """The checkpoint with the highest step (at most ``up_to``), by its name only; unfinished
    temporary folders do not count. ``latest_good_checkpoint`` also checks its files."""
    return next(iter(all_checkpoints(output_dir, up_to)), None)


def all_checkpoints(output_dir: Path, up_to: int | None = None) -> list[Path]:
    """The checkpoint folders (step_N) at most at step ``up_to``, the newest first."""
    steps = [(int(m[1]), p) for p in (Path(output_dir) / CHECKPOINT_DIR).glob("step_*")
             if (m := STEP_DIR.match(p.name))]  # glob: none in a folder that is not there
    return [p for step, p in sorted(steps, reverse=True) if up_to is None or step <= up_to]


def latest_good_checkpoint(output_dir: Path,
                           up_to: int | None = None) -> tuple[Path | None, dict[Path, str]]:
    """The newest checkpoint that ``checkpoint_problem`` passes (None if there is none), and the
    problem of each newer one, which it does not."""
    damaged = {}
    for checkpoint in all_checkpoints(output_dir, up_to):
        if (problem := checkpoint_problem(checkpoint)) is None:
            return checkpoint, damaged
        damaged[checkpoint] = problem
    return None, damaged


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What makes a checkpoint folder unusable, naming the file ("optimizer.bin is missing"); None
    when it is complete.

    Every file in the folder must be listed in its checkpoint.json, and every file listed must be
    there with the size and the crc32 it was written with: a copy that lost a file, a disk that
    filled, bytes damaged since (a bad disk, a copy gone wrong) would otherwise load without a
    word, and an inf in a BatchNorm buffer trains on to a finite loss. A folder without that list,
    or a list without digests, is no checkpoint these scripts wrote: it is refused like a damaged
    one.
    """
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        files = {str(name): int(size) for name, size in manifest["files"].items()}
        digests = {str(name): str(crc) for name, crc in manifest["crc32"].items()}
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return f"{MANIFEST} is unreadable"
    try:
        unlisted = sorted(set(_state_files(checkpoint)) - set(files))
    except OSError as error:
        return f"the folder cannot be read ({error.strerror})"
    if unlisted:
        return f"{MANIFEST} does not list {unlisted[0]}"
    return next((f"{name} {problem}" for name, size in files.items()
                 if (problem := _file_problem(checkpoint / name, size, digests.get(name)))), None)


def _state_files(checkpoint: Path) -> list[str]:
    """The files of a checkpoint folder but its list, as the list names them; in its subfolders
    (FSDP's sharded pytorch_model_fsdp_0/, optimizer_0/) hidden ones too: DCP's .metadata."""
    return [p.relative_to(checkpoint).as_posix() for p in sorted(checkpoint.rglob("*"))
            if p.is_file() and p.name != MANIFEST
            and not (p.name.startswith(".") and p.parent == checkpoint)]


def file_crc32(path: Path) -> str:
    """A file's crc32, read in 1 MiB pieces. Not sha256: this guards against damage, not forgery,
    and zlib's crc32 runs at about 2 GB/s here against 1 GB/s for sha256 (256 MB of random bytes,
    one core), so a checkpoint costs one more read of a file the page cache still holds."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            crc = zlib.crc32(piece, crc)
    return f"{crc:08x}"


def _file_problem(path: Path, size: int, crc: str | None) -> str | None:
    try:
        if (actual := path.stat().st_size) != size:
            return f"has {actual} bytes where {size} were written"
        if crc is None:
            return f"has no crc32 in {MANIFEST}"
        found = file_crc32(path)
        return f"is damaged (crc32 {found} where {crc} was written)" if found != crc else None
    except FileNotFoundError:
        return "is missing"
    except OSError as error:
        return f"cannot be read ({error.strerror})"


def save_checkpoint(accelerator, output_dir: Path, step: int, keep: int) -> Path:
    """Full training state (model, optimizer, scheduler, RNGs, what save_as_data adds) at ``step``.

    Every process must call this: save_state writes each process's RNG state and waits for all of
    them (under ``if is_main_process`` it would hang). The main process then lists the files with
    their sizes and digests in checkpoint.json, renames the finished folder into place once every
    file is on the disk (a process killed while saving leaves the previous checkpoint intact) and
    removes the oldest checkpoints beyond ``keep``. A write that fails on any process (and
    metrics.jsonl not written, which write_metrics leaves to be said here) stops every process
    with one line naming the checkpoint that is intact; the one being written is removed.
    """
    folder = output_dir / CHECKPOINT_DIR
    final, partial = folder / f"step_{step:08d}", folder / f".tmp-step_{step:08d}"
    with removed_if_ended(partial):
        failure = unwritten_metrics()  # the epoch's record, which only the main process writes
        if failure is None and accelerator.is_main_process:
            try:
                shutil.rmtree(partial, ignore_errors=True)  # left by a process killed while saving
                partial.mkdir(parents=True)
            except OSError as error:
                failure = f"cannot write checkpoint {final} ({why_not_written(error, folder)})"
        failure = from_main(accelerator, failure)  # the others wait for the folder or its failure
        if failure is None:
            try:
                accelerator.save_state(str(partial))
            # SafetensorError, RuntimeError, OSError ..., FSDP2's CheckpointException (a
            # BaseException)
            except (Exception, CheckpointException) as error:  # noqa: BLE001
                failure = f"cannot write checkpoint {final} ({why_not_written(error, partial)})"
                # the others may be in save_state's collectives (FSDP2's gathers, --ema-decay's):
                # no agreeing
                if accelerator.num_processes > 1:
                    fail_alone(accelerator, failure + intact_advice(output_dir))
            # every process's files are written (or not) before the list is made
            failure = agree(accelerator, failure)
        if failure is None and accelerator.is_main_process:
            try:
                files = {name: (partial / name).stat().st_size for name in _state_files(partial)}
                digests = {name: file_crc32(partial / name) for name in files}
                # last: it lists all the others
                write_json(partial / MANIFEST, {"step": step, "files": files, "crc32": digests})
                fsync_tree(partial)
                if not (output_dir / WROTE_CHECKPOINTS).exists():
                    write_json(output_dir / WROTE_CHECKPOINTS, {"first": final.name})
            except Exception as error:  # noqa: BLE001
                failure = f"cannot write checkpoint {final} ({why_not_written(error, partial)})"
        failure = from_main(accelerator, failure)
        if failure is not None:  # partial removed on the way out (removed_if_ended)
            fail_together(accelerator, failure + intact_advice(output_dir))
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            fsync_dir(folder)
            # Newer ones than this (left by a run resumed from an older checkpoint, a damaged one
            # among them) are not counted: they are replaced when this run reaches their step.
            for path in all_checkpoints(output_dir, up_to=step)[keep:]:
                shutil.rmtree(path)
        accelerator.wait_for_everyone()
    return final


@contextmanager
def removed_if_ended(partial: Path):
    """``partial`` removed if this process leaves the block by an exception (fail_together's, a
    collective that lost the main process) or ends inside it (the failure watch and fail_alone end
    a process through end_now, which runs the exit handlers). A checkpoint that one process failed
    to write is then removed whichever process ends last: after the main process removed it,
    another may make the folder again in save_state and write its own file there."""
    remove = functools.partial(shutil.rmtree, partial, ignore_errors=True)
    atexit.register(remove)
    try:
        yield
    except BaseException:
        remove()
        raise
    finally:
        atexit.unregister(remove)


def intact_advice(output_dir: Path) -> str:
    """The end of a line saying a write failed: which checkpoint is intact, how to finish."""
    then = f"then run the same command with --output-dir {output_dir} --resume"
    if (previous := latest_checkpoint(output_dir)) is None:
        return (f"; no checkpoint of this run is written yet: free space in {output_dir}, {then} "
                f"to start it again from step 0")
    return f"; the checkpoint {previous} is intact: free space in {output_dir}, {then}"


# Not damage: every checkpoint of the run has it. Bias and norm parameters have their own group (no
# weight decay) since fine-tuning came; the checkpoints written before have one group.
OTHER_GROUPS = "its optimizer has another number of parameter groups than this run's"


def _load_problem(accelerator, checkpoint: Path, code_in) -> str | None:
    """accelerator.load_state, unless a file would run code (``code_in``); what went wrong in a few
    words, naming the file; None: loaded."""
    if problem := code_in(checkpoint, accelerator.process_index):
        return problem
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as error:  # noqa: BLE001 - whatever Accelerate or torch met
        if "different number of parameter groups" in str(error):  # Optimizer.load_state_dict
            return OTHER_GROUPS
        return file_problem(_file_in_traceback(error, checkpoint), error)
    return None


def _file_in_traceback(error: BaseException, checkpoint: Path) -> str | None:
    """The checkpoint file that the innermost frame reading one was reading, if any: Accelerate
    does not say which of its files failed to load."""
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        for value in frame.f_locals.values():
            if isinstance(value, (str, os.PathLike)) and str(value).startswith(str(checkpoint)):
                path = Path(value)
                if path.parent == checkpoint and path.is_file():
                    found = path.name
    return found


def resume_from(accelerator, checkpoint: Path | None, progress: "TrainProgress", config: dict,
                resumable: set[str], code_in=code_in_checkpoint) -> None:
    """Continue the run of ``checkpoint`` (None: nothing to continue): check that this run is the
    same experiment (its flags except ``resumable``, its data), load the training state into
    everything prepared and registered, and forget the metrics of an epoch saved only in part.

    A checkpoint that does not load on some process is skipped with one warning for the newest
    complete one before it, on every process (loading that one overwrites all that the failed load
    changed); one named by --resume stops the run with one line instead. One with a file that
    would run code (a pickle from elsewhere, or of an earlier version) stops it before that file
    is read: ``code_in``, common.data_only's or, for a sharded one, common.parallel.fsdp's.
    """
    if checkpoint is None:
        return
    check_resume_config(checkpoint, config, resumable)
    named = config["args"].get("resume") not in (None, "latest") \
        and Path(config["args"]["resume"]).resolve() == checkpoint.resolve()
    while (problem := agree(accelerator,
                            _load_problem(accelerator, checkpoint, code_in))) is not None:
        if problem == OTHER_GROUPS:
            fail_together(accelerator, (
                f"--resume: {checkpoint}: {problem}: it was written by an earlier version of "
                f"the scripts (one group, weight decay on every parameter); continue it with "
                f"that version, or start a new run from its weights with --pretrained-path "
                f"{checkpoint}/model.safetensors"))
        if RUNS_CODE in problem:
            fail_together(accelerator, (
                f"--resume: {checkpoint} was not loaded: {problem}; these scripts write "
                f"checkpoints of data only: resume one of theirs, or start a new run (one of an "
                f"earlier version, with custom_checkpoint_N.pkl: continue it with that version, "
                f"if you trust where it came from)"))
        older = message = None  # the checkpoint to load instead, or the line that stops the run
        if accelerator.is_main_process:
            step = int(STEP_DIR.match(checkpoint.name).group(1))
            older, damaged = latest_good_checkpoint(checkpoint.parent.parent, up_to=step - 1)
            if named or older is None:
                message = (f"--resume: {checkpoint} is damaged ({problem}) and no complete "
                           f"checkpoint comes before it" if older is None else
                           f"--resume {checkpoint}: the checkpoint is damaged ({problem}); "
                           f"the newest complete one is {older}: continue from it with "
                           f"--output-dir {older.parent.parent} --resume")
            else:
                skipped = "".join(f"; {bad.name}: {why}" for bad, why in damaged.items())
                print(f"warning: damaged checkpoint skipped ({checkpoint.name}: {problem}"
                      f"{skipped}): resuming from {older}, the newest complete one before it",
                      file=sys.stderr, flush=True)
        checkpoint, message = from_main(accelerator, (older, message))
        if message:
            fail_together(accelerator, message)
    per_epoch = config.get("steps_per_epoch")  # the counts of a checkpoint of this run add up
    if per_epoch and (progress.batch_in_epoch > per_epoch or
                      progress.step != progress.epoch * per_epoch + progress.batch_in_epoch):
        fail_together(accelerator, (
            f"--resume: {checkpoint}/progress.json: step {progress.step} is not epoch "
            f"{progress.epoch} x {per_epoch} steps + {progress.batch_in_epoch}: it is no "
            f"checkpoint of this run; start a new run"))
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

    def save(self, step: int, epoch_end: bool, stop=None) -> None:
        """Save ``step`` when it is due or ``stop`` (common.parallel.step_guard.Stop) keeps it (a
        non-finite loss: nothing of this step is kept)."""
        if stop.saves if stop is not None else self.due(step, epoch_end):
            self.last = save_checkpoint(self.accelerator, self.output_dir, step, self.keep)


class TrainProgress:
    """Where training stands, saved in every checkpoint as progress.json (``save_as_data``).

    ``step`` counts optimizer steps over the whole run; ``batch_in_epoch`` lets a resumed run skip
    the batches of the current epoch it has already trained on; ``history`` holds the metrics of
    finished epochs, so metrics.jsonl can be rewritten to match the checkpoint being resumed;
    ``tracker_run_id`` and ``mlflow_run_id`` are the wandb and MLflow runs a resumed job keeps
    logging to (wandb's id is chosen before its run starts, MLflow's by MLflow as it starts).
    """

    def __init__(self, accelerator):
        self.epoch, self.step, self.batch_in_epoch, self.history = 0, 0, 0, []
        self.tracker_run_id = self.mlflow_run_id = None
        save_as_data(accelerator, self, "progress")

    def end_epoch(self, epoch: int, steps_per_epoch: int) -> bool:
        """After the last step trained in ``epoch``: whether the epoch is complete (not cut short by
        --max-steps); if it is, the next one begins at its first batch."""
        complete = self.batch_in_epoch == steps_per_epoch
        if complete:
            self.epoch, self.batch_in_epoch = epoch + 1, 0
        return complete

    def state_dict(self) -> dict:
        return dict(vars(self))  # the six values __init__ sets

    def load_state_dict(self, state: dict) -> None:
        """Each of the six values, checked (a ValueError naming it): ``_fits``."""
        for key in self.state_dict():  # each one must be there
            if not _fits(key, value := state[key]):
                raise ValueError(f"{key} is {value!r:.60}, which these scripts never write")
            setattr(self, key, value)


def _fits(key: str, value) -> bool:
    """Whether TrainProgress writes ``value`` as ``key``: counts from 0, run ids, epoch records."""
    if key.endswith("run_id"):
        return value is None or isinstance(value, str)
    if key == "history":
        return isinstance(value, list) and all(
            isinstance(m, dict) and type(m.get("epoch_complete")) is bool
            and type(m.get("test_acc")) in (int, float) for m in value)
    return type(value) is int and value >= 0
