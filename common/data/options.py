"""DataOptions: the values the input path is given, the data flags' and a few training flags'.

common.data.flags.data_options(args) makes one from the parsed flags. Nothing in common/ but the
flag modules (common/cli.py, common/data/flags.py) reads the argparse namespace, so what the input
path depends on is this one record. The cache folder, --cache-dir or its default, is found and made
here too: cache_folder(options.cache_dir).
"""

import dataclasses
import os
from pathlib import Path

from common.errors import UserError, first_line


@dataclasses.dataclass(frozen=True)
class DataOptions:
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
    # Pretrained weights' {"mean": [...], "std": [...]}; None: the training images' own statistics
    normalization: dict | None = None
    # Of every resize, common.data.images.INTERPOLATIONS: bilinear, or pretrained weights' bicubic
    interpolation: str = "bilinear"
    # Training only: scripts/evaluate.py, which builds no training loader, keeps these defaults.
    seed: int = 0  # shuffling, augmentation and the --val-fraction draw
    batch_size: int | None = None  # global: images per optimizer step over all processes
    grad_accum: int = 1  # micro-batches per optimizer step
    augment: bool = False  # random crops and flips of the training batches
    channels_last: bool = False  # NHWC batches, for a channels_last model
    auto_augment: str = "none"  # randaugment, trivialaugment: per image, in the workers
    random_erase: float = 0.0  # probability of erasing a rectangle of each training image
    mixup: float = 0.0  # MixUp's alpha (0: off)
    cutmix: float = 0.0  # CutMix's alpha (0: off)


def default_cache_dir() -> str:
    """Where decoded tensors and Arrow files are cached: $CIFAR_CACHE_DIR if set, else
    $XDG_CACHE_HOME/multigpu-cifar, else ~/.cache/multigpu-cifar."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.environ.get("CIFAR_CACHE_DIR") or os.path.join(xdg, "multigpu-cifar")


def cache_folder(cache_dir: str | None) -> Path:
    """The cache folder (``cache_dir``, else default_cache_dir()), made if missing, when something
    is about to be cached. A home folder that cannot be written in (read-only on many clusters)
    is one line naming the flag and the variable that move it, not a traceback at the first file."""
    folder = Path(cache_dir or default_cache_dir()).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):  # root too: a read-only file system's EROFS
            raise PermissionError(f"no write permission in {folder}")
    except OSError as e:
        where = (f"--cache-dir {cache_dir}" if cache_dir
                 else f"the cache folder {folder} (CIFAR_CACHE_DIR)"
                 if os.environ.get("CIFAR_CACHE_DIR") else f"the default cache folder {folder}")
        raise UserError(f"{where} cannot be written in ({first_line(e)}); pass --cache-dir DIR or "
                        f"set CIFAR_CACHE_DIR to a folder you can write in") from None
    return folder
