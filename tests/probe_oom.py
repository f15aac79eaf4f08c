"""Run a training script whose process PROBE_OOM_RANK (1 by default) runs out of memory at its third
optimizer step: the step asks the allocator for 4 EiB, which it refuses as it refuses a request the
machine cannot meet (RuntimeError: DefaultCPUAllocator: can't allocate memory; on a GPU
torch.OutOfMemoryError). A test tool, not a feature.

    python tests/probe_oom.py scripts/train_ddp.py ARGS...
"""

import os
import runpy
import sys

import torch

_step = torch.optim.SGD.step
_calls = 0


def _step_out_of_memory(self, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == 3 and os.environ.get("RANK", "0") == os.environ.get("PROBE_OOM_RANK", "1"):
        torch.empty(1 << 62, dtype=torch.uint8)
    return _step(self, *args, **kwargs)


torch.optim.SGD.step = _step_out_of_memory
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
