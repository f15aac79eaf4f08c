"""Training batches from the decoded dataset: the loader and batched augmentation, on the device.

The whole dataset is one uint8 tensor per split, so the loader fetches a batch with one indexing
operation, and a batch arrives as uint8 (B, 3, H, W) and is turned into a normalised float batch in
a few tensor operations on the device that trains. Per-image PIL transforms on CPU workers were the
bottleneck in the source articles (docs/benchmark: about 5,600 img/s with torchvision's CIFAR10
pipeline and 2 workers against 31,000 img/s this way on 2 CPU cores).
"""

import dataclasses
import math

import torch
from torch.utils.data import DataLoader, Dataset

from common.errors import UserError

# Images at most this size train with CIFAR's augmentation (pad by 4, random crop, flip); larger
# ones with ImageNet's (random-resized crop, flip). The same on both input paths.
PAD_CROP_MAX_SIZE = 64
CROP_SCALE, CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop defaults
CROP_TRIES = 10  # as RandomResizedCrop


def crop_mode(size: int) -> str:
    """'pad' (CIFAR: pad by 4, random crop, flip) for small images, else 'resized' (ImageNet:
    random-resized crop, flip)."""
    return "pad" if size <= PAD_CROP_MAX_SIZE else "resized"


class BatchTransform:
    """Random crop and horizontal flip of a whole batch, then per-channel normalisation.

    The crop is crop_mode's for the batch's image size: up to 64 px zero padding by 4 and a random
    crop (CIFAR), above a random-resized crop as torchvision's RandomResizedCrop draws it, of the
    image as held (already resized to the training size), scaled back up to that size.

    ``mean`` and ``std`` are per-channel statistics of the training images in the 0..255 scale
    (see ``channel_stats``), so any dataset gets its own normalisation.
    """

    def __init__(self, mean, std, augment: bool = True, padding: int = 4, channels_last: bool = False):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.augment = augment
        self.padding = padding
        # NHWC batches for a model converted to channels_last, so no layer has to reorder its input.
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def train(self, images: torch.Tensor, seed: tuple[int, ...]) -> torch.Tensor:
        """Augment and normalise a uint8 batch; the same seed gives the same batch.

        The random numbers come from a generator seeded per batch (``seed`` is a tuple of ints,
        e.g. (run seed, step)), not from the global RNG, so a resumed run draws exactly what the
        uninterrupted run drew for that batch.
        """
        if not self.augment:
            return self.normalize(images)
        generator = torch.Generator(images.device).manual_seed(sample_seed(*seed))
        if crop_mode(max(images.shape[-2:])) == "resized":
            return self.normalize(self.resized_crop_and_flip(images, generator))
        return self.normalize(self.crop_and_flip(images, generator))

    def eval(self, images: torch.Tensor) -> torch.Tensor:
        return self.normalize(images)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        if self.mean.device != images.device:  # once: a copy per batch would make the host wait for the GPU
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        # One float tensor in the wanted layout, filled by a copy and two in-place passes, with the
        # values of (images.float() - mean) / std: that allocated three or four (one more to change
        # the layout), and on a CPU each fresh allocation of a batch costs its page faults again.
        out = torch.empty(images.shape, dtype=torch.float32, device=images.device, memory_format=self.memory_format)
        return out.copy_(images).sub_(self.mean).div_(self.std)

    def crop_and_flip(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = images.shape
        p, device = self.padding, images.device
        padded = torch.nn.functional.pad(images, (p, p, p, p))  # zeros, as torchvision's RandomCrop
        top = torch.randint(0, 2 * p + 1, (b, 1), device=device, generator=generator)
        left = torch.randint(0, 2 * p + 1, (b, 1), device=device, generator=generator)
        rows = top + torch.arange(h, device=device)  # (B, H): source row of each output row
        cols = torch.arange(w, device=device).expand(b, w)
        flipped = torch.rand(b, 1, device=device, generator=generator) < 0.5
        cols = torch.where(flipped, w - 1 - cols, cols)
        cols = left + cols
        # One gather does crop and flip for the whole batch: index (B, C, H, W) with broadcasting.
        batch = torch.arange(b, device=device).view(b, 1, 1, 1)
        channel = torch.arange(c, device=device).view(1, c, 1, 1)
        return padded[batch, channel, rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]

    def resized_crop_and_flip(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A random-resized crop of each image, flipped half the time, back at the images' size:
        float (B, C, H, W). One grid_sample for the batch, bilinear as torchvision's resize (a crop
        is never larger than the image, so it is only ever enlarged and needs no antialiasing), with
        the values of torchvision's resized_crop of the same box in float."""
        b, _, h, w = images.shape
        top, left, height, width = resized_crop_boxes(b, h, w, generator)
        flipped = torch.rand(b, device=images.device, generator=generator) < 0.5
        # Output pixel centre j of W maps to source pixel centre left + (j + 0.5) * width / W - 0.5,
        # as torch's bilinear resize with align_corners=False (and the same for rows); in
        # grid_sample's [-1, 1] coordinates, x = (2 * position + 1) / W - 1. Built element-wise, not
        # by affine_grid, whose matmul would run in TF32 on GPUs (the scripts' --tf32) and move the
        # positions by up to a few hundredths of a pixel.
        def positions(start, length, side, mirrored=None):
            j = torch.arange(side, device=images.device, dtype=torch.float32) + 0.5
            j = torch.where(mirrored.view(-1, 1), side - j, j) if mirrored is not None else j.expand(b, side)
            source = start.view(-1, 1) + j * (length / side).view(-1, 1) - 0.5
            # Near its edges the resize reads the crop's edge pixels, not those beyond it.
            source = source.clamp(start.view(-1, 1), (start + length - 1).view(-1, 1))
            return (2 * source + 1) / side - 1
        x, y = positions(left, width, w, flipped), positions(top, height, h)
        grid = torch.stack([x.view(b, 1, w).expand(b, h, w), y.view(b, h, 1).expand(b, h, w)], dim=-1)
        return torch.nn.functional.grid_sample(images.float(), grid, mode="bilinear", padding_mode="border",
                                               align_corners=False)


def resized_crop_boxes(count: int, height: int, width: int, generator: torch.Generator):
    """(top, left, crop height, crop width), each float (count,) on the generator's device: the boxes
    torchvision's RandomResizedCrop draws with its defaults, for ``count`` images of height x width:
    8 % to 100 % of the area, aspect ratio 3/4 to 4/3 (log-uniform), the first of 10 tries that
    fits, else the largest centre crop within those ratios. In float32, which every device has."""
    device = generator.device
    uniform = torch.rand(count, CROP_TRIES, 2, device=device, generator=generator)
    area = height * width * (CROP_SCALE[0] + (CROP_SCALE[1] - CROP_SCALE[0]) * uniform[..., 0])
    low, high = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    aspect = torch.exp(low + (high - low) * uniform[..., 1])
    h, w = (area / aspect).sqrt().round(), (area * aspect).sqrt().round()
    fits = (h > 0) & (h <= height) & (w > 0) & (w <= width)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first try that fits (0 when none)
    h, w, found = h.gather(1, first)[:, 0], w.gather(1, first)[:, 0], fits.any(dim=1)
    centre_top, centre_left, centre_h, centre_w = centre_crop_box(height, width)  # where none fits
    h, w = torch.where(found, h, float(centre_h)), torch.where(found, w, float(centre_w))
    place = torch.rand(count, 2, device=device, generator=generator)
    # 0 to height - h, each as likely (min: a draw just under 1 may round up to the next integer)
    top = torch.where(found, torch.minimum((place[:, 0] * (height - h + 1)).floor(), height - h), float(centre_top))
    left = torch.where(found, torch.minimum((place[:, 1] * (width - w + 1)).floor(), width - w), float(centre_left))
    return top, left, h, w


def centre_crop_box(height: int, width: int) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box when none of its tries fits: the whole image, cut to the nearest
    aspect ratio within CROP_RATIO, in the centre."""
    h, w = height, width
    if width / height < CROP_RATIO[0]:
        h = round(width / CROP_RATIO[0])
    elif width / height > CROP_RATIO[1]:
        w = round(height * CROP_RATIO[1])
    return (height - h) // 2, (width - w) // 2, h, w


def sample_seed(*key: int) -> int:
    """A 63-bit seed from a tuple of ints, e.g. (run seed, step) or (run seed, epoch, index)."""
    # hash() of a tuple of ints is the same in every process and run (no hash randomisation).
    return hash(key) & 0x7FFF_FFFF_FFFF_FFFF


def channel_stats(images, chunk_bytes: int = 2**27):
    """Per-channel mean and standard deviation of uint8 images, in the 0..255 scale.

    ``images``: one (N, C, H, W) tensor, summed 128 MB of float64 at a time whatever the image size,
    or an iterable of (C, H, W) images or (N, C, H, W) batches, summed as they come, so that none
    has to be held beside the others. Raises ValueError when there is no image.
    """
    parts = images
    if isinstance(images, torch.Tensor):
        if images.ndim != 4:
            raise ValueError(f"channel_stats: a tensor of images is (N, C, H, W), not {tuple(images.shape)}")
        chunk = max(1, chunk_bytes // (8 * images[0].numel())) if len(images) else 1
        parts = images.split(chunk)
    total = total_sq = 0
    count = 0
    for part in parts:
        part = part.to(torch.float64)
        dims = (0, 2, 3) if part.ndim == 4 else (1, 2)
        total = total + part.sum(dim=dims)
        total_sq = total_sq + part.square().sum(dim=dims)
        count += part.numel() / part.shape[-3]
    if not count:
        raise ValueError("channel_stats: no images")
    mean = total / count
    std = (total_sq / count - mean.square()).clamp_min(1e-6).sqrt()
    return mean.float().tolist(), std.float().tolist()


# The decoded dataset may take at most this share of the GPU memory free when training starts; the
# rest is for the model, its activations, gradients and optimizer state, and the allocator's cache.
DEVICE_DATA_SHARE = 0.5


def on_device(data, device: torch.device):
    """``data`` (common.data.ImageData) with its tensors on ``device``, where the loader indexes
    them; the host copy is no longer referenced and is freed (a cache loaded with mmap=True only
    ever mapped it).

    A dataset that would take more than DEVICE_DATA_SHARE of the free memory of the GPU is refused
    with its size, instead of a CUDA out-of-memory error now or at the first step.
    """
    tensors = ("train_images", "train_labels", "test_images", "test_labels")
    if device.type == "cuda":
        size = sum(getattr(data, name).nbytes for name in tensors)
        free, _ = torch.cuda.mem_get_info(device)
        if size > DEVICE_DATA_SHARE * free:
            raise UserError(
                f"the decoded dataset takes {size / 1e9:.1f} GB, and this template keeps it on every GPU: more "
                f"than {DEVICE_DATA_SHARE:.0%} of the {free / 1e9:.1f} GB free on {device}; train on fewer or smaller "
                f"images, or on GPUs with more free memory")
    return dataclasses.replace(data, **{name: getattr(data, name).to(device) for name in tensors})


class TensorImages(Dataset):
    """Images and labels held as two tensors, on the CPU or already on the training device.

    ``__getitems__`` lets the DataLoader fetch a whole batch with one index instead of stacking
    one sample at a time (torch.utils.data's batched fetch), which is what makes a tensor-held
    dataset fast.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices):
        index = torch.as_tensor(indices)
        if self.labels.is_cuda:
            # From pinned memory the copy is queued behind the GPU's work; from pageable memory
            # the host would wait for all of it (the previous step's backward) every batch.
            index = index.pin_memory().to(self.labels.device, non_blocking=True)
        return self.images[index], self.labels[index]


def _batch_as_is(batch):
    return batch  # __getitems__ already returns the stacked batch


def tensor_loader(images, labels, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    """A DataLoader over tensors; training loaders drop the last partial batch.

    The loader gets its own generator: one without it draws its seed from the global RNG, which
    would make a resumed run shuffle differently from an uninterrupted one.
    """
    return DataLoader(TensorImages(images, labels), batch_size=batch_size, shuffle=shuffle,
                      drop_last=shuffle, collate_fn=_batch_as_is,
                      generator=torch.Generator().manual_seed(seed))
