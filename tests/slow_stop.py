"""A training process that needs some seconds to stop after a SIGTERM, as one saving a large
checkpoint does (tests/test_kubernetes.py): it leaves OUT/ready, and after a SIGTERM works SECONDS,
leaves OUT/stopped and exits 75.

    torchrun --standalone --nproc-per-node 1 tests/slow_stop.py OUT SECONDS
"""

import signal
import sys
import time
from pathlib import Path

out, seconds = Path(sys.argv[1]), float(sys.argv[2])
asked = []
signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
(out / "ready").touch()
while not asked:
    time.sleep(0.02)
time.sleep(seconds)  # the checkpoint being written
(out / "stopped").touch()
sys.exit(75)
