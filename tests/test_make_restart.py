"""`make ddp`, the README's DDP command, survives a crashed worker: run through the Makefile itself.

The contract, on 2 CPU processes: kill one worker with SIGKILL in the middle of an epoch, the
launcher restarts the job, and the final weights equal those of an uninterrupted run bit for bit
(the same flags, 2 processes forked as torchrun starts them: tests/helpers.py's Processes).

What the recipe's settings do (the Makefile says why), checked by dropping each (docs/tests.md):
`--max_restarts` restarts the job: without it the job fails. PET_STANDALONE=1 gives the job a
rendezvous of its own instead of localhost:29400, which another job on the machine may hold (a
listener stands for it here): without it the launcher waits there until the test gives up. Without
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restarted job hangs or fails in about one run in three (a
race; this test then fails), and `--rdzv_backend c10d` is what PET_STANDALONE=1 makes torchrun use
anyway (torch/distributed/run.py), so dropping it alone changes nothing.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
from helpers import ROOT, Processes, assert_same_weights, user_env
from safetensors import safe_open

# 4 steps an epoch, 8 in all, a checkpoint every 2 steps; the last value of a flag wins over the recipe's.
ARGS = ("--dataset synthetic --synthetic-train-size 256 --synthetic-test-size 64 --model resnet20 --batch-size 64 "
        "--epochs 2 --checkpoint-every 2 --report-to none")
RECIPE = ("--dataset", "synthetic", "--model", "resnet20", "--checkpoint-every", "50")  # the Makefile's flags
DEFAULT_RENDEZVOUS = 29400  # torch's c10d default port, where launchers without PET_STANDALONE meet


@contextlib.contextmanager
def another_job_at_the_default_rendezvous():
    """A listener on localhost:29400 that never answers, as the store of another job there would
    be to a launcher that went to meet it; nothing if the port is taken already (by such a job)."""
    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", DEFAULT_RENDEZVOUS))
        listener.listen()
    except OSError:
        pass
    try:
        yield
    finally:
        listener.close()


def kill_worker(make: subprocess.Popen, checkpoint: Path, log: Path, deadline: float) -> int:
    """SIGKILL the worker of local rank 1 once ``checkpoint`` exists; its pid."""
    while not checkpoint.is_dir():
        assert make.poll() is None, f"make ddp ended before {checkpoint}:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"{checkpoint} never appeared:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    for process in psutil.Process(make.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "train_ddp.py" in " ".join(process.cmdline()) and process.environ().get("LOCAL_RANK") == "1":
                process.send_signal(signal.SIGKILL)
                return process.pid
    raise AssertionError(f"no worker of local rank 1 to kill:\n{log.read_text()[-3000:]}")


def test_make_ddp_restarts_a_killed_worker_and_resumes_from_its_checkpoint(tmp_path):
    out, log = tmp_path / "run", tmp_path / "make.log"
    venv = Path(sys.prefix)
    command = ["make", "-C", str(ROOT), "-o", f"{venv}/bin/.installed", f"VENV={venv}", "ddp", "NPROC=2",
               f"OUTPUT_DIR={out}", f"ARGS={ARGS}"]
    # The recipe's settings only: none of them, nor any other of the launcher's, from the test's environment.
    env = {k: v for k, v in user_env(CIFAR_CACHE_DIR=str(tmp_path / ".cache"), OMP_NUM_THREADS="1").items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "TORCH_DISABLE_SHARE_RDZV"))}
    # the uninterrupted run, beside the job
    reference = Processes("train_ddp.py", *RECIPE, *ARGS.split(), "--output-dir", tmp_path / "reference",
                          cwd=tmp_path)
    with another_job_at_the_default_rendezvous(), open(log, "w") as output:
        make = subprocess.Popen(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            killed = kill_worker(make, out / "checkpoints" / "step_00000002", log, deadline=time.time() + 150)
            make.wait(timeout=150)  # a restart that hangs (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE) ends here
        finally:
            if make.poll() is None:
                os.killpg(make.pid, signal.SIGKILL)
                make.wait()
    text = log.read_text()
    assert make.returncode == 0, f"make ddp failed after worker {killed} was killed:\n{text[-4000:]}"
    # The restarted job found its newest checkpoint by itself (no --resume in the recipe) and finished.
    resumed = [line for line in text.splitlines() if line.startswith("resumed from ")]
    assert resumed and resumed[0].startswith(f"resumed from {out}/checkpoints/step_0000000"), text[-4000:]
    assert "done: step 8" in text, text[-4000:]
    with safe_open(str(out / "model.safetensors"), "pt") as final:
        assert int(final.metadata()["step"]) == 8
    assert reference.wait(timeout=150) == [0, 0], reference.output()
    assert_same_weights(out, tmp_path / "reference")
