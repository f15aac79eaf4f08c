"""A dataset by name or by folder, opened as undecoded splits, checked, and carved if asked.

    source = open_source("cifar10")                       # uoft-cs/cifar10 through `datasets`
    source = open_source("food101")                        # any Hub dataset with image and label
    source = open_source(data_dir="~/data/imagenet")       # a local copy, format detected

Each split stays undecoded: image files, rows of a memory-mapped Arrow table, or rows of a
tensor. The evaluation split is ``test`` when it has labels, else ``validation`` (or val,
valid); with ``val_fraction`` it is carved from train instead, seeded and stratified by class.
"""

import re
from pathlib import Path

from common.data.carve import carve
from common.data.formats import detect_format
from common.data.hub import download
from common.data.splits import ImageSource, TensorSplit, checked
from common.data.synthetic import make_synthetic
from common.errors import UserError

BUILT_IN = ("cifar10", "cifar100", "synthetic")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def open_source(dataset: str = "cifar10", data_dir: str | None = None,
                cache_dir: str | None = None, synthetic_train_size: int = 5000,
                synthetic_test_size: int = 1000, synthetic_classes: int = 10, seed: int = 0,
                val_fraction: float | None = None) -> ImageSource:
    """``dataset`` (cifar10, cifar100, synthetic or a Hub id), or the local copy in ``data_dir``,
    which takes precedence; ``val_fraction`` carves the evaluation split from train (``seed``)."""
    source = open_unchecked(dataset, data_dir, cache_dir, synthetic_train_size,
                            synthetic_test_size, synthetic_classes, seed)
    if val_fraction:
        return carve(checked(source, carving=True), val_fraction, seed)
    return checked(source)


def open_unchecked(dataset, data_dir, cache_dir, synthetic_train_size, synthetic_test_size,
                   synthetic_classes, seed) -> ImageSource:
    """``open_source``'s splits as the source has them: an evaluation split may be missing."""
    check_dataset_name(dataset)
    if dataset == "synthetic":
        if data_dir is not None:
            raise UserError(f"--dataset synthetic takes no --data-dir (got {data_dir}); drop one "
                            f"of the two")
        data = make_synthetic(synthetic_train_size, synthetic_test_size, synthetic_classes, seed)
        return ImageSource(TensorSplit(data.train_images, data.train_labels, "synthetic train"),
                           TensorSplit(data.test_images, data.test_labels, "synthetic test"),
                           data.classes, data.source)
    if data_dir is not None:  # the cache folder only for parquet, made then (cache_folder)
        root, files, read = detect_format(Path(data_dir).expanduser())
        return read(cache_dir)
    return download(dataset)


def check_dataset_name(dataset: str) -> None:
    if dataset not in BUILT_IN and not HUB_ID.match(dataset):
        raise UserError(f"--dataset {dataset!r} is neither one of {', '.join(BUILT_IN)} nor a "
                        f"Hugging Face Hub dataset id (owner/name); pass one of those, or "
                        f"--data-dir DIR for a local copy")

