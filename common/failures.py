"""A failure on one process stops all of them: agreed in a collective, said once, no hang.

A write can fail on any process (a full disk, a quota, a read-only folder) and each library says so
its own way: OSError for small writes, safetensors' SafetensorError, torch.save's RuntimeError
("unexpected pos ..."). ``why_not_written`` turns any of them into a few words; ``agree`` and
``from_main`` let every process learn of a failure in the collective it would reach next anyway,
instead of waiting in it until --dist-timeout; ``fail_together`` stops them all with one line;
``refused_together`` does all three for a step that may refuse its input (a UserError).

A failure that one process meets alone (an exception in its data, its step, its evaluation, its
write) cannot be agreed: ``watch_failures`` makes it end every process within seconds, said once.
"""

import atexit
import os
import re
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from tqdm import tqdm

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


@contextmanager
def main_alone(accelerator, name: str, seconds: float):
    """Run the block on every process; the others then wait for the main process to end its block
    in the store (``seconds`` at most), not in the next collective, which --dist-timeout would end:
    for work that the main process does alone and that may take long (the trackers' start). A
    collective: every process must enter it, with the same ``name``, once per job."""
    main = getattr(accelerator, "num_processes", 1) == 1 or accelerator.is_main_process
    try:
        yield
    finally:
        if main and accelerator.num_processes > 1:
            _store().set(name, "done")  # done or failed: the next collective says which
    if not main:
        _store().wait([name], timedelta(seconds=seconds))


def fail_together(accelerator, message: str) -> None:
    """Stop every process with ``message`` (they all have it): one line from the main process, said
    before any process exits so that the launcher cannot stop it first, then exit status 1."""
    error = UserError(message)
    end_tracking_failed(accelerator)
    if getattr(accelerator, "num_processes", 1) > 1:
        ignore_the_launchers_stop()
        if accelerator.is_main_process:
            print(error.code, file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        error.code = 1  # said once, above; the other processes say nothing
    raise error


# The key, in the store through which the processes met (c10d's), that names the process that failed
# first. A watcher thread asks for it twice a second: no collective, nothing on the training step.
FIRST_FAILURE = "first-failure"
POLL_S = 0.5
GRACE_S = 3.0  # for a process that will meet the failure in a collective and end by itself
TRACKERS_S = 10.0  # at most for the trackers' last records before this process ends


def watch_failures(accelerator) -> None:
    """Make an exception that one process meets alone end every process within seconds, with one
    line: that process's own (a bad image's line, the traceback of a bug), said by it alone. The
    others end without a word, and without waiting out a collective until --dist-timeout: the one
    they are in fails (gloo: "Connection closed by peer") or, if it waits (NCCL), a watcher thread
    that reads the store ends the process. Every process exits 1, its trackers closed as failed.
    A process killed outright (out of memory, SIGKILL) posts nothing: the first to lose it in a
    collective says so in one line. Failures the processes agree on (``fail_together``) and stops
    (``announce_stop``) end as before. Multi-process runs only; call it once training starts."""
    if getattr(accelerator, "num_processes", 1) == 1 or getattr(sys.excepthook, "watches", False):
        return
    store, me, previous = _store(), str(accelerator.process_index), sys.excepthook

    def hook(kind, error, traceback):
        if _first(store, me):
            _own_line(accelerator)
            if _lost_a_process(error):
                print(f"error: process {me} lost another process of the job in a collective "
                      f"({_short(error)}): that process ended first; its own output or the "
                      f"launcher's report says why", file=sys.stderr)
            elif _timed_out(error):
                print(f"error: process {me} waited --dist-timeout in a collective for another "
                      f"process that never came ({_short(error)}): it stalled (a hung read, a "
                      f"stopped process) or is far slower; raise --dist-timeout only for the "
                      f"second", file=sys.stderr)
            else:
                previous(kind, error, traceback)  # our line (a bad image) or a bug's traceback
        end_now(accelerator)

    hook.watches = True
    sys.excepthook = hook
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(store, me, accelerator, stop), daemon=True,
                              name="failure-watch")
    thread.start()
    atexit.register(_stop_watching, stop, thread)


def fail_alone(accelerator, message: str) -> None:
    """Stop every process for a failure that this process may meet alone, where the others may be
    inside collectives it will not join (save_state: FSDP2's gathers, --ema-decay's): ``message``
    said once, by the first process to fail, then every process exits 1 (the others through the
    collective that loses this one, or the watch). With one process: a UserError, as ever."""
    if getattr(accelerator, "num_processes", 1) == 1:
        raise UserError(message)
    if _first(_store(), str(accelerator.process_index)):
        _own_line(accelerator)
        print(UserError(message).code, file=sys.stderr)
    end_now(accelerator)


def _store():
    """The store through which the processes met (c10d's), which outlives any one of them when a
    launcher holds it."""
    return torch.distributed.distributed_c10d._get_default_store()  # noqa: SLF001


def _first(store, me: str) -> bool:
    """Whether this process's failure is the job's first: the store keeps the first name given."""
    try:
        return store.compare_set(FIRST_FAILURE, "", me).decode() == me
    except Exception:  # noqa: BLE001 - the store's host (the main process) ended: it went first
        return False


def _own_line(accelerator) -> None:
    """Start a line of its own: the main process's progress bar holds the terminal's line."""
    if accelerator.is_main_process:
        _clear_progress_bars()
    else:
        print(file=sys.stderr)


def _stop_watching(stop: threading.Event, thread: threading.Thread) -> None:
    """At exit, the watcher out of the store before Python's shutdown: a daemon thread that it
    finds inside a C++ call (the store's) is ended there, and the process aborts ("terminate
    called without an active exception")."""
    stop.set()
    if thread is not threading.current_thread():  # end_now, from the watcher itself
        thread.join(timeout=10)


def _watch(store, me: str, accelerator, stop: threading.Event) -> None:
    """Another process's failure, read from the store: this process ends, unless its main thread
    meets the failure itself within GRACE_S (gloo's collectives fail at once) and ends there.
    Until ``stop`` is set."""
    while not stop.wait(POLL_S):
        try:
            if not store.check([FIRST_FAILURE]):
                continue
            failed = store.get(FIRST_FAILURE).decode()
        except Exception:  # noqa: BLE001 - the store's host ended: a job that finished, or a
            return  # failure that the collective this process meets next reports
        if failed != me and not stop.wait(GRACE_S):  # (this process ending by itself meanwhile)
            end_now(accelerator)
        return


def end_now(accelerator, exit_code: int = 1) -> None:
    """End this process as failed, now: its trackers closed as failed (for TRACKERS_S at most),
    its progress bars cleared, its output flushed and its exit handlers run (the run folder's lock,
    the loader workers), then os._exit, not Python's shutdown: torch's threads, still in a
    collective with a process that is gone, can abort it there (C++ "terminate called")."""
    closing = threading.Thread(target=end_tracking_failed, args=(accelerator, exit_code),
                               daemon=True)
    closing.start()
    closing.join(TRACKERS_S)
    _clear_progress_bars()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs first
    finally:
        os._exit(exit_code)


def _clear_progress_bars() -> None:
    for bar in list(getattr(tqdm, "_instances", ())):  # tqdm.auto's bars are tqdm's too
        bar.close()  # leave=False: the line is cleared


def _lost_a_process(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure because another process is gone."""
    text = str(error)
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                         "Broken pipe", "remote process exited", "NCCL error"))


def _timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a collective that waited out --dist-timeout (gloo's, NCCL's words)."""
    return re.search(r"Timed out waiting \d+ms|collective operation timeout|timed out after",
                     str(error)) is not None


def _short(error: BaseException) -> str:
    """A collective's error in a few words: gloo's starts with the source file and goes on."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])
    return text.split(". ", 1)[0]


def ignore_the_launchers_stop() -> None:
    """SIGTERM ignored from here on, by a process that ends with the job's agreed failure: the
    launcher stops the other processes once one has exited, and one that it kills (before it has
    said why, or while it exits) dies by a signal instead of its own exit status 1."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


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
