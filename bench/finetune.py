"""The benchmark's finetune check: what each fine-tuning flag costs per optimizer step.

train_single --loader workers (the path RandAugment and TrivialAugmentWide need) on an image
folder, launched without the fine-tuning flags (the base) and with each of them, by the benchmark's
protocol. The launches alternate round by round (base, flag 1, ..., flag n, base, ...): a flag is
compared with base launches of the same minutes, as a shared machine's speed drifts. A launch's step
time is the mean of its steps after the warm-up, not the median: trackers write once every
--log-every steps (5 here, in every launch), and that write is part of what their flag costs.
"""

import statistics
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.models import build_model

LOG_EVERY = 5

# name (the --finetune-flags choice): the flags added to the base launch; FILE is the weights file
VARIANTS = {
    "pretrained-path": ("--pretrained-path", "FILE"),
    "freeze": ("--pretrained-path", "FILE", "--freeze", "backbone"),
    "head-lr-scale": ("--head-lr-scale", "10"),
    "adamw": ("--optimizer", "adamw"),
    "randaugment": ("--auto-augment", "randaugment"),
    "trivialaugment": ("--auto-augment", "trivialaugment"),
    "random-erase": ("--random-erase", "0.25"),
    "mixup": ("--mixup", "0.2"),
    "cutmix": ("--cutmix", "1.0"),
    "tensorboard": ("--report-to", "tensorboard"),
    "mlflow": ("--report-to", "mlflow"),
}


def write_weights(model: str, path: Path) -> Path:
    """A weights file of ``model`` (seeded random weights, 10 classes) for --pretrained-path: the
    load and the head swap are what a real checkpoint costs; its values do not change a step's
    time."""
    torch.manual_seed(0)
    state = build_model(model, num_classes=10).state_dict()
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))
    return path


def flags(name: str, weights: Path) -> tuple[str, ...]:
    return tuple(str(weights) if part == "FILE" else part for part in VARIANTS[name])


def launch_mean(run: dict) -> float:
    """A launch's step time: the mean of its steps after the warm-up, log steps included."""
    return statistics.fmean(run["step_seconds"])


def summarise(base: list[dict], variant: list[dict]) -> dict:
    """A flag's launches against the base launches of the same rounds: the median over rounds of
    the step-time ratio, and the median step times and data waits of each."""
    ratios = [launch_mean(v) / launch_mean(b) for b, v in zip(base, variant)]
    base_s = statistics.median(map(launch_mean, base))
    flag_s = statistics.median(map(launch_mean, variant))
    return {"ratio": statistics.median(ratios), "round_ratios": ratios,
            "base_step_s": base_s, "flag_step_s": flag_s, "cost_ms": 1e3 * (flag_s - base_s),
            "base_data_wait": statistics.median(r["data_wait_steady_frac"] for r in base),
            "flag_data_wait": statistics.median(r["data_wait_steady_frac"] for r in variant)}
