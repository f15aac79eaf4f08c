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
import ctypes
import os
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future, wait
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from tqdm import tqdm

from common.errors import UserError, first_line
from common.faults import fault_line, lost_the_store

# Under this much free space a failed write is put down to a full disk: torch.save reports one only
# as a position mismatch ("unexpected pos 576 vs 534"), measured here on a full tmpfs.
_FULL = 1 << 20


def why_not_written(error: BaseException, path: Path) -> str:
    """A failed write's cause in a few words, whatever raised it; call it before cleaning up, while
    the partial file still takes the space it took."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    try:  # of the nearest folder that exists: a failed write may leave none of its own
        existing = next(folder for folder in (Path(path), *Path(path).parents) if folder.exists())
        free = shutil.disk_usage(existing).free
    except (OSError, StopIteration):
        free = None
    if "No space left" in str(error) or free is not None and free < _FULL:
        return "no space left on the device"
    return first_line(error)


def agree(accelerator, mine: str | None) -> str | None:
    """Every process's failure (None: none), gathered: the first one, the same on every process.
    A collective: every process must call it."""
    if getattr(accelerator, "num_processes", 1) == 1:
        return mine
    return next((why for why in gather_object([mine]) if why), None)


def from_main(accelerator, mine):
    """The main process's ``mine`` (a failure, None, a value it chose) everywhere. A collective."""
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
    deadline = time.monotonic() + seconds  # asked in short calls: a long wait would hold the
    while not main and not _store().check([name]):  # store's client from the watch's thread
        if time.monotonic() > deadline:
            raise TimeoutError(f"process 0 did not end its {name} in {seconds:g} s")
        time.sleep(POLL_S / 5)


def fail_together(accelerator, message: str) -> None:
    """Stop every process with ``message`` (they all have it): one line from the main process, said
    before any process exits so that the launcher cannot stop it first, then exit status 1."""
    error = UserError(message)
    end_tracking(accelerator)
    if getattr(accelerator, "num_processes", 1) > 1:
        ignore_the_launchers_stop()
        if accelerator.is_main_process:
            print(error.code, file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        error.code = 1  # said once, above; the other processes say nothing
    raise error


# The keys, in the store through which the processes met (c10d's): the process that failed first,
# which a watcher thread asks for twice a second (no collective, nothing on the training step), and
# the count of those that ended for it. Per restart (_store): a launcher's store outlives attempts,
# and torch 2.14 no longer keys its users' keys by attempt: a restart would read the last failure.
FIRST_FAILURE, ENDED = "first-failure", "ended-for-a-failure"
POLL_S = 0.5
GRACE_S = 3.0  # for a process that will meet the failure in a collective and end by itself
STORE_S = 5.0  # an answer of the store at most: a stopped host never answers, whatever the timeout
TRACKERS_S = 10.0  # at most for the trackers' last records before this process ends
EXIT_S = 10.0  # at most for the exit handlers: wandb's waits for its service process to end
HOLD_S = POLL_S + GRACE_S + STORE_S  # at most for process 0's wait for the others (end_now)
# At most for a stop in progress once the store is lost (a launcher killed outright takes its store,
# and its death signal is the stop); Kubernetes' 30 s grace and SLURM's KillWait end it first there.
STOPPING_S = 120.0
STOPPING = threading.Event()  # set by common.parallel.step_guard as a stop signal comes
MLFLOW_RUN = []  # the main process's MLflow run and store, on every process (start_run)
# A process whose heartbeat (its watcher thread's, in the store) stops this long is stalled: the one
# before it says so and the job ends, not at --dist-timeout (a quarter of it if less, 10 s at least:
# _stall_s). A long evaluation, checkpoint or compile is no silence: the loop does not beat.
STALL_S = 60.0
BEAT = {"step": 0}  # this process's last optimizer step (common.parallel.step_guard), in its beat
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies
_ENDING = threading.RLock()  # held by the one thread that ends this process: one end, said once


def watch_failures(accelerator) -> None:
    """Make an exception that one process meets alone end every process within seconds, with one
    line: that process's own (a bad image's line, the traceback of a bug), said by it alone. The
    others end without a word, and without waiting out a collective until --dist-timeout: the one
    they are in fails (gloo: "Connection closed by peer") or, if it waits (NCCL), a watcher thread
    that reads the store ends the process. A store that fails or does not answer (its host ended or
    stopped) is itself a failure of the job: each process says so and ends. Every process exits 1,
    once, its trackers closed as failed. A process killed outright (out of memory, SIGKILL) posts
    nothing: the first to lose it in a collective says so. It replaces the excepthook, and asks for
    SIGTERM if the launcher dies (`accelerate launch` of one process passes no signal on). Call it
    as the Accelerator is made, and once the trackers have started (wandb wraps the hook there)."""
    if getattr(sys.excepthook, "watches", False):
        return
    previous = _without_wandbs_traceback(sys.excepthook)
    if getattr(previous, "watches", False):  # this one, inside wandb's: taken back
        sys.excepthook = previous
        return
    several = getattr(accelerator, "num_processes", 1) > 1
    store, me = _store() if several else None, str(accelerator.process_index)

    def hook(kind, error, traceback):
        _claim_the_end()
        line = fault_line(me, error)
        if store is None or _first(store, me):
            _own_line(accelerator)
            if line:
                print(line, file=sys.stderr)
            else:
                previous(kind, error, traceback)  # our line (a bad image) or a bug's traceback
        end_now(accelerator, through_the_store=several and not (line and "lost" in line))

    hook.watches = True
    sys.excepthook = hook
    with suppress(OSError, AttributeError):  # Linux: SIGTERM to this process if its launcher dies
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if several:
        stop = threading.Event()
        thread = threading.Thread(target=_watch, daemon=True, name="failure-watch",
                                  args=(store, me, accelerator, stop, _stall_s(accelerator)))
        thread.start()
        atexit.register(_stop_watching, stop, thread, store, me)


def _without_wandbs_traceback(hook):
    """``hook`` without wandb's traceback: wandb puts its excepthook around the one it finds as its
    service starts (wandb/sdk/lib/exit_hooks.py), which prints the whole traceback before calling
    that one (our line); the exit code it records for the run is kept."""
    wandbs = getattr(hook, "__self__", None)
    if not hasattr(wandbs, "_orig_excepthook"):
        return hook

    def told(kind, error, traceback):
        wandbs.exit_code = 1
        (wandbs._orig_excepthook or sys.__excepthook__)(kind, error, traceback)  # noqa: SLF001
    told.watches = getattr(wandbs._orig_excepthook, "watches", False)  # noqa: SLF001
    return told


def fail_alone(accelerator, message: str) -> None:
    """Stop every process for a failure that this process may meet alone, where the others may be
    inside collectives it will not join (save_state: FSDP2's gathers, --ema-decay's): ``message``
    said once, by the first process to fail, then every process exits 1 (the others through the
    collective that loses this one, or the watch). Several processes only: one has fail_together."""
    _claim_the_end()
    if _first(_store(), str(accelerator.process_index)):
        _own_line(accelerator)
        print(UserError(message).code, file=sys.stderr)
    end_now(accelerator)


def _store():
    """The store through which the processes met (c10d's), which outlives any one of them when a
    launcher holds it; its keys are this restart's (TORCHELASTIC_RESTART_COUNT): 0/first-failure."""
    store = torch.distributed.distributed_c10d._get_default_store()  # noqa: SLF001
    return torch.distributed.PrefixStore(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), store)


def _bounded(seconds: float, call, *args):
    """``call(*args)`` waited for ``seconds`` at most, in a thread of its own (left behind if it
    does not return: the process is ending by then): its result, or its error, or TimeoutError."""
    done = Future()

    def run():
        try:
            done.set_result(call(*args))
        except Exception as error:  # noqa: BLE001 - raised again below, in the caller's thread
            done.set_exception(error)
    threading.Thread(target=run, daemon=True).start()
    if not wait([done], seconds).done:
        raise TimeoutError(f"no answer in {seconds:g} s")
    return done.result()


def _first(store, me: str) -> bool:
    """Whether this process's failure is the job's first, to be said: the store keeps the first
    name given. A store that fails or does not answer cannot tell: said, rather than never."""
    try:
        return _bounded(STORE_S, store.compare_set, FIRST_FAILURE, "", me).decode() == me
    except Exception:  # noqa: BLE001 - its host ended or stopped: the job is failing anyway
        return True


def _claim_the_end() -> None:
    """This thread ends the process, once: a thread that comes second (the watcher and the
    excepthook at once) waits for the first one's os._exit instead, saying nothing."""
    if not _ENDING.acquire(blocking=False):
        threading.Event().wait()


def _own_line(accelerator) -> None:
    """Start a line of its own: the main process's progress bar holds the terminal's line."""
    if accelerator.is_main_process:
        _clear_progress_bars()
    else:
        print(file=sys.stderr)


def _stop_watching(stop: threading.Event, thread: threading.Thread, store, me: str) -> None:
    """At exit, the watcher out of the store before Python's shutdown (a daemon thread that it finds
    inside a C++ call, the store's, aborts the process: "terminate called"); then its beat says
    "ended", no stall. Not when end_now runs the exit handlers (another thread holds _ENDING): it
    ends the process with os._exit, and the watcher may be waiting for it."""
    stop.set()
    if _ENDING.acquire(blocking=False):  # a normal exit: a watcher that wakes now ends nothing
        thread.join(timeout=STORE_S + 1)
        with suppress(Exception):
            _bounded(STORE_S, store.set, f"beat-{me}", "ended")


def _stall_s(accelerator) -> float:
    """STALL_S, or a quarter of the group's timeout (--dist-timeout) if less, 10 s at least."""
    with suppress(Exception):  # the timeout of the group's backend for this process's device
        group = torch.distributed.distributed_c10d._get_default_group()  # noqa: SLF001
        timeout = group._get_backend(accelerator.device).options._timeout  # noqa: SLF001
        return max(10.0, min(STALL_S, timeout.total_seconds() / 4))
    return STALL_S


def _silence(store, peer: str, heard: list) -> float:
    """Seconds since ``peer``'s beat changed (``heard``: last read, when); 0 before, or ended."""
    key = f"beat-{peer}"
    beat = _bounded(STORE_S, store.get, key).decode() if _bounded(STORE_S, store.check, [key]) \
        else None
    if beat != heard[0]:
        heard[:] = [beat, time.monotonic()]
    return 0.0 if beat in (None, "ended") else time.monotonic() - heard[1]


def _watch(store, me: str, accelerator, stop: threading.Event, stall_s: float) -> None:
    """Another process's failure, or the store's, read from the store: this process ends, unless
    within GRACE_S it ends by itself, with its own failure met in a collective (gloo's fail at
    once) or at the job's end (the store's host exits first). Each poll also posts this process's
    beat and reads the next one's: silent for ``stall_s``, it is stalled. Until ``stop`` is set."""
    peer, host = str((int(me) + 1) % accelerator.num_processes), socket.gethostname()
    heard, beats = [None, time.monotonic()], 0
    while not stop.wait(POLL_S):
        try:
            beats += 1
            _bounded(STORE_S, store.set, f"beat-{me}", f"{beats} {BEAT['step']} {host}")
            if _silence(store, peer, heard) > stall_s:
                _claim_the_end()
                if _first(store, me):
                    _, step, where = heard[0].split(" ", 2)
                    _own_line(accelerator)
                    when = f"after step {step}" if step != "0" else "before its first step"
                    print(f"error: process {me}: process {peer} on {where} has not answered for "
                          f"{stall_s:g} s, {when}: it is stopped (SIGSTOP, a frozen node) or cut "
                          f"off; the job ends now, not at --dist-timeout", file=sys.stderr)
                end_now(accelerator)
            if not _bounded(STORE_S, store.check, [FIRST_FAILURE]):
                continue
            failed, lost = _bounded(STORE_S, store.get, FIRST_FAILURE).decode(), None
        except Exception as error:  # noqa: BLE001 - the store's host ended or stopped
            failed, lost = None, error
        if failed == me or stop.wait(GRACE_S) or lost is not None and STOPPING.is_set() and \
                stop.wait(STOPPING_S) or not threading.main_thread().is_alive():  # a stop waits on
            return
        _claim_the_end()
        if lost is not None:
            _own_line(accelerator)
            print(lost_the_store(me, lost), file=sys.stderr)
        end_now(accelerator, through_the_store=lost is None)


def end_now(accelerator, through_the_store: bool = True) -> None:
    """End this process as failed, now, once: its trackers closed as failed (for TRACKERS_S at
    most), its progress bars cleared, its output flushed, its exit handlers run (the run folder's
    lock, the loader workers, wandb's service: EXIT_S at most), then os._exit, not Python's
    shutdown: torch's threads, still in a collective with a process that is gone, can abort it
    there (C++ "terminate called"). ``through_the_store``: it says so in the store, and process 0,
    which hosts the store unless a launcher does, holds it until every process has (HOLD_S at
    most): the others' watch would meet a closed store instead of the failure."""
    _claim_the_end()
    several = through_the_store and getattr(accelerator, "num_processes", 1) > 1
    ended = 0
    with suppress(Exception):
        ended = several and _bounded(STORE_S, _store().add, ENDED, 1)
    for seconds, call, args in ((TRACKERS_S, end_tracking, (accelerator,)),
                                (EXIT_S, _exit_handlers, ())):
        with suppress(Exception):
            _bounded(seconds, call, *args)
    deadline = time.monotonic() + HOLD_S
    with suppress(Exception):
        while several and accelerator.process_index == 0 and ended < accelerator.num_processes \
                and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
            ended = _bounded(STORE_S, _store().add, ENDED, 0)
    os._exit(1)


def _exit_handlers() -> None:
    """What a normal exit runs first: the output flushed, the exit handlers."""
    _clear_progress_bars()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # noqa: SLF001


def _clear_progress_bars() -> None:
    for bar in list(getattr(tqdm, "_instances", ())):  # tqdm.auto's bars are tqdm's too
        bar.close()  # leave=False: the line is cleared


def ignore_the_launchers_stop() -> None:
    """SIGTERM ignored from here on, by a process that ends with the job's agreed failure: the
    launcher stops the other processes once one has exited, and one that it kills (before it has
    said why, or while it exits) dies by a signal instead of its own exit status 1."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def end_tracking(accelerator, stopped: bool = False) -> None:
    """Finish the job's trackers as failed, or as ``stopped`` with a checkpoint to resume, from any
    thread (wandb would record a run nothing finished as a success, MLflow as FINISHED): wandb's
    exit code 1, MLflow's FAILED; stopped: wandb's run marked preempting (exit code 0: a resume
    continues it), MLflow's KILLED. TensorBoard's finish() flushes its events. The main process has
    the trackers; the others end its MLflow run too (it may be dead: SIGKILL, out of memory)."""
    status = "KILLED" if stopped else "FAILED"
    if MLFLOW_RUN and not getattr(accelerator, "is_main_process", True):  # it may be gone
        with suppress(Exception):
            __import__("mlflow").MlflowClient(MLFLOW_RUN[1]).set_terminated(MLFLOW_RUN[0], status)
    for tracker in getattr(accelerator, "trackers", None) or []:
        with suppress(Exception):  # already failing; tracking must not add to it
            run = getattr(tracker, "run", None)  # Accelerate's WandBTracker holds the wandb Run
            if hasattr(run, "finish"):
                if stopped:
                    run.mark_preempting()
                run.finish(exit_code=0 if stopped else 1)
            elif getattr(tracker, "name", None) == "mlflow":  # imported as the run started
                # MLflow's active run is the thread's own: its client ends it from end_now's thread,
                # end_run in the thread that started it (else FINISHED at exit)
                mlflow = sys.modules["mlflow"]
                mlflow.MlflowClient().set_terminated(tracker.active_run.info.run_id, status)
                mlflow.end_run(status=status)
            else:
                tracker.finish()
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
