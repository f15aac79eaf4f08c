"""Every refusal's advice, followed as printed, gets past the check that printed it.

A flag's refusal says what to do (`use 62 or 64`, `drop --sync-bn`, `add --loader workers`, `e.g.
0.9`, `pass --model timm:resnet18.a1_in1k` ...). Here each is read from the line the check printed,
by the few phrasings the scripts use (`follow`), applied to the same command line, and the command
checked again: it must pass (one refusal names two values; its two lines are followed in turn). A
refusal whose advice this cannot follow fails the test, so a new one is written to be followed.
The advice that needs a run (data, checkpoints, the disk, a diverged loss) is followed by the
tests of those faults: test_faults_*.py, test_fail_together.py, test_inputs.py, test_fine_tune.py.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from common.data.choice import choose_loader
from common.errors import UserError
from common.parallel.amp import choose_mixed_precision
from common.parallel.launch import check_batch_split, check_sync_bn, plan_gpu_sharing

CPU = torch.device("cpu")
SCRIPTS = {}


def script(name: str):
    """scripts/NAME.py as a module: its imports and definitions (main() runs under __main__)."""
    if name not in SCRIPTS:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        SCRIPTS[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(SCRIPTS[name])
    return SCRIPTS[name]


# The phrasings of advice, first match wins: (pattern, what it does). A value group absent means a
# flag given alone; "NAMED" is the flag the line names first (the one refused).
VALUE = r"(?: (?!or\b)([^\s;,()]+))?"
RULES = [
    (r"\buse (\w+\.py) (--[\w-]+)" + VALUE, "script"),  # use train_ddp.py --compile
    (r"\b(?:pass|use|add) (--[\w-]+)" + VALUE, "set"),  # pass --image-size 224, add --pretrained
    (r"\bchoose another (--[\w-]+)", "new folder"),
    (r"\bdrop (--[\w-]+)", "drop"),
    (r"\bdrop (?:it|one of them)\b|\bpass one$", "drop named"),
    (r"\buse (\d+) or (?:\d+|more)\b", "set named"),  # use 62 or 64
    (r"\be\.g\. ([^\s,;()]+)", "set named"),
    (r"\bsuch as ([^\s,;()]+)", "set named"),
    (r"\b(?:closest|one of):? ([\w:.-]+)", "set named"),  # choose one of resnet18, ...
    (r"\bfrom (\S+) to\b", "set named"),
    (r"\b(\d+)(?: \([^)]*\))? or more\b", "set named"),  # must be 0 (load in ...) or more
]


def without(argv: list[str], flag: str) -> list[str]:
    """argv less ``flag`` and its values."""
    kept, skipping = [], False
    for part in argv:
        if part.startswith("--"):
            skipping = part == flag
        if not skipping:
            kept.append(part)
    return kept


def follow(line: str, name: str, argv: list[str], named: str | None, tmp_path: Path) -> tuple[str, list[str]]:
    """(script, argv) as ``line``'s advice makes them."""
    named = named or re.search(r"--[\w-]+", line).group()
    for pattern, action in RULES:
        if match := re.search(pattern, line):
            break
    else:
        raise AssertionError(f"advice this test cannot follow: {line}")
    if action == "script":
        name, flag, value = match.groups()
        return name.removesuffix(".py"), [*without(argv, flag), flag, *([value] if value else [])]
    if action == "set":
        flag, value = match.groups()
        return name, [*without(argv, flag), flag, *([value] if value else [])]
    if action == "new folder":
        return name, [*without(argv, match[1]), match[1], str(tmp_path / "another")]
    if action == "drop":
        return name, without(argv, match[1])
    if action == "drop named":
        return name, without(argv, named)
    return name, [*without(argv, named), named, match[1]]


def parse(name):
    return lambda argv: script(name).parse_args(argv)


def after_parse(name, check):
    """A check made once the run knows more than its flags, after the script's own parse."""
    return lambda argv: check(script(name).parse_args(argv))


TRAIN = parse("train_single")
DDP = parse("train_ddp")
# (the check that refuses, argv, the flag refused where the line names none)
CASES = {
    "unknown model": (TRAIN, ["--model", "resnet99"], "--model"),
    "unknown timm model": (TRAIN, ["--model", "timm:resnt18"], None),
    "unknown timm tag": (TRAIN, ["--model", "timm:resnet18.badtag"], None),
    "unknown dataset": (TRAIN, ["--dataset", "not a/name!"], None),
    "image size": (TRAIN, ["--image-size", "0"], None),
    "workers": (TRAIN, ["--workers", "-1"], None),
    "val fraction": (TRAIN, ["--val-fraction", "1"], None),
    "loader budget": (TRAIN, ["--loader-budget", "nan"], None),
    "workers with the device loader": (TRAIN, ["--loader", "device", "--workers", "4"], None),
    "budget with the workers loader": (TRAIN, ["--loader", "workers", "--loader-budget", "8"], None),
    "synthetic size": (TRAIN, ["--synthetic-train-size", "0"], None),
    "synthetic images beyond the memory": (TRAIN, ["--dataset", "synthetic", "--synthetic-train-size", str(10**12),
                                                   "--synthetic-test-size", str(10**12), "--image-size", "4096"], None),
    "batch size 0": (TRAIN, ["--batch-size", "0"], None),
    "epochs 0": (TRAIN, ["--epochs", "0"], None),
    "micro-batches": (TRAIN, ["--batch-size", "64", "--grad-accum", "3"], None),
    "seed": (TRAIN, ["--seed", "-1"], None),
    "lr": (TRAIN, ["--lr", "nan"], None),
    "lr of adamw": (TRAIN, ["--optimizer", "adamw", "--lr", "0"], None),
    "lr that overflows": (TRAIN, ["--lr", "1e300"], None),
    "clip grad": (TRAIN, ["--clip-grad", "0"], None),
    "momentum": (TRAIN, ["--momentum", "0"], None),
    "weight decay": (TRAIN, ["--weight-decay", "-1"], None),
    "label smoothing": (TRAIN, ["--label-smoothing", "1"], None),
    "ema decay": (TRAIN, ["--ema-decay", "1"], None),
    "warm-up": (TRAIN, ["--epochs", "3", "--warmup-epochs", "4"], None),
    "milestones": (TRAIN, ["--schedule", "step", "--epochs", "10", "--milestones", "4", "9", "14", "20"], None),
    "step schedule of one epoch": (TRAIN, ["--schedule", "step", "--epochs", "1"], None),
    "random erase": (TRAIN, ["--random-erase", "2"], None),
    "mixup": (TRAIN, ["--mixup", "-1"], None),
    "auto augment": (TRAIN, ["--auto-augment", "randaugment", "--loader", "device"], None),
    "profile": (TRAIN, ["--profile", "x"], None),
    "compile mode": (TRAIN, ["--compile", "aot_eager", "--compile-mode", "reduce-overhead"], None),
    "CUDA graphs": (TRAIN, ["--compile", "--compile-mode", "max-autotune", "--grad-accum", "2"], None),
    "report to none and more": (TRAIN, ["--report-to", "none", "wandb"], None),
    "a frozen random backbone": (TRAIN, ["--model", "timm:resnet18", "--freeze", "backbone"], None),
    "weights from two places": (TRAIN, ["--pretrained", "--pretrained-path", "w.safetensors"], None),
    "head lr scale": (TRAIN, ["--head-lr-scale", "0"], None),
    "head lr that overflows": (TRAIN, ["--head-lr-scale", "1e300"], None),
    "output dir that is a file": (TRAIN, ["--output-dir", str(ROOT / "README.md")], None),
    "dist timeout": (DDP, ["--dist-timeout", "1"], None),
    "sync bn with timm": (DDP, ["--model", "timm:resnet18", "--sync-bn"], None),
    "eval batch size": (parse("evaluate"), ["--weights", "w.safetensors", "--eval-batch-size", "0"], None),
    "sweep with a global batch": (parse("benchmark"), ["--sweep-batch-size", "8", "16", "--global-batch-size",
                                                       "256"], None),
    "too few loader files": (parse("benchmark"), ["--loader-files", "2", "--per-device-batch-size", "8"], None),
    "benchmark timeout": (parse("benchmark"), ["--timeout", "0"], None),
    "data dir of synthetic": (parse("benchmark"), ["--data-dir", "data"], None),
    "all-reduce size": (parse("check_gpus"), ["--size-mb", "nan"], None),
    "one cpu process": (parse("check_gpus"), ["--cpu-processes", "1"], None),
    "gpu check budget": (parse("gpu_check"), ["--budget", "10"], None),
    # the checks made once the processes, the device or the data are known, on their real values
    "batch split": (after_parse("train_ddp", lambda args: check_batch_split(args.batch_size, 2, "processes")),
                    ["--batch-size", "63"], None),
    "batch split into micro-batches": (after_parse("train_ddp", lambda args: check_batch_split(
        args.batch_size, 2, "processes", args.grad_accum)), ["--batch-size", "100", "--grad-accum", "4"], None),
    "nccl on a cpu": (after_parse("train_ddp", lambda args: plan_gpu_sharing(args.share_gpus, 2, 0, None)),
                      ["--share-gpus", "nccl"], None),
    "sync bn on a cpu": (after_parse("train_ddp", lambda args: check_sync_bn(args.sync_bn, CPU)),
                         ["--sync-bn"], None),
    "fp16 on a cpu": (after_parse("train_amp", lambda args: choose_mixed_precision(args.mixed_precision)),
                      ["--mixed-precision", "fp16"], None),
    "device loader over its budget": (after_parse("train_single", lambda args: choose_loader(
        OneProcess, args.loader, 50_000, 32, args.loader_budget)), ["--loader", "device", "--loader-budget", "0"],
        None),
}


# Both sizes too large: the first line gives the test split's size that fits, the next the training
# split's, once the test split's is known.
TWO_STEPS = {"synthetic images beyond the memory"}


class OneProcess:  # choose_loader's view of the Accelerator: one process on the CPU
    num_processes, device = 1, CPU


@pytest.mark.parametrize("case", CASES)
def test_the_advice_of_a_refusal_followed_as_printed_passes(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --output-dir and the like, made where the test can make them
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's checks, on any machine
    check, argv, named = CASES[case]
    name, lines = None, []
    for _ in range(3):  # the advice followed may meet another check, whose advice is followed too
        try:
            check(argv)
        except UserError as refused:
            lines.append(refused.message)
            assert refused.message not in lines[:-1], f"the advice circles: {lines}"
            name, argv = follow(refused.message, name, argv, named if len(lines) == 1 else None, tmp_path)
            if name is not None:  # another script, as the advice says
                check = parse(name)
            continue
        assert lines, f"{case}: {argv} was not refused"
        # one step, but where one line names two values to change
        assert len(lines) == 1 or case in TWO_STEPS, f"the advice followed meets another refusal: {lines}"
        return
    raise AssertionError(f"still refused after following its advice: {lines}")


def test_dataparallel_s_compile_advice_is_followed():
    """train_dp.py refuses --compile as it starts (a real run: one line); train_ddp.py, as it says,
    takes the same command with --compile."""
    done = subprocess.run([sys.executable, ROOT / "scripts" / "train_dp.py", "--compile", "--report-to", "none"],
                          capture_output=True, text=True, timeout=120)
    [line] = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line.startswith("error: "), done.stderr
    name, argv = follow(line, "train_dp", ["--compile", "--report-to", "none"], None, Path("."))
    assert name == "train_ddp"
    assert script(name).parse_args(argv).compile == "inductor"
