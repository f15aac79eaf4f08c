"""Run a training script and keep what each process's weight average holds at the end: a test tool.

Accelerate saves the average from the main process only, so the other processes' copies are seen
nowhere else. Each time the run applies the average (each epoch's evaluation of it, and before
model.safetensors), each process writes its copy to $EMA_PROBE_DIR/rank<N>.pt: the last write holds
the final average.

    accelerate launch ... tests/probe_ema.py scripts/train_ddp.py ARGS...
"""

import os
import runpy
import sys
from pathlib import Path

import torch

from common.recipe import ema

_apply = ema.WeightAverage.apply


def _apply_and_keep(self):
    folder = Path(os.environ["EMA_PROBE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(dict(zip(self.names, [a.cpu() for a in self.average])),
               folder / f"rank{self.accelerator.process_index}.pt")
    _apply(self)


ema.WeightAverage.apply = _apply_and_keep
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
