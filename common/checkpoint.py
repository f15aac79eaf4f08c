"""The run folder and its files: config.json, metrics.jsonl, checkpoints, the final weights, the lock.

Every file is written under a temporary name and renamed into place (``atomic_write``), so a
process killed while writing leaves the previous file or checkpoint intact, where writing in place
would leave a half-written checkpoint that the next --resume would pick. Each checkpoint ends with
checkpoint.json, the list of its files and their sizes, which --resume checks before it trusts one
(a copy that lost a file, a disk that filled). A running job holds the folder's lock (``.lock``), so
a second job cannot write into the same run.
"""

import atexit
import errno
import fcntl
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NoReturn

import safetensors.torch
import torch
from accelerate.utils import broadcast_object_list
from safetensors.torch import load_file

from common.errors import UserError, first_line

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "checkpoint.json"  # a checkpoint's files and sizes, written last
LOCK_FILE = ".lock"  # held by the main process of the job that writes the run
_SET_ASIDE = ".config.json.before-restart"  # config.json of a run started again from step 0, until replaced
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
    """The run folder, and the checkpoint to continue from (None: a start from step 0).

    ``resume`` is None, "latest" (the newest complete checkpoint of ``output_dir``) or a checkpoint
    folder, whose run folder is then the default ``output_dir``. A worker restarted by torchrun
    (``accelerate launch --max_restarts N``) and a SLURM job requeued (``sbatch --requeue``; SLURM sets
    SLURM_RESTART_COUNT) continue from the newest checkpoint of ``output_dir`` by themselves.
    The main process takes the folder's lock for the job (``lock_run_folder``), checks the folder
    and the checkpoints and decides; the other processes learn its decision, so all of them go on,
    or all stop with the same line.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 \
        or (output_dir is not None and int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0)
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
    if given is not None and (not given.is_dir() or not _STEP_DIR.match(given.name)):
        raise UserError(f"--resume {given}: not a checkpoint folder; pass runs/NAME/checkpoints/step_NNNNNNNN "
                        f"or --resume alone for the newest checkpoint of --output-dir")
    decision = [None, None]  # the checkpoint to continue from, or the line that stops every process
    if accelerator.is_main_process:
        lock = None
        try:
            if resume == "latest" and not restarted and not path.is_dir():
                check_output_dir(path, resume)  # says so before the lock would create the folder
            lock = lock_run_folder(path)
            decision[0] = _choose_checkpoint(lock, path, given, resume, restarted)
        except UserError as error:
            if lock:
                lock.release()
            decision[1] = error.message
    checkpoint, message = broadcast_object_list(decision)  # every process has waited for the checks
    if message:
        raise UserError(message)
    return path, Path(checkpoint) if checkpoint else None  # nothing written yet, so bad input leaves nothing


def _choose_checkpoint(lock: "RunLock", path: Path, given: Path | None, resume: str | None,
                       restarted: bool) -> str | None:
    """resolve_run's decision, on the main process, holding the lock."""
    if given is not None:
        problem = checkpoint_problem(given)
        if problem:
            raise UserError(f"--resume {given}: the checkpoint is damaged ({problem}); pass a complete one, or "
                            f"--resume alone for the newest complete checkpoint of --output-dir")
        if path != given.parent.parent:
            check_output_dir(path, resume=None)  # continuing elsewhere: never into another run
        return str(given)
    if restarted:  # None: the worker died before the first checkpoint; start again in the same folder
        return _newest_complete(path, "")
    check_output_dir(path, resume)
    if not resume:
        return None
    checkpoint = _newest_complete(path, "--resume: ")
    if checkpoint is None:
        # The run stopped before its first checkpoint (a bad image in epoch 1, say): nothing of it
        # is continued, so this run may have other flags (a smaller --batch-size after running out of
        # memory), and config.json must become this run's. The scripts write config.json when there is
        # none: it is set aside here and put back if this run fails before writing its own.
        lock.set_aside_config()
        print(f"warning: --resume: {path} has no checkpoint (its run stopped before the first one): starting it "
              f"again from step 0", file=sys.stderr, flush=True)
    return checkpoint


def _newest_complete(path: Path, prefix: str) -> str | None:
    """The newest checkpoint that checkpoint_problem passes, with one line naming the damaged ones
    skipped; None when there is none at all; one line (UserError) when none is complete."""
    checkpoint, damaged = latest_good_checkpoint(path)
    found = "; ".join(f"{bad.name}: {problem}" for bad, problem in damaged.items())
    if damaged and checkpoint is None:
        raise UserError(f"{prefix}no checkpoint in {path / CHECKPOINT_DIR} is complete ({found}): restore the "
                        f"damaged files, or remove {path / CHECKPOINT_DIR} and --resume to start the run again "
                        f"from step 0")
    if damaged:
        print(f"warning: damaged checkpoint{'s' * (len(damaged) > 1)} skipped ({found}): resuming from "
              f"{checkpoint}, the newest complete one", file=sys.stderr, flush=True)
    return str(checkpoint) if checkpoint else None


def check_output_dir(output_dir: Path, resume: str | None) -> None:
    """Never overwrite a run silently: a used folder needs --resume, --resume needs the folder of a run."""
    if resume:
        if not output_dir.is_dir():
            raise UserError(f"--resume: {output_dir} does not exist; pass the --output-dir of the run "
                            f"to continue")
        if latest_checkpoint(output_dir) is None:
            if (output_dir / "model.safetensors").exists():
                raise UserError(f"--resume: the run in {output_dir} has finished (model.safetensors) and has no "
                                f"checkpoint left to continue from; start a new run in another --output-dir")
            if not (output_dir / "config.json").exists():
                raise UserError(f"--resume: no complete checkpoint in {output_dir / CHECKPOINT_DIR}; "
                                f"start a new run without --resume")
    elif output_dir.exists() and any(p.name != LOCK_FILE for p in output_dir.iterdir()):
        what = "a run" if (output_dir / "config.json").exists() else "files"
        raise UserError(f"--output-dir {output_dir} already holds {what}: add --resume to continue it, "
                        f"or choose another --output-dir")


# ----------------------------------------------------------------------------------------------
# One job per run folder

def lock_run_folder(folder: Path) -> "RunLock":
    """Take the run folder's lock for this job (its main process), or stop with one line naming the
    job that holds it.

    The lock is ``flock`` on ``folder/.lock``: the kernel releases it when the process ends, however
    it ends (SIGKILL included), and on NFS lockd carries it to the other hosts. The file says who
    holds it (host, pid, since when, the job) for the message. A file whose lock is free was left by
    a job that died: this one takes it over with one line, quietly when it is this job's own earlier
    life (a worker restarted by torchrun, a SLURM job requeued). Where flock is not offered (some
    network filesystems), the file alone is the lock: one left by a process that no longer runs on
    this host, or by this job before a restart, is taken over; one from another host is not, as
    nothing here can tell whether that process still runs. Released at exit (``RunLock.release``):
    the file is removed, and so are the folders made only for it when the run wrote nothing.
    """
    folder = Path(folder)
    created = [p for p in [folder, *folder.parents] if not p.exists()]
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
          "job": _job()}
    lock = RunLock(folder, created)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        previous = lock.acquire(me)
        lock.put_back_config()  # set aside by a job that died before it wrote its own
    except OSError as error:
        lock.release()
        raise UserError(f"cannot write in {folder} ({error.strerror or error}): choose an --output-dir you can "
                        f"write to") from None
    except UserError:
        lock.release()
        raise
    if previous and not (me["job"] and previous.get("job") == me["job"]):
        print(f"warning: {lock.path} was left by {_holder(previous)}, which ended without releasing it; this job "
              f"takes the run over", file=sys.stderr, flush=True)
    return lock


def _job() -> str | None:
    """What stays the same when a job starts again by itself: the SLURM job id (requeued, perhaps on
    another host), or the torchrun agent that restarts its workers; None for a plain process."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun {os.environ['TORCHELASTIC_RUN_ID']} on {socket.gethostname()}, agent pid {os.getppid()}"
    return None


def _holder(info: dict) -> str:
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} (since {info.get('since', '?')})"


class RunLock:
    """The lock one job holds on its run folder; ``lock_run_folder`` takes it."""

    _held: list["RunLock"] = []  # released at exit, forgotten by forked children
    _hooked = False

    def __init__(self, folder: Path, created: list[Path]):
        self.folder, self.path, self.created = folder, folder / LOCK_FILE, created  # created: innermost first
        self.fd, self.flock = None, True

    def acquire(self, me: dict) -> dict | None:
        """Hold the lock; returns what a dead holder left in the file (None: it was free)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = _read_holder(self.path, wait=True)
                if holder is None:
                    continue  # released meanwhile
                self._refuse(holder)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                return self._acquire_without_flock(me)
            try:  # the holder may have removed the file between our open and flock: lock the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read_holder(self.path)
        self._hold(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)  # for the other hosts that read it
        return previous

    def _acquire_without_flock(self, me: dict) -> dict | None:
        self.flock, previous = False, None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                previous = _read_holder(self.path, wait=True)
                if previous is not None and not _ended(previous, me):
                    self._refuse(previous)
                self.path.unlink(missing_ok=True)
                continue
            self._hold(fd)
            os.write(fd, (json.dumps(me) + "\n").encode())
            os.fsync(fd)
            return previous
        self._refuse(_read_holder(self.path) or {})  # another job took it over at the same moment

    def _hold(self, fd: int) -> None:
        if not RunLock._hooked:
            atexit.register(RunLock._release_all)
            os.register_at_fork(after_in_child=RunLock._forget_all)  # DataLoader workers must not release it
            RunLock._hooked = True
        self.fd = fd
        RunLock._held.append(self)

    def _refuse(self, holder: dict) -> NoReturn:
        elsewhere = holder.get("host") not in (None, socket.gethostname())
        hint = f"; if that job has ended, remove {self.path}" if elsewhere else ""
        raise UserError(f"{self.folder} is in use by another job ({_holder(holder)}): wait for it to end, or "
                        f"choose another --output-dir{hint}")

    def set_aside_config(self) -> None:
        """Move config.json aside until this job writes its own; ``release`` puts it back otherwise."""
        os.replace(self.folder / "config.json", self.folder / _SET_ASIDE)

    def put_back_config(self) -> None:
        """The set-aside config.json back in place, unless a new one was written."""
        aside, config = self.folder / _SET_ASIDE, self.folder / "config.json"
        if aside.exists():
            if config.exists():
                aside.unlink()
            else:
                os.replace(aside, config)

    def release(self) -> None:
        """Give the lock up: remove the file, then the folders made for it that stayed empty."""
        if self.fd is not None:
            try:
                self.put_back_config()
                # Removed while still locked, and only if it is ours: a job that opened it meanwhile
                # finds the name gone (acquire) and locks a new file.
                if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                    self.path.unlink()
            except OSError:
                pass  # the folder was moved or removed while running: nothing of ours is left there
            os.close(self.fd)
            self.fd = None
            RunLock._held.remove(self)
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote into it
                break

    @staticmethod
    def _release_all() -> None:
        for lock in list(RunLock._held):
            lock.release()

    @staticmethod
    def _forget_all() -> None:
        for lock in RunLock._held:
            os.close(lock.fd)  # the child's copy only: the parent's descriptor keeps the lock
        RunLock._held.clear()


def _read_holder(path: Path, wait: bool = False) -> dict | None:
    """What the lock file says; a holder that has just taken the lock may not have written yet."""
    for _ in range(10 if wait else 1):
        try:
            info = json.loads(path.read_text())
            if isinstance(info, dict):
                return info
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            pass
        if wait:
            time.sleep(0.1)
    return {} if wait else None


def _ended(holder: dict, me: dict) -> bool:
    """Without flock: whether the holder written in the lock file is known to have ended."""
    if holder.get("job") and holder.get("job") == me["job"]:
        return True  # this job before it was restarted or requeued
    if holder.get("host") != me["host"] or not isinstance(holder.get("pid"), int):
        return False  # another host: no way to know
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # runs, as another user
    return False


# ----------------------------------------------------------------------------------------------
# Checkpoints: which are there, which are complete, writing one

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
             if (m := _STEP_DIR.match(p.name)) and (up_to is None or int(m.group(1)) <= up_to)]
    return [p for _, p in sorted(steps, reverse=True)]


def latest_good_checkpoint(output_dir: Path, up_to: int | None = None) -> tuple[Path | None, dict[Path, str]]:
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
    checksums would read every byte (gigabytes of optimizer state) at each resume, for bit flips that
    the storage's own checksums catch. Checkpoints of earlier versions, without checkpoint.json, are
    checked against what save_state writes for the scripts: the model, optimizer, scheduler, the RNG
    state of each process and the training progress.
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
    model = "pytorch_model.bin" if "pytorch_model.bin" in names else "model.safetensors"  # safe_serialization
    processes = 1 + max((int(m.group(1)) for n in names if (m := re.fullmatch(r"random_states_(\d+)\.pkl", n))),
                        default=0)
    expected = [model, "optimizer.bin", "scheduler.bin", *(f"random_states_{i}.pkl" for i in range(processes)),
                "custom_checkpoint_0.pkl"]  # TrainProgress
    others = sorted(n for n in names if n.endswith((".bin", ".pkl", ".pt", ".safetensors")) and n not in expected)
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
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "is not a complete safetensors file"
        if 8 + length + end != size:
            return f"is not a complete safetensors file ({size} bytes where its header gives {8 + length + end})"
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
        accelerator.wait_for_everyone()  # every process's RNG state is written before the list is made
        if accelerator.is_main_process:
            files = {p.relative_to(partial).as_posix(): p.stat().st_size for p in sorted(partial.rglob("*"))
                     if p.is_file()}
            write_json(partial / MANIFEST, {"step": step, "files": files})  # last: it lists all the others
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
        # Newer ones than this (left by a run resumed from an older checkpoint, a damaged one among
        # them) are not counted: they are replaced when this run reaches their step.
        for path in _checkpoints(output_dir, up_to=step)[keep:]:
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
