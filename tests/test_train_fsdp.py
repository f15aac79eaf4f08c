"""train_fsdp.py: FSDP2 through Accelerate on 2 gloo CPU processes, against train_ddp.py.

Accelerate enables FSDP on GPUs only, so the script refuses on this machine (tested below as a user
meets it). The runs that train go through tests/probe_fsdp.py, which sets, in the test's processes
only, the state Accelerate sets on GPUs; prepare, the sharded steps, save_state, load_state and the
gathered state dict are then Accelerate's and torch's FSDP2 code. One FSDP2 run and one DDP run of
the same flags, both with a weight average (--ema-decay), serve every test.
"""

import dataclasses
import io
import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from helpers import (ROOT, Payload, Processes, assert_same_weights, bad_ends, plant, relist, run, tree_digest,
                     two_processes, weights)
from probe_counts import per_class, predictions, printed_per_class

from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.run.checkpoints import MANIFEST, checkpoint_problem
from common.parallel.fsdp import code_in_shards
from common.data.synthetic import make_synthetic

BIN = Path(sys.executable).parent
ACCELERATE = (str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "4gpu.yaml"),
              "--num_processes", "2")
PROBE = str(ROOT / "tests" / "probe_fsdp.py")
DATA = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "101"]
# 4 steps an epoch, stopped at step 6 inside the second: a checkpoint every 2 steps gives a
# mid-epoch one (step 2) to resume from. BatchNorm trains and augmentation is on: both scripts cut
# the batch into the same slices and draw the same augmentation per process, so what differs is
# only how the gradients are reduced and the weights are held. model.safetensors holds the weight
# average (FSDP2: of each process's slices); the checkpoints hold the live weights.
DECAY = 0.5
FLAGS = [*DATA, "--model", "resnet20", "--batch-size", "32", "--reference-batch-size", "32", "--lr", "0.02",
         "--epochs", "2", "--max-steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "5",
         "--report-to", "none", "--ema-decay", DECAY]


def launch(script, out, *extra, resume=False):
    """``script`` on 2 processes (as torchrun starts them), FSDP forced by tests/probe_fsdp.py."""
    return two_processes(PROBE, ROOT / "scripts" / script, *FLAGS, "--output-dir", out,
                         *(["--resume"] if resume else []), *extra, cwd=out.parent,
                         env_extra={"PROBE_FILE": f"{out}.probe"})


def probed(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.probe.{rank}").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"fsdp": (folder, output), "ddp": (folder, output)}: the same flags."""
    folders = {name: tmp_path_factory.mktemp(name) / "run" for name in ("fsdp", "ddp")}
    return {name: (folders[name], launch(f"train_{name}.py", folders[name])) for name in folders}


def is_parameter(key: str) -> bool:
    return not key.endswith(("running_mean", "running_var", "num_batches_tracked"))


def sharded_checkpoint_weights(checkpoint: Path, tmp_path: Path) -> dict:
    """The live weights of a sharded checkpoint, its slices put together by torch's own converter."""
    dcp_to_torch_save(checkpoint / "pytorch_model_fsdp_0", tmp_path / "whole.pt")
    return torch.load(tmp_path / "whole.pt")["model"]


def largest_gap(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if is_parameter(k))


def test_fsdp_trains_the_weights_of_ddp(runs, tmp_path):
    """Same forward and backward on the same slices with the same (all-gathered) weights; the mean
    gradient is (a + b) / 2 in both, reduce-scattered or all-reduced (a sum of two is commutative,
    a halving exact), and SGD acts element by element, on a shard or a whole tensor: the same
    arithmetic, so the bound is float32 rounding of the weights (|w| < 1: 6e-8), not a tolerance for
    an algorithm that differs. Measured: 0.0 after 6 steps, for the live weights (the checkpoints)
    and for their average (model.safetensors: FSDP2 averages each process's slices)."""
    out, done = runs["fsdp"]
    assert "train_fsdp: resnet20 on 2 x cpu" in done.stdout and ", sharded (gloo), batch 32 (16 per device)" in done.stdout
    ddp_out = runs["ddp"][0]
    live = sharded_checkpoint_weights(out / "checkpoints" / "step_00000006", tmp_path)
    ddp_live = weights(ddp_out / "checkpoints" / "step_00000006")
    fsdp, ddp = weights(out), weights(ddp_out)
    assert sorted(live) == sorted(ddp_live) == sorted(fsdp) == sorted(ddp)
    gaps = {"live": largest_gap(live, ddp_live), "average": largest_gap(fsdp, ddp)}
    print(f"FSDP2 vs DDP after 6 steps: largest parameter difference {gaps}")
    assert gaps["live"] <= 6e-8 and gaps["average"] <= 6e-8
    moved = largest_gap(ddp_live, weights(ddp_out / "checkpoints" / "step_00000002"))
    assert moved > 1e-3  # steps 3 to 6 moved the weights: the agreement is not trivial
    assert largest_gap(fsdp, live) > 1e-4  # and the file holds the average, not the live weights
    # BatchNorm's running statistics: DDP broadcasts rank 0's before each forward; train_fsdp.py
    # averages both processes' after each step, so they are the same on both but not rank 0's.
    records = probed(out)
    assert records[0]["buffer_sum"] == records[1]["buffer_sum"]
    assert any(not torch.equal(fsdp[k], ddp[k]) for k in fsdp if k.endswith("running_mean"))


def test_each_process_holds_half_the_parameters_and_optimizer_state(runs):
    fsdp, ddp = probed(runs["fsdp"][0]), probed(runs["ddp"][0])
    whole = ddp[0]["param_bytes"]
    assert ddp[0]["param_full_bytes"] == whole == ddp[0]["optimizer_bytes"]  # momentum: one per weight
    for rank, record in enumerate(fsdp):
        print(f"rank {rank}: parameters {record['param_bytes']:,} bytes, optimizer state "
              f"{record['optimizer_bytes']:,} bytes; DDP: {whole:,} each")
        assert record["dtensor_params"] == record["params"] == 59  # every parameter sharded
        assert record["param_full_bytes"] == whole
        assert abs(record["param_bytes"] / whole - 0.5) < 0.02  # dim 0 cut in two (padding aside)
        assert abs(record["optimizer_bytes"] / whole - 0.5) < 0.02
        assert record["ema_param_bytes"] == record["param_bytes"]  # the average of its slice only
    assert ddp[0]["ema_param_bytes"] == whole
    assert fsdp[0]["param_bytes"] + fsdp[1]["param_bytes"] == whole
    # One unit per residual block (resnet20: 9 BasicBlocks) and the root; Accelerate also makes the
    # last norm among the model's direct children (here the stem's bn1) a unit of its own.
    assert fsdp[0]["units"] == ["FSDPBasicBlock"] * 9 + ["FSDPBatchNorm2d", "FSDPCifarResNet"]


def test_sharded_checkpoints_resume_bit_for_bit(runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["fsdp"][0], out)
    step2 = out / "checkpoints" / "step_00000002"
    listed = json.loads((step2 / MANIFEST).read_text())["crc32"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch.distributed.checkpoint: a file per process
        assert {f"{folder}/.metadata", f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp"} <= set(listed)
    # The weight average is saved whole (its slices gathered) by the main process, as DDP's.
    average = {k.removeprefix("average/"): v for k, v in load_file(step2 / "weight_average.safetensors").items()}
    full = weights(runs["ddp"][0])
    assert {k: v.shape for k, v in average.items()} == {k: v.shape for k, v in full.items() if v.is_floating_point()}
    for later in ("step_00000004", "step_00000006"):
        shutil.rmtree(out / "checkpoints" / later)
    (out / "model.safetensors").unlink()
    done = launch("train_fsdp.py", out, resume=True)
    assert f"resumed from {step2} at epoch 1, step 2" in done.stdout  # in the middle of the epoch
    assert_same_weights(out, runs["fsdp"][0])
    # The digests cover the shards' index too: a damaged .metadata is found before it is loaded.
    metadata = step2 / "optimizer_0" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0xFF
    metadata.write_bytes(bytes(data))
    assert checkpoint_problem(step2).startswith("optimizer_0/.metadata is damaged")


def forge_a_value(checkpoint: Path, marker: Path) -> str:
    """One value of optimizer_0/ that is not a tensor (a param group's lr), which DCP reads with
    torch.load(weights_only=False), made a pickle of Payload(marker): appended to its .distcp file,
    the .metadata pointed at it, the list written again. The file's name in the checkpoint."""
    folder = checkpoint / "optimizer_0"
    index = pickle.loads((folder / ".metadata").read_bytes())
    key = next(k for k in index.storage_data if k.fqn.endswith("param_groups.0.lr"))
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    shard = folder / index.storage_data[key].relative_path
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], offset=shard.stat().st_size,
                                                  length=len(blob.getvalue()))
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    relist(checkpoint)
    return f"optimizer_0/{shard.name}"


@pytest.mark.parametrize("name", ["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "optimizer_0/*.distcp",
                                  "random_states_1.pkl", "progress.json"])
def test_every_file_of_a_sharded_checkpoint_is_read_as_data(runs, tmp_path, name):
    """A payload that would create a marker file, in each kind of file a sharded resume reads (a DCP
    value: a param group's lr; random_states_1.pkl, read by process 1 only, whose failure Accelerate
    only logs): named before any of it is loaded, the marker never made. In-process: what each
    process of the launched test below checks."""
    checkpoint = tmp_path / "step"
    shutil.copytree(runs["fsdp"][0] / "checkpoints" / "step_00000006", checkpoint)
    assert code_in_shards(checkpoint, 1) is None
    if name.endswith(".distcp"):
        name = forge_a_value(checkpoint, tmp_path / "marker")
    else:
        plant(checkpoint / name, tmp_path / "marker")
    found = code_in_shards(checkpoint, 1)
    assert not (tmp_path / "marker").exists()
    if name == "progress.json":  # JSON, parsed when Accelerate loads the checkpoint
        assert found is None
    else:
        assert found == f"{name} could run code: it names posix.system, which is not data"


@pytest.mark.parametrize("index", ["removed", "unusable"])
def test_each_process_s_own_dcp_metadata_is_read_as_data_too(runs, tmp_path, index):
    """Where a DCP folder's .metadata does not load (removed; or its storage_meta a torch.Size, which DCP
    cannot set the load id of), torch reads the process's own __<rank>.metadata with pickle.load: a payload
    there (checkpoint.json written to match) is named before anything of it is loaded, and DCP's own load of
    the folder runs it, the threat being real."""
    checkpoint, marker = tmp_path / "step", tmp_path / "marker"
    shutil.copytree(runs["fsdp"][0] / "checkpoints" / "step_00000006", checkpoint)
    folder = checkpoint / "pytorch_model_fsdp_0"
    if index == "removed":
        (folder / ".metadata").unlink()
    else:
        metadata = pickle.loads((folder / ".metadata").read_bytes())
        (folder / ".metadata").write_bytes(pickle.dumps(dataclasses.replace(metadata, storage_meta=torch.Size([1]))))
    (folder / "__0.metadata").write_bytes(pickle.dumps(Payload(marker)))
    relist(checkpoint)
    assert code_in_shards(checkpoint, 0) == ("pytorch_model_fsdp_0/__0.metadata could run code: it names "
                                             "posix.system, which is not data")
    assert not marker.exists()
    # the payload is os.system's call: DCP gets its exit status, no Metadata, and fails after running it
    with pytest.raises(CheckpointException, match="rank local metadata read failed: 'int' object"):
        dcp.load({}, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    assert marker.exists()


def test_a_sharded_checkpoint_carrying_code_is_refused_in_one_line(runs, tmp_path):
    """FSDP2's sharded resume on 2 processes, pytorch_model_fsdp_0/.metadata (which DCP reads with
    pickle.load) a payload: one line from the main process, both exit 1, nothing ran, nothing of
    the run folder changed."""
    out = tmp_path / "run"
    shutil.copytree(runs["fsdp"][0], out)
    newest = out / "checkpoints" / "step_00000006"
    plant(newest / "pytorch_model_fsdp_0" / ".metadata", tmp_path / "marker")
    before = tree_digest(out)
    job = Processes(PROBE, ROOT / "scripts" / "train_fsdp.py", *FLAGS, "--output-dir", out, "--resume",
                    cwd=tmp_path)
    assert job.wait() == [1, 1], job.output()
    assert bad_ends(job.output()) == [], job.output()
    errors = [line for line in (job.stderr(0) + job.stderr(1)).splitlines() if line.startswith("error:")]
    assert errors == [f"error: --resume: {newest} was not loaded: pytorch_model_fsdp_0/.metadata could run code: "
                      f"it names posix.system, which is not data; these scripts write checkpoints of data only: "
                      f"resume one of theirs, or start a new run (one of an earlier version, with "
                      f"custom_checkpoint_N.pkl: continue it with that version, if you trust where it came from)"]
    assert not (tmp_path / "marker").exists()
    assert tree_digest(out) == before


def test_evaluate_gives_the_logged_accuracy(runs, tmp_path):
    """The gathered average in model.safetensors, read by evaluate.py, gives the logged test_acc_ema,
    class by class as counted here with plain torch (tests/probe_counts.py). Six steps do not teach
    the model much: the count made here, not a learnt model, is what evaluate.py must match."""
    out = runs["fsdp"][0]
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["weights"] == f"ema {DECAY}"
    done = run("evaluate.py", "--weights", out / "model.safetensors", *DATA, cwd=tmp_path)
    test = make_synthetic(128, 101)
    counts = per_class(predictions(out / "model.safetensors", test.test_images), test.test_labels, 10)
    correct = sum(c for c, _ in counts)
    assert done.stdout.startswith(f"test_acc={correct / 101:.4f} ({correct}/101) "), done.stdout
    assert printed_per_class(done.stdout) == counts
    assert logged["test_images"] == 101 and logged["test_acc_ema"] == correct / 101


def test_without_gpus_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    """As a user meets it: Accelerate drops the FSDP plugin on a CPU and would run DDP."""
    out = tmp_path / "run"
    done = run("train_fsdp.py", *FLAGS, "--output-dir", out, cwd=tmp_path, launcher=ACCELERATE, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and done.stdout == "", done.stderr
    expected = ("error: train_fsdp.py shards over GPUs only, and Accelerate runs this launch as MULTI_CPU "
                "on 2 x cpu (without GPUs it drops the FSDP plugin and would run DDP): launch it on 2 or "
                "more GPUs (accelerate launch --config_file accelerate_configs/4gpu_fsdp.yaml), or use "
                "train_ddp.py on this machine")
    assert errors == [expected], done.stderr
    assert list(tmp_path.iterdir()) == []


def test_sync_bn_is_refused(tmp_path):
    done = run("train_fsdp.py", *FLAGS, "--sync-bn", "--output-dir", tmp_path / "run", cwd=tmp_path, check=False)
    assert done.returncode == 1 and done.stderr.startswith("error: --sync-bn is train_ddp.py's:")
    assert len(done.stderr.splitlines()) == 1 and list(tmp_path.iterdir()) == []
