"""A local copy of a dataset (--data-dir): its format detected, then read as undecoded splits.

Any of:
  - a snapshot of a Hub repository (parquet files named train-*.parquet / test-*.parquet),
  - a ``DatasetDict.save_to_disk`` folder (has dataset_dict.json),
  - torchvision's ``cifar-10-batches-py`` / ``cifar-100-python`` folder, or its .tar.gz archive:
    read straight into uint8 (N, 3, 32, 32) tensors (TensorSplit), no image to decode; a batch
    that names more than numpy's arrays is refused before it can run code (common.data_only),
  - an image folder in the ImageNet layout: train/<class>/* and one of test/, val/, validation/ or
    valid/ with the same class folders; JPEG, PNG, WebP, GIF, BMP or TIFF of any size and mode.
"""

import io
import json
import os
import re
import shlex
import tarfile
from pathlib import Path

import numpy as np
import torch

from common.data.hub import from_hf
from common.data.options import cache_folder
from common.data.splits import EVAL_SPLITS, FileSplit, ImageSource, TensorSplit
from common.data_only import DataUnpickler, NotData
from common.errors import UserError, first_line

DATA_DIR_FORMATS = ("a Hub snapshot with train-*.parquet and test-*.parquet files, a save_to_disk "
                    "folder (dataset_dict.json), cifar-10-batches-py or cifar-100-python (folder "
                    "or .tar.gz), or an image folder train/<class>/* with test/<class>/* (or "
                    "val/, validation/)")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
# All a CIFAR batch names besides dicts, lists, strings and numbers: numpy arrays (numpy.core is
# numpy 1's name, numpy._core numpy 2's) and _codecs.encode, by which protocol 2 pickles bytes.
ARRAYS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
          ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}
# The dtypes of datasets' Value and Array features (pyarrow's types). It calls pa.__dict__[dtype]():
# any other name in a dataset's metadata would be called as it is read (show_versions prints).
DTYPES = re.compile(r"null|bool|u?int(8|16|32|64)|float(16|32|64)?|double|(large_)?(string|binary)"
                    r"|(string|binary)_view|date(32|64)|(time(32|64)|timestamp|duration)\[[^]]*\]"
                    r"|decimal(32|64|128|256)\(\d+, ?-?\d+\)")


def detect_format(data_dir: Path):
    """(root, a function listing the files the data is read from, a function of --cache-dir (None:
    the default, common.data.options.cache_folder) that opens them, parquet converted to Arrow
    there). Listing is for the decoded cache's key only, and costs a stat per file."""
    if not data_dir.exists():
        raise UserError(f"--data-dir {data_dir} does not exist; pass a folder holding "
                        f"{DATA_DIR_FORMATS}")
    if data_dir.is_file():
        if data_dir.name.endswith((".tar.gz", ".tgz")):
            return data_dir.parent, lambda: [data_dir], lambda cache: read_cifar_tar(data_dir)
        raise UserError(f"--data-dir {data_dir} is a file, not a folder or a .tar.gz; "
                        f"pass a folder holding {DATA_DIR_FORMATS}")
    if (data_dir / "dataset_dict.json").is_file():
        return data_dir, lambda: _all_files(data_dir), lambda cache: _read_saved(data_dir)
    for folder in (data_dir, data_dir / "cifar-10-batches-py", data_dir / "cifar-100-python"):
        if (folder / "batches.meta").is_file() or ((folder / "meta").is_file()
                                                   and (folder / "test").is_file()):
            return folder, lambda: _all_files(folder), lambda cache: read_cifar_pickles(folder)
    for archive in (data_dir / "cifar-10-python.tar.gz", data_dir / "cifar-100-python.tar.gz"):
        if archive.is_file():
            return detect_format(archive)
    if parquet := sorted(data_dir.rglob("*.parquet")):
        files = parquet + [readme for readme in [data_dir / "README.md"] if readme.is_file()]
        return data_dir, lambda: files, lambda cache: _read_parquet(data_dir, parquet, cache)
    if (data_dir / "train").is_dir():
        folders = [data_dir / "train",
                   *(data_dir / name for name in EVAL_SPLITS if (data_dir / name).is_dir())]
        return data_dir, lambda: [f for folder in folders for f in _all_files(folder)], \
            lambda cache: _read_image_folder(data_dir)
    if not any(data_dir.iterdir()):
        raise UserError(f"--data-dir {data_dir} is empty; put in it {DATA_DIR_FORMATS}")
    inside = [p for p in data_dir.iterdir() if not p.name.startswith(".")]
    if len(inside) == 1 and inside[0].is_dir() and _has_data(inside[0]):  # an archive's top folder
        raise UserError(f"--data-dir {data_dir} holds one folder, {inside[0].name}, with the data "
                        f"in it: pass --data-dir {inside[0]}")
    raise UserError(f"--data-dir {data_dir} holds no data in a known format; expected "
                    f"{DATA_DIR_FORMATS}")


def _has_data(folder: Path) -> bool:
    try:
        detect_format(folder)
        return True
    except UserError:
        return False


def _all_files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


def _read_saved(folder: Path) -> ImageSource:
    import datasets
    import pyarrow

    try:  # the features of each split's dataset_info.json and Arrow files, before datasets's load
        for info in sorted(folder.rglob("dataset_info.json")):
            _check_features(json.loads(info.read_text()), info.relative_to(folder))
        for table in sorted(folder.rglob("*.arrow")):
            with pyarrow.memory_map(str(table)) as f:
                _check_features(pyarrow.ipc.open_stream(f).schema, table.relative_to(folder))
        splits = datasets.load_from_disk(str(folder))
    except Exception as e:
        raise UserError(f"cannot read the save_to_disk folder {folder} ({first_line(e)}); "
                        f"save it again with DatasetDict.save_to_disk") from None
    return from_hf(splits, f"save_to_disk folder {folder}")


def _read_parquet(root: Path, files: list[Path], cache_dir: str | None) -> ImageSource:
    import datasets
    import pyarrow.parquet

    # The Hub names them train-00000-of-00001.parquet; other tools, e.g. cifar10_train.parquet.
    by_split = {split: [str(f) for f in files if re.search(rf"(^|[-_.]){split}[-_.]", f.name)]
                for split in ("train", *EVAL_SPLITS)}
    by_split = {split: found for split, found in by_split.items() if found}
    if "train" not in by_split:  # with no test-*.parquet, splits.checked asks for --val-fraction
        raise UserError(f"--data-dir {root} has parquet files but no train-*.parquet (found "
                        f"{', '.join(f.name for f in files[:4])}); add the train split")
    for file in (f for found in by_split.values() for f in found):
        try:  # reads the footer, so a truncated download is caught here, by name
            _check_features(pyarrow.parquet.read_schema(file), "its metadata")
        except Exception as e:
            raise UserError(f"cannot read parquet file {file} ({first_line(e)}); download it "
                            f"again") from None
    # load_dataset converts parquet to memory-mapped Arrow files, kept in our cache for the workers.
    arrow = cache_folder(cache_dir) / "arrow"
    try:
        splits = datasets.load_dataset("parquet", data_files=by_split, cache_dir=str(arrow))
    except Exception as e:
        raise UserError(f"cannot read the parquet files under {root} ({first_line(e)}); "
                        f"download them again") from None
    return from_hf(splits, f"parquet files under {root}", fallback_names=_readme_class_names(root))


def _check_features(info, where) -> None:
    """Raise ValueError where the features of ``info`` (a DatasetInfo's JSON, or an Arrow or parquet
    schema, whose metadata holds one) name a dtype that is none of DTYPES."""
    if not isinstance(info, dict):
        info = json.loads((info.metadata or {}).get(b"huggingface", b"{}")).get("info", {})
    todo = [info.get("features")]
    while todo:
        node = todo.pop()
        if isinstance(node, dict) and isinstance(dtype := node.get("dtype"), str) \
                and not DTYPES.fullmatch(dtype):
            raise ValueError(f"{where} names the dtype {dtype!r}, which is not one of pyarrow's "
                             f"types: datasets would call it")
        todo += node.values() if isinstance(node, dict) else node if isinstance(node, list) else []


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
                if isinstance(names, dict):
                    return [names[k] for k in sorted(names, key=int)]
                return list(names)
    return None


def _read_image_folder(root: Path) -> ImageSource:
    """root/train/<class>/* and root/<test, validation, valid or val>/<class>/*, as torchvision's
    ImageFolder: a class is a folder, its images any file with an image suffix in it or below it
    (``_images_in``). Its find_classes is not used: it takes hidden folders (.ipynb_checkpoints)
    for classes, and our errors below say more than its one."""
    def class_folders(split):
        return sorted(p.name for p in (root / split).iterdir()
                      if p.is_dir() and not p.name.startswith("."))
    # The first with class folders: a test/ of unlabelled images (as Kaggle's) is not evaluated on.
    evaluated = next((name for name in EVAL_SPLITS
                      if (root / name).is_dir() and class_folders(name)), None)
    if not (classes := class_folders("train")):
        raise UserError(f"image folder {root / 'train'} has no class folders; put each class's "
                        f"images in train/<class>/")
    if len(classes) == 1:
        _refuse_one_class(root, classes[0], evaluated, class_folders(f"train/{classes[0]}"))
    eval_classes = class_folders(evaluated) if evaluated else classes
    if classes != eval_classes:
        only_train = sorted(set(classes) - set(eval_classes))
        only_eval = sorted(set(eval_classes) - set(classes))
        missing = [f"{', '.join(names[:5])} missing from {split}/"
                   for names, split in ((only_train, evaluated), (only_eval, "train")) if names]
        raise UserError(f"image folder {root}: the class folders of train/ and {evaluated}/ "
                        f"differ ({'; '.join(missing)}); give both splits the same class folders")
    out = []
    for split in ("train", evaluated) if evaluated else ("train",):
        if not (files := _images_in(root / split, classes)):
            raise UserError(f"image folder {root / split} has no image files "
                            f"({', '.join(IMAGE_SUFFIXES)}); add the images")
        labels = torch.tensor([label for _, label in files], dtype=torch.int64)
        out.append(FileSplit([path for path, _ in files], labels))
    if evaluated is None:  # the error, unless --val-fraction carves one, is splits.checked's
        return ImageSource(out[0], None, classes, f"image folder {root} (no test/, val/ or "
                                                  f"validation/ folder of class folders)")
    return ImageSource(*out, classes, f"image folder {root}; evaluated on {evaluated}")


def _images_in(split: Path, classes: list[str]) -> list[tuple[str, int]]:
    """(path, label) of each image in split/<class>/ and below, as torchvision's make_dataset lists
    them, but no folder that holds the class folder or was met before is walked (a link to ..: no
    end) and only regular files are taken (a FIFO named x.png would block its reader)."""
    found = []
    for label, name in enumerate(classes):
        walked, seen = [], {os.stat(above)[1:3] for above in (split / name).absolute().parents}
        for folder, subfolders, files in os.walk(split / name, followlinks=True):
            if (where := os.stat(folder)[1:3]) in seen:  # its inode and device
                subfolders.clear()
                continue
            seen.add(where)
            walked.append((folder, sorted(files)))
        found += [(path, label) for folder, files in sorted(walked) for path in
                  (os.path.join(folder, file) for file in files)
                  if _is_image(path) and os.path.isfile(path)]
    return found


def _is_image(path: str) -> bool:
    """An image file by its suffix; hidden files (macOS's ._name.jpg) are none."""
    name = Path(path).name
    return name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith(".")


def _refuse_one_class(root: Path, only: str, evaluated: str | None, inner: list[str]) -> None:
    """One class folder is no classification problem (splits.checked refuses it for every source);
    here it is said what it holds instead (``inner``, its folders), and what to give."""
    folder = root / "train" / only
    if "train" in inner:  # a whole dataset one level down: give that folder
        raise UserError(f"image folder {root} has one class folder, train/{only}/, which holds a "
                        f"dataset of its own (train/{only}/train/); pass --data-dir {folder}")
    if inner:  # train/images/<class>/...: the classes are one level too deep
        # shell words, quoted where the names need it (spaces), the * left to the shell
        move = (f"mv {shlex.quote(str(folder))}/* {shlex.quote(str(root / 'train'))}/ && "
                f"rmdir {shlex.quote(str(folder))}")
        also = f" (and the same in {evaluated}/)" if evaluated else ""
        raise UserError(f"image folder {root} has one class, {only}, whose subfolders "
                        f"({', '.join(inner[:5])}{', ...' * (len(inner) > 5)}) look like the "
                        f"classes, one level too deep: move them up into train/, e.g. {move}{also}")
    raise UserError(f"image folder {root} has one class folder, train/{only}/: a classifier needs "
                    f"2 or more classes; put each class's images in its own train/<class>/")


def read_cifar_pickles(folder: Path) -> ImageSource:
    """torchvision's cifar-10-batches-py or cifar-100-python folder."""
    def read(name):
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path} is missing; download the complete CIFAR archive again")
        return _unpickle(path.read_bytes(), str(path))
    return _from_cifar_pickles(read, str(folder), cifar100=(folder / "meta").is_file())


def read_cifar_tar(archive: Path) -> ImageSource:
    """cifar-10-python.tar.gz or cifar-100-python.tar.gz, read in one pass without extracting."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = {member.name.split("/")[-1]: tar.extractfile(member).read()
                       for member in tar if member.isfile()}
    except (OSError, EOFError, tarfile.TarError) as e:  # zlib and gzip errors are OSError
        raise UserError(f"cannot read archive {archive} ({first_line(e)}); download it "
                        f"again") from None

    def read(name):
        if name not in members:
            raise UserError(f"archive {archive} has no member {name}; download the complete CIFAR "
                            f"archive again")
        return _unpickle(members[name], f"{archive}:{name}")
    return _from_cifar_pickles(read, str(archive), cifar100="meta" in members)


def _unpickle(blob: bytes, name: str) -> dict:
    try:  # the files were written by Python 2
        return DataUnpickler(io.BytesIO(blob), ARRAYS, encoding="latin1").load()
    except Exception as e:  # NotData: "it names posix.system, which is not data"
        why = str(e) if isinstance(e, NotData) else first_line(e)
        raise UserError(f"cannot unpickle {name} ({why}); download the CIFAR archive again"
                        ) from None


def _from_cifar_pickles(read, source: str, cifar100: bool) -> ImageSource:
    train_files = ["train"] if cifar100 else [f"data_batch_{i}" for i in range(1, 6)]
    test_files, meta = (["test"], "meta") if cifar100 else (["test_batch"], "batches.meta")
    names_key, labels_key = (("fine_label_names", "fine_labels") if cifar100
                             else ("label_names", "labels"))

    def split(files, name):
        batches = [read(file) for file in files]
        data = np.concatenate([b["data"] for b in batches])  # (N, 3072): R, G, B planes of 32x32
        labels = np.concatenate([np.asarray(b[labels_key]) for b in batches])
        return TensorSplit(torch.from_numpy(data.reshape(-1, 3, 32, 32)),
                           torch.from_numpy(labels.astype(np.int64)), f"{source} {name}")

    try:
        classes = [str(name) for name in read(meta)[names_key]]
        train, test = split(train_files, "train"), split(test_files, "test")
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source} is not in CIFAR's pickle format ({first_line(e)}); "
                        f"download the CIFAR archive again") from None
    return ImageSource(train, test, classes, f"CIFAR pickles from {source}; evaluated on test")
