"""An evaluation split carved from train (--val-fraction): seeded, stratified by class.

The same images on both input paths: ``carve`` splits an undecoded source (workers), and
``carve_decoded`` the decoded tensors (device), from the same draw over the source's training
split, also when unreadable images were left out of the decoded one.
"""

import dataclasses

import torch

from common.data.splits import ImageData, ImageSource, checked


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
    keep = torch.ones(len(labels), dtype=torch.bool)
    keep[evaluation] = False
    return keep.nonzero().flatten(), evaluation


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
    if not len(data.skipped):
        return stratified_split(data.train_labels, fraction, seed)
    index, skipped_labels = data.skipped.T
    kept = torch.ones(len(data.train_labels) + len(index), dtype=torch.bool)
    kept[index] = False
    labels = torch.empty(len(kept), dtype=torch.int64)
    labels[kept], labels[index] = data.train_labels, skipped_labels
    position = kept.cumsum(0) - 1  # of each source image among the decoded ones
    return tuple(position[chosen[kept[chosen]]]
                 for chosen in stratified_split(labels, fraction, seed))
