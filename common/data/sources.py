"""A dataset by name or by folder, opened as undecoded splits, checked, and carved if asked.

    source = open_source("cifar10")                       # uoft-cs/cifar10 through `datasets`
    source = open_source("food101")                        # any Hub dataset with image and label
    source = open_source(data_dir="~/data/imagenet")       # a local copy, format detected

Each split stays undecoded: image files, memory-mapped Arrow rows, or tensor rows. The evaluation
split is ``test`` when it has labels, else ``validation`` (or val, valid); with ``val_fraction`` it
is carved from train instead, seeded and stratified by class, the same images on both input paths:
``carve`` splits an undecoded source (workers), ``carve_decoded`` the decoded tensors (device).
"""

import dataclasses
import re
from pathlib import Path

import torch

from common.data.formats import detect_format
from common.data.hub import download
from common.data.splits import ImageData, ImageSource, TensorSplit, checked
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
    source = checked(open_unchecked(dataset, data_dir, cache_dir, synthetic_train_size,
                                    synthetic_test_size, synthetic_classes, seed),
                     carving=bool(val_fraction))
    return carve(source, val_fraction, seed) if val_fraction else source


def open_unchecked(dataset, data_dir, cache_dir, synthetic_train_size, synthetic_test_size,
                   synthetic_classes, seed) -> ImageSource:
    """``open_source``'s splits as the source has them: an evaluation split may be missing."""
    if dataset == "synthetic":
        if data_dir is not None:
            raise UserError(f"--dataset synthetic takes no --data-dir (got {data_dir}); drop one "
                            f"of the two")
        data = make_synthetic(synthetic_train_size, synthetic_test_size, synthetic_classes, seed)
        return ImageSource(TensorSplit(data.train_images, data.train_labels, "synthetic train"),
                           TensorSplit(data.test_images, data.test_labels, "synthetic test"),
                           data.classes, data.source)
    if data_dir is not None:  # the cache folder only for parquet, made then (cache_folder)
        *_, read = detect_format(Path(data_dir).expanduser())
        return read(cache_dir)
    return download(dataset)


def check_dataset_name(dataset: str) -> None:
    if dataset not in BUILT_IN and not HUB_ID.match(dataset):
        raise UserError(f"--dataset {dataset!r} is neither one of {', '.join(BUILT_IN)} nor a "
                        f"Hugging Face Hub dataset id (owner/name); pass one of those, or "
                        f"--data-dir DIR for a local copy")


def stratified_split(labels: torch.Tensor, fraction: float,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, evaluation indices): ``fraction`` of each class, at least one image of every
    class with two or more, drawn with ``seed``; both sorted."""
    gen = torch.Generator().manual_seed(seed)
    held = []
    for label in labels.unique().tolist():
        members = (labels == label).nonzero().flatten()
        take = min(len(members) - 1, max(1, round(fraction * len(members))))
        held.append(members[torch.randperm(len(members), generator=gen)[:take]])
    evaluation = torch.cat(held).sort().values
    return (~torch.isin(torch.arange(len(labels)), evaluation)).nonzero().flatten(), evaluation


def _carved(source: str, fraction: float, seed: int) -> str:
    where = source.split("; evaluated on")[0]
    return f"{where}; evaluated on {fraction:g} of train (--val-fraction, seed {seed})"


def carve(source: ImageSource, fraction: float, seed: int) -> ImageSource:
    train, evaluation = stratified_split(source.train.labels, fraction, seed)
    return checked(dataclasses.replace(
        source, train=source.train.subset(train), test=source.train.subset(evaluation),
        source=_carved(source.source, fraction, seed)))


def carve_decoded(data: ImageData, fraction: float | None, seed: int) -> ImageData:
    if not fraction:
        return data
    train, evaluation = carved_positions(data, fraction, seed)
    return ImageData(data.train_images[train], data.train_labels[train],
                     data.train_images[evaluation], data.train_labels[evaluation], data.classes,
                     _carved(data.source, fraction, seed))


def carved_positions(data: ImageData, fraction: float,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """stratified_split over the training split as its source lists it, as ``carve`` draws it for
    the workers path, then as positions among the images decoded: an image skipped as unreadable
    is missing from its side of the split, and the rest are the same images on both paths."""
    index, skipped_labels = data.skipped.T
    kept = ~torch.isin(torch.arange(len(data.train_labels) + len(index)), index)
    labels = torch.empty(len(kept), dtype=torch.int64)
    labels[kept], labels[index] = data.train_labels, skipped_labels
    position = kept.cumsum(0) - 1  # of each source image among the decoded ones
    return tuple(position[chosen[kept[chosen]]]
                 for chosen in stratified_split(labels, fraction, seed))
