"""What the training flags do to a run, read from what train_single.py leaves (config.json, metrics.jsonl,
the weights) and checked against values computed here from what each flag's help says: the linear scaling
rule (--scale-lr), --schedule step, --label-smoothing, and --clip-grad under --grad-accum."""

import json

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from helpers import run, weights
from safetensors.torch import load_file

from common.data.synthetic import make_synthetic
from common.recipe.models import build_model

SMALL = ["--dataset", "synthetic", "--synthetic-test-size", "10", "--model", "resnet20", "--report-to", "none"]


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def config(out) -> dict:
    return json.loads((out / "config.json").read_text())


def test_step_schedule_from_the_scaled_peak_lr(tmp_path):
    """--scale-lr (on by default): the peak lr is --lr x --batch-size / --reference-batch-size. --schedule
    step: a linear warm-up to it over --warmup-epochs, then the lr divided by 10 after each milestone epoch."""
    out = tmp_path / "run"
    run("train_single.py", *SMALL, "--synthetic-train-size", 256, "--batch-size", 32, "--reference-batch-size", 64,
        "--lr", 0.2, "--epochs", 3, "--schedule", "step", "--milestones", 2, "--warmup-epochs", 1.5,
        "--max-steps", 17, "--output-dir", out)
    peak = 0.2 * 32 / 64
    assert config(out)["lr"] == pytest.approx(peak, rel=1e-12)
    # 256 / 32 = 8 steps an epoch: the warm-up is 12 steps, the milestone comes after step 16. metrics.jsonl
    # has the lr of each epoch's last step: the 8th (8/12 of the warm-up done), the 16th (the peak) and the
    # 17th, where --max-steps stops the third epoch: the first step after the milestone.
    assert [r["step"] for r in records(out)] == [8, 16, 17]
    assert [r["lr"] for r in records(out)] == pytest.approx([peak * 8 / 12, peak, peak / 10], rel=1e-6)


def test_label_smoothing_is_the_loss_trained_on(tmp_path):
    """--label-smoothing S: torch's cross-entropy against targets with S spread over the classes. One batch of
    all the training images an epoch, no augmentation: epoch 2's train_loss is the loss of the weights saved
    at the end of epoch 1 on all of them in training mode (BatchNorm on the batch's statistics), computed
    here from the images, the run's normalisation and torch's cross_entropy."""
    out = tmp_path / "run"
    run("train_single.py", *SMALL, "--synthetic-train-size", 64, "--batch-size", 64, "--reference-batch-size", 64,
        "--epochs", 2, "--lr", 1, "--no-augment", "--label-smoothing", 0.3, "--output-dir", out)
    data = make_synthetic(64, 10)  # --dataset synthetic's training images (seed 0)
    mean, std = (torch.tensor(config(out)["normalization"][k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    model = build_model("resnet20", 10)
    model.load_state_dict(load_file(str(out / "checkpoints" / "step_00000001" / "model.safetensors")))
    with torch.no_grad():
        logits = model.train()((data.train_images.float() - mean) / std)
    smoothed = F.cross_entropy(logits, data.train_labels, label_smoothing=0.3).item()
    plain = F.cross_entropy(logits, data.train_labels).item()
    logged = records(out)[1]["train_loss"]
    # The same logits without smoothing give a loss about 0.05 away (a large first step, --lr 1, makes the
    # predictions far from uniform); rounding (channels_last there, not here) moves it a few 1e-6.
    assert abs(logged - smoothed) < 0.01 * abs(plain - smoothed), (logged, smoothed, plain)


# One optimizer step of two accumulated micro-batches of 32 (64 images, --grad-accum 2), at a constant lr
# (--schedule step, no warm-up), without weight decay: SGD's first Nesterov step moves the weights by
# -lr x (1 + momentum) x the gradient, clipped or not. --no-scale-lr: the lr as given, not x 64 / 128.
LR, MOMENTUM, MAX_NORM = 0.2, 0.9, 0.1
ONE_STEP = [*SMALL, "--synthetic-train-size", 64, "--batch-size", 64, "--grad-accum", 2, "--epochs", 2,
            "--schedule", "step", "--milestones", 1, "--warmup-epochs", 0, "--max-steps", 1, "--weight-decay", 0,
            "--lr", LR, "--momentum", MOMENTUM, "--no-scale-lr"]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """The step without clipping and with --clip-grad, as the change of each parameter from the initial
    weights (--seed 0, then the model), all parameters in one vector; and the clipped run's folder."""
    base = tmp_path_factory.mktemp("one-step")
    run("train_single.py", *ONE_STEP, "--output-dir", base / "plain")
    run("train_single.py", *ONE_STEP, "--clip-grad", MAX_NORM, "--output-dir", base / "clipped")
    set_seed(0)
    initial = build_model("resnet20", 10)
    names = [name for name, _ in initial.named_parameters()]  # the weights SGD moves (not BatchNorm's statistics)

    def step(out):
        final = weights(out)
        return torch.cat([(final[k].double() - initial.state_dict()[k].double()).flatten() for k in names])
    return step(base / "plain"), step(base / "clipped"), base / "clipped"


def test_no_scale_lr_keeps_the_lr_as_given(one_step):
    _, clipped, out = one_step
    assert config(out)["lr"] == LR  # scaled, it would be LR x 64 / 128
    # ... and the optimizer took it: a clipped step is exactly lr x (1 + momentum) x MAX_NORM long.
    assert clipped.norm().item() == pytest.approx(LR * (1 + MOMENTUM) * MAX_NORM, rel=1e-4)


def test_clip_grad_clips_the_accumulated_gradient_once_a_step(one_step):
    """--clip-grad MAX_NORM: the gradient of the whole step (both micro-batches summed) is scaled to norm
    MAX_NORM, once, before the optimizer step. Then the clipped step is the unclipped one made shorter, in
    the same direction, MAX_NORM x lr x (1 + momentum) long. Clipping each micro-batch's gradient as it
    comes would turn the step: the first micro-batch would count less than the second."""
    plain, clipped, _ = one_step
    assert plain.norm() > 10 * clipped.norm()  # the gradient was far longer than MAX_NORM: clipping acted
    assert clipped.norm().item() == pytest.approx(LR * (1 + MOMENTUM) * MAX_NORM, rel=1e-4)
    cosine = (plain @ clipped / (plain.norm() * clipped.norm())).item()
    assert cosine > 1 - 1e-6, cosine
