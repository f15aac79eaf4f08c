"""Run a training script and keep the model as fine_tune leaves it (step 0) and the optimizer's
parameter groups as built: a test tool, not a feature.

    python tests/probe_fine_tune.py scripts/train_single.py ARGS...

Writes $PROBE_FILE.pt: {"state": the model's state dict right after common.data.pretrained.fine_tune,
"groups": [{"names": [...], "lr", "lr_scale", "weight_decay"}], "optimizer": its class name}, from
the main process.
"""

import os
import runpy
import sys

import torch

from common.data import pretrained
from common.recipe import optim

_fine_tune, _build_optimizer = pretrained.fine_tune, optim.build_optimizer
record = {}


def _kept_fine_tune(model, *args, **kwargs):
    done = _fine_tune(model, *args, **kwargs)
    record["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return done


def _kept_optimizer(model, *args, **kwargs):
    optimizer = _build_optimizer(model, *args, **kwargs)
    names = {id(p): n for n, p in model.named_parameters()}
    record["groups"] = [{"names": [names[id(p)] for p in group["params"]], "lr": group["lr"],
                         "lr_scale": group["lr_scale"], "weight_decay": group["weight_decay"]}
                        for group in optimizer.param_groups]
    record["optimizer"] = type(optimizer).__name__
    if os.environ.get("RANK", "0") == "0":
        torch.save(record, f"{os.environ['PROBE_FILE']}.pt")
    return optimizer


pretrained.fine_tune = _kept_fine_tune
optim.build_optimizer = _kept_optimizer
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
