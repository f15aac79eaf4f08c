"""The input pipelines at ImageNet sizes, for scripts/benchmark.py's loader check: the training
scripts' workers path (common.data.workers) against torchvision's ImageFolder with PIL
transforms, on an image folder of JPEGs this module writes, with the same DataLoader workers and
batch size.

    ours          worker_loader over the folder's FileSplit (decode_image, a random-resized crop
                  and flip per sample with transforms.v2.functional, uint8 channels_last
                  batches), then on the device the
                  uint8 -> float normalisation of BatchTransform(augment=False)
    torchvision   ImageFolder, PIL RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize,
                  float batches copied to the device

Also the image folders the benchmark's --loader workers rows train on.
"""

import statistics
import time
from pathlib import Path

import PIL.Image
import torch
import torchvision
from torch.utils.data import DataLoader

from bench import tools
from common.data.sources import open_source
from common.data.splits import ImageData
from common.data.transform import BatchTransform
from common.data.workers import worker_loader

# ImageNet's training images: mostly 300-500 px a side (500 x 375 the most common), JPEG at quality
# about 90, ~110 KB each. Ours: each side drawn from SIDES, so mixed aspect ratios, at JPEG_QUALITY.
SIDES = (300, 500)
JPEG_QUALITY = 90
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # torchvision's ImageNet recipes
SIZE = 224


# ----------------------------------------------------------------------------- image folders

def write_jpeg_folder(root: Path, train_files: int, test_files: int = 8, classes: int = 4, seed: int = 0) -> dict:
    """An ImageNet-layout folder (train/<class>/*.jpg, test/<class>/*.jpg) of JPEGs of mixed sizes:
    crops of a few large canvases (_canvas), so each file costs only its encoding (a few ms).
    Returns what was written: the files, their mean size in KB, the range of sides."""
    gen = torch.Generator().manual_seed(seed)
    canvases = [_canvas(SIDES[1] + 100, gen) for _ in range(4)]
    sizes = []
    for split, count in (("train", train_files), ("test", test_files)):
        for i in range(count):
            h, w = torch.randint(SIDES[0], SIDES[1] + 1, (2,), generator=gen).tolist()
            canvas = canvases[i % len(canvases)]
            top, left = (torch.randint(canvas.shape[d] - s + 1, (1,), generator=gen).item()
                         for d, s in ((1, h), (2, w)))
            path = root / split / f"class{i % classes}" / f"{split}{i:05d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            _image(canvas[:, top:top + h, left:left + w]).save(path, quality=JPEG_QUALITY)
            sizes.append(path.stat().st_size)
    return {"folder": str(root), "train_files": train_files, "test_files": test_files,
            "mean_kb": round(sum(sizes) / len(sizes) / 1e3, 1), "sides": list(SIDES), "quality": JPEG_QUALITY}


def _canvas(side: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 (3, side, side): broad colour gradients, texture at a pixel or two and grain, which at
    quality 90 take about 4.7 bits a pixel, as ImageNet's JPEGs do (138 GB for 1.28 M images of
    about 470 x 390 px on average)."""
    broad = torch.nn.functional.interpolate(torch.rand(1, 3, 6, 6, generator=gen) * 255, size=(side, side),
                                            mode="bicubic", align_corners=False)
    texture = torch.nn.functional.interpolate(torch.randn(1, 3, side // 2, side // 2, generator=gen),
                                              size=(side, side), mode="bilinear", align_corners=False)
    grain = torch.randn(1, 3, side, side, generator=gen)
    return (broad + 48 * texture + 10 * grain).clamp(0, 255).round().to(torch.uint8)[0]


def write_png_folder(root: Path, data: ImageData) -> None:
    """``data`` as an image folder of PNGs (CIFAR's format: train/<class>/*.png, test/<class>/*.png)."""
    for split, images, labels in (("train", data.train_images, data.train_labels),
                                  ("test", data.test_images, data.test_labels)):
        for i, (image, label) in enumerate(zip(images, labels.tolist())):
            path = root / split / data.classes[label] / f"{split}{i:06d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            _image(image).save(path)


def _image(pixels: torch.Tensor) -> PIL.Image.Image:
    """uint8 (3, H, W) as a PIL image, to be saved: torchvision.io's encoders are deprecated (0.29)."""
    return PIL.Image.fromarray(pixels.permute(1, 2, 0).numpy())


# ------------------------------------------------------------------------------- the pipelines

class WorkersPipeline:
    """The training scripts' --loader workers at 224 px: common.data.workers.worker_loader over
    the folder's training FileSplit (as common.data.inputs builds it), normalised on the device by
    BatchTransform(augment=False) with the scripts' default channels_last."""

    def __init__(self, root: Path, batch_size: int, workers: int, device: torch.device):
        split = open_source(data_dir=str(root)).train  # a common.data.splits.FileSplit of JPEGs
        self.loader = worker_loader(split, SIZE, batch_size, train=True, workers=workers,
                                    pin_memory=device.type == "cuda")
        self.transform = BatchTransform([255 * m for m in IMAGENET_MEAN], [255 * s for s in IMAGENET_STD],
                                        augment=False, channels_last=True)
        self.device, self.epochs = device, 0

    def epoch(self) -> float:
        """img/s over one epoch of normalised batches on the device."""
        self.loader.sampler.set_epoch(self.epochs)  # as Accelerate's loader does each epoch
        start, seen = time.perf_counter(), 0
        for step, (images, _) in enumerate(self.loader):
            images = self.transform.train(images.to(self.device, non_blocking=True), seed=(self.epochs, step))
            seen += len(images)
        tools.synchronize(self.device)
        self.epochs += 1
        return seen / (time.perf_counter() - start)


class ImageFolderPipeline:
    """The usual ImageNet input pipeline (torchvision's references): ImageFolder, PIL transforms per
    image in DataLoader workers, float batches copied to the device."""

    def __init__(self, root: Path, batch_size: int, workers: int, device: torch.device):
        T = torchvision.transforms
        transform = T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.ToTensor(),
                               T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        dataset = torchvision.datasets.ImageFolder(str(root / "train"), transform=transform)
        # As worker_loader: shuffled, the last partial batch dropped, workers kept between epochs.
        self.loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True,
                                 persistent_workers=workers > 0, pin_memory=device.type == "cuda")
        self.device = device

    epoch = tools.TorchvisionPipeline.epoch  # one epoch of batches moved to the device, in img/s


def compare_loaders(root: Path, batch_size: int, workers: int, device: torch.device,
                    rounds: int = 5) -> dict[str, list[float]]:
    """img/s of each pipeline over ``rounds`` rounds of one epoch each, back to back, the order
    swapped every round (ours first, then theirs first) so that a machine speeding up or slowing
    down favours neither; after one warm-up epoch each, in which the workers start and the page
    cache fills."""
    pipelines = {"ours": WorkersPipeline(root, batch_size, workers, device),
                 "torchvision": ImageFolderPipeline(root, batch_size, workers, device)}
    rates = {name: [] for name in pipelines}
    for pipeline in pipelines.values():
        pipeline.epoch()
    for k in range(rounds):
        for name in list(pipelines)[::-1 if k % 2 else 1]:
            rates[name].append(pipelines[name].epoch())
    del pipelines  # their persistent workers end with them
    return rates


def ratio(rates: dict[str, list[float]]) -> float:
    """ours / torchvision: the median of the round-by-round ratios, each of two epochs run back to back."""
    return statistics.median(o / t for o, t in zip(rates["ours"], rates["torchvision"]))
