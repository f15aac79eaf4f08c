"""Prove a GPU machine and the scripts on it with one command, in the minutes a lent GPU is there.

    make gpu-check                                    # or: python scripts/gpu_check.py
    make gpu-check ARGS=--dry-run                     # the plan and its times; no GPU needed
    make gpu-check ARGS="--budget 3600"               # every row, not only those 9 minutes hold
    CUDA_VISIBLE_DEVICES=0,1 make gpu-check           # the GPUs a run will use

The plan (bench/gpu_plan.py) is in order of value; a row runs while its estimate fits in --budget
(9 minutes by default), and what does not fit is listed with the reason:
1. the multi-process paths on CUDA tensors, in tests/test_gpu.py: with one GPU two processes share
   it (--share-gpus), else a process per GPU. DDP and FSDP2 against one process after fixed steps
   (BatchNorm frozen, --deterministic), FSDP2's shards (about 1/N of the parameter and optimizer
   bytes each), the refusal of more processes than GPUs without --share-gpus, FSDP2 stop +
   --resume bit for bit with --ema-decay, --sync-bn, AMP fp16 and bf16, --profile and NVML's
   utilisation, fine-tuning a timm model at 224 px through DataLoader workers, --compile-mode
   reduce-overhead under DDP;
2. the benchmark's single-GPU rows (scripts/benchmark.py): the plain-loop ratio and data wait at
   batch 128 and 512, the bf16 epoch with and without CUDA graphs;
3. with the budget to spare: the rest of tests/test_gpu.py (every script on one GPU, DataParallel
   on several), every benchmark row on all GPUs, ResNet-50 at 224 px.
A check does not start when its estimate no longer fits the time left, and a check still running at
the end of the budget is stopped. gpu-check.json (every figure) and gpu-check.md are rewritten as
each row ends, in a new run folder (runs/gpu-check-<date>-<time>, or --output-dir): a run cut
short keeps what finished. The report gives the machine (GPUs, driver, torch, CUDA, cuDNN, NCCL,
accelerate), each row's estimate and time, each check's figures and criterion, the targets met or
missed, and the limits of processes sharing a GPU (bench/gpu_report.py).

Exit status 0 when every row of the plan ran and passed, 1 otherwise (a missed target is reported,
not an exit status). Without a CUDA GPU it says so in one line, writes nothing and exits 1
(--dry-run excepted). Keep a report as docs/gpu/<device>.md, one per device kind.
"""

import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import gpu_plan, tools
from bench.gpu_report import LARGE_MODEL, LARGE_SIZE, build_report, verdict, write_report
from common.cli import Parser
from common.data.stats import channel_stats
from common.data.synthetic import make_synthetic
from common.data.transform import BatchTransform
from common.errors import UserError, first_line
from common.files import check_folder
from common.parallel.launch import nccl_shares_gpus, nccl_version
from common.run.folder import new_run_dir
from common.units import GB

ROOT = Path(__file__).resolve().parents[1]
# where tests/test_gpu.py appends each check's figures, and bench/gpu_pytest.py its outcome
RESULTS_ENV, OUTCOMES_ENV = "GPU_CHECK_RESULTS", "GPU_CHECK_OUTCOMES"
KINDS = {"tests": "check", "benchmark": "benchmark", "resnet50": "resnet50"}  # --skip's parts
WARMUP_STEPS = 3  # plain-loop steps left out: cudnn.benchmark tries its algorithms on the first
EPOCH_IMAGES = 50_000
POLL_S = 2  # how often the report is brought up to date while the checks run


def parse_args(argv=None):
    parser = Parser(__doc__)
    parser.add_argument("--output-dir", default=None,
                        help="folder of the report (default: a new runs/gpu-check-<date>-<time>)")
    parser.add_argument("--budget", type=float, default=gpu_plan.BUDGET_S,
                        help="seconds the whole check may take: rows run in order while their "
                             "estimates fit, a check running at the end is stopped "
                             "(default: %(default)s, 9 minutes)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan, each row's estimate and whether it fits, and exit")
    parser.add_argument("--skip", nargs="+", default=[], choices=tuple(KINDS),
                        help="parts not to run: the checks (tests), the benchmark rows, the "
                             "ResNet-50 224 px rows (default: run all)")
    parser.add_argument("--resnet50-batch-size", type=int, default=128,
                        help="images per step of the ResNet-50 224 px plain loop "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.resnet50_batch_size < 1:
        raise UserError(f"--resnet50-batch-size {args.resnet50_batch_size}: must be 1 or more")
    if not 60 <= args.budget <= 86_400:
        raise UserError(f"--budget {args.budget:g}: must be from 60 to 86400 seconds, e.g. 540")
    check_folder("--output-dir", args.output_dir)
    return args


# ------------------------------------------------------------------------------------ the machine

def first_visible_gpu() -> str:
    """The first GPU CUDA_VISIBLE_DEVICES leaves visible, as a value for CUDA_VISIBLE_DEVICES."""
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()


def driver_version() -> str:
    """The NVIDIA driver, from nvidia-smi (torch has no stable API for it); 'unknown' without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[0] if out else "unknown"


def machine() -> dict:
    info = tools.machine_info()
    info["gpus"] = [{"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                     "memory_gb": round(p.total_memory / GB, 1)}
                    for i, p in enumerate(map(torch.cuda.get_device_properties,
                                              range(torch.cuda.device_count())))]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):  # a torch built without NCCL
        nccl = "none"
    info.update(driver=driver_version(), cudnn=str(torch.backends.cudnn.version()), nccl=nccl,
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", "(not set: all)"))
    return info


# ------------------------------------------------------------------------------------ the checks

class Progress:
    """The plan as it runs: each row's status, the checks' outcomes and figures, the benchmark and
    ResNet-50 rows; ``write()`` rewrites the report from it (as each row ends)."""

    def __init__(self, folder: Path, planned: list, info: dict, command: str):
        self.folder, self.info, self.command = folder, info, command
        self.started, self.clock = time.strftime("%Y-%m-%d %H:%M"), time.perf_counter()
        self.rows = [{"name": p.row.name, "kind": p.row.kind, "proves": p.row.proves,
                      "estimate_s": p.row.seconds, "status": "not run" if p.why_not else "planned",
                      "message": p.why_not or "", "seconds": None} for p in planned]
        self.checks, self.benchmark, self.resnet50 = [], [], []

    def row(self, name: str) -> dict:
        return next(r for r in self.rows if r["name"] == name)

    def write(self) -> dict:
        report = build_report(self.info, self.checks, self.benchmark, self.resnet50,
                              self.started, time.perf_counter() - self.clock, self.command,
                              self.rows)
        write_report(self.folder, report)
        return report


def read_checks(outcomes: Path, figures: Path) -> list[dict]:
    """Each check's outcome (bench/gpu_pytest.py: status, first line of the message, seconds),
    joined by name with the figures it recorded (one JSON object a line, with its "test")."""
    recorded: dict[str, dict] = {}
    for entry in _json_lines(figures):
        recorded.setdefault(entry.pop("test"), {}).update(entry)
    return [{"name": o["name"], "status": o["status"], "message": o["message"],
             "seconds": round(o["seconds"], 1), "figures": recorded.get(o["name"], {})}
            for o in _json_lines(outcomes)]


def _json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_checks(progress: Progress, names: list[str], deadline: float) -> None:
    """tests/test_gpu.py's checks ``names``, in this order, in one pytest (module fixtures shared),
    the report rewritten as each ends; stopped at ``deadline`` (time.time())."""
    folder = progress.folder
    outcomes, figures = folder / "checks-outcomes.jsonl", folder / "checks-figures.jsonl"
    estimates = {r["name"]: r["estimate_s"] for r in progress.rows if r["name"] in names}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider",
               "-p", "bench.gpu_pytest", *(f"{gpu_plan.CHECKS}::{name}" for name in names)]
    env = {**os.environ, RESULTS_ENV: str(figures), OUTCOMES_ENV: str(outcomes),
           "GPU_CHECK_DEADLINE": str(deadline), "GPU_CHECK_ESTIMATES": json.dumps(estimates)}
    for name in names:
        progress.row(name)["status"] = "running"
    process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    seen = -1
    while process.poll() is None:
        if time.time() > deadline:  # the check in progress is stopped; its row says so
            stop(process)
            break
        time.sleep(POLL_S)
        if outcomes.exists() and outcomes.stat().st_size != seen:
            seen = outcomes.stat().st_size
            _update_checks(progress, outcomes, figures, names)
            progress.write()
    _update_checks(progress, outcomes, figures, names)
    for name in names:
        row = progress.row(name)
        if row["status"] == "running":  # no outcome: stopped, or pytest itself failed
            row["status"], row["message"] = (("cut", "stopped: the check's time ran out")
                                             if time.time() > deadline else
                                             ("error", f"pytest exited with {process.returncode} "
                                                       f"before this check ended"))


def stop(process: subprocess.Popen) -> None:
    """End ``process`` and what it started (its own session: the training processes of a launch
    too), SIGTERM first: the scripts save and exit within seconds; SIGKILL after 15 s."""
    os.killpg(process.pid, signal.SIGTERM)
    # The whole group, not only its leader: pytest ends at once, the launches under it save first.
    ends = time.time() + 15
    while time.time() < ends and _group_alive(process):
        time.sleep(0.5)
    if _group_alive(process):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _group_alive(process: subprocess.Popen) -> bool:
    """Whether any process of ``process``'s group is left (its leader reaped first: a zombie
    would count)."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _update_checks(progress: Progress, outcomes: Path, figures: Path, names: list[str]) -> None:
    ended = read_checks(outcomes, figures)
    progress.checks = [c for c in progress.checks if c["name"] not in names] + ended
    for check in ended:
        row = progress.row(check["name"])
        out_of_time = check["message"].startswith("not run: out of time")
        row.update(status="not run" if out_of_time else check["status"],
                   message=check["message"], seconds=check["seconds"])


# ----------------------------------------------------------------------------------- the benchmark

def run_benchmark(progress: Progress, name: str, flags: tuple[str, ...], all_gpus: bool,
                  deadline: float) -> None:
    """A benchmark row: scripts/benchmark.py ``flags`` into a folder of its own (1 GPU unless
    ``all_gpus``), its rows and checks into the report; stopped at ``deadline``."""
    out = progress.folder / name
    command = [sys.executable, "scripts/benchmark.py", *flags, "--output-dir", str(out)]
    env = {} if all_gpus else {"CUDA_VISIBLE_DEVICES": first_visible_gpu()}
    print(f"gpu-check: {name}: {shlex.join(command)}", flush=True)
    row, began = progress.row(name), time.perf_counter()
    row["status"] = "running"
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, start_new_session=True)
    try:
        returncode = process.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        stop(process)
        returncode = None
    report = (json.loads((out / "benchmark.json").read_text())
              if (out / "benchmark.json").exists() else {})
    # A run without plain-loop rounds (the all-GPU one) is compared with the first run's.
    plain = plain_rates(report) or next((r["plain"] for r in progress.benchmark if r["plain"]), {})
    rows = script_rows(report, plain, skip_single=all_gpus)
    progress.benchmark.append({"name": name, "command": shlex.join(command), "env": env,
                               "returncode": returncode if returncode is not None else -1,
                               "folder": out.name, "rows": rows, "plain": plain,
                               "checks": report.get("checks", [])})
    failed = returncode != 0 or any(r["error"] for r in rows)
    row.update(seconds=round(time.perf_counter() - began, 1),
               status="cut" if returncode is None else "failed" if failed else "passed",
               message="stopped: the check's time ran out" if returncode is None else
               f"exit status {returncode}" if returncode else "")


def plain_rates(benchmark: dict) -> dict[str, float]:
    """The median img/s of a benchmark run's plain-loop rounds, by precision (fp32, bf16)."""
    return {key: statistics.median(rates)
            for key, rates in benchmark.get("plain_loop_img_per_s", {}).items() if rates}


def script_rows(benchmark: dict, plain: dict[str, float], skip_single: bool = False) -> list[dict]:
    """benchmark.json's rows for the report. vs_plain = img/s / (GPUs x ``plain``[precision]), the
    plain loop of the same model, precision and batch per GPU; fp16 has no plain loop."""
    rows = []
    for r in benchmark.get("rows", []):
        if skip_single and r["name"] == "single":
            continue
        # The scripts run channels_last: against the plain loop in that layout where there is one.
        rate, base = r.get("img_per_s"), plain.get(f"{r['precision']}_channels_last",
                                                   plain.get(r["precision"]))
        rows.append({"strategy": r["name"], "label": r["label"], "script": r["script"],
                     "precision": r["precision"], "gpus": r["devices"],
                     "per_gpu_batch": r["per_device_batch"], "img_per_s": rate,
                     "epoch_50k_s": r.get("epoch_50k_s"), "speedup": r.get("speedup"),
                     "vs_plain": rate / (r["devices"] * base) if rate and base else None,
                     "data_wait_frac": r.get("data_wait_frac"),
                     "peak_memory_gb": r.get("peak_memory_gb", []),
                     "memory_kind": r.get("memory_kind"), "command": r.get("command"),
                     "error": r.get("error")})
    return rows


def large_rows(batch: int, steps: int) -> list[dict]:
    """ResNet-50 at 224 px, synthetic batches already on the GPU, the plain loop in fp32 and bf16,
    both in channels_last with TF32 and cudnn.benchmark on: the scripts' defaults
    (common.recipe.numerics.set_numerics)."""
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    batches = max(2, math.ceil(10 / batch))  # whole batches, and every one of the 10 classes
    data = make_synthetic(batches * batch, 10, image_size=LARGE_SIZE)
    transform = BatchTransform(*channel_stats(data.train_images), augment=False, channels_last=True)
    rows = []
    for precision in ("fp32", "bf16"):
        row = {"model": LARGE_MODEL, "image_size": LARGE_SIZE, "precision": precision,
               "batch": batch, "img_per_s": None, "epoch_50k_s": None, "peak_memory_gb": None,
               "error": None}
        rows.append(row)
        if precision == "bf16" and not tools.native_bf16():
            row["error"] = "no native bf16 on this GPU (compute capability below 8.0)"
            continue
        print(f"gpu-check: {LARGE_MODEL} at {LARGE_SIZE} px, {precision}, batch {batch}, "
              f"plain loop ...", flush=True)
        loop = None
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            loop = tools.PlainLoop(LARGE_MODEL, batch, device, bf16=precision == "bf16",
                                   channels_last=True, num_batches=batches, tf32_math=True)
            # PlainLoop makes 32 px batches; these are its 224 px replacement, prepared the
            # same way.
            loop.batches = [(transform.eval(images.to(device)), labels.to(device))
                            for images, labels in zip(data.train_images.split(batch),
                                                      data.train_labels.split(batch))]
            loop.run(WARMUP_STEPS)
            loop.run(steps)
            row["img_per_s"] = batch / statistics.median(loop.step_seconds[-steps:])
            row["epoch_50k_s"] = EPOCH_IMAGES / row["img_per_s"]
            row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 2)
        except torch.cuda.OutOfMemoryError:
            row["error"] = (f"out of GPU memory at batch {batch}: "
                            f"try --resnet50-batch-size {batch // 2}")
        except Exception as error:  # noqa: BLE001 - a row that cannot run is a result to report
            row["error"] = first_line(error)
        finally:
            del loop
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------- main

def segments(runnable: list) -> list[tuple[str, list]]:
    """Consecutive rows of one kind, in plan order: the checks among them run in one pytest."""
    out: list[tuple[str, list]] = []
    for planned in runnable:
        if out and out[-1][0] == planned.row.kind == "check":
            out[-1][1].append(planned)
        else:
            out.append((planned.row.kind, [planned]))
    return out


def run_plan(progress: Progress, planned: list, deadline: float, batch: int) -> None:
    for kind, group in segments([p for p in planned if p.why_not is None]):
        if kind == "check":  # one pytest for the group: its module fixtures are shared
            run_checks(progress, [p.row.name for p in group], deadline)
        else:
            for p in group:
                run_one(progress, p.row, deadline, batch)
        progress.write()


def run_one(progress: Progress, row, deadline: float, batch: int) -> None:
    """A benchmark or ResNet-50 row of the plan, if its estimate still fits before ``deadline``."""
    status = progress.row(row.name)
    if time.time() + row.seconds > deadline:
        status.update(status="not run", message="out of time: its estimate no longer fit")
    elif row.kind == "benchmark":
        run_benchmark(progress, row.name, row.bench, row.gpus > 1, deadline)
    else:
        began = time.perf_counter()
        progress.resnet50 = large_rows(batch, 50)
        failed = any(r["error"] and "native bf16" not in r["error"] for r in progress.resnet50)
        status.update(status="failed" if failed else "passed",
                      seconds=round(time.perf_counter() - began, 1))


def main(args) -> int:
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 1  # the plan for one lent GPU, shown anywhere
    rows = [row for row in gpu_plan.PLAN if row.kind not in {KINDS[s] for s in args.skip}]
    planned = gpu_plan.plan(rows, args.budget, gpus, tools.native_bf16() if cuda else True,
                            nccl_shares=nccl_shares_gpus(nccl_version()) if cuda else True)
    if args.dry_run:
        print(gpu_plan.render(planned, args.budget, gpus))
        return 0
    if not cuda:
        print(f"error: gpu-check needs a CUDA GPU and torch sees none (torch.cuda.is_available() "
              f"is False; torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): "
              f"run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 1
    deadline = time.time() + args.budget
    # runs use cwd=ROOT
    folder = (Path(args.output_dir) if args.output_dir else new_run_dir("gpu-check")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    info = machine()
    progress = Progress(folder, planned, info, shlex.join(sys.argv))
    print(f"gpu-check: {len(info['gpus'])} GPU(s): {', '.join(g['name'] for g in info['gpus'])}; "
          f"driver {info['driver']}; NCCL {info['nccl']}; report in {folder}\n"
          f"{gpu_plan.render(planned, args.budget, gpus)}", flush=True)
    progress.write()
    run_plan(progress, planned, deadline, args.resnet50_batch_size)
    report = progress.write()
    print("\n" + (folder / "gpu-check.md").read_text())
    missed = [t["target"] for t in report["targets"] if t["met"] is False]
    complete = report["passed"] and not report["unfinished"]
    print(f"gpu-check: {verdict(report)}; targets missed: {len(missed)}; wrote gpu-check.json and "
          f"gpu-check.md to {folder}; keep it as docs/gpu/{report['slug']}.md", flush=True)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main(parse_args()))
