"""Run a training script with every BatchNorm layer held in eval mode: a test tool, not a feature.

BatchNorm normalises with the statistics of the images each process sees, so 2-process DDP and one
process with the same global batch compute different things by design (on GPUs, --sync-bn closes
the gap). With BatchNorm frozen and augmentation off (--no-augment), nothing differs but what DDP
itself does: split the batch, average the gradients. That is what the agreement tests compare.

    accelerate launch ... tests/frozen_bn.py scripts/train_ddp.py ARGS...

PROBE_STEP_S=S slows each optimizer step by S seconds, and PROBE_SAVE_S=S each save_state of
process 1, so that a fault lands mid-run or mid-checkpoint (tests/test_cluster_faults.py).
"""

import os
import runpy
import sys
import time

import torch
from accelerate import Accelerator


def _slowed(method, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return method(*args, **kwargs)
    return slow


if step_s := float(os.environ.get("PROBE_STEP_S", "0")):
    torch.optim.SGD.step = _slowed(torch.optim.SGD.step, step_s)
if (save_s := float(os.environ.get("PROBE_SAVE_S", "0"))) and os.environ.get("RANK") == "1":
    Accelerator.save_state = _slowed(Accelerator.save_state, save_s)


def _always_eval(self, mode=True):
    return torch.nn.Module.train(self, False)


torch.nn.modules.batchnorm._BatchNorm.train = _always_eval
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
