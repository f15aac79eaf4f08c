"""train_single.py and evaluate.py run as a user runs them: as subprocesses, on the synthetic set."""

import json
import re
import shutil

import pytest
import torch
from accelerate.utils import set_seed
from helpers import DATA, ROOT, TINY, assert_same_weights, run, wandb_runs, weights
from safetensors.torch import load_file
from wandb_records import offline_run

from common.recipe.models import build_model
from common.run.weights import read_metadata, save_weights

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


@pytest.mark.floor
def test_resume_mid_epoch_equals_uninterrupted_bitwise(full_run, tmp_path):
    reference, _ = full_run
    out = tmp_path / "run"
    first = run("train_single.py", *TINY, "--output-dir", out, "--max-steps", 23)  # stops inside epoch 2
    assert (out / "checkpoints" / "step_00000023").is_dir(), first.stdout
    resumed = run("train_single.py", *TINY, "--output-dir", out, "--resume")
    assert "resumed from" in resumed.stdout and "step 23" in resumed.stdout

    assert_same_weights(out, reference)
    # metrics.jsonl holds one line per finished epoch, as the uninterrupted run does.
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3]
    # The resumed job logs to the same wandb run and continues its step count.
    first, second = (offline_run(path) for path in wandb_runs(out))
    assert first["id"] == second["id"]
    assert max(first["history"]) == 23 and min(k for k in second["history"] if k is not None) > 23


def test_a_different_seed_gives_different_weights(full_run, tmp_path):
    """Negative control: the bitwise comparison above can fail. The uninterrupted run's flags with another
    --seed, compared after the same 32 steps (the reference's checkpoint of step 32): --max-steps and
    --report-to change nothing computed before the stop (a resume may change them), so the seed is the one
    difference."""
    reference, _ = full_run
    out = tmp_path / "run"
    done = run("train_single.py", *TINY, "--seed", 1, "--max-steps", 32, "--report-to", "none", "--output-dir", out)
    ours = weights(out)
    theirs = load_file(str(reference / "checkpoints" / "step_00000032" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    trained = {k for k in ours if ours[k].is_floating_point()}  # all but BatchNorm's step counts
    assert {k for k in trained if not torch.equal(ours[k], theirs[k])} == trained
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
    assert "this run has --model 'resnet32' but the run" in done.stderr and "Traceback" not in done.stderr


def test_resume_with_nothing_to_resume(tmp_path):
    done = run("train_single.py", *TINY, "--output-dir", tmp_path / "none", "--resume", check=False)
    assert done.returncode != 0
    assert "--resume:" in done.stderr and "does not exist" in done.stderr and "Traceback" not in done.stderr


def test_default_output_dir_is_new_for_each_run(tmp_path):
    from common.run.folder import new_run_dir

    first = new_run_dir("single", root=str(tmp_path))
    first.mkdir()
    second = new_run_dir("single", root=str(tmp_path))
    assert second != first and not second.exists()
    assert first.name.startswith("single-") and second.name.startswith(first.name)


def test_refuses_to_run_as_several_processes(tmp_path):
    # What torchrun / accelerate launch --multi_gpu set for each process. Under torchrun itself, 2
    # processes: test_bad_input.py ("one-process script launched as several"), the same line.
    done = run("train_single.py", *TINY, "--output-dir", tmp_path / "run", check=False,
               env_extra={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert done.returncode != 0
    assert "launched as 2 processes" in done.stderr and "scripts/train_ddp.py" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.floor
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
                      "normalization": config["normalization"], "channels_last": True,
                      "interpolation": "bilinear",  # no pretrained weights: the data path's own
                      "weights": "live"}  # the last step's, not an --ema-decay average
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
    save_weights(model.state_dict(), tmp_path / "model.safetensors", other)
    done = run("evaluate.py", "--weights", tmp_path / "model.safetensors", *DATA, check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: --weights {tmp_path / 'model.safetensors'} were trained on the classes bird0, bird1, bird2, bird3, "
        f"bird4... but the data has class0, class1, class2, class3, class4...: pass the data flags of the training run"]


def test_evaluate_refuses_another_image_size(full_run):
    out, _ = full_run
    trained = out / "model.safetensors"
    done = run("evaluate.py", "--weights", trained, *DATA, "--image-size", 64, check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: --weights {trained} were trained on 32px images, not --image-size 64: drop --image-size"]
    followed = run("evaluate.py", "--weights", trained, *DATA)  # as it says
    assert followed.stdout.startswith("test_acc=")


def test_evaluate_says_when_weights_do_not_fit(full_run):
    out, _ = full_run
    done = run("evaluate.py", "--weights", out / "model.safetensors", "--model", "resnet32", *DATA, check=False)
    assert done.returncode != 0
    assert done.stderr.startswith("error: --weights") and "do not fit --model resnet32" in done.stderr


def far_from(ours, reference, initial, rtol):
    """The tensors of ``ours`` further from ``reference`` (largest difference) than ``rtol`` times how far
    training moved ``reference`` from ``initial`` (largest difference); integer ones (BatchNorm's step
    counts) must be equal."""
    def largest(a, b):
        return (a.double() - b.double()).abs().max().item()
    return {k for k, v in reference.items() if (largest(ours[k], v) > rtol * largest(v, initial[k])
                                                if v.is_floating_point() else not torch.equal(ours[k], v))}


def test_compile_traces_the_model_and_trains_the_same_weights(tmp_path):
    # --compile goes through Accelerate's dynamo_backend. aot_eager traces forward and backward as
    # inductor does, without inductor's minute of C++ compiling (scripts/benchmark.py measures that).
    # lr 0.1 from the first step: in 6 steps every tensor moves by 1e-3 or more, so 1% of that is far above
    # float32's rounding and far below what a wrong gradient in any one layer changes. Batch 16: a step costs
    # a quarter of one of 64, and the tensors move further (5.8e-3 at least, against 1.9e-3 at batch 64). 48
    # test images, 3 evaluation batches of 16: a last, smaller batch would be one more graph to trace.
    flags = [*DATA, "--synthetic-test-size", 48, "--model", "resnet20", "--batch-size", 16,
             "--reference-batch-size", 16, "--epochs", 1, "--warmup-epochs", 0, "--report-to", "none"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    run("train_single.py", *flags, "--max-steps", 8, "--checkpoint-every", 6, "--output-dir", eager)
    # tests/traced.py: the traced graphs logged from inside the run, which the zygote then starts warm.
    done = run(ROOT / "tests" / "traced.py", ROOT / "scripts" / "train_single.py", *flags, "--max-steps", 6,
               "--compile", "aot_eager", "--output-dir", compiled)
    assert "TRACED GRAPH" in done.stderr  # dynamo really traced the model
    assert json.loads((compiled / "config.json").read_text())["args"]["compile"] == "aot_eager"
    # Tensor by tensor, the eager run's weights of step 6 within 1% of how far it moved each from the
    # initial weights (--seed 0, then the model), in a file that loads into a plain model.
    set_seed(0)
    initial = build_model("resnet20", 10).state_dict()
    eager_6 = load_file(str(eager / "checkpoints" / "step_00000006" / "model.safetensors"))
    compiled_6 = weights(compiled)
    assert compiled_6.keys() == eager_6.keys() == initial.keys()
    moved = {k: (v - initial[k]).abs().max().item() for k, v in eager_6.items() if v.is_floating_point()}
    assert min(moved.values()) > 5e-4, moved
    assert far_from(compiled_6, eager_6, initial, rtol=0.01) == set()
    # Negative control: each tensor 5% further along than eager took it fails the same comparison.
    overshot = {k: v + 0.05 * (v - initial[k]) if v.is_floating_point() else v for k, v in eager_6.items()}
    assert far_from(overshot, eager_6, initial, rtol=0.01) == set(moved)
    # Checkpoints hold the plain model: the run goes on without --compile, to the eager run's weights of
    # step 8 (within 1% of how far those 2 steps moved each tensor).
    run("train_single.py", *flags, "--max-steps", 8, "--output-dir", compiled, "--resume")
    assert json.loads((compiled / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 8
    assert far_from(weights(compiled), weights(eager), eager_6, rtol=0.01) == set()
