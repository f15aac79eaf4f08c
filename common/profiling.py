"""--profile: a torch.profiler trace of chosen optimizer steps into the run folder, and the table of
the operations that cost most per step, printed when the run ends.

    profiler = StepProfiler(accelerator, args.profile, output_dir)  # None: does nothing
    ...  profiler.step()       # after each optimizer step
    profiler.finish()          # the table (main process); the trace files are written by then

``--profile N`` traces N optimizer steps after the first SKIP_STEPS of this launch (the first steps
allocate memory, search cuDNN's algorithms and compile); ``--profile S:N`` after S of them. The
profiler is Accelerate's (``ProfileKwargs(...).build()``: torch.profiler with a schedule of one
warm-up step, then N recorded), so it costs nothing on the steps outside it. Each process writes
RUN/profile/trace_rank<N>.json, a Chrome trace that Perfetto (ui.perfetto.dev) and
chrome://tracing open. The table: each op's calls and self time per step, on the CPU and on the
GPU, the top ROWS by the time of the device that trains.
"""

import re
from pathlib import Path

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
    found = re.fullmatch(r"(?:(\d+):)?(\d+)", spec.strip())
    if not found or int(found.group(2)) < 1:
        raise UserError(f"--profile {spec}: give the number of steps to trace, e.g. 5, or the "
                        f"steps to skip first and the number to trace, e.g. 20:5")
    skip = int(found.group(1)) if found.group(1) is not None else SKIP_STEPS
    return skip, int(found.group(2))


class StepProfiler:
    """The profiler of one launch: ``step()`` after each optimizer step, ``finish()`` at the end."""

    def __init__(self, accelerator, spec: str | None, output_dir: Path):
        self.accelerator, self.steps, self.table = accelerator, profile_steps(spec), None
        self.profiler = None
        if self.steps is None:
            return
        skip, count = self.steps
        self.trace = Path(output_dir) / PROFILE_DIR / f"trace_rank{accelerator.process_index}.json"
        gpu = accelerator.device.type == "cuda"
        self.profiler = ProfileKwargs(
            activities=["cpu", "cuda"] if gpu else ["cpu"], on_trace_ready=self._ready,
            # one warm-up step before the recorded ones: the profiler's own start is left out
            schedule_option={"skip_first": max(skip - 1, 0), "wait": 0, "warmup": min(skip, 1),
                             "active": count, "repeat": 1}).build()
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
        self.table = per_step_table(averages, max(self.recorded, 1),
                                    self.accelerator.device.type == "cuda")

    def finish(self) -> None:
        """Stop profiling; print (main process) what was traced, where, and the table."""
        if self.profiler is None:
            return
        self.profiler.stop()
        skip, count = self.steps
        if self.table is None:
            self.accelerator.print(f"--profile: the run ended before steps {skip + 1}-"
                                   f"{skip + count} of this launch: nothing traced")
            return
        traced = f"steps {skip + 1}-{skip + count}"
        if self.recorded < count:  # the table is per step of those recorded, not of those asked
            last = skip + self.recorded - 1
            traced = (f"the run ended inside the window: steps {skip + 1}-{last} and the run's "
                      f"end ({self.recorded} steps)")
        self.accelerator.print(f"--profile: {traced} of this launch traced "
                               f"in {self.trace.parent} (trace_rank<N>.json: Perfetto, "
                               f"chrome://tracing); per step, the main process:\n{self.table}")


def per_step_table(averages, steps: int, gpu: bool) -> str:
    """The top ROWS operations of torch.profiler's ``averages`` (key_averages) by self time per
    step on the device that trains: calls and self CPU / GPU time (microseconds) per step, and the
    steps' totals."""
    def device_time(event) -> float:  # torch >= 2.4 names it self_device_time_total
        return getattr(event, "self_device_time_total", 0.0) or 0.0

    events = [e for e in averages if not e.key.startswith("ProfilerStep")]
    events.sort(key=device_time if gpu else (lambda e: e.self_cpu_time_total), reverse=True)
    header = f"{'op':<44} {'calls':>7} {'self CPU us':>12}"
    header += f" {'self GPU us':>12}" if gpu else ""
    lines = [header, "-" * len(header)]
    for event in events[:ROWS]:
        line = f"{event.key[:44]:<44} {event.count / steps:>7.1f} " \
               f"{event.self_cpu_time_total / steps:>12.1f}"
        lines.append(line + (f" {device_time(event) / steps:>12.1f}" if gpu else ""))
    cpu = sum(e.self_cpu_time_total for e in events) / steps
    total = f"{'all ops':<44} {sum(e.count for e in events) / steps:>7.1f} {cpu:>12.1f}"
    lines.append(total + (f" {sum(device_time(e) for e in events) / steps:>12.1f}" if gpu else ""))
    return "\n".join(lines)
