"""Image classification data from the Hugging Face Hub, a local copy, or made on the spot.

    source = open_source("cifar10")                       # uoft-cs/cifar10 through `datasets`
    source = open_source("food101")                        # any Hub dataset with an image and a label
    source = open_source(data_dir="~/data/imagenet")       # a local copy, format detected
    data = load_image_data(data_dir="~/data/cifar10")      # the same, decoded into uint8 tensors

Two views of one dataset, for the two input paths of the training scripts (--loader):
  - ``open_source`` gives each split undecoded: image files, rows of a memory-mapped Arrow table,
    or rows of a memory-mapped tensor. DataLoader workers decode a sample at a time
    (common.images), so nothing decoded is held and a dataset of any size trains.
  - ``load_image_data`` decodes every image once, at one size, into one uint8 (N, 3, H, W) tensor
    per split, for augmentation batched on the device (common.batches). The decoded tensors are
    cached under ``default_cache_dir()``, one file per source and size, so a second run starts in
    about a second and a cached Hub dataset loads with no network access at all.

Local copies (``data_dir``) can be any of:
  - a snapshot of a Hub repository (parquet files named train-*.parquet / test-*.parquet),
  - a ``DatasetDict.save_to_disk`` folder (has dataset_dict.json),
  - torchvision's ``cifar-10-batches-py`` / ``cifar-100-python`` folder, or its .tar.gz archive,
  - an image folder in the ImageNet layout: train/<class>/* and one of test/, val/, validation/ or
    valid/ with the same class folders; JPEG, PNG, WebP, GIF, BMP or TIFF of any size and mode.
The evaluation split is ``test`` when it has labels, else ``validation`` (or val, valid); with
``val_fraction`` it is carved from train instead, seeded and stratified by class.
"""

import dataclasses
import hashlib
import logging
import os
import pickle
import re
import tarfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from common.checkpoint import atomic_write
from common.errors import UserError, first_line
from common.images import BadImage, decode, fit

log = logging.getLogger(__name__)

BUILT_IN = ("cifar10", "cifar100", "synthetic")
HUB_REPOS = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100"}
DATA_DIR_FORMATS = (
    "a Hub snapshot with train-*.parquet and test-*.parquet files, a save_to_disk folder "
    "(dataset_dict.json), cifar-10-batches-py or cifar-100-python (folder or .tar.gz), "
    "or an image folder train/<class>/* with test/<class>/* (or val/, validation/)"
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
EVAL_SPLITS = ("test", "validation", "valid", "val")  # the first one with labels is evaluated on
DEFAULT_IMAGE_SIZE = 224  # for images of mixed sizes, as torchvision's ImageNet models
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


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
    skipped: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, 2, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------
# Undecoded splits: item i is read with encoded(i), named in errors with name(i)

class FileSplit:
    """Image files and their labels."""

    def __init__(self, paths, labels: torch.Tensor):
        # One numpy array of bytes, not a list of str: a forked worker that reads a Python object
        # writes its reference count and so copies its page, and over an epoch a worker would copy
        # every page of a list of a million names (pytorch/pytorch#13246).
        self.paths = paths if isinstance(paths, np.ndarray) else np.array([os.fsencode(p) for p in paths])
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def encoded(self, i: int):
        return os.fsdecode(self.paths[i])

    def name(self, i: int) -> str:
        return os.fsdecode(self.paths[i])

    def subset(self, indices: torch.Tensor) -> "FileSplit":
        return FileSplit(self.paths[indices.numpy()], self.labels[indices])


class ArrowSplit:
    """A split of a `datasets.Dataset`, memory-mapped Arrow: the image column holds each file's
    encoded bytes (or its path), read a row at a time, never decoded by `datasets`."""

    def __init__(self, table, column: str, labels: torch.Tensor, where: str):
        import datasets

        self.table = table.select_columns([column]).cast_column(column, datasets.Image(decode=False))
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
        part.table, part.column, part.labels = self.table.select(indices.tolist()), self.column, self.labels[indices]
        part.where = f"{self.where} (subset)"
        return part

    def all_encoded(self, chunk: int = 1024):
        """Every row's bytes in order, read a chunk at a time (a row at a time costs ~50 us each)."""
        arrow = self.table.with_format("arrow")
        for start in range(0, len(self), chunk):
            for cell in arrow[start:start + chunk][self.column].to_pylist():
                yield cell["bytes"] or cell["path"]


class TensorSplit:
    """Images already decoded into a uint8 (N, 3, H, W) tensor (CIFAR's pickles, synthetic data)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, where: str):
        self.images, self.labels, self.where = images, labels, where

    def __len__(self):
        return len(self.labels)

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


def open_source(dataset: str = "cifar10", data_dir: str | None = None, cache_dir: str | None = None,
                synthetic_train_size: int = 5000, synthetic_test_size: int = 1000, synthetic_classes: int = 10,
                seed: int = 0, val_fraction: float | None = None) -> ImageSource:
    """``dataset`` (cifar10, cifar100, synthetic or a Hub id), or the local copy in ``data_dir``,
    which takes precedence; ``val_fraction`` carves the evaluation split from train (``seed``)."""
    source = _open(dataset, data_dir, cache_dir, synthetic_train_size, synthetic_test_size, synthetic_classes, seed)
    return carve(_checked(source, carving=True), val_fraction, seed) if val_fraction else _checked(source)


NO_EVAL_SPLIT = "pass --val-fraction 0.1 to evaluate on a share of train"


def _open(dataset, data_dir, cache_dir, synthetic_train_size, synthetic_test_size, synthetic_classes, seed):
    check_dataset_name(dataset)
    if dataset == "synthetic":
        if data_dir is not None:
            raise UserError(f"--dataset synthetic takes no --data-dir (got {data_dir}); drop one of the two")
        data = make_synthetic(synthetic_train_size, synthetic_test_size, synthetic_classes, seed)
        return ImageSource(TensorSplit(data.train_images, data.train_labels, "synthetic train"),
                           TensorSplit(data.test_images, data.test_labels, "synthetic test"), data.classes, data.source)
    cache_dir = Path(cache_dir or default_cache_dir())
    if data_dir is not None:
        return _open_data_dir(Path(data_dir).expanduser(), cache_dir)
    return _download(dataset, HUB_REPOS.get(dataset, dataset))


def check_dataset_name(dataset: str) -> None:
    if dataset not in BUILT_IN and not HUB_ID.match(dataset):
        raise UserError(f"--dataset {dataset!r} is neither one of {', '.join(BUILT_IN)} nor a Hugging Face Hub "
                        f"dataset id (owner/name); pass one of those, or --data-dir DIR for a local copy")


def load_image_data(dataset: str = "cifar10", data_dir: str | None = None, cache_dir: str | None = None,
                    synthetic_train_size: int = 5000, synthetic_test_size: int = 1000, synthetic_classes: int = 10,
                    seed: int = 0, image_size: int | None = None, val_fraction: float | None = None,
                    skip_bad: bool = False) -> ImageData:
    """``open_source``'s dataset decoded: every image at ``image_size`` (shorter side resized, centre
    square cropped) or, with None, at the size all images share. Cached, except synthetic data."""
    if dataset == "synthetic" and data_dir is None:
        check_dataset_name(dataset)
        data = make_synthetic(synthetic_train_size, synthetic_test_size, synthetic_classes, seed)
        if image_size not in (None, data.train_images.shape[-1]):
            data = dataclasses.replace(data, train_images=_fit_all(data.train_images, image_size),
                                       test_images=_fit_all(data.test_images, image_size))
        return carve_decoded(data, val_fraction, seed)
    cache_dir = Path(cache_dir or default_cache_dir())
    if data_dir is not None:
        root, files, _ = _detect_format(Path(data_dir).expanduser())
        key = f"dir-{_files_key(root, files())}"
    else:
        check_dataset_name(dataset)
        key = _hub_key(dataset)
    name = f"{key}{f'-{image_size}px' if image_size else ''}{'-skip' if skip_bad else ''}.pt"

    def build():
        source = _open(dataset, data_dir, cache_dir, synthetic_train_size, synthetic_test_size, synthetic_classes,
                       seed)
        return decode_source(_checked(source, carving=bool(val_fraction)), image_size, skip_bad)
    data = _cached(cache_dir / name, build)
    if not val_fraction and not len(data.test_labels):  # cached by a run that carved its evaluation split
        raise UserError(f"{data.source.split(' (cached at ')[0]} has no labelled evaluation split; {NO_EVAL_SPLIT}")
    return carve_decoded(data, val_fraction, seed)


def cached_hub_data(dataset: str, cache_dir: str | None, skip_bad: bool = False) -> ImageData | None:
    """The Hub dataset as an earlier run decoded and cached it at its own size, else None: with it
    a run neither asks the Hub nor opens the `datasets` cache."""
    path = Path(cache_dir or default_cache_dir()) / f"{_hub_key(dataset)}{'-skip' if skip_bad else ''}.pt"
    if not path.is_file():
        return None
    with FileLock(f"{path}.lock"):  # not while a first run is still writing it
        try:
            return _saved(path)
        except Exception:  # unreadable: load_image_data says so and rebuilds it
            return None


def _hub_key(dataset: str) -> str:
    return f"hub-{HUB_REPOS.get(dataset, dataset).replace('/', '--')}"


def default_cache_dir() -> str:
    """$CIFAR_CACHE_DIR if set, else $XDG_CACHE_HOME/multigpu-cifar, else ~/.cache/multigpu-cifar."""
    if os.environ.get("CIFAR_CACHE_DIR"):
        return os.environ["CIFAR_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "multigpu-cifar")


def _checked(source: ImageSource, carving: bool = False) -> ImageSource:
    """Refuse a missing or empty split, or a label that names no class. ``carving``: the evaluation
    split is to be carved from train, and the source need not have one."""
    if source.test is None and not carving:
        raise UserError(f"{source.source} has no labelled evaluation split; {NO_EVAL_SPLIT}")
    for split_name, split in (("train", source.train), ("test", source.test)):
        if split is None:
            continue
        if len(split) == 0:
            raise UserError(f"the {split_name} split of {source.source} is empty; provide a {split_name} split "
                            f"with images")
        labels = split.labels
        bad = labels[(labels < 0) | (labels >= len(source.classes))]
        if len(bad):
            raise UserError(f"{source.source} has {split_name} label {bad[0].item()} but {len(source.classes)} "
                            f"class names ({', '.join(source.classes[:5])}...); make every label a class index")
    return source


# ----------------------------------------------------------------------------------------------
# An evaluation split carved from train

def stratified_split(labels: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def carve(source: ImageSource, fraction: float, seed: int) -> ImageSource:
    train, evaluation = stratified_split(source.train.labels, fraction, seed)
    where = source.source.split("; evaluated on")[0]
    return _checked(dataclasses.replace(
        source, train=source.train.subset(train), test=source.train.subset(evaluation),
        source=f"{where}; evaluated on {fraction:g} of train (--val-fraction, seed {seed})"))


def carve_decoded(data: ImageData, fraction: float | None, seed: int) -> ImageData:
    if not fraction:
        return data
    train, evaluation = carved_positions(data, fraction, seed)
    where = data.source.split("; evaluated on")[0]
    return ImageData(data.train_images[train], data.train_labels[train], data.train_images[evaluation],
                     data.train_labels[evaluation], data.classes,
                     f"{where}; evaluated on {fraction:g} of train (--val-fraction, seed {seed})")


def carved_positions(data: ImageData, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    return tuple(position[chosen[kept[chosen]]] for chosen in stratified_split(labels, fraction, seed))


# ----------------------------------------------------------------------------------------------
# Decoding every image once (the device path), and the cache of the result

def native_size(source: ImageSource, probes: int = 16) -> int | None:
    """The side of the training images when all of ``probes`` spread over the split are square
    and of one size (CIFAR: 32), else None."""
    split = source.train
    if isinstance(split, TensorSplit):
        h, w = split.images.shape[-2:]
        return h if h == w else None
    sizes = set()
    for i in sorted({round(k * (len(split) - 1) / max(probes - 1, 1)) for k in range(probes)}):
        try:
            sizes.add(tuple(decode(split.encoded(i), split.name(i)).shape[-2:]))
        except BadImage:
            continue
    if len(sizes) == 1:
        h, w = sizes.pop()
        return h if h == w else None
    return None


def decode_source(source: ImageSource, image_size: int | None, skip_bad: bool = False) -> ImageData:
    """Every image of both splits decoded, at ``image_size`` or (None) the size they all share."""
    size = image_size or native_size(source)
    if size is None:
        size = DEFAULT_IMAGE_SIZE
        log.warning("the images of %s differ in size: decoding them at %dx%d (set --image-size)",
                    source.source, size, size)
    train_images, train_labels, left_out = decode_split(source.train, size, skip_bad)
    if source.test is None:  # to be carved from train (--val-fraction)
        test_images, test_labels = torch.empty(0, 3, size, size, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    else:
        test_images, test_labels, _ = decode_split(source.test, size, skip_bad)
    return ImageData(train_images, train_labels, test_images, test_labels, classes=source.classes,
                     source=source.source, skipped=torch.stack([left_out, source.train.labels[left_out]], dim=1))


def decode_split(split, size: int, skip_bad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One split as uint8 (N, 3, size, size), its labels and the indices of the images left out as
    unreadable (with skip_bad). One thread on purpose: a 32x32 PNG decodes in about 50 us, mostly
    under the GIL, and a thread pool was no faster."""
    none = torch.empty(0, dtype=torch.int64)
    if isinstance(split, TensorSplit):
        return _fit_all(split.images, size), split.labels, none
    items = split.all_encoded() if isinstance(split, ArrowSplit) else (split.encoded(i) for i in range(len(split)))
    batch = torch.empty(len(split), 3, size, size, dtype=torch.uint8)
    kept = torch.ones(len(split), dtype=torch.bool)
    for i, encoded in enumerate(items):
        try:
            batch[i] = fit(decode(encoded, split.name(i)), size)
        except BadImage as e:
            if not skip_bad:
                raise UserError(f"{e}; replace or remove the file, or pass --bad-images skip to train without "
                                f"it") from None
            log.warning("%s; skipped (--bad-images skip)", e)
            kept[i] = False
    if kept.all():
        return batch, split.labels, none
    return batch[kept].contiguous(), split.labels[kept], (~kept).nonzero().flatten()


def _fit_all(images: torch.Tensor, size: int, chunk: int = 1024) -> torch.Tensor:
    if images.shape[-2:] == (size, size):
        return images
    return torch.cat([torch.stack([fit(image, size) for image in images[start:start + chunk]])
                      for start in range(0, len(images), chunk)])


def _cached(path: Path, build) -> ImageData:
    """Load the cache file at `path`, or build the data, save it there atomically and return it.

    Processes that start together (DDP) all call this: the first to take the file lock downloads
    and decodes, the others wait for the lock and then read its cache. A lock, not a collective
    barrier, so a long first download is not cut short by the process group's timeout.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        return _load_or_build(path, build)


def _load_or_build(path: Path, build) -> ImageData:
    if path.exists():
        try:
            # Mapped, not read: pages come from the file as they are used, and a training script
            # that moves the data to its GPU keeps no host copy.
            return _saved(path)
        except Exception as e:  # a truncated or foreign file only costs a rebuild
            log.warning("ignoring unreadable cache file %s (%s); rebuilding it", path, first_line(e))
    data = build()
    cached = dataclasses.replace(data, source=f"{data.source} (cached at {path})")
    try:
        with atomic_write(path) as f:
            torch.save(vars(cached), f)
    except OSError as e:
        log.warning("could not write cache file %s (%s); the next run decodes again", path, first_line(e))
        return data
    return cached


def _saved(path: Path) -> ImageData:
    saved = torch.load(path, weights_only=True, mmap=True)
    if path.stem.endswith("-skip") and "skipped" not in saved:
        raise ValueError("written before the images skipped were recorded")  # its --val-fraction would differ
    return ImageData(**saved)


def _files_key(root: Path, files: list[Path]) -> str:
    """A digest of where the files are and of their names, sizes and modification times."""
    digest = hashlib.sha256(str(root.resolve()).encode())
    for file in sorted(files):
        st = file.stat()
        digest.update(f"\0{file.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# The Hugging Face Hub

def _download(dataset: str, repo: str) -> ImageSource:
    import datasets  # imported here: it takes a second, and only some sources need it

    offline = datasets.config.HF_HUB_OFFLINE or not _hub_reachable(datasets.config.HF_ENDPOINT)
    try:
        with _datasets_offline(offline):
            splits = datasets.load_dataset(repo)
    except Exception as e:  # offline, the datasets cache is all there is, and it fails in several ways
        if not (offline or isinstance(e, ConnectionError)):
            if type(e).__name__ in ("DatasetNotFoundError", "FileNotFoundError", "RepositoryNotFoundError"):
                raise UserError(f"--dataset {dataset}: no such dataset on the Hugging Face Hub ({first_line(e)}); "
                                f"check the id (owner/name) or pass --data-dir DIR") from None
            # e.g. a dataset of several configurations and no default, or a gated one without a token
            raise UserError(f"cannot load --dataset {dataset} from the Hugging Face Hub ({first_line(e)}); load it "
                            f"once with datasets.load_dataset and save_to_disk, then pass --data-dir DIR") from None
        if datasets.config.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set"
        else:
            why = f"{datasets.config.HF_ENDPOINT} is unreachable"
        detail = "" if isinstance(e, ConnectionError) else f" ({first_line(e)})"
        raise UserError(f"cannot load --dataset {dataset}: {why} and the Hugging Face cache holds no usable copy "
                        f"of {repo}{detail}; pass --data-dir DIR with a local copy (e.g. torchvision's "
                        f"cifar-10-batches-py or a snapshot of the Hub repository), or use --dataset synthetic"
                        ) from None
    how = ", offline from the datasets cache" if offline else ""
    return _from_hf(splits, f"{repo} from the Hugging Face Hub{how}")


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    # Without this check, an unreachable Hub costs 23 s of retries inside load_dataset before it
    # falls back to the datasets cache (measured with datasets 5.2 / huggingface_hub 2.4).
    import huggingface_hub

    try:
        huggingface_hub.get_session().head(endpoint, timeout=timeout)  # any HTTP answer will do
        return True
    except Exception:
        return False


@contextmanager
def _datasets_offline(offline: bool):
    """Make `datasets` read only its cache, as HF_HUB_OFFLINE=1 does.

    The variable is read once, when `datasets` is imported, and the scripts import it before we
    know the Hub is unreachable; its config flag is what its loaders check.
    """
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or offline
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def _from_hf(splits, source: str, fallback_names: list[str] | None = None) -> ImageSource:
    """The train split and the evaluation split of a `datasets.DatasetDict`, undecoded.

    The image column is the first Image feature (or, in parquet written without `datasets`
    metadata, a {bytes, path} struct); the label column is label, labels, fine_label or the first
    ClassLabel. The evaluation split is the first of EVAL_SPLITS whose labels are set (the Hub
    marks an unlabelled test split with -1).
    """
    import datasets

    if "train" not in splits:
        raise UserError(f"{source} has splits {sorted(splits)} but no train split; provide one named train")
    features = splits["train"].features
    image_col = next((name for name, f in features.items() if isinstance(f, datasets.Image)), None) or next(
        (name for name, f in features.items() if isinstance(f, dict) and "bytes" in f), None)
    class_cols = [name for name, f in features.items() if isinstance(f, datasets.ClassLabel)]
    label_col = next((c for c in ("label", "labels", "fine_label", *class_cols) if c in features), None)
    if image_col is None or label_col is None:
        raise UserError(f"{source} has columns {', '.join(features)}, which lack an image column or a label column "
                        f"(label, labels, fine_label or a ClassLabel); provide an Image column and a label column")

    def labels(split):
        if label_col not in splits[split].column_names:
            return None
        values = splits[split].with_format("arrow")[label_col]
        return torch.from_numpy(np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64).copy())
    evaluated = None
    for name in EVAL_SPLITS:
        if name in splits and (found := labels(name)) is not None and len(found) and (found >= 0).all():
            evaluated = name, found
            break
    train_labels = labels("train")
    if train_labels is None:
        raise UserError(f"{source}: the train split has no {label_col} column; provide labels for train")
    if isinstance(features[label_col], datasets.ClassLabel):
        classes = list(features[label_col].names)
    else:
        top = int(max(train_labels.max(), evaluated[1].max() if evaluated else 0))
        classes = fallback_names or [str(i) for i in range(top + 1)]
    where = source.split(" from ")[0]
    if evaluated is None:  # the error, unless --val-fraction carves one, is _checked's
        return ImageSource(ArrowSplit(splits["train"], image_col, train_labels, f"{where}, train"), None, classes,
                           f"{source} (splits: {', '.join(sorted(splits))}, none of {', '.join(EVAL_SPLITS)} labelled)")
    return ImageSource(ArrowSplit(splits["train"], image_col, train_labels, f"{where}, train"),
                       ArrowSplit(splits[evaluated[0]], image_col, evaluated[1], f"{where}, {evaluated[0]}"),
                       classes, f"{source}; evaluated on {evaluated[0]}")


# ----------------------------------------------------------------------------------------------
# Local copies: detect the format, then read it

def _open_data_dir(data_dir: Path, cache_dir: Path) -> ImageSource:
    root, files, reader = _detect_format(data_dir)
    return reader(cache_dir)


def _detect_format(data_dir: Path):
    """Return (root, a function listing the files the data is read from, a function of the cache
    folder that opens them). Listing is for the decoded cache's key only, and costs a stat per file."""
    if not data_dir.exists():
        raise UserError(f"--data-dir {data_dir} does not exist; pass a folder holding {DATA_DIR_FORMATS}")
    if data_dir.is_file():
        if data_dir.name.endswith((".tar.gz", ".tgz")):
            return data_dir.parent, lambda: [data_dir], lambda cache: _read_cifar_tar(data_dir)
        raise UserError(f"--data-dir {data_dir} is a file, not a folder or a .tar.gz; "
                        f"pass a folder holding {DATA_DIR_FORMATS}")
    if (data_dir / "dataset_dict.json").is_file():
        return data_dir, lambda: _all_files(data_dir), lambda cache: _read_saved(data_dir)
    for folder in (data_dir, data_dir / "cifar-10-batches-py", data_dir / "cifar-100-python"):
        if (folder / "batches.meta").is_file() or (folder / "meta").is_file() and (folder / "test").is_file():
            return folder, lambda folder=folder: _all_files(folder), \
                lambda cache, folder=folder: _read_cifar_pickles(folder)
    for archive in (data_dir / "cifar-10-python.tar.gz", data_dir / "cifar-100-python.tar.gz"):
        if archive.is_file():
            return data_dir, lambda archive=archive: [archive], lambda cache, archive=archive: _read_cifar_tar(archive)
    parquet = sorted(data_dir.rglob("*.parquet"))
    if parquet:
        files = parquet + [readme for readme in [data_dir / "README.md"] if readme.is_file()]
        return data_dir, lambda: files, lambda cache: _read_parquet(data_dir, parquet, cache)
    if (data_dir / "train").is_dir():
        folders = [data_dir / "train", *(data_dir / name for name in EVAL_SPLITS if (data_dir / name).is_dir())]
        return data_dir, lambda: [f for folder in folders for f in _all_files(folder)], \
            lambda cache: _read_image_folder(data_dir)
    if not any(data_dir.iterdir()):
        raise UserError(f"--data-dir {data_dir} is empty; put in it {DATA_DIR_FORMATS}")
    raise UserError(f"--data-dir {data_dir} holds no data in a known format; expected {DATA_DIR_FORMATS}")


def _all_files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


def _read_saved(folder: Path) -> ImageSource:
    import datasets

    try:
        splits = datasets.load_from_disk(str(folder))
    except Exception as e:
        raise UserError(f"cannot read the save_to_disk folder {folder} ({first_line(e)}); "
                        f"save it again with DatasetDict.save_to_disk") from None
    return _from_hf(splits, f"save_to_disk folder {folder}")


def _read_parquet(root: Path, files: list[Path], cache_dir: Path) -> ImageSource:
    import datasets
    import pyarrow.parquet

    # The Hub names them train-00000-of-00001.parquet; other tools, e.g. cifar10_train.parquet.
    by_split = {split: [str(f) for f in files if re.search(rf"(^|[-_.]){split}[-_.]", f.name)]
                for split in ("train", *EVAL_SPLITS)}
    by_split = {split: found for split, found in by_split.items() if found}
    if "train" not in by_split:  # with no test-*.parquet, _checked asks for --val-fraction
        raise UserError(f"--data-dir {root} has parquet files but no train-*.parquet (found "
                        f"{', '.join(f.name for f in files[:4])}); add the train split")
    for file in (f for found in by_split.values() for f in found):
        try:  # reads the footer, so a truncated download is caught here, by name
            pyarrow.parquet.read_schema(file)
        except Exception as e:
            raise UserError(f"cannot read parquet file {file} ({first_line(e)}); download it again") from None
    # load_dataset converts parquet to memory-mapped Arrow files, kept in our cache for the workers.
    try:
        splits = datasets.load_dataset("parquet", data_files=by_split, cache_dir=str(cache_dir / "arrow"))
    except Exception as e:
        raise UserError(f"cannot read the parquet files under {root} ({first_line(e)}); "
                        f"download them again") from None
    return _from_hf(splits, f"parquet files under {root}", fallback_names=_readme_class_names(root))


def _readme_class_names(root: Path) -> list[str] | None:
    """Class names from the Hub dataset card (README.md), for parquet files that lack the
    features metadata `datasets` writes into them."""
    import huggingface_hub

    readme = root / "README.md"
    if not readme.is_file():
        return None
    infos = huggingface_hub.DatasetCard.load(readme).data.dataset_info or []
    for info in infos if isinstance(infos, list) else [infos]:
        features = {f.get("name"): f.get("dtype") for f in info.get("features", [])}
        for column in ("label", "labels", "fine_label", *features):
            dtype = features.get(column)
            if isinstance(dtype, dict) and "class_label" in dtype:
                names = dtype["class_label"]["names"]
                return [names[k] for k in sorted(names, key=int)] if isinstance(names, dict) else list(names)
    return None


def _read_cifar_pickles(folder: Path) -> ImageSource:
    """torchvision's cifar-10-batches-py or cifar-100-python folder."""
    def read(name):
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path} is missing; download the complete CIFAR archive again")
        return _unpickle(path.read_bytes(), str(path))
    return _from_cifar_pickles(read, str(folder), cifar100=(folder / "meta").is_file())


def _read_cifar_tar(archive: Path) -> ImageSource:
    """cifar-10-python.tar.gz or cifar-100-python.tar.gz, read in one pass without extracting."""
    members = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.isfile():
                    members[member.name.split("/")[-1]] = tar.extractfile(member).read()
    except (OSError, EOFError, tarfile.TarError) as e:  # zlib and gzip errors are OSError
        raise UserError(f"cannot read archive {archive} ({first_line(e)}); download it again") from None

    def read(name):
        if name not in members:
            raise UserError(f"archive {archive} has no member {name}; download the complete CIFAR archive again")
        return _unpickle(members[name], f"{archive}:{name}")
    return _from_cifar_pickles(read, str(archive), cifar100="meta" in members)


def _unpickle(blob: bytes, name: str) -> dict:
    try:
        return pickle.loads(blob, encoding="latin1")  # the files were written by Python 2
    except Exception as e:
        raise UserError(f"cannot unpickle {name} ({first_line(e)}); download the CIFAR archive again") from None


def _from_cifar_pickles(read, source: str, cifar100: bool) -> ImageSource:
    if cifar100:
        train_files, test_files = ["train"], ["test"]
        meta, names_key, labels_key = "meta", "fine_label_names", "fine_labels"
    else:
        train_files, test_files = [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]
        meta, names_key, labels_key = "batches.meta", "label_names", "labels"

    def split(files, name):
        batches = [read(file) for file in files]
        data = np.concatenate([b["data"] for b in batches])  # (N, 3072): R, G, B planes of 32x32
        labels = np.concatenate([np.asarray(b[labels_key]) for b in batches])
        return TensorSplit(torch.from_numpy(data.reshape(-1, 3, 32, 32)), torch.from_numpy(labels.astype(np.int64)),
                           f"{source} {name}")

    try:
        classes = [str(name) for name in read(meta)[names_key]]
        train, test = split(train_files, "train"), split(test_files, "test")
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source} is not in CIFAR's pickle format ({first_line(e)}); "
                        f"download the CIFAR archive again") from None
    return ImageSource(train, test, classes, f"CIFAR pickles from {source}; evaluated on test")


def _read_image_folder(root: Path) -> ImageSource:
    """root/train/<class>/* and root/<test, validation, valid or val>/<class>/*, as torchvision's
    ImageFolder: a class is a folder, its images any file with an image suffix in it or below it."""
    def class_folders(split):
        return sorted(p.name for p in (root / split).iterdir() if p.is_dir() and not p.name.startswith("."))
    # The first with class folders: a test/ of unlabelled images (as Kaggle's) is not evaluated on.
    evaluated = next((name for name in EVAL_SPLITS if (root / name).is_dir() and class_folders(name)), None)
    classes = class_folders("train")
    if not classes:
        raise UserError(f"image folder {root / 'train'} has no class folders; put each class's images in "
                        f"train/<class>/")
    eval_classes = class_folders(evaluated) if evaluated else classes
    if classes != eval_classes:
        only_train = sorted(set(classes) - set(eval_classes))
        only_eval = sorted(set(eval_classes) - set(classes))
        missing = ([f"{', '.join(only_train[:5])} missing from {evaluated}/"] if only_train else []) + \
                  ([f"{', '.join(only_eval[:5])} missing from train/"] if only_eval else [])
        raise UserError(f"image folder {root}: the class folders of train/ and {evaluated}/ differ "
                        f"({'; '.join(missing)}); give both splits the same class folders")
    out = []
    for split in ("train", evaluated) if evaluated else ("train",):
        files = [(str(path), label) for label, name in enumerate(classes)
                 for path in sorted((root / split / name).rglob("*"))
                 if path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".") and path.is_file()]
        if not files:
            raise UserError(f"image folder {root / split} has no image files ({', '.join(IMAGE_SUFFIXES)}); "
                            f"add the images")
        out.append(FileSplit([path for path, _ in files], torch.tensor([label for _, label in files],
                                                                         dtype=torch.int64)))
    if evaluated is None:  # the error, unless --val-fraction carves one, is _checked's
        return ImageSource(out[0], None, classes,
                           f"image folder {root} (no test/, val/ or validation/ folder of class folders)")
    return ImageSource(*out, classes=classes, source=f"image folder {root}; evaluated on {evaluated}")


# ----------------------------------------------------------------------------------------------
# Synthetic data

def make_synthetic(train_size: int, test_size: int, num_classes: int = 10, seed: int = 0,
                   image_size: int = 32) -> ImageData:
    """CIFAR-shaped images that a CNN learns in a few epochs and a linear model cannot.

    Each class is a smooth random colour pattern that tiles the plane (an 8x8 random field
    upsampled bilinearly with wrap-around). A sample is its class pattern cyclically shifted to a
    random position, mirrored left-right half the time (so flip augmentation keeps the
    distribution), with random contrast and brightness, plus per-pixel Gaussian noise as strong as
    the pattern. Averaged over positions every pattern is flat grey, so a linear model on pixels
    stays near chance, while a CNN recognises the pattern wherever it lies. The test split is an
    independent draw from the same distribution and does not depend on train_size. Deterministic
    for a seed; the global RNG is left alone. About 2 s for 50,000 images on 2 cores.
    """
    if num_classes < 2 or image_size % 8:
        raise ValueError(f"need 2 or more classes and an image size divisible by 8, got {num_classes}, {image_size}")
    if min(train_size, test_size) < num_classes:
        raise UserError(f"synthetic data needs at least one image per class in each split, got {train_size} train "
                        f"and {test_size} test images for {num_classes} classes; raise --synthetic-train-size "
                        f"or --synthetic-test-size")
    gen = torch.Generator().manual_seed(seed)
    coarse, scale = 8, image_size // 8
    field = torch.nn.functional.pad(torch.randn(num_classes, 3, coarse, coarse, generator=gen),
                                    (1, 1, 1, 1), mode="circular")
    patterns = torch.nn.functional.interpolate(field, scale_factor=scale, mode="bilinear")
    patterns = patterns[..., scale:-scale, scale:-scale]  # one period, seamless at the edges
    patterns -= patterns.mean(dim=(2, 3), keepdim=True)
    patterns /= patterns.std(dim=(1, 2, 3), keepdim=True)
    train_seed, test_seed = torch.randint(2**62, (2,), generator=gen).tolist()
    train = _synthetic_split(patterns, train_size, torch.Generator().manual_seed(train_seed))
    test = _synthetic_split(patterns, test_size, torch.Generator().manual_seed(test_seed))
    return ImageData(*train, *test, classes=[f"class{i}" for i in range(num_classes)],
                     source=f"synthetic: {num_classes} classes, {train_size} train / {test_size} test images "
                            f"of {image_size}x{image_size}, seed {seed}")


def _synthetic_split(patterns, size, gen, chunk=8192):
    num_classes, channels, side, _ = patterns.shape
    labels = torch.randperm(size, generator=gen) % num_classes  # balanced, in random order
    images = torch.empty(size, channels, side, side, dtype=torch.uint8)
    pixels = torch.arange(side)
    for start in range(0, size, chunk):  # bounds the float32 working memory
        y = labels[start:start + chunk]
        n = len(y)
        dy, dx = torch.randint(side, (2, n, 1, 1, 1), generator=gen)
        mirror = torch.randint(2, (n, 1, 1, 1), generator=gen) * 2 - 1
        shifted = patterns[y[:, None, None, None], torch.arange(channels)[:, None, None],
                           (dy + pixels[:, None]) % side, (dx + mirror * pixels) % side]
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=gen)
        brightness = 0.5 * torch.randn(n, 1, 1, 1, generator=gen)
        x = torch.randn(n, channels, side, side, generator=gen).addcmul_(shifted, contrast).add_(brightness)
        images[start:start + n] = x.mul_(40).add_(128).round_().clamp_(0, 255).to(torch.uint8)
    return images, labels
