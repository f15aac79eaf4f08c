"""Run scripts/train_dp.py on a CPU with DataParallel's split into 2 replicas: a test tool, not a feature.

On a CPU torch.nn.DataParallel has no devices and calls its module on the whole batch, so the code
that combines the replicas' results never sees more than one. Here it is replaced by what it does on
2 GPUs, on the CPU (torch/nn/parallel/data_parallel.py): scatter the batch along dim 0 in
torch.chunk's slices, run one replica per slice, gather the results along dim 0. Replicas share the
parameters (their gradients add up in the model, as reduce_add sums them); only the first updates
the BatchNorm buffers, the others run on copies that are dropped after forward (replicate).

    python tests/probe_dp_replicas.py scripts/train_dp.py ARGS...

Each step's gathered result (its shape) is written to $PROBE_FILE as JSON: a loss per replica with
--loss-in-replicas, every image's logits without.
"""

import atexit
import json
import os
import runpy
import sys

import torch
from torch.func import functional_call

import common.parallel.data_parallel

REPLICAS = 2
gathered = []


class TwoReplicas(torch.nn.Module):
    """torch.nn.DataParallel(module, device_ids) for 2 devices, computed on the CPU."""

    def __init__(self, module, device_ids=None):
        super().__init__()
        self.module, self.device_ids = module, device_ids

    def forward(self, *inputs):
        slices = zip(*(torch.chunk(x, REPLICAS) for x in inputs), strict=True)
        outputs = []
        for index, chunk in enumerate(slices):
            if index == 0:
                outputs.append(self.module(*chunk))
            else:
                copies = {name: b.clone() for name, b in self.module.named_buffers()}
                outputs.append(functional_call(self.module, {**dict(self.module.named_parameters()), **copies},
                                               chunk))
        result = torch.cat(outputs)
        if torch.is_grad_enabled():  # a training step, not evaluate()'s no_grad
            gathered.append(list(result.shape))
        return result


def _write():
    with open(os.environ["PROBE_FILE"], "w") as f:
        json.dump(gathered, f)


def two_devices(device, batch_size, grad_accum):
    common.parallel.data_parallel.check_batch_split(batch_size, REPLICAS, "visible GPUs", grad_accum)
    return [torch.device("cuda", i) for i in range(REPLICAS)]


common.parallel.data_parallel.checked_gpus = two_devices
common.parallel.data_parallel.memory_report = lambda devices: {}  # no GPU to read
torch.nn.DataParallel = TwoReplicas
atexit.register(_write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
