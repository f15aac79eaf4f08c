"""Per-channel normalisation statistics (mean, std) of the training images, on either path.

Each dataset gets its own normalisation: BatchTransform (common.data.transform) subtracts the
mean and divides by the std that these return, in the 0..255 scale.
"""

from contextlib import suppress

import torch

from common.data.images import BadImage, decode, fit
from common.data.splits import TensorSplit
from common.errors import UserError

STATS_SAMPLE = 1000  # images the normalisation of the workers path is estimated from


def channel_stats(images, chunk_bytes: int = 2**27):
    """Per-channel mean and standard deviation of uint8 images, in the 0..255 scale. ``images``: one
    (N, C, H, W) tensor, summed 128 MB of float64 at a time whatever the image size, or an iterable
    of (C, H, W) images or (N, C, H, W) batches, summed as they come, so that none has to be held
    beside the others. Raises ValueError when there is no image."""
    parts = images
    if isinstance(images, torch.Tensor):
        if images.ndim != 4:
            raise ValueError(f"channel_stats: a tensor of images is (N, C, H, W), not "
                             f"{tuple(images.shape)}")
        parts = images.split(max(1, chunk_bytes // (8 * images[0].numel())) if len(images) else 1)
    total = total_sq = count = 0
    for part in parts:
        part = part.to(torch.float64)
        dims = (0, 2, 3) if part.ndim == 4 else (1, 2)
        total, total_sq = total + part.sum(dim=dims), total_sq + part.square().sum(dim=dims)
        count += part.numel() / part.shape[-3]
    if not count:
        raise ValueError("channel_stats: no images")
    mean = total / count
    std = (total_sq / count - mean.square()).clamp_min(1e-6).sqrt()
    return mean.float().tolist(), std.float().tolist()


def sample_stats(split, size: int, sample: int = STATS_SAMPLE,
                 interpolation: str = "bilinear") -> tuple[list[float], list[float]]:
    """Per-channel mean and std (0..255 scale) of the training images as evaluated at ``size``
    (resized with ``interpolation``): from all of them when they are held decoded, else from
    ``sample`` spread over the split; one image in memory at a time."""
    picks = (range(len(split)) if isinstance(split, TensorSplit) or len(split) <= sample
             else torch.linspace(0, len(split) - 1, sample).round().long().tolist())

    def fitted():
        for i in picks:
            with suppress(BadImage):  # the loader reports it, or skips it (--bad-images)
                yield fit(decode(split.encoded(i), split.name(i)), size, interpolation)
    try:
        if isinstance(split, TensorSplit) and split.images.shape[-2:] == (size, size):
            return channel_stats(split.images)  # as the device path computes them
        return channel_stats(fitted())
    except ValueError:
        raise UserError(f"no training image of {split.name(0)}'s split can be decoded; check the "
                        f"data") from None
