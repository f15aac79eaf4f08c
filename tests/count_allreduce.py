"""Run a training script and record, in order, its backward passes, the gradient buckets DDP
all-reduces during each of them, the collectives it calls from Python and its optimizer steps: a test
tool, not a feature.

    accelerate launch ... tests/count_allreduce.py [tests/frozen_bn.py] scripts/train_ddp.py ARGS...

Each process writes its events to $COUNT_FILE.<rank> as JSON, a list of ["backward", buckets],
["collective", name] and ["step"] in the order they happened.
"""

import atexit
import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

events = []
_buckets, _in_hook = 0, False


def _counting_hook(process_group, bucket):
    """DDP's own all-reduce of one gradient bucket, counted."""
    global _buckets, _in_hook
    _buckets, _in_hook = _buckets + 1, True
    try:
        return default_hooks.allreduce_hook(process_group, bucket)
    finally:
        _in_hook = False


_ddp_init = torch.nn.parallel.DistributedDataParallel.__init__


def _init(self, *args, **kwargs):
    _ddp_init(self, *args, **kwargs)
    self.register_comm_hook(None, _counting_hook)


_backward = torch.Tensor.backward


def _counted_backward(self, *args, **kwargs):
    global _buckets
    _buckets = 0
    _backward(self, *args, **kwargs)
    events.append(["backward", _buckets])


def _counted(name):
    collective = getattr(dist, name)

    def call(*args, **kwargs):
        if not _in_hook:  # the hook's own all-reduce is counted as a bucket
            events.append(["collective", name])
        return collective(*args, **kwargs)
    return call


_sgd_step = torch.optim.SGD.step


def _step(self, *args, **kwargs):
    events.append(["step"])
    return _sgd_step(self, *args, **kwargs)


def _write():
    with open(f"{os.environ['COUNT_FILE']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(events, f)


torch.nn.parallel.DistributedDataParallel.__init__ = _init
torch.Tensor.backward = _counted_backward
torch.optim.SGD.step = _step
for _name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor"):
    setattr(dist, _name, _counted(_name))
atexit.register(_write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
