"""The run folder's lock: one job writes a run folder at a time; a dead job's lock is taken over.

Not filelock's FileLock (read in filelock 4.3): it chooses flock or its soft lock once, at
import, by whether fcntl exists, so a filesystem that refuses flock (some NFS and Lustre mounts:
ENOLCK) fails the lock instead of taking the fallback here, whose takeover of a dead holder's
file filelock's soft lock lacks (a SIGKILLed job's file stays until removed by hand); and its
file names no holder (host, pid, job) for the line a second job gets.
"""

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

import psutil

from common.errors import UserError
from common.files import atomic_write

LOCK_FILE = ".lock"  # held by the main process of the job that writes the run
JOB_FILE = ".job"  # the launched job that took the folder last: its restarted workers go on there
# The job's id from its scheduler, when it starts the whole job again with new processes on new
# hosts and counts nothing (a Kubernetes JobSet restart, Kueue's resume): one per job, the same at
# each of its starts. accelerate_configs/kubernetes/ sets it to the JobSet's uid (downward API).
JOB_ID_VARIABLE = "TRAINING_JOB_ID"
# config.json of a run started again from step 0, until replaced (common.run.folder sets it aside)
SET_ASIDE = ".config.json.before-restart"

def lock_run_folder(folder: Path) -> "RunLock":
    """Lock the run folder for this job's main process, or stop with one line naming its holder.

    The lock is ``flock`` on ``folder/.lock``: the kernel releases it however the process ends
    (SIGKILL included), and on NFS lockd carries it to other hosts. The file names its holder (host,
    pid, since when, the job) for the message. A free lock's file is a dead job's: this one takes it
    over with one line, quietly if it is this job's earlier life (a worker restarted by torchrun, a
    SLURM job requeued). Without flock (some network filesystems), the file alone is the lock: one
    of a process no longer running on this host, or of this job before a restart, is taken over; one
    from another host is not (that process may still run). Released at exit (``RunLock.release``):
    the file removed, with the folders made for it alone if the run wrote nothing."""
    folder = Path(folder)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "job": this_job()}
    lock = RunLock(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        previous = lock.acquire(me)
        lock.put_back_config()  # set aside by a job that died before it wrote its own
    except (OSError, UserError) as error:
        lock.release()
        if isinstance(error, UserError):
            raise
        linked = error.errno == errno.ELOOP  # O_NOFOLLOW's answer: never written through
        why = "its .lock is a symbolic link: remove it" if linked else error.strerror
        raise UserError(f"cannot write in {folder} ({why or error}): choose an --output-dir you "
                        f"can write to") from None
    if previous and not (me["job"] and previous.get("job") == me["job"]):
        print(f"warning: {lock.path} was left by {_holder(previous)}, which ended without "
              f"releasing it; this job takes the run over", file=sys.stderr, flush=True)
    return lock


def this_job() -> str | None:
    """What stays the same when a job starts again by itself: the id its scheduler gives it
    (JOB_ID_VARIABLE), the SLURM job id (requeued, perhaps on another host), or the torchrun agent
    that restarts its workers; None for a plain process."""
    for variable, kind in ((JOB_ID_VARIABLE, "job"), ("SLURM_JOB_ID", "slurm job")):
        if os.environ.get(variable):
            return f"{kind} {os.environ[variable]}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return (f"torchrun {os.environ['TORCHELASTIC_RUN_ID']} on {socket.gethostname()}, "
                f"agent pid {os.getppid()}")
    return None


def read_job(folder: Path) -> str | None:
    """The launched job that took ``folder`` last (``this_job``); None: none, or unreadable."""
    try:
        return (Path(folder) / JOB_FILE).read_text().strip() or None
    except OSError:
        return None


def _holder(info: dict) -> str:
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} (since {info.get('since', '?')})"


class RunLock:
    """The lock one job holds on its run folder; ``lock_run_folder`` takes it."""

    _held: list["RunLock"] = []  # released at exit; forked children (DataLoader workers) forget it
    _hooked = False  # the hooks registered with the first lock taken: importing changes nothing

    def __init__(self, folder: Path):
        self.folder, self.path, self.fd = folder, folder / LOCK_FILE, None
        # the folders that taking the lock makes, innermost first
        self.created = [p for p in [folder, *folder.parents] if not p.exists()]

    def acquire(self, me: dict) -> dict | None:
        """Hold the lock; returns what a dead holder left in the file (None: it was free)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # ELOOP: a link
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if (holder := _read_holder(self.path, wait=True)) is None:
                    continue  # released meanwhile
                self._refuse(holder)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                return self._acquire_without_flock(me)
            # the holder may have removed the file between our open and flock: lock the new one
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            os.close(fd)
        previous = _read_holder(self.path)
        self._hold(fd, me)
        return previous

    def _acquire_without_flock(self, me: dict) -> dict | None:
        previous = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                previous = _read_holder(self.path, wait=True)
                if previous is not None and not _ended(previous, me):
                    self._refuse(previous)
                self.path.unlink(missing_ok=True)
                continue
            self._hold(fd, me)
            return previous
        self._refuse(_read_holder(self.path) or {})  # another job took it over at the same moment

    def _hold(self, fd: int, me: dict) -> None:
        """Keep ``fd`` as this job's lock, released at exit; write ``me`` (its holder) in it."""
        if not RunLock._hooked:
            atexit.register(RunLock._release_all)
            os.register_at_fork(after_in_child=RunLock._forget_all)
            RunLock._hooked = True
        self.fd = fd
        RunLock._held.append(self)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)  # for the other hosts that read it

    def _refuse(self, holder: dict) -> NoReturn:
        elsewhere = holder.get("host") not in (None, socket.gethostname())
        hint = f"; if that job has ended, remove {self.path}" if elsewhere else ""
        raise UserError(f"{self.folder} is in use by another job ({_holder(holder)}): wait for it "
                        f"to end, or choose another --output-dir{hint}")

    def record_job(self) -> None:
        """Say in the folder which launched job took it (a SLURM job, a torchrun agent), so that
        its restarted workers know the folder for theirs; nothing for a plain process."""
        if (job := this_job()) is None or read_job(self.folder) == job:
            return
        # not written: a restart then gets the checks of a new start: it stops, it never guesses
        with contextlib.suppress(OSError), atomic_write(self.folder / JOB_FILE) as f:
            f.write(f"{job}\n".encode())

    def put_back_config(self) -> None:
        """The set-aside config.json back in place, unless a new one was written."""
        aside, config = self.folder / SET_ASIDE, self.folder / "config.json"
        if aside.exists() and not config.exists():
            os.replace(aside, config)
        aside.unlink(missing_ok=True)

    def release(self) -> None:
        """Give the lock up: remove the file, then the folders made for it that stayed empty."""
        if self.fd is not None:
            # OSError: the folder was moved or removed while running: nothing of ours is left there
            with contextlib.suppress(OSError):
                self.put_back_config()
                # Removed while still locked, and only if it is ours: a job that opened it meanwhile
                # finds the name gone (acquire) and locks a new file.
                if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                    self.path.unlink()
            os.close(self.fd)
            self.fd = None
            RunLock._held.remove(self)
        with contextlib.suppress(OSError):
            if self.created and [p.name for p in self.folder.iterdir()] == [JOB_FILE]:
                (self.folder / JOB_FILE).unlink()  # the run wrote nothing
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
    pid = holder.get("pid")
    if holder.get("host") != me["host"] or type(pid) is not int or not 0 < pid < 2**31:
        return False  # another host: no way to know
    # psutil's test: one that runs as another user runs; a thread's id is no process
    return not psutil.pid_exists(pid)
