"""The worker input path (--loader workers) end to end, launched as users launch it, on the CPU.

- 2-process DDP through workers ends with the weights of one process with the same global batch
  (BatchNorm frozen, tests/frozen_bn.py), augmentation ON: it is drawn per sample from
  (seed, epoch, index), so the two processes' batches are the one process's batch split in two.
  The one process has one worker, the two processes two each: the worker count does not matter.
- A run stopped mid-epoch and resumed from a --checkpoint-every checkpoint (taken while the workers
  had batches prefetched) ends bit for bit where the uninterrupted run ends.
- Memory does not grow with the data: 2,000 and 20,000 JPEGs (96px) train with the same peak memory
  in the main process and in each worker; the 20,000 decoded would take 553 MB. The evaluation
  reads 1% of them (448px), so a worker that kept what it read would grow by 54 MB.
- torchvision:resnet50 at 224px trains through workers on JPEGs of mixed sizes, and evaluate.py on
  its model.safetensors, through workers too, evaluates the 6 val/ images cut and normalised as
  made here with torchvision, and counts, class by class, what a count made here finds.
- evaluate.py on a --val-fraction run evaluates the files the run held out (the same 24, where
  another seed holds out others), with no --val-fraction or --seed of its own, through the other
  loader (device); weights that have learnt, counted again here class by class.
"""

import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch
from accelerate.utils import set_seed
from helpers import ROOT, image_folder, run, two_processes, user_env, weights
from probe_counts import learnt, metadata, per_class, predictions, printed_per_class
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from common.recipe.models import build_model

FROZEN_BN = str(ROOT / "tests" / "frozen_bn.py")
WORKERS = ["--loader", "workers", "--report-to", "none"]
HELD_OUT = str(ROOT / "tests" / "probe_heldout.py")  # records the images a model was evaluated on


def max_difference(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def last_metrics(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def evaluated(done) -> tuple[float, int, int]:
    """(accuracy, correct, total) from evaluate.py's first line."""
    m = re.match(r"test_acc=(\d\.\d{4}) \((\d+)/(\d+)\)", done.stdout)
    assert m, done.stdout
    return float(m.group(1)), int(m.group(2)), int(m.group(3))


# ------------------------------------------------------------------------------ DDP agreement

# As tests/test_train_ddp.py's agreement, but through workers and with augmentation on; 101 test
# images do not divide by 2 processes x 64, so the padded last batch is exercised too.
AGREE = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "101",
         "--model", "resnet20", "--batch-size", "64", "--lr", "0.001", "--reference-batch-size", "64",
         "--epochs", "1", "--max-steps", "4", *WORKERS]


def test_two_process_ddp_through_workers_matches_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run("train_single.py", *AGREE, "--workers", 1, "--output-dir", one, cwd=tmp_path,
        launcher=(sys.executable, FROZEN_BN))
    done = two_processes(FROZEN_BN, ROOT / "scripts" / "train_ddp.py", *AGREE, "--workers", 2, "--output-dir", two,
                         cwd=tmp_path)
    assert "on 2 x cpu" in done.stdout and "batch 64 (32 per device)" in done.stdout
    assert "loader workers, 2 workers per process" in done.stdout
    config = json.loads((two / "config.json").read_text())
    assert config["loader"] == "workers" and config["args"]["augment"] and config["train_crop"] == "pad"

    ddp, single = weights(two), weights(one)
    assert max_difference(ddp, single) < 1e-5
    set_seed(0)
    initial = build_model("resnet20", num_classes=10).state_dict()
    assert max_difference(ddp, initial) > 1e-3  # the weights did move: the agreement is not trivial
    assert last_metrics(two)["test_images"] == last_metrics(one)["test_images"] == 101


# ------------------------------------------------------------------------------------ resume

# 128 images at batch 32: 4 steps an epoch, 8 in all.
RESUME = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "32",
          "--model", "resnet20", "--batch-size", "32", "--reference-batch-size", "32", "--epochs", "2",
          *WORKERS, "--workers", "2"]


def test_resume_through_workers_equals_uninterrupted_bitwise(tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "run"
    run("train_single.py", *RESUME, "--output-dir", reference, cwd=tmp_path)
    # Stops at step 3; the checkpoint of step 2 is --checkpoint-every's, taken inside epoch 1 while
    # the workers had the next batches in flight. The resumed run finishes epoch 1 on a new loader
    # (skip_first_batches) and starts epoch 2 on the first.
    run("train_single.py", *RESUME, "--output-dir", out, "--max-steps", 3, "--checkpoint-every", 2, cwd=tmp_path)
    checkpoint = out / "checkpoints" / "step_00000002"
    assert checkpoint.is_dir()
    # Continued into a folder of its own: in place it would replace the stopped run's record.
    elsewhere = tmp_path / "resumed"
    resumed = run("train_single.py", *RESUME, "--output-dir", elsewhere, "--checkpoint-every", 2, "--resume",
                  checkpoint, cwd=tmp_path)
    assert "at epoch 1, step 2" in resumed.stdout, resumed.stdout

    ours, theirs = weights(elsewhere), weights(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert last_metrics(elsewhere)["test_acc"] == last_metrics(reference)["test_acc"]


# ------------------------------------------------------------------------------------ memory

LINUX = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status (Linux)")

def hwm_mb(pid: int) -> float | None:
    """The peak resident memory of a live process (VmHWM), in MB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            found = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(found.group(1)) / 1024 if found else None


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, read from /proc. Not psutil's children(): it drops a
    child whose start time, reckoned from the boot time it reads again for each process, seems
    earlier than its parent's, and the kernel's boot time moves when the clock is adjusted."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the name, in (), may hold spaces
        except (OSError, IndexError):
            continue  # it ended while the folder was read
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def peak_memory(args, cwd: Path, interval: float = 0.05) -> dict:
    """Run train_single.py with ``args`` and return the peak resident memory (VmHWM, sampled to the
    end of each process) of its main process, over the whole run ("main") and before its first worker
    started ("setup": reading the file list, the statistics, the model; no training step yet), and of
    each worker, and each worker's peak private memory (USS: the pages only it holds; its resident
    memory counts the pages it shares with the main process).

    Not getrusage's ru_maxrss: an exec'd child starts with its parent's high-water mark (the kernel
    carries it over exec), so the whole pytest process's peak would be counted."""
    log = cwd / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train_single.py"), *map(str, args)],
                                cwd=cwd, env=user_env(CIFAR_CACHE_DIR=str(cwd / ".cache")), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    resident, private = {}, {}
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        resident[proc.pid] = hwm_mb(proc.pid) or resident.get(proc.pid, 0)
        if len(resident) == 1:  # no worker seen yet
            setup = resident[proc.pid]
        for pid in children(proc.pid):
            try:  # a worker is forked: the same command; `git rev-parse` (config.json) is not one
                worker = psutil.Process(pid)
                if worker.cmdline() != psutil.Process(proc.pid).cmdline():
                    continue
                private[worker.pid] = max(private.get(worker.pid, 0), worker.memory_full_info().uss / 2**20)
            except psutil.Error:
                continue  # it ended between the listing and the reading
            resident[worker.pid] = hwm_mb(worker.pid) or resident.get(worker.pid, 0)
        time.sleep(interval)
    if proc.poll() is None:  # past the deadline
        proc.kill()
    proc.wait()
    assert proc.returncode == 0, f"train_single.py {args} failed ({proc.returncode}):\n{log.read_text()}"
    worker_pids = [pid for pid in resident if pid != proc.pid]  # in the order they started
    return {"main": resident.pop(proc.pid), "setup": setup, "workers": [resident[p] for p in worker_pids],
            "workers_private": [private.get(p, 0) for p in worker_pids], "log": log.read_text()}


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """Peaks of 5 steps on 2,000 and on 20,000 JPEGs, 99% of them training images of 96px, 1% validation
    images of 448px (20 and 200: the evaluation reads them all, its 2 workers 10 and 100 each). Decoded, a
    448px image is 602 KB: a worker that kept each image it read would hold 54 MB more with 20,000
    (90 more images), where 5 training steps read 160 images of 28 KB, the same in both runs. The
    evaluation resizes them to 96px: 180 more images of the model's work, a few seconds. The main
    process's high-water mark, sampled every 2 s, rises over the first 3 or 4 steps and stays nearly
    flat after."""
    peaks = {}
    for count in (2_000, 20_000):
        where = tmp_path_factory.mktemp(f"memory{count}")
        root = image_folder(where / "data", train=count - count // 100, val=0, classes=10, sizes=((96, 96),))
        image_folder(root, train=0, val=count // 100, classes=10, sizes=((448, 448),))
        peaks[count] = peak_memory(["--data-dir", root, "--image-size", 96, "--model", "resnet20", "--batch-size", 32,
                                    "--epochs", 1, "--max-steps", 5, *WORKERS, "--workers", 2,
                                    "--output-dir", where / "run"], where)
        shutil.rmtree(root)  # 80 MB of files for 20,000, kept by pytest for its last three sessions otherwise
    print(json.dumps({count: {k: v for k, v in found.items() if k != "log"} for count, found in peaks.items()}))
    return peaks


@LINUX
def test_main_process_memory_does_not_grow_with_the_number_of_images(memory):
    small, large = memory[2_000], memory[20_000]
    assert "loader workers, 2 workers per process" in large["log"]
    # Before training (the file list, the 1,000 images decoded for the normalisation, the model): 1,183
    # and 1,187 MB in each of 3 runs, within 0.1 MB; 4 MB for 17,820 more file names. 20 MB is 4% of
    # the 553 MB that the 20,000 images take decoded.
    assert large["setup"] < small["setup"] + 20, (small["setup"], large["setup"])
    # The whole run's peak, 1.5-1.7 GB with the activations of a batch of 32 at 96px, moves with the
    # heap's timing whatever the data: 1,465-1,681 MB over 25 runs of either size, 216 MB apart. Holding
    # the 20,000 images decoded would add 553 MB (with --loader device the peak was 2,970 MB).
    assert large["main"] < small["main"] + 300, (small["main"], large["main"])


@LINUX
def test_worker_memory_does_not_grow_with_the_number_of_images(memory):
    small, large = memory[2_000], memory[20_000]
    for peaks in (small, large):  # a training loader and an evaluation loader, 2 workers each
        assert len(peaks["workers"]) == len(peaks["workers_private"]) == 4, peaks["workers"]
    report = {"2000": small["workers"], "20000": large["workers"], "2000 private": small["workers_private"],
              "20000 private": large["workers_private"]}
    # A worker's resident memory is mostly pages it shares with the main process, forked with them:
    # the training workers' (the first two) grew by 3.5 MB (the 17,820 more file names); the evaluation
    # workers', forked later from a larger main process, vary with it. Its private memory (USS,
    # about 10 MB) is all a worker adds.
    assert max(large["workers"][:2]) < max(small["workers"][:2]) + 20, report
    assert max(large["workers_private"]) < max(small["workers_private"]) + 20, report
    assert max(large["workers_private"]) < 64, report


# ------------------------------------------------------------------ ImageNet-sized, evaluation

@pytest.fixture(scope="module")
def resnet50_run(tmp_path_factory):
    """torchvision's ResNet-50 at 224px, 2 steps of 4 on 16 JPEGs of mixed sizes and shapes."""
    where = tmp_path_factory.mktemp("resnet50")
    root = image_folder(where / "data", train=16, val=6, classes=2,
                        sizes=((96, 128), (300, 200), (224, 224), (181, 333)), variants=4)
    data = ["--data-dir", root, "--image-size", 224]
    out = where / "run"
    run("train_single.py", *data, "--model", "torchvision:resnet50", "--batch-size", 4, "--epochs", 1,
        "--max-steps", 2, *WORKERS, "--workers", 2, "--output-dir", out, cwd=where)
    return out, data, where


def test_resnet50_at_224_trains_through_workers(resnet50_run):
    out, _, _ = resnet50_run
    config = json.loads((out / "config.json").read_text())
    assert config["loader"] == "workers" and config["image_size"] == [224, 224] and config["train_crop"] == "resized"
    assert config["args"]["model"] == "torchvision:resnet50" and config["train_size"] == 16
    logged = last_metrics(out)
    assert logged["step"] == 2 and logged["test_images"] == 6 and logged["train_loss"] < 10


def test_evaluate_reproduces_the_resnet50_accuracy_through_workers(resnet50_run):
    out, data, where = resnet50_run
    weights_file, logged = out / "model.safetensors", last_metrics(out)
    done = run("evaluate.py", "--weights", weights_file, *data, "--loader", "workers", cwd=where,
               launcher=(sys.executable, HELD_OUT), env_extra={"PROBE_FILE": str(where / "evaluated.pt")})
    # What the model got is each of the 6 val/ images, cut to 224px and normalised as done here with
    # torchvision: neither training images nor another crop. A few steps of ResNet-50 from scratch
    # predict one class for all (8 steps at the scaled lr, 4 at an unscaled 0.1), so the
    # count alone would not tell the images apart: the inputs do.
    files = evaluated_images(where / "evaluated.pt", weights_file, data[1] / "val", 224)
    assert sorted(files) == sorted(data[1].glob("val/*/*.jpg")), files
    counts = counted_here(weights_file, files, 224)  # without common.recipe.evaluation
    correct = sum(c for c, _ in counts)
    assert evaluated(done) == (round(correct / 6, 4), correct, 6) and printed_per_class(done.stdout) == counts
    assert logged["test_acc"] == correct / 6


def view(path: Path, size: int) -> torch.Tensor:
    """The evaluation view of an image file, made here with torchvision: decoded, the shorter side
    resized to ``size`` and the centre square cut (an image of that size as it is)."""
    image = decode_image(str(path), mode=ImageReadMode.RGB)
    if image.shape[-2:] != (size, size):
        image = v2.functional.center_crop(v2.functional.resize(image, size, antialias=True), [size, size])
    return image


def evaluated_images(probe_file: Path, weights_file: Path, folder: Path, size: int) -> list[Path]:
    """The files under ``folder`` of the images a model was evaluated on, as tests/probe_heldout.py
    recorded them: each input turned back into uint8 with the run's normalisation and looked up among
    the views of the folder's images made here; an input that is none of them (another file, crop or
    normalisation) fails the test."""
    stored = metadata(weights_file)
    mean, std = (torch.tensor(stored["normalization"][k])[:, None, None] for k in ("mean", "std"))
    views = {view(path, size).numpy().tobytes(): path for path in sorted(folder.rglob("*.jpg"))}
    found = []
    for x in (x for batch in torch.load(probe_file) for x in batch):
        image = (x * std + mean).round().clamp(0, 255).to(torch.uint8).numpy().tobytes()
        if image not in views:
            pytest.fail(f"evaluated image {len(found)} is no {size}px view of an image of {folder}")
        found.append(views[image])
    return found


def counted_here(weights_file: Path, files: list[Path], size: int) -> list[tuple[int, int]]:
    """(correct, total) of each class on ``files``, counted without common.recipe.evaluation or common.data:
    their views, labelled by their class folder, through tests/probe_counts.py."""
    classes = metadata(weights_file)["classes"]
    labels = torch.tensor([classes.index(path.parent.name) for path in files])
    images = torch.stack([view(path, size) for path in files])
    return per_class(predictions(weights_file, images), labels, len(classes))


@pytest.fixture(scope="module")
def val_fraction_run(tmp_path_factory):
    """A train/-only folder of 120 images, each its own (a class colour with its own noise);
    --val-fraction 0.2 with --seed 3 carves 6 of each class's 30. 12 steps of 8: weights that have
    learnt (2 steps predicted one class for all, so any 24 images gave the same accuracy). The images
    the run evaluated are recorded (tests/probe_heldout.py)."""
    where = tmp_path_factory.mktemp("val-fraction")
    root = image_folder(where / "data", train=120, val=0, classes=4, variants=30)
    out = where / "run"
    run("train_single.py", "--data-dir", root, "--val-fraction", 0.2, "--seed", 3, "--model", "resnet20",
        "--batch-size", 8, "--reference-batch-size", 32, "--warmup-epochs", 0, "--epochs", 1, *WORKERS,
        "--workers", 2, "--output-dir", out, cwd=where, launcher=(sys.executable, HELD_OUT),
        env_extra={"PROBE_FILE": str(where / "trained.pt")})
    return out, root, where


def test_evaluate_finds_the_carved_split(val_fraction_run):
    out, root, where = val_fraction_run
    weights_file = out / "model.safetensors"
    config, logged = json.loads((out / "config.json").read_text()), last_metrics(out)
    assert config["test_size"] == logged["test_images"] == 24 and config["train_size"] == 96
    held_out = evaluated_images(where / "trained.pt", weights_file, root, 32)
    assert len(held_out) == len(set(held_out)) == 24, held_out
    assert Counter(path.parent.name for path in held_out) == {f"class{c}": 6 for c in range(4)}

    # No --val-fraction and no --seed: the weights say which split the run carved. Through the
    # device loader, the split is carved from the decoded tensors (common.data.sources.carve_decoded),
    # not from the file list as in training (carve): the same 24 files.
    def evaluate(weights_file, probe_file):
        done = run("evaluate.py", "--weights", weights_file, "--data-dir", root, "--loader", "device", cwd=where,
                   launcher=(sys.executable, HELD_OUT), env_extra={"PROBE_FILE": str(probe_file)})
        return done, evaluated_images(probe_file, weights_file, root, 32)

    done, names = evaluate(weights_file, where / "evaluated.pt")
    assert "evaluated on 0.2 of train (--val-fraction, seed 3)" in done.stdout.splitlines()[0]
    assert sorted(names) == sorted(held_out)
    # The count, class by class, made here on those files with plain torch.
    counts = counted_here(weights_file, held_out, 32)
    assert learnt(counts), counts
    correct = sum(c for c, _ in counts)
    assert evaluated(done) == (round(correct / 24, 4), correct, 24) and printed_per_class(done.stdout) == counts
    assert logged["test_acc"] == correct / 24

    # Negative control: the same weights saying seed 4 are evaluated on 24 other files, 6 a class,
    # which the comparison above tells apart.
    other_seed = where / "seed4.safetensors"
    with safe_open(str(weights_file), "pt") as f:
        stored = f.metadata()
    save_file(load_file(str(weights_file)), str(other_seed),
              {**stored, "eval_split": json.dumps({"val_fraction": 0.2, "seed": 4})})
    done, names = evaluate(other_seed, where / "seed4.pt")
    assert "(--val-fraction, seed 4)" in done.stdout.splitlines()[0] and evaluated(done)[2] == 24
    assert Counter(path.parent.name for path in names) == {f"class{c}": 6 for c in range(4)}
    assert sorted(names) != sorted(held_out)
