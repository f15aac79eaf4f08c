"""What the launcher started: checks that the process count is the one the script expects."""

import os

from common.errors import UserError


def launched_processes() -> int:
    """Processes started by torchrun / accelerate launch (WORLD_SIZE), 1 for a plain python run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def require_single_process(script: str) -> None:
    """A one-process script launched as several would train the same model N times over."""
    world_size = launched_processes()
    if world_size > 1:
        raise UserError(f"{script} trains in one process but was launched as {world_size} processes "
                        f"(WORLD_SIZE={world_size}): use scripts/train_ddp.py for several processes, or "
                        f"launch with --num_processes 1")
