"""Weight averaging (--ema-decay): an exponential moving average of the model's weights and
BatchNorm buffers, updated after every optimizer step, saved in every checkpoint.

    ema = WeightAverage(accelerator, model, args.ema_decay)  # after prepare; None or 0: off
    ema.update()                       # after each optimizer step
    ema.evaluate(model, ...)           # {"test_acc_ema": ...} at the epoch's end ({} when off)
    ema.apply()                        # before model.safetensors is written: the averaged weights

The decay warms up as timm's ModelEmaV3 does (gamma 1, power 3/4): the t-th update uses
min(decay, 1 - (1 + t) ** -0.75), so the first steps, whose weights are far from the end, are not
frozen into the average (0.41 at the first update, 0.97 at the 100th, 0.99 at the 500th). One
update is one fused lerp per dtype (torch._foreach_lerp_) with the weight as a Python number: no
per-parameter Python loop, no host-device synchronisation.

Under DDP the parameters are the same on every process but each process's BatchNorm statistics
follow its own slice of the batch: the averaged buffers are averaged over the processes after every
update (one small all-reduce), so every process holds the same average, evaluates with it, and
resumes from the copy the main process saves (save_as_data writes the main process's) bit for bit.

Under FSDP2 each process averages its weights' slice: common.parallel.fsdp's ShardedWeightAverage.
"""

import torch

from common.recipe.evaluation import evaluate
from common.data_only import save_as_data

WARMUP_POWER = 0.75  # timm ModelEmaV3's warm-up, with gamma 1


class WeightAverage:
    """The average of ``model``'s floating-point parameters and buffers (``decay`` None or 0: off,
    and every method does nothing). In every checkpoint when on: weight_average.safetensors."""

    def __init__(self, accelerator, model: torch.nn.Module, decay: float | None):
        self.accelerator, self.decay, self.updates = accelerator, decay or 0.0, 0
        self.names, self.live, self.average, self.buffers = [], [], [], []
        if not self.decay:
            return
        plain = accelerator.unwrap_model(model)
        plain = getattr(plain, "_orig_mod", plain)  # torch.compile's: names without its _orig_mod.
        for name, tensor in [*plain.named_parameters(), *plain.named_buffers()]:
            if tensor.is_floating_point():
                self.names.append(name)
                self.live.append(tensor.data)
                self.average.append(tensor.data.detach().clone())
                self.buffers.append(not isinstance(tensor, torch.nn.Parameter))
        save_as_data(accelerator, self, "weight_average")

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the model's weights after an optimizer step."""
        if not self.decay:
            return
        self.updates += 1
        weight = 1 - min(self.decay, 1 - (1 + self.updates) ** -WARMUP_POWER)  # the warm-up's decay
        torch._foreach_lerp_(self.average, self.live, weight)
        # BatchNorm's statistics differ by process: the same average on every process
        mean_over_processes(self.accelerator,
                            [a for a, is_buffer in zip(self.average, self.buffers) if is_buffer])

    @torch.no_grad()
    def evaluate(self, model, *args) -> dict:
        """common.recipe.evaluation.evaluate(model, *args) with the averaged weights, the trained
        ones put back after: {"test_acc_ema": accuracy}, for the epoch's metrics; {} when off."""
        if not self.decay:
            return {}
        trained = [t.clone() for t in self.live]
        self.apply()
        try:
            return {"test_acc_ema": evaluate(model, *args).accuracy}
        finally:
            torch._foreach_copy_(self.live, trained)

    @torch.no_grad()
    def apply(self) -> None:
        """Put the averaged weights in the model for good (the run's end: model.safetensors)."""
        if self.decay:
            torch._foreach_copy_(self.live, self.average)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "decay": self.decay,
                "average": {name: average.cpu() for name, average in zip(self.names, self.average)}}

    def load_state_dict(self, state: dict) -> None:
        if type(state["updates"]) is not int or state["updates"] < 0:
            raise ValueError(f"updates {state['updates']!r} is not a whole number from 0")
        self.updates = state["updates"]
        with torch.no_grad():
            # the checkpoints of compiled runs before 2026-12: torch.compile's prefix in each name
            saved = {k.removeprefix("_orig_mod."): v for k, v in state["average"].items()}
            torch._foreach_copy_(self.average, [saved[name] for name in self.names])


@torch.no_grad()
def mean_over_processes(accelerator, tensors: list[torch.Tensor]) -> None:
    """Set each of ``tensors`` to its mean over the processes, in place: one all-reduce per dtype.
    A collective (every process must call it); nothing with one process."""
    if accelerator.num_processes == 1 or not tensors:
        return
    for dtype in dict.fromkeys(tensor.dtype for tensor in tensors):  # the same order everywhere
        group = [tensor for tensor in tensors if tensor.dtype == dtype]
        flat = accelerator.reduce(torch.cat([t.reshape(-1) for t in group]), "mean")
        torch._foreach_copy_(group, [f.view_as(t) for f, t in zip(
            flat.split([t.numel() for t in group]), group)])
