"""Run a script and record the images its model evaluated: a test tool, not a feature.

    python tests/probe_heldout.py scripts/evaluate.py ARGS...

Every batch that a model built by common.recipe.models.build_model gets in eval mode is written, as it
reached the model (normalised floats), to $PROBE_FILE as a list of tensors (torch.save). The test
turns them back into uint8 images with the run's normalisation and finds the files they came from:
which images a run held out, seen where they are used, whatever the loader.
"""

import atexit
import os
import runpy
import sys

import torch

import common.recipe.models

batches = []
_build_model = common.recipe.models.build_model


def _record(module, inputs):
    if not module.training:
        batches.append(inputs[0].detach().float().cpu().contiguous())


def build_model(*args, **kwargs):
    model = _build_model(*args, **kwargs)
    model.register_forward_pre_hook(_record)
    return model


def _write():
    torch.save(batches, os.environ["PROBE_FILE"])


common.recipe.models.build_model = build_model  # before the script imports it by name
atexit.register(_write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
