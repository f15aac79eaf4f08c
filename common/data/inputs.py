"""The training scripts' input path, device or workers (--loader), chosen and built in one call.

    weights, data = load_data(args, accelerator, checkpoint)  # --pretrained's file, the loaders
    data = load_inputs(data_options(args), accelerator)   # common.data.flags.data_options
    data.train_loader, data.test_loader   # batches of uint8 (B, 3, N, N) images and int64 labels
    data.transform.train(images, seed)    # to normalised float on the device (+ augmentation)

--loader device (common.data.device): every image decoded once into one uint8 tensor that lives
on the training device; a batch is one indexing operation and its augmentation a few tensor
operations (common.data.transform). The fastest path, for datasets that fit: CIFAR-10 is 180 MB.

--loader workers (common.data.workers): DataLoader workers read, decode and augment each sample of
this process's slice of the batch; nothing decoded is held, so images of any number and size train.

--loader auto (the default) takes device when the decoded dataset fits the budget
(common.data.choice). The other modules of common.data, one job each, are listed in its __init__.py.
"""

import dataclasses
import os

from common.data.cache import cached_hub_data, load_image_data
from common.data.choice import choose_loader
from common.data.decode import DEFAULT_IMAGE_SIZE, native_size
from common.data.device import on_device, tensor_loader
from common.data.flags import data_options
from common.data.options import DataOptions
from common.data.pretrained import find_weights
from common.data.sources import carve_decoded, open_source
from common.data.stats import channel_stats, sample_stats
from common.data.transform import BatchMix, BatchTransform, crop_mode
from common.data.workers import default_workers, report_bad_images, worker_loader
from common.errors import UserError
from common.failures import refused_together


@dataclasses.dataclass
class Inputs:
    """A run's loaders, and what the scripts print and record about its data."""

    train_loader: object
    test_loader: object
    transform: BatchTransform  # to float, normalised, channels_last; augments on the device path
    classes: list[str]
    source: str
    train_size: int
    test_size: int
    image_size: int
    loader: str  # "device" or "workers"
    why: str  # why that loader, for the start line
    workers: int
    interpolation: str  # of every resize (DataOptions.interpolation)
    eval_split: dict | None = None  # --val-fraction and --seed (_eval_split)
    mix: BatchMix = dataclasses.field(default_factory=lambda: BatchMix(2))  # --mixup, --cutmix

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def config(self) -> dict:
        """What config.json records of the data (model.safetensors part of it, for evaluation)."""
        return {"data": self.source, "classes": self.classes, "train_size": self.train_size,
                "test_size": self.test_size, "image_size": [self.image_size, self.image_size],
                "loader": self.loader, "loader_reason": self.why, "loader_workers": self.workers,
                "train_crop": crop_mode(self.image_size), "interpolation": self.interpolation,
                "normalization": {"mean": self.transform.mean.flatten().tolist(),
                                  "std": self.transform.std.flatten().tolist()},
                **({"eval_split": self.eval_split} if self.eval_split else {})}

    @property
    def line(self) -> str:
        """For the start line: the loader, why, and the resolution and its interpolation."""
        workers = (f", {self.workers} {'worker' if self.workers == 1 else 'workers'} per process"
                   if self.loader == "workers" else "")
        return (f"{self.image_size}px ({self.interpolation}), loader {self.loader}{workers} "
                f"({self.why})")


def load_data(args, accelerator, checkpoint) -> tuple:
    """A training run's data: the file of the pretrained weights it starts from (--pretrained,
    --pretrained-path; None without), which sets the input size and normalisation, and its
    Inputs (load_inputs). A collective: every process must call it."""
    # found now, one line if missing; resuming ``checkpoint``, only what the run recorded of them
    weights = refused_together(accelerator, find_weights, args.model, args.pretrained,
                               args.pretrained_path, checkpoint)
    return weights, load_inputs(data_options(args, weights), accelerator)


def load_inputs(options: DataOptions, accelerator) -> Inputs:
    """The loaders of ``options`` (common.data.flags.data_options) for ``accelerator``'s device and
    processes; one line and exit status 1 when the data or flags cannot work (once on N processes
    too). Each batch is a micro-batch: --batch-size / --grad-accum images over all processes."""
    inputs = loaders(options, accelerator, train=True)
    inputs.mix = BatchMix(inputs.num_classes, options.mixup, options.cutmix, options.seed,
                          accelerator.process_index)
    return inputs


def loaders(options: DataOptions, accelerator, train: bool) -> Inputs:
    """The loaders of ``options``, the training one only if ``train`` (scripts/evaluate.py: not):
    from the decode cache of an earlier run when there is one, else from the source. A collective:
    every process refuses together."""
    if (data := refused_together(accelerator, _cached, options, train)) is not None:
        if inputs := refused_together(accelerator, _from_cache, options, accelerator, data, train):
            return inputs
    source = refused_together(accelerator, _open, options, train)
    return refused_together(accelerator, _build, options, accelerator, source, train)


def _open(options: DataOptions, train: bool):
    source = open_source(options.dataset, options.data_dir, options.cache_dir,
                         options.synthetic_train_size, options.synthetic_test_size,
                         seed=options.seed, val_fraction=options.val_fraction)
    _check_batch_size(options.batch_size, len(source.train), train)
    return source


def _check_batch_size(batch_size: int, train_size: int, train: bool) -> None:
    if train and train_size < batch_size:  # a training loader's batches; evaluation keeps all
        raise UserError(f"--batch-size {batch_size} is larger than the {train_size} training "
                        f"images: use a smaller --batch-size")


def _cached(options: DataOptions, train: bool):
    """A Hub dataset an earlier run decoded at its own size (CIFAR from the Hub, run after run):
    the device path starts from it without asking the Hub or `datasets` anything."""
    hub = (options.loader != "workers" and options.data_dir is None
           and options.dataset != "synthetic")
    data = cached_hub_data(options.dataset, options.cache_dir, options.bad_images == "skip",
                           options.interpolation) if hub else None
    if data is None or options.image_size not in (None, data.train_images.shape[-1]):
        return None
    _check_batch_size(options.batch_size, len(data.train_labels), train)
    return data


def _from_cache(options: DataOptions, accelerator, data, train: bool) -> Inputs | None:
    images = len(data.train_labels) + len(data.test_labels)
    loader, why = choose_loader(accelerator, options.loader, images, data.train_images.shape[-1],
                                options.loader_budget)
    if loader != "device" or not (options.val_fraction or len(data.test_labels)):
        return None  # no test split: open_source says so
    return _on_device(options, accelerator.device,
                      carve_decoded(data, options.val_fraction, options.seed), why, train)


def _build(options: DataOptions, accelerator, source, train: bool) -> Inputs:
    """Loaders of ``source``; only the test loader unless ``train``."""
    native = native_size(source)
    size = options.image_size or native or DEFAULT_IMAGE_SIZE
    images = len(source.train) + len(source.test)
    loader, why = choose_loader(accelerator, options.loader, images, size, options.loader_budget)
    skip_bad = options.bad_images == "skip"
    if loader == "device":
        # The first process there decodes (and downloads); the others wait, then read its cache.
        data = load_image_data(options.dataset, options.data_dir, options.cache_dir,
                               options.synthetic_train_size, options.synthetic_test_size,
                               seed=options.seed, image_size=None if size == native else size,
                               val_fraction=options.val_fraction, skip_bad=skip_bad,
                               interpolation=options.interpolation)
        return _on_device(options, accelerator.device, data, why, train)
    on_node = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))  # share its cores
    workers = default_workers(on_node) if options.workers is None else options.workers
    report_bad_images(training=train)  # a worker's unreadable image: one line, not a traceback
    # The workers augment, per sample; the device only normalises (and --random-erase).
    stats = _normalization(options) or sample_stats(source.train, size,
                                                    interpolation=options.interpolation)
    transform = BatchTransform(*stats, augment=False, channels_last=options.channels_last,
                               erase=options.random_erase)
    common = dict(size=size, batch_size=options.batch_size // options.grad_accum,
                  workers=workers, seed=options.seed, process=accelerator.process_index,
                  pin_memory=accelerator.device.type == "cuda", skip_bad=skip_bad,
                  interpolation=options.interpolation)
    train_loader = worker_loader(source.train, train=True, augment=options.augment,
                                 auto_augment=options.auto_augment, **common) if train else None
    return Inputs(train_loader, worker_loader(source.test, train=False, **common), transform,
                  source.classes, source.source, len(source.train), len(source.test), size,
                  loader, why, workers, options.interpolation, _eval_split(options))


def _on_device(options: DataOptions, device, data, why: str, train: bool) -> Inputs:
    """The device path's loaders of decoded ``data``; the training one only if ``train``."""
    stats = _normalization(options) or channel_stats(data.train_images)
    transform = BatchTransform(*stats, augment=options.augment, channels_last=options.channels_last,
                               interpolation=options.interpolation, erase=options.random_erase)
    data = on_device(data, device)  # the whole dataset lives on the device: no copy per batch
    batch_size = options.batch_size // options.grad_accum
    train_loader = tensor_loader(data.train_images, data.train_labels, batch_size, shuffle=True,
                                 seed=options.seed) if train else None
    return Inputs(train_loader,
                  tensor_loader(data.test_images, data.test_labels, batch_size, shuffle=False),
                  transform, data.classes, data.source, len(data.train_labels),
                  len(data.test_labels), data.train_images.shape[-1], "device", why, 0,
                  options.interpolation, _eval_split(options))


def _normalization(options: DataOptions) -> tuple | None:
    """The mean and std pretrained weights were trained with; None: the training images' own."""
    return (given["mean"], given["std"]) if (given := options.normalization) else None


def _eval_split(options: DataOptions) -> dict | None:
    """--val-fraction and --seed, which evaluation needs to find the same split."""
    return ({"val_fraction": options.val_fraction, "seed": options.seed} if options.val_fraction
            else None)
