"""train_dp.py on a CPU, run as a user runs it, plus its GPU-only checks with the GPUs faked in-process.

Without GPUs DataParallel has nothing to split, so train_dp.py must train exactly as train_single.py
does: the bitwise comparison below proves that the diff changes nothing else.
"""

import importlib.util
import json
import math
import sys

import pytest
import torch
from accelerate import Accelerator
from helpers import DATA, ROOT, TINY, assert_same_weights, run, weights
from probe_counts import learnt, per_class, predictions, printed_per_class

from common.data.synthetic import make_synthetic
from common.errors import UserError
from common.observe.tracking import log_line
from common.parallel.data_parallel import data_parallel_devices, memory_report
from common.parallel.launch import check_batch_split
from common.recipe.models import build_model

# DATA with fewer images (the last value of a flag wins): 16 steps an epoch at batch 32, of which the runs
# train 3, with augmentation (the default); untracked, as no test here reads the tracking (wandb's offline
# start costs seconds).
FLAGS = [*DATA, "--synthetic-train-size", 512, "--synthetic-test-size", 100, "--model", "resnet20",
         "--batch-size", 32, "--max-steps", 3, "--report-to", "none"]
# DataParallel over 2 replicas on the CPU, as on 2 GPUs (tests/probe_dp_replicas.py)
TWO_REPLICAS = (sys.executable, str(ROOT / "tests" / "probe_dp_replicas.py"))


def load_script():
    spec = importlib.util.spec_from_file_location("train_dp", ROOT / "scripts" / "train_dp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the script's imports only: main() runs under __main__
    return module


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "run"
    return out, run("train_dp.py", *FLAGS, "--output-dir", out)


# --------------------------------------------------------------------------------- CPU runs

def test_cpu_trains_on_one_device_and_writes_the_run_record(dp_run):
    out, done = dp_run
    assert "train_dp: resnet20 on cpu, batch 32 (32 per device)" in done.stdout, done.stdout
    assert "epoch=1/" in done.stdout and "step=3 " in done.stdout and "gpu_mem" not in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["gpus"] == [] and config["per_device_batch_size"] == 32 and config["global_batch_size"] == 32
    assert config["args"]["loss_in_replicas"] is False and "mixed_precision" not in config["args"]
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["step"] == 3 and math.isfinite(metrics["train_loss"])
    assert not any(key.startswith(("gpu_mem", "loss_scale", "skipped")) for key in metrics)  # CPU, fp32
    assert (out / "checkpoints" / "step_00000003").is_dir()

    state = weights(out)
    assert not any(key.startswith(("module.", "model.")) for key in state)
    build_model("resnet20", num_classes=10).load_state_dict(state)  # strict: every key, no extra


@pytest.fixture(scope="module")
def learnt_dp_run(full_run, tmp_path_factory):
    """train_dp.py over 2 replicas, one step on from the end of full_run's second epoch (train_single.py's
    checkpoint: the same training on a CPU): weights that have learnt, evaluated through DataParallel."""
    out = tmp_path_factory.mktemp("dp-learnt") / "run"
    run("train_dp.py", *TINY, "--resume", full_run[0] / "checkpoints" / "step_00000032", "--max-steps", 33,
        "--output-dir", out, launcher=TWO_REPLICAS, env_extra={"PROBE_FILE": str(out.parent / "gathered.json")})
    return out


def test_evaluate_reproduces_the_accuracy_of_a_dp_run(learnt_dp_run):
    out = learnt_dp_run
    assert json.loads((out.parent / "gathered.json").read_text()) == [[64, 10]]  # 2 replicas' logits gathered
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["step"] == 33
    done = run("evaluate.py", "--weights", out / "model.safetensors", *DATA)
    # Counted again here, without common.recipe.evaluation: the test images, the weights, argmax == label.
    test = make_synthetic(1024, 300)
    counts = per_class(predictions(out / "model.safetensors", test.test_images), test.test_labels, 10)
    assert learnt(counts), counts  # not one class predicted for every image
    correct = sum(c for c, _ in counts)
    assert logged["test_acc"] == correct / 300 and logged["test_images"] == 300
    assert done.stdout.startswith(f"test_acc={correct / 300:.4f} ({correct}/300) ")
    assert printed_per_class(done.stdout) == counts


def test_cpu_gives_the_weights_of_train_single_bitwise(dp_run, tmp_path):
    out, _ = dp_run
    run("train_single.py", *FLAGS, "--output-dir", tmp_path / "single")
    assert_same_weights(out, tmp_path / "single")


def test_resume_mid_epoch_equals_uninterrupted_bitwise(dp_run, tmp_path):
    reference, _ = dp_run
    out = tmp_path / "run"
    run("train_dp.py", *FLAGS, "--max-steps", 1, "--output-dir", out)
    resumed = run("train_dp.py", *FLAGS, "--output-dir", out, "--resume")
    assert "resumed from" in resumed.stdout and "step 1" in resumed.stdout
    assert_same_weights(out, reference)


def test_loss_in_replicas_gives_the_same_weights_over_two_replicas(tmp_path):
    """The losses the replicas computed, combined, train as the loss of the gathered outputs: their mean
    over 2 replicas of equal slices (a sum would double every gradient)."""
    runs = {}
    for name, extra in (("gathered", []), ("replicas", ["--loss-in-replicas"])):
        runs[name] = tmp_path / name
        done = run("train_dp.py", *FLAGS, *extra, "--output-dir", runs[name], launcher=TWO_REPLICAS,
                   env_extra={"PROBE_FILE": str(tmp_path / f"{name}.json")})
        assert "on cuda:0, cuda:1, batch 32 (16 per device)" in done.stdout, done.stdout
    # What DataParallel gathered at each of the 3 steps: every image's logits, or one loss per replica.
    assert json.loads((tmp_path / "gathered.json").read_text()) == [[32, 10]] * 3
    assert json.loads((tmp_path / "replicas.json").read_text()) == [[2]] * 3
    ours, theirs = weights(runs["replicas"]), weights(runs["gathered"])
    assert ours.keys() == theirs.keys()  # the plain model's keys: no module. or model. prefix
    for key in ours:
        assert torch.allclose(ours[key].float(), theirs[key].float(), rtol=0, atol=1e-6), key


def test_mixed_precision_is_left_to_train_amp(tmp_path):
    done = run("train_dp.py", *FLAGS, "--mixed-precision", "bf16", "--output-dir", tmp_path / "run", check=False)
    assert done.returncode == 2 and "unrecognized arguments: --mixed-precision bf16" in done.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------- the replicated module, GPUs faked in-process

def test_replica_computes_its_loss_and_unwraps_to_the_plain_model():
    replica_class = load_script().Replica
    model, criterion = build_model("resnet20", num_classes=10), torch.nn.CrossEntropyLoss()
    images, labels = torch.randn(8, 3, 32, 32), torch.arange(8)
    wrapped = torch.nn.DataParallel(replica_class(model, criterion), device_ids=[])  # on a CPU: calls the module
    assert Accelerator(cpu=True).unwrap_model(wrapped).model is model
    # The wrapper's keys carry both prefixes; the script saves `model`, whose parameters these are.
    assert set(wrapped.state_dict()) == {f"module.model.{key}" for key in model.state_dict()}
    assert all(a is b for a, b in zip(wrapped.parameters(), model.parameters(), strict=True))
    loss = wrapped(images, labels)  # one loss per replica, to be gathered
    assert loss.shape == (1,) and torch.allclose(loss[0], criterion(model(images), labels))
    assert torch.equal(wrapped(images), model(images))  # without labels: the logits, for evaluation


def fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return data_parallel_devices(torch.device("cuda"))


def test_batch_must_divide_by_the_gpu_count(monkeypatch):
    devices = fake_gpus(monkeypatch, 3)
    assert [str(d) for d in devices] == ["cuda:0", "cuda:1", "cuda:2"]
    check_batch_split(63, len(devices), "visible GPUs")
    with pytest.raises(UserError) as error:
        check_batch_split(64, len(devices), "visible GPUs")
    assert error.value.message == "--batch-size 64 does not divide by 3 visible GPUs: use 63 or 66"
    with pytest.raises(UserError, match="use 2 or more$"):
        check_batch_split(1, 2, "processes")  # never suggests 0


def test_memory_report_has_one_value_per_gpu_and_nothing_on_cpu(monkeypatch):
    assert memory_report(data_parallel_devices(torch.device("cpu"))) == {}
    devices = fake_gpus(monkeypatch, 2)
    for name, per_gpu in [("memory_allocated", [1.5e9, 0.5e9]), ("memory_reserved", [2e9, 1e9]),
                          ("max_memory_allocated", [3.25e9, 0.75e9])]:
        monkeypatch.setattr(torch.cuda, name, lambda device, values=per_gpu: values[device.index])
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: reset.append(device.index))
    report = memory_report(devices)
    assert reset == [0, 1]  # called once an epoch: the peak of that epoch
    assert report == {"gpu_mem_alloc_gb": [1.5, 0.5], "gpu_mem_reserved_gb": [2.0, 1.0],
                      "gpu_mem_peak_gb": [3.25, 0.75]}
    line = log_line({"epoch": 1, "epochs": 1, "step": 4, "batch_size": 64, "lr": 0.1, "train_loss": 2.0,
                     "test_acc": 0.5, "epoch_time_s": 1.0, "img_per_s": 256, "data_wait_frac": 0.0, **report})
    assert line.endswith(" gpu_mem_alloc_gb=1.50,0.50 gpu_mem_reserved_gb=2.00,1.00 gpu_mem_peak_gb=3.25,0.75")
