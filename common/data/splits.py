"""The containers of the input path: undecoded splits, a source's two splits, decoded data.

An undecoded split is read an item at a time: ``encoded(i)`` (what common.data.images.decode
reads), ``name(i)`` (for errors), ``labels`` (int64) and ``subset(indices)``. FileSplit and
TensorSplit are here; ArrowSplit, which needs `datasets`, is in common.data.hub.
"""

import dataclasses
import os

import numpy as np
import torch

from common.errors import UserError

EVAL_SPLITS = ("test", "validation", "valid", "val")  # the first one with labels is evaluated on
NO_EVAL_SPLIT = "pass --val-fraction 0.1 to evaluate on a share of train"


@dataclasses.dataclass(frozen=True)
class ImageData:
    """Both splits of an image classification dataset, decoded."""

    train_images: torch.Tensor  # uint8, (N, 3, H, W), CPU, contiguous
    train_labels: torch.Tensor  # int64, (N,)
    test_images: torch.Tensor  # uint8, (M, 3, H, W)
    test_labels: torch.Tensor  # int64, (M,)
    classes: list[str]  # class names, index = label
    source: str  # one human-readable line: where the data came from and where it is cached
    # Training images left out as unreadable (--bad-images skip): (S, 2) rows of [index in the
    # source's training split, label], so that --val-fraction carves what the workers path carves.
    skipped: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.empty(0, 2, dtype=torch.int64))


class Split:
    """What the undecoded splits share: as many items as labels."""

    def __len__(self):
        return len(self.labels)


class FileSplit(Split):
    """Image files and their labels."""

    def __init__(self, paths, labels: torch.Tensor):
        # One numpy array of bytes, not a list of str: a forked worker that reads a Python object
        # writes its reference count and so copies its page, and over an epoch a worker would copy
        # every page of a list of a million names (pytorch/pytorch#13246).
        if not isinstance(paths, np.ndarray):
            paths = np.array([os.fsencode(p) for p in paths])
        self.paths, self.labels = paths, labels

    def name(self, i: int) -> str:
        return os.fsdecode(self.paths[i])

    encoded = name  # the path, which common.data.images.decode opens

    def subset(self, indices: torch.Tensor) -> "FileSplit":
        return FileSplit(self.paths[indices.numpy()], self.labels[indices])


class TensorSplit(Split):
    """Images already decoded into a uint8 (N, 3, H, W) tensor (CIFAR's pickles, synthetic data)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, where: str):
        self.images, self.labels, self.where = images, labels, where

    def encoded(self, i: int):
        return self.images[i]

    def name(self, i: int) -> str:
        return f"{self.where} image {i}"

    def subset(self, indices: torch.Tensor) -> "TensorSplit":
        return TensorSplit(self.images[indices], self.labels[indices], self.where)


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """Both splits of a dataset, undecoded."""

    train: object  # FileSplit, ArrowSplit or TensorSplit
    test: object
    classes: list[str]
    source: str  # one human-readable line: where the data came from, which split is evaluated on


def checked(source: ImageSource, carving: bool = False) -> ImageSource:
    """Refuse a missing or empty split, a label that names no class, or a training split of fewer
    than two classes; class names and the source line made ``readable``. ``carving``: the
    evaluation split is to be carved from train, and the source need not have one."""
    if source.test is None and not carving:
        raise UserError(f"{source.source} has no labelled evaluation split; {NO_EVAL_SPLIT}")
    for split_name, split in (("train", source.train), ("test", source.test)):
        if split is None:
            continue
        if len(split) == 0:
            raise UserError(f"the {split_name} split of {source.source} is empty; provide a "
                            f"{split_name} split with images")
        if len(bad := split.labels[(split.labels < 0) | (split.labels >= len(source.classes))]):
            names = ", ".join(source.classes[:5])
            raise UserError(f"{source.source} has {split_name} label {bad[0].item()} but "
                            f"{len(source.classes)} class names ({names}...); "
                            f"make every label a class index")
    check_classes(source.train.labels, source.classes, source.source)
    return dataclasses.replace(source, classes=[readable(str(name)) for name in source.classes],
                               source=readable(source.source))


def check_classes(train_labels: torch.Tensor, classes: list[str], source: str) -> None:
    """A classifier needs two classes or more among its training labels: with one, every answer
    is right and a run trains to test_acc 1.0 (a folder of one class, labels all alike)."""
    found = train_labels.unique()
    if len(classes) >= 2 and len(found) >= 2:
        return
    if len(classes) < 2:
        what = f"{len(classes)} class{'es' * (len(classes) != 1)}"
        what += f" ({readable(str(classes[0]))})" if classes else ""
    else:
        label = found[0].item()
        what = (f"training labels all {label} ({readable(str(classes[label]))}, one of "
                f"{len(classes)} class names)")
    where = readable(source.split("; evaluated on")[0])
    raise UserError(f"{where} has {what}: a classifier needs 2 or more classes; "
                    f"give it images of two or more classes")


def readable(text: str) -> str:
    """``text`` with the bytes of a file name that is not UTF-8 (which os.fsdecode keeps as lone
    surrogates) written as \\xNN: valid Unicode, which JSON, safetensors metadata and a UTF-8
    terminal all take, where the surrogates raise UnicodeEncodeError."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no file name gave
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")
