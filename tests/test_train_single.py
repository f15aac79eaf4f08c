"""train_single.py and evaluate.py run as a user runs them: as subprocesses, on the synthetic set."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import DATA, TINY, run, wandb_runs, weights
from wandb_records import offline_run

from common.models import build_model
from common.weights import read_metadata, save_weights

LOG_LINE = re.compile(r"^epoch=(\d+)/(\d+) step=(\d+) batch=(\d+) lr=\S+ train_loss=\d+\.\d{4} "
                      r"test_acc=(\d\.\d{4}) epoch_time_s=\S+ img_per_s=\d+ data_wait_frac=\d\.\d{3}$")


def test_learns_and_writes_the_run_record(full_run):
    out, done = full_run
    lines = [LOG_LINE.match(line) for line in done.stdout.splitlines() if line.startswith("epoch=")]
    assert len(lines) == 3 and all(lines), done.stdout
    assert [int(m.group(3)) for m in lines] == [16, 32, 48]

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert {"epoch", "train_loss", "test_acc", "epoch_time_s", "img_per_s", "data_wait_frac", "lr"} <= set(m)
        assert 0 <= m["test_acc"] <= 1 and 0 <= m["data_wait_frac"] < 1 and m["img_per_s"] > 0
    # The log line and the record say the same thing.
    assert [float(m.group(5)) for m in lines] == [round(m["test_acc"], 4) for m in metrics]
    # Ten classes: chance is 0.10. Three short epochs must get far above it (0.48-0.52 across memory
    # formats and machines: the rounding of the convolutions moves it).
    assert metrics[-1]["test_acc"] > 0.4, metrics
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]

    config = json.loads((out / "config.json").read_text())
    assert config["args"]["model"] == "resnet20" and config["world_size"] == 1
    assert config["global_batch_size"] == 64 and config["steps_per_epoch"] == 16
    assert {"torch", "accelerate", "datasets", "torchvision"} <= set(config["versions"])
    assert done.stdout.strip().splitlines()[-1].startswith(f"done: step 48, test_acc {metrics[-1]['test_acc']:.4f}")


def test_final_weights_load_into_a_plain_model(full_run):
    out, _ = full_run
    state = weights(out)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)
    model = build_model("resnet20", num_classes=10)
    model.load_state_dict(state)  # strict: every key present, no extra


def test_keeps_the_newest_checkpoints_only(full_run):
    out, _ = full_run
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_00000032", "step_00000048"]  # --keep-checkpoints 2 by default


def test_resume_mid_epoch_equals_uninterrupted_bitwise(full_run, tmp_path):
    reference, _ = full_run
    out = tmp_path / "run"
    first = run("train_single.py", *TINY, "--output-dir", out, "--max-steps", 23)  # stops inside epoch 2
    assert (out / "checkpoints" / "step_00000023").is_dir(), first.stdout
    resumed = run("train_single.py", *TINY, "--output-dir", out, "--resume")
    assert "resumed from" in resumed.stdout and "step 23" in resumed.stdout

    ours, theirs = weights(out), weights(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    # metrics.jsonl holds one line per finished epoch, as the uninterrupted run does.
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3]
    # The resumed job logs to the same wandb run and continues its step count.
    first, second = (offline_run(path) for path in wandb_runs(out))
    assert first["id"] == second["id"]
    assert max(first["history"]) == 23 and min(k for k in second["history"] if k is not None) > 23


def test_a_different_seed_gives_different_weights(full_run, tmp_path):
    """Negative control: the bitwise comparison above can fail."""
    reference, _ = full_run
    out = tmp_path / "run"
    done = run("train_single.py", *TINY, "--epochs", 1, "--seed", 1, "--report-to", "none", "--output-dir", out)
    ours, theirs = weights(out), weights(reference)
    assert not all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not (out / "wandb").exists() and "wandb" not in done.stdout  # --report-to none: no tracking


def test_an_existing_run_is_never_overwritten(full_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(full_run[0], out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    done = run("train_single.py", *TINY, "--output-dir", out, check=False)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"error: --output-dir {out} already holds a run: add --resume to continue it, or choose another "
        f"--output-dir"]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_refuses_a_different_experiment(full_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(full_run[0], out)
    done = run("train_single.py", *TINY, "--model", "resnet32", "--output-dir", out, "--resume", check=False)
    assert done.returncode != 0
    assert "--model is 'resnet32' but the run" in done.stderr and "Traceback" not in done.stderr


def test_resume_with_nothing_to_resume(tmp_path):
    done = run("train_single.py", *TINY, "--output-dir", tmp_path / "none", "--resume", check=False)
    assert done.returncode != 0
    assert "--resume:" in done.stderr and "does not exist" in done.stderr and "Traceback" not in done.stderr


def test_default_output_dir_is_new_for_each_run(tmp_path):
    from common.run_folder import new_run_dir

    first = new_run_dir("single", root=str(tmp_path))
    first.mkdir()
    second = new_run_dir("single", root=str(tmp_path))
    assert second != first and not second.exists()
    assert first.name.startswith("single-") and second.name.startswith(first.name)


@pytest.mark.parametrize("launcher", ["env", "torchrun"])
def test_refuses_to_run_as_several_processes(tmp_path, launcher):
    if launcher == "env":  # what torchrun / accelerate launch --multi_gpu set for each process
        done = run("train_single.py", *TINY, "--output-dir", tmp_path / "run", check=False,
                   env_extra={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    else:
        torchrun = Path(sys.executable).with_name("torchrun")
        done = run("train_single.py", *TINY, "--output-dir", tmp_path / "run", check=False,
                   launcher=(str(torchrun), "--standalone", "--nproc_per_node", "2"))
    assert done.returncode != 0
    assert "launched as 2 processes" in done.stderr and "scripts/train_ddp.py" in done.stderr
    assert not (tmp_path / "run").exists()


def test_evaluate_reproduces_the_logged_accuracy(full_run, tmp_path):
    out, _ = full_run
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["test_acc"]
    data_flags = DATA  # the same data as training
    ours = run("evaluate.py", "--weights", out / "model.safetensors", *data_flags)  # model name from the file
    assert ours.stdout.startswith(f"test_acc={logged:.4f} (")
    assert len([line for line in ours.stdout.splitlines() if line.startswith("  class")]) == 10

    # The same weights saved the way another DataParallel/DDP script saves them: module. prefixes.
    wrapped = tmp_path / "ddp_checkpoint.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in weights(out).items()}}, wrapped)
    theirs = run("evaluate.py", "--weights", wrapped, "--model", "resnet20", *data_flags)
    assert theirs.stdout.splitlines()[0].split()[0] == f"test_acc={logged:.4f}"


def test_weights_carry_what_evaluation_needs(full_run):
    out, _ = full_run
    config = json.loads((out / "config.json").read_text())
    stored = read_metadata(out / "model.safetensors")
    assert stored == {"model": "resnet20", "step": 48, "classes": config["classes"], "image_size": [32, 32],
                      "normalization": config["normalization"], "channels_last": True}
    # A different training split has other channel statistics; the synthetic test split stays the same
    # (it does not depend on the training size). The stored normalisation alone reproduces the accuracy.
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["test_acc"]
    other_train = [*DATA, "--synthetic-train-size", "64"]
    done = run("evaluate.py", "--weights", out / "model.safetensors", *other_train, "--eval-batch-size", 37)
    assert done.stdout.startswith(f"test_acc={logged:.4f} (")


def test_evaluate_refuses_data_of_other_classes(full_run, tmp_path):
    out, _ = full_run
    model = build_model("resnet20", num_classes=10)
    model.load_state_dict(weights(out))
    other = {**read_metadata(out / "model.safetensors"), "classes": [f"bird{i}" for i in range(10)]}
    save_weights(model, tmp_path / "model.safetensors", other)
    done = run("evaluate.py", "--weights", tmp_path / "model.safetensors", *DATA, check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: --weights {tmp_path / 'model.safetensors'} were trained on the classes bird0, bird1, bird2, bird3, "
        f"bird4... but the data has class0, class1, class2, class3, class4...: pass the data flags of the training run"]


def test_evaluate_says_when_weights_do_not_fit(full_run):
    out, _ = full_run
    done = run("evaluate.py", "--weights", out / "model.safetensors", "--model", "resnet32", *DATA, check=False)
    assert done.returncode != 0
    assert done.stderr.startswith("error: --weights") and "do not fit --model resnet32" in done.stderr


def test_compile_traces_the_model_and_trains_the_same_weights(tmp_path):
    # --compile goes through Accelerate's dynamo_backend. aot_eager traces forward and backward as
    # inductor does, without inductor's minute of C++ compiling (scripts/benchmark.py measures that).
    flags = [*DATA, "--model", "resnet20", "--batch-size", "64", "--epochs", "1", "--lr", "0.01",
             "--report-to", "none"]
    run("train_single.py", *flags, "--max-steps", "3", "--output-dir", tmp_path / "eager")
    done = run("train_single.py", *flags, "--max-steps", "3", "--compile", "aot_eager",
               "--output-dir", tmp_path / "compiled", env_extra={"TORCH_LOGS": "graph_code"})
    assert "TRACED GRAPH" in done.stderr  # dynamo really traced the model
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["args"]["compile"] == "aot_eager"
    # The same weights as the eager run, in a file that loads into a plain model.
    eager, compiled = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    assert compiled.keys() == eager.keys() == build_model("resnet20", 10).state_dict().keys()
    assert max((eager[k].float() - compiled[k].float()).abs().max().item() for k in eager) < 1e-4
    # Checkpoints hold the plain model: the run goes on without --compile.
    run("train_single.py", *flags, "--max-steps", "4", "--output-dir", tmp_path / "compiled", "--resume")
    assert json.loads((tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
