"""Measure every training strategy this machine can run, launched as users launch them, and check
the project's speed targets side by side in the same run.

Each strategy row launches the real training script as a subprocess, as its docstring says:

    one device                python scripts/train_single.py
    DataParallel, all GPUs    python scripts/train_dp.py
    DDP on 2, 4, ... GPUs     accelerate launch --config_file accelerate_configs/4gpu.yaml \\
                                  --num_processes N scripts/train_ddp.py
    DDP + fp16, DDP + bf16    accelerate launch ... scripts/train_amp.py --mixed-precision fp16|bf16
    FSDP2 on all GPUs         accelerate launch ... --num_processes N scripts/train_fsdp.py
    a machine without GPUs    train_single.py; train_amp.py --mixed-precision bf16 in one process;
                              train_ddp.py as 2 processes on gloo

on --dataset synthetic (made on the spot and, as every dataset in these scripts, held on the device,
so the rows measure compute) or on real data (--dataset cifar10, --data-dir). Per row: images/s, the
time of a 50,000-image epoch, the speed-up over one device, the scaling efficiency, the peak memory
of each device and the share of time spent waiting for data. The protocol, the same for every row,
is printed with the table (PROTOCOL below). --sweep-batch-size asks the source articles' other
question: how throughput and memory change with the batch size.

Checks (--checks), the project's speed targets, each a ratio of two things measured side by
side here:
    tta         time to accuracy: the defaults and the fastest configuration, each launched on the
                built-in data to its done line: wall time, test accuracy, and for those that
                compile the second launch's, from the compiler's cache (bench/time_to_accuracy.py);
                reported as measured
    ops         train_single's steady step dispatches at most 8 operators more than a plain loop
                with the same data work (the surplus named op by op; bench/opcount.py); on a GPU
                also the CUDA runtime calls per step, eager and with the defaults, reported
    overhead    train_single's steady img/s >= 0.97 x a plain PyTorch loop (same model, optimizer,
                batch, channels_last layout and cuDNN search, data on the device;
                bench/tools.py PlainLoop)
    data        tensor_loader + BatchTransform >= 5 x torchvision's CIFAR10 with PIL transforms and
                a DataLoader with 2 workers; data wait < 2 % of train_single's step time
    loader      the workers path (common.data.workers.worker_loader + the normalisation on the
                device) >= 1.5 x torchvision's ImageFolder with PIL transforms, same workers and
                batch, on JPEGs of ImageNet's sizes the benchmark writes (bench/loaders.py),
                224 px crops
    workers     data wait of train_single --loader workers, reported: the `single` row's model at
                32 px (its images as PNG files), torchvision:resnet50 at 224 px (the JPEGs)
    precision   bf16 autocast + channels_last >= 1.8 x fp32, one training step of the plain loop
    compute     train_single fp32 FLOP/s (FlopCounterMode's count per image) >= 85 % of the matmul
                peak measured in the math its fp32 runs in: TF32 on GPUs of compute capability 8.0
                and later, as the scripts' --tf32 default sets it (the strict fp32 peak beside it)
    compile     torch.compile on the plain loop: compile time and steady speed-up,
                reported as measured
    ema         the cost of --ema-decay: the plain loop with the scripts' weight average updated
                after every step against the same loop without it, rounds alternated, and one
                update timed alone; reported as measured
    watch       the cost of the failure watch that every process of a multi-process run keeps
                (common.failures.watch_failures: a thread asking the launch's store twice
                a second whether a process failed; no collective): the plain loop with it against
                without it, rounds alternated, and one question to a TCPStore timed alone;
                reported as measured
    finetune    the cost per step of each fine-tuning flag (--finetune-flags): train_single
                --loader workers on the `single` row's images as PNG files (or --data-dir), with
                the flag against without it, each round of launches between two without flags
                (bench/finetune.py); reported as measured. Not part of `all`: 2 launches per flag

Launch:
    python scripts/benchmark.py                              # every strategy here and every check
    python scripts/benchmark.py --strategies single ddp2 --checks none --steps 5
    python scripts/benchmark.py --model resnet50 --per-device-batch-size 256 --steps 50     # GPUs
    python scripts/benchmark.py --sweep-batch-size 32 64 128 256 512 --checks none
    python scripts/benchmark.py --dataset cifar10 --checks none
                                                             # real CIFAR-10 (Hub, cached) instead
    python scripts/benchmark.py --strategies single --checks loader workers   # the input paths only
    python scripts/benchmark.py --model resnet20 --strategies single --checks finetune
                                                             # what each fine-tuning flag costs
    make bench                                               # the CPU benchmark, ~20 min on 2 cores
Writes benchmark.json (every figure, the protocol, the machine), benchmark.md (the tables) and
benchmark.png (the chart) to --output-dir; the exit status is 1 if a row failed to run.
"""

import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

from bench import finetune, loaders, opcount, steptimer, time_to_accuracy, tools
from common import failures
from common.cli import Parser
from common.data.synthetic import make_synthetic
from common.data.workers import default_workers
from common.errors import UserError
from common.files import check_folder, write_json
from common.recipe.models import build_model
from common.run.folder import new_run_dir

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
DDP_CONFIG = "accelerate_configs/4gpu.yaml"  # --num_processes on the command line overrides its 4
CHECKS = ("tta", "ops", "overhead", "data", "loader", "workers", "precision", "compute",
          "compile", "ema", "watch", "finetune")
EMA_DECAY = 0.999  # the ema check's --ema-decay (the update's cost does not depend on it)
EPOCH_IMAGES = 50_000  # CIFAR-10's training split
# steps left out of every measurement: the first allocates, tunes kernels, fills caches
WARMUP_STEPS = 2
LARGE_MODEL, LARGE_SIZE = "torchvision:resnet50", 224  # the workers check's ImageNet-sized row
# Its batch without GPUs: ResNet-50 at 224 px trains at about 4 img/s on 2 CPU cores, 2 s a step.
LARGE_CPU_BATCH = 8

PROTOCOL = (
    "each row launches its script {repeats}, as users launch it, for {warmup} + N optimizer steps "
    "(N = {steps}; --max-steps, --epochs 1, --report-to none, a temporary --output-dir), with "
    "bench.steptimer recording when each optimizer step ends. The first {warmup} steps "
    "(the warm-up) are left out; img/s = global batch / the median time of the other steps, which "
    "start-up, data loading, evaluation and the odd step stalled by other work do not move. {data} "
    "50,000-image epoch = 50,000 / img/s. Speed-up = img/s over the `single` row's; scaling "
    "efficiency = speed-up / devices{cpu}; for fp16/bf16 rows both include the precision's gain. "
    "Peak memory: {memory}. Data wait: the share of the training loop's time spent fetching and "
    "augmenting batches (the scripts' data_wait_frac, warm-up included; after the warm-up: the "
    "same wait, recorded per step by bench.steptimer, over the measured steps' time). Other work: "
    "the share of the CPU that other processes used while the row ran")


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str  # the --strategies name
    label: str
    script: str  # in scripts/
    processes: int
    # GPUs the global batch is spread over; the CPU is 1 device, however many processes
    devices: int
    precision: str = "fp32"
    flags: tuple[str, ...] = ()
    model: str | None = None  # instead of --model
    data: tuple[str, ...] | None = None  # data flags instead of --dataset / --data-dir
    batch: int | None = None  # global batch instead of the one the batch-size flags give

    def launcher(self) -> list[str]:
        if self.processes == 1:
            return [sys.executable]
        return [ACCELERATE, "launch", "--config_file", DDP_CONFIG,
                "--num_processes", str(self.processes)]


def available_strategies(gpus: int) -> dict[str, Strategy]:
    """The rows this machine can run: from torch.cuda.device_count(), or the CPU rows without
    GPUs."""
    if gpus == 0:  # every row shares the same cores, so the CPU counts as one device
        rows = [Strategy("single", "train_single, fp32", "train_single.py", 1, 1),
                Strategy("bf16", "train_amp, bf16 + channels_last", "train_amp.py", 1, 1, "bf16",
                         ("--mixed-precision", "bf16")),
                Strategy("ddp2", "train_ddp, 2 processes on gloo, fp32", "train_ddp.py", 2, 1)]
        return {s.name: s for s in rows}
    # Eager (--compile none): the rows compare strategies, and --compile auto would compile each
    # (CUDA graphs) and its steps would not compare with the eager plain loop's. `defaults` is
    # train_single as a user runs it (CUDA graphs); bf16-graphs the fastest configuration.
    eager = ("--compile", "none")
    rows = [Strategy("single", "train_single, 1 GPU, fp32, eager", "train_single.py", 1, 1,
                     flags=eager),
            Strategy("defaults", "train_single, 1 GPU, the defaults (--compile auto: CUDA graphs)",
                     "train_single.py", 1, 1)]
    if gpus > 1:
        rows.append(Strategy("dp", f"train_dp, DataParallel on {gpus} GPUs, fp32",
                             "train_dp.py", 1, gpus))
    counts = sorted({n for n in (2, 4, 8, 16, 32, 64) if n < gpus} | ({gpus} - {1}))
    rows += [Strategy(f"ddp{n}", f"train_ddp, DDP on {n} GPUs, fp32", "train_ddp.py", n, n,
                      flags=eager) for n in counts]
    if gpus > 1:  # sharded against DDP on the same GPUs: img/s and peak memory per GPU
        rows.append(Strategy(f"fsdp{gpus}", f"train_fsdp, FSDP2 on {gpus} GPUs, fp32",
                             "train_fsdp.py", gpus, gpus))
    for precision in ("fp16", "bf16") if tools.native_bf16() else ("fp16",):
        name = f"ddp{gpus}-{precision}" if gpus > 1 else precision
        where = f"DDP on {gpus} GPUs" if gpus > 1 else "1 GPU"
        rows.append(Strategy(name, f"train_amp, {where}, {precision}", "train_amp.py", gpus, gpus,
                             precision, ("--mixed-precision", precision, *eager)))
    if tools.native_bf16():  # each step replayed as CUDA graphs: no per-kernel launch cost
        rows.append(Strategy("bf16-graphs", "train_amp, 1 GPU, bf16, CUDA graphs (--compile "
                             "--compile-mode reduce-overhead)", "train_amp.py", 1, 1, "bf16",
                             ("--mixed-precision", "bf16", "--compile", "--compile-mode",
                              "reduce-overhead")))
    return {s.name: s for s in rows}


def parse_args(argv=None):
    parser = Parser(__doc__)
    parser.add_argument("--strategies", nargs="+", default=None, metavar="NAME",
                        help="rows to run (default: every one this machine can run: "
                             "single bf16 ddp2 on a CPU; "
                             "single defaults dp ddp2 ddp4 ... ddpN-fp16 ddpN-bf16 bf16-graphs "
                             "with N GPUs)")
    parser.add_argument("--model", default="resnet18",
                        help="as in the training scripts (default: %(default)s)")
    parser.add_argument("--per-device-batch-size", type=int, default=128,
                        help="images per device per step; a row's global batch is this times its "
                             "devices, as DDP is used (default: %(default)s)")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="hold the global batch at this size in every row instead, split over "
                             "the devices")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"measured optimizer steps per launch, after {WARMUP_STEPS} warm-up "
                             f"steps (default: 50 with GPUs, 8 on a CPU, where ResNet-18 takes "
                             f"~2.6 s a step)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="launches per row; the median step time over all of them counts "
                             "(default: %(default)s)")
    parser.add_argument("--dataset", default="synthetic",
                        choices=("synthetic", "cifar10", "cifar100"),
                        help="synthetic isolates compute; cifar10/cifar100 from the Hub or its "
                             "cache (default: %(default)s)")
    parser.add_argument("--data-dir", default=None,
                        help="real data from this folder, as in the training scripts")
    parser.add_argument("--sweep-batch-size", type=int, nargs="+", default=None, metavar="B",
                        help="also run --sweep-strategy at each of these per-device batch sizes")
    parser.add_argument("--sweep-strategy", default="single",
                        help="the row the sweep varies (default: %(default)s)")
    parser.add_argument("--checks", nargs="+", default=["all"], choices=("all", "none", *CHECKS),
                        help="ratio checks to run after the rows; all is every one but "
                             "finetune (default: all)")
    parser.add_argument("--tta-flags", default="", metavar="FLAGS",
                        help="flags added to each of the tta check's runs, in one string, e.g. "
                             "\"--epochs 1\" (default: none, the configurations as they are)")
    parser.add_argument("--finetune-flags", nargs="+", default=list(finetune.VARIANTS),
                        choices=finetune.VARIANTS, metavar="NAME",
                        help="the finetune check's flags, by name: "
                             f"{', '.join(finetune.VARIANTS)} (default: all)")
    parser.add_argument("--loader-images", type=int, default=10_000,
                        help="images per epoch in the data check's loader comparison "
                             "(default: %(default)s)")
    parser.add_argument("--loader-files", type=int, default=None,
                        help="JPEG files (300-500 px a side) per epoch in the loader check "
                             "(default: 4 batches per loader worker, at least 1,024)")
    parser.add_argument("--matmul-size", type=int, default=4096,
                        help="side of the square matmuls that measure the peaks "
                             "(default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one launch may take (default: %(default)s)")
    parser.add_argument("--output-dir", default=None,
                        help="where the report files go "
                             "(default: a new runs/benchmark-<date>-<time>)")
    args = parser.parse_args(argv)
    for flag in ("per_device_batch_size", "global_batch_size", "steps", "repeats", "loader_images",
                 "loader_files", "matmul_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be 1 or more")
    if args.loader_files is not None and args.loader_files < args.per_device_batch_size:
        raise UserError(f"--loader-files {args.loader_files}: less than one batch of "
                        f"--per-device-batch-size {args.per_device_batch_size}; raise it to "
                        f"{args.per_device_batch_size} or more")
    if {"all", "data"} & set(args.checks) and args.loader_images < args.per_device_batch_size:
        raise UserError(f"--loader-images {args.loader_images}: less than one batch of "
                        f"--per-device-batch-size {args.per_device_batch_size}; raise it to "
                        f"{args.per_device_batch_size} or more")
    if any(batch < 1 for batch in args.sweep_batch_size or []):
        raise UserError(f"--sweep-batch-size {' '.join(map(str, args.sweep_batch_size))}: "
                        f"each must be 1 or more")
    # measure() would run the held global batch each time
    if args.sweep_batch_size and args.global_batch_size:
        raise UserError(f"--sweep-batch-size varies the per-device batch but --global-batch-size "
                        f"{args.global_batch_size} holds the global batch: drop one of them")
    if not 0 < args.timeout < math.inf:
        raise UserError(f"--timeout {args.timeout}: must be a positive number of seconds, e.g. "
                        f"{parser.get_default('timeout'):g}")
    if args.data_dir and args.dataset == "synthetic":
        raise UserError(f"--data-dir {args.data_dir} with --dataset synthetic: "
                        f"add --dataset cifar10 (or cifar100)")
    check_folder("--output-dir", args.output_dir)
    return args


# ------------------------------------------------------------------------------------- one row

def launch(strategy, args, global_batch: int, steps: int, gpus: int, workdir: Path) -> dict:
    """Run the row's script for WARMUP_STEPS + ``steps`` optimizer steps under bench.steptimer:
    the time of each step after the warm-up, the data wait and the peak memory."""
    max_steps = WARMUP_STEPS + steps
    output_dir = workdir / f"{strategy.name}-b{global_batch}-{time.monotonic_ns()}"
    if strategy.data is not None:
        data = list(strategy.data)
    elif args.dataset == "synthetic":
        # one batch more than the steps: the run stops inside its one epoch
        data = ["--dataset", "synthetic",
                "--synthetic-train-size", str((max_steps + 1) * global_batch),
                "--synthetic-test-size", str(max(global_batch, 10))]
    else:
        data = ["--dataset", args.dataset,
                *(["--data-dir", args.data_dir] if args.data_dir else [])]
    model = strategy.model or args.model
    script = [f"scripts/{strategy.script}", "--model", model, "--batch-size", str(global_batch),
              "--epochs", "1", "--max-steps", str(max_steps), "--report-to", "none",
              *strategy.flags, *data, "--output-dir", str(output_dir)]
    times_file = str(workdir / f"{output_dir.name}-steps")
    launcher = strategy.launcher()  # python, or accelerate launch, which runs a module with -m
    timed = [*launcher, "-m", "bench.steptimer", times_file, *script]
    if gpus:  # what the plain loops and matmul peaks freed, this process's allocator still holds
        torch.cuda.empty_cache()
    run = tools.run_watched(timed, ROOT, gpus, args.timeout)
    if run.returncode != 0:
        last = tools.last_line(run.stdout, run.stderr)
        raise RuntimeError(f"exit status {run.returncode}: {last}")
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    if len(metrics) != 1 or metrics[0]["step"] != max_steps:
        raise RuntimeError(f"{max_steps} steps did not fit in one epoch; use a smaller --steps")
    ranks = [steptimer.read(times_file, rank) for rank in range(strategy.processes)]
    # rank 0's: DDP keeps the processes in step
    times, waits = ranks[0]["step_end"], ranks[0]["data_wait"]
    if len(times) != max_steps or len(waits) != max_steps:
        raise RuntimeError(f"the step timer saw {len(times)} of the {max_steps} steps, "
                           f"{len(waits)} data waits")
    step_seconds = [end - start
                    for start, end in zip(times[WARMUP_STEPS - 1:], times[WARMUP_STEPS:])]
    config = json.loads((output_dir / "config.json").read_text())
    return {"steps": max_steps, "step_end": times, "step_seconds": step_seconds, "data_wait": waits,
            # The waits of the measured steps, each inside its step's interval, over those
            # intervals.
            "data_wait_steady_frac": sum(waits[WARMUP_STEPS:]) / sum(step_seconds),
            "loader": config["loader"], "loader_workers": config["loader_workers"],
            "args": config["args"],  # the flags as the script parsed them
            "epoch_time_s": metrics[0]["epoch_time_s"],
            "data_wait_frac": metrics[0]["data_wait_frac"], "wall_s": round(run.wall_s, 2),
            "peak_memory_gb": run.peak_memory_gb if gpus else [r["peak_rss_gb"] for r in ranks],
            "torch_peak_memory_gb": metrics[0].get("gpu_mem_peak_gb", []),
            "memory_error": run.memory_error,
            "command": shlex.join([*launcher, *script]).replace(str(output_dir), "OUT")}


def peak_memory(runs: list[dict], gpus: int) -> tuple[list[float], str]:
    """A row's peak memory per device over its launches, and what it is: on GPUs nvidia-smi's
    rise where every launch has it, else the peak torch allocated as the scripts report it
    (gpu_mem_peak_gb: no CUDA context, no allocator cache), else none; without GPUs each process's
    peak resident memory."""
    kinds = [("peak_memory_gb", "GPU, nvidia-smi"),
             ("torch_peak_memory_gb", "GPU, torch max_memory_allocated")]
    for key, kind in kinds if gpus else [("peak_memory_gb", "RSS per process")]:
        if all(run[key] for run in runs):
            return [max(values) for values in zip(*(run[key] for run in runs))], kind
    return [], "unknown"


def measure(strategy, args, per_device_batch: int, steps: int, gpus: int, workdir: Path,
            between=lambda: None) -> dict:
    """One row by the protocol. ``between`` runs before the first launch and after each one: the
    checks' plain-loop rounds, so that the row's launches sit between rounds measured beside
    them."""
    global_batch = strategy.batch or args.global_batch_size or per_device_batch * strategy.devices
    row = {**dataclasses.asdict(strategy), "per_device_batch": global_batch // strategy.devices,
           "global_batch": global_batch, "memory_kind": "unknown",
           "img_per_s": None, "epoch_50k_s": None, "data_wait_frac": None, "peak_memory_gb": [],
           "runs": []}
    print(f"{strategy.name}: {strategy.label}, global batch {global_batch}, {args.repeats} x "
          f"({WARMUP_STEPS} + {steps}) steps ...", flush=True)
    other_work = tools.OtherWork()
    try:
        if global_batch % strategy.processes:
            raise RuntimeError(f"global batch {global_batch} does not divide by "
                               f"{strategy.processes} processes")
        between()
        for _ in range(args.repeats):
            row["runs"].append(launch(strategy, args, global_batch, steps, gpus, workdir))
            between()
    except RuntimeError as error:
        row["error"] = str(error)
        print(f"  failed: {error}", flush=True)
        return row
    finally:
        row["other_work"] = other_work.share()
    seconds = [s for run in row["runs"] for s in run["step_seconds"]]
    row["step_seconds"] = {"median": statistics.median(seconds), "min": min(seconds),
                           "max": max(seconds), "count": len(seconds)}
    row["img_per_s"] = global_batch / row["step_seconds"]["median"]
    row["epoch_50k_s"] = EPOCH_IMAGES / row["img_per_s"]
    row["data_wait_frac"] = statistics.median(run["data_wait_frac"] for run in row["runs"])
    row["data_wait_steady_frac"] = statistics.median(run["data_wait_steady_frac"]
                                                     for run in row["runs"])
    row["loader"], row["loader_workers"] = (row["runs"][-1]["loader"],
                                            row["runs"][-1]["loader_workers"])
    peaks, row["memory_kind"] = peak_memory(row["runs"], gpus)
    # GPUs the row used; CPU: per process
    row["peak_memory_gb"] = peaks[:strategy.devices] if gpus else peaks
    row["command"] = row["runs"][-1]["command"]
    print(f"  {row['img_per_s']:.1f} img/s (median of {len(seconds)} steps, "
          f"{row['step_seconds']['min']:.3f} to {row['step_seconds']['max']:.3f} s), "
          f"data wait {100 * row['data_wait_frac']:.1f} % "
          f"({100 * row['data_wait_steady_frac']:.1f} % after the warm-up)", flush=True)
    errors = sorted({run["memory_error"] for run in row["runs"] if run.get("memory_error")})
    if errors:
        print(f"  peak memory: {row['memory_kind']}, as {'; '.join(errors)}", flush=True)
    return row


def add_speedups(rows: list[dict]) -> None:
    base = next((r["img_per_s"] for r in rows if r["name"] == "single" and r["img_per_s"]), None)
    for row in rows:
        if base and row["img_per_s"]:
            row["speedup"] = row["img_per_s"] / base
            row["efficiency"] = row["speedup"] / row["devices"]


# ------------------------------------------------------------------------------------- checks

def counted(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def check(name, value, passed, measured, target, note="", other_work=None):
    return {"check": name, "value": value, "passed": passed, "measured": measured, "target": target,
            "note": note, "other_work": other_work}


def run_checks(checks, single, plain, peaks, loops, args, steps, device, inputs=None) -> list[dict]:
    """The ratio checks. ``single`` is the train_single row; ``plain`` and ``peaks`` hold the
    plain-loop img/s and matmul FLOP/s of the rounds that ran around its launches (the fp32 peak in
    the math the fp32 rows run in: TF32 where tools.uses_tf32, the strict peak beside it). The speed
    of a shared machine drifts by tens of percent within minutes, so each ratio compares things
    measured in the same minutes, by medians, which the occasional stalled step does not move.
    ``inputs`` is input_paths' report, for the loader and workers checks."""
    results, batch = [], args.per_device_batch_size
    script_steps = [s for run in single.get("runs", []) for s in run["step_seconds"]]
    baseline = "fp32_channels_last"  # the plain loop in train_single's layout
    plain_steps = loops[baseline].step_seconds if baseline in loops else []
    rate = single.get("img_per_s")  # batch / its median step time, as for every row
    if "overhead" in checks and rate and plain_steps:
        # Launch k ran between plain rounds k and k + 1: each launch against the mean of its two
        # neighbours, as the machine's speed drifts by tens of percent over minutes.
        launches = [batch / statistics.median(run["step_seconds"]) for run in single["runs"]]
        neighbours = [(before + after) / 2
                      for before, after in zip(plain[baseline], plain[baseline][1:])]
        ratios = [s / p for s, p in zip(launches, neighbours)]
        ratio = statistics.median(ratios)
        results.append(check(
            "overhead: train_single / plain PyTorch loop", ratio, ratio >= 0.97,
            f"{ratio:.3f}x ({statistics.median(launches):.1f} vs "
            f"{statistics.median(neighbours):.1f} img/s; {args.model}, batch {batch}; "
            f"{counted(len(ratios), 'launch', 'launches')}: "
            f"{min(ratios):.3f}x to {max(ratios):.3f}x)", ">= 0.97x",
            f"each of train_single's {len(launches)} launches against the plain-loop rounds just "
            f"before and after it, by median step times ({len(script_steps)} and "
            f"{len(plain_steps)} steps), the loop in channels_last as train_single runs by "
            f"default; train_single also augments every batch "
            f"({100 * single['data_wait_frac']:.1f} % of its step time), steps its schedule and "
            f"checks the loss for NaN", single["other_work"]))
        results[-1].update(launch_ratios=ratios, train_single_step_seconds=script_steps,
                           plain_step_seconds=list(plain_steps))
    if "data" in checks:
        results += data_checks(single, args, device)
    results += input_checks(inputs or {})
    # what the fp32 rows and loops compute in
    fp32_math = "TF32" if tools.uses_tf32(device) else "fp32"
    strict = (f"; the strict fp32 matmul peak is "
              f"{statistics.median(peaks['fp32_strict']) / 1e9:,.0f} GFLOP/s"
              if peaks.get("fp32_strict") else "")
    if "precision" in checks and plain["bf16"]:
        # round by round
        ratio = statistics.median(b / f for b, f in zip(plain["bf16"], plain["fp32"]))
        allows = statistics.median(b / f for b, f in zip(peaks["bf16"], peaks["fp32"]))
        results.append(check(
            "precision: bf16 + channels_last / fp32", ratio, ratio >= 1.8,
            f"{ratio:.2f}x ({statistics.median(plain['bf16']):.1f} vs "
            f"{statistics.median(plain['fp32']):.1f} img/s, "
            f"plain loop{', fp32 in TF32' if fp32_math == 'TF32' else ''})", ">= 1.8x",
            f"the bf16 / {fp32_math} matmul peaks allow {allows:.2f}x here",
            single.get("other_work")))
    if "compute" in checks and rate and peaks["fp32"]:
        flops, peak = tools.flops_per_image(args.model), statistics.median(peaks["fp32"])
        ratio = rate * flops / peak
        plain_ratio = statistics.median(r * flops / p for r, p in zip(plain["fp32"], peaks["fp32"]))
        results.append(check(
            f"compute: train_single fp32 FLOP/s / {fp32_math} matmul peak", ratio, ratio >= 0.85,
            f"{ratio:.0%} ({rate * flops / 1e9:,.0f} of {peak / 1e9:,.0f} GFLOP/s; "
            f"{flops / 1e9:.2f} GFLOP per image, FlopCounterMode)", ">= 85 %",
            f"the plain loop reaches {plain_ratio:.0%}{strict}" + ("" if ratio >= 0.85 else
            f"; a {args.matmul_size}-square matmul is the most favourable case: convolutions lose "
            f"to their memory layouts, BatchNorm, ReLU and the optimizer to memory traffic, which "
            f"the FLOP count leaves out"),
            single.get("other_work")))
    if "compile" in checks:
        results += [compile_check(setting, loop, args, steps, device)
                    for setting, loop in loops.items() if setting not in ("ema", "watch")]
    if "ema" in checks and plain.get("ema"):
        results.append(ema_check(plain, loops["ema"], args, single.get("other_work")))
    if "watch" in checks and plain.get("watch"):
        results.append(watch_check(plain, args, single.get("other_work")))
    return results


@contextmanager
def failure_watch():
    """The failure watch of a multi-process run's processes
    (common.failures.watch_failures) as it runs beside their training loop: a thread
    asking a TCPStore, twice a second, whether a process failed, posting its heartbeat and
    reading the next process's. The store is this process's own."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    stop = threading.Event()
    job = SimpleNamespace(num_processes=2, is_main_process=True)  # process 1's beat: never posted
    thread = threading.Thread(target=failures._watch, daemon=True,
                              args=(store, "0", job, stop, failures.STALL_S))
    thread.start()
    try:
        yield store
    finally:
        failures._stop_watching(stop, thread, store, "0")


def store_question_seconds(questions: int = 200) -> float:
    """The median time of one question the failure watch asks its store (store.check, in a
    thread of its own that bounds its wait, as the watch asks it)."""
    with failure_watch() as store:
        times = []
        for _ in range(questions):
            start = time.perf_counter()
            failures._bounded(failures.STORE_S, store.check, ["a key no one sets"])  # noqa: SLF001
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def watch_check(plain: dict, args, other_work) -> dict:
    """The failure watch's cost: the plain loop with it against the same loop without it, round
    by round, and one question to the store timed alone."""
    ratio = statistics.median(w / p for w, p in zip(plain["watch"], plain["fp32_channels_last"]))
    question = store_question_seconds()
    step = args.per_device_batch_size / statistics.median(plain["fp32_channels_last"])
    result = check(
        "watch: plain loop with the failure watch / without", ratio, None,
        f"{ratio:.3f}x ({statistics.median(plain['watch']):.1f} vs "
        f"{statistics.median(plain['fp32_channels_last']):.1f} img/s); one question to the "
        f"store {question * 1e6:.0f} us, asked every {failures.POLL_S:g} s: "
        f"{question / failures.POLL_S:.3%} of the time, "
        f"{question * step / failures.POLL_S * 1e6:.1f} us per {step * 1e3:.0f} ms step",
        "reported",
        f"{len(plain['watch'])} rounds of each, alternated; the question alone is the median of "
        f"200; no collective is added to the step", other_work)
    result["question_s"], result["step_s"] = question, step
    return result


def ema_check(plain: dict, loop, args, other_work) -> dict:
    """--ema-decay's cost: the plain loop with the weight average against the same loop without it
    (train_single's layout), round by round, and one update timed alone."""
    ratio = statistics.median(e / p for e, p in zip(plain["ema"], plain["fp32_channels_last"]))
    update = tools.ema_update_seconds(loop)
    step = args.per_device_batch_size / statistics.median(plain["fp32_channels_last"])
    result = check(
        "ema: plain loop with --ema-decay / without", ratio, None,
        f"{ratio:.3f}x ({statistics.median(plain['ema']):.1f} vs "
        f"{statistics.median(plain['fp32_channels_last']):.1f} img/s); one update "
        f"{update * 1e3:.2f} ms, {update / step:.2%} of a {step * 1e3:.0f} ms step",
        "reported", f"{len(plain['ema'])} rounds of each, alternated; the update alone is the "
        f"median of 20, the device waited for before and after each", other_work)
    result["update_s"], result["step_s"] = update, step
    return result


def data_checks(single, args, device) -> list[dict]:
    """Our loader + augmentation against torchvision's CIFAR10 pipeline, epochs alternated."""
    batch, other_work = args.per_device_batch_size, tools.OtherWork()
    rates = tools.compare_pipelines(make_synthetic(args.loader_images, 10), batch, device)
    ratio = statistics.median(o / t for o, t in zip(rates["ours"], rates["torchvision"]))
    ours, theirs = statistics.median(rates["ours"]), statistics.median(rates["torchvision"])
    results = [check(
        "data: our loader + augmentation / torchvision CIFAR10 + PIL, 2 workers", ratio, ratio >= 5,
        f"{ratio:.1f}x ({ours:,.0f} vs {theirs:,.0f} img/s, batch {batch})",
        ">= 5x", f"ours takes {1000 * batch / ours:.1f} ms per batch in the training process; "
                 f"torchvision's pipeline runs in 2 worker processes beside it",
        other_work.share())]
    if single.get("img_per_s"):
        share = single["data_wait_frac"]
        results.append(check("data wait: train_single's share of step time", share, share < 0.02,
                             f"{100 * share:.2f} % ({args.model}, "
                             f"batch {args.per_device_batch_size}; "
                             f"{100 * single['data_wait_steady_frac']:.2f} % after the warm-up)",
                             "< 2 %", other_work=single["other_work"]))
    return results


# ------------------------------------------------------------------------------ input paths

def input_paths(checks, args, steps, gpus, device, workdir: Path) -> dict:
    """The loader check (our workers path against torchvision's ImageFolder + PIL, epochs
    alternated) and the workers check's rows (train_single --loader workers, by the protocol), on
    image folders written to ``workdir``: JPEGs of ImageNet's sizes, and the `single` row's
    synthetic images as 32 px PNGs (CIFAR's format), or its --dataset itself."""
    workers, batch = default_workers(), args.per_device_batch_size
    large_batch = batch if gpus else LARGE_CPU_BATCH
    # 4 batches a worker, so no worker idles long, and at least 1,024 files: the last batch's
    # normalisation, which no decoding overlaps, must weigh in an epoch no more than it does in
    # training.
    files = args.loader_files or max(1024, 4 * workers * batch)
    # one epoch of the large row, with a batch to spare, as launch's synthetic data
    if "workers" in checks:
        files = max(files, (WARMUP_STEPS + steps + 1) * large_batch)
    jpegs = workdir / "jpeg"
    print(f"input paths: writing {files} JPEGs of {loaders.SIDES[0]}-{loaders.SIDES[1]} px ...",
          flush=True)
    out = {"folder": loaders.write_jpeg_folder(jpegs, files), "workers": workers, "batch": batch,
           "rows": []}
    if "workers" in checks:
        out["rows"] = [measure(row, args, batch, steps, gpus, workdir)
                       for row in workers_rows(args, steps, jpegs, large_batch, workdir)]
    if "loader" in checks:
        print(f"loader: workers path vs torchvision ImageFolder + PIL, "
              f"{tools.count(workers, 'worker')}, batch {batch}, {files} files ...", flush=True)
        other_work = tools.OtherWork()
        out["rates"] = loaders.compare_loaders(jpegs, batch, workers, device)
        out["ratio"], out["other_work"] = loaders.ratio(out["rates"]), other_work.share()
    return out


def small_images(args, steps, workdir: Path) -> tuple[tuple[str, ...], str]:
    """The data flags of the `single` row's images read from files, and where they are: its
    synthetic images (launch) as 32 px PNGs written to ``workdir``, or its --dataset itself."""
    if args.dataset != "synthetic":
        return (("--dataset", args.dataset,
                 *(("--data-dir", args.data_dir) if args.data_dir else ())),
                args.data_dir or args.dataset)
    batch = args.global_batch_size or args.per_device_batch_size
    pngs = workdir / "png"
    if not pngs.exists():
        loaders.write_png_folder(pngs, make_synthetic((WARMUP_STEPS + steps + 1) * batch,
                                                      max(batch, 10)))
    return ("--data-dir", str(pngs), "--image-size", "32"), "the `single` row's images as PNG files"


def workers_rows(args, steps, jpegs: Path, large_batch: int, workdir: Path) -> list[Strategy]:
    """train_single --loader workers (the scripts' default worker count) on the `single` row's
    model, batch and images, and on ResNet-50 at 224 px."""
    small, where = small_images(args, steps, workdir)
    flags = ("--loader", "workers")
    return [Strategy("workers32", f"train_single --loader workers, {args.model} at "
                                  f"32 px on {where}",
                     "train_single.py", 1, 1, flags=flags, model=args.model, data=small),
            Strategy("workers224", f"train_single --loader workers, {LARGE_MODEL} at "
                                   f"{LARGE_SIZE} px on the JPEGs",
                     "train_single.py", 1, 1, flags=flags, model=LARGE_MODEL, batch=large_batch,
                     data=("--data-dir", str(jpegs), "--image-size", str(LARGE_SIZE)))]


def input_checks(inputs: dict) -> list[dict]:
    """The loader check's ratio against its target, and the workers rows' data wait, reported."""
    results = []
    if "rates" in inputs:
        rates, ratio, folder = inputs["rates"], inputs["ratio"], inputs["folder"]
        ours, theirs = statistics.median(rates["ours"]), statistics.median(rates["torchvision"])
        results.append(check(
            f"loader: workers path / torchvision ImageFolder + PIL, "
            f"{tools.count(inputs['workers'], 'worker')}",
            ratio, ratio >= 1.5,
            f"{ratio:.2f}x ({ours:,.0f} vs {theirs:,.0f} img/s, {loaders.SIZE} px crops, "
            f"batch {inputs['batch']})",
            ">= 1.5x",
            f"{folder['train_files']} JPEGs of {folder['sides'][0]}-{folder['sides'][1]} "
            f"px a side, {folder['mean_kb']:.0f} KB on average; the median of "
            f"{len(rates['ours'])} rounds, each an epoch of each pipeline back to back (the order "
            f"swapped every round), after a warm-up epoch each", inputs["other_work"]))
    for row in inputs.get("rows", []):
        if row.get("error"):
            continue
        share, workers = row["data_wait_steady_frac"], tools.count(row["loader_workers"], "worker")
        results.append(check(
            f"data wait: {row['label']}", share, None,
            f"{100 * share:.2f} % after the warm-up, {100 * row['data_wait_frac']:.2f} % with it "
            f"(batch {row['global_batch']}, {workers}, {tools._fmt_rate(row['img_per_s'])} img/s)",
            "reported", other_work=row["other_work"]))
    return results


def finetune_checks(args, steps, gpus, workdir: Path) -> list[dict]:
    """The finetune check: train_single --loader workers without the fine-tuning flags and with
    each of --finetune-flags, --repeats rounds of one launch each, each round between two launches
    without them (bench/finetune.py)."""
    data, where = small_images(args, steps, workdir)
    weights = finetune.write_weights(args.model, workdir / "weights.safetensors")
    base = ("--loader", "workers", "--log-every", str(finetune.LOG_EVERY))
    label = f"train_single --loader workers, {args.model} on {where}"
    names = list(dict.fromkeys(args.finetune_flags))  # each once
    rows = {"base": Strategy("finetune-base", label, "train_single.py", 1, 1, flags=base,
                             data=data)}
    rows.update({name: Strategy(f"finetune-{name}", f"{label}, {name}", "train_single.py", 1, 1,
                                flags=(*base, *finetune.flags(name, weights)), data=data)
                 for name in names})
    batch = args.global_batch_size or args.per_device_batch_size
    print(f"finetune: {label}, batch {batch}, {counted(args.repeats, 'round', 'rounds')} of "
          f"{counted(len(names), 'launch', 'launches')} "
          f"({' '.join(names)}), each round between two launches without the flags ...",
          flush=True)
    runs, other_work = {name: [] for name in rows}, tools.OtherWork()
    try:
        for round_ in range(args.repeats):
            for name in ["base", *finetune.order(names, round_)]:
                runs[name].append(launch(rows[name], args, batch, steps, gpus, workdir))
        runs["base"].append(launch(rows["base"], args, batch, steps, gpus, workdir))
    except RuntimeError as error:
        print(f"  failed: {error}", flush=True)
        failed = check("finetune: the fine-tuning flags' cost per step", None, None,
                       f"failed: {error}", "reported")
        return [{**failed, "error": str(error)}]
    share, results = other_work.share(), []
    base_ms = [1e3 * finetune.launch_mean(run) for run in runs["base"]]
    note = (f"{label}, batch {batch}; a launch's step: the mean after the warm-up (a log every "
            f"{finetune.LOG_EVERY} steps); each flag's launch against the mean of the launches "
            f"without flags before and after its round, which took {min(base_ms):.1f} to "
            f"{max(base_ms):.1f} ms a step ({len(base_ms)} launches); the medians over "
            f"{counted(args.repeats, 'round', 'rounds')}, the flags' order reversed every other "
            f"round")
    for name in names:
        cost = finetune.summarise(runs["base"], runs[name])
        shown = " ".join(finetune.flags(name, Path("FILE")))
        result = check(
            f"finetune: {shown}", cost["ratio"], None,
            f"{cost['cost_ms']:+.1f} ms a step, {cost['ratio']:.3f}x "
            f"({1e3 * cost['flag_step_s']:.1f} vs {1e3 * cost['base_step_s']:.1f} ms, "
            f"{min(cost['round_ratios']):.3f}x to {max(cost['round_ratios']):.3f}x); data wait "
            f"{100 * cost['flag_data_wait']:.1f} % vs {100 * cost['base_data_wait']:.1f} %",
            "reported", "" if results else note, share)
        result.update(cost, runs=runs[name], base_runs=runs["base"])
        results.append(result)
        print(f"  {shown}: {result['measured']}", flush=True)
    return results


def compile_check(setting, eager, args, steps, device) -> dict:
    """torch.compile of the plain loop, from an empty cache: compile time = first step - a steady
    step; the speed-up is over an eager round in the same setting, run right after."""
    name, other_work = f"compile: torch.compile, {setting}", tools.OtherWork()
    try:
        loop = tools.PlainLoop(args.model, args.per_device_batch_size, device,
                               bf16=setting == "bf16", channels_last=setting == "bf16",
                               compiled=True, tf32_math=eager.tf32_math)
        with tools.cold_compile_cache():  # a first run's compile time, not a rerun's from the cache
            first = loop.run(1)
        rate, eager_rate = steady_rate(loop, steps), steady_rate(eager, steps)
    except Exception as error:  # noqa: BLE001 - a missing or failing compiler is a result to report
        return check(name, None, None,
                     f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}",
                     "reported")
    compile_s = first - loop.batch_size / rate
    speedup = rate / eager_rate
    saved_per_image = 1 / eager_rate - 1 / rate
    verdict = (f"pays for its compile time after {compile_s / saved_per_image:,.0f} images "
               f"({compile_s / saved_per_image / EPOCH_IMAGES:.2f} epochs of 50,000)"
               if speedup > 1.02 else "does not pay here: no speed-up beyond 2 %")
    result = check(name, speedup, None,
                   f"{speedup:.2f}x ({rate:.1f} vs {eager_rate:.1f} img/s eager), "
                   f"compile {compile_s:.0f} s", "reported", verdict, other_work.share())
    result["compile_s"] = compile_s
    return result


def steady_rate(loop, steps: int) -> float:
    """img/s of ``steps`` more steps of a plain loop, by their median step time as for the rows."""
    loop.run(steps)
    return loop.batch_size / statistics.median(loop.step_seconds[-steps:])


def noise_note(rates: list[float], other_work: float) -> str:
    """How much the machine's speed moved: other processes' share of the CPU, and the spread of
    identical plain-loop rounds (which also shows what no process list shows: a shared host)."""
    note = f"other processes used {other_work:.0%} of the machine's CPU time during the benchmark"
    if len(rates) > 1:
        spread = max(rates) / min(rates) - 1
        note += (f"; identical plain-loop rounds ran at {min(rates):.1f} to {max(rates):.1f} img/s "
                 f"({spread:.0%} apart), so the overhead, precision and compute ratios compare "
                 f"measurements taken in the same minutes")
        if spread > 0.1 or other_work > 0.05:
            note += (". The machine's speed moved by more than 10 %: medians resist a stalled "
                     "step, not a slower machine; run again on a quieter one before trusting a "
                     "ratio near its target")
    return note


def memory_protocol(gpus: int) -> str:
    """The protocol's account of the peak-memory column, with the physical GPUs nvidia-smi
    measures."""
    if not gpus:
        return ("per training process, its peak resident memory (VmHWM, reported by the process as "
                "it exits)")
    try:
        watched = tools.nvidia_smi_gpus()[:gpus]
    except tools.NVIDIA_SMI_ERRORS as error:
        return (f"per GPU, the peak memory torch allocated in the training processes (their "
                f"gpu_mem_peak_gb; no CUDA context, no allocator cache), as nvidia-smi failed here "
                f"({type(error).__name__}: {str(error).strip()[:200]})")
    return (f"per GPU, the largest rise of nvidia-smi's memory.used during the runs, CUDA context "
            f"included; {tools.describe_gpus(watched)}")


# --------------------------------------------------------------------------------------- main

def chosen_checks(asked: list[str]) -> list[str]:
    """--checks as the checks to run: all is every one but finetune (2 launches per flag), which
    runs where it is named."""
    if "none" in asked:
        return []
    if "all" in asked:
        return [c for c in CHECKS if c != "finetune" or c in asked]
    return list(asked)


def main(args):
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    steps = args.steps or (50 if gpus else 8)
    available = available_strategies(gpus)
    names = args.strategies or list(available)
    checks = chosen_checks(args.checks)
    if checks and "single" not in names:
        names = ["single", *names]  # the checks compare the other loops with train_single
    for name in [*names, *([args.sweep_strategy] if args.sweep_batch_size else [])]:
        if name not in available:
            raise UserError(f"strategy {name!r} cannot run on this machine ({gpus} GPUs): "
                            f"choose from {', '.join(available)}")
    build_model(args.model, num_classes=10)  # an unknown --model stops here, with the valid names
    output_dir = Path(args.output_dir) if args.output_dir else new_run_dir("benchmark")
    output_dir.mkdir(parents=True, exist_ok=True)
    machine = tools.machine_info()
    protocol = PROTOCOL.format(
        steps=steps, repeats="once" if args.repeats == 1 else f"{args.repeats} times",
        warmup=WARMUP_STEPS,
        data=f"Data: synthetic, {WARMUP_STEPS} + N + 1 batches made on the spot and held on the "
             f"device." if args.dataset == "synthetic"
        else f"Data: {args.data_dir or args.dataset}, held on the device.",
        cpu=" (without GPUs every row shares the same cores: the CPU is one device)"
        if not gpus else "",
        memory=memory_protocol(gpus))
    print(f"benchmark: {args.model} on {tools.describe_machine(machine)}; N = {steps} steps; rows: "
          f"{' '.join(names)}; checks: {' '.join(checks) or 'none'}; report in {output_dir}\n"
          f"protocol: {protocol}", flush=True)
    started, clock, other_work = (time.strftime("%Y-%m-%d %H:%M"), time.perf_counter(),
                                  tools.OtherWork())

    # Plain-loop rounds run around train_single's launches: the overhead and precision ratios then
    # compare loops that ran on the same machine at the same time.
    plain = {"fp32": [], "fp32_channels_last": [], "bf16": [], "ema": [], "watch": []}
    # Matmul FLOP/s, measured in the same rounds and in the math the loops run in: with the
    # scripts' --tf32 default, fp32 in TF32 on GPUs that have it, so the strict fp32 peak is
    # measured beside it.
    peaks = {"fp32": [], "bf16": [], **({"fp32_strict": []} if tools.uses_tf32(device) else {})}
    tf32_math = True if gpus else None  # the scripts' --tf32 default; it changes nothing on a CPU
    loops = {}
    if {"overhead", "precision", "compute", "compile", "ema", "watch"} & set(checks):
        loops["fp32"] = tools.PlainLoop(args.model, args.per_device_batch_size, device,
                                        tf32_math=tf32_math)
        if {"overhead", "ema", "watch"} & set(checks):  # train_single's layout (channels_last);
            # "fp32" stays NCHW, the baseline of the precision check (bf16 + channels_last
            # against fp32)
            loops["fp32_channels_last"] = tools.PlainLoop(args.model, args.per_device_batch_size,
                                                          device, channels_last=True,
                                                          tf32_math=tf32_math)
        if {"precision", "compile"} & set(checks) and (gpus == 0 or tools.native_bf16()):
            loops["bf16"] = tools.PlainLoop(args.model, args.per_device_batch_size, device,
                                            bf16=True, channels_last=True, tf32_math=tf32_math)
        if "ema" in checks:  # the same loop as fp32_channels_last, plus the weight average
            loops["ema"] = tools.PlainLoop(args.model, args.per_device_batch_size, device,
                                           channels_last=True, tf32_math=tf32_math,
                                           ema_decay=EMA_DECAY)
        if "watch" in checks:  # the same loop as fp32_channels_last, the failure watch beside it
            loops["watch"] = tools.PlainLoop(args.model, args.per_device_batch_size, device,
                                             channels_last=True, tf32_math=tf32_math)
        for loop in loops.values():
            loop.run(WARMUP_STEPS)
            loop.step_seconds.clear()

    def plain_round():
        for key, loop in loops.items():
            with failure_watch() if key == "watch" else nullcontext():
                plain[key].append(steady_rate(loop, steps))
        if {"precision", "compute"} & set(checks):
            for key, math in (("fp32", tf32_math), ("fp32_strict", False), ("bf16", None)):
                if key in peaks and key.split("_")[0] in loops:
                    dtype = torch.bfloat16 if key == "bf16" else torch.float32
                    # The best of 2 on a CPU, where a 4096-square matmul takes a second; of 5
                    # on a GPU.
                    peaks[key].append(tools.matmul_peak(device, dtype, args.matmul_size,
                                                        repeats=5 if gpus else 2, tf32_math=math))

    rows = []
    with tempfile.TemporaryDirectory(prefix="benchmark-") as workdir:
        for name in names:
            rows.append(measure(available[name], args, args.per_device_batch_size, steps, gpus,
                                Path(workdir),
                                between=plain_round if name == "single" else lambda: None))
        add_speedups(rows)
        sweep = []
        for batch in args.sweep_batch_size or []:
            same = next((r for r in rows if r["name"] == args.sweep_strategy
                         and r["per_device_batch"] == batch and not args.global_batch_size), None)
            sweep.append(same or measure(available[args.sweep_strategy], args, batch, steps, gpus,
                                         Path(workdir)))
        inputs = input_paths(checks, args, steps, gpus, device, Path(workdir)) \
            if {"loader", "workers"} & set(checks) else {}
        tuned = finetune_checks(args, steps, gpus, Path(workdir)) if "finetune" in checks else []
        # first in the report: what a user waits for, and what a step costs beyond the model
        first = (time_to_accuracy.tta_check(gpus, Path(workdir), args.tta_flags.split(),
                                            args.timeout) if "tta" in checks else [])
        first += (opcount.ops_check(args.model, args.per_device_batch_size, device, Path(workdir),
                                    args.timeout) if "ops" in checks else [])
    single = next((r for r in rows if r["name"] == "single"), {})
    results = first + (run_checks(checks, single, plain, peaks, loops, args, steps, device, inputs)
                       if checks else []) + tuned

    report = {"title": f"{args.model}, {args.dataset}", "model": args.model,
              "dataset": args.data_dir or args.dataset, "started": started,
              "duration_s": round(time.perf_counter() - clock, 1), "machine": machine,
              "load_average_end": list(os.getloadavg()), "command": shlex.join(sys.argv),
              "protocol": protocol, "steps": steps, "repeats": args.repeats, "rows": rows,
              "sweep": sweep, "inputs": inputs,
              "plain_loop_img_per_s": plain, "matmul_flop_per_s": peaks,
              "fp32_math": "TF32" if tools.uses_tf32(device) else "fp32", "checks": results,
              "other_work_cpu_share": other_work.share()}
    report["noise"] = noise_note(plain["fp32"], report["other_work_cpu_share"])
    write_json(output_dir / "benchmark.json", report)
    tools.write_markdown(output_dir / "benchmark.md", report)
    tools.write_chart(output_dir / "benchmark.png", report)
    print("\n" + (output_dir / "benchmark.md").read_text())
    print(f"benchmark: {report['duration_s']:.0f} s; wrote benchmark.json, benchmark.md, "
          f"benchmark.png to {output_dir}")
    failed = [r["name"] for r in rows + sweep + inputs.get("rows", []) if r.get("error")]
    failed += ["finetune"] * any(r.get("error") for r in tuned)
    if failed:
        print(f"error: rows {', '.join(failed)} failed to run (see above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
