"""Bad input: one line naming the wrong value and what to do, a non-zero exit within seconds, and
nothing lost. The same list is the table of docs/bad-input.md."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, execute, tmpfs, tree_digest, user_env

from common.errors import UserError
from common.parallel.launch import check_batch_split
from common.run.checkpoints import save_checkpoint

BIN = Path(sys.executable).parent
DATA = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64"]
SMALL = [*DATA, "--model", "resnet20", "--batch-size", "64", "--report-to", "none"]


def python(script):
    return [sys.executable, str(ROOT / "scripts" / script)]


def accelerate(config="4gpu.yaml"):
    return [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / config),
            "--num_processes", "2"]


def make_run(folder: Path, model="resnet20"):
    """An earlier run's record: config.json, a checkpoint, weights."""
    (folder / "checkpoints" / "step_00000004").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000004" / "model.safetensors").write_bytes(b"weights of an earlier run")
    (folder / "checkpoints" / "step_00000004" / "checkpoint.json").write_text(  # complete, as listed
        '{"files": {"model.safetensors": 25}, "crc32": {"model.safetensors": "9856a234"}}')
    (folder / "config.json").write_text('{"args": {"model": "%s", "batch_size": 64}}' % model)
    (folder / "model.safetensors").write_bytes(b"final weights of an earlier run")


def corrupt_parquet(folder: Path):
    (folder / "plain_text").mkdir(parents=True)
    for split in ("train", "test"):
        (folder / "plain_text" / f"{split}-00000-of-00001.parquet").write_bytes(b"PAR1 truncated")


def empty(folder: Path):
    folder.mkdir()


def a_file(path: Path):
    path.write_text("not a folder")


def bad_yaml(folder: Path):
    folder.mkdir()
    (folder / "bad.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: [\n")


# case: (command, arguments with {tmp} for the test's folder, setup, what the last line must say)
CASES = {
    "unknown model": (python("train_single.py"), [*DATA, "--model", "resnet99"], None,
                      "error: unknown model 'resnet99': choose one of resnet18"),
    "unknown dataset": (python("train_single.py"), ["--dataset", "not a/name!"], None,
                        "error: --dataset 'not a/name!' is neither one of cifar10, cifar100, synthetic nor a Hugging"),
    "dataset not on the Hub": (python("train_single.py"), ["--dataset", "nobody/no-such-dataset"], None,
                               "error: cannot load --dataset nobody/no-such-dataset:"),
    "unknown schedule": (python("train_single.py"), ["--schedule", "cosine"], None,
                         "error: argument --schedule: invalid choice: 'cosine'"),
    "batch size 0": (python("train_single.py"), [*SMALL, "--batch-size", "0"], None,
                     "error: --batch-size 0: must be 1 or more"),
    "negative batch size": (python("train_single.py"), [*SMALL, "--batch-size", "-8"], None,
                            "error: --batch-size -8: must be 1 or more"),
    "epochs 0": (python("train_single.py"), [*SMALL, "--epochs", "0"], None, "error: --epochs 0: must be 1 or more"),
    "learning rate not a number": (python("train_ddp.py"), [*SMALL, "--lr", "nan"], None,
                                   "error: --lr nan: must be a positive number"),
    "batch size that does not divide": (accelerate() + [str(ROOT / "scripts" / "train_ddp.py")],
                                        [*SMALL, "--batch-size", "63"], None,
                                        "error: --batch-size 63 does not divide by 2 processes: use 62 or 64"),
    "missing --data-dir": (python("train_single.py"), ["--data-dir", "{tmp}/nowhere"], None,
                           "error: --data-dir {tmp}/nowhere does not exist"),
    "empty --data-dir": (python("train_single.py"), ["--data-dir", "{tmp}/data"], lambda t: empty(t / "data"),
                         "error: --data-dir {tmp}/data is empty"),
    "corrupt data file": (python("train_single.py"), ["--data-dir", "{tmp}/data"],
                          lambda t: corrupt_parquet(t / "data"), "{tmp}/data/plain_text/t"),
    "--output-dir holding another run": (python("train_single.py"), [*SMALL, "--output-dir", "{tmp}/old"],
                                         lambda t: make_run(t / "old"),
                                         "error: --output-dir {tmp}/old already holds a run: add --resume"),
    "--output-dir that is a file": (python("train_single.py"), [*SMALL, "--output-dir", "{tmp}/out"],
                                    lambda t: a_file(t / "out"),
                                    "error: --output-dir {tmp}/out: must be a folder, but it is a file; choose "
                                    "another --output-dir"),
    "--resume with nothing to resume": (python("train_single.py"),
                                        [*SMALL, "--output-dir", "{tmp}/new", "--resume"], None,
                                        "error: --resume: {tmp}/new does not exist"),
    "--resume a checkpoint of another model": (python("train_single.py"),
                                               [*SMALL, "--output-dir", "{tmp}/old", "--resume"],
                                               lambda t: make_run(t / "old", model="resnet32"),
                                               "error: --resume: this run has --model 'resnet20' but the run in "
                                               "{tmp}/old had --model 'resnet32'; resume with the flags of that run, "
                                               "or start a new run"),
    "--resume a checkpoint that does not load": (python("train_single.py"),
                                                 [*SMALL, "--output-dir", "{tmp}/old", "--resume"],
                                                 lambda t: (make_run(t / "old"), (  # and no checkpoint.json
                                                     t / "old/checkpoints/step_00000004/checkpoint.json").unlink(
                                                     missing_ok=True)),
                                                 "error: --resume: no checkpoint in {tmp}/old/checkpoints is complete "
                                                 "(step_00000004: checkpoint.json is missing"),
    "--resume a folder that is no checkpoint": (python("train_single.py"), [*SMALL, "--resume", "{tmp}/old"],
                                                lambda t: make_run(t / "old"),
                                                "error: --resume {tmp}/old: not a checkpoint folder"),
    "fp16 on a CPU": (python("train_amp.py"), [*SMALL, "--mixed-precision", "fp16"], None,
                      "error: --mixed-precision fp16 needs a GPU"),
    "--sync-bn on a CPU": (python("train_ddp.py"), [*SMALL, "--sync-bn"], None, "error: --sync-bn needs GPUs"),
    "--compile with DataParallel": (python("train_dp.py"), [*SMALL, "--compile"], None,
                                    "error: --compile inductor: not offered with DataParallel"),
    "unknown --compile backend": (python("train_single.py"), [*SMALL, "--compile", "tvmx"], None,
                                  "error: argument --compile: invalid choice: 'tvmx'"),
    "--compile-mode without --compile inductor": (
        python("train_ddp.py"), [*SMALL, "--compile", "aot_eager", "--compile-mode", "reduce-overhead"], None,
        "error: --compile-mode reduce-overhead with --compile aot_eager: the modes are TorchInductor's; add "
        "--compile (inductor) or drop --compile-mode"),
    "CUDA graphs with --grad-accum": (
        python("train_amp.py"), [*SMALL, "--compile", "--compile-mode", "max-autotune", "--grad-accum", "2"], None,
        "error: --compile-mode max-autotune with --grad-accum 2: CUDA graphs replay into the same buffers, so one "
        "micro-batch's gradients can be overwritten by the next's before they are added up (pytorch#169545); use "
        "--compile-mode max-autotune-no-cudagraphs, or --grad-accum 1 with a smaller --batch-size"),
    "Accelerate config that does not exist": (
        accelerate("nothing.yaml") + [str(ROOT / "scripts" / "train_ddp.py")], SMALL, None,
        "configuration file `{root}/accelerate_configs/nothing.yaml` does not exist"),
    "malformed Accelerate config": ([str(BIN / "accelerate"), "launch", "--config_file", "{tmp}/cfg/bad.yaml",
                                     str(ROOT / "scripts" / "train_ddp.py")], SMALL, lambda t: bad_yaml(t / "cfg"),
                                    'in "{tmp}/cfg/bad.yaml", line 3'),
    "--share-gpus nccl without a GPU": (accelerate() + [str(ROOT / "scripts" / "train_ddp.py")],
                                        [*SMALL, "--share-gpus", "nccl"], None,
                                        "error: --share-gpus nccl: no GPU here, and NCCL reduces GPU tensors "
                                        "only: use --share-gpus gloo, or drop the flag"),
    "one-process script launched as several": ([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                                                str(ROOT / "scripts" / "train_single.py")], SMALL, None,
                                               ("train_single.py trains in one process but was launched as 2 processes "
                                                "(WORLD_SIZE=2): use scripts/train_ddp.py")),
}


# The cases under a launcher that starts several processes: a test of their own, run one at a time
# with the suite's other launches (conftest.py).
LAUNCHED = [case for case, (command, *_) in CASES.items() if command[0] != sys.executable]


@pytest.mark.parametrize("case", [case for case in CASES if case not in LAUNCHED])
def test_bad_input_gets_one_line(case, tmp_path):
    one_line(case, tmp_path)


@pytest.mark.parametrize("case", LAUNCHED)
def test_a_bad_launch_gets_one_line(case, tmp_path):
    one_line(case, tmp_path)


def one_line(case, tmp_path):
    command, arguments, setup, expected = CASES[case]
    if setup:
        setup(tmp_path)
    before = tree_digest(tmp_path)
    fill = {"tmp": str(tmp_path), "root": str(ROOT)}
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"))  # a warm start: same HOME
    start = time.time()
    done = execute([part.format(**fill) for part in command + arguments], cwd=tmp_path, env=env, timeout=120)
    elapsed = time.time() - start
    assert done.returncode != 0, done.stdout + done.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"
    stderr = done.stderr.strip()
    assert expected.format(**fill) in stderr, stderr
    if command[0] == sys.executable:  # our own scripts: exactly one line, no traceback
        assert len(stderr.splitlines()) == 1 and stderr.startswith("error: "), stderr
    elif "error: " in expected:  # under a launcher, one line from the processes before its report
        assert sum(line.startswith("error: ") for line in stderr.splitlines()) == 1, stderr
    # Nothing lost: earlier files untouched, and nothing new but the data cache.
    after = {p: h for p, h in tree_digest(tmp_path).items() if "/.cache/" not in p}
    assert after == before


# Flag values that parse_args refuses (check_args, before anything is set up), each a real run of
# the script: one line, a non-zero exit, nothing written.
RANGES = [("train_single", ["--image-size", "4097"], "--image-size 4097: must be from 8 to 4096 pixels"),
          ("train_dp", ["--image-size", "0"], "--image-size 0: must be from 8 to 4096 pixels"),
          ("train_single", ["--loader-budget", "inf"], "--loader-budget inf: must be a number of GB, 0 or more"),
          ("train_ddp", ["--synthetic-train-size", "0"], "--synthetic-train-size 0: must be 1 or more"),
          ("train_single", ["--max-steps", "0"], "--max-steps 0: must be 1 or more"),
          ("train_amp", ["--keep-checkpoints", "0"], "--keep-checkpoints 0: must be 1 or more"),
          ("train_single", ["--log-every", "0"], "--log-every 0: must be 1 or more"),
          ("train_single", ["--report-to", "x"], ("argument --report-to: invalid choice: 'x' (choose from "
                                                  "'wandb', 'tensorboard', 'mlflow', 'none'); see --help")),
          ("train_single", ["--report-to", "none", "wandb"], ("--report-to none wandb: none means no tracking; "
                                                              "pass --report-to none alone, or only trackers (wandb, "
                                                              "tensorboard, mlflow)")),
          ("train_dp", ["--bad-images", "x"],
           "argument --bad-images: invalid choice: 'x' (choose from 'stop', 'skip'); see --help"),
          ("train_single", ["--workers", "-1"], "--workers -1: must be 0 (load in the training process) or more"),
          ("train_single", ["--workers", "4", "--loader", "device"],
           "--workers 4 is for --loader workers, not --loader device: drop one of them"),
          ("train_single", ["--data-dir", f"{ROOT}/README.md"],
           f"--data-dir {ROOT}/README.md is a file, not a folder or a .tar.gz; pass a folder holding a Hub snapshot "
           f"with train-*.parquet and test-*.parquet files, a save_to_disk folder (dataset_dict.json), "
           f"cifar-10-batches-py or cifar-100-python (folder or .tar.gz), or an image folder train/<class>/* with "
           f"test/<class>/* (or val/, validation/)"),
          ("train_amp", ["--clip-grad", "0"], "--clip-grad 0.0: must be a positive number, e.g. 1.0"),
          ("train_ddp", ["--grad-accum", "0"], "--grad-accum 0: must be 1 or more"),
          ("train_single", ["--batch-size", "64", "--grad-accum", "3"],
           "--batch-size 64 does not divide into --grad-accum 3 micro-batches: use 63 or 66"),
          ("train_single", ["--lr", "-0.1"], "--lr -0.1: must be a positive number"
           ", e.g. 0.1, at most 3.4e+38 (float32's largest) once scaled by --scale-lr"),
          ("train_ddp", ["--lr", "inf"], "--lr inf: must be a positive number"
           ", e.g. 0.1, at most 3.4e+38 (float32's largest) once scaled by --scale-lr"),
          ("train_dp", ["--reference-batch-size", "0"], "--reference-batch-size 0: must be 1 or more"),
          ("train_single", ["--head-lr-scale", "1e300"], "--head-lr-scale 1e+300: the classifier's lr would be 1e+299, "
           "outside what float32 holds (1.18e-38 to 3.4e+38); use a scale such as 10"),
          ("train_ddp", ["--head-lr-scale", "1e-300", "--lr", "0.5"], "--head-lr-scale 1e-300: the classifier's lr "
           "would be 5e-301, outside what float32 holds (1.18e-38 to 3.4e+38); use a scale such as 10"),
          ("train_single", ["--model", "timm:resnet18.badtag"], "--model 'timm:resnet18.badtag': timm has no "
           "pretrained tag 'badtag' for resnet18 (its tags: a1_in1k, a2_in1k, a3_in1k, fb_ssl_yfcc100m_ft_in1k, "
           "fb_swsl_ig1b_ft_in1k, gluon_in1k, tv_in1k); pass --model timm:resnet18.a1_in1k"),
          ("train_dp", ["--share-gpus"], "unrecognized arguments: --share-gpus; see --help"),  # one GPU a replica
          ("train_fsdp", ["--share-gpus", "mpi"], "argument --share-gpus: invalid choice: 'mpi' (choose from "
                                                  "'auto', 'nccl', 'gloo'); see --help"),
          ("train_single", ["--checkpoint-every", "0"], "--checkpoint-every 0: must be 1 or more"),
          ("evaluate", ["--weights", "w.safetensors", "--eval-batch-size", "0"],
           "--eval-batch-size 0: must be 1 or more"),
          ("train_single", ["--momentum", "0"],
           "--momentum 0.0: must be above 0 (Nesterov needs some) and below 1, e.g. 0.9"),
          ("train_dp", ["--momentum", "nan"],
           "--momentum nan: must be above 0 (Nesterov needs some) and below 1, e.g. 0.9"),
          ("train_ddp", ["--weight-decay", "-1"], "--weight-decay -1.0: must be a number, 0 (none) or more"
           ", at most 3.4e+38 (float32's largest)"),
          ("train_single", ["--weight-decay", "inf"], "--weight-decay inf: must be a number, 0 (none) or more"
           ", at most 3.4e+38 (float32's largest)"),
          ("train_amp", ["--label-smoothing", "1"], "--label-smoothing 1.0: must be 0 (none) or more and below 1"),
          ("train_single", ["--random-erase", "1.5"], "--random-erase 1.5: must be a probability from 0 to 1, e.g. 0.25"),
          ("train_ddp", ["--mixup", "-1"],
           "--mixup -1.0: must be 0 (off) or a positive alpha of the Beta distribution, e.g. 0.2"),
          ("train_dp", ["--cutmix", "inf"],
           "--cutmix inf: must be 0 (off) or a positive alpha of the Beta distribution, e.g. 1.0"),
          ("train_single", ["--auto-augment", "randaugment"],
           "--auto-augment randaugment draws one policy per image, in the DataLoader workers: add --loader workers "
           "(on a batch tensor torchvision applies one operation to every image)"),
          ("train_ddp", ["--model", "timm:resnet18", "--sync-bn"],
           "--sync-bn with --model timm:resnet18: torch's SyncBatchNorm conversion drops the activation timm keeps "
           "inside its norm layers; drop --sync-bn"),
          ("train_ddp", ["--profile", "0"],
           "--profile 0: give the number of steps to trace, e.g. 5, or the steps to skip first and the number to "
           "trace, e.g. 20:5"),
          ("train_amp", ["--head-lr-scale", "nan"],
           "--head-lr-scale nan: must be a positive number, e.g. 10 (the classifier's lr 10 times the rest's)"),
          ("train_single", ["--warmup-epochs", "nan"],
           "--warmup-epochs nan: must be a number of epochs from 0 to --epochs 15"),
          ("train_dp", ["--epochs", "3", "--warmup-epochs", "4"],
           "--warmup-epochs 4.0: must be a number of epochs from 0 to --epochs 3"),
          ("train_single", ["--schedule", "step", "--epochs", "10"],
           "--milestones 4 9 14: must be increasing epochs from 1 to 9 for --schedule step with --epochs 10"),
          ("train_ddp", ["--schedule", "step", "--milestones", "9", "4"],
           "--milestones 9 4: must be increasing epochs from 1 to 14 for --schedule step with --epochs 15"),
          ("train_single", ["--schedule", "step", "--milestones", "0", "4"],
           "--milestones 0 4: must be increasing epochs from 1 to 14 for --schedule step with --epochs 15"),
          ("train_single", ["--schedule", "step", "--epochs", "1"],
           "--milestones 4 9 14: --schedule step with --epochs 1 has no epoch to divide the lr after; use --schedule "
           "onecycle, or 2 or more --epochs"),
          ("train_single", ["--seed", "-1"], "--seed -1: must be from 0 to 4294967295 (numpy's seeds are 32-bit)"),
          ("train_amp", ["--seed", "4294967296"],
           "--seed 4294967296: must be from 0 to 4294967295 (numpy's seeds are 32-bit)"),
          ("train_ddp", ["--dist-timeout", "inf"],
           "--dist-timeout inf: must be a number of seconds from 10 to 1000000000, e.g. 600 (below 10 the "
           "others time out while the main process starts the tracker or writes a checkpoint)"),
          ("train_amp", ["--dist-timeout", "0"],
           "--dist-timeout 0.0: must be a number of seconds from 10 to 1000000000, e.g. 600 (below 10 the "
           "others time out while the main process starts the tracker or writes a checkpoint)"),
          ("train_single", ["--model", "torchvision:resnet51"],
           "unknown torchvision model 'resnet51' in --model 'torchvision:resnet51' (closest: torchvision:resnet50, "
           "torchvision:resnet18, torchvision:resnet152, torchvision:resnet101, torchvision:resnet34); NAME is any of torchvision.models.list_models(module=torchvision.models)"),
          ("evaluate", ["--weights", "w.safetensors", "--model", "resnet99"],
           "unknown model 'resnet99': choose one of resnet18, resnet34, resnet50, resnet20, resnet32, resnet56, "
           "torchvision:NAME (e.g. torchvision:resnet50) where NAME is any of "
           "torchvision.models.list_models(module=torchvision.models), or timm:NAME (e.g. timm:resnet50) where "
           "NAME is any of timm.list_models()"),
          ("train_single", ["--model", "timm:zzzz"],  # no close name, whatever timm's version lists
           "unknown timm model 'zzzz' in --model 'timm:zzzz' (e.g. timm:resnet50, timm:convnext_tiny); NAME is any of "
           "timm.list_models(), with or without a pretrained tag"),
          ("train_single", ["--val-fraction", "nan"], "--val-fraction nan: must be between 0 and 1, e.g. 0.1"),
          ("train_dp", ["--loader-budget", "nan"], "--loader-budget nan: must be a number of GB, 0 or more"),
          ("train_single", ["--loader", "workers", "--loader-budget", "8"],
           "--loader-budget 8.0 is for --loader device or auto, not --loader workers: drop one of them"),
          ("train_dp", ["--output-dir", f"{ROOT}/README.md/run"],
           f"--output-dir {ROOT}/README.md/run: must be a folder, but {ROOT}/README.md is a file; choose another "
           f"--output-dir"),
          ("evaluate", ["--weights", "w.safetensors", "--cache-dir", f"{ROOT}/README.md"],
           f"--cache-dir {ROOT}/README.md: must be a folder, but it is a file; choose another --cache-dir"),
          ("benchmark", ["--output-dir", f"{ROOT}/README.md"],
           f"--output-dir {ROOT}/README.md: must be a folder, but it is a file; choose another --output-dir"),
          ("benchmark", ["--timeout", "nan"], "--timeout nan: must be a positive number of seconds, e.g. 1800"),
          ("benchmark", ["--sweep-batch-size", "64", "0"], "--sweep-batch-size 64 0: each must be 1 or more"),
          ("benchmark", ["--sweep-batch-size", "64", "--global-batch-size", "256"],
           "--sweep-batch-size varies the per-device batch but --global-batch-size 256 holds the global batch: drop "
           "one of them"),
          ("benchmark", ["--per-device-batch-size", "512", "--loader-images", "100"],
           "--loader-images 100: less than one batch of --per-device-batch-size 512; raise it to 512 or more"),
          ("gpu_check", ["--budget", "10"], "--budget 10: must be from 60 to 86400 seconds, e.g. 540"),
          ("gpu_check", ["--output-dir", f"{ROOT}/README.md"],
           f"--output-dir {ROOT}/README.md: must be a folder, but it is a file; choose another --output-dir"),
          ("check_gpus", ["--size-mb", "nan"], "--size-mb nan: must be a positive number, e.g. 64"),
          ("check_gpus", ["--timeout", "0"], "--timeout 0.0: must be a positive number, e.g. 120"),
          ("check_gpus", ["--iters", "0"], "--iters 0: must be 1 or more"),
          ("check_gpus", ["--cpu-processes", "1"], "--cpu-processes 1: must be 2 or more")]


@pytest.mark.parametrize("script, flags, message", RANGES)
def test_out_of_range_flags_are_one_line(script, flags, message, tmp_path):
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"))  # a warm start: same HOME
    done = execute([*python(f"{script}.py"), *flags], cwd=tmp_path, env=env, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [f"error: {message}"], done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_port_already_in_use():
    """torchrun stops at once naming the port; accelerate launch on one node picks a free one."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port),
                               str(ROOT / "scripts" / "train_ddp.py"), *SMALL], capture_output=True, text=True,
                              timeout=60)
    assert done.returncode != 0
    assert f"port: {port}" in done.stderr.strip().splitlines()[-1] and "address already in use" in done.stderr


def test_a_batch_that_does_not_split_into_processes_and_micro_batches():
    with pytest.raises(UserError) as error:
        check_batch_split(100, 2, "processes", grad_accum=4)
    assert error.value.message == ("--batch-size 100 does not divide by 8 (2 processes x 4 micro-batches of "
                                   "--grad-accum): use 96 or 104")
    check_batch_split(96, 2, "processes", grad_accum=4)


def test_no_disk_space_for_a_checkpoint(tmp_path):
    """A real full disk (a 3 MB tmpfs; root only): safetensors raises SafetensorError, not OSError.
    The failed checkpoint is removed, the previous one stays whole, and the line says what to do."""
    import shutil

    import torch
    from accelerate import Accelerator

    from common.run.checkpoints import TrainProgress, checkpoint_problem

    with tmpfs(tmp_path / "disk", "3m") as disk:
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(300, 300)  # 360 kB of weights, as much momentum
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = accelerator.prepare(model, optimizer)
        TrainProgress(accelerator)  # progress.json in every checkpoint
        model(torch.ones(2, 300)).sum().backward()
        optimizer.step()
        previous = save_checkpoint(accelerator, disk, step=4, keep=2)
        (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - (200 << 10)))
        with pytest.raises(UserError) as error:
            save_checkpoint(accelerator, disk, step=8, keep=2)
        assert error.value.message == (f"cannot write checkpoint {disk}/checkpoints/step_00000008 (no space left on "
                                       f"the device); the checkpoint {previous} is intact: free space in {disk}, then "
                                       f"run the same command with --output-dir {disk} --resume")
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_00000004"]
        assert checkpoint_problem(previous) is None
        accelerator.load_state(str(previous))
