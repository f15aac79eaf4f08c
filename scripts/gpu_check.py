"""Prove a GPU machine and the scripts on it with one command, and write the report.

    make gpu-check                                    # or: python scripts/gpu_check.py
    CUDA_VISIBLE_DEVICES=0,1 make gpu-check           # the GPUs a run will use
    make gpu-check ARGS="--skip benchmark resnet50"   # the checks only
    make gpu-check ARGS="--output-dir runs/my-check"

In order, on the first visible GPU and on all of them:
1. checks: `pytest -m gpu tests/test_gpu.py`. Every training script on every path it has (1 GPU and
   all GPUs; fp32 with and without TF32, fp16, bf16; --compile; --sync-bn; --ema-decay; FSDP2;
   DataParallel, which checks the copies between GPUs first; check_gpus.py), and what must agree:
   N-GPU DDP, DataParallel, FSDP2 and SyncBatchNorm against 1 GPU after fixed steps, stop +
   --resume under --deterministic bit for bit, evaluate.py against the logged accuracy. The
   criteria and tolerances are in tests/test_gpu.py and, with each check's figures, in the
   report. Multi-GPU checks are skipped, with the reason, on 1 GPU.
2. the benchmark's GPU rows (scripts/benchmark.py, its protocol): ResNet-18 at 32 px on synthetic
   data, every script and precision on 1 GPU (batch 128, and 512 for the bf16 epoch target), then
   every row on all GPUs (FSDP2 beside DDP): img/s, the ratio to a plain PyTorch loop of the same
   model and precision, data wait, peak memory per GPU; the cost of --ema-decay's update (1 GPU).
3. ResNet-50 (torchvision, ImageNet stem) at 224 px on synthetic data, fp32 (TF32) and bf16: the
   plain loop only (bench/tools.py PlainLoop), because the scripts' synthetic data is 32 px.
4. gpu-check.json (every figure) and gpu-check.md in a new run folder (runs/gpu-check-<date>-<time>,
   or --output-dir), with the machine (GPUs, compute capability, driver, torch, CUDA, cuDNN, NCCL,
   accelerate) and the project's targets (TARGETS below), each met or not.

Exit status 0 when every check passed and every benchmark row ran, 1 otherwise; a missed target is
reported, not an exit status. Without a CUDA GPU it says so in one line, writes nothing and exits 1.
Keep a report as docs/gpu/<device>.md, one per device kind (the name is printed at the end).
"""

import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import torch

from bench import tools
from common.cli import Parser
from common.data.stats import channel_stats
from common.data.synthetic import make_synthetic
from common.data.transform import BatchTransform
from common.errors import UserError, first_line
from common.files import check_folder, write_json
from common.run_folder import new_run_dir
from common.tracking import GB

ROOT = Path(__file__).resolve().parents[1]
# where tests/test_gpu.py appends each check's figures (JSON lines)
RESULTS_ENV = "GPU_CHECK_RESULTS"
PARTS = ("tests", "benchmark", "resnet50")
LARGE_MODEL, LARGE_SIZE = "torchvision:resnet50", 224
WARMUP_STEPS = 3  # plain-loop steps left out: cudnn.benchmark tries its algorithms on the first
EPOCH_IMAGES = 50_000
TARGETS = {  # the targets the reports in docs/gpu/ are held to
    "overhead": "train_single within 3 % of the plain loop (ResNet-18, 32 px, fp32, 1 GPU)",
    "data_wait": "data wait under 1 % (every ResNet-18 script row)",
    "epoch": "a 50,000-image epoch of ResNet-18 at 32 px in bf16 on one H100 in under 2 s",
    "graphs_epoch": "that epoch with CUDA graphs (--compile-mode reduce-overhead) in under 0.7 s",
}


def parse_args(argv=None):
    parser = Parser(__doc__)
    parser.add_argument("--output-dir", default=None,
                        help="folder of the report (default: a new runs/gpu-check-<date>-<time>)")
    parser.add_argument("--skip", nargs="+", default=[], choices=PARTS,
                        help="parts not to run: the checks (tests), the ResNet-18 benchmark rows, "
                             "the ResNet-50 224 px rows (default: run all)")
    parser.add_argument("--steps", type=int, default=50,
                        help="measured steps per benchmark launch and plain-loop round "
                             "(default: %(default)s)")
    parser.add_argument("--resnet50-batch-size", type=int, default=128,
                        help="images per step of the ResNet-50 224 px plain loop "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    for flag in ("steps", "resnet50_batch_size"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be 1 or more")
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


def device_slug(name: str) -> str:
    """The report's file name under docs/gpu/ for a device kind: 'NVIDIA H100 80GB HBM3' ->
    nvidia-h100-80gb-hbm3."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


# ------------------------------------------------------------------------------------ the checks

def run_tests(folder: Path) -> list[dict]:
    """tests/test_gpu.py's `gpu` tests, each with its status and the figures it recorded."""
    junit, figures = folder / "tests-junit.xml", folder / "tests-figures.jsonl"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-v", "-rs", "-p",
               "no:cacheprovider", f"--junitxml={junit}"]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, RESULTS_ENV: str(figures)},
                          check=False)
    if not junit.exists():
        return [{"name": "pytest -m gpu tests/test_gpu.py", "status": "error", "seconds": 0.0,
                 "figures": {}, "message": f"pytest exited with {done.returncode} and wrote no "
                                           f"results (see its output above)"}]
    return read_checks(junit, figures)


def read_checks(junit: Path, figures: Path) -> list[dict]:
    """pytest's junit XML (status, first line of the message, seconds), joined by test name with the
    figures each test appended to ``figures`` (one JSON object a line, with its "test")."""
    recorded: dict[str, dict] = {}
    if figures.exists():
        for line in figures.read_text().splitlines():
            entry = json.loads(line)
            recorded.setdefault(entry.pop("test"), {}).update(entry)
    checks = []
    for case in ElementTree.parse(junit).iter("testcase"):
        status, message = "passed", ""
        for outcome in case:
            if outcome.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[outcome.tag]
                message = (outcome.get("message") or outcome.text
                           or "").strip().split("\n")[0][:300]
                break
        name = case.get("name")
        checks.append({"name": name, "status": status, "message": message,
                       "seconds": round(float(case.get("time") or 0), 1),
                       "figures": recorded.get(name, {})})
    return checks


# ----------------------------------------------------------------------------------- the benchmark

def benchmark_runs(gpus: int, steps: int) -> list[dict]:
    """The benchmark runs: 1 GPU at batch 128 with the ratio checks, 1 GPU at batch 512 for the bf16
    epoch target, and every row on all GPUs (its 1-GPU row, the speed-up base, is left out here)."""
    one = {"CUDA_VISIBLE_DEVICES": first_visible_gpu()}
    runs = [{"name": "1gpu-b128", "env": one, "flags": ["--steps", str(steps)], "all_gpus": False}]
    if tools.native_bf16():
        runs.append({"name": "1gpu-b512", "env": one, "all_gpus": False,
                     "flags": ["--steps", str(steps), "--per-device-batch-size", "512",
                               "--strategies", "single", "bf16", "bf16-graphs",
                               "--checks", "overhead", "precision"]})
    if gpus > 1:
        runs.append({"name": f"{gpus}gpu-b128", "env": {},
                     "flags": ["--steps", str(steps), "--checks", "none"], "all_gpus": True})
    return runs


def run_benchmarks(folder: Path, gpus: int, steps: int) -> list[dict]:
    """Each benchmark run as scripts/benchmark.py writes it to a folder of its own, and its rows."""
    results, base = [], {}
    for run in benchmark_runs(gpus, steps):
        out = folder / f"benchmark-{run['name']}"
        command = [sys.executable, "scripts/benchmark.py", *run["flags"], "--output-dir", str(out)]
        print(f"gpu-check: benchmark {run['name']}: {shlex.join(command)}", flush=True)
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **run["env"]}, check=False)
        report = (json.loads((out / "benchmark.json").read_text())
                  if (out / "benchmark.json").exists() else {})
        # A run without plain-loop rounds (the all-GPU one) is compared with the 1-GPU run's, at the
        # same batch.
        plain = plain_rates(report) or base
        base = base or plain
        results.append({"name": run["name"], "command": shlex.join(command), "env": run["env"],
                        "returncode": done.returncode, "folder": out.name,
                        "rows": script_rows(report, plain, skip_single=run["all_gpus"]),
                        "checks": report.get("checks", [])})
    return results


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
    (common.numerics.set_numerics)."""
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


# -------------------------------------------------------------------------------------- the report

def evaluate_targets(rows: list[dict], gpu_names: list[str]) -> list[dict]:
    """Each target with what was measured and whether it was met (None: not measured, or not
    applicable)."""
    ok = [r for r in rows if r.get("img_per_s")]
    results = {key: {"target": text, "measured": "not measured", "met": None}
               for key, text in TARGETS.items()}
    single = next((r for r in ok if r["strategy"] == "single" and r["per_gpu_batch"] == 128
                   and r["vs_plain"]), None)
    if single:
        results["overhead"].update(measured=f"{single['vs_plain']:.3f}x the plain loop",
                                   met=single["vs_plain"] >= 0.97)
    worst = max((r for r in ok if r["data_wait_frac"] is not None),
                key=lambda r: r["data_wait_frac"], default=None)
    if worst:
        results["data_wait"].update(met=worst["data_wait_frac"] < 0.01, measured=(
            f"at most {100 * worst['data_wait_frac']:.2f} % ({worst['label']}, "
            f"batch {worst['per_gpu_batch']})"))
    on_h100 = any("H100" in name for name in gpu_names)
    for key, graphs, limit in (("epoch", False, 2), ("graphs_epoch", True, 0.7)):
        fastest = min((r for r in ok if r["precision"] == "bf16" and r["gpus"] == 1
                       and (r["strategy"] == "bf16-graphs") == graphs),
                      key=lambda r: r["epoch_50k_s"], default=None)
        if fastest:
            results[key].update(met=fastest["epoch_50k_s"] < limit if on_h100 else None, measured=(
                f"{fastest['epoch_50k_s']:.2f} s ({fastest['label']}, batch "
                f"{fastest['per_gpu_batch']})" + ("" if on_h100 else
                f"; set for an H100, this is {', '.join(sorted(set(gpu_names)))}")))
    return list(results.values())


def _cell(value, form: str, unit: str = "", scale: float = 1) -> str:
    return "-" if value is None else format(value * scale, form) + unit


def _figures(figures: dict) -> str:
    shown = [f"{k} {format(v, '.4g') if isinstance(v, float) else v}" for k, v in figures.items()
             if k != "criterion"]
    return _escape("; ".join(shown)) or "-"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")  # a table cell ends at a bare |


def render_markdown(report: dict) -> str:
    """gpu-check.md from the report (gpu-check.json's content)."""
    m, checks = report["machine"], report["checks"]
    counts = {s: sum(c["status"] == s for c in checks)
              for s in ("passed", "failed", "error", "skipped")}
    gpus = ", ".join(f"{g['name']} (cc {g['capability']}, {g['memory_gb']} GB)"
                     for g in m["gpus"]) or "none"
    v = m["versions"]
    lines = [f"# GPU check: {report['device']}", "",
             f"{'PASS' if report['passed'] else 'FAIL'}. Checks: {counts['passed']} passed, "
             f"{counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped. "
             f"Started {report['started']}, {report['duration_s'] / 60:.0f} min. "
             f"Command: `{report['command']}`", "",
             "## Machine", "",
             f"- GPUs ({len(m['gpus'])}, CUDA_VISIBLE_DEVICES {m['cuda_visible_devices']}): {gpus}",
             f"- driver {m['driver']}; torch {v['torch']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, "
             f"NCCL {m['nccl']}, accelerate {v['accelerate']}, Python {v['python']}",
             f"- CPU: {m['cpu']}, {m['cpu_cores']} cores; {m['platform']}", "",
             "## Targets", "", tools.markdown_table(["target", "measured", "result"], [
                 [t["target"], t["measured"],
                  {True: "met", False: "**missed**", None: "-"}[t["met"]]]
                 for t in report["targets"]]), "",
             "## Checks (tests/test_gpu.py)", "",
             tools.markdown_table(["check", "result", "figures", "s"], [
                 [c["name"], c["status"] if c["status"] == "passed" else
                  f"**{c['status']}**: {_escape(c['message'])}",
                  _figures(c["figures"]), f"{c['seconds']:.0f}"] for c in checks]), ""]
    criteria = {c["figures"]["criterion"] for c in checks if "criterion" in c["figures"]}
    lines += ["Pass criteria:", "", *sorted(f"- {text}" for text in criteria), ""]
    rows = [r for run in report["benchmark"] for r in run["rows"]]
    if report["benchmark"]:
        lines += ["## ResNet-18, 32 px, synthetic data: the scripts (scripts/benchmark.py)", "",
                  tools.markdown_table(["script", "precision", "GPUs", "batch per GPU", "img/s",
                                        "50,000-image epoch", "speed-up", "vs plain loop",
                                        "data wait", "peak memory per GPU (GB)"], [
                      [f"`{r['strategy']}`: {r['label']}", r["precision"], str(r["gpus"]),
                       str(r["per_gpu_batch"]),
                       *([f"failed: {_escape(r['error'])}"] + [""] * 5 if r["error"] else
                         [_cell(r["img_per_s"], ",.0f"), _cell(r["epoch_50k_s"], ".2f", " s"),
                          _cell(r["speedup"], ".2f", "x"), _cell(r["vs_plain"], ".3f", "x"),
                          _cell(r["data_wait_frac"], ".2f", " %", scale=100),
                          ", ".join(f"{gb:.2f}" for gb in r["peak_memory_gb"]) or "-"])]
                      for r in rows]), "",
                  "vs plain loop: img/s over GPUs x the img/s of bench/tools.py's PlainLoop (same "
                  "model, precision and batch per GPU, batches already normalised on the GPU, "
                  "nothing but forward, loss, backward, step), measured in the same benchmark run; "
                  "fp16 has no plain loop. The plain fp32 loop runs in NCHW without "
                  "cudnn.benchmark, the scripts in channels_last with it; the bf16 loop in "
                  "channels_last. Peak memory, as benchmark.py measured it: " + ("; ".join(sorted(
                      {r["memory_kind"] for r in rows
                       if r["peak_memory_gb"] and r["memory_kind"]})) or "-")
                  + " (nvidia-smi: the largest rise of memory.used, CUDA context included).", ""]
        for run in report["benchmark"]:
            state = "ran" if run["returncode"] == 0 else f"**exit status {run['returncode']}**"
            lines.append(f"- `{run['name']}` ({state}, {run['folder']}/): `{run['command']}`")
        lines.append("")
        bench_checks = [{**c, "check": f"{run['name']}: {c['check']}"}
                        for run in report["benchmark"] for c in run["checks"]]
        if bench_checks:
            lines += ["Benchmark checks:", "", tools.check_table(bench_checks), ""]
    if report["resnet50"]:
        lines += [f"## ResNet-50 ({LARGE_MODEL}), {LARGE_SIZE} px, synthetic data: "
                  f"the plain loop", "",
                  tools.markdown_table(["precision", "batch", "img/s", "ms per image",
                                        "50,000-image epoch", "peak memory (GB, allocated)"], [
                      [r["precision"], str(r["batch"]),
                       *([f"not run: {r['error']}", "", "", ""] if r["error"] else
                         [f"{r['img_per_s']:,.0f}", f"{1000 / r['img_per_s']:.2f}",
                          f"{r['epoch_50k_s']:.1f} s",
                          _cell(r["peak_memory_gb"], ".2f")])] for r in report["resnet50"]]), "",
                  "The training script's row at this size, train_single.py --image-size 224 "
                  "through --loader workers with its data wait, is the benchmark's workers check "
                  "above (1gpu-b128). The plain loop runs with TF32, cudnn.benchmark and "
                  "channels_last, as the scripts do.", ""]
    lines += [f"Every figure: gpu-check.json. Keep this report as docs/gpu/{report['slug']}.md.",
              ""]
    return "\n".join(lines)


def build_report(machine_info: dict, checks: list[dict], benchmark: list[dict],
                 resnet50: list[dict], started: str, duration_s: float, command: str) -> dict:
    names = [g["name"] for g in machine_info["gpus"]]
    rows = [r for run in benchmark for r in run["rows"]]
    passed = (all(c["status"] in ("passed", "skipped") for c in checks)
              and all(run["returncode"] == 0 and not any(r["error"] for r in run["rows"])
                      for run in benchmark))
    device = names[0] if len(set(names)) == 1 else " + ".join(sorted(set(names))) or "no GPU"
    return {"device": f"{len(names)} x {device}" if len(names) > 1 else device,
            "slug": device_slug(device), "started": started, "duration_s": round(duration_s, 1),
            "command": command, "passed": passed, "machine": machine_info,
            "targets": evaluate_targets(rows, names), "checks": checks,
            "benchmark": benchmark, "resnet50": resnet50}


def write_report(folder: Path, report: dict) -> None:
    write_json(folder / "gpu-check.json", report)
    (folder / "gpu-check.md").write_text(render_markdown(report))


# ------------------------------------------------------------------------------------------- main

def main(args) -> int:
    if not torch.cuda.is_available():
        print(f"error: gpu-check needs a CUDA GPU and torch sees none (torch.cuda.is_available() "
              f"is False; torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): "
              f"run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 1
    # runs use cwd=ROOT
    folder = (Path(args.output_dir) if args.output_dir else new_run_dir("gpu-check")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    started, clock, command = (time.strftime("%Y-%m-%d %H:%M"), time.perf_counter(),
                               shlex.join(sys.argv))
    info = machine()
    print(f"gpu-check: {len(info['gpus'])} GPU(s): {', '.join(g['name'] for g in info['gpus'])}; "
          f"driver {info['driver']}; report in {folder}", flush=True)
    checks = run_tests(folder) if "tests" not in args.skip else []
    benchmark = (run_benchmarks(folder, len(info["gpus"]), args.steps)
                 if "benchmark" not in args.skip else [])
    resnet50 = (large_rows(args.resnet50_batch_size, args.steps)
                if "resnet50" not in args.skip else [])
    report = build_report(info, checks, benchmark, resnet50, started, time.perf_counter() - clock,
                          command)
    write_report(folder, report)
    print("\n" + (folder / "gpu-check.md").read_text())
    missed = [t["target"] for t in report["targets"] if t["met"] is False]
    print(f"gpu-check: {'PASS' if report['passed'] else 'FAIL'}; targets missed: {len(missed)}; "
          f"wrote gpu-check.json and gpu-check.md to {folder}; keep it as "
          f"docs/gpu/{report['slug']}.md", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(parse_args()))
