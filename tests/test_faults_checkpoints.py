"""Real faults around a run's record: damaged checkpoint bytes, a full disk, a finished run resumed
from an older step, checkpoints deleted, weights that are not finite.

The faults are real: bytes changed in files a real run wrote, a tmpfs that fills (mounted here,
so these tests need root, as CI has; skipped otherwise), a pickle of objects. One run of
train_single.py (2 epochs of 4 steps, a checkpoint every 2 steps) is the reference: resume is bit
for bit, so a run that falls back to an older checkpoint must end with exactly its weights.
"""

import json
import pickle
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest
import torch
from helpers import (ROOT, Forked, Payload, Processes, assert_same_weights, bad_ends, execute, plant, run, tmpfs,
                     tree_digest, two_processes, user_env, weights, worker_lines)
from safetensors.torch import load_file, save_file

from common.run.checkpoints import checkpoint_problem, save_checkpoint
from common.errors import UserError
from common.run.record import unwritten_metrics, write_config, write_metrics

BIN = Path(sys.executable).parent
DATA = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "64"]
# 4 steps an epoch at the lr of 0.05 (--lr 0.1 at half the reference batch); a batch of 32 (16 per
# process under DDP): what these tests check does not depend on it, and a step costs half of one of 64.
FLAGS = [*DATA, "--model", "resnet20", "--batch-size", "32", "--reference-batch-size", "64", "--epochs", "2",
         "--report-to", "none", "--checkpoint-every", "2", "--keep-checkpoints", "5"]
DDP = (str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "4gpu.yaml"),
       "--num_processes", "2")


def step(n: int) -> str:
    return f"step_{n:08d}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The reference run: checkpoints at steps 2, 4, 6, 8 and its final weights."""
    out = tmp_path_factory.mktemp("base") / "run"
    run("train_single.py", *FLAGS, "--output-dir", out, cwd=out.parent)
    return out


@pytest.fixture
def copy(base, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base, out)
    return out


def garble(path: Path, n: int = 64):
    """n bytes in the middle of a file inverted: the size stays, the structure mostly too."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + n] = bytes(b ^ 0xFF for b in data[middle:middle + n])
    path.write_bytes(bytes(data))


def diagnostics(stderr: str) -> list[str]:
    """The warning, error and traceback lines of stderr, after any progress bar on their line."""
    found = (re.match(r"(?:.*?\])?\s*((?:warning|error): .*|Traceback .*)$", line.strip())
             for line in re.split(r"[\r\n]", stderr))
    return [m.group(1) for m in found if m]


def grow(path: Path, size: str):
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


# ------------------------------------------------------------------------------ damaged bytes

@pytest.mark.parametrize("name", ["optimizer.bin", "model.safetensors", "scheduler.bin"])
def test_damaged_bytes_are_skipped_for_the_older_checkpoint(base, copy, name):
    """64 bytes changed, the size kept: the digest catches it; the run resumes from the checkpoint
    before it and ends with the weights of the uninterrupted run."""
    newest = copy / "checkpoints" / step(8)
    manifest = json.loads((newest / "checkpoint.json").read_text())
    garble(newest / name)
    found = f"{zlib.crc32((newest / name).read_bytes()):08x}"
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", cwd=copy.parent)
    assert diagnostics(done.stderr) == [
        f"warning: damaged checkpoint skipped ({step(8)}: {name} is damaged (crc32 {found} where "
        f"{manifest['crc32'][name]} was written)): resuming from {copy}/checkpoints/{step(6)}, the newest "
        f"complete one"]
    assert f"resumed from {copy}/checkpoints/{step(6)} at epoch 2, step 6" in done.stdout
    assert_same_weights(copy, base)
    assert checkpoint_problem(newest) is None  # written again, whole


def relist(checkpoint: Path):
    """checkpoint.json written again for the bytes on disk: damage done before the files were
    listed, which their digests cannot see."""
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    manifest["files"] = {name: (checkpoint / name).stat().st_size for name in manifest["files"]}
    manifest["crc32"] = {name: f"{zlib.crc32((checkpoint / name).read_bytes()):08x}" for name in manifest["files"]}
    (checkpoint / "checkpoint.json").write_text(json.dumps(manifest))


def test_a_listed_checkpoint_that_does_not_load_falls_back(base, copy):
    """A garbled scheduler.bin listed with its garbled bytes' digest passes the checks and fails
    to load: the older one is loaded over whatever the failed load changed."""
    newest = copy / "checkpoints" / step(8)
    garble(newest / "scheduler.bin")
    relist(newest)
    assert checkpoint_problem(newest) is None
    (copy / "model.safetensors").unlink()
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", cwd=copy.parent)
    [line] = diagnostics(done.stderr)
    assert line.startswith(f"warning: damaged checkpoint skipped ({step(8)}: scheduler.bin does not load (")
    assert line.endswith(f"): resuming from {copy}/checkpoints/{step(6)}, the newest complete one before it")
    assert "written by another script" not in done.stderr
    assert_same_weights(copy, base)


def test_a_named_checkpoint_that_does_not_load_is_refused_naming_an_older_one(base, copy, tmp_path):
    """--resume RUN/checkpoints/step_N names the checkpoint to load: when it does not load (a
    garbled scheduler.bin listed with its digest), one line names a complete one to pass instead,
    and nothing of the run changes."""
    (copy / "model.safetensors").unlink()  # stopped after step 8, say
    newest = copy / "checkpoints" / step(8)
    garble(newest / "scheduler.bin")
    relist(newest)
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--resume", newest, check=False, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    [line] = diagnostics(done.stderr)
    assert line.startswith(f"error: --resume {newest}: the checkpoint is damaged (scheduler.bin does not load (")
    assert line.endswith(f"); the newest complete one is {copy}/checkpoints/{step(6)}: continue from it with "
                         f"--output-dir {copy} --resume"), line
    assert tree_digest(copy) == before
    # followed as printed: the run continues from step 6 and ends as the uninterrupted one
    advice = line.rpartition(" with ")[2].split()
    done = run("train_single.py", *FLAGS, *advice, cwd=tmp_path)
    assert f"resuming from {copy}/checkpoints/{step(6)}" in done.stderr
    assert_same_weights(copy, base)


def test_a_checkpoint_of_one_parameter_group_is_said_to_be_of_an_earlier_version(copy, tmp_path):
    """Checkpoints written before bias and norm parameters got their own group (no weight decay)
    hold one group: every checkpoint of such a run has it, so no older one is tried and nothing is
    called damaged. The real bytes: each optimizer.bin rewritten with its groups merged, the
    manifest written for them."""
    for checkpoint in sorted((copy / "checkpoints").iterdir()):
        state = torch.load(checkpoint / "optimizer.bin", weights_only=True)
        merged = {**state["param_groups"][0], "params": sorted(i for g in state["param_groups"] for i in g["params"])}
        state["param_groups"] = [merged]
        torch.save(state, checkpoint / "optimizer.bin")
        relist(checkpoint)
    (copy / "model.safetensors").unlink()
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", check=False, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    [line] = diagnostics(done.stderr)
    newest = copy / "checkpoints" / step(8)
    assert line == (f"error: --resume: {newest}: its optimizer has another number of parameter groups than this "
                    f"run's: it was written by an earlier version of the scripts (one group, weight decay on "
                    f"every parameter); continue it with that version, or start a new run from its weights "
                    f"with --pretrained-path {newest}/model.safetensors")
    assert tree_digest(copy) == before


def test_a_manifest_listing_nothing_is_damaged(base, copy):
    """checkpoint.json rewritten to list no file: the checkpoint is damaged, not empty; the resume
    falls back to the one before and ends with the uninterrupted run's weights."""
    newest = copy / "checkpoints" / step(8)
    (newest / "checkpoint.json").write_text('{"step": 8, "files": {}, "crc32": {}}')
    assert checkpoint_problem(newest) == "checkpoint.json does not list model.safetensors"
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", cwd=copy.parent)
    assert diagnostics(done.stderr) == [
        f"warning: damaged checkpoint skipped ({step(8)}: checkpoint.json does not list model.safetensors): "
        f"resuming from {copy}/checkpoints/{step(6)}, the newest complete one"]
    assert_same_weights(copy, base)


# ------------------------------------------------------------------------------ files carrying code

REFUSED = ("could run code: {why}; these scripts write checkpoints of data only: resume one of theirs, or start a "
           "new run (one of an earlier version, with custom_checkpoint_N.pkl: continue it with that version, if you "
           "trust where it came from)")


def test_a_checkpoint_from_elsewhere_runs_no_code_on_resume(copy, tmp_path):
    """A run folder someone else wrote: its newest checkpoint holds custom_checkpoint_0.pkl with a
    __reduce__ payload, as Accelerate's register_for_checkpointing writes it, listed in
    checkpoint.json. Accelerate would load it with weights_only=False and the run would train on
    and finish with exit 0; it is refused in one line, the payload never runs, nothing changes.
    The checkpoints hold the run's progress as JSON: nothing a resume reads is a pickle of ours."""
    newest = copy / "checkpoints" / step(8)
    assert {p.name for p in newest.iterdir()} == {"model.safetensors", "optimizer.bin", "scheduler.bin",
                                                  "random_states_0.pkl", "progress.json", "checkpoint.json"}
    plant(newest / "custom_checkpoint_0.pkl", tmp_path / "marker")
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", check=False, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    why = "a pickle that Accelerate loads with weights_only=False"
    assert diagnostics(done.stderr) == [f"error: --resume: {newest} was not loaded: custom_checkpoint_0.pkl "
                                        + REFUSED.format(why=why)]
    assert not (tmp_path / "marker").exists()
    assert tree_digest(copy) == before


def test_a_payload_read_by_one_process_of_two_is_refused_by_both(ddp_base, tmp_path):
    """2-process DDP: random_states_1.pkl, which process 1 alone reads (and whose failure to load
    Accelerate only logs), a payload: one line from the main process, both exit 1, nothing ran and
    nothing of the run folder changed."""
    out = tmp_path / "run"
    shutil.copytree(ddp_base, out)
    newest = out / "checkpoints" / step(8)
    plant(newest / "random_states_1.pkl", tmp_path / "marker")
    before = tree_digest(out)
    job = Processes("train_ddp.py", *FLAGS, "--output-dir", out, "--resume", cwd=tmp_path)
    assert job.wait() == [1, 1], job.output()
    assert bad_ends(job.output()) == [], job.output()
    why = "it names posix.system, which is not data"
    assert diagnostics(job.stderr(0) + job.stderr(1)) == [
        f"error: --resume: {newest} was not loaded: random_states_1.pkl " + REFUSED.format(why=why)]
    assert not (tmp_path / "marker").exists()
    assert tree_digest(out) == before


# ------------------------------------------------------------------------------ a run's record

def test_an_older_step_of_a_finished_run_is_refused_and_continues_elsewhere(base, copy, tmp_path):
    older = copy / "checkpoints" / step(4)
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--resume", older, check=False, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"error: --resume {older}: the run in {copy} has finished (model.safetensors; metrics.jsonl records 2 "
        f"epochs to step 8); continuing it from {step(4)} in place would replace its record: add --output-dir "
        f"NEW to continue from {step(4)} in a new folder"]
    assert tree_digest(copy) == before
    # the choice it gives: the same run continued in a new folder, bit for bit
    done = run("train_single.py", *FLAGS, "--resume", older, "--output-dir", tmp_path / "new", cwd=tmp_path)
    assert_same_weights(tmp_path / "new", base)
    assert tree_digest(copy) == before


def test_an_older_step_of_a_run_that_went_on_is_refused(copy, tmp_path):
    (copy / "model.safetensors").unlink()  # stopped after step 8, say
    older = copy / "checkpoints" / step(4)
    done = run("train_single.py", *FLAGS, "--resume", older, check=False, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"error: --resume {older}: the run in {copy} went on to {step(8)}; continuing it from {step(4)} in place "
        f"would replace its record: add --output-dir NEW to continue from {step(4)} in a new folder, or "
        f"--output-dir {copy} --resume to continue from its newest"]
    # the second choice followed as printed: the run continues from step 8 to its end
    advice = done.stderr.rpartition(", or ")[2].split()[:3]
    done = run("train_single.py", *FLAGS, *advice, cwd=tmp_path)
    assert f"resumed from {copy}/checkpoints/{step(8)}" in done.stdout and weights(copy)


def test_resume_after_the_checkpoints_were_deleted_says_so_and_changes_nothing(copy, tmp_path):
    shutil.rmtree(copy / "checkpoints")
    (copy / "model.safetensors").unlink()
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", check=False, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"error: --resume: the run in {copy} wrote checkpoints but none is left in {copy}/checkpoints "
        f"(metrics.jsonl records 2 epochs to step 8): put them back, or start a new run in another --output-dir; "
        f"nothing of the run was changed"]
    assert tree_digest(copy) == before and "stopped before its first" not in done.stderr


# ------------------------------------------------------------------------------ weights not finite

def poison(path: Path) -> str:
    """An infinity in a BatchNorm buffer, as the damaged bytes of issue 24 left; the name."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    state = load_file(str(path))
    name = next(k for k in state if k.endswith("running_var"))
    state[name][0] = float("inf")
    save_file(state, str(path), metadata=header.get("__metadata__"))
    return name


def test_resume_with_no_complete_checkpoint_is_one_line_and_changes_nothing(copy, tmp_path):
    for n in (2, 4, 6):
        shutil.rmtree(copy / "checkpoints" / step(n))
    (copy / "model.safetensors").unlink()  # stopped after step 8, say
    cut = copy / "checkpoints" / step(8) / "model.safetensors"
    size = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[:-3])  # a copy cut short
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", check=False, cwd=tmp_path)
    assert done.returncode == 1 and diagnostics(done.stderr) == [
        f"error: --resume: no checkpoint in {copy}/checkpoints is complete ({step(8)}: model.safetensors has "
        f"{size - 3} bytes where {size} were written): restore the damaged files, or start the run again from "
        f"step 0 in another --output-dir"]
    assert tree_digest(copy) == before


def test_resume_of_a_finished_run_whose_checkpoints_were_removed_is_one_line(copy, tmp_path):
    shutil.rmtree(copy / "checkpoints")
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", check=False, cwd=tmp_path)
    assert done.returncode == 1 and diagnostics(done.stderr) == [
        f"error: --resume: the run in {copy} has finished (model.safetensors) and has no checkpoint left to "
        f"continue from; start a new run in another --output-dir"]
    assert tree_digest(copy) == before


def test_a_run_killed_before_its_first_checkpoint_starts_again_on_resume_with_new_flags(tmp_path):
    """SIGKILL after config.json, before any checkpoint: --resume, here with another --batch-size (the
    advice after running out of memory), starts the run again from step 0 with one warning, and
    config.json becomes the new run's."""
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts" / "train_single.py"), *FLAGS, "--checkpoint-every", "100",
               "--epochs", "50", "--output-dir", str(out)]
    process = Forked(command, tmp_path, user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache")))
    while not (out / "config.json").exists():
        assert process.poll() is None
        time.sleep(0.01)
    process.kill()
    process.wait()
    assert not (out / "checkpoints").exists()
    done = run("train_single.py", *FLAGS, "--output-dir", out, "--resume", "--batch-size", "16", cwd=tmp_path)
    lock, again = diagnostics(done.stderr)
    assert re.fullmatch(rf"warning: {re.escape(str(out))}/\.lock was left by pid {process.pid} on \S+ \(since "
                        rf"[^)]+\), which ended without releasing it; this job takes the run over", lock), lock
    assert again == f"warning: --resume: {out} has no checkpoint (its run stopped before the first one): starting " \
                    f"it again from step 0"
    assert json.loads((out / "config.json").read_text())["args"]["batch_size"] == 16
    assert "done: step 16" in done.stdout  # 128 images at batch 16, 2 epochs


def test_resume_in_another_precision_or_with_other_flags_is_one_line(copy, tmp_path):
    """The checkpoint of a fp32 run resumed by train_amp.py in bf16, or with another --image-size: one
    line naming both, nothing changed."""
    (copy / "model.safetensors").unlink()  # stopped after step 8, say
    before = tree_digest(copy)
    done = run("train_amp.py", *FLAGS, "--output-dir", copy, "--resume", "--mixed-precision", "bf16",
               check=False, cwd=tmp_path)
    assert done.returncode == 1 and diagnostics(done.stderr) == [
        f"error: --resume: the run in {copy} trained in fp32 but this one would train in bf16; resume with the "
        f"script and precision of that run, or start a new run"]
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", "--image-size", "40", check=False,
               cwd=tmp_path)
    assert done.returncode == 1 and diagnostics(done.stderr) == [
        f"error: --resume: this run has --image-size 40 but the run in {copy} had no --image-size; resume with "
        f"the flags of that run, or start a new run"]
    assert tree_digest(copy) == before


def test_weights_that_are_not_finite_are_not_written(base, copy, tmp_path):
    """A checkpoint that holds an inf (digests rewritten: it was trained in, not damaged since)."""
    newest = copy / "checkpoints" / step(8)
    name = poison(newest / "model.safetensors")
    manifest = json.loads((newest / "checkpoint.json").read_text())
    manifest["files"]["model.safetensors"] = (newest / "model.safetensors").stat().st_size
    manifest["crc32"]["model.safetensors"] = f"{zlib.crc32((newest / 'model.safetensors').read_bytes()):08x}"
    (newest / "checkpoint.json").write_text(json.dumps(manifest))
    (copy / "model.safetensors").unlink()
    before = tree_digest(copy)
    done = run("train_single.py", *FLAGS, "--output-dir", copy, "--resume", check=False, cwd=copy.parent)
    assert done.returncode == 1 and diagnostics(done.stderr) == [
        f"error: the final weights are not finite ({name}: 1 of 16 values NaN or infinite) at step 8: "
        f"{copy}/model.safetensors was not written, and the run's checkpoints in {copy}/checkpoints are intact; "
        f"resume from an earlier one into a new --output-dir (--resume CHECKPOINT --output-dir NEW), or start "
        f"again"]
    assert tree_digest(copy) == before
    # followed: an earlier checkpoint continued into a new folder ends as the uninterrupted run
    run("train_single.py", *FLAGS, "--resume", copy / "checkpoints" / step(6), "--output-dir", tmp_path / "new",
        cwd=tmp_path)
    assert_same_weights(tmp_path / "new", base)


def evaluate(weights_file, *extra):
    return run("evaluate.py", "--weights", weights_file, *DATA, *extra, check=False, cwd=Path(weights_file).parent)


def test_evaluate_refuses_weights_that_are_not_finite(copy):
    name = poison(copy / "model.safetensors")
    done = evaluate(copy / "model.safetensors")
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"error: --weights {copy}/model.safetensors: the weights are not finite ({name}: 1 of 16 values NaN or "
        f"infinite): not evaluated; use weights of a run that stayed finite"]
    assert "test_acc" not in done.stdout


def test_evaluate_on_a_pickle_of_objects_is_one_plain_line(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"model": torch.nn.Linear(2, 2)}, path)  # a module, not a state dict
    done = evaluate(path, "--model", "resnet20")
    assert done.returncode == 1 and "\x1b[" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: --weights {path}: cannot read it (it holds pickled objects, not only tensors: "
                           f"Unsupported global: GLOBAL torch.nn.modules.linear.Linear")
    assert line.endswith("save model.state_dict() instead); pass a .safetensors file or a torch.save'd state dict")


def test_evaluate_on_a_pickle_that_would_run_code_names_it_and_never_advises_loading_it(tmp_path):
    """A payload pickled as pickle.dumps writes it (protocol 4): torch 2.14's refusal names no global and
    its first sentence advises weights_only=False, which would run it. The line says what torch refused."""
    path, marker = tmp_path / "model.pt", tmp_path / "ran"
    path.write_bytes(pickle.dumps(Payload(marker)))
    done = evaluate(path, "--model", "resnet20")
    assert done.returncode == 1 and not marker.exists()
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: --weights {path}: cannot read it (it holds pickled objects, not only tensors: "
                           f"Unsupported operand "), line
    assert "weights_only" not in line and "Re-running" not in line


# ------------------------------------------------------------------------------ a full disk

def test_a_full_disk_at_a_checkpoint_keeps_the_previous_and_resume_finishes(base, tmp_path):
    """3 MB hold the first checkpoint of resnet20 (2.2 MB) but not the second."""
    with tmpfs(tmp_path / "disk", "3m") as disk:
        out = disk / "run"
        done = run("train_single.py", *FLAGS, "--output-dir", out, check=False, cwd=tmp_path)
        assert done.returncode == 1 and diagnostics(done.stderr) == [
            f"error: cannot write checkpoint {out}/checkpoints/{step(4)} (no space left on the device); "
            f"the checkpoint {out}/checkpoints/{step(2)} is intact: free space in {out}, then run the same command "
            f"with --output-dir {out} --resume"], done.stderr
        assert [p.name for p in (out / "checkpoints").iterdir()] == [step(2)]
        assert checkpoint_problem(out / "checkpoints" / step(2)) is None
        assert (out / "metrics.jsonl").read_text().count("\n") == 1  # epoch 1, as recorded
        grow(disk, "64m")
        done = run("train_single.py", *FLAGS, "--output-dir", out, "--resume", cwd=tmp_path)
        assert f"resumed from {out}/checkpoints/{step(2)}" in done.stdout
        assert_same_weights(out, base)


def test_a_full_disk_for_the_final_weights(base, tmp_path):
    """The run has trained to its end: its last checkpoint finishes it once there is space."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        out = disk / "run"
        out.mkdir()
        for name in ("config.json", "metrics.jsonl", ".checkpoints-written"):
            shutil.copy(base / name, out / name)
        shutil.copytree(base / "checkpoints" / step(8), out / "checkpoints" / step(8))
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (shutil.disk_usage(disk).free - (200 << 10)))
        done = run("train_single.py", *FLAGS, "--output-dir", out, "--resume", check=False, cwd=tmp_path)
        [line] = diagnostics(done.stderr)
        assert done.returncode == 1 and line.startswith(f"error: cannot write {out}/model.safetensors (")
        assert line.endswith(f"); the checkpoint {out}/checkpoints/{step(8)} is intact: free space in {out}, then "
                             f"run the same command with --output-dir {out} --resume to write the weights")
        assert sorted(p.name for p in out.iterdir()) == [".checkpoints-written", "checkpoints", "config.json",
                                                         "metrics.jsonl"]
        filler.unlink()
        run("train_single.py", *FLAGS, "--output-dir", out, "--resume", cwd=tmp_path)
        assert_same_weights(out, base)


def test_a_disk_full_before_the_run_starts_is_one_line_and_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "filler").write_bytes(b"\0" * shutil.disk_usage(disk).free)
        out = disk / "run"
        done = run("train_single.py", *FLAGS, "--output-dir", out, check=False, cwd=tmp_path)
        assert done.returncode == 1 and diagnostics(done.stderr) == [
            f"error: cannot write in {out} (No space left on device): choose an --output-dir you can write to"]
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


class OneProcess:
    is_main_process, num_processes = True, 1

    def wait_for_everyone(self):
        pass


def test_a_full_disk_for_config_and_metrics(tmp_path):
    """The small writes (OSError 28): one line each; metrics.jsonl keeps the previous record and its
    failure stops the run at the next checkpoint, before anything else is written."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        write_metrics(disk, [{"epoch": 1, "step": 4}])
        (disk / "filler").write_bytes(b"\0" * shutil.disk_usage(disk).free)
        with pytest.raises(UserError) as error:
            write_config(OneProcess(), disk, {"args": {"x": "y" * 20000}})
        assert error.value.message == (f"cannot write {disk}/config.json (No space left on device): free space in "
                                       f"{disk}, then run the same command again")
        write_metrics(disk, [{"epoch": 1, "step": 4}, {"epoch": 2, "step": 8, "x": "y" * 20000}])
        assert json.loads((disk / "metrics.jsonl").read_text()) == {"epoch": 1, "step": 4}
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "metrics.jsonl"]
        with pytest.raises(UserError) as error:
            save_checkpoint(OneProcess(), disk, 8, keep=2)
        assert error.value.message == (f"cannot write {disk}/metrics.jsonl (No space left on device) after epoch 2; "
                                       f"no checkpoint of this run is written yet: free space in {disk}, then run "
                                       f"the same command with --output-dir {disk} --resume to start it again from "
                                       f"step 0")
        assert unwritten_metrics() is None


# ------------------------------------------------------------------------------ restarts (torchrun)

RESTARTABLE = (*DDP, "--max_restarts", "1", "--rdzv_backend", "c10d")  # as `make ddp`


def launch(command, tmp_path, *args) -> Forked:
    """The launcher forked warm (one zygote for these launches' variables), its workers started cold."""
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"), PET_STANDALONE="1",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return Forked([*command, ROOT / "scripts" / "train_ddp.py", *FLAGS, *args], tmp_path, env)


@pytest.fixture(scope="module")
def ddp_base(tmp_path_factory):
    """A finished 2-process run (started as torchrun starts its processes, forked warm): checkpoints
    at steps 2, 4, 6, 8 and its final weights."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    two_processes("train_ddp.py", *FLAGS, "--output-dir", out, cwd=out.parent)
    return out


def test_a_restart_continues_elsewhere_from_the_checkpoint_it_was_given(ddp_base, tmp_path):
    """--resume RUN/checkpoints/step_2 --output-dir NEW under --max_restarts, a worker SIGKILLed as soon
    as NEW holds the run's config.json: the restarted job does not take NEW for another run; it goes on
    from NEW's own newest checkpoint, or from step 2 when it has none, and ends bit for bit where the
    uninterrupted run ended."""
    new = tmp_path / "new"
    process = launch(RESTARTABLE, tmp_path, "--resume", ddp_base / "checkpoints" / step(2), "--output-dir", new)
    while not (new / "config.json").exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.01)
    own = sorted(p.name for p in (new / "checkpoints").glob("step_*")) if (new / "checkpoints").exists() else []
    worker = next(c for c in psutil.Process(process.pid).children(recursive=True)
                  if "train_ddp" in " ".join(c.cmdline()) and c.environ().get("LOCAL_RANK") == "1")
    worker.kill()
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    restarted_from = new / "checkpoints" / own[-1] if own else ddp_base / "checkpoints" / step(2)
    resumes = re.findall(r"resumed from (\S+) at", stdout)
    assert resumes == [str(ddp_base / "checkpoints" / step(2)), str(restarted_from)], stdout[-3000:]
    assert "already holds" not in stderr
    assert_same_weights(new, ddp_base)


SHARED_STORE = ("error: a restartable launch whose processes share the launcher's store can hang in its restart: "
                "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and a c10d rendezvous (--rdzv_backend c10d), as make "
                "ddp does")


@pytest.mark.parametrize("launcher", ["accelerate launch, static", "torchrun --standalone"])
def test_a_restartable_launch_that_shares_the_launchers_store_is_refused(launcher, tmp_path):
    """--max_restarts where the workers share the launcher's store (TORCHELASTIC_USE_AGENT_STORE: a static
    rendezvous always, a c10d one unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), whose restart can hang in
    Accelerator(): refused at each start (the launch and its one restart) in one line, nothing written. The
    launch the line advises is make ddp's, which tests/test_make_restart.py runs to its end."""
    command = ((*DDP, "--max_restarts", "1") if launcher.startswith("accelerate") else
               (str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"))
    out = tmp_path / "run"
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"))
    refused = execute([*command, ROOT / "scripts" / "train_ddp.py", *FLAGS, "--output-dir", out], cwd=tmp_path,
                      env=env, timeout=300)
    assert refused.returncode != 0 and diagnostics(worker_lines(refused.stderr)) == [SHARED_STORE], refused.stderr
    assert refused.stderr.count(SHARED_STORE) == 2 and not out.exists()


def test_a_job_refused_at_its_start_is_refused_again_after_its_restart(ddp_base, tmp_path):
    """`make ddp` into the folder of a finished run, without --resume: refused; the restarted job gets
    the same checks, not the newest checkpoint of a run that is not its own, and nothing is changed."""
    before = tree_digest(ddp_base)
    process = launch(RESTARTABLE, tmp_path, "--output-dir", ddp_base)
    stderr = process.communicate(timeout=300)[1]
    assert process.returncode != 0
    refusal = (f"error: --output-dir {ddp_base} already holds a run: add --resume to continue it, or choose "
               f"another --output-dir")
    assert diagnostics(worker_lines(stderr)) == [refusal] and stderr.count(refusal) == 2  # once a start
    assert tree_digest(ddp_base) == before
