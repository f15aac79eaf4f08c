"""A failure that one process of a 2-process job meets alone ends both within seconds, said once.

Each fault is real: a damaged image in one process's slice of the training or of the evaluation
data, SIGKILL to one process mid-training, an exception in one process while the other waits outside
any collective (as a process waits in an NCCL collective that nothing fails), a disk that fills under
load. The processes are started as torchrun starts its workers, but without a launcher
(helpers.Processes): nothing stops a process but our own code, and each process's exit status and
output are checked, not only the lines printed.
"""

import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT, Processes, image_folder, tmpfs

FOLDER = ["--image-size", "32", "--model", "resnet20", "--batch-size", "8", "--epochs", "1", "--loader",
          "workers", "--workers", "1", "--report-to", "none"]
ABORTS = ("Traceback", "terminate called", "core dumped")


def lines(text: str) -> list[str]:
    """The warning and error lines of a process's stderr, after any progress bar on their line."""
    found = (re.match(r"(?:.*?\])?\s*((?:warning|error): .*)$", line.strip()) for line in re.split(r"[\r\n]", text))
    return [m.group(1) for m in found if m]


def damaged(root, split: str, index: int):
    """The index-th image of a split, cut to its first 300 bytes: a file that cannot be decoded."""
    path = sorted((root / split).rglob("*.jpg"))[index]
    path.write_bytes(path.read_bytes()[:300])
    return path


def ended_as_one(job: Processes, failed: int | None = None) -> list[str]:
    """Both processes exited 1 within 5 s of each other, neither by a signal nor an abort, with one
    line in all (on a line of its own, from process ``failed``); that line."""
    assert job.wait() == [1, 1], job.output()
    assert job.spread() < 5, (job.spread(), job.output())
    said = {rank: lines(job.stderr(rank)) for rank in (0, 1)}
    assert sum(len(found) for found in said.values()) == 1, job.output()
    for rank in (0, 1):
        assert not any(sign in job.stderr(rank) for sign in ABORTS), job.output()
    if failed is not None:
        assert said[failed] and said[failed][0] in job.stderr(failed).splitlines(), job.output()
    return [line for found in said.values() for line in found]


@pytest.fixture
def folder(tmp_path):
    return image_folder(tmp_path / "data", train=48, val=8, classes=2)


def test_a_bad_training_image_in_one_process_ends_both_and_the_advice_finishes_the_run(folder, tmp_path):
    """Process 1 reads the damaged image (the order is a function of the seed); process 0 is in a
    collective by then. The printed advice, followed, finishes the run."""
    bad = damaged(folder, "train", 17)
    command = ["train_ddp.py", "--data-dir", folder, *FOLDER, "--output-dir", tmp_path / "run"]
    [line] = ended_as_one(Processes(*command, cwd=tmp_path), failed=1)
    assert line.startswith(f"error: cannot decode image {bad} (OSError: ")
    assert line.endswith("); replace or remove the file, or pass --bad-images skip to train without it; then the "
                         "same command with --resume continues the run")
    bad.unlink()  # "remove the file", "then the same command with --resume"
    again = tmp_path / "again"
    again.mkdir()
    job = Processes(*command, "--resume", cwd=again)
    assert job.wait() == [0, 0], job.output()
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_a_bad_evaluation_image_in_one_process_ends_both(folder, tmp_path):
    bad = damaged(folder, "val", 7)
    job = Processes("train_ddp.py", "--data-dir", folder, *FOLDER, "--output-dir", tmp_path / "run", cwd=tmp_path)
    [line] = ended_as_one(job)
    assert line.startswith(f"error: cannot decode image {bad} (OSError")
    assert "--bad-images skip" in line


def test_a_process_killed_mid_training_ends_the_other_with_one_line(tmp_path):
    job = Processes("train_ddp.py", "--dataset", "synthetic", "--synthetic-train-size", "4096",
                    "--synthetic-test-size", "64", "--model", "resnet20", "--batch-size", "16", "--epochs", "1",
                    "--report-to", "none", "--output-dir", tmp_path / "run", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while "epoch 1/1:" not in job.stderr(0):  # training has started
        assert time.monotonic() < deadline and job.procs[0].poll() is None, job.output()
        time.sleep(0.1)
    time.sleep(1)
    job.procs[1].send_signal(signal.SIGKILL)
    assert job.wait() == [1, -signal.SIGKILL], job.output()
    assert job.spread() < 5, (job.spread(), job.output())
    [line] = lines(job.stderr(0))
    assert re.fullmatch(r"error: process 0 lost another process of the job in a collective \(.+\): that process "
                        r"ended first; its own output or the launcher's report says why", line), line
    assert not any(sign in job.stderr(0) for sign in ABORTS), job.output()


def test_a_process_waiting_outside_a_collective_is_ended_by_the_watch(tmp_path):
    job = Processes(ROOT / "tests" / "probe_watch.py", cwd=tmp_path)
    assert job.wait(timeout=60) == [1, 1], job.output()
    assert job.spread() < 6, (job.spread(), job.output())  # the watch asks every 0.5 s, then waits 3 s
    assert "RuntimeError: a bug in process 1" in job.stderr(1)  # a bug keeps its traceback
    assert job.stderr(0) == "" and "not ended" not in job.stdout(0), job.output()


@pytest.mark.skipif(shutil.which("mount") is None, reason="mounts a tmpfs")
def test_a_full_disk_under_load_ends_both_processes_every_time(tmp_path):
    """3 MB hold the first checkpoint (step 2) of resnet20, not the second: every process writes its
    part (save_state) and learns of the failure in one collective. Three runs, a busy process beside;
    in the second, process 1 saves 2 s late (tests/late_save.py), after the main process has failed
    and ended: the folder it makes again is removed too. The last one's advice followed, with the
    space freed, finishes the run."""
    flags = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "64", "--model",
             "resnet20", "--batch-size", "32", "--epochs", "2", "--report-to", "none", "--checkpoint-every", "2",
             "--keep-checkpoints", "5"]
    # At the lowest priority: it takes the cores the suite's other tests leave idle (all of them when
    # this test runs alone), not the ones they are using.
    busy = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    try:
        for attempt in range(3):
            with tmpfs(tmp_path / f"disk{attempt}", "3m") as disk:
                out = disk / "run"
                late = [ROOT / "tests" / "late_save.py"] if attempt == 1 else []
                job = Processes(*late, ROOT / "scripts" / "train_ddp.py", *flags, "--output-dir", out, cwd=tmp_path)
                [line] = ended_as_one(job)
                assert line.startswith(f"error: cannot write checkpoint {out}/checkpoints/step_00000004 (no space left")
                assert line.endswith(f"the checkpoint {out}/checkpoints/step_00000002 is intact: free space in "
                                     f"{out}, then run the same command with --output-dir {out} --resume")
                assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]
                if attempt == 2:
                    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
                    job = Processes("train_ddp.py", *flags, "--output-dir", out, "--resume", cwd=tmp_path)
                    assert job.wait() == [0, 0], job.output()
                    assert "resumed from" in job.stdout(0) and (out / "model.safetensors").is_file()
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.skipif(shutil.which("mount") is None, reason="mounts a tmpfs")
def test_a_full_disk_under_fsdp2_with_a_weight_average_ends_both_processes(tmp_path):
    """FSDP2 forced on 2 CPU processes (tests/probe_fsdp.py) with --ema-decay: save_state gathers the
    average's slices and only the main process writes it, so a process whose write fails may leave the
    other inside save_state's collectives. 6 MB hold the first checkpoint (3.8 MB), not the second."""
    flags = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "64", "--model",
             "resnet20", "--batch-size", "32", "--epochs", "2", "--report-to", "none", "--checkpoint-every", "2",
             "--keep-checkpoints", "5", "--ema-decay", "0.9"]
    with tmpfs(tmp_path / "disk", "6m") as disk:
        out = disk / "run"
        job = Processes(ROOT / "tests" / "probe_fsdp.py", ROOT / "scripts" / "train_fsdp.py", *flags, "--output-dir",
                        out, cwd=tmp_path)
        [line] = ended_as_one(job)
        assert line.startswith(f"error: cannot write checkpoint {out}/checkpoints/step_00000004 (no space left")
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]


def test_tracker_servers_that_do_not_answer_cost_their_bounds_and_one_warning_each(tmp_path):
    """wandb online and MLflow, their server accepting connections and never answering, wandb's
    start bounded at 12 s (WANDB_INIT_TIMEOUT) and MLflow's at about 15 s (two requests of 6 s, as
    the user's MLFLOW_HTTP_REQUEST_TIMEOUT asks), each above --dist-timeout's 10: the other process
    waits for the main one in the store, not in a collective that the timeout would end; the run
    finishes, one warning said for each."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel accepts; nothing reads or answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    env = {"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": url, "WANDB_INIT_TIMEOUT": "12", "MLFLOW_TRACKING_URI": url,
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "6"}
    with silent:
        job = Processes("train_ddp.py", "--dataset", "synthetic", "--synthetic-train-size", "64",
                        "--synthetic-test-size", "32", "--model", "resnet20", "--batch-size", "16", "--epochs", "1",
                        "--report-to", "wandb", "mlflow", "--dist-timeout", "10", "--output-dir", tmp_path / "run",
                        cwd=tmp_path, env_extra=env)
        assert job.wait(timeout=240) == [0, 0], job.output()
    said = job.stdout(0).splitlines()
    assert "wandb: starting its run online (a server that does not answer costs 12 s, then training goes on " \
           "without it)" in said, job.output()
    assert f"mlflow: starting its run at {url} (one that does not answer costs about 15 s, then training goes " \
           f"on)" in said, job.output()
    warnings = [line for line in said if line.startswith("warning:")]
    assert [warning.split(" (")[0] for warning in warnings] == ["warning: wandb did not start",
                                                                "warning: mlflow did not start"], warnings
    assert all(warning.endswith("); training goes on without tracking") for warning in warnings), warnings
    assert "done: step 4" in job.stdout(0) and lines(job.stderr(1)) == []
    assert (tmp_path / "run" / "model.safetensors").is_file()
