"""Mixed precision, train_amp.py's own: the 16-bit format it trains in, and fp16's skipped steps.

The other scripts train in fp32 and never reach this module: a DDP copier takes no AMP code.
"""

import os
import sys

import torch

from common.errors import UserError
from common.parallel.step_guard import Stop
from common.run.checkpoints import latest_checkpoint


def choose_mixed_precision(requested: str | None) -> str:
    """The 16-bit format to train in: ``requested`` (--mixed-precision), else the Accelerate
    config's (accelerate launch exports it as ACCELERATE_MIXED_PRECISION), else bf16 where the
    hardware has it (CPUs; GPUs of compute capability 8.0 and newer) and fp16 on older GPUs, which
    only emulate bf16 (torch.cuda.is_bf16_supported() says True on them). Call it before the
    Accelerator exists: it asks about this process's GPU (LOCAL_RANK) without creating a context on
    another one."""
    configured = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    precision = requested or configured
    if precision not in ("fp16", "bf16"):
        precision = "bf16"
        if torch.cuda.is_available():  # this process's GPU made current first, as Accelerate will
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            precision = "fp16" if torch.cuda.get_device_capability() < (8, 0) else "bf16"
        if configured != "no" and os.environ.get("RANK", "0") == "0":
            print(f"warning: the Accelerate config's mixed_precision {configured} is not one "
                  f"train_amp.py trains in; training in {precision} (--mixed-precision fp16 or "
                  f"bf16 to choose)", file=sys.stderr)
    if precision == "fp16" and not torch.cuda.is_available():
        given = ("--mixed-precision fp16" if requested
                 else "mixed_precision fp16 (from the Accelerate config)")
        raise UserError(f"{given} needs a GPU (on a CPU Accelerate would train in fp32 without a "
                        f"word): use --mixed-precision bf16")
    return precision


class SkippedSteps:
    """fp16 steps that the GradScaler skipped because their gradients overflowed.

    A skip halves the loss scale, and one now and then is normal: the scale probes upwards after
    every 2,000 good steps. A run whose every step overflows has diverged, and nothing says so: the
    scale halves forever and no step is applied. ``limit`` skipped steps in a row (a scale 2^-limit
    of the one that last worked) make ``count`` return a Stop, the same in every process (DDP
    averages the gradients before the scaler looks, so all skip alike): nothing of those steps is
    saved, and its line names the newest checkpoint from before the skipping began.
    """

    def __init__(self, accelerator, output_dir, limit: int = 100):
        self.accelerator, self.output_dir, self.limit = accelerator, output_dir, limit
        self.in_epoch = self.in_a_row = 0  # the log line reports in_epoch, the count of this epoch

    def figures(self) -> dict:
        """For the epoch's record, in fp16 only: the loss scale and the steps skipped this epoch,
        then counted again from 0 for the next epoch."""
        if self.accelerator.scaler is None:
            return {}
        figures = {"loss_scale": self.accelerator.scaler.get_scale(),
                   "skipped_steps": self.in_epoch}
        self.in_epoch = 0
        return figures

    def count(self, step: int) -> Stop | None:
        """After ``optimizer.step()`` of optimizer step ``step``: a Stop when the run diverged."""
        if not self.accelerator.optimizer_step_was_skipped:
            self.in_a_row = 0
            return None
        self.in_epoch += 1
        self.in_a_row += 1
        if self.in_a_row < self.limit:
            return None
        first = step - self.in_a_row + 1
        checkpoint = latest_checkpoint(self.output_dir, up_to=first - 1)
        # Checkpoints written while every step was skipped may follow it: continuing from it in
        # place would fork the run's record, so the advice continues it in a new folder.
        then = (f"the newest checkpoint before them is {checkpoint}: continue from it with a lower "
                f"--lr or --clip-grad (the same command with --resume {checkpoint} --output-dir "
                f"NEW and the new flag)" if checkpoint
                else "there is no checkpoint from before them: start again in a new --output-dir "
                     "with a lower --lr, --clip-grad or --mixed-precision bf16")
        return Stop(False, f"error: fp16 skipped {self.in_a_row} steps in a row "
                           f"({first} to {step}) because the gradients overflowed at every loss "
                           f"scale (now {self.accelerator.scaler.get_scale():g}): training "
                           f"diverged and stopped; {then}")
