"""The augmentation both loaders draw: the crop for an image size, its box, per-sample seeds.

The device path crops a whole batch at once (common.data.transform draws all its boxes in one
go), the workers path one image at a time (common.data.workers, a box from ``resized_crop_box``);
both follow these rules, so --loader does not change the recipe.
"""

import math
import random

PAD_CROP_MAX_SIZE = 64  # images up to this size train with CIFAR's crop, larger with ImageNet's
PADDING = 4  # CIFAR's crop pads by this much, as torchvision's CIFAR recipes
CROP_SCALE, CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop defaults
CROP_TRIES = 10  # as RandomResizedCrop


def crop_mode(size: int) -> str:
    """'pad' (CIFAR: pad by 4, random crop, flip) for small images, else 'resized' (ImageNet:
    random-resized crop, flip)."""
    return "pad" if size <= PAD_CROP_MAX_SIZE else "resized"


def centre_crop_box(height: int, width: int) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box when none of its tries fits: the whole image, cut to the nearest
    aspect ratio within CROP_RATIO, in the centre."""
    h, w = height, width
    if width / height < CROP_RATIO[0]:
        h = round(width / CROP_RATIO[0])
    elif width / height > CROP_RATIO[1]:
        w = round(height * CROP_RATIO[1])
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop_box(height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random-resized crop, drawn as torchvision's RandomResizedCrop
    draws it with its defaults: 8 % to 100 % of the area, aspect ratio 3/4 to 4/3 (log-uniform),
    10 tries, else the largest centre crop within those ratios."""
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(CROP_TRIES):
        area = height * width * rng.uniform(*CROP_SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        h, w = round(math.sqrt(area / aspect)), round(math.sqrt(area * aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    return centre_crop_box(height, width)


def sample_seed(*key: int) -> int:
    """A 63-bit seed from a tuple of ints, e.g. (run seed, step) or (run seed, epoch, index)."""
    # hash() of a tuple of ints is the same in every process and run (no hash randomisation).
    return hash(key) & 0x7FFF_FFFF_FFFF_FFFF
