"""The workers loader (--loader workers): DataLoader workers decode and augment each sample.

Nothing decoded is held: each worker reads a sample (a file, a row of a memory-mapped Arrow
table, or a row of a tensor), decodes it (common.data.images) and crops it to the training
resolution with torchvision's transforms.v2, resizing with the run's interpolation. A batch leaves
the workers as uint8 (B, 3, N, N) in channels_last memory: a quarter of the bytes of float,
normalised on the device by BatchTransform (common.data.transform) as on the device path.

Augmentation is drawn per sample from (seed, epoch, index), not from the worker's random state, so
it does not depend on the number of workers, of processes or on where a resumed run restarts.
"""

import atexit
import functools
import multiprocessing
import os
import random
import signal
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate
from torchvision.transforms import v2

from common.data.images import INTERPOLATIONS, BadImage, decode, fit
from common.data.transform import PADDING, crop_mode, resized_crop_box, sample_seed

# --auto-augment: torchvision's policies, one operation (or two) drawn per image
POLICIES = {"randaugment": v2.RandAugment, "trivialaugment": v2.TrivialAugmentWide}


def augment(image: torch.Tensor, size: int, rng: random.Random, policy=None,
            crop: bool = True, interpolation: str = "bilinear") -> torch.Tensor:
    """A training view (3, size, size) of a uint8 image, every random number drawn from ``rng``: the
    crop of crop_mode(size) and a horizontal flip half the time (``crop``; else the evaluation
    view), resized with ``interpolation``, then ``policy`` (RandAugment ...), whose draws from
    torch's generator are seeded from ``rng`` and leave that generator as it was."""
    if not crop:
        image = fit(image, size, interpolation)
    elif crop_mode(size) == "pad":  # the device path's BatchTransform, one image at a time
        image = v2.functional.pad(fit(image, size, interpolation), [PADDING])  # zeros: RandomCrop's
        top, left = rng.randint(0, 2 * PADDING), rng.randint(0, 2 * PADDING)
        image = v2.functional.crop(image, top, left, size, size)
    else:
        box = resized_crop_box(*image.shape[-2:], rng)
        image = v2.functional.resized_crop(image, *box, [size, size],
                                           INTERPOLATIONS[interpolation], antialias=True)
    if crop and rng.random() < 0.5:
        image = v2.functional.horizontal_flip(image)
    if policy is None:
        return image
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.getrandbits(63))
        return policy(image)


class SampleImages(Dataset):
    """One split read and transformed a sample at a time, in DataLoader workers.

    ``split`` is a common.data split (``encoded(i)``, ``name(i)``, ``labels``). Training indexes it
    with (epoch, index) pairs from EpochSampler, and the transform's random numbers come from
    (seed, epoch, index); evaluation indexes it with plain indices and the deterministic ``fit``."""

    def __init__(self, split, size: int, train: bool, augment: bool = True, seed: int = 0,
                 skip_bad: bool = False, auto_augment: str = "none",
                 interpolation: str = "bilinear"):
        self.split, self.size, self.seed, self.skip_bad = split, size, seed, skip_bad
        self.interpolation, self.augment = interpolation, train and augment
        self.policy = POLICIES[auto_augment]() if train and auto_augment != "none" else None
        self.skipped = set()  # images this process (a worker, each its own) has warned of

    def __len__(self):
        return len(self.split)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image, read = self.read(index)  # read != index: a bad image skipped, the next in its place
        rng = random.Random(sample_seed(self.seed, epoch, index))
        image = augment(image, self.size, rng, self.policy, self.augment, self.interpolation)
        return image, int(self.split.labels[read])

    def read(self, index: int) -> tuple[torch.Tensor, int]:
        """The decoded image at ``index``; with skip_bad, an unreadable one is reported and the next
        readable image (and its label) takes its place, the same one in every run."""
        for attempt in range(len(self.split)):
            at = (index + attempt) % len(self.split)
            try:
                return decode(self.split.encoded(at), self.split.name(at)), at
            except BadImage as e:
                if not self.skip_bad:
                    raise
                if at not in self.skipped:  # once, not every epoch
                    self.skipped.add(at)
                    print(f"warning: {e}; skipped (--bad-images skip): the next readable image "
                          f"takes its place", file=sys.stderr, flush=True)
        raise BadImage(f"no image of {self.split.name(index)}'s split can be decoded")


class EpochSampler(Sampler):
    """A shuffle that is a function of (seed, epoch) only, yielding (epoch, index) pairs so that
    each sample's augmentation can be drawn from its epoch too. Accelerate's loader calls set_epoch
    and gives each process its slice of every batch of these indices."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch))
        order = torch.randperm(self.size, generator=generator)
        return zip([self.epoch] * self.size, order.tolist())


def default_workers(processes_per_node: int = 1) -> int:
    """Loader workers per process: the CPU cores this process may use, shared among the processes
    of the node, less one for the training loop itself; at least 1, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, min(16, cores // max(processes_per_node, 1) - 1))


def _init_worker(seed: int, process: int, exiting, worker: int) -> None:
    """Seeds each worker's numpy, random and torch generators from (seed, process, worker), for any
    transform added that draws from them (ours draw per sample), and keeps the worker alive through
    the job's stop signals. DataLoader seeds all three from base_seed + worker, base_seed drawn from
    the training process's torch generator, which set_seed(args.seed) makes alike on every process:
    worker k of each process would draw the same numbers (checked, torch 2.14). The signals: SLURM
    signals every process of a job, Ctrl-C and a closed terminal the whole process group; the
    training process decides (it saves and stops), and a worker dead of one would fail the step it
    finishes before it saves (common.parallel.step_guard.StepGuard). SIGTERM still ends a worker
    once its training process is exiting (``exiting``, its _exiting() flag): multiprocessing
    terminates the workers left then, and waits for them."""
    seed = sample_seed(seed, process, worker)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # each worker is one core; the cores are shared among them
    for stop_signal in (signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop_signal, signal.SIG_IGN)

    def on_sigterm(signum, frame):
        if exiting.value:  # from the exiting training process: end, quietly (exit 0: torch's
            os._exit(0)  # SIGCHLD handler there reports a worker killed by a signal as a failure)
        # else a stop signal to the whole job: the training process finishes its step and stops us
    signal.signal(signal.SIGTERM, on_sigterm)


@functools.cache
def _exiting():
    """A flag in shared memory that this process raises when it exits (atexit runs before
    multiprocessing terminates the workers still running)."""
    exiting = multiprocessing.RawValue("b", 0)
    atexit.register(setattr, exiting, "value", 1)
    return exiting


def worker_loader(split, size: int, batch_size: int, train: bool, workers: int, seed: int = 0,
                  process: int = 0, pin_memory: bool = False, **sample) -> DataLoader:
    """A DataLoader of uint8 (B, 3, size, size) batches in channels_last memory, decoded by
    ``workers`` processes, each sample as SampleImages makes it (``sample``: its augment,
    skip_bad, auto_augment and interpolation).

    Training loaders shuffle with EpochSampler and drop the last partial batch; evaluation loaders
    keep every image in order. Workers stay up between epochs (persistent_workers)."""
    return DataLoader(SampleImages(split, size, train, seed=seed, **sample), batch_size=batch_size,
                      sampler=EpochSampler(len(split), seed) if train else None,
                      drop_last=train, num_workers=workers, persistent_workers=workers > 0,
                      pin_memory=pin_memory, collate_fn=collate_channels_last,
                      worker_init_fn=functools.partial(_init_worker, seed, process, _exiting()),
                      prefetch_factor=4 if workers else None)


def collate_channels_last(samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (3, H, W) and labels to a uint8 batch (B, 3, H, W) in channels_last memory (NHWC), the
    scripts' default layout: the worker, not the training process, does the reordering (as it
    stacks the batch into shared memory, in default_collate)."""
    images, labels = default_collate([(image.permute(1, 2, 0), label) for image, label in samples])
    return images.permute(0, 3, 1, 2), labels


def report_bad_images(training: bool = True) -> None:
    """Make an unreadable image end the run in one line (exit status 1) wherever it was found: in
    this process, or in a DataLoader worker, which passes the BadImage on with its whole traceback
    as the message. Installed as sys.excepthook, around the hook already there. A training run has
    written its folder by then: the line says that --resume continues it."""
    previous = sys.excepthook
    if getattr(previous, "reports_bad_images", False):
        return

    def hook(kind, error, traceback):
        if not issubclass(kind, BadImage):
            return previous(kind, error, traceback)
        message = str(error).strip().splitlines()[-1].split("BadImage: ", 1)[-1]
        then = "; then the same command with --resume continues the run" if training else ""
        print(f"error: {message}; replace or remove the file, or pass --bad-images skip to train "
              f"without it{then}", file=sys.stderr)
    hook.reports_bad_images = True
    sys.excepthook = hook
