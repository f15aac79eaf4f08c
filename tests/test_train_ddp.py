"""train_ddp.py and train_amp.py as real 2-process DDP on the CPU (gloo): the agreement runs launched the way
users do (accelerate launch, torchrun, two nodes), the others started as torchrun starts its processes."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import set_seed
from helpers import ROOT, Forked, assert_same_weights, execute, run, two_processes, user_env, weights
from probe_counts import per_class, predictions, printed_per_class

from common.data.synthetic import make_synthetic
from common.errors import UserError
from common.parallel.launch import check_world_size
from common.recipe.models import build_model

BIN = Path(sys.executable).parent
ACCELERATE = (str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "4gpu.yaml"),
              "--num_processes", "2")
TORCHRUN = (str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2")
SMALL_DATA = ["--dataset", "synthetic", "--synthetic-train-size", "512", "--synthetic-test-size", "301"]
SMALL = [*SMALL_DATA, "--model", "resnet20", "--batch-size", "64"]
# Agreement: BatchNorm frozen (tests/frozen_bn.py) and no augmentation, so the only differences
# left are DDP's own: the batch split across processes and the all-reduced gradients. A small lr
# keeps an unnormalised ResNet far from the chaotic regime where rounding differences grow.
AGREE = [*SMALL, "--no-augment", "--lr", "0.001", "--reference-batch-size", "64", "--epochs", "1",
         "--max-steps", "5"]
# For the runs whose tracking no test reads (wandb's offline start costs seconds): the agreement runs
# (one wandb run per job), the accumulation's collectives and the AMP run keep it.
UNTRACKED = ["--report-to", "none"]
FROZEN_BN = str(ROOT / "tests" / "frozen_bn.py")


def _run_frozen(launcher, script, out, *extra, env_extra=None):
    """Run a training script with BatchNorm frozen, under ``launcher`` (one process: forked from the
    zygote)."""
    cmd = [*launcher, FROZEN_BN, str(ROOT / "scripts" / script), *AGREE, *extra, "--output-dir", str(out)]
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(Path(out).parent / ".cache"), **(env_extra or {}))
    done = execute(cmd, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done


def max_difference(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    _run_frozen((sys.executable,), "train_single.py", out, "--checkpoint-every", "2", "--keep-checkpoints", "5",
                *UNTRACKED)
    return out


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return weights(one_process_run)


# ----------------------------------------------------------------------------- agreement

@pytest.fixture(scope="module")
def ddp_agreement_run(tmp_path_factory):
    """The agreement run under accelerate launch, with the checkpoints of steps 2, 4 and 5."""
    out = tmp_path_factory.mktemp("agreement") / "run"
    return out, _run_frozen(ACCELERATE, "train_ddp.py", out, "--checkpoint-every", "2", "--keep-checkpoints", "5")


@pytest.mark.parametrize("launcher", [pytest.param("accelerate", marks=pytest.mark.floor), "torchrun"])
def test_two_process_ddp_matches_one_process(one_process, tmp_path, launcher, request):
    out = tmp_path / "run"
    # torchrun: with --share-gpus gloo, which asks Accelerate for gloo by name as on a shared GPU
    # (tests/test_share_gpus.py); the weights must not change with it.
    shared = ["--share-gpus", "gloo"] if launcher == "torchrun" else []
    if launcher == "accelerate":
        out, done = request.getfixturevalue("ddp_agreement_run")
    else:
        done = _run_frozen(TORCHRUN, "train_ddp.py", out, *shared)
    assert "TRACED GRAPH" not in done.stderr
    assert_agrees(out, done, one_process, checkpoints=[2, 4, 5] if launcher == "accelerate" else [5],
                  share_gpus="gloo" if shared else None)


def test_compiled_two_process_ddp_matches_one_process(one_process, tmp_path):
    """--compile under DDP: Accelerate wraps the DDP model in torch.compile; aot_eager traces it as
    inductor would. The 2 processes are forked as torchrun starts them (helpers.Processes): what is
    tested is the compiled DDP model, the launchers are tested above."""
    out = tmp_path / "run"
    done = two_processes(ROOT / "tests" / "traced.py", FROZEN_BN, ROOT / "scripts" / "train_ddp.py", *AGREE,
                         "--compile", "aot_eager", "--output-dir", out, cwd=tmp_path,
                         env_extra={"WANDB_MODE": "offline"})
    assert done.stderr.count("TRACED GRAPH") >= 2, done.stderr[-3000:]  # dynamo traced in both processes
    assert_agrees(out, done, one_process, checkpoints=[5], share_gpus=None, launched=False)


def assert_agrees(out: Path, done, one_process: dict, checkpoints: list[int], share_gpus: str | None,
                  launched=True):
    assert "on 2 x cpu:0 (gloo)" in done.stdout and "batch 64 (32 per device)" in done.stdout
    ddp = weights(out)
    assert max_difference(ddp, one_process) < 1e-5
    set_seed(0)
    initial = build_model("resnet20", num_classes=10).state_dict()
    assert max_difference(ddp, initial) > 1e-3  # the weights did move: the agreement is not trivial

    # One writer: one run record, one wandb run, checkpoints holding both processes' RNG states,
    # no leftovers.
    # .job: the launched job that took the folder, for its restarted workers (common/run/lock.py); no
    # launcher, no job
    assert sorted(p.name for p in out.iterdir()) == [".checkpoints-written", *[".job"] * launched, "checkpoints",
                                                     "config.json", "metrics.jsonl", "model.safetensors", "wandb"]
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    found = sorted((out / "checkpoints").iterdir())
    assert [c.name for c in found] == [f"step_{step:08d}" for step in checkpoints]
    for checkpoint in found:
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in checkpoint.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["per_device_batch_size"] == 32
    assert (config["backend"], config["processes_per_gpu"], config["gpu_sharing"]) == ("gloo", None, None)
    assert config["args"]["share_gpus"] == share_gpus
    # Exact evaluation: 301 test images do not divide by 2 processes x 64, each still counts once.
    assert json.loads((out / "metrics.jsonl").read_text())["test_images"] == 301


def test_two_nodes_on_loopback_match_one_process(one_process, tmp_path):
    """Two launches, machine ranks 0 and 1, one process each: the two-node config on one machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    config = str(ROOT / "accelerate_configs" / "2nodes_4gpu.yaml")
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"))
    nodes = [Forked(  # the launchers warm, from a zygote each
        [BIN / "accelerate", "launch", "--config_file", config, "--num_processes", "2", "--machine_rank", rank,
         "--main_process_ip", "127.0.0.1", "--main_process_port", port, FROZEN_BN, ROOT / "scripts" / "train_ddp.py",
         *AGREE, *UNTRACKED, "--output-dir", out], ROOT, env, merged=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert "on 2 x cpu" in outputs[0]
    assert max_difference(weights(out), one_process) < 1e-5


def test_a_different_global_batch_does_not_match(one_process, tmp_path):
    """Negative control: the agreement tests can fail (one process, which the zygote starts warm: the
    comparison, not the launch, is what it checks)."""
    out = tmp_path / "run"
    _run_frozen((sys.executable,), "train_single.py", out, "--batch-size", "32", *UNTRACKED)
    assert max_difference(weights(out), one_process) > 1e-4


# ------------------------------------------------------------------- gradient accumulation
# --grad-accum 2 runs the same global batch of 64 as two micro-batches of 32: with BatchNorm frozen
# the gradient of the mean loss is the same up to rounding, so the weights agree with one_process.

COUNT_TOOL = str(ROOT / "tests" / "count_allreduce.py")


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    """One process, --grad-accum 2, a checkpoint every 2 optimizer steps (5 in all)."""
    out = tmp_path_factory.mktemp("accumulated") / "run"
    done = _run_frozen((sys.executable,), "train_single.py", out, "--grad-accum", "2", "--checkpoint-every", "2",
                       "--keep-checkpoints", "5", *UNTRACKED)
    return out, done


def initial_weights():
    set_seed(0)
    return build_model("resnet20", num_classes=10).state_dict()


def relative_gaps(ours, reference, start):
    """Per tensor, the largest difference between ``ours`` and ``reference`` over the largest distance
    ``reference`` moved from ``start``; the tensors that did not move must be equal."""
    gaps = {}
    for key, tensor in reference.items():
        moved = (tensor.double() - start[key].double()).abs().max().item()
        gap = (ours[key].double() - tensor.double()).abs().max().item()
        if moved == 0:
            assert gap == 0, key
        else:
            gaps[key] = gap / moved
    return gaps


def test_accumulating_two_micro_batches_equals_one_batch(one_process_run, accumulated):
    out, done = accumulated
    # The two runs add the same products in another order (one sum over 64 images, or two over 32 each
    # halved), so they differ by float32 rounding only: a conv weight gradient sums up to 64 x 32 x 32 =
    # 65,536 products, rounded to about sqrt(n) x 2**-24 = 1.5e-5 of its size, where the summation order
    # (the thread count changes it too) decides. Each step of this unnormalised network amplifies what
    # differs; measured after 5 steps: up to 1.4e-3 of the distance a tensor moved (OMP_NUM_THREADS=1),
    # so the bound is 1e-2. An accumulation that breaks (no division by --grad-accum, an optimizer step
    # per micro-batch) changes the steps themselves: a difference of the order of the distance moved.
    start = initial_weights()
    gaps = {step: relative_gaps(weights(out / path), weights(one_process_run / path), start)
            for step, path in ((4, "checkpoints/step_00000004"), (5, "."))}
    worst = {step: max(gaps[step], key=gaps[step].get) for step in gaps}
    print("--grad-accum 2 vs 1, one process: largest difference / distance moved "
          + ", ".join(f"{gaps[s][worst[s]]:.2g} after {s} steps ({worst[s]})" for s in gaps))
    assert max(gaps[4].values()) < 1e-2 and max(gaps[5].values()) < 1e-2, worst
    assert "batch 64 (32 per device x 2 micro-batches)" in done.stdout and "5 steps/epoch" not in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["grad_accum"], config["per_device_batch_size"], config["global_batch_size"]) == (2, 32, 64)
    assert config["steps_per_epoch"] == 8  # optimizer steps: 512 images / 64, not 16 micro-batches
    # Checkpoints and --max-steps count optimizer steps.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004", "step_00000005"]
    assert json.loads((out / "metrics.jsonl").read_text())["step"] == 5


def test_accumulation_resumes_bit_for_bit(accumulated, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(accumulated[0], out)
    for later in ("step_00000004", "step_00000005"):
        shutil.rmtree(out / "checkpoints" / later)
    (out / "model.safetensors").unlink()
    done = _run_frozen((sys.executable,), "train_single.py", out, "--grad-accum", "2", "--checkpoint-every", "2",
                       "--keep-checkpoints", "5", *UNTRACKED, "--resume")
    assert "resumed from" in done.stdout and "step 2" in done.stdout  # in the middle of the epoch
    assert_same_weights(out, accumulated[0])


def test_accumulation_in_ddp_agrees_and_all_reduces_once_per_step(one_process, tmp_path):
    out = tmp_path / "run"
    counts = tmp_path / "events"
    done = two_processes(COUNT_TOOL, FROZEN_BN, ROOT / "scripts" / "train_ddp.py", *AGREE, "--grad-accum", "2",
                        "--output-dir", out, cwd=tmp_path, env_extra={"COUNT_FILE": str(counts)})
    assert "on 2 x cpu" in done.stdout and "batch 64 (16 per device x 2 micro-batches)" in done.stdout
    gap = max_difference(weights(out), one_process)
    print(f"--grad-accum 2 on 2 processes vs 1 process: largest weight difference {gap:.2g}")
    assert gap < 1e-5
    for rank in (0, 1):
        events = json.loads(Path(f"{counts}.{rank}").read_text())
        steps = [i for i, event in enumerate(events) if event == ["step"]]
        assert len(steps) == 5
        for start, end in zip([-1, *steps], steps):  # the events up to each optimizer step
            passes = [i for i in range(start + 1, end) if events[i][0] == "backward"]
            assert [events[i][1] for i in passes][:-1] == [0]  # the micro-step's backward: no gradient all-reduce
            assert events[passes[-1]][1] > 0  # the step's last backward all-reduces the summed gradients
            between = [events[i] for i in range(passes[0], passes[-1]) if events[i][0] == "collective"]
            assert between == [], between  # nor any other collective during the micro-step


# ------------------------------------------------------------------- training, cross-loading

CONV_PROBE = str(ROOT / "tests" / "probe_conv_dtypes.py")
# The normal run and its bf16 twin: 128 training images at batch 16, 8 steps an epoch, stopped at step 12 inside
# the second. On a CPU without native bf16 (AVX2 only) a bf16 step takes about 6x a float32 one, so the bf16
# run's time is the images it trains on: a quarter of 512 at batch 64 (the same 12 steps) took the AMP test
# from about 70 s to 45 s on 2 busy cores. 12 steps still move BatchNorm's running statistics far enough that
# the weights predict several classes (3; 8 images or more right in each of two).
BRIEF_DATA = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "301"]
BRIEF = [*BRIEF_DATA, "--model", "resnet20", "--batch-size", "16", "--epochs", "2", "--max-steps", "12"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """A normal 2-process run (BatchNorm, augmentation), stopped inside its second epoch, its convolutions
    recorded by tests/probe_conv_dtypes.py."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    done = two_processes(CONV_PROBE, ROOT / "scripts" / "train_ddp.py", *BRIEF, "--output-dir", out, cwd=out.parent,
                        env_extra={"PROBE_FILE": str(out.parent / "convolutions")})
    return out, done


def convolutions(probe_file: Path) -> dict:
    """{(phase, dtype, layout): calls} of both processes, as tests/probe_conv_dtypes.py wrote them."""
    records = [json.loads(Path(f"{probe_file}.{rank}").read_text()) for rank in (0, 1)]
    assert records[0] == records[1]  # the two processes computed alike
    return {tuple(record[:3]): record[3] for record in records[0]}


def check_evaluation(weights_file: Path, evaluated: str, logged: dict) -> None:
    """evaluate.py's overall and per-class counts and the run's logged accuracy against a count made
    here without common.recipe.evaluation (tests/probe_counts.py), on the 301 test images of BRIEF_DATA."""
    test = make_synthetic(128, 301)
    counts = per_class(predictions(weights_file, test.test_images), test.test_labels, 10)
    assert sum(c > 0 for c, _ in counts) >= 2, counts  # not one class predicted for every image
    correct = sum(c for c, _ in counts)
    assert evaluated.startswith(f"test_acc={correct / 301:.4f} ({correct}/301) "), evaluated
    assert printed_per_class(evaluated) == counts
    assert logged["test_acc"] == correct / 301 and logged["test_images"] == 301


def test_ddp_trains_and_evaluate_reproduces_its_accuracy(ddp_run):
    out, _ = ddp_run
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["step"] == 12 and logged["train_loss"] < 10
    done = run("evaluate.py", "--weights", out / "model.safetensors", *BRIEF_DATA)
    check_evaluation(out / "model.safetensors", done.stdout, logged)


def test_a_ddp_checkpoint_resumes_in_train_single_with_its_weights(ddp_agreement_run, one_process, tmp_path):
    """The DDP run's checkpoint of step 2 (BatchNorm frozen, augmentation off) finished by train_single.py
    ends with the weights of the uninterrupted one process: DDP's weights, momentum, schedule and place
    carried over, within the agreement tests' 1e-5."""
    out = tmp_path / "run"
    shutil.copytree(ddp_agreement_run[0], out)
    for later in ("step_00000004", "step_00000005"):
        shutil.rmtree(out / "checkpoints" / later)
    (out / "model.safetensors").unlink()
    done = _run_frozen((sys.executable,), "train_single.py", out, "--checkpoint-every", "2", "--resume")
    assert "resumed from" in done.stdout and "step 2" in done.stdout
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 5
    resumed = weights(out)
    assert max_difference(resumed, one_process) < 1e-5
    assert max_difference(resumed, weights(ddp_agreement_run[0] / "checkpoints" / "step_00000002")) > 1e-4


def test_amp_bf16_on_cpu_really_runs_in_bf16(ddp_run, tmp_path):
    """Same flags as the DDP run, the same memory layout: the difference in the weights is the precision, and
    the convolutions computed in bf16 (those of the DDP run in float32)."""
    done = two_processes(CONV_PROBE, ROOT / "scripts" / "train_amp.py", *BRIEF, "--mixed-precision", "bf16",
                        cwd=tmp_path, env_extra={"PROBE_FILE": str(tmp_path / "convolutions")})
    (out,) = (tmp_path / "runs").iterdir()  # the default output dir: one folder for both processes
    assert out.name.startswith("train_amp-") and "train_amp: bf16" in done.stdout
    config, reference = (json.loads((run / "config.json").read_text()) for run in (out, ddp_run[0]))
    assert config["args"]["channels_last"] == reference["args"]["channels_last"] is True
    # 12 training steps of resnet20's 19 convolutions; 2 evaluations (the end of epoch 1 and step 12),
    # each of 19 batches per process (301 images, 151 on each process, 8 per process and batch).
    calls = {"train": 12 * 19, "eval": 2 * 19 * 19}
    fp32 = convolutions(ddp_run[0].parent / "convolutions")
    assert fp32 == {(phase, "float32", "channels_last"): n for phase, n in calls.items()}, fp32
    bf16 = convolutions(tmp_path / "convolutions")
    assert bf16 == {(phase, "bfloat16", "channels_last"): n for phase, n in calls.items()}, bf16
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert torch.isfinite(torch.tensor(metrics["train_loss"])) and metrics["train_loss"] < 10
    difference = max_difference(weights(out), weights(ddp_run[0]))
    assert 1e-3 < difference < 1.0, difference  # bf16 rounding (0.019 measured), not divergence
    assert json.loads((out / "config.json").read_text())["mixed_precision"] == "bf16"
    # The weights say how the run evaluated (bf16, channels_last): evaluate.py does the same.
    evaluated = run("evaluate.py", "--weights", out / "model.safetensors", *BRIEF_DATA)
    assert " precision=bf16 " in evaluated.stdout
    check_evaluation(out / "model.safetensors", evaluated.stdout, metrics)


# ---------------------------------------------------------------------------------- refusals
# fp16 and --sync-bn on a CPU, and a batch that does not divide: tests/test_bad_input.py.

def test_the_independent_runs_trap_is_caught(monkeypatch):
    """torchrun without CUDA and without cpu=True: every process thinks it is alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")

    class Alone:
        num_processes, distributed_type = 1, "DistributedType.NO"

    with pytest.raises(UserError, match="the launcher started 2 processes .* but Accelerate runs 1"):
        check_world_size(Alone())


# -------------------------------------------------------------------------------- configs

@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "accelerate_configs").glob("*.yaml")))
def test_every_accelerate_config_loads(name):
    config = load_config_from_file(str(ROOT / "accelerate_configs" / name))
    gpus = {"1gpu.yaml": 1, "2gpu.yaml": 2, "4gpu.yaml": 4, "8gpu.yaml": 8, "4gpu_fp16.yaml": 4,
            "4gpu_bf16.yaml": 4, "2nodes_4gpu.yaml": 8, "4gpu_fsdp.yaml": 4,
            "8gpu_rehearsal.yaml": 8}[name]
    assert config.num_processes == gpus
    assert config.mixed_precision == {"4gpu_fp16.yaml": "fp16", "4gpu_bf16.yaml": "bf16"}.get(name, "no")
    kind = "NO" if gpus == 1 else "FSDP" if name == "4gpu_fsdp.yaml" else "MULTI_GPU"
    assert str(config.distributed_type) == f"DistributedType.{kind}"
    if name == "4gpu_fsdp.yaml":
        fsdp = config.fsdp_config
        assert (fsdp["fsdp_version"], fsdp["fsdp_auto_wrap_policy"], fsdp["fsdp_state_dict_type"]) == (
            2, "TRANSFORMER_BASED_WRAP", "SHARDED_STATE_DICT")
    if name == "2nodes_4gpu.yaml":
        assert config.num_machines == 2 and config.machine_rank == 0 and config.main_process_port


def test_the_slurm_script_launches_one_accelerate_per_node():
    script = (ROOT / "accelerate_configs" / "slurm_2nodes.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "accelerate_configs" / "slurm_2nodes.sh")], check=True)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "--machine_rank \"$SLURM_NODEID\"" in script and "2nodes_4gpu.yaml" in script
