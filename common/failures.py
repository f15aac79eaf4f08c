"""A failure on one process stops all of them: agreed in a collective, said once, no hang.

A write can fail on any process (a full disk, a quota, a read-only folder) and each library says so
its own way: OSError for small writes, safetensors' SafetensorError, torch.save's RuntimeError
("unexpected pos ..."). ``why_not_written`` turns any of them into a few words; ``agree`` and
``from_main`` let every process learn of a failure in the collective it would reach next anyway,
instead of waiting in it until --dist-timeout; ``fail_together`` stops them all with one line;
``refused_together`` does all three for a step that may refuse its input (a UserError).
"""

import shutil
import sys
from pathlib import Path

from accelerate.utils import broadcast_object_list, gather_object

from common.errors import UserError, first_line

# Under this much free space a failed write is put down to a full disk: torch.save reports one only
# as a position mismatch ("unexpected pos 576 vs 534"), measured here on a full tmpfs.
_FULL = 1 << 20


def why_not_written(error: BaseException, path: Path) -> str:
    """A failed write's cause in a few words, whatever raised it; call it before cleaning up, while
    the partial file still takes the space it took."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    try:
        free = shutil.disk_usage(_existing(Path(path))).free
    except OSError:
        free = None
    if "No space left" in str(error) or free is not None and free < _FULL:
        return "no space left on the device"
    return first_line(error)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def agree(accelerator, mine: str | None) -> str | None:
    """Every process's failure (None: none), gathered: the first one, the same on every process.
    A collective: every process must call it."""
    if getattr(accelerator, "num_processes", 1) == 1:
        return mine
    return next((why for why in gather_object([mine]) if why), None)


def from_main(accelerator, mine: str | None) -> str | None:
    """The main process's failure (None: none), on every process. A collective."""
    if getattr(accelerator, "num_processes", 1) == 1:
        return mine
    return broadcast_object_list([mine])[0]


def fail_together(accelerator, message: str) -> None:
    """Stop every process with ``message`` (they all have it): one line from the main process, said
    before any process exits so that the launcher cannot stop it first, then exit status 1."""
    error = UserError(message)
    end_tracking_failed(accelerator)
    if getattr(accelerator, "num_processes", 1) > 1:
        if accelerator.is_main_process:
            print(error.code, file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        error.code = 1  # said once, above; the other processes say nothing
    raise error


def end_tracking_failed(accelerator, exit_code: int = 1) -> None:
    """Finish the job's trackers as failed: wandb records a run that nothing finished as exit code
    0, that is, as a success, and Accelerate's MLflow finish() as FINISHED. Only the main process
    has trackers; a no-op before they start."""
    for tracker in getattr(accelerator, "trackers", None) or []:
        try:
            run = getattr(tracker, "run", None)  # Accelerate's WandBTracker holds the wandb Run
            if hasattr(run, "finish"):
                run.finish(exit_code=exit_code)
            elif getattr(tracker, "name", None) == "mlflow" and accelerator.is_main_process:
                sys.modules["mlflow"].end_run(status="FAILED")  # imported as the run started
            else:
                tracker.finish()
        except Exception:  # noqa: BLE001, S110 - already failing; tracking must not add to it
            pass
    if getattr(accelerator, "trackers", None):
        accelerator.trackers = []


def refused_together(accelerator, step, *args, **kwargs):
    """``step(*args, **kwargs)``, whose refusal (a UserError) on any process stops every process
    with one line instead of one per process. A collective: every process must call it, and
    ``step`` may refuse only after the collectives it makes itself (or on every process at one)."""
    result, refusal = None, None
    try:
        result = step(*args, **kwargs)
    except UserError as error:
        refusal = error.message
    if (refusal := agree(accelerator, refusal)) is not None:
        fail_together(accelerator, refusal)
    return result
