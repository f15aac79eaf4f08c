"""Every image of a source decoded once, at one size, into a uint8 (N, 3, H, W) tensor per split.

For the device path (--loader device): decoded once, then cached (common.data.cache) and held on
the training device (common.data.device). One thread on purpose: a 32x32 PNG decodes in about
50 us, mostly under the GIL, and a thread pool was no faster.
"""

import logging
from contextlib import suppress

import torch

from common.data.hub import ArrowSplit
from common.data.images import BadImage, decode, fit
from common.data.splits import ImageData, ImageSource, TensorSplit
from common.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_IMAGE_SIZE = 224  # for images of mixed sizes, as torchvision's ImageNet models


def native_size(source: ImageSource, probes: int = 16) -> int | None:
    """The side of the training images when all of ``probes`` spread over the split are square
    and of one size (CIFAR: 32), else None."""
    split = source.train
    sizes = set()
    for i in sorted({round(k * (len(split) - 1) / max(probes - 1, 1)) for k in range(probes)}):
        with suppress(BadImage):
            sizes.add(tuple(decode(split.encoded(i), split.name(i)).shape[-2:]))
    squares = {h for h, w in sizes if h == w}
    return squares.pop() if len(sizes) == 1 and squares else None


def decode_source(source: ImageSource, image_size: int | None, skip_bad: bool = False,
                  interpolation: str = "bilinear") -> ImageData:
    """Every image of both splits decoded, at ``image_size`` or (None) the size they all share,
    resized with ``interpolation`` where they are not at that size."""
    if (size := image_size or native_size(source)) is None:
        size = DEFAULT_IMAGE_SIZE
        log.warning("the images of %s differ in size: decoding them at %dx%d (set --image-size)",
                    source.source, size, size)
    train_images, train_labels, left_out = decode_split(source.train, size, skip_bad, interpolation)
    if source.test is None:  # to be carved from train (--val-fraction)
        test = torch.empty(0, 3, size, size, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    else:
        test = decode_split(source.test, size, skip_bad, interpolation)[:2]
    return ImageData(train_images, train_labels, *test, source.classes, source.source,
                     skipped=torch.stack([left_out, source.train.labels[left_out]], dim=1))


def decode_split(split, size: int, skip_bad: bool = False, interpolation: str = "bilinear"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One split as uint8 (N, 3, size, size), its labels and the indices of the images left out as
    unreadable (with skip_bad)."""
    none = torch.empty(0, dtype=torch.int64)
    if isinstance(split, TensorSplit):
        return fit_all(split.images, size, interpolation), split.labels, none
    items = (split.all_encoded() if isinstance(split, ArrowSplit)
             else (split.encoded(i) for i in range(len(split))))
    batch = torch.empty(len(split), 3, size, size, dtype=torch.uint8)
    kept = torch.ones(len(split), dtype=torch.bool)
    for i, encoded in enumerate(items):
        try:
            batch[i] = fit(decode(encoded, split.name(i)), size, interpolation)
        except BadImage as e:
            if not skip_bad:
                raise UserError(f"{e}; replace or remove the file, or pass --bad-images skip to "
                                f"train without it") from None
            log.warning("%s; skipped (--bad-images skip)", e)
            kept[i] = False
    if kept.all():
        return batch, split.labels, none
    return batch[kept].contiguous(), split.labels[kept], (~kept).nonzero().flatten()


def fit_all(images: torch.Tensor, size: int, interpolation: str = "bilinear",
            chunk: int = 1024) -> torch.Tensor:
    """A tensor of images, each ``fit`` to size x size, ``chunk`` images at a time (a batch resizes
    as its images one by one do)."""
    if images.shape[-2:] == (size, size):
        return images
    return torch.cat([fit(part, size, interpolation) for part in images.split(chunk)]).contiguous()
