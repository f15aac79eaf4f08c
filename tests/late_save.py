"""Run a training script with process 1 entering each save_state 2 s late: a test tool, not a
feature. With a checkpoint that the main process cannot write (a full disk), the main process has
failed, removed the checkpoint's partial folder and ended by the time process 1 writes: Accelerate's
save_state makes the folder again on process 1, which writes its own file there and then meets the
lost main process in the next collective. Nothing else changes: the save is Accelerate's.

    python tests/late_save.py scripts/train_ddp.py ARGS...   (as each process of the job)
"""

import os
import runpy
import sys
import time

from accelerate import Accelerator

if os.environ.get("RANK") == "1":
    save_state = Accelerator.save_state

    def late_save_state(self, *args, **kwargs):
        time.sleep(2)
        return save_state(self, *args, **kwargs)

    Accelerator.save_state = late_save_state
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
