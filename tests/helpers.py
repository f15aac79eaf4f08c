"""What the tests share: running the scripts as a user does, and reading what they leave."""

import atexit
import contextlib
import hashlib
import json
import os
import pickle
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchvision.io import encode_jpeg

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
    done = execute([*launcher, str(ROOT / "scripts" / script), *map(str, args)], cwd=cwd, env=env, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{script} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


# Console scripts execute forks from the zygote too, saving their ~5 s of imports: the launchers (the
# processes they start start cold, as a user's do) and pytest (a test that collects tests).
CONSOLE_SCRIPTS = {str(BIN / name) for name in ("accelerate", "torchrun", "pytest")}


def forkable(command: list[str]) -> bool:
    """Whether the zygote can run ``command``: ``python script.py ...`` or one of CONSOLE_SCRIPTS."""
    return command[0] in CONSOLE_SCRIPTS or (len(command) > 1 and command[0] == sys.executable
                                             and command[1].endswith(".py"))


def execute(command, cwd, env, timeout) -> subprocess.CompletedProcess:
    """subprocess.run(command) with its output captured, stdin closed; ``python script.py ...`` and the
    CONSOLE_SCRIPTS (``accelerate launch ...``, ``torchrun ...``) forked from the warm Zygote instead of
    started cold."""
    command = [str(part) for part in command]
    if forkable(command) and Zygote.can_run(env):
        return Zygote.run(command, cwd=cwd, env=env, timeout=timeout)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


class Zygote:
    """tests/zygote.py: `python script.py` runs forked from a process that has imported torch,
    torchvision and accelerate, so each run saves their ~7 s of imports. One zygote serves one run
    at a time; runs started together (from threads) each take an idle one or start another."""

    idle: list["Zygote"] = []
    lock = threading.Lock()
    # Variables read while python starts or torch, torchvision, accelerate and what they import
    # are imported (TORCH_LOGS, OMP_NUM_THREADS, PYTHONHASHSEED, TMPDIR, accelerate's config path
    # from HF_HOME, Inductor's C++ compiler from CXX ...): a run that sets them otherwise than the
    # zygote had them starts cold.
    IMPORT_TIME = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA", "NCCL", "ACCELERATE",
                   "LD_", "TRITON", "TQDM_", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME", "HOME", "LANG", "LC_", "CXX")

    @classmethod
    def can_run(cls, env: dict) -> bool:
        return cls.same_at_import(env, user_env())

    @classmethod
    def same_at_import(cls, env: dict, other: dict) -> bool:
        names = {k for k in {*env, *other} if k.startswith(cls.IMPORT_TIME)}
        return all(env.get(k) == other.get(k) for k in names)

    def __init__(self, env: dict):
        """A zygote importing with ``env``'s import-time variables (the rest is the user's)."""
        self.env = {**{k: v for k, v in user_env().items() if not k.startswith(self.IMPORT_TIME)},
                    **{k: v for k, v in env.items() if k.startswith(self.IMPORT_TIME)}}
        self.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=self.env, cwd=ROOT)
        self.pending = b""
        atexit.register(self.process.kill)

    @classmethod
    def take(cls, env: dict) -> "Zygote":
        """An idle zygote with ``env``'s import-time variables, or a new one."""
        with cls.lock:
            zygote = next((z for z in cls.idle if cls.same_at_import(env, z.env)), None)
            if zygote is not None:
                cls.idle.remove(zygote)
        if zygote is None or zygote.process.poll() is not None:
            zygote = cls(env)
        return zygote

    def give_back(self) -> None:
        with self.lock:
            self.idle.append(self)

    @classmethod
    def run(cls, command, cwd, env, timeout) -> subprocess.CompletedProcess:
        zygote = cls.take(env)
        in_step = False  # whether the zygote has answered all it was asked, and may serve again
        try:
            done, in_step = zygote.fork(command, cwd, env, timeout), True
            return done
        except subprocess.TimeoutExpired:
            in_step = True  # fork killed the run and read its status
            raise
        finally:
            if in_step:
                zygote.give_back()
            else:
                zygote.process.kill()

    def start(self, command, cwd, env, out: Path, err: Path) -> int:
        """Fork a child to run ``command``, its output to the files ``out`` and ``err``; its pid."""
        argv = command[1:] if command[0] == sys.executable else command  # python X.py, or a console script
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        return self.answer(None)["pid"]

    def fork(self, command, cwd, env, timeout) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            pid = self.start(command, cwd, env, out, err)
            try:
                returncode = self.answer(timeout)["returncode"]
            except subprocess.TimeoutExpired:
                self.kill(pid)
                self.answer(None)
                raise subprocess.TimeoutExpired(command, timeout, read(out), read(err)) from None
            except BaseException:  # the test was interrupted: the run must not outlive it
                self.kill(pid)
                raise
            return subprocess.CompletedProcess(command, returncode, read(out), read(err))

    @staticmethod
    def kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass

    def answer(self, timeout) -> dict:
        """The zygote's next line, read unbuffered: its pid and status lines may come in one read."""
        while b"\n" not in self.pending:
            if not select.select([self.process.stdout], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("tests/zygote.py", timeout)
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"tests/zygote.py ended (status {self.process.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


class Forked:
    """``python script.py ...`` or a launcher (CONSOLE_SCRIPTS) forked from a zygote and returned at
    once, for a test that signals the run or the launcher's workers by pid while it trains: what the
    tests use of a Popen (pid, poll, wait, send_signal, kill, communicate), the output read back
    from files once the run has ended (``out`` and ``err``, or files of its own). Not for a test
    that reads what the interpreter's shutdown or the run's orphaned children print (a forked run
    ends with os._exit after its atexit functions), nor for a signal to a process group. A zygote
    is kept for each set of import-time variables: ``env`` has the user's unless a test starts many
    runs with the same others (Processes)."""

    def __init__(self, command, cwd, env: dict, out: Path | None = None, err: Path | None = None,
                 merged: bool = False):
        """``merged``: stderr into stdout, as Popen's stderr=STDOUT (communicate gives (output, None))."""
        self.args = [str(part) for part in command]
        assert forkable(self.args), self.args
        self.returncode = None
        self._folder = tempfile.TemporaryDirectory()
        self._out = out or Path(self._folder.name) / "stdout"
        self._err = self._out if merged else err or Path(self._folder.name) / "stderr"
        self._zygote = Zygote.take(env)
        try:
            self.pid = self._zygote.start(self.args, cwd, env, self._out, self._err)
        except BaseException:
            self._zygote.process.kill()
            raise

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout=None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._zygote.answer(timeout)["returncode"]
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._zygote.give_back()
        return self.returncode

    def send_signal(self, signum) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None) -> tuple[str, str]:
        """Wait for the end; (stdout, stderr)."""
        self.wait(timeout)
        output = read(self._out), None if self._err == self._out else read(self._err)
        self._folder.cleanup()
        return output


def read(path: Path) -> str:
    """A run's captured output; empty when the run never opened it (e.g. its folder did not exist)."""
    return path.read_text() if path.exists() else ""


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


def assert_same_weights(a, b) -> None:
    """The weights of two runs (or checkpoints) are equal bit for bit, tensor by tensor; the first that
    differs is named."""
    ours, theirs = weights(a), weights(b)
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def wandb_runs(run_dir: Path) -> list[Path]:
    """The offline wandb run folders a run left next to its record."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"))


@contextmanager
def tmpfs(path: Path, size: str):
    """A real filesystem of ``size`` at ``path`` (a tmpfs, mounted: root only, as CI runs; skipped
    otherwise): it fills as a disk does, and its writers meet the errors a full disk gives."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class Payload:
    """What a crafted pickle holds: an object whose ``__reduce__`` has the loader run a command, here
    one that creates ``marker``. A loader that runs it leaves the marker; one that refuses, none."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path: Path, marker: Path) -> None:
    """``path`` in a checkpoint made a pickle of Payload(marker) in its own format (torch.save's zip
    for a file torch writes, or one that is new; a plain pickle otherwise), the checkpoint's list
    written again to match (relist)."""
    path = Path(path)
    if not path.exists() or zipfile.is_zipfile(path):
        torch.save({"state": Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))
    relist(next(p for p in path.parents if (p / "checkpoint.json").exists()))


def relist(checkpoint: Path) -> None:
    """checkpoint.json written again for the folder as it now is: a forgery, which the crc32
    digests, kept against damage, cannot see."""
    files = [p for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != "checkpoint.json"]
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    manifest["files"] = {p.relative_to(checkpoint).as_posix(): p.stat().st_size for p in files}
    manifest["crc32"] = {p.relative_to(checkpoint).as_posix(): f"{zlib.crc32(p.read_bytes()):08x}" for p in files}
    (checkpoint / "checkpoint.json").write_text(json.dumps(manifest))


def tree_digest(folder: Path) -> dict:
    """Every file under ``folder`` and the sha256 of its bytes: equal before and after, nothing
    was written, changed or removed."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).rglob("*"))
            if p.is_file()}


def image_folder(root: Path, train: int, val: int, classes: int, sizes=((32, 32),), variants: int = 8) -> Path:
    """An ImageNet-layout folder, train/<class>/*.jpg and (val > 0) val/<class>/*.jpg, ``train`` and
    ``val`` JPEGs spread evenly over the classes. Each class is a colour with noise, in ``variants``
    versions (cycling through ``sizes``, (height, width)) encoded once and written many times: it is
    the number of files that matters, and 20,000 files are written in a few seconds."""
    gen = torch.Generator().manual_seed(0)
    pool = []
    for _ in range(classes):
        colour = torch.randint(0, 256, (3, 1, 1), generator=gen).float()
        versions = []
        for v in range(variants):
            h, w = sizes[v % len(sizes)]
            noise = torch.randint(-40, 41, (3, h, w), generator=gen)
            image = (colour + noise).clamp(0, 255).to(torch.uint8)
            versions.append(encode_jpeg(image, quality=90).numpy().tobytes())
        pool.append(versions)
    for split, count in (("train", train), ("val", val)):
        for label in range(classes):
            folder = root / split / f"class{label}"
            for i in range(label, count, classes):
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{i:06d}.jpg").write_bytes(pool[label][i // classes % variants])
    return root


def free_port() -> int:
    """A port no one listens on, never the launchers' defaults that other tests meet at."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in (29400, 29500):
            return port


class Processes:
    """``python scripts/<script>`` (or ``script``, a path) started ``count`` times as torchrun starts its
    workers (RANK, WORLD_SIZE, MASTER_ADDR ...; gloo on the CPU, one thread each), without a launcher:
    nothing stops the others when one ends, and each one's exit status and output are its own. Each
    is forked from a zygote of its own (Forked): a job costs no imports, where a launcher and its
    processes cost about 20 s of CPU before the first step. How the launchers start the processes
    is tested with the launchers (test_train_ddp.py, test_fault_tolerance.py ...)."""

    def __init__(self, script, *args, count=2, cwd: Path, env_extra=None, port=None):
        """``port``: where a store of the test's own (a launcher's) listens; a free one otherwise."""
        self.logs, self.procs, port = Path(cwd), [], port or free_port()
        path = ROOT / "scripts" / script  # a path joined to an absolute one is that one
        for rank in range(count):
            env = user_env(CIFAR_CACHE_DIR=str(Path(cwd) / ".cache"), OMP_NUM_THREADS="1", RANK=str(rank),
                           LOCAL_RANK=str(rank), WORLD_SIZE=str(count), LOCAL_WORLD_SIZE=str(count),
                           GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env_extra or {}))
            self.procs.append(Forked([sys.executable, str(path), *map(str, args)], cwd, env,
                                     out=self.logs / f"rank{rank}.out", err=self.logs / f"rank{rank}.err"))
        self.ended: dict[int, tuple[int, float]] = {}  # rank: (exit status, time.monotonic() then)

    def wait(self, timeout=240) -> list[int]:
        """Every process's exit status (negative: the signal that ended it); those still running after
        ``timeout`` are killed and the test fails."""
        deadline = time.monotonic() + timeout
        while len(self.ended) < len(self.procs):
            for rank, proc in enumerate(self.procs):
                if rank not in self.ended and proc.poll() is not None:
                    self.ended[rank] = (proc.returncode, time.monotonic())
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"still running after {timeout} s: {self.output()}")
            time.sleep(0.02)
        return [self.ended[rank][0] for rank in range(len(self.procs))]

    def kill(self) -> None:
        """SIGKILL to the processes still running (a test that stops waiting for them)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def spread(self) -> float:
        """Seconds between the first process's end and the last's."""
        times = [when for _, when in self.ended.values()]
        return max(times) - min(times)

    def stderr(self, rank: int) -> str:
        return self._read(f"rank{rank}.err")

    def stdout(self, rank: int) -> str:
        return self._read(f"rank{rank}.out")

    def _read(self, name: str) -> str:
        """What a process wrote so far: nothing before its zygote has opened the file (a busy machine
        forks late)."""
        path = self.logs / name
        return path.read_text() if path.exists() else ""

    def output(self) -> str:
        return "\n".join(f"--- rank {r} ({self.ended.get(r, ('running',))[0]}):\n{self.stdout(r)}{self.stderr(r)}"
                         for r in range(len(self.procs)))


def two_processes(script, *args, cwd: Path, env_extra=None, timeout=300) -> subprocess.CompletedProcess:
    """A 2-process job (Processes) run to its end, both processes ending with 0: the main process's
    stdout, both processes' stderr."""
    job = Processes(script, *args, cwd=cwd, env_extra=env_extra)
    assert job.wait(timeout) == [0, 0], job.output()
    return subprocess.CompletedProcess(job.procs[0].args, 0, job.stdout(0), job.stderr(0) + job.stderr(1))


# A log line of torchrun's own (torch.distributed.elastic), each line of a logged traceback included.
# torch gives its file's path relative to the first sys.path entry it is under: .venv/lib/... where
# the project's root is on PYTHONPATH (its venv inside it), torch/... otherwise.
ELASTIC_LOG = r"[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/"


def worker_lines(stderr: str) -> str:
    """What the training processes said, before torchrun's own report of a failed worker."""
    return re.split(ELASTIC_LOG, stderr, maxsplit=1)[0]


def bad_ends(output: str) -> list[str]:
    """What in a launched job's output (accelerate launch, torchrun) says that a training process
    ended badly: a C++ abort, a Python traceback of its own (the launcher's report of a failed worker,
    which starts at its first log line, is not one) or death by a signal in the launcher's table of
    the workers that ended. Empty: every process ended by its own exit."""
    workers = worker_lines(output)
    found = [sign for sign in ("terminate called", "core dumped") if sign in output]
    found += ["a worker's traceback"] if "Traceback" in workers else []
    # the table may list a worker twice: among the failures and as the first one
    found += [f"a worker ended by signal {code}" for code in dict.fromkeys(re.findall(r"exitcode\s*: (-\d+)", output))]
    return found
