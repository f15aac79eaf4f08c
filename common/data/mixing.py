"""MixUp and CutMix (--mixup, --cutmix): a training batch blended with itself in another order, its
labels turned into the classes' shares, drawn from a seed per batch.

MixUp (Zhang et al. 2018, arXiv:1710.09412) blends whole images by a share lam ~ Beta(a, a);
CutMix (Yun et al. 2019, arXiv:1905.04899) pastes a rectangle of 1 - lam of the area from the other
image, and the labels follow the pasted area. With both on, one of the two per batch, each half the
time, as timm's Mixup does. torchvision's v2.MixUp and v2.CutMix draw from the global random number
generator; these draw from the batch's seed, so a resumed run mixes what the first one mixed.
The shares are drawn on the host (Python's random) and the order on the device: no host-device
synchronisation.
"""

import math
import random

import torch

from common.data.crops import sample_seed


class BatchMix:
    """MixUp and/or CutMix of (normalised images, int64 labels) into (images, float class shares):

        images, labels = data.mix(images, labels, micro_batch)   # as they are when both are off

    drawn from (seed, micro-batch, process): each process of a job mixes its slice its own way."""

    def __init__(self, num_classes: int, mixup: float = 0.0, cutmix: float = 0.0, seed: int = 0,
                 process: int = 0):
        self.num_classes, self.mixup, self.cutmix = num_classes, mixup, cutmix
        self.seed, self.process = seed, process

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.mixup or self.cutmix):
            return images, labels
        seed = (self.seed, micro_batch, self.process)
        rng = random.Random(sample_seed(*seed, 1))  # another stream than the crops' of this batch
        generator = torch.Generator(images.device).manual_seed(sample_seed(*seed, 2))
        order = torch.randperm(len(images), device=images.device, generator=generator)
        shares = torch.nn.functional.one_hot(labels, self.num_classes).float()
        use_cutmix = self.cutmix and (not self.mixup or rng.random() < 0.5)
        lam = rng.betavariate(*(2 * [self.cutmix if use_cutmix else self.mixup]))
        if use_cutmix:
            images, lam = self._paste(images, order, lam, rng)
        else:
            images = images.lerp(images[order], 1 - lam)
        layout = torch.channels_last if images.is_contiguous(
            memory_format=torch.channels_last) and images.dim() == 4 else torch.contiguous_format
        return images.contiguous(memory_format=layout), shares.lerp(shares[order], 1 - lam)

    @staticmethod
    def _paste(images, order, lam, rng) -> tuple[torch.Tensor, float]:
        """The other image's rectangle of about 1 - lam of the area, centred at random and cut at
        the borders; lam becomes the share of the area that stays."""
        h, w = images.shape[-2:]
        cut_h, cut_w = round(h * math.sqrt(1 - lam)), round(w * math.sqrt(1 - lam))
        y, x = rng.randrange(h), rng.randrange(w)
        top, bottom = max(y - cut_h // 2, 0), min(y + cut_h - cut_h // 2, h)
        left, right = max(x - cut_w // 2, 0), min(x + cut_w - cut_w // 2, w)
        mixed = images.clone()
        mixed[..., top:bottom, left:right] = images[order][..., top:bottom, left:right]
        return mixed, 1 - (bottom - top) * (right - left) / (h * w)
