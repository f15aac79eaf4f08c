"""The augmentation: the crop both loaders draw, and a batch's on the device (crop, flip, mix).

A uint8 (B, 3, H, W) batch from either loader becomes a normalised float batch in a few tensor
operations on the training device. The device path crops and flips here too, a batch at once:
per-image PIL transforms on CPU workers were the source articles' bottleneck (docs/benchmark, 2 CPU
cores: about 5,600 img/s with torchvision's CIFAR10 pipeline and 2 workers, 31,000 img/s here). The
workers path (common.data.workers) crops an image at a time (a box from ``resized_crop_box``); both
follow the crop rules here (crop_mode, the boxes, per-sample seeds): --loader keeps the recipe.

MixUp and CutMix (--mixup, --cutmix, BatchMix): a training batch blended with itself in another
order, its labels turned into the classes' shares, drawn from a seed per batch. MixUp (Zhang et al.
2018, arXiv:1710.09412) blends whole images by a share lam ~ Beta(a, a); CutMix (Yun et al. 2019,
arXiv:1905.04899) pastes a rectangle of 1 - lam of the area from the other image, and the labels
follow the pasted area. With both on, one of the two per batch, each half the time, as timm's Mixup
does. torchvision's v2.MixUp and v2.CutMix draw from the global random number generator; these draw
from the batch's seed, so a resumed run mixes what the first one mixed. The shares are drawn on the
host (Python's random) and the order on the device: no host-device synchronisation.
"""

import math
import random

import torch

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


class BatchTransform:
    """Random crop and horizontal flip of a whole batch, then per-channel normalisation.

    The crop is crop_mode's for the batch's image size: up to 64 px zero padding by 4 and a random
    crop (CIFAR), above a random-resized crop as torchvision's RandomResizedCrop draws it, of the
    image as held (already resized to the training size), scaled back up to that size with
    ``interpolation``: bilinear, or bicubic where pretrained weights were trained so.

    ``mean`` and ``std`` are per-channel statistics of the training images in the 0..255 scale
    (see common.data.stats.channel_stats), so any dataset gets its own normalisation."""

    def __init__(self, mean, std, augment: bool = True, channels_last: bool = False,
                 erase: float = 0.0, interpolation: str = "bilinear"):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.augment, self.erase = augment, erase  # erase: --random-erase's probability per image
        self.interpolation = interpolation  # of the random-resized crop's enlargement
        # NHWC batches for a model converted to channels_last, so no layer has to reorder its input.
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def train(self, images: torch.Tensor, seed: tuple[int, ...]) -> torch.Tensor:
        """Augment and normalise a uint8 batch; the same seed gives the same batch.

        The random numbers come from a generator seeded per batch (``seed`` is a tuple of ints,
        e.g. (run seed, step)), not from the global RNG, so a resumed run draws exactly what the
        uninterrupted run drew for that batch."""
        if not (self.augment or self.erase):
            return self.eval(images)
        generator = torch.Generator(images.device).manual_seed(sample_seed(*seed))
        if self.augment and crop_mode(max(images.shape[-2:])) == "resized":
            images = self.resized_crop_and_flip(images, generator)
        elif self.augment:
            images = self.crop_and_flip(images, generator)
        images = self.eval(images)
        return erase_rectangles(images, self.erase, generator) if self.erase else images

    def eval(self, images: torch.Tensor) -> torch.Tensor:
        """Normalise a uint8 batch: what evaluation takes, and training after its augmentation."""
        # Moved once: a copy per batch would make the host wait for the GPU.
        if self.mean.device != images.device:
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        # One float tensor in the wanted layout, filled by a copy and two in-place passes, with the
        # values of (images.float() - mean) / std: that allocated three or four (one more to change
        # the layout), and on a CPU each fresh allocation of a batch costs its page faults again.
        out = torch.empty(images.shape, dtype=torch.float32, device=images.device,
                          memory_format=self.memory_format)
        return out.copy_(images).sub_(self.mean).div_(self.std)

    def crop_and_flip(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = images.shape
        p, device = PADDING, images.device
        padded = torch.nn.functional.pad(images, (p, p, p, p))  # zeros, as torchvision's RandomCrop
        top = torch.randint(0, 2 * p + 1, (b, 1), device=device, generator=generator)
        left = torch.randint(0, 2 * p + 1, (b, 1), device=device, generator=generator)
        flipped = torch.rand(b, 1, device=device, generator=generator) < 0.5
        rows, cols, mirrored, batch, channel = self._grid(b, c, h, w, device)
        rows = top + rows  # (B, H): source row of each output row
        cols = left + torch.where(flipped, mirrored, cols)
        # One gather does crop and flip for the whole batch: index (B, C, H, W) with broadcasting.
        return padded[batch, channel, rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]

    def _grid(self, b: int, c: int, h: int, w: int, device) -> tuple[torch.Tensor, ...]:
        """The index tensors of a batch's shape, made once: 5 kernels a step fewer, which on a GPU
        that waits for the host's launches is time (--profile counts them)."""
        key = (b, c, h, w, str(device))
        if getattr(self, "_grid_key", None) != key:
            cols = torch.arange(w, device=device).expand(b, w)
            self._grid_tensors = (torch.arange(h, device=device), cols, w - 1 - cols,
                                  torch.arange(b, device=device).view(b, 1, 1, 1),
                                  torch.arange(c, device=device).view(1, c, 1, 1))
            self._grid_key = key
        return self._grid_tensors

    def resized_crop_and_flip(self, images: torch.Tensor,
                              generator: torch.Generator) -> torch.Tensor:
        """A random-resized crop of each image, flipped half the time, back at the images' size:
        float (B, C, H, W), with the values of torchvision's resized_crop of the same box in float.
        Bilinear: one grid_sample for the batch, as torchvision's resize (a crop is never larger
        than the image, so it is only enlarged: no antialiasing needed); bicubic: bicubic_crops."""
        b, _, h, w = images.shape
        top, left, height, width = resized_crop_boxes(b, h, w, generator)
        flipped = torch.rand(b, device=images.device, generator=generator) < 0.5
        if self.interpolation == "bicubic":
            return bicubic_crops(images, top, left, height, width, flipped)
        # Output pixel centre j of W maps to source pixel centre left + (j + 0.5) * width / W - 0.5,
        # as torch's bilinear resize with align_corners=False (and the same for rows); in
        # grid_sample's [-1, 1] coordinates, x = (2 * position + 1) / W - 1. Built element-wise, not
        # by affine_grid, whose matmul would run in TF32 on GPUs (the scripts' --tf32) and move the
        # positions by up to a few hundredths of a pixel.
        def positions(start, length, side, mirrored=None):
            j = torch.arange(side, device=images.device, dtype=torch.float32) + 0.5
            if mirrored is not None:
                j = torch.where(mirrored.view(-1, 1), side - j, j)
            source = start.view(-1, 1) + j * (length / side).view(-1, 1) - 0.5
            # Near its edges the resize reads the crop's edge pixels, not those beyond it.
            source = source.clamp(start.view(-1, 1), (start + length - 1).view(-1, 1))
            return (2 * source + 1) / side - 1
        x, y = positions(left, width, w, flipped), positions(top, height, h)
        grid = torch.stack([x.view(b, 1, w).expand(b, h, w), y.view(b, h, 1).expand(b, h, w)], -1)
        return torch.nn.functional.grid_sample(images.float(), grid, mode="bilinear",
                                               padding_mode="border", align_corners=False)


def bicubic_crops(images: torch.Tensor, top, left, height, width, flipped) -> torch.Tensor:
    """The box (top, left, height, width: float (B,)) of each image enlarged back to the images'
    size, mirrored where ``flipped``: float (B, C, H, W) with the values of torchvision's
    resized_crop(image.float(), box, size, BICUBIC, antialias=True), which the workers path does.

    Not grid_sample's bicubic: its kernel is Keys' a = -0.75 (torch's unantialiased resize), not
    PIL's -0.5 of torchvision's antialiased one (timm trained with PIL); and near a crop's edge its
    taps read the pixels beyond it, where a resize of the crop repeats the edge: on uniform noise at
    96 px, up to 25 of 255 off inside the crop, 46 at its edges. So the antialiased resize's own
    weights (aten's UpSampleKernel.cpp, _compute_weights_aa; only enlarging, 4 taps), applied as it
    does, rows then columns, element-wise in float32 (a matmul would round to TF32 under --tf32)."""
    h, w = images.shape[-2:]
    images = _resample(images.float(), 2, *_bicubic_taps(top, height, h))
    return _resample(images, 3, *_bicubic_taps(left, width, w, flipped))


def _bicubic_taps(start, length, side: int, mirrored=None):
    """For each of ``side`` output pixels of a crop from ``start``, ``length`` long (float (B,)),
    the 4 image pixels it reads (int64 (B, side, 4)) and their weights (float (B, side, 4))."""
    j = torch.arange(side, device=start.device, dtype=torch.float32) + 0.5
    centre = j * (length / side).view(-1, 1)  # in the crop's pixels
    # The kernel spans 2 pixels either side of the centre: taps beyond the crop are dropped (their
    # weight 0, their index the crop's edge) and the others' weights renormalised.
    first = (centre - 1.5).floor().clamp(min=0)
    end = torch.minimum((centre + 2.5).floor(), length.view(-1, 1))
    taps = first.unsqueeze(-1) + torch.arange(4, device=start.device, dtype=torch.float32)
    weights = _keys_cubic(taps + 0.5 - centre.unsqueeze(-1)) * (taps < end.unsqueeze(-1))
    weights = weights / weights.sum(-1, keepdim=True)
    index = (start.view(-1, 1, 1) + torch.minimum(taps, (length - 1).view(-1, 1, 1))).long()
    if mirrored is not None:  # a mirrored row's pixel j is the unmirrored row's side - 1 - j
        flip = mirrored.view(-1, 1, 1)
        index, weights = (torch.where(flip, t.flip(1), t) for t in (index, weights))
    return index, weights


def _keys_cubic(x: torch.Tensor, a: float = -0.5) -> torch.Tensor:
    """Keys' cubic convolution kernel (1981), with PIL's and antialiased torch's a = -0.5."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, 0.0))


def _resample(images: torch.Tensor, dim: int, index: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """Along ``dim`` (2: rows, 3: columns) of float ``images``, each output pixel the sum of the
    pixels at ``index`` (B, side, taps) times ``weights``: one gather of the batch per tap."""
    shape = [len(images), 1, 1, 1]
    shape[dim] = index.shape[1]
    out = None
    for k in range(index.shape[-1]):
        tap = images.gather(dim, index[..., k].view(shape).expand(images.shape))
        tap.mul_(weights[..., k].view(shape))
        out = tap if out is None else out.add_(tap)
    return out


def erase_rectangles(images: torch.Tensor, probability: float,
                     generator: torch.Generator) -> torch.Tensor:
    """torchvision's RandomErasing with its defaults (2 % to 33 % of the area, aspect ratio 0.3 to
    3.3, value 0: the mean, once normalised) for each image of a float batch with ``probability``,
    drawn for the whole batch at once. A box that does not fit, clipped at the borders (torchvision
    tries 10 times, then erases nothing)."""
    (b, _, h, w), device = images.shape, images.device
    uniform = torch.rand(b, 5, device=device, generator=generator)
    area = h * w * (0.02 + (1 / 3 - 0.02) * uniform[:, 0])
    aspect = torch.exp(math.log(0.3) + (math.log(1 / 0.3) - math.log(0.3)) * uniform[:, 1])
    box_h, box_w = (area * aspect).sqrt().clamp(max=h), (area / aspect).sqrt().clamp(max=w)
    top, left = uniform[:, 2] * (h - box_h), uniform[:, 3] * (w - box_w)
    rows = torch.arange(h, device=device).view(1, h, 1)
    cols = torch.arange(w, device=device).view(1, 1, w)
    inside = ((rows >= top.view(b, 1, 1)) & (rows < (top + box_h).view(b, 1, 1))
              & (cols >= left.view(b, 1, 1)) & (cols < (left + box_w).view(b, 1, 1)))
    erased = inside & (uniform[:, 4] < probability).view(b, 1, 1)
    return images.masked_fill_(erased.unsqueeze(1), 0.0)


def resized_crop_boxes(count: int, height: int, width: int, generator: torch.Generator):
    """(top, left, crop height, crop width), each float (count,) on the generator's device: the
    boxes torchvision's RandomResizedCrop draws with its defaults (resized_crop_box says which), for
    ``count`` images of height x width. In float32, which every device has."""
    device = generator.device
    uniform = torch.rand(count, CROP_TRIES, 2, device=device, generator=generator)
    area = height * width * (CROP_SCALE[0] + (CROP_SCALE[1] - CROP_SCALE[0]) * uniform[..., 0])
    low, high = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    aspect = torch.exp(low + (high - low) * uniform[..., 1])
    h, w = (area / aspect).sqrt().round(), (area * aspect).sqrt().round()
    fits = (h > 0) & (h <= height) & (w > 0) & (w <= width)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first try that fits (0 if none)
    h, w, found = h.gather(1, first)[:, 0], w.gather(1, first)[:, 0], fits.any(dim=1)
    place = torch.rand(count, 2, device=device, generator=generator)
    # 0 to height - h, each as likely (min: a draw just under 1 may round up to the next integer)
    top = torch.minimum((place[:, 0] * (height - h + 1)).floor(), height - h)
    left = torch.minimum((place[:, 1] * (width - w + 1)).floor(), width - w)
    centre = centre_crop_box(height, width)  # the box of the images none of whose tries fits
    return tuple(torch.where(found, drawn, float(fallback))
                 for drawn, fallback in zip((top, left, h, w), centre))


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
        images, lam = (self._paste(images, order, lam, rng) if use_cutmix
                       else (images.lerp(images[order], 1 - lam), lam))
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
