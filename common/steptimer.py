"""Run a training script and record when each of its optimizer steps ends: the benchmark's clock.

    python -m common.steptimer TIMES scripts/train_single.py ARGS...
    accelerate launch ... -m common.steptimer TIMES scripts/train_ddp.py ARGS...

The scripts log one time per epoch, not per step. A global optimizer hook
(torch.optim.optimizer.register_optimizer_step_post_hook), installed before the script starts, takes
the per-step times without a line of the scripts changing. Each process writes, when it exits, to
TIMES.<rank> (JSON): ``step_end``, the time.perf_counter() at the end of each step, and
``peak_rss_gb``, its peak resident memory (ru_maxrss), measured by the process itself, so no watcher
takes CPU time from the run. The scripts wait for the device at every step (the NaN check,
common/guard.py), so on a GPU these CPU times follow the device.
"""

import atexit
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook


def read(times_file: str, rank: int = 0) -> dict:
    """What process ``rank`` recorded for ``times_file``: step_end and peak_rss_gb."""
    return json.loads(Path(f"{times_file}.{rank}").read_text())


def _write(path: str, times: list[float]) -> None:
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    Path(path).write_text(json.dumps({"step_end": times, "peak_rss_gb": round(peak_kib * 1024 / 1e9, 3)}))


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m common.steptimer TIMES SCRIPT [ARGS...]")
    times_file, script = sys.argv[1], sys.argv[2]
    times: list[float] = []
    register_optimizer_step_post_hook(lambda *_: times.append(time.perf_counter()))
    rank = os.environ.get("RANK", "0")
    atexit.register(_write, f"{times_file}.{rank}", times)
    sys.argv = sys.argv[2:]  # the script sees its own command line
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
