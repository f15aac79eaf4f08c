"""Run a training script whose process PROBE_KILL_RANK (1 by default) is killed (SIGKILL, as the
out-of-memory killer kills) as it starts to load its data: after the process group is made, in the
middle of start-up. A test tool, not a feature.

    torchrun ... tests/probe_startup.py scripts/train_ddp.py ARGS...
"""

import os
import runpy
import signal
import sys

import common.data.inputs

_load_data = common.data.inputs.load_data


def _killed_first(*args, **kwargs):
    if os.environ.get("RANK") == os.environ.get("PROBE_KILL_RANK", "1"):
        os.kill(os.getpid(), signal.SIGKILL)
    return _load_data(*args, **kwargs)


common.data.inputs.load_data = _killed_first
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
