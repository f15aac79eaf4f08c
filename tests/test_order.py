"""The order of the training samples, a function of (seed, epoch), on both loaders and on 1 and 2
processes, as every training script says at `train_loader.set_epoch(epoch)`.

The training loaders are built as the scripts build them: common.data.inputs.load_inputs on a small
synthetic set (--loader device, --loader workers), then accelerator.prepare under the script's own
DataLoaderConfiguration (read from the script), once for a one-process job and once for each
process of a two-process job (prepare with that job's process count and index: the slice of every
batch its BatchSamplerShard gives the process). Each sample's label is replaced by its index, so a
batch names its samples. Every loader is made afresh, as a new or a resumed run makes it. Then:
two epochs see different orders; the same seed and epoch give the same order, another seed another;
a resumed epoch (accelerator.skip_first_batches, as the scripts resume) continues the order it was
in; a two-process job trains each global batch of the one-process order, split in two. And every
training script calls `train_loader.set_epoch(epoch)` with its epoch loop's variable before it
iterates that loader: `set_epoch(0)` in a script fails here.

In-process, no training: a few seconds.
"""

import ast
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from helpers import ROOT

from common.cli import build_parser
from common.data.flags import data_options
from common.data.inputs import load_inputs

TRAINING = ["train_single", "train_dp", "train_ddp", "train_amp", "train_fsdp"]
IMAGES, BATCH = 48, 8  # 6 batches an epoch; 4 images a process on 2 processes
SCRIPT = {1: "train_single", 2: "train_ddp"}  # whose DataLoaderConfiguration each job takes


def dataloader_config(script: str, seed: int) -> DataLoaderConfiguration:
    """The DataLoaderConfiguration that ``script`` gives its Accelerator, for --seed ``seed``."""
    tree = ast.parse((ROOT / "scripts" / f"{script}.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "DataLoaderConfiguration"]
    assert len(calls) == 1, f"scripts/{script}.py: {len(calls)} DataLoaderConfiguration(...) calls, not 1"
    return eval(compile(ast.Expression(calls[0]), script, "eval"),
                {"DataLoaderConfiguration": DataLoaderConfiguration, "args": SimpleNamespace(seed=seed)})


def epoch_order(loader: str, processes: int, process: int, seed: int, epoch: int, cache,
                skip: int = 0) -> list[int]:
    """The samples, in order, that process ``process`` of a job of ``processes`` trains on in
    ``epoch``, from a loader made afresh; the first ``skip`` batches skipped, as a resume skips
    them."""
    accelerator = Accelerator(cpu=True, dataloader_config=dataloader_config(SCRIPT[processes], seed))
    args = build_parser("").parse_args([
        "--dataset", "synthetic", "--synthetic-train-size", str(IMAGES), "--synthetic-test-size", "10",
        "--batch-size", str(BATCH), "--loader", loader, "--seed", str(seed), "--cache-dir", str(cache),
        *(["--workers", "0"] if loader == "workers" else [])])
    train_loader = load_inputs(data_options(args), accelerator).train_loader
    # The labels replaced by each sample's index: a batch's labels name its samples
    data = train_loader.dataset
    (data.split if loader == "workers" else data).labels = torch.arange(IMAGES)
    with mock.patch.object(Accelerator, "num_processes", processes), \
            mock.patch.object(Accelerator, "process_index", process):
        train_loader = accelerator.prepare(train_loader)  # as the script prepares it
        train_loader.set_epoch(epoch)  # as the script sets it
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        return [int(label) for _, labels in batches for label in labels]


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("loader", ["device", "workers"])
def test_the_order_is_a_function_of_seed_and_epoch_and_a_resume_continues_it(tmp_path, loader,
                                                                               processes):
    per_process = BATCH // processes
    for process in range(processes):
        def order(seed=0, epoch=1, skip=0):
            return epoch_order(loader, processes, process, seed, epoch, tmp_path, skip)

        first, second = order(epoch=0), order(epoch=1)
        assert len(first) == len(second) == IMAGES // processes
        assert first != second, f"process {process}: epochs 0 and 1 see the same order: {first}"
        assert order(epoch=1) == second, f"process {process}: seed 0, epoch 1 gave two orders"
        assert order(seed=1) != second, f"process {process}: seeds 0 and 1 give one order"
        for skip in (2, 5):  # a resume in the middle of epoch 1, and before its last batch
            assert order(skip=skip) == second[skip * per_process:], (
                f"process {process}: epoch 1 resumed after {skip} batches does not continue it")
    # Every sample once an epoch; on 2 processes each global batch of the 1-process order, split
    slices = [epoch_order(loader, processes, p, 0, 1, tmp_path) for p in range(processes)]
    alone = epoch_order(loader, 1, 0, 0, 1, tmp_path)
    assert sorted(alone) == list(range(IMAGES))
    job = [sample for at in range(0, IMAGES // processes, per_process)
           for part in slices for sample in part[at:at + per_process]]
    assert job == alone, f"the job's batches {job} are not the one-process batches {alone}"


def test_the_scripts_prepare_their_loaders_alike():
    """The one-process scripts take train_single.py's loader configuration, the multi-process
    ones train_ddp.py's, which the test above uses."""
    for script in TRAINING:
        family = "train_single" if script in ("train_single", "train_dp") else "train_ddp"
        assert dataloader_config(script, 3) == dataloader_config(family, 3), (
            f"scripts/{script}.py's DataLoaderConfiguration is not {family}.py's")


def set_epoch_problem(source: str) -> str:
    """'' when the epoch loop of ``source`` (a training script) calls train_loader.set_epoch(epoch)
    with its loop variable before it iterates its batches, else what is wrong."""
    loops = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.For)
             and isinstance(node.target, ast.Name) and node.target.id == "epoch"]
    if len(loops) != 1:
        return f"{len(loops)} loops `for epoch in ...`, not 1"
    calls = [(index, ast.unparse(node)) for index, statement in enumerate(loops[0].body)
             for node in ast.walk(statement) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "set_epoch"]
    inner = [index for index, statement in enumerate(loops[0].body) if isinstance(statement, ast.For)]
    if [call for _, call in calls] != ["train_loader.set_epoch(epoch)"] or not inner \
            or calls[0][0] > inner[0]:
        return (f"the epoch loop calls {[call for _, call in calls] or 'no set_epoch'}; it must call "
                f"train_loader.set_epoch(epoch) once, before its batches (a new order each epoch, "
                f"a function of seed and epoch, the one a resume continues)")
    return ""


def test_every_script_sets_its_loader_to_the_epoch_it_trains():
    problems = {script: set_epoch_problem((ROOT / "scripts" / f"{script}.py").read_text())
                for script in TRAINING}
    problems = {script: problem for script, problem in problems.items() if problem}
    assert not problems, "; ".join(f"scripts/{s}.py: {p}" for s, p in problems.items())
    # Negative control: the mutant that trains every epoch in epoch 0's order
    source = (ROOT / "scripts" / "train_ddp.py").read_text()
    mutant = source.replace("train_loader.set_epoch(epoch)", "train_loader.set_epoch(0)")
    assert mutant != source and "train_loader.set_epoch(0)" in set_epoch_problem(mutant)
