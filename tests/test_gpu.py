"""On GPUs (the `gpu` marker): every training script on every path it has, on 1 GPU and on several
processes, compared with what it must agree with. The multi-process checks run a process per GPU, or,
on one GPU, 2 processes sharing it (--share-gpus: NCCL 2.30+ or gloo on CUDA tensors), which proves the
code paths (collectives, sharded checkpoints, per-process RNG, CUDA graphs under DDP), not speed, device
placement or copies between GPUs. `make gpu-check` (scripts/gpu_check.py) runs them in the order of its
plan (bench/gpu_plan.py) and puts the figures each one records into its report; by hand:
`pytest -m gpu tests/test_gpu.py [-k NAME]`. Without CUDA every `gpu` test is skipped, not failed, and
so is each DataParallel test on fewer than 2 GPUs.

Pass criteria (quoted in the report with each check's figures):
- learns: 3 epochs of the suite's tiny run (ResNet-20, 1,024 synthetic images) reach test_acc > 0.4
  (chance 0.1; 0.48-0.52 on CPUs; test_acc_ema with --ema-decay) with a finite loss, and evaluate.py on
  the saved weights alone gives the logged accuracy within 1 test image (it picks its own kernels and runs fp32 matmuls without TF32);
- agreement: N-process DDP, FSDP2, DataParallel on N GPUs and DDP with --sync-bn end 5 steps (lr 0.001, no augmentation,
  --no-tf32 --deterministic) within 1e-4 of one GPU, largest absolute weight difference (the CPU suite
  holds 1e-5; GPU kernels' reduction order depends on the batch per GPU), and plain DDP, whose
  BatchNorm sees only its own slice, does not (negative control);
- resume: stopped in the middle of epoch 2 and resumed with --resume, --deterministic, the final
  weights equal the uninterrupted run's bit for bit;
- TF32: on compute capability 8.0 and newer, --tf32 and --no-tf32 train different weights;
- compile: --compile (TorchInductor) trains eager's weights: after 6 steps at lr 0.1 without TF32, each tensor
  within 1% of how far eager moved it from the initial weights (every one moved more than 5e-4), and a copy
  5% further along does not pass (negative control);
- shards: each FSDP2 process holds its 1/N of the parameter and optimizer bytes (within 10 %), and
  FSDP2's weights are DDP's within 1e-4;
- refusal: without --share-gpus, more processes than GPUs stop in one line;
- profile: --profile writes every process's trace with CUDA kernels in it, and each process reads
  its GPU's utilisation (0-100 %, not all 0);
- fine-tuning: timm's ResNet-18 from a weights file at 224 px through DataLoader workers learns
  (its loss halves, test_acc > 0.5, chance 1/3) and evaluate.py reproduces it;
- check_gpus.py passes every check.
The tests at the end need no GPU: gpu_check's one line without CUDA, its plan, and its report writer.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import set_seed
import helpers
from helpers import BIN, DATA, ROOT, TINY, bad_ends, execute, image_folder, user_env, weights

from bench import gpu_plan, gpu_pytest, gpu_report
from common.data.device import on_device, tensor_loader
from common.data.synthetic import make_synthetic
from common.data.transform import BatchTransform
from common.observe.utilisation import DataWait
from common.parallel import launch as launch_module
from common.parallel.step_guard import StepGuard
from common.recipe.models import build_model

_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

GPUS = torch.cuda.device_count()
NATIVE_BF16 = HAS_TF32 = GPUS > 0 and torch.cuda.get_device_capability(0) >= (8, 0)  # Ampere and newer
ONE_GPU = {"CUDA_VISIBLE_DEVICES": gpu_check.first_visible_gpu()}
# The multi-process checks: a process per GPU, or 2 processes sharing the one GPU (--share-gpus: auto,
# NCCL where its version shares a GPU, else gloo).
PROCESSES = max(GPUS, 2)
SHARED = ("--share-gpus",) if GPUS == 1 else ()
# FSDP2's processes share a GPU over NCCL 2.30 and newer only: over gloo they crash, and train_fsdp.py refuses it.
FSDP_REFUSED = GPUS == 1 and not launch_module.nccl_shares_gpus(launch_module.nccl_version())
SKIP_FSDP = pytest.mark.skipif(FSDP_REFUSED, reason=f"FSDP2's 2 processes share a GPU over NCCL 2.30 and newer "
                                                    f"only; this torch has NCCL {launch_module.nccl_version()}")
ACCELERATE = (str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
              str(ROOT / "accelerate_configs" / "4gpu.yaml"), "--num_processes", str(PROCESSES))
FROZEN_BN = str(ROOT / "tests" / "frozen_bn.py")
PROBE_FSDP = str(ROOT / "tests" / "probe_fsdp.py")
ALL_BATCH = math.lcm(64, PROCESSES)  # the tiny run's batch, or the next that divides by the processes
LEARNED, EVAL_IMAGES, AGREE_TOL = 0.4, 1, 1e-4
COMPILE_TOL = 1e-2  # of how far eager moved each tensor from the initial weights
# evaluate.py runs the test set in one batch, eager, in strict fp32: other kernels than the run's own evaluation
# (batches of 64, split over GPUs, cuDNN's search, TF32, 16-bit or compiled), whose rounding can flip the
# near-ties of a half-trained model. 1 image for fp32 on 1 GPU; 1 % of the test set otherwise.
EVAL_IMAGES_LOOSE = 3
CPU_TESTS = {"test_gpu_tests_carry_the_marker", "test_without_cuda_make_gpu_check_says_so_in_one_line",
             "test_the_report_renders_fabricated_results", "test_the_plan_fits_its_budget_and_names_real_checks",
             "test_a_check_cut_short_still_leaves_its_report", "test_a_failed_launch_names_its_cause",
             "test_the_gpu_wheels_are_pinned_once"}


def gpu(count: int = 1):
    """The `gpu` marker, and a skip with its reason where fewer than ``count`` GPUs are visible."""
    def mark(test):
        reason = f"needs {count} CUDA GPU{'s' if count > 1 else ''}, {GPUS} visible"
        return pytest.mark.gpu(pytest.mark.skipif(GPUS < count, reason=reason)(test))
    return mark


@pytest.fixture
def record(request):
    """Figures for gpu_check's report: one JSON line per call, in $GPU_CHECK_RESULTS when it is set."""
    def write(**figures):
        if os.environ.get(gpu_check.RESULTS_ENV):
            with open(os.environ[gpu_check.RESULTS_ENV], "a") as f:
                f.write(json.dumps({"test": request.node.name, **figures}) + "\n")
    return write


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def table_widths(markdown: str) -> list[set[int]]:
    """For each markdown table, the numbers of cell borders (unescaped |) its lines have."""
    tables, current = [], None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = set()
            tables.append(current)
        current.add(len(re.findall(r"(?<!\\)\|", line)))
    return tables


def run(script, *args, **kwargs):
    """helpers.run, a training script run eagerly unless its flags say --compile: the checks here were made for
    eager runs, and --compile auto (the default: CUDA graphs on a GPU) has cases of its own (``--compile auto``)."""
    compiled = "--compile" in map(str, args) or not str(script).startswith("train_")
    return helpers.run(script, *args, *(() if compiled else ("--compile", "none")), **kwargs)


def max_difference(a, b) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ------------------------------------------------------------------ every script on every path

# name: (script, GPUs: 1 or "all", flags). 1-GPU runs see only the first visible GPU; "all" runs
# launch PROCESSES processes (train_dp.py: one process driving every GPU, 2 or more).
CASES = {
    # the defaults (--compile auto): on a GPU each step replayed as CUDA graphs
    "train_single-defaults": ("train_single.py", 1, ("--compile", "auto")),
    "train_single-tf32": ("train_single.py", 1, ("--deterministic",)),
    "train_single-fp32": ("train_single.py", 1, ("--deterministic", "--no-tf32")),
    "train_dp-1gpu": ("train_dp.py", 1, ("--deterministic",)),
    "train_ddp-1gpu": ("train_ddp.py", 1, ("--deterministic",)),
    "train_amp-fp16": ("train_amp.py", 1, ("--deterministic", "--mixed-precision", "fp16")),
    "train_amp-bf16": ("train_amp.py", 1, ("--deterministic", "--mixed-precision", "bf16")),
    "train_amp-bf16-compile": ("train_amp.py", 1, ("--mixed-precision", "bf16", "--compile")),
    "train_dp-all": ("train_dp.py", "all", ("--deterministic",)),
    "train_ddp-all-sync-bn": ("train_ddp.py", "all", ("--deterministic", "--sync-bn")),
    "train_ddp-all-compile": ("train_ddp.py", "all", ("--compile",)),
    "train_amp-all-fp16-sync-bn": ("train_amp.py", "all", ("--deterministic", "--mixed-precision", "fp16",
                                                           "--sync-bn")),
    "train_amp-all-bf16-sync-bn": ("train_amp.py", "all", ("--deterministic", "--mixed-precision", "bf16",
                                                           "--sync-bn")),
    "train_fsdp-all": ("train_fsdp.py", "all", ("--deterministic",)),
    # --ema-decay: model.safetensors holds the average, whose accuracy is test_acc_ema
    "train_amp-bf16-ema": ("train_amp.py", 1, ("--deterministic", "--mixed-precision", "bf16", "--ema-decay", "0.9")),
    "train_dp-all-ema": ("train_dp.py", "all", ("--deterministic", "--ema-decay", "0.9")),
    "train_fsdp-all-ema": ("train_fsdp.py", "all", ("--deterministic", "--ema-decay", "0.9")),
    # --compile-mode reduce-overhead: CUDA graphs in training and in each evaluation after it (DDP's
    # trap: pytorch#128218), bf16 AMP and the weight average through the same graphs
    "train_single-cuda-graphs": ("train_single.py", 1, ("--compile", "--compile-mode", "reduce-overhead")),
    "train_amp-bf16-cuda-graphs-ema": ("train_amp.py", 1, ("--mixed-precision", "bf16", "--compile", "--compile-mode",
                                                           "reduce-overhead", "--ema-decay", "0.9")),
    "train_ddp-all-cuda-graphs": ("train_ddp.py", "all", ("--compile", "--compile-mode", "reduce-overhead")),
}


def launcher(script: str, all_gpus: bool) -> tuple[str, ...]:
    """PROCESSES processes through accelerate launch; train_dp.py drives every GPU from one."""
    return ACCELERATE if all_gpus and script != "train_dp.py" else (sys.executable,)


def shared(script: str, all_gpus: bool) -> tuple[str, ...]:
    """--share-gpus where the processes outnumber the GPUs (DataParallel needs a GPU a replica)."""
    return SHARED if all_gpus and script != "train_dp.py" else ()


def case(name: str):
    """A CASES entry as a pytest parameter, skipped where this machine cannot run it."""
    script, gpus, flags = CASES[name]
    marks = []
    if gpus == "all" and script == "train_dp.py":
        marks.append(pytest.mark.skipif(GPUS < 2, reason=f"DataParallel needs 2 CUDA GPUs (one a replica), "
                                                         f"{GPUS} visible"))
    if gpus == "all" and script == "train_fsdp.py":
        marks.append(SKIP_FSDP)
    if "bf16" in flags:
        marks.append(pytest.mark.skipif(not NATIVE_BF16, reason="no native bf16 (compute capability below 8.0)"))
    return pytest.param(name, marks=marks, id=name)


def train(name: str, out: Path, *extra):
    """The tiny run (16 steps an epoch) of a CASES entry; on all GPUs with the batch and the training
    split scaled by ALL_BATCH / 64 (the same as 1 GPU's with 2, 4 or 8 GPUs)."""
    script, gpus, flags = CASES[name]
    size = ["--batch-size", 64] if gpus == 1 else ["--batch-size", ALL_BATCH, "--synthetic-train-size", 16 * ALL_BATCH]
    return run(script, *TINY, *size, "--report-to", "none", *flags, *shared(script, gpus != 1), *extra,
               "--output-dir", out,
               launcher=launcher(script, gpus != 1), env_extra=ONE_GPU if gpus == 1 else None,
               timeout=1200 if "--compile" in flags else 300)  # N processes compiling on shared cores


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run folder of a CASES entry, trained on first use."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(name) / "run"
            train(name, out)
            done[name] = out
        return done[name]
    return get


@gpu()
@pytest.mark.parametrize("name", [case(name) for name in CASES])
def test_every_script_learns_and_evaluate_reproduces_it(trained, record, name):
    out = trained(name)
    logged, settings = metrics(out), config(out)
    evaluated = run("evaluate.py", "--weights", out / "model.safetensors", *DATA, env_extra=ONE_GPU)
    script, gpus, flags = CASES[name]
    allowed = EVAL_IMAGES if gpus == 1 and not {"--mixed-precision", "--compile"} & set(flags) else EVAL_IMAGES_LOOSE
    found = re.match(r"test_acc=\S+ \((\d+)/(\d+)\)", evaluated.stdout)
    assert found, evaluated.stdout
    correct, total = int(found.group(1)), int(found.group(2))
    accuracy = "test_acc_ema" if "--ema-decay" in flags else "test_acc"  # what the weights file holds
    logged_correct = round(logged[accuracy] * logged["test_images"])
    record(criterion=f"learns: test_acc > {LEARNED} and a finite loss after 3 epochs; evaluate.py within "
                     f"{allowed} test images of the logged accuracy",
           test_acc=logged["test_acc"], train_loss=logged["train_loss"], evaluate_correct=correct,
           logged_correct=logged_correct, test_images=total, img_per_s=round(logged["img_per_s"]),
           world_size=settings["world_size"], backend=settings["backend"],
           processes_per_gpu=settings["processes_per_gpu"],
           **{k: v for k, v in logged.items() if k.startswith(("gpu_mem", "gpu_util"))})
    assert math.isfinite(logged["train_loss"]) and logged[accuracy] > LEARNED, logged
    assert total == logged["test_images"] and abs(correct - logged_correct) <= allowed, evaluated.stdout
    assert settings["world_size"] == (PROCESSES if gpus == "all" and script != "train_dp.py" else 1)
    if shared(script, gpus == "all"):  # the rehearsal says so, at the start and in config.json
        assert settings["processes_per_gpu"] == 2 and settings["gpu_sharing"].startswith("warning: --share-gpus")
    assert settings["args"]["deterministic"] == ("--deterministic" in flags)
    assert settings["args"]["tf32"] == ("--no-tf32" not in flags)
    if "--compile" in flags:
        assert settings["args"]["compile"] == ("auto" if "auto" in flags else "inductor")
    if {"reduce-overhead", "auto"} & set(flags):
        assert "its steps replayed as CUDA graphs" in settings["compile"], settings["compile"]
    if script == "train_amp.py":
        assert settings["mixed_precision"] == flags[flags.index("--mixed-precision") + 1]


@gpu()
@pytest.mark.skipif(GPUS > 0 and not HAS_TF32, reason="no TF32 below compute capability 8.0")
def test_tf32_changes_fp32_math_and_no_tf32_turns_it_off(trained, record):
    tf32, ieee = weights(trained("train_single-tf32")), weights(trained("train_single-fp32"))
    difference = max_difference(tf32, ieee)
    record(criterion="TF32: --tf32 and --no-tf32 train different weights (compute capability >= 8.0)",
           max_abs_difference=difference)
    assert difference > 0


@gpu()
@pytest.mark.parametrize("name", [case(name) for name in ("train_single-tf32", "train_dp-1gpu", "train_amp-fp16",
                                                          "train_amp-bf16", "train_dp-all", "train_ddp-all-sync-bn",
                                                          "train_amp-all-bf16-sync-bn", "train_fsdp-all-ema",
                                                          "train_amp-bf16-ema")])
def test_stop_and_resume_is_bit_for_bit(trained, record, tmp_path, name):
    reference = trained(name)
    steps = config(reference)["steps_per_epoch"]
    stop = steps + steps // 2  # the middle of epoch 2
    out = tmp_path / "run"
    train(name, out, "--max-steps", stop)
    done = train(name, out, "--resume")
    ours, theirs = weights(out), weights(reference)
    differing = [key for key in theirs if key not in ours or not torch.equal(ours[key], theirs[key])]
    record(criterion="resume: stopped mid-epoch and resumed under --deterministic, the weights equal the "
                     "uninterrupted run's bit for bit", stopped_at_step=stop, steps=metrics(reference)["step"],
           differing_tensors=len(differing), tensors=len(theirs))
    assert "resumed from" in done.stdout and f"step {stop}" in done.stdout
    assert ours.keys() == theirs.keys() and not differing, differing[:5]


# ------------------------------------------------------- N processes against one, fixed steps

AGREE_BATCH = 32 * PROCESSES
AGREE = ["--dataset", "synthetic", "--synthetic-train-size", 8 * AGREE_BATCH, "--synthetic-test-size", 301,
         "--model", "resnet20", "--batch-size", AGREE_BATCH, "--reference-batch-size", AGREE_BATCH, "--no-augment",
         "--lr", 0.001, "--epochs", 1, "--max-steps", 5, "--report-to", "none", "--no-tf32", "--deterministic"]
SHARD_TOL = 0.1  # of each process's 1/N share of the bytes (FSDP2 pads a dimension that does not divide)


def agree_run(script: str, out: Path, *extra, frozen: bool, many: bool, probe: Path | None = None):
    """5 steps of AGREE in one process on the first GPU, or (``many``) in PROCESSES processes (train_dp.py:
    one driving every GPU); BatchNorm frozen (tests/frozen_bn.py) or not; with ``probe``, under
    tests/probe_fsdp.py, which writes what each process holds to ``probe``.<rank>."""
    wrappers = [*([FROZEN_BN] if frozen else []), *([PROBE_FSDP] if probe else [])]
    run(script, *AGREE, *extra, *shared(script, many), "--output-dir", out,
        launcher=(*launcher(script, many), *wrappers),
        env_extra={**({} if many else ONE_GPU), **({"PROBE_FILE": str(probe)} if probe else {})})
    return weights(out)


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """train_single's weights after AGREE on one GPU, by BatchNorm frozen or not, made on first use."""
    done = {}

    def get(frozen: bool):
        if frozen not in done:
            done[frozen] = agree_run("train_single.py", tmp_path_factory.mktemp("one-gpu") / "run", frozen=frozen,
                                     many=False)
        return done[frozen]
    return get


@pytest.fixture(scope="module")
def agreed(tmp_path_factory):
    """(weights, run folder) of a script's AGREE run in PROCESSES processes, BatchNorm frozen, made on first
    use; train_fsdp.py's with its shards recorded (run folder/../shards.<rank>)."""
    done = {}

    def get(script: str):
        if script not in done:
            out = tmp_path_factory.mktemp(script.removesuffix(".py")) / "run"
            probe = out.parent / "shards" if script == "train_fsdp.py" else None
            done[script] = agree_run(script, out, frozen=True, many=True, probe=probe), out
        return done[script]
    return get


@gpu()
@pytest.mark.parametrize("script", ["train_ddp.py", pytest.param("train_fsdp.py", marks=SKIP_FSDP), pytest.param(
    "train_dp.py", marks=pytest.mark.skipif(GPUS < 2, reason=f"DataParallel needs 2 CUDA GPUs (one a replica), "
                                                             f"{GPUS} visible"))])
def test_all_gpus_match_one_gpu(one_gpu, agreed, record, script):
    """DDP (its processes' gradients all-reduced), FSDP2 (sharded weights, gradients reduce-scattered) and
    DataParallel (which first checks the copies between GPUs) split the batch and combine the gradients: with
    BatchNorm frozen nothing else differs from one GPU. FSDP2's processes each hold their 1/N of the
    parameters and of the optimizer's momentum, and end with DDP's weights."""
    ours, out = agreed(script)
    set_seed(0)
    initial = build_model("resnet20", num_classes=10).state_dict()
    difference, moved = max_difference(ours, one_gpu(True)), max_difference(ours, initial)
    figures = {}
    if script == "train_fsdp.py":
        shards = [json.loads(Path(f"{out.parent / 'shards'}.{rank}").read_text()) for rank in range(PROCESSES)]
        figures = {"param_share": [round(s["param_bytes"] / s["param_full_bytes"], 4) for s in shards],
                   "optimizer_share": [round(s["optimizer_bytes"] / s["param_full_bytes"], 4) for s in shards],
                   "param_full_mb": round(shards[0]["param_full_bytes"] / 2**20, 2),
                   "max_abs_difference_from_ddp": max_difference(ours, agreed("train_ddp.py")[0])}
    settings = config(out)
    record(criterion=f"agreement: {PROCESSES} processes end 5 steps within {AGREE_TOL:g} of 1 GPU (largest absolute "
                     f"weight difference; BatchNorm frozen, no augmentation, no TF32); FSDP2: each process holds "
                     f"1/{PROCESSES} of the parameter and optimizer bytes within {SHARD_TOL:.0%}, and DDP's weights "
                     f"within {AGREE_TOL:g}", processes=settings["world_size"], backend=settings["backend"],
           processes_per_gpu=settings["processes_per_gpu"], max_abs_difference=difference, moved_from_init=moved,
           **figures, **{k: v for k, v in metrics(out).items() if k.startswith("gpu_mem")})
    assert difference < AGREE_TOL and moved > 1e-3
    if figures:
        shares = figures["param_share"] + figures["optimizer_share"]
        assert all(abs(share * PROCESSES - 1) < SHARD_TOL for share in shares), shares
        assert figures["max_abs_difference_from_ddp"] < AGREE_TOL


@gpu()
def test_sync_bn_matches_one_gpu_and_plain_ddp_does_not(one_gpu, record, tmp_path):
    synced = agree_run("train_ddp.py", tmp_path / "sync", "--sync-bn", frozen=False, many=True)
    plain = agree_run("train_ddp.py", tmp_path / "plain", frozen=False, many=True)
    reference = one_gpu(False)
    with_sync, without = max_difference(synced, reference), max_difference(plain, reference)
    record(criterion=f"--sync-bn: {PROCESSES}-process DDP with SyncBatchNorm ends 5 steps within {AGREE_TOL:g} of 1 "
                     f"GPU; without it (BatchNorm per process's slice) it does not", processes=PROCESSES,
           backend=config(tmp_path / "sync")["backend"], max_abs_difference_sync_bn=with_sync,
           max_abs_difference_without=without)
    assert with_sync < AGREE_TOL < without


# ------------------------------------------------------------------ the launch, the profiler, fine-tuning

@gpu()
def test_more_processes_than_gpus_is_refused_without_share_gpus(record, tmp_path):
    """One process more than there are GPUs, without --share-gpus: one line, nothing written; and where this
    torch's NCCL cannot share a GPU, --share-gpus nccl is refused the same way, as is FSDP2 sharing it over gloo."""
    def refused(*flags, script="train_ddp.py"):
        done = run(script, *AGREE, *flags, "--output-dir", tmp_path / "run", check=False, timeout=180,
                   launcher=(*ACCELERATE[:-1], str(GPUS + 1)))
        return done.returncode, [line for line in done.stderr.splitlines() if line.startswith("error: ")]

    status, lines = refused()
    record(criterion="refusal: more processes than GPUs without --share-gpus stop with one line (and "
                     "--share-gpus nccl where NCCL cannot share a GPU)", exit_status=status, error_lines=lines)
    assert status != 0 and lines == [
        f"error: the launch starts {GPUS + 1} processes on this node but it has {GPUS} GPUs: pass --num_processes "
        f"{GPUS} (per node) to accelerate launch, or use a config for {GPUS} GPUs (to rehearse this launch here, "
        f"several processes a GPU: add --share-gpus)"]
    nccl = launch_module.nccl_version()
    if not launch_module.nccl_shares_gpus(nccl):
        status, lines = refused("--share-gpus", "nccl")
        assert status != 0 and len(lines) == 1 and lines[0].startswith("error: --share-gpus nccl: this torch's NCCL")
        status, lines = refused("--share-gpus", script="train_fsdp.py")
        record(fsdp_over_gloo_exit_status=status, fsdp_over_gloo_error_lines=lines)
        assert status != 0 and len(lines) == 1 and lines[0].startswith(
            "error: --share-gpus: FSDP2's processes share a GPU over NCCL only")
    assert not (tmp_path / "run").exists()


@gpu()
def test_a_failure_in_one_process_ends_every_process(record, tmp_path):
    """An image that one process cannot decode (--loader workers) while the others wait in an NCCL
    collective, which fails by nothing but its timeout: the failure watch ends every process within
    seconds (common.failures.watch_failures), one line said, no process aborted or killed."""
    root = image_folder(tmp_path / "data", train=48, val=8, classes=2)
    bad = sorted((root / "train").rglob("*.jpg"))[17]
    bad.write_bytes(bad.read_bytes()[:300])
    start = time.monotonic()
    done = run("train_ddp.py", "--data-dir", root, "--image-size", 32, "--model", "resnet20", "--batch-size",
               math.lcm(8, PROCESSES), "--epochs", 1, "--loader", "workers", "--workers", 1, "--report-to", "none",
               "--dist-timeout", 600, *SHARED, "--output-dir", tmp_path / "run", launcher=ACCELERATE, check=False,
               timeout=300)
    seconds = time.monotonic() - start
    errors = re.findall(r"error: .*", done.stderr)
    record(criterion="a failure in one process: every process ends within seconds over NCCL, one line, none "
                     "aborted or killed by a signal", seconds=round(seconds, 1), error_lines=errors,
           bad_ends=bad_ends(done.stderr), exit_codes=re.findall(r"exitcode\s*: (-?\d+)", done.stderr))
    assert done.returncode != 0 and len(errors) == 1 and errors[0].startswith(f"error: cannot decode image {bad}")
    assert bad_ends(done.stderr) == [], done.stderr[-3000:]
    assert seconds < 240, seconds  # start-up and a few steps, not --dist-timeout's 600 s


@gpu()
def test_profile_traces_cuda_and_utilisation_is_read_per_process(record, tmp_path):
    out = tmp_path / "run"
    done = run("train_ddp.py", *TINY, "--batch-size", ALL_BATCH, "--synthetic-train-size", 16 * ALL_BATCH, "--epochs",
               2, "--profile", "3", "--report-to", "none", *SHARED, "--output-dir", out, launcher=ACCELERATE)
    traces = [json.loads((out / "profile" / f"trace_rank{rank}.json").read_text()) for rank in range(PROCESSES)]
    kernels = [sum(event.get("cat") == "kernel" for event in trace.get("traceEvents", [])) for trace in traces]
    logged = metrics(out)
    record(criterion="--profile: every process's trace holds CUDA kernels and the table GPU times; each process "
                     "reads its GPU's utilisation (0-100 %, not all 0)", kernel_events=kernels,
           gpu_util_pct=logged.get("gpu_util_pct"), gpu_util_absent=logged.get("gpu_util_absent"))
    assert all(count > 0 for count in kernels) and "self GPU us" in done.stdout
    utilisation = logged.get("gpu_util_pct")
    assert utilisation and len(utilisation) == PROCESSES, logged
    assert all(0 <= value <= 100 for value in utilisation) and max(utilisation) > 0


@gpu()
def test_fine_tunes_a_timm_model_at_224_px_through_the_workers(record, tmp_path):
    """timm's ResNet-18 from a weights file (made here: no download), its head swapped for 3 classes, at
    the weights' 224 px, JPEGs of 256 px decoded and augmented in DataLoader workers, under DDP."""
    import timm
    from safetensors.torch import save_file

    data = image_folder(tmp_path / "data", train=96, val=48, classes=3, sizes=((256, 256),))
    torch.manual_seed(1)
    save_file(timm.create_model("resnet18", num_classes=1000).state_dict(), tmp_path / "imagenet.safetensors")
    batch, out = math.lcm(32, PROCESSES), tmp_path / "run"
    run("train_ddp.py", "--data-dir", data, "--model", "timm:resnet18", "--pretrained-path",
        tmp_path / "imagenet.safetensors", "--loader", "workers", "--optimizer", "adamw", "--batch-size", batch,
        "--reference-batch-size", batch, "--epochs", 4, "--report-to", "none", *SHARED, "--output-dir", out,
        launcher=ACCELERATE, env_extra={"HF_HUB_OFFLINE": "1"}, timeout=600)
    settings, history = config(out), [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = run("evaluate.py", "--weights", out / "model.safetensors", "--data-dir", data, env_extra=ONE_GPU)
    found = re.match(r"test_acc=\S+ \((\d+)/(\d+)\)", evaluated.stdout)
    assert found, evaluated.stdout
    logged_correct = round(history[-1]["test_acc"] * history[-1]["test_images"])
    record(criterion=f"fine-tuning at 224 px through workers: the loss halves, test_acc > 0.5 (chance 1/3), "
                     f"evaluate.py within {EVAL_IMAGES_LOOSE} images", image_size=settings["image_size"],
           loader=settings["loader"], train_loss=[round(h["train_loss"], 4) for h in history],
           test_acc=history[-1]["test_acc"], evaluate_correct=int(found.group(1)), logged_correct=logged_correct,
           img_per_s=round(history[-1]["img_per_s"]), data_wait_frac=history[-1]["data_wait_frac"])
    assert settings["image_size"] == [224, 224] and settings["loader"] == "workers"
    assert history[-1]["train_loss"] < history[0]["train_loss"] / 2 and history[-1]["test_acc"] > 0.5, history
    assert abs(int(found.group(1)) - logged_correct) <= EVAL_IMAGES_LOOSE, evaluated.stdout


def relative_differences(ours, reference, initial) -> dict:
    """For each float tensor, the largest difference of ``ours`` from ``reference`` over the largest
    difference of ``reference`` from ``initial`` (how far training moved it); inf for an integer one
    (BatchNorm's step counts) that is not equal."""
    def relative(key, value):
        if not value.is_floating_point():
            return 0.0 if torch.equal(ours[key], value) else math.inf
        difference = (ours[key].double() - value.double()).abs().max().item()
        moved = (value.double() - initial[key].double()).abs().max().item()
        return difference / moved if moved else 0.0 if difference == 0 else math.inf
    return {k: relative(k, v) for k, v in reference.items()}


@gpu()
def test_compile_trains_the_eager_weights(record, tmp_path):
    # lr 0.1 from the first step (TINY's batch is its reference batch): in 6 steps every tensor moves far past
    # float32's rounding, and 1% of that is far below what a wrong gradient in any one layer changes.
    flags = [*TINY, "--epochs", 1, "--max-steps", 6, "--warmup-epochs", 0, "--no-tf32", "--report-to", "none"]
    run("train_single.py", *flags, "--output-dir", tmp_path / "eager", env_extra=ONE_GPU)
    run("train_single.py", *flags, "--compile", "--output-dir", tmp_path / "compiled", env_extra=ONE_GPU)
    eager, compiled = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    set_seed(0)
    initial = build_model("resnet20", num_classes=10).state_dict()  # what both runs start from
    assert compiled.keys() == eager.keys() == initial.keys()
    moved = {k: (v.double() - initial[k].double()).abs().max().item() for k, v in eager.items()
             if v.is_floating_point()}
    differences = relative_differences(compiled, eager, initial)
    # Negative control: each tensor 5% further along than eager took it fails the same comparison.
    overshot = {k: v + 0.05 * (v - initial[k]) if v.is_floating_point() else v for k, v in eager.items()}
    record(criterion=f"--compile: TorchInductor ends 6 steps (lr 0.1, no TF32) with each tensor within "
                     f"{COMPILE_TOL:.0%} of how far eager moved it from the initial weights (each moved more than "
                     f"5e-4); a copy 5% further along fails", largest_relative_difference=max(differences.values()),
           least_moved=min(moved.values()), max_abs_difference=max_difference(compiled, eager))
    assert config(tmp_path / "compiled")["args"]["compile"] == "inductor"
    assert min(moved.values()) > 5e-4, moved
    assert {k for k, d in differences.items() if d > COMPILE_TOL} == set(), differences
    assert {k for k, d in relative_differences(overshot, eager, initial).items() if d > COMPILE_TOL} == set(moved)


@gpu()
def test_auto_decides_from_this_gpu_and_a_weight_average_resumes_across_compile_settings(record, tmp_path):
    """--compile auto on the device's real properties (compute capability, Triton, the C compiler
    Triton finds): CUDA graphs exactly where nothing is missing, said on the start line; a run with
    --ema-decay checkpointed under the defaults resumes with --compile none (the advice of a failed
    compile) and writes the average it saved, bit for bit."""
    from common.recipe.compiling import triton_cannot_build, why_eager_here
    capability = torch.cuda.get_device_capability()
    eager = capability < (7, 0) or triton_cannot_build() is not None  # what auto must see here
    flags = [*TINY, "--epochs", 2, "--max-steps", 4, "--ema-decay", 0.5, "--report-to", "none"]
    out = tmp_path / "run"
    first = run("train_single.py", *flags, "--output-dir", out, env_extra=ONE_GPU)
    said = config(out).get("compile", "")
    record(criterion="auto compiles with CUDA graphs where the GPU, Triton and a C compiler allow, else "
                     "says why; a weight average saved compiled resumes eager bit for bit",
           capability=".".join(map(str, capability)), why_eager=why_eager_here(), compile_line=said)
    assert (why_eager_here() is not None) == eager, why_eager_here()
    assert ("replayed as CUDA graphs" in said) != eager, said
    checkpoint = out / "checkpoints" / "step_00000004"
    saved = {k.removeprefix("average/"): v for k, v in
             helpers.load_file(checkpoint / "weight_average.safetensors").items()}
    run("train_single.py", *flags, "--compile", "none", "--resume", "--output-dir", out, env_extra=ONE_GPU)
    final = weights(out)
    assert all(torch.equal(final[k].cpu(), v.cpu()) for k, v in saved.items()), first.stdout


@gpu()
def test_check_gpus_passes(record):
    done = run("check_gpus.py", check=False)
    record(criterion="check_gpus.py: every check passes (exit status 0)", exit_status=done.returncode,
           results=[line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))])
    assert done.returncode == 0, done.stdout + done.stderr


@gpu()
def test_a_training_step_never_makes_the_host_wait_for_the_gpu(record, tmp_path):
    """The input path (indices, gather, augmentation, normalisation), the data-wait clock, the
    forward and backward passes, the optimizer and the step check (NaN loss, stop signals) queue their work without a
    synchronising call: torch.cuda.set_sync_debug_mode("error") raises on any. The NaN check's one
    wait, for the previous step's loss, is an event's (long complete by then)."""
    class OneProcess:
        num_processes = 1

        def reduce(self, tensor, reduction):
            return tensor

    device = torch.device("cuda")
    data = on_device(make_synthetic(640, 64), device)
    batches = iter(tensor_loader(data.train_images, data.train_labels, 64, shuffle=True))
    transform = BatchTransform([125.0, 123.0, 114.0], [63.0, 62.0, 66.0], channels_last=True)
    model = build_model("resnet20", 10).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    guard, wait = StepGuard(OneProcess(), tmp_path), DataWait(device)

    def step(i):
        wait.start()
        images, labels = next(batches)
        images = transform.train(images, seed=(0, i))
        wait.stop()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        guard.check(loss, i)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for i in range(2):  # first use: pinned memory, cuDNN's algorithm search, the optimizer's state
        step(i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(2, 8):
            step(i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    guard.flush()
    record(criterion="6 training steps under torch.cuda.set_sync_debug_mode('error') raise nothing",
           data_wait_s=round(wait.seconds(), 6))


# --------------------------------------------------------------------------- without a GPU

def test_gpu_tests_carry_the_marker():
    tests = {name: test for name, test in globals().items() if name.startswith("test_")}
    for name, test in tests.items():
        marks = {mark.name for mark in getattr(test, "pytestmark", [])}
        assert ("gpu" in marks) == (name not in CPU_TESTS), name
        assert "gpu" not in marks or "skipif" in marks, name  # skipped, not failed, without CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_without_cuda_make_gpu_check_says_so_in_one_line(tmp_path):
    venv = Path(sys.prefix)  # this suite's virtual environment, counted as installed (as tests/helpers.make)
    done = subprocess.run(["make", "-C", str(ROOT), "-o", f"{venv}/bin/.installed", f"VENV={venv}", "gpu-check",
                           f"ARGS=--output-dir {tmp_path / 'report'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    ours = [line for line in done.stderr.splitlines() if not line.startswith("make")]  # make adds "Error 1"
    assert done.returncode != 0
    assert ours == [f"error: gpu-check needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False; "
                    f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): run it on a machine with "
                    f"an NVIDIA GPU"], done.stderr
    assert [line for line in done.stdout.splitlines() if not line.startswith("make")] == []
    assert not (tmp_path / "report").exists()


def test_the_report_renders_fabricated_results(tmp_path):
    # The checks: each one's outcome as bench/gpu_pytest.py writes it, and the figures the tests recorded.
    outcomes = [{"name": "test_check_gpus_passes", "status": "passed", "message": "", "seconds": 9.5},
                {"name": "test_sync_bn_matches_one_gpu_and_plain_ddp_does_not", "status": "skipped",
                 "message": "needs 2 CUDA GPUs, 1 visible", "seconds": 1.0},
                {"name": "test_compile_trains_the_eager_weights", "status": "failed",
                 "message": "AssertionError: assert 0.01 < 0.001", "seconds": 80.2}]
    (tmp_path / "outcomes.jsonl").write_text("".join(json.dumps({**o, "ended": 1.0}) + "\n" for o in outcomes))
    (tmp_path / "figures.jsonl").write_text(
        json.dumps({"test": "test_compile_trains_the_eager_weights", "criterion": "within 1e-3",
                    "max_abs_difference": 0.01}) + "\n")
    checks = gpu_check.read_checks(tmp_path / "outcomes.jsonl", tmp_path / "figures.jsonl")
    assert [(c["status"], c["message"]) for c in checks] == [
        ("passed", ""), ("skipped", "needs 2 CUDA GPUs, 1 visible"), ("failed", "AssertionError: assert 0.01 < 0.001")]
    assert checks[2]["figures"] == {"criterion": "within 1e-3", "max_abs_difference": 0.01}

    # The benchmark: rows as benchmark.json has them, the plain loop's rounds, in a 1-GPU run.
    def row(name, precision, img_per_s, batch=128, wait=0.004, devices=1):
        return {"name": name, "label": f"{name} label", "script": "train_x.py", "precision": precision,
                "devices": devices, "per_device_batch": batch, "img_per_s": img_per_s,
                "epoch_50k_s": 50_000 / img_per_s, "speedup": 1.0, "data_wait_frac": wait,
                "peak_memory_gb": [1.5] * devices, "memory_kind": "GPU, nvidia-smi", "command": "python scripts/x.py"}
    bench = {"rows": [row("single", "fp32", 9_800.0), row("fp16", "fp16", 20_000.0),
                      row("bf16", "bf16", 30_000.0, wait=0.02), row("bf16-graphs", "bf16", 62_500.0, wait=0.005)],
             # fp32 rows against the loop in the scripts' layout (channels_last), not the NCHW one
             "plain_loop_img_per_s": {"fp32": [8_000.0], "fp32_channels_last": [9_900.0, 10_100.0, 10_000.0],
                                      "bf16": [30_000.0]},
             "checks": [{"check": "overhead: train_single / plain PyTorch loop", "value": 0.98, "passed": True,
                         "measured": "0.980x", "target": ">= 0.97x", "note": "", "other_work": 0.0}]}
    rows = gpu_check.script_rows(bench, gpu_check.plain_rates(bench))
    assert [r["vs_plain"] for r in rows] == [0.98, None, 1.0, 2.0833333333333335]  # fp16 has no plain loop
    four = gpu_check.script_rows({"rows": [row("single", "fp32", 1.0), row("ddp4", "fp32", 36_000.0, devices=4)]},
                                 {"fp32": 10_000.0}, skip_single=True)
    assert [(r["strategy"], r["vs_plain"]) for r in four] == [("ddp4", 0.9)]  # per GPU, against one plain loop
    machine = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gb": 85.0}],
               "driver": "unknown", "cudnn": "91002", "nccl": "2.27.3", "cuda": "13.2", "cpu": "a CPU",
               "cpu_cores": 16, "platform": "Linux", "cuda_visible_devices": "(not set: all)",
               "versions": {"torch": "2.15.0", "accelerate": "1.15.0", "python": "3.12.3"}}
    benchmark = [{"name": "1gpu-b128", "command": "python scripts/benchmark.py", "env": {}, "returncode": 0,
                  "folder": "benchmark-1gpu-b128", "rows": rows, "checks": bench["checks"]}]
    resnet50 = [{"model": "torchvision:resnet50", "image_size": 224, "precision": "fp32", "batch": 128,
                 "img_per_s": 2_000.0, "epoch_50k_s": 25.0, "peak_memory_gb": 20.1, "error": None},
                {"model": "torchvision:resnet50", "image_size": 224, "precision": "bf16", "batch": 128,
                 "img_per_s": None, "epoch_50k_s": None, "peak_memory_gb": None, "error": "out of GPU memory"}]
    report = gpu_report.build_report(machine, checks, benchmark, resnet50, "2026-01-01 12:00", 600.0,
                                    "scripts/gpu_check.py")
    assert report["passed"] is False and report["slug"] == "nvidia-h100-80gb-hbm3"  # a check failed
    # 0.98x; 2 % wait; 1.67 s on an H100 without CUDA graphs (the graphs row is not the epoch target's), 0.8 s with
    assert [t["met"] for t in report["targets"]] == [True, False, True, False, None]  # no defaults row
    assert report["targets"][3]["measured"] == "0.80 s (bf16-graphs label, batch 128)"
    assert report["targets"][1]["measured"] == "at most 2.00 % (bf16 label, batch 128)"
    gpu_report.write_report(tmp_path, report)
    assert json.loads((tmp_path / "gpu-check.json").read_text()) == report
    text = (tmp_path / "gpu-check.md").read_text()
    assert text.startswith(
        "# GPU check: NVIDIA H100 80GB HBM3\n\nFAIL. Checks: 1 passed, 1 failed, 0 errors, 1 skipped.")
    assert "| a 50,000-image epoch of ResNet-18 at 32 px in bf16 on one H100 in under 2 s | 1.67 s (bf16 label, " \
           "batch 128) | met |" in text
    assert "**failed**: AssertionError: assert 0.01 < 0.001 | max_abs_difference 0.01 |" in text
    assert "| `single`: single label | fp32 | 1 | 128 | 9,800 | 5.10 s | 1.00x | 0.980x | 0.40 % | 1.50 |" in text
    assert "| bf16 | 128 | not run: out of GPU memory |" in text and "- within 1e-3" in text
    assert "Peak memory, as benchmark.py measured it: GPU, nvidia-smi (nvidia-smi: " in text
    assert "keep this report as docs/gpu/nvidia-h100-80gb-hbm3.md" in text.lower()
    # The defaults (--compile auto) against the fastest train_single row measured, whatever its batch.
    singles = [{**r, "script": "train_single.py"} for r in gpu_check.script_rows({"rows": [
        row("single", "fp32", 10_000.0), row("defaults", "fp32", 8_000.0), row("defaults", "fp32", 12_000.0, batch=512)]},
        {"fp32": 10_000.0})]
    defaults = gpu_report.evaluate_targets(singles, ["NVIDIA H200"])[4]
    assert defaults["met"] is False and defaults["measured"] == "0.67x (8,000 vs 12,000 img/s, defaults label, batch 512)"
    # On another GPU the H100 target is reported, not judged; a row that failed fails the report.
    other = gpu_report.evaluate_targets(rows, ["NVIDIA A100-SXM4-80GB"])
    assert other[2]["met"] is None and other[2]["measured"].endswith("this is NVIDIA A100-SXM4-80GB")
    broken = [{**benchmark[0], "rows": [{**rows[0], "error": "exit status 1: CUDA error"}]}]
    failed = gpu_report.build_report(machine, checks[:2], broken, [], "", 1.0, "")
    assert failed["passed"] is False
    assert "| `single`: single label | fp32 | 1 | 128 | failed: exit status 1: CUDA error |" in \
        gpu_report.render_markdown(failed)
    for markdown in (text, gpu_report.render_markdown(failed)):
        assert all(len(widths) == 1 for widths in table_widths(markdown)), markdown  # rows as wide as the header
    assert gpu_report.build_report(machine, checks[:2], benchmark, [], "", 1.0, "")["passed"] is True

    # The plan: each row's estimate and what became of it; a row the time ran out on makes it INCOMPLETE.
    plan = [{"name": "test_check_gpus_passes", "kind": "check", "proves": "check_gpus.py | passes",
             "estimate_s": 9, "status": "passed", "message": "", "seconds": 9.5},
            {"name": "benchmark-b512", "kind": "benchmark", "proves": "the epoch", "estimate_s": 85,
             "status": "cut", "message": "stopped: the check's time ran out", "seconds": None}]
    cut = gpu_report.build_report(machine, checks[:2], benchmark, [], "", 1.0, "", plan)
    assert cut["passed"] is True and cut["unfinished"] == ["benchmark-b512"]
    markdown = gpu_report.render_markdown(cut)
    assert "INCOMPLETE (1 planned rows did not finish). Checks: 1 passed" in markdown
    assert "| `test_check_gpus_passes` | check_gpus.py \\| passes | 9 s | 10 s | passed |" in markdown
    assert "| `benchmark-b512` | the epoch | 85 s | - | cut: stopped: the check's time ran out |" in markdown
    assert "Limits: Several processes on one GPU (--share-gpus) prove" in markdown
    assert all(len(widths) == 1 for widths in table_widths(markdown)), markdown


# What the issue of the one-GPU check asks to prove first, each a row that the default plan runs by the
# estimates the H200's check of 2026-11-28 corrected (the 11th fits where FSDP2's rows cannot run, the 12th with
# --budget to spare).
FIRST_ROWS = ["benchmark-tta",
              "test_auto_decides_from_this_gpu_and_a_weight_average_resumes_across_compile_settings",
              "benchmark-defaults", "benchmark-b32", "test_all_gpus_match_one_gpu[train_ddp.py]",
              "test_every_script_learns_and_evaluate_reproduces_it[train_ddp-all-cuda-graphs]",
              "test_all_gpus_match_one_gpu[train_fsdp.py]",
              "test_more_processes_than_gpus_is_refused_without_share_gpus"]


def test_the_plan_fits_its_budget_and_names_real_checks(tmp_path):
    """`make gpu-check ARGS=--dry-run` on this CPU: the plan for one GPU, what a user of the defaults waits for
    first (time to accuracy, the defaults against the fastest configuration), then the multi-process rows, every
    row it runs ending within the 9-minute budget by its estimate; nothing written. Every check it names is a
    test of this file (collected by pytest), every benchmark row's flags parse."""
    venv, before = Path(sys.prefix), sorted((ROOT / "runs").glob("gpu-check-*"))
    done = subprocess.run(["make", "-C", str(ROOT), "-o", f"{venv}/bin/.installed", f"VENV={venv}", "gpu-check",
                           "ARGS=--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # as on a CPU
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("make")]  # -C: its own lines
    assert lines[0].startswith("gpu-check plan for 1 GPU(s), budget 540 s (2 processes share the GPU")
    rows = [re.match(r"\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+): ", line) for line in lines]
    rows = [(int(m.group(2)), m.group(3), m.group(4)) for m in rows if m]
    runs = [name for _, ends, name in rows if ends != "-"]
    assert runs == FIRST_ROWS[:5]  # in this order, and nothing else fits
    assert int(next(ends for _, ends, name in rows if name == runs[-1])) <= 540
    assert re.search(r"^5 of \d+ rows run, ending at about (\d+) s of the 540 s budget\.$", lines[-1])
    assert {name for _, ends, name in rows if ends == "-"} == {r.name for r in gpu_plan.PLAN} - set(runs)
    assert not list(tmp_path.iterdir()) and sorted((ROOT / "runs").glob("gpu-check-*")) == before
    collected = execute([BIN / "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", gpu_plan.CHECKS], cwd=ROOT,
                        env=user_env(), timeout=120)
    tests = {line.split("::", 1)[1] for line in collected.stdout.splitlines() if "::" in line}
    assert {r.name for r in gpu_plan.PLAN if r.kind == "check"} <= tests
    benchmark = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(benchmark)
    benchmark.loader.exec_module(module)
    for row in (r for r in gpu_plan.PLAN if r.kind == "benchmark"):
        module.parse_args([*row.bench, "--output-dir", str(tmp_path / "x")])
    # A budget that holds less runs fewer rows, from the top; too few GPUs, no bf16, or FSDP2 on one GPU whose
    # NCCL cannot share it (the H200's 2.28.9) are reasons too, and what they free goes to the next rows.
    short = gpu_plan.plan(gpu_plan.PLAN, 240, 1, True)
    assert [p.row.name for p in short if p.why_not is None] == FIRST_ROWS[:1]
    no_bf16 = {p.row.name: p.why_not for p in gpu_plan.plan(gpu_plan.PLAN, 540, 1, False)}
    assert [no_bf16[name] for name in ("benchmark-tta", "benchmark-defaults")] == \
        ["needs native bf16 (compute capability 8.0 and newer)"] * 2
    old_nccl = gpu_plan.plan(gpu_plan.PLAN, 540, 1, True, nccl_shares=False)
    assert [p.row.name for p in old_nccl if p.why_not is None] == FIRST_ROWS[:5]
    assert {p.row.name for p in old_nccl if p.why_not and "FSDP2's processes share a GPU over NCCL" in p.why_not} == {
        p.row.name for p in old_nccl if p.row.fsdp} and len([p for p in old_nccl if p.row.fsdp]) == 4


CUT_SHORT = """import os
import subprocess
import time
import pytest

@pytest.mark.gpu
def test_fast():
    pass

@pytest.mark.gpu
def test_crashes():  # as the H200's FSDP2 launch over gloo failed: the cause is at the end of the launch's output
    raise AssertionError("train_fsdp.py failed (1):\\nepoch=1/1 step=5\\n"
                         "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \\n"
                         "  traceback : Signal 11 (SIGSEGV) received by PID 614\\n=====")

@pytest.mark.gpu
def test_too_long_for_the_time_left():
    pass

@pytest.mark.gpu
def test_slow():  # as a launch does: a process of its own that saves for 2 s when told to stop
    child = subprocess.Popen(["bash", "-c", "trap 'sleep 2; exit 75' TERM; sleep 120 & wait"])
    with open(os.environ["CHILD_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    time.sleep(120)
"""


def ended(pid: int) -> bool:
    """Whether process ``pid`` has exited: gone, or a zombie (an orphan whose exit status the process
    that adopted it, PID 1 of a container, has not collected yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_failed_launch_names_its_cause():
    """A failed check's message in the report: its first line, and what ended the launch below it (the script's
    error line, the signal that killed a worker, a worker's exception as torch prints it under a process group),
    never the launcher's own report that a worker failed."""
    def message(text):
        return gpu_pytest._message(SimpleNamespace(skipped=False, longrepr=SimpleNamespace(
            reprcrash=SimpleNamespace(message=text))))
    child_failed = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n  traceback : To enable "
                    "traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    assert message(f"train_ddp.py failed (1):\n[rank1]: Traceback (most recent call last):\n[rank1]:   File x\n"
                   f"[rank1]: RuntimeError: CUDA error: out of memory\n{child_failed}") == \
        "train_ddp.py failed (1): ... RuntimeError: CUDA error: out of memory"
    assert message("train_single.py failed (1):\nValueError: bad\nsubprocess.CalledProcessError: Command '[...]' "
                   "returned non-zero exit status 1.") == "train_single.py failed (1): ... ValueError: bad"
    assert message("train_ddp.py failed (1):\n[rank0]: error: --batch-size 63 does not divide by 2 processes: use 62 "
                   f"or 64\nValueError: x\n{child_failed}") == \
        "train_ddp.py failed (1): ... error: --batch-size 63 does not divide by 2 processes: use 62 or 64"
    assert message("assert 1 == 2") == "assert 1 == 2"


def test_a_check_cut_short_still_leaves_its_report(tmp_path, monkeypatch):
    """gpu_check's run of four checks (bench/gpu_pytest.py in a real pytest) with 12 s left: the fast one
    passes and the report says so while the slow one still runs; the failed one's message names what ended its
    launch; the one whose estimate (100 s) no longer fits is not started; the slow one is stopped at the
    deadline, the process it started too (after its 2 s of saving), and its row says so."""
    (tmp_path / "test_cut.py").write_text(CUT_SHORT)
    monkeypatch.setenv("CHILD_PID_FILE", str(tmp_path / "child.pid"))
    monkeypatch.setattr(gpu_plan, "CHECKS", str(tmp_path / "test_cut.py"))
    rows = [gpu_plan.Row("test_fast", "passes", 1), gpu_plan.Row("test_crashes", "-", 1),
            gpu_plan.Row("test_too_long_for_the_time_left", "-", 100), gpu_plan.Row("test_slow", "-", 1)]
    machine = {"gpus": [], "driver": "-", "cudnn": "-", "nccl": "-", "cuda": "-", "cpu": "-", "cpu_cores": 2,
               "platform": "-", "cuda_visible_devices": "-", "versions": {"torch": "-", "accelerate": "-",
                                                                          "python": "-"}}
    progress = gpu_check.Progress(tmp_path, gpu_plan.plan(rows, 10**6, 1, True), machine, "test")
    deadline = time.time() + 12
    runner = threading.Thread(target=gpu_check.run_checks, args=(progress, [r.name for r in rows], deadline))
    runner.start()
    seen_while_running = None
    while runner.is_alive():
        if (tmp_path / "gpu-check.json").exists():
            plan = {r["name"]: r["status"] for r in json.loads((tmp_path / "gpu-check.json").read_text())["plan"]}
            if plan["test_too_long_for_the_time_left"] == "not run" and seen_while_running is None:
                seen_while_running = plan
        time.sleep(0.2)
    runner.join()
    assert time.time() < deadline + 20  # stopped at the deadline, not after the slow test's 120 s
    child = int((tmp_path / "child.pid").read_text())  # the process the slow check started: ended too
    assert ended(child), child
    assert seen_while_running == {"test_fast": "passed", "test_crashes": "failed",
                                  "test_too_long_for_the_time_left": "not run", "test_slow": "running"}
    report = progress.write()
    assert [r["status"] for r in report["plan"]] == ["passed", "failed", "not run", "cut"]
    assert report["plan"][1]["message"] == ("AssertionError: train_fsdp.py failed (1): ... Signal 11 (SIGSEGV) "
                                            "received by PID 614")
    assert re.fullmatch(r"not run: out of time \(100 s estimated, \d+ s left\)", report["plan"][2]["message"])
    assert report["plan"][3]["message"] == "stopped: the check's time ran out"
    assert report["unfinished"] == ["test_too_long_for_the_time_left", "test_slow"]
    assert gpu_report.render_markdown(report).split("\n")[2].startswith(
        "FAIL, INCOMPLETE (2 planned rows did not finish)")


def test_the_gpu_wheels_are_pinned_once():
    """docs/gpu/wheels*.txt: each wheel the lent machines' image lacks pinned once, datasets and wandb in the
    first list, MLflow in the second; `make gpu-wheels` fetches them for that image's Python (3.12)."""
    lists = {name: [line for line in (ROOT / "docs" / "gpu" / name).read_text().splitlines()
                    if line.strip() and not line.startswith("#")] for name in ("wheels.txt", "wheels-mlflow.txt")}
    names = {name: [re.fullmatch(r"([a-z0-9][a-z0-9._-]*)==[0-9][\w.]*", pin).group(1) for pin in pins]
             for name, pins in lists.items()}
    every = names["wheels.txt"] + names["wheels-mlflow.txt"]
    assert len(every) == len(set(every)) == 61
    assert {"datasets", "wandb"} <= set(names["wheels.txt"]) and "mlflow" in names["wheels-mlflow.txt"]
    venv = Path(sys.prefix)
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), "-o", f"{venv}/bin/.installed", f"VENV={venv}",
                          "gpu-wheels", "WHEELS=docs/gpu/wheels.txt docs/gpu/wheels-mlflow.txt"],
                         capture_output=True, text=True, timeout=60)
    assert "--python-version 3.12" in dry.stdout and "-d .whl" in dry.stdout
    assert "-r docs/gpu/wheels.txt -r docs/gpu/wheels-mlflow.txt" in dry.stdout
