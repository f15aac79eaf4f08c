"""--ema-decay: the average of the weights computed here from the run's own per-step weights, the
final file and evaluate.py, and a 2-process resume bit for bit.

The reference average is made in the test: the initial weights (set_seed, then build_model, as the
scripts start), each step's live weights from its checkpoint (--checkpoint-every 1), and the
warm-up's decay min(DECAY, 1 - (1 + t) ** -0.75) (timm's ModelEmaV3 with gamma 1, power 3/4).
"""

import json
import re

import pytest
import torch
from accelerate.utils import set_seed
from helpers import ROOT, assert_same_weights, relist, run, two_processes, weights
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.recipe.models import build_model

DECAY = 0.5
DATA = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--synthetic-test-size", "32"]
FLAGS = [*DATA, "--model", "resnet20", "--batch-size", "16", "--reference-batch-size", "16", "--epochs", "2",
         "--report-to", "none", "--ema-decay", DECAY]


def floats(state: dict) -> dict:
    return {k: v for k, v in state.items() if v.is_floating_point()}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("ema") / "run"
    done = run("train_single.py", *FLAGS, "--checkpoint-every", 1, "--keep-checkpoints", 20, "--output-dir", out,
               cwd=out.parent)
    return out, done


def test_the_final_weights_are_the_average_of_every_step(single):
    out, _ = single
    set_seed(0)
    average = floats(build_model("resnet20", 10, 32).state_dict())
    steps = sorted((out / "checkpoints").glob("step_*"))
    assert len(steps) == 8
    for t, checkpoint in enumerate(steps, start=1):
        live = floats(weights(checkpoint))
        decay = min(DECAY, 1 - (1 + t) ** -0.75)
        average = {k: decay * a + (1 - decay) * live[k] for k, a in average.items()}
    final = floats(weights(out))
    assert final.keys() == average.keys()
    for key in final:
        torch.testing.assert_close(final[key], average[key], rtol=1e-5, atol=1e-6, msg=key)
    last = floats(weights(steps[-1]))
    assert any(not torch.allclose(final[k], last[k]) for k in final)  # not the live weights


def test_each_epoch_logs_both_accuracies_and_evaluate_reproduces_the_averaged_one(single):
    out, done = single
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [set(r) >= {"test_acc", "test_acc_ema"} for r in records] == [True, True]
    assert re.search(r"test_acc=\d\.\d{4} test_acc_ema=\d\.\d{4} ", done.stdout), done.stdout
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["weights"] == f"ema {DECAY}"
    evaluated = run("evaluate.py", "--weights", out / "model.safetensors", *DATA, cwd=out.parent)
    correct, total = map(int, re.search(r"\((\d+)/(\d+)\)", evaluated.stdout).groups())
    assert total == 32 and correct / total == pytest.approx(records[-1]["test_acc_ema"])
    # The last line gives the accuracy of the weights it names: the average's, not the trained weights'.
    assert done.stdout.strip().splitlines()[-1] == (
        f"done: step {records[-1]['step']}, test_acc_ema {records[-1]['test_acc_ema']:.4f} (the weight average, "
        f"saved; the trained weights' test_acc {records[-1]['test_acc']:.4f}) - weights in {out / 'model.safetensors'}")


def test_a_two_process_resume_is_bit_for_bit(tmp_path):
    """Under DDP each process's BatchNorm statistics differ and Accelerate saves the average from the
    main process only; the averaged buffers are kept the same on every process (tests/probe_ema.py
    reads each process's copy at the end), so the run resumed from a checkpoint ends, on every
    process, with the average of the uninterrupted one."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    probe, script = ROOT / "tests" / "probe_ema.py", ROOT / "scripts" / "train_ddp.py"
    two_processes(probe, script, *FLAGS, "--checkpoint-every", 2, "--keep-checkpoints", 10, "--output-dir", whole,
                  cwd=tmp_path, env_extra={"EMA_PROBE_DIR": str(whole / "probe")})
    two_processes(probe, script, *FLAGS, "--resume", whole / "checkpoints" / "step_00000002", "--output-dir",
                  resumed, cwd=tmp_path, env_extra={"EMA_PROBE_DIR": str(resumed / "probe")})
    assert_same_weights(whole, resumed)
    copies = {(out.name, rank): torch.load(out / "probe" / f"rank{rank}.pt") for out in (whole, resumed)
              for rank in (0, 1)}
    reference = copies["whole", 0]
    for copy in copies.values():  # the same average on both processes, resumed or not
        assert copy.keys() == reference.keys() and all(torch.equal(copy[k], reference[k]) for k in copy)
    accuracies = [[json.loads(line)["test_acc_ema"] for line in (out / "metrics.jsonl").read_text().splitlines()]
                  for out in (whole, resumed)]
    assert accuracies[0] == accuracies[1]


def average_in(checkpoint) -> dict:
    return {k.removeprefix("average/"): v for k, v in load_file(checkpoint / "weight_average.safetensors").items()}


@pytest.mark.parametrize("saved, resumed", [("aot_eager", "none"), ("none", "aot_eager"), ("old", "none")])
def test_a_weight_average_resumes_whatever_compiled_it(saved, resumed, tmp_path):
    """A checkpoint written compiled resumes eager, and one written eager resumes compiled: no name
    saved carries torch.compile's _orig_mod. (aot_eager wraps the model as Inductor does, without
    its minute of compiling on a CPU). "old": a compiled run's checkpoint as the last release wrote
    it, _orig_mod. in every name of the average, still loads. Resumed to the step it was saved at,
    the run writes the average it loaded as its final weights: the saved one, bit for bit."""
    out = tmp_path / "run"
    first = ["--compile", "none" if saved == "old" else saved]
    run("train_single.py", *FLAGS, *first, "--max-steps", 4, "--output-dir", out, cwd=tmp_path)
    checkpoint = out / "checkpoints" / "step_00000004"
    average = average_in(checkpoint)
    assert not any(k.startswith("_orig_mod.") for k in [*average, *weights(checkpoint)])
    if saved == "old":
        save_file({f"average/_orig_mod.{k}": v for k, v in average.items()}, checkpoint / "weight_average.safetensors")
        relist(checkpoint)
    done = run("train_single.py", *FLAGS, "--compile", resumed, "--max-steps", 4, "--output-dir", out, "--resume",
               cwd=tmp_path)
    assert f"resumed from {checkpoint}" in done.stdout, done.stdout
    final = weights(out)
    assert all(torch.equal(final[k], v) for k, v in average.items()) and average.keys() <= final.keys()


@pytest.mark.parametrize("script, flags, message", [
    ("train_single", ["--ema-decay", "1"], "--ema-decay 1.0: must be 0 (none) or more and below 1, e.g. 0.999"),
    ("train_ddp", ["--ema-decay", "-0.1"], "--ema-decay -0.1: must be 0 (none) or more and below 1, e.g. 0.999"),
])
def test_a_decay_out_of_range_is_one_line(script, flags, message, tmp_path):
    done = run(f"{script}.py", *DATA, *flags, cwd=tmp_path, check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [f"error: {message}"]
