"""Run a training script whose rank 1 stops answering after its third optimizer step, as a process
stuck in I/O or a deadlock would: a test tool, not a feature.

    accelerate launch ... tests/stall_rank.py scripts/train_ddp.py ARGS...
"""

import os
import runpy
import sys
import time

import torch

_step = torch.optim.SGD.step
_calls = 0


def _stalling_step(self, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == 3 and os.environ.get("RANK") == "1":
        time.sleep(3600)
    return _step(self, *args, **kwargs)


torch.optim.SGD.step = _stalling_step
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
