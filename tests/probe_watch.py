"""Two processes meet (gloo) and watch for failures as the training scripts do; process 1 then
fails alone (a bug: an exception) while process 0 waits outside any collective, as a process waits
in an NCCL collective that nothing fails: only the failure watch can end process 0."""

import sys
import time

from accelerate import Accelerator

from common.failures import watch_failures

accelerator = Accelerator(cpu=True)
watch_failures(accelerator)
accelerator.wait_for_everyone()
if accelerator.process_index == 1:
    time.sleep(0.5)
    raise RuntimeError("a bug in process 1")
time.sleep(60)
print("process 0 was not ended", flush=True)
sys.exit(0)
