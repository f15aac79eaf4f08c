"""Run a training script whose stop takes PROBE_SAVE_S seconds (8 by default) longer to save its
checkpoint, as a large model's does (ResNet-50: 8 s a step on 2 CPU cores): the save that follows a
stop signal sleeps first. A test tool, not a feature.

    python tests/probe_slow_save.py scripts/train_ddp.py ARGS...
"""

import os
import runpy
import sys
import time

import common.run.checkpoints
from common.failures import STOPPING

_save = common.run.checkpoints.save_checkpoint


def _slow_after_a_stop_signal(*args, **kwargs):
    if STOPPING.is_set():
        time.sleep(float(os.environ.get("PROBE_SAVE_S", "8")))
    return _save(*args, **kwargs)


common.run.checkpoints.save_checkpoint = _slow_after_a_stop_signal
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
