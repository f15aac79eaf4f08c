"""Crash, restart, resume: a killed worker costs the steps since the last checkpoint, nothing more.

The contract, on 2 CPU processes: kill one worker with SIGKILL in the middle of an epoch, let the
launcher restart the job, and the final weights equal those of an uninterrupted run bit for bit.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ROOT, weights

BIN = Path(sys.executable).parent
# 8 steps an epoch, 24 in all; a checkpoint every 4 steps, so step 12 is the middle of epoch 2.
FLAGS = ["--dataset", "synthetic", "--synthetic-train-size", "512", "--synthetic-test-size", "100",
         "--model", "resnet20", "--batch-size", "64", "--epochs", "3", "--checkpoint-every", "4",
         "--keep-checkpoints", "10", "--report-to", "none"]
# The restart recipe that works: c10d rendezvous, and the launcher told not to share
# its TCP store with the rendezvous; the default static rendezvous fails to restart.
RESTARTABLE = ["--max_restarts", "1", "--rdzv_backend", "c10d"]


def env(tmp_path):
    return {**os.environ, "WANDB_MODE": "offline", "CIFAR_CACHE_DIR": str(tmp_path / ".cache"),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def accelerate(*launch_args, script="train_ddp.py"):
    return [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "4gpu.yaml"),
            "--num_processes", "2", *launch_args, str(ROOT / "scripts" / script), *FLAGS]


def run(cmd, tmp_path, *extra):
    done = subprocess.run([*cmd, *map(str, extra)], cwd=ROOT, env=env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def kill_worker_after(process, checkpoint: Path, local_rank: str, timeout=180):
    """SIGKILL the worker with ``local_rank`` as soon as ``checkpoint`` exists; returns its pid."""
    deadline = time.time() + timeout
    while not checkpoint.exists():
        assert process.poll() is None, "the job ended before the checkpoint to kill after"
        assert time.time() < deadline, f"{checkpoint} never appeared"
        time.sleep(0.05)
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if "train_" in " ".join(child.cmdline()) and child.environ().get("LOCAL_RANK") == local_rank:
                child.send_signal(signal.SIGKILL)
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no worker to kill")


def assert_same(a: Path, b: Path):
    ours, theirs = weights(a), weights(b)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    run(accelerate(), tmp_path_factory.getbasetemp(), "--output-dir", out)
    return out


def test_a_killed_worker_is_restarted_and_resumes_bit_for_bit(uninterrupted, tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen([*accelerate(*RESTARTABLE), "--output-dir", str(out)], cwd=ROOT, env=env(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_worker_after(process, out / "checkpoints" / "step_00000012", local_rank="1")
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    assert "resumed from" in output and "step_00000012" in output  # by itself: no --resume given
    assert_same(out, uninterrupted)


def test_without_restarts_a_killed_worker_ends_the_job(tmp_path):
    """Negative control: the kill is real, and the job fails fast, naming the rank, instead of hanging."""
    out = tmp_path / "run"
    process = subprocess.Popen([*accelerate(), "--output-dir", str(out)], cwd=ROOT, env=env(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid = kill_worker_after(process, out / "checkpoints" / "step_00000004", local_rank="1")
    start = time.time()
    output = process.communicate(timeout=120)[0]
    assert process.returncode != 0 and time.time() - start < 60, output
    assert f"pid: {pid}" in output and "rank      : 1" in output
    assert not (out / "model.safetensors").exists()
    assert (out / "checkpoints" / "step_00000004").is_dir()  # the work up to the last checkpoint stays


def test_ddp_stop_and_resume_by_hand(uninterrupted, tmp_path):
    out = tmp_path / "run"
    run(accelerate(), tmp_path, "--output-dir", out, "--max-steps", 13)  # stops inside epoch 2
    done = run(accelerate(), tmp_path, "--output-dir", out, "--resume")
    assert "resumed from" in done.stdout and "step 13" in done.stdout
    assert_same(out, uninterrupted)


def test_single_killed_and_resumed_by_hand(tmp_path):
    reference = tmp_path / "reference"
    single = [sys.executable, str(ROOT / "scripts" / "train_single.py"), *FLAGS, "--deterministic"]
    run(single, tmp_path, "--output-dir", reference)

    out = tmp_path / "run"
    process = subprocess.Popen([*single, "--output-dir", str(out)], cwd=ROOT, env=env(tmp_path),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = out / "checkpoints" / "step_00000012"
    while not checkpoint.exists():
        assert process.poll() is None, "the run ended before the checkpoint to kill after"
        time.sleep(0.05)
    process.kill()
    process.wait()
    assert not (out / "model.safetensors").exists()
    run(single, tmp_path, "--output-dir", out, "--resume")
    assert_same(out, reference)


def test_a_nan_loss_stops_every_process_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    cmd = [*accelerate(), "--lr", "1e6", "--checkpoint-every", "2", "--output-dir", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    # Each process writes its line; they may follow a progress bar or each other on one line.
    lines = re.findall(r"error: the loss is .*? with a lower --lr", done.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], done.stderr  # both processes, the same decision
    step = int(lines[0].split(" at step ")[1].split(":")[0])
    newest = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir())
    assert newest < step and f"the last good checkpoint is {out}/checkpoints/step_{newest:08d}" in lines[0]
    assert not (out / "model.safetensors").exists()


def test_a_stalled_worker_fails_the_job_after_the_dist_timeout(tmp_path):
    """Rank 1 stops answering after 3 steps; rank 0 waits --dist-timeout (10 s here, 600 by default)
    in its next all-reduce, fails, and the launcher ends the job instead of letting it hang."""
    cmd = [*accelerate(), "--dist-timeout", "10", "--output-dir", str(tmp_path / "run")]
    cmd.insert(cmd.index(str(ROOT / "scripts" / "train_ddp.py")), str(ROOT / "tests" / "stall_rank.py"))
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    assert done.returncode != 0
    assert re.search(r"[Tt]imed? ?out", done.stderr), done.stderr[-3000:]
    assert elapsed < 200, f"the job took {elapsed:.0f} s to fail"  # start-up + 10 s, not the 3,600 s stall
