"""common/data/inputs.py, common/data/workers.py: the two input paths (--loader device and workers)
read every source the same way, and each flag of the input path does what its help says.

The fixtures write one small dataset (3 named classes) in each format the scripts read: an
ImageNet-layout image folder of JPEG, PNG and WebP files of mixed sizes and modes (RGB, L, RGBA,
CMYK, P), a Hub parquet snapshot and a fake Hub dataset (someone/flowers) of mixed sizes, a
save_to_disk folder whose test split is unlabelled (so validation is evaluated on), and CIFAR
pickles. Covered:
  - each source through both loaders: the same classes, split sizes, evaluation split and test
    labels in the same order, batches of uint8 (B, 3, N, N), test images equal pixel for pixel;
  - decoding: every mode becomes RGB (grayscale as three equal channels, CMYK converted), an
    animated GIF its first frame; the default --image-size is 224 for mixed sizes and the
    images' own size when they share one;
  - --loader auto against --loader-budget, and its reason; --loader device over the budget;
  - the evaluation split: an unlabelled test/ folder (Kaggle's layout) gives way to val/;
    --val-fraction is seeded, stratified, disjoint from and covering train, and works for data
    with no evaluation split (an image folder, a parquet snapshot of train alone); without it
    such data stops with one line that suggests it, also when a decoded cache is at hand;
  - augmentation per sample from (seed, epoch, index): the same batches with 0 and 2 workers,
    other crops in another epoch;
  - bad input as one line through the real script: an undecodable image with either loader (and
    --bad-images skip), flags out of range, an image folder whose splits differ, --loader device
    over the budget.
"""

import importlib.util
import io
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import numpy as np
import PIL.Image
import pytest
import torch
from accelerate import Accelerator
from helpers import ROOT, run
from torchvision.transforms import v2

from bench.tools import write_cifar_pickles
from common.cli import build_parser, check_args
from common.data import hub
from common.data.cache import load_image_data
from common.data.flags import data_options
from common.data.images import decode
from common.data.inputs import load_inputs
from common.data.sources import open_source
from common.data.splits import ImageData
from common.data.transform import resized_crop_box, resized_crop_boxes
from common.data.workers import SampleImages, augment, worker_loader
from common.errors import UserError

CLASSES = ["cat", "dog", "frog"]
# (width, height): none square, so nothing has a "native" size
SIZES = [(40, 30), (90, 70), (64, 48), (45, 60), (70, 52), (33, 41), (80, 50)]
# (PIL mode, format, suffix): what an image folder scraped from the web holds
KINDS = [("RGB", "JPEG", ".jpg"), ("L", "JPEG", ".jpg"), ("RGBA", "PNG", ".png"), ("CMYK", "JPEG", ".jpeg"),
         ("P", "PNG", ".png"), ("RGB", "WEBP", ".webp")]
TINY_RUN = ["--model", "resnet20", "--epochs", "1", "--batch-size", "8", "--max-steps", "2", "--image-size", "32",
            "--report-to", "none"]


# ----------------------------------------------------------------------------------------------
# Fixtures: small datasets in every format, written the way the real tools write them

def picture(seed: int, size: tuple[int, int]) -> PIL.Image.Image:
    """A smooth random colour pattern (it compresses like a photo, unlike noise) of (width, height)."""
    coarse = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return PIL.Image.fromarray(coarse).resize(size, PIL.Image.BILINEAR)


def encoded(image: PIL.Image.Image, mode: str, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


def sample(i: int) -> tuple[bytes, str]:
    """Image i of every mixed fixture: its file bytes and suffix."""
    mode, fmt, suffix = KINDS[i % len(KINDS)]
    return encoded(picture(i, SIZES[i % len(SIZES)]), mode, fmt), suffix


def write_image_folder(root: Path, splits: dict[str, int]) -> Path:
    """root/<split>/<class>/NN.<suffix>, ``splits[split]`` images per class."""
    i = 0
    for split, per_class in splits.items():
        for name in CLASSES:
            (root / split / name).mkdir(parents=True)
            for k in range(per_class):
                data, suffix = sample(i)
                (root / split / name / f"{k:02d}{suffix}").write_bytes(data)
                i += 1
    return root


def hub_split(first: int, count: int, labels=None, square: int | None = None) -> datasets.Dataset:
    """``count`` mixed images from ``first`` on (or, with ``square``, RGB PNGs of that size), in the
    Hub's schema: an Image and a ClassLabel."""
    features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=CLASSES))
    images = [{"bytes": encoded(picture(i, (square, square)), "RGB", "PNG") if square else sample(i)[0],
               "path": None} for i in range(first, first + count)]
    labels = [i % len(CLASSES) for i in range(count)] if labels is None else labels
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The --data-dir of each format."""
    root = tmp_path_factory.mktemp("sources")
    write_image_folder(root / "image_folder", {"train": 10, "val": 4})
    write_image_folder(root / "train_only", {"train": 10})
    (root / "parquet" / "data").mkdir(parents=True)
    for split, dataset in {"train": hub_split(0, 24), "test": hub_split(100, 9)}.items():
        dataset.to_parquet(root / "parquet" / "data" / f"{split}-00000-of-00001.parquet")
    # 48x48: a size they share, not CIFAR's; the test split unlabelled, as the Hub marks it
    datasets.DatasetDict(train=hub_split(0, 21, square=48), validation=hub_split(200, 6, square=48),
                         test=hub_split(300, 9, [-1] * 9, square=48)).save_to_disk(root / "save_to_disk")
    gen = torch.Generator().manual_seed(0)
    cifar = ImageData(torch.randint(0, 256, (30, 3, 32, 32), dtype=torch.uint8, generator=gen),
                      torch.arange(30) % 3, torch.randint(0, 256, (12, 3, 32, 32), dtype=torch.uint8, generator=gen),
                      torch.arange(12) % 3, CLASSES, "fixture")
    write_cifar_pickles(root / "cifar-10-batches-py", cifar)
    return {"image_folder": root / "image_folder", "train_only": root / "train_only", "parquet": root / "parquet",
            "save_to_disk": root / "save_to_disk", "pickles": root / "cifar-10-batches-py"}


@pytest.fixture(scope="session")
def flowers() -> datasets.DatasetDict:
    return datasets.DatasetDict(train=hub_split(0, 27), test=hub_split(100, 9))


@pytest.fixture
def fake_hub(monkeypatch, flowers):
    """load_dataset answers "someone/flowers" with mixed images, as tests/test_data.py fakes the Hub;
    ``fake_hub(other)`` answers with another DatasetDict."""
    def answer(splits):
        def load_dataset(repo, *args, **kwargs):
            assert repo == "someone/flowers"
            return splits
        monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    answer(flowers)
    monkeypatch.setattr(hub, "_hub_reachable", lambda endpoint: True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    return answer


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def inputs_of(accelerator, *flags):
    """load_inputs for the flags a user would pass a training script."""
    args = build_parser("test").parse_args([str(flag) for flag in flags])
    check_args(args)
    return load_inputs(data_options(args), accelerator)


def source_flags(name, sources, tmp_path):
    where = ["--dataset", "someone/flowers"] if name == "hub" else ["--data-dir", sources[name]]
    return [*where, "--cache-dir", tmp_path / "cache"]


def everything(loader) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


# ----------------------------------------------------------------------------------------------
# Both loaders read every source the same way

# source: (train images, evaluated images, the split evaluated on, default --image-size)
EXPECTED = {"image_folder": (30, 12, "val", 224), "parquet": (24, 9, "test", 224),
            "save_to_disk": (21, 6, "validation", 48), "pickles": (30, 12, "test", 32), "hub": (27, 9, "test", 224)}


@pytest.mark.parametrize("name", EXPECTED)
def test_both_loaders_read_each_source_alike(name, sources, accelerator, tmp_path, request):
    if name == "hub":
        request.getfixturevalue("fake_hub")
    train_size, test_size, evaluated, _ = EXPECTED[name]
    flags = [*source_flags(name, sources, tmp_path), "--batch-size", 8]
    if name != "pickles":
        flags += ["--image-size", 32]  # 224 is the default for mixed sizes: too slow here
    device = inputs_of(accelerator, *flags, "--loader", "device")
    workers = inputs_of(accelerator, *flags, "--loader", "workers", "--workers", 0)
    assert (device.loader, workers.loader) == ("device", "workers")
    for data in (device, workers):
        assert data.classes == CLASSES
        assert (data.train_size, data.test_size, data.image_size) == (train_size, test_size, 32)
        assert f"evaluated on {evaluated}" in data.source
        images, labels = next(iter(data.train_loader))
        assert images.shape == (8, 3, 32, 32) and images.dtype == torch.uint8 and labels.dtype == torch.int64
    (device_images, device_labels), (worker_images, worker_labels) = map(everything, [device.test_loader,
                                                                                       workers.test_loader])
    assert worker_images.shape == (test_size, 3, 32, 32) and worker_images.dtype == torch.uint8
    assert torch.equal(device_labels, worker_labels)
    # Evaluation is deterministic (resize, centre crop) and the same code on both paths.
    assert torch.equal(device_images, worker_images)
    # Normalisation from the training images as evaluated (the workers' from up to 1,000: here all).
    assert torch.equal(device.transform.mean, workers.transform.mean)
    assert torch.equal(device.transform.std, workers.transform.std)


@pytest.mark.parametrize("name", EXPECTED)
def test_default_image_size_is_the_shared_size_else_224(name, sources, accelerator, tmp_path, request):
    if name == "hub":
        request.getfixturevalue("fake_hub")
    data = inputs_of(accelerator, *source_flags(name, sources, tmp_path), "--loader", "workers", "--workers", 0,
                     "--batch-size", 4)
    size = EXPECTED[name][3]
    assert data.image_size == size and f"{size}px" in data.line
    assert data.config["train_crop"] == ("pad" if size <= 64 else "resized")  # on both loaders
    images, _ = next(iter(data.test_loader))
    assert images.shape == (4, 3, size, size)


def test_every_mode_decodes_to_rgb(sources):
    """Grayscale as three equal channels, CMYK, palette and RGBA converted as PIL converts them."""
    files = sorted(p for p in (sources["image_folder"] / "train").rglob("*") if p.is_file())
    modes = set()
    for path in files:
        with PIL.Image.open(path) as original:
            modes.add(original.mode)
            expected = torch.from_numpy(np.asarray(original.convert("RGB")).copy()).permute(2, 0, 1)
        image = decode(str(path), str(path))
        assert image.dtype == torch.uint8 and image.shape == expected.shape, path
        if original.mode == "L":
            assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2]), path
        # libjpeg-turbo and PIL's libjpeg may round a JPEG's colours differently
        assert (image.int() - expected.int()).abs().max() <= (0 if path.suffix == ".png" else 2), path
    assert modes >= {"RGB", "L", "RGBA", "CMYK", "P"}
    assert decode(files[0].read_bytes(), "bytes").equal(decode(str(files[0]), "path"))


def test_an_animated_gif_decodes_to_its_first_frame():
    frames = [PIL.Image.new("RGB", (40, 30), (value, value, value)) for value in (10, 120, 250)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    image = decode(buffer.getvalue(), "animated.gif")
    assert image.shape == (3, 30, 40) and (image == 10).all()


# ----------------------------------------------------------------------------------------------
# --loader auto and the budget

def test_auto_takes_device_under_the_budget_and_workers_over_it(sources, accelerator, tmp_path):
    flags = [*source_flags("pickles", sources, tmp_path), "--batch-size", 8, "--workers", 0]
    fits = inputs_of(accelerator, *flags, "--loader-budget", 1000)
    assert fits.loader == "device"
    assert "42 images at 32px decoded take 0.1 MB, budget 1000.00 GB (--loader-budget)" in fits.line
    assert fits.config["loader_reason"] == fits.why
    over = inputs_of(accelerator, *flags, "--loader-budget", 0)
    assert over.loader == "workers"
    assert "42 images at 32px decoded take 0.1 MB, budget 0.0 MB (--loader-budget)" in over.line
    assert over.config["loader"] == "workers"
    default = inputs_of(accelerator, *flags)  # half the host's available memory: ample
    assert default.loader == "device" and "of the host's available memory" in default.why


def test_loader_device_over_the_budget_is_refused(sources, accelerator, tmp_path):
    with pytest.raises(UserError) as error:
        inputs_of(accelerator, *source_flags("pickles", sources, tmp_path), "--batch-size", 8, "--loader", "device",
                  "--loader-budget", 0)
    message = error.value.message
    assert "\n" not in message
    assert message.startswith("--loader device: the 42 images at 32px decoded take 0.1 MB, over the budget of "
                              "0.0 MB (--loader-budget); use --loader auto (over --loader-budget it loads through "
                              "the workers)")


# ----------------------------------------------------------------------------------------------
# --val-fraction

def test_val_fraction_is_seeded_stratified_disjoint_and_covers_train(sources):
    folder = str(sources["image_folder"])
    full = open_source(data_dir=folder).train
    a, again, other = (open_source(data_dir=folder, val_fraction=0.3, seed=seed) for seed in (1, 1, 2))
    def names(split):
        return [split.name(i) for i in range(len(split))]
    assert names(a.test) == names(again.test) and names(a.train) == names(again.train)
    assert names(a.test) != names(other.test)
    assert set(names(a.train)).isdisjoint(names(a.test))
    assert sorted(names(a.train) + names(a.test)) == sorted(names(full))
    for label in range(len(CLASSES)):  # 10 images a class: 3 held out of each
        assert (a.test.labels == label).sum() == 3 and (a.train.labels == label).sum() == 7
    for path, label in zip(names(a.test), a.test.labels.tolist()):
        assert Path(path).parent.name == CLASSES[label]
    assert "evaluated on 0.3 of train (--val-fraction, seed 1)" in a.source


def test_val_fraction_gives_an_evaluation_split_to_data_without_one(sources, accelerator, tmp_path):
    flags = [*source_flags("train_only", sources, tmp_path), "--batch-size", 8, "--image-size", 32]
    with pytest.raises(UserError) as error:
        inputs_of(accelerator, *flags, "--loader", "workers")
    assert "\n" not in error.value.message
    assert "has no labelled evaluation split; pass --val-fraction 0.1" in error.value.message
    flags += ["--val-fraction", 0.2, "--seed", 3]
    device = inputs_of(accelerator, *flags, "--loader", "device")
    workers = inputs_of(accelerator, *flags, "--loader", "workers", "--workers", 0)
    for data in (device, workers):
        assert (data.train_size, data.test_size) == (24, 6)
        assert data.eval_split == {"val_fraction": 0.2, "seed": 3}  # what evaluate.py needs to find them
    (device_images, device_labels), (worker_images, worker_labels) = map(everything, [device.test_loader,
                                                                                       workers.test_loader])
    assert device_labels.tolist() == worker_labels.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(device_images, worker_images)
    # The decoded cache that run left (its test split empty, to be carved) does not stand in for one.
    with pytest.raises(UserError, match="has no labelled evaluation split; pass --val-fraction"):
        load_image_data(data_dir=str(sources["train_only"]), cache_dir=str(tmp_path / "cache"), image_size=32)


def test_a_hub_dataset_decoded_for_val_fraction_is_not_evaluated_on_nothing(fake_hub, accelerator, tmp_path):
    fake_hub(datasets.DatasetDict(train=hub_split(0, 27, square=32)))  # its own size: cached under its name
    flags = ["--dataset", "someone/flowers", "--cache-dir", tmp_path, "--batch-size", 4, "--loader", "device"]
    carved = inputs_of(accelerator, *flags, "--val-fraction", 0.25)
    assert (carved.train_size, carved.test_size) == (21, 6)
    with pytest.raises(UserError, match="has no labelled evaluation split; pass --val-fraction"):
        inputs_of(accelerator, *flags)


def test_an_image_folder_with_an_unlabelled_test_folder_is_evaluated_on_val(sources, tmp_path):
    """Kaggle's layout: test/ holds the images without their classes, val/ the labelled ones."""
    folder = tmp_path / "kaggle"
    shutil.copytree(sources["image_folder"], folder)
    (folder / "test").mkdir()
    for path in sorted((folder / "val" / "cat").iterdir()):
        shutil.copy(path, folder / "test" / path.name)
    source = open_source(data_dir=str(folder))
    assert source.source.endswith("; evaluated on val") and len(source.test) == 12
    shutil.rmtree(folder / "val")
    with pytest.raises(UserError, match="has no labelled evaluation split; pass --val-fraction"):
        open_source(data_dir=str(folder))


def test_a_hub_snapshot_of_train_alone_takes_val_fraction(sources, tmp_path):
    snapshot = tmp_path / "snapshot" / "data"
    snapshot.mkdir(parents=True)
    shutil.copy(sources["parquet"] / "data" / "train-00000-of-00001.parquet", snapshot)
    with pytest.raises(UserError) as error:
        open_source(data_dir=str(snapshot.parent), cache_dir=str(tmp_path / "cache"))
    assert "has no labelled evaluation split; pass --val-fraction 0.1" in error.value.message
    carved = open_source(data_dir=str(snapshot.parent), cache_dir=str(tmp_path / "cache"), val_fraction=0.25)
    assert (len(carved.train), len(carved.test)) == (18, 6) and carved.classes == CLASSES


# ----------------------------------------------------------------------------------------------
# Augmentation per sample, from (seed, epoch, index)

def epoch_batches(split, size: int, workers: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = worker_loader(split, size, batch_size=8, train=True, workers=workers, seed=5)
    loader.sampler.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("name", ["image_folder", "parquet"], ids=["files", "memory-mapped Arrow"])
def test_augmentation_does_not_depend_on_the_workers(name, sources, tmp_path):
    split = open_source(data_dir=str(sources[name]), cache_dir=str(tmp_path)).train
    in_process, two_workers = epoch_batches(split, 32, 0, epoch=0), epoch_batches(split, 32, 2, epoch=0)
    assert len(in_process) == len(two_workers) == len(split) // 8  # the last partial batch dropped
    for (a, a_labels), (b, b_labels) in zip(in_process, two_workers):
        assert a.shape == (8, 3, 32, 32) and torch.equal(a, b) and torch.equal(a_labels, b_labels)
        # NHWC, the scripts' default layout, reordered in the workers rather than the training process
        assert a.is_contiguous(memory_format=torch.channels_last) and b.is_contiguous(memory_format=torch.channels_last)
    next_epoch = epoch_batches(split, 32, 0, epoch=1)
    assert not torch.equal(torch.cat([b[1] for b in next_epoch]), torch.cat([b[1] for b in in_process]))


@pytest.mark.parametrize("size", [32, 72], ids=["pad and crop", "random-resized crop"])
def test_each_sample_has_its_own_crop_per_epoch(sources, size):
    split = open_source(data_dir=str(sources["image_folder"])).train
    images = SampleImages(split, size, train=True, seed=5)
    first = torch.stack([images[0, i][0] for i in range(len(split))])
    assert torch.equal(first, torch.stack([images[0, i][0] for i in range(len(split))]))  # same key, same crop
    second = torch.stack([images[1, i][0] for i in range(len(split))])
    differ = sum(not torch.equal(a, b) for a, b in zip(first, second))
    assert differ >= len(split) - 2, f"only {differ} of {len(split)} crops changed with the epoch"
    other_seed = SampleImages(split, size, train=True, seed=6)
    assert not torch.equal(first, torch.stack([other_seed[0, i][0] for i in range(len(split))]))
    evaluation = SampleImages(split, size, train=False, seed=5)
    assert torch.equal(evaluation[0][0], evaluation[0][0]) and evaluation[0][0].shape == (3, size, size)


def boxes_per_image(draws: int, height: int, width: int) -> torch.Tensor:
    """The workers path's boxes: one image at a time, each from its own random.Random."""
    return torch.tensor([resized_crop_box(height, width, random.Random(k)) for k in range(draws)], dtype=torch.float64)


def boxes_per_batch(draws: int, height: int, width: int) -> torch.Tensor:
    """The device path's boxes: a whole batch at once, from one torch generator."""
    return torch.stack(resized_crop_boxes(draws, height, width, torch.Generator().manual_seed(0)), 1).double()


@pytest.mark.parametrize("draw", [boxes_per_image, boxes_per_batch], ids=["workers", "device"])
def test_random_resized_crop_boxes_are_drawn_as_torchvisions(draw):
    """Each path's random-resized crop boxes against torchvision's own RandomResizedCrop over 4,000
    draws each: every box inside the image and of whole pixels, the same distribution of heights,
    widths, aspect ratios (log-uniform: a uniform draw moves their quantiles by 0.04) and
    positions, and the same centre crop when no try fits."""
    height, width, draws = 300, 450, 4000
    ours = draw(draws, height, width)
    torch.manual_seed(0)
    reference, image = v2.RandomResizedCrop(224), torch.zeros(3, height, width, dtype=torch.uint8)
    theirs = torch.tensor([[box[k] for k in ("top", "left", "height", "width")]
                           for box in (reference.make_params([image]) for _ in range(draws))], dtype=torch.float64)
    top, left, h, w = ours.T
    assert (top >= 0).all() and (top + h <= height).all() and (left >= 0).all() and (left + w <= width).all()
    assert torch.equal(ours, ours.round()) and (h >= 1).all() and (w >= 1).all()

    def quantiles(boxes):  # of top, left, height, width as shares of the image's sides, and log(w / h)
        top, left, h, w = boxes.T
        shares = (top / height, left / width, h / height, w / width, (w / h).log())
        return torch.stack([torch.quantile(s, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64))
                            for s in shares])
    gap = (quantiles(ours) - quantiles(theirs)).abs()
    assert gap.max() < 0.02, gap
    for shape in ((10, 1000), (1000, 10)):  # no try fits: torchvision's centre crop, in its 3/4 to 4/3 ratio
        expected = reference.make_params([torch.zeros(3, *shape, dtype=torch.uint8)])
        assert draw(1, *shape)[0].tolist() == [expected[k] for k in ("top", "left", "height", "width")]


def test_augment_crops_and_flips_the_image_it_is_given():
    """The views are crops of the image itself: with padding, every one of the 81 offsets of a
    4-pixel pad and both flips occur, and nothing else; a random-resized crop is the box the same
    random numbers draw, resized."""
    image = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    padded = v2.functional.pad(image, [4])
    views = {(top, left, flip): v2.functional.horizontal_flip(view) if flip else view
             for top in range(9) for left in range(9) for flip in (False, True)
             for view in [padded[:, top:top + 8, left:left + 8]]}
    seen = set()
    for k in range(2000):
        out = augment(image, 8, random.Random(k))
        match = [key for key, view in views.items() if torch.equal(out, view)]
        assert len(match) == 1, f"seed {k}: not one of the padded image's crops"
        seen.add(match[0])
    assert seen == set(views)
    large = torch.randint(0, 256, (3, 90, 120), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    flips = set()
    for k in range(20):
        rng = random.Random(k)
        box = resized_crop_box(90, 120, rng)
        flip = rng.random() < 0.5
        expected = v2.functional.resized_crop(large, *box, [72, 72], antialias=True)
        assert torch.equal(augment(large, 72, random.Random(k)),
                           v2.functional.horizontal_flip(expected) if flip else expected)
        flips.add(flip)
    assert flips == {False, True}


# ----------------------------------------------------------------------------------------------
# Bad input: one line, through the real script

def bad_folder(root: Path) -> tuple[Path, Path]:
    """16 training images (two batches of 8: every one is read), one of them a garbage JPEG."""
    write_image_folder(root, {"train": 5, "val": 2})
    (root / "train" / "dog" / "05.jpg").write_bytes(encoded(picture(999, (50, 40)), "RGB", "JPEG"))
    broken = root / "train" / "cat" / "01.jpg"
    assert broken.is_file()
    broken.write_bytes(b"\xff\xd8\xff\xe0 this is no JPEG" + bytes(100))
    return root, broken


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """The scripts' runs on bad input, two at a time: each costs seconds of imports."""
    root = tmp_path_factory.mktemp("bad")
    folder, broken = bad_folder(root / "images")
    mismatched = write_image_folder(root / "mismatched", {"train": 2, "val": 2})
    (mismatched / "val" / "dog").rename(mismatched / "val" / "dogs")
    cases = {
        "workers": ["--data-dir", folder, "--loader", "workers", "--workers", 1],
        "device": ["--data-dir", folder, "--loader", "device"],
        "skip": ["--data-dir", folder, "--loader", "workers", "--workers", 1, "--bad-images", "skip",
                 "--epochs", 2, "--max-steps", 4],  # two epochs: the bad image is met twice
        "mismatched": ["--data-dir", mismatched],
        "over budget": ["--data-dir", folder, "--loader", "device", "--loader-budget", 0],
    }

    def one(case):
        out = root / f"run {case}"
        out.mkdir()
        return case, run("train_single.py", *TINY_RUN, *cases[case], "--output-dir", out / "run", cwd=out,
                         check=False, timeout=240)
    with ThreadPoolExecutor(2) as pool:
        done = dict(pool.map(one, cases))
    return done, broken


def last_line(done) -> str:
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), done.stderr
    return line


@pytest.mark.parametrize("loader", ["workers", "device"])
def test_an_undecodable_image_is_named(loader, bad_runs):
    done, broken = bad_runs
    line = last_line(done[loader])
    assert f"error: cannot decode image {broken} (" in line and "--bad-images skip" in line


def test_bad_images_skip_trains_without_it(bad_runs):
    done, broken = bad_runs
    run = done["skip"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"warning: cannot decode image {broken} (" in run.stderr
    assert run.stderr.count("skipped (--bad-images skip)") == 1, run.stderr  # said once, not every epoch
    assert "Traceback" not in run.stderr


def test_val_fraction_carves_alike_on_both_loaders_when_a_bad_image_is_skipped(accelerator, tmp_path):
    """With --bad-images skip the device path leaves the unreadable image out of the decoded
    training split, and the workers path puts the next readable image in its place. Either way
    --val-fraction holds out the same images (drawn over the source's list, as evaluate.py draws
    them again), less the bad one on the device path, whichever side it falls on."""
    folder, broken = bad_folder(tmp_path / "images")
    sides = set()
    for seed in range(6):
        flags = ["--data-dir", folder, "--cache-dir", tmp_path / "cache", "--image-size", 32, "--batch-size", 2,
                 "--val-fraction", 0.4, "--seed", seed, "--bad-images", "skip"]
        device = inputs_of(accelerator, *flags, "--loader", "device")
        workers = inputs_of(accelerator, *flags, "--loader", "workers", "--workers", 0)
        held = open_source(data_dir=str(folder), val_fraction=0.4, seed=seed).test
        names = [held.name(i) for i in range(len(held))]
        in_held = str(broken) in names
        sides.add(in_held)
        assert (device.train_size + (not in_held), device.test_size + in_held) == (workers.train_size,
                                                                                    workers.test_size)
        (device_images, device_labels), (worker_images, worker_labels) = map(everything, [device.test_loader,
                                                                                           workers.test_loader])
        if in_held:  # the workers path's stand-in for the bad image: not on the device path
            keep = torch.tensor([name != str(broken) for name in names])
            worker_images, worker_labels = worker_images[keep], worker_labels[keep]
        assert torch.equal(device_images, worker_images) and torch.equal(device_labels, worker_labels)
    assert sides == {True, False}  # the bad image fell on each side for some seed


def test_image_folder_whose_splits_differ(bad_runs, tmp_path):
    line = last_line(bad_runs[0]["mismatched"])
    assert "the class folders of train/ and val/ differ (dog missing from val/; dogs missing from train/)" in line
    assert line.endswith("; give both splits the same class folders")
    # followed: val/dogs named as train/ names it, the folder opens with both classes
    folder = shutil.copytree(line.split("image folder ")[1].split(": ")[0], tmp_path / "images")
    (folder / "val" / "dogs").rename(folder / "val" / "dog")
    assert "dog" in open_source(data_dir=str(folder)).classes


def test_loader_device_over_budget(bad_runs):
    line = last_line(bad_runs[0]["over budget"])
    assert line.startswith("error: --loader device: the 22 images at 32px decoded take 0.1 MB, over the budget "
                           "of 0.0 MB (--loader-budget); use --loader auto")


@pytest.mark.parametrize("flags, message", [
    (["--image-size", "0"], "--image-size 0: must be from 8 to 4096 pixels"),
    (["--image-size", "-5"], "--image-size -5: must be from 8 to 4096 pixels"),
    (["--workers", "-1"], "--workers -1: must be 0 (load in the training process) or more"),
    (["--val-fraction", "1"], "--val-fraction 1.0: must be between 0 and 1, e.g. 0.1"),
    (["--loader-budget", "-1"], "--loader-budget -1.0: must be a number of GB, 0 or more"),
    (["--loader", "device", "--workers", "2"], "--workers 2 is for --loader workers, not --loader device: drop one"),
])
def test_input_flags_out_of_range_are_refused_when_parsed(flags, message):
    spec = importlib.util.spec_from_file_location("train_single", ROOT / "scripts" / "train_single.py")
    train_single = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_single)
    with pytest.raises(UserError) as error:
        train_single.parse_args(["--dataset", "synthetic", *flags])
    assert error.value.message.startswith(message)


def test_unknown_loader_is_one_line(capsys):
    with pytest.raises(SystemExit):
        build_parser("test").parse_args(["--loader", "gpu"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: argument --loader: invalid choice: 'gpu'") and line.endswith("see --help")
