"""The benchmark's finetune check: what each fine-tuning flag costs per optimizer step.

train_single --loader workers (the path RandAugment and TrivialAugmentWide need) on an image
folder, launched without the fine-tuning flags (the base) and with each of them, by the benchmark's
protocol. A round launches the base, then each flag once; one more base launch ends the last round.
Each flag's launch is compared with the base launches just before and after its round (their mean),
as a shared machine's speed drifts, and every other round runs the flags in reverse order, so no
flag always runs furthest from a base launch. A launch's step time is the mean of its steps after
the warm-up, not the median: trackers write once every --log-every steps (5 here, in every launch),
and that write is part of what their flag costs.
"""

import statistics
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.recipe.models import build_model

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
    """A weights file of ``model`` (seeded random weights, 10 classes) for --pretrained-path: its
    values do not change a step's time, and the load happens before the timed steps."""
    torch.manual_seed(0)
    state = build_model(model, num_classes=10).state_dict()
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))
    return path


def order(names: list[str], round_: int) -> list[str]:
    """The flags' launch order in a round: as given, reversed every other round."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def flags(name: str, weights: Path) -> tuple[str, ...]:
    return tuple(str(weights) if part == "FILE" else part for part in VARIANTS[name])


def launch_mean(run: dict) -> float:
    """A launch's step time: the mean of its steps after the warm-up, log steps included."""
    return statistics.fmean(run["step_seconds"])


def summarise(base: list[dict], variant: list[dict]) -> dict:
    """A flag's launches (one a round) against the base launches that bracket each round
    (``base`` has one launch more than ``variant``): per round, the flag's step time over the mean
    of the two, and the difference; the medians over the rounds."""
    brackets = [(launch_mean(before) + launch_mean(after)) / 2
                for before, after in zip(base, base[1:])]
    flagged = [launch_mean(run) for run in variant]
    ratios = [f / b for f, b in zip(flagged, brackets)]
    return {"ratio": statistics.median(ratios), "round_ratios": ratios,
            "cost_ms": 1e3 * statistics.median(f - b for f, b in zip(flagged, brackets)),
            "base_step_s": statistics.median(brackets), "flag_step_s": statistics.median(flagged),
            "base_data_wait": statistics.median(r["data_wait_steady_frac"] for r in base),
            "flag_data_wait": statistics.median(r["data_wait_steady_frac"] for r in variant)}
