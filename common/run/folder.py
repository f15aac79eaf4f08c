"""The run folder: which one a run writes, and which checkpoint it continues from.

A new run gets a new folder. What a run has recorded is never replaced by a resume: a used folder
needs --resume, an older checkpoint of a run that went on from it continues only in a new folder,
and a run whose checkpoints are gone is not started again.
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

from common.errors import UserError
from common.failures import agree, fail_together, from_main
from common.run.checkpoints import (CHECKPOINT_DIR, STEP_DIR, WROTE_CHECKPOINTS, all_checkpoints,
                                    checkpoint_problem, latest_good_checkpoint)
from common.run.lock import (JOB_ID_VARIABLE, LOCK_FILE, SET_ASIDE, lock_run_folder, read_job,
                             this_job)
from common.run.weights import read_metadata


def new_run_dir(script: str, root: str = "runs") -> Path:
    """A folder name no earlier run has used: runs/<script>-<date>-<time>[-N]."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path(root) / f"{script}-{stamp}", 1
    while path.exists():
        n += 1
        path = Path(root) / f"{script}-{stamp}-{n}"
    return path


def lock_run_and_find_resume(accelerator, output_dir: str | None, resume: str | None,
                             script: str) -> tuple[Path, Path | None]:
    """Take the run folder's lock for this job, and find the checkpoint to continue from (None: a
    start from step 0): the run folder and that checkpoint.

    ``resume`` is None, "latest" (the newest complete checkpoint of ``output_dir``) or a checkpoint
    folder, whose run folder is then the default ``output_dir``. A worker restarted by torchrun
    (``accelerate launch --max_restarts N``), a SLURM job requeued (``sbatch --requeue``; SLURM
    sets SLURM_RESTART_COUNT) and a job its scheduler names (TRAINING_JOB_ID: a Kubernetes JobSet
    restarted, a TrainJob resumed by Kueue) continue from the newest checkpoint of ``output_dir`` by
    themselves.
    The main process takes the folder's lock for the job (``lock_run_folder``), checks the folder
    and the checkpoints and decides; the other processes learn its decision, so all of them go on,
    or all stop with the same line.
    """
    # a scheduler that names the job counts no restarts: the folder's JOB_FILE is the record
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 \
        or (output_dir is not None and (int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
                                        or (bool(os.environ.get(JOB_ID_VARIABLE))
                                            and read_job(output_dir) == this_job())))
    given = Path(resume) if resume not in (None, "latest") else None
    if output_dir is None and given is None \
            and (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
                 or os.environ.get(JOB_ID_VARIABLE)):
        fail_together(accelerator, f"a restartable launch (--max_restarts, {JOB_ID_VARIABLE}) "
                      f"needs --output-dir, so that a restarted worker finds the run's "
                      f"checkpoints: add --output-dir runs/NAME")
    if resume == "latest" and output_dir is None:
        fail_together(accelerator, "--resume needs --output-dir (the folder of the run to "
                      "continue) or a checkpoint: --resume runs/NAME/checkpoints/step_NNNNNNNN")
    if output_dir:
        path = Path(output_dir)
    elif given is not None:
        path = given.parent.parent  # runs/NAME/checkpoints/step_N
    else:  # processes started a second apart must agree on its name
        path = from_main(accelerator, new_run_dir(Path(script).stem))
    if given is not None and (not given.is_dir() or not STEP_DIR.match(given.name)):
        fix = (f"it is a run's folder: pass --output-dir {given} --resume for its newest "
               f"checkpoint" if (given / CHECKPOINT_DIR).is_dir() else
               "pass runs/NAME/checkpoints/step_NNNNNNNN, or --output-dir RUN --resume for the "
               "newest checkpoint of a run")
        fail_together(accelerator, f"--resume {given}: not a checkpoint folder; {fix}")
    decision = [None, None]  # the checkpoint to continue from, or the line that stops every process
    if accelerator.is_main_process:
        lock = None
        try:
            if resume == "latest" and not restarted and not path.is_dir():  # the lock would make it
                raise UserError(f"--resume: {path} does not exist; pass the --output-dir of the "
                                f"run to continue")
            lock = lock_run_folder(path)
            # a restart continues by itself only in the folder its own job took: one refused at its
            # start gets the same checks, and the same refusal
            own_restart = restarted and read_job(path) == this_job()
            decision[0] = _choose_checkpoint(path, given, resume, own_restart)
            lock.record_job()  # for a restart of this job
        except UserError as error:
            if lock:
                lock.release()
            decision[1] = error.message
    checkpoint, message = from_main(accelerator, decision)  # all have waited for the checks
    if message or (message := agree(accelerator, None if (path / LOCK_FILE).exists() else (
            f"{path} is not on a disk that every node shares: process {accelerator.process_index}"
            f" on {socket.gethostname()} does not see the .lock that process 0 holds there, and "
            f"each writes its part of a checkpoint; pass an --output-dir on a shared filesystem"))):
        fail_together(accelerator, message)  # one line, from the main process
    return path, checkpoint  # nothing written yet, so bad input leaves nothing


def _choose_checkpoint(path: Path, given: Path | None, resume: str | None,
                       own_restart: bool) -> Path | None:
    """lock_run_and_find_resume's decision, on the main process, holding the lock; ``own_restart``:
    this job started again in the folder it took before."""
    if own_restart:  # its own newest checkpoint; none yet: where it started, --resume or step 0
        return _newest_complete(path, "") or given
    if given is not None:
        if problem := checkpoint_problem(given):
            raise UserError(f"--resume {given}: the checkpoint is damaged ({problem}); pass a "
                            f"complete one, or --output-dir {given.parent.parent} --resume for "
                            f"its newest complete checkpoint")
        if path != given.parent.parent:
            check_output_dir(path)  # continuing elsewhere: never into another run
        else:
            check_no_later_record(path, given)
        return given
    if not resume:
        check_output_dir(path)
        return None
    if (checkpoint := _newest_complete(path, "--resume: ")) is not None:
        return checkpoint
    if (path / "model.safetensors").exists():  # no checkpoint at all
        raise UserError(f"--resume: the run in {path} has finished (model.safetensors) and has no "
                        f"checkpoint left to continue from; start a new run in another "
                        f"--output-dir")
    if not (path / "config.json").exists():
        raise UserError(f"--resume: no complete checkpoint in {path / CHECKPOINT_DIR}; start a new "
                        f"run without --resume")
    if (path / WROTE_CHECKPOINTS).exists():
        raise UserError(f"--resume: the run in {path} wrote checkpoints but none is left in "
                        f"{path / CHECKPOINT_DIR} ({_recorded_epochs(path) or 'no metrics.jsonl'})"
                        f": put them back, or start a new run in another --output-dir; nothing of "
                        f"the run was changed")
    # Stopped before its first checkpoint (a bad image in epoch 1): nothing of it is continued, so
    # its flags may change; its config.json, set aside, is put back if this run fails first.
    os.replace(path / "config.json", path / SET_ASIDE)
    print(f"warning: --resume: {path} has no checkpoint (its run stopped before the first "
          f"one): starting it again from step 0", file=sys.stderr, flush=True)
    return None


def _newest_complete(path: Path, prefix: str) -> Path | None:
    """The newest checkpoint that checkpoint_problem passes, with one line naming the damaged ones
    skipped; None when there is none at all; one line (UserError) when none is complete."""
    checkpoint, damaged = latest_good_checkpoint(path)
    found = "; ".join(f"{bad.name}: {problem}" for bad, problem in damaged.items())
    if damaged and checkpoint is None:
        raise UserError(f"{prefix}no checkpoint in {path / CHECKPOINT_DIR} is complete ({found}): "
                        f"restore the damaged files, or start the run again from step 0 in "
                        f"another --output-dir")
    if damaged:
        print(f"warning: damaged checkpoint{'s' * (len(damaged) > 1)} skipped ({found}): "
              f"resuming from {checkpoint}, the newest complete one", file=sys.stderr, flush=True)
    return checkpoint


def check_no_later_record(path: Path, given: Path) -> None:
    """--resume with an older checkpoint of a run that went on from it: continuing in place would
    replace its weights and metrics and leave two timelines in one folder."""
    step = int(STEP_DIR.match(given.name).group(1))
    newer = [c for c in all_checkpoints(path) if int(STEP_DIR.match(c.name).group(1)) > step]
    weights = path / "model.safetensors"
    # the weights of its last step: resuming from that step is --resume alone
    finished = weights.exists() and read_metadata(weights).get("step", step + 1) > step
    if not newer and not finished:
        return
    went_on = (f"has finished (model.safetensors; {_recorded_epochs(path) or 'no metrics'})"
               if finished else f"went on to {newer[0].name}")
    newest = "" if finished else f", or --output-dir {path} --resume to continue from its newest"
    raise UserError(f"--resume {given}: the run in {path} {went_on}; continuing it from "
                    f"{given.name} in place would replace its record: add --output-dir NEW to "
                    f"continue from {given.name} in a new folder{newest}")


def _recorded_epochs(path: Path) -> str:
    """What metrics.jsonl says of a run: "metrics.jsonl records 3 epochs to step 48"."""
    try:
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
        return (f"metrics.jsonl records {len(records)} epoch{'s' * (len(records) > 1)} to step "
                f"{records[-1]['step']}")
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return ""


def check_output_dir(output_dir: Path) -> None:
    """Never overwrite a run silently: a used folder needs --resume."""
    if any(p.name != LOCK_FILE for p in output_dir.iterdir()):  # the lock made the folder
        what = "a run" if (output_dir / "config.json").exists() else "files"
        raise UserError(f"--output-dir {output_dir} already holds {what}: add --resume to "
                        f"continue it, or choose another --output-dir")
