"""torchrun for one pod of a TrainJob, whose exit status says how the training processes ended.

    python accelerate_configs/kubernetes/torchrun_pod.py [torchrun's options] SCRIPT [its flags]

torchrun exits 1 whether its processes failed or stopped with a checkpoint after a SIGTERM (torch's
SignalException, or their exit 75 read as a failure), and the Job's podFailurePolicy reads only the
pod's exit status (runtime.yaml). This runs torchrun as it is and exits with its status, but with
75 when every training process of this pod stopped with its checkpoint saved: each leaves a record
in the folder named by TRAINING_STOP_RECORDS (common/parallel/step_guard.py). The policy then
restarts the job without counting it against maxRestarts, a crash still counts.

A record is named by the process's rank: with torchrun's own restarts (--max-restarts, which a
TrainJob does not use) one left by an earlier attempt would count as this one's.

SIGTERM, SIGINT, SIGHUP and SIGQUIT go on to torchrun, which passes them on to its processes and
SIGKILLs them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later: PID 1 of a container gets no default
action for a signal it does not handle. Standard library only: no torch to import before torchrun.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

STOPPED = 75  # common.parallel.step_guard.STOPPED_EXIT_CODE: stopped with a checkpoint
RECORDS = "TRAINING_STOP_RECORDS"  # common.parallel.step_guard.STOP_RECORDS_VARIABLE
# torchrun's default --signals-to-handle
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def warn_if_the_wait_is_ignored() -> None:
    """torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT since pytorch PR #172596 (merged 2026-03);
    an older torch SIGKILLs its processes 30 s after a SIGTERM, whatever the variable says."""
    torch = importlib.util.find_spec("torch")  # found, not imported
    launcher = Path(torch.origin).parent / "distributed" / "launcher" / "api.py" if torch else None
    if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ and launcher and launcher.exists() \
            and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in launcher.read_text():
        print(f"warning: this torch ({launcher}) does not read TORCH_ELASTIC_SHUTDOWN_TIMEOUT: "
              f"torchrun SIGKILLs the training processes 30 s after a SIGTERM; use the torch "
              f"the Dockerfile pins", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    warn_if_the_wait_is_ignored()
    with tempfile.TemporaryDirectory(prefix="stop-records-") as records:
        # the torchrun of this python's environment, as the TrainJob's command would start it
        beside = Path(sys.executable).parent / "torchrun"
        torchrun = subprocess.Popen([str(beside) if beside.exists() else "torchrun", *argv],
                                    env={**os.environ, RECORDS: records})
        for passed_on in PASSED_ON:
            signal.signal(passed_on, lambda signum, frame: torchrun.send_signal(signum))
        code = torchrun.wait()
        if code == 0:
            return 0
        # each record holds the number of processes on this node: all of them stopped and saved
        stopped = [int(path.read_text()) for path in Path(records).iterdir()]
        if stopped and len(stopped) == stopped[0]:
            print(f"torchrun_pod.py: torchrun exited {code}, every training process of this pod "
                  f"stopped with its checkpoint saved: exit {STOPPED}", file=sys.stderr, flush=True)
            return STOPPED
        return code if code > 0 else 128 - code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
