"""Hugging Face `datasets`: a Hub dataset downloaded (or read from its cache offline), as splits.

The Hub, parquet files and save_to_disk folders (common.data.formats) all arrive as a
`datasets.DatasetDict`; ``from_hf`` finds its image and label columns and the split to evaluate
on, and leaves every image undecoded in the memory-mapped Arrow files (ArrowSplit). An
unreachable Hub is found in seconds, not after a minute of retries, and then only the `datasets`
cache is read; a failure is one line that says what to pass instead.
"""

from unittest.mock import patch

import numpy as np
import torch

from common.data.splits import EVAL_SPLITS, ImageSource, Split
from common.errors import UserError, first_line

# The Hub repository of a --dataset: uoft-cs/... for cifar10 and cifar100, else the name itself
HUB_REPOS = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100"}


class ArrowSplit(Split):
    """A split of a `datasets.Dataset`, memory-mapped Arrow: the image column holds each file's
    encoded bytes (or its path), read a row at a time, never decoded by `datasets`."""

    def __init__(self, table, column: str, labels: torch.Tensor, where: str):
        import datasets

        self.table = table.select_columns([column]).cast_column(
            column, datasets.Image(decode=False))
        self.column, self.labels, self.where = column, labels, where

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
        """Each row's bytes in order, read a chunk at a time (a row at a time costs ~50 us each)."""
        for batch in self.table.with_format("arrow").iter(batch_size=chunk):
            for cell in batch[self.column].to_pylist():
                yield cell["bytes"] or cell["path"]


def from_hf(splits, source: str, fallback_names: list[str] | None = None) -> ImageSource:
    """The train and evaluation splits of a `datasets.DatasetDict`, undecoded. The image column is
    the first Image feature (or, in parquet written without `datasets` metadata, a {bytes, path}
    struct); the label column is label, labels, fine_label or the first ClassLabel of the train
    split. The evaluation split is the first of EVAL_SPLITS whose labels are set (the Hub marks an
    unlabelled test split with -1)."""
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
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).astype(np.int64))  # a copy
    labelled = ((name, labels(name)) for name in EVAL_SPLITS if name in splits)  # read lazily
    evaluated = next(((name, found) for name, found in labelled
                      if found is not None and len(found) and (found >= 0).all()), None)
    train_labels = labels("train")
    if isinstance(features[label_col], datasets.ClassLabel):
        classes = list(features[label_col].names)
    else:
        top = int(max(train_labels.max(), evaluated[1].max() if evaluated else 0))
        classes = fallback_names or [str(i) for i in range(top + 1)]
    where = source.split(" from ")[0]
    train = ArrowSplit(splits["train"], image_col, train_labels, f"{where}, train")
    if evaluated is None:  # the error, unless --val-fraction carves one, is splits.checked's
        return ImageSource(train, None, classes, f"{source} (splits: {', '.join(sorted(splits))}, "
                                                 f"none of {', '.join(EVAL_SPLITS)} labelled)")
    test = ArrowSplit(splits[evaluated[0]], image_col, evaluated[1], f"{where}, {evaluated[0]}")
    return ImageSource(train, test, classes, f"{source}; evaluated on {evaluated[0]}")


def download(dataset: str) -> ImageSource:
    import datasets  # imported here: it takes a second, and only some sources need it

    repo = HUB_REPOS.get(dataset, dataset)
    offline = datasets.config.HF_HUB_OFFLINE or not _hub_reachable(datasets.config.HF_ENDPOINT)
    try:
        # `datasets` reads HF_HUB_OFFLINE once, when imported, and the scripts import it before we
        # know the Hub is unreachable; its config flag is what its loaders check.
        with patch.object(datasets.config, "HF_HUB_OFFLINE", offline):
            splits = datasets.load_dataset(repo)
    except Exception as e:  # offline, the datasets cache is all there is, failing in several ways
        if not (offline or isinstance(e, ConnectionError)):
            missing = ("DatasetNotFoundError", "FileNotFoundError", "RepositoryNotFoundError")
            if type(e).__name__ in missing:
                raise UserError(f"--dataset {dataset}: no such dataset on the Hugging Face Hub "
                                f"({first_line(e)}); check the id (owner/name) or pass --data-dir "
                                f"DIR") from None
            # e.g. a dataset of several configurations and no default, or a gated one and no token
            raise UserError(f"cannot load --dataset {dataset} from the Hugging Face Hub "
                            f"({first_line(e)}); load it once with datasets.load_dataset and "
                            f"save_to_disk, then pass --data-dir DIR") from None
        why = ("HF_HUB_OFFLINE is set" if datasets.config.HF_HUB_OFFLINE
               else f"{datasets.config.HF_ENDPOINT} is unreachable")
        detail = "" if isinstance(e, ConnectionError) else f" ({first_line(e)})"
        raise UserError(f"cannot load --dataset {dataset}: {why} and the Hugging Face cache holds "
                        f"no usable copy of {repo}{detail}; pass --data-dir DIR with a local copy "
                        f"(e.g. torchvision's cifar-10-batches-py or a snapshot of the Hub "
                        f"repository), or use --dataset synthetic") from None
    how = ", offline from the datasets cache" if offline else ""
    return from_hf(splits, f"{repo} from the Hugging Face Hub{how}")


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    # Without this check, an unreachable Hub costs 23 s of retries inside load_dataset before it
    # falls back to the datasets cache (measured with datasets 5.2 / huggingface_hub 2.4).
    import huggingface_hub

    try:
        huggingface_hub.get_session().head(endpoint, timeout=timeout)  # any HTTP answer will do
        return True
    except Exception:
        return False
