"""Run train_fsdp.py sharded on the CPU, and record what each process holds: a test tool, not a
feature.

Accelerate enables its FSDP plugin on GPUs only: with ``Accelerator(cpu=True, fsdp_plugin=...)``
it sets MULTI_CPU and wraps the model in DDP (accelerate/state.py), and train_fsdp.py refuses to
run. torch's fully_shard itself works on gloo, so here, in the test's processes only, the state
Accelerate would have set on GPUs is set after the script's Accelerator is made: the distributed
type FSDP in both shared states (setting it on the accelerator alone reverts) and the script's own
plugin. Everything after that (prepare, the steps, save_state, load_state, get_state_dict) is
Accelerate's and torch's FSDP2 code, unchanged.

    accelerate launch --config_file accelerate_configs/4gpu.yaml --num_processes 2 \
        tests/probe_fsdp.py scripts/train_fsdp.py ARGS...

With $PROBE_FILE set, each process writes $PROBE_FILE.<rank> (JSON) when the script ends: the bytes of the
parameters and of the optimizer's state it holds (a DTensor's local shard; a plain tensor whole),
the bytes of the full parameters, the classes that are FSDP units, the sum of its floating-point
buffers, and the bytes of the weight average (--ema-decay) it holds for the parameters. Without a
plugin (train_ddp.py) it only records.
"""

import gc
import json
import os
import runpy
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common.recipe import ema

_init, _prepare = Accelerator.__init__, Accelerator.prepare
_average = ema.WeightAverage.__init__
prepared = {}


def _sharded_on_cpu(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    plugin = kwargs.get("fsdp_plugin")
    if plugin is not None:
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        self.state.fsdp_plugin = plugin


def _recorded_prepare(self, *args, **kwargs):
    result = _prepare(self, *args, **kwargs)
    for obj in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(obj, torch.nn.Module):
            prepared["model"] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            prepared["optimizer"] = obj
    return result


def _recorded_average(self, *args, **kwargs):
    _average(self, *args, **kwargs)
    prepared["ema"] = self


def held(tensor) -> int:
    """Bytes this process holds of ``tensor``: its local shard if it is a DTensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _write():
    if "PROBE_FILE" not in os.environ or "model" not in prepared:
        return
    model, optimizer = prepared["model"], prepared["optimizer"]
    params = list(model.parameters())
    states = [t for state in optimizer.state.values() for t in state.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    record = {
        "param_bytes": sum(held(p) for p in params),
        "param_full_bytes": sum(p.numel() * p.element_size() for p in params),
        "optimizer_bytes": sum(held(t) for t in states),
        "optimizer_tensors": len(states),
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "params": len(params),
        "units": sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)),
        "buffer_sum": sum(b.double().sum().item() for b in model.buffers() if b.is_floating_point()),
    }
    if prepared.get("ema"):
        average = prepared["ema"]
        record["ema_param_bytes"] = sum(held(a) for a, is_buffer in zip(average.average, average.buffers)
                                        if not is_buffer)
    with open(f"{os.environ['PROBE_FILE']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(record, f)


def _let_go():
    """The sharded model and optimizer dropped and the process group ended while the interpreter
    still runs: left to its shutdown, a gloo FSDP2 process now and then aborted there ("terminate
    called without an active exception") after its run had finished."""
    prepared.clear()
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


Accelerator.__init__ = _sharded_on_cpu
Accelerator.prepare = _recorded_prepare
ema.WeightAverage.__init__ = _recorded_average
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    _write()
    _let_go()
