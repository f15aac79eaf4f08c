"""Exact test accuracy, overall and per class, however many processes share the test set."""

from dataclasses import dataclass

import torch


@dataclass
class EvalResult:
    correct: int
    total: int
    class_correct: list[int]
    class_total: list[int]

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)


@torch.no_grad()
def evaluate(model, loader, transform, accelerator, num_classes: int) -> EvalResult:
    """Counts correct predictions over the whole test split. ``gather_for_metrics`` is called per
    batch on per-sample tensors: it collects every process's share and drops the samples repeated to
    pad the last batch, so each image counts exactly once."""
    model.eval()
    class_correct = torch.zeros(num_classes, dtype=torch.long, device=accelerator.device)
    class_total = torch.zeros_like(class_correct)
    for images, labels in loader:
        with accelerator.autocast():
            predictions = model(transform.eval(images)).argmax(dim=1)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))
        class_total += torch.bincount(labels, minlength=num_classes)
        class_correct += torch.bincount(labels[predictions == labels], minlength=num_classes)
    return EvalResult(int(class_correct.sum()), int(class_total.sum()),
                      class_correct.tolist(), class_total.tolist())
