"""Data, names, flag ranges and models that are not what they seem, each run through the real
script: one line and nothing written where it must be refused, a finished run where it must work.

  - data that is no classification problem: an image folder of one class folder, an archive one
    level too deep (train/images/<class>/: the line says how to move them up), a save_to_disk
    dataset whose labels are all one value;
  - a home folder that cannot be written in (a real read-only bind mount): the default cache
    folder is one line naming --cache-dir and CIFAR_CACHE_DIR, not a traceback;
  - an image folder with links to .. (a loop for os.walk) and a FIFO named like an image: passed
    over, the rest listed as torchvision's make_dataset lists it, and the run trains;
  - a class folder whose name is not UTF-8: trains, its name is recorded as JSON-safe text, and
    evaluate.py on the weights gives the run's accuracy;
  - --dist-timeout at both ends of its range on a real 2-process job, tracked by wandb and
    checkpointed every step (the main process alone starts the tracker and writes checkpoints:
    1 s ended the job there), and below the range one line;
  - an absurd --synthetic-train-size: one line with the memory it would take; an --lr or
    --weight-decay beyond float32 (the optimizer's arithmetic): one line, not an overflow at step 1;
  - torchvision models: googlenet and inception_v3 (auxiliary heads) train and evaluate; one that
    cannot take the data's size (a ViT at 32 px, inception_v3 below 75 px) is refused before
    config.json is written, with the size it needs.
"""

import json
import shutil
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import numpy as np
import PIL.Image
import pytest
from helpers import ROOT, Processes, execute, run, user_env
from torchvision.datasets.folder import make_dataset

from common.data.formats import _images_in, _is_image
from common.data.sources import open_source

STEP = ["--model", "resnet20", "--epochs", "1", "--batch-size", "4", "--max-steps", "1",
        "--report-to", "none"]
SYNTHETIC = ["--dataset", "synthetic", "--synthetic-train-size", "32",
             "--synthetic-test-size", "20"]


def write_images(folder, count: int, seed: int = 0) -> None:
    """``count`` random 32x32 PNG files in ``folder`` (str or bytes: any name the OS allows)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        name = os.path.join(folder, f"{i}.png".encode() if isinstance(folder, bytes) else f"{i}.png")
        PIL.Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(os.fsdecode(name))


def image_folder(root: Path, classes, layout: str = "{split}/{name}") -> Path:
    for split in ("train", "test"):
        for k, name in enumerate(classes):
            if isinstance(name, bytes):
                folder = os.fsencode(root) + b"/" + layout.format(split=split, name="").encode() + name
            else:
                folder = root / layout.format(split=split, name=name)
            write_images(folder, 6, seed=k)
    return root


def refused(done, run_dir: Path) -> str:
    """The one error line of a refused run, which wrote no config.json."""
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), done.stderr
    assert not (run_dir / "config.json").exists()
    return line


def train(tmp_path: Path, *flags, name="run", **kwargs):
    out = tmp_path / name
    return out, run("train_single.py", *flags, "--output-dir", out, cwd=tmp_path, check=False,
                    timeout=300, **kwargs)


# ----------------------------------------------------------------------------------------------
# A dataset must be a classification problem

@pytest.fixture(scope="module")
def one_class_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("one class")
    one = image_folder(root / "one", ["cat"])
    deep = image_folder(root / "deep", ["cat", "dog", "frog"], layout="{split}/images/{name}")
    splits = datasets.DatasetDict({split: datasets.Dataset.from_dict(
        {"img": [PIL.Image.new("RGB", (32, 32), (k, 0, 0)) for k in range(8)], "label": [1] * 8},
        features=datasets.Features({"img": datasets.Image(),
                                    "label": datasets.ClassLabel(names=["cat", "dog"])}))
        for split in ("train", "test")})
    splits.save_to_disk(str(root / "saved"))
    cases = {"one": one, "deep": deep, "saved": root / "saved"}

    def one_run(case):
        return case, train(root, "--data-dir", cases[case], *STEP, name=f"run {case}")
    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one_run, cases)), cases


def test_an_image_folder_of_one_class_is_refused(one_class_runs, tmp_path):
    (out, done), root = one_class_runs[0]["one"], one_class_runs[1]["one"]
    assert refused(done, out) == (f"error: image folder {root} has one class folder, train/cat/: a "
                                  f"classifier needs 2 or more classes; put each class's images in "
                                  f"its own train/<class>/")
    # followed: a second class's images in train/dog/ (and test/dog/), and the folder opens
    folder = shutil.copytree(root, tmp_path / "images")
    for split in ("train", "test"):
        shutil.copytree(folder / split / "cat", folder / split / "dog")
    assert open_source(data_dir=str(folder)).classes == ["cat", "dog"]


def test_classes_one_level_too_deep_are_refused_with_the_move_that_fixes_them(one_class_runs):
    (out, done), root = one_class_runs[0]["deep"], one_class_runs[1]["deep"]
    line = refused(done, out)
    images, train_dir = shlex.quote(f"{root}/train/images"), shlex.quote(f"{root}/train")
    move = f"mv {images}/* {train_dir}/ && rmdir {images}"
    assert line == (f"error: image folder {root} has one class, images, whose subfolders (cat, dog, "
                    f"frog) look like the classes, one level too deep: move them up into train/, "
                    f"e.g. {move} (and the same in test/)")
    # The advice works: moved up, the same folder trains.
    images, test_dir = shlex.quote(f"{root}/test/images"), shlex.quote(f"{root}/test")
    subprocess.run(f"{move} && mv {images}/* {test_dir}/ && rmdir {images}",
                   shell=True, check=True)
    out, done = train(out.parent, "--data-dir", root, *STEP, name="run deep moved")
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["classes"] == ["cat", "dog", "frog"]


def test_a_dataset_whose_labels_are_all_one_value_is_refused(one_class_runs):
    (out, done), root = one_class_runs[0]["saved"], one_class_runs[1]["saved"]
    assert refused(done, out) == (f"error: save_to_disk folder {root} has training labels all 1 "
                                  f"(dog, one of 2 class names): a classifier needs 2 or more "
                                  f"classes; give it images of two or more classes")


# ----------------------------------------------------------------------------------------------
# Defaults and names

@pytest.fixture
def read_only_home(tmp_path):
    """A real read-only folder (root ignores permission bits, not a read-only mount)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    source, home = tmp_path / "home source", tmp_path / "home"
    source.mkdir()
    home.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(home)], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        pytest.skip(f"cannot bind-mount: {done.stderr.strip()}")
    try:
        done = subprocess.run(["mount", "-o", "remount,bind,ro", str(home)], capture_output=True,
                              text=True, check=False)
        if done.returncode:
            pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
        with pytest.raises(OSError):
            (home / "probe").write_text("")
        yield home
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


def train_at_home(tmp_path, home: Path, *flags, name="run", **env):
    """train_single.py with HOME at ``home`` and no cache variable: the default cache folder."""
    base = user_env(HOME=str(home), XDG_CACHE_HOME="")
    base.pop("CIFAR_CACHE_DIR", None)
    env = {**base, **env}
    out = tmp_path / name
    return out, execute([sys.executable, ROOT / "scripts" / "train_single.py", *flags,
                         "--output-dir", out], cwd=tmp_path, env=env, timeout=300)


def test_an_unwritable_home_makes_the_default_cache_one_line(read_only_home, tmp_path):
    data = image_folder(tmp_path / "data", ["cat", "dog"])
    out, done = train_at_home(tmp_path, read_only_home, "--data-dir", data, *STEP)
    folder = read_only_home / ".cache" / "multigpu-cifar"
    assert refused(done, out) == (
        f"error: the default cache folder {folder} cannot be written in (OSError: [Errno 30] "
        f"Read-only file system: '{read_only_home / '.cache'}'); pass --cache-dir DIR or set "
        f"CIFAR_CACHE_DIR to a folder you can write in")
    # What the line says works.
    out, done = train_at_home(tmp_path, read_only_home, "--data-dir", data, *STEP, name="run 2",
                              CIFAR_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr


def test_a_class_folder_whose_name_is_not_utf8_trains_and_evaluates(tmp_path):
    data = image_folder(tmp_path / "data", [b"caf\xe9", b"dog"])
    assert sorted(os.listdir(os.fsencode(data / "train"))) == [b"caf\xe9", b"dog"]
    out, done = train(tmp_path, "--data-dir", data, *STEP)
    assert done.returncode == 0, done.stderr
    # The bytes that are not UTF-8 written as \xNN: JSON, safetensors metadata and terminals take it
    assert json.loads((out / "config.json").read_text())["classes"] == ["caf\\xe9", "dog"]
    evaluated = run("evaluate.py", "--weights", out / "model.safetensors", "--data-dir", data,
                    cwd=tmp_path, check=False)
    assert evaluated.returncode == 0, evaluated.stderr
    accuracy = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["test_acc"]
    assert f"test_acc={accuracy:.4f} (" in evaluated.stdout
    assert re.search(r"^  caf\\xe9  ", evaluated.stdout, re.MULTILINE), evaluated.stdout


def test_an_absurd_synthetic_size_is_one_line(tmp_path):
    out, done = train(tmp_path, "--dataset", "synthetic", "--synthetic-train-size", 10**12)
    line = refused(done, out)
    assert line.startswith("error: --synthetic-train-size 1000000000000 and --synthetic-test-size "
                           "1000: 1000000001000 synthetic images of 32x32 take 3.072e+06 GB, more "
                           "than this machine's ")
    assert re.search(r" GB of memory; use --synthetic-train-size \d+ or fewer \(CIFAR-10 has 60000\)$", line), line


# ----------------------------------------------------------------------------------------------
# --dist-timeout: both ends of its range on a real 2-process job

@pytest.mark.parametrize("timeout", [10, 10**9], ids=["shortest", "longest"])
def test_dist_timeout_works_at_both_ends(timeout, tmp_path):
    # wandb (offline: no API key) and a checkpoint every step: what the main process does alone
    # while the other waits in its next collective. 1 s failed here, at wandb's start.
    out = tmp_path / "run"
    job = Processes("train_ddp.py", *SYNTHETIC, "--model", "resnet20", "--batch-size", "8", "--epochs", "1",
                    "--max-steps", "2", "--checkpoint-every", "1", "--dist-timeout", timeout, "--output-dir", out,
                    cwd=tmp_path)
    assert job.wait(timeout=300) == [0, 0], job.output()
    assert "done: step 2" in job.stdout(0)
    assert (out / "model.safetensors").is_file()


def test_dist_timeout_below_its_range_is_one_line(tmp_path):
    out = tmp_path / "run"
    done = run("train_ddp.py", *SYNTHETIC, "--dist-timeout", "1", "--output-dir", out,
               cwd=tmp_path, check=False)
    assert refused(done, out) == (
        "error: --dist-timeout 1.0: must be a number of seconds from 10 to 1000000000, e.g. 600 "
        "(below 10 the others time out while the main process starts the tracker or writes a "
        "checkpoint)")


# ----------------------------------------------------------------------------------------------
# torchvision models

@pytest.mark.parametrize("model, size", [("googlenet", 32), ("inception_v3", 75)])
def test_models_with_auxiliary_heads_train_and_evaluate(model, size, tmp_path):
    out, done = train(tmp_path, *SYNTHETIC, *STEP, "--model", f"torchvision:{model}",
                      "--image-size", size)
    assert done.returncode == 0, done.stderr
    assert "done: step 1" in done.stdout
    evaluated = run("evaluate.py", "--weights", out / "model.safetensors", *SYNTHETIC,
                    cwd=tmp_path, check=False)
    assert evaluated.returncode == 0, evaluated.stderr
    accuracy = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["test_acc"]
    assert f"test_acc={accuracy:.4f} (" in evaluated.stdout


@pytest.mark.parametrize("model, size, message", [
    ("vit_b_16", 32, ("takes 224x224 images only, not 32x32 (AssertionError: Wrong image height! "
                      "Expected 224 but got 32!); pass --image-size 224")),
    ("inception_v3", 74, ("needs images of at least 75x75, not 74x74 (RuntimeError: Calculated "
                          "padded input size per channel: (2 x 2). Kernel size: (3 x 3). ...); "
                          "pass --image-size 75 or more")),
], ids=["fixed size", "smallest size"])
def test_a_model_that_cannot_take_the_size_is_refused_before_anything_is_written(
        model, size, message, tmp_path):
    out, done = train(tmp_path, *SYNTHETIC, *STEP, "--model", f"torchvision:{model}",
                      "--image-size", size)
    assert refused(done, out) == f"error: --model torchvision:{model} {message}"


@pytest.mark.parametrize("flags, message", [
    (["--lr", "1e300"], ("--lr 1e+300: must be a positive number, e.g. 0.1, at most 3.4e+38 (float32's "
                         "largest) once scaled by --scale-lr")),
    (["--weight-decay", "1e300"], ("--weight-decay 1e+300: must be a number, 0 (none) or more, at "
                                   "most 3.4e+38 (float32's largest)")),
], ids=["lr", "weight decay"])
def test_a_value_the_optimizer_cannot_hold_is_one_line(flags, message, tmp_path):
    # Before: "RuntimeError: value cannot be converted to type float without overflow" at step 1.
    out, done = train(tmp_path, *SYNTHETIC, *STEP, *flags)
    assert refused(done, out) == f"error: {message}"


# ----------------------------------------------------------------------------------------------
# A refusal on N processes: one line, from the main process

@pytest.mark.parametrize("case", ["one class", "model size"])  # the batch split: test_bad_input.py
def test_a_refusal_on_two_processes_is_one_line(case, one_class_runs, tmp_path):
    """Every process meets the same bad input; they agree on it, and only the main process says it."""
    flags = {"one class": ["--data-dir", one_class_runs[1]["one"], *STEP],
             "model size": [*SYNTHETIC, *STEP, "--model", "torchvision:vit_b_16"]}[case]
    out = tmp_path / "run"
    job = Processes("train_ddp.py", *flags, "--output-dir", out, cwd=tmp_path)
    assert job.wait(timeout=300) == [1, 1], job.output()
    assert job.stderr(1) == "" and not any(sign in job.output() for sign in ("Traceback", "terminate called"))
    errors = job.stderr(0).splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: "), job.output()
    assert {"one class": "has one class folder, train/cat/", "model size": "takes 224x224 images only"}[case] \
        in errors[0]
    assert not out.exists()


def test_a_whole_dataset_one_level_down_is_refused_and_the_folder_it_names_trains(tmp_path):
    """train/X/train/<class>/...: the refusal names the folder to give; given, it trains."""
    root = tmp_path / "data"
    image_folder(root / "train" / "X", ["cat", "dog"])
    out, done = train(tmp_path, "--data-dir", root, *STEP)
    assert refused(done, out) == (f"error: image folder {root} has one class folder, train/X/, which holds a "
                                  f"dataset of its own (train/X/train/); pass --data-dir {root}/train/X")
    out, done = train(tmp_path, "--data-dir", root / "train" / "X", *STEP)
    assert done.returncode == 0 and json.loads((out / "config.json").read_text())["classes"] == ["cat", "dog"]


def test_link_loops_and_a_fifo_in_an_image_folder_are_passed_over(tmp_path):
    """Three links to .. in a class folder (os.walk following links, as torchvision's ImageFolder lists a
    folder, never ends) and a FIFO named like an image (its reader would wait forever): the images are
    listed as make_dataset lists the folder without them (a link to a folder elsewhere still followed),
    and a run trains to its done line."""
    data = image_folder(tmp_path / "data", ["cat", "dog"])
    write_images(tmp_path / "more", 3, seed=5)
    os.symlink(tmp_path / "more", data / "train" / "dog" / "more")
    listed = make_dataset(str(data / "train"), {"cat": 0, "dog": 1}, is_valid_file=_is_image)
    assert len(listed) == 15
    for link in "abc":
        os.symlink("..", data / "train" / "cat" / link)
    os.mkfifo(data / "train" / "dog" / "zz.png")
    assert _images_in(data / "train", ["cat", "dog"]) == listed
    out, done = train(tmp_path, "--data-dir", data, *STEP)
    assert done.returncode == 0 and "done: step 1" in done.stdout, done.stderr


def test_an_unreadable_image_met_while_training_is_one_line_whose_advice_finishes_the_run(tmp_path):
    """--loader workers meets the image in epoch 1, after the run's folder is written: the line says
    to replace the file (or skip it) and --resume; replacing it and doing so finishes the run."""
    root = image_folder(tmp_path / "data", ["cat", "dog"])
    broken = root / "train" / "dog" / "3.png"
    good = broken.read_bytes()
    broken.write_bytes(good[:40])  # cut short, as an interrupted copy leaves it
    flags = ["--data-dir", root, "--loader", "workers", "--workers", "1", *STEP, "--max-steps", "3"]  # all of it
    out, done = train(tmp_path, *flags)
    assert done.returncode == 1 and (out / "config.json").is_file(), done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: cannot decode image {broken} (") and line.endswith(
        "; replace or remove the file, or pass --bad-images skip to train without it; then the same command "
        "with --resume continues the run"), line
    broken.write_bytes(good)
    out, done = train(tmp_path, *flags, "--resume")
    assert done.returncode == 0 and (out / "model.safetensors").is_file(), done.stderr


@pytest.mark.parametrize("flag", ["--output-dir", "--cache-dir"])
def test_a_folder_flag_on_a_read_only_mount_is_one_line(flag, read_only_home, tmp_path):
    """A real read-only filesystem (root may write anywhere else): refused with the flags, nothing run."""
    folder = read_only_home / "run"
    done = run("train_single.py", *SYNTHETIC, *STEP, "--output-dir", tmp_path / "run", flag, folder,
               cwd=tmp_path, check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: {flag} {folder}: must be a folder you can write in, but {read_only_home} is not writable; "
        f"choose another {flag}"], done.stderr
    assert not (tmp_path / "run").exists() and list(read_only_home.iterdir()) == []


@pytest.mark.parametrize("case", ["one level above", "no evaluation split"])
def test_a_data_dir_that_is_not_the_data_is_refused_and_the_advice_trains(case, tmp_path):
    """DIR holding only the dataset's folder, and a folder with train/ alone: one line with what to
    pass, nothing written; passing it trains."""
    if case == "one level above":
        root = tmp_path / "data"
        image_folder(root / "flowers", ["cat", "dog"])
        message = f"error: --data-dir {root} holds one folder, flowers, with the data in it: pass --data-dir {root}/flowers"
        advice = ["--data-dir", root / "flowers"]
    else:
        root = image_folder(tmp_path / "data", ["cat", "dog"])
        shutil.rmtree(root / "test")
        message = (f"error: image folder {root} (no test/, val/ or validation/ folder of class folders) has no labelled "
                   f"evaluation split; pass --val-fraction 0.1 to evaluate on a share of train")
        advice = ["--data-dir", root, "--val-fraction", "0.1"]
    out, done = train(tmp_path, "--data-dir", root, *STEP)
    assert refused(done, out) == message and not out.exists()
    out, done = train(tmp_path, *STEP, *advice)
    assert done.returncode == 0 and (out / "model.safetensors").is_file(), done.stderr
