"""The run folder: checkpoints checked before a resume trusts them, and one job at a time.

In-process where the decision is ours (lock_run_and_find_resume, checkpoint_problem, lock_run_folder on real
Accelerate checkpoints of a tiny model); three runs of train_single.py and one small process show
what a user sees: a damaged newest checkpoint skipped, a second job refused, the lock given back.
"""

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from helpers import ROOT, plant, relist, run, tree_digest

from common.errors import UserError
from common.run.checkpoints import (
    TrainProgress,
    checkpoint_problem,
    file_crc32,
    latest_good_checkpoint,
    resume_from,
    save_checkpoint,
)
from common.run.folder import lock_run_and_find_resume
from common.run.record import check_resume_config
from common.run.lock import JOB_FILE, LOCK_FILE, RunLock, lock_run_folder
from common.recipe.ema import WeightAverage

SMALL = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64",
         "--model", "resnet20", "--batch-size", "64", "--epochs", "1", "--report-to", "none"]
HOST = socket.gethostname()


class MainProcess:
    """What lock_run_and_find_resume asks of the accelerator of a one-process job."""
    is_main_process = True

    def wait_for_everyone(self):
        pass


def resolve(output_dir, resume="latest"):
    return lock_run_and_find_resume(MainProcess(), str(output_dir), resume, "train_single.py")


@pytest.fixture(autouse=True)
def no_lock_left_held():
    yield
    RunLock._release_all()  # a test's locks, as the end of a job would


def tiny_accelerator():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.progress = TrainProgress(accelerator)  # progress.json in every checkpoint
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # momentum buffers: an optimizer state with tensors
    return accelerator


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run folder with config.json and two real checkpoints, steps 4 and 8."""
    out = tmp_path_factory.mktemp("saved") / "run"
    accelerator = tiny_accelerator()
    for step in (4, 8):
        save_checkpoint(accelerator, out, step, keep=2)
    (out / "config.json").write_text('{"args": {"model": "resnet20"}}')
    return out


@pytest.fixture
def out(saved, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def cut(path: Path, n: int = 10):
    path.write_bytes(path.read_bytes()[:-n])


# ------------------------------------------------------------------------------ checkpoints

def test_a_checkpoint_lists_its_files_last(saved):
    checkpoint = saved / "checkpoints" / "step_00000008"
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    assert manifest["step"] == 8
    assert manifest["files"] == {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name != "checkpoint.json"}
    assert manifest["crc32"] == {name: file_crc32(checkpoint / name) for name in manifest["files"]}
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                                      "progress.json"}
    assert checkpoint_problem(checkpoint) is None
    assert latest_good_checkpoint(saved) == (checkpoint, {})


def without_digests(checkpoint: Path):
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    (checkpoint / "checkpoint.json").write_text(json.dumps({"files": manifest["files"]}))


DAMAGE = {  # what is done to the newest checkpoint, and what the line says of it
    "file missing": (lambda c: (c / "optimizer.bin").unlink(), "optimizer.bin is missing"),
    "file cut short": (lambda c: cut(c / "random_states_0.pkl"), "random_states_0.pkl has {size} bytes where "
                                                                 "{written} were written"),
    "list unreadable": (lambda c: (c / "checkpoint.json").write_text('{"files": '), "checkpoint.json is unreadable"),
    # No checkpoint these scripts write: a folder without its list, a list without digests
    "list missing": (lambda c: (c / "checkpoint.json").unlink(), "checkpoint.json is missing"),
    "list without digests": (without_digests, "checkpoint.json is unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_skips_a_damaged_checkpoint_naming_the_file(out, damage, capsys):
    newest, previous = out / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000004"
    sizes = {p.name: p.stat().st_size for p in newest.iterdir()}
    spoil, expected = DAMAGE[damage]
    spoil(newest)
    name = expected.split()[0]
    expected = expected.format(size=sizes[name] - 10 if name in sizes else 0, written=sizes.get(name))
    assert resolve(out) == (out, previous)
    assert capsys.readouterr().err == (f"warning: damaged checkpoint skipped (step_00000008: {expected}): "
                                       f"resuming from {previous}, the newest complete one\n")


def test_with_no_complete_checkpoint_resume_stops_with_one_line(out):
    (out / "checkpoints" / "step_00000008" / "optimizer.bin").unlink()
    cut(out / "checkpoints" / "step_00000004" / "model.safetensors")
    before = tree_digest(out)
    with pytest.raises(UserError) as error:
        resolve(out)
    assert error.value.message.startswith(
        f"--resume: no checkpoint in {out}/checkpoints is complete (step_00000008: optimizer.bin is missing; "
        f"step_00000004: model.safetensors has ")
    assert error.value.message.endswith("restore the damaged files, or start the run again from step 0 in another "
                                        "--output-dir")
    assert tree_digest(out) == before and not (out / LOCK_FILE).exists()


def test_a_run_folder_given_for_a_checkpoint_is_refused_and_the_advice_resumes(out):
    with pytest.raises(UserError) as error:
        lock_run_and_find_resume(MainProcess(), None, str(out), "train_single.py")
    assert error.value.message == (f"--resume {out}: not a checkpoint folder; it is a run's folder: pass "
                                   f"--output-dir {out} --resume for its newest checkpoint")
    # followed as printed
    assert resolve(out, resume="latest") == (out, out / "checkpoints" / "step_00000008")


def test_a_damaged_checkpoint_named_by_resume_is_refused(out):
    given = out / "checkpoints" / "step_00000008"
    (given / "scheduler.bin").unlink()
    with pytest.raises(UserError) as error:
        resolve(out, resume=str(given))
    assert error.value.message == (f"--resume {given}: the checkpoint is damaged (scheduler.bin is missing); pass a "
                                   f"complete one, or --output-dir {out} --resume for its newest complete "
                                   f"checkpoint")
    # followed as printed: the newest complete one, the damaged one passed over
    assert resolve(out, resume="latest") == (out, out / "checkpoints" / "step_00000004")


def test_a_restarted_worker_resumes_from_the_newest_complete_checkpoint(out, monkeypatch, capsys):
    """torchrun's restart: no --resume; a damaged newest checkpoint is skipped the same way, and the
    lock its killed predecessor left is taken over without a word."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    (out / "checkpoints" / "step_00000008" / "model.safetensors").unlink()
    # The predecessor's lock file, SIGKILLed: the file stays, the kernel released its flock.
    job = f"torchrun job-1 on {HOST}, agent pid {os.getppid()}"
    (out / LOCK_FILE).write_text(json.dumps({"host": HOST, "pid": dead_pid(), "since": "then", "job": job}))
    (out / JOB_FILE).write_text(job + "\n")  # the folder this job took before its restart
    assert resolve(out, resume=None) == (out, out / "checkpoints" / "step_00000004")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: damaged checkpoint skipped (step_00000008: model.safetensors is missing): resuming from "
        f"{out}/checkpoints/step_00000004, the newest complete one"]


def test_a_requeued_slurm_job_resumes_by_itself(out, monkeypatch, capsys):
    """sbatch --requeue: the same job id, perhaps another host, SLURM_RESTART_COUNT set; no --resume."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    (out / LOCK_FILE).write_text(json.dumps({"host": "node-7", "pid": 12345, "since": "then",
                                             "job": "slurm job 4242"}))
    (out / JOB_FILE).write_text("slurm job 4242\n")
    assert resolve(out, resume=None) == (out, out / "checkpoints" / "step_00000008")
    assert capsys.readouterr().err == ""  # its own lock, from before the requeue: taken over without a word


@pytest.mark.parametrize("taken_by", [None, "slurm job 17"], ids=["no job", "another job"])
def test_a_restart_into_a_folder_this_job_never_took_gets_the_checks_of_a_new_start(out, monkeypatch, taken_by):
    """A job refused at its start (a folder holding another run) and restarted by torchrun or requeued is
    refused again: the restart never continues a run that is not its own."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    if taken_by:
        (out / JOB_FILE).write_text(taken_by + "\n")
    with pytest.raises(UserError) as error:
        resolve(out, resume=None)
    assert error.value.message == (f"--output-dir {out} already holds a run: add --resume to continue it, or "
                                   f"choose another --output-dir")
    if taken_by:  # the folder still names the job that took it
        assert (out / JOB_FILE).read_text() == f"{taken_by}\n"
    else:
        assert not (out / JOB_FILE).exists()


def test_a_checkpoint_that_passes_the_checks_but_does_not_load_gets_one_line(tmp_path):
    """A checkpoint whose files were wrong before they were listed passes the checks and still does
    not load: with nothing before it, one line naming the file, not a guess about another script."""
    checkpoint = tmp_path / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "pytorch_model.bin").write_bytes(b"not a state dict")
    accelerator = tiny_accelerator()
    (checkpoint / "progress.json").write_text(json.dumps(accelerator.progress.state_dict()))
    files = ("pytorch_model.bin", "progress.json")
    (checkpoint / "checkpoint.json").write_text(json.dumps(
        {"files": {name: (checkpoint / name).stat().st_size for name in files},
         "crc32": {name: file_crc32(checkpoint / name) for name in files}}))
    (tmp_path / "config.json").write_text('{"args": {}}')
    assert checkpoint_problem(checkpoint) is None
    with pytest.raises(UserError) as error:
        resume_from(accelerator, checkpoint, accelerator.progress, {"args": {}}, set())
    assert error.value.message.startswith(f"--resume: {checkpoint} is damaged (pytorch_model.bin does not load (")
    assert error.value.message.endswith(") and no complete checkpoint comes before it")


# Every file a one-process --resume reads, and the pickle an earlier version wrote (planted)
READ_ON_RESUME = ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "progress.json",
                  "weight_average.json", "weight_average.safetensors", "custom_checkpoint_0.pkl"]


@pytest.mark.parametrize("name", READ_ON_RESUME)
def test_a_payload_in_any_file_of_a_checkpoint_runs_nothing(tmp_path, name):
    """A checkpoint from elsewhere: one of its files made a pickle whose __reduce__ creates a marker
    file, and checkpoint.json written again to match. A pickle --resume would load is refused in one
    line naming the file (torch's weights_only loader refuses the name; custom_checkpoint_0.pkl is
    not read at all); a file parsed as JSON or safetensors does not parse, and the checkpoint is
    damaged. Either way the marker is never made and nothing of the run folder changes."""
    accelerator = tiny_accelerator()
    WeightAverage(accelerator, accelerator._models[0], 0.9)  # weight_average.* in the checkpoint
    checkpoint = save_checkpoint(accelerator, tmp_path / "run", 4, keep=2)
    config = {"args": {"resume": str(checkpoint)}}  # named: no older checkpoint to fall back to
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    plant(checkpoint / name, tmp_path / "marker")
    before = tree_digest(tmp_path / "run")
    with pytest.raises(UserError) as error:
        resume_from(accelerator, checkpoint, accelerator.progress, config, set())
    assert not (tmp_path / "marker").exists()
    assert tree_digest(tmp_path / "run") == before
    message = error.value.message
    assert "\n" not in message
    if name.endswith((".bin", ".pkl")):
        assert message.startswith(f"--resume: {checkpoint} was not loaded: {name} could run code: "), message
    else:
        assert message.startswith(f"--resume: {checkpoint} is damaged ({name} does not load ("), message


def test_saving_keeps_the_newest_up_to_this_step(out):
    """A run resumed from step 4 does not prune its new checkpoints for newer ones of the old run."""
    accelerator = tiny_accelerator()
    (out / "checkpoints" / "step_00000008" / "optimizer.bin").unlink()  # damaged, left by the old run
    save_checkpoint(accelerator, out, 6, keep=2)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004", "step_00000006",
                                                                       "step_00000008"]
    save_checkpoint(accelerator, out, 8, keep=2)  # replaced whole
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    assert latest_good_checkpoint(out) == (out / "checkpoints" / "step_00000008", {})


# ------------------------------------------------------------------------------ a run without a checkpoint

def test_resume_starts_again_a_run_that_stopped_before_its_first_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"args": {"batch_size": 128}}')  # died in epoch 1, out of memory, say
    (out / "metrics.jsonl").write_text("")
    assert resolve(out) == (out, None)
    assert capsys.readouterr().err == (f"warning: --resume: {out} has no checkpoint (its run stopped before the "
                                       f"first one): starting it again from step 0\n")
    # config.json becomes the new run's (it may have another --batch-size): the scripts write it
    # when there is none, so the old one is set aside until then ...
    assert not (out / "config.json").exists()
    (out / "config.json").write_text('{"args": {"batch_size": 64}}')
    RunLock._release_all()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.jsonl"]
    assert json.loads((out / "config.json").read_text())["args"]["batch_size"] == 64

    # ... and put back when the run fails before writing its own (bad input changes nothing).
    before = tree_digest(out)
    assert resolve(out) == (out, None)
    RunLock._release_all()
    assert tree_digest(out) == before and sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.jsonl"]


def test_a_config_set_aside_by_a_killed_run_is_put_back(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".config.json.before-restart").write_text("{}")  # the run died before writing config.json
    lock_run_folder(out).release()
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_a_finished_run_without_checkpoints_is_not_started_again(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"final weights")
    with pytest.raises(UserError, match="has finished \\(model.safetensors\\) and has no checkpoint left"):
        resolve(out)


def test_a_new_start_in_a_folder_with_only_a_stale_lock(tmp_path):
    """The lock file is not a file of a run: a folder holding only one is free for a new run."""
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"host": HOST, "pid": 1 << 22, "since": "then"}))
    assert resolve(out, resume=None) == (out, None)


# ------------------------------------------------------------------------------ the lock

def test_a_second_job_is_refused_naming_the_holder(out):
    held = lock_run_folder(out)
    info = json.loads((out / LOCK_FILE).read_text())
    assert (info["host"], info["pid"]) == (HOST, os.getpid())
    before = tree_digest(out)
    for resume in ("latest", None):
        with pytest.raises(UserError) as error:
            resolve(out, resume)
        assert error.value.message == (f"{out} is in use by another job (pid {os.getpid()} on {HOST} (since "
                                       f"{info['since']})): wait for it to end, or choose another --output-dir")
    assert tree_digest(out) == before
    held.release()
    assert not (out / LOCK_FILE).exists()
    assert resolve(out) == (out, out / "checkpoints" / "step_00000008")


def dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    pid = dead_pid()
    (out / LOCK_FILE).write_text(json.dumps({"host": HOST, "pid": pid, "since": "2026-01-01 12:00:00 UTC",
                                             "job": None}))
    lock_run_folder(out)
    assert capsys.readouterr().err == (f"warning: {out / LOCK_FILE} was left by pid {pid} on {HOST} (since "
                                       f"2026-01-01 12:00:00 UTC), which ended without releasing it; this job "
                                       f"takes the run over\n")
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_without_flock_the_file_alone_is_the_lock(tmp_path, monkeypatch, capsys):
    """Where flock fails (ENOLCK: an NFS mount without lockd), a holder that runs on this host, or
    one on another host, keeps the folder; a dead one on this host, or this job's own earlier life,
    is taken over."""
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("common.run.lock.fcntl.flock", no_flock)
    out = tmp_path / "run"
    out.mkdir()
    lock = out / LOCK_FILE
    for holder, refused in [({"host": HOST, "pid": os.getppid()}, f"(pid {os.getppid()} on {HOST} (since then))"
                                                                 f": wait for it to end, or choose another "
                                                                 f"--output-dir"),
                            ({"host": "node7", "pid": 1}, f"(pid 1 on node7 (since then)): wait for it to end, or "
                                                          f"choose another --output-dir; if that job has ended, "
                                                          f"remove {lock}")]:
        lock.write_text(json.dumps({**holder, "since": "then", "job": None}))
        with pytest.raises(UserError) as error:
            lock_run_folder(out)
        assert error.value.message == f"{out} is in use by another job {refused}"
    lock.write_text(json.dumps({"host": HOST, "pid": dead_pid(), "since": "then", "job": None}))
    lock_run_folder(out).release()
    assert "which ended without releasing it" in capsys.readouterr().err and not lock.exists()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # requeued on another host: its own lock, quietly
    lock.write_text(json.dumps({"host": "node7", "pid": 1, "since": "then", "job": "slurm job 4242"}))
    lock_run_folder(out)
    assert capsys.readouterr().err == "" and json.loads(lock.read_text())["host"] == HOST


def test_the_lock_goes_with_the_folders_made_for_it(tmp_path):
    """A run that fails before writing anything leaves nothing; one that wrote keeps its folder."""
    lock_run_folder(tmp_path / "runs" / "a").release()
    assert list(tmp_path.iterdir()) == []
    held = lock_run_folder(tmp_path / "runs" / "b")
    (tmp_path / "runs" / "b" / "config.json").write_text("{}")
    held.release()
    assert [p.name for p in (tmp_path / "runs" / "b").iterdir()] == ["config.json"]


def test_a_forked_child_does_not_release_the_lock(tmp_path):
    """DataLoader workers are forked from the main process: their exit must not free the folder."""
    out = tmp_path / "run"
    held = lock_run_folder(out)
    pid = os.fork()
    if pid == 0:
        RunLock._release_all()  # what the child's exit would do
        os._exit(0)
    os.waitpid(pid, 0)
    assert (out / LOCK_FILE).exists()
    with pytest.raises(UserError, match="is in use by another job"):
        lock_run_folder(out)
    held.release()


def test_the_lock_is_released_when_a_process_stops_with_a_user_error(tmp_path):
    out = tmp_path / "runs" / "new"
    code = ("import sys; from common.run.lock import lock_run_folder; from common.errors import UserError; "
            "lock_run_folder(sys.argv[1]); raise UserError('--model resnet99: no such model')")
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and done.stderr == "error: --model resnet99: no such model\n"
    assert list(tmp_path.iterdir()) == []  # the folders made for the lock went with it


# ------------------------------------------------------------------------------ the scripts

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train_single.py, one epoch of 4 steps, a checkpoint every 2: step_00000002, step_00000004."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run("train_single.py", *SMALL, "--checkpoint-every", 2, "--output-dir", out, cwd=out.parent)
    return out


def test_a_finished_run_gives_its_lock_back(trained):
    assert sorted(p.name for p in trained.iterdir()) == [".checkpoints-written", "checkpoints", "config.json",
                                                         "metrics.jsonl", "model.safetensors"]
    for checkpoint in (trained / "checkpoints").iterdir():
        assert checkpoint_problem(checkpoint) is None and (checkpoint / "checkpoint.json").is_file()


def test_a_damaged_newest_checkpoint_is_skipped_by_the_script(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    (out / "model.safetensors").unlink()
    (out / "checkpoints" / "step_00000004" / "optimizer.bin").unlink()  # lost in a copy, say
    done = run("train_single.py", *SMALL, "--output-dir", out, "--resume", cwd=tmp_path)
    assert [line for line in done.stderr.splitlines() if line.startswith(("warning", "error", "Traceback"))] == [
        f"warning: damaged checkpoint skipped (step_00000004: optimizer.bin is missing): resuming from "
        f"{out}/checkpoints/step_00000002, the newest complete one"]
    assert f"resumed from {out}/checkpoints/step_00000002 at epoch 1, step 2" in done.stdout
    assert checkpoint_problem(out / "checkpoints" / "step_00000004") is None  # written again, whole
    assert (out / "model.safetensors").is_file() and not (out / LOCK_FILE).exists()


def test_a_second_job_into_a_held_folder_stops_and_changes_nothing(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    held = lock_run_folder(out)  # the first job, still running
    since = json.loads((out / LOCK_FILE).read_text())["since"]
    before = tree_digest(out)
    done = run("train_single.py", *SMALL, "--output-dir", out, "--resume", check=False, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: {out} is in use by another job (pid {os.getpid()} on {HOST} (since {since})): wait for it to end, "
        f"or choose another --output-dir"]
    assert tree_digest(out) == before
    held.release()


def test_links_planted_in_a_run_folder_are_never_written_through(tmp_path):
    """A run folder from elsewhere with links where the run writes: each temporary name of atomic_write
    (metrics.jsonl, model.safetensors, config.json) and the lock. The run never writes through one: the
    files they point at keep their bytes; a linked .lock is one line, nothing written; the temporary
    names that the run writes through are its own files again, and the resumed run finishes."""
    out, victim = tmp_path / "run", tmp_path / "victim"
    victim.write_text("precious\n")
    run("train_single.py", *SMALL, "--epochs", "2", "--max-steps", "4", "--output-dir", out, cwd=tmp_path)
    for name in (".tmp-metrics.jsonl", ".tmp-model.safetensors", ".tmp-config.json", LOCK_FILE):
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(victim)
    before = tree_digest(out)
    refused = run("train_single.py", *SMALL, "--epochs", "2", "--output-dir", out, "--resume", cwd=tmp_path,
                  check=False)
    assert refused.returncode == 1 and refused.stderr.splitlines() == [
        f"error: cannot write in {out} (its .lock is a symbolic link: remove it): choose an --output-dir you can "
        f"write to"], refused.stderr
    assert tree_digest(out) == before and victim.read_text() == "precious\n"
    (out / LOCK_FILE).unlink()  # as the line says
    done = run("train_single.py", *SMALL, "--epochs", "2", "--output-dir", out, "--resume", cwd=tmp_path)
    assert "done: step 8" in done.stdout and victim.read_text() == "precious\n"
    # the files it wrote went through their temporary names, the links there gone with them
    assert not (out / ".tmp-metrics.jsonl").is_symlink() and not (out / ".tmp-model.safetensors").is_symlink()
    assert not (out / "model.safetensors").is_symlink() and (out / "model.safetensors").stat().st_size > 1000


# ------------------------------------------------------------------------------ the JSON a resume reads

# A value of a checkpoint's JSON that these scripts never write: the file, what is changed in it, and how the
# line names it (the field and its value)
HOSTILE = {
    "step text": ("progress.json", {"step": "abc"}, "step is 'abc', which these scripts never write"),
    "step NaN": ("progress.json", {"step": float("nan")}, "step is nan, which these scripts never write"),
    "step 1e308": ("progress.json", {"step": 1e308}, "step is 1e+308, which these scripts never write"),
    "step negative": ("progress.json", {"step": -4}, "step is -4, which these scripts never write"),
    "epoch text": ("progress.json", {"epoch": "x"}, "epoch is 'x', which these scripts never write"),
    "epoch negative": ("progress.json", {"epoch": -1}, "epoch is -1, which these scripts never write"),
    "batch_in_epoch 1e9": ("progress.json", {"batch_in_epoch": 1e9},
                           "batch_in_epoch is 1000000000.0, which these scripts never write"),
    "history a number": ("progress.json", {"history": 5}, "history is 5, which these scripts never write"),
    "an epoch without epoch_complete": ("progress.json", {"history": [{"epoch": 1, "test_acc": 0.5}]},
                                        "history is [{'epoch': 1, 'test_acc': 0.5}], which these scripts never write"),
    "run id a number": ("progress.json", {"tracker_run_id": 7}, "tracker_run_id is 7, which these scripts never write"),
    "updates text": ("weight_average.json", {"updates": "x"}, "updates 'x' is not a whole number from 0"),
}


def rewrite_json(path: Path, **changes) -> None:
    """``path``'s JSON with ``changes``, its checkpoint's list written again to match (a forgery)."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    relist(path.parent)


@pytest.mark.parametrize("case", HOSTILE)
def test_a_value_of_a_checkpoint_s_json_that_the_scripts_never_write_is_one_line(tmp_path, case):
    """Each value of progress.json and weight_average.json is checked by type and range as it loads: the
    checkpoint does not load, named with the file and the field, in one line (here named by --resume: nothing
    to fall back to), never a traceback nor a run that goes on from it."""
    name, changes, said = HOSTILE[case]
    accelerator = tiny_accelerator()
    WeightAverage(accelerator, accelerator._models[0], 0.9)
    checkpoint = save_checkpoint(accelerator, tmp_path / "run", 4, keep=2)
    config = {"args": {"resume": str(checkpoint)}}
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    rewrite_json(checkpoint / name, **changes)
    with pytest.raises(UserError) as error:
        resume_from(accelerator, checkpoint, accelerator.progress, config, set())
    assert error.value.message == (f"--resume: {checkpoint} is damaged ({name} does not load (ValueError: {said})) "
                                   f"and no complete checkpoint comes before it")


def test_progress_whose_steps_do_not_add_up_is_one_line(tmp_path):
    """A step count of the right type that is not this run's (10^30 steps at epoch 0): one line, not a run
    that ends at once and writes its weights untrained."""
    accelerator = tiny_accelerator()
    checkpoint = save_checkpoint(accelerator, tmp_path / "run", 4, keep=2)
    config = {"args": {}, "steps_per_epoch": 4}
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    rewrite_json(checkpoint / "progress.json", step=10**30)
    with pytest.raises(UserError) as error:
        resume_from(accelerator, checkpoint, accelerator.progress, config, set())
    assert error.value.message == (f"--resume: {checkpoint}/progress.json: step {10**30} is not epoch 0 x 4 steps "
                                   f"+ 0: it is no checkpoint of this run; start a new run")


@pytest.mark.parametrize("args", ["a string", ["a", "list"], None])
def test_a_config_json_whose_flags_are_not_a_mapping_is_one_line(out, args):
    (out / "config.json").write_text(json.dumps({"args": args}))
    with pytest.raises(UserError) as error:
        check_resume_config(out / "checkpoints" / "step_00000008", {"args": {"model": "resnet20"}}, set())
    assert error.value.message == (f"--resume: {out / 'config.json'} is missing or unreadable, so the run's flags "
                                   f"are unknown; start a new run")


def test_a_resume_skips_a_checkpoint_whose_progress_was_forged_and_finishes(tmp_path):
    """The script itself: the newest checkpoint's progress.json says step 1e308 (a run that would end at once,
    its weights untrained); the resume skips it with one warning, goes on from the one before and finishes
    where an uninterrupted run does."""
    out = tmp_path / "run"
    run("train_single.py", *SMALL, "--epochs", "2", "--max-steps", "4", "--checkpoint-every", "2",
        "--output-dir", out, cwd=tmp_path)
    newest = out / "checkpoints" / "step_00000004"
    rewrite_json(newest / "progress.json", step=1e308)
    done = run("train_single.py", *SMALL, "--epochs", "2", "--output-dir", out, "--resume", cwd=tmp_path)
    warned = re.findall(r"(?:warning|error): [^\r\n]*", done.stderr)
    assert warned == [f"warning: damaged checkpoint skipped (step_00000004: progress.json does not load (ValueError: "
                      f"step is 1e+308, which these scripts never write)): resuming from {out}/checkpoints/"
                      f"step_00000002, the newest complete one before it"], done.stderr
    assert "done: step 8" in done.stdout and "Traceback" not in done.stderr
