"""CIFAR-shaped image data as uint8 tensors: from the Hugging Face Hub, a local copy, or made on the spot.

    data = load_image_data("cifar10")                     # uoft-cs/cifar10 through `datasets`
    data = load_image_data(data_dir="~/data/cifar10")     # a local copy, format detected
    data = load_image_data("synthetic")                   # no download, learnable, deterministic

Every image is decoded once into one uint8 (N, 3, H, W) tensor per split, so augmentation can run
batched on tensors instead of PIL per sample (the input bottleneck the source articles hit). The
decoded tensors are cached under `default_cache_dir()`, one file per source, so a second run starts
in about a second and a cached Hub dataset loads with no network access at all.

Local copies (`data_dir`) can be any of:
  - a snapshot of the Hub repository (parquet files named train-*.parquet / test-*.parquet),
  - a `DatasetDict.save_to_disk` folder (has dataset_dict.json),
  - torchvision's `cifar-10-batches-py` / `cifar-100-python` folder, or its .tar.gz archive,
  - an image folder tree: train/<class>/*.png and test/<class>/*.png (png, jpg or jpeg).
"""

import dataclasses
import hashlib
import io
import logging
import os
import pickle
import re
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from filelock import FileLock

from common.checkpoint import atomic_write
from common.errors import UserError, first_line

log = logging.getLogger(__name__)

DATASETS = ("cifar10", "cifar100", "synthetic")
HUB_REPOS = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100"}
DATA_DIR_FORMATS = (
    "a Hub snapshot with train-*.parquet and test-*.parquet files, a save_to_disk folder "
    "(dataset_dict.json), cifar-10-batches-py or cifar-100-python (folder or .tar.gz), "
    "or an image folder tree train/<class>/*.png and test/<class>/*.png"
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclasses.dataclass(frozen=True)
class ImageData:
    """Both splits of an image classification dataset, decoded."""

    train_images: torch.Tensor  # uint8, (N, 3, H, W), CPU, contiguous
    train_labels: torch.Tensor  # int64, (N,)
    test_images: torch.Tensor  # uint8, (M, 3, H, W)
    test_labels: torch.Tensor  # int64, (M,)
    classes: list[str]  # class names, index = label
    source: str  # one human-readable line: where the data came from and where it is cached


def load_image_data(
    dataset: str = "cifar10",
    data_dir: str | None = None,
    cache_dir: str | None = None,
    synthetic_train_size: int = 5000,
    synthetic_test_size: int = 1000,
    synthetic_classes: int = 10,
    seed: int = 0,
) -> ImageData:
    """Load `dataset` (one of DATASETS), or the local copy in `data_dir`, which takes precedence.

    `seed` and the synthetic_* sizes only apply to dataset="synthetic", which is made on the
    spot and never cached.
    """
    if dataset not in DATASETS:
        raise UserError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if dataset == "synthetic":
        if data_dir is not None:
            raise UserError(f"--dataset synthetic takes no --data-dir (got {data_dir}); drop one of the two")
        return make_synthetic(synthetic_train_size, synthetic_test_size, synthetic_classes, seed)
    cache_dir = cache_dir or default_cache_dir()
    if data_dir is not None:
        return _load_data_dir(Path(data_dir).expanduser(), Path(cache_dir))
    return _load_hub(dataset, Path(cache_dir))


def default_cache_dir() -> str:
    """$CIFAR_CACHE_DIR if set, else $XDG_CACHE_HOME/multigpu-cifar, else ~/.cache/multigpu-cifar."""
    if os.environ.get("CIFAR_CACHE_DIR"):
        return os.environ["CIFAR_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "multigpu-cifar")


# ----------------------------------------------------------------------------------------------
# Cache: one torch.save file per source

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
            saved = torch.load(path, weights_only=True, mmap=True)
            return ImageData(**saved)
        except Exception as e:  # a truncated or foreign file only costs a rebuild
            log.warning("ignoring unreadable cache file %s (%s); rebuilding it", path, first_line(e))
    data = _checked(build())
    cached = dataclasses.replace(data, source=f"{data.source} (cached at {path})")
    try:
        with atomic_write(path) as f:
            torch.save(vars(cached), f)
    except OSError as e:
        log.warning("could not write cache file %s (%s); the next run decodes again", path, first_line(e))
        return data
    return cached


def _checked(data: ImageData) -> ImageData:
    """Refuse an empty split, or a label that names no class, before it is cached."""
    for split, images, labels in (("train", data.train_images, data.train_labels),
                                  ("test", data.test_images, data.test_labels)):
        if len(images) == 0:
            raise UserError(f"the {split} split of {data.source} is empty; provide a {split} split with images")
        bad = labels[(labels < 0) | (labels >= len(data.classes))]
        if len(bad):
            raise UserError(f"{data.source} has {split} label {bad[0].item()} but {len(data.classes)} class names "
                            f"({', '.join(data.classes[:5])}...); make every label a class index")
    return data


def _files_key(root: Path, files: list[Path]) -> str:
    """A digest of where the files are and of their names, sizes and modification times."""
    digest = hashlib.sha256(str(root.resolve()).encode())
    for file in sorted(files):
        st = file.stat()
        digest.update(f"\0{file.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# The Hugging Face Hub

def _load_hub(dataset: str, cache_dir: Path) -> ImageData:
    repo = HUB_REPOS[dataset]
    return _cached(cache_dir / f"hub-{repo.replace('/', '--')}.pt", lambda: _download(dataset, repo))


def _download(dataset: str, repo: str) -> ImageData:
    import datasets  # imported here: it takes a second, and only some sources need it

    offline = datasets.config.HF_HUB_OFFLINE or not _hub_reachable(datasets.config.HF_ENDPOINT)
    try:
        with _datasets_offline(offline):
            splits = datasets.load_dataset(repo)
    except Exception as e:  # offline, the datasets cache is all there is, and it fails in several ways
        if not (offline or isinstance(e, ConnectionError)):
            raise
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


def _from_hf(splits, source: str, fallback_names: list[str] | None = None) -> ImageData:
    """Decode a `datasets.DatasetDict` with train and test splits (the Hub schema) to tensors."""
    import datasets

    missing = {"train", "test"} - set(splits)
    if missing:
        raise UserError(f"{source} has splits {sorted(splits)}, not train and test; "
                        f"provide both splits")
    features = splits["train"].features
    # Parquet written without `datasets` metadata holds images as plain {bytes, path} structs.
    image_col = next((name for name, f in features.items() if isinstance(f, datasets.Image)), None) or next(
        (name for name, f in features.items() if isinstance(f, dict) and "bytes" in f), None)
    class_cols = [name for name, f in features.items() if isinstance(f, datasets.ClassLabel)]
    label_col = next((c for c in ("label", "fine_label", *class_cols) if c in features), None)
    if image_col is None or label_col is None:
        raise UserError(f"{source} has columns {dict(features)}, which lack an Image column or a label column "
                        f"(label, fine_label or a ClassLabel); provide CIFAR's schema: img (Image), label (ClassLabel)")
    out = []
    for split in ("train", "test"):
        # The Arrow view holds each image as its encoded bytes: no per-row Python objects from
        # datasets, and PIL decodes each PNG once.
        table = splits[split].with_format("arrow")
        images = _decode_images([(row["bytes"] or row["path"], f"{source}, {split} row {i}")
                                 for i, row in enumerate(table[image_col].to_pylist())])
        out += [images, torch.from_numpy(table[label_col].to_numpy().astype(np.int64))]
    if isinstance(features[label_col], datasets.ClassLabel):
        classes = features[label_col].names
    else:
        labels = torch.cat([out[1], out[3]])
        classes = fallback_names or [str(i) for i in range(int(labels.max()) + 1 if len(labels) else 0)]
    return ImageData(*out, classes=list(classes), source=source)


def _decode_images(items: list[tuple[object, str]]) -> torch.Tensor:
    """Decode (bytes or file path, name for errors) pairs with PIL into one uint8 (N, 3, H, W) tensor.

    One thread on purpose: a 32x32 PNG decodes in about 50 us, mostly under the GIL, and a
    thread pool was no faster. All of CIFAR-10 takes about 3 s.
    """
    batch = None
    for i, (blob, name) in enumerate(items):
        try:
            with PIL.Image.open(io.BytesIO(blob) if isinstance(blob, bytes) else blob) as image:
                pixels = np.asarray(image.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as e:  # PIL's errors for corrupt or truncated files
            raise UserError(f"cannot decode image {name} ({first_line(e)}); replace or remove it") from None
        if batch is None:
            batch = np.empty((len(items), *pixels.shape), dtype=np.uint8)
        if pixels.shape != batch.shape[1:]:
            raise UserError(f"image {name} is {pixels.shape[1]}x{pixels.shape[0]} but earlier images are "
                            f"{batch.shape[2]}x{batch.shape[1]}; resize all images to one size")
        batch[i] = pixels
    if batch is None:
        return torch.empty(0, 3, 0, 0, dtype=torch.uint8)
    return torch.from_numpy(batch).permute(0, 3, 1, 2).contiguous()


# ----------------------------------------------------------------------------------------------
# Local copies: detect the format, then read it

def _load_data_dir(data_dir: Path, cache_dir: Path) -> ImageData:
    if not data_dir.exists():
        raise UserError(f"--data-dir {data_dir} does not exist; pass a folder holding {DATA_DIR_FORMATS}")
    root, files, reader = _detect_format(data_dir)
    key = _files_key(root, files)
    return _cached(cache_dir / f"dir-{key}.pt", reader)


def _detect_format(data_dir: Path):
    """Return (root, files the data is read from, a function that reads them)."""
    if data_dir.is_file():
        if data_dir.name.endswith((".tar.gz", ".tgz")):
            return data_dir.parent, [data_dir], lambda: _read_cifar_tar(data_dir)
        raise UserError(f"--data-dir {data_dir} is a file, not a folder or a .tar.gz; "
                        f"pass a folder holding {DATA_DIR_FORMATS}")
    if (data_dir / "dataset_dict.json").is_file():
        return data_dir, _all_files(data_dir), lambda: _read_saved(data_dir)
    for folder in (data_dir, data_dir / "cifar-10-batches-py", data_dir / "cifar-100-python"):
        if (folder / "batches.meta").is_file() or (folder / "meta").is_file() and (folder / "test").is_file():
            return folder, _all_files(folder), lambda folder=folder: _read_cifar_pickles(folder)
    for archive in (data_dir / "cifar-10-python.tar.gz", data_dir / "cifar-100-python.tar.gz"):
        if archive.is_file():
            return data_dir, [archive], lambda archive=archive: _read_cifar_tar(archive)
    parquet = sorted(data_dir.rglob("*.parquet"))
    if parquet:
        files = parquet + [readme for readme in [data_dir / "README.md"] if readme.is_file()]
        return data_dir, files, lambda: _read_parquet(data_dir, parquet)
    if (data_dir / "train").is_dir():
        return data_dir, _all_files(data_dir / "train") + _all_files(data_dir / "test"), \
            lambda: _read_image_folder(data_dir)
    if not any(data_dir.iterdir()):
        raise UserError(f"--data-dir {data_dir} is empty; put in it {DATA_DIR_FORMATS}")
    raise UserError(f"--data-dir {data_dir} holds no data in a known format; expected {DATA_DIR_FORMATS}")


def _all_files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


def _read_saved(folder: Path) -> ImageData:
    import datasets

    try:
        splits = datasets.load_from_disk(str(folder))
    except Exception as e:
        raise UserError(f"cannot read the save_to_disk folder {folder} ({first_line(e)}); "
                        f"save it again with DatasetDict.save_to_disk") from None
    return _from_hf(splits, f"save_to_disk folder {folder}")


def _read_parquet(root: Path, files: list[Path]) -> ImageData:
    import datasets
    import pyarrow.parquet

    # The Hub names them train-00000-of-00001.parquet; other tools, e.g. cifar10_train.parquet.
    by_split = {split: [str(f) for f in files if re.search(rf"(^|[-_.]){split}[-_.]", f.name)]
                for split in ("train", "test")}
    if not by_split["train"] or not by_split["test"]:
        raise UserError(f"--data-dir {root} has parquet files but not both train-*.parquet and test-*.parquet "
                        f"(found {', '.join(f.name for f in files[:4])}); add the missing split")
    for file in by_split["train"] + by_split["test"]:
        try:  # reads the footer, so a truncated download is caught here, by name
            pyarrow.parquet.read_schema(file)
        except Exception as e:
            raise UserError(f"cannot read parquet file {file} ({first_line(e)}); download it again") from None
    # load_dataset converts parquet to Arrow files in a cache; they are only needed until decoded.
    with tempfile.TemporaryDirectory(prefix="parquet-") as tmp:
        try:
            splits = datasets.load_dataset("parquet", data_files=by_split, cache_dir=tmp)
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
        for column in ("label", "fine_label", *features):
            dtype = features.get(column)
            if isinstance(dtype, dict) and "class_label" in dtype:
                names = dtype["class_label"]["names"]
                return [names[k] for k in sorted(names, key=int)] if isinstance(names, dict) else list(names)
    return None


def _read_cifar_pickles(folder: Path) -> ImageData:
    """torchvision's cifar-10-batches-py or cifar-100-python folder."""
    def read(name):
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path} is missing; download the complete CIFAR archive again")
        return _unpickle(path.read_bytes(), str(path))
    return _from_cifar_pickles(read, str(folder), cifar100=(folder / "meta").is_file())


def _read_cifar_tar(archive: Path) -> ImageData:
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


def _from_cifar_pickles(read, source: str, cifar100: bool) -> ImageData:
    if cifar100:
        train_files, test_files = ["train"], ["test"]
        meta, names_key, labels_key = "meta", "fine_label_names", "fine_labels"
    else:
        train_files, test_files = [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]
        meta, names_key, labels_key = "batches.meta", "label_names", "labels"

    def split(files):
        batches = [read(name) for name in files]
        data = np.concatenate([b["data"] for b in batches])  # (N, 3072): R, G, B planes of 32x32
        labels = np.concatenate([np.asarray(b[labels_key]) for b in batches])
        return torch.from_numpy(data.reshape(-1, 3, 32, 32)), torch.from_numpy(labels.astype(np.int64))

    try:
        classes = [str(name) for name in read(meta)[names_key]]
        train, test = split(train_files), split(test_files)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source} is not in CIFAR's pickle format ({first_line(e)}); "
                        f"download the CIFAR archive again") from None
    return ImageData(*train, *test, classes=classes, source=f"CIFAR pickles from {source}")


def _read_image_folder(root: Path) -> ImageData:
    """root/train/<class>/*.png and root/test/<class>/*.png, like torchvision's ImageFolder."""
    def class_folders(split):
        folder = root / split
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    classes, test_classes = class_folders("train"), class_folders("test")
    if not classes or classes != test_classes:
        raise UserError(f"image folder {root} must have train/<class>/ and test/<class>/ with the same class "
                        f"folders; found train: {classes[:10]}, test: {test_classes[:10]}")
    out = []
    for split in ("train", "test"):
        files = [(path, label) for label, name in enumerate(classes)
                 for path in sorted((root / split / name).iterdir()) if path.suffix.lower() in IMAGE_SUFFIXES]
        if not files:
            raise UserError(f"image folder {root / split} has no .png, .jpg or .jpeg files; add the images")
        out += [_decode_images([(str(path), str(path)) for path, _ in files]),
                torch.tensor([label for _, label in files], dtype=torch.int64)]
    return ImageData(*out, classes=classes, source=f"image folder {root}")


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
