"""Faults from outside a run, produced for real: Ctrl-C, a terminal that hangs up, a reader of the
output that goes away; and the advice a diverged run prints, followed as a user would.

Ctrl-C and a closed terminal signal the whole foreground process group, so the tests send SIGINT
and SIGHUP to the group of a run started in a session of its own: the training process, its
DataLoader workers and, under `accelerate launch`, the launcher too. These runs start cold: the
output of the workers and of the interpreter's own shutdown is part of what they check. The runs
no signal is sent to fork from the zygote.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BIN, ROOT, bad_ends, execute, user_env, wandb_runs, weights
from wandb_records import offline_run

STOPPED = 75  # common.parallel.step_guard.STOPPED_EXIT_CODE
# 8 steps an epoch, 16 in all, at the peak lr --lr gives (the batch is the reference batch); a batch
# of 32: what these tests check does not depend on it, and a step costs half of one of 64.
TRACKED = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "100",
           "--model", "resnet20", "--batch-size", "32", "--reference-batch-size", "32", "--epochs", "2"]
SMALL = [*TRACKED, "--report-to", "none"]
TRAIN_SINGLE = [sys.executable, str(ROOT / "scripts" / "train_single.py")]
SINGLE = [*TRAIN_SINGLE, *SMALL]
DDP = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "4gpu.yaml"),
       "--num_processes", "2", str(ROOT / "scripts" / "train_ddp.py"), *SMALL]


def env(tmp_path) -> dict:
    return user_env(CIFAR_CACHE_DIR=str(tmp_path / ".cache"), WANDB_MODE="offline")


def start(command, tmp_path, **popen) -> subprocess.Popen:
    """``command`` in a session and process group of its own, as a shell starts a foreground job."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(command, cwd=ROOT, env=env(tmp_path), text=True, start_new_session=True,
                            stdin=subprocess.DEVNULL, **popen)


def wait_for(process, path: Path, timeout=180):
    deadline = time.time() + timeout
    while not path.exists():
        assert process.poll() is None, "the run ended before " + str(path)
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def finish(command, tmp_path, *extra) -> subprocess.CompletedProcess:
    """A run no signal is sent to, to its end: a plain `python script.py` one forks from the zygote."""
    return execute([*command, *map(str, extra)], cwd=ROOT, env=env(tmp_path), timeout=300)


def all_finite(path: Path) -> bool:
    return all(torch.isfinite(t).all() for t in weights(path).values() if t.is_floating_point())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hang-up"])
def test_ctrl_c_and_a_lost_terminal_save_the_step_and_stop_like_sigterm(tmp_path, signum):
    """On the workers path, whose DataLoader workers get the signal too: one line, exit 75, the lock
    released, and --resume finishes the run. Ctrl-C's run is tracked by wandb (offline), whose own
    process is in the group too, and MLflow: wandb's run is marked preempting with exit code 0 and MLflow's
    is KILLED (not FINISHED: it did not end), and the resume continues both to their finish."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    tracked = signum == signal.SIGINT
    command = [*TRAIN_SINGLE, *(TRACKED + ["--report-to", "wandb", "mlflow"] if tracked else SMALL), "--loader",
               "workers", "--workers", "1", "--checkpoint-every", "3"]
    process = start([*command, "--output-dir", str(out)], tmp_path)
    wait_for(process, out / "checkpoints" / "step_00000003")
    os.killpg(process.pid, signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == STOPPED, stdout[-2000:] + stderr[-3000:]
    stops = re.findall(rf"stopped by {signum.name} after step (\d+): the training state is in (\S+);", stdout)
    assert len(stops) == 1, stdout[-2000:]
    step, checkpoint = int(stops[0][0]), Path(stops[0][1])
    assert checkpoint == out / "checkpoints" / f"step_{step:08d}" and (checkpoint / "checkpoint.json").is_file()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert not (out / ".lock").exists() and not (out / "model.safetensors").exists()
    mlflow = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")
    if tracked:
        (stopped,) = map(offline_run, wandb_runs(out))
        assert stopped["exit_code"] == 0 and stopped["preempting"], stdout[-2000:] + stderr[-3000:]  # not crashed
        (killed,) = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()])
        assert killed.info.status == "KILLED"
    done = finish(command, tmp_path, "--output-dir", out, "--resume")
    assert done.returncode == 0 and f"resumed from {checkpoint}" in done.stdout, done.stderr[-3000:]
    assert "done: step 16" in done.stdout
    if tracked:  # one wandb run, continued at the step after the checkpoint
        first, second = map(offline_run, wandb_runs(out))
        assert first["id"] == second["id"] and second["exit_code"] == 0 and not second["preempting"]
        (finished,) = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()])
        assert finished.info.run_id == killed.info.run_id and finished.info.status == "FINISHED"
        assert min(k for k in second["history"] if k is not None) > step, second["history"]


def test_ctrl_c_on_a_two_process_job_stops_both_after_one_step_with_one_line(tmp_path):
    out = tmp_path / "run"
    process = start([*DDP, "--checkpoint-every", "3", "--output-dir", str(out)], tmp_path,
                    stderr=subprocess.STDOUT)
    wait_for(process, out / "checkpoints" / "step_00000003")
    os.killpg(process.pid, signal.SIGINT)
    output = process.communicate(timeout=120)[0]
    stops = re.findall(r"stopped by (\S+) after step (\d+): the training state is in (\S+);", output)
    assert len(stops) == 1 and stops[0][0] == "SIGINT", output[-3000:]  # the main process speaks
    assert "KeyboardInterrupt" not in output, output[-3000:]
    checkpoint = out / "checkpoints" / f"step_{int(stops[0][1]):08d}"
    saved = {p.name for p in checkpoint.iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "checkpoint.json"} <= saved, saved
    exit_codes = re.findall(r"exitcode\s*: (-?\d+)", output)  # the launcher's table, if it prints one
    assert set(exit_codes) <= {str(STOPPED)} and bad_ends(output) == [], output[-3000:]
    assert not (out / ".lock").exists()


@pytest.mark.parametrize("closed", [["stdout"], ["stdout", "stderr"]], ids=["stdout", "both"])
def test_a_reader_that_goes_away_costs_no_training(tmp_path, closed):
    """`... | head -1`: the reader takes the start line and closes the pipe; the run goes on to the
    end with every epoch's checkpoint, its metrics and the final weights."""
    out = tmp_path / "run"
    process = start([*SINGLE, "--output-dir", str(out)], tmp_path)
    first = process.stdout.readline()
    assert first.startswith("train_single: resnet20 on cpu"), first
    for name in closed:
        getattr(process, name).close()
    returncode = process.wait(timeout=300)
    stderr = "" if "stderr" in closed else process.stderr.read()
    assert returncode == 0, stderr[-3000:]
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert (out / "checkpoints" / "step_00000016").is_dir() and all_finite(out)


def test_an_unbreakable_stream_keeps_the_streams_answers_and_never_raises(tmp_path):
    """A real pipe whose reader is gone: the first write fails inside, none raises, and what the
    stream says of itself (encoding, a terminal or not) is the stream's."""
    from common.observe.output import _Unbreakable
    read, write = os.pipe()
    stream = open(write, "w", encoding="utf-8", buffering=1)
    wrapped = _Unbreakable(stream)
    assert wrapped.encoding == "utf-8" and wrapped.errors == stream.errors and wrapped.writable()
    assert not wrapped.isatty() and wrapped.fileno() == write
    os.close(read)
    for _ in range(3):
        print("a line nobody reads", file=wrapped)
        wrapped.flush()
    assert wrapped.broken
    stream.close()  # its buffer goes to /dev/null now: no BrokenPipeError at exit either


# ------------------------------------------------------------------------- advice, followed

def last_error(stderr: str) -> str:
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert lines, stderr[-3000:]
    return lines[-1]


def follow(error: str, out: Path, tmp_path, *flags, lr="0.05") -> tuple[subprocess.CompletedProcess, Path]:
    """A diverged run's advice done as printed, with ``--lr lr``: the run it gives, and its folder."""
    new = tmp_path / f"new{len(list(tmp_path.glob('new*')))}"
    if found := re.search(r"\(the same command with --resume (\S+) --output-dir NEW and the new --lr\)$", error):
        return finish(SINGLE, tmp_path, *flags, "--resume", found.group(1), "--output-dir", new, "--lr", lr), new
    if re.search(r"\(the same command with --resume and the new --lr( starts the run again from step 0)?\)$", error):
        return finish(SINGLE, tmp_path, *flags, "--output-dir", out, "--resume", "--lr", lr), out
    if error.endswith(": start again with a lower --lr in a new --output-dir"):
        return finish(SINGLE, tmp_path, *flags, "--output-dir", new, "--lr", lr), new
    raise AssertionError(f"no advice to follow: {error}")


def test_the_advice_after_a_diverged_run_works_when_followed(tmp_path):
    """A run resumed with far too high an lr diverges: the error names the checkpoint it resumed from,
    the last written before the loss grew, and says to resume from it with a lower --lr; doing so
    finishes the run, with the schedule scaled to the new peak from the step it was at."""
    out = tmp_path / "run"
    assert finish(SINGLE, tmp_path, "--output-dir", out, "--max-steps", 8).returncode == 0
    diverged = finish(SINGLE, tmp_path, "--output-dir", out, "--resume", "--lr", "1e9")
    assert diverged.returncode == 1
    error = last_error(diverged.stderr)
    assert re.fullmatch(rf"error: the loss is (nan|inf) at step \d+: .*the last good checkpoint(, from before it,)? "
                        rf"is {re.escape(str(out))}/checkpoints/step_00000008: resume from it with a lower --lr "
                        rf"\(the same command with --resume and the new --lr\)", error), error
    followed, where = follow(error, out, tmp_path)
    assert followed.returncode == 0 and where == out, followed.stderr[-3000:]
    assert "--lr changed on resume: the schedule's peak lr is 0.05 (it was 0.1)" in followed.stdout
    assert "done: step 16" in followed.stdout and all_finite(out)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["lr"] == pytest.approx(0.05 / 25 / 1e4, rel=0.2)  # one-cycle's floor of the new peak
    # fp16's advice after 100 skipped steps (a GPU's; its form here): an older checkpoint of the run,
    # continued in a new folder with a lower --lr and --clip-grad.
    elsewhere = finish(SINGLE, tmp_path, "--resume", out / "checkpoints" / "step_00000008", "--output-dir",
                       tmp_path / "new", "--lr", "0.05", "--clip-grad", "1")
    assert elsewhere.returncode == 0 and "done: step 16" in elsewhere.stdout, elsewhere.stderr[-3000:]


@pytest.mark.parametrize("resumed", [False, True], ids=["from-the-start", "resumed"])
def test_the_advice_passes_over_checkpoints_written_after_the_loss_grew(resumed, tmp_path):
    """--lr 1e9 with a checkpoint every step: the steps before the NaN have finite, huge losses and
    their checkpoints hold weights that no lower --lr brings back. The advice names the last
    checkpoint from before the loss grew (continued in a new folder) or, with none, a new start;
    followed as printed, the run finishes with finite weights."""
    out = tmp_path / "run"
    if resumed:
        assert finish(SINGLE, tmp_path, "--output-dir", out, "--max-steps", 8).returncode == 0
    diverged = finish(SINGLE, tmp_path, "--output-dir", out, *(["--resume"] if resumed else []), "--lr", "1e9",
                      "--checkpoint-every", 1, "--keep-checkpoints", 20)
    assert diverged.returncode == 1
    error = last_error(diverged.stderr)
    grew = re.search(r"the loss grew from [\d.e+-]+ to [\d.e+-]+ at step (\d+)", error)
    assert grew, error
    written = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert max(written) >= int(grew.group(1)) - 1, written  # checkpoints of blown-up weights exist
    if resumed:
        assert error.endswith(f"continue from it with a lower --lr (the same command with --resume "
                              f"{out}/checkpoints/step_00000008 --output-dir NEW and the new --lr)"), error
    else:
        assert error.endswith("no checkpoint of this run is from before it: start again with a lower --lr in a "
                              "new --output-dir"), error
    followed, where = follow(error, out, tmp_path)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "done: step 16" in followed.stdout and all_finite(where)


def test_the_advice_when_no_checkpoint_was_written_works_when_followed(tmp_path):
    out = tmp_path / "run"
    diverged = finish(SINGLE, tmp_path, "--output-dir", out, "--lr", "1e5")
    assert diverged.returncode == 1 and not (out / "checkpoints").exists()
    error = last_error(diverged.stderr)
    assert "there is no checkpoint yet" in error and "--resume" in error, error
    followed = finish(SINGLE, tmp_path, "--output-dir", out, "--resume", "--lr", "0.05")
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "done: step 16" in followed.stdout and all_finite(out)
