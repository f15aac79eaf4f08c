"""The step guard: after each optimizer step, whether every process stops, and why.

The guard only answers; the training loop acts on the answer (``Stop``): it saves the step and
exits STOPPED_EXIT_CODE after a stop signal, and exits 1 without saving after a non-finite loss or,
in fp16, a run of skipped steps (common.parallel.amp). ``announce_stop`` says which, in one line.
"""

import dataclasses
import math
import os
import signal
import sys
from pathlib import Path

import torch

from common.failures import BEAT, STOPPING, end_tracking, ignore_the_launchers_stop, watch_failures
from common.run.checkpoints import latest_good_checkpoint

# The signals that ask a run to stop and save the step: SIGTERM (SLURM's scancel and preemption,
# Kubernetes, the launchers passing theirs on), SIGUSR1 (SLURM's --signal ahead of its time limit),
# SIGINT (Ctrl-C), SIGHUP (a closed terminal, a dropped ssh session).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: stopped to be continued, not failed
DIVERGED_EXIT_CODE = 1
# A loss this many times the first one read has blown up: the checkpoints written from that step on
# hold weights that a lower --lr cannot bring back, and the advice after a NaN passes them over.
GROWN = 10
# A launcher that says how its processes ended names a folder here: torchrun exits 1 whether they
# failed or stopped with a checkpoint, and a Kubernetes policy reads only the pod's exit status
# (accelerate_configs/kubernetes/torchrun_pod.py). A process that stopped with its checkpoint
# saved leaves a file there, holding the number of processes on its node.
STOP_RECORDS_VARIABLE = "TRAINING_STOP_RECORDS"


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why every process stops after the current optimizer step: ``saves`` after a stop signal
    (STOPPED_EXIT_CODE, to be resumed), not after divergence (DIVERGED_EXIT_CODE)."""

    saves: bool
    message: str  # the signal's name, or the whole error line

    @property
    def exit_code(self) -> int:
        return STOPPED_EXIT_CODE if self.saves else DIVERGED_EXIT_CODE


class StepGuard:
    """What every process must decide together after each optimizer step, without the host waiting
    for the device each step: a non-finite loss stops the run; a stop signal, after a checkpoint.

    ``check`` sums, over processes, the step's loss (non-finite if any part is) and the number of
    processes that got a stop signal (``install_signal_handlers``), so every process gets the same
    answer at the same step and none is left waiting in the next all-reduce. On a GPU it reads the
    two numbers one step later, when the device has long computed them, so the host keeps queueing
    work ahead of the device; on a CPU they are there at once. A bad step has then changed the
    weights in memory, but nothing of it is kept: with ``now`` (a step to be saved, an epoch's end)
    ``check`` reads the step at once, so no checkpoint, model.safetensors or metrics line holds it.
    """

    def __init__(self, accelerator, output_dir: Path):
        self.accelerator, self.output_dir = accelerator, output_dir
        self.pending = None  # (step, sums on their way to the host, event that marks their arrival)
        self.received = None  # the first stop signal this process got, by name
        self.stop = None  # the Stop the processes agreed on
        self.first_loss = None  # the first step's loss this process read, and the first step
        self.grew = None  # (step, loss) whose loss was GROWN times that: the weights blew up

    def install_signal_handlers(self) -> None:
        """SIGTERM, SIGUSR1, SIGINT (Ctrl-C: no KeyboardInterrupt) and SIGHUP set a flag that
        ``check`` reads (the step in progress finishes). An exception that one process meets alone
        ends every process within seconds, and the kernel sends this process SIGTERM when its
        launcher dies (common.failures.watch_failures: from check_launch on, under a launcher of
        several processes). Main thread of a training process only."""
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, self._on_signal)
        watch_failures(self.accelerator)

    def _on_signal(self, signum, frame) -> None:  # only a flag: the step in progress finishes
        self.received = self.received or signal.Signals(signum).name
        STOPPING.set()  # the failure watch waits for it, should the store go

    def check(self, loss: torch.Tensor, step: int, now: bool = False) -> Stop | None:
        """After optimizer step ``step`` with its detached ``loss``: the Stop every process agrees
        on, or None to go on. ``now``: read this step's numbers at once (it is to be saved)."""
        total = loss.float()  # detached already: the sum of the micro-batches' detached losses
        BEAT["step"] = step  # said, should this process stall: common.failures' heartbeat
        if self.accelerator.num_processes > 1:  # one all-reduce of [loss, processes signalled]
            signalled = torch.full_like(total, float(self.received is not None))  # a fill, no copy
            total = self.accelerator.reduce(torch.stack([total, signalled]), "sum")
        if total.is_cuda:  # a copy into pinned host memory, queued behind the step's work
            stream, arrived = torch.cuda.current_stream(total.device), torch.cuda.Event()
            total = total.to("cpu", non_blocking=True)
            arrived.record(stream)
            self.flush()  # the step before's, arrived meanwhile
            self.pending = (step, total, arrived)
        else:  # the CPU has computed it already
            self._agree(self._read(step, total, None))
        if now or self.stop:  # on a GPU, the step after the signal too, before anything is saved
            self.flush()
        return self.stop

    def signalled(self) -> Stop | None:
        """The Stop for a signal that reached any process since the last step, asked of all at once
        (it waits for the device): at an epoch's end, for one that came during evaluation."""
        self.flush()
        flag = torch.tensor(float(self.received is not None), device=self.accelerator.device)
        if self.accelerator.reduce(flag, "sum") > 0:
            self._agree(self._signal_stop())
        return self.stop

    def flush(self) -> None:
        """Read the newest step's numbers, if they are still on their way."""
        if self.pending:
            pending, self.pending = self.pending, None
            self._agree(self._read(*pending))

    def _agree(self, stop: Stop | None) -> None:
        """A diverged step overrides a signal's stop: it must not be saved."""
        if stop and (self.stop is None or self.stop.saves and not stop.saves):
            self.stop = stop

    def _signal_stop(self) -> Stop:
        return Stop(True, self.received or "a stop signal to another process")

    def _read(self, step: int, total: torch.Tensor, arrived) -> Stop | None:
        if arrived is not None:
            arrived.synchronize()
        # alone, the signal is this process's own: three operators a step fewer than the all-reduce
        values = total.tolist()  # [loss, signalled], or the loss alone
        loss, signalled = values if total.dim() else (values, self.received is not None)
        if math.isfinite(loss):
            self.first_loss = self.first_loss or loss
            if self.grew is None and loss > GROWN * self.first_loss:
                self.grew = (step, loss)
            return self._signal_stop() if signalled > 0 else None
        return Stop(False, f"error: the loss is {loss} at step {step}: training stopped and "
                           f"nothing of that step was saved; {self._advice()}")

    def _advice(self) -> str:
        """What to do after a non-finite loss, such that doing it finishes the run (tests/
        test_faults_signals.py): resume from a checkpoint written before the loss grew, with a
        lower --lr (it may change on resume), or start again."""
        newest = latest_good_checkpoint(self.output_dir)[0]  # checked: one to resume from
        if newest is None:
            return ("there is no checkpoint yet: start again with a lower --lr (the same command "
                    "with --resume and the new --lr starts the run again from step 0)")
        if self.grew is None:
            return (f"the last good checkpoint is {newest}: resume from it with a lower --lr (the "
                    f"same command with --resume and the new --lr)")
        step, loss = self.grew
        grew = f"the loss grew from {self.first_loss:.4g} to {loss:.4g} at step {step}"
        # step N's loss is that of the weights after step N - 1: those had blown up already
        before = latest_good_checkpoint(self.output_dir, up_to=step - 2)[0]
        if before == newest:  # none written since
            return (f"{grew}; the last good checkpoint, from before it, is {newest}: resume from "
                    f"it with a lower --lr (the same command with --resume and the new --lr)")
        if before:  # in place, the newer checkpoints would be resumed from, and the record forked
            return (f"{grew}, so the checkpoints since hold weights that blew up; the last one "
                    f"before is {before}: continue from it with a lower --lr (the same command "
                    f"with --resume {before} --output-dir NEW and the new --lr)")
        return (f"{grew}, and no checkpoint of this run is from before it: start again with a "
                f"lower --lr in a new --output-dir")


def announce_stop(accelerator, stop: Stop, step: int, checkpoint: Path | None) -> int:
    """Say why the run stopped, from every process that must, and return its exit code.

    After a stop signal: one line naming ``checkpoint`` (the step saved), the trackers closed, and
    further stop signals ignored (the launcher's SIGTERM, once another process has exited, must not
    kill this one while it shuts down). After divergence: the error line, the same on every process,
    from the main process before any exits, so the launcher cannot stop it before it speaks.
    """
    if not stop.saves:
        end_tracking(accelerator)  # wandb: the run failed, not finished
        ignore_the_launchers_stop()  # every process exits 1 by itself
        if accelerator.is_main_process:  # the same line on every process
            print(stop.message, file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        return stop.exit_code
    accelerator.print(f"stopped by {stop.message} after step {step}: the training state is in "
                      f"{checkpoint}; the same command with --resume continues from there "
                      f"(exit code {STOPPED_EXIT_CODE})", flush=True)
    end_tracking(accelerator, stopped=True)  # wandb: preempting; MLflow: KILLED, not FINISHED
    accelerator.end_training()
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)
    # For a launcher that asks (STOP_RECORDS_VARIABLE): a record that cannot be written costs the
    # job a restart it could have had for free.
    if folder := os.environ.get(STOP_RECORDS_VARIABLE):
        try:
            (Path(folder) / f"rank{os.environ.get('RANK', '0')}").write_text(
                os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except OSError as error:
            print(f"warning: cannot record the stop in {STOP_RECORDS_VARIABLE}={folder} ({error}): "
                  f"the launcher reports a failure", file=sys.stderr, flush=True)
    return stop.exit_code
