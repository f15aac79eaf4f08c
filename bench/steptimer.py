"""Run a training script and record when each of its optimizer steps ends: the benchmark's clock.

    python -m bench.steptimer TIMES scripts/train_single.py ARGS...
    accelerate launch ... -m bench.steptimer TIMES scripts/train_ddp.py ARGS...

The scripts log one time per epoch, not per step. A global optimizer hook
(torch.optim.optimizer.register_optimizer_step_post_hook), installed before the script starts, takes
the per-step times without a line of the scripts changing. Each process writes, when it exits, to
TIMES.<rank> (JSON): ``step_end``, the time.perf_counter() at the end of each step, and
``peak_rss_gb``, its peak resident memory (VmHWM), measured by the process itself, so no watcher
takes CPU time from the run. At every step the scripts wait for the previous step's loss (the NaN
check, common/parallel/step_guard.py), so the host stays within about a step of the device and, over
the measured steps, these CPU times follow the device's pace. With fp16, GradScaler skips the
optimizer step when the gradients overflow but updates its scale at every step, so a run that uses a
scaler is timed by its scale updates instead.

``data_wait`` holds each step's wait for its batch, as the scripts' common.observe.utilisation.DataWait measures
it (the host clock on a CPU, CUDA events on a GPU), one value a step: the scripts log only its sum
per epoch (data_wait_frac), warm-up included, and the benchmark leaves the warm-up out, as it does
for step times, because the first batch of a run also waits for the DataLoader workers to start.
"""

import atexit
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from common.observe.utilisation import DataWait


def read(times_file: str, rank: int = 0) -> dict:
    """What process ``rank`` recorded for ``times_file``: step_end, data_wait and peak_rss_gb."""
    return json.loads(Path(f"{times_file}.{rank}").read_text())


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's VmHWM belongs to the process's own memory map;
    ru_maxrss would also count the parent's memory at the fork before exec, which a launcher's
    large parent makes the larger one."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _write(path: str, steps: list[float], scaler_updates: list[float], waits: list[float]) -> None:
    record = {"step_end": scaler_updates or steps, "data_wait": waits, "peak_rss_gb": round(peak_rss_bytes() / 1e9, 3)}
    Path(path).write_text(json.dumps(record))


def record_data_waits() -> list[float]:
    """Each DataWait span in seconds, in order, from DataWait's own clock: on a CPU the host time
    each ``stop`` adds; on a GPU each pair of CUDA events, read where ``seconds`` reads them (once an
    epoch, after waiting for the last one)."""
    waits: list[float] = []
    stop, seconds = DataWait.stop, DataWait.seconds

    def timed_stop(self):
        before = self.total
        stop(self)
        if not self.cuda:
            waits.append(self.total - before)

    def timed_seconds(self):
        if self.spans:
            self.spans[-1][1].synchronize()
            waits.extend(start.elapsed_time(end) / 1000 for start, end in self.spans)
        return seconds(self)

    DataWait.stop, DataWait.seconds = timed_stop, timed_seconds
    return waits


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m bench.steptimer TIMES SCRIPT [ARGS...]")
    times_file, script = sys.argv[1], sys.argv[2]
    steps: list[float] = []
    register_optimizer_step_post_hook(lambda *_: steps.append(time.perf_counter()))
    scaler_updates: list[float] = []
    update = torch.amp.GradScaler.update  # torch.cuda.amp.GradScaler inherits it

    def timed_update(self, *args, **kwargs):
        result = update(self, *args, **kwargs)
        scaler_updates.append(time.perf_counter())
        return result

    torch.amp.GradScaler.update = timed_update
    waits = record_data_waits()
    rank = os.environ.get("RANK", "0")
    atexit.register(_write, f"{times_file}.{rank}", steps, scaler_updates, waits)
    sys.argv = sys.argv[2:]  # the script sees its own command line
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
