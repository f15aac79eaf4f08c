"""Which loader a run takes (--loader): the decoded dataset's size against the memory budget.

--loader auto (the default) takes device when the decoded dataset fits the budget:
DEVICE_DATA_SHARE of the GPU's free memory and HOST_DATA_SHARE of the host's available memory,
or --loader-budget. Every process takes the main process's budget, so all decide alike.
"""

import psutil
import torch

from common.data.device import DEVICE_DATA_SHARE
from common.errors import UserError
from common.failures import from_main

# Decoding keeps the whole dataset in the host memory of the process that decodes it (and in the
# page cache after): at most this share of the memory available when the run starts.
HOST_DATA_SHARE = 0.5


def choose_loader(accelerator, wanted: str, images: int, size: int,
                  budget_gb: float | None) -> tuple[str, str]:
    """(loader, why): ``wanted`` (device, workers or auto) checked against the main process's
    budget, so that every process takes the same path even when their free memory differs."""
    if wanted == "workers":  # the same flag on every process: no budget to agree on
        return "workers", "--loader workers"
    budget, of_what = from_main(accelerator, data_budget(accelerator.device, budget_gb))
    need = images * 3 * size * size
    summary = (f"{images} images at {size}px decoded take {_gb(need)}, budget {_gb(budget)} "
               f"({of_what})")
    if need <= budget:
        return "device", summary if wanted == "auto" else "--loader device"
    if wanted == "device":  # refused by every process alike: they share the main one's budget
        raise UserError(f"--loader device: the {images} images at {size}px decoded take "
                        f"{_gb(need)}, over the budget of {_gb(budget)} ({of_what}); "
                        + ("use --loader auto (over --loader-budget it loads through the workers)"
                           if budget_gb is not None else "use --loader workers (or auto)"))
    return "workers", summary


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def data_budget(device: torch.device, budget_gb: float | None) -> tuple[float, str]:
    """The most the decoded dataset may take, and a description of where the number comes from:
    the smaller share, of the host's memory or of the GPU's (the host's when they are equal)."""
    if budget_gb is not None:
        return budget_gb * 1e9, "--loader-budget"
    budgets = [(HOST_DATA_SHARE * psutil.virtual_memory().available,
                f"{HOST_DATA_SHARE:.0%} of the host's available memory")]
    if device.type == "cuda":
        budgets.append((DEVICE_DATA_SHARE * torch.cuda.mem_get_info(device)[0],
                        f"{DEVICE_DATA_SHARE:.0%} of the free memory of {device}"))
    return min(budgets, key=lambda budget: budget[0])
