"""The training scripts' input path, device or workers (--loader), chosen and built in one call.

    data = load_inputs(args, accelerator)
    data.train_loader, data.test_loader   # batches of uint8 (B, 3, N, N) images and int64 labels
    data.transform.train(images, seed)    # to normalised float on the device (+ augmentation: device path)

--loader device (common.batches): every image decoded once into one uint8 tensor that lives on the
training device; a batch is one indexing operation and its augmentation a few tensor operations.
The fastest path, for datasets that fit: CIFAR-10 is 180 MB.

--loader workers (common.images): DataLoader workers read, decode and augment each sample of this
process's slice of the batch; nothing decoded is held, so any number of images of any size trains.

--loader auto (the default) takes device when the decoded dataset fits the budget: DEVICE_DATA_SHARE
of the GPU's free memory and HOST_DATA_SHARE of the host's available memory, or --loader-budget.
"""

import dataclasses
import os

import psutil
import torch
from accelerate.utils import broadcast_object_list

from common.batches import DEVICE_DATA_SHARE, BatchTransform, channel_stats, crop_mode, on_device, tensor_loader
from common.data import (
    DEFAULT_IMAGE_SIZE,
    TensorSplit,
    cached_hub_data,
    carve_decoded,
    load_image_data,
    native_size,
    open_source,
)
from common.errors import UserError
from common.images import BadImage, decode, default_workers, fit, report_bad_images, worker_loader

# Decoding keeps the whole dataset in the host memory of the process that decodes it (and in the
# page cache after): at most this share of the memory available when the run starts.
HOST_DATA_SHARE = 0.5
STATS_SAMPLE = 1000  # images the normalisation of the workers path is estimated from


@dataclasses.dataclass
class Inputs:
    train_loader: object
    test_loader: object
    transform: BatchTransform  # to float, normalised, channels_last; augments on the device path only
    classes: list[str]
    source: str
    train_size: int
    test_size: int
    image_size: int
    loader: str  # "device" or "workers"
    why: str  # why that loader, for the start line
    workers: int
    eval_split: dict | None = None  # --val-fraction and --seed, which evaluation needs to find the same split

    @property
    def config(self) -> dict:
        """What config.json records about the data (and model.safetensors, of it, for evaluation)."""
        return {"data": self.source, "classes": self.classes, "train_size": self.train_size,
                "test_size": self.test_size, "image_size": [self.image_size, self.image_size],
                "loader": self.loader, "loader_reason": self.why, "loader_workers": self.workers,
                "train_crop": crop_mode(self.image_size),
                "normalization": {"mean": self.transform.mean.flatten().tolist(),
                                  "std": self.transform.std.flatten().tolist()},
                **({"eval_split": self.eval_split} if self.eval_split else {})}

    @property
    def line(self) -> str:
        """For the start line: the loader, why, and the resolution."""
        workers = f", {self.workers} worker{'s' * (self.workers != 1)} per process" if self.loader == "workers" else ""
        return f"{self.image_size}px, loader {self.loader}{workers} ({self.why})"


def load_inputs(args, accelerator) -> Inputs:
    """The loaders of the data flags (common.cli.add_data_args) for ``accelerator``'s device and
    processes; one line and exit status 1 when the data or the flags cannot work. Each batch is a
    micro-batch: --batch-size / --grad-accum images over all processes."""
    micro_batch = args.batch_size // args.grad_accum
    data = _cached(args, args.image_size)
    if data is not None:
        _check_batch_size(args.batch_size, len(data.train_labels))
        inputs = _from_cache(args, accelerator, data, micro_batch, args.seed, args.val_fraction, args.augment)
        if inputs is not None:
            return inputs
    source = open_source(args.dataset, args.data_dir, args.cache_dir, args.synthetic_train_size,
                         args.synthetic_test_size, seed=args.seed, val_fraction=args.val_fraction)
    _check_batch_size(args.batch_size, len(source.train))
    return _build(args, accelerator, source, args.image_size, micro_batch, args.seed, args.val_fraction,
                  augment=args.augment)


def load_test_inputs(args, accelerator, image_size: int | None, batch_size: int, eval_split: dict | None,
                     normalization: dict | None) -> Inputs:
    """The evaluation loader alone (train_loader None), for weights trained at ``image_size`` with
    ``normalization`` (None: the statistics of the training images) on the split ``eval_split``
    names (a training run's --val-fraction and --seed) or the data's own test split."""
    eval_split = eval_split or {}
    val_fraction, seed = args.val_fraction or eval_split.get("val_fraction"), eval_split.get("seed", 0)
    data = _cached(args, image_size)
    if data is not None:
        inputs = _from_cache(args, accelerator, data, batch_size, seed, val_fraction, normalization=normalization)
        if inputs is not None:
            return inputs
    source = open_source(args.dataset, args.data_dir, args.cache_dir, args.synthetic_train_size,
                         args.synthetic_test_size, seed=seed, val_fraction=val_fraction)
    return _build(args, accelerator, source, image_size, batch_size, seed, val_fraction, normalization=normalization)


def _check_batch_size(batch_size: int, train_size: int) -> None:
    if train_size < batch_size:
        raise UserError(f"--batch-size {batch_size} is larger than the {train_size} training images: use a "
                        f"smaller --batch-size")


def _cached(args, image_size: int | None):
    """A Hub dataset an earlier run decoded at its own size (CIFAR from the Hub, run after run): the
    device path starts from it without asking the Hub or `datasets` anything."""
    if args.loader == "workers" or args.data_dir is not None or args.dataset == "synthetic":
        return None
    data = cached_hub_data(args.dataset, args.cache_dir, args.bad_images == "skip")
    if data is None or image_size not in (None, data.train_images.shape[-1]):
        return None
    return data


def _from_cache(args, accelerator, data, batch_size, seed, val_fraction, augment=None, normalization=None):
    size, device = data.train_images.shape[-1], accelerator.device
    loader, why = choose_loader(accelerator, args.loader, len(data.train_labels) + len(data.test_labels), size,
                                args.loader_budget)
    if loader != "device" or not (val_fraction or len(data.test_labels)):  # no test split: open_source says so
        return None
    return _on_device(args, device, carve_decoded(data, val_fraction, seed), batch_size, seed, val_fraction, augment,
                      normalization, why)


def _build(args, accelerator, source, image_size, batch_size, seed, val_fraction, augment=None,
           normalization=None) -> Inputs:
    """Loaders of ``source``; only the test loader when ``augment`` is None (evaluation)."""
    native = native_size(source)
    size = image_size or native or DEFAULT_IMAGE_SIZE
    device = accelerator.device
    loader, why = choose_loader(accelerator, args.loader, len(source.train) + len(source.test), size,
                                args.loader_budget)
    skip_bad = args.bad_images == "skip"
    if loader == "device":
        # The first process to get there decodes (and downloads); the others wait, then read its cache.
        data = load_image_data(args.dataset, args.data_dir, args.cache_dir, args.synthetic_train_size,
                               args.synthetic_test_size, seed=seed, image_size=None if size == native else size,
                               val_fraction=val_fraction, skip_bad=skip_bad)
        return _on_device(args, device, data, batch_size, seed, val_fraction, augment, normalization, why)
    workers = default_workers(local_processes(accelerator)) if args.workers is None else args.workers
    report_bad_images()  # an unreadable image found by a worker: one line, not a worker's traceback
    # Augmentation happens in the workers, per sample; on the device only the normalisation.
    stats = (normalization["mean"], normalization["std"]) if normalization else sample_stats(source.train, size)
    transform = BatchTransform(*stats, augment=False, channels_last=getattr(args, "channels_last", False))
    common = dict(size=size, batch_size=batch_size, workers=workers, seed=seed,
                  process=accelerator.process_index, pin_memory=device.type == "cuda", skip_bad=skip_bad)
    train_loader = worker_loader(source.train, train=True, augment=augment, **common) if augment is not None else None
    return Inputs(train_loader, worker_loader(source.test, train=False, **common), transform, source.classes,
                  source.source, len(source.train), len(source.test), size, loader, why, workers,
                  _eval_split(val_fraction, seed))


def _on_device(args, device, data, batch_size, seed, val_fraction, augment, normalization, why) -> Inputs:
    """The device path's loaders of decoded ``data``; no training loader when ``augment`` is None."""
    stats = (normalization["mean"], normalization["std"]) if normalization else channel_stats(data.train_images)
    transform = BatchTransform(*stats, augment=bool(augment), channels_last=getattr(args, "channels_last", False))
    data = on_device(data, device)  # the whole dataset lives on the device: no copy per batch
    train_loader = tensor_loader(data.train_images, data.train_labels, batch_size, shuffle=True,
                                 seed=seed) if augment is not None else None
    return Inputs(train_loader, tensor_loader(data.test_images, data.test_labels, batch_size, shuffle=False),
                  transform, data.classes, data.source, len(data.train_labels), len(data.test_labels),
                  data.train_images.shape[-1], "device", why, 0, _eval_split(val_fraction, seed))


def _eval_split(val_fraction, seed) -> dict | None:
    return {"val_fraction": val_fraction, "seed": seed} if val_fraction else None


def local_processes(accelerator) -> int:
    """The processes of this job on this node, which share its CPU cores."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))


def choose_loader(accelerator, wanted: str, images: int, size: int, budget_gb: float | None) -> tuple[str, str]:
    """(loader, why): ``wanted`` (device, workers or auto) checked against the main process's
    budget, so that every process takes the same path even when their free memory differs."""
    if accelerator.num_processes == 1:
        return _choose(wanted, images, size, accelerator.device, budget_gb)
    try:
        choice = _choose(wanted, images, size, accelerator.device, budget_gb) if accelerator.is_main_process else None
    except UserError as error:
        choice = error.message
    choice = broadcast_object_list([choice])[0]
    if isinstance(choice, str):  # the main process's refusal, said by every process
        raise UserError(choice)
    return tuple(choice)


def _choose(wanted: str, images: int, size: int, device: torch.device, budget_gb: float | None):
    need = images * 3 * size * size
    budget, of_what = data_budget(device, budget_gb)
    summary = f"{images} images at {size}px decoded take {_gb(need)}, budget {_gb(budget)} ({of_what})"
    if wanted == "workers":
        return "workers", "--loader workers"
    if need <= budget:
        return "device", summary if wanted == "auto" else "--loader device"
    if wanted == "device":
        raise UserError(f"--loader device: the {images} images at {size}px decoded take {_gb(need)}, over "
                        f"the budget of {_gb(budget)} ({of_what}); use --loader workers (or auto)")
    return "workers", summary


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def data_budget(device: torch.device, budget_gb: float | None) -> tuple[float, str]:
    """The most the decoded dataset may take, and a description of where the number comes from."""
    if budget_gb is not None:
        return budget_gb * 1e9, "--loader-budget"
    host = HOST_DATA_SHARE * psutil.virtual_memory().available
    described = f"{HOST_DATA_SHARE:.0%} of the host's available memory"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if DEVICE_DATA_SHARE * free < host:
            return DEVICE_DATA_SHARE * free, f"{DEVICE_DATA_SHARE:.0%} of the free memory of {device}"
    return host, described


def sample_stats(split, size: int, sample: int = STATS_SAMPLE) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (0..255 scale) of the training images as evaluated at ``size``:
    from all of them when they are held decoded, else from ``sample`` spread over the split; one
    image in memory at a time."""
    if isinstance(split, TensorSplit) or len(split) <= sample:
        picks = range(len(split))
    else:
        picks = torch.linspace(0, len(split) - 1, sample).round().long().tolist()

    def fitted():
        for i in picks:
            try:
                yield fit(decode(split.encoded(i), split.name(i)), size)
            except BadImage:
                continue  # the loader reports it, or skips it (--bad-images)
    try:
        if isinstance(split, TensorSplit) and split.images.shape[-2:] == (size, size):
            return channel_stats(split.images)  # as the device path computes them
        return channel_stats(fitted())
    except ValueError:
        raise UserError(f"no training image of {split.name(0)}'s split can be decoded; check the data") from None
