"""--profile: a torch.profiler trace of chosen optimizer steps into the run folder, and the table of
the operations that cost most per step, printed when the run ends.

    profiler = StepProfiler(accelerator, args.profile, output_dir)  # None: does nothing
    ...  profiler.step()       # after each optimizer step
    profiler.finish()          # the table (main process); the trace files are written by then

``--profile N`` traces N optimizer steps after the first SKIP_STEPS of this launch (which allocate
memory, search cuDNN's algorithms and compile); ``--profile S:N`` after S. The profiler is
Accelerate's (``ProfileKwargs(...).build()``: torch.profiler scheduled for one warm-up step, then N
recorded), free on the steps outside it. Each process writes RUN/profile/trace_rank<N>.json, a
Chrome trace for Perfetto (ui.perfetto.dev) or chrome://tracing. Two tables: each op's calls and
self CPU and GPU time per step, the top ROWS by the training device's time; and the same time by
what the loop called to run it (the forward, the backward, the optimizer, the augmentation, the stop
check, the loader ...), from each op's Python stack: the per-step work outside the model, counted.
"""

import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from accelerate.utils import ProfileKwargs

from common.errors import UserError

PROFILE_DIR = "profile"  # under --output-dir
SKIP_STEPS = 5
ROWS = 15


def profile_steps(spec: str | None) -> tuple[int, int] | None:
    """(steps skipped, steps traced) of a --profile value, "N" or "S:N"; None for none. A value of
    another form is a UserError."""
    if spec is None:
        return None
    if not (found := re.fullmatch(r"(?:(\d+):)?(\d+)", spec.strip())) or int(found.group(2)) < 1:
        raise UserError(f"--profile {spec}: give the number of steps to trace, e.g. 5, or the "
                        f"steps to skip first and the number to trace, e.g. 20:5")
    return int(found.group(1) or SKIP_STEPS), int(found.group(2))  # no S: SKIP_STEPS ("0" is an S)


class StepProfiler:
    """The profiler of one launch: ``step()`` after each optimizer step, ``finish()`` at the end."""

    def __init__(self, accelerator, spec: str | None, output_dir: Path):
        self.accelerator, self.steps, self.table = accelerator, profile_steps(spec), None
        self.profiler = None
        if self.steps is None:
            return
        skip, count = self.steps
        self.trace = Path(output_dir) / PROFILE_DIR / f"trace_rank{accelerator.process_index}.json"
        self.gpu = accelerator.device.type == "cuda"
        self.profiler = ProfileKwargs(
            activities=["cpu", "cuda"] if self.gpu else ["cpu"], on_trace_ready=self._ready,
            # one warm-up step before the recorded ones: the profiler's own start is left out
            schedule_option={"skip_first": max(skip - 1, 0), "wait": 0, "warmup": min(skip, 1),
                             "active": count, "repeat": 1}, with_stack=True).build()
        # Each op's Python callers, for the table by caller: torch keeps them only with a verbose
        # config, which ProfileKwargs does not pass on (read when the profiler starts).
        self.profiler.experimental_config = torch.profiler._ExperimentalConfig(verbose=True)
        self.script = Path(sys.argv[0]).name  # the file of the training loop
        self.profiler.start()

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def _ready(self, profiler) -> None:
        """The recorded steps are over: the trace written, the table made."""
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.trace))
        averages = profiler.key_averages()
        # A run that ends inside the window records fewer steps (the last one with the run's end)
        self.recorded = sum(e.count for e in averages if e.key.startswith("ProfilerStep"))
        steps = max(self.recorded, 1)
        self.table = per_step_table(averages, steps, self.gpu)
        self.callers = per_caller_table(profiler.events(), steps, self.gpu, self.script)

    def finish(self) -> None:
        """Stop profiling; print (main process) what was traced, where, and the table."""
        if self.profiler is None:
            return
        self.profiler.stop()
        skip, count = self.steps
        traced = f"steps {skip + 1}-{skip + count}"
        if self.table is None:
            self.accelerator.print(f"--profile: the run ended before {traced} of this launch: "
                                   f"nothing traced")
            return
        if self.recorded < count:  # the table is per step of those recorded, not of those asked
            traced = (f"the run ended inside the window: steps {skip + 1}-"
                      f"{skip + self.recorded - 1} and the run's end ({self.recorded} steps)")
        self.accelerator.print(f"--profile: {traced} of this launch traced "
                               f"in {self.trace.parent} (trace_rank<N>.json: Perfetto, "
                               f"chrome://tracing); per step, the main process:\n{self.table}")
        if self.callers:
            self.accelerator.print(f"--profile: per step, by what {self.script}'s loop called "
                                   f"(the model, and all the rest):\n{self.callers}")


def per_step_table(averages, steps: int, gpu: bool) -> str:
    """The top ROWS ops of torch.profiler's ``averages`` (key_averages) by self time per step on the
    training device: calls and self CPU / GPU time (us) per step, and the steps' totals."""
    rows = [(e.key, e.count, e.self_cpu_time_total, e.self_device_time_total) for e in averages
            if not e.key.startswith("ProfilerStep")]
    total = ("all ops", *(sum(row[i] for row in rows) for i in (1, 2, 3)))
    return _table("op", 44, "calls", rows, steps, gpu, last=total)


def per_caller_table(events, steps: int, gpu: bool, script: str) -> str | None:
    """torch.profiler's ops (``events``) grouped by what the training loop in ``script`` called to
    run them (``_caller``: the model's forward, the backward ...): ops called per step, self CPU and
    self GPU time (microseconds) per step, most costly first. None without stacks.

    Not torch's ``key_averages(group_by_stack_n=N)``: it keys each op by its N innermost frames
    (torch/nn/modules/linear.py, torch/_ops.py: every layer of the model alike), not by what the
    loop called, and it needs the same verbose config (checked, torch 2.14: without it every op's
    stack is empty, with_stack=True or not)."""
    rows = defaultdict(lambda: [0, 0.0, 0.0])
    for event in events:
        if not event.name.startswith(("aten::", "cuda", "autograd::engine")) or \
                not str(event.device_type).endswith("CPU"):
            continue  # the step markers, the Python calls, the GPU's side of each kernel
        row = rows[_caller(event, script)]
        row[0] += event.name.startswith("aten::") and not (
            event.cpu_parent and event.cpu_parent.name.startswith("aten::"))  # an op, not a part
        row[1] += event.self_cpu_time_total
        row[2] += event.self_device_time_total
    if set(rows) <= {None}:
        return None
    named = [(caller or "no Python caller", *row) for caller, row in rows.items()]
    return _table("called from the loop", 56, "ops", named, steps, gpu)


def _table(first: str, width: int, count: str, rows, steps: int, gpu: bool, last=None) -> str:
    """``rows`` of (name, count, self CPU us, self GPU us) over ``steps`` as a table, per step: the
    top ROWS by the training device's time, then ``last``; the GPU column only if ``gpu``."""
    header = f"{first:<{width}} {count:>7} {'self CPU us':>12}"
    header += f" {'self GPU us':>12}" if gpu else ""
    lines = [header, "-" * len(header)]
    top = sorted(rows, key=lambda row: row[3 if gpu else 2], reverse=True)[:ROWS]
    for name, calls, cpu, device in [*top, last] if last else top:
        line = f"{name[:width]:<{width}} {calls / steps:>7.1f} {cpu / steps:>12.1f}"
        lines.append(line + (f" {device / steps:>12.1f}" if gpu else ""))
    return "\n".join(lines)


# Frames that only pass a call on: the frame inside them says what ran.
_WRAPPERS = ("torch/nn/modules/module.py", "tqdm/std.py", "contextlib.py")


def _caller(event, script: str) -> str | None:
    """What the loop called to run ``event``, from its Python stack (innermost frame first): the
    frame below the loop's, through wrappers (a module's __call__, tqdm); the backward for an op
    that autograd's engine ran (its stack is the forward's). Paths from common/ on for ours
    (common/recipe/models.py), else cut to their last two parts (accelerate/optimizer.py)."""
    parent, stack = event, None
    while parent is not None:
        if parent.name.startswith("autograd::engine"):
            return "the backward (autograd's engine)"
        stack = stack or parent.stack  # a kernel launch's is its op's
        parent = parent.cpu_parent
    frames = [frame for frame in stack or () if ".py(" in frame]
    loop = next((i for i, frame in enumerate(frames) if f"{script}(" in frame), None)
    if not loop:  # None: not called from the loop; 0: the loop's own lines
        return None if loop is None else f"{script}: its own lines"
    inner = frames[:loop]
    called = next((f for f in reversed(inner) if not any(w in f for w in _WRAPPERS)), inner[-1])
    path, _, where = called.rpartition(".py(")
    parts = Path(path).parts
    ours = [i for i, name in enumerate(parts[:-1]) if name == "common"]
    first = ours[-1] if ours else len(parts) - 2
    return f"{'/'.join(parts[first:])}.py: {where.split(': ', 1)[-1]}"
