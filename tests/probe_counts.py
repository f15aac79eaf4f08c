"""The correct predictions of saved weights, counted in the test with plain torch: a test tool.

evaluate.py and the training scripts both count with common.recipe.evaluation.evaluate; a test that
compares the two compares that function with itself. This counts again from the file alone: the
weights and the metadata a run stores (normalisation, memory format, precision), images turned into
floats by (x - mean) / std, the model's argmax against the labels, class by class.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from common.recipe.models import build_model


def metadata(weights: Path) -> dict:
    """model.safetensors' metadata, JSON values decoded."""
    def value(text):
        try:
            return json.loads(text)
        except ValueError:  # a plain string: the model's name, the precision
            return text
    with safe_open(str(weights), "pt") as f:
        return {key: value(text) for key, text in f.metadata().items()}


def predictions(weights: Path, images: torch.Tensor) -> torch.Tensor:
    """The class each uint8 image (N, 3, H, W) gets from ``weights``, in one batch, in the precision and
    memory format the run stored."""
    stored = metadata(weights)
    model = build_model(stored["model"], len(stored["classes"]), stored["image_size"][0])
    model.load_state_dict(load_file(str(weights)))
    mean, std = (torch.tensor(stored["normalization"][k])[:, None, None] for k in ("mean", "std"))
    x = (images.float() - mean) / std
    if stored.get("channels_last"):
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    bf16 = stored.get("mixed_precision") == "bf16"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model.eval()(x).argmax(dim=1)


def per_class(predicted: torch.Tensor, labels: torch.Tensor, classes: int) -> list[tuple[int, int]]:
    """(correct, total) of each class."""
    return [(int((predicted[labels == c] == c).sum()), int((labels == c).sum())) for c in range(classes)]


def printed_per_class(stdout: str) -> list[tuple[int, int]]:
    """evaluate.py's per-class lines, "  name  0.5000  (5/10)", as (correct, total)."""
    return [(int(a), int(b)) for a, b in re.findall(r"^  \S+ +\d\.\d{4}  \((\d+)/(\d+)\)$", stdout, re.MULTILINE)]


def learnt(counts: list[tuple[int, int]]) -> bool:
    """Above chance, with at least two classes predicted right: not one class predicted for all."""
    correct, total = sum(c for c, _ in counts), sum(t for _, t in counts)
    return correct / total > 1.5 / len(counts) and sum(c > 0 for c, _ in counts) >= 2
