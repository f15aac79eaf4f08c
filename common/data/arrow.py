"""Hugging Face `datasets` tables as splits: ArrowSplit, and a DatasetDict's two splits.

The Hub (common.data.hub), parquet files and save_to_disk folders (common.data.formats) all
arrive as a `datasets.DatasetDict`; ``from_hf`` finds its image and label columns and the split
to evaluate on, and leaves every image undecoded in the memory-mapped Arrow files.
"""

import numpy as np
import torch

from common.data.splits import EVAL_SPLITS, ImageSource
from common.errors import UserError


class ArrowSplit:
    """A split of a `datasets.Dataset`, memory-mapped Arrow: the image column holds each file's
    encoded bytes (or its path), read a row at a time, never decoded by `datasets`."""

    def __init__(self, table, column: str, labels: torch.Tensor, where: str):
        import datasets

        self.table = table.select_columns([column]).cast_column(
            column, datasets.Image(decode=False))
        self.column, self.labels, self.where = column, labels, where

    def __len__(self):
        return len(self.labels)

    def encoded(self, i: int):
        cell = self.table[i][self.column]
        return cell["bytes"] or cell["path"]

    def name(self, i: int) -> str:
        return f"{self.where} row {i}"

    def subset(self, indices: torch.Tensor) -> "ArrowSplit":
        part = ArrowSplit.__new__(ArrowSplit)
        part.table, part.column = self.table.select(indices.tolist()), self.column
        part.labels, part.where = self.labels[indices], f"{self.where} (subset)"
        return part

    def all_encoded(self, chunk: int = 1024):
        """Every row's bytes in order, read a chunk at a time (a row at a time costs ~50 us
        each)."""
        arrow = self.table.with_format("arrow")
        for start in range(0, len(self), chunk):
            for cell in arrow[start:start + chunk][self.column].to_pylist():
                yield cell["bytes"] or cell["path"]


def from_hf(splits, source: str, fallback_names: list[str] | None = None) -> ImageSource:
    """The train split and the evaluation split of a `datasets.DatasetDict`, undecoded.

    The image column is the first Image feature (or, in parquet written without `datasets`
    metadata, a {bytes, path} struct); the label column is label, labels, fine_label or the first
    ClassLabel. The evaluation split is the first of EVAL_SPLITS whose labels are set (the Hub
    marks an unlabelled test split with -1).
    """
    import datasets

    if "train" not in splits:
        raise UserError(f"{source} has splits {sorted(splits)} but no train split; provide one "
                        f"named train")
    features = splits["train"].features
    image_col = next((name for name, f in features.items() if isinstance(f, datasets.Image)), None)
    image_col = image_col or next(
        (name for name, f in features.items() if isinstance(f, dict) and "bytes" in f), None)
    class_cols = [name for name, f in features.items() if isinstance(f, datasets.ClassLabel)]
    label_col = next((c for c in ("label", "labels", "fine_label", *class_cols) if c in features),
                     None)
    if image_col is None or label_col is None:
        raise UserError(f"{source} has columns {', '.join(features)}, which lack an image column "
                        f"or a label column (label, labels, fine_label or a ClassLabel); provide "
                        f"an Image column and a label column")

    def labels(split):
        if label_col not in splits[split].column_names:
            return None
        values = splits[split].with_format("arrow")[label_col]
        return torch.from_numpy(
            np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64).copy())
    evaluated = None
    for name in EVAL_SPLITS:
        found = labels(name) if name in splits else None
        if found is not None and len(found) and (found >= 0).all():
            evaluated = name, found
            break
    train_labels = labels("train")
    if train_labels is None:
        raise UserError(f"{source}: the train split has no {label_col} column; provide labels for "
                        f"train")
    if isinstance(features[label_col], datasets.ClassLabel):
        classes = list(features[label_col].names)
    else:
        top = int(max(train_labels.max(), evaluated[1].max() if evaluated else 0))
        classes = fallback_names or [str(i) for i in range(top + 1)]
    where = source.split(" from ")[0]
    train = ArrowSplit(splits["train"], image_col, train_labels, f"{where}, train")
    if evaluated is None:  # the error, unless --val-fraction carves one, is splits.checked's
        return ImageSource(train, None, classes,
                           f"{source} (splits: {', '.join(sorted(splits))}, "
                           f"none of {', '.join(EVAL_SPLITS)} labelled)")
    return ImageSource(train,
                       ArrowSplit(splits[evaluated[0]], image_col, evaluated[1],
                                  f"{where}, {evaluated[0]}"),
                       classes, f"{source}; evaluated on {evaluated[0]}")
