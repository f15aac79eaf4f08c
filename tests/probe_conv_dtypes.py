"""Run a training script and record what its convolutions computed: a test tool, not a feature.

    accelerate launch ... tests/probe_conv_dtypes.py scripts/train_amp.py ARGS...

Each process writes to $PROBE_FILE.<rank> as JSON the distinct [phase, output dtype, layout] of every
Conv2d call, phase "train" (gradients on) or "eval", layout "channels_last" or "contiguous" (of the
output; a NHWC convolution answers NHWC), and the number of calls.
"""

import atexit
import json
import os
import runpy
import sys
from collections import Counter

import torch

seen = Counter()


def _record(module, inputs, output):
    if isinstance(module, torch.nn.Conv2d):
        layout = "channels_last" if output.dim() == 4 and output.is_contiguous(
            memory_format=torch.channels_last) and not output.is_contiguous() else "contiguous"
        seen[("train" if torch.is_grad_enabled() else "eval", str(output.dtype).removeprefix("torch."), layout)] += 1


def _write():
    with open(f"{os.environ['PROBE_FILE']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(sorted([*key, count] for key, count in seen.items()), f)


torch.nn.modules.module.register_module_forward_hook(_record)
atexit.register(_write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
