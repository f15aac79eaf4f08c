"""torchvision's CIFAR-10/100 pickles, as the folder or the .tar.gz archive it downloads.

Read straight into uint8 (N, 3, 32, 32) tensors (TensorSplit): no image to decode. A batch that
names more than numpy's arrays is refused before it can run code (common.data_only).
"""

import io
import tarfile
from pathlib import Path

import numpy as np
import torch

from common.data.splits import ImageSource, TensorSplit
from common.errors import UserError, first_line
from common.data_only import DataUnpickler, NotData

# All a CIFAR batch names besides dicts, lists, strings and numbers: numpy arrays (numpy.core is
# numpy 1's name, numpy._core numpy 2's) and _codecs.encode, by which protocol 2 pickles bytes.
ARRAYS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
          ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


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
    members = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.isfile():
                    members[member.name.split("/")[-1]] = tar.extractfile(member).read()
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
        return TensorSplit(torch.from_numpy(data.reshape(-1, 3, 32, 32)),
                           torch.from_numpy(labels.astype(np.int64)), f"{source} {name}")

    try:
        classes = [str(name) for name in read(meta)[names_key]]
        train, test = split(train_files, "train"), split(test_files, "test")
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source} is not in CIFAR's pickle format ({first_line(e)}); "
                        f"download the CIFAR archive again") from None
    return ImageSource(train, test, classes, f"CIFAR pickles from {source}; evaluated on test")
