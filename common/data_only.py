"""Files from outside read as data only: no checkpoint or dataset a run reads can run code.

A pickle has the functions it names called as it loads (``__reduce__``): one from elsewhere runs
its author's code. ``save_as_data`` keeps an object's state as JSON and safetensors, where
Accelerate's ``register_for_checkpointing`` pickles it and loads it with weights_only=False
(accelerate/checkpointing.py). ``code_in_checkpoint`` finds what would still run code on --resume;
Accelerate reads its other files with weights_only=True loaders, which refuse. ``DataUnpickler``
reads a pickle with only the types it names allowed: CIFAR's batches, and FSDP2's DCP folders
(common.parallel.fsdp.code_in_shards).
"""

import functools
import json
import pickle
import re
from pathlib import Path

import torch
from accelerate.utils import load
from safetensors.torch import load_file, save_file

from common.errors import first_line
from common.files import write_json

RUNS_CODE = "could run code"  # in the words of a checkpoint refused for what it holds


class NotData(pickle.UnpicklingError):
    """A pickle that names a type or function it may not hold."""


class DataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that builds only the ``allowed`` (module, name) pairs and raises NotData
    for any other: every function a pickle can call and every class it can build is looked up
    through find_class, so nothing else can run. ``options`` go to pickle.Unpickler."""

    def __init__(self, stream, allowed: set[tuple[str, str]], **options):
        super().__init__(stream, **options)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise NotData(f"it names {module}.{name}, which is not data")
        return super().find_class(module, name)


def code_in_checkpoint(checkpoint: Path, process_index: int) -> str | None:
    """What in ``checkpoint`` would run code as it loads ("random_states_1.pkl could run code: it
    names posix.system, which is not data"), or a file Accelerate would load without a word when it
    does not load; None: nothing."""
    if old := sorted(checkpoint.glob("custom_checkpoint_*.pkl")):  # an earlier version's
        return f"{old[0].name} {RUNS_CODE}: a pickle that Accelerate loads with weights_only=False"
    rng = checkpoint / f"random_states_{process_index}.pkl"
    try:  # Accelerate loads it in a try whose except only logs: a refusal would go unsaid
        if rng.exists():
            load(rng)  # Accelerate's own loader: weights_only=True, numpy's RNG arrays allowed
    except Exception as error:  # noqa: BLE001 - whatever torch met
        return file_problem(rng.name, error)
    return None


def file_problem(name: str | None, error: BaseException) -> str:
    """``error`` met reading the file ``name`` (None: unknown), in a few words: what it names that
    could run code (NotData's, or torch's weights_only refusal of several lines, which advises
    weights_only=False: that would run it), or that it does not load."""
    named = re.search(r"GLOBAL ([\w.]+)", str(error))
    if named and "Weights only load failed" in str(error):
        error = NotData(f"it names {named[1]}, which is not data")
    if isinstance(error, NotData):
        return f"{name or 'a file'} {RUNS_CODE}: {error}"
    return f"{name + ' ' if name else ''}does not load ({first_line(error)})"


def save_as_data(accelerator, obj, name: str) -> None:
    """Save ``obj.state_dict()`` in every checkpoint as NAME.json, its tensors (at any depth of
    its dicts) in NAME.safetensors; ``accelerator.load_state`` gives them back to
    ``obj.load_state_dict``. state_dict() is called on every process (FSDP2's gathers are
    collectives), the files are written by the main process and read by every process."""
    def save(models, weights, folder):
        tensors = {}
        state = _without_tensors(obj.state_dict(), tensors, "")
        if accelerator.is_main_process:
            write_json(Path(folder) / f"{name}.json", state)
            if tensors:
                save_file(tensors, Path(folder) / f"{name}.safetensors")

    def restore(models, folder):  # not accelerate.utils.load, which code_in_checkpoint uses
        tensors = Path(folder) / f"{name}.safetensors"
        state = json.loads((file := Path(folder) / f"{name}.json").read_text())
        for key, tensor in (load_file(tensors) if tensors.exists() else {}).items():
            *dicts, leaf = key.split("/")  # the dicts on its path are in the JSON
            functools.reduce(dict.__getitem__, dicts, state)[leaf] = tensor
        obj.load_state_dict(state)  # a value it refuses: ``file``'s (the last path of the frame)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(restore)


def _without_tensors(state: dict, tensors: dict, prefix: str) -> dict:
    """``state`` without its tensors, which go into ``tensors`` by their keys' path (a/b)."""
    kept = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors[prefix + key] = value.contiguous()  # safetensors: a channels_last copy too
        else:
            kept[key] = _without_tensors(value, tensors, f"{prefix}{key}/") \
                if isinstance(value, dict) else value
    return kept
