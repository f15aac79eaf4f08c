"""CIFAR-shaped image data as uint8 tensors: from the Hugging Face Hub, a local copy, or made on the spot.

    data = load_image_data("cifar10")                     # uoft-cs/cifar10 through `datasets`
    data = load_image_data(data_dir="~/data/cifar10")     # a local copy, format detected
    data = load_image_data("synthetic")                   # no download, learnable, deterministic

Every image is decoded once into one uint8 (N, 3, H, W) tensor per split, so augmentation can run
batched on tensors instead of PIL per sample (the input bottleneck the source articles hit). The
decoded tensors are cached under `default_cache_dir()`, one file per source, so a second run starts
in about a second and a cached Hub dataset loads with no network access at all.

Local copies (`data_dir`) can be any of:
  - a snapshot of the Hub repository (parquet files named train-*.parquet / test-*.parquet),
  - a `DatasetDict.save_to_disk` folder (has dataset_dict.json),
  - torchvision's `cifar-10-batches-py` / `cifar-100-python` folder, or its .tar.gz archive,
  - an image folder tree: train/<class>/*.png and test/<class>/*.png (png, jpg or jpeg).
"""

import hashlib
import io
import logging
import os
import pickle
import re
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from common.errors import UserError

log = logging.getLogger(__name__)

DATASETS = ("cifar10", "cifar100", "synthetic")
HUB_REPOS = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100"}
DATA_DIR_FORMATS = (
    "a Hub snapshot with train-*.parquet and test-*.parquet files, a save_to_disk folder "
    "(dataset_dict.json), cifar-10-batches-py or cifar-100-python (folder or .tar.gz), "
    "or an image folder tree train/<class>/*.png and test/<class>/*.png"
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class ImageData:
    train_images: torch.Tensor  # uint8, (N, 3, H, W), CPU, contiguous
    train_labels: torch.Tensor  # int64, (N,)
    test_images: torch.Tensor  # uint8, (M, 3, H, W)
    test_labels: torch.Tensor  # int64, (M,)
    classes: list[str]  # class names, index = label
    source: str  # one human-readable line: where the data came from and where it is cached


def load_image_data(
    dataset: str = "cifar10",
    data_dir: str | None = None,
    cache_dir: str | None = None,
    synthetic_train_size: int = 5000,
    synthetic_test_size: int = 1000,
    synthetic_classes: int = 10,
    seed: int = 0,
) -> ImageData:
    """Load `dataset` (one of DATASETS), or the local copy in `data_dir`, which takes precedence.

    `seed` and the synthetic_* sizes only apply to dataset="synthetic", which is made on the
    spot and never cached.
    """
    if dataset not in DATASETS:
        raise UserError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if dataset == "synthetic":
        if data_dir is not None:
            raise UserError(f"--dataset synthetic takes no --data-dir (got {data_dir}); drop one of the two")
        return make_synthetic(synthetic_train_size, synthetic_test_size, synthetic_classes, seed)
    cache_dir = cache_dir or default_cache_dir()
    if data_dir is not None:
        return _load_data_dir(Path(data_dir).expanduser(), Path(cache_dir))
    return _load_hub(dataset, Path(cache_dir))


def default_cache_dir() -> str:
    """$CIFAR_CACHE_DIR if set, else $XDG_CACHE_HOME/multigpu-cifar, else ~/.cache/multigpu-cifar."""
    if os.environ.get("CIFAR_CACHE_DIR"):
        return os.environ["CIFAR_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "multigpu-cifar")


# ----------------------------------------------------------------------------------------------
# Synthetic data

def make_synthetic(train_size: int, test_size: int, num_classes: int = 10, seed: int = 0,
                   image_size: int = 32) -> ImageData:
    """CIFAR-shaped images whose class is learnable, but not by a linear model in one pass.

    Each class has a smooth random colour pattern (a coarse random field upsampled bilinearly);
    a sample is its class pattern shifted by a few pixels, with random brightness and contrast,
    plus per-pixel noise. The test split is an independent draw from the same distribution and
    does not depend on train_size. Deterministic for a seed; the global RNG is not touched.
    """
    if min(train_size, test_size) < num_classes or num_classes < 2:
        raise UserError(f"synthetic data needs at least 2 classes and at least one image per class in each "
                        f"split; got {num_classes} classes, {train_size} train, {test_size} test images")
    gen = torch.Generator().manual_seed(seed)
    shift = image_size // 8
    coarse = torch.randn(num_classes, 3, 8, 8, generator=gen)
    patterns = torch.nn.functional.interpolate(coarse, size=image_size + 2 * shift, mode="bilinear",
                                               align_corners=False)
    patterns = patterns / patterns.std(dim=(1, 2, 3), keepdim=True)
    train_seed, test_seed = torch.randint(2**62, (2,), generator=gen).tolist()
    train = _synthetic_split(patterns, train_size, image_size, torch.Generator().manual_seed(train_seed))
    test = _synthetic_split(patterns, test_size, image_size, torch.Generator().manual_seed(test_seed))
    return ImageData(*train, *test, classes=[f"class{i}" for i in range(num_classes)],
                     source=f"synthetic: {num_classes} classes, {train_size} train / {test_size} test "
                            f"images of {image_size}x{image_size}, seed {seed}")


def _synthetic_split(patterns, size, image_size, gen, chunk=8192):
    num_classes, _, padded, _ = patterns.shape
    labels = torch.randperm(size, generator=gen) % num_classes  # balanced, in random order
    images = torch.empty(size, 3, image_size, image_size, dtype=torch.uint8)
    pixels = torch.arange(image_size)
    for start in range(0, size, chunk):  # bounds the float32 working memory
        y = labels[start:start + chunk]
        n = len(y)
        dy, dx = (torch.randint(padded - image_size + 1, (2, n, 1, 1, 1), generator=gen))
        crops = patterns[y[:, None, None, None], torch.arange(3)[None, :, None, None],
                         (dy + pixels[:, None]), (dx + pixels)]
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=gen)
        brightness = torch.randn(n, 1, 1, 1, generator=gen) * 0.5
        noise = torch.randn(n, 3, image_size, image_size, generator=gen)
        x = 128 + 40 * (contrast * crops + brightness + noise)
        images[start:start + n] = x.round_().clamp_(0, 255).to(torch.uint8)
    return images, labels
