"""Count the operators a training step dispatches: a script's against a plain loop's with the same
data work, the surplus named op by op. Deterministic, unlike a timing: the benchmark's `ops` check.

    python -m bench.opcount COUNTS scripts/train_single.py ARGS...   # the script, unchanged
    python -m bench.opcount COUNTS --profiler scripts/train_single.py ARGS...   # GPUs: CUDA calls

A GPU pays for every operator a step dispatches (a kernel launch, a record, a copy) whether or not
the CPU notices: at batch 128 an eager ResNet-18 step on an H200 is bound by the host launching its
kernels, while on 2 CPU cores the same surplus is lost in the compute. So the cost of what the
scripts do around the plain loop's forward, loss, backward and step (the batch's indexing, the
meters, the stop check, Accelerate's wrappers, the progress bar) is counted here, not timed.

A TorchDispatchMode, entered at the end of the first optimizer step (a global post-hook, as
bench.steptimer's), counts each aten operator that reaches the dispatcher below autograd, backward
included; a step is what is dispatched from the end of one optimizer step to the end of the next.
The script writes COUNTS.<rank> (JSON: one {operator: count} per step) when it exits. With
--profiler, torch.profiler records PROFILED_STEPS steps instead, from the end of the first: on a GPU
its CUDA runtime calls (kernel launches, event records, copies, synchronisations; CUDA graphs
replay each as one launch), which a dispatch mode cannot see, as the mean per step. The plain
loop (``plain_loop_counts``) is counted the same way: a shuffled batch indexed from uint8 images on
the device, the scripts' crop, flip and normalisation (BatchTransform), forward, loss, backward,
SGD with the scripts' optimizer, a one-cycle schedule, zero_grad.
"""

import atexit
import collections
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from bench import tools
from common.data.stats import channel_stats
from common.data.synthetic import make_synthetic
from common.data.transform import BatchTransform
from common.recipe.models import build_model
from common.recipe.optim import build_optimizer


PROFILED_STEPS = 4
ROOT = Path(__file__).resolve().parents[1]
# Operators a steady step of train_single (--grad-accum 1, no EMA, MixUp or CutMix) may dispatch
# beyond the plain loop's, measured 8 on a CPU (2026-11-28; 12 before the stop check stopped
# all-reducing a single process's loss): Accelerate's backward divides the loss by
# --grad-accum (a div, and its gradient's), the loop sums the step's loss (detach, div, add) and
# the epoch's (add_), the DataLoader makes its index list a tensor (lift_fresh, against the plain
# loop's slice) and marks each batch for the profiler (two record_function calls).
OPS_CAP = 8


class StepCounts(TorchDispatchMode):
    """The aten operators dispatched, one Counter per optimizer step, from the end of the first."""

    def __init__(self):
        super().__init__()
        self.steps: list[collections.Counter] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.steps[-1][str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def install(self) -> None:
        """Counts from the end of the next optimizer step on, a new Counter at the end of each."""
        def step_ended(*_):
            if not self.steps:
                self.__enter__()  # left on the mode stack until the process ends
            self.steps.append(collections.Counter())
        register_optimizer_step_post_hook(step_ended)


class ProfiledSteps:
    """torch.profiler over PROFILED_STEPS optimizer steps from the end of the first: each event's
    count per step (their mean), in ``steps`` as one Counter once the window has closed."""

    def __init__(self):
        self.steps: list[collections.Counter] = []
        self.ended, self.profile = 0, None

    def install(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)

        def step_ended(*_):
            self.ended += 1
            if self.ended == 1:
                self.profile = torch.profiler.profile(activities=activities)
                self.profile.__enter__()
            elif self.ended == 1 + PROFILED_STEPS:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.profile.__exit__(None, None, None)
                totals = {e.key: e.count for e in self.profile.key_averages()}
                self.steps = [collections.Counter({k: v / PROFILED_STEPS for k, v in totals.items()}),
                              collections.Counter()]  # steady() drops the last, as a step cut short
        register_optimizer_step_post_hook(step_ended)


def runtime_calls(counts: collections.Counter) -> dict[str, float]:
    """The CUDA runtime and driver calls of a profiled step (cudaLaunchKernel, cudaMemcpyAsync,
    cudaEventRecord, cudaStreamSynchronize, cudaGraphLaunch, cuLaunchKernel ...), per step."""
    return {name: count for name, count in sorted(counts.items())
            if re.match(r"cu(da)?[A-Z]", name)}


def steady(steps: list[collections.Counter]) -> collections.Counter:
    """A typical step: of the whole steps counted (the last Counter is a step cut short by the run's
    end), the one with the median number of operators, so that a step that also logs, saves or
    evaluates does not count."""
    whole = steps[:-1]
    if not whole:
        raise RuntimeError("no whole step was counted: run at least 3 optimizer steps")
    totals = [sum(step.values()) for step in whole]
    return whole[totals.index(statistics.median_low(totals))]


def surplus(script: collections.Counter, plain: collections.Counter) -> dict[str, int]:
    """Operator by operator, what the script dispatches beyond the plain loop (negative: fewer),
    largest first."""
    names = set(script) | set(plain)
    difference = {name: script[name] - plain[name] for name in names if script[name] != plain[name]}
    return dict(sorted(difference.items(), key=lambda item: (-abs(item[1]), item[0])))


def plain_loop_counts(model_name: str, batch_size: int, device: torch.device,
                      profiler: bool = False, channels_last: bool = True) -> collections.Counter:
    """The steady step of the plain loop with the scripts' data work on ``device``, counted as a
    script's steps are: the operators dispatched, or with ``profiler`` the profiled events."""
    steps = 1 + PROFILED_STEPS + 1
    data = make_synthetic(batch_size * (steps + 1), 10)
    images, labels = data.train_images.to(device), data.train_labels.to(device)
    transform = BatchTransform(*channel_stats(data.train_images), channels_last=channels_last)
    model = build_model(model_name, num_classes=len(data.classes)).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, lr=0.1, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=steps)
    criterion, order = torch.nn.CrossEntropyLoss(), torch.randperm(len(labels), device=device)

    def step(number: int) -> None:
        index = order[number * batch_size:(number + 1) * batch_size]
        loss = criterion(model(transform.train(images[index], (0, number))), labels[index])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)  # allocates, and cuDNN chooses its kernels: not a steady step
    if profiler:
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as profile:
            for number in range(1, 1 + PROFILED_STEPS):
                step(number)
            if device.type == "cuda":
                torch.cuda.synchronize()
        return collections.Counter({e.key: e.count / PROFILED_STEPS
                                    for e in profile.key_averages()})
    counts = StepCounts()
    with counts:
        for number in range(1, steps):
            counts.steps.append(collections.Counter())
            step(number)
    return steady(counts.steps + [collections.Counter()])


def script_counts(model: str, batch: int, workdir: Path, profiler: bool = False,
                  compile: str = "none", timeout: float = 1800) -> collections.Counter:
    """train_single.py's steady step at ``batch`` on --dataset synthetic, counted in a launch of its
    own (``profiler``: profiled), eager unless ``compile`` (e.g. auto: the defaults)."""
    steps = 1 + PROFILED_STEPS + 1
    output_dir = workdir / f"opcount-{compile}-{'profiler' if profiler else 'ops'}-b{batch}"
    counts_file = str(workdir / f"{output_dir.name}-counts")
    command = [sys.executable, "-m", "bench.opcount", counts_file, *(["--profiler"] * profiler),
               "scripts/train_single.py", "--model", model, "--batch-size", str(batch),
               "--dataset", "synthetic", "--synthetic-train-size", str((steps + 1) * batch),
               "--synthetic-test-size", str(max(batch, 10)), "--epochs", "1", "--max-steps", str(steps),
               "--report-to", "none", "--compile", compile, "--output-dir", str(output_dir)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        last = tools.last_line(done.stdout, done.stderr)
        raise RuntimeError(f"exit status {done.returncode}: {last}")
    return steady(read(counts_file))


def named(difference: dict[str, float], limit: int = 12) -> str:
    """``surplus``'s result as "div +3, add +1, ..." (aten. dropped)."""
    return ", ".join(f"{name.removeprefix('aten.')} {count:+g}"
                     for name, count in list(difference.items())[:limit]) or "none"


def ops_check(model: str, batch: int, device: torch.device, workdir: Path,
              timeout: float = 1800) -> list[dict]:
    """The `ops` check: train_single's steady step against the plain loop's, operators dispatched
    (capped at OPS_CAP more) and, on a GPU, CUDA runtime calls per step, eager and with the
    defaults (--compile auto: CUDA graphs), reported."""
    try:
        script = script_counts(model, batch, workdir, timeout=timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return [{"check": "ops: train_single's operators per step - the plain loop's", "value": None,
                 "passed": False, "measured": f"failed: {str(error)[:200]}",
                 "target": f"<= +{OPS_CAP}", "note": ""}]
    plain = plain_loop_counts(model, batch, device)
    extra = sum(script.values()) - sum(plain.values())
    results = [{"check": "ops: train_single's operators per step - the plain loop's",
                "value": extra, "passed": extra <= OPS_CAP,
                "measured": f"{extra:+d} ({sum(script.values())} vs {sum(plain.values())}; "
                            f"{named(surplus(script, plain))}; {model}, batch {batch}, eager)",
                "target": f"<= +{OPS_CAP}",
                "note": "aten operators dispatched below autograd in a steady step (bench/opcount"
                        ".py), the plain loop with the same data work: a shuffled batch indexed on "
                        "the device, the scripts' crop, flip and normalisation",
                "surplus": surplus(script, plain), "script_ops": sum(script.values()),
                "plain_ops": sum(plain.values())}]
    if device.type == "cuda":
        plain_calls = runtime_calls(plain_loop_counts(model, batch, device, profiler=True))
        for compile in ("none", "auto"):
            calls = runtime_calls(script_counts(model, batch, workdir, True, compile, timeout))
            total, base = sum(calls.values()), sum(plain_calls.values())
            results.append({
                "check": f"cuda calls: train_single --compile {compile} per step - the plain "
                         f"loop's (eager)", "value": total - base, "passed": None,
                "measured": f"{total - base:+.0f} ({total:.0f} vs {base:.0f}; "
                            f"{named(surplus(calls, plain_calls))})", "target": "reported",
                "note": "CUDA runtime and driver calls per step, torch.profiler over "
                        f"{PROFILED_STEPS} steps", "calls": calls, "plain_calls": plain_calls})
    return results


def read(counts_file: str, rank: int = 0) -> list[collections.Counter]:
    """The per-step counts process ``rank`` of a script run wrote."""
    steps = json.loads(Path(f"{counts_file}.{rank}").read_text())["steps"]
    return [collections.Counter(step) for step in steps]


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m bench.opcount COUNTS [--profiler] SCRIPT [ARGS...]")
    counts_file, profiler = sys.argv[1], sys.argv[2] == "--profiler"
    counts = ProfiledSteps() if profiler else StepCounts()
    counts.install()
    path = f"{counts_file}.{os.environ.get('RANK', '0')}"
    atexit.register(lambda: Path(path).write_text(json.dumps({"steps": counts.steps})))
    sys.argv = sys.argv[2 + profiler:]  # the script sees its own command line
    script = sys.argv[0]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
