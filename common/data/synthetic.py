"""Synthetic data (--dataset synthetic): CIFAR-shaped images made on the spot, no download."""

import os

import torch

from common.data.splits import ImageData
from common.errors import UserError


def make_synthetic(train_size: int, test_size: int, num_classes: int = 10, seed: int = 0,
                   image_size: int = 32) -> ImageData:
    """CIFAR-shaped images that a CNN learns in a few epochs and a linear model cannot.

    Each class is a smooth random colour pattern that tiles the plane (an 8x8 random field
    upsampled bilinearly with wrap-around). A sample is its class pattern cyclically shifted to a
    random position, mirrored left-right half the time (so flip augmentation keeps the
    distribution), with random contrast and brightness, plus per-pixel Gaussian noise as strong as
    the pattern. Averaged over positions every pattern is flat grey, so a linear model on pixels
    stays near chance, while a CNN recognises the pattern wherever it lies. The test split is an
    independent draw from the same distribution and does not depend on train_size. Deterministic
    for a seed; the global RNG is left alone. About 2 s for 50,000 images on 2 cores.
    """
    if num_classes < 2 or image_size % 8:
        raise ValueError(f"need 2 or more classes and an image size divisible by 8, got "
                         f"{num_classes}, {image_size}")
    if min(train_size, test_size) < num_classes:
        raise UserError(f"synthetic data needs at least one image per class in each split, got "
                        f"{train_size} train and {test_size} test images for {num_classes} "
                        f"classes; raise --synthetic-train-size or --synthetic-test-size")
    gen = torch.Generator().manual_seed(seed)
    coarse, scale = 8, image_size // 8
    field = torch.nn.functional.pad(torch.randn(num_classes, 3, coarse, coarse, generator=gen),
                                    (1, 1, 1, 1), mode="circular")
    patterns = torch.nn.functional.interpolate(field, scale_factor=scale, mode="bilinear")
    patterns = patterns[..., scale:-scale, scale:-scale]  # one period, seamless at the edges
    patterns -= patterns.mean(dim=(2, 3), keepdim=True)
    patterns /= patterns.std(dim=(1, 2, 3), keepdim=True)
    train_seed, test_seed = torch.randint(2**62, (2,), generator=gen).tolist()
    train = _synthetic_split(patterns, train_size, torch.Generator().manual_seed(train_seed))
    test = _synthetic_split(patterns, test_size, torch.Generator().manual_seed(test_seed))
    return ImageData(*train, *test, classes=[f"class{i}" for i in range(num_classes)],
                     source=f"synthetic: {num_classes} classes, {train_size} train / {test_size} "
                            f"test images of {image_size}x{image_size}, seed {seed}")


def _synthetic_split(patterns, size, gen, chunk=8192):
    num_classes, channels, side, _ = patterns.shape
    labels = torch.randperm(size, generator=gen) % num_classes  # balanced, in random order
    images = torch.empty(size, channels, side, side, dtype=torch.uint8)
    pixels = torch.arange(side)
    for start in range(0, size, chunk):  # bounds the float32 working memory
        n = len(y := labels[start:start + chunk])
        dy, dx = torch.randint(side, (2, n, 1, 1, 1), generator=gen)
        mirror = torch.randint(2, (n, 1, 1, 1), generator=gen) * 2 - 1
        shifted = patterns[y[:, None, None, None], torch.arange(channels)[:, None, None],
                           (dy + pixels[:, None]) % side, (dx + mirror * pixels) % side]
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=gen)
        brightness = 0.5 * torch.randn(n, 1, 1, 1, generator=gen)
        noise = torch.randn(n, channels, side, side, generator=gen)
        x = noise.addcmul_(shifted, contrast).add_(brightness)
        images[start:start + n] = x.mul_(40).add_(128).round_().clamp_(0, 255).to(torch.uint8)
    return images, labels


def check_synthetic_size(train_size: int, test_size: int, image_size: int | None) -> None:
    """Refuse sizes whose images cannot fit in this machine's memory, with the figure: made at
    32x32 (3 KB an image), then resized to ``image_size``, all held at once, so a typo (10**12)
    is one line, not an allocation traceback."""
    pixels = 32 * 32 + (image_size**2 if image_size not in (None, 32) else 0)
    need = (train_size + test_size) * 3 * pixels
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        size, fit = image_size or 32, memory // (3 * pixels)  # images that fit, both splits
        flag, most = (("--synthetic-train-size", fit - test_size) if test_size < fit
                      else ("--synthetic-test-size", fit // 2))
        raise UserError(f"--synthetic-train-size {train_size} and --synthetic-test-size "
                        f"{test_size}: {train_size + test_size} synthetic images of {size}x{size} "
                        f"take {need / 1e9:.4g} GB, more than this machine's {memory / 1e9:.0f} GB "
                        f"of memory; use {flag} {most} or fewer (CIFAR-10 has 60000)")
