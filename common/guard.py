"""Decisions every process must take together, at the same step."""

import sys

import torch

from common.checkpoint import latest_checkpoint


def stop_if_not_finite(accelerator, loss: torch.Tensor, step: int, output_dir) -> None:
    """Stop the run, in every process at once, when any process's loss is NaN or infinite.

    The sum over processes is non-finite if any part is, so all processes see the same answer and
    none is left waiting in the next all-reduce. The check runs before the optimizer step, so the
    weights and the last checkpoint stay good. Reading the flag waits for the device: one small
    synchronisation per step, the price of stopping at the exact step.
    """
    total = accelerator.reduce(loss.detach().float(), "sum")
    if not torch.isfinite(total):
        checkpoint = latest_checkpoint(output_dir)
        then = (f"the last good checkpoint is {checkpoint}: resume from it with a lower --lr" if checkpoint
                else "there is no checkpoint yet: start again with a lower --lr")
        # Every process says it before any exits, so the launcher cannot stop one before it speaks.
        print(f"error: the loss is {total.item()} at step {step}: training stopped before that step changed "
              f"the weights; {then}", file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        raise SystemExit(1)
