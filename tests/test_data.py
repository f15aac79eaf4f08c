"""common/data/ (sources, formats, decode, cache, synthetic): every source format decodes to the
same tensors, caches are reused and invalidated, synthetic data is deterministic, an image of
another size is resized, and bad input ends in one line naming the culprit (or, with skip_bad, is
left out with a warning naming it). Every resize takes the interpolation it is given, bicubic as
torchvision's on both loaders, and the decode cache is keyed by it.

The fixtures write one small dataset (3 named classes, 24 train / 12 test random 32x32 images)
in every format the loader reads, the way the real tools write them.
"""

import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import datasets
import PIL.Image
import pyarrow
import pyarrow.parquet
import pytest
import torch
from helpers import Payload, tmpfs
from torchvision.transforms import v2

from bench.tools import write_cifar_pickles
from common.data import decode, hub, options
from common.data.cache import cache_name, cached_hub_data, load_image_data
from common.data.images import INTERPOLATIONS, fit
from common.data.splits import ImageData, TensorSplit
from common.data.synthetic import make_synthetic
from common.data.transform import BatchTransform, resized_crop_box, resized_crop_boxes, sample_seed
from common.data.workers import SampleImages
from common.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["cat", "dog", "frog"]


# ----------------------------------------------------------------------------------------------
# Fixtures: one dataset, written in every format

@pytest.fixture(scope="session")
def source() -> ImageData:
    gen = torch.Generator().manual_seed(0)

    def split(n):
        images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen)
        return images, torch.randperm(n, generator=gen) % len(CLASSES)
    return ImageData(*split(24), *split(12), classes=CLASSES, source="test fixture")


def png(image: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def hub_splits(source: ImageData, label_column: str = "label") -> datasets.DatasetDict:
    """The schema of uoft-cs/cifar10 (img, label) or, with label_column="fine_label", of cifar100."""
    features = {"img": datasets.Image(), label_column: datasets.ClassLabel(names=source.classes)}
    if label_column == "fine_label":
        features["coarse_label"] = datasets.ClassLabel(names=["animal"])

    def split(images, labels):
        columns = {"img": [{"bytes": png(image), "path": None} for image in images], label_column: labels.tolist()}
        if label_column == "fine_label":
            columns["coarse_label"] = [0] * len(labels)
        return datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    return datasets.DatasetDict(train=split(source.train_images, source.train_labels),
                                test=split(source.test_images, source.test_labels))


def write_image_folder(root: Path, source: ImageData) -> None:
    splits = {"train": (source.train_images, source.train_labels), "test": (source.test_images, source.test_labels)}
    for split, (images, labels) in splits.items():
        for name in source.classes:
            (root / split / name).mkdir(parents=True)
        for i, (image, label) in enumerate(zip(images, labels)):
            (root / split / source.classes[label] / f"{i:03d}.png").write_bytes(png(image))


@pytest.fixture(scope="session")
def formats(source, tmp_path_factory) -> dict[str, Path]:
    """The data_dir to pass for each format."""
    root = tmp_path_factory.mktemp("formats")
    splits = hub_splits(source)
    for split in ("train", "test"):
        path = root / "parquet" / "plain_text" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        splits[split].to_parquet(path)
    splits.save_to_disk(root / "save_to_disk")
    write_cifar_pickles(root / "cifar-10-batches-py", source, cifar100=False)
    write_cifar_pickles(root / "c100" / "cifar-100-python", source, cifar100=True)
    (root / "tar").mkdir()
    with tarfile.open(root / "tar" / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(root / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    write_image_folder(root / "image_folder", source)
    return {
        "parquet": root / "parquet",
        "save_to_disk": root / "save_to_disk",
        "cifar10_pickles": root / "cifar-10-batches-py",  # the folder itself
        "cifar100_pickles": root / "c100",  # the folder that holds cifar-100-python
        "cifar10_tar_in_dir": root / "tar",
        "cifar10_tar_file": root / "tar" / "cifar-10-python.tar.gz",
        "image_folder": root / "image_folder",
    }


def copy_of(path: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy" / path.name
    target.parent.mkdir()
    if path.is_dir():
        shutil.copytree(path, target)
    else:
        shutil.copy(path, target)
    return target


def assert_same(loaded: ImageData, expected: ImageData) -> None:
    for name in ("train_images", "train_labels", "test_images", "test_labels"):
        got, want = getattr(loaded, name), getattr(expected, name)
        assert got.dtype == want.dtype and got.is_contiguous(), name
        assert torch.equal(got, want), name
    assert loaded.classes == expected.classes


def error_of(**kwargs) -> str:
    with pytest.raises(UserError) as error:
        load_image_data(**kwargs)
    assert "\n" not in error.value.message
    return error.value.message


# ----------------------------------------------------------------------------------------------
# Every format gives the same tensors

@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk", "cifar10_pickles", "cifar100_pickles",
                                 "cifar10_tar_in_dir", "cifar10_tar_file", "image_folder"])
def test_each_format_loads_the_source_bitwise(fmt, formats, source, tmp_path):
    expected = source
    if fmt == "image_folder":  # files are listed class by class, in the order they were written
        train, test = source.train_labels.argsort(stable=True), source.test_labels.argsort(stable=True)
        expected = ImageData(source.train_images[train], source.train_labels[train],
                             source.test_images[test], source.test_labels[test], CLASSES, "")
    loaded = load_image_data(data_dir=str(formats[fmt]), cache_dir=str(tmp_path))
    assert_same(loaded, expected)
    assert str(tmp_path) in loaded.source
    assert_same(load_image_data(data_dir=str(formats[fmt]), cache_dir=str(tmp_path)), expected)  # from the cache


def test_parquet_without_features_metadata_takes_names_from_the_readme(formats, source, tmp_path):
    snapshot = tmp_path / "snapshot"
    for split in ("train", "test"):  # as written by pyarrow or pandas: no `datasets` metadata
        table = pyarrow.parquet.read_table(formats["parquet"] / "plain_text" / f"{split}-00000-of-00001.parquet")
        (snapshot / "plain_text").mkdir(parents=True, exist_ok=True)
        pyarrow.parquet.write_table(table.replace_schema_metadata(None),
                                    snapshot / "plain_text" / f"{split}-00000-of-00001.parquet")
    without_readme = load_image_data(data_dir=str(snapshot), cache_dir=str(tmp_path / "cache"))
    assert without_readme.classes == ["0", "1", "2"]
    assert torch.equal(without_readme.train_images, source.train_images)
    names = "".join(f"          '{i}': {name}\n" for i, name in enumerate(CLASSES))
    (snapshot / "README.md").write_text(
        "---\ndataset_info:\n  config_name: plain_text\n  features:\n  - name: img\n    dtype: image\n"
        f"  - name: label\n    dtype:\n      class_label:\n        names:\n{names}---\n# CIFAR\n")
    assert_same(load_image_data(data_dir=str(snapshot), cache_dir=str(tmp_path / "cache")), source)


# ----------------------------------------------------------------------------------------------
# The Hub path and the caches

@pytest.fixture
def fake_hub(monkeypatch, source):
    """load_dataset answers with the fixture in the Hub's schema; records the calls."""
    calls = []

    def load_dataset(repo, *args, **kwargs):
        calls.append((repo, datasets.config.HF_HUB_OFFLINE))
        return hub_splits(source, "fine_label" if repo.endswith("cifar100") else "label")
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(hub, "_hub_reachable", lambda endpoint: True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    return calls


@pytest.mark.parametrize("dataset, repo", [("cifar10", "uoft-cs/cifar10"), ("cifar100", "uoft-cs/cifar100")])
def test_hub_dataset_is_decoded_then_served_from_our_cache(dataset, repo, fake_hub, source, tmp_path):
    first = load_image_data(dataset, cache_dir=str(tmp_path))
    assert_same(first, source)
    assert fake_hub == [(repo, False)]
    assert repo in first.source and str(tmp_path) in first.source
    second = load_image_data(dataset, cache_dir=str(tmp_path))
    assert fake_hub == [(repo, False)]  # no second call: no network needed
    assert_same(second, source)
    assert second.source == first.source


def test_unreachable_hub_falls_back_to_the_datasets_cache_at_once(fake_hub, monkeypatch, source, tmp_path):
    monkeypatch.setattr(hub, "_hub_reachable", lambda endpoint: False)
    assert_same(load_image_data("cifar10", cache_dir=str(tmp_path)), source)
    assert fake_hub == [("uoft-cs/cifar10", True)]  # load_dataset ran in offline mode
    assert datasets.config.HF_HUB_OFFLINE is False  # and the flag was restored


def test_unreadable_cache_file_is_rebuilt_with_a_warning(fake_hub, source, tmp_path, caplog):
    load_image_data("cifar10", cache_dir=str(tmp_path))
    (cache_file,) = tmp_path.glob("*.pt")
    cache_file.write_bytes(cache_file.read_bytes()[:1000])  # as if a foreign writer had crashed
    assert_same(load_image_data("cifar10", cache_dir=str(tmp_path)), source)
    assert len(fake_hub) == 2
    assert "ignoring unreadable cache file" in caplog.text
    assert_same(load_image_data("cifar10", cache_dir=str(tmp_path)), source)
    assert len(fake_hub) == 2  # the rebuilt file is good
    # common.files.atomic_write writes .tmp-<name>, then renames it: nothing but the cache and its lock
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache_file.name, f"{cache_file.name}.lock"]


def test_a_cache_file_carrying_code_is_rebuilt_and_runs_nothing(fake_hub, source, tmp_path, caplog):
    """The decoded cache a pickle whose __reduce__ would make a marker (torch.save's zip, as the cache is):
    refused by torch's weights_only loader, said in the warning by the name it refused (never torch's advice
    to load it with weights_only=False), and rebuilt."""
    load_image_data("cifar10", cache_dir=str(tmp_path))
    (cache_file,) = tmp_path.glob("*.pt")
    torch.save({"train_images": Payload(tmp_path / "marker")}, cache_file)
    assert_same(load_image_data("cifar10", cache_dir=str(tmp_path)), source)
    assert not (tmp_path / "marker").exists() and len(fake_hub) == 2
    assert (f"ignoring unreadable cache file {cache_file} ({cache_file.name} could run code: it names posix.system, "
            f"which is not data); rebuilding it") in caplog.text
    assert "weights_only" not in caplog.text


def test_data_dir_cache_is_reused_until_a_file_changes(formats, tmp_path, monkeypatch):
    folder = copy_of(formats["image_folder"], tmp_path)
    cache = str(tmp_path / "cache")
    decoded = []  # number of images per decoding pass (one per split)
    decode_split = decode.decode_split
    monkeypatch.setattr(decode, "decode_split",
                        lambda split, *args: decoded.append(len(split)) or decode_split(split, *args))
    before = load_image_data(data_dir=str(folder), cache_dir=cache)
    assert_same(load_image_data(data_dir=str(folder), cache_dir=cache), before)
    assert decoded == [24, 12]
    changed = sorted((folder / "train" / "cat").iterdir())[0]
    changed.write_bytes(png(torch.zeros(3, 32, 32, dtype=torch.uint8)))
    stat = changed.stat()  # some filesystems keep mtime in whole seconds
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = load_image_data(data_dir=str(folder), cache_dir=cache)
    assert decoded == [24, 12, 24, 12]
    assert torch.equal(after.train_images[0], torch.zeros(3, 32, 32, dtype=torch.uint8))
    assert torch.equal(after.train_images[1:], before.train_images[1:])


def test_a_full_disk_for_the_cache_is_one_warning_and_the_run_goes_on(formats, source, tmp_path, caplog):
    """A real full disk (a 1 MB tmpfs) under the cache folder: the data still loads, one warning
    names the file and the cause, no partial file is left, and the cache already there is intact."""
    with tmpfs(tmp_path / "disk", "1m") as cache:
        earlier = load_image_data(data_dir=str(formats["image_folder"]), cache_dir=str(cache))
        (earlier_file,) = cache.glob("*.pt")
        before = earlier_file.read_bytes()
        (cache / "filler").write_bytes(b"\0" * (shutil.disk_usage(cache).free - (16 << 10)))
        caplog.clear()
        loaded = load_image_data(data_dir=str(formats["cifar10_pickles"]), cache_dir=str(cache))
        assert_same(loaded, source)  # the run goes on without a cache
        assert "cached at" not in loaded.source
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        (warning,) = warnings
        assert warning.startswith(f"could not write cache file {cache}/dir-") and "\n" not in warning, warning
        assert warning.endswith(" (no space left on the device); the next run decodes again"), warning
        # nothing half-written (no .tmp-<name> of common.files.atomic_write), the earlier cache whole
        assert sorted(p.name for p in cache.iterdir() if p.suffix != ".lock") == sorted([earlier_file.name, "filler"])
        assert earlier_file.read_bytes() == before
        again = load_image_data(data_dir=str(formats["image_folder"]), cache_dir=str(cache))
        assert_same(again, earlier)
        assert again.source == earlier.source


def test_default_cache_dir_follows_the_environment(monkeypatch):
    monkeypatch.setenv("CIFAR_CACHE_DIR", "/data/cache")
    assert options.default_cache_dir() == "/data/cache"
    monkeypatch.delenv("CIFAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert options.default_cache_dir() == "/xdg/multigpu-cifar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert options.default_cache_dir() == os.path.expanduser("~/.cache/multigpu-cifar")


# ----------------------------------------------------------------------------------------------
# Synthetic data

def test_synthetic_is_deterministic_and_shaped_like_cifar():
    a, b = make_synthetic(200, 50, num_classes=10, seed=3), make_synthetic(200, 50, num_classes=10, seed=3)
    assert_same(a, b)
    assert a.train_images.shape == (200, 3, 32, 32) and a.test_images.shape == (50, 3, 32, 32)
    assert a.train_images.dtype == torch.uint8 and a.train_labels.dtype == torch.int64
    assert a.classes == [f"class{i}" for i in range(10)]
    assert set(a.train_labels.tolist()) == set(a.test_labels.tolist()) == set(range(10))
    other = make_synthetic(200, 50, num_classes=10, seed=4)
    assert not torch.equal(a.train_images, other.train_images)
    assert torch.equal(make_synthetic(300, 50, seed=3).test_images, a.test_images)  # test split fixed by seed
    assert 40 < a.train_images.float().mean() < 216 and a.train_images.float().std() > 30


def test_load_image_data_makes_synthetic_data_from_its_arguments(tmp_path):
    data = load_image_data("synthetic", cache_dir=str(tmp_path), synthetic_train_size=64,
                           synthetic_test_size=16, synthetic_classes=4, seed=1)
    assert len(data.train_images) == 64 and len(data.test_labels) == 16 and len(data.classes) == 4
    assert not list(tmp_path.iterdir())  # never cached
    assert "--synthetic-test-size" in error_of(dataset="synthetic", synthetic_test_size=3)


# ----------------------------------------------------------------------------------------------
# Errors: one line, naming the thing and what to do

@pytest.mark.parametrize("offline", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["HF_HUB_OFFLINE", "unreachable Hub"])
def test_offline_without_cache_fails_fast_in_one_line(tmp_path, offline):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_HOME=str(tmp_path / "hf"), **offline)
    # The clock starts after the imports, which alone take seconds on a busy 2-core machine.
    code = ("import sys, time; from common.data.cache import load_image_data\n"
            "start = time.monotonic()\n"
            "try:\n"
            f"    load_image_data('cifar10', cache_dir={str(tmp_path / 'c')!r})\n"
            "finally:\n"
            "    print(f'{time.monotonic() - start:.2f}')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert float(result.stdout) < 10, "no minute of retries"
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "cifar10" in line and "--data-dir" in line and "--dataset synthetic" in line


def test_truncated_parquet_is_named(formats, tmp_path):
    snapshot = copy_of(formats["parquet"], tmp_path)
    broken = snapshot / "plain_text" / "train-00000-of-00001.parquet"
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    assert str(broken) in error_of(data_dir=str(snapshot), cache_dir=str(tmp_path / "cache"))


def test_truncated_tar_gz_is_named(formats, tmp_path):
    archive = copy_of(formats["cifar10_tar_file"], tmp_path)
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    assert str(archive) in error_of(data_dir=str(archive), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_bad_image_in_image_folder_is_named(damage, formats, tmp_path):
    folder = copy_of(formats["image_folder"], tmp_path)
    broken = sorted((folder / "test" / "dog").iterdir())[0]
    if damage == "garbage":
        broken.write_bytes(b"not a png at all")
    else:
        broken.write_bytes(broken.read_bytes()[:200])
    message = error_of(data_dir=str(folder), cache_dir=str(tmp_path / "cache"))
    assert str(broken) in message and "--bad-images skip" in message


def test_bad_image_is_left_out_with_skip_bad(formats, source, tmp_path, caplog):
    folder = copy_of(formats["image_folder"], tmp_path)
    broken = sorted((folder / "test" / "dog").iterdir())[0]
    broken.write_bytes(b"not a png at all")
    loaded = load_image_data(data_dir=str(folder), cache_dir=str(tmp_path / "cache"), skip_bad=True)
    assert len(loaded.test_labels) == len(source.test_labels) - 1
    dog = CLASSES.index("dog")
    assert loaded.test_labels.tolist().count(dog) == source.test_labels.tolist().count(dog) - 1
    assert str(broken) in caplog.text and "--bad-images skip" in caplog.text


def test_images_of_other_sizes_are_resized_and_centre_cropped_to_the_size_of_the_others(formats, tmp_path):
    """Images need not share a size: a 16x24 one and a 24x16 one among 32x32 ones are resized (the
    shorter side to 32, so 2x) and their centre squares cut out. Each is 200 in its centre and has
    4-pixel borders of 0 and 100 at the ends of its long side, which the centre crop leaves out but
    for the blend of the 2x bilinear resize in its first and last column (row): 3/4 of the centre's
    200 and 1/4 of the border. A crop off the centre, or a squeeze without a crop, shows a border."""
    folder = copy_of(formats["image_folder"], tmp_path)
    wide = torch.full((3, 16, 24), 200, dtype=torch.uint8)
    wide[..., :4], wide[..., 20:] = 0, 100
    images = {"dog": wide, "cat": wide.transpose(1, 2)}  # landscape, portrait
    for name, image in images.items():
        sorted((folder / "test" / name).iterdir())[0].write_bytes(png(image.contiguous()))
    loaded = load_image_data(data_dir=str(folder), cache_dir=str(tmp_path / "cache"))
    assert loaded.test_images.shape[1:] == (3, 32, 32)
    for name in images:
        fitted = loaded.test_images[loaded.test_labels.tolist().index(CLASSES.index(name))].int()
        if name == "cat":
            fitted = fitted.transpose(1, 2)  # its long side along the columns too
        assert torch.equal(fitted[..., 1:-1], torch.full((3, 32, 30), 200)), name
        assert (fitted[..., 0] - 150).abs().max() <= 1 and (fitted[..., -1] - 175).abs().max() <= 1, name


@pytest.mark.parametrize("damage", ["missing", "not a pickle"])
def test_bad_cifar_batch_is_named(damage, formats, tmp_path):
    folder = copy_of(formats["cifar10_pickles"], tmp_path)
    if damage == "missing":
        (folder / "data_batch_3").unlink()
    else:
        (folder / "data_batch_3").write_bytes(b"\x80\x02garbage")
    assert str(folder / "data_batch_3") in error_of(data_dir=str(folder), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("form", ["cifar10_pickles", "cifar10_tar_file"])
def test_a_cifar_batch_carrying_code_is_refused_and_runs_nothing(form, formats, tmp_path):
    """data_batch_1 a batch whose images are an object with a __reduce__ that would create a marker
    file, in the folder and in the .tar.gz: refused in one line naming the file, before anything of
    it runs (pickle.loads would run it, and the run would then train on the other batches)."""
    marker, batch = tmp_path / "marker", pickle.dumps({"data": Payload(tmp_path / "marker"),
                                                       "labels": [0]}, protocol=2)
    folder = copy_of(formats["cifar10_pickles"], tmp_path)
    (folder / "data_batch_1").write_bytes(batch)
    named = folder / "data_batch_1"
    if form == "cifar10_tar_file":
        named = tmp_path / "cifar-10-python.tar.gz"
        with tarfile.open(named, "w:gz") as tar:
            tar.add(folder, arcname="cifar-10-batches-py")
        named = f"{named}:data_batch_1"
    message = error_of(data_dir=str(folder if form == "cifar10_pickles" else tmp_path / "cifar-10-python.tar.gz"),
                       cache_dir=str(tmp_path / "cache"))
    assert message == (f"cannot unpickle {named} (it names posix.system, which is not data); download the "
                       f"CIFAR archive again")
    assert not marker.exists()


def plant_features(path: Path, label: dict) -> None:
    """The label column's feature in the features metadata of ``path`` (dataset_info.json, or the schema of an
    Arrow or parquet file) made ``label``, the file written again in its own format."""
    if path.suffix == ".json":
        info = json.loads(path.read_text())
        info["features"]["label"] = label
        return path.write_text(json.dumps(info))
    table = (pyarrow.parquet.read_table(path) if path.suffix == ".parquet"
             else pyarrow.ipc.open_stream(path.read_bytes()).read_all())  # no map: the file is rewritten
    metadata = json.loads(table.schema.metadata[b"huggingface"])
    metadata["info"]["features"]["label"] = label
    table = table.replace_schema_metadata({b"huggingface": json.dumps(metadata).encode()})
    if path.suffix == ".parquet":
        return pyarrow.parquet.write_table(table, path)
    with pyarrow.ipc.new_stream(str(path), table.schema) as writer:
        writer.write_table(table)


# pyarrow.show_versions, called by name: the dtype of a Value or an array, made with pa.__dict__[dtype]()
CALLED = {"Value": {"dtype": "show_versions", "_type": "Value"},
          "Array2D": {"shape": [1, 1], "dtype": "show_versions", "_type": "Array2D"}}


@pytest.mark.parametrize("name", list(CALLED))
@pytest.mark.parametrize("where", ["save_to_disk/train/dataset_info.json", "save_to_disk/test/*.arrow",
                                   "parquet/plain_text/train-*.parquet"])
def test_a_dataset_whose_features_name_a_function_is_refused_and_calls_nothing(where, name, formats, tmp_path,
                                                                               capfd):
    """Features metadata that makes datasets call a pyarrow function by name (show_versions prints its table):
    refused in one line naming the file and the name, before datasets reads it; datasets' own read of the
    same files calls it, the plant being real."""
    kind, path = where.split("/", 1)
    folder = copy_of(formats[kind], tmp_path)
    planted = next(folder.glob(path))
    plant_features(planted, CALLED[name])
    message = error_of(data_dir=str(folder), cache_dir=str(tmp_path / "cache"))
    named = "the dtype 'show_versions', which is not one of pyarrow's types: datasets would call it"
    if kind == "parquet":
        assert message == f"cannot read parquet file {planted} (ValueError: its metadata names {named}); download it again"
    else:
        assert message == (f"cannot read the save_to_disk folder {folder} (ValueError: {planted.relative_to(folder)} "
                           f"names {named}); save it again with DatasetDict.save_to_disk")
    assert "pyarrow version info" not in capfd.readouterr().out
    with contextlib.suppress(Exception):
        if kind == "parquet":
            datasets.load_dataset("parquet", data_files=str(planted), cache_dir=str(tmp_path / "hf"))
        else:
            datasets.load_from_disk(str(folder))
    assert "pyarrow version info" in capfd.readouterr().out


def test_data_dir_and_dataset_errors(tmp_path):
    assert "does not exist" in error_of(data_dir=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "is empty" in error_of(data_dir=str(tmp_path / "empty"))
    (tmp_path / "other" / "stuff").mkdir(parents=True)
    (tmp_path / "other" / "notes.txt").write_text("hello")
    assert "no data in a known format" in error_of(data_dir=str(tmp_path / "other"))
    message = error_of(dataset="not a/name!")  # a bare name, e.g. food101, may be a Hub id
    assert "'not a/name!'" in message and "cifar10, cifar100, synthetic" in message
    assert "--data-dir" in error_of(dataset="synthetic", data_dir=str(tmp_path))


def test_image_folder_with_different_test_classes_is_refused(formats, tmp_path):
    folder = copy_of(formats["image_folder"], tmp_path)
    (folder / "test" / "frog").rename(folder / "test" / "toad")
    assert "toad" in error_of(data_dir=str(folder), cache_dir=str(tmp_path / "cache"))


def test_processes_that_start_together_decode_once(tmp_path):
    """Several processes (as under DDP) ask at once: one builds the cache, the others read it."""
    import multiprocessing

    # Forked: each process opens the cache and its lock itself, as a spawned one would, without
    # importing torch again (5 s of CPU a process)
    context = multiprocessing.get_context("fork")
    folder = tmp_path / "cache"
    folder.mkdir()  # as cache_folder makes it
    builds = context.Manager().list()
    with context.Pool(3) as pool:
        results = pool.starmap(_build_through_cache, [(str(folder), builds)] * 3)
    assert len(builds) == 1 and len(set(results)) == 1
    # one cache and its lock: no .tmp-<name> left by common.files.atomic_write
    assert sorted(p.name for p in folder.iterdir()) == ["shared.pt", "shared.pt.lock"]


def _build_through_cache(folder, builds):
    # A forked child of a process whose OpenMP threads have run (torch's earlier ops in this pytest
    # process) hangs in its first parallel op: GNU OpenMP is not fork-safe. One thread, no pool.
    torch.set_num_threads(1)
    from common.data import cache, synthetic

    def build():
        builds.append(1)
        time.sleep(1)  # long enough for the others to find the cache missing and wait
        return synthetic.make_synthetic(20, 10, num_classes=2, seed=0)

    data = cache._cached(Path(folder) / "shared.pt", build)
    return int(data.train_images.sum())


# ----------------------------------------------------------------------------------------------
# Data that is no classification problem, cache folders that cannot be written

def test_parquet_whose_labels_are_all_one_value_is_refused(source, tmp_path):
    # Plain integer labels, no ClassLabel: the class names are 0 .. the largest label.
    for split in ("train", "test"):
        table = datasets.Dataset.from_dict({"img": [{"bytes": png(source.train_images[0]), "path": None}] * 4,
                                            "label": [2] * 4})
        table.to_parquet(tmp_path / "data" / f"{split}-00000-of-00001.parquet")
    message = error_of(data_dir=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"))
    assert message == (f"parquet files under {tmp_path / 'data'} has training labels all 2 (2, one of 3 "
                       f"class names): a classifier needs 2 or more classes; give it images of two or more "
                       f"classes")


def test_a_data_dir_one_level_above_the_data_names_the_folder_to_give(formats, tmp_path):
    outer = tmp_path / "download"
    shutil.copytree(formats["image_folder"], outer / "flowers")
    assert error_of(data_dir=str(outer), cache_dir=str(tmp_path / "cache")) == (
        f"--data-dir {outer} holds one folder, flowers, with the data in it: pass --data-dir {outer / 'flowers'}")


def test_a_cache_folder_that_cannot_be_made_is_one_line(formats, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CIFAR_CACHE_DIR", str(tmp_path / "file" / "cache"))
    message = error_of(data_dir=str(formats["image_folder"]))
    assert message.startswith(f"the cache folder {tmp_path / 'file' / 'cache'} (CIFAR_CACHE_DIR) cannot be "
                              f"written in (")
    assert message.endswith("); pass --cache-dir DIR or set CIFAR_CACHE_DIR to a folder you can write in")
    assert error_of(data_dir=str(formats["image_folder"]), cache_dir=str(tmp_path / "file")).startswith(
        f"--cache-dir {tmp_path / 'file'} cannot be written in (")


# ----------------------------------------------------------------------------------------------
# Interpolation: pretrained weights' bilinear or bicubic, in every resize of both loaders

def test_the_device_path_s_bicubic_crops_are_torchvisions_bicubic_resized_crop_of_the_same_box():
    """BatchTransform's random-resized crop with bicubic is, for each image, torchvision's
    antialiased bicubic resized_crop (what the workers path calls) of the box the batch's generator
    drew, flipped when it drew a flip, in float. The tolerance is float32 rounding: the same
    weights summed in another order, measured at 3e-4 of 255 (grid_sample's bicubic is up to 46
    off); bilinear, of the same boxes, differs by far more."""
    batch = torch.randint(0, 256, (24, 3, 96, 96), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1))
    out = BatchTransform([0, 0, 0], [1, 1, 1], interpolation="bicubic").train(batch, seed=(3, 7))
    bilinear = BatchTransform([0, 0, 0], [1, 1, 1]).train(batch, seed=(3, 7))
    generator = torch.Generator().manual_seed(sample_seed(3, 7))  # as BatchTransform.train draws
    boxes = torch.stack(resized_crop_boxes(len(batch), 96, 96, generator), dim=1).int().tolist()
    flipped = (torch.rand(len(batch), generator=generator) < 0.5).tolist()
    for image, result, box, flip in zip(batch, out, boxes, flipped):
        expected = v2.functional.resized_crop(image.float(), *box, [96, 96],
                                              v2.InterpolationMode.BICUBIC, antialias=True)
        expected = v2.functional.horizontal_flip(expected) if flip else expected
        assert (result - expected).abs().max() < 0.01  # of 255
    assert 0 < sum(flipped) < len(batch) and sum(h < 96 for _, _, h, _ in boxes) > 20
    assert (out - bilinear).abs().max() > 20


def test_fit_and_the_workers_crops_resize_with_the_interpolation_they_are_given():
    """The samples the workers loader reads: the evaluation view (fit, which the decode cache uses
    too) and the training crop are torchvision's antialiased resize with the interpolation given,
    and bicubic is not bilinear."""
    image = torch.randint(0, 256, (3, 90, 120), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(2))
    split = TensorSplit(image[None], torch.tensor([0]), "one image")
    views = {}
    for interpolation, mode in INTERPOLATIONS.items():
        evaluated, _ = SampleImages(split, 40, train=False, interpolation=interpolation)[0]
        resized = v2.functional.resize(image, 40, mode, antialias=True)
        assert torch.equal(evaluated, v2.functional.center_crop(resized, [40, 40]))
        assert torch.equal(fit(image, 40, interpolation), evaluated)
        trained, _ = SampleImages(split, 72, train=True, seed=3, interpolation=interpolation)[1, 0]
        rng = random.Random(sample_seed(3, 1, 0))  # the draws of sample 0 in epoch 1
        box = resized_crop_box(90, 120, rng)
        expected = v2.functional.resized_crop(image, *box, [72, 72], mode, antialias=True)
        flip = rng.random() < 0.5
        assert torch.equal(trained, v2.functional.horizontal_flip(expected) if flip else expected)
        views[interpolation] = evaluated.int(), trained.int()
    for bicubic, bilinear in zip(views["bicubic"], views["bilinear"]):
        assert (bicubic - bilinear).abs().max() > 20


def test_the_decode_cache_is_keyed_by_the_interpolation_and_bilinear_keeps_its_name(
        formats, source, tmp_path, monkeypatch):
    """A cache built bilinear is never read for bicubic (nor the other way), and bilinear's file
    names are those every earlier run wrote, so their caches stay valid."""
    assert cache_name("hub-uoft-cs--cifar10", None, "bilinear", False) == "hub-uoft-cs--cifar10.pt"
    assert cache_name("dir-0123", 24, "bilinear", True) == "dir-0123-24px-skip.pt"
    assert cache_name("dir-0123", 24, "bicubic", True) == "dir-0123-24px-bicubic-skip.pt"
    cache, folder = tmp_path / "cache", str(formats["parquet"])  # in the order of the source
    for interpolation in ("bilinear", "bicubic", "bilinear", "bicubic"):  # built, then read
        data = load_image_data(data_dir=folder, cache_dir=str(cache), image_size=24,
                               interpolation=interpolation)
        assert torch.equal(data.test_images, torch.stack(  # the source's, as fit resizes them
            [fit(image, 24, interpolation) for image in source.test_images]))
    bicubic, bilinear = sorted(p.name for p in cache.glob("*.pt"))
    assert re.fullmatch(r"dir-[0-9a-f]{16}-24px\.pt", bilinear)
    assert bicubic == bilinear.replace("-24px.pt", "-24px-bicubic.pt")
    assert not torch.equal(fit(source.test_images[0], 24), fit(source.test_images[0], 24, "bicubic"))
    # A Hub dataset decoded at its own size: the file found for bilinear only
    torch.save(vars(source), cache / "hub-uoft-cs--cifar10.pt")
    assert cached_hub_data("cifar10", str(cache)) is not None
    assert cached_hub_data("cifar10", str(cache), interpolation="bicubic") is None
    # --cache-dir ~/...: written where cache_folder expands it, and found there (a quoted ~, or
    # --cache-dir=~/..., reaches the script unexpanded)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cached_hub_data("cifar10", "~/cache") is not None
