"""Run a training script and record when each of its optimizer steps ends: the benchmark's clock.

    python -m bench.steptimer TIMES scripts/train_single.py ARGS...
    accelerate launch ... -m bench.steptimer TIMES scripts/train_ddp.py ARGS...

The scripts log one time per epoch, not per step. A global optimizer hook
(torch.optim.optimizer.register_optimizer_step_post_hook), installed before the script starts, takes
the per-step times without a line of the scripts changing. Each process writes, when it exits, to
TIMES.<rank> (JSON): ``step_end``, the time.perf_counter() at the end of each step, and
``peak_rss_gb``, its peak resident memory (VmHWM), measured by the process itself, so no watcher
takes CPU time from the run. At every step the scripts wait for the previous step's loss (the NaN
check, common/parallel.py), so the host stays within about a step of the device and, over the
measured steps, these CPU times follow the device's pace. With fp16, GradScaler skips the
optimizer step when the gradients overflow but updates its scale at every step, so a run that uses
a scaler is timed by its scale updates instead.
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


def read(times_file: str, rank: int = 0) -> dict:
    """What process ``rank`` recorded for ``times_file``: step_end and peak_rss_gb."""
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


def _write(path: str, steps: list[float], scaler_updates: list[float]) -> None:
    record = {"step_end": scaler_updates or steps, "peak_rss_gb": round(peak_rss_bytes() / 1e9, 3)}
    Path(path).write_text(json.dumps(record))


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
    rank = os.environ.get("RANK", "0")
    atexit.register(_write, f"{times_file}.{rank}", steps, scaler_updates)
    sys.argv = sys.argv[2:]  # the script sees its own command line
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
