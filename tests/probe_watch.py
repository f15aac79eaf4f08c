"""Two processes meet (gloo) and watch for failures as the training scripts do; one of them then
fails alone (a bug: an exception) while the other waits outside any collective, as a process waits
in an NCCL collective that nothing fails: only the failure watch can end it.

PROBE_FAILS: the process that fails (1 by default; "none": none fails, both wait PROBE_WAIT_S
and exit 0). PROBE_GO: a file the failing process waits for (the test sets up its fault first).
PROBE_TRACK: trackers the main process starts (Accelerate's names), in PROBE_DIR. Each process
prints "ready" once it watches."""

import os
import sys
import time
from pathlib import Path

from accelerate import Accelerator

from common.failures import watch_failures

tracking = [name for name in os.environ.get("PROBE_TRACK", "").split(",") if name]
accelerator = Accelerator(cpu=True, log_with=tracking or None, project_dir=os.environ.get("PROBE_DIR"))
if tracking:
    accelerator.init_trackers("probe")
watch_failures(accelerator)
accelerator.wait_for_everyone()
print("ready", flush=True)
fails, go = os.environ.get("PROBE_FAILS", "1"), os.environ.get("PROBE_GO")
if fails == "none":
    time.sleep(float(os.environ.get("PROBE_WAIT_S", "8")))
    sys.exit(0)
if accelerator.process_index == int(fails):
    while go and not Path(go).exists():
        time.sleep(0.05)
    time.sleep(0.5)
    raise RuntimeError(f"a bug in process {fails}")
time.sleep(60)
print(f"process {accelerator.process_index} was not ended", flush=True)
sys.exit(0)
