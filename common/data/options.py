"""DataOptions: the values the input path is given, the data flags' and a few training flags'.

common.cli.data_options(args) makes one from the parsed flags. Nothing in common/ reads the
argparse namespace itself, so what the input path depends on is this one record.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """The data flags (common.cli.add_data_args), then the training flags the loaders read."""

    dataset: str  # cifar10, cifar100, synthetic or a Hub id (owner/name)
    data_dir: str | None  # a local copy, read instead of the Hub
    cache_dir: str | None  # decoded tensors and Arrow files; None: default_cache_dir()
    val_fraction: float | None  # evaluate on this share of train, carved with ``seed``
    image_size: int | None  # N of N x N; None: the images' own size, else 224
    loader: str  # device, workers or auto
    workers: int | None  # DataLoader workers per process; None: default_workers()
    loader_budget: float | None  # GB the decoded images may take; None: shares of free memory
    bad_images: str  # stop or skip
    synthetic_train_size: int
    synthetic_test_size: int
    # Training only: scripts/evaluate.py, which builds no training loader, keeps these defaults.
    seed: int = 0  # shuffling, augmentation and the --val-fraction draw
    batch_size: int | None = None  # global: images per optimizer step over all processes
    grad_accum: int = 1  # micro-batches per optimizer step
    augment: bool = False  # random crops and flips of the training batches
    channels_last: bool = False  # NHWC batches, for a channels_last model
