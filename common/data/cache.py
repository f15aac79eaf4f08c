"""The decoded data cached on disk: a file per source, size and interpolation, built under a lock.

    data = load_image_data("cifar10")                      # decoded, uint8 (N, 3, 32, 32)
    data = load_image_data(data_dir="~/data/cifar10")      # a local copy, decoded the same way

A second run starts in about a second, and a cached Hub dataset loads with no network access. A
file's name is its key: the Hub repository, or a digest of a local copy's file names, sizes and
times; then the size, the interpolation unless bilinear (so earlier runs' files, all bilinear, keep
their names) and whether unreadable images were skipped. Synthetic data is never cached.
"""

import dataclasses
import hashlib
import logging
import os
from pathlib import Path

import torch
from filelock import FileLock

from common.data.decode import decode_source
from common.data.formats import detect_format
from common.data.hub import HUB_REPOS
from common.data.options import cache_folder, default_cache_dir
from common.data.sources import carve_decoded, check_dataset_name, open_unchecked
from common.data.splits import NO_EVAL_SPLIT, ImageData, check_classes, checked
from common.data_only import file_problem
from common.errors import UserError
from common.failures import why_not_written
from common.files import atomic_write

log = logging.getLogger(__name__)


def load_image_data(dataset: str = "cifar10", data_dir: str | None = None,
                    cache_dir: str | None = None, synthetic_train_size: int = 5000,
                    synthetic_test_size: int = 1000, synthetic_classes: int = 10, seed: int = 0,
                    image_size: int | None = None, val_fraction: float | None = None,
                    skip_bad: bool = False, interpolation: str = "bilinear") -> ImageData:
    """``open_source``'s dataset decoded: every image at ``image_size`` (shorter side resized with
    ``interpolation``, centre square cropped) or, with None, at the size all images share."""
    def build():
        source = open_unchecked(dataset, data_dir, cache_dir, synthetic_train_size,
                                synthetic_test_size, synthetic_classes, seed)
        return decode_source(checked(source, carving=bool(val_fraction)), image_size, skip_bad,
                             interpolation)
    if dataset == "synthetic" and data_dir is None:  # made again each time, never cached
        return carve_decoded(build(), val_fraction, seed)
    folder = cache_folder(cache_dir)
    if data_dir is not None:
        root, files, _ = detect_format(Path(data_dir).expanduser())
        key = f"dir-{_files_key(root, files())}"
    else:
        check_dataset_name(dataset)
        key = _hub_key(dataset)
    data = _cached(folder / cache_name(key, image_size, interpolation, skip_bad), build)
    if not val_fraction and not len(data.test_labels):  # cached by a run that carved its split
        where = data.source.split(" (cached at ")[0]
        raise UserError(f"{where} has no labelled evaluation split; {NO_EVAL_SPLIT}")
    return carve_decoded(data, val_fraction, seed)


def cached_hub_data(dataset: str, cache_dir: str | None, skip_bad: bool = False,
                    interpolation: str = "bilinear") -> ImageData | None:
    """The Hub dataset as an earlier run decoded and cached it at its own size, else None: with it
    a run neither asks the Hub nor opens the `datasets` cache."""
    folder = Path(cache_dir or default_cache_dir()).expanduser()  # as cache_folder wrote it
    path = folder / cache_name(_hub_key(dataset), None, interpolation, skip_bad)
    return _cached(path) if path.is_file() else None


def cache_name(key: str, image_size: int | None, interpolation: str, skip_bad: bool) -> str:
    """The cache file of the data ``key`` names, decoded at ``image_size`` (None: its own size).
    Images of mixed sizes are resized at their own size too (decode.DEFAULT_IMAGE_SIZE), so the
    interpolation is in every name but bilinear's, which keeps the names earlier runs wrote."""
    size = f"-{image_size}px" if image_size else ""
    resize = "" if interpolation == "bilinear" else f"-{interpolation}"
    return f"{key}{size}{resize}{'-skip' if skip_bad else ''}.pt"


def _hub_key(dataset: str) -> str:
    return f"hub-{HUB_REPOS.get(dataset, dataset).replace('/', '--')}"


def _cached(path: Path, build=None) -> ImageData | None:
    """Load the cache file at `path`, or build the data, save it there atomically and return it;
    without ``build`` (cached_hub_data), None: load_image_data then says so and rebuilds it.

    Processes that start together (DDP) all call this: the first to take the file lock downloads
    and decodes, the others wait for the lock and then read its cache. A lock, not a collective
    barrier, so a long first download is not cut short by the process group's timeout."""
    with FileLock(f"{path}.lock"):
        if path.exists():
            try:
                # Mapped, not read: pages come from the file as they are used, and a training
                # script that moves the data to its GPU keeps no host copy.
                return _saved(path)
            except Exception as e:  # a truncated or foreign file only costs a rebuild
                if build is not None:
                    log.warning("ignoring unreadable cache file %s (%s); rebuilding it", path,
                            file_problem(path.name, e))  # never torch's weights_only advice
        if build is None:
            return None
        data = build()
        cached = dataclasses.replace(data, source=f"{data.source} (cached at {path})")
        why = None
        try:
            with atomic_write(path) as f:
                try:
                    torch.save(vars(cached), f)
                except RuntimeError as e:  # torch.save's way of saying the disk is full
                    why = why_not_written(e, path)  # while the partial file still takes its space
                    raise
        except (OSError, RuntimeError) as e:
            log.warning("could not write cache file %s (%s); the next run decodes again", path,
                        why or why_not_written(e, path))
            return data
        return cached


def _saved(path: Path) -> ImageData:
    saved = torch.load(path, weights_only=True, mmap=True)
    if path.stem.endswith("-skip") and "skipped" not in saved:  # its --val-fraction would differ
        raise ValueError("written before the images skipped were recorded")
    check_classes(saved["train_labels"], saved["classes"], saved["source"])  # old one-class caches
    return ImageData(**saved)


def _files_key(root: Path, files: list[Path]) -> str:
    """A digest of where the files are and of their names, sizes and modification times."""
    digest = hashlib.sha256(os.fsencode(root.resolve()))  # fsencode: bytes, UTF-8 or not
    for file in sorted(files):
        st = file.stat()
        digest.update(b"\0" + os.fsencode(file.relative_to(root))
                      + f"\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]
