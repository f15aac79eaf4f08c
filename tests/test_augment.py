"""The fine-tuning augmentations: --auto-augment per image in the workers, --random-erase, --mixup
and --cutmix with soft labels; each drawn from its batch's or sample's seed, so a run resumes bit
for bit with them on."""

import json
import random

import pytest
import torch
from helpers import image_folder, run, weights
from torchvision.transforms import v2

from common.data.splits import TensorSplit
from common.data.transform import BatchMix, BatchTransform, erase_rectangles
from common.data.workers import SampleImages, augment


def distinct_images(count: int, size: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=gen)


# ------------------------------------------------------------------------------- --auto-augment

def test_auto_augment_draws_one_policy_per_image_from_its_seed():
    """The same image, index by index: another op per index (torchvision's v2 on a batch tensor
    would apply one op to all), the same view for the same (seed, epoch, index) in every run."""
    image = distinct_images(1)[0]
    split = TensorSplit(image.expand(16, -1, -1, -1).contiguous(), torch.zeros(16, dtype=torch.long), "test")
    samples = SampleImages(split, 32, train=True, augment=False, auto_augment="randaugment")
    views = [samples[(0, i)][0] for i in range(16)]
    assert len({v.numpy().tobytes() for v in views}) >= 12  # differing ops and magnitudes per image
    again = SampleImages(split, 32, train=True, augment=False, auto_augment="randaugment")
    assert all(torch.equal(again[(0, i)][0], views[i]) for i in range(16))
    assert not torch.equal(samples[(1, 0)][0], views[0])  # another epoch, another draw
    state = torch.random.get_rng_state()
    augment(image, 32, random.Random(5), v2.TrivialAugmentWide())
    assert torch.equal(torch.random.get_rng_state(), state)  # the worker's own generator untouched
    evaluation = SampleImages(split, 32, train=False, auto_augment="randaugment")
    assert torch.equal(evaluation[0][0], image)  # evaluation is never augmented


# -------------------------------------------------------------------------------- --random-erase

def test_random_erase_zeroes_one_rectangle_per_chosen_image():
    images = torch.randn(64, 3, 32, 32) + 10  # no zero before erasing
    out = erase_rectangles(images.clone(), 0.5, torch.Generator().manual_seed(0))
    erased = [(out[i] == 0).all(dim=0) for i in range(64)]
    chosen = [e.any().item() for e in erased]
    assert 16 <= sum(chosen) <= 48  # about half
    for mask in (e for e, c in zip(erased, chosen) if c):
        rows, cols = mask.any(dim=1).nonzero().flatten(), mask.any(dim=0).nonzero().flatten()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        assert mask.sum() == box  # one rectangle, every channel
        assert 1 <= box <= 0.34 * 32 * 32
    assert torch.equal(out[~torch.tensor(chosen)], images[~torch.tensor(chosen)])
    again = erase_rectangles(images.clone(), 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(again, out)
    transform = BatchTransform([0, 0, 0], [1, 1, 1], augment=False, erase=1.0)
    batch = distinct_images(8)
    assert (transform.train(batch, (0, 1)) == 0).all(dim=1).any()  # the device path applies it
    assert torch.equal(transform.eval(batch), batch.float())  # evaluation does not


# -------------------------------------------------------------------------------- MixUp, CutMix

def mixed(mix: BatchMix, count: int = 8):
    """A batch whose image i is the constant i + 1 and whose label is i: the shares name the order."""
    images = (torch.arange(count, dtype=torch.float32) + 1).view(count, 1, 1, 1).expand(count, 3, 8, 8)
    labels = torch.arange(count)
    out, shares = mix(images.contiguous(), labels, micro_batch=3)
    return images, out, shares


def test_mixup_blends_images_and_labels_by_the_same_share():
    images, out, shares = mixed(BatchMix(8, mixup=0.4))
    assert shares.shape == (8, 8) and torch.allclose(shares.sum(dim=1), torch.ones(8))
    for i in range(8):
        lam = shares[i, i].item()
        other = [j for j in range(8) if j != i and shares[i, j] > 0]
        expected = lam * images[i] + (1 - lam) * images[other[0]] if other else images[i]
        torch.testing.assert_close(out[i], expected)


def test_cutmix_pastes_a_rectangle_and_labels_follow_its_area():
    images, out, shares = mixed(BatchMix(8, cutmix=1.0))
    for i in range(8):
        pasted = out[i, 0] != images[i, 0, 0, 0]
        lam = shares[i, i].item()
        if pasted.any():
            assert pasted.sum().item() / 64 == pytest.approx(1 - lam)
            rows, cols = pasted.any(dim=1).nonzero().flatten(), pasted.any(dim=0).nonzero().flatten()
            assert pasted.sum() == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)


def test_mixing_is_drawn_from_the_batch_its_process_and_is_off_by_default():
    a, b, c = BatchMix(8, 0.4, 1.0, seed=1), BatchMix(8, 0.4, 1.0, seed=1), BatchMix(8, 0.4, 1.0, 1, process=1)
    assert torch.equal(mixed(a)[2], mixed(b)[2]) and not torch.equal(mixed(a)[2], mixed(c)[2])
    images, out, labels = mixed(BatchMix(8))
    assert out is images.contiguous() or torch.equal(out, images)
    assert torch.equal(labels, torch.arange(8))  # the int labels, untouched


# ---------------------------------------------------------------------------- a run, resumed

def test_a_run_with_every_augmentation_resumes_bit_for_bit(tmp_path):
    """Workers with RandAugment, random erasing, MixUp and CutMix (soft targets, label smoothing):
    trains, records the flags, and a stop + --resume ends on the uninterrupted run's weights."""
    data = image_folder(tmp_path / "data", train=60, val=20, classes=3)
    flags = ["--data-dir", data, "--model", "resnet20", "--batch-size", "20", "--epochs", "2", "--report-to", "none",
             "--loader", "workers", "--workers", "1", "--auto-augment", "randaugment", "--random-erase", "0.5",
             "--mixup", "0.2", "--cutmix", "1.0", "--label-smoothing", "0.1"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run("train_single.py", *flags, "--output-dir", whole, cwd=tmp_path)
    run("train_single.py", *flags, "--output-dir", stopped, "--max-steps", "4", cwd=tmp_path)
    done = run("train_single.py", *flags, "--output-dir", stopped, "--resume", cwd=tmp_path)
    assert "resumed from" in done.stdout
    a, b = weights(whole), weights(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    args = json.loads((whole / "config.json").read_text())["args"]
    assert (args["auto_augment"], args["random_erase"], args["mixup"], args["cutmix"]) == ("randaugment", 0.5, 0.2, 1.0)
