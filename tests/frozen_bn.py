"""Run a training script with every BatchNorm layer held in eval mode: a test tool, not a feature.

BatchNorm normalises with the statistics of the images each process sees, so 2-process DDP and one
process with the same global batch compute different things by design (on GPUs, --sync-bn closes
the gap). With BatchNorm frozen and augmentation off (--no-augment), nothing differs but what DDP
itself does: split the batch, average the gradients. That is what the agreement tests compare.

    accelerate launch ... tests/frozen_bn.py scripts/train_ddp.py ARGS...
"""

import runpy
import sys

import torch


def _always_eval(self, mode=True):
    return torch.nn.Module.train(self, False)


torch.nn.modules.batchnorm._BatchNorm.train = _always_eval
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
